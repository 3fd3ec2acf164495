"""Throughput and memory of NVEsm vs transformers' EsmForMaskedLM on one GPU, side by side on the same batches.

    python bench/benchmark.py --shapes 8M 650M --proteins 16 64 --out bench/results

Variants (random weights of the ESM-2 shape):
  transformers  EsmForMaskedLM, attn_implementation="sdpa", padded to the longest protein of the batch
  nv_bshd       NVEsm on Transformer Engine, padded batch run padded (attn_input_format="bshd")
  nv_thd        NVEsm on TE, packed batch (cu_seq_lens) run packed, default config (inputs checked: 1 sync)
  nv_thd_unchecked  nv_thd with check_inputs=False (no device sync per forward; trusted training pipelines)
  nv_inmodel    NVEsm on TE, padded batch unpadded inside the model (attn_input_format="thd")
  nv_thd_fp8    nv_thd_unchecked with every layer in FP8 (DelayedScaling)
  nv_thd_bf16w  nv_thd_unchecked training on bf16 weights with fp32 master copies in the optimizer and no autocast
                (what the FSDP2 recipe does); same numerics class as autocast, fewer casts and no autocast dispatch
  nv_thd_graphs      nv_thd with cuda_graphs=True: batches padded to static shapes, layers replayed as CUDA graphs
  nv_thd_graphs_fp8  nv_thd_graphs with every layer in FP8 (DelayedScaling)
  nv_thd_graphs_cudnn_ln  nv_thd_graphs with cudnn_layer_norm=True (cuDNN's LayerNorm kernels in TE's layers)
  nv_thd_graphs_bf16w  nv_thd_graphs training bf16 weights, AdamW on fp32 master copies (as nv_thd_bf16w)
  te_port       the plain TE port (`te_port.py`): a `te.TransformerLayer` stack fed THD keyword arguments directly,
                ESM-2's embedding and LM head around it, nothing else; the floor any TE port gets

Every variant first runs the timed batches 4 times untimed (so each shape has been seen: cuDNN plans, TE's
first-use set-up, CUDA-graph captures, which for an inference shape come at its second batch, and the timing of
each captured inference shape replayed and run eagerly, after which it runs the faster way; the passes are
reported as `warm_pass_seconds`), then times them.
Each variant runs in its own process (Transformer Engine's torch.compile'd helpers and cuDNN caches are not
shared between variants). `--max-batch` also searches, by doubling, the most proteins per training step that fit.

Training step: forward + backward + fused AdamW, fp32 master weights, torch.autocast(bfloat16).
Inference: bf16 weights, no grad. Protein lengths are drawn log-normally (median 270 residues, long tail, cropped
to 1024 as UniRef50 training does), 15% of residues masked (80/10/10) with labels on them.

Model FLOPs (MFU = FLOP/s / 989 TFLOP/s, H100 SXM dense bf16), counted on real (unpadded) tokens only:
  matmul FLOPs per token = 2 * (L * (4 h^2 + 2 h i) + h^2 + h * V)     (QKV, proj, fc1, fc2; LM head)
  attention FLOPs per protein of s tokens = 4 * L * h * s^2
  training = 3 x forward. Embedding lookups, norms and softmax are not counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from modeling_nv_esm import NVEsmForMaskedLM, pack_proteins
from modeling_nv_esm_layers import transformer_engine_available
from nv_esm.data import pad_proteins

assert transformer_engine_available(), "the benchmark needs Transformer Engine (imported before cuDNN loads)"

from te_port import TEPort  # noqa: E402  (bench/te_port.py)
from transformers import EsmForMaskedLM  # noqa: E402

from configuration_nv_esm import NVEsmConfig  # noqa: E402
from nv_esm import shapes  # noqa: E402
from nv_esm.alphabet import CLS, EOS, MASK, PAD, STANDARD_IDS  # noqa: E402
from plot_speed import plot  # noqa: E402  (bench/plot_speed.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = shapes.ESM2_SHAPES
VARIANT_CONFIGS = {
    "nv_bshd": dict(attn_input_format="bshd"),
    "nv_thd": dict(),
    "nv_thd_unchecked": dict(check_inputs=False),
    "nv_inmodel": dict(),
    "nv_thd_fp8": dict(check_inputs=False, fp8=True),
    "nv_thd_bf16w": dict(check_inputs=False),
    "nv_thd_graphs": dict(cuda_graphs=True),
    "nv_thd_graphs_unchecked": dict(cuda_graphs=True, check_inputs=False),
    "nv_thd_graphs_fp8": dict(cuda_graphs=True, fp8=True),
    "nv_thd_graphs_cudnn_ln": dict(cuda_graphs=True, cudnn_layer_norm=True),
    "nv_thd_graphs_bf16w": dict(cuda_graphs=True),
    "nv_thd_fp8_current": dict(check_inputs=False, fp8=True, fp8_recipe="current"),
    "nv_thd_graphs_fp8_current": dict(cuda_graphs=True, fp8=True, fp8_recipe="current"),
}
VARIANTS = ("transformers", "te_port", *VARIANT_CONFIGS)
PACKED_VARIANTS = {"te_port", *(name for name in VARIANT_CONFIGS if name.startswith("nv_thd"))}
MASTER_WEIGHT_VARIANTS = {"nv_thd_bf16w", "nv_thd_graphs_bf16w"}
MAX_BATCH_VARIANTS = {"transformers", "nv_thd_unchecked"}
PEAK_TFLOPS = shapes.PEAK_BF16_TFLOPS["H100"]
MEDIAN_RESIDUES, LENGTH_SIGMA, MAX_RESIDUES = 270, 0.7, 1024
FIRST_RESIDUE, END_RESIDUES = STANDARD_IDS[0], STANDARD_IDS[-1] + 1  # the 20 standard residues' ids are contiguous
assert STANDARD_IDS == tuple(range(FIRST_RESIDUE, END_RESIDUES))


def draw_batches(num_batches: int, proteins: int, seed: int) -> list[list[torch.Tensor]]:
    """Token lists (with <cls>/<eos>), 15% of residues masked; labels kept separately in `masked_batch`."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        lengths = torch.exp(math.log(MEDIAN_RESIDUES) + LENGTH_SIGMA * torch.randn(proteins, generator=generator))
        lengths = lengths.clamp(10, MAX_RESIDUES).long().tolist()
        batches.append([torch.randint(FIRST_RESIDUE, END_RESIDUES, (n,), generator=generator) for n in lengths])
    return batches


def mlm_inputs(residues: list[torch.Tensor], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """ESM masking: 15% of residues; of those 80% <mask>, 10% random, 10% unchanged. Labels -100 elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    tokens, labels = [], []
    for protein in residues:
        chosen = torch.rand(protein.shape, generator=generator) < 0.15
        roll = torch.rand(protein.shape, generator=generator)
        inputs = torch.where(chosen & (roll < 0.8), MASK, protein)
        inputs = torch.where(
            chosen & (roll >= 0.8) & (roll < 0.9),
            torch.randint(FIRST_RESIDUE, END_RESIDUES, protein.shape, generator=generator),
            inputs,
        )
        tokens.append(torch.cat([torch.tensor([CLS]), inputs, torch.tensor([EOS])]))
        labels.append(torch.cat([torch.tensor([-100]), torch.where(chosen, protein, -100), torch.tensor([-100])]))
    return tokens, labels


def padded(tokens: list[torch.Tensor], labels: list[torch.Tensor]) -> dict:
    """Right-padded batch on the GPU, labels -100 at padding."""
    batch = pad_proteins(tokens, PAD)
    batch["labels"] = pad_proteins(labels, -100)["input_ids"]
    return {name: tensor.cuda() for name, tensor in batch.items()}


def packed(tokens: list[torch.Tensor], labels: list[torch.Tensor]) -> dict:
    """Packed batch on the GPU: input_ids, labels, cu_seq_lens_q, max_length_q."""
    batch = pack_proteins(tokens, labels)
    return {
        "input_ids": batch["input_ids"].cuda(),
        "labels": batch["labels"].cuda(),
        "cu_seq_lens_q": batch["cu_seq_lens_q"].cuda(),
        "max_length_q": batch["max_length_q"],
    }


def model_flops(shape: dict, lengths: list[int], training: bool) -> float:
    return shapes.model_flops(
        shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], lengths, training
    )


def build(variant: str, shape: dict, training: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if variant == "transformers":
        model = EsmForMaskedLM._from_config(shapes.esm2_config(**shape), attn_implementation="sdpa")
    elif variant == "te_port":
        model = TEPort(**shape)
    else:
        options = {"cuda_graphs": False, **VARIANT_CONFIGS[variant]}  # eager unless the variant says graphs
        if options.pop("fp8", False):
            options["layer_precision"] = ["fp8"] * shape["num_hidden_layers"]
        model = NVEsmForMaskedLM(NVEsmConfig(**shape, backend="te", **options))
    fp32 = training and variant not in MASTER_WEIGHT_VARIANTS
    return model.cuda().to(torch.float32 if fp32 else torch.bfloat16).train(training)


class MasterWeightAdamW:
    """Fused AdamW on fp32 master copies of a bf16 model's weights: gradients are cast up, the step runs in fp32 and
    the weights are cast back, each with one multi-tensor copy."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        # Every trained weight gets a gradient each step; the contact head takes no part in the MLM loss.
        self.weights = [p for name, p in model.named_parameters() if p.requires_grad and "contact_head" not in name]
        self.master = [p.detach().float() for p in self.weights]
        for master in self.master:
            master.grad = torch.zeros_like(master)
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.weights])
        self.optimizer.step()
        torch._foreach_copy_(self.weights, self.master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for weight in self.weights:
            weight.grad = None


def make_optimizer(variant: str, model: torch.nn.Module) -> torch.optim.Optimizer | MasterWeightAdamW:
    if variant in MASTER_WEIGHT_VARIANTS:
        return MasterWeightAdamW(model, lr=1e-5)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def inputs_for(variant: str, tokens, labels) -> dict:
    return packed(tokens, labels) if variant in PACKED_VARIANTS else padded(tokens, labels)


def step(
    model: torch.nn.Module, batch: dict, optimizer: torch.optim.Optimizer | None, autocast: bool = True
) -> torch.Tensor | None:
    """One training step (forward, backward, AdamW; under bf16 autocast unless the weights are bf16 already; its
    loss, detached, is returned without waiting for it) or, without optimizer, one inference (None)."""
    if optimizer is None:
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
        return None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run(variant: str, shape_name: str, proteins: int, training: bool, steps: int, warmup: int) -> dict:
    shape = SHAPES[shape_name]
    batches = [mlm_inputs(b, seed=i) for i, b in enumerate(draw_batches(steps + warmup, proteins, seed=1))]
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = {"variant": variant, "shape": shape_name, "proteins": proteins, "mode": "train" if training else "infer"}
    try:
        model = build(variant, shape, training)
        optimizer = make_optimizer(variant, model) if training else None
        prepared = [inputs_for(variant, tokens, labels) for tokens, labels in batches]
        autocast = variant not in MASTER_WEIGHT_VARIANTS
        for batch in prepared[:warmup]:
            step(model, batch, optimizer, autocast)
        warm_pass = []
        for _ in range(4):  # the warm passes: every timed shape 4 times (an inference graph is captured at the
            # second, timed at the third, run eagerly and timed at the fourth; the timed pass runs the faster way)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for batch in prepared[warmup:]:
                step(model, batch, optimizer, autocast)
            torch.cuda.synchronize()
            warm_pass.append(time.perf_counter() - start)
        start = time.perf_counter()
        for batch in prepared[warmup:]:
            step(model, batch, optimizer, autocast)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
    except torch.OutOfMemoryError:
        result.update(
            oom=True,
            peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30,
            peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30,
        )
        return result
    finally:
        model = optimizer = prepared = None  # noqa: F841
    timed = batches[warmup:]
    lengths = [[len(t) for t in tokens] for tokens, _ in timed]
    real_tokens = sum(map(sum, lengths)) / steps
    padded_tokens = sum(len(ls) * max(ls) for ls in lengths) / steps
    step_flops = sum(model_flops(shape, ls, training) for ls in lengths) / steps
    result.update(
        oom=False,
        step_seconds=seconds,
        tokens_per_step=real_tokens,
        tokens_per_second=real_tokens / seconds,
        tflops=step_flops / seconds / 1e12,
        mfu=step_flops / seconds / 1e12 / PEAK_TFLOPS,
        padding_fraction=1 - real_tokens / padded_tokens,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 2**30,
        peak_reserved_gb=torch.cuda.max_memory_reserved() / 2**30,
        warm_pass_seconds=warm_pass,
    )
    return result


def largest_batch(variant: str, shape: str, start: int, limit: int = 1024) -> int:
    """Most proteins per training step (doubling from `start`) that run 2 steps without running out of memory."""
    fits, proteins = 0, start
    while proteins <= limit:
        if run(variant, shape, proteins, training=True, steps=1, warmup=1)["oom"]:
            break
        fits, proteins = proteins, 2 * proteins
    return fits


def worker(args: argparse.Namespace) -> None:
    """Run every requested case of the given variants in this process, printing one RESULT line each."""
    for variant in args.variants:
        for shape in args.shapes:
            for mode in args.modes:
                for proteins in args.proteins:
                    result = run(variant, shape, proteins, mode == "train", args.steps, args.warmup)
                    print("RESULT " + json.dumps(result), flush=True)
            if shape in args.max_batch and variant in MAX_BATCH_VARIANTS:
                result = {"variant": variant, "shape": shape, "mode": "train", "max_proteins": None}
                result["max_proteins"] = largest_batch(variant, shape, start=8)
                print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["8M", "650M"], choices=sorted(SHAPES))
    parser.add_argument("--proteins", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--max-batch", nargs="*", default=[], choices=sorted(SHAPES), help="shapes to search")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants:
        command = [sys.executable, __file__, "--worker", "--variants", variant, "--shapes", *args.shapes]
        command += ["--proteins", *map(str, args.proteins), "--modes", *args.modes, "--max-batch", *args.max_batch]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        process = subprocess.run(command, capture_output=True, text=True)
        lines = [line[7:] for line in process.stdout.splitlines() if line.startswith("RESULT ")]
        if process.returncode:
            print(process.stderr[-3000:], file=sys.stderr)
        for line in lines:
            print(line, flush=True)
            results.append(json.loads(line))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    meta["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # the workers inherit it
    (args.out / "benchmark.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, args.out / "benchmark.png", f"ESM-2 throughput, {meta['device']}, {meta['date']}")


if __name__ == "__main__":
    main()
