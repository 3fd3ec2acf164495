"""Small GPU kernels where Transformer Engine has no fused path, each beside its PyTorch twin (the reference its GPU
parity test compares it with).

`rotate_qk`: ESM's rotary position embedding applied to the queries and keys of the fused QKV projection in one
pass, in place where no gradient is recorded. Transformer Engine's `MultiheadAttention` splits the projection
into queries, keys and values, rotates the queries and the keys in two kernels that write new tensors, and then
copies the values too, as its attention takes the rotated queries and keys with the values' other strides as a
layout it cannot read; in the backward it concatenates the three gradients again. Rotating the projection's
output where it lies keeps queries, keys and values interleaved (`[tokens, heads, 3, head_dim]`), the packed
layout TE's `DotProductAttention` reads without a copy and whose gradient it writes as one tensor.

`add_bias_residual`: a layer's residual sum `residual + (x + bias)` (the output projection's or fc2's output, its bias,
the block's input) in one pass. Transformer Engine's `TransformerLayer` fuses it with `torch.compile`, which compiles it
in every new process (seconds of a short job) and again for new shapes; a Triton kernel compiles once per machine
(Triton's cache).

Triton (it ships with CUDA builds of PyTorch) is optional: without it `TRITON_AVAILABLE` is False, TE's own
attention block rotates (`modeling_nv_esm_layout.QKVRotation.of`) and TE's own sum runs. Nothing here runs on the
CPU except the twins.

Part of the model's Hub remote code: imports nothing of the project.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import torch
from torch.autograd.function import once_differentiable

try:  # optional (a try block, so that transformers' remote-code loader does not require it)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TRITON_AVAILABLE = triton is not None


@functools.cache
def hash_triton_installation_early() -> None:
    """Start Triton's hash of its own installation on a background thread (once a process). Triton computes it at
    the first kernel launch of a process to look its compiled kernels up on disk, and it reads every byte of its
    library: about a second the first batch would otherwise wait for. Hashing lets go of the GIL, so it overlaps
    the model's loading."""
    try:
        triton_key = importlib.import_module("triton.runtime.cache").triton_key
    except (ImportError, AttributeError):  # no Triton, or one that keys its cache otherwise
        return
    if callable(triton_key):
        threading.Thread(target=triton_key, name="triton-key", daemon=True).start()


def rotate_qk_reference(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """The PyTorch twin of `rotate_qk` (out of place): `qkv [T, heads, 3, head_dim]` with `[..., 0, :]` (queries)
    and `[..., 1, :]` (keys) rotated by the angles of `positions [T]` (`cos`/`sin` `[L, head_dim / 2]` float32, the
    half table: ESM's angles repeat it), in float32, as `modeling_nv_esm_layout.apply_rotary` computes; `inverse`
    rotates back (the backward)."""
    half = qkv.shape[-1] // 2
    c, s = cos[positions][:, None, None, :], sin[positions][:, None, None, :]
    if inverse:
        s = -s
    pair = qkv[:, :, :2].float()
    x1, x2 = pair[..., :half], pair[..., half:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)
    return torch.cat((rotated, qkv[:, :, 2:]), dim=2)


if TRITON_AVAILABLE:

    @triton.jit
    def _rotate_qk_kernel(
        source,
        target,
        positions,
        cos,
        sin,
        heads,
        table_length,
        source_token_stride,
        source_head_stride,
        target_token_stride,
        target_head_stride,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        INVERSE: tl.constexpr,
        COPY_VALUES: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        # Bounded, so that a position past the table (a caller's max_length_q shorter than a protein, with
        # check_inputs=False) cannot read past it
        position = tl.minimum(tl.maximum(tl.load(positions + token).to(tl.int64), 0), table_length - 1)
        column = tl.arange(0, BLOCK_HALF)
        head = tl.arange(0, BLOCK_HEADS)
        in_row = column < HALF
        mask = (head < heads)[:, None] & in_row[None, :]
        c = tl.load(cos + position * HALF + column, mask=in_row)[None, :]
        s = tl.load(sin + position * HALF + column, mask=in_row)[None, :]
        if INVERSE:
            s = -s
        source_row = source + token * source_token_stride + head[:, None] * source_head_stride + column[None, :]
        target_row = target + token * target_token_stride + head[:, None] * target_head_stride + column[None, :]
        for part in tl.static_range(2):  # queries, keys
            x1 = tl.load(source_row + part * 2 * HALF, mask=mask).to(tl.float32)
            x2 = tl.load(source_row + part * 2 * HALF + HALF, mask=mask).to(tl.float32)
            tl.store(target_row + part * 2 * HALF, (x1 * c - x2 * s).to(target.dtype.element_ty), mask=mask)
            tl.store(target_row + part * 2 * HALF + HALF, (x2 * c + x1 * s).to(target.dtype.element_ty), mask=mask)
        if COPY_VALUES:
            for offset in tl.static_range(2):
                values = tl.load(source_row + 4 * HALF + offset * HALF, mask=mask)
                tl.store(target_row + 4 * HALF + offset * HALF, values, mask=mask)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _launch(
    source: torch.Tensor,  # [T, heads, 3, head_dim], each head's q, k, v contiguous (target too)
    target: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
) -> None:
    tokens, heads, _, head_dim = source.shape
    if tokens == 0:
        return
    with torch.cuda.device(source.device):
        _rotate_qk_kernel[(tokens,)](
            *(source, target, positions, cos, sin, heads, cos.shape[0], *source.stride()[:2], *target.stride()[:2]),
            HALF=head_dim // 2,
            BLOCK_HALF=_next_power_of_2(head_dim // 2),
            BLOCK_HEADS=_next_power_of_2(heads),
            INVERSE=inverse,
            COPY_VALUES=target.data_ptr() != source.data_ptr(),
        )


def _heads_side_by_side(qkv: torch.Tensor) -> bool:
    """Whether the kernel reads `qkv [T, heads, 3, head_dim]` as it lies: each head's q, k, v side by side (any
    token and head strides)."""
    return qkv.stride(-1) == 1 and qkv.stride(2) == qkv.shape[-1]


def _check(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if not TRITON_AVAILABLE:
        raise ImportError("rotate_qk needs Triton (it ships with CUDA builds of PyTorch: pip install triton)")
    if qkv.dim() != 4 or qkv.shape[2] != 3 or qkv.shape[-1] % 2:
        raise ValueError(f"rotate_qk takes [tokens, heads, 3, head_dim] with an even head_dim, got {tuple(qkv.shape)}")
    if not _heads_side_by_side(qkv):
        raise ValueError(f"rotate_qk needs each head's q, k, v side by side, got strides {qkv.stride()}")
    half = qkv.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != half or table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"rotate_qk needs a contiguous float32 [L, {half}] {name} table")
    if positions.shape != qkv.shape[:1] or not positions.is_contiguous():
        raise ValueError("rotate_qk needs one contiguous position per token")
    if not (qkv.is_cuda and positions.device == cos.device == sin.device == qkv.device):
        raise ValueError("rotate_qk runs on one CUDA device: qkv, positions and the tables on it")


class _RotateQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        rotated = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        _launch(qkv, rotated, positions, cos, sin, inverse=False)
        ctx.save_for_backward(positions, cos, sin)
        return rotated

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        positions, cos, sin = ctx.saved_tensors
        if not _heads_side_by_side(grad):
            grad = grad.contiguous()
        grad_qkv = torch.empty_like(grad, memory_format=torch.contiguous_format)  # never write a given gradient
        _launch(grad, grad_qkv, positions, cos, sin, inverse=True)
        return grad_qkv, None, None, None


def rotate_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the queries and keys of `qkv [T, heads, 3, head_dim]` (CUDA; each head's q, k, v side by side) by the
    angles of `positions [T]` (int32/int64, each clamped to the table): `cos`/`sin` `[L, head_dim / 2]` float32
    tables of ESM's half angles. In place, returning `qkv`, when no gradient is recorded; else a new tensor,
    differentiable with respect to `qkv`. Float32 math as the twin (`rotate_qk_reference`)."""
    _check(qkv, positions, cos, sin)
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _RotateQK.apply(qkv, positions, cos, sin)
    _launch(qkv, qkv, positions, cos, sin, inverse=False)
    if not torch.is_inference_mode_enabled():
        torch.autograd.graph.increment_version(qkv)  # as an in-place torch op would: a saved copy of it fails loudly
    return qkv


def add_bias_residual_reference(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The PyTorch twin of `add_bias_residual`: `(x + bias) + residual` in float32, rounded once to the three
    inputs' promoted dtype; `x` and `residual` `[..., hidden]`, `bias` `[hidden]`."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, bias.dtype), residual.dtype)
    return ((x.float() + bias.float()) + residual.float()).to(dtype)


if TRITON_AVAILABLE:

    @triton.jit
    def _add_bias_residual_kernel(x, bias, residual, out, rows, hidden, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        # a tile of ROWS tokens x COLUMNS hidden features per program: the bias is read once per tile and no index
        # needs a per-element division
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
        column = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)[None, :]
        in_hidden = column < hidden
        mask = (row < rows) & in_hidden
        offsets = row.to(tl.int64) * hidden + column
        total = tl.load(x + offsets, mask=mask).to(tl.float32) + tl.load(bias + column, mask=in_hidden).to(tl.float32)
        total += tl.load(residual + offsets, mask=mask).to(tl.float32)
        tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)


_ADD_TILE = (16, 256)  # tokens x features per program: 4,096 elements, 16 per thread of 8 warps


def _add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(x.dtype, bias.dtype), residual.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    hidden = bias.numel()
    if out.numel():
        rows, (tile_rows, tile_columns) = out.numel() // hidden, _ADD_TILE
        with torch.cuda.device(x.device):
            grid = (triton.cdiv(rows, tile_rows), triton.cdiv(hidden, tile_columns))
            _add_bias_residual_kernel[grid](
                x, bias, residual, out, rows, hidden, ROWS=tile_rows, COLUMNS=tile_columns, num_warps=8
            )
    return out


class _AddBiasResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        ctx.dtypes = x.dtype, bias.dtype, residual.dtype
        return _add(x, bias, residual)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x_dtype, bias_dtype, residual_dtype = ctx.dtypes
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(bias_dtype)
        grad_x = grad.to(x_dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grad_bias, grad.to(residual_dtype) if ctx.needs_input_grad[2] else None


def add_bias_residual_shapes_fit(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether `add_bias_residual` takes these shapes: `x` and `residual` of one shape `[..., hidden]`, `bias`
    `[hidden]`."""
    return x.shape == residual.shape and bias.shape == x.shape[-1:]


def add_bias_residual(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`(x + bias) + residual` of `x` and `residual` `[..., hidden]` (CUDA, one shape) and `bias` `[hidden]`, in
    float32 rounded once to the inputs' promoted dtype, as the twin (`add_bias_residual_reference`); differentiable
    with respect to all three."""
    if not TRITON_AVAILABLE:
        raise ImportError("add_bias_residual needs Triton (it ships with CUDA builds of PyTorch: pip install triton)")
    if not add_bias_residual_shapes_fit(x, bias, residual):
        raise ValueError(
            f"add_bias_residual takes x and residual of one shape [..., hidden] and a bias [hidden], got "
            f"{tuple(x.shape)}, {tuple(residual.shape)} and {tuple(bias.shape)}"
        )
    if not (x.is_cuda and bias.device == residual.device == x.device):
        raise ValueError("add_bias_residual runs on one CUDA device: x, bias and residual on it")
    x, bias, residual = x.contiguous(), bias.contiguous(), residual.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or bias.requires_grad or residual.requires_grad):
        return _AddBiasResidual.apply(x, bias, residual)
    return _add(x, bias, residual)
