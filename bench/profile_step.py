"""Where does a packed NVEsm step spend its time? GPU-idle fraction per step from a trace, step times under
controlled batch shapes, and the top operators, for one or several benchmark.py variants side by side.

    python bench/profile_step.py --shape 650M --proteins 16 64 --variants nv_thd nv_thd_graphs --out bench/results/x

Per variant, mode (train/infer) and protein count, after two warm passes over the same batches (cuDNN plans, TE set-up,
CUDA-graph captures: none of that is traced):
  trace         `--trace-steps` new random batches under torch.profiler, each step a `train_step_i` span; from the
                Chrome trace (`nv_esm.trace_summary`): wall time per step (first to last kernel), GPU busy (union of
                kernels), GPU idle = wall - busy (the GPU waiting for the CPU), kernels per step, top kernels
and with `--experiments`:
  varying       a new random batch every step (what training sees)
  repeated      one batch over and over (no new shapes)
  bucketed      new batches, max_length_q rounded up to a multiple of `--bucket` tokens
Writes OUT/profile.json and the traces, TRACE_DIR/trace_{variant}_{mode}_{proteins}.json.gz.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from benchmark import PACKED_VARIANTS, SHAPES, build, draw_batches, make_optimizer, mlm_inputs, packed, step

from nv_esm import trace_summary


def step_times(model, batches: list[dict], optimizer) -> list[float]:
    times = []
    for batch in batches:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, batch, optimizer)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def record_trace(model, batches: list[dict], optimizer, path: Path, with_stack: bool = False) -> None:
    """Run `batches` under torch.profiler (CPU and CUDA; Python stacks too with `with_stack`), one `train_step_i`
    span each, and write the Chrome trace to `path`."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=with_stack) as profiler:
        for index, batch in enumerate(batches):
            with torch.profiler.record_function(f"train_step_{index}"):
                step(model, batch, optimizer)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(path))


def traced(model, batches: list[dict], optimizer, path: Path, top: int = 12) -> dict:
    """Trace `batches` (one `train_step_i` span each) into `path`; its `trace_summary` (the `top` kernels) with the
    idle fraction."""
    record_trace(model, batches, optimizer, path)
    summary = trace_summary.summarise(path, top=top)
    times = summary["ms_per_step"]
    summary["gpu_idle_fraction"] = round(times["gpu_idle"] / times["wall"], 3)
    return summary


def experiments(model, optimizer, args, proteins: int, seed: int) -> dict:
    """Median step times of the varying, repeated and bucketed batches."""
    raw = [mlm_inputs(b, seed=i) for i, b in enumerate(draw_batches(2 * args.steps, proteins, seed=seed))]
    varying = [packed(*b) for b in raw]
    step_times(model, varying, optimizer)  # warm-up
    bucketed = []
    for batch in varying[args.steps :]:
        bucket = -(-batch["max_length_q"] // args.bucket) * args.bucket
        bucketed.append({**batch, "max_length_q": bucket})
    report = {}
    for name, batches in {"varying": varying[: args.steps], "repeated": [varying[0]] * args.steps}.items():
        times = step_times(model, batches, optimizer)
        report[f"{name}_ms"] = [round(1e3 * t, 1) for t in times]
    times = step_times(model, bucketed, optimizer)
    report["bucketed_ms"] = [round(1e3 * t, 1) for t in times]
    return report


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["nv_thd"], choices=sorted(PACKED_VARIANTS))
    parser.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--proteins", type=int, nargs="+", default=[16])
    parser.add_argument("--trace-steps", type=int, default=4)
    parser.add_argument("--experiments", action="store_true", help="also time varying/repeated/bucketed batches")
    parser.add_argument("--steps", type=int, default=8, help="steps per experiment")
    parser.add_argument("--bucket", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--trace-dir", type=Path, help="where the traces go (default: --out)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per trace, by GPU time")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace_dir = args.trace_dir or args.out
    trace_dir.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape, "runs": []}
    for variant in args.variants:
        for mode in args.modes:
            training = mode == "train"
            model = build(variant, SHAPES[args.shape], training)
            optimizer = make_optimizer(variant, model) if training else None
            for proteins in args.proteins:
                raw = draw_batches(args.trace_steps, proteins, seed=9)
                batches = [packed(*mlm_inputs(b, seed=99 + i)) for i, b in enumerate(raw)]
                for _ in range(4):  # 4 warm passes, as benchmark.py's, kept out of the trace: set-up, captures (an
                    step_times(model, batches, optimizer)  # inference shape's at its 2nd batch) and its 2 timings
                name = f"{variant}_{mode}_{proteins}"
                summary = traced(model, batches, optimizer, trace_dir / f"trace_{name}.json.gz", args.top)
                run = dict(variant=variant, mode=mode, proteins=proteins, **summary)
                if args.experiments:
                    run["experiments"] = experiments(model, optimizer, args, proteins, seed=7)
                report["runs"].append(run)
                times = summary["ms_per_step"]
                print(
                    f"{name}: wall {times['wall']} ms/step, GPU busy {times['gpu_busy']}, idle "
                    f"{summary['gpu_idle_fraction']:.0%}, {summary['kernels_per_step']} kernels/step",
                    flush=True,
                )
                (args.out / "profile.json").write_text(json.dumps(report, indent=1))
            model = optimizer = None
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
