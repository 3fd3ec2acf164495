"""FP8 weights under FSDP2 (issue 44, item 4), outside the trainer: does NVEsm hold Transformer Engine's quantized
weights as FSDP2 shards, train, evaluate and round-trip a DCP checkpoint (the probe), and is it faster than FP8
compute with bf16 all-gathers (`--speed`)? On 2 GPUs or more:

    torchrun --nproc-per-node 2 bench/fp8_weights_fsdp2.py --recipes delayed current block --out OUT/fp8w.json
    torchrun --nproc-per-node 2 bench/fp8_weights_fsdp2.py --speed 650M 3B --recipes block delayed --out OUT/speed.json

The model is built on the meta device and its layers rebuilt there inside `te.quantized_model_init(recipe)` (the
model's own `make_layers` builds high precision first and `hold_fp8_weights` quantizes real weights, which a meta
model does not have), then `fully_shard` per layer and root (our MixedPrecisionPolicy: bf16 compute, fp32 gradient
reduction; `--no-mp-policy`: none) with the trainer's neighbour prefetch, then TE's own `reset_parameters` per TE
module (which quantizes each local shard) and a plain initialisation of the rest.

Probe (hidden 512, 2 layers, per recipe; a stage that fails records its exception and ends that recipe):
  build/shard/materialize  every GEMM weight a DTensor over a TE quantized tensor, its per-tensor scale equal on
             every rank; nothing left on meta
  step       3 training steps (the model's own FP8 region), TE FusedAdam with fp32 master weights; losses, seconds,
             peak memory; then an eval forward
  dcp        torch.distributed.checkpoint save of the model, load into a fresh one: dequantized weights bitwise equal
Speed (ESM-2 shapes, `--tokens` per rank, `--steps` steps, median step after 4): `bf16` (bf16 layers and
all-gathers, torch's fused AdamW as the trainer's), `fp8` (FP8 compute, bf16 all-gathers), `fp8w` (FP8 weights
and all-gathers, FusedAdam with fp32 master weights); tokens/s per GPU, peak memory, losses. The batches' labels
are their own unmasked tokens (a copy task: the losses fall fast and say nothing of training quality; they only
show the steps update the weights).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformer_engine.pytorch as te  # before anything loads cuDNN
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from configuration_nv_esm import NVEsmConfig
from modeling_nv_esm import NVEsmForMaskedLM, pack_proteins
from modeling_nv_esm_layers import is_fp8_tensor, make_fp8_recipe
from nv_esm.train.parallel import prefetch_layers

RECIPES = ("delayed", "current", "block")


SMALL = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_hidden_layers=2)


def small_config(recipe: str | None, shape: dict | None = None) -> NVEsmConfig:
    """Hidden 512, 2 layers (or `shape`): local rows of every GEMM weight a multiple of 128 on 2 ranks (block
    scaling). `recipe` None: bf16 layers."""
    shape = shape or SMALL
    precision = ["fp8" if recipe else None] * shape["num_hidden_layers"]
    return NVEsmConfig(
        vocab_size=33, max_position_embeddings=1026, backend="te", layer_precision=precision,
        fp8_recipe=recipe or "delayed", cuda_graphs=False, check_inputs=False, **shape,
    )  # fmt: skip


def packed_batch(device: torch.device, seed: int, proteins: int = 12) -> dict:
    """`proteins` random proteins (`<cls>` ... `<eos>`, 40-300 tokens), 15% of tokens labelled, packed; a multiple
    of 16 tokens (FP8)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 300, (proteins,), generator=generator)
    lengths[-1] += (-int(lengths.sum())) % 16
    return packed_proteins(lengths.tolist(), generator, device)


def packed_proteins(lengths: list[int], generator: torch.Generator, device: torch.device) -> dict:
    """Random proteins of `lengths` tokens (`<cls>` ... `<eos>`, residue ids drawn from `generator`), 15% of tokens
    labelled with themselves, packed on `device`."""
    proteins = [torch.cat([torch.tensor([0]), torch.randint(4, 24, (n - 2,), generator=generator), torch.tensor([2])])
                for n in lengths]  # fmt: skip
    labels = [torch.where(torch.rand(p.shape, generator=generator) < 0.15, p, -100) for p in proteins]
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack_proteins(proteins, labels).items()}


def te_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = te.module.base.TransformerEngineBaseModule
    return [module for module in model.modules() if isinstance(module, base)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def weight_report(model: torch.nn.Module) -> dict:
    """Per TE GEMM weight: its DTensor-ness, local type, and whether its scale is equal on every rank."""
    report = {}
    for module_name, module in ((n, m) for n, m in model.named_modules() if m in te_modules(model)):
        for name, parameter in module.named_parameters(recurse=False):
            if not name.endswith("weight") or "layer_norm" in name:
                continue
            part = local(parameter)
            entry = {"dtensor": isinstance(parameter, DTensor), "local_type": type(part).__name__,
                     "quantized": is_fp8_tensor(part), "shape": list(part.shape)}  # fmt: skip
            scale = getattr(part, "_scale_inv", None)
            if isinstance(scale, torch.Tensor) and scale.numel() == 1:
                scales = [torch.zeros_like(scale) for _ in range(dist.get_world_size())]
                dist.all_gather(scales, scale.contiguous())
                entry["scale_inv"] = [s.item() for s in scales]
                entry["scales_equal"] = all(torch.equal(s, scales[0]) for s in scales)
            entry["has_transpose"] = getattr(part, "_transpose", None) is not None
            report[f"{module_name}.{name}"] = entry
    return report


def build(
    recipe: str | None, device: torch.device, policy: bool, result: dict, fp8_weights: bool = True,
    shape: dict | None = None,
) -> torch.nn.Module:  # fmt: skip
    """The model on the meta device, its layers rebuilt inside quantized_model_init (`fp8_weights`), FSDP2 per layer
    and root (prefetching the neighbour's gather, as the trainer does), TE modules materialised by their own
    `reset_parameters` (quantized shards for FP8 weights), the rest by `to_empty` and a plain initialisation."""
    config = small_config(recipe, shape)
    with torch.device("meta"):
        model = NVEsmForMaskedLM(config)
    encoder = model.esm.encoder
    # our make_layers builds high precision first (hold_fp8_weights quantizes real weights later, skipped on meta):
    # rebuild each layer on meta inside quantized_model_init, as TE's own FSDP2 tests build theirs
    if fp8_weights:
        with torch.device("meta"), te.quantized_model_init(enabled=True, recipe=make_fp8_recipe(recipe)):
            for index in range(config.num_hidden_layers):
                encoder.layers[index] = encoder.backend.make_layer(config, index + 1)
    result["build"] = {"te_weights_quantized": all(is_fp8_tensor(m.weight) for m in te_modules(model)
                                                   if hasattr(m, "weight") and m.weight is not None)}  # fmt: skip
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy else None
    kwargs = {} if mp is None else {"mp_policy": mp}
    for layer in model.esm.encoder.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    prefetch_layers(list(model.esm.encoder.layers))
    result["shard"] = {"mp_policy": policy}
    modules = te_modules(model)
    for module in modules:
        module.reset_parameters()
    for module in model.modules():
        if module in modules:
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)) or any(b.is_meta for b in module.buffers(False)):
            module.to_empty(device=device, recurse=False)
            for name, parameter in module.named_parameters(recurse=False):
                with torch.no_grad():
                    if "bias" in name:
                        local(parameter).zero_()
                    elif parameter.dim() == 1:
                        local(parameter).fill_(1.0)
                    else:
                        local(parameter).normal_(0.0, 0.02)
    for module in model.modules():  # rotary inv_freq and other buffers
        if any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)
    rotary = model.esm.rotary_embeddings
    rotary.inv_freq = rotary.default_inv_freq(config).to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    result["materialize"] = {"meta_left": left, "weights": weight_report(model)}
    return model


def packed_tokens(device: torch.device, seed: int, tokens: int) -> dict:
    """Random proteins of 40-640 tokens, `tokens` in all (a multiple of 16), 15% labelled, packed."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens - 640:  # the last protein takes the rest: 41 to 640 tokens
        lengths.append(int(torch.randint(40, 600, (1,), generator=generator)))
    lengths.append(tokens - sum(lengths))
    return packed_proteins(lengths, generator, device)


def speed(variant: str, recipe: str, shape_name: str, tokens: int, steps: int, device: torch.device) -> dict:
    """Train `steps` steps of `variant` (bf16: bf16 layers, bf16 all-gather; fp8: FP8 compute, bf16 all-gather, torch
    fused AdamW as the trainer; fp8w: FP8 weights, FP8 all-gather, TE FusedAdam with fp32 master weights) on
    `tokens` tokens per rank: median step seconds after 4, tokens/s per GPU, peak memory, losses."""
    from nv_esm.shapes import ESM2_SHAPES

    result: dict = {"variant": variant, "recipe": recipe, "shape": shape_name, "tokens_per_rank": tokens}
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = build(None if variant == "bf16" else recipe, device, True, {}, variant == "fp8w",
                      ESM2_SHAPES[shape_name])  # fmt: skip
        model.train()
        if variant == "fp8w":
            optimizer = te.optimizers.FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                                                master_weights=True, master_weight_dtype=torch.float32)  # fmt: skip
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        result["state_gb"] = torch.cuda.memory_allocated() / 2**30
        losses, seconds = [], []
        for step in range(steps):
            batch = packed_tokens(device, 1000 * dist.get_rank() + step, tokens)
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            losses.append(loss.item())
        timed = sorted(seconds[4:])
        median = timed[len(timed) // 2]
        result.update(losses=losses, seconds=seconds, median_s=median, tokens_per_s_per_gpu=tokens / median,
                      peak_gb=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip
        del model, optimizer
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    torch.cuda.empty_cache()
    return result


def probe(recipe: str, device: torch.device, policy: bool, out_dir: Path) -> dict:
    result: dict = {}
    stage = "build"
    try:
        torch.cuda.reset_peak_memory_stats()
        model = build(recipe, device, policy, result)
        stage = "step"
        model.train()
        optimizer = te.optimizers.FusedAdam(
            model.parameters(), lr=1e-4, master_weights=True, master_weight_dtype=torch.float32
        )
        losses, seconds = [], []
        for step in range(3):
            started = time.perf_counter()
            loss = model(**packed_batch(device, 1000 * dist.get_rank() + step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            losses.append(loss.item())
        model.eval()
        eval_weights = weight_report(model)
        with torch.no_grad():
            eval_loss = model(**packed_batch(device, 99)).loss.item()
        model.train()
        result["eval"] = {"loss": eval_loss, "weights": eval_weights}
        result["step"] = {"losses": losses, "seconds": seconds, "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
                          "weights_after": weight_report(model)}  # fmt: skip
        stage = "dcp"
        import torch.distributed.checkpoint as dcp

        folder = out_dir / f"dcp_{recipe}"
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder))
        fresh = build(recipe, device, policy, {})
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=str(folder))
        fresh.load_state_dict(state["model"])
        same = {}
        for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
            da, db = local(a), local(b)
            da = da.dequantize() if is_fp8_tensor(da) else da
            db = db.dequantize() if is_fp8_tensor(db) else db
            same[name] = bool(torch.equal(da, db))
        result["dcp"] = {"all_equal": all(same.values()), "differ": [n for n, v in same.items() if not v]}
    except Exception as error:  # recorded: the answer to this stage's question
        result["failed_stage"] = stage
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--no-mp-policy", action="store_true", help="fully_shard without MixedPrecisionPolicy")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--speed", nargs="*", default=None, metavar="SHAPE",
                        help="instead of the probe: training speed of bf16 / fp8 / fp8w for these shapes")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=14)
    args = parser.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    import transformer_engine

    results = {
        "te": transformer_engine.__version__,
        "torch": torch.__version__,
        "world": dist.get_world_size(),
        "recipes": {},
    }
    if args.speed is not None:
        results["speed"] = []
        for shape_name in args.speed:
            for recipe in args.recipes:
                for variant in ("bf16", "fp8", "fp8w"):
                    if variant == "bf16" and recipe != args.recipes[0]:
                        continue
                    results["speed"].append(speed(variant, recipe, shape_name, args.tokens, args.steps, device))
                    row = results["speed"][-1]
                    if dist.get_rank() == 0:
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps(results, indent=1, default=str))
                        print(f"{shape_name} {variant} {recipe}: {row.get('error') or row['tokens_per_s_per_gpu']:.0f}"
                              if "error" not in row else f"{shape_name} {variant} {recipe}: {row['error']}",
                              flush=True)  # fmt: skip
        dist.destroy_process_group()
        return
    for recipe in args.recipes:
        results["recipes"][recipe] = probe(recipe, device, not args.no_mp_policy, args.out.parent)
        failed = torch.tensor([int("error" in results["recipes"][recipe])], device=device)
        dist.all_reduce(failed)
        results["recipes"][recipe]["ranks_failed"] = int(failed.item())
        if dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1, default=str))
        print(f"[rank {dist.get_rank()}] {recipe}: {results['recipes'][recipe].get('error', 'ok')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
