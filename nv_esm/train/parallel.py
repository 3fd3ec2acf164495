"""How the model runs on many ranks: the process group and device mesh, FSDP2 sharding (flat, or hybrid: sharded
within groups of ranks, replicated across them) with explicit prefetch, tensor and context parallelism, mixed
precision, activation checkpointing and offloading, and per-layer compilation.

`parallelize` is the one entry point the trainer calls on the meta-device model (before its weights exist), and
`forward_context` the context its forwards run in; new scale-out options belong here. A world of one is not sharded
(FSDP2 over one rank would only copy every weight each step, and its hooks keep CUDA graphs off): its fp32 weights
compute under `torch.autocast`.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modeling_nv_esm_parallel import tensor_parallel_split_dim, tensor_parallel_whole_shape
from nv_esm.train.config import ParallelConfig, refuse_option_combinations


@dataclass
class Dist:
    """This process's place in the run: its rank of `world_size`, its device and the device mesh: `("dp_shard",)`;
    with `--dp-replicate R`, `("dp_replicate", "dp_shard")` of shape `(R, world_size // (R * C * T))`; with `--cp C` and
    `--tp T`, last dimensions `"cp"` and `"tp"` (consecutive ranks). The ranks of a "cp" or "tp" group share their
    micro-batches; the groups are the data-parallel ranks, each with its own. `fsdp_mesh`: the dimensions FSDP2
    shards and replicates over (without "tp"; "dp_shard" and "cp" flattened into "dp_shard_cp", as context-parallel
    ranks hold whole weights). `checkpoint_mesh` (with `--tp` only) holds the ranks with "tp" first, the layout in
    which checkpoints see the split weights (`checkpoint_view`)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    fsdp_mesh: Any = None
    checkpoint_mesh: Any = None
    replicated: bool = False  # the data-parallel ranks hold whole models (`data_parallel_layout`), not FSDP2 shards

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def size(self, dimension: str) -> int:
        """The size of mesh dimension `dimension` ("tp", "cp", ...), 1 when the mesh has none."""
        names = () if self.mesh is None else self.mesh.mesh_dim_names
        return self.mesh.size(names.index(dimension)) if dimension in names else 1

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def ranks_per_batch(self) -> int:
        """How many ranks run each micro-batch together (`--cp` x `--tp`)."""
        return self.tp_size * self.cp_size

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp") if self.tp_size > 1 else 0

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks (groups of `ranks_per_batch` ranks that share micro-batches)."""
        return self.world_size // self.ranks_per_batch

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which micro-batches it trains on."""
        return self.rank // self.ranks_per_batch

    def describe(self) -> str:
        """The layout in words, e.g. "1 process (no parallelism)", "4 processes: FSDP over 4", "4 processes: 2
        replicas x FSDP over 2 (mesh dp_replicate=2 x dp_shard=2)" or "2 processes: a whole model on each
        (gradients all-reduced)"; the mesh is named where it has more than one dimension."""
        if self.world_size == 1:
            return "1 process (no parallelism)"
        head = f"{self.world_size} processes"
        if self.replicated:
            together = f"context parallel over {self.cp_size}, " if self.cp_size > 1 else ""
            return f"{head}: {together}a whole model on each (gradients all-reduced)"
        sizes = dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))
        words = {
            "dp_replicate": "{} replicas",
            "dp_shard": "FSDP over {}",
            "cp": "context parallel over {}",
            "tp": "tensor parallel over {}",
        }
        parts = [words.get(name, name + "={}").format(size) for name, size in sizes.items() if size > 1]
        mesh = " x ".join(f"{name}={size}" for name, size in sizes.items())
        return f"{head}: {' x '.join(parts)}" + (f" (mesh {mesh})" if len(sizes) > 1 else "")

    @property
    def shard_position(self) -> tuple[int, int]:
        """(this rank's index along the dimension FSDP2 shards over, that dimension's size): the rows of each
        parameter this rank holds are the index-th of that many chunks."""
        name = self.fsdp_mesh.mesh_dim_names[-1]
        return self.fsdp_mesh.get_local_rank(name), self.fsdp_mesh.size(self.fsdp_mesh.ndim - 1)


def init_distributed(settings: ParallelConfig) -> Dist:
    """NCCL on GPUs, gloo on CPU; a plain `python -m nv_esm.train` (no torchrun) runs as a world of one. Raises
    ValueError (before joining the process group) when `--tp` x `--cp` does not divide the world size, or
    `--dp-replicate` the world size / (`--tp` x `--cp`)."""
    # A world of one meets in an in-process store: no port to pick (a probed free port can be taken by another
    # process before the group binds it: EADDRINUSE when runs start side by side).
    # The environment is left as it was: a later process group in the same process (transformers' Trainer, a second
    # run) must not take it for a launcher's.
    alone = "RANK" not in os.environ or "MASTER_ADDR" not in os.environ  # torchrun sets both
    world_size = 1 if alone else int(os.environ["WORLD_SIZE"])
    replicas, tp, cp = settings.dp_replicate, settings.tp, settings.cp
    for option, size in (("--tp", tp), ("--cp", cp), ("--tp x --cp", tp * cp)):
        if world_size % size:
            raise ValueError(f"{option} {size} must divide the number of ranks ({world_size}).")
    if (world_size // (tp * cp)) % replicas:
        together = " x ".join(f"{option} {size}" for option, size in (("--cp", cp), ("--tp", tp)) if size > 1)
        ranks = f"{world_size}" if tp * cp == 1 else f"{world_size} / {together} = {world_size // (tp * cp)}"
        raise ValueError(
            f"--dp-replicate {replicas} must divide the number of ranks ({ranks}): each replica group shards "
            "the model over the same number of ranks."
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    names, shape = ["dp_shard"], [world_size // (replicas * tp * cp)]
    if replicas > 1:
        names, shape = ["dp_replicate", *names], [replicas, *shape]
    for name, size in (("cp", cp), ("tp", tp)):
        if size > 1:
            names, shape = [*names, name], [*shape, size]
    mesh = init_device_mesh(device.type, tuple(shape), mesh_dim_names=tuple(names))
    fsdp_mesh = mesh if tp == 1 else mesh[tuple(name for name in names if name != "tp")]
    if cp > 1:  # FSDP2 shards over "dp_shard" x "cp" (a context-parallel rank holds whole weights)
        ranks = fsdp_mesh.mesh.reshape(*fsdp_mesh.mesh.shape[:-2], -1)
        fsdp_names = (*fsdp_mesh.mesh_dim_names[:-2], "dp_shard_cp")
        fsdp_mesh = DeviceMesh(device.type, ranks, mesh_dim_names=fsdp_names)
    checkpoint_mesh = None
    if tp > 1:
        order = [len(names) - 1, *range(len(names) - 1)]
        ranks = mesh.mesh.permute(order)
        checkpoint_mesh = DeviceMesh(device.type, ranks, mesh_dim_names=tuple(names[i] for i in order))
    return Dist(dist.get_rank(), world_size, device, mesh, fsdp_mesh, checkpoint_mesh)


def compute_dtype(settings: ParallelConfig, device: torch.device) -> torch.dtype:
    """The dtype layers compute in (FSDP2 casts the fp32 master weights to it): `settings.precision`, or bf16 on
    GPU and fp32 on CPU."""
    precision = settings.precision or ("bf16" if device.type == "cuda" else "fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def reduce_dtype(settings: ParallelConfig) -> torch.dtype:
    """The dtype FSDP2 reduce-scatters gradients in: `settings.reduce_dtype` (fp32 by default, or bf16)."""
    return torch.bfloat16 if settings.reduce_dtype == "bf16" else torch.float32


def find_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers (`...encoder.layers`) of an NVEsm model, PEFT-wrapped or not, in order."""
    return list(next(m for name, m in model.named_modules() if name.endswith("encoder.layers")))


def parallelize(model: nn.Module, settings: ParallelConfig, world: Dist, backend: str) -> None:
    """Prepare the meta-device `model` (an NVEsm model, possibly PEFT-wrapped) in place: activation checkpointing,
    `torch.compile` of each layer, then, on several ranks, FSDP2 sharding in `compute_dtype` (the
    weights are materialised after).
    `backend` is the model config's layer backend (`te` or `torch`). With `--tp`, the layers are split over the
    "tp" ranks first (`NVEsmPreTrainedModel.enable_tensor_parallel`) and FSDP2 shards each rank's part; with
    `--cp`, the layers run each batch across the "cp" ranks (`enable_context_parallel`). Raises ValueError for
    options that do not combine with the layers' backend (`refuse_option_combinations`: --compile with TE)."""
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world.tp_size > 1:
        model.enable_tensor_parallel(world.mesh.get_group("tp"))
    if world.cp_size > 1:
        model.enable_context_parallel(world.mesh.get_group("cp"))
    layers = find_layers(model)
    refuse_option_combinations(settings, backend=backend)  # TrainConfig.validate checked them without the backend
    if settings.compile:
        for layer in layers:
            layer.compile()
    if sharded(world):
        dtype = compute_dtype(settings, world.device)
        reduce = reduce_dtype(settings)
        shard(model, layers, world, dtype, reduce, reshard_after_forward=not settings.keep_gathered)


def sharded(world: Dist) -> bool:
    """Whether `parallelize` shards the model (FSDP2): on several ranks that do not hold whole models."""
    return world.world_size > 1 and not world.replicated


def forward_context(settings: ParallelConfig, world: Dist) -> contextlib.AbstractContextManager:
    """The context of the model's forward (and loss): FSDP2 casts sharded weights to `compute_dtype` itself; an
    unsharded model (a world of one) keeps fp32 weights and computes under `torch.autocast` in that dtype."""
    dtype = compute_dtype(settings, world.device)
    if sharded(world) or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(world.device.type, dtype=dtype)


def shard(
    model: nn.Module,
    layers: list[nn.Module],
    world: Dist,
    dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """`fully_shard` each layer, then the rest (embeddings, tied LM decoder, heads) as the root group, computing in
    `dtype` and reducing gradients in `reduce_dtype`; each layer then prefetches its neighbour's gather
    (`prefetch_layers`).
    On a 2-D mesh FSDP2 shards over "dp_shard" and replicates over "dp_replicate" (HSDP): gradients are
    reduce-scattered within a replica group, then all-reduced across the groups. With "tp", each tensor-parallel
    rank's FSDP2 group is the ranks of its "tp" index; context-parallel ranks shard too (`Dist.fsdp_mesh`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    mesh = world.fsdp_mesh
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    prefetch_layers(layers)
    # FSDP2 warns at every forward that the model (the root, now class FSDP<model class>) returned a view: the MLM
    # logits are the vocabulary columns of the padded decoder output (`logits[..., :vocab_size]`). The hazard it
    # names is an in-place op on that view, which would drop the root's pre-backward hook; the trainer's losses
    # (`summed_loss`, `evaluate`) take the logits out of place only, and two ranks' gradients equal one rank's
    # (tests/test_recipe_train.py). Silenced for the root alone: a layer returning a view would be another matter.
    root = re.escape(type(model).__name__)
    warnings.filterwarnings("ignore", rf"FSDP2-wrapped module \({root}\) returned a view tensor", UserWarning)


def prefetch_layers(layers: list[nn.Module]) -> None:
    """Gather layer i+1 while layer i computes (and i-1 during i's backward), even when the CPU is not ahead:
    FSDP2's implicit prefetch waits for the CPU to reach a layer."""
    for previous, current in zip(layers, layers[1:]):
        previous.set_modules_to_forward_prefetch([current])
        current.set_modules_to_backward_prefetch([previous])


# --------------------------------------------------------------------------------------------------------------
# Tensor parallelism: gradients, their norm, checkpoints
# --------------------------------------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def complete_gradients(model: nn.Module, world: Dist) -> None:
    """Complete, after the step's backwards, the layer gradients that each rank computed from its own tokens only
    (`NVEsmEncoder.reduce_partial_gradients`): with `--cp`, FSDP2 (or `average_gradients`) averaged them over the
    "cp" ranks, where their sum is the gradient; with `--tp` ("tp" is not in FSDP2's mesh), they are summed over
    the group. Embeddings, heads and split parameters are whole already. Ranks holding whole models first average
    all gradients over the ranks (`average_gradients`), as FSDP2 would."""
    if world.replicated:
        average_gradients(model, world.world_size)
    if world.ranks_per_batch == 1:
        return
    model.reduce_partial_gradients(averaged=world.cp_size > 1)


# About the bytes of gradients in one all-reduce: `average_gradients`' layer buckets, `all_reduce_gradients`' buckets.
GRADIENT_BUCKET_BYTES = 256 << 20


def average_gradients(model: nn.Module, world_size: int) -> None:
    """Average every `.grad` of `model` (a whole model on each rank) over the ranks, as FSDP2's reduction does
    (fp32 sums divided by `world_size`), right after the step's last backward (nothing may touch `.grad` in
    between). The layers' GEMM weight gradients go in buckets of about `GRADIENT_BUCKET_BYTES` of adjacent layers,
    from the last layer down, one all-reduce each, planned from the weights alone (`_layer_buckets`), so every rank
    issues the same collectives whether its backward replayed a CUDA graph or ran eagerly. After a replay each
    bucket is reduced in place while the backward still runs: on a side stream, once the graph records that the
    bucket's lowest layer is done (`StaticShapeGraphs.replayed_layer_gradients`); after an eager backward, when
    it is done. The other gradients (embeddings, heads, LayerNorms, biases) follow in `all_reduce_gradients`.
    Nothing here waits for the GPU."""
    covered: set[int] = set()
    side = None
    layers, replayed = model.layer_gradients()
    for bucket in _layer_buckets(layers):
        weights = [weight for index in bucket for weight in layers[index]]
        covered.update(map(id, weights))
        if replayed is None:
            for weight in weights:  # the same elements on every rank (a replay's main_grad holds zeros there)
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
            _all_reduce_together([weight.grad for weight in weights], world_size)
            continue
        # The side stream does not wait for the current one, which holds the whole backward: each event is
        # recorded inside it, after everything queued before the replay (zeroing the buffers, the last step).
        side = side or torch.cuda.Stream()
        _all_reduce_when_recorded([replayed[index] for index in bucket], side, world_size)
    rest = [p for p in model.parameters() if p.grad is not None and id(p) not in covered]
    all_reduce_gradients(rest, world_size)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


def _layer_buckets(layers: list[list[nn.Parameter]]) -> list[list[int]]:
    """Layer indices in buckets of about `GRADIENT_BUCKET_BYTES` of weights, from the last layer down (each bucket
    from its highest layer to its lowest); layers without weights are left out."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    size = 0
    for index in reversed(range(len(layers))):
        if not layers[index]:
            continue
        bucket.append(index)
        size += sum(weight.numel() * weight.element_size() for weight in layers[index])
        if size >= GRADIENT_BUCKET_BYTES:
            buckets.append(bucket)
            bucket, size = [], 0
    return [*buckets, bucket] if bucket else buckets


def _all_reduce_when_recorded(bucket: list[tuple[Any, torch.Tensor]], side: Any, world_size: int) -> None:
    """On stream `side`: wait for the event of the bucket's last (lowest) layer, then all-reduce the layers'
    adjacent flat views as one view and divide it by `world_size`, in place."""
    event, lowest = bucket[-1]
    start = lowest.storage_offset() - lowest._base.storage_offset()
    flat = lowest._base[start : start + sum(view.numel() for _, view in bucket)]
    with torch.cuda.stream(side):
        side.wait_event(event)
        dist.all_reduce(flat, async_op=True).wait()  # the side stream waits for the reduction (the host does not)
        flat.div_(world_size)


def _all_reduce_together(grads: list[torch.Tensor], world_size: int) -> None:
    """Average `grads` over the ranks in one all-reduce of their concatenation, copied back."""
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    _copy_back(grads, flat, dist.all_reduce(flat, async_op=True), world_size)


def all_reduce_gradients(parameters: list[nn.Parameter], world_size: int) -> None:
    """Average the `.grad` of `parameters` (whole tensors, same order on every rank) over the ranks, as FSDP2's
    reduction does: in buckets of about `GRADIENT_BUCKET_BYTES` per dtype, each flattened, all-reduced (summed) and
    divided by `world_size`, then copied back. A bucket is copied while the previous one is in flight."""
    grads = [p.grad for p in parameters]
    buckets: list[list[torch.Tensor]] = []
    size: dict[torch.dtype, int] = {}
    open_bucket: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        bucket = open_bucket.get(grad.dtype)
        if bucket is None or size[grad.dtype] + grad.nbytes > GRADIENT_BUCKET_BYTES:
            bucket = open_bucket[grad.dtype] = []
            buckets.append(bucket)
            size[grad.dtype] = 0
        bucket.append(grad)
        size[grad.dtype] += grad.nbytes
    in_flight: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
    for bucket in buckets:
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        in_flight.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
        if len(in_flight) == 2:
            _copy_back(*in_flight.pop(0), world_size)
    for item in in_flight:
        _copy_back(*item, world_size)


def _copy_back(bucket: list[torch.Tensor], flat: torch.Tensor, work: Any, world_size: int) -> None:
    work.wait()
    flat.div_(world_size)
    pieces = flat.split([grad.numel() for grad in bucket])
    torch._foreach_copy_(bucket, [piece.view_as(grad) for piece, grad in zip(pieces, bucket)])


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, world: Dist) -> torch.Tensor:
    """The global gradient norm over all shards as a device tensor, after scaling the gradients to at most
    `max_norm` (no clipping when 0). Computed on each rank's local tensors: a DTensor's sum of squares is summed
    over the mesh dimensions that shard it (FSDP2's), with `--tp` the split parameters' over the "tp" ranks too,
    and whole tensors count once. (DTensor runs foreach operations one tensor at a time: through it, the norm and
    the scaling of a 33-layer model's ~400 gradients took 190 ms of host time a step, under cProfile on the CPU.)"""
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for name, grad in named:
        reduced_over: list[Any] = []
        if hasattr(grad, "placements"):
            if any(placement.is_partial() for placement in grad.placements):  # FSDP2's gradients never are
                raise ValueError(f"the gradient of {name} is a partial sum (placements {grad.placements})")
            mesh = grad.device_mesh
            reduced_over += [mesh.get_group(dim) for dim, p in enumerate(grad.placements) if p.is_shard()]
        if world.tp_size > 1 and tensor_parallel_split_dim(name) is not None:
            reduced_over.append(world.mesh.get_group("tp"))
        groups.setdefault((grad.dtype, *reduced_over), []).append(_local(grad))
    total = torch.zeros((), dtype=torch.float64, device=world.device)
    for (_, *reduced_over), grads in groups.items():
        squares = torch.stack(torch._foreach_norm(grads)).double().square().sum()
        for group in reduced_over:
            dist.all_reduce(squares, group=group)
        total += squares
    total = total.sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for (dtype, *_), grads in groups.items():
            torch._foreach_mul_(grads, scale.to(dtype))
    return total.float()


def checkpoint_view(state: dict, world: Dist) -> dict:
    """`state` (the model or optimizer state dict of `get_state_dict`) as checkpoints hold it: with `--tp`, each
    tensor of a split parameter becomes a DTensor of the whole parameter's shape on `Dist.checkpoint_mesh`
    (split over "tp" first, then FSDP2's rows within each part), sharing this rank's storage, so that loading
    into the view loads the model and the checkpoint does not depend on the layout. Unchanged without `--tp`."""
    if world.tp_size == 1:
        return state
    from torch.distributed.tensor import DTensor, Shard

    def whole(value: Any, name: str) -> Any:
        if not isinstance(value, DTensor) or value.dim() == 0:  # e.g. the optimizer's step count
            return value
        shape = tensor_parallel_whole_shape(name, tuple(value.shape), world.tp_size)
        stride = torch.empty(shape, device="meta").stride()
        placements = (Shard(tensor_parallel_split_dim(name)), *value.placements)
        return DTensor.from_local(
            value.to_local(), world.checkpoint_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )

    def view(value: Any, name: str | None) -> Any:
        if isinstance(value, dict):  # a new dict only where something in it changed (the rest loads in place)
            items = {
                key: view(item, key if name is None and isinstance(key, str) else name) for key, item in value.items()
            }
            return items if any(items[key] is not value[key] for key in value) else value
        dim = None if name is None else tensor_parallel_split_dim(name)
        return value if dim is None else whole(value, name)

    if "state" in state and "param_groups" in state:  # optimizer: {"state": {name: {"exp_avg": ...}}, ...}
        return {**state, "state": view(state["state"], None)}
    return view(state, None)
