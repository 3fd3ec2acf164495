"""Does a converted model give the source model's logits? Both run on real proteins and their logits are compared.

The source (the reference) always runs in float32; the converted folder in the dtype of its weights. `verify`
loads the two one after the other, so it needs memory for one model at a time. The tolerances below are the
project's: the converter's `--verify`, its `verify` command and the demo use them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nv_esm.alphabet import read_fasta
from nv_esm.checkpoint_io import DTYPES, read_json

PROTEINS_FASTA = Path(__file__).resolve().parent / "proteins.fasta"  # package data: installed with nv_esm
# Largest |logit difference| allowed, by the dtype of the converted weights; the reference always runs in
# float32. float32: both implementations do the same arithmetic in another order (fused QKV GEMM, other
# kernels): 4e-6 on a random 650M-shaped model (33 layers, H100 and CPU alike). bfloat16 keeps 8 significant bits
# and float16 11: rounding weights and activations moved that model's logits by up to 0.07 (bf16) and 0.009
# (fp16). Trained ESM-2 has larger logits than random weights, so the defaults leave ~10x room; a mapping error
# (swapped q/k, wrong head order, a missing bias) moves logits by far more.
DEFAULT_VERIFY_ATOL = {"float32": 1e-4, "float16": 0.1, "bfloat16": 0.75}
# Transformer Engine's fused GELU is the tanh approximation (|gelu_tanh - gelu_erf| <= 5e-4 per activation):
# float32 logits on the TE backend moved by up to 2.7e-3 on the same model.
TE_FP32_VERIFY_ATOL = 5e-2
VERIFY_DEVICES = ("auto", "cpu", "cuda")
# Loads a model on a device ("cpu" or "cuda"); returns it in eval mode and a description for the report.
ModelLoader = Callable[[str], tuple[Any, str]]


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
    out_is_nv: bool,
    atol: float | None = None,
    proteins: Path = PROTEINS_FASTA,
    device: str = "auto",
) -> VerifyReport:
    """Run the reference model (float32) and the converted folder `out` (its own dtype) on real proteins and
    compare their logits.

    `reference` loads the source model in float32 (e.g. `partial(load_transformers, folder, torch.float32)`).
    `out` is an NVEsm folder, loaded with `AutoModelForMaskedLM` + remote code (`out_is_nv`), or a transformers
    one, loaded with plain transformers. `device` (see `VERIFY_DEVICES`) "auto" runs on the GPU when there is one
    (Transformer Engine if it is installed), else on the CPU; on the CPU the NVEsm model uses the PyTorch backend.
    The models are loaded one after the other. `atol` None: `default_atol` of `out`'s dtype.
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
    load_converted = load_nv if out_is_nv else load_transformers
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


# --------------------------------------------------------------------------------------------------------------
# Loading the two models
# --------------------------------------------------------------------------------------------------------------


def load_nv(folder: Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    """The NVEsm folder through `AutoModelForMaskedLM` and its remote code (see `remote_code_folder`), on `device`.

    On the CPU the model gets `backend="torch"`, even where a GPU is visible; on the GPU `"auto"`, which the model
    resolves (`modeling_nv_esm.resolve_backend`): Transformer Engine when it is installed.
    """
    from transformers import AutoModelForMaskedLM

    backend = "auto" if device == "cuda" else "torch"
    with remote_code_folder(folder) as alias:
        model = AutoModelForMaskedLM.from_pretrained(alias, trust_remote_code=True, dtype=dtype, backend=backend)
    name = f"NVEsm AutoModelForMaskedLM {str(dtype).removeprefix('torch.')} backend {model.esm.backend} ({label})"
    return model.to(device).eval(), name


def load_transformers(folder: Path, dtype: torch.dtype, device: str, label: str = "OUT") -> tuple[Any, str]:
    """A transformers ESM-2 folder as plain transformers' `EsmForMaskedLM` (no remote code), on `device`."""
    from transformers import EsmForMaskedLM

    model = EsmForMaskedLM.from_pretrained(folder, dtype=dtype)
    return model.to(device).eval(), f"transformers {type(model).__name__} {str(dtype).removeprefix('torch.')} ({label})"


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
