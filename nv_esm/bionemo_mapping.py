"""NVIDIA's BioNeMo ESM-2 layout (`nvidia/esm2_t*_UR50D`, written by bionemo-recipes' `models/esm2`) <-> NVEsm: the
tensor names, the vocabulary rows and the config, for `nv-esm convert bionemo-to-te` and `te-to-bionemo`.

Their layout, as bionemo-recipes' `models/esm2/convert.py` (`mapping`, `_pack_qkv_weight`, `_pad_weights`,
`_pad_bias`), `modeling_esm_te.py` (`NVEsmConfig`, `NVEsmForMaskedLM`, `state_dict`) and `export.py` write it:

- the base model under `model.` (`esm.` before their vLLM change of March 2026, read too); the same Transformer
  Engine module names as ours below it (`encoder.layers.N.self_attention.layernorm_qkv.weight`,
  `layernorm_mlp.fc1_weight`, ...), and the MLM head's LayerNorm inside `lm_head.decoder` as ours;
- query, key and value fused with rows `[h0: q, k, v | h1: ...]` (`qkv_weight_interleaved` true), our own order
  (`state_dict_mapping.fuse_qkv`), so those tensors are copied; with `qkv_weight_interleaved` false the rows are
  `[q | k | v]`, which is read and re-ordered;
- the embedding, the decoder weight and its bias with `padded_vocab_size` rows (64 by default; `export.py` writes the
  vocabulary size, 33, since March 2026): zeros past the vocabulary, the bias there the dtype's lowest value. Ours
  has `NVEsmConfig.padded_vocab_size` rows, zeros past the vocabulary: the rows past it are never read by either
  model (the logits are cut to `vocab_size`), so both directions cut them off and pad afresh;
- no contact head and no rotary `inv_freq` (their `state_dict` drops it; converting in, it is computed as
  transformers computes it) and no pooler; TE's `_extra_state` is not a weight. The decoder weight is tied to the
  embedding and not saved, as ours;
- config.json: model_type "nv_esm" (ours too: told apart by `BIONEMO_MARKER_FIELDS` and the `model.` prefix),
  transformers' `EsmConfig` fields and theirs (`BIONEMO_FIELDS`), `auto_map` naming `esm_nv.py` (their model
  code, which their export copies beside the weights; `te-to-bionemo` writes the config, not their code).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from configuration_nv_esm import BIONEMO_CONFIG_FIELDS, BIONEMO_MARKER_FIELDS, NVEsmConfig, check_bionemo_field
from nv_esm.alphabet import ESM_VOCAB
from nv_esm.hub_folder import esm_tokens_out_of_place
from nv_esm.state_dict_mapping import CONTACT_HEAD, HEADS, SHARED_CONFIG_FIELDS, nv_config_from_hf

# The fields bionemo-recipes' `NVEsmConfig` adds to transformers' `EsmConfig`, with its defaults: those NVEsm has
# fields of its own for, and the rest (`BIONEMO_CONFIG_FIELDS`, which says what each means to NVEsm).
BIONEMO_FIELDS: dict[str, Any] = {
    "attn_input_format": "bshd",
    "padded_vocab_size": 64,
    "layer_precision": None,
    **{name: field.default for name, field in BIONEMO_CONFIG_FIELDS.items()},
}
# Fields of theirs that choose how their model runs, not what its weights compute: dropped converting in (our
# load-time options, e.g. `layer_precision` and `attn_input_format`, are `from_pretrained` keywords and the commands'
# --fp8), written with their defaults converting out. `add_pooling_layer`: their masked LM never has a pooler;
# `attn_mask_type` "no_mask" (their context-parallel runs of unpadded batches; a causal mask is refused): NVEsm
# always masks padding, which an unpadded batch has none of.
RUN_OPTIONS = (
    "attn_mask_type",
    "attn_input_format",
    "micro_batch_size",
    "max_seq_length",
    "layer_precision",
    "use_quantized_model_init",
    "add_pooling_layer",
)
# transformers' `EsmConfig` fields that their published config.json files carry besides the shared ones.
ESM_CONFIG_EXTRAS: dict[str, Any] = {
    "classifier_dropout": None,
    "esmfold_config": None,
    "hidden_act": "gelu",
    "is_folding_model": False,
    "use_cache": True,
    "vocab_list": None,
}
# Their classes (the `architectures` of a folder) by our head; their code has no sequence classifier.
BIONEMO_CLASSES = {"masked_lm": "NVEsmForMaskedLM", "token_classification": "NVEsmForTokenClassification"}
# The `auto_map` their export writes: their model code, copied beside the weights as `esm_nv.py`.
BIONEMO_AUTO_MAP = {
    "AutoConfig": "esm_nv.NVEsmConfig",
    "AutoModel": "esm_nv.NVEsmModel",
    "AutoModelForMaskedLM": "esm_nv.NVEsmForMaskedLM",
    "AutoModelForTokenClassification": "esm_nv.NVEsmForTokenClassification",
}
BASE_PREFIX = "model."  # their base model's prefix (`base_model_prefix`)
ROTARY_BASE = 10000.0  # their RotaryPositionEmbedding's, whatever config.json says


# --------------------------------------------------------------------------------------------------------------
# Telling their layout from ours
# --------------------------------------------------------------------------------------------------------------


def bionemo_markers(fields: Mapping[str, Any]) -> list[str]:
    """The fields of a config.json (`fields`) that only NVIDIA's BioNeMo ESM-2 config has, and an `auto_map` naming
    their `esm_nv.py`."""
    found = [name for name in BIONEMO_MARKER_FIELDS if name in fields]
    auto_map = fields.get("auto_map")
    if isinstance(auto_map, dict) and any(str(value).startswith("esm_nv.") for value in auto_map.values()):
        found.append("auto_map")
    return found


def has_bionemo_names(names: Iterable[str]) -> bool:
    """Whether tensor names hold their base model under `model.` (ours is under `esm.`)."""
    return any(name.startswith((BASE_PREFIX + "embeddings.", BASE_PREFIX + "encoder.")) for name in names)


def is_bionemo(fields: Mapping[str, Any], names: Iterable[str] = ()) -> bool:
    """Whether a checkpoint of model_type "nv_esm" is NVIDIA's BioNeMo layout: by its config.json's fields or its
    tensor names."""
    return bool(bionemo_markers(fields)) or has_bionemo_names(names)


def bionemo_refusal(checkpoint: str | Path, why: str) -> str:
    """The one-line refusal of an unconverted BioNeMo checkpoint given to a command, with the conversion."""
    return (
        f"{checkpoint} is NVIDIA's BioNeMo ESM-2 layout ({why}), not nv-esm's; convert it first: "
        f"nv-esm convert bionemo-to-te {checkpoint} OUT"
    )


def config_refusal(checkpoint: str | Path, fields: Mapping[str, Any]) -> str | None:
    """`bionemo_refusal` for a config.json whose fields are theirs, else None."""
    markers = bionemo_markers(fields)
    return bionemo_refusal(checkpoint, f"its config.json has {', '.join(markers)}") if markers else None


# --------------------------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------------------------


def bionemo_name(nv_name: str) -> str | None:
    """Their name of an NVEsm tensor; None for the tensors their layout lacks (contact head, rotary inv_freq)."""
    if nv_name.startswith(CONTACT_HEAD) or nv_name.endswith(".inv_freq"):
        return None
    return BASE_PREFIX + nv_name.removeprefix("esm.") if nv_name.startswith("esm.") else nv_name


def canonical_bionemo_name(key: str) -> str | None:
    """The current name of a tensor of their checkpoint (`esm.` before March 2026 -> `model.`); None for what is not
    a weight: TE's `_extra_state`, a rotary `inv_freq` (computed, not read)."""
    if key.endswith(("._extra_state", ".inv_freq")):
        return None
    return BASE_PREFIX + key.removeprefix("esm.") if key.startswith("esm.") else key


# --------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------


def bionemo_padded_vocab_size(fields: Mapping[str, Any]) -> int:
    """Rows of their embedding and decoder: `padded_vocab_size` (64 when absent, the vocabulary size when null)."""
    padded = fields.get("padded_vocab_size", BIONEMO_FIELDS["padded_vocab_size"])
    return padded if padded is not None else fields.get("vocab_size", len(ESM_VOCAB))


def bionemo_vocab_rows(config: NVEsmConfig, padded_vocab_size: int | None = None) -> int:
    """Rows of their embedding and decoder for a model of NVEsm config `config`: `padded_vocab_size` (their
    config.json's: a source's, or an existing output's that is checked) or, None, the NVEsm config's."""
    return padded_vocab_size or config.padded_vocab_size


def check_bionemo_config(fields: Mapping[str, Any]) -> None:
    """Refuse (ValueError, one line naming the field) what their config.json may say that the converted folder
    cannot honour: what NVEsm refuses of their fields (`check_bionemo_field`: another activation than gelu, unfused
    query/key/value parameters, a causal attention mask, ...) but the query/key/value order, which converting
    re-orders; another rotary base than their model's; a `padded_vocab_size` below the vocabulary."""
    for name in ("encoder_activation", "fuse_qkv_params", "attn_mask_type"):
        check_bionemo_field(name, fields.get(name, BIONEMO_FIELDS[name]))
    interleaved = fields.get("qkv_weight_interleaved", True)
    if type(interleaved) is not bool:
        raise ValueError(f"qkv_weight_interleaved {interleaved!r} is refused: it is true or false.")
    rope_theta = fields.get("rope_theta", ROTARY_BASE)
    if rope_theta != ROTARY_BASE:
        raise ValueError(f"rope_theta {rope_theta!r} is refused: their model's rotary base is always {ROTARY_BASE:g}.")
    padded, vocab_size = bionemo_padded_vocab_size(fields), fields.get("vocab_size", len(ESM_VOCAB))
    if type(padded) is not int or type(vocab_size) is not int or padded < vocab_size:
        raise ValueError(f"padded_vocab_size {padded!r} is refused: it is a row count of at least vocab_size.")


def nv_config_from_bionemo(fields: Mapping[str, Any], head: str = "masked_lm", **overrides: object) -> NVEsmConfig:
    """The NVEsmConfig of their config.json (`fields`), checked (`check_bionemo_config`); their run options
    (`RUN_OPTIONS`) dropped. The padded vocabulary size is theirs where ours can hold it (a multiple of 16), else
    NVEsm's default."""
    check_bionemo_config(fields)
    esm_fields = {name: value for name, value in fields.items() if name not in BIONEMO_FIELDS}
    padded = bionemo_padded_vocab_size(fields)
    ours = {"padded_vocab_size": padded} if padded % 16 == 0 else {}
    return nv_config_from_hf({**esm_fields, "model_type": "esm"}, head, **{**ours, **overrides})


def dropped_run_options(fields: Mapping[str, Any]) -> list[str]:
    """Their run options (`RUN_OPTIONS`) that their config.json sets to other values than their defaults, as
    `name=value`: what converting in leaves out."""
    return [
        f"{name}={fields[name]!r}" for name in RUN_OPTIONS if name in fields and fields[name] != BIONEMO_FIELDS[name]
    ]


def bionemo_config_dict(config: NVEsmConfig, head: str = "masked_lm", padded_vocab_size: int | None = None) -> dict:
    """Their config.json for an NVEsm config: transformers' `EsmConfig` fields, theirs at their defaults
    (`padded_vocab_size`: `bionemo_vocab_rows`), model_type "nv_esm", their class of `head` in
    `architectures` and their `auto_map`. ValueError for what their model cannot run: a sequence classifier (they
    have no such class), another rotary base than theirs."""
    if head not in BIONEMO_CLASSES:
        raise ValueError(
            f"their code has no {head.replace('_', ' ')} class ({', '.join(BIONEMO_CLASSES.values())} only); a "
            f"{HEADS[head].nv_class} checkpoint does not convert to their layout."
        )
    if config.rope_theta != ROTARY_BASE:
        raise ValueError(f"rope_theta {config.rope_theta!r}: their model's rotary base is always {ROTARY_BASE:g}.")
    fields = {name: getattr(config, name) for name in SHARED_CONFIG_FIELDS if name != "rope_theta"}
    if head != "masked_lm":
        fields["id2label"] = {str(i): label for i, label in config.id2label.items()}
        fields["label2id"] = config.label2id
        fields.update({"problem_type": config.problem_type} if config.problem_type else {})
    return {
        "architectures": [BIONEMO_CLASSES[head]],
        "auto_map": BIONEMO_AUTO_MAP,
        "model_type": NVEsmConfig.model_type,
        **ESM_CONFIG_EXTRAS,
        **BIONEMO_FIELDS,
        **fields,
        "padded_vocab_size": bionemo_vocab_rows(config, padded_vocab_size),
    }


# --------------------------------------------------------------------------------------------------------------
# Their tokenizer
# --------------------------------------------------------------------------------------------------------------


def check_fast_tokenizer(path: Path, vocab_size: int) -> None:
    """Refuse their `tokenizer.json` (a folder without vocab.txt: their export saves only the fast tokenizer) unless
    its vocabulary gives ESM-2's tokens ESM-2's ids (`esm_tokens_out_of_place`, as for a vocab.txt) and no token an
    id past `vocab_size` or another token's: the converted folder gets ESM-2's vocabulary."""
    try:
        model = json.loads(path.read_text(encoding="utf-8")).get("model") or {}
    except (ValueError, UnicodeDecodeError, AttributeError) as error:
        raise ValueError(f"{path} is not a tokenizer file: {error}.") from None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if not isinstance(vocab, dict):
        raise ValueError(f"{path} holds no token -> id vocabulary (a WordLevel model); it is not ESM-2's tokenizer.")
    moved = esm_tokens_out_of_place(vocab)
    beyond = [token for token, index in vocab.items() if type(index) is not int or not 0 <= index < vocab_size]
    if moved or beyond or len(set(vocab.values())) != len(vocab):
        first = moved[0] if moved else beyond[0] if beyond else "an id given twice"
        raise ValueError(
            f"{path} is not ESM-2's vocabulary ({first!r} out of place); its ids would not match the weights."
        )
