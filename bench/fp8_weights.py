"""GPU memory and speed of weights held in FP8 (`fp8_weights=True`, TE's `quantized_model_init`) against the same
FP8 layers computing from bf16 weights, and against bf16, one process per variant.

    python bench/fp8_weights.py --shapes 650M 3B --out bench/results/fp8_weights.json

Variants (random weights of the ESM-2 shape, built in bf16 on the GPU, every layer "fp8" except `bf16`):
  bf16                  no FP8
  fp8_{recipe}          FP8 GEMMs, bf16 weights cast to FP8 at each forward
  fp8_weights_{recipe}  FP8 GEMMs, weights held in FP8 only (recipe: delayed, current, block)

Figures per variant: inference on a model built under `torch.no_grad()` in eval mode (FP8 weights: rows only),
packed batches of `--proteins` proteins: weights GB (allocated by the build), peak GB, seconds per batch, mean loss;
then a training step (forward, backward, TE's FusedAdam with fp32 master weights for every variant alike) on a model
built with gradients (FP8 weights: rows and transposes): the same figures. Batches as `bench/benchmark.py` draws.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from modeling_nv_esm import NVEsmForMaskedLM
from modeling_nv_esm_layers import transformer_engine_available

assert transformer_engine_available(), "the benchmark needs Transformer Engine (imported before cuDNN loads)"

from benchmark import draw_batches, mlm_inputs, packed  # noqa: E402  (bench/benchmark.py, beside this script)
from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: E402

from configuration_nv_esm import NVEsmConfig  # noqa: E402
from nv_esm import shapes  # noqa: E402

RECIPES = ("delayed", "current", "block")
VARIANTS = ("bf16", *(f"fp8_{r}" for r in RECIPES), *(f"fp8_weights_{r}" for r in RECIPES))
GB = 2**30


def build(variant: str, shape: dict) -> NVEsmForMaskedLM:
    options: dict = dict(backend="te", cuda_graphs=False, check_inputs=False)
    if variant != "bf16":
        options.update(layer_precision=["fp8"] * shape["num_hidden_layers"], fp8_recipe=variant.rsplit("_", 1)[1])
        options.update(fp8_weights=variant.startswith("fp8_weights"))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = NVEsmForMaskedLM(NVEsmConfig(**shape, **options))
    torch.set_default_dtype(torch.float32)
    return model


def timed(run_once, batches: list[dict]) -> tuple[float, float, float]:
    """Seconds per batch (after one untimed pass), peak GB, mean loss of the timed pass."""
    for batch in batches:
        run_once(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, losses = time.perf_counter(), []
    for batch in batches:
        losses.append(run_once(batch))
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / len(batches)
    return seconds, torch.cuda.max_memory_allocated() / GB, float(torch.stack(losses).mean())


def run(variant: str, shape_name: str, proteins: int, steps: int) -> dict:
    """Inference on a model built without gradients (eval: FP8 weights keep their rows only), then training on one
    built with them (FP8 weights keep rows and transposes)."""
    shape = shapes.ESM2_SHAPES[shape_name]
    batches = [packed(*mlm_inputs(b, seed=i)) for i, b in enumerate(draw_batches(steps, proteins, seed=1))]
    result = {"variant": variant, "shape": shape_name, "proteins": proteins}
    gc.collect()  # an earlier shape's models (TE modules hold reference cycles)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        model = build(variant, shape).eval()
    result["infer_weights_gb"] = (torch.cuda.memory_allocated() - before) / GB

    def infer(batch: dict) -> torch.Tensor:
        with torch.no_grad():
            return model(**batch).loss.detach()

    result["infer_seconds"], result["infer_peak_gb"], result["infer_loss"] = timed(infer, batches)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = build(variant, shape).train()
    result["train_weights_gb"] = (torch.cuda.memory_allocated() - before) / GB
    optimizer = FusedAdam(model.parameters(), lr=1e-5, master_weights=True)

    def train(batch: dict) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        result["train_seconds"], result["train_peak_gb"], result["train_loss"] = timed(train, batches)
    except torch.OutOfMemoryError:
        result["train_oom"] = True
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["650M"], choices=sorted(shapes.ESM2_SHAPES))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--proteins", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        for shape in args.shapes:
            print("RESULT " + json.dumps(run(args.variants[0], shape, args.proteins, args.steps)), flush=True)
        return
    results = []
    for variant in args.variants:
        command = [sys.executable, __file__, "--worker", "--variants", variant, "--shapes", *args.shapes]
        command += ["--proteins", str(args.proteins), "--steps", str(args.steps), "--out", str(args.out)]
        process = subprocess.run(command, capture_output=True, text=True)
        if process.returncode:
            print(f"{variant}: exit {process.returncode}\n{process.stderr[-3000:]}", file=sys.stderr)
            results.append({"variant": variant, "error": process.stderr[-3000:]})
        for line in process.stdout.splitlines():
            if line.startswith("RESULT "):
                print(line[7:], flush=True)
                results.append(json.loads(line[7:]))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
