"""What a process pays once before `nv-esm embed` and `nv-esm score` run at speed: each command twice in one
process (a cold run, then a warm run of the same job into a fresh output, the model loaded again), per variant.

    python bench/inference_warmup.py --shape 650M --proteins 10000 --mutants 5000 --out $OUT/warmup

The cold run pays what a process meets once (Transformer Engine's `torch.compile` of its fused bias-dropout-add,
cuBLAS/cuDNN set-up, the attention backend's choice) and what every model meets once (CUDA graph captures); the
warm run pays only the second. The variants run as fresh processes: `default`, `no_te_compile`
(`NVTE_TORCH_COMPILE=0`: TE's fused functions run uncompiled), `eager` (`--no-cuda-graphs`) and both. Workload:
`inference_scaling.py`'s (random proteins of UniRef50-like lengths; single substitutions of a 300-residue wild
type). Times are the commands' own reports ("this run: N ... in S s", model loading excluded). Writes
OUT/inference_warmup_<shape>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inference_scaling import RATE, write_workload
from random_checkpoint import random_checkpoint

VARIANTS = {
    "default": ({}, []),
    "no_te_compile": ({"NVTE_TORCH_COMPILE": "0"}, []),
    "eager": ({}, ["--no-cuda-graphs"]),
    "eager_no_te_compile": ({"NVTE_TORCH_COMPILE": "0"}, ["--no-cuda-graphs"]),
}


def child(work: Path, extra: list[str]) -> dict:
    """Embed and score twice each in this process; the commands' seconds and dynamo's compile times."""
    with contextlib.suppress(ImportError):
        import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
    import torch

    from nv_esm import embed, score

    started = time.perf_counter()
    checkpoint, fasta, wild_type, mutants = (work / name for name in ("nv", "proteins.fasta", "wt.fasta", "m.csv"))
    common = ["--shard-size", "250", "--no-progress", *extra]
    jobs = {
        "embed": lambda out: embed.main([str(checkpoint), str(fasta), str(out), *common]),
        "score": lambda out: score.main(
            [str(checkpoint), str(wild_type), str(out), "--mutants", str(mutants), *common]
        ),
    }
    result: dict = {}
    for name, run in jobs.items():
        for attempt in ("cold", "warm"):
            output = work / f"{name}_{attempt}_{os.getpid()}" / ("scores.csv" if name == "score" else "embeddings")
            output.parent.mkdir()
            printed = io.StringIO()
            begun = time.perf_counter()
            with contextlib.redirect_stdout(printed):
                status = run(output)
            found = RATE.findall(printed.getvalue())
            if status != 0 or not found:
                raise RuntimeError(f"{name} ({attempt}) failed: {printed.getvalue()[-2000:]}")
            result[f"{name}_{attempt}_s"] = float(found[-1][1])
            result[f"{name}_{attempt}_with_load_s"] = time.perf_counter() - begun
    result["process_s"] = time.perf_counter() - started
    with contextlib.suppress(Exception):
        result["dynamo_compile_times"] = torch._dynamo.utils.compile_times(repr="str", aggregate=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M")
    parser.add_argument("--proteins", type=int, default=10000)
    parser.add_argument("--mutants", type=int, default=5000)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.extra)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"shape": args.shape, "proteins": args.proteins, "mutants": args.mutants, "variants": {}}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        random_checkpoint(args.shape, work)
        fasta, wild_type, mutants = write_workload(work, args.proteins, args.mutants)
        wild_type.rename(work / "wt.fasta")
        mutants.rename(work / "m.csv")
        for name in args.variants:
            env, extra = VARIANTS[name]
            command = [sys.executable, __file__, "--out", str(args.out), "--child", str(work), "--extra", *extra]
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env})
            (args.out / f"{name}.log").write_text(done.stdout + done.stderr)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            results["variants"][name] = json.loads(lines[-1][7:]) if lines else {"failed": done.returncode}
            print(name, json.dumps({k: v for k, v in results["variants"][name].items() if k.endswith("_s")}))
            (args.out / f"inference_warmup_{args.shape}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
