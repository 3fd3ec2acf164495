"""How one batch runs through the encoder layers: the run layout (`RunLayout`), built once per forward by the
forward's plan (`ForwardPlan.lay_out`) and read by every layer. Padded layers (BSHD) run `PaddedRun`, packed layers
(THD) `PackedRun`; the tensor- and context-parallel layouts (`modeling_nv_esm_parallel`) are `PackedRun`s too.

A layout offers what the layers and the encoder need besides the hidden states: the rotary angles, Transformer
Engine's keyword arguments, the twin's attention view (queries, keys and values in the right-padded view, with the
key mask), the tokens this rank runs and back, and the way back to the input's layout. Also here: the one function
that pads a packed batch with dummy proteins (`pad_packed`), which FP8, tensor parallelism and CUDA graphs' static
shapes all use, and rotary position embedding.

Part of the model's Hub remote code: imports `modeling_nv_esm_batch` and `modeling_nv_esm_kernels` below it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:
    from .modeling_nv_esm_batch import FP8_TOKEN_MULTIPLE, InputBatch, PackedSequences
    from .modeling_nv_esm_kernels import TRITON_AVAILABLE
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from modeling_nv_esm_batch import FP8_TOKEN_MULTIPLE, InputBatch, PackedSequences
    from modeling_nv_esm_kernels import TRITON_AVAILABLE

RotaryTable = Callable[[int], torch.Tensor]  # length -> `[length, head_dim]` float32 angles (`NVEsmRotaryEmbedding`)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> `[-x2, x1]` for halves x1, x2 of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, heads, S, d]` by `angles [S, d]` (float32 math, result in x's dtype)."""
    x32 = x.float()
    return (x32 * angles.cos() + rotate_half(x32) * angles.sin()).to(x.dtype)


def dummy_proteins(extra_tokens: int, max_length: int) -> int:
    """How many dummy proteins of at most `max_length` tokens hold `extra_tokens` padding tokens."""
    return -(-extra_tokens // max_length)


def pad_packed(
    hidden_states: torch.Tensor, packed: PackedSequences, tokens: int, slots: int, max_length: int
) -> tuple[torch.Tensor, PackedSequences]:
    """Pad `[T, hidden]` to `[tokens, hidden]` with zero tokens in dummy proteins of at most `max_length` tokens
    each (`dummy_proteins`), then empty proteins (`cu_seq_lens` repeats its last entry) up to `slots` proteins in
    all. The one padding of packed batches: FP8's and tensor parallelism's token multiples, CUDA graphs' shapes.
    The per-token indices `packed` has computed already are extended to the padding, not computed again."""
    num_sequences = packed.cu_seq_lens.numel() - 1
    hidden_states = F.pad(hidden_states, (0, 0, 0, tokens - packed.num_tokens))
    device = packed.cu_seq_lens.device
    extra_slots = torch.arange(1, slots - num_sequences + 1, device=device)
    ends = (packed.num_tokens + extra_slots * max_length).clamp_max(tokens).to(torch.int32)
    cu_seq_lens = torch.cat([packed.cu_seq_lens.to(torch.int32), ends])
    indices = {}
    computed = packed.computed_indices()
    if computed is not None:  # the dummy proteins' tokens: max_length each, the last one shorter
        sequence_index, positions = computed
        padding = torch.arange(tokens - packed.num_tokens, device=device)
        indices = {
            "sequence_index": torch.cat([sequence_index, (num_sequences + padding // max_length).to(sequence_index)]),
            "positions": torch.cat([positions, (padding % max_length).to(positions)]),
        }
    return hidden_states, PackedSequences.right_padded(cu_seq_lens, max_length, tokens, **indices)


def pad_packed_to_multiple(
    hidden_states: torch.Tensor, packed: PackedSequences, multiple: int
) -> tuple[torch.Tensor, PackedSequences]:
    """`pad_packed` with one dummy protein, so the token count is a multiple of `multiple` (FP8 GEMMs need
    `FP8_TOKEN_MULTIPLE`; tensor parallelism splits the tokens over its ranks)."""
    extra = -packed.num_tokens % multiple
    num_sequences = packed.cu_seq_lens.numel() - 1
    return pad_packed(
        hidden_states, packed, packed.num_tokens + extra, num_sequences + 1, max(packed.max_length, extra)
    )


class QKVRotation:
    """What Transformer Engine layers rotate the fused QKV projection with (`modeling_nv_esm_kernels.rotate_qk`):
    `positions [tokens]` int32, each token's position in its protein (tokens of the run layout in order: packed, or
    the padded `[B, L]` flattened), and `cos`/`sin` `[L, head_dim / 2]` float32 of the half angle table (ESM's
    table repeats it). A plain object, for FSDP2's casts (`RunLayout`)."""

    def __init__(self, positions: torch.Tensor, rotary_angles: torch.Tensor) -> None:
        half = rotary_angles[:, : rotary_angles.shape[1] // 2]
        self.positions = positions.to(torch.int32).contiguous()
        self.cos, self.sin = half.cos().contiguous(), half.sin().contiguous()

    @classmethod
    def of(cls, rotary_angles: torch.Tensor | None, positions: Callable[[], torch.Tensor]) -> QKVRotation | None:
        """The rotation of a run layout's tokens (`positions()`, called only when one is made), or None where TE's own
        attention block must rotate: no rotary table, a layout on the CPU (the twin's), or no Triton
        (`TRITON_AVAILABLE`)."""
        if rotary_angles is None or not (TRITON_AVAILABLE and rotary_angles.is_cuda):
            return None
        return cls(positions(), rotary_angles)


@dataclass
class AttentionView:
    """The twin's attention inputs in the right-padded view: `query` (scaled by `head_dim**-0.5`, then rotated),
    `key` (rotated) and `value`, each `[N, heads, L, head_dim]` (queries: this rank's `L_q` under context
    parallelism), and `key_mask [N, L]` True for real keys (None: nothing padded)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_mask: torch.Tensor | None


class RunLayout:
    """How the layers run one batch: built once per forward, read by every layer. A plain object, not a dataclass:
    FSDP2 casts the floating tensors of a dataclass argument to its compute dtype (`cast_forward_inputs`), which
    would turn the float32 rotary angles into bf16 (errors up to 2 radians at position 600). What a layer reads is
    made when the layout is built, but for the twin's key mask of a packed run (`PackedRun.key_mask`, made by the
    first layer that attends in the padded view, so never for Transformer Engine's layers): `torch.compile` traces
    the first layer, which makes it, and the others, which read it, as two graphs.

    Attributes (every subclass):
        rotary_angles: `[L, head_dim]` float32 angles for positions `0..L-1` of the run layout (None only in a
            layout built without a rotary table, which no layer runs).
        attention_kwargs: keyword arguments of TE's `DotProductAttention.forward` besides the queries, keys,
            values and `qkv_format`: the mask type and the lengths (what `NVEsmTEMultiheadAttention.rotated_forward`
            passes).
        te_kwargs: the same as TE's `TransformerLayer.forward` names them (`self_attn_mask_type`), with the
            rotary table (`rotary_pos_emb`): what TE's own layer forward takes. Both made once, by `set_attention`.
        qkv_rotation: how TE layers rotate their fused QKV projection (`QKVRotation`, `rotate_qk`); None where TE's
            own attention block must rotate the split queries and keys (context parallelism's per-rank chunks; no
            Triton; `QKVRotation.of`), and in a run padded to a CUDA graph's shape, whose replay rotates with what
            the graph computes inside (the encoder makes it where the batch runs eagerly after all).
        static_shape: the batch was padded to a CUDA graph's static shape (`static_shape`): it replays one.
    """

    rotary_angles: torch.Tensor | None
    attention_kwargs: dict[str, Any]
    te_kwargs: dict[str, Any]
    qkv_rotation: QKVRotation | None = None
    static_shape: bool = False

    def with_qkv_rotation(self, qkv_rotation: QKVRotation | None) -> RunLayout:
        """A shallow copy that rotates q/k with `qkv_rotation` (None: Transformer Engine's layers rotate them)."""
        layout = copy.copy(self)
        layout.qkv_rotation = qkv_rotation
        return layout

    def set_attention(self, attention_kwargs: dict[str, Any]) -> None:
        """Set `attention_kwargs` and the `te_kwargs` that say the same to TE's `TransformerLayer`, with TE's
        `rotary_pos_emb` (`[L, 1, 1, head_dim]`) where the layout has a rotary table. Both say "no sliding window"
        (`window_size` (-1, -1)): TE's attention block builds its `DotProductAttention` with the default causal
        mask, whose window (-1, 0) it would otherwise take and correct with a warning at every call."""
        self.attention_kwargs = {**attention_kwargs, "window_size": (-1, -1)}
        layer_names = {"attn_mask_type": "self_attn_mask_type"}
        self.te_kwargs = {layer_names.get(name, name): value for name, value in self.attention_kwargs.items()}
        if self.rotary_angles is not None:
            self.te_kwargs["rotary_pos_emb"] = self.rotary_angles[:, None, None, :]

    def own_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """The states this rank's layers run (all of them without tensor or context parallelism)."""
        return states

    def all_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """This rank's layer outputs -> every token's, the inverse of `own_tokens`."""
        return states

    def to_input(self, states: torch.Tensor) -> torch.Tensor:
        """Layer outputs (after `all_tokens`) -> the input's layout, the run's padding cut off."""
        raise NotImplementedError

    def attention_view(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> AttentionView:
        """The fused QKV projection of this rank's tokens (per head `[q, k, v]`, as TE interleaves them) as the
        twin's attention inputs (`AttentionView`)."""
        raise NotImplementedError

    def from_attention_view(self, context: torch.Tensor) -> torch.Tensor:
        """Attention output `[N, heads, L_q, head_dim]` -> this rank's tokens `[..., heads * head_dim]`."""
        raise NotImplementedError


def rotated_view(
    qkv: torch.Tensor, key_mask: torch.Tensor | None, angles: torch.Tensor, num_heads: int, head_dim: int
) -> AttentionView:
    """`AttentionView` of right-padded `qkv [N, L, heads * 3 * head_dim]`: ESM scales the query before the rotation
    (as transformers does), then attends with scale 1."""
    batch, length = qkv.shape[:2]
    query, key, value = qkv.view(batch, length, num_heads, 3, head_dim).transpose(1, 2).unbind(3)
    query = apply_rotary(query * head_dim**-0.5, angles[:length])
    return AttentionView(query, apply_rotary(key, angles[:length]), value, key_mask)


class PaddedRun(RunLayout):
    """Padded layers (BSHD): states `[B, L, hidden]`, each protein from column 0.

    Attributes:
        rotary_angles: `[L, head_dim]`.
        key_mask: `[B, L]` True for tokens; None when nothing is padded.
        width: L before FP8 padding.
        run: the right-padded packing the states were unpacked with (outputs go back through it); None when a
            padded input without padding runs as it came.
        batch: the input batch.
        rows: B.
    """

    def __init__(
        self,
        rotary_angles: torch.Tensor,
        key_mask: torch.Tensor | None,
        width: int,
        run: PackedSequences | None,
        batch: InputBatch,
        rows: int,
    ) -> None:
        self.rotary_angles, self.key_mask, self.width, self.run, self.batch = rotary_angles, key_mask, width, run, batch
        mask = {"attn_mask_type": "no_mask"}
        if key_mask is not None:
            mask = {"attn_mask_type": "padding", "attention_mask": ~key_mask[:, None, None, :]}
        self.set_attention(mask)
        self.qkv_rotation = QKVRotation.of(
            rotary_angles, lambda: torch.arange(rotary_angles.shape[0], device=rotary_angles.device).repeat(rows)
        )

    @classmethod
    def of(
        cls, hidden_states: torch.Tensor, batch: InputBatch, rotary: RotaryTable, fp8: bool
    ) -> tuple[torch.Tensor, PaddedRun]:
        """Lay `_embed`'s states (`[T, hidden]` packed; `[B, S, hidden]` when `batch.packed` is None) out padded: a
        padded input with padding on the left, or wider than its longest protein, is laid out anew, so every
        protein sees positions `0..length-1` and none of the padding; with `fp8`, the width is padded so the token
        count is a multiple of `FP8_TOKEN_MULTIPLE`."""
        run, key_mask = None, None
        if batch.packed is not None:
            run = batch.run_packing
            hidden_states, key_mask = run.unpack(hidden_states), run.key_mask()
        rows, width = hidden_states.shape[:2]
        if fp8 and (rows * width) % FP8_TOKEN_MULTIPLE:
            extra = -width % FP8_TOKEN_MULTIPLE
            if key_mask is None:
                key_mask = torch.ones(rows, width, dtype=torch.bool, device=hidden_states.device)
            hidden_states, key_mask = F.pad(hidden_states, (0, 0, 0, extra)), F.pad(key_mask, (0, extra), value=False)
        return hidden_states, cls(rotary(hidden_states.shape[1]), key_mask, width, run, batch, rows)

    def to_input(self, states: torch.Tensor) -> torch.Tensor:
        states = states[:, : self.width]
        return states if self.run is None else self.batch.to_input_layout(self.run.pack(states))

    def attention_view(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> AttentionView:
        return rotated_view(qkv, self.key_mask, self.rotary_angles, num_heads, head_dim)

    def from_attention_view(self, context: torch.Tensor) -> torch.Tensor:
        return context.transpose(1, 2).flatten(2)


class PackedRun(RunLayout):
    """Packed layers (THD): states `[T, hidden]`; the twin attends in the right-padded view `[N, L]`.

    Attributes:
        packed: the packing of the states (with dummy proteins and empty slots after the real ones when padded).
        rotary_angles: `[packed.max_length, head_dim]`.
        num_tokens: the real tokens, the first ones of the states.
        batch: the input batch (None inside a CUDA graph, which never restores).
        static_shape: padded to a CUDA graph's static shape.
        key_mask: `[N, L]` True where the right-padded view holds a token (the twin's: made at its first attention
            view, so never on Transformer Engine's layers; or given by a subclass whose view differs).
    """

    def __init__(
        self,
        packed: PackedSequences,
        rotary_angles: torch.Tensor | None,
        num_tokens: int,
        batch: InputBatch | None = None,
        static_shape: bool = False,
        key_mask: torch.Tensor | None = None,
    ) -> None:
        self.packed, self.rotary_angles, self.num_tokens = packed, rotary_angles, num_tokens
        self.batch, self.static_shape = batch, static_shape
        self._key_mask = key_mask
        self.set_attention(self.make_attention_kwargs())
        # a static shape replays a graph, which rotates with the positions it computes inside (`StaticShapeLayers`)
        self.qkv_rotation = None if static_shape else self.make_qkv_rotation()

    @property
    def key_mask(self) -> torch.Tensor:
        if self._key_mask is None:  # once per batch, by the first layer that attends in the view
            self._key_mask = self.packed.key_mask()
        return self._key_mask

    def make_attention_kwargs(self) -> dict[str, Any]:
        cu_seq_lens, max_length = self.packed.cu_seq_lens, self.packed.max_length
        return {
            "attn_mask_type": "padding",
            "cu_seqlens_q": cu_seq_lens,
            "cu_seqlens_kv": cu_seq_lens,
            "max_seqlen_q": max_length,
            "max_seqlen_kv": max_length,
        }

    def make_qkv_rotation(self) -> QKVRotation | None:
        return QKVRotation.of(self.rotary_angles, lambda: self.packed.positions)

    @classmethod
    def of(
        cls,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        rotary: RotaryTable,
        token_multiple: int = 1,
        shape: tuple[int, int, int] | None = None,
        **fields: Any,
    ) -> tuple[torch.Tensor, PackedRun]:
        """Pad packed `[T, hidden]` states for the run: to a CUDA graph's static `shape` (tokens, slots,
        max_length), else to a multiple of `token_multiple` tokens (FP8; tensor parallelism's ranks). `fields`: a
        subclass's own."""
        run = batch.run_packing
        if shape is not None:
            hidden_states, run = pad_packed(hidden_states, run, *shape)
        elif run.num_tokens % token_multiple:
            hidden_states, run = pad_packed_to_multiple(hidden_states, run, token_multiple)
        layout = cls(run, rotary(run.max_length), batch.run_packing.num_tokens, batch, shape is not None, **fields)
        return hidden_states, layout

    def to_input(self, states: torch.Tensor) -> torch.Tensor:
        return self.batch.to_input_layout(states[: self.num_tokens])

    def attention_view(self, qkv: torch.Tensor, num_heads: int, head_dim: int) -> AttentionView:
        return rotated_view(self.packed.unpack(qkv), self.key_mask, self.rotary_angles, num_heads, head_dim)

    def from_attention_view(self, context: torch.Tensor) -> torch.Tensor:
        return self.packed.pack(context.transpose(1, 2).flatten(2))
