"""`nv-esm proteingym` end to end over ProteinGym's 217 wild types, against ProteinGym's own ESM scoring loop.

    # the reference file (not committed; bench/data/ is git-ignored), from a clone of OATML-Markslab/ProteinGym:
    mkdir -p bench/data && git -C PROTEINGYM_CLONE show HEAD:reference_files/DMS_substitutions.csv \
        > bench/data/DMS_substitutions.csv
    # on one H100 (with Transformer Engine importable; OUT a folder):
    python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
        --variants bf16 fp8 fp8_current --checkpoint-cache /tmp/pg --out OUT/proteingym_650M.json
    python bench/proteingym_benchmark.py --shape 3B --reference bench/data/DMS_substitutions.csv --limit 20 \
        --variants bf16 fp8 --baseline-wild-types 2 --checkpoint-cache /tmp/pg --out OUT/proteingym_3B.json
    # on 1, 2 and 4 GPUs of one machine (the command under torchrun on more than one):
    python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
        --variants bf16 --gpus 1 2 4 --baseline-wild-types 0 --checkpoint-cache /tmp/pg --out OUT/proteingym_gpus.json
    # a small run, also on the CPU (the bundled tiny checkpoint, the 3 shortest wild types):
    python bench/proteingym_benchmark.py --quick --reference bench/data/DMS_substitutions.csv --out /tmp/pg.json

Expected (650M ~3e5 tokens/s in bf16 on an H100, bench/results/score_h100_2026-11-25; 3B ~4.4x its FLOPs per
token): 650M, all 217 rows (4.95e7 tokens): the command ~3 minutes per variant (random checkpoint ~1 minute unless
`--checkpoint-cache` has it; side by side ~1 minute). 3B: the whole file takes ~12-14 minutes, so `--limit 20`
(7.3e6 tokens, the first 20 rows) and the JSON's `projected_full_reference_seconds` (the whole file's tokens at the
run's tokens/s, start-up included, so an upper bound); checkpoint ~3 minutes, the command ~2.5, side by side ~2.

Workload: every row of `--reference` (ProteinGym's reference_files/DMS_substitutions.csv; `--limit N`: the first N
rows) gets a stand-in assay in ProteinGym's layout (`mutant`, `mutated_sequence`, `DMS_score`, `DMS_score_bin`):
one random single substitution at every position of its `target_seq`, then (`--mutants reference`, the default)
random rows up to the row's `DMS_number_single_mutants` singles and `DMS_number_multiple_mutants` multiples of 2
to 4 sites (2.47 million rows, ~1 GB of CSV for the whole file, as the real assays: reading them is part of the
timed command; `--mutants positions`: the first rows alone), random scores (seed `--seed`), so
`masked-marginals` masks every position of every wild type once (the command computes a wild type shared by several
assays once: 4.95e7 tokens for the 187 distinct wild types of the 217 rows; 5.75e7 counted per row). Weights: an
ESM-2 shape with random weights (`--shape`, seed 0, `random_checkpoint.py`), or `--model` (an NVEsm folder).

Timed: `python -m nv_esm proteingym CHECKPOINT REFERENCE ASSAYS OUT --methods masked-marginals` as a subprocess, per
variant: `bf16` (the command's default: bf16, CUDA graphs on Transformer Engine; on the CPU, fp32), `fp8`
(`--fp8 all`, block scaling: the command's default) and `fp8_current` (`--fp8 all --fp8-scaling current`). Wall
time from process start to exit (imports, model load, scoring, the assays' files, the summary and its plots),
tokens/s, masked copies, the process's peak GPU memory (nvidia-smi, polled every 0.2 s) and peak RSS; from the
command's own line after the scoring, rank 0's seconds of set-up (assays read while the model loads) and of scoring
(its last files written); and, its output read line by line as it comes (Python unbuffered), the seconds from the
start at which that line (`seconds_at_scored_line`) and the summary's (`seconds_at_summary_line`: then the plots
and the exit) appeared. Once per run, `import_seconds`: importing the command's modules (Transformer Engine where it
imports, `nv_esm.proteingym`) in a fresh Python process.

Side by side, on `--baseline-wild-types` K (3) distinct wild types under 1,022 residues drawn at random (seed):
- ProteinGym's loop (their baselines/esm/compute_fitness.py, masked-marginals: the tokens `<cls>` + wild type +
  `<eos>` at batch size 1, one forward per token position, that position alone masked, log-softmax over the
  vocabulary, a mutant's score log p(mt) - log p(wt) at its masked position) on transformers' `EsmForMaskedLM` with
  the same weights, bf16 on CUDA (fp32 on the CPU), after a few untimed forwards; then again in fp32 (ProteinGym
  runs fair-esm in fp32), timed too;
- ours: `nv_esm.proteingym_scoring.score_assays` on the model as the command loads it, in this process, after an
  untimed warm-up on the same assays (graph captures).
Agreement on those assays: Spearman (`nv_esm.rank_statistics.spearman`) of our bf16 (and fp8) scores against our
fp32 scores (fp32 weights, torch backend, no autocast; the issue's target: >= 0.999 per assay), and the largest
|difference| between our fp32 scores and the transformers loop's in fp32. Random weights give nearly flat
log-probabilities, so bf16 noise moves ranks more than it would with trained weights: the JSON also has the same
Spearman for the transformers loop (bf16 vs fp32) as the noise floor of the weights. And the largest |difference|
between the scores the command wrote for those assays and the API's here (packed with other copies there).

Everything goes to `--out` (JSON, rewritten after each step), and a short table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
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
from nv_esm.proteingym_scoring import Assay, mutated_sequence, score_assays
from nv_esm.rank_statistics import spearman
from nv_esm.shapes import ESM2_SHAPES

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "esm2_tiny"
VARIANTS = {
    "bf16": ("off", "block"),
    "fp8": ("all", "block"),
    "fp8_current": ("all", "current"),
}  # --fp8, --fp8-scaling
WINDOW_TOKENS = 1024  # ESM-2's window: ProteinGym's model_window, and the longest protein of the baseline + 2
QUICK_ROWS = 3
MODEL_NAME = "bench"  # the command's --model-name: its score column


def read_reference(path: Path, limit: int | None, quick: bool) -> tuple[list[str], list[dict[str, str]]]:
    """(columns, rows) of the reference: the first `limit` rows; with `quick`, the `QUICK_ROWS` shortest of those."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        columns = list(reader.fieldnames or [])
    missing = [name for name in ("DMS_id", "DMS_filename", "target_seq") if name not in columns]
    if missing:
        raise SystemExit(f"{path} has no column {missing[0]!r}: not ProteinGym's DMS_substitutions.csv")
    rows = rows[:limit]
    if quick:
        rows = sorted(rows, key=lambda row: len(row["target_seq"]))[:QUICK_ROWS]
    return columns, rows


def stand_in_mutants(wild_type: str, generator: random.Random, row: dict[str, str] | None = None) -> list[str]:
    """One random single substitution at every position of `wild_type` (ProteinGym's notation, 1-based); with the
    reference `row` (`--mutants reference`), then as many more random rows as its assay has
    (`DMS_number_single_mutants` singles, `DMS_number_multiple_mutants` of 2 to 4 sites, ':'-joined), so the
    files are as large as the real ones while the masked copies stay one per position."""

    def substitution(position: int) -> str:
        letter = wild_type[position]
        return f"{letter}{position + 1}{generator.choice([a for a in STANDARD_AMINO_ACIDS if a != letter])}"

    mutants = [substitution(i) for i in range(len(wild_type))]
    if row is None:
        return mutants
    singles = max(0, int(row.get("DMS_number_single_mutants") or 0) - len(wild_type))
    mutants += [substitution(generator.randrange(len(wild_type))) for _ in range(singles)]
    for _ in range(int(row.get("DMS_number_multiple_mutants") or 0)):
        sites = generator.sample(range(len(wild_type)), min(len(wild_type), generator.randint(2, 4)))
        mutants.append(":".join(substitution(position) for position in sorted(sites)))
    return mutants


def write_assays(
    columns: list[str], rows: list[dict[str, str]], folder: Path, seed: int, reference_counts: bool = False
) -> dict[str, list[str]]:
    """The reference's `rows` as `folder/reference.csv` and one stand-in assay per row in `folder/assays/`
    (`mutant`, `mutated_sequence`, `DMS_score` ~ N(0, 1), `DMS_score_bin`: above 0, the scores' median: the row's
    `DMS_binarization_cutoff` is on its assay's own scale, where N(0, 1) scores can all fall on one side; with
    `reference_counts`, the row's numbers of mutants: `stand_in_mutants`); {DMS_id: its mutants}."""
    generator = random.Random(seed)
    (folder / "assays").mkdir(parents=True)
    mutants_of = {}
    for row in rows:
        wild_type = row["target_seq"]
        mutants = stand_in_mutants(wild_type, generator, row if reference_counts else None)
        mutants_of[row["DMS_id"]] = mutants
        variants = scoring.parse_mutants(mutants, wild_type, mutants)
        with (folder / "assays" / row["DMS_filename"]).open("w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"])
            for mutant, substitutions in zip(mutants, variants):
                score = generator.gauss(0, 1)
                mutated = mutated_sequence(wild_type, substitutions)
                writer.writerow([mutant, mutated, repr(score), int(score > 0)])
    with (folder / "reference.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return mutants_of


def workload(rows: list[dict[str, str]], window: int = WINDOW_TOKENS) -> dict[str, int]:
    """What `masked-marginals` runs: one masked copy per position of each distinct wild type (the command computes a
    wild type shared by several assays once), min(L + 2, window) tokens each (ProteinGym's optimal window)."""
    distinct = {row["target_seq"] for row in rows}
    return {
        "assays": len(rows),
        "distinct_wild_types": len(distinct),
        "masked_copies": sum(map(len, distinct)),
        "tokens": sum(len(s) * min(len(s) + 2, window) for s in distinct),
        "tokens_per_row": sum(len(r["target_seq"]) * min(len(r["target_seq"]) + 2, window) for r in rows),
    }


def gpu_memory_used() -> list[int] | None:
    """MiB in use on each GPU (nvidia-smi), or None without it."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split()
        return [int(line) for line in lines]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class GpuMemoryPoll:
    """The largest rise (GB) of the GPUs' used memory over what they held when it started, polled every 0.2 s with
    nvidia-smi (device-wide: a container's process ids need not match nvidia-smi's); None without nvidia-smi. This
    process holds no CUDA memory while the command runs."""

    def __init__(self) -> None:
        self.before, self.peak, self.done = gpu_memory_used(), None, threading.Event()
        self.thread = None
        if self.before:
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()

    def _poll(self) -> None:
        while not self.done.wait(0.2):
            used = gpu_memory_used()
            if used and len(used) == len(self.before):
                rise = max(now - then for now, then in zip(used, self.before)) / 1024
                self.peak = max(self.peak or 0.0, rise)

    def stop(self) -> float | None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
        return self.peak


FINAL_LINES = {  # the command's last two lines: scoring done (assays written), summary written
    "seconds_at_scored_line": lambda line: "assays (" in line,
    "seconds_at_summary_line": lambda line: line.startswith("average Spearman"),
}
IMPORT_TIMING = """import time
start = time.perf_counter()
try:
    import transformer_engine.pytorch
except Exception:  # not importable (the CPU): the command runs without it
    pass
import nv_esm.proteingym
print(time.perf_counter() - start)
"""


def logged_run(command: list[str], log: Path) -> tuple[int, float, resource.struct_rusage, dict[str, float | None]]:
    """Run `command` (Python unbuffered), its stdout and stderr copied line by line to `log` by a thread: (exit
    status, wall seconds, its resource usage from os.wait4, the seconds from its start at which each of
    `FINAL_LINES` first appeared, None where none did)."""
    seen: dict[str, float | None] = dict.fromkeys(FINAL_LINES)
    with log.open("w", encoding="utf-8") as handle:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"}, encoding="utf-8",
                                   errors="replace")  # fmt: skip

        def copy() -> None:
            for line in process.stdout:
                now = time.perf_counter() - start
                handle.write(line)
                for key, matches in FINAL_LINES.items():
                    if seen[key] is None and matches(line):
                        seen[key] = now

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        reader.join()
        process.stdout.close()
    return process.returncode, seconds, usage, seen


def import_seconds() -> float:
    """Seconds to import the command's modules (Transformer Engine where it imports, `nv_esm.proteingym`) in a
    fresh Python process."""
    done = subprocess.run([sys.executable, "-c", IMPORT_TIMING], capture_output=True, text=True, cwd=ROOT, check=True)
    return float(done.stdout.split()[-1])


def time_command(args: argparse.Namespace, checkpoint: Path, folder: Path, variant: str, gpus: int = 1) -> dict:
    """Run `nv-esm proteingym` on the stand-in assays as a subprocess (under torchrun on `gpus` GPUs where more
    than one): wall seconds, when its last two lines appeared (`FINAL_LINES`), its peak GPU memory (the most on
    one GPU) and RSS (the largest process's)."""
    output = folder / (f"out_{variant}" if gpus == 1 else f"out_{variant}_{gpus}gpu")
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"] if gpus > 1 else []
    command = [sys.executable, *launcher, "-m", "nv_esm", "proteingym", str(checkpoint), str(folder / "reference.csv"),
               str(folder / "assays"), str(output), "--methods", "masked-marginals", "--fp8", VARIANTS[variant][0],
               "--fp8-scaling", VARIANTS[variant][1],
               "--tokens-per-batch", str(args.tokens_per_batch), "--no-progress",
               "--model-name", MODEL_NAME]  # fmt: skip
    if args.device_given:
        command += ["--device", args.device]
    log = folder / f"log_{variant}_{gpus}gpu.txt"
    poll = GpuMemoryPoll()
    returncode, seconds, usage, seen = logged_run(command, log)
    peak_gpu = poll.stop()
    text = log.read_text()
    if returncode != 0:
        raise SystemExit(f"nv-esm proteingym ({variant}) exited with {returncode}:\n{text[-4000:]}")
    written = sorted(output.glob("*.csv"))
    phases = re.search(r"in ([\d.]+) s(?: on rank 0)?\b.* after ([\d.]+) s of set-up", text)  # the command's own timing
    return {
        "command": " ".join(command),
        "seconds": seconds,
        "rank0_scoring_seconds": float(phases[1]) if phases else None,
        "rank0_set_up_seconds": float(phases[2]) if phases else None,  # reading the assays, loading the model
        **seen,  # from the start: scoring (and writing) done; the summary written (then its plots, the exit)
        "assay_files_written": len(written),
        "peak_gpu_gb": peak_gpu,
        "peak_rss_gb": usage.ru_maxrss / 2**20,  # KiB on Linux
        "log_tail": text[-600:],
    }


@torch.no_grad()
def proteingym_loop(model, tokenizer, wild_type: str, positions: int | None = None) -> torch.Tensor:
    """ProteinGym's masked-marginals loop (compute_fitness.py): `[L + 2, vocab]` log-probabilities, row i from the
    forward of the tokens with token i alone masked, batch size 1 (`positions`: the first few rows only)."""
    tokens = torch.tensor([tokenizer(wild_type)["input_ids"]], device=model.device)
    rows = []
    for i in range(tokens.shape[1] if positions is None else positions):
        masked = tokens.clone()
        masked[0, i] = tokenizer.mask_token_id
        rows.append(model(input_ids=masked).logits.float().log_softmax(-1)[0, i])
    return torch.stack(rows)


def label_scores(log_probs: torch.Tensor, tokenizer, mutants: list[str]) -> torch.Tensor:
    """ProteinGym's label_row: per mutant, the sum over its substitutions of log p(mt) - log p(wt) at the
    substitution's token (`[M]` float64)."""
    vocab = tokenizer.get_vocab()
    host = log_probs.double().cpu()

    def score(mutant: str) -> float:
        sites = [(int(part[1:-1]), part[0], part[-1]) for part in mutant.split(":")]
        return sum((host[i, vocab[mt]] - host[i, vocab[wt]]).item() for i, wt, mt in sites)

    return torch.tensor([score(mutant) for mutant in mutants], dtype=torch.float64)


def command_scores(path: Path) -> torch.Tensor:
    """The `masked-marginals` column (`bench`, `--model-name`) of an assay file the command wrote (`[M]` float64)."""
    with path.open(newline="") as handle:
        return torch.tensor([float(row[MODEL_NAME]) for row in csv.DictReader(handle)], dtype=torch.float64)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, function, *args, **kwargs):
    """(result, seconds, peak GPU GB or None)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    return result, time.perf_counter() - start, peak


@contextlib.contextmanager
def no_autocast():
    """`nv_esm.scoring` without its bf16 autocast on CUDA: the fp32 weights run in fp32."""
    saved = scoring.inference_autocast
    scoring.inference_autocast = lambda device: contextlib.nullcontext()
    try:
        yield
    finally:
        scoring.inference_autocast = saved


def baseline_subset(rows: list[dict[str, str]], k: int, seed: int) -> list[dict[str, str]]:
    """`k` rows of distinct wild types under 1,022 residues (the first row of each), drawn at random."""
    first: dict[str, dict[str, str]] = {}
    for row in rows:
        if len(row["target_seq"]) <= WINDOW_TOKENS - 2:
            first.setdefault(row["target_seq"], row)
    candidates = list(first.values())
    return random.Random(seed).sample(candidates, min(k, len(candidates)))


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def side_by_side(args, checkpoint: Path, hf_folder: Path, work: Path, subset, mutants_of, summary: dict) -> None:
    """ProteinGym's loop (transformers) and `score_assays` on the subset: times, speed-up, agreement (also of the
    command's written scores, `work/out_<variant>/`, with the API's in this process)."""
    from transformers import EsmForMaskedLM, EsmTokenizer

    device = torch.device(args.device)
    if device.type == "cuda" and transformer_engine_available():
        import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
    tokenizer = EsmTokenizer.from_pretrained(checkpoint)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = [row["DMS_id"] for row in subset]
    wild_types = [row["target_seq"] for row in subset]
    part = summary["baseline"] = {
        "assays": ids,
        "residues": [len(w) for w in wild_types],
        "transformers_forwards": sum(len(w) + 2 for w in wild_types),
        "our_masked_copy_tokens": sum(len(w) * (len(w) + 2) for w in wild_types),
    }

    def their_scores(model):
        loops = (proteingym_loop(model, tokenizer, wild_type) for wild_type in wild_types)
        return [label_scores(log_probs, tokenizer, mutants_of[i]) for log_probs, i in zip(loops, ids)]

    reference = EsmForMaskedLM.from_pretrained(hf_folder, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    proteingym_loop(reference, tokenizer, wild_types[0], positions=8)  # warm-up
    theirs, seconds, peak = timed(device, their_scores, reference)
    part["transformers_loop"] = {"precision": str(dtype).removeprefix("torch."), "seconds": seconds, "peak_gb": peak}
    del reference
    free(device)
    reference = EsmForMaskedLM.from_pretrained(hf_folder, attn_implementation="sdpa", dtype=torch.float32)
    theirs_fp32, seconds, peak = timed(device, their_scores, reference.to(device).eval())
    part["transformers_loop_fp32"] = {"seconds": seconds, "peak_gb": peak}  # ProteinGym runs fair-esm in fp32
    del reference
    free(device)
    write(args.out, summary)

    def assays():
        return [Assay(i, w, mutants_of[i]) for i, w in zip(ids, wild_types)]

    def ours(model):
        results = score_assays(model, tokenizer, assays(), max_tokens_per_batch=args.tokens_per_batch)
        return [results[i]["masked-marginals"] for i in ids]

    config = load_config(str(checkpoint))
    backend = modeling_nv_esm.resolve_backend("auto", device).name
    scores = {}
    for variant in args.variants:
        fp8, fp8_scaling = VARIANTS[variant]
        model = load_model(str(checkpoint), config, backend, fp8, True, device, masked_lm=True, progress=False,
                           fp8_scaling=fp8_scaling)  # fmt: skip
        ours(model)  # warm-up: graph captures, cuDNN plans
        scores[variant], seconds, peak = timed(device, ours, model)
        loop = part["transformers_loop"]["seconds"]
        loop_fp32 = part["transformers_loop_fp32"]["seconds"]
        part[f"ours_{variant}"] = {"seconds": seconds, "peak_gb": peak, "x_transformers_loop": loop / seconds,
                                   "x_transformers_loop_fp32": loop_fp32 / seconds}  # fmt: skip
        del model
        free(device)
        write(args.out, summary)
    model = modeling_nv_esm.NVEsmForMaskedLM.from_pretrained(
        checkpoint, dtype=torch.float32, backend="torch", cuda_graphs=False, check_inputs=False
    )
    with no_autocast():
        fp32 = ours(model.to(device).eval())
    del model
    free(device)

    agreement = summary["agreement"] = {"per_assay": {}}
    for k, dms_id in enumerate(ids):
        entry = agreement["per_assay"][dms_id] = {
            "ours_fp32_vs_transformers_fp32_max_abs_diff": (fp32[k] - theirs_fp32[k]).abs().max().item(),
            "transformers_loop_vs_fp32_spearman": spearman(theirs[k].numpy(), theirs_fp32[k].numpy()),
        }
        for variant in args.variants:
            entry[f"ours_{variant}_vs_fp32_spearman"] = spearman(scores[variant][k].numpy(), fp32[k].numpy())
            written = command_scores(work / f"out_{variant}" / f"{dms_id}.csv")
            entry[f"command_{variant}_vs_api_max_abs_diff"] = (written - scores[variant][k]).abs().max().item()
        if "bf16" in scores:
            entry["ours_bf16_vs_transformers_loop_max_abs_diff"] = (scores["bf16"][k] - theirs[k]).abs().max().item()
    values = agreement["per_assay"].values()
    for variant in args.variants:
        found = [v[f"ours_{variant}_vs_fp32_spearman"] for v in values]
        agreement[f"ours_{variant}_vs_fp32_spearman_min"] = min((v for v in found if v is not None), default=None)
    for variant in args.variants:
        key = f"command_{variant}_vs_api_max_abs_diff"
        agreement[key] = max(v[key] for v in values)
    agreement["ours_fp32_vs_transformers_fp32_max_abs_diff"] = max(
        v["ours_fp32_vs_transformers_fp32_max_abs_diff"] for v in values
    )


def versions() -> dict:
    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        import transformers

        found["transformers"] = transformers.__version__
    if torch.cuda.is_available() and transformer_engine_available():
        import transformer_engine

        found["transformer_engine"] = transformer_engine.__version__
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="an NVEsm masked-LM folder (default with --quick: assets/esm2_tiny)")
    source.add_argument("--shape", choices=sorted(ESM2_SHAPES), help="an ESM-2 shape with random weights (seed 0)")
    parser.add_argument("--reference", type=Path, required=True, help="ProteinGym's DMS_substitutions.csv")
    parser.add_argument("--limit", type=int, help="the first N rows of the reference only")
    parser.add_argument("--quick", action="store_true", help=f"the {QUICK_ROWS} shortest rows, 2 baseline wild types")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: bf16 (fp8 needs CUDA)")
    parser.add_argument("--baseline-wild-types", type=int, default=3, help="K of the side-by-side subset")
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    parser.add_argument("--checkpoint-cache", type=Path, help="keep the random checkpoint here, reuse it if there")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1], help="the command on 1 and more GPUs (torchrun)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mutants",
        choices=("positions", "reference"),
        default="reference",
        help="stand-in assays: one substitution per position, or as many rows as the reference row's assay has",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/proteingym_benchmark.json"))
    args = parser.parse_args(argv)
    args.device_given = args.device is not None  # else the command picks its own default device too
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.variants = list(dict.fromkeys(args.variants or ["bf16"]))
    if any(VARIANTS[v][0] != "off" for v in args.variants) and args.device == "cpu":
        parser.error("--variants fp8 and fp8_current need a CUDA device")
    if args.quick:
        args.baseline_wild_types = min(args.baseline_wild_types, 2)
    if args.model is None and args.shape is None:
        if not args.quick:
            parser.error("name --model or --shape (--quick defaults to assets/esm2_tiny)")
    with tempfile.TemporaryDirectory() as work:
        run(args, Path(work))


def checkpoint_folders(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """(the NVEsm folder, the transformers folder of the same weights)."""
    if args.shape:
        cache = (args.checkpoint_cache or work) / args.shape
        if not (cache / "complete").is_file():  # written last: a run killed while writing leaves none
            shutil.rmtree(cache, ignore_errors=True)
            random_checkpoint(args.shape, cache)
            (cache / "complete").touch()
        return cache / "nv", cache / "hf"
    if args.model is None:  # --quick: the bundled tiny transformers checkpoint, converted
        assert convert_checkpoint.main(["hf-to-te", str(TINY), str(work / "nv")]) == 0
        return work / "nv", TINY
    assert convert_checkpoint.main(["te-to-hf", str(args.model), str(work / "hf")]) == 0
    return args.model, work / "hf"


def run(args: argparse.Namespace, work: Path) -> None:
    columns, rows = read_reference(args.reference, args.limit, args.quick)
    mutants_of = write_assays(columns, rows, work / "data", args.seed, args.mutants == "reference")
    device = torch.device(args.device)
    summary = {
        "device": None,  # named after the command's runs: this process touches no GPU before them
        "model": f"ESM-2 {args.shape}, random weights" if args.shape else str(args.model or TINY),
        "reference": str(args.reference),
        "workload": workload(rows),
        "stand_in_assays": {"mutants": args.mutants, "rows": sum(map(len, mutants_of.values()))},
        "full_reference_workload": workload(read_reference(args.reference, None, False)[1]),
        "tokens_per_batch": args.tokens_per_batch,
        "variants": {},
    }
    started = time.perf_counter()
    checkpoint, hf_folder = checkpoint_folders(args, work)
    summary["checkpoint_seconds"] = time.perf_counter() - started
    summary["import_seconds"] = import_seconds()  # of the command's start-up, in a fresh process
    tokens = summary["workload"]["tokens"]
    for variant in args.variants:
        for gpus in args.gpus:
            result = time_command(args, checkpoint, work / "data", variant, gpus)
            result["tokens_per_s"] = tokens / result["seconds"]
            full = summary["full_reference_workload"]["tokens"]
            result["projected_full_reference_seconds"] = full / result["tokens_per_s"]
            one = summary["variants"].get(variant)
            if gpus > 1 and one:
                result["speedup_vs_one_gpu"] = one["seconds"] / result["seconds"]
            summary["variants"][variant if gpus == 1 else f"{variant}_{gpus}gpu"] = result
            write(args.out, summary)  # after each step: a run cut short keeps what it measured
    summary["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary["versions"] = versions()
    write(args.out, summary)
    if args.baseline_wild_types > 0:
        subset = baseline_subset(rows, args.baseline_wild_types, args.seed)
        side_by_side(args, checkpoint, hf_folder, work / "data", subset, mutants_of, summary)
    write(args.out, summary)
    print_table(summary)


def print_table(summary: dict) -> None:
    load = summary["workload"]
    print(f"{summary['device']}, {summary['model']}: {load['assays']} assays, {load['distinct_wild_types']} wild types,"
          f" {load['masked_copies']:,} masked copies, {load['tokens']:,} tokens")  # fmt: skip
    print(f"{'variant':<11} {'seconds':>9} {'tokens/s':>11} {'GPU GB':>7} {'full file s':>11}")
    for name, v in summary["variants"].items():
        gpu = "-" if v["peak_gpu_gb"] is None else f"{v['peak_gpu_gb']:.1f}"
        print(f"{name:<11} {v['seconds']:>9.1f} {v['tokens_per_s']:>11,.0f} {gpu:>7} "
              f"{v['projected_full_reference_seconds']:>11.0f}")  # fmt: skip
    base = summary.get("baseline")
    if base:
        print(f"subset {base['assays']} ({base['residues']} residues): ProteinGym loop "
              f"{base['transformers_loop']['seconds']:.2f} s ({base['transformers_loop']['precision']}), "
              f"{base['transformers_loop_fp32']['seconds']:.2f} s (float32)")  # fmt: skip
        for key, v in base.items():
            if key.startswith("ours_"):
                print(f"  {key}: {v['seconds']:.2f} s, {v['x_transformers_loop']:.1f}x the loop "
                      f"({v['x_transformers_loop_fp32']:.1f}x its float32 run)")  # fmt: skip
        agreement = summary["agreement"]
        for key, value in agreement.items():
            if key != "per_assay":
                print(f"  {key}: {value}")


def write(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
