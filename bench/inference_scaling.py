"""`nv-esm embed` and `nv-esm score` on 1, 2 and 4 GPUs (torchrun, one rank per GPU): proteins/s and mutants/s of
the whole job against one GPU, in one run.

    python bench/inference_scaling.py --shape 650M --proteins 10000 --mutants 5000 --gpus 1 2 4 --out $OUT/inference

Workload: a random checkpoint of `--shape` (`random_checkpoint`), a FASTA of `--proteins` random proteins of
UniRef50-like lengths (log-normal around 270 residues, 10 to 1,024, as `bench/benchmark.py` draws them) and a deep
mutational scan of a 300-residue wild type (`--mutants` single substitutions, ProteinGym's CSV layout). Each command
runs with its defaults but `--shard-size` (default 250 proteins or mutant rows per shard: the unit ranks share; the
commands' own defaults, 1,000 and 2,000, would leave 10k proteins in 10 shards, 3 of them on one of 4 ranks) into a
fresh output. The time is the command's own report
(rank 0's loop, from its first batch to its last part written: model loading excluded, CUDA graph captures
included); ranks take shards round-robin, so rank 0's time is the job's to within a shard.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from random_checkpoint import random_checkpoint

from nv_esm.alphabet import STANDARD_AMINO_ACIDS

RATE = re.compile(r"this run: (\d+) (?:proteins|records|rows) in ([\d.]+) s")
MEDIAN_RESIDUES, LENGTH_SIGMA, MAX_RESIDUES = 270, 0.7, 1024  # bench/benchmark.py's draw


def write_workload(work: Path, proteins: int, mutants: int) -> tuple[Path, Path, Path]:
    """(FASTA of `proteins` proteins, FASTA of the wild type, CSV of `mutants` single substitutions of it)."""
    rng = random.Random(5)
    lengths = [
        min(max(round(math.exp(rng.gauss(math.log(MEDIAN_RESIDUES), LENGTH_SIGMA))), 10), MAX_RESIDUES)
        for _ in range(proteins)
    ]
    fasta = work / "proteins.fasta"
    fasta.write_text(
        "".join(f">p{i}\n{''.join(rng.choices(STANDARD_AMINO_ACIDS, k=n))}\n" for i, n in enumerate(lengths))
    )
    wild_type = "".join(rng.choices(STANDARD_AMINO_ACIDS, k=300))
    (work / "wild_type.fasta").write_text(f">wt\n{wild_type}\n")
    rows = [
        f"{residue}{position + 1}{other},{rng.random():.4f}"
        for position, residue in enumerate(wild_type)
        for other in STANDARD_AMINO_ACIDS
        if other != residue
    ][:mutants]
    (work / "mutants.csv").write_text("mutant,DMS_score\n" + "\n".join(rows) + "\n")
    return fasta, work / "wild_type.fasta", work / "mutants.csv"


def run_command(gpus: int, argv: list[str], log: Path) -> dict:
    """`torchrun --nproc-per-node gpus -m nv_esm ARGV`; the count and seconds of its "this run" report."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--standalone"]
    result = subprocess.run([*command, "-m", "nv_esm", *argv], capture_output=True, text=True, env=os.environ)
    log.write_text(result.stdout + result.stderr)
    found = RATE.findall(result.stdout)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"nv-esm {argv[0]} on {gpus} GPUs failed or reported no rate; see {log}")
    units, seconds = found[-1]
    return {"rank0_units": int(units), "seconds": float(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M")
    parser.add_argument("--proteins", type=int, default=10000)
    parser.add_argument("--mutants", type=int, default=5000)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shard-size", type=int, default=250)
    parser.add_argument("--jobs", nargs="+", choices=("embed", "score"), default=["embed", "score"])
    parser.add_argument("--tag", default="", help="added to the result names (e.g. for --extra runs)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more options for both commands")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"shape": args.shape, "proteins": args.proteins, "mutants": args.mutants, "runs": {}}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        _, checkpoint = random_checkpoint(args.shape, work)
        fasta, wild_type, mutants = write_workload(work, args.proteins, args.mutants)
        jobs = {
            "embed": (args.proteins, lambda out: ["embed", str(checkpoint), str(fasta), str(out)]),
            "score": (
                args.mutants,
                lambda out: [
                    "score",
                    str(checkpoint),
                    str(wild_type),
                    str(out),
                    "--mutants",
                    str(mutants),
                ],  # fmt: skip
            ),
        }
        for name in args.jobs:
            total, argv = jobs[name]
            for gpus in args.gpus:
                tag = f"{name}{args.tag}_{gpus}gpu"
                output = work / (f"{tag}.csv" if name == "score" else tag)
                shards = ["--shard-size", str(args.shard_size), "--no-progress", *args.extra]
                run = run_command(gpus, [*argv(output), *shards], args.out / f"{tag}.log")
                run["units_per_s"] = total / run["seconds"]
                one = results["runs"].get(f"{name}{args.tag}_1gpu")
                if one:
                    run["speedup_vs_one_gpu"] = run["units_per_s"] / one["units_per_s"]
                results["runs"][tag] = run
                print(tag, json.dumps(run), flush=True)
    (args.out / f"inference_scaling_{args.shape}{args.tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
