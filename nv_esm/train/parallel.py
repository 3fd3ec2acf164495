"""How the model runs on many ranks: the process group and device mesh, FSDP2 sharding (flat, or hybrid: sharded
within groups of ranks, replicated across them) with explicit prefetch, mixed precision, activation checkpointing
and offloading, and per-layer compilation.

`parallelize` is the one entry point the trainer calls on the meta-device model (before its weights exist), and
`forward_context` the context its forwards run in; new scale-out options belong here. A world of one is not sharded
(FSDP2 over one rank would only copy every weight each step, and its hooks keep CUDA graphs off): its fp32 weights
compute under `torch.autocast`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nv_esm.train.config import ParallelConfig


@dataclass
class Dist:
    """This process's place in the run: its rank of `world_size`, its device and the data-parallel device mesh,
    1-D `("dp_shard",)` or, with `--dp-replicate R`, 2-D `("dp_replicate", "dp_shard")` of shape
    `(R, world_size // R)`. Every rank is a data-parallel rank (its own micro-batches)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """The mesh in words, e.g. "4 ranks: dp_replicate=2 x dp_shard=2"."""
        dimensions = " x ".join(f"{name}={size}" for name, size in zip(self.mesh.mesh_dim_names, self.mesh.shape))
        return f"{self.world_size} ranks: {dimensions}"

    @property
    def shard_position(self) -> tuple[int, int]:
        """(this rank's index along the dimension FSDP2 shards over, that dimension's size): the rows of each
        parameter this rank holds are the index-th of that many chunks."""
        return self.mesh.get_local_rank("dp_shard"), self.mesh.size(self.mesh.mesh_dim_names.index("dp_shard"))


def init_distributed(settings: ParallelConfig) -> Dist:
    """NCCL on GPUs, gloo on CPU; a plain `python -m nv_esm.train` (no torchrun) runs as a world of one. Raises
    ValueError (before joining the process group) when `--dp-replicate` does not divide the world size."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world_size, replicas = int(os.environ["WORLD_SIZE"]), settings.dp_replicate
    if world_size % replicas:
        raise ValueError(
            f"--dp-replicate {replicas} must divide the number of ranks ({world_size}): each replica group shards "
            "the model over the same number of ranks."
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    else:
        shape, names = (replicas, world_size // replicas), ("dp_replicate", "dp_shard")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return Dist(dist.get_rank(), world_size, device, mesh)


def compute_dtype(settings: ParallelConfig, device: torch.device) -> torch.dtype:
    """The dtype layers compute in (FSDP2 casts the fp32 master weights to it): `settings.precision`, or bf16 on
    GPU and fp32 on CPU."""
    precision = settings.precision or ("bf16" if device.type == "cuda" else "fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers (`...encoder.layers`) of an NVEsm model, PEFT-wrapped or not, in order."""
    return list(next(m for name, m in model.named_modules() if name.endswith("encoder.layers")))


def parallelize(model: nn.Module, settings: ParallelConfig, world: Dist, backend: str) -> None:
    """Prepare the meta-device `model` (an NVEsm model, possibly PEFT-wrapped) in place: activation checkpointing
    and offloading, `torch.compile` of each layer, then, on several ranks, FSDP2 sharding in `compute_dtype` (the
    weights are materialised after).
    `backend` is the model config's layer backend (`te` or `torch`)."""
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if settings.offload_activations:
        if world.device.type != "cuda":
            raise ValueError("--offload-activations moves activations from GPU to host memory: it needs GPUs.")
        model.config.offload_activations = True
    layers = find_layers(model)
    if settings.compile:
        if backend == "te":
            raise ValueError("--compile is for --backend torch; Transformer Engine layers are fused already.")
        for layer in layers:
            layer.compile()
    if sharded(world):
        dtype = compute_dtype(settings, world.device)
        shard(model, layers, world, dtype, reshard_after_forward=not settings.keep_gathered)


def sharded(world: Dist) -> bool:
    """Whether `parallelize` shards the model (FSDP2): on several ranks only."""
    return world.world_size > 1


def forward_context(settings: ParallelConfig, world: Dist) -> contextlib.AbstractContextManager:
    """The context of the model's forward (and loss): FSDP2 casts sharded weights to `compute_dtype` itself; an
    unsharded model (a world of one) keeps fp32 weights and computes under `torch.autocast` in that dtype."""
    dtype = compute_dtype(settings, world.device)
    if sharded(world) or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(world.device.type, dtype=dtype)


def shard(
    model: nn.Module, layers: list[nn.Module], world: Dist, dtype: torch.dtype, reshard_after_forward: bool
) -> None:
    """`fully_shard` each layer, then the rest (embeddings, tied LM decoder, heads) as the root group, computing in
    `dtype` with fp32 gradient reduction; each layer then prefetches its neighbour's gather (`prefetch_layers`).
    On a 2-D mesh FSDP2 shards over "dp_shard" and replicates over "dp_replicate" (HSDP): gradients are
    reduce-scattered within a replica group, then all-reduced across the groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=world.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=world.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    prefetch_layers(layers)


def prefetch_layers(layers: list[nn.Module]) -> None:
    """Gather layer i+1 while layer i computes (and i-1 during i's backward), even when the CPU is not ahead:
    FSDP2's implicit prefetch waits for the CPU to reach a layer."""
    for previous, current in zip(layers, layers[1:]):
        previous.set_modules_to_forward_prefetch([current])
        current.set_modules_to_backward_prefetch([previous])
