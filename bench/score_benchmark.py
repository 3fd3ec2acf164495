"""Speed of `nv_esm.scoring` (what `nv-esm score` runs) vs a transformers loop written as users write it.

    python bench/score_benchmark.py --model ./esm2_650M_te --out bench/results/score_h100.json
    python bench/score_benchmark.py --shape 650M --out bench/results/score_h100.json   # random weights, no download
    python bench/score_benchmark.py --model ./esm2_nv --quick          # a small run; also on the CPU

Two workloads, on random sequences:
  pll   the pseudo-log-likelihood of `--proteins` proteins (500; lengths log-normal, median 270 residues, sigma 0.7,
        clipped to 10..window): every residue masked in turn, L copies per protein.
  scan  the masked marginals of a `--scan-rows` scan (5,000) of one `--scan-length` protein (300 residues): 76% single
        mutants (all 19 substitutions at as many sites as that takes) and 24% random double mutants.

Reference: transformers' `EsmForMaskedLM` holding the same weights (the `--model` folder converted back with
`nv-esm convert te-to-hf`), attn_implementation="sdpa", bf16 on CUDA (fp32 on the CPU), the masked copies in padded
batches of `--reference-batch` (32): for the PLL, a protein's L copies; for the scan, one copy per row with the
row's positions masked. Log-softmax in fp32 over the full vocabulary, as `nv_esm.scoring` does.

Ours: `nv_esm.scoring.pseudo_log_likelihood` / `score_variants(method="masked_marginal")` on the model as
`nv-esm score` loads it (bf16 weights on CUDA, no data-dependent input checks), per variant: `nv` (CUDA graphs on
Transformer Engine, the default), `nv_eager` (`cuda_graphs=False`), `nv_fp8` (every layer FP8 with the scaling
`nv-esm score` uses by default, block scaling; graphs). Each timed run follows an untimed warm-up on a slice of the
same workload (captures, cuDNN plans). The JSON has seconds, proteins/s or rows/s, the speed-up over the reference
loop, peak GPU memory, and the largest difference of our PLLs / scores from the reference's (bf16 noise on the GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch
from random_checkpoint import random_checkpoint  # bench/random_checkpoint.py, beside this script

import convert_checkpoint
import modeling_nv_esm
from modeling_nv_esm_layers import transformer_engine_available
from nv_esm import scoring
from nv_esm.alphabet import STANDARD_AMINO_ACIDS
from nv_esm.embed_model import load_config, load_model
from nv_esm.shapes import ESM2_SHAPES

VARIANTS = {"nv": ("off", True), "nv_eager": ("off", False), "nv_fp8": ("all", True)}  # name: (fp8, cuda graphs)


def workloads(args: argparse.Namespace, window: int) -> tuple[list[str], str, list[str]]:
    """(the PLL's proteins, the scan's wild type, the scan's mutants), from `--seed`."""
    generator = random.Random(args.seed)
    lengths = [
        min(max(round(math.exp(math.log(args.median_length) + 0.7 * generator.gauss(0, 1))), 10), window)
        for _ in range(args.proteins)
    ]
    proteins = ["".join(generator.choices(STANDARD_AMINO_ACIDS, k=length)) for length in lengths]
    wild_type = "".join(generator.choices(STANDARD_AMINO_ACIDS, k=args.scan_length))
    sites = min(args.scan_length, round(0.76 * args.scan_rows / 19))
    mutants = [
        f"{wild_type[site]}{site + 1}{letter}"
        for site in sorted(generator.sample(range(args.scan_length), sites))
        for letter in STANDARD_AMINO_ACIDS
        if letter != wild_type[site]
    ][: args.scan_rows]
    doubles: set[str] = set()
    while len(mutants) + len(doubles) < args.scan_rows:
        first, second = sorted(generator.sample(range(args.scan_length), 2))
        changes = [
            (p, generator.choice([a for a in STANDARD_AMINO_ACIDS if a != wild_type[p]])) for p in (first, second)
        ]
        doubles.add(":".join(f"{wild_type[p]}{p + 1}{a}" for p, a in changes))
    return proteins, wild_type, mutants + sorted(doubles)


@torch.no_grad()
def reference_log_probs(model, copies: torch.Tensor, batch: int):
    """`[C, S, vocab]` is too much to keep: yields (first copy, `[b, S, vocab]` fp32 log-probabilities) per batch."""
    for start in range(0, len(copies), batch):
        chunk = copies[start : start + batch].to(model.device)
        yield start, model(input_ids=chunk, attention_mask=torch.ones_like(chunk)).logits.float().log_softmax(-1)


def reference_pll(model, tokenizer, proteins: list[str], batch: int) -> list[float]:
    plls = []
    for protein in proteins:
        ids = torch.tensor(tokenizer(protein)["input_ids"])
        length = len(protein)
        copies = ids.repeat(length, 1)
        copies[torch.arange(length), torch.arange(length) + 1] = tokenizer.mask_token_id
        total = 0.0
        for start, log_probs in reference_log_probs(model, copies, batch):
            rows = torch.arange(len(log_probs), device=log_probs.device)
            total += log_probs[rows, rows + start + 1, ids[rows.cpu() + start + 1].to(log_probs.device)].sum().item()
        plls.append(total)
    return plls


def reference_scan(model, tokenizer, wild_type: str, mutants: list[str], batch: int) -> list[float]:
    ids = torch.tensor(tokenizer(wild_type)["input_ids"])
    parsed = [[(m[0], int(m[1:-1]), m[-1]) for m in mutant.split(":")] for mutant in mutants]
    copies = ids.repeat(len(mutants), 1)
    for row, changes in enumerate(parsed):
        copies[row, [position for _, position, _ in changes]] = tokenizer.mask_token_id  # position + 1 - 1 (<cls>)
    scores = []
    vocab = tokenizer.get_vocab()
    for start, log_probs in reference_log_probs(model, copies, batch):
        host = log_probs.cpu()
        for offset, changes in enumerate(parsed[start : start + len(host)]):
            scores.append(
                sum((host[offset, p, vocab[new]] - host[offset, p, vocab[old]]).item() for old, p, new in changes)
            )
    return scores


def timed(device: torch.device, function, *args, **kwargs):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    return result, time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an NVEsm masked-LM folder (nv-esm convert hf-to-te)")
    source.add_argument("--shape", choices=sorted(ESM2_SHAPES), help="an ESM-2 shape with random weights (seed 0)")
    parser.add_argument("--quick", action="store_true", help="8 proteins (median 40) and a 100-row scan of 40")
    parser.add_argument("--proteins", type=int, default=500)
    parser.add_argument("--median-length", type=int, default=270)
    parser.add_argument("--scan-rows", type=int, default=5000)
    parser.add_argument("--scan-length", type=int, default=300)
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    parser.add_argument("--reference-batch", type=int, default=32)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all on CUDA, nv on the CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/score_benchmark.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        if args.shape:
            args.model = str(random_checkpoint(args.shape, Path(work))[1])
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.quick:
        args.proteins, args.median_length, args.scan_rows, args.scan_length = 8, 40, 100, 40
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and transformer_engine_available():
        import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
    from transformers import EsmForMaskedLM, EsmTokenizer

    variants = args.variants or (list(VARIANTS) if device.type == "cuda" else ["nv"])
    config = load_config(args.model)
    window = scoring.default_window(config)
    proteins, wild_type, mutants = workloads(args, window)
    tokenizer = EsmTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": str(args.model),
        "pll": {
            "proteins": len(proteins),
            "residues": sum(map(len, proteins)),
            "masked_copy_tokens": sum(len(p) * (len(p) + 2) for p in proteins),
        },  # fmt: skip
        "scan": {"rows": len(mutants), "doubles": sum(":" in m for m in mutants), "wild_type_residues": len(wild_type)},
        "tokens_per_batch": args.tokens_per_batch,
        "reference_batch": args.reference_batch,
        "variants": {},
    }

    with tempfile.TemporaryDirectory() as work:
        assert convert_checkpoint.main(["te-to-hf", str(args.model), f"{work}/hf"]) == 0
        reference = EsmForMaskedLM.from_pretrained(f"{work}/hf", attn_implementation="sdpa", dtype=dtype)
    reference = reference.to(device).eval()
    reference_pll(reference, tokenizer, proteins[:2], args.reference_batch)  # warm-up
    expected_pll, seconds_pll, peak_pll = timed(
        device, reference_pll, reference, tokenizer, proteins, args.reference_batch
    )
    expected_scan, seconds_scan, peak_scan = timed(
        device, reference_scan, reference, tokenizer, wild_type, mutants, args.reference_batch
    )
    summary["variants"]["transformers_loop"] = {
        "pll_seconds": seconds_pll, "pll_proteins_per_s": len(proteins) / seconds_pll, "pll_peak_gb": peak_pll,
        "scan_seconds": seconds_scan, "scan_rows_per_s": len(mutants) / seconds_scan, "scan_peak_gb": peak_scan,
    }  # fmt: skip
    write(args.out, summary)
    del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()

    backend = modeling_nv_esm.resolve_backend("auto", device).name
    for name in variants:
        fp8, graphs = VARIANTS[name]
        model = load_model(args.model, config, backend, fp8, graphs, device, masked_lm=True)
        options = {"max_tokens_per_batch": args.tokens_per_batch}
        scoring.pseudo_log_likelihood(model, proteins[: max(1, len(proteins) // 10)], tokenizer, **options)  # warm-up
        scoring.score_variants(model, wild_type, mutants[: max(1, len(mutants) // 10)], tokenizer, **options)
        plls, pll_seconds, pll_peak = timed(
            device, scoring.pseudo_log_likelihood, model, proteins, tokenizer, **options
        )
        scores, scan_seconds, scan_peak = timed(
            device, scoring.score_variants, model, wild_type, mutants, tokenizer, **options
        )
        pll_error = max(abs(ours.pll - theirs) for ours, theirs in zip(plls, expected_pll))
        scan_error = (scores - torch.tensor(expected_scan, dtype=torch.float64)).abs().max().item()
        summary["variants"][name] = {
            "pll_seconds": pll_seconds, "pll_proteins_per_s": len(proteins) / pll_seconds, "pll_peak_gb": pll_peak,
            "pll_x_transformers_loop": seconds_pll / pll_seconds, "pll_max_abs_diff": pll_error,
            "scan_seconds": scan_seconds, "scan_rows_per_s": len(mutants) / scan_seconds, "scan_peak_gb": scan_peak,
            "scan_x_transformers_loop": seconds_scan / scan_seconds, "scan_max_abs_diff": scan_error,
        }  # fmt: skip
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(args.out, summary)  # after each variant: a run cut short keeps what it measured
    print(json.dumps(summary, indent=1))


def write(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
