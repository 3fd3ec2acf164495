"""Convert ESM-2 checkpoints between transformers' layout (`EsmForMaskedLM`) and NVEsm's (Transformer Engine).

One table, `RULES`, maps every tensor; both directions read it. The functions here are pure (state dict in,
state dict out) and are what the tests, the demo and the CLI use.

    python convert_checkpoint.py hf-to-te facebook/esm2_t6_8M_UR50D ./esm2_t6_8M_nv
    python convert_checkpoint.py te-to-hf ./esm2_t6_8M_nv ./esm2_t6_8M_hf
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from configuration_nv_esm import NVEsmConfig

HERE = Path(__file__).resolve().parent
REMOTE_CODE_FILES = ("configuration_nv_esm.py", "modeling_nv_esm.py")
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json")
AUTO_MAP = {
    "AutoConfig": "configuration_nv_esm.NVEsmConfig",
    "AutoModel": "modeling_nv_esm.NVEsmModel",
    "AutoModelForMaskedLM": "modeling_nv_esm.NVEsmForMaskedLM",
    "AutoModelForTokenClassification": "modeling_nv_esm.NVEsmForTokenClassification",
    "AutoModelForSequenceClassification": "modeling_nv_esm.NVEsmForSequenceClassification",
}
# EsmConfig fields that NVEsmConfig carries unchanged.
SHARED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "max_position_embeddings",
    "initializer_range",
    "layer_norm_eps",
    "position_embedding_type",
    "emb_layer_norm_before",
    "token_dropout",
    "mask_token_id",
    "pad_token_id",
    "rope_theta",
    "tie_word_embeddings",
)


# --------------------------------------------------------------------------------------------------------------
# The mapping table
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One NVEsm tensor and the transformers tensors it is made of.

    `kind`: "copy" (same tensor), "vocab" (rows padded with zeros from `vocab_size` to `padded_vocab_size`),
    "qkv" (query, key, value fused into rows interleaved per head `[h0: q, k, v | h1: ...]`).
    Names with `{i}` exist once per layer. `optional` tensors may be absent (tied decoder weight).
    """

    hf: tuple[str, ...]
    nv: str
    kind: str = "copy"
    optional: bool = False

    def for_layer(self, index: int) -> Rule:
        return Rule(tuple(n.format(i=index) for n in self.hf), self.nv.format(i=index), self.kind, self.optional)


HF_LAYER = "esm.encoder.layer.{i}."
NV_LAYER = "esm.encoder.layers.{i}."
RULES: tuple[Rule, ...] = (
    Rule(("esm.embeddings.word_embeddings.weight",), "esm.embeddings.word_embeddings.weight", "vocab"),
    Rule(("esm.rotary_embeddings.inv_freq",), "esm.rotary_embeddings.inv_freq"),
    Rule(("esm.encoder.emb_layer_norm_after.weight",), "esm.encoder.emb_layer_norm_after.weight"),
    Rule(("esm.encoder.emb_layer_norm_after.bias",), "esm.encoder.emb_layer_norm_after.bias"),
    Rule(("esm.contact_head.regression.weight",), "esm.contact_head.regression.weight"),
    Rule(("esm.contact_head.regression.bias",), "esm.contact_head.regression.bias"),
    Rule(("lm_head.dense.weight",), "lm_head.dense.weight"),
    Rule(("lm_head.dense.bias",), "lm_head.dense.bias"),
    Rule(("lm_head.layer_norm.weight",), "lm_head.decoder.layer_norm_weight"),
    Rule(("lm_head.layer_norm.bias",), "lm_head.decoder.layer_norm_bias"),
    Rule(("lm_head.decoder.weight",), "lm_head.decoder.weight", "vocab", optional=True),
    Rule(("lm_head.bias",), "lm_head.decoder.bias", "vocab"),
)
LAYER_RULES: tuple[Rule, ...] = (
    Rule((HF_LAYER + "attention.LayerNorm.weight",), NV_LAYER + "self_attention.layernorm_qkv.layer_norm_weight"),
    Rule((HF_LAYER + "attention.LayerNorm.bias",), NV_LAYER + "self_attention.layernorm_qkv.layer_norm_bias"),
    Rule(
        tuple(HF_LAYER + f"attention.self.{name}.weight" for name in ("query", "key", "value")),
        NV_LAYER + "self_attention.layernorm_qkv.weight",
        "qkv",
    ),
    Rule(
        tuple(HF_LAYER + f"attention.self.{name}.bias" for name in ("query", "key", "value")),
        NV_LAYER + "self_attention.layernorm_qkv.bias",
        "qkv",
    ),
    Rule((HF_LAYER + "attention.output.dense.weight",), NV_LAYER + "self_attention.proj.weight"),
    Rule((HF_LAYER + "attention.output.dense.bias",), NV_LAYER + "self_attention.proj.bias"),
    Rule((HF_LAYER + "LayerNorm.weight",), NV_LAYER + "layernorm_mlp.layer_norm_weight"),
    Rule((HF_LAYER + "LayerNorm.bias",), NV_LAYER + "layernorm_mlp.layer_norm_bias"),
    Rule((HF_LAYER + "intermediate.dense.weight",), NV_LAYER + "layernorm_mlp.fc1_weight"),
    Rule((HF_LAYER + "intermediate.dense.bias",), NV_LAYER + "layernorm_mlp.fc1_bias"),
    Rule((HF_LAYER + "output.dense.weight",), NV_LAYER + "layernorm_mlp.fc2_weight"),
    Rule((HF_LAYER + "output.dense.bias",), NV_LAYER + "layernorm_mlp.fc2_bias"),
)
# Names that transformers checkpoints use besides the current ones: (pattern, canonical name or None = dropped).
# transformers >= 5 saves LayerNorms as gamma/beta and the rotary inv_freq as `encoder.layer.*.…`; older
# versions keep one inv_freq per layer and a `position_ids` buffer.
HF_ALIASES: tuple[tuple[re.Pattern, str | None], ...] = (
    (re.compile(r"esm\.embeddings\.position_ids"), None),
    (re.compile(r"esm\.encoder\.layer\.(\d+|\*)\.attention\.self\.rotary_embeddings\.inv_freq"), "esm.rotary_embeddings.inv_freq"),
    (re.compile(r"(.*LayerNorm)\.gamma"), r"\1.weight"),
    (re.compile(r"(.*LayerNorm)\.beta"), r"\1.bias"),
)


def rules_for(config: NVEsmConfig) -> list[Rule]:
    """Every rule of a model of this shape, layers expanded."""
    layers = [rule.for_layer(i) for i in range(config.num_hidden_layers) for rule in LAYER_RULES]
    return list(RULES) + layers


# --------------------------------------------------------------------------------------------------------------
# Tensor transforms (one pair per rule kind)
# --------------------------------------------------------------------------------------------------------------


def fuse_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[H, ...]` x3 -> `[3H, ...]` with rows `[h0: q, k, v | h1: q, k, v | ...]`."""
    stacked = torch.stack([query, key, value])  # [3, H, ...]
    head_dim = query.shape[0] // num_heads
    stacked = stacked.view(3, num_heads, head_dim, *query.shape[1:]).transpose(0, 1)
    return stacked.reshape(3 * query.shape[0], *query.shape[1:]).contiguous()


def split_qkv(fused: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    hidden = fused.shape[0] // 3
    per_head = fused.view(num_heads, 3, hidden // num_heads, *fused.shape[1:]).transpose(0, 1)
    query, key, value = (part.reshape(hidden, *fused.shape[1:]).contiguous() for part in per_head)
    return query, key, value


def pad_vocab(tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows up to `padded_vocab_size`."""
    padding = tensor.new_zeros(padded_vocab_size - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, padding]).contiguous()


def apply_rule_hf_to_nv(rule: Rule, tensors: list[torch.Tensor], config: NVEsmConfig) -> torch.Tensor:
    if rule.kind == "qkv":
        return fuse_qkv(*tensors, config.num_attention_heads)
    if rule.kind == "vocab":
        return pad_vocab(tensors[0], config.padded_vocab_size)
    return tensors[0]


def apply_rule_nv_to_hf(rule: Rule, tensor: torch.Tensor, config: NVEsmConfig) -> list[torch.Tensor]:
    if rule.kind == "qkv":
        return list(split_qkv(tensor, config.num_attention_heads))
    if rule.kind == "vocab":
        return [tensor[: config.vocab_size].contiguous()]
    return [tensor]


# --------------------------------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------------------------------


class CheckpointMismatch(ValueError):
    """The source does not hold the tensors an ESM-2 checkpoint of its config holds."""

    def __init__(self, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        lines = ["The checkpoint is not an ESM-2 checkpoint of the shape its config describes."]
        if self.missing:
            lines.append(f"Missing ({len(self.missing)}): " + ", ".join(self.missing[:20]))
        if self.unexpected:
            lines.append(f"Unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected[:20]))
        super().__init__("\n".join(lines))


def canonical_hf_name(key: str) -> str | None:
    """The current transformers name of a tensor an ESM-2 checkpoint may hold (None: not needed)."""
    for pattern, canonical in HF_ALIASES:
        if pattern.fullmatch(key):
            return None if canonical is None else pattern.sub(canonical, key)
    return key


def hf_to_nv_state_dict(hf_state: dict[str, torch.Tensor], config: NVEsmConfig) -> dict[str, torch.Tensor]:
    """transformers `EsmForMaskedLM` state dict -> NVEsm state dict. Raises CheckpointMismatch on other keys."""
    renamed = {canonical_hf_name(key): value for key, value in hf_state.items()}
    renamed.pop(None, None)
    rules = rules_for(config)
    _check_keys(renamed, [rule.hf for rule in rules], rules)
    return {
        rule.nv: apply_rule_hf_to_nv(rule, [renamed[name] for name in rule.hf], config)
        for rule in rules
        if all(name in renamed for name in rule.hf)
    }


def nv_to_hf_state_dict(nv_state: dict[str, torch.Tensor], config: NVEsmConfig) -> dict[str, torch.Tensor]:
    """NVEsm state dict -> transformers `EsmForMaskedLM` state dict. Raises CheckpointMismatch on other keys."""
    nv_state = {key: value for key, value in nv_state.items() if not key.endswith("._extra_state")}
    rules = rules_for(config)
    _check_keys(nv_state, [(rule.nv,) for rule in rules], rules)
    hf_state = {}
    for rule in rules:
        if rule.nv in nv_state:
            hf_state.update(zip(rule.hf, apply_rule_nv_to_hf(rule, nv_state[rule.nv], config)))
    return hf_state


def _check_keys(state: dict, names_per_rule: list[tuple[str, ...]], rules: list[Rule]) -> None:
    expected = {name for names in names_per_rule for name in names}
    required = {name for names, rule in zip(names_per_rule, rules) if not rule.optional for name in names}
    missing, unexpected = required - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise CheckpointMismatch(missing, unexpected)


# --------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------


def nv_config_from_hf(hf_config: dict, **overrides: object) -> NVEsmConfig:
    """An NVEsmConfig from a transformers `EsmConfig` dict (config.json of `facebook/esm2_*`)."""
    if hf_config.get("model_type") not in (None, "esm"):
        raise ValueError(f"Expected an ESM config (model_type 'esm'), got model_type {hf_config.get('model_type')!r}.")
    if hf_config.get("is_folding_model"):
        raise ValueError("This is an ESMFold config; only ESM-2 language models convert.")
    if hf_config.get("is_decoder"):
        raise ValueError("is_decoder=True: ESM-2 is an encoder; decoder configs do not convert.")
    fields = {name: hf_config[name] for name in SHARED_CONFIG_FIELDS if hf_config.get(name) is not None}
    return NVEsmConfig(**fields, **overrides)


def hf_config_from_nv(config: NVEsmConfig) -> dict:
    """A transformers `EsmConfig` dict (loadable by plain transformers) for an NVEsm config."""
    fields = {name: getattr(config, name) for name in SHARED_CONFIG_FIELDS}
    return {"architectures": ["EsmForMaskedLM"], "model_type": "esm", "hidden_act": config.hidden_act, **fields}


# --------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------


def resolve_source(source: str, revision: str | None = None) -> Path:
    """A local folder, or a Hub id downloaded with `huggingface_hub.snapshot_download`."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{source} is a file; pass the folder that holds config.json and the weights.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as error:
        raise ValueError(f"{source} is neither a local folder nor a Hub repository that can be reached: {error}") from error


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{folder} holds no model.safetensors or model.safetensors.index.json.")
    return [single]


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as file:
            state.update({key: file.get_tensor(key) for key in file.keys()})
    return state


def write_folder(
    out: Path, state: dict[str, torch.Tensor], config_dict: dict, source: Path, with_code: bool
) -> None:
    """Write weights, config.json, tokenizer files and (for NVEsm) the remote-code files into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in state.items()}, str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
    if with_code:
        for name in REMOTE_CODE_FILES:
            shutil.copy2(HERE / name, out / name)


def nv_config_dict(config: NVEsmConfig) -> dict:
    config_dict = config.to_dict()
    config_dict.update(auto_map=AUTO_MAP, architectures=["NVEsmForMaskedLM"])
    return config_dict


def convert_hf_to_nv(source: Path, out: Path, **config_overrides: object) -> NVEsmConfig:
    """Convert a transformers ESM-2 folder into an NVEsm folder; returns the NVEsm config."""
    config = nv_config_from_hf(json.loads((source / "config.json").read_text()), **config_overrides)
    state = hf_to_nv_state_dict(load_state_dict(source), config)
    write_folder(out, state, nv_config_dict(config), source, with_code=True)
    return config


def convert_nv_to_hf(source: Path, out: Path) -> NVEsmConfig:
    """Convert an NVEsm folder back into a transformers ESM-2 folder; returns the NVEsm config."""
    config_dict = json.loads((source / "config.json").read_text())
    if config_dict.get("model_type") != NVEsmConfig.model_type:
        raise ValueError(f"{source} is not an NVEsm checkpoint (model_type {config_dict.get('model_type')!r}).")
    config = NVEsmConfig.from_dict(config_dict)
    state = nv_to_hf_state_dict(load_state_dict(source), config)
    write_folder(out, state, hf_config_from_nv(config), source, with_code=False)
    return config


COMMANDS: dict[str, Callable[[Path, Path], NVEsmConfig]] = {
    "hf-to-te": convert_hf_to_nv,
    "te-to-hf": convert_nv_to_hf,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=sorted(COMMANDS), help="hf-to-te: transformers -> NVEsm; te-to-hf: back")
    parser.add_argument("source", help="local checkpoint folder or Hub id (e.g. facebook/esm2_t6_8M_UR50D)")
    parser.add_argument("out", type=Path, help="output folder (must be empty or absent)")
    parser.add_argument("--revision", default=None, help="Hub revision of SOURCE")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} is not empty; choose another folder or empty it.")
    try:
        source = resolve_source(args.source, args.revision)
        config = COMMANDS[args.direction](source, args.out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.direction}: {args.source} -> {args.out} ({config.num_hidden_layers} layers, hidden {config.hidden_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
