"""Where does a packed NVEsm step spend its time? Step times under controlled batch shapes, plus a profile.

    python bench/profile_step.py --shape 650M --proteins 16 --out bench/results

Experiments (one packed variant of benchmark.py, nv_thd by default):
  varying       a new random batch every step (what training sees)
  repeated      one batch over and over (no new shapes)
  bucketed      new batches, max_length_q rounded up to a multiple of `--bucket` tokens
and a torch.profiler table of one varying step (GPU kernel time vs wall time, top operators).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchmark import PACKED_VARIANTS, SHAPES, build, draw_batches, mlm_inputs, packed, step


def step_times(model, batches: list[dict], optimizer) -> list[float]:
    times = []
    for batch in batches:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, batch, optimizer)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--variant", default="nv_thd", choices=sorted(PACKED_VARIANTS))
    parser.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--proteins", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bucket", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for mode in args.modes:
        training = mode == "train"
        model = build(args.variant, SHAPES[args.shape], training)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True) if training else None
        raw = [mlm_inputs(b, seed=i) for i, b in enumerate(draw_batches(2 * args.steps, args.proteins, seed=7))]
        varying = [packed(*b) for b in raw]
        step_times(model, varying[:3], optimizer)  # warm-up
        bucketed = []
        for batch in varying[args.steps :]:
            bucket = -(-batch["max_length_q"] // args.bucket) * args.bucket
            bucketed.append({**batch, "max_length_q": bucket})
        experiments = {
            "varying": varying[3 : 3 + args.steps],
            "repeated": [varying[0]] * args.steps,
            "bucketed": bucketed,
        }
        for name, batches in experiments.items():
            times = step_times(model, batches, optimizer)
            report[f"{mode}_{name}_ms"] = [round(1e3 * t, 1) for t in times]
            print(f"{mode} {name}: median {1e3 * sorted(times)[len(times) // 2]:.1f} ms {report[f'{mode}_{name}_ms']}")
        fresh = [
            packed(*b) for b in [mlm_inputs(b, seed=99 + i) for i, b in enumerate(draw_batches(2, args.proteins, 9))]
        ]
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            step_times(model, fresh, optimizer)
        events = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 1e3 / len(fresh)
        report[f"{mode}_gpu_busy_ms_per_step"] = round(cuda_total, 1)
        table = events.table(sort_by="self_cpu_time_total", row_limit=25)
        table_gpu = events.table(sort_by="self_device_time_total", row_limit=25)
        (args.out / f"profile_{mode}.txt").write_text(table + "\n\n" + table_gpu)
        print(f"{mode}: GPU kernel time per step {cuda_total:.1f} ms")
        print(table[:6000])
        model = optimizer = None
        torch.cuda.empty_cache()
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
