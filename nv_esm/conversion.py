"""Converting a checkpoint (`convert`, `convert_hf_to_nv`, `convert_nv_to_hf`), every direction (transformers or
fair-esm <-> NVEsm, NVIDIA's BioNeMo layout <-> NVEsm), and checking an existing conversion (`verify_folder`).

The source is a local folder (single or sharded safetensors), a Hub id or, into NVEsm, an original fair-esm `.pt`
(`nv_esm.conversion_plan.open_source`). Its plan is streamed into a staging folder beside OUT with the companion
files (config.json, tokenizer, LICENSE, remote code, model card), optionally checked on real proteins
(`nv_esm.verification.verify`), and moved into place only when everything succeeded. `verify_folder` reads OUT as
data (none of its code runs): its files against those the converter writes, its tensors bit for bit against SRC's
mapped through the table, then the logit table.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from configuration_nv_esm import NVEsmConfig
from nv_esm.checkpoint_checks import check_finite, check_special_token_ids
from nv_esm.checkpoint_io import DTYPES, format_bytes, load_torch_file, read_json, weight_files
from nv_esm.conversion_plan import (
    BIONEMO_TO_TE,
    CONVERTED_BY,
    DIRECTIONS,
    HF_TO_TE,
    TE_TO_HF,
    Direction,
    Source,
    Step,
    canonical_keys,
    count_bytes,
    count_parameters,
    dtype_name,
    open_source,
    plan_steps,
    run_step,
    weights_dtype_name,
    write_weights,
)
from nv_esm.hub_folder import (
    check_contained,
    check_out,
    copy_remote_code,
    staging_folder,
    write_license,
    write_tokenizer,
)
from nv_esm.model_card import ConvertedCheckpoint
from nv_esm.options import parse_size
from nv_esm.path_guard import overlap, refuse_overlap
from nv_esm.state_dict_mapping import (
    CONTACT_HEAD_TENSORS,
    RULES,
    CheckpointMismatch,
    hf_config_from_nv,
    hf_to_nv_adapter_state_dict,
    nv_to_hf_adapter_state_dict,
    nv_to_hf_state_dict,
)
from nv_esm.verification import (
    ConvertedLoader,
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
from nv_esm.vocabulary import DEFAULT_MAX_SHARD_SIZE

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
    notes: tuple[str, ...] = ()  # what the conversion left out (a contact head, run options), one line each

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
    """Convert `source` into `out` (see the module docstring); `config_overrides` go into the NVEsm config. A
    PEFT adapter folder (`adapter_config.json`) is converted by `convert_adapter`."""
    start = time.perf_counter()
    options = options or ConvertOptions()
    out = Path(out)
    if is_adapter_folder(source):
        if not direction.converts_adapters:
            adapters = " and ".join(name for name, other in DIRECTIONS.items() if other.converts_adapters)
            raise ValueError(f"{source} is a PEFT adapter folder: adapters convert with {adapters} only.")
        return convert_adapter(direction, Path(source).expanduser(), out, options, config_overrides or {})
    check_out(out, options.force)
    opened = open_source(source, options.revision)
    check_not_source(out, opened)
    check_special_token_ids(opened.config, opened.path / "config.json" if opened.folder else opened.path)
    direction = direction.for_source(opened.config)
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
            loader = converted_loader(direction)
            report = verify(reference, staging, staging, loader, options.verify_atol, device=options.verify_device)
        if report is not None and not report.passed:
            raise VerificationFailed(report)
        if direction.writes_card:
            checkpoint, repo = converted_checkpoint(opened, steps), options.hub_repo_id or str(out)
            (staging / "README.md").write_text(direction.card(checkpoint, config, report, repo, opened.head))
    seconds = time.perf_counter() - start
    parameters, nbytes = count_parameters(steps), count_bytes(steps)
    notes = direction.notes(opened)
    return ConversionResult(config, out, parameters, nbytes, shards, seconds, report, notes)


# What each kind of source is (the direction that reads it: `conversion_plan.CONVERTED_BY`).
KIND_NAMES = {
    "transformers": "a transformers ESM-2 checkpoint",
    "fair-esm": "a fair-esm ESM-2 checkpoint",
    "nvesm": "an NVEsm checkpoint",
    "bionemo": "NVIDIA's BioNeMo ESM-2 layout (bionemo-recipes)",
}


def refuse_kind(source: Source, direction: Direction) -> None:
    """Refuse a source that `direction` does not read, naming the direction that does."""
    if source.kind in direction.reads:
        return
    if source.kind == "nvesm":
        back = direction.inverse.name
        raise ValueError(f"{source.spec} is already an NVEsm checkpoint; convert it back with {back}.")
    if direction.to_nv:
        raise ValueError(
            f"{source.spec} is {KIND_NAMES[source.kind]}, which {direction.name} does not read; convert it with "
            f"{CONVERTED_BY[source.kind]}."
        )
    writers = " or ".join(name for name, other in DIRECTIONS.items() if other.writes in direction.reads)
    raise ValueError(
        f"{source.spec} is not an NVEsm checkpoint ({KIND_NAMES[source.kind]}; model_type "
        f"{source.config.get('model_type')!r}); {direction.name} reads folders written by {writers}: "
        f"convert it with {CONVERTED_BY[source.kind]} first."
    )


def source_config(source: Source, direction: Direction, overrides: dict[str, Any]) -> NVEsmConfig:
    """The NVEsm config of the conversion (a classifier's labels included: `Direction.nv_config`); refuses a source
    of another direction (`refuse_kind`) and, into NVIDIA's layout, a model their code cannot run."""
    refuse_kind(source, direction)
    try:
        return direction.nv_config(source.config, source.head, overrides)
    except ValueError as error:  # a field of the wrong type or value (`NVEsmConfig`'s checks)
        where = source.path / "config.json" if source.folder else source.path
        raise ValueError(f"{where}: {error}") from None


def write_companions(out: Path, source: Source, config: NVEsmConfig, direction: Direction, steps: list[Step]) -> None:
    """config.json (naming the class of the source's head), tokenizer (transformers' `EsmTokenizer` out of NVEsm)
    and LICENSE; for NVEsm also the remote code (the model card comes last)."""
    config_dict = direction.config_dict(config, source.head)
    config_dict["dtype"] = weights_dtype_name(steps)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out, source.folder, config.vocab_size, remote_code=direction.to_nv)
    if direction.to_nv:
        copy_remote_code(out)
    write_license(out, with_code=direction.to_nv)


def check_not_source(out: Path, source: Source) -> None:
    """Refuse an OUT that is, or contains, the source (replacing it would delete the source); how two paths meet
    is `path_guard.overlap`'s to say, as for every command."""
    if overlap(out, source.path) in ("is", "contains"):
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
        nbytes=count_bytes(steps),
    )


def reference_model(source: Source) -> ModelLoader:
    """Loads `source` in float32 as the reference of the logit check (see `nv_esm.verification.verify`)."""
    if source.kind == "fair-esm":
        return partial(_load_fair_esm, source)
    if source.kind == "bionemo":
        return partial(load_bionemo, source, torch.float32, label=source.spec)
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
    load_hf_state(model, state)
    return model.to(device).eval(), f"transformers EsmForMaskedLM float32 ({source.spec})"


def load_hf_state(model: Any, state: dict[str, torch.Tensor], absent: frozenset[str] = frozenset()) -> None:
    """Load `state` (transformers' names) into transformers' `EsmForMaskedLM` `model` and tie its decoder to the
    embedding; CheckpointMismatch unless it holds every parameter but the tied decoder weight and `absent`, and
    nothing else."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = set(missing) - {"lm_head.decoder.weight", *absent}
    if unexpected or left:
        raise CheckpointMismatch(left, unexpected)
    model.tie_weights()


def converted_loader(direction: Direction, out: Source | None = None) -> ConvertedLoader:
    """How `verify` loads the folder `direction` writes, never with that folder's own code: NVEsm's into the
    installed package's class (`load_nv`), transformers' with plain transformers (`load_transformers`), NVIDIA's
    layout through `load_bionemo`; of `out`, that folder already opened, when given (read, not opened again)."""
    if direction.writes == "nvesm":
        return load_nv
    if direction.writes == "transformers":
        return load_transformers
    if out is None:
        return load_bionemo
    return lambda _folder, dtype, device: load_bionemo(out, dtype, device)


def load_bionemo(source: Source | Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    """A folder in NVIDIA's BioNeMo layout (or its opened `Source`) as transformers' `EsmForMaskedLM` in `dtype` on
    `device`, read as data: its tensors converted to NVEsm's as `bionemo-to-te` converts them (`plan_steps`,
    `run_step`), and from there to transformers' (`nv_to_hf_state_dict`); their code is not run, nor shipped. The
    contact head, which their layout lacks, stays random (the logits do not use it)."""
    from transformers import EsmConfig, EsmForMaskedLM

    source = source if isinstance(source, Source) else open_source(source)
    direction = BIONEMO_TO_TE.for_source(source.config)
    config = source_config(source, direction, {})
    verifiable_head(source.head)
    nv_state = {
        name: tensor
        for step in plan_steps(source, config, direction, dtype)
        for (name, _), tensor in zip(step.outputs, run_step(step, source, config, direction))
    }
    hf_state = nv_to_hf_state_dict(nv_state, config, absent=CONTACT_HEAD_TENSORS)
    fields = {key: value for key, value in hf_config_from_nv(config).items() if key != "model_type"}
    model = EsmForMaskedLM._from_config(EsmConfig(**fields), dtype=dtype)
    load_hf_state(model, hf_state, absent=CONTACT_HEAD_TENSORS)
    name = f"transformers EsmForMaskedLM {dtype_name(dtype)} ({label}: NVIDIA's BioNeMo layout, mapped)"
    return model.to(device).eval(), name


# --------------------------------------------------------------------------------------------------------------
# PEFT adapters
# --------------------------------------------------------------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def is_adapter_folder(source: str | Path) -> bool:
    """Whether `source` is a local PEFT adapter folder (`adapter_config.json`, as `save_pretrained` writes)."""
    path = Path(source).expanduser()
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def convert_adapter(
    direction: Direction, source: Path, out: Path, options: ConvertOptions, config_overrides: dict[str, Any]
) -> ConversionResult:
    """Convert a PEFT adapter folder saved from transformers' ESM-2 (LoRA, `modules_to_save` heads) into one whose
    tensor names are NVEsm's (`hf_to_nv_adapter_state_dict`), or back; the other files (adapter_config.json: the
    target module names are the same on both sides) are copied. `config_overrides` may set the vocabulary sizes
    (default ESM-2's: 33 entries, padded to 64)."""
    start = time.perf_counter()
    if options.verify:
        raise ValueError(f"{source} is a PEFT adapter folder: --verify compares models; load the adapter instead.")
    refuse_overlap({"OUT": out}, {"SRC": source})  # replacing it would delete the adapter being converted
    check_contained(source)  # no file linked in from elsewhere is read or copied
    check_out(out, options.force)
    weights = [source / name for name in ADAPTER_WEIGHTS if (source / name).is_file()]
    if not weights:
        raise ValueError(f"{source} holds {ADAPTER_CONFIG} but no {' or '.join(ADAPTER_WEIGHTS)}.")
    state = load_file(weights[0]) if weights[0].suffix == ".safetensors" else load_torch_file(weights[0])
    check_finite(state.items(), weights[0])
    config = NVEsmConfig(**config_overrides)
    mapped = (hf_to_nv_adapter_state_dict if direction.to_nv else nv_to_hf_adapter_state_dict)(state, config)
    dtype = DTYPES[options.dtype] if options.dtype else None
    mapped = {
        key: (tensor.to(dtype) if dtype and tensor.is_floating_point() else tensor).contiguous()
        for key, tensor in mapped.items()
    }
    with staging_folder(out, options.force) as staging:
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in ADAPTER_WEIGHTS:
                shutil.copyfile(path, staging / path.name)
        save_file(mapped, staging / ADAPTER_WEIGHTS[0], metadata={"format": "pt"})
    seconds = time.perf_counter() - start
    nbytes = sum(tensor.nbytes for tensor in mapped.values())
    parameters = sum(tensor.numel() for tensor in mapped.values())
    return ConversionResult(config, out, parameters, nbytes, 1, seconds, None)


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

    def verdict(self) -> str:
        """One line: the file check, the tensor check and the logit table, each under its own label."""
        logits = "PASSED" if self.report.passed else "FAILED"
        return (
            f"files {_differences(len(self.file_mismatches))}, tensors {_differences(len(self.mismatches))}; "
            f"logit table {logits}"
        )

    def text(self) -> str:
        """What `verify` prints: the file check and the tensor check (a line per difference), then the logit table,
        whose last line says PASSED only when the whole check passed (when the files or tensors differ, it says
        that the logits agree, and `verify` ends with its failure: no PASSED before a failure)."""
        lines = [
            f"files: every file of OUT against what the converter writes from SRC ({self.files} files: config.json "
            "field by field, the others byte for byte; the weights are checked below; a model card is not compared): "
            f"{_differences(len(self.file_mismatches))}",
            *(f"  DIFFERS {mismatch}" for mismatch in self.file_mismatches),
            f"tensors: {self.compared} of SRC mapped through the rules ({self.direction.name}, {self.dtype}) and "
            f"compared with OUT bit for bit: {_differences(len(self.mismatches))}",
            *(f"  DIFFERS {mismatch}" for mismatch in self.mismatches),
        ]
        table = self.report.table()
        if self.report.passed and not self.passed:
            table = table.replace("\nPASSED: ", "\nlogits agree (files or tensors above differ): ", 1)
        return "\n".join([*lines, "", table])


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
    found = [d for d in DIRECTIONS.values() if source.kind in d.reads and converted.kind == d.writes]
    if not found:
        raise ValueError(
            f"verify compares SRC with the folder converted from it (transformers or fair-esm SRC and NVEsm OUT, "
            f"NVEsm SRC and transformers or NVIDIA BioNeMo OUT, or NVIDIA BioNeMo SRC and NVEsm OUT); {source.spec} is "
            f"{source.kind} and {out} is {converted.kind}."
        )
    direction = found[0].for_source(source.config).for_output(converted.config)
    out_dtype = read_json(out / "config.json").get("dtype", "float32")
    verifiable_head(source.head)
    verifiable_dtype(out_dtype)
    verify_device(device)
    config, steps = expected_conversion(source, converted, direction)
    compared, mismatches = compare_tensors(source, converted, direction, config, steps)
    with tempfile.TemporaryDirectory() as folder:
        expected = Path(folder)
        write_companions(expected, source, config, direction, steps)
        files, file_mismatches = compare_files(out, expected, weight_files(out), direction.writes_card)
        load_converted = converted_loader(direction, converted)
        report = verify(reference_model(source), out, expected, load_converted, atol, device=device)
    return FolderCheck(direction, out_dtype, files, file_mismatches, compared, mismatches, report)


def expected_conversion(source: Source, out: Source, direction: Direction) -> tuple[NVEsmConfig, list[Step]]:
    """The config and steps of converting `source` as `out` was converted: to `out`'s dtype and, into NVEsm, its
    padded vocabulary size (whose padding rows `compare_tensors` checks)."""
    out_config = source_config(out, direction.inverse.for_source(out.config), {})
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
