"""Checks that the parts of an NVEsm checkpoint agree before its weights run: config.json's special-token ids,
vocab.txt and the tokenizer files against ESM-2's alphabet (`check_checkpoint_tokens`), the stored tensors' names
and shapes against the config (`check_tensor_names`), and the weights' values (`check_finite`).

A checkpoint whose parts disagree still loads and runs (transformers only logs unexpected tensors, the model reads
`<mask>` at whatever id config.json names, NaN weights give NaN outputs), so its numbers would silently be other
ones; each check refuses it instead with a one-line ValueError naming the file or tensor. `nv-esm embed`, `score`
and `proteingym` run them through `nv_esm.embed_model.load_config` / `load_model`; the trainer's checkpoint reader
(`nv_esm.train.materialize.CheckpointReader`, which loads no model through transformers) checks the tokens as it opens
a folder and the values of the rows it reads (names and shapes against its parallelized model: its own
`check_checkpoint_shapes`); the converter checks its source's ids
(`check_special_token_ids`) and values (`check_finite`, as it reads them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from configuration_nv_esm import NVEsmConfig
from nv_esm.alphabet import CLS, EOS, ESM_VOCAB, MASK, PAD
from nv_esm.bionemo_mapping import bionemo_refusal, config_refusal, has_bionemo_names
from nv_esm.checkpoint_io import SafetensorsStore, weight_files
from nv_esm.hub_folder import check_vocabulary
from nv_esm.state_dict_mapping import canonical_nv_name, head_of, nv_shape, rules_for

# config.json's special-token fields and the ESM-2 token each must name (bos_token_id may be None: transformers'
# ESM configs write None, `<cls>` not being a generation start token).
SPECIAL_TOKEN_IDS = {"mask_token_id": MASK, "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": CLS}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_model_type(fields: Mapping[str, Any], checkpoint: str | Path) -> None:
    """Refuse a config.json (`fields`, of the folder or Hub id `checkpoint`) that is not NVEsm's: the commands load
    NVEsm checkpoints only, and say how to convert another ESM-2 one. No `model_type` is taken as NVEsm's; NVIDIA's
    BioNeMo config (model_type "nv_esm" too) is told by its own fields (`bionemo_mapping.config_refusal`)."""
    refusal = config_refusal(checkpoint, fields)
    if refusal is not None:
        raise ValueError(refusal)
    model_type = fields.get("model_type", NVEsmConfig.model_type)
    if model_type != NVEsmConfig.model_type:
        raise ValueError(
            f"{checkpoint} is not an NVEsm checkpoint (its config.json says model_type {model_type!r}); convert it "
            f"first: nv-esm convert hf-to-te {checkpoint} OUT"
        )


def check_checkpoint_tokens(checkpoint: str | Path, config: NVEsmConfig) -> None:
    """Refuse a checkpoint (a folder or a Hub id) whose config.json names other special-token ids than ESM-2's
    (`check_special_token_ids`) or whose vocab.txt and tokenizer files are not ESM-2's (`check_vocabulary`): the
    commands tokenize with ESM-2's ids, and the model reads `<mask>` (token dropout) and `<pad>` at config.json's."""
    fields = {name: getattr(config, name, None) for name in SPECIAL_TOKEN_IDS}
    check_special_token_ids(fields, Path(checkpoint) / "config.json")
    check_vocabulary(checkpoint, config.vocab_size)


def check_special_token_ids(fields: Mapping[str, Any], where: str | Path) -> None:
    """Refuse special-token ids (config fields `fields`: a config.json's or a config's; an absent or None one is not
    checked) other than ESM-2's (`SPECIAL_TOKEN_IDS`): ValueError naming `where`, the field, the token its id is in
    ESM-2's vocabulary and the one it should be."""
    for name, expected in SPECIAL_TOKEN_IDS.items():
        value = fields.get(name)
        if value is None or (value == expected and type(value) is int):
            continue
        is_id = type(value) is int and 0 <= value < len(ESM_VOCAB)
        names = f" ({ESM_VOCAB[value]!r} in ESM-2's vocabulary)" if is_id else ""
        raise ValueError(
            f"{where}: {name} is {value!r}{names}, but ESM-2's {ESM_VOCAB[expected]} is {expected}; the model would "
            f"take another token for {ESM_VOCAB[expected]}."
        )


def check_tensor_names(folder: Path, config: NVEsmConfig) -> SafetensorsStore:
    """The tensors of a checkpoint folder, after checking that each is one a model of `config` has, in its shape
    (the converter's table: `nv_esm.state_dict_mapping.rules_for`, with the checkpoint's head): ValueError in one
    line naming the first tensors that no layer or head of the config holds (a layer 7 in a 6-layer config, which
    transformers would drop with a log line) or that have another shape (an embedding of other rows than
    `padded_vocab_size`, which transformers reports in a table and a traceback). Missing tensors are the loaders'
    to judge (`nv_esm.embed_model.check_loaded_weights`; the trainer starts them fresh and says so). A base model
    saved on its own (`NVEsmModel.save_pretrained`: no `esm.` prefix, a pooler) is read as the prefixed one; NVIDIA's
    BioNeMo layout (its base model under `model.`) is refused with its conversion."""
    store = SafetensorsStore(weight_files(folder))
    if has_bionemo_names(store.info):
        raise ValueError(bionemo_refusal(folder, "its tensors are under model."))
    stored = {key: key for key in store.info if canonical_nv_name(key) is not None}
    if stored and not any(key.startswith("esm.") for key in stored):
        stored = {f"esm.{key}": key for key in stored}
    rules = rules_for(config, head_of(stored))
    expected = {rule.nv: nv_shape(rule, config) for rule in rules}
    hidden = config.hidden_size
    expected |= {"esm.pooler.dense.weight": (hidden, hidden), "esm.pooler.dense.bias": (hidden,)}
    unexpected = sorted(stored[name] for name in stored.keys() - expected.keys())
    if unexpected:
        raise ValueError(
            f"{folder} holds {len(unexpected)} tensors that a model of its config.json ({_shape_fields(config)}) has "
            f"no place for ({_listed(unexpected)}): its weights and its config disagree; convert it again."
        )
    mismatched = [
        f"{stored[name]} {list(store.info[stored[name]].shape)}, expected {list(expected[name])}"
        for name in sorted(stored)
        if store.info[stored[name]].shape != expected[name]
    ]
    if mismatched:
        raise ValueError(
            f"{folder} holds {len(mismatched)} tensors of other shapes than its config.json ({_shape_fields(config)}) "
            f"gives ({_listed(mismatched)}): its weights and its config disagree; convert it again."
        )
    return store


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], where: str | Path) -> None:
    """Refuse NaN or Inf in the floating-point tensors of `tensors` (name, tensor): ValueError naming `where` and
    the first such tensor, which would make the outputs NaN. One pass at memory speed: each tensor's sum (NaN or
    Inf if any value is; of finite values only if they are near the dtype's largest), whose non-finite ones are
    confirmed value by value (`torch.isfinite`); the sums of tensors on a GPU are read back with one wait.
    About 0.1 s for ESM-2 650M's weights on two CPU cores, milliseconds on a GPU."""
    named: list[tuple[str, torch.Tensor]] = []
    sums: list[torch.Tensor] = []
    for name, tensor in tensors:
        data = tensor.detach()
        if data.dtype not in FLOAT_DTYPES or type(data) is not torch.Tensor:  # not TE's FP8 tensors
            continue
        total = data.sum()
        if data.device.type == "cpu":  # confirmed now: a reader's tensors are not kept
            if not torch.isfinite(total) and not torch.isfinite(data).all():
                _refuse_non_finite(name, where)
            continue
        named.append((name, data))
        sums.append(total.float())
    if not sums:
        return
    finite = torch.isfinite(torch.stack([total.to(sums[0].device) for total in sums])).cpu()
    for index in (~finite).nonzero().flatten().tolist():
        name, data = named[index]
        if not torch.isfinite(data).all():
            _refuse_non_finite(name, where)


def _refuse_non_finite(name: str, where: str | Path) -> None:
    raise ValueError(
        f"{where}: {name} holds NaN or Inf values, which would make the outputs NaN; the weights are damaged: convert "
        "or download them again."
    )


def _shape_fields(config: NVEsmConfig) -> str:
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "padded_vocab_size")
    return ", ".join(f"{name} {getattr(config, name)}" for name in fields)


def _listed(items: list[str]) -> str:
    return f"{', '.join(items[:3])}{', ...' if len(items) > 3 else ''}"
