"""Small GPU kernels where Transformer Engine has no fused path, each beside its PyTorch twin (the reference its GPU
parity test compares it with).

`rotate_qk`: ESM's rotary position embedding applied to the queries and keys of the fused QKV projection in one
pass, in place where no gradient is recorded. Transformer Engine's `MultiheadAttention` splits the projection
into queries, keys and values, rotates the queries and the keys in two kernels that write new tensors, and then
copies the values too, as its attention takes the rotated queries and keys with the values' other strides as a
layout it cannot read; in the backward it concatenates the three gradients again. Rotating the projection's
output where it lies keeps queries, keys and values interleaved (`[tokens, heads, 3, head_dim]`), the packed
layout TE's `DotProductAttention` reads without a copy and whose gradient it writes as one tensor.

Triton is imported on first use (it ships with CUDA builds of PyTorch); nothing here runs on the CPU except the
twin.

Part of the model's Hub remote code: imports nothing of the project.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


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


@functools.cache
def _rotate_qk_kernel() -> Any:
    try:
        import triton
        import triton.language as tl
    except ImportError as error:
        raise ImportError(
            "Transformer Engine layers rotate queries and keys with a Triton kernel; Triton ships with CUDA builds of "
            "PyTorch (pip install triton), or load the model with backend='torch'."
        ) from error

    @triton.jit
    def rotate_qk_kernel(
        source,
        target,
        positions,
        cos,
        sin,
        heads,
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
        position = tl.load(positions + token).to(tl.int64)
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

    return rotate_qk_kernel


def _launch(
    source: torch.Tensor,  # [T, heads, 3, head_dim], each head's q, k, v contiguous (target too)
    target: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
) -> None:
    import triton

    tokens, heads, _, head_dim = source.shape
    _rotate_qk_kernel()[(tokens,)](
        *(source, target, positions, cos, sin, heads, *source.stride()[:2], *target.stride()[:2]),
        HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_HEADS=triton.next_power_of_2(heads),
        INVERSE=inverse,
        COPY_VALUES=target.data_ptr() != source.data_ptr(),
    )


def _check(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = qkv.shape[-1] // 2
    if qkv.dim() != 4 or qkv.shape[2] != 3 or qkv.stride(-1) != 1 or qkv.stride(2) != 2 * half:
        raise ValueError(f"rotate_qk takes [tokens, heads, 3, head_dim] with each head's q, k, v contiguous, got "
                         f"shape {tuple(qkv.shape)}, strides {qkv.stride()}")  # fmt: skip
    if qkv.shape[-1] % 2 or cos.shape[1:] != (half,) or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rotate_qk needs an even head_dim and contiguous [L, {half}] cos/sin tables")
    if positions.shape != qkv.shape[:1] or not positions.is_contiguous():
        raise ValueError("rotate_qk needs one contiguous position per token")


class _RotateQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        rotated = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        _launch(qkv, rotated, positions, cos, sin, inverse=False)
        ctx.save_for_backward(positions, cos, sin)
        return rotated

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        positions, cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1 or grad.stride(2) != grad.shape[-1]:
            grad = grad.contiguous()
        grad_qkv = torch.empty_like(grad, memory_format=torch.contiguous_format)  # never write a given gradient
        _launch(grad, grad_qkv, positions, cos, sin, inverse=True)
        return grad_qkv, None, None, None


def rotate_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the queries and keys of `qkv [T, heads, 3, head_dim]` (CUDA; each head's q, k, v contiguous) by the
    angles of `positions [T]` (int32/int64): `cos`/`sin` `[L, head_dim / 2]` float32 tables of ESM's half angles.
    In place, returning `qkv`, when no gradient is recorded; else a new tensor, differentiable with respect to
    `qkv`. Float32 math as the twin (`rotate_qk_reference`)."""
    _check(qkv, positions, cos, sin)
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _RotateQK.apply(qkv, positions, cos, sin)
    _launch(qkv, qkv, positions, cos, sin, inverse=False)
    return qkv
