"""Does a converted model give the source model's logits? Both run on real proteins and their logits are compared.

The source (the reference) always runs in float32; the converted folder in the dtype of its weights. `verify`
loads the two one after the other, so it needs memory for one model at a time. The tolerances below are the
project's: the converter's `--verify`, its `verify` command and the demo use them.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nv_esm.alphabet import read_fasta
from nv_esm.checkpoint_io import DTYPES, WEIGHTS_INDEX_NAME, read_json
from nv_esm.vocabulary import DEFAULT_VERIFY_ATOL as DEFAULT_VERIFY_ATOL
from nv_esm.vocabulary import TE_FP32_VERIFY_ATOL as TE_FP32_VERIFY_ATOL
from nv_esm.vocabulary import VERIFY_DEVICES as VERIFY_DEVICES

PROTEINS_FASTA = Path(__file__).resolve().parent / "proteins.fasta"  # package data: installed with nv_esm
# Loads a model on a device ("cpu" or "cuda"); returns it in eval mode and a description for the report.
ModelLoader = Callable[[str], tuple[Any, str]]
# Loads a converted folder in a dtype on a device (`load_nv`, `load_transformers`); returns it as `ModelLoader` does.
ConvertedLoader = Callable[[Path, torch.dtype, str], tuple[Any, str]]


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


def default_atol(dtype_name: str, uses_te: bool) -> float:
    """The --verify tolerance for converted weights of this dtype (see DEFAULT_VERIFY_ATOL)."""
    if dtype_name == "float32" and uses_te:
        return TE_FP32_VERIFY_ATOL
    return DEFAULT_VERIFY_ATOL.get(dtype_name, DEFAULT_VERIFY_ATOL["float32"])


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


def verifiable_head(head: str) -> None:
    """Refuse a checkpoint whose logits the table cannot check: it compares masked-LM logits (`head` is a key of
    `state_dict_mapping.HEADS`)."""
    if head != "masked_lm":
        raise ValueError(
            f"--verify and verify compare masked-LM logits; this is a {head.replace('_', ' ')} checkpoint. Convert "
            "it without --verify (its tensors go through the same table as a masked LM's)."
        )


def verify(
    reference: ModelLoader,
    out: Path,
    tokenizer: Path,
    load_converted: ConvertedLoader,
    atol: float | None = None,
    proteins: Path = PROTEINS_FASTA,
    device: str = "auto",
) -> VerifyReport:
    """Run the reference model (float32) and the converted folder `out` (its own dtype) on real proteins and
    compare their logits.

    `reference` loads the source model in float32 (e.g. `partial(load_transformers, folder, torch.float32)`).
    `load_converted(out, dtype, device)` loads `out`, never with the folder's own code: `load_nv` (an NVEsm folder,
    into the installed package's model class), `load_transformers` (plain transformers) or the converter's loader of
    NVIDIA's BioNeMo layout (`nv_esm.conversion.converted_loader` chooses). The proteins are tokenized by the
    tokenizer in folder `tokenizer` (the one the converter writes from the source, not `out`'s, which may have been
    changed).
    `device` (see `VERIFY_DEVICES`) "auto" runs on the GPU when there is one (Transformer Engine if it is
    installed), else on the CPU; on the CPU the NVEsm model uses the PyTorch backend. The models are loaded one
    after the other. `atol` None: `default_atol` of `out`'s dtype.
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
    tokenize = EsmTokenizer.from_pretrained(tokenizer)
    inputs = [tokenize(sequence, return_tensors="pt")["input_ids"] for _, sequence in records]
    reference_logits, reference_name, reference_te = _run(lambda: reference(device), inputs, device)
    converted_logits, converted_name, converted_te = _run(lambda: load_converted(out, dtype, device), inputs, device)
    uses_te = reference_te or converted_te
    atol = default_atol(out_dtype, uses_te) if atol is None else atol
    checks = [
        _compare(name, ids[0], a, b)
        for (name, _), ids, a, b in zip(records, inputs, reference_logits, converted_logits)
    ]
    return VerifyReport(checks, atol, reference_name, converted_name, device)


def _import_transformer_engine_early() -> None:
    """Transformer Engine must be imported before torch loads cuDNN in the process (see tests/test_gpu.py), which
    running the first model may do; importing it first lets the NVEsm model use it. Absent TE is fine."""
    from modeling_nv_esm_layers import transformer_engine_available

    transformer_engine_available()


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


# --------------------------------------------------------------------------------------------------------------
# Loading the two models
# --------------------------------------------------------------------------------------------------------------


def load_nv(folder: Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    """The NVEsm folder's weights and config in the installed package's `NVEsmForMaskedLM`, on `device`: the folder
    is read as data (config.json, safetensors), never as code, so a tampered `modeling_nv_esm.py` in it runs no
    code here.

    The backend is `resolve_backend("auto", device)`'s: the PyTorch twin on the CPU, even where a GPU is visible;
    Transformer Engine on the GPU when it is installed.
    """
    from modeling_nv_esm import NVEsmForMaskedLM, resolve_backend

    backend = resolve_backend("auto", device).name
    model = NVEsmForMaskedLM.from_pretrained(folder, dtype=dtype, backend=backend, use_safetensors=True)
    name = f"NVEsm NVEsmForMaskedLM {str(dtype).removeprefix('torch.')} backend {model.esm.backend} ({label})"
    return model.to(device).eval(), name


def load_transformers(folder: Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    """A transformers ESM-2 folder as plain transformers' `EsmForMaskedLM` (no remote code), on `device`."""
    from transformers import EsmForMaskedLM

    model = EsmForMaskedLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    return model.to(device).eval(), f"transformers {type(model).__name__} {str(dtype).removeprefix('torch.')} ({label})"


# --------------------------------------------------------------------------------------------------------------
# Comparing a folder's files with those the converter writes
# --------------------------------------------------------------------------------------------------------------

# config.json fields that say which transformers wrote the file, not what the model is.
UNCOMPARED_CONFIG_FIELDS = ("transformers_version",)
# Files a conversion writes whose text is not determined by the checkpoint (the model card holds the --verify table
# and the Hub id of the upload); they are data, never loaded as code.
UNCOMPARED_FILES = ("README.md",)


def compare_files(out: Path, expected: Path, weight_files: list[Path], model_card: bool) -> tuple[int, list[str]]:
    """Every entry of folder `out` against what the converter writes: the files in `expected` (config.json, the
    tokenizer, the remote code, LICENSE), `config.json` field by field and the others byte for byte; `weight_files`
    (the safetensors files of `out`, compared tensor by tensor elsewhere) and their index; with `model_card`,
    `UNCOMPARED_FILES`. Any other entry, a sub-folder or a link, is a difference. Returns how many files were
    compared and a line per difference."""
    found = {path.name: path for path in out.iterdir()}
    wanted = {path.name: path for path in expected.iterdir()}
    allowed = set(wanted) | {path.name for path in weight_files} | (set(UNCOMPARED_FILES) if model_card else set())
    if len(weight_files) > 1:
        allowed.add(WEIGHTS_INDEX_NAME)
    mismatches = [f"{name}: missing in OUT" for name in sorted(wanted.keys() - found.keys())]
    for name, path in sorted(found.items()):
        if path.is_symlink() or not path.is_file():
            kind = "link" if path.is_symlink() else "folder"
            mismatches.append(f"{name}: a {kind} in OUT, where the converter writes only files")
        elif name not in allowed:
            mismatches.append(f"{name}: in OUT, not written by the converter")
        elif name == "config.json":
            mismatches += _compare_config(read_json(path), read_json(wanted[name]))
        elif name in wanted and path.read_bytes() != wanted[name].read_bytes():
            mismatches.append(f"{name}: its bytes differ from the file the converter writes")
    return len(wanted), mismatches


def _compare_config(found: dict, expected: dict) -> list[str]:
    """A line per config.json field that differs from the converter's (`UNCOMPARED_CONFIG_FIELDS` aside)."""
    names = sorted((found.keys() | expected.keys()) - set(UNCOMPARED_CONFIG_FIELDS))
    missing = object()
    return [
        f"config.json {name}: {found.get(name, 'absent')!r}, from SRC {expected.get(name, 'absent')!r}"
        for name in names
        if found.get(name, missing) != expected.get(name, missing)
    ]


# --------------------------------------------------------------------------------------------------------------
# Comparing logits
# --------------------------------------------------------------------------------------------------------------


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
