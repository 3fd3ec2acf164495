"""The ESM-2 tensor and config mapping between transformers / fair-esm and NVEsm: one table, both directions.

`RULES` (and `LAYER_RULES`, once per layer) name every tensor on both sides and the transform between them (query,
key and value fused per head into TE's interleaved `layernorm_qkv`; the vocabulary padded to a multiple of 8).
The pure functions here map whole state dicts and configs; `convert_checkpoint.py` streams the same table one rule
at a time over files, and the tests, the benchmarks and the trainer use these functions directly.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from configuration_nv_esm import NVEsmConfig
from modeling_nv_esm_lora import LORA_TARGETS
from nv_esm.alphabet import ESM_VOCAB

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
# Fields a classification head's config carries besides (transformers' meaning on both sides).
LABEL_CONFIG_FIELDS = ("id2label", "label2id", "problem_type")


# --------------------------------------------------------------------------------------------------------------
# The mapping table
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One NVEsm tensor and the transformers tensors it is made of.

    `kind`: "copy" (same tensor), "buffer" (same tensor, never cast by `--dtype`: the rotary frequencies set
    every position's angle, and ESM-2 ran with the exact values stored), "vocab" (rows padded with zeros from
    `vocab_size` to `padded_vocab_size`), "qkv" (query, key, value fused into rows interleaved per head
    `[h0: q, k, v | h1: ...]`). Names with `{i}` exist once per layer. `optional` tensors may be absent (tied
    decoder weight). `dims` is the shape of each transformers tensor in config sizes (see `dim_sizes`).
    """

    hf: tuple[str, ...]
    nv: str
    kind: str = "copy"
    optional: bool = False
    dims: tuple[str, ...] = ()

    def for_layer(self, index: int) -> Rule:
        return replace(self, hf=tuple(n.format(i=index) for n in self.hf), nv=self.nv.format(i=index))


HF_LAYER = "esm.encoder.layer.{i}."
NV_LAYER = "esm.encoder.layers.{i}."
# The contact head's tensors (the same names on both sides): the one part of the base model a checkpoint may lack
# (NVIDIA's BioNeMo layout has none, so bionemo-to-te writes none). `NVEsmModel`'s own names lack the `esm.`.
CONTACT_HEAD = "esm.contact_head."
H, HH = ("H",), ("H", "H")
RULES: tuple[Rule, ...] = (
    Rule(("esm.embeddings.word_embeddings.weight",), "esm.embeddings.word_embeddings.weight", "vocab", dims=("V", "H")),
    Rule(("esm.rotary_embeddings.inv_freq",), "esm.rotary_embeddings.inv_freq", "buffer", dims=("R",)),
    Rule(("esm.encoder.emb_layer_norm_after.weight",), "esm.encoder.emb_layer_norm_after.weight", dims=H),
    Rule(("esm.encoder.emb_layer_norm_after.bias",), "esm.encoder.emb_layer_norm_after.bias", dims=H),
    Rule((CONTACT_HEAD + "regression.weight",), CONTACT_HEAD + "regression.weight", dims=("1", "C")),
    Rule((CONTACT_HEAD + "regression.bias",), CONTACT_HEAD + "regression.bias", dims=("1",)),
)
CONTACT_HEAD_TENSORS = frozenset(rule.nv for rule in RULES if rule.nv.startswith(CONTACT_HEAD))


def is_contact_head(name: str) -> bool:
    """Whether the tensor or parameter `name` is the contact head's: under `CONTACT_HEAD` or, in `NVEsmModel`
    (whose names lack `esm.`), under the rest of it."""
    return name.startswith((CONTACT_HEAD, CONTACT_HEAD.removeprefix("esm.")))


@dataclass(frozen=True)
class Head:
    """A task head: the model classes on both sides and the rules of its tensors (besides the encoder's)."""

    hf_class: str
    nv_class: str
    rules: tuple[Rule, ...]


HEADS: dict[str, Head] = {
    "masked_lm": Head(
        "EsmForMaskedLM",
        "NVEsmForMaskedLM",
        (
            Rule(("lm_head.dense.weight",), "lm_head.dense.weight", dims=HH),
            Rule(("lm_head.dense.bias",), "lm_head.dense.bias", dims=H),
            Rule(("lm_head.layer_norm.weight",), "lm_head.decoder.layer_norm_weight", dims=H),
            Rule(("lm_head.layer_norm.bias",), "lm_head.decoder.layer_norm_bias", dims=H),
            Rule(("lm_head.decoder.weight",), "lm_head.decoder.weight", "vocab", optional=True, dims=("V", "H")),
            Rule(("lm_head.bias",), "lm_head.decoder.bias", "vocab", dims=("V",)),
        ),
    ),
    "token_classification": Head(
        "EsmForTokenClassification",
        "NVEsmForTokenClassification",
        (
            Rule(("classifier.weight",), "classifier.weight", dims=("L", "H")),
            Rule(("classifier.bias",), "classifier.bias", dims=("L",)),
        ),
    ),
    "sequence_classification": Head(
        "EsmForSequenceClassification",
        "NVEsmForSequenceClassification",
        (
            Rule(("classifier.dense.weight",), "classifier.dense.weight", dims=HH),
            Rule(("classifier.dense.bias",), "classifier.dense.bias", dims=H),
            Rule(("classifier.out_proj.weight",), "classifier.out_proj.weight", dims=("L", "H")),
            Rule(("classifier.out_proj.bias",), "classifier.out_proj.bias", dims=("L",)),
        ),
    ),
}
LAYER_RULES: tuple[Rule, ...] = (
    Rule(
        (HF_LAYER + "attention.LayerNorm.weight",), NV_LAYER + "self_attention.layernorm_qkv.layer_norm_weight", dims=H
    ),
    Rule((HF_LAYER + "attention.LayerNorm.bias",), NV_LAYER + "self_attention.layernorm_qkv.layer_norm_bias", dims=H),
    Rule(
        tuple(HF_LAYER + f"attention.self.{name}.weight" for name in ("query", "key", "value")),
        NV_LAYER + "self_attention.layernorm_qkv.weight",
        "qkv",
        dims=HH,
    ),
    Rule(
        tuple(HF_LAYER + f"attention.self.{name}.bias" for name in ("query", "key", "value")),
        NV_LAYER + "self_attention.layernorm_qkv.bias",
        "qkv",
        dims=H,
    ),
    Rule((HF_LAYER + "attention.output.dense.weight",), NV_LAYER + "self_attention.proj.weight", dims=HH),
    Rule((HF_LAYER + "attention.output.dense.bias",), NV_LAYER + "self_attention.proj.bias", dims=H),
    Rule((HF_LAYER + "LayerNorm.weight",), NV_LAYER + "layernorm_mlp.layer_norm_weight", dims=H),
    Rule((HF_LAYER + "LayerNorm.bias",), NV_LAYER + "layernorm_mlp.layer_norm_bias", dims=H),
    Rule((HF_LAYER + "intermediate.dense.weight",), NV_LAYER + "layernorm_mlp.fc1_weight", dims=("I", "H")),
    Rule((HF_LAYER + "intermediate.dense.bias",), NV_LAYER + "layernorm_mlp.fc1_bias", dims=("I",)),
    Rule((HF_LAYER + "output.dense.weight",), NV_LAYER + "layernorm_mlp.fc2_weight", dims=("H", "I")),
    Rule((HF_LAYER + "output.dense.bias",), NV_LAYER + "layernorm_mlp.fc2_bias", dims=H),
)
# Names that transformers checkpoints use besides the current ones: (pattern, canonical name or None = dropped).
# transformers >= 5 saves LayerNorms as gamma/beta and the rotary inv_freq as `encoder.layer.*.…`; older
# versions keep one inv_freq per layer and a `position_ids` buffer.
HF_ALIASES: tuple[tuple[re.Pattern, str | None], ...] = (
    (re.compile(r"esm\.embeddings\.position_ids"), None),
    (
        re.compile(r"esm\.encoder\.layer\.(\d+|\*)\.attention\.self\.rotary_embeddings\.inv_freq"),
        "esm.rotary_embeddings.inv_freq",
    ),
    (re.compile(r"(.*LayerNorm)\.gamma"), r"\1.weight"),
    (re.compile(r"(.*LayerNorm)\.beta"), r"\1.bias"),
)
# fair-esm (fairseq) names of an ESM-2 `.pt` -> transformers names, as in fair-esm's ESM2 module (`layers.{i}`
# are `TransformerLayer`s, `lm_head` a `RobertaLMHead`). `{i}` is a layer, `{p}` weight or bias. The
# `lm_head.weight` of fair-esm is the embedding matrix itself (tied), so it is dropped (None). The contact
# regression lives in a separate `-contact-regression.pt`, with or without the `encoder.` prefix.
FAIR_ESM_NAMES: dict[str, str | None] = {
    "encoder.sentence_encoder.embed_tokens.weight": "esm.embeddings.word_embeddings.weight",
    "encoder.sentence_encoder.emb_layer_norm_after.{p}": "esm.encoder.emb_layer_norm_after.{p}",
    "encoder.sentence_encoder.layers.{i}.self_attn.rot_emb.inv_freq": "esm.rotary_embeddings.inv_freq",
    "encoder.sentence_encoder.layers.{i}.self_attn.q_proj.{p}": HF_LAYER + "attention.self.query.{p}",
    "encoder.sentence_encoder.layers.{i}.self_attn.k_proj.{p}": HF_LAYER + "attention.self.key.{p}",
    "encoder.sentence_encoder.layers.{i}.self_attn.v_proj.{p}": HF_LAYER + "attention.self.value.{p}",
    "encoder.sentence_encoder.layers.{i}.self_attn.out_proj.{p}": HF_LAYER + "attention.output.dense.{p}",
    "encoder.sentence_encoder.layers.{i}.self_attn_layer_norm.{p}": HF_LAYER + "attention.LayerNorm.{p}",
    "encoder.sentence_encoder.layers.{i}.final_layer_norm.{p}": HF_LAYER + "LayerNorm.{p}",
    "encoder.sentence_encoder.layers.{i}.fc1.{p}": HF_LAYER + "intermediate.dense.{p}",
    "encoder.sentence_encoder.layers.{i}.fc2.{p}": HF_LAYER + "output.dense.{p}",
    "encoder.lm_head.dense.{p}": "lm_head.dense.{p}",
    "encoder.lm_head.layer_norm.{p}": "lm_head.layer_norm.{p}",
    "encoder.lm_head.bias": "lm_head.bias",
    "encoder.lm_head.weight": None,
    "encoder.contact_head.regression.{p}": CONTACT_HEAD + "regression.{p}",
    "contact_head.regression.{p}": CONTACT_HEAD + "regression.{p}",
}


def _template_pattern(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(pattern)


FAIR_ESM_ALIASES: tuple[tuple[re.Pattern, str | None], ...] = tuple(
    (_template_pattern(name), target) for name, target in FAIR_ESM_NAMES.items()
)


def rules_for(config: NVEsmConfig, head: str = "masked_lm") -> list[Rule]:
    """Every rule of a model of this shape with this head (a key of `HEADS`), layers expanded."""
    layers = [rule.for_layer(i) for i in range(config.num_hidden_layers) for rule in LAYER_RULES]
    return [*RULES, *HEADS[head].rules, *layers]


def head_of(names: Iterable[str]) -> str:
    """The head (a key of `HEADS`) whose tensors are among `names` (canonical names, either side): the masked-LM
    head when any of its tensors is there (its rules then name what is missing or unexpected), else the classifier
    whose tensors are, else the masked-LM head."""
    names = set(names)

    def holds(head: str) -> bool:
        return any(name in names for rule in HEADS[head].rules for name in (*rule.hf, rule.nv))

    return next((head for head in HEADS if holds(head)), "masked_lm")


def dim_sizes(config: NVEsmConfig) -> dict[str, int]:
    """Sizes of the symbols in `Rule.dims`."""
    return {
        "V": config.vocab_size,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "R": config.head_dim // 2,
        "C": config.num_hidden_layers * config.num_attention_heads,
        "L": config.num_labels,
        "1": 1,
    }


def hf_shape(rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
    """Shape of each transformers tensor of `rule`."""
    sizes = dim_sizes(config)
    return tuple(sizes[dim] for dim in rule.dims)


def nv_shape(rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
    """Shape of the NVEsm tensor of `rule`."""
    shape = hf_shape(rule, config)
    if rule.kind == "vocab":
        return (config.padded_vocab_size, *shape[1:])
    if rule.kind == "qkv":
        return (3 * shape[0], *shape[1:])
    return shape


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
    """The NVEsm tensor of `rule` from its transformers tensors."""
    if rule.kind == "qkv":
        return fuse_qkv(*tensors, config.num_attention_heads)
    if rule.kind == "vocab":
        return pad_vocab(tensors[0], config.padded_vocab_size)
    return tensors[0]


def apply_rule_nv_to_hf(rule: Rule, tensor: torch.Tensor, config: NVEsmConfig) -> list[torch.Tensor]:
    """The transformers tensors of `rule` from its NVEsm tensor."""
    if rule.kind == "qkv":
        return list(split_qkv(tensor, config.num_attention_heads))
    if rule.kind == "vocab":
        return [tensor[: config.vocab_size].contiguous()]
    return [tensor]


# --------------------------------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------------------------------


class CheckpointMismatch(ValueError):
    """The source does not hold the tensors an ESM-2 checkpoint of its config holds (one line: the first 20 names
    missing and unexpected)."""

    def __init__(self, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        parts = []
        if self.missing:
            parts.append(f"Missing ({len(self.missing)}): " + _listed(self.missing))
        if self.unexpected:
            parts.append(f"Unexpected ({len(self.unexpected)}): " + _listed(self.unexpected))
        super().__init__(
            f"The checkpoint is not an ESM-2 checkpoint of the shape its config describes: {'; '.join(parts)}."
        )


class ConfigMismatch(ValueError):
    """The tensors have other shapes than the config describes (one line: the first 20 of them)."""

    def __init__(self, mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]], config: NVEsmConfig) -> None:
        self.mismatches = mismatches
        shape = ", ".join(
            f"{name}={getattr(config, name)}"
            for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        )
        listed = [f"{name}: {list(actual)}, expected {list(expected)}" for name, actual, expected in mismatches]
        super().__init__(f"The tensors do not have the shapes the config describes ({shape}): {_listed(listed, '; ')}.")


def _listed(items: list[str], separator: str = ", ") -> str:
    """The first 20 of `items` on one line, and how many more there are."""
    more = f"{separator}... and {len(items) - 20} more" if len(items) > 20 else ""
    return separator.join(items[:20]) + more


def canonical_hf_name(key: str) -> str | None:
    """The current transformers name of a tensor an ESM-2 checkpoint may hold (None: not needed)."""
    return _apply_aliases(key, HF_ALIASES)


def canonical_fair_esm_name(key: str) -> str | None:
    """The transformers name of a tensor of a fair-esm ESM-2 `.pt` (None: not needed; unknown names unchanged)."""
    return _apply_aliases(key, FAIR_ESM_ALIASES)


def canonical_nv_name(key: str) -> str | None:
    """NVEsm names are canonical; Transformer Engine's `._extra_state` (FP8 scaling state) is not a weight."""
    return None if key.endswith("._extra_state") else key


def _apply_aliases(key: str, aliases: tuple[tuple[re.Pattern, str | None], ...]) -> str | None:
    for pattern, canonical in aliases:
        match = pattern.fullmatch(key)
        if match:
            if canonical is None:
                return None
            groups = match.groupdict()
            return pattern.sub(canonical, key) if not groups else canonical.format(**groups)
    return key


def hf_to_nv_state_dict(hf_state: dict[str, torch.Tensor], config: NVEsmConfig) -> dict[str, torch.Tensor]:
    """transformers `EsmForMaskedLM` (or token/sequence classification) state dict -> NVEsm state dict. Raises
    CheckpointMismatch on other keys."""
    renamed = {canonical_hf_name(key): value for key, value in hf_state.items()}
    renamed.pop(None, None)
    rules = rules_for(config, head_of(renamed))
    check_keys(renamed, [rule.hf for rule in rules], rules)
    return {
        rule.nv: apply_rule_hf_to_nv(rule, [renamed[name] for name in rule.hf], config)
        for rule in rules
        if all(name in renamed for name in rule.hf)
    }


def nv_to_hf_state_dict(
    nv_state: dict[str, torch.Tensor], config: NVEsmConfig, absent: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """NVEsm state dict -> transformers `EsmForMaskedLM` (or token/sequence classification) state dict. Raises
    CheckpointMismatch on other keys; `absent`: NVEsm names `nv_state` may lack besides the optional ones (the
    contact head, `CONTACT_HEAD_TENSORS`, of a model read from NVIDIA's BioNeMo layout)."""
    nv_state = {key: value for key, value in nv_state.items() if not key.endswith("._extra_state")}
    rules = rules_for(config, head_of(nv_state))
    rules = [replace(rule, optional=True) if rule.nv in absent else rule for rule in rules]
    check_keys(nv_state, [(rule.nv,) for rule in rules], rules)
    hf_state = {}
    for rule in rules:
        if rule.nv in nv_state:
            hf_state.update(zip(rule.hf, apply_rule_nv_to_hf(rule, nv_state[rule.nv], config)))
    return hf_state


def check_keys(state: dict, names_per_rule: list[tuple[str, ...]], rules: list[Rule]) -> None:
    """Raise CheckpointMismatch when `state` lacks a tensor that a non-optional rule needs or holds one that no
    rule names (`names_per_rule[i]`: the names rule i reads)."""
    expected = {name for names in names_per_rule for name in names}
    required = {name for names, rule in zip(names_per_rule, rules) if not rule.optional for name in names}
    missing, unexpected = required - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise CheckpointMismatch(missing, unexpected)


# --------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------


def nv_config_from_hf(hf_config: dict, head: str = "masked_lm", **overrides: object) -> NVEsmConfig:
    """An NVEsmConfig from a transformers `EsmConfig` dict (config.json of `facebook/esm2_*`); for a classification
    `head` with its labels (`id2label`, `label2id`) and `problem_type`."""
    if hf_config.get("model_type") not in (None, "esm"):
        raise ValueError(f"Expected an ESM config (model_type 'esm'), got model_type {hf_config.get('model_type')!r}.")
    if hf_config.get("is_folding_model"):
        raise ValueError("This is an ESMFold config; only ESM-2 language models convert.")
    if hf_config.get("is_decoder"):
        raise ValueError("is_decoder=True: ESM-2 is an encoder; decoder configs do not convert.")
    fields = {name: hf_config[name] for name in SHARED_CONFIG_FIELDS if hf_config.get(name) is not None}
    if head != "masked_lm":
        fields.update({name: hf_config[name] for name in LABEL_CONFIG_FIELDS if hf_config.get(name) is not None})
    return NVEsmConfig(**{**fields, **overrides})


def hf_config_from_nv(config: NVEsmConfig, head: str = "masked_lm") -> dict:
    """A transformers `EsmConfig` dict (loadable by plain transformers) for an NVEsm config, whose `architectures`
    name the transformers class of `head`; a classification head's labels and `problem_type` included."""
    fields = {name: getattr(config, name) for name in SHARED_CONFIG_FIELDS}
    if head != "masked_lm":
        labels = {"id2label": {str(i): label for i, label in config.id2label.items()}, "label2id": config.label2id}
        fields.update(labels, **({"problem_type": config.problem_type} if config.problem_type else {}))
    architectures = [HEADS[head].hf_class]
    return {"architectures": architectures, "model_type": "esm", "hidden_act": config.hidden_act, **fields}


def hf_config_from_fair_esm(model_args: Any) -> dict:
    """A transformers `EsmConfig` dict for the `cfg["model"]` of a fair-esm ESM-2 checkpoint (Namespace or dict)."""

    def arg(name: str, default: Any = None) -> Any:
        return model_args.get(name, default) if isinstance(model_args, dict) else getattr(model_args, name, default)

    needed = ("encoder_layers", "encoder_embed_dim", "encoder_attention_heads")
    missing = [name for name in needed if arg(name) is None]
    if missing:
        raise ValueError(f"The fair-esm checkpoint's cfg['model'] lacks {', '.join(missing)}; is it ESM-2?")
    hidden = int(arg("encoder_embed_dim"))
    return {
        "model_type": "esm",
        "vocab_size": len(ESM_VOCAB),
        "hidden_size": hidden,
        "num_hidden_layers": int(arg("encoder_layers")),
        "num_attention_heads": int(arg("encoder_attention_heads")),
        "intermediate_size": int(arg("encoder_ffn_embed_dim", 4 * hidden)),
        "token_dropout": bool(arg("token_dropout", True)),
        "mask_token_id": ESM_VOCAB.index("<mask>"),
        "pad_token_id": ESM_VOCAB.index("<pad>"),
        "max_position_embeddings": 1026,  # as transformers' ESM-2 configs: 1024 residues + <cls> + <eos>
        "layer_norm_eps": 1e-5,
        "position_embedding_type": "rotary",
        "emb_layer_norm_before": False,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "tie_word_embeddings": True,
    }


# --------------------------------------------------------------------------------------------------------------
# PEFT adapters
# --------------------------------------------------------------------------------------------------------------

# An adapter's tensor names (`adapter_model.safetensors`) start with this; the rest is the model's module path.
ADAPTER_PREFIX = "base_model.model."
# A LoRA tensor: the module it adapts, the LoRA part (`lora_A`, `lora_embedding_B`, `lora_magnitude_vector`, ...).
LORA_TENSOR = re.compile(r"(?P<module>.+?)\.(?P<part>lora_[A-Za-z_]+)(?P<rest>\..+)?")
# A layer of the encoder in each naming (EsmModel's adapters lack `esm.`).
LAYER_PATHS = {
    True: re.compile(r"^((?:esm\.)?encoder)\.layer\.(\d+)\."),
    False: re.compile(r"^((?:esm\.)?encoder)\.layers\.(\d+)\."),
}
LAYER_PATH_NAMES = {True: r"\1.layers.\2.", False: r"\1.layer.\2."}
# Modules outside the layers that LoRA may adapt with the same name on both sides (the embedding's LoRA A has a
# column per vocabulary entry).
LORA_MODULES = ("lm_head.dense", "classifier", "classifier.dense", "classifier.out_proj")
LORA_EMBEDDING = "embeddings.word_embeddings"


def hf_to_nv_adapter_state_dict(state: dict[str, torch.Tensor], config: NVEsmConfig) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors (LoRA; `modules_to_save` heads) saved from transformers' ESM-2 -> NVEsm's: layers
    renamed, a head's tensors through the head's rules (the LM head's LayerNorm into its decoder, vocabulary rows
    padded to `config.padded_vocab_size`). ValueError on a tensor with no NVEsm counterpart."""
    return {_adapter_key(key, True): _adapter_tensor(key, tensor, config, True) for key, tensor in state.items()}


def nv_to_hf_adapter_state_dict(state: dict[str, torch.Tensor], config: NVEsmConfig) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_nv_adapter_state_dict` (vocabulary rows cut to `config.vocab_size`; refused unless the
    cut rows are zero)."""
    return {_adapter_key(key, False): _adapter_tensor(key, tensor, config, False) for key, tensor in state.items()}


def _head_rules() -> dict[str, Rule]:
    """The single-tensor rules outside the layers, by the name of either side."""
    rules = [rule for rule in (*RULES, *(r for head in HEADS.values() for r in head.rules)) if len(rule.hf) == 1]
    return {**{rule.hf[0]: rule for rule in rules}, **{rule.nv: rule for rule in rules}}


def _adapter_key(key: str, to_nv: bool) -> str:
    if not key.startswith(ADAPTER_PREFIX):
        raise ValueError(f"{key}: not a PEFT adapter tensor of a model (expected the prefix {ADAPTER_PREFIX!r}).")
    name = key.removeprefix(ADAPTER_PREFIX)
    lora = LORA_TENSOR.fullmatch(name)
    if lora is None:  # a `modules_to_save` tensor, under its model name
        canonical = (canonical_hf_name(name) if to_nv else name) or name
        rule = _head_rules().get(canonical)
        if rule is None or canonical != (rule.hf[0] if to_nv else rule.nv):
            raise ValueError(
                f"{key}: a `modules_to_save` tensor that is not a head's or the embedding's; only those convert (an "
                f"encoder module saved whole does not: merge the adapter and convert the model)."
            )
        return ADAPTER_PREFIX + (rule.nv if to_nv else rule.hf[0])
    if LAYER_PATHS[not to_nv].match(lora["module"]):
        names, back = ("NVEsm's", "te-to-hf") if to_nv else ("transformers'", "hf-to-te")
        raise ValueError(f"{key}: the adapter already has {names} names; convert it with {back}.")
    module = LAYER_PATHS[to_nv].sub(LAYER_PATH_NAMES[to_nv], lora["module"])
    inner = LAYER_PATHS[not to_nv].sub("", module)
    in_layer, known = inner != module, (*LORA_MODULES, LORA_EMBEDDING, f"esm.{LORA_EMBEDDING}")
    if (in_layer and inner not in LORA_TARGETS) or (not in_layer and module not in known):
        raise ValueError(
            f"{key}: LoRA on `{lora['module']}` has no NVEsm counterpart; adapters convert on the layers' "
            f"projections ({', '.join(LORA_TARGETS)}), {', '.join(LORA_MODULES)} and the word embedding."
        )
    return f"{ADAPTER_PREFIX}{module}.{lora['part']}{lora['rest'] or ''}"


def _adapter_tensor(key: str, tensor: torch.Tensor, config: NVEsmConfig, to_nv: bool) -> torch.Tensor:
    name = key.removeprefix(ADAPTER_PREFIX)
    lora = LORA_TENSOR.fullmatch(name)
    if lora is not None:  # only the embedding's LoRA A has a vocabulary dimension: [r, vocabulary]
        if not (lora["module"].endswith(LORA_EMBEDDING) and lora["part"] == "lora_embedding_A"):
            return tensor
        return _vocab_rows(key, tensor.T, config, to_nv).T.contiguous()
    rule = _head_rules()[(canonical_hf_name(name) or name) if to_nv else name]
    return _vocab_rows(key, tensor, config, to_nv) if rule.kind == "vocab" else tensor


def _vocab_rows(key: str, tensor: torch.Tensor, config: NVEsmConfig, to_nv: bool) -> torch.Tensor:
    """`tensor`'s rows, one per vocabulary entry, padded (`to_nv`) or cut back."""
    rows, padded = (config.vocab_size, config.padded_vocab_size) if to_nv else (config.padded_vocab_size, None)
    if tensor.shape[0] != rows:
        raise ValueError(f"{key}: {tensor.shape[0]} vocabulary rows, expected {rows} (ESM-2's vocabulary).")
    if to_nv:
        return pad_vocab(tensor, padded)
    if tensor[config.vocab_size :].any():
        raise ValueError(f"{key}: its rows past the vocabulary ({config.vocab_size}) are not zero; not converted.")
    return tensor[: config.vocab_size].contiguous()
