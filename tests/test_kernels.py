"""The GPU kernels of `modeling_nv_esm_kernels` against their PyTorch twins, and the twins against the model's.

`rotate_qk_reference` (the twin of `rotate_qk`) is checked on the CPU against the rotation the PyTorch layers run
(`modeling_nv_esm_layout.apply_rotary`); the Triton kernel is checked on the GPU against the twin, forward (in
place and out of place) and backward (a packed and a strided gradient). Float32 within 1e-6: the same float32
operations, possibly contracted into fused multiply-adds. bf16 and fp16 within one step of the value in their
dtype, as the float32 results round at most one step apart (1e-6 more where the terms cancel). Random shapes: any
head count (ESM-2's 20 is not a power of two), head dims 8..128 (24, of ESM-2 35M, is not one either), positions
anywhere in the table, tokens of one protein or many.

`add_bias_residual` (the layers' residual sum) against its twin on the GPU: the same float32 additions rounded
once, so equal bit for bit; the bias gradient (a float32 sum over tokens, reduced in another order) within 1e-5
relative plus one step of its dtype. And a Transformer Engine model's forward and backward compile nothing
(`torch.compile` is what the kernel replaces).
"""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_MARKS
from modeling_nv_esm_kernels import add_bias_residual, add_bias_residual_reference, rotate_qk, rotate_qk_reference
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


def test_add_bias_residual_twin_is_the_residual_sum():
    generator = torch.Generator().manual_seed(3)
    x, residual = torch.randn(2, 5, 7, generator=generator), torch.randn(2, 5, 7, generator=generator)
    bias = torch.randn(7, generator=generator)
    torch.testing.assert_close(add_bias_residual_reference(x, bias, residual), residual + (x + bias), rtol=0, atol=0)
    half = add_bias_residual_reference(x.bfloat16(), bias, residual.bfloat16())
    assert half.dtype == torch.float32  # promoted, as torch's own sum: the bias is float32
    assert add_bias_residual_reference(x.bfloat16(), bias.bfloat16(), residual.bfloat16()).dtype == torch.bfloat16


ADD_SHAPES = [(0, 8), (1, 1280), (3, 7), (4099, 320), (2, 33, 480)]  # tokens ([B, S] or [T]), hidden
ADD_DTYPES = [  # x and residual, bias
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", ADD_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", ADD_SHAPES, ids=str)
@GPU_MARKS[1]
def test_add_bias_residual_matches_its_twin_forward_and_backward(shape, dtypes):
    dtype, bias_dtype = dtypes
    generator = torch.Generator().manual_seed(sum(shape))
    x, residual = (torch.randn(*shape, generator=generator).to("cuda", dtype) for _ in range(2))
    bias = torch.randn(shape[-1], generator=generator).to("cuda", bias_dtype)
    expected = add_bias_residual_reference(x, bias, residual)
    with torch.no_grad():
        assert torch.equal(add_bias_residual(x, bias, residual), expected)
    strided = torch.randn(shape[-1], *shape[:-1], generator=generator).to("cuda", dtype).movedim(0, -1)
    assert torch.equal(add_bias_residual(strided, bias, residual), add_bias_residual_reference(strided, bias, residual))

    inputs = [t.clone().requires_grad_() for t in (x, bias, residual)]
    twins = [t.clone().requires_grad_() for t in (x, bias, residual)]
    out = add_bias_residual(*inputs)
    assert torch.equal(out.detach(), expected)
    grad = torch.randn(out.shape, generator=generator).to("cuda", out.dtype)
    out.backward(grad)
    add_bias_residual_reference(*twins).backward(grad)
    for tensor, twin in zip(inputs, twins):
        assert tensor.grad.dtype == tensor.dtype
        bound = twin.grad.float().abs() * (1e-5 + torch.finfo(tensor.dtype).eps) + 1e-5 * max(1, out.numel()) ** 0.5
        assert bool(((tensor.grad.float() - twin.grad.float()).abs() <= bound).all())


@pytest.mark.gpu
@GPU_MARKS[1]
def test_add_bias_residual_refuses_what_it_cannot_add():
    x = torch.zeros(4, 8, device="cuda")
    with pytest.raises(ValueError, match="one shape"):
        add_bias_residual(x, torch.zeros(8, device="cuda"), torch.zeros(4, 9, device="cuda"))
    with pytest.raises(ValueError, match="bias \\[hidden\\]"):
        add_bias_residual(x, torch.zeros(4, device="cuda"), x)
    with pytest.raises(ValueError, match="one CUDA device"):
        add_bias_residual(x, torch.zeros(8), x)


def tiny_te_model_and_batches(lengths: list[int], seed: int) -> tuple:
    """(a tiny TE model on the GPU, no CUDA graphs; the packed inputs of random proteins of `lengths` tokens; the
    same proteins right-padded), all on the GPU."""
    from conftest import make_hf_model, make_nv_model, packed_on_gpu, pad_batch, random_proteins

    model = make_nv_model(make_hf_model("tiny", seed=seed), backend="te", cuda_graphs=False).cuda()
    proteins = random_proteins(lengths, seed=seed)
    packed = packed_on_gpu(proteins)
    input_ids, attention_mask = pad_batch(proteins)
    return model, packed, dict(input_ids=input_ids.cuda(), attention_mask=attention_mask.cuda())


@pytest.mark.gpu
@GPU_MARKS[1]
def test_a_te_model_compiles_nothing_in_forward_and_backward():
    """The residual sums run as `add_bias_residual`, not TE's `torch.compile`d function: no frame is compiled in a
    training step (ESM-2's hidden dropout is 0) nor in eval, packed or padded."""
    from torch._dynamo.utils import counters

    model, packed, padded = tiny_te_model_and_batches([1, 9, 40], seed=2)
    torch._dynamo.reset()
    before = counters["frames"]["total"]
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**packed).logits.float().sum().backward()
        model(**padded).logits.float().sum().backward()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**packed)
        model(**padded)
    assert counters["frames"]["total"] == before


@pytest.mark.gpu
@GPU_MARKS[1]
def test_a_te_model_forward_warns_nothing_about_its_attention():
    """TE's `DotProductAttention` inside its attention block is built causal (window (-1, 0)); the layout says
    (-1, -1), so a packed or padded forward does not warn "window_size should be (-1, -1)" at every call. Nor does
    TE's note on the packed q/k/v views `rotated_forward` passes on purpose reach the user."""
    import warnings

    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")  # before the model is built: the layers add their own filter above it
        model, packed, padded = tiny_te_model_and_batches([3, 17, 30], seed=4)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(**packed)
            model(**padded)
    assert not [str(w.message) for w in caught if "window_size" in str(w.message) or "q/k/v" in str(w.message)]


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
    assert attention["window_size"] == (-1, -1)  # no sliding window, said to TE (its attention's default is causal)
    if transformer_engine_available():
        import inspect

        te = import_transformer_engine()
        assert set(layout.te_kwargs) <= set(inspect.signature(te.TransformerLayer.forward).parameters)
        assert set(attention) <= set(inspect.signature(te.DotProductAttention.forward).parameters)
