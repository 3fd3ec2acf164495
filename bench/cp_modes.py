"""Transformer Engine's context-parallel attention, per communication type (`p2p`, `a2a`, `all_gather`), on all the
ranks of one torchrun (`--cp` = the world size): where its outputs are right, and how fast it is.

    PYTHONPATH=$PWD:$PWD/tests torchrun --nproc-per-node 2 bench/cp_modes.py --out $OUT/cp_modes_2.json

accuracy (8M, bf16, random weights): the unsplit model against the split one on the same packed batch, the largest
logit difference of each protein, in eval and train mode; once for one batch holding a protein of every length in
`SHORT` and `LONG` (tokens, <cls> and <eos> included), once per short length in a batch of its own beside a
300-token protein; and the largest
relative gradient difference after `reduce_partial_gradients` on the long proteins. Each protein also gets "empty
chunk": whether one of its `2 * cp` chunks holds padding only (TE's chunk lengths clamp to 0 there).

speed (`--speed-shape`, bf16 weights, one protein of `--speed-tokens` tokens): seconds per forward + backward on one
GPU (rank 0) and split over the ranks, per communication type (median of 5 after 2). The model itself picks the
exchange (`ContextParallel.te_exchange`); this script sets each one on the split model's layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformer_engine.pytorch  # noqa: F401  (before cuDNN loads)

from conftest import make_hf_model, make_nv_model, pack_batch, random_proteins
from modeling_nv_esm import NVEsmForMaskedLM, pack_proteins
from nv_esm.shapes import ESM2_SHAPES, esm2_config
from nv_esm.state_dict_mapping import nv_config_from_hf

SHORT = list(range(1, 41)) + [50, 62, 63]
LONG = [64, 100, 129, 300, 1026]
COMM_TYPES = ("p2p", "a2a", "all_gather")


def set_comm_type(model: NVEsmForMaskedLM, comm_type: str) -> None:
    group = dist.group.WORLD
    stream = torch.cuda.Stream()
    for layer in model.base_model.encoder.layers:
        layer.set_context_parallel_group(group, list(range(dist.get_world_size())), stream, cp_comm_type=comm_type)


def empty_chunk(tokens: int, cp: int) -> bool:
    unit = 2 * cp
    padded = -(-tokens // unit) * unit
    return padded - tokens >= padded // unit


def on_cuda(batch: dict) -> dict:
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def per_protein_errors(models: dict, lengths: list[int], seed: int, cp: int) -> list[dict]:
    proteins = random_proteins(lengths, seed=seed, mask_fraction=0.15)
    packed = on_cuda(pack_batch(proteins))
    bounds = packed["cu_seq_lens_q"].tolist()
    rows = []
    for mode in ("eval", "train"):
        logits = {}
        for name, model in models.items():
            model.train(mode == "train")
            with torch.no_grad():
                logits[name] = model(**packed).logits[0].float()
        diff = (logits["split"] - logits["whole"]).abs().amax(-1)
        for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if mode == "eval":
                rows.append({"tokens": lengths[index], "empty_chunk": empty_chunk(end - start, cp)})
            rows[index][mode] = diff[start:end].max().item()
    return rows


def gradient_error(models: dict, lengths: list[int]) -> float:
    proteins = random_proteins(lengths, seed=7, mask_fraction=0.15)
    packed = on_cuda(pack_proteins(proteins, labels=proteins))
    grads = {}
    for name, model in models.items():
        model.train()
        model.zero_grad(set_to_none=True)
        model(**packed).loss.backward()
        if name == "split":
            model.reduce_partial_gradients()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    worst = 0.0
    for name, grad in grads["whole"].items():
        other = grads["split"][name]
        worst = max(worst, ((other - grad).norm() / grad.norm().clamp_min(1e-12)).item())
    return worst


def accuracy(cp: int) -> dict:
    hf = make_hf_model("esm2_8M", seed=100)
    models = {
        name: make_nv_model(hf, backend="te", attn_input_format="thd", cuda_graphs=False).cuda().to(torch.bfloat16)
        for name in ("whole", "split")
    }
    models["split"].load_state_dict(models["whole"].state_dict())
    models["split"].enable_context_parallel(dist.group.WORLD)
    results = {}
    for comm_type in COMM_TYPES:
        try:
            set_comm_type(models["split"], comm_type)
            together = per_protein_errors(models, SHORT + LONG, seed=130, cp=cp)
            alone = [per_protein_errors(models, [length, 300], seed=length, cp=cp)[0] for length in SHORT]
            results[comm_type] = {
                "together": together,
                "beside_300": alone,
                "gradient_rel_long": gradient_error(models, LONG),
            }
        except Exception as error:  # noqa: BLE001  (a diagnosis: record what TE refused)
            results[comm_type] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    return results


def step_seconds(model: NVEsmForMaskedLM, packed: dict, together: bool = True) -> float:
    """Median seconds of forward + backward (5 after 2); `together`: every rank starts each step at once."""
    times = []
    for _ in range(7):
        torch.cuda.synchronize()
        if together:
            dist.barrier()
        start = time.perf_counter()
        model(**packed).loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[2:])


def speed(shape: str, tokens: int) -> dict:
    hf_config = esm2_config(**ESM2_SHAPES[shape]).to_dict()
    config = nv_config_from_hf(hf_config, max_protein_length=tokens, backend="te", attn_input_format="thd")
    torch.manual_seed(0)
    proteins = [[0, *torch.randint(4, 24, (tokens - 2,)).tolist(), 2]]
    packed = pack_proteins(proteins, labels=proteins)
    packed = on_cuda(packed)
    model = NVEsmForMaskedLM(config).cuda().to(torch.bfloat16).train()
    results = {"shape": shape, "tokens": tokens}
    if dist.get_rank() == 0:
        try:
            results["one_gpu_s"] = step_seconds(model, packed, together=False)
        except torch.OutOfMemoryError:
            results["one_gpu_s"] = "out of memory"
        torch.cuda.empty_cache()
    dist.barrier()
    model.enable_context_parallel(dist.group.WORLD)
    for comm_type in COMM_TYPES:
        try:
            set_comm_type(model, comm_type)
            torch.cuda.reset_peak_memory_stats()
            results[f"{comm_type}_s"] = step_seconds(model, packed)
            results[f"{comm_type}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        except Exception as error:  # noqa: BLE001
            results[f"{comm_type}_s"] = f"{type(error).__name__}: {error}"[:500]
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--speed-shape", default="650M")
    parser.add_argument("--speed-tokens", type=int, nargs="*", default=[32768])
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    cp = dist.get_world_size()
    results = {"cp": cp, "device": torch.cuda.get_device_name(), "accuracy": accuracy(cp)}
    torch.cuda.empty_cache()
    results["speed"] = [speed(args.speed_shape, tokens) for tokens in args.speed_tokens]
    if rank == 0:
        args.out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results["speed"], indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
