"""Tensor and context parallelism of the PyTorch twin on CPU (2 gloo processes, fp32). `enable_tensor_parallel`
splits every layer's heads and MLP columns over the ranks, and the tokens between the products (sequence
parallelism); `enable_context_parallel` runs each rank's chunks of every protein, attending to all ranks' keys. Each
rank's outputs must equal transformers' `EsmForMaskedLM` and the unsplit model, and its gradients, put back together
as the recipe does (split parameters concatenated; layer parameters that saw only this rank's tokens summed over
the ranks), the unsplit model's. Transformer Engine's versions run the same checks on a GPU
(tests/test_gpu_tensor_parallel.py).

Tolerances (fp32): the split products sum in another order, ~1e-7 relative per layer: logits within 2e-5 of
transformers' and of the unsplit model's; gradients within 1e-5 relative (L2)."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import (
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_lengths,
    random_proteins,
    relative_error,
)
from modeling_nv_esm import ContextParallel, ContextParallelLayout, PackedSequences, RankGroup
from modeling_nv_esm_parallel import tensor_parallel_split_dim

RANKS = 2
LOGITS_ATOL = 2e-5
GRAD_RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def whole_gradient(name: str, grad: torch.Tensor, kind: str = "tensor") -> torch.Tensor:
    """A rank's gradient of parameter `name`, after `reduce_partial_gradients`, as the unsplit model's: tensor
    parallelism's split parameters concatenated over the ranks, the others as they are."""
    dim = tensor_parallel_split_dim(name) if kind == "tensor" else None
    if dim is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(RANKS)]
    dist.all_gather(parts, grad.contiguous())
    return torch.cat(parts, dim)


def enable(model: torch.nn.Module, kind: str) -> None:
    if kind == "tensor":
        model.enable_tensor_parallel(dist.group.WORLD)
    else:
        model.enable_context_parallel(dist.group.WORLD)


def check_rank(rank: int, port: int, seed: int, kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    try:
        check_split_model(seed, kind)
        dist.barrier()  # no rank leaves (tearing down its connections) while another still reads from it
    finally:
        dist.destroy_process_group()
    leave_without_teardown()


def leave_without_teardown() -> None:
    """End a process whose checks passed at once: in about 1 of 40 runs (torch 2.13 CPU, gloo) the interpreter's
    teardown aborted ("terminate called without an active exception", no Python frame left) after every check and
    the process group's destruction had passed. A failed check raises before this and is reported as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def check_split_model(seed: int, kind: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    hf = make_hf_model("tiny", seed=seed)
    whole = make_nv_model(hf, attn_input_format="thd")
    split = make_nv_model(hf, attn_input_format="thd")
    enable(split, kind)
    layer = split.esm.encoder.layers[0]
    size = RANKS if kind == "tensor" else 1
    assert layer.self_attention.num_heads == hf.config.num_attention_heads // size
    assert layer.layernorm_mlp.fc1_weight.shape[0] == hf.config.intermediate_size // size

    lengths = random_lengths(generator, 6, longest=120)
    if seed == 0:
        lengths.append(hf.config.max_position_embeddings)  # a maximum-length protein
    if sum(lengths) % RANKS == 0:
        lengths.append(2)  # an odd token count: the model pads it to split the tokens
    proteins = random_proteins(lengths, seed=seed, mask_fraction=0.15)
    packed = pack_batch(proteins)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = hf(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = split(**packed, output_hidden_states=True)
        unsplit = whole(**packed, output_hidden_states=True)
        padded = split(input_ids=input_ids, attention_mask=attention_mask).logits
    cu_seq_lens = packed["cu_seq_lens_q"].tolist()
    for i, length in enumerate(lengths):
        own = logits.logits[0, cu_seq_lens[i] : cu_seq_lens[i + 1]]
        assert max_abs_diff(own, expected[i, :length]) <= LOGITS_ATOL, (i, length)
        assert max_abs_diff(padded[i, :length], expected[i, :length]) <= LOGITS_ATOL, (i, length)
    assert max_abs_diff(logits.logits, unsplit.logits) <= LOGITS_ATOL
    assert len(logits.hidden_states) == len(unsplit.hidden_states) == hf.config.num_hidden_layers + 1
    for ours, theirs in zip(logits.hidden_states, unsplit.hidden_states):
        assert ours.shape == theirs.shape and max_abs_diff(ours, theirs) <= LOGITS_ATOL

    labels = torch.where(packed["input_ids"] == 32, torch.randint(4, 24, packed["input_ids"].shape), -100)
    labels[0, torch.randint(0, labels.shape[1], (8,), generator=generator)] = 5
    recomputed = make_nv_model(hf, attn_input_format="thd")  # activation checkpointing reissues the collectives
    enable(recomputed, kind)
    recomputed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = []
    for model in (whole, split, recomputed):
        model.train()
        output = model(**packed, labels=labels)
        output.loss.backward()
        losses.append(output.loss.detach())
        if model is not whole:
            model.reduce_partial_gradients()
    for loss in losses[1:]:
        assert abs(loss.item() - losses[0].item()) <= 1e-6 * abs(losses[0].item())
    reference = dict(whole.named_parameters())
    for model in (split, recomputed):
        for name, parameter in model.named_parameters():
            if parameter.grad is None:
                assert reference[name].grad is None, name
                continue
            error = relative_error(whole_gradient(name, parameter.grad, kind), reference[name].grad)
            assert error <= GRAD_RTOL, (name, model is recomputed)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor", "context"])
@pytest.mark.parametrize("seed", range(2))
def test_split_layers_give_transformers_outputs_and_the_unsplit_gradients(seed: int, kind: str) -> None:
    """Random lengths with a length-1 protein (seed 0 also a maximum-length one) and an odd token count; packed
    and padded inputs; eval outputs (logits, every layer's states) and a training step's loss and gradients."""
    mp.spawn(check_rank, args=(free_port(), seed, kind), nprocs=RANKS)


def test_what_tensor_parallelism_does_not_support_is_refused() -> None:
    hf = make_hf_model("tiny", seed=1)
    group_of = {size: RankGroup(group=None, size=size, rank=0) for size in (1, 3)}
    cases = {
        "heads do not split over 3 ranks": (make_nv_model(hf, attn_input_format="thd"), group_of[3]),
        "needs packed layers": (make_nv_model(hf, attn_input_format="bshd"), group_of[1]),
        "dropout is not supported": (make_nv_model(hf, attn_input_format="thd", hidden_dropout_prob=0.1), group_of[1]),
        "activation offloading is not supported": (
            make_nv_model(hf, attn_input_format="thd", offload_activations=True),
            group_of[1],
        ),
    }
    for message, (model, tensor_parallel) in cases.items():
        with pytest.raises(ValueError, match=message):
            model.esm.encoder.enable_tensor_parallel(tensor_parallel)
    model = make_nv_model(hf, attn_input_format="thd")
    model.esm.encoder.enable_tensor_parallel(group_of[1])
    with pytest.raises(ValueError, match="it was enabled already"):
        model.esm.encoder.enable_tensor_parallel(group_of[1])
    with pytest.raises(ValueError, match="split over tensor-parallel ranks"):
        model.save_pretrained("unused")
    with pytest.raises(ValueError, match="context parallelism: it does not combine with tensor parallelism yet"):
        model.esm.encoder.enable_context_parallel(ContextParallel(group=None, size=1, rank=0))


def test_what_context_parallelism_does_not_support_is_refused() -> None:
    hf = make_hf_model("tiny", seed=1)
    group = ContextParallel(group=None, size=2, rank=0)
    cases = {
        "needs packed layers": make_nv_model(hf, attn_input_format="bshd"),
        "dropout is not supported": make_nv_model(hf, attn_input_format="thd", attention_probs_dropout_prob=0.1),
        "activation offloading is not supported": make_nv_model(hf, attn_input_format="thd", offload_activations=True),
    }
    for message, model in cases.items():
        with pytest.raises(ValueError, match=message):
            model.esm.encoder.enable_context_parallel(group)
    model = make_nv_model(hf, attn_input_format="thd")
    model.esm.encoder.enable_context_parallel(group)
    with pytest.raises(ValueError, match="it was enabled already"):
        model.esm.encoder.enable_context_parallel(group)
    with pytest.raises(ValueError, match="tensor parallelism: it does not combine with context parallelism yet"):
        model.esm.encoder.enable_tensor_parallel(RankGroup(group=None, size=1, rank=0))


@pytest.mark.parametrize("size", [2, 3])
def test_the_context_parallel_layout_gives_each_rank_two_chunks_of_every_protein(size: int) -> None:
    """Transformer Engine's dual-chunk THD layout, computed independently here: proteins padded to a multiple of
    2 x size, rank r holds chunks r and 2 x size - 1 - r of each; `own_tokens` puts the real tokens there (zeros
    at padding); a token multiple (FP8) rounds the padded count up with a dummy protein."""
    lengths = [5, 1, 12, 8]
    cu_seq_lens = torch.tensor([0, 5, 6, 18, 26], dtype=torch.int32)
    packed = PackedSequences.right_padded(cu_seq_lens, 12, 26)
    padded_lengths = {2: [8, 4, 12, 8], 3: [6, 6, 12, 12]}[size]
    starts = [sum(padded_lengths[:i]) for i in range(len(lengths))]
    num_local = sum(padded_lengths) // size
    for rank in range(size):
        layout = ContextParallelLayout.of(packed, ContextParallel(group=None, size=size, rank=rank))
        assert layout.cu_seq_lens_padded.tolist() == [*starts, sum(padded_lengths)] and layout.max_length == 12
        assert layout.cu_seq_lens.tolist() == cu_seq_lens.tolist()
        expected, start = [], 0
        for padded in padded_lengths:
            chunk = padded // (2 * size)
            for index in (rank, 2 * size - 1 - rank):
                expected += list(range(start + index * chunk, start + (index + 1) * chunk))
            start += padded
        own = layout.rank_order[rank * num_local : (rank + 1) * num_local]
        assert own.tolist() == expected
        protein = [max(i for i, s in enumerate(starts) if s <= place) for place in expected]
        assert layout.local_positions.tolist() == [place - starts[p] for place, p in zip(expected, protein)]
        states = torch.arange(1, 27, dtype=torch.float32)[:, None]  # token t of the batch holds t + 1
        real = {starts[i] + j: cu_seq_lens[i].item() + j + 1 for i, n in enumerate(lengths) for j in range(n)}
        values = torch.tensor([real.get(place, 0) for place in expected], dtype=torch.float32)
        torch.testing.assert_close(layout.own_tokens(states)[:, 0], values, rtol=0, atol=0)
    if size == 2:
        rounded = ContextParallelLayout.of(packed, ContextParallel(group=None, size=2, rank=0), token_multiple=24)
        assert rounded.cu_seq_lens_padded.tolist() == [0, 8, 12, 24, 32, 48]  # 48 tokens: 24 per rank
        assert rounded.cu_seq_lens.tolist() == [0, 5, 6, 18, 26, 42] and rounded.max_length == 16


def check_fsdp_rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    try:
        check_fsdp_keeps_rotary_angles_in_float32()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_without_teardown()


def check_fsdp_keeps_rotary_angles_in_float32() -> None:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from nv_esm.train.parallel import shard

    nv = make_nv_model(make_hf_model("tiny", seed=3), attn_input_format="thd").train()
    layers = list(nv.esm.encoder.layers)
    seen = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append((args[0].dtype, args[1].rotary_angles)))
    world = SimpleNamespace(fsdp_mesh=init_device_mesh("cpu", (RANKS,)))
    shard(nv, layers, world, torch.bfloat16, torch.float32, reshard_after_forward=True)
    batch = pack_batch(random_proteins([600, 30], seed=5))
    nv(**batch).logits.float().mean().backward()
    expected = nv.esm.rotary_embeddings(batch["max_length_q"])
    assert len(seen) == len(layers)
    for states_dtype, angles in seen:
        assert states_dtype == torch.bfloat16  # the layers compute in the policy's dtype
        assert angles.dtype == torch.float32 and torch.equal(angles, expected)


@pytest.mark.slow
def test_fsdp2_mixed_precision_leaves_the_rotary_angles_in_float32() -> None:
    """The recipe's FSDP2 policy (`shard`: bf16 parameters, `cast_forward_inputs`) casts the floating tensors of
    each layer's arguments, dataclasses included; the run layout is a plain object, so its float32 rotary angles
    reach every layer unchanged (cast to bf16 they were off by up to 2 radians at position 600)."""
    mp.spawn(check_fsdp_rank, args=(free_port(),), nprocs=RANKS)


def test_te_context_parallel_shares_tokens_all_to_all_where_the_heads_divide_else_gathers_them() -> None:
    """Transformer Engine's context-parallel attention exchange (`ContextParallel.te_exchange`): an all-to-all over
    heads where each rank's heads divide among the group's ranks, else an all-gather of keys and values; never TE's
    ring, which got proteins of 1 to 3 tokens wrong (bench/results/cp_comm_h200x4_2026-11-27/; the GPU test runs both
    exchanges)."""
    from modeling_nv_esm_parallel import ContextParallel

    def exchange(size: int, heads: int) -> str:
        return ContextParallel(None, size, 0, tuple(range(size))).te_exchange(heads)

    assert [exchange(size, 20) for size in (2, 4, 5, 8)] == ["a2a", "a2a", "a2a", "all_gather"]
    assert [exchange(size, 40) for size in (8, 16)] == ["a2a", "all_gather"]
    assert exchange(2, 5) == "all_gather"
