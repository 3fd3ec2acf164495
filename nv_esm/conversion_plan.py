"""The conversion's inputs and plan: the checkpoint to convert (`Source`: a folder, a Hub id or a fair-esm `.pt`) and
one `Step` per rule of `nv_esm.state_dict_mapping.RULES` (and the head's rules) that applies to it.

A `Direction` says which side of each rule is read and which is written; `BionemoDirection` reads or writes NVIDIA's
BioNeMo layout in place of transformers' (`nv_esm.bionemo_mapping`: their names of our tensors, their vocabulary
rows). `plan_steps` checks every stored name and shape against the table before anything is written; `run_step`
reads one rule's tensors, maps and casts them, so `write_weights` streams a checkpoint with memory for its largest
layer, not for the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path

import torch

from configuration_nv_esm import NVEsmConfig
from nv_esm.bionemo_mapping import (
    bionemo_name,
    bionemo_padded_vocab_size,
    canonical_bionemo_name,
    check_fast_tokenizer,
    is_bionemo,
)
from nv_esm.checkpoint_checks import check_finite
from nv_esm.checkpoint_io import (
    SafetensorsStore,
    StateDictStore,
    TensorInfo,
    read_fair_esm,
    read_json,
    weight_files,
    write_shards,
)
from nv_esm.hub_folder import hub_id_of, resolve_source
from nv_esm.state_dict_mapping import (
    ConfigMismatch,
    Rule,
    apply_rule_hf_to_nv,
    apply_rule_nv_to_hf,
    canonical_fair_esm_name,
    canonical_hf_name,
    canonical_nv_name,
    check_keys,
    fuse_qkv,
    head_of,
    hf_config_from_fair_esm,
    hf_shape,
    nv_shape,
    pad_vocab,
    rules_for,
)

# --------------------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Source:
    """A checkpoint to convert.

    Attributes:
        spec: What was asked for: a folder, a Hub id or a `.pt` file.
        path: The local folder (downloaded for a Hub id) or `.pt` file.
        kind: "transformers" (an ESM-2 model class), "nvesm", "bionemo" (NVIDIA's BioNeMo layout) or "fair-esm".
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
        names = {
            "transformers": canonical_hf_name,
            "fair-esm": canonical_fair_esm_name,
            "bionemo": canonical_bionemo_name,
        }
        return names.get(self.kind, canonical_nv_name)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.store.info.values())

    @cached_property
    def head(self) -> str:
        """Its task head (a key of `HEADS`: masked LM, token or sequence classification), told by its tensors."""
        return head_of(canonical_keys(self.store.info, self.canonical))


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
    store = SafetensorsStore(weight_files(folder))
    if kind == "nvesm" and is_bionemo(config, store.info):  # their model_type is ours: told by fields and names
        kind = "bionemo"
        if not (folder / "vocab.txt").exists() and (folder / "tokenizer.json").exists():
            check_fast_tokenizer(folder / "tokenizer.json", config.get("vocab_size", 33))
    return Source(spec, folder, kind, config, store, hub_id or hub_id_of(folder))


def open_fair_esm(path: Path) -> Source:
    """An original fair-esm ESM-2 checkpoint (`{"model": state dict, "cfg": {"model": args}}`)."""
    state, model_args = read_fair_esm(path)
    return Source(str(path), path, "fair-esm", hf_config_from_fair_esm(model_args), StateDictStore(state))


# --------------------------------------------------------------------------------------------------------------
# The conversion plan: one step per rule, built on the same table
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Direction:
    """Which side of each `Rule` is read and which is written; `reads`: the kinds of `Source` it converts, `writes`:
    the kind it makes."""

    name: str
    to_nv: bool
    reads: tuple[str, ...]
    writes: str

    def for_source(self, config: dict) -> Direction:
        """This direction set for a source of config.json `config` (BioNeMo's: its padding and QKV order)."""
        return self

    def rules(self, config: NVEsmConfig, head: str) -> list[Rule]:
        """The rules that apply to a model of `config` with `head`."""
        return rules_for(config, head)

    def read(self, rule: Rule, tensors: list[torch.Tensor], config: NVEsmConfig) -> list[torch.Tensor]:
        """The part of the stored tensors that the conversion keeps (BioNeMo's vocabulary rows, not their padding)."""
        return tensors

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


@dataclass(frozen=True)
class BionemoDirection(Direction):
    """NVIDIA's BioNeMo layout in place of transformers': their name of each NVEsm tensor (`bionemo_name`), copied,
    except their vocabulary rows (`padded_vocab_size` of them: the source's converting in, None = the NVEsm
    config's converting out), cut to the vocabulary and padded afresh as each side pads (ours with zeros; theirs as
    their convert.py: zeros, the decoder bias the dtype's lowest value), and the QKV rows of a source with
    `qkv_interleaved` false, re-ordered. Their layout lacks the contact head and the rotary inv_freq: converting
    in, inv_freq is computed (as transformers computes it) and no contact head is written; converting out, both
    are left behind."""

    qkv_interleaved: bool = True
    padded_vocab_size: int | None = None

    def for_source(self, config: dict) -> Direction:
        if not self.to_nv:
            return self
        interleaved = config.get("qkv_weight_interleaved", True)
        return replace(self, qkv_interleaved=interleaved, padded_vocab_size=bionemo_padded_vocab_size(config))

    def rules(self, config: NVEsmConfig, head: str) -> list[Rule]:
        theirs = [rule for rule in rules_for(config, head) if bionemo_name(rule.nv) is not None]
        absent = [rule for rule in rules_for(config, head) if bionemo_name(rule.nv) is None]
        if self.to_nv:  # the rotary frequencies made from the config; no contact head
            return [*theirs, *(rule for rule in absent if rule.kind == "buffer")]
        return [*theirs, *(replace(rule, optional=True) for rule in absent)]  # read by nothing, dropped

    def sources(self, rule: Rule) -> tuple[str, ...]:
        theirs = bionemo_name(rule.nv)
        return (rule.nv,) if not self.to_nv else () if theirs is None else (theirs,)

    def targets(self, rule: Rule) -> tuple[str, ...]:
        theirs = bionemo_name(rule.nv)
        return (rule.nv,) if self.to_nv else () if theirs is None else (theirs,)

    def their_shape(self, rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
        shape = nv_shape(rule, config)
        return (self.padded_vocab_size or config.padded_vocab_size, *shape[1:]) if rule.kind == "vocab" else shape

    def source_shape(self, rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
        return self.their_shape(rule, config) if self.to_nv else nv_shape(rule, config)

    def target_shape(self, rule: Rule, config: NVEsmConfig) -> tuple[int, ...]:
        return nv_shape(rule, config) if self.to_nv else self.their_shape(rule, config)

    def read(self, rule: Rule, tensors: list[torch.Tensor], config: NVEsmConfig) -> list[torch.Tensor]:
        return [tensors[0][: config.vocab_size]] if rule.kind == "vocab" else tensors

    def transform(self, rule: Rule, tensors: list[torch.Tensor], config: NVEsmConfig) -> list[torch.Tensor]:
        if not tensors:  # inv_freq, which their layout lacks
            from modeling_nv_esm import NVEsmRotaryEmbedding  # its one formula (= transformers')

            return [NVEsmRotaryEmbedding.default_inv_freq(config)]
        tensor = tensors[0]
        if rule.kind == "qkv" and self.to_nv and not self.qkv_interleaved:  # rows [q | k | v]
            return [fuse_qkv(*tensor.chunk(3), config.num_attention_heads)]
        if rule.kind != "vocab":
            return [tensor]
        if self.to_nv:
            return [pad_vocab(tensor, config.padded_vocab_size)]
        rows = self.padded_vocab_size or config.padded_vocab_size
        fill = torch.finfo(tensor.dtype).min if tensor.dim() == 1 else 0.0  # their _pad_bias / _pad_weights
        padding = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), fill)
        return [torch.cat([tensor, padding]).contiguous()]


HF_TO_TE = Direction("hf-to-te", to_nv=True, reads=("transformers", "fair-esm"), writes="nvesm")
TE_TO_HF = Direction("te-to-hf", to_nv=False, reads=("nvesm",), writes="transformers")
BIONEMO_TO_TE = BionemoDirection("bionemo-to-te", to_nv=True, reads=("bionemo",), writes="nvesm")
TE_TO_BIONEMO = BionemoDirection("te-to-bionemo", to_nv=False, reads=("nvesm",), writes="bionemo")
DIRECTIONS = {direction.name: direction for direction in (HF_TO_TE, TE_TO_HF, BIONEMO_TO_TE, TE_TO_BIONEMO)}
INVERSE = {"hf-to-te": TE_TO_HF, "te-to-hf": HF_TO_TE, "bionemo-to-te": TE_TO_BIONEMO, "te-to-bionemo": BIONEMO_TO_TE}


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
    rules = direction.rules(config, source.head)
    check_keys(stored, [direction.sources(rule) for rule in rules], rules)
    present = [
        rule
        for rule in rules
        if all(name in stored for name in direction.sources(rule)) and direction.targets(rule)  # else: dropped
    ]
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
    stored_dtype = source.store.info[inputs[0]].dtype if inputs else torch.float32  # else: made (inv_freq)
    if rule.kind != "buffer" and not stored_dtype.is_floating_point:
        raise ValueError(
            f"{inputs[0]} is {dtype_name(stored_dtype)}: ESM-2 weights are floating point (a quantised checkpoint "
            "is not converted; convert its float original)."
        )
    keep = dtype is None or rule.kind == "buffer"
    info = TensorInfo(direction.target_shape(rule, config), stored_dtype if keep else dtype)
    return Step(rule, inputs, tuple((name, info) for name in direction.targets(rule)))


def run_step(step: Step, source: Source, config: NVEsmConfig, direction: Direction) -> list[torch.Tensor]:
    """Read the step's tensors (the part the direction keeps, refused if NaN or Inf: `check_finite`), cast them to
    the planned dtype (every rule's transform commutes with the cast: it moves, cuts or pads values), apply the
    rule."""
    tensors = direction.read(step.rule, [source.store.load(key) for key in step.inputs], config)
    check_finite(zip(step.inputs, tensors), source.spec)
    dtype = step.outputs[0][1].dtype
    results = direction.transform(step.rule, [tensor.to(dtype) for tensor in tensors], config)
    return [tensor.to(info.dtype) for tensor, (_, info) in zip(results, step.outputs)]


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
    produce = partial(run_step, source=source, config=config, direction=direction)
    return write_shards(folder, steps, produce, max_shard_bytes, direction.name, progress)


def weights_dtype_name(steps: list[Step]) -> str:
    """The dtype of the weights (the embedding's), as config.json's `dtype` names it."""
    return dtype_name(steps[0].outputs[0][1].dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def count_parameters(steps: list[Step]) -> int:
    """Parameters the steps write."""
    return sum(math.prod(info.shape) for step in steps for _, info in step.outputs)


def count_bytes(steps: list[Step]) -> int:
    """Bytes the steps write."""
    return sum(step.nbytes for step in steps)
