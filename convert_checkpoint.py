"""Convert ESM-2 checkpoints between transformers (`EsmForMaskedLM`), fair-esm (`.pt`) and NVEsm (Transformer Engine).

One table, `RULES`, maps every tensor; both directions read it. The pure functions (state dict in, state dict
out) serve the model code and the tests; the command line streams: it reads and writes one rule's tensors at a
time, so converting a checkpoint needs memory for its largest layer, not for the whole model.

SRC is a local folder (single or sharded safetensors), a Hugging Face Hub id, or, for hf-to-te, an original
fair-esm checkpoint (`esm2_t33_650M_UR50D.pt`; its `-contact-regression.pt` is read when it lies beside it).
OUT is written in a temporary folder next to it and moved into place only when everything succeeded.
`verify SRC OUT` checks an existing conversion: every tensor of SRC mapped through `RULES` must equal OUT's bit for
bit, and both models' logits must agree on real proteins.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

import huggingface_hub
import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from configuration_nv_esm import NVEsmConfig

HERE = Path(__file__).resolve().parent
PROTEINS_FASTA = HERE / "assets" / "proteins.fasta"
REMOTE_CODE_FILES = ("configuration_nv_esm.py", "modeling_nv_esm.py")
TOKENIZER_SETTINGS_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# What the output's tokenizer takes from a source folder's tokenizer files; nothing else of them is written
# (an `auto_map` there would make AutoTokenizer(..., trust_remote_code=True) run code from another repository).
SPECIAL_TOKENS = ("cls_token", "pad_token", "eos_token", "unk_token", "mask_token")
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
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
# The ESM-2 alphabet in token-id order (fair-esm's "ESM-1b" alphabet; the vocab.txt of facebook/esm2_*).
ESM_VOCAB = "<cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O . - <null_1> <mask>".split()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DEFAULT_MAX_SHARD_SIZE = "5GB"
# --verify: largest |logit difference| allowed, by the dtype of the converted weights; the reference always runs
# in float32. float32: both implementations do the same arithmetic in another order (fused QKV GEMM, other
# kernels): 4e-6 on a random 650M-shaped model (33 layers, H100 and CPU alike). bfloat16 keeps 8 significant bits
# and float16 11: rounding weights and activations moved that model's logits by up to 0.07 (bf16) and 0.009
# (fp16). Trained ESM-2 has larger logits than random weights, so the defaults leave ~10x room; a mapping error
# (swapped q/k, wrong head order, a missing bias) moves logits by far more.
DEFAULT_VERIFY_ATOL = {"float32": 1e-4, "float16": 0.1, "bfloat16": 0.75}
# Transformer Engine's fused GELU is the tanh approximation (|gelu_tanh - gelu_erf| <= 5e-4 per activation):
# float32 logits on the TE backend moved by up to 2.7e-3 on the same model.
TE_FP32_VERIFY_ATOL = 5e-2
ESM2_CITATION = """@article{lin2023evolutionary,
  title   = {Evolutionary-scale prediction of atomic-level protein structure with a language model},
  author  = {Lin, Zeming and Akin, Halil and Rao, Roshan and Hie, Brian and Zhu, Zhongkai and Lu, Wenting and
             Smetanin, Nikita and Verkuil, Robert and Kabeli, Ori and Shmueli, Yaniv and dos Santos Costa, Allan and
             Fazel-Zarandi, Maryam and Sercu, Tom and Candido, Salvatore and Rives, Alexander},
  journal = {Science},
  volume  = {379},
  number  = {6637},
  pages   = {1123--1130},
  year    = {2023},
  doi     = {10.1126/science.ade2574}
}"""
MIT_LICENSE = """MIT License

Copyright (c) Meta Platforms, Inc. and affiliates (ESM-2 model weights).{code_copyright}

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


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
H, HH = ("H",), ("H", "H")
RULES: tuple[Rule, ...] = (
    Rule(("esm.embeddings.word_embeddings.weight",), "esm.embeddings.word_embeddings.weight", "vocab", dims=("V", "H")),
    Rule(("esm.rotary_embeddings.inv_freq",), "esm.rotary_embeddings.inv_freq", "buffer", dims=("R",)),
    Rule(("esm.encoder.emb_layer_norm_after.weight",), "esm.encoder.emb_layer_norm_after.weight", dims=H),
    Rule(("esm.encoder.emb_layer_norm_after.bias",), "esm.encoder.emb_layer_norm_after.bias", dims=H),
    Rule(("esm.contact_head.regression.weight",), "esm.contact_head.regression.weight", dims=("1", "C")),
    Rule(("esm.contact_head.regression.bias",), "esm.contact_head.regression.bias", dims=("1",)),
    Rule(("lm_head.dense.weight",), "lm_head.dense.weight", dims=HH),
    Rule(("lm_head.dense.bias",), "lm_head.dense.bias", dims=H),
    Rule(("lm_head.layer_norm.weight",), "lm_head.decoder.layer_norm_weight", dims=H),
    Rule(("lm_head.layer_norm.bias",), "lm_head.decoder.layer_norm_bias", dims=H),
    Rule(("lm_head.decoder.weight",), "lm_head.decoder.weight", "vocab", optional=True, dims=("V", "H")),
    Rule(("lm_head.bias",), "lm_head.decoder.bias", "vocab", dims=("V",)),
)
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
    "encoder.contact_head.regression.{p}": "esm.contact_head.regression.{p}",
    "contact_head.regression.{p}": "esm.contact_head.regression.{p}",
}


def _template_pattern(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(pattern)


FAIR_ESM_ALIASES: tuple[tuple[re.Pattern, str | None], ...] = tuple(
    (_template_pattern(name), target) for name, target in FAIR_ESM_NAMES.items()
)


def rules_for(config: NVEsmConfig) -> list[Rule]:
    """Every rule of a model of this shape, layers expanded."""
    layers = [rule.for_layer(i) for i in range(config.num_hidden_layers) for rule in LAYER_RULES]
    return list(RULES) + layers


def dim_sizes(config: NVEsmConfig) -> dict[str, int]:
    """Sizes of the symbols in `Rule.dims`."""
    return {
        "V": config.vocab_size,
        "H": config.hidden_size,
        "I": config.intermediate_size,
        "R": config.head_dim // 2,
        "C": config.num_hidden_layers * config.num_attention_heads,
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
    """The source does not hold the tensors an ESM-2 checkpoint of its config holds."""

    def __init__(self, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        lines = ["The checkpoint is not an ESM-2 checkpoint of the shape its config describes."]
        if self.missing:
            lines.append(f"Missing ({len(self.missing)}): " + ", ".join(self.missing[:20]))
        if self.unexpected:
            lines.append(f"Unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected[:20]))
        super().__init__("\n".join(lines))


class ConfigMismatch(ValueError):
    """The tensors have other shapes than the config describes."""

    def __init__(self, mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]], config: NVEsmConfig) -> None:
        self.mismatches = mismatches
        shape = ", ".join(
            f"{name}={getattr(config, name)}"
            for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        )
        lines = [f"The tensors do not have the shapes the config describes ({shape}):"]
        lines += [f"  {name}: {list(actual)}, expected {list(expected)}" for name, actual, expected in mismatches[:20]]
        if len(mismatches) > 20:
            lines.append(f"  ... and {len(mismatches) - 20} more")
        super().__init__("\n".join(lines))


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


def nv_config_dict(config: NVEsmConfig) -> dict:
    """config.json of an NVEsm folder: the config, its architecture and the `auto_map` of the remote code."""
    config_dict = config.to_dict()
    config_dict.update(auto_map=AUTO_MAP, architectures=["NVEsmForMaskedLM"])
    return config_dict


# --------------------------------------------------------------------------------------------------------------
# Reading checkpoints
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsStore:
    """The tensors of safetensors files, read one at a time.

    Each read opens (memory-maps) the file for that tensor only, so pages of tensors already converted do not stay
    resident: the process never holds more than the tensors of the rule being converted.
    """

    def __init__(self, files: list[Path]) -> None:
        self.info: dict[str, TensorInfo] = {}
        self._files: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as file:
                for key in file.keys():
                    self.info[key] = TensorInfo(tuple(file.get_slice(key).get_shape()), _torch_dtype(file, key, path))
                    self._files[key] = path

    def load(self, key: str) -> torch.Tensor:
        with safe_open(str(self._files[key]), framework="pt") as file:
            return file.get_tensor(key)


def _torch_dtype(file: Any, key: str, path: Path) -> torch.dtype:
    name = file.get_slice(key).get_dtype()
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path.name}: tensor {key} has dtype {name}, which ESM-2 checkpoints do not use.")
    return SAFETENSORS_DTYPES[name]


class StateDictStore:
    """The tensors of a state dict loaded from a `.pt` file (memory-mapped when the file allows)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}
        self.info = {key: TensorInfo(tuple(value.shape), value.dtype) for key, value in self._state.items()}

    def load(self, key: str) -> torch.Tensor:
        return self._state[key]


@dataclass
class Source:
    """A checkpoint to convert.

    Attributes:
        spec: What was asked for: a folder, a Hub id or a `.pt` file.
        path: The local folder (downloaded for a Hub id) or `.pt` file.
        kind: "transformers" (EsmForMaskedLM), "nvesm" or "fair-esm".
        config: Its config.json (a transformers `EsmConfig` dict for fair-esm checkpoints).
        store: Its tensors.
        hub_id: The Hub repository it comes from, when known.
    """

    spec: str
    path: Path
    kind: str
    config: dict
    store: SafetensorsStore | StateDictStore
    hub_id: str | None = None

    @property
    def folder(self) -> Path | None:
        return self.path if self.path.is_dir() else None

    @property
    def canonical(self) -> Callable[[str], str | None]:
        return {"transformers": canonical_hf_name, "fair-esm": canonical_fair_esm_name}.get(
            self.kind, canonical_nv_name
        )

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.store.info.values())


def resolve_source(source: str, revision: str | None = None) -> Path:
    """A local folder, or a Hub id downloaded with `huggingface_hub.snapshot_download` (token and cache from the
    usual `HF_TOKEN`/`HF_HOME` settings)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{source} is a file; pass the folder that holds config.json and the weights.")
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ValueError(f"{source}: no such folder.")
    try:
        return Path(
            huggingface_hub.snapshot_download(
                source, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt"]
            )
        )
    except Exception as error:
        raise ValueError(
            f"{source} is neither a local folder nor a Hub repository that can be reached "
            f"(revision {revision or 'main'}): {type(error).__name__}: {error}\n"
            "Check the id and the network; private or gated repositories need HF_TOKEN or `hf auth login`."
        ) from error


def open_source(spec: str | Path, revision: str | None = None) -> Source:
    """Find, and if needed download, a checkpoint; read its config and the index of its tensors."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".pt":
        if not path.is_file():
            raise ValueError(f"{spec}: no such file.")
        return open_fair_esm(path)
    folder = resolve_source(spec, revision)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ValueError(f"{folder} holds no config.json; it is not a transformers or NVEsm checkpoint.")
    config = read_json(config_path)
    kind = {"esm": "transformers", NVEsmConfig.model_type: "nvesm"}.get(config.get("model_type"))
    if kind is None:
        raise ValueError(
            f"{spec} is not an ESM-2 checkpoint: config.json has model_type {config.get('model_type')!r} "
            f"(expected 'esm' or '{NVEsmConfig.model_type}')."
        )
    hub_id = None if path.is_dir() else spec
    return Source(spec, folder, kind, config, SafetensorsStore(weight_files(folder)), hub_id or hub_id_of(folder))


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file when it holds something else."""
    try:
        data = json.loads(path.read_text())
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object.")
    return data


def hub_id_of(folder: Path) -> str | None:
    """The Hub id of a folder inside the Hugging Face cache (`models--org--name/snapshots/<commit>`), else None."""
    for part in folder.resolve().parts:
        if part.startswith("models--"):
            return part[len("models--") :].replace("--", "/")
    return None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (single file or sharded with an index)."""
    index = folder / WEIGHTS_INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if (
            not isinstance(weight_map, dict)
            or not weight_map
            or not all(isinstance(v, str) for v in weight_map.values())
        ):
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> file name); the index is broken.")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not shard.endswith(".safetensors") or PurePath(shard).is_absolute() or ".." in PurePath(shard).parts:
                raise ValueError(f"{index} names the file {shard!r}, not a .safetensors file inside {folder}; refused.")
            if not (folder / shard).is_file():
                raise ValueError(f"{index} names {shard}, which is not in {folder}.")
        return [folder / shard for shard in shards]
    single = folder / WEIGHTS_NAME
    if not single.exists():
        raise ValueError(
            f"{folder} holds no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}. Only safetensors weights are read "
            "(pickled pytorch_model.bin files are not); original fair-esm checkpoints are passed as the .pt file."
        )
    return [single]


def load_torch_file(path: Path) -> dict:
    """`torch.load` with `weights_only=True` (tensors and plain containers; fair-esm's `argparse.Namespace` cfg is
    allowed, nothing else runs), memory-mapped when the file is in the zip format."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        detail = str(error).strip().splitlines()[-3:]
        raise ValueError(
            f"{path} holds objects other than tensors, so it is not read (only weights_only loading is done): "
            + " ".join(line.strip() for line in detail)
        ) from error


def open_fair_esm(path: Path) -> Source:
    """An original fair-esm ESM-2 checkpoint (`{"model": state dict, "cfg": {"model": args}}`)."""
    data = load_torch_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"{path} is not a fair-esm checkpoint (expected a dict with a 'model' state dict).")
    if "cfg" not in data:
        arch = getattr(data.get("args"), "arch", None)
        raise ValueError(f"{path} is not an ESM-2 checkpoint (no 'cfg'; args.arch={arch!r}: ESM-1 and MSA models).")
    cfg = data["cfg"]
    model_args = cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None)
    if model_args is None:
        raise ValueError(
            f"{path}: its 'cfg' has no 'model' (the model's arguments); is it a fair-esm ESM-2 checkpoint?"
        )
    state = dict(data["model"])
    regression = path.with_name(path.stem + "-contact-regression.pt")
    if regression.exists():
        regression_data = load_torch_file(regression)
        if not isinstance(regression_data, dict) or not isinstance(regression_data.get("model"), dict):
            raise ValueError(
                f"{regression} is not a contact-regression file (expected a dict with a 'model' state dict)."
            )
        state.update(regression_data["model"])
    if not any("contact_head.regression" in key for key in state):
        raise ValueError(
            f"{path} holds no contact-regression weights and {regression.name} is not beside it; put fair-esm's "
            f"{regression.name} (from the same release as the model) in {path.parent}."
        )
    config = hf_config_from_fair_esm(model_args)
    return Source(str(path), path, "fair-esm", config, StateDictStore(state))


# --------------------------------------------------------------------------------------------------------------
# The conversion plan: one step per rule, built on the same table
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Direction:
    """Which side of each `Rule` is read and which is written."""

    name: str
    to_nv: bool

    def sources(self, rule: Rule) -> tuple[str, ...]:
        return rule.hf if self.to_nv else (rule.nv,)

    def targets(self, rule: Rule) -> tuple[str, ...]:
        return (rule.nv,) if self.to_nv else rule.hf

    def source_shape(self, rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
        return hf_shape(rule, config) if self.to_nv else nv_shape(rule, config)

    def target_shape(self, rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
        return nv_shape(rule, config) if self.to_nv else hf_shape(rule, config)

    def transform(self, rule: Rule, tensors: list[torch.Tensor], config: NVEsmConfig) -> list[torch.Tensor]:
        if self.to_nv:
            return [apply_rule_hf_to_nv(rule, tensors, config)]
        return apply_rule_nv_to_hf(rule, tensors[0], config)


HF_TO_TE = Direction("hf-to-te", to_nv=True)
TE_TO_HF = Direction("te-to-hf", to_nv=False)
DIRECTIONS = {direction.name: direction for direction in (HF_TO_TE, TE_TO_HF)}


@dataclass(frozen=True)
class Step:
    """One rule applied to one checkpoint: the stored tensors it reads and the tensors it writes."""

    rule: Rule
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, TensorInfo], ...]

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.outputs)


def plan_steps(
    source: Source, config: NVEsmConfig, direction: Direction, dtype: torch.dtype | None = None
) -> list[Step]:
    """The steps that convert `source`; raises CheckpointMismatch (names) or ConfigMismatch (shapes) first."""
    stored = canonical_keys(source.store.info, source.canonical)
    rules = rules_for(config)
    _check_keys(stored, [direction.sources(rule) for rule in rules], rules)
    present = [rule for rule in rules if all(name in stored for name in direction.sources(rule))]
    _check_shapes(source, stored, present, config, direction)
    return [_step(rule, stored, source, config, direction, dtype) for rule in present]


def canonical_keys(keys: Iterable[str], canonical: Callable[[str], str | None]) -> dict[str, str]:
    """canonical name -> stored key; of several keys with one canonical name (per-layer inv_freq) the first."""
    names: dict[str, str] = {}
    for key in sorted(keys):
        name = canonical(key)
        if name is not None:
            names.setdefault(name, key)
    return names


def _check_shapes(
    source: Source, stored: dict[str, str], rules: list[Rule], config: NVEsmConfig, direction: Direction
) -> None:
    mismatches = []
    for rule in rules:
        expected = direction.source_shape(rule, config)
        for name in direction.sources(rule):
            actual = source.store.info[stored[name]].shape
            if actual != expected:
                mismatches.append((stored[name], actual, expected))
    if mismatches:
        raise ConfigMismatch(mismatches, config)


def _step(
    rule: Rule,
    stored: dict[str, str],
    source: Source,
    config: NVEsmConfig,
    direction: Direction,
    dtype: torch.dtype | None,
) -> Step:
    inputs = tuple(stored[name] for name in direction.sources(rule))
    stored_dtype = source.store.info[inputs[0]].dtype
    keep = dtype is None or rule.kind == "buffer" or not stored_dtype.is_floating_point
    info = TensorInfo(direction.target_shape(rule, config), stored_dtype if keep else dtype)
    return Step(rule, inputs, tuple((name, info) for name in direction.targets(rule)))


def run_step(step: Step, source: Source, config: NVEsmConfig, direction: Direction) -> list[torch.Tensor]:
    """Read the step's tensors, apply its rule, cast to the planned dtype."""
    tensors = [source.store.load(key) for key in step.inputs]
    results = direction.transform(step.rule, tensors, config)
    return [tensor.to(info.dtype) for tensor, (_, info) in zip(results, step.outputs)]


# --------------------------------------------------------------------------------------------------------------
# Writing safetensors shards tensor by tensor
# --------------------------------------------------------------------------------------------------------------


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (names, shapes, dtypes) are known before their values.

    The header goes first; then each tensor's bytes as it is produced, in the announced order. Only the tensor
    being written is in memory. Use as a context manager; leaving it early (an error) leaves an incomplete file,
    which the caller deletes with the rest of the staging folder.
    """

    def __init__(self, path: Path, entries: list[tuple[str, TensorInfo]], metadata: dict[str, str]) -> None:
        names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, info in entries:
            header[name] = {
                "dtype": names[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.path = path
        self._pending = deque(entries)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must be the one announced next, with its shape and dtype."""
        expected, info = self._pending.popleft()
        if name != expected or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
            raise RuntimeError(
                f"{self.path.name}: expected {expected} {list(info.shape)} {info.dtype}, got {name} "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, error_type: type | None, *_: object) -> None:
        self._file.close()
        if error_type is None and self._pending:
            raise RuntimeError(f"{self.path.name}: {len(self._pending)} announced tensors were not written")


def parse_size(text: str) -> int:
    """`"5GB"` -> 5_000_000_000 (KB/MB/GB/TB: powers of 1000, KiB/MiB/GiB/TiB: powers of 1024, or plain bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    base = 1024 if "i" in unit else 1000
    size = int(number * base ** "bkmgt".index(unit[0]))
    if size < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def format_bytes(size: float) -> str:
    """Bytes in decimal units, as the Hub shows them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def split_into_shards(steps: list[Step], max_bytes: int) -> list[list[Step]]:
    """Consecutive steps grouped into shards of at most `max_bytes` (a larger step gets a shard of its own)."""
    shards: list[list[Step]] = []
    size = 0
    for step in steps:
        if not shards or size + step.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(step)
        size += step.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def write_weights(
    folder: Path,
    steps: list[Step],
    source: Source,
    config: NVEsmConfig,
    direction: Direction,
    max_shard_bytes: int,
    progress: bool | None = None,
) -> int:
    """Stream every step into safetensors shards in `folder` (+ index when sharded); returns the shard count."""
    shards = split_into_shards(steps, max_shard_bytes)
    weight_map = {}
    total = sum(step.nbytes for step in steps)
    with tqdm(total=total, unit="B", unit_scale=True, desc=direction.name, disable=_quiet(progress)) as bar:
        for name, shard in zip(shard_names(len(shards)), shards):
            entries = [output for step in shard for output in step.outputs]
            with SafetensorsWriter(folder / name, entries, {"format": "pt"}) as writer:
                for step in shard:
                    bar.set_postfix_str(step.outputs[0][0], refresh=False)
                    for (out_name, _), tensor in zip(step.outputs, run_step(step, source, config, direction)):
                        writer.write(out_name, tensor)
                    bar.update(step.nbytes)
            weight_map.update({out_name: name for out_name, _ in entries})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


def _quiet(progress: bool | None) -> bool | None:
    """tqdm's `disable`: None shows bars on a terminal only."""
    return None if progress is None else not progress


# --------------------------------------------------------------------------------------------------------------
# Output folder: staging, companions (config, tokenizer, code, license, model card)
# --------------------------------------------------------------------------------------------------------------


def check_out(out: Path, force: bool) -> None:
    """Refuse a file as OUT, and a non-empty OUT without `force`."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder.")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty; pass --force to replace it, or choose another folder.")


def check_not_source(out: Path, source: Source) -> None:
    """Refuse an OUT that is, or contains, the source (replacing it would delete the source)."""
    resolved, src = out.resolve(), source.path.resolve()
    if resolved == src or resolved in src.parents:
        raise ValueError(f"{out} holds the source checkpoint {source.path}; choose another output folder.")


# Staging folders are named `.OUT.partial-HOST-PID-XXXXXXXX` (PID: the converting process), so a later run can
# tell those of runs that died (kill -9, a crash, a power cut) from those of runs still going.
STAGING_NAME = re.compile(r"\..*\.partial-(?P<host>[\w.-]*)-(?P<pid>\d+)-[a-z0-9_]{8}")


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname())


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(parent: Path) -> None:
    """Delete the staging folders in `parent` whose converting process, on this host, has ended."""
    for path in parent.iterdir():
        match = STAGING_NAME.fullmatch(path.name)
        if match and match["host"] == _host() and path.is_dir() and not _process_alive(int(match["pid"])):
            print(f"removing {path}, left by an interrupted run (process {match['pid']})", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staging_folder(out: Path, force: bool) -> Iterator[Path]:
    """A new folder next to `out`, moved to `out` when the block succeeds and deleted when it fails; staging
    folders of ended runs in the same parent are deleted first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out.parent)
    prefix = f".{out.name}.partial-{_host()}-{os.getpid()}-"
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        check_out(out, force)
        replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_folder(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an existing `out` is set aside first and deleted only once the rename worked."""
    if not out.exists():
        staging.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_tokenizer(out: Path, source: Source, vocab_size: int) -> None:
    """An `EsmTokenizer` with the source folder's vocabulary and settings, checked (fair-esm checkpoints carry no
    tokenizer: ESM-2's). The source's tokenizer files are read, never copied: only `SPECIAL_TOKENS` and
    `model_max_length` are taken from them."""
    folder = source.folder
    if folder is None or not (folder / "vocab.txt").exists():
        write_esm_tokenizer(out)
        return
    vocab = read_vocab(folder / "vocab.txt", vocab_size)
    settings: dict[str, Any] = {}
    for path in (folder / name for name in TOKENIZER_SETTINGS_FILES if (folder / name).exists()):
        data = read_json(path)
        for key in (*SPECIAL_TOKENS, "model_max_length"):
            value = data.get(key)
            if isinstance(value, dict):  # an AddedToken's fields
                value = value.get("content")
            if value is None:
                continue
            special = key in SPECIAL_TOKENS
            if (value not in vocab) if special else (type(value) is not int or value < 1):
                raise ValueError(f"{path}: {key} {value!r} is not {'a token of vocab.txt' if special else 'a count'}.")
            settings[key] = value
    write_esm_tokenizer(out, vocab, **settings)


def read_vocab(path: Path, vocab_size: int) -> list[str]:
    """The tokens of a vocab.txt, one a line, as `EsmTokenizer` reads them; ValueError unless they are distinct
    words without spaces whose ids fit the model's `vocab_size`."""
    tokens = [line.strip() for line in path.read_text().splitlines()]
    bad = [token for token in tokens if not token or len(token.split()) != 1]
    if bad or len(set(tokens)) != len(tokens) or not 0 < len(tokens) <= vocab_size:
        raise ValueError(
            f"{path} is not a vocabulary of this model: {len(tokens)} lines ({len(set(tokens))} distinct, "
            f"{len(bad)} empty or with spaces) for vocab_size {vocab_size}."
        )
    return tokens


def write_esm_tokenizer(folder: Path, vocab: list[str] = ESM_VOCAB, **settings: Any) -> None:
    """vocab.txt (default: the ESM-2 alphabet) and the `EsmTokenizer` files that AutoTokenizer loads; `settings`
    are `EsmTokenizer` arguments (special tokens, `model_max_length`)."""
    from transformers import EsmTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    EsmTokenizer(str(folder / "vocab.txt"), **settings).save_pretrained(folder)


def weights_dtype_name(steps: list[Step]) -> str:
    """The dtype of the weights (the embedding's), as config.json's `dtype` names it."""
    return str(steps[0].outputs[0][1].dtype).removeprefix("torch.")


def count_parameters(steps: list[Step]) -> int:
    return sum(math.prod(info.shape) for step in steps for _, info in step.outputs)


# --------------------------------------------------------------------------------------------------------------
# Verification: both models on real proteins
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProteinCheck:
    """How the converted model's logits on one protein compare with the reference's.

    `perplexity_*` is the plain MLM perplexity on the unmasked protein: exp of the mean cross-entropy of each
    residue's logits against that residue (not pseudo-perplexity; every token is visible).
    """

    name: str
    length: int
    max_abs: float
    mean_abs: float
    argmax_agreement: float
    perplexity_reference: float
    perplexity_converted: float


@dataclass
class VerifyReport:
    """Per-protein comparison of the converted model with the reference, and the verdict."""

    checks: list[ProteinCheck]
    atol: float
    reference: str
    converted: str
    device: str

    @property
    def max_abs(self) -> float:
        return max((check.max_abs for check in self.checks), default=math.nan)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(math.isfinite(c.max_abs) and c.max_abs <= self.atol for c in self.checks)

    def table(self) -> str:
        """A markdown table (prints readably in a terminal and renders in the model card)."""
        lines = [
            "| protein | residues | max abs Δlogit | mean abs Δlogit | argmax agreement "
            "| perplexity (ref) | Δ perplexity |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in self.checks:
            delta = c.perplexity_converted - c.perplexity_reference
            lines.append(
                f"| {c.name} | {c.length} | {c.max_abs:.3g} | {c.mean_abs:.3g} | {100 * c.argmax_agreement:.1f}% "
                f"| {c.perplexity_reference:.4g} | {delta:+.3g} |"
            )
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append("")
        lines.append(
            f"{verdict}: largest max abs Δlogit {self.max_abs:.3g}, tolerance {self.atol:g}. Reference: "
            f"{self.reference}; converted: {self.converted}; device {self.device}. Perplexity is the plain MLM "
            "perplexity of the unmasked protein (not pseudo-perplexity)."
        )
        return "\n".join(lines)


class VerificationFailed(RuntimeError):
    """--verify found logits further apart than the tolerance."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        super().__init__(f"--verify failed: max |Δlogit| {report.max_abs:.3g} > tolerance {report.atol:g}")


def read_fasta(path: Path) -> list[tuple[str, str]]:
    """(first word of the header, sequence) of each record."""
    with open(path) as lines:
        return [(header.split()[0], sequence) for header, sequence in iter_fasta(lines, path)]


def iter_fasta(lines: Iterable[str], path: Path) -> Iterator[tuple[str, str]]:
    """(header, sequence) of each FASTA record of `lines`, read from `path` (named in errors). Records may span
    lines; `;` lines are comments. A sequence line before the first header or an empty record raises ValueError."""
    header, parts = None, []
    for number, line in enumerate(lines, 1):
        if line.startswith(";"):
            continue
        if line.startswith(">"):
            if header is not None:
                yield header, _fasta_sequence(header, parts, path)
            header, parts = line[1:].strip(), []
        elif line.strip():
            if header is None:
                raise ValueError(f"{path}, line {number}: sequence before the first '>' header.")
            parts.append("".join(line.split()))
    if header is not None:
        yield header, _fasta_sequence(header, parts, path)


def _fasta_sequence(header: str, parts: list[str], path: Path) -> str:
    if not parts:
        raise ValueError(f"{path}: FASTA record '>{header}' has an empty sequence.")
    return "".join(parts)


def default_atol(dtype_name: str, uses_te: bool) -> float:
    """The --verify tolerance for converted weights of this dtype (see DEFAULT_VERIFY_ATOL)."""
    if dtype_name == "float32" and uses_te:
        return TE_FP32_VERIFY_ATOL
    return DEFAULT_VERIFY_ATOL.get(dtype_name, DEFAULT_VERIFY_ATOL["float32"])


VERIFY_DEVICES = ("auto", "cpu", "cuda")


def verify_device(name: str) -> str:
    """The device that a `--verify-device` (see `VERIFY_DEVICES`) names; "auto" is the GPU when there is one."""
    if name not in VERIFY_DEVICES:
        raise ValueError(f"verify device {name!r}: expected one of {', '.join(VERIFY_DEVICES)}.")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--verify-device cuda: no CUDA GPU is visible to PyTorch.")
    return name


def verifiable_dtype(name: str) -> torch.dtype:
    """The dtype of converted weights named as config.json names it; ValueError for those --verify does not run."""
    if name not in DTYPES:
        raise ValueError(
            f"verifying runs float32, bfloat16 or float16 weights; these are {name}: convert with --dtype float32."
        )
    return DTYPES[name]


def verify(
    source: Source,
    out: Path,
    direction: Direction,
    atol: float | None = None,
    proteins: Path = PROTEINS_FASTA,
    device: str = "auto",
) -> VerifyReport:
    """Run the source model (float32) and the converted one (its own dtype) on real proteins and compare logits.

    hf-to-te: source with transformers' `EsmForMaskedLM`, OUT with `AutoModelForMaskedLM` + remote code;
    te-to-hf: the reverse, OUT with plain transformers. `device` (see `VERIFY_DEVICES`) "auto" runs on the GPU
    when there is one (Transformer Engine if it is installed), else on the CPU; on the CPU the NVEsm model uses
    the PyTorch backend. The models are loaded one after the other.
    """
    from transformers import EsmTokenizer

    device = verify_device(device)
    if device == "cuda":
        _import_transformer_engine_early()
    if not proteins.exists():
        raise ValueError(f"{proteins} is missing; --verify runs from a checkout of nv-esm, which ships it.")
    out_dtype = read_json(out / "config.json").get("dtype", "float32")
    dtype = verifiable_dtype(out_dtype)
    records = read_fasta(proteins)
    tokenizer = EsmTokenizer.from_pretrained(out)
    inputs = [tokenizer(sequence, return_tensors="pt")["input_ids"] for _, sequence in records]
    load_reference, load_converted = (_load_source_hf, _load_nv) if direction.to_nv else (_load_source_nv, _load_hf)
    reference, reference_name, reference_te = _run(lambda: load_reference(source, device), inputs, device)
    converted, converted_name, converted_te = _run(lambda: load_converted(out, dtype, device), inputs, device)
    uses_te = reference_te or converted_te
    atol = default_atol(out_dtype, uses_te) if atol is None else atol
    checks = [_compare(name, ids[0], a, b) for (name, _), ids, a, b in zip(records, inputs, reference, converted)]
    return VerifyReport(checks, atol, reference_name, converted_name, device)


def _import_transformer_engine_early() -> None:
    """Transformer Engine must be imported before torch loads cuDNN in the process (see tests/test_gpu.py), which
    running the first model may do; importing it first lets the NVEsm model use it. Absent TE is fine."""
    with contextlib.suppress(Exception):
        importlib.import_module("transformer_engine.pytorch")


def _run(load: Callable[[], tuple[Any, str]], inputs: list[torch.Tensor], device: str) -> tuple[list, str, bool]:
    """Load a model, get its float32 CPU logits for each protein, free it. Also: whether it ran Transformer Engine."""
    model, name = load()
    uses_te = getattr(getattr(model, "esm", None), "backend", None) == "te"
    with torch.no_grad():
        logits = [model(input_ids=ids.to(device)).logits[0].float().cpu() for ids in inputs]
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return logits, name, uses_te


def _backend(device: str) -> str:
    return "auto" if device == "cuda" else "torch"


def _load_source_hf(source: Source, device: str) -> tuple[Any, str]:
    from transformers import EsmConfig, EsmForMaskedLM

    if source.kind == "fair-esm":
        model = EsmForMaskedLM(EsmConfig(**{k: v for k, v in source.config.items() if k != "model_type"}))
        state = {}
        for name, key in canonical_keys(source.store.info, source.canonical).items():
            state[name] = source.store.load(key).float()
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.decoder.weight"}:
            raise CheckpointMismatch(set(missing) - {"lm_head.decoder.weight"}, unexpected)
        model.tie_weights()
    else:
        model = EsmForMaskedLM.from_pretrained(source.path, dtype=torch.float32)
    return model.to(device).eval(), f"transformers EsmForMaskedLM float32 ({source.spec})"


def _load_source_nv(source: Source, device: str) -> tuple[Any, str]:
    return _load_nv(source.path, torch.float32, device, label=source.spec)


def _load_nv(folder: Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    from transformers import AutoModelForMaskedLM

    with remote_code_folder(folder) as alias:
        model = AutoModelForMaskedLM.from_pretrained(
            alias, trust_remote_code=True, dtype=dtype, backend=_backend(device)
        )
    name = f"NVEsm AutoModelForMaskedLM {str(dtype).removeprefix('torch.')} backend {model.esm.backend} ({label})"
    return model.to(device).eval(), name


@contextlib.contextmanager
def remote_code_folder(folder: Path) -> Iterator[Path]:
    """`folder` under a new name (a symlink), for loading with `trust_remote_code=True`; afterwards the copy of its
    code that transformers puts in its modules cache (HF_MODULES_CACHE) under that name is deleted, and with it
    the cache folders that loading created, so that verifying leaves nothing behind."""
    from transformers import dynamic_module_utils

    cache = Path(dynamic_module_utils.HF_MODULES_CACHE)
    package = cache / dynamic_module_utils.TRANSFORMERS_DYNAMIC_MODULE_NAME
    created = [path for path in (cache, package) if not path.exists()]
    in_sys_path = str(cache) in sys.path
    name = f"nvesm_verify_{os.getpid()}_{os.urandom(4).hex()}"  # a valid module name, new in the cache
    with tempfile.TemporaryDirectory() as links:
        alias = Path(links) / name
        alias.symlink_to(folder.resolve(), target_is_directory=True)
        try:
            yield alias
        finally:
            shutil.rmtree(package / name, ignore_errors=True)
            for path in reversed(created):  # unless another process has put modules there meanwhile
                with contextlib.suppress(OSError):
                    if {entry.name for entry in path.iterdir()} <= {"__init__.py", "__pycache__"}:
                        shutil.rmtree(path)
            if not in_sys_path and not cache.exists() and str(cache) in sys.path:
                sys.path.remove(str(cache))
            ours = f"{package.name}.{name}"
            for module in [module for module in sys.modules if module == ours or module.startswith(ours + ".")]:
                del sys.modules[module]
            if package in created and not package.exists():
                sys.modules.pop(package.name, None)


def _load_hf(folder: Path, dtype: torch.dtype, device: str) -> tuple[Any, str]:
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(folder, dtype=dtype)  # no remote code: plain transformers
    return model.to(device).eval(), f"transformers {type(model).__name__} {str(dtype).removeprefix('torch.')} (OUT)"


def _compare(name: str, ids: torch.Tensor, reference: torch.Tensor, converted: torch.Tensor) -> ProteinCheck:
    difference = (converted.double() - reference.double()).abs()
    residues = slice(1, -1)  # <cls> ... <eos>
    agreement = (converted[residues].argmax(-1) == reference[residues].argmax(-1)).double().mean().item()
    return ProteinCheck(
        name=name,
        length=len(ids) - 2,
        max_abs=difference.max().item(),
        mean_abs=difference.mean().item(),
        argmax_agreement=agreement,
        perplexity_reference=_perplexity(reference[residues], ids[residues]),
        perplexity_converted=_perplexity(converted[residues], ids[residues]),
    )


def _perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(torch.nn.functional.cross_entropy(logits.double(), targets).item())


# --------------------------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------------------------


def model_card(source: Source, config: NVEsmConfig, steps: list[Step], report: VerifyReport | None, repo: str) -> str:
    """README.md of an NVEsm folder: YAML front matter and a markdown description.

    `steps` are the conversion's (sizes and dtypes); `repo` is where the folder will be loaded from, for examples.
    """
    front = ["---", "license: mit", "library_name: transformers", "pipeline_tag: fill-mask", "tags:"]
    front += [f"  - {tag}" for tag in ("esm", "esm2", "protein-language-model", "biology", "transformer-engine")]
    if source.hub_id:
        front.append(f"base_model: {json.dumps(source.hub_id)}")
    front.append("---")
    sections = [
        _card_intro(source, config, steps),
        _card_usage(repo, config),
        _card_hardware(_nbytes(steps), weights_dtype_name(steps)),
        _card_verification(report),
        "## License\n\nMIT, as ESM-2. The weights are Copyright (c) Meta Platforms, Inc. and affiliates; see LICENSE.",
        f"## Citation\n\n```bibtex\n{ESM2_CITATION}\n```",
    ]
    return "\n".join(front) + "\n\n" + "\n\n".join(sections) + "\n"


def _card_intro(source: Source, config: NVEsmConfig, steps: list[Step]) -> str:
    name = source.hub_id or Path(source.spec).name
    dtype_name = weights_dtype_name(steps)
    origin = f"[{source.hub_id}](https://huggingface.co/{source.hub_id})" if source.hub_id else f"`{name}`"
    source_dtype = str(source.store.info[steps[0].inputs[0]].dtype).removeprefix("torch.")
    values = f"The weights are the source's values in {dtype_name}"
    if source_dtype != dtype_name:
        values = f"The weights are the source's {source_dtype} values rounded to {dtype_name}"
    return f"""# {name} on NVIDIA Transformer Engine (NVEsm)

ESM-2 is Meta AI's protein language model (Lin et al., Science 2023), trained with masked language modelling
on protein sequences from UniRef. This repository holds the weights of {origin} ({source.kind} checkpoint,
{format_bytes(source.nbytes)}) for `NVEsmForMaskedLM`, whose encoder layers are Transformer Engine
`TransformerLayer`s; a pure-PyTorch implementation with the same parameters runs where Transformer Engine is
not installed. {values}; the layout differs only in that query, key and value
are fused into one matrix per layer (rows interleaved per head), and the embedding and decoder rows are padded
with zeros from {config.vocab_size} to {config.padded_vocab_size}.

| layers | hidden size | heads | intermediate size | parameters (with vocabulary padding) | weights |
|---:|---:|---:|---:|---:|---:|
| {config.num_hidden_layers} | {config.hidden_size} | {config.num_attention_heads} | {config.intermediate_size} \
| {count_parameters(steps):,} | {format_bytes(_nbytes(steps))} |

Converted with `convert_checkpoint.py hf-to-te` of nv-esm; `convert_checkpoint.py te-to-hf` gives back a folder
that plain transformers (`EsmForMaskedLM`) loads."""


def _card_usage(repo: str, config: NVEsmConfig) -> str:
    return f"""## Usage

The model code ships with the weights, so loading needs `trust_remote_code=True`. With Transformer Engine
installed and a CUDA GPU the layers run in Transformer Engine (`backend="auto"`, the default); anywhere else
`"auto"` picks the PyTorch implementation (same weights, same results up to float rounding), and
`backend="torch"` forces it, e.g. to run on the CPU of a machine that has a GPU.

```python
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

repo = "{repo}"  # the Hub id, or the local folder
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForMaskedLM.from_pretrained(repo, trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
# without Transformer Engine (e.g. on a CPU):
# model = AutoModelForMaskedLM.from_pretrained(repo, trust_remote_code=True, backend="torch").eval()

batch = tokenizer(["MSKGEELFTGVVPILVELDGDVNGHKFSVSGEG<mask>GDATYGKLTLKFICTTGKLPVPWPTLVTTF"], return_tensors="pt")
with torch.no_grad():
    logits = model(**batch.to(model.device)).logits
```

### Packed sequences (THD)

Proteins can be packed into one row without padding. Pass the packed `input_ids [1, T]` with either
`cu_seq_lens_q` (int32 `[N + 1]` offsets of the proteins) and `max_length_q`, or with `position_ids` restarting
at 0 for every protein; `transformers.DataCollatorWithFlattening` produces both
(`return_flash_attn_kwargs=True` for `cu_seq_lens_*`/`max_length_*`). Outputs come back packed, `[1, T, ...]`.

```python
from transformers import DataCollatorWithFlattening

collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
packed = collator([tokenizer(sequence) for sequence in ["MKTAYIAKQRQISFVKSHFSRQ", "MSKGEELFTGVVPILVELDG"]])
packed.pop("labels")  # the collator copies input_ids as labels; masked-LM labels are your own
packed = {{key: value.to(model.device) if torch.is_tensor(value) else value for key, value in packed.items()}}
with torch.no_grad():
    logits = model(**packed).logits  # [1, total tokens, vocab]
```

With `attn_input_format="thd"` (the default in config.json) the layers always run packed: padded batches
(`input_ids [B, S]` + `attention_mask`) are unpadded inside the model and the outputs scattered back, so no
compute is spent on padding. `attn_input_format="bshd"` runs padded batches as they are.

### FP8

On GPUs with FP8 tensor cores (Hopper, e.g. H100/H200, and newer) Transformer Engine can run the layers' GEMMs
in FP8. Choose the layers with `layer_precision`, one entry per layer (`"fp8"`, or `None` for bf16), and the
scaling with `fp8_recipe` (`"delayed"`, `"current"` or `"block"`):

```python
model = AutoModelForMaskedLM.from_pretrained(
    repo, trust_remote_code=True, dtype=torch.bfloat16,
    layer_precision=["fp8"] * {config.num_hidden_layers}, fp8_recipe="delayed",
)
```

FP8 changes the numerics; check the accuracy of your task before relying on it."""


def _card_hardware(nbytes: int, dtype_name: str) -> str:
    return f"""## Hardware

- Transformer Engine backend: an NVIDIA GPU with CUDA and `transformer-engine[pytorch]>=2.8`; bf16 needs Ampere
  (sm_80) or newer, FP8 Hopper (sm_90) or newer.
- PyTorch backend (`backend="torch"`): any device PyTorch runs on, CPU included.
- Memory: the weights take {format_bytes(nbytes)} in {dtype_name}; activations come on top and grow with the
  number of tokens in a batch."""


def _card_verification(report: VerifyReport | None) -> str:
    if report is None:
        return "## Verification\n\nThe conversion was not verified with `--verify`."
    return (
        "## Verification\n\n`convert_checkpoint.py --verify` ran the source model and this one on real UniProt "
        "proteins and compared the logits:\n\n" + report.table()
    )


# --------------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertOptions:
    """How to convert.

    Attributes:
        revision: Hub revision of the source.
        dtype: "float32", "bfloat16" or "float16" for the written weights; None keeps the source's.
        max_shard_size: Largest safetensors file, in bytes.
        force: Replace a non-empty OUT.
        verify: Compare source and converted models on real proteins before OUT is put in place.
        verify_atol: Tolerance of --verify (None: by dtype, see `default_atol`).
        verify_device: Where --verify runs: "auto" (the GPU when there is one), "cpu" or "cuda".
        progress: Show progress bars (None: only on a terminal).
        hub_repo_id: Where the folder will be uploaded, for the model card's examples.
    """

    revision: str | None = None
    dtype: str | None = None
    max_shard_size: int = field(default_factory=lambda: parse_size(DEFAULT_MAX_SHARD_SIZE))
    force: bool = False
    verify: bool = False
    verify_atol: float | None = None
    verify_device: str = "auto"
    progress: bool | None = None
    hub_repo_id: str | None = None


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    config: NVEsmConfig
    out: Path
    parameters: int
    nbytes: int
    shards: int
    seconds: float
    report: VerifyReport | None

    def summary(self) -> str:
        return (
            f"wrote {self.out}: {self.parameters:,} parameters, {format_bytes(self.nbytes)} in {self.shards} "
            f"shard{'s' if self.shards > 1 else ''}, {self.seconds:.1f} s"
        )


def convert(
    direction: Direction,
    source: str | Path,
    out: Path,
    options: ConvertOptions | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> ConversionResult:
    """Convert `source` into `out` (see the module docstring); `config_overrides` go into the NVEsm config."""
    start = time.perf_counter()
    options = options or ConvertOptions()
    out = Path(out)
    check_out(out, options.force)
    opened = open_source(source, options.revision)
    check_not_source(out, opened)
    config = source_config(opened, direction, config_overrides or {})
    steps = plan_steps(opened, config, direction, DTYPES[options.dtype] if options.dtype else None)
    if options.verify:  # refuse what verifying would refuse before converting
        verifiable_dtype(weights_dtype_name(steps))
        verify_device(options.verify_device)
    with staging_folder(out, options.force) as staging:
        shards = write_weights(staging, steps, opened, config, direction, options.max_shard_size, options.progress)
        write_companions(staging, opened, config, direction, steps)
        report = None
        if options.verify:
            report = verify(opened, staging, direction, options.verify_atol, device=options.verify_device)
        if report is not None and not report.passed:
            raise VerificationFailed(report)
        if direction.to_nv:
            card = model_card(opened, config, steps, report, options.hub_repo_id or str(out))
            (staging / "README.md").write_text(card)
    seconds = time.perf_counter() - start
    return ConversionResult(config, out, count_parameters(steps), _nbytes(steps), shards, seconds, report)


def _nbytes(steps: list[Step]) -> int:
    return sum(step.nbytes for step in steps)


def source_config(source: Source, direction: Direction, overrides: dict[str, Any]) -> NVEsmConfig:
    """The NVEsm config of the conversion; refuses a source of the other direction."""
    if direction.to_nv:
        if source.kind == "nvesm":
            raise ValueError(f"{source.spec} is already an NVEsm checkpoint; convert it back with te-to-hf.")
        return nv_config_from_hf(source.config, **overrides)
    if source.kind != "nvesm":
        raise ValueError(
            f"{source.spec} is not an NVEsm checkpoint ({source.kind}; model_type "
            f"{source.config.get('model_type')!r}); te-to-hf reads folders written by hf-to-te."
        )
    return NVEsmConfig.from_dict({**source.config, **overrides})


def write_companions(out: Path, source: Source, config: NVEsmConfig, direction: Direction, steps: list[Step]) -> None:
    """config.json, tokenizer and LICENSE; for NVEsm also the remote code (the model card comes last)."""
    config_dict = nv_config_dict(config) if direction.to_nv else hf_config_from_nv(config)
    config_dict["dtype"] = weights_dtype_name(steps)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, source, config.vocab_size)
    if direction.to_nv:
        copy_remote_code(out)
    write_license(out, with_code=direction.to_nv)


def copy_remote_code(out: Path) -> None:
    """The two files that `trust_remote_code=True` loads."""
    for name in REMOTE_CODE_FILES:
        shutil.copy2(HERE / name, out / name)


def write_license(out: Path, with_code: bool) -> None:
    """ESM-2's MIT license for the weights, naming this project's remote code when the folder holds it."""
    code = "\nCopyright (c) the nv-esm contributors (configuration_nv_esm.py, modeling_nv_esm.py)."
    (out / "LICENSE").write_text(MIT_LICENSE.format(code_copyright=code if with_code else ""))


def convert_hf_to_nv(
    source: Path | str, out: Path, *, options: ConvertOptions | None = None, **config_overrides: object
) -> NVEsmConfig:
    """Convert a transformers ESM-2 folder, Hub id or fair-esm `.pt` into an NVEsm folder; returns the config."""
    return convert(HF_TO_TE, source, out, options, config_overrides).config


def convert_nv_to_hf(source: Path | str, out: Path, *, options: ConvertOptions | None = None) -> NVEsmConfig:
    """Convert an NVEsm folder back into a transformers ESM-2 folder; returns the NVEsm config."""
    return convert(TE_TO_HF, source, out, options).config


# --------------------------------------------------------------------------------------------------------------
# Checking an existing conversion (`verify SRC OUT`)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class FolderCheck:
    """OUT compared with SRC: config fields and tensors (bit for bit), then the logit table."""

    direction: Direction
    dtype: str
    compared: int
    mismatches: list[str]
    report: VerifyReport

    @property
    def passed(self) -> bool:
        return not self.mismatches and self.report.passed

    @property
    def differences(self) -> str:
        count = len(self.mismatches)
        return f"{count} difference{'s' * (count != 1)}" if count else "all identical"

    def text(self) -> str:
        """What `verify` prints: the tensor check (a line per difference), then the logit table."""
        lines = [
            f"tensors: {self.compared} of SRC mapped through the rules ({self.direction.name}, {self.dtype}) and "
            f"compared with OUT bit for bit: {self.differences}",
            *(f"  DIFFERS {mismatch}" for mismatch in self.mismatches),
        ]
        return "\n".join([*lines, "", self.report.table()])


def verify_folder(
    source_spec: str | Path,
    out: Path,
    revision: str | None = None,
    atol: float | None = None,
    device: str = "auto",
) -> FolderCheck:
    """Check OUT, a folder converted from SRC (either direction, told by what the two are): see `compare_tensors`,
    then the logit table of `verify`."""
    out = Path(out)
    if not out.is_dir():
        raise ValueError(f"{out}: no such folder.")
    source, converted = open_source(source_spec, revision), open_source(out)
    if source.kind != "nvesm" and converted.kind == "nvesm":
        direction = HF_TO_TE
    elif source.kind == "nvesm" and converted.kind == "transformers":
        direction = TE_TO_HF
    else:
        raise ValueError(
            f"verify compares SRC with the folder converted from it (transformers or fair-esm SRC and NVEsm OUT, or "
            f"NVEsm SRC and transformers OUT); {source.spec} is {source.kind} and {out} is {converted.kind}."
        )
    dtype_name = read_json(out / "config.json").get("dtype", "float32")
    verifiable_dtype(dtype_name)
    verify_device(device)
    compared, mismatches = compare_tensors(source, converted, direction)
    return FolderCheck(direction, dtype_name, compared, mismatches, verify(source, out, direction, atol, device=device))


def compare_tensors(source: Source, out: Source, direction: Direction) -> tuple[int, list[str]]:
    """Map each tensor of `source` through `RULES`, cast as the converter casts to the dtype of `out`'s weights, and
    compare it bit for bit with `out`'s, one rule at a time (memory for one rule's tensors). Also compares the
    config fields the two formats share. Returns how many tensors were compared and a line per difference."""
    other_way = TE_TO_HF if direction.to_nv else HF_TO_TE
    out_config = source_config(out, other_way, {})
    overrides = {"padded_vocab_size": out_config.padded_vocab_size} if direction.to_nv else {}
    config = source_config(source, direction, overrides)
    mismatches = [
        f"config.json {name}: {getattr(out_config, name)!r}, from SRC {getattr(config, name)!r}"
        for name in SHARED_CONFIG_FIELDS
        if getattr(out_config, name) != getattr(config, name)
    ]
    stored = canonical_keys(out.store.info, out.canonical)
    embedding = direction.targets(RULES[0])[0]
    dtype = out.store.info[stored[embedding]].dtype if embedding in stored else None
    steps = plan_steps(source, config, direction, dtype)
    expected = {name for step in steps for name, _ in step.outputs}
    mismatches += [f"{name}: missing in OUT" for name in sorted(expected - stored.keys())]
    mismatches += [f"{stored[name]}: in OUT, not made from SRC" for name in sorted(stored.keys() - expected)]
    for step in steps:
        for (name, info), tensor in zip(step.outputs, run_step(step, source, config, direction)):
            if name not in stored:
                continue
            found = out.store.info[stored[name]]
            if found != info:
                mismatches.append(
                    f"{name}: {list(found.shape)} {found.dtype}, from SRC {list(info.shape)} {info.dtype}"
                )
                continue
            differ, largest = count_differences(out.store.load(stored[name]), tensor)
            if differ:
                mismatches.append(
                    f"{name}: {differ} of {tensor.numel()} values differ, largest |difference| {largest:.3g}"
                )
    return len(expected), mismatches


def count_differences(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """How many elements of two tensors of one shape and dtype differ in their bits, and the largest |a - b|."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.reshape(-1), b.reshape(-1)
    differ = a.view(bits) != b.view(bits)
    if not differ.any():
        return 0, 0.0
    return int(differ.sum()), (a[differ].double() - b[differ].double()).abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# Hub upload
# --------------------------------------------------------------------------------------------------------------


def push_to_hub(folder: Path, repo_id: str, private: bool, commit_message: str, dry_run: bool) -> None:
    """Upload `folder` to a Hub model repository (created if needed); `dry_run` only lists what would go."""
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    total = sum(path.stat().st_size for path in files)
    visibility = "private" if private else "default visibility"
    if dry_run:
        print(f"dry run: would upload {len(files)} files ({format_bytes(total)}) to {repo_id} ({visibility}):")
        width = max(len(str(path.relative_to(folder))) for path in files)
        for path in files:
            print(f"  {str(path.relative_to(folder)):<{width}}  {format_bytes(path.stat().st_size):>10}")
        print(f"  commit message: {commit_message}")
        return
    huggingface_hub.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
    commit = huggingface_hub.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    print(f"uploaded {len(files)} files ({format_bytes(total)}) to {getattr(commit, 'commit_url', repo_id)}")


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

EPILOG = f"""examples:
  # a transformers ESM-2 from the Hub -> NVEsm, checked against transformers on real proteins
  python convert_checkpoint.py hf-to-te facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify

  # bf16 weights in 2 GB shards, uploaded to a private Hub repository
  python convert_checkpoint.py hf-to-te facebook/esm2_t36_3B_UR50D ./esm2_3B_te --dtype bfloat16 \\
      --max-shard-size 2GB --push-to-hub my-org/esm2_t36_3B_te --private

  # an original fair-esm checkpoint (esm2_t33_650M_UR50D-contact-regression.pt beside it is read too)
  python convert_checkpoint.py hf-to-te ~/esm/esm2_t33_650M_UR50D.pt ./esm2_650M_te

  # back to a folder plain transformers loads (EsmForMaskedLM), replacing an older one
  python convert_checkpoint.py te-to-hf ./esm2_650M_te ./esm2_650M_hf --verify --force

  # check an existing conversion: every tensor bit for bit through the mapping table, then the logit table (CPU)
  python convert_checkpoint.py verify facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify-device cpu

  # list what would be uploaded; nothing is sent
  python convert_checkpoint.py hf-to-te facebook/esm2_t6_8M_UR50D ./esm2_8M_te --push-to-hub me/esm2_8M_te --dry-run

Hub downloads and uploads use the usual huggingface_hub settings (HF_TOKEN or `hf auth login`, HF_HOME,
HF_HUB_OFFLINE). `verify SRC OUT` takes the direction from what SRC and OUT are; it maps every tensor of SRC
through the table (cast to OUT's dtype, as converting does) and compares it with OUT's bit for bit, naming each
one that differs, then prints the logit table. The logit table (--verify, verify) runs on the GPU when there is
one (--verify-device auto; Transformer Engine if installed), else on the CPU with the PyTorch backend; default
tolerances on max |logit difference| against the float32 source: float32 {DEFAULT_VERIFY_ATOL["float32"]:g} \
({TE_FP32_VERIFY_ATOL:g} when Transformer Engine runs: its GELU is the tanh approximation), bfloat16 \
{DEFAULT_VERIFY_ATOL["bfloat16"]:g}, float16 {DEFAULT_VERIFY_ATOL["float16"]:g}.

Staging folders (.OUT.partial-*) are removed on errors, Ctrl-C and SIGTERM; those of runs killed otherwise are
removed by the next run into the same parent folder.

exit status: 0 done; 1 conversion, verify or upload error (OUT untouched); 2 usage error;
3 --verify over tolerance (table printed, OUT not written) or verify found a difference;
130/143 interrupted by Ctrl-C/SIGTERM (OUT untouched)."""
COMMANDS = {
    "hf-to-te": "transformers/fair-esm -> NVEsm",
    "te-to-hf": "back",
    "verify": "check an existing OUT against SRC",
}
# Options that only conversions take (verify reads, writes nothing).
CONVERT_ONLY = ("dtype", "max_shard_size", "force", "verify", "push_to_hub", "private", "commit_message", "dry_run")


def build_parser() -> argparse.ArgumentParser:
    """The command line (see EPILOG)."""
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command", choices=list(COMMANDS), help="; ".join(f"{name}: {text}" for name, text in COMMANDS.items())
    )
    parser.add_argument("source", metavar="SRC", help="checkpoint folder, Hub id (org/name) or fair-esm .pt file")
    parser.add_argument(
        "out",
        metavar="OUT",
        type=Path,
        help="output folder (absent or empty unless --force); verify: the converted one",
    )
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of SRC")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written weights (default: as SRC)")
    parser.add_argument(
        "--max-shard-size", type=parse_size, metavar="SIZE",
        help=f"largest weights file, e.g. 500MB or 2GiB (default {DEFAULT_MAX_SHARD_SIZE}); more files get an index",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    parser.add_argument("--verify", action="store_true", help="compare both models' logits on assets/proteins.fasta")
    parser.add_argument(
        "--verify-atol", type=float, metavar="ATOL", help="logit tolerance of --verify and verify (default: by dtype)"
    )
    parser.add_argument(
        "--verify-device", choices=VERIFY_DEVICES, help="where --verify and verify run the models (default: auto)"
    )
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload OUT to this Hub model repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository private")
    parser.add_argument("--commit-message", help="commit message of the upload")
    parser.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list the files, upload nothing")
    return parser


class Interrupted(KeyboardInterrupt):
    """A signal asked the process to stop; raised like Ctrl-C's KeyboardInterrupt so that staging is cleaned up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises `Interrupted`, as Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {flag for flag, value in vars(args).items() if value not in (None, False)}
    if args.command == "verify":
        for flag in sorted(given & set(CONVERT_ONLY)):
            parser.error(f"--{flag.replace('_', '-')} does not apply to verify (it writes nothing)")
    for flag, needed in (("private", "push_to_hub"), ("commit_message", "push_to_hub"), ("dry_run", "push_to_hub"),
                         ("verify_atol", "verify"), ("verify_device", "verify")):  # fmt: skip
        if flag in given and needed not in given and args.command != "verify":
            parser.error(f"--{flag.replace('_', '-')} needs --{needed.replace('_', '-')}")
    try:
        with sigterm_as_interrupt():
            if args.command == "verify":
                return _main_verify(args)
            options = ConvertOptions(
                revision=args.revision,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size or parse_size(DEFAULT_MAX_SHARD_SIZE),
                force=args.force,
                verify=args.verify,
                verify_atol=args.verify_atol,
                verify_device=args.verify_device or "auto",
                hub_repo_id=args.push_to_hub,
            )
            result = convert(DIRECTIONS[args.command], args.source, args.out, options)
    except VerificationFailed as failure:
        print(failure.report.table(), file=sys.stderr)
        print(f"error: {failure}; {args.out} was not written.", file=sys.stderr)
        return 3
    except (ValueError, OSError, SafetensorError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        signum = interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT
        untouched = "" if args.command == "verify" else f"; {args.out} was not written"
        print(f"error: interrupted ({signal.Signals(signum).name}){untouched}.", file=sys.stderr)
        return 128 + signum
    if result.report is not None:
        print(result.report.table())
    print(result.summary())
    if args.push_to_hub:
        message = args.commit_message or f"Upload {args.out.name} ({args.command} of {args.source})"
        try:
            push_to_hub(args.out, args.push_to_hub, args.private, message, args.dry_run)
        except Exception as error:
            print(f"error: upload to {args.push_to_hub} failed ({args.out} is complete): {error}", file=sys.stderr)
            return 1
    return 0


def _main_verify(args: argparse.Namespace) -> int:
    check = verify_folder(args.source, args.out, args.revision, args.verify_atol, args.verify_device or "auto")
    print(check.text())
    if check.passed:
        return 0
    verdict = "PASSED" if check.report.passed else "FAILED"
    print(f"error: verify failed: tensors {check.differences}; logit table {verdict}.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
