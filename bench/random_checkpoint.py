"""A random-weight ESM-2 checkpoint for the benchmarks (no download): transformers' `EsmForMaskedLM` of an ESM-2
shape, seed 0, saved with the bundled tokenizer files and converted to an NVEsm folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import convert_checkpoint
from nv_esm.shapes import ESM2_SHAPES, esm2_config

TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "esm2_tiny"


def random_checkpoint(shape: str, work: Path) -> tuple[torch.nn.Module, Path]:
    """(transformers' `EsmForMaskedLM` of `shape` with random weights, its NVEsm folder): `work/hf` and `work/nv`."""
    from transformers import EsmForMaskedLM

    torch.manual_seed(0)
    reference = EsmForMaskedLM(esm2_config(**ESM2_SHAPES[shape]))
    reference.save_pretrained(work / "hf")
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, work / "hf" / name)
    assert convert_checkpoint.main(["hf-to-te", str(work / "hf"), str(work / "nv")]) == 0
    return reference, work / "nv"
