"""The conversion's inputs and plan: the checkpoint to convert (`Source`: a folder, a Hub id or a fair-esm `.pt`) and
one `Step` per rule of `nv_esm.state_dict_mapping.RULES` (and the head's rules) that applies to it.

A `Direction` says which side of each rule is read and which is written, and makes every other choice that differs
between directions (the config, config.json, model card and notes of a conversion): the converter asks it, never
tests its type. `BionemoDirection` reads or writes NVIDIA's BioNeMo layout in place of transformers'
(`nv_esm.bionemo_mapping`: their names of our tensors, their vocabulary rows). `DIRECTIONS` is the one list of them;
`INVERSE` and `CONVERTED_BY` are read from it. `plan_steps` checks every stored name and shape against the table
before anything is written; `run_step` reads one rule's tensors, maps and casts them, so `write_weights` streams a
checkpoint with memory for its largest layer, not for the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from configuration_nv_esm import NVEsmConfig
from nv_esm.alphabet import ESM_VOCAB
from nv_esm.bionemo_mapping import (
    bionemo_config_dict,
    bionemo_name,
    bionemo_padded_vocab_size,
    bionemo_vocab_rows,
    canonical_bionemo_name,
    check_fast_tokenizer,
    dropped_run_options,
    is_bionemo,
    nv_config_from_bionemo,
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
from nv_esm.hub_folder import hub_id_of, nv_config_dict, resolve_source
from nv_esm.model_card import ConvertedCheckpoint, bionemo_card, model_card
from nv_esm.state_dict_mapping import (
    CONTACT_HEAD,
    HEADS,
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
    hf_config_from_nv,
    hf_shape,
    nv_config_from_hf,
    nv_shape,
    pad_vocab,
    rules_for,
)

if TYPE_CHECKING:
    from nv_esm.verification import VerifyReport

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
            check_fast_tokenizer(folder / "tokenizer.json", config.get("vocab_size", len(ESM_VOCAB)))
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
    the kind it makes. Between transformers (or fair-esm) and NVEsm; `BionemoDirection` for NVIDIA's layout."""

    name: str
    to_nv: bool
    reads: tuple[str, ...]
    writes: str
    converts_adapters: ClassVar[bool] = True  # PEFT adapter folders (`nv_esm.conversion.convert_adapter`)

    @property
    def inverse(self) -> Direction:
        """The direction that converts back what this one writes (`INVERSE`)."""
        return INVERSE[self.name]

    @property
    def writes_card(self) -> bool:
        """Whether the folder it writes gets a model card (README.md, `card`): NVEsm's do, transformers' do not."""
        return self.to_nv

    def for_source(self, config: dict) -> Direction:
        """This direction set for a source of config.json `config` (BioNeMo's: its padding and QKV order)."""
        return self

    def for_output(self, config: dict) -> Direction:
        """This direction set for an existing output of config.json `config`, to check it against a conversion
        (BioNeMo's: as many vocabulary rows as it has)."""
        return self

    def nv_config(self, fields: dict, head: str, overrides: dict[str, Any]) -> NVEsmConfig:
        """The NVEsm config of a conversion whose source has config.json `fields` and `head` (a key of `HEADS`; a
        classifier's labels included), with `overrides`; ValueError for a field of the wrong type or value."""
        if self.to_nv:
            return nv_config_from_hf(fields, head, **overrides)
        return NVEsmConfig.from_dict({**fields, **overrides})

    def config_dict(self, config: NVEsmConfig, head: str) -> dict:
        """config.json of the folder it writes for a model of `config` with `head` (naming that head's class);
        NVEsm's with the `auto_map` of the remote code."""
        if self.to_nv:
            return nv_config_dict(config, HEADS[head].nv_class)
        return hf_config_from_nv(config, head)

    def card(
        self, checkpoint: ConvertedCheckpoint, config: NVEsmConfig, report: VerifyReport | None, repo: str, head: str
    ) -> str:
        """The model card of the folder it writes (where `writes_card`): `checkpoint` converted, `report` of
        --verify (None: not verified), `repo` where it will be loaded from, for the examples."""
        return model_card(checkpoint, config, report, repo, head)

    def notes(self, source: Source) -> tuple[str, ...]:
        """What converting `source` leaves out, one line each (nothing here: every tensor and field has its place)."""
        return ()

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
    except their vocabulary rows (`padded_vocab_size` of them: the source's converting in, an existing OUT's when it
    is checked, None = the NVEsm config's converting out; `vocab_rows`), cut to the vocabulary and padded afresh as
    each side pads (ours with zeros; theirs as their convert.py: zeros, the decoder bias the dtype's lowest value),
    and the QKV rows of a source with `qkv_interleaved` false, re-ordered. Their layout lacks the contact head and
    the rotary inv_freq: converting in, inv_freq is computed (as transformers computes it) and no contact head is
    written; converting out, both are left behind. Their folders get a model card of their own; PEFT adapters do not
    convert this way."""

    qkv_interleaved: bool = True
    padded_vocab_size: int | None = None
    converts_adapters: ClassVar[bool] = False

    @property
    def writes_card(self) -> bool:
        return True

    def for_source(self, config: dict) -> Direction:
        if not self.to_nv:
            return self
        interleaved = config.get("qkv_weight_interleaved", True)
        return replace(self, qkv_interleaved=interleaved, padded_vocab_size=bionemo_padded_vocab_size(config))

    def for_output(self, config: dict) -> Direction:
        return self if self.to_nv else replace(self, padded_vocab_size=bionemo_padded_vocab_size(config))

    def vocab_rows(self, config: NVEsmConfig) -> int:
        """Rows of their embedding and decoder for a model of `config` (`bionemo_vocab_rows`)."""
        return bionemo_vocab_rows(config, self.padded_vocab_size)

    def nv_config(self, fields: dict, head: str, overrides: dict[str, Any]) -> NVEsmConfig:
        """Converting in, from their config.json (`nv_config_from_bionemo`); converting out, also refused where their
        code cannot run the model (`bionemo_config_dict`: a sequence classifier, another rotary base)."""
        if self.to_nv:
            return nv_config_from_bionemo(fields, head, **overrides)
        config = super().nv_config(fields, head, overrides)
        self.config_dict(config, head)
        return config

    def config_dict(self, config: NVEsmConfig, head: str) -> dict:
        """Converting out, theirs, for their code (bionemo-recipes), which is not written."""
        if self.to_nv:
            return super().config_dict(config, head)
        return bionemo_config_dict(config, head, self.vocab_rows(config))

    def card(
        self, checkpoint: ConvertedCheckpoint, config: NVEsmConfig, report: VerifyReport | None, repo: str, head: str
    ) -> str:
        if self.to_nv:
            return super().card(checkpoint, config, report, repo, head)
        return bionemo_card(checkpoint, config, self.vocab_rows(config), report, head)

    def notes(self, source: Source) -> tuple[str, ...]:
        """The contact head (their layout has none) and, converting in, their run options
        (`bionemo_mapping.RUN_OPTIONS`) set to other values than their defaults."""
        if not self.to_nv:
            stored = canonical_keys(source.store.info, source.canonical)
            if any(name.startswith(CONTACT_HEAD) for name in stored):
                return ("NVIDIA's BioNeMo layout has no contact head: the source's was left out.",)
            return ()
        notes = [
            "NVIDIA's BioNeMo layout has no contact head, so OUT has none: nv-esm embed --include contacts refuses "
            "it (from_pretrained starts it at random)."
        ]
        dropped = dropped_run_options(source.config)
        if dropped:
            notes.append(f"their run options were left out (NVEsm's are load-time options): {', '.join(dropped)}.")
        return tuple(notes)

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
        return (self.vocab_rows(config), *shape[1:]) if rule.kind == "vocab" else shape

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
        fill = torch.finfo(tensor.dtype).min if tensor.dim() == 1 else 0.0  # their _pad_bias / _pad_weights
        padding = tensor.new_full((self.vocab_rows(config) - tensor.shape[0], *tensor.shape[1:]), fill)
        return [torch.cat([tensor, padding]).contiguous()]


HF_TO_TE = Direction("hf-to-te", to_nv=True, reads=("transformers", "fair-esm"), writes="nvesm")
TE_TO_HF = Direction("te-to-hf", to_nv=False, reads=("nvesm",), writes="transformers")
BIONEMO_TO_TE = BionemoDirection("bionemo-to-te", to_nv=True, reads=("bionemo",), writes="nvesm")
TE_TO_BIONEMO = BionemoDirection("te-to-bionemo", to_nv=False, reads=("nvesm",), writes="bionemo")
DIRECTIONS = {direction.name: direction for direction in (HF_TO_TE, TE_TO_HF, BIONEMO_TO_TE, TE_TO_BIONEMO)}


def _back(direction: Direction) -> Direction:
    """The one direction of `DIRECTIONS` that reads what `direction` writes and writes what it reads."""
    (back,) = (
        other for other in DIRECTIONS.values() if direction.writes in other.reads and other.writes in direction.reads
    )
    return back


# Each direction's way back, and the direction into NVEsm that reads each kind of source (its "convert it with").
INVERSE = {name: _back(direction) for name, direction in DIRECTIONS.items()}
CONVERTED_BY = {kind: name for name, direction in DIRECTIONS.items() if direction.to_nv for kind in direction.reads}


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
