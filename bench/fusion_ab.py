"""Kernel-level A/B of the Transformer Engine layer's fused paths, in ONE process, against the plain TE port.

    python bench/fusion_ab.py --proteins 64 --out bench/results/fusions

Variants of NVEsm (same weights; eager, so the GPU work is what differs):
  te_mha        TE's own MultiheadAttention (rotary on split queries and keys, values copied for the attention)
  rotate_qk_te_gelu  the layer's `rotated_forward`: `rotate_qk` on the fused QKV projection, packed attention, and
                TE's separate bias + GELU kernel
  gelu_gemm     rotate_qk and GELU in fc1's GEMM epilogue (bf16: TE's bias_gelu_nvfusion off, so cuBLASLt's GELU
                epilogue, the layer's default; FP8: TE's gemm_gelu_fusion, the epilogue writing fc2's FP8 input)
and `te_port` (`te_port.py`). Cases: infer (bf16 weights, no grad) and train (fp32 weights, bf16 autocast,
forward + backward), bf16 and FP8 (delayed scaling, every layer). Timed in alternating rounds (median tokens/s),
then each variant traced: GPU ms per kernel kind and every kernel with the operator that launched it. Logits of each
variant are compared with te_mha's. Writes OUT/fusion_ab.json.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformer_engine.pytorch as te  # noqa: F401  (before anything loads cuDNN)
from ab_model_code import SHAPE, draw_batches
from te_port import TEPort

import modeling_nv_esm
import modeling_nv_esm_layout
from nv_esm import trace_summary

VARIANTS = ("te_port", "te_mha", "rotate_qk_te_gelu", "gelu_gemm")
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


@contextlib.contextmanager
def variant_switches(model: torch.nn.Module, variant: str, fp8: bool):
    """Within: `model` runs `variant` (TE's own attention block, or the GELU epilogue switched on)."""
    patched = modeling_nv_esm_layout.PackedRun.make_qkv_rotation
    layers = [] if variant == "te_port" else [layer.layernorm_mlp for layer in model.esm.encoder.layers]
    if variant == "te_mha":
        modeling_nv_esm_layout.PackedRun.make_qkv_rotation = lambda self: None
    for mlp in layers:
        mlp.bias_gelu_nvfusion = variant != "gelu_gemm"  # te_mha: TE's layer as it comes
        mlp.gemm_gelu_fusion = variant == "gelu_gemm" and fp8
    try:
        yield
    finally:
        modeling_nv_esm_layout.PackedRun.make_qkv_rotation = patched
        for mlp in layers:
            mlp.bias_gelu_nvfusion, mlp.gemm_gelu_fusion = False, False  # the layer's defaults


def build(fp8: bool, train: bool) -> dict:
    torch.manual_seed(0)
    precision = {"layer_precision": ["fp8"] * SHAPE["num_hidden_layers"]} if fp8 else {}
    config = modeling_nv_esm.NVEsmConfig(
        **SHAPE, backend="te", attn_input_format="thd", check_inputs=False, cuda_graphs=False, **precision
    )
    ours = modeling_nv_esm.NVEsmForMaskedLM(config).cuda()
    port = TEPort(**SHAPE).cuda()
    for model in (ours, port):
        model.train(train)
        if not train:
            model.to(torch.bfloat16)
    return {"ours": ours, "te_port": port}


def step(model: torch.nn.Module, batch: dict, train: bool, fp8: bool) -> torch.Tensor:
    region = contextlib.nullcontext()
    if fp8 and isinstance(model, TEPort):
        from transformer_engine.common import recipe

        region = te.autocast(enabled=True, recipe=recipe.DelayedScaling())
    if train:
        with torch.autocast("cuda", dtype=torch.bfloat16), region:
            output = model(**batch)
        output.loss.backward()
        model.zero_grad(set_to_none=True)
        return output.logits.detach()
    with torch.no_grad(), region:
        return model(**{name: value for name, value in batch.items() if name != "labels"}).logits


def launching_ops(events: list[dict]) -> dict[int, str]:
    """Kernel correlation id -> name of the innermost CPU operator around the runtime call that launched it."""
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e and not e["name"].startswith("train_step"):
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in ops.values():
        spans.sort()
    names = {}
    for e in events:
        if e.get("cat") != "cuda_runtime" or "correlation" not in e.get("args", {}):
            continue
        spans = ops.get(e["tid"], [])
        index = bisect.bisect_right(spans, (e["ts"], float("inf"), ""))
        inner = None
        for start, end, name in reversed(spans[max(0, index - 200) : index]):
            if start <= e["ts"] <= end and (inner is None or start >= inner[0]):
                inner = (start, name)
        names[e["args"]["correlation"]] = inner[1] if inner else "?"
    return names


def kernels_with_ops(path: Path, steps: int) -> list[dict]:
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    ops = launching_ops(events)
    table = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            key = (e["name"][:90], ops.get(e.get("args", {}).get("correlation"), "?")[:60])
            table[key][0] += 1
            table[key][1] += e["dur"] / 1e3
    rows = [dict(kernel=k, op=o, calls=c // steps, ms=round(ms / steps, 3)) for (k, o), (c, ms) in table.items()]
    return sorted(rows, key=lambda row: -row["ms"])


def run_case(fp8: bool, train: bool, proteins: int, rounds: int, trace_dir: Path) -> dict:
    models = build(fp8, train)
    ours = models["ours"]
    batches = draw_batches(modeling_nv_esm, 3, proteins, seed=proteins)
    if fp8:  # FP8 GEMMs need a multiple of 16 tokens: the port gets no padding logic, so trim its batches
        for batch in batches:
            keep = batch["input_ids"].shape[1] // 16 * 16
            cu = batch["cu_seq_lens_q"].clamp_max(keep)
            batch.update(input_ids=batch["input_ids"][:, :keep], labels=batch["labels"][:, :keep], cu_seq_lens_q=cu)
    tokens = sum(batch["input_ids"].shape[1] for batch in batches)
    result = {"logits_max_abs_diff_vs_te_mha": {}}
    reference = None
    for variant in VARIANTS[1:]:
        with variant_switches(ours, variant, fp8):
            logits = step(ours, batches[0], train, fp8).float()
        if reference is None:
            reference = logits
        result["logits_max_abs_diff_vs_te_mha"][variant] = (logits - reference).abs().max().item()
    for variant in VARIANTS:  # warm: every shape, every path
        model = models["te_port" if variant == "te_port" else "ours"]
        with variant_switches(ours, variant, fp8):
            for _ in range(2):
                for batch in batches:
                    step(model, batch, train, fp8)
    rates = {variant: [] for variant in VARIANTS}
    for index in range(rounds):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            model = models["te_port" if variant == "te_port" else "ours"]
            with variant_switches(ours, variant, fp8):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for batch in batches:
                    step(model, batch, train, fp8)
                torch.cuda.synchronize()
            rates[variant].append(tokens / (time.perf_counter() - started))
    medians = {variant: statistics.median(values) for variant, values in rates.items()}
    result["tokens_per_s"] = medians
    result["over_te_port"] = {variant: medians[variant] / medians["te_port"] for variant in VARIANTS}
    result["traces"] = {}
    for variant in VARIANTS:
        model = models["te_port" if variant == "te_port" else "ours"]
        path = trace_dir / f"{variant}.json.gz"
        with variant_switches(ours, variant, fp8):
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=ACTIVITIES) as prof:
                for index, batch in enumerate(batches):
                    with torch.profiler.record_function(f"train_step_{index}"):
                        step(model, batch, train, fp8)
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        summary = trace_summary.summarise(path, top=0)
        result["traces"][variant] = {
            "gpu_busy_ms": summary["ms_per_step"]["gpu_busy"],
            "kernels_per_step": summary["kernels_per_step"],
            "kinds_ms": summary["kernel_kinds_ms_per_step"],
            "kernels": kernels_with_ops(path, len(batches))[:45],
        }
    print(
        f"{'fp8' if fp8 else 'bf16'} {'train' if train else 'infer'} {proteins}: "
        + ", ".join(f"{v} {result['over_te_port'][v]:.3f} ({result['traces'][v]['gpu_busy_ms']} ms)" for v in VARIANTS),
        flush=True,
    )
    del models
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proteins", type=int, nargs="+", default=[64])
    parser.add_argument("--cases", nargs="+", default=["bf16_infer", "bf16_train", "fp8_infer", "fp8_train"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "cases": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for case in args.cases:
            precision, mode = case.split("_")
            for proteins in args.proteins:
                trace_dir = Path(folder)
                name = f"{case}_{proteins}"
                report["cases"][name] = run_case(precision == "fp8", mode == "train", proteins, args.rounds, trace_dir)
                (args.out / "fusion_ab.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
