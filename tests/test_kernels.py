"""The GPU kernels of `modeling_nv_esm_kernels` against their PyTorch twins, and the twins against the model's.

`rotate_qk_reference` (the twin of `rotate_qk`) is checked on the CPU against the rotation the PyTorch layers run
(`modeling_nv_esm_layout.apply_rotary`); the Triton kernel is checked on the GPU against the twin, forward (in
place and out of place) and backward (a packed and a strided gradient). Float32 within 1e-6: the same float32
operations, possibly contracted into fused multiply-adds. bf16 and fp16 within one step of the value in their
dtype, as the float32 results round at most one step apart (1e-6 more where the terms cancel). Random shapes: any
head count (ESM-2's 20 is not a power of two), head dims 8..128 (24, of ESM-2 35M, is not one either), positions
anywhere in the table, tokens of one protein or many.
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_MARKS
from modeling_nv_esm_kernels import rotate_qk, rotate_qk_reference
from modeling_nv_esm_layers import import_transformer_engine, transformer_engine_available
from modeling_nv_esm_layout import QKVRotation, apply_rotary

SHAPES = [(1, 1, 8), (37, 20, 64), (300, 5, 24), (64, 3, 128)]  # tokens, heads, head_dim (ESM-2 35M: 24)


def angle_table(length: int, head_dim: int) -> torch.Tensor:
    """ESM's table (`NVEsmRotaryEmbedding`): the half table repeated twice, `[length, head_dim]`."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)


def draw(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, 1100, (), generator=generator))
    qkv = torch.randn(tokens, heads, 3, head_dim, generator=generator).to(device, dtype)
    positions = torch.randint(0, length, (tokens,), generator=generator)
    rotation = QKVRotation(positions.to(device), angle_table(length, head_dim).to(device))
    return qkv, rotation


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_rotates_as_the_pytorch_layers_do(shape):
    qkv, rotation = draw(*shape, torch.float32, "cpu", seed=sum(shape))
    tokens, heads, head_dim = shape
    angles = angle_table(int(rotation.cos.shape[0]), head_dim)[rotation.positions.long()]  # [T, head_dim]
    rotated = rotate_qk_reference(qkv, rotation.positions.long(), rotation.cos, rotation.sin)
    for part in (0, 1):  # each token its own "sequence" of length 1 at its position: [1, heads, T, d] x [T, d]
        expected = apply_rotary(qkv[:, :, part].transpose(0, 1)[None], angles)[0].transpose(0, 1)
        torch.testing.assert_close(rotated[:, :, part], expected, rtol=0, atol=1e-6)
    assert torch.equal(rotated[:, :, 2], qkv[:, :, 2])
    back = rotate_qk_reference(rotated, rotation.positions.long(), rotation.cos, rotation.sin, inverse=True)
    torch.testing.assert_close(back, qkv, rtol=0, atol=1e-5)


def within_a_step(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:  # one step of the value (bf16 2**-7, fp16 2**-10 relative), plus float32 rounding where q/k terms cancel
        step = expected.float().abs() * torch.finfo(dtype).eps + 1e-6
        assert bool(((actual.float() - expected.float()).abs() <= step).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@GPU_MARKS[1]
def test_rotate_qk_matches_its_twin_forward_and_backward(shape, dtype):
    qkv, rotation = draw(*shape, dtype, "cuda", seed=7 * sum(shape))
    args = (rotation.positions, rotation.cos, rotation.sin)
    expected = rotate_qk_reference(qkv, *args)

    in_place = qkv.clone()
    with torch.no_grad():
        result = rotate_qk(in_place, *args)
    assert result is in_place
    within_a_step(in_place, expected, dtype)

    source = qkv.clone().requires_grad_()
    rotated = rotate_qk(source, *args)
    assert rotated.data_ptr() != source.data_ptr()
    within_a_step(rotated.detach(), expected, dtype)
    assert torch.equal(source.detach(), qkv)  # the input is left as it was
    # a gradient as TE's attention hands it back (packed) and a strided one (the kernel reads any token/head strides)
    for grad in (torch.randn_like(rotated), torch.randn(qkv.shape[1], qkv.shape[0], 3, qkv.shape[3]).to(qkv)):
        grad = grad if grad.shape == qkv.shape else grad.transpose(0, 1)
        given = grad.clone()
        source.grad = None
        rotate_qk(source, *args).backward(grad)
        assert torch.equal(grad, given)  # the given gradient is left as it was
        twin_source = qkv.detach().float().requires_grad_()  # a new leaf each time (fp32: .float() is qkv)
        rotate_qk_reference(twin_source, *args).backward(grad.float())
        within_a_step(source.grad, twin_source.grad.to(dtype), dtype)


def test_the_rotation_is_left_to_te_off_the_gpu():
    """`QKVRotation.of` gives none for a CPU layout (the twin's) or without a rotary table, without computing the
    tokens' positions: TE's own attention block rotates wherever the kernel cannot run."""
    angles = angle_table(16, 8)
    unused = lambda: pytest.fail("positions made for a rotation that is not used")  # noqa: E731
    assert QKVRotation.of(angles, unused) is None
    assert QKVRotation.of(None, unused) is None


@pytest.mark.gpu
@GPU_MARKS[1]
def test_rotate_qk_refuses_layouts_it_cannot_read():
    qkv, rotation = draw(8, 4, 64, torch.bfloat16, "cuda", seed=1)
    args = (rotation.positions, rotation.cos, rotation.sin)
    with pytest.raises(ValueError, match="heads, 3, head_dim"):
        rotate_qk(qkv.transpose(1, 2), *args)  # [T, 3, heads, d]: q, k, v of a head not side by side
    with pytest.raises(ValueError, match="one contiguous position per token"):
        rotate_qk(qkv, rotation.positions[:4], rotation.cos, rotation.sin)


def layouts() -> list:
    """A packed run (three proteins) and padded runs with and without padding, on the CPU."""
    from modeling_nv_esm_batch import PackedSequences
    from modeling_nv_esm_layout import PackedRun, PaddedRun

    angles = angle_table(12, 8)
    cu_seq_lens = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    packed = PackedRun(PackedSequences.right_padded(cu_seq_lens, 6, 12), angles[:6], 12)
    key_mask = torch.tensor([[True] * 6, [True] * 2 + [False] * 4])
    padded = PaddedRun(angles[:6], key_mask, 6, None, None, 2)
    unpadded = PaddedRun(angles[:6], None, 6, None, None, 2)
    return [packed, padded, unpadded]


@pytest.mark.parametrize("index", range(3), ids=["packed", "padded", "unpadded"])
def test_the_layout_says_the_same_to_te_layers_and_to_their_attention(index):
    """`attention_kwargs` (what the rotated attention passes to TE's `DotProductAttention`) and `te_kwargs` (TE's
    `TransformerLayer`) hold the same lengths and mask, under each forward's names, and only `te_kwargs` the rotary
    table; where Transformer Engine is installed, every name is a parameter of the forward it goes to."""
    layout = layouts()[index]
    attention, layer = layout.attention_kwargs, dict(layout.te_kwargs)
    torch.testing.assert_close(layer.pop("rotary_pos_emb")[:, 0, 0], layout.rotary_angles, rtol=0, atol=0)
    assert layer.pop("self_attn_mask_type") == attention["attn_mask_type"]
    assert layer.keys() == attention.keys() - {"attn_mask_type"}
    assert all(layer[name] is attention[name] for name in layer)
    if transformer_engine_available():
        import inspect

        te = import_transformer_engine()
        assert set(layout.te_kwargs) <= set(inspect.signature(te.TransformerLayer.forward).parameters)
        assert set(attention) <= set(inspect.signature(te.DotProductAttention.forward).parameters)
