"""The conversion's inputs and plan: the checkpoint to convert (`Source`: a folder, a Hub id or a fair-esm `.pt`) and
one `Step` per rule of `nv_esm.state_dict_mapping.RULES` (and the head's rules) that applies to it.

A `Direction` says which side of each rule is read and which is written. `plan_steps` checks every stored name and
shape against the table before anything is written; `run_step` reads one rule's tensors, maps and casts them, so
`write_weights` streams a checkpoint with memory for its largest layer, not for the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import torch

from configuration_nv_esm import NVEsmConfig
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
    head_of,
    hf_config_from_fair_esm,
    hf_shape,
    nv_shape,
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
        kind: "transformers" (an ESM-2 model class), "nvesm" or "fair-esm".
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
    return Source(spec, folder, kind, config, SafetensorsStore(weight_files(folder)), hub_id or hub_id_of(folder))


def open_fair_esm(path: Path) -> Source:
    """An original fair-esm ESM-2 checkpoint (`{"model": state dict, "cfg": {"model": args}}`)."""
    state, model_args = read_fair_esm(path)
    return Source(str(path), path, "fair-esm", hf_config_from_fair_esm(model_args), StateDictStore(state))


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
    rules = rules_for(config, source.head)
    check_keys(stored, [direction.sources(rule) for rule in rules], rules)
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
    if rule.kind != "buffer" and not stored_dtype.is_floating_point:
        raise ValueError(
            f"{inputs[0]} is {dtype_name(stored_dtype)}: ESM-2 weights are floating point (a quantised checkpoint "
            "is not converted; convert its float original)."
        )
    keep = dtype is None or rule.kind == "buffer"
    info = TensorInfo(direction.target_shape(rule, config), stored_dtype if keep else dtype)
    return Step(rule, inputs, tuple((name, info) for name in direction.targets(rule)))


def run_step(step: Step, source: Source, config: NVEsmConfig, direction: Direction) -> list[torch.Tensor]:
    """Read the step's tensors (refused if NaN or Inf: `check_finite`), apply its rule, cast to the planned dtype."""
    tensors = [source.store.load(key) for key in step.inputs]
    check_finite(zip(step.inputs, tensors), source.spec)
    results = direction.transform(step.rule, tensors, config)
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
