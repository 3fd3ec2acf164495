"""Running one batch's layers across ranks, applied from outside the layers: tensor parallelism (token
scatter/gather, the plan `TENSOR_PARALLEL_SPLITS` and `TENSOR_PARALLEL_TWINS`, the layers' parts
`tensor_parallel_layers`, the run layout `TensorParallelRun`) and context parallelism (the run layout
`ContextParallelLayout`).

Part of the model's Hub remote code: imports the batch, layout, LoRA and layers siblings below it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .modeling_nv_esm_batch import InputBatch, PackedSequences, positions_in_proteins, sequence_index_of_tokens
    from .modeling_nv_esm_layers import Backend, NVEsmLayerNormLinear, NVEsmLayerNormMLP, NVEsmLinear, gelu
    from .modeling_nv_esm_layout import AttentionView, PackedRun, RotaryTable, apply_rotary
    from .modeling_nv_esm_lora import with_qkv_updates
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from modeling_nv_esm_batch import InputBatch, PackedSequences, positions_in_proteins, sequence_index_of_tokens
    from modeling_nv_esm_layers import Backend, NVEsmLayerNormLinear, NVEsmLayerNormMLP, NVEsmLinear, gelu
    from modeling_nv_esm_layout import AttentionView, PackedRun, RotaryTable, apply_rotary
    from modeling_nv_esm_lora import with_qkv_updates

# The layer parameters that tensor parallelism splits across its ranks, by name inside a layer, with the dimension
# they are split along: query/key/value rows (interleaved per head, so each rank gets whole heads) and fc1 rows
# (column-parallel), and the columns of the attention output projection and of fc2 (row-parallel). Every other
# layer parameter (LayerNorms, the two output biases) is whole on each rank and sees only that rank's tokens, so
# its gradient there is a partial sum over the tensor-parallel ranks.
TENSOR_PARALLEL_SPLITS = {
    "self_attention.layernorm_qkv.weight": 0,
    "self_attention.layernorm_qkv.bias": 0,
    "self_attention.proj.weight": 1,
    "layernorm_mlp.fc1_weight": 0,
    "layernorm_mlp.fc1_bias": 0,
    "layernorm_mlp.fc2_weight": 1,
}


def tensor_parallel_split_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits the parameter `name` (a model's, an encoder's or a layer
    list's: `....layers.<i>.<name in the layer>`, or a layer's own; `TENSOR_PARALLEL_SPLITS`), or None for one every
    rank holds whole."""
    _, in_layers, rest = f".{name}".partition(".layers.")
    return TENSOR_PARALLEL_SPLITS.get(rest.split(".", 1)[-1] if in_layers else name)


def tensor_parallel_part(name: str, whole_shape: tuple[int, ...], size: int, rank: int) -> tuple[int, slice] | None:
    """The part of parameter `name` (of `whole_shape`) that rank `rank` of `size` tensor-parallel ranks holds: the
    split dimension and the slice of it (`tensor_parallel_split_dim`), or None where every rank holds it whole. The
    one place a whole weight is cut for a rank: `tensor_parallel_layers` and the trainer's loading."""
    dim = tensor_parallel_split_dim(name) if size > 1 else None
    if dim is None:
        return None
    part = whole_shape[dim] // size
    return dim, slice(rank * part, (rank + 1) * part)


def tensor_parallel_whole_shape(name: str, part_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The whole shape of parameter `name` whose part on each of `size` tensor-parallel ranks is `part_shape`."""
    dim = tensor_parallel_split_dim(name) if size > 1 else None
    return tuple(length * size if index == dim else length for index, length in enumerate(part_shape))


@dataclass(frozen=True)
class RankGroup:
    """The ranks that share a batch under tensor or context parallelism: the process `group`, its `size` and this
    process's `rank` in it. Tensor parallelism: each rank holds `1/size` of every layer's heads and MLP columns
    and, between the layers' matrix products, `1/size` of the tokens (sequence parallelism)."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> RankGroup:
        distributed = torch.distributed
        return cls(group, distributed.get_world_size(group), distributed.get_rank(group))


def _collective(name: str, older_name: str) -> Callable:
    distributed = torch.distributed
    return getattr(distributed, name, None) or getattr(distributed, older_name)


def _all_gather_tokens(x: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """`[t, ...]` on each rank -> `[size * t, ...]`, the ranks' tokens in rank order."""
    gathered = x.new_empty((ranks.size * x.shape[0], *x.shape[1:]))
    _collective("all_gather_single", "all_gather_into_tensor")(gathered, x.contiguous(), group=ranks.group)
    return gathered


def _reduce_scatter_tokens(x: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """`[T, ...]` partial sums on each rank -> this rank's `[T / size, ...]` of their sum."""
    part = x.new_empty((x.shape[0] // ranks.size, *x.shape[1:]))
    _collective("reduce_scatter_single", "reduce_scatter_tensor")(part, x.contiguous(), group=ranks.group)
    return part


class _GatherTokens(torch.autograd.Function):
    """All-gather the tokens `[T / size, ...] -> [T, ...]`. Backward: when the ranks use the gathered tokens
    differently (they feed split weights), each rank's gradient is partial and is reduce-scattered; when every
    rank computes the same from them (`replicated`), each keeps its own part of its (whole) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: RankGroup, replicated: bool) -> torch.Tensor:
        ctx.ranks, ctx.replicated = ranks, replicated
        return _all_gather_tokens(x, ranks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.replicated:
            return grad.chunk(ctx.ranks.size)[ctx.ranks.rank].contiguous(), None, None
        return _reduce_scatter_tokens(grad, ctx.ranks), None, None


class _ScatterTokens(torch.autograd.Function):
    """This rank's tokens `[T, ...] -> [T / size, ...]`: of the ranks' sum (`summed`: the partial products of a
    row-parallel weight, reduce-scattered) or of a tensor every rank holds whole. Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: RankGroup, summed: bool) -> torch.Tensor:
        ctx.ranks = ranks
        return _reduce_scatter_tokens(x, ranks) if summed else x.chunk(ranks.size)[ranks.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_tokens(grad, ctx.ranks), None, None


def gather_tokens(x: torch.Tensor, ranks: RankGroup, replicated: bool = False) -> torch.Tensor:
    """`_GatherTokens`: `[T / size, ...] -> [T, ...]`."""
    return _GatherTokens.apply(x, ranks, replicated)


def scatter_tokens(x: torch.Tensor, ranks: RankGroup, summed: bool) -> torch.Tensor:
    """`_ScatterTokens`: `[T, ...] -> [T / size, ...]`."""
    return _ScatterTokens.apply(x, ranks, summed)


class ColumnParallelLayerNormLinear(NVEsmLayerNormLinear):
    """The twin's LayerNorm + Linear split column-parallel: `out_features` is this rank's rows; the LayerNormed
    tokens of all ranks are gathered before the product, `[T / size, in] -> [T, out]`."""

    tensor_parallel: RankGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = gather_tokens(
            F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps), self.tensor_parallel
        )
        return with_qkv_updates(self, normed, F.linear(normed, self.weight, self.bias))


class RowParallelLinear(NVEsmLinear):
    """The twin's Linear split row-parallel: `in_features` is this rank's columns; the ranks' partial products are
    summed and scattered by tokens before the bias is added, `[T, in] -> [T / size, out]`."""

    tensor_parallel: RankGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_tokens(F.linear(x, self.weight), self.tensor_parallel, summed=True) + self.bias


class TensorParallelLayerNormMLP(NVEsmLayerNormMLP):
    """The twin's MLP split: `intermediate_size` is this rank's part; fc1 column-parallel and fc2 row-parallel
    (tokens gathered after the LayerNorm, summed and scattered before fc2's bias), `[T / size, hidden]` in and out."""

    tensor_parallel: RankGroup

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        activated = gelu(F.linear(gather_tokens(normed, self.tensor_parallel), self.fc1_weight, self.fc1_bias))
        return scatter_tokens(F.linear(activated, self.fc2_weight), self.tensor_parallel, summed=True) + self.fc2_bias


TENSOR_PARALLEL_TWINS = {
    NVEsmLayerNormLinear: ColumnParallelLayerNormLinear,
    NVEsmLinear: RowParallelLinear,
    NVEsmLayerNormMLP: TensorParallelLayerNormMLP,
}


def tensor_parallel_layer(backend: Backend, config: Any, layer_number: int, tensor_parallel: RankGroup) -> nn.Module:
    """This rank's part of layer `layer_number` (empty weights of the part's shapes): Transformer Engine's layer
    built split (`set_parallel_mode`, sequence parallelism, the group's ranks), or the twin's layer of the part's
    shapes with its products made column- and row-parallel (`TENSOR_PARALLEL_TWINS`, same parameters)."""
    layer = backend.make_layer(config, layer_number, tensor_parallel)
    for module in layer.modules():
        parallel = TENSOR_PARALLEL_TWINS.get(type(module))
        if parallel is not None:
            module.__class__ = parallel
            module.tensor_parallel = tensor_parallel
    return layer


def tensor_parallel_layers(
    layers: nn.ModuleList, backend: Backend, config: Any, tensor_parallel: RankGroup
) -> nn.ModuleList:
    """This rank's parts of the whole `layers` (`tensor_parallel_layer`), in their dtype, device and training mode,
    holding this rank's slices of their weights (`tensor_parallel_part`; none when `layers` are on the meta device).
    `NVEsmEncoder.enable_tensor_parallel` runs its layers so."""
    first = next(layers.parameters())
    with torch.device("meta"):
        parts = (tensor_parallel_layer(backend, config, i + 1, tensor_parallel) for i in range(len(layers)))
        split = nn.ModuleList(parts).to(first.dtype)
    if first.device.type != "meta":
        split.to_empty(device=first.device)
        with torch.no_grad():
            for part_layer, whole_layer in zip(split, layers):
                whole = dict(whole_layer.named_parameters())
                for name, parameter in part_layer.named_parameters():
                    part = tensor_parallel_part(
                        name, tuple(whole[name].shape), tensor_parallel.size, tensor_parallel.rank
                    )
                    parameter.copy_(whole[name] if part is None else whole[name][(slice(None),) * part[0] + (part[1],)])
    return split.train(layers.training)


@dataclass(frozen=True)
class ContextParallel(RankGroup):
    """A context-parallel group: each of its `size` ranks runs the layers on part of every protein's tokens
    (`ContextParallelLayout`) and exchanges keys and values with the others in attention. `ranks`: the group's
    global ranks (Transformer Engine's attention needs them)."""

    ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, group: Any) -> ContextParallel:
        distributed = torch.distributed
        ranks = tuple(distributed.get_process_group_ranks(group))
        return cls(group, len(ranks), distributed.get_rank(group), ranks)

    def te_exchange(self, heads: int) -> str:
        """How Transformer Engine's attention (`cp_comm_type`), with `heads` heads per rank, shares the tokens: "a2a"
        (an all-to-all gives each rank whole proteins for `heads / size` heads) where the heads divide among the
        ranks, else "all_gather" (every rank gathers all keys and values). Not TE's ring ("p2p"): with TE 2.20 it
        gave wrong logits for proteins of 1 to 3 tokens, where both of these are right for every length (and no
        faster; bench/results/cp_comm_h200x4_2026-11-27/)."""
        return "a2a" if heads % self.size == 0 else "all_gather"


class TensorParallelRun(PackedRun):
    """Packed layers split over the ranks of `tp` (`RankGroup`): between the layers' matrix products each rank runs
    `1/size` of the tokens (sequence parallelism), so the token count is padded to a multiple of the group size."""

    def __init__(self, *args: Any, tp: RankGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def own_tokens(self, states: torch.Tensor) -> torch.Tensor:
        return scatter_tokens(states, self.tp, summed=False)

    def all_tokens(self, states: torch.Tensor) -> torch.Tensor:
        return gather_tokens(states, self.tp, replicated=True)


class ContextParallelLayout(PackedRun):
    """Where each token of a packed batch runs under context parallelism, Transformer Engine's THD layout: every
    protein is padded to a multiple of `2 * size` tokens and cut into `2 * size` chunks; rank r runs chunks r and
    `2 * size - 1 - r` of each (the early and late chunks of a protein attend to few and many keys: one of each
    balances the work), protein after protein. Every rank runs `num_tokens_padded / size` tokens.

    Attributes (besides `PackedRun`'s: `packed` is the whole batch's packing of its real tokens):
        cp: the group.
        cu_seq_lens: `[N + 1]` int32, the real lengths (with a dummy protein when the token count was rounded up).
        cu_seq_lens_padded: `[N + 1]` int32, the padded lengths (each a multiple of `2 * size`).
        max_length: the longest padded protein (an upper bound).
        to_padded: `[T]` each real token's place in the padded batch.
        rank_order: `[T_padded]` the padded batch's tokens in rank order (rank 0's, then rank 1's, ...), as places
            in the padded batch; `from_rank_order` is its inverse.
        local_positions: `[T_padded / size]` their positions in their protein.
        local: the packing of this rank's tokens (each protein's two chunks side by side).
        padded: the packing of the padded batch.
        key_mask: `[N, max_length]` True for the real tokens of each padded protein.
    """

    def __init__(
        self,
        packed: PackedSequences,
        rotary_angles: torch.Tensor | None,
        batch: InputBatch | None,
        cp: ContextParallel,
        cu_seq_lens: torch.Tensor,
        cu_seq_lens_padded: torch.Tensor,
        max_length: int,
        to_padded: torch.Tensor,
        rank_order: torch.Tensor,
        from_rank_order: torch.Tensor,
        local_positions: torch.Tensor,
        local: PackedSequences,
        padded: PackedSequences,
        key_mask: torch.Tensor,
    ) -> None:
        self.cp, self.cu_seq_lens, self.cu_seq_lens_padded, self.max_length = (
            cp,
            cu_seq_lens,
            cu_seq_lens_padded,
            max_length,
        )
        self.to_padded, self.rank_order, self.from_rank_order = to_padded, rank_order, from_rank_order
        self.local_positions, self.local, self.padded = local_positions, local, padded
        # the padded proteins' real tokens (PackedRun's own would be the unpadded view's)
        super().__init__(packed, rotary_angles, packed.num_tokens, batch, key_mask=key_mask)

    def make_attention_kwargs(self) -> dict[str, Any]:
        """The whole batch's real and padded lengths; TE finds this rank's part."""
        return {
            "attn_mask_type": "padding",
            "cu_seqlens_q": self.cu_seq_lens,
            "cu_seqlens_kv": self.cu_seq_lens,
            "cu_seqlens_q_padded": self.cu_seq_lens_padded,
            "cu_seqlens_kv_padded": self.cu_seq_lens_padded,
            "max_seqlen_q": self.max_length,
            "max_seqlen_kv": self.max_length,
            "pad_between_seqs": True,
        }

    def make_qkv_rotation(self) -> None:
        """None: TE's attention rotates this rank's chunks itself (it knows their positions from the padded
        lengths)."""
        return None

    @classmethod
    def of(
        cls,
        packed: PackedSequences,
        cp: ContextParallel,
        token_multiple: int = 1,
        rotary: RotaryTable | None = None,
        batch: InputBatch | None = None,
    ) -> ContextParallelLayout:
        """The layout of `packed` (real proteins); the padded token count is also rounded up to a multiple of
        `token_multiple * size` (FP8), with a dummy protein. One device sync (the padded token count). `rotary`
        gives the angles (None: no layer runs it, e.g. in tests of the layout alone)."""
        unit, device = 2 * cp.size, packed.cu_seq_lens.device
        lengths = packed.cu_seq_lens.diff().long()
        padded_lengths = (lengths + unit - 1) // unit * unit
        num_padded = int(padded_lengths.sum())
        multiple = math.lcm(unit, token_multiple * cp.size)
        max_length = -(-packed.max_length // unit) * unit
        if num_padded % multiple:
            extra = -num_padded % multiple
            dummy = torch.tensor([extra], device=device)
            lengths, padded_lengths = torch.cat([lengths, dummy]), torch.cat([padded_lengths, dummy])
            max_length, num_padded = max(max_length, extra), num_padded + extra
        cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        cu_seq_lens_padded = F.pad(padded_lengths.cumsum(0), (1, 0)).to(torch.int32)
        protein = sequence_index_of_tokens(cu_seq_lens_padded, num_padded)
        position = positions_in_proteins(cu_seq_lens_padded, num_padded, protein)
        chunk = position // (padded_lengths[protein] // unit)
        owner = torch.where(chunk < cp.size, chunk, unit - 1 - chunk)
        rank_order = torch.argsort(owner * num_padded + torch.arange(num_padded, device=device))
        from_rank_order = torch.empty_like(rank_order)
        from_rank_order[rank_order] = torch.arange(num_padded, device=device)
        num_local = num_padded // cp.size
        own = rank_order[cp.rank * num_local : (cp.rank + 1) * num_local]
        real = packed.sequence_index
        to_padded = cu_seq_lens_padded[real] + packed.positions
        return cls(
            packed=packed,
            rotary_angles=None if rotary is None else rotary(max_length),
            batch=batch,
            cp=cp,
            cu_seq_lens=cu_seq_lens,
            cu_seq_lens_padded=cu_seq_lens_padded,
            max_length=max_length,
            to_padded=to_padded,
            rank_order=rank_order,
            from_rank_order=from_rank_order,
            local_positions=position[own],
            local=PackedSequences.right_padded(cu_seq_lens_padded // cp.size, max_length // cp.size, num_local),
            padded=PackedSequences.right_padded(cu_seq_lens_padded, max_length, num_padded, protein, position),
            key_mask=torch.arange(max_length, device=device) < lengths[:, None],
        )

    def own_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` (every rank holds them all) -> this rank's `[T_padded / size, ...]` (zeros at padding).
        Backward gathers every rank's part, so what computed `states` gets its whole gradient on each rank."""
        padded = states.new_zeros((self.padded.num_tokens, *states.shape[1:])).index_copy(0, self.to_padded, states)
        return scatter_tokens(padded[self.rank_order], self.cp, summed=False)

    def all_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """This rank's `[T_padded / size, ...]` -> every real token `[T, ...]` (the same on every rank)."""
        gathered = gather_tokens(states, self.cp, replicated=True)
        return gathered[self.from_rank_order][self.to_padded]

    def to_input(self, states: torch.Tensor) -> torch.Tensor:
        return self.batch.to_input_layout(states)

    def attention_view(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> AttentionView:
        """This rank's queries `[N, heads, L / size, d]` and every rank's keys and values `[N, heads, L, d]`
        (all-gathered, as Transformer Engine does where the heads do not divide among the ranks)."""
        qkv = qkv.view(qkv.shape[0], num_heads, 3, head_dim)
        keys_values = gather_tokens(qkv[:, :, 1:].contiguous(), self.cp)[self.from_rank_order]
        key, value = self.padded.unpack(keys_values).permute(0, 2, 1, 3, 4).unbind(3)
        query = self.local.unpack(qkv[:, :, 0]).transpose(1, 2)
        query_angles = self.local.unpack(self.rotary_angles[self.local_positions])[:, None]
        query = apply_rotary(query * head_dim**-0.5, query_angles)
        key = apply_rotary(key, self.rotary_angles[: key.shape[2]])
        return AttentionView(query, key, value, self.key_mask)

    def from_attention_view(self, context: torch.Tensor) -> torch.Tensor:
        return self.local.pack(context.transpose(1, 2).flatten(2))


def several_ranks() -> bool:
    """Whether this process is one of several ranks of a `torch.distributed` process group."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) manages `module`: its parameters move between calls, so no graphs."""
    fsdp = importlib.import_module("torch.distributed.fsdp") if torch.distributed.is_available() else None
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))
