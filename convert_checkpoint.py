"""Convert ESM-2 checkpoints between transformers (`EsmForMaskedLM`), fair-esm (`.pt`) and NVEsm (Transformer Engine).

One table, `RULES` and a head's rules (`HEADS`: masked LM, token or sequence classification, told by the tensors;
`nv_esm.state_dict_mapping`, with the pure state-dict and config mappings that the tests, benchmarks and trainer
use), maps every tensor; both directions read it. This command streams it: it reads and
writes one rule's tensors at a time, so converting a checkpoint needs memory for its largest layer, not for the
whole model.

SRC is a local folder (single or sharded safetensors), a Hugging Face Hub id, or, for hf-to-te, an original
fair-esm checkpoint (`esm2_t33_650M_UR50D.pt`; its `-contact-regression.pt` is read when it lies beside it).
OUT is written in a temporary folder next to it and moved into place only when everything succeeded.
`verify SRC OUT` checks an existing conversion, reading OUT as data (none of its code runs): every file of OUT must be
what the converter writes from SRC, every tensor of SRC mapped through `RULES` must equal OUT's bit for bit, and
both models' logits must agree on real proteins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from configuration_nv_esm import NVEsmConfig
from nv_esm.checkpoint_io import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    SafetensorsStore,
    StateDictStore,
    TensorInfo,
    format_bytes,
    parse_size,
    read_fair_esm,
    read_json,
    weight_files,
    write_shards,
)
from nv_esm.hub_folder import (
    check_out,
    copy_remote_code,
    hub_id_of,
    nv_config_dict,
    push_to_hub,
    resolve_source,
    staging_folder,
    write_license,
    write_tokenizer,
)
from nv_esm.model_card import ConvertedCheckpoint, model_card
from nv_esm.state_dict_mapping import (
    HEADS,
    RULES,
    CheckpointMismatch,
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
    hf_config_from_nv,
    hf_shape,
    nv_config_from_hf,
    nv_shape,
    rules_for,
)
from nv_esm.verification import (
    DEFAULT_VERIFY_ATOL,
    TE_FP32_VERIFY_ATOL,
    VERIFY_DEVICES,
    ModelLoader,
    VerificationFailed,
    VerifyReport,
    compare_files,
    load_nv,
    load_transformers,
    verifiable_dtype,
    verifiable_head,
    verify,
    verify_device,
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
    """Read the step's tensors, apply its rule, cast to the planned dtype."""
    tensors = [source.store.load(key) for key in step.inputs]
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


def _nbytes(steps: list[Step]) -> int:
    return sum(step.nbytes for step in steps)


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
        verify_atol: Tolerance of --verify (None: by dtype, see `nv_esm.verification.default_atol`).
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
        verifiable_head(opened.head)
        verifiable_dtype(weights_dtype_name(steps))
        verify_device(options.verify_device)
    with staging_folder(out, options.force) as staging:
        shards = write_weights(staging, steps, opened, config, direction, options.max_shard_size, options.progress)
        write_companions(staging, opened, config, direction, steps)
        report = None
        if options.verify:
            reference = reference_model(opened)
            report = verify(
                reference, staging, direction.to_nv, staging, options.verify_atol, device=options.verify_device
            )
        if report is not None and not report.passed:
            raise VerificationFailed(report)
        if direction.to_nv:
            repo = options.hub_repo_id or str(out)
            card = model_card(converted_checkpoint(opened, steps), config, report, repo, opened.head)
            (staging / "README.md").write_text(card)
    seconds = time.perf_counter() - start
    return ConversionResult(config, out, count_parameters(steps), _nbytes(steps), shards, seconds, report)


def source_config(source: Source, direction: Direction, overrides: dict[str, Any]) -> NVEsmConfig:
    """The NVEsm config of the conversion (a classifier's labels included); refuses a source of the other
    direction."""
    if direction.to_nv:
        if source.kind == "nvesm":
            raise ValueError(f"{source.spec} is already an NVEsm checkpoint; convert it back with te-to-hf.")
        return nv_config_from_hf(source.config, source.head, **overrides)
    if source.kind != "nvesm":
        raise ValueError(
            f"{source.spec} is not an NVEsm checkpoint ({source.kind}; model_type "
            f"{source.config.get('model_type')!r}); te-to-hf reads folders written by hf-to-te."
        )
    return NVEsmConfig.from_dict({**source.config, **overrides})


def write_companions(out: Path, source: Source, config: NVEsmConfig, direction: Direction, steps: list[Step]) -> None:
    """config.json (naming the class of the source's head), tokenizer and LICENSE; for NVEsm also the remote code
    (the model card comes last)."""
    if direction.to_nv:
        config_dict = nv_config_dict(config, HEADS[source.head].nv_class)
    else:
        config_dict = hf_config_from_nv(config, source.head)
    config_dict["dtype"] = weights_dtype_name(steps)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, source.folder, config.vocab_size)
    if direction.to_nv:
        copy_remote_code(out)
    write_license(out, with_code=direction.to_nv)


def check_not_source(out: Path, source: Source) -> None:
    """Refuse an OUT that is, or contains, the source (replacing it would delete the source)."""
    resolved, src = out.resolve(), source.path.resolve()
    if resolved == src or resolved in src.parents:
        raise ValueError(f"{out} holds the source checkpoint {source.path}; choose another output folder.")


def converted_checkpoint(source: Source, steps: list[Step]) -> ConvertedCheckpoint:
    """What the model card says about converting `source` with `steps`."""
    return ConvertedCheckpoint(
        name=source.hub_id or Path(source.spec).name,
        hub_id=source.hub_id,
        source_kind=source.kind,
        source_nbytes=source.nbytes,
        source_dtype=dtype_name(source.store.info[steps[0].inputs[0]].dtype),
        dtype=weights_dtype_name(steps),
        parameters=count_parameters(steps),
        nbytes=_nbytes(steps),
    )


def reference_model(source: Source) -> ModelLoader:
    """Loads `source` in float32 as the reference of the logit check (see `nv_esm.verification.verify`)."""
    if source.kind == "fair-esm":
        return partial(_load_fair_esm, source)
    load = load_nv if source.kind == "nvesm" else load_transformers
    return partial(load, source.path, torch.float32, label=source.spec)


def _load_fair_esm(source: Source, device: str) -> tuple[Any, str]:
    """transformers' `EsmForMaskedLM` (float32) with the tensors of a fair-esm `.pt`, renamed through the table."""
    from transformers import EsmConfig, EsmForMaskedLM

    model = EsmForMaskedLM(EsmConfig(**{k: v for k, v in source.config.items() if k != "model_type"}))
    state = {
        name: source.store.load(key).float()
        for name, key in canonical_keys(source.store.info, source.canonical).items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.decoder.weight"}:
        raise CheckpointMismatch(set(missing) - {"lm_head.decoder.weight"}, unexpected)
    model.tie_weights()
    return model.to(device).eval(), f"transformers EsmForMaskedLM float32 ({source.spec})"


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
    """OUT compared with SRC: its files (as the converter writes them), its tensors (bit for bit), the logit table."""

    direction: Direction
    dtype: str
    files: int
    file_mismatches: list[str]
    compared: int
    mismatches: list[str]
    report: VerifyReport

    @property
    def passed(self) -> bool:
        return not self.file_mismatches and not self.mismatches and self.report.passed

    @property
    def differences(self) -> str:
        return _differences(len(self.file_mismatches) + len(self.mismatches))

    def text(self) -> str:
        """What `verify` prints: the file check and the tensor check (a line per difference), then the logit table."""
        lines = [
            f"files: every file of OUT against what the converter writes from SRC ({self.files} byte for byte or, "
            f"config.json, field by field; weights below; a model card not compared): "
            f"{_differences(len(self.file_mismatches))}",
            *(f"  DIFFERS {mismatch}" for mismatch in self.file_mismatches),
            f"tensors: {self.compared} of SRC mapped through the rules ({self.direction.name}, {self.dtype}) and "
            f"compared with OUT bit for bit: {_differences(len(self.mismatches))}",
            *(f"  DIFFERS {mismatch}" for mismatch in self.mismatches),
        ]
        return "\n".join([*lines, "", self.report.table()])


def _differences(count: int) -> str:
    return f"{count} difference{'s' * (count != 1)}" if count else "all identical"


def verify_folder(
    source_spec: str | Path,
    out: Path,
    revision: str | None = None,
    atol: float | None = None,
    device: str = "auto",
) -> FolderCheck:
    """Check OUT, a folder converted from SRC (either direction, told by what the two are): its files against those
    the converter writes (`nv_esm.verification.compare_files`), its tensors (`compare_tensors`), then the logit
    table of `verify`. OUT is read as data: its code is compared, never run, and the proteins are tokenized with
    the tokenizer made from SRC."""
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
    out_dtype = read_json(out / "config.json").get("dtype", "float32")
    verifiable_head(source.head)
    verifiable_dtype(out_dtype)
    verify_device(device)
    config, steps = expected_conversion(source, converted, direction)
    compared, mismatches = compare_tensors(source, converted, direction, config, steps)
    with tempfile.TemporaryDirectory() as folder:
        expected = Path(folder)
        write_companions(expected, source, config, direction, steps)
        files, file_mismatches = compare_files(out, expected, weight_files(out), direction.to_nv)
        report = verify(reference_model(source), out, direction.to_nv, expected, atol, device=device)
    return FolderCheck(direction, out_dtype, files, file_mismatches, compared, mismatches, report)


def expected_conversion(source: Source, out: Source, direction: Direction) -> tuple[NVEsmConfig, list[Step]]:
    """The config and steps of converting `source` as `out` was converted: to `out`'s dtype and, into NVEsm, its
    padded vocabulary size (whose padding rows `compare_tensors` checks)."""
    other_way = TE_TO_HF if direction.to_nv else HF_TO_TE
    out_config = source_config(out, other_way, {})
    overrides = {"padded_vocab_size": out_config.padded_vocab_size} if direction.to_nv else {}
    config = source_config(source, direction, overrides)
    stored = canonical_keys(out.store.info, out.canonical)
    embedding = direction.targets(RULES[0])[0]
    dtype = out.store.info[stored[embedding]].dtype if embedding in stored else None
    return config, plan_steps(source, config, direction, dtype)


def compare_tensors(
    source: Source, out: Source, direction: Direction, config: NVEsmConfig, steps: list[Step]
) -> tuple[int, list[str]]:
    """Map each tensor of `source` through `RULES` (`steps`, from `expected_conversion`), cast as the converter
    casts to the dtype of `out`'s weights, and compare it bit for bit with `out`'s, one rule at a time (memory for
    one rule's tensors). Returns how many tensors were compared and a line per difference."""
    stored = canonical_keys(out.store.info, out.canonical)
    expected = {name for step in steps for name, _ in step.outputs}
    mismatches = [f"{name}: missing in OUT" for name in sorted(expected - stored.keys())]
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
# Command line
# --------------------------------------------------------------------------------------------------------------

EPILOG = f"""examples:
  # a transformers ESM-2 from the Hub -> NVEsm, checked against transformers on real proteins
  nv-esm convert hf-to-te facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify

  # bf16 weights in 2 GB shards, uploaded to a private Hub repository
  nv-esm convert hf-to-te facebook/esm2_t36_3B_UR50D ./esm2_3B_te --dtype bfloat16 \\
      --max-shard-size 2GB --push-to-hub my-org/esm2_t36_3B_te --private

  # an original fair-esm checkpoint (esm2_t33_650M_UR50D-contact-regression.pt beside it is read too)
  nv-esm convert hf-to-te ~/esm/esm2_t33_650M_UR50D.pt ./esm2_650M_te

  # back to a folder plain transformers loads (EsmForMaskedLM), replacing an older one
  nv-esm convert te-to-hf ./esm2_650M_te ./esm2_650M_hf --verify --force

  # check an existing conversion: every tensor bit for bit through the mapping table, then the logit table (CPU)
  nv-esm convert verify facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify-device cpu

  # list what would be uploaded; nothing is sent
  nv-esm convert hf-to-te facebook/esm2_t6_8M_UR50D ./esm2_8M_te --push-to-hub me/esm2_8M_te --dry-run

Hub downloads and uploads use the usual huggingface_hub settings (HF_TOKEN or `hf auth login`, HF_HOME,
HF_HUB_OFFLINE). `verify SRC OUT` takes the direction from what SRC and OUT are and runs none of OUT's code: it
compares every file of OUT with what the converter writes from SRC (code and tokenizer byte for byte, config.json
field by field, nothing extra), maps every tensor of SRC through the table (cast to OUT's dtype, as converting does)
and compares it with OUT's bit for bit, naming each file, field or tensor that differs, then prints the logit
table. The logit table (--verify, verify) runs on the GPU when there is
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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line (see EPILOG); `prog` names the command in the usage line (default nv-esm convert)."""
    parser = argparse.ArgumentParser(
        prog=prog or "nv-esm convert",
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
    parser.add_argument("--verify", action="store_true", help="compare both models' logits on 22 real proteins")
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command-line entry point; returns the exit status. `prog`: the command's name in usage and errors."""
    parser = build_parser(prog)
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
