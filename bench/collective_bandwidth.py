"""Bandwidth of the collectives FSDP2 runs for ESM-2 650M, between the GPUs of one host (torchrun, one process each).

    torchrun --nproc-per-node 2 bench/collective_bandwidth.py

Per step FSDP2 all-gathers the bf16 weights twice (forward, backward) and reduce-scatters fp32 gradients; this times
one all-gather of the bf16 650M weights and one reduce-scatter of their fp32 gradients, and prints GB/s per GPU
(bytes each GPU receives / time) and the time both take per training step.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

PARAMETERS = 651_000_000


def timed(function, repeats: int = 5) -> float:
    function()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shard = PARAMETERS // world
    weights = torch.empty(shard * world, dtype=torch.bfloat16, device="cuda")
    gradients = torch.empty(shard * world, dtype=torch.float32, device="cuda")
    weight_shard = torch.empty(shard, dtype=torch.bfloat16, device="cuda")
    gradient_shard = torch.empty(shard, dtype=torch.float32, device="cuda")
    gather = timed(lambda: dist.all_gather_into_tensor(weights, weight_shard))
    scatter = timed(lambda: dist.reduce_scatter_tensor(gradient_shard, gradients))
    moved = (world - 1) / world
    result = dict(
        world_size=world,
        all_gather_bf16_seconds=gather,
        all_gather_gb_per_s=weights.nbytes * moved / gather / 1e9,
        reduce_scatter_fp32_seconds=scatter,
        reduce_scatter_gb_per_s=gradients.nbytes * moved / scatter / 1e9,
        seconds_per_training_step=2 * gather + scatter,
    )
    if rank == 0:
        print(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
