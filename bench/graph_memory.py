"""Memory and speed of CUDA-graph training across a run's packed shapes, one case per process.

    python bench/graph_memory.py --shape 650M --proteins 64 --out bench/results/graph_memory

Cases (each in its own process, same batches, fp32 weights + bf16 autocast + fused AdamW):
  eager            cuda_graphs=False: the memory target's baseline
  buckets          cuda_graphs=True, every batch in its own bucket (`static_shape`): a capture per new shape, each
                   with the allocator on expandable segments (the model's `_expandable_segments`)
  buckets_fixed_segments  buckets, captures on the process's allocator settings (fixed-size segments), as before
                   `_expandable_segments` was added
  buckets_expand   buckets, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the whole process
  buckets_fp8, buckets_expand_fp8  the same with every layer FP8 (DelayedScaling)
  one_shape        cuda_graphs=True, every batch padded to the bucket of the largest batch: one capture
  one_shape_fp8    one_shape with every layer FP8 (DelayedScaling)
  eager_fp8        eager with every layer FP8
  buckets_warmup_beside_pool, buckets_warmup_beside_pool_fp8  buckets (and FP8) with TE's eager warm-up before
                   each capture beside the graphs' memory pool, as before `WarmUpInPool` (not routed): the
                   second shape's warm-up needs its activations on top of the pool's (3B at 16 proteins on an 80 GB
                   H100: out of memory, eager from then on). The other `buckets` cases warm up in the pool from the
                   second capture on; each capture's record says where (`captures`).

Per step it records the bucket, the number of captured shapes (0 after a capture ran out of memory: eager from
then on), allocated / reserved / peak memory; at the end the
seconds per step of a second pass over the same batches (all shapes captured by then). The results of
bench/results/graphs_benchmark_h100_2026-11-23/ were recorded before the model switched segments itself: there,
`buckets` is today's `buckets_fixed_segments` and `buckets_capture_expand` (a patch of `_capture`) is today's `buckets`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import benchmark  # bench/benchmark.py: imports Transformer Engine first
import torch

import modeling_nv_esm
import modeling_nv_esm_graphs

CASES = {
    "eager": dict(cuda_graphs=False),
    "buckets": dict(cuda_graphs=True),
    "buckets_fixed_segments": dict(cuda_graphs=True),
    "buckets_expand": dict(cuda_graphs=True),
    "buckets_fp8": dict(cuda_graphs=True, fp8=True),
    "buckets_expand_fp8": dict(cuda_graphs=True, fp8=True),
    "one_shape": dict(cuda_graphs=True),
    "one_shape_fp8": dict(cuda_graphs=True, fp8=True),
    "eager_fp8": dict(cuda_graphs=False, fp8=True),
    "buckets_warmup_beside_pool": dict(cuda_graphs=True),
    "buckets_warmup_beside_pool_fp8": dict(cuda_graphs=True, fp8=True),
}
GB = 2**30


def record_warm_ups(captures: list[dict], routed: bool) -> None:
    """Append to `captures` where each capture's warm-up ran (`WarmUpInPool.routed`), forcing it beside the pool
    unless `routed`."""
    warm_up = modeling_nv_esm_graphs.WarmUpInPool
    real_init = warm_up.__init__

    def init(self, pool, routed_by_model: bool) -> None:
        real_init(self, pool, routed_by_model and routed)
        captures.append({"warm_up_in_pool": self.routed})

    warm_up.__init__ = init


def run_case(case: str, shape_name: str, proteins: int, steps: int) -> dict:
    options = dict(CASES[case])
    shape = benchmark.SHAPES[shape_name]
    batches = [benchmark.mlm_inputs(b, seed=i) for i, b in enumerate(benchmark.draw_batches(steps, proteins, seed=1))]
    if case.startswith("one_shape"):
        buckets = [
            modeling_nv_esm_graphs.static_shape(sum(map(len, tokens)), len(tokens), max(map(len, tokens)))
            for tokens, _ in batches
        ]
        largest = tuple(map(max, zip(*buckets)))
        modeling_nv_esm_graphs.static_shape = lambda num_tokens, num_sequences, max_length: largest
    if case == "buckets_fixed_segments":
        modeling_nv_esm_graphs._expandable_segments = contextlib.nullcontext
    captures: list[dict] = []
    record_warm_ups(captures, routed=not case.startswith("buckets_warmup_beside_pool"))
    if options.pop("fp8", False):
        options["layer_precision"] = ["fp8"] * shape["num_hidden_layers"]
    torch.manual_seed(0)
    config = modeling_nv_esm.NVEsmConfig(**shape, backend="te", check_inputs=False, **options)
    model = modeling_nv_esm.NVEsmForMaskedLM(config).cuda().float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    prepared = [benchmark.packed(tokens, labels) for tokens, labels in batches]
    result = {"case": case, "shape": shape_name, "proteins": proteins, "steps": [], "oom": False}
    try:
        for batch in prepared:
            started = time.perf_counter()
            loss = benchmark.step(model, batch, optimizer)
            torch.cuda.synchronize()
            tokens = batch["input_ids"].numel()
            length = batch["max_length_q"]
            result["steps"].append(
                dict(
                    tokens=tokens,
                    bucket=modeling_nv_esm_graphs.static_shape(tokens, batch["cu_seq_lens_q"].numel() - 1, length),
                    shapes_captured=len(model.esm.encoder.graphs._graphs),
                    graphs_out_of_memory=model.esm.encoder.graphs._out_of_memory,
                    seconds=time.perf_counter() - started,
                    loss=loss.item(),
                    allocated_gb=torch.cuda.memory_allocated() / GB,
                    reserved_gb=torch.cuda.memory_reserved() / GB,
                    peak_allocated_gb=torch.cuda.max_memory_allocated() / GB,
                    peak_reserved_gb=torch.cuda.max_memory_reserved() / GB,
                )
            )
        started = time.perf_counter()
        for batch in prepared:
            benchmark.step(model, batch, optimizer)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / len(prepared)
        real_tokens = sum(sum(map(len, tokens)) for tokens, _ in batches) / len(batches)
        result.update(step_seconds=seconds, tokens_per_second=real_tokens / seconds)
    except torch.OutOfMemoryError as error:
        result.update(oom=True, error=str(error).splitlines()[0], traceback=traceback.format_exc()[-3000:])
    result.update(
        captures=captures,
        peak_allocated_gb=torch.cuda.max_memory_allocated() / GB,
        peak_reserved_gb=torch.cuda.max_memory_reserved() / GB,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(benchmark.SHAPES))
    parser.add_argument("--proteins", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, default=benchmark.ROOT / "bench" / "results" / "graph_memory")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = run_case(args.cases[0], args.shape, args.proteins, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases:
        command = [sys.executable, __file__, "--worker", "--cases", case, "--shape", args.shape]
        command += ["--proteins", str(args.proteins), "--steps", str(args.steps)]
        environment = dict(os.environ)
        if case.startswith("buckets_expand"):
            environment["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        process = subprocess.run(command, capture_output=True, text=True, env=environment)
        lines = [line[7:] for line in process.stdout.splitlines() if line.startswith("RESULT ")]
        if process.returncode or not lines:
            print(process.stderr[-3000:], file=sys.stderr)
            results.append({"case": case, "failed": process.stderr[-1000:]})
            continue
        result = json.loads(lines[0]) | {"log": [line for line in process.stderr.splitlines() if "CUDA graph" in line]}
        summary = {k: result.get(k) for k in ("case", "oom", "tokens_per_second", "peak_allocated_gb")}
        summary |= {"peak_reserved_gb": result["peak_reserved_gb"], "captures": result["captures"]}
        print(json.dumps(summary | {"losses": [step["loss"] for step in result["steps"]]}), flush=True)
        results.append(result)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        (args.out / f"graph_memory_{args.shape}_{args.proteins}.json").write_text(  # after each case: a cut run
            json.dumps({"meta": meta, "results": results}, indent=1)  # keeps what it measured
        )


if __name__ == "__main__":
    main()
