"""Where the time of a traced training step goes: `python -m nv_esm.train --profile-steps K` traces, one per rank.

    python -m nv_esm.trace_summary RUN/profile/rank*.json.gz [--json OUT.json]

Per rank, over the traced steps: wall time per step (first to last GPU kernel), time the GPU ran compute kernels,
NCCL kernels, both at once, and none (idle: waiting for the CPU or for another rank), the CPU time of the steps'
`train_step_*` spans, host-device synchronisations, GPU time per kind of kernel (`KERNEL_KINDS`: GEMMs, attention,
FP8 quantization, ...) and the kernels that took the most time, and the host time of the annotated regions
(`record_function`: FSDP2's hooks, the optimizer step, collectives) that took the most, per region name (a layer's
name and "for <layer>" dropped, so the regions of all layers add up; nested regions each count their own span).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

# (kind, substrings of a kernel's lower-cased name), first match wins; anything else is "other".
KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("rotary", ("rope", "rotate_qk")),
    ("attention", ("sdpa", "fmha", "flash", "fused_attn", "attn")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("fp8_quantize", ("cast_transpose", "quantize", "amax", "fp8", "scale", "scaling", "transpose")),
    ("norm", ("ln_", "layernorm", "layer_norm", "rmsnorm", "normalization")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("loss", ("cross_entropy", "softmax", "nll")),
    ("copy_elementwise", ("elementwise", "copy", "fill", "triton", "reduce", "cat", "index", "gather", "scatter")),
)


def kernel_kind(name: str) -> str:
    """The `KERNEL_KINDS` kind of a CUDA kernel's name."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `(start, end)` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both the intervals `a` and the intervals `b`."""
    return union_length(a) + union_length(b) - union_length(a + b)


def region_name(name: str) -> str:
    """An annotated region's name without its module: "FSDP::all_gather (esm.encoder.layers.3)" and
    "FSDP::forward_prefetch for esm.encoder.layers.3" -> "FSDP::all_gather", "FSDP::forward_prefetch";
    "Optimizer.step#AdamW.step" -> "Optimizer.step"."""
    return re.sub(r"( \(.*\)| for \S+)$", "", name.split("#")[0])


def summarise(path: Path, top: int) -> dict:
    """The summary of one Chrome trace (`.json` or `.json.gz`), with the `top` kernels by GPU time."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("train_step_")]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    timeline = nccl + compute or spans  # a CPU run has no kernels: its wall time is that of the step spans
    wall = max(end for _, end in timeline) - min(start for start, _ in timeline)
    busy = union_length(nccl + compute)
    runtime = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", ""):
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e.get("dur", 0) / 1e3
    by_kernel = defaultdict(lambda: [0, 0.0])
    by_kind = defaultdict(float)
    for e in kernels:
        by_kernel[e["name"][:120]][0] += 1
        by_kernel[e["name"][:120]][1] += e["dur"] / 1e3
        by_kind[kernel_kind(e["name"])] += e["dur"]
    regions = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "user_annotation" and "dur" in e and not e["name"].startswith("train_step_"):
            region = regions[region_name(e["name"])]
            region[0] += 1
            region[1] += e["dur"] / 1e3
    count = max(1, len(steps))
    per_step = lambda microseconds: round(microseconds / 1e3 / count, 2)  # noqa: E731
    return dict(
        trace=str(path),
        steps=len(steps),
        ms_per_step=dict(
            wall=per_step(wall),
            cpu_step_spans=per_step(sum(e["dur"] for e in steps)),
            gpu_busy=per_step(busy),
            gpu_idle=per_step(wall - busy),
            compute_kernels=per_step(union_length(compute)),
            compute_kernel_sum=per_step(sum(end - start for start, end in compute)),
            nccl_kernels=per_step(union_length(nccl)),
            nccl_overlapped_with_compute=per_step(overlap_length(nccl, compute)),
        ),
        kernels_per_step=round(len(kernels) / count),
        synchronisations={name: dict(calls=c, ms=round(ms, 2)) for name, (c, ms) in runtime.items()},
        kernel_kinds_ms_per_step={kind: per_step(us) for kind, us in sorted(by_kind.items(), key=lambda i: -i[1])},
        top_kernels_ms_per_step=[
            dict(name=name, calls=calls // count, ms=round(ms / count, 2))
            for name, (calls, ms) in sorted(by_kernel.items(), key=lambda item: -item[1][1])[:top]
        ],
        top_host_regions_ms_per_step=[
            dict(name=name, calls=calls // count, ms=round(ms / count, 2))
            for name, (calls, ms) in sorted(regions.items(), key=lambda item: -item[1][1])[:top]
        ],
    )


def main(argv: list[str] | None = None) -> None:
    """The command line: summarise the traces given, print the summaries as JSON (and write them with --json)."""
    parser = argparse.ArgumentParser(
        prog="nv_esm.trace_summary", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="kernels listed")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args(argv)
    summaries = [summarise(path, args.top) for path in args.traces]
    text = json.dumps(summaries, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
