"""Whole jobs as a user runs them: each `nv-esm` command beside the careful transformers script that does the same
job (`bench/baselines/`: sorted by length, token-budget batches, bf16, sdpa), each a fresh process from its start to
its written file, in one run on one GPU; then the in-process case and the model's own speed on the jobs' batches.

    python bench/job_benchmark.py --out OUT/jobs                          # everything (650M; ~12 min on an H200)
    python bench/job_benchmark.py --jobs embed_2k scan_5k --sides nv --no-in-process --no-steady --out /tmp/jobs
    python bench/job_benchmark.py --no-jobs --in-process default eager --no-steady --out /tmp/loop   # a part

Weights: ESM-2 `--shape` with random weights made by transformers (seed 0) and converted by `nv-esm convert`
(`random_checkpoint.py`; `--work` keeps them between runs). Workload (seeded, `inference_scaling.write_workload`'s
draw: log-normal lengths around 270 residues, at most 1,022):
- `embed_2k`, `embed_20k`: `nv-esm embed CKPT proteins.fasta OUT` (mean over residues, the last layer) vs
  `hf_embed.py` (the same means, one safetensors file), the first 2,000 / all 20,000 proteins;
- `pll_60`: `nv-esm score CKPT pll.fasta OUT.csv` (every position masked once) vs `hf_pll.py`, 60 proteins;
- `scan_5k`: `nv-esm score CKPT wild_type.fasta OUT.csv --mutants mutants.csv` (masked marginals) vs `hf_scan.py`,
  5,000 single substitutions of a 300-residue wild type;
- `proteingym`: `nv-esm proteingym CKPT reference.csv assays/ OUT` (masked-marginals) vs `hf_proteingym.py`, on
  `--assays` stand-in assays (`proteingym_benchmark.write_assays`: random wild types of the same lengths, every
  position substituted once plus random single and 2-4 site mutants, 4,000 rows each).
Each process's wall time (start to exit), after an untimed run of each side's first job (`--warm-up`), and, for
nv-esm, its `time:` line (where the time went: start-up, input,
load, batches with the first result and the CUDA graph captures, writing).

In process (`--in-process`): a fresh process per variant that loads the model with `from_pretrained` and runs 100
batches of 1-64 random-length proteins in a user's own loop (tokenizer, padded batch, forward, mean over residues,
`.cpu()`): `default` (NVEsm as loaded), `eager` (`cuda_graphs=False`) and `transformers` (`EsmModel`, bf16, sdpa).
Seconds to load, to the first result and for the whole loop.

The model's own speed (`--steady`): in one process, the model as `nv-esm embed` loads it, run on the embed job's
batches (the proteins of each 1,000-protein shard sorted by length and packed to 16,384 tokens, as the command packs
them; inputs on the GPU before timing; the first 10 shards), a warm pass then a timed one; and the PLL job's masked
copies (its first 30 proteins), the same way.
This is the throughput the commands' batches phase is measured against (`batches_vs_model`).

Writes OUT/job_benchmark.json (after each step) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "bench" / "baselines"
TIME_LINE = re.compile(r"^time: (.*)$", re.MULTILINE)
BATCHES = re.compile(r"batches ([\d.]+) s \(([^)]*)\)")
TOKENS = re.compile(r"([\d,]+) tokens")
FIRST = re.compile(r"first result at ([\d.]+) s")
CAPTURES = re.compile(r"(\d+) CUDA graph captures ([\d.]+) s")
PHASE = re.compile(r"(start-up|input|load|batches|writing|other) ([\d.]+) s")
JOBS = ("embed_2k", "embed_20k", "pll_60", "scan_5k", "proteingym")
IN_PROCESS = ("default", "eager", "transformers")
BUDGET = 16384  # tokens per batch: the commands' default and the baselines'
SHARD = 1000  # nv-esm embed's default --shard-size


def parse_time_line(text: str) -> dict | None:
    """The phases of an nv-esm command's `time:` line: seconds per phase, tokens, first result, captures."""
    found = TIME_LINE.findall(text)
    if not found:
        return None
    line = found[-1]
    phases = PHASE.findall(re.sub(r"\([^)]*\)", "", line))  # the batches' details left out
    result: dict = {"line": line, "phases": {name: float(seconds) for name, seconds in phases}}
    batches = BATCHES.search(line)
    if batches:
        details = batches[2]
        result["tokens"] = int(TOKENS.search(details)[1].replace(",", "")) if TOKENS.search(details) else None
        result["first_result"] = float(FIRST.search(details)[1]) if FIRST.search(details) else None
        captures = CAPTURES.search(details)
        result["captures"], result["capture_seconds"] = (int(captures[1]), float(captures[2])) if captures else (0, 0)
    return result


def timed_process(argv: list[str], log: Path) -> dict:
    """Run `argv` as a fresh process from ROOT; its wall time (start to exit), exit status and `time:` line."""
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=os.environ)
    seconds = time.perf_counter() - started
    log.write_text(f"$ {' '.join(argv)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}; see {log}:\n{done.stderr[-2000:]}")
    return {"seconds": round(seconds, 2), "clock": parse_time_line(done.stdout)}


def write_fasta(path: Path, records: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f">{name}\n{sequence}\n" for name, sequence in records))
    return path


def read_fasta(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text().split()
    return list(zip((line[1:] for line in lines[::2]), lines[1::2]))


def make_workload(work: Path, shape: str, assays: int) -> dict[str, Path]:
    """The checkpoints (`hf`, `nv`) and every job's inputs under `work` (made once; kept for reruns)."""
    from inference_scaling import write_workload
    from random_checkpoint import random_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    if not (work / "nv" / "config.json").exists():
        random_checkpoint(shape, work)
    paths = {"hf": work / "hf", "nv": work / "nv"}
    if not (work / "mutants.csv").exists():
        fasta, wild_type, mutants = write_workload(work, 20000, 5000)
        proteins = read_fasta(fasta)
        write_fasta(work / "proteins_20k.fasta", proteins)
        write_fasta(work / "proteins_2k.fasta", proteins[:2000])
        write_fasta(work / "pll.fasta", random.Random(7).sample(proteins, 60))
        write_proteingym(work / "proteingym", proteins, assays)
    paths.update(
        proteins_20k=work / "proteins_20k.fasta",
        proteins_2k=work / "proteins_2k.fasta",
        pll=work / "pll.fasta",
        wild_type=work / "wild_type.fasta",
        mutants=work / "mutants.csv",
        reference=work / "proteingym" / "reference.csv",
        assays=work / "proteingym" / "assays",
    )
    return paths


def write_proteingym(folder: Path, proteins: list[tuple[str, str]], count: int) -> None:
    """`count` stand-in assays in ProteinGym's layout (reference.csv + assays/), wild types of at most 1,000
    residues drawn from `proteins`, each with 4,000 mutant rows (every position once, then singles and multiples)."""
    from proteingym_benchmark import write_assays

    generator = random.Random(11)
    chosen = generator.sample([sequence for _, sequence in proteins if 50 <= len(sequence) <= 1000], count)
    rows = [
        {
            "DMS_id": f"ASSAY{k:03d}",
            "DMS_filename": f"ASSAY{k:03d}.csv",
            "target_seq": wild_type,
            "DMS_number_single_mutants": str(3000),
            "DMS_number_multiple_mutants": str(1000),
        }
        for k, wild_type in enumerate(chosen)
    ]
    write_assays(list(rows[0]), rows, folder, seed=3, reference_counts=True)


def job_commands(job: str, paths: dict[str, Path], out: Path) -> dict[str, list[str]]:
    """{"nv": the nv-esm command, "transformers": the baseline script} of `job`, writing under `out`."""
    python, nv, hf = sys.executable, str(paths["nv"]), str(paths["hf"])
    command = [python, "-m", "nv_esm"]
    if job.startswith("embed"):
        fasta = str(paths["proteins_2k" if job == "embed_2k" else "proteins_20k"])
        return {
            "nv": [*command, "embed", nv, fasta, str(out)],
            "transformers": [python, str(BASELINES / "hf_embed.py"), hf, fasta, str(out / "hf.safetensors")],
        }
    if job == "pll_60":
        fasta = str(paths["pll"])
        return {
            "nv": [*command, "score", nv, fasta, str(out / "nv.csv")],
            "transformers": [python, str(BASELINES / "hf_pll.py"), hf, fasta, str(out / "hf.csv")],
        }
    if job == "scan_5k":
        wild_type, mutants = str(paths["wild_type"]), str(paths["mutants"])
        return {
            "nv": [*command, "score", nv, wild_type, str(out / "nv.csv"), "--mutants", mutants],
            "transformers": [python, str(BASELINES / "hf_scan.py"), hf, wild_type, mutants, str(out / "hf.csv")],
        }
    reference, assays = str(paths["reference"]), str(paths["assays"])
    return {
        "nv": [*command, "proteingym", nv, reference, assays, str(out / "nv"), "--methods", "masked-marginals"],
        "transformers": [python, str(BASELINES / "hf_proteingym.py"), hf, reference, assays, str(out / "hf")],
    }


def agreement(job: str, out: Path) -> dict:
    """How far nv-esm's output is from the baseline's: the smallest cosine similarity of the embeddings, the largest
    relative difference of the PLLs, the largest difference of the scores (every assay's, for proteingym)."""
    import csv

    import torch

    def last_column(path: Path) -> list[float]:
        return [float(row[-1]) for row in list(csv.reader(open(path)))[1:]]

    if job.startswith("embed"):
        from safetensors.torch import load_file

        from nv_esm.embed import iter_embeddings

        means = [next(v for k, v in outputs.items() if k.startswith("mean.")) for _, outputs in iter_embeddings(out)]
        theirs = load_file(out / "hf.safetensors")["mean"].float()
        return {"min_cosine": torch.nn.functional.cosine_similarity(torch.stack(means).float(), theirs).min().item()}
    if job == "pll_60":
        ours = [float(row["pll"]) for row in csv.DictReader(open(out / "nv.csv"))]
        theirs = [float(row["pll"]) for row in csv.DictReader(open(out / "hf.csv"))]
        return {"max_relative_difference": max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ours, theirs))}
    if job == "scan_5k":
        ours = [float(row["masked_marginal"]) for row in csv.DictReader(open(out / "nv.csv"))]
        pairs = zip(ours, last_column(out / "hf.csv"))
    else:
        pairs = [
            pair
            for path in sorted((out / "hf").glob("*.csv"))
            for pair in zip(last_column(out / "nv" / path.name), last_column(path))
        ]
    return {"max_abs_difference": max(abs(a - b) for a, b in pairs)}


def compare(job: str, out: Path, baseline_out: Path) -> dict:
    """`agreement` of the nv-esm run in `out` with the baseline's in `baseline_out` (linked into `out`); a failure
    is recorded, not raised: the timings stand without it."""
    for path in baseline_out.iterdir():
        if path.name.startswith("hf") and not (out / path.name).exists():
            (out / path.name).symlink_to(path)
    try:
        return agreement(job, out)
    except Exception as error:  # noqa: BLE001 - a comparison that fails must not lose the run's timings
        return {"error": f"{type(error).__name__}: {error}"}


def in_process_worker(variant: str, paths: dict[str, Path], proteins: int, batches: int) -> dict:
    """One fresh process's user loop (`variant`): load, then `batches` batches of 1-`proteins` proteins."""
    if variant != "transformers":
        import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
    import torch
    from transformers import AutoModel, AutoTokenizer, EsmModel

    from nv_esm.job_clock import process_start_time

    process_start = process_start_time()
    imported = time.time()
    generator = random.Random(13)
    sequences = [sequence for _, sequence in read_fasta(paths["proteins_20k"])]
    work = [generator.sample(sequences, generator.randint(1, proteins)) for _ in range(batches)]
    if variant == "transformers":
        tokenizer = AutoTokenizer.from_pretrained(paths["hf"])
        model = EsmModel.from_pretrained(
            paths["hf"], dtype=torch.bfloat16, attn_implementation="sdpa", add_pooling_layer=False
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(paths["nv"], trust_remote_code=True)
        options = {} if variant == "default" else {"cuda_graphs": False}
        model = AutoModel.from_pretrained(paths["nv"], trust_remote_code=True, dtype=torch.bfloat16, **options)
    model = model.cuda().eval()
    torch.cuda.synchronize()
    loaded = time.time()
    first = None
    tokens = 0
    for batch in work:
        encoded = tokenizer(batch, return_tensors="pt", padding=True).to("cuda")
        with torch.no_grad():
            states = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].clone()
        mask[:, 0] = 0
        mask[torch.arange(len(batch)), encoded["attention_mask"].sum(1) - 1] = 0
        means = ((states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).float().cpu()
        tokens += int(encoded["attention_mask"].sum())
        first = first or time.time()
    finished = time.time()
    assert means.isfinite().all()
    return {
        "imports_s": round(imported - process_start, 2),
        "load_s": round(loaded - imported, 2),
        "first_result_s": round(first - loaded, 3),
        "loop_s": round(finished - loaded, 2),
        "process_to_first_result_s": round(first - process_start, 2),
        "tokens": tokens,
        "loop_tokens_per_s": round(tokens / (finished - loaded)),
    }


def steady_worker(paths: dict[str, Path], jobs: list[str]) -> dict:
    """The model alone (loaded as `nv-esm embed` / `nv-esm score` load it) on the embed job's and the PLL job's
    packed batches, inputs on the GPU: tokens/s of a timed pass after a warm one."""
    import torch
    import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)

    from modeling_nv_esm_batch import length_sorted_batches, pack_proteins
    from modeling_nv_esm_plan import inference_autocast
    from nv_esm.embed_model import load_config, load_model
    from nv_esm.score import load_tokenizer

    device = torch.device("cuda")
    config = load_config(str(paths["nv"]))
    tokenizer = load_tokenizer(str(paths["nv"]))
    model = load_model(str(paths["nv"]), config, "te", "off", True, device, masked_lm=True, progress=False).esm

    def encode(sequence: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(sequence), dtype=torch.int64)

    def batches_of(pieces: list[torch.Tensor]) -> list[dict]:
        uploaded = []
        for batch in length_sorted_batches(pieces, BUDGET):
            packed = pack_proteins([pieces[i] for i in batch])
            uploaded.append(
                {
                    "input_ids": packed["input_ids"].to(device),
                    "cu_seq_lens_q": packed["cu_seq_lens_q"].to(device),
                    "max_length_q": packed["max_length_q"],
                }
            )
        return uploaded

    def rate(batches: list[dict]) -> dict:
        tokens = sum(batch["input_ids"].numel() for batch in batches)
        passes = []
        for _ in range(2):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.no_grad(), inference_autocast(device):
                for batch in batches:
                    model(**batch)
            torch.cuda.synchronize()
            passes.append(time.perf_counter() - started)
        return {"tokens": tokens, "warm_pass_s": round(passes[0], 2), "tokens_per_s": round(tokens / passes[1])}

    result = {}
    if "embed_20k" in jobs:  # the first half of its shards
        proteins = [encode(sequence) for _, sequence in read_fasta(paths["proteins_20k"])][:10_000]
        shards = [proteins[start : start + SHARD] for start in range(0, len(proteins), SHARD)]
        result["embed_20k"] = rate([batch for shard in shards for batch in batches_of(shard)])
    if "pll_60" in jobs:
        copies = []
        for _, sequence in read_fasta(paths["pll"])[:30]:  # half of its proteins
            tokens = encode(sequence)
            for position in range(1, len(tokens) - 1):
                copy = tokens.clone()
                copy[position] = tokenizer.mask_token_id
                copies.append(copy)
        result["pll_60"] = rate(batches_of(copies))
    return result


def worker_call(kind: str, args: argparse.Namespace, log: Path, variant: str = "") -> dict:
    """Run a worker of this script as a fresh process; its JSON (the last line of its output)."""
    argv = [sys.executable, __file__, "--worker", kind, "--work", str(args.work), "--variant", variant]
    result = timed_process(argv, log)
    worker = json.loads(_last_json(log.read_text()))
    worker["process_s"] = result["seconds"]
    return worker


def _last_json(text: str) -> str:
    return next(line for line in reversed(text.splitlines()) if line.startswith("{"))


def summarize(summary: dict) -> None:
    """Ratios: each job's transformers seconds over nv-esm's; the batches' rate against the model's own."""
    steady = summary.get("steady", {})
    for job, result in summary["jobs"].items():
        if "nv" in result and "transformers" in result:
            result["speedup"] = round(result["transformers"]["seconds"] / result["nv"]["seconds"], 2)
        clock = result.get("nv", {}).get("clock")
        model = steady.get("embed_20k" if job.startswith("embed") else job, {}).get("tokens_per_s")
        if clock and clock.get("tokens") and model:
            between = clock["phases"]["batches"] - (clock.get("first_result") or 0)
            result["batches_tokens_per_s"] = round(clock["tokens"] / max(between, 1e-9))
            result["batches_vs_model"] = round(result["batches_tokens_per_s"] / model, 3)
        if clock and "transformers" in result:
            fixed = sum(s for name, s in clock["phases"].items() if name != "batches") + (
                clock.get("first_result") or 0
            )
            result["nv_fixed_s"] = round(fixed, 2)


def print_table(summary: dict) -> None:
    print("| job | nv-esm s | transformers s | ratio | batches / model | nv-esm's time line |")
    print("| --- | --- | --- | --- | --- | --- |")
    for job, result in summary["jobs"].items():
        nv, hf = result.get("nv", {}), result.get("transformers", {})
        line = (nv.get("clock") or {}).get("line", "")
        print(
            f"| {job} | {nv.get('seconds', '')} | {hf.get('seconds', '')} | {result.get('speedup', '')} | "
            f"{result.get('batches_vs_model', '')} | {line} |"
        )
    for variant, result in summary.get("in_process", {}).items():
        print(f"in process, {variant}: {result}")
    if summary.get("steady"):
        print(f"model alone: {summary['steady']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M")
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS, help="the whole jobs to time")
    parser.add_argument("--no-jobs", dest="jobs", action="store_const", const=[], help="no whole job")
    parser.add_argument("--sides", nargs="+", default=["transformers", "nv"], choices=["transformers", "nv"])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side of each job (interleaved)")
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each side's first job once, untimed, before timing (with no job, the default's user loop): a "
        "machine's first run reads the libraries from disk and compiles nv-esm's Triton kernels into Triton's cache "
        "(once per machine, ~3 s)",
    )
    parser.add_argument("--in-process", nargs="+", default=list(IN_PROCESS), choices=IN_PROCESS)
    parser.add_argument("--no-in-process", dest="in_process", action="store_const", const=[], help="no user loop")
    parser.add_argument("--steady", nargs="+", default=["embed_20k", "pll_60"], choices=["embed_20k", "pll_60"])
    parser.add_argument("--no-steady", dest="steady", action="store_const", const=[], help="no model-alone run")
    parser.add_argument("--assays", type=int, default=24, help="stand-in assays of the proteingym job")
    parser.add_argument("--work", type=Path, default=Path("/tmp/job_benchmark"), help="checkpoints and inputs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "jobs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # the other bench scripts, run from anywhere
    if args.worker:
        paths = make_workload(args.work, args.shape, args.assays)
        result = in_process_worker(args.variant, paths, 64, 100) if args.worker == "in_process" else None
        print(json.dumps(result if result is not None else steady_worker(paths, args.variant.split(","))))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = make_workload(args.work, args.shape, args.assays)
    summary: dict = {"shape": args.shape, "workload_s": round(time.perf_counter() - started, 1), "jobs": {}}
    summary["environment"] = environment()
    result_path = args.out / "job_benchmark.json"
    if args.warm_up and args.jobs:
        for side in args.sides:
            out = args.work / "runs" / f"warm_up_{side}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            out.mkdir(parents=True)
            summary[f"warm_up_{side}_s"] = timed_process(job_commands(args.jobs[0], paths, out)[side], out / "log")
    for job in args.jobs:
        result = summary["jobs"].setdefault(job, {})
        for repeat in range(args.repeats):
            for side in args.sides:
                out = args.work / "runs" / f"{job}_{side}_{repeat}"
                subprocess.run(["rm", "-rf", str(out)], check=True)
                out.mkdir(parents=True)
                argv = job_commands(job, paths, out)[side]
                run = timed_process(argv, args.out / f"{job}_{side}_{repeat}.log")
                result.setdefault(f"{side}_runs", []).append(run)
                best = min(result[f"{side}_runs"], key=lambda r: r["seconds"])
                result[side] = best
                if side == "nv" and "transformers" in args.sides and repeat == args.repeats - 1:
                    result["agreement"] = compare(job, out, args.work / "runs" / f"{job}_transformers_{repeat}")
                summarize(summary)
                result_path.write_text(json.dumps(summary, indent=1))
    if args.warm_up and not args.jobs and args.in_process:  # the machine's first process compiles Triton's kernels
        summary["warm_up_in_process"] = worker_call("in_process", args, args.out / "in_process_warm_up.log", "default")
    for variant in args.in_process:
        summary.setdefault("in_process", {})[variant] = worker_call(
            "in_process", args, args.out / f"in_process_{variant}.log", variant
        )
        result_path.write_text(json.dumps(summary, indent=1))
    if args.steady:
        summary["steady"] = worker_call("steady", args, args.out / "steady.log", ",".join(args.steady))
    summarize(summary)
    result_path.write_text(json.dumps(summary, indent=1))
    print_table(summary)


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


if __name__ == "__main__":
    main()
