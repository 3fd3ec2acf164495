"""Where the GPU waits for the host in a graphed packed step: the Python calls between the step's input-check sync
(`cudaStreamSynchronize`) and its CUDA-graph launch, while the GPU has nothing queued.

    python bench/host_gap.py --shape 650M --proteins 64 --variants nv_thd_graphs nv_thd_graphs_unchecked --out DIR

Per variant and mode: `--steps` batches traced after two warm passes (as `profile_step.py`), with Python stacks.
For each step: wall, GPU busy and idle (`nv_esm.trace_summary`), the host time from the sync's end to the graph
launch, and the Python functions in that window that took at least `--min-ms` (a tree, by nesting). Writes
OUT/host_gap.json.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import io
import json
import pstats
import time
from pathlib import Path

import torch
from benchmark import PACKED_VARIANTS, SHAPES, build, draw_batches, make_optimizer, mlm_inputs, packed, step
from profile_step import record_trace, step_times, traced


def window_tree(events: list[dict], start: float, end: float, min_us: float) -> list[str]:
    """The Python calls inside `[start, end]` (µs) that took at least `min_us`, indented by nesting."""
    calls = sorted(
        (e for e in events if e.get("cat") == "python_function" and start <= e["ts"] and e["ts"] + e["dur"] <= end),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    lines, open_ends = [], []
    for call in calls:
        while open_ends and call["ts"] >= open_ends[-1]:
            open_ends.pop()
        if call["dur"] >= min_us:
            lines.append(f"{'  ' * len(open_ends)}{call['dur'] / 1e3:.2f} ms {call['name'][:110]}")
        open_ends.append(call["ts"] + call["dur"])
    return lines


def host_gaps(path: Path, min_us: float) -> list[dict]:
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    steps = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("train_step_")),
        key=lambda e: e["ts"],
    )
    runtime = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    report = []
    for span in steps:
        inside = [e for e in runtime if span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        syncs = [e for e in inside if "Synchronize" in e["name"]]
        launches = [e for e in inside if e["name"] == "cudaGraphLaunch"]
        if not syncs or not launches:
            report.append({"step": span["name"], "syncs": len(syncs), "graph_launches": len(launches)})
            continue
        start, end = syncs[0]["ts"] + syncs[0]["dur"], launches[0]["ts"]
        kernel_launches = sum(1 for e in inside if start <= e["ts"] <= end and "Launch" in e["name"])
        report.append(
            {
                "step": span["name"],
                "syncs": len(syncs),
                "sync_to_graph_launch_ms": round((end - start) / 1e3, 2),
                "launches_in_window": kernel_launches,
                "python": window_tree(events, start, end, min_us),
            }
        )
    return report


def host_costs(model, batches: list[dict], optimizer, top: int) -> dict:
    """Host seconds of each step without waiting for the GPU (with `check_inputs=False` nothing in a step waits,
    so while the GPU is busy this is the step's host work alone), the graph checks' host time, and a cProfile of
    the steps (its `top` functions by cumulative time)."""
    encoder = model.esm.encoder if hasattr(model, "esm") else None
    torch.cuda.synchronize()
    host_ms = []
    for batch in batches * 3:
        start = time.perf_counter()
        step(model, batch, optimizer)
        host_ms.append(round(1e3 * (time.perf_counter() - start), 2))
    torch.cuda.synchronize()
    pieces = {}
    if encoder is not None:
        for name, call in {
            "replayable": lambda: encoder.graphs.replayable(encoder),  # the graph checks' one pass over the modules
            "modules": lambda: list(encoder.modules()),
        }.items():
            start = time.perf_counter()
            for _ in range(20):
                call()
            pieces[name] = round(1e3 * (time.perf_counter() - start) / 20, 3)
    profiler = cProfile.Profile()
    profiler.enable()
    for batch in batches:
        step(model, batch, optimizer)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    return {"host_ms": host_ms, "pieces_ms": pieces, "cprofile": text.getvalue().splitlines()}


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--variants", nargs="+", default=["nv_thd_graphs"], choices=sorted(PACKED_VARIANTS))
    parser.add_argument("--modes", nargs="+", default=["infer"], choices=["train", "infer"])
    parser.add_argument("--proteins", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-ms", type=float, default=0.15)
    parser.add_argument("--host-costs", action="store_true", help="also time each step's host work (cProfile)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for variant in args.variants:
        for mode in args.modes:
            training = mode == "train"
            model = build(variant, SHAPES[args.shape], training)
            optimizer = make_optimizer(variant, model) if training else None
            raw = draw_batches(args.steps, args.proteins, seed=9)
            batches = [packed(*mlm_inputs(b, seed=99 + i)) for i, b in enumerate(raw)]
            for _ in range(2):
                step_times(model, batches, optimizer)
            timed = [round(1e3 * t, 2) for t in step_times(model, batches, optimizer)]
            path = Path(f"/tmp/host_gap_{variant}_{mode}.json.gz")
            summary = traced(model, batches, optimizer, path)
            stacked = Path(f"/tmp/host_gap_{variant}_{mode}_stacks.json.gz")
            record_trace(model, batches, optimizer, stacked, with_stack=True)
            run = dict(
                variant=variant,
                mode=mode,
                proteins=args.proteins,
                step_ms=timed,
                ms_per_step=summary["ms_per_step"],
                gpu_idle_fraction=summary["gpu_idle_fraction"],
                gaps_untraced_stacks=host_gaps(path, 1e9),
                gaps_with_stacks=host_gaps(stacked, 1e3 * args.min_ms),
            )
            if args.host_costs:
                run["host_costs"] = host_costs(model, batches, optimizer, top=40)
            report["runs"].append(run)
            print(f"{variant} {mode}: step ms {timed}, {summary['ms_per_step']}", flush=True)
            (args.out / "host_gap.json").write_text(json.dumps(report, indent=1))
            model = optimizer = None
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
