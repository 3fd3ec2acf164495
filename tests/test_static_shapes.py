"""Static packed shapes (the buckets CUDA graphs are captured for): bounds, and padding (static shapes, FP8's
multiple of 16 tokens) that changes no output.

The graphs themselves need a GPU (tests/test_gpu_graphs.py); the shapes and the padding are checked here on the
PyTorch backend, fp32, against the unpadded run within 1e-5 (tests/test_model.py's tolerance).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_hf_model, make_nv_model, max_abs_diff, pack_batch, random_lengths, random_proteins
from modeling_nv_esm import PackedSequences, length_sorted_batches
from modeling_nv_esm_batch import FP8_TOKEN_MULTIPLE
from modeling_nv_esm_graphs import (
    ALLOCATOR_POOL_BINDINGS,
    StaticShapeGraphs,
    WarmUpInPool,
    _expandable_segments,
    _graph_mode,
    larger_graph_shape,
    static_shape,
    warm_up_hooks,
)
from modeling_nv_esm_layout import PackedRun, pad_packed, pad_packed_to_multiple
from modeling_nv_esm_plan import ForwardPrecision


@pytest.mark.parametrize("seed", range(5))
def test_static_shape_bounds(seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2000):
        num_sequences = int(torch.randint(1, 300, (), generator=generator))
        max_length = int(torch.randint(1, 2049, (), generator=generator))
        num_tokens = int(torch.randint(max_length, max_length * num_sequences + 1, (), generator=generator))
        tokens, slots, length = static_shape(num_tokens, num_sequences, max_length)
        assert 0 <= tokens - num_tokens < max(num_tokens / 8, 256) and tokens % 256 == 0
        if max_length <= 512:
            assert max_length <= length < max(2 * max_length, 65) and length & (length - 1) == 0
        elif max_length <= 1026:
            assert length == 1026
        else:
            assert max_length <= length < max_length + 512 and length % 512 == 0
        assert slots >= num_sequences + -(-(tokens - num_tokens) // length) and slots & (slots - 1) == 0
        assert slots < max(32, 2 * (num_sequences + -(-(tokens - num_tokens) // length)), 8 * tokens // length)


def test_lognormal_batches_use_few_static_shapes():
    """How many static shapes (so captures) 500 batches of log-normal protein lengths use."""
    generator = torch.Generator().manual_seed(6)
    for proteins, most in ((16, 40), (64, 30)):
        shapes = set()
        for _ in range(500):
            lengths = (torch.exp(5.6 + 0.7 * torch.randn(proteins, generator=generator)).clamp(10, 1024) + 2).long()
            shapes.add(static_shape(int(lengths.sum()), proteins, int(lengths.max())))
        print(f"\n[static shapes] {proteins} proteins per batch, 500 batches: {len(shapes)} shapes")
        assert len(shapes) <= most


def test_length_sorted_batches_share_one_shape_per_length_bucket():
    """`nv-esm embed`'s batches (length-sorted proteins under one token budget): apart from the last batch, those
    whose longest protein falls in one `max_length` bucket share one static shape (one capture), 1,024-residue
    proteins included (1026 tokens)."""
    generator = torch.Generator().manual_seed(8)
    lengths = (torch.exp(5.6 + 0.7 * torch.randn(3000, generator=generator)).clamp(10, 1024) + 2).long().tolist()
    lengths[:3] = [1026, 1026, 1025]
    batches = length_sorted_batches([[0] * length for length in lengths], 16384)
    shapes = {}
    for batch in batches[:-1]:
        tokens, slots, length = static_shape(sum(lengths[i] for i in batch), len(batch), max(lengths[i] for i in batch))
        shapes.setdefault(length, set()).add((tokens, slots))
    print(f"\n[static shapes] {len(batches)} length-sorted batches: {shapes}")
    assert len(shapes) >= 4 and all(len(found) == 1 for found in shapes.values()), shapes
    assert 1026 in shapes


def pad_to_static_shape(states: torch.Tensor, packed: PackedSequences) -> tuple[torch.Tensor, PackedSequences]:
    shape = static_shape(packed.num_tokens, packed.cu_seq_lens.numel() - 1, packed.max_length)
    return pad_packed(states, packed, *shape)


# Captured shapes for `pad_into_a_larger_graph`: too few tokens and too short; too few slots for the dummies that
# 2048 tokens of 256 need beside 7 proteins; the smallest that holds the batch; one with more tokens.
CAPTURED = [(512, 16, 64), (2048, 8, 256), (2048, 16, 256), (4096, 64, 1026)]


def pad_into_a_larger_graph(states: torch.Tensor, packed: PackedSequences) -> tuple[torch.Tensor, PackedSequences]:
    host = larger_graph_shape(CAPTURED, packed.num_tokens, packed.cu_seq_lens.numel() - 1, packed.max_length)
    assert host == (2048, 16, 256)
    return pad_packed(states, packed, *host)


def pad_for_fp8(states: torch.Tensor, packed: PackedSequences) -> tuple[torch.Tensor, PackedSequences]:
    return pad_packed_to_multiple(states, packed, FP8_TOKEN_MULTIPLE)


@pytest.mark.parametrize("pad", [pad_to_static_shape, pad_into_a_larger_graph, pad_for_fp8])
@pytest.mark.parametrize("seed", range(3))
def test_padding_the_packed_batch_changes_no_output(seed, pad):
    """Dummy proteins and empty slots appended to a packed batch (to its static shape, to a larger captured shape
    that holds it, or to the FP8 multiple of 16 tokens) leave every real token's final state unchanged."""
    nv = make_nv_model(make_hf_model("wide_heads", seed=7))
    generator = torch.Generator().manual_seed(seed)
    proteins = random_proteins(random_lengths(generator, 7, longest=150), seed=seed, mask_fraction=0.15)
    batch = pack_batch(proteins)
    embeddings = torch.randn(batch["input_ids"].shape[1], nv.config.hidden_size, generator=generator)
    packed = PackedSequences.right_padded(batch["cu_seq_lens_q"], batch["max_length_q"], embeddings.shape[0])
    padded_states, padded = pad(embeddings, packed)
    if pad is pad_to_static_shape:
        assert padded.num_tokens == static_shape(embeddings.shape[0], 7, packed.max_length)[0]
    elif pad is pad_into_a_larger_graph:
        assert (padded.num_tokens, padded.cu_seq_lens.numel() - 1, padded.max_length) == (2048, 16, 256)
    else:  # one dummy protein up to the next multiple of 16
        assert padded.num_tokens == -(-embeddings.shape[0] // FP8_TOKEN_MULTIPLE) * FP8_TOKEN_MULTIPLE
        assert padded.cu_seq_lens.numel() == packed.cu_seq_lens.numel() + 1
    assert padded.num_tokens == padded_states.shape[0]
    assert padded.cu_seq_lens[-1] == padded.num_tokens and (padded.cu_seq_lens.diff() >= 0).all()
    assert (padded.cu_seq_lens.diff() <= padded.max_length).all()
    assert torch.equal(padded.cu_seq_lens[: len(proteins) + 1], packed.cu_seq_lens)
    rotary = nv.esm.rotary_embeddings
    with torch.no_grad():
        precision = ForwardPrecision.of(nv.esm.encoder)
        expected = nv.esm.encoder.body(
            embeddings, PackedRun(packed, rotary(packed.max_length), packed.num_tokens), precision
        )
        actual = nv.esm.encoder.body(
            padded_states, PackedRun(padded, rotary(padded.max_length), padded.num_tokens), precision
        )
    assert max_abs_diff(actual[: embeddings.shape[0]], expected) <= 1e-5


@pytest.mark.parametrize(
    ("model_recipe", "layer_fp8", "expected"),
    [(False, (), (True,) * 3), (True, (True, False, True), (True, False, True)), (True, (False,) * 3, (False,) * 3)],
)
def test_layers_with_fp8_attention_get_a_layout_that_leaves_the_rotation_to_transformer_engine(
    monkeypatch, model_recipe, layer_fp8, expected
):
    """`ForwardPrecision.attention_fp8` (a recipe with `fp8_dpa`/`fp8_mha`: the model's own, or only the caller's)
    is read once per forward; `run_layers` then hands each layer that runs FP8 attention (every layer under the
    caller's recipe, the FP8 layers under the model's) its layout without a QKV rotation, the others the layout as
    planned, and never changes the planned one."""
    import dataclasses

    nv = make_nv_model(make_hf_model("wide_heads", seed=7))
    encoder = nv.esm.encoder
    assert len(encoder.layers) == 3
    batch = pack_batch(random_proteins([5, 9], seed=1))
    packed = PackedSequences.right_padded(batch["cu_seq_lens_q"], batch["max_length_q"], 14)
    layout = PackedRun(packed, nv.esm.rotary_embeddings(packed.max_length), packed.num_tokens)
    rotation = object()  # stands for a QKV rotation (the CPU makes none)
    layout.qkv_rotation = rotation
    seen = []
    monkeypatch.setattr(encoder, "run_layer", lambda layer, states, run: seen.append(run.qkv_rotation) or states)
    recipe = object() if model_recipe else None
    plain = ForwardPrecision.of(encoder)
    assert not plain.attention_fp8 and not any(plain.fp8_attention(i) for i in range(3))
    precision = dataclasses.replace(
        plain, recipe=recipe, caller_fp8=not model_recipe, layer_fp8=layer_fp8, attention_fp8=True
    )
    encoder.run_layers(torch.zeros(14, nv.config.hidden_size), layout, precision)
    assert [value is None for value in seen] == list(expected)
    assert all(value is rotation for value, te in zip(seen, expected) if not te)
    assert layout.qkv_rotation is rotation
    seen.clear()
    encoder.run_layers(torch.zeros(14, nv.config.hidden_size), layout, plain)
    assert seen == [rotation] * 3


def zero_packed_batch(lengths: list[int], hidden_size: int) -> tuple[torch.Tensor, PackedSequences]:
    cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    num_tokens = int(cu_seq_lens[-1])
    return torch.zeros(num_tokens, hidden_size), PackedSequences.right_padded(cu_seq_lens, max(lengths), num_tokens)


def test_an_uncaptured_inference_shape_runs_in_a_captured_graph_until_its_padding_costs_a_capture():
    """`StaticShapeGraphs.shape_for`, the policy (the CPU captures nothing: a captured graph is stood for by its
    key, as `run` files it). Inference: a shape no captured graph holds runs eagerly (None) at its first batch and is
    captured at its second (`capture_at_use`); one a captured graph holds runs padded in it until the padding it
    added passes `padding_before_capture` replays of that graph, then its own shape is captured. A captured shape
    runs as itself; graphs of another mode or failed captures hold nothing; `clear()` forgets the counts.
    Training: its own shape at first use."""
    nv = make_nv_model(make_hf_model("wide_heads", seed=7)).eval()
    encoder, graphs, hidden = nv.esm.encoder, StaticShapeGraphs(), nv.config.hidden_size
    graphs.time_shapes = False  # the timing of each replaying shape: the tests below
    large, small = zero_packed_batch([300] * 10, hidden), zero_packed_batch([1, 40, 40, 40, 79], hidden)
    large_shape, small_shape = static_shape(3000, 10, 300), static_shape(200, 5, 79)
    assert graphs.shape_for(encoder, *large) is None
    assert graphs.shape_for(encoder, *large) == large_shape
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = "graph"
    assert graphs.shape_for(encoder, *large) == large_shape
    assert larger_graph_shape([large_shape], 200, 5, 79) == large_shape
    # (3072, 32, 512) holds (256, 16, 128) with 2816 padding tokens a batch: 4 such batches fit in 4 x 3072.
    assert (large_shape, small_shape) == ((3072, 32, 512), (256, 16, 128))
    assert [graphs.shape_for(encoder, *small) for _ in range(5)] == [large_shape] * 4 + [small_shape]
    graphs.clear()
    assert not graphs._graphs and not graphs._uses and not graphs._padding
    nv.train()  # training: its own shape at first use, even where a graph would hold it
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = "graph"
    assert graphs.shape_for(encoder, small[0].clone().requires_grad_(), small[1]) == small_shape
    nv.eval()  # a training graph holds no inference batch, nor does a failed capture (None)
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = None
    assert graphs.shape_for(encoder, *small) is None


class FakeClock:
    """Stands for `CudaEventClock`: each timed span takes the next of `milliseconds`; None is a span still running
    until `finish` gives its time."""

    def __init__(self, milliseconds: list[float | None]) -> None:
        self.milliseconds, self.running = list(milliseconds), []

    def start(self) -> None:
        return None

    def stop(self, started: None) -> list:
        span = [self.milliseconds.pop(0)]
        if span[0] is None:
            self.running.append(span)
        return span

    def finish(self, milliseconds: float) -> None:
        self.running.pop(0)[0] = milliseconds

    def elapsed_ms(self, span: list) -> float | None:
        return span[0]


def timed_call(graphs: StaticShapeGraphs, encoder, batch) -> tuple:
    """One planned call as the encoder makes it: the shape `shape_for` gives, and what ran timed (as `run` and the
    eager path do: a replay where a shape was given, else an eager run)."""
    shape = graphs.shape_for(encoder, *batch)
    request = graphs.take_timing_request()
    kind = "replay" if shape is not None else "eager"
    with graphs.timed(request, kind):
        pass
    return shape, None if request is None else request.kind


@pytest.mark.parametrize(
    ("eager_per_replay_token", "margin"),
    [(0.96, 0.0), (0.99, 0.0), (1.02, 0.0), (0.96, 0.03), (0.98, 0.03)],
    ids=["eager_faster", "eager_slightly_faster", "graph_kept", "eager_faster_past_a_margin", "graph_kept_in_a_margin"],
)
def test_a_captured_inference_shape_is_timed_both_ways_and_runs_the_faster_way(eager_per_replay_token, margin):
    """`StaticShapeGraphs` times a captured inference shape's next replay, then one eager run of it; once both are
    done it keeps the faster per token, eager only when faster by more than `eager_margin` (0 by default; the eager
    batch has fewer tokens in the same shape), and then the shape hosts no smaller batch either, and a larger shape not
    captured yet runs eagerly without a capture. A span not finished yet is read at a later batch; `clear()` forgets
    the timings; with `time_shapes` off nothing is timed."""
    nv = make_nv_model(make_hf_model("wide_heads", seed=7)).eval()
    encoder, graphs, hidden = nv.esm.encoder, StaticShapeGraphs(), nv.config.hidden_size
    graphs.eager_margin = margin
    graphs.clock = FakeClock([10.0, None, 1.0, 5.0])
    large, small = zero_packed_batch([300] * 10, hidden), zero_packed_batch([1, 40, 40, 40, 79], hidden)
    fewer = zero_packed_batch([300] * 9 + [150], hidden)  # 2,850 tokens
    large_shape = static_shape(3000, 10, 300)
    assert static_shape(2850, 10, 300) == large_shape
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = "graph"  # captured (the CPU captures none)
    assert timed_call(graphs, encoder, large) == (large_shape, "replay")  # 10 ms for 3,000 tokens
    assert timed_call(graphs, encoder, fewer) == (None, "eager")  # still running when next read:
    assert [timed_call(graphs, encoder, large) for _ in range(2)] == [(large_shape, None)] * 2  # replays meanwhile
    graphs.clock.finish(eager_per_replay_token * 10.0 / 3000 * 2850)
    eager = eager_per_replay_token < 1 - margin
    assert [timed_call(graphs, encoder, large) for _ in range(3)] == [(None if eager else large_shape, None)] * 3
    hosted = (large_shape, "replay")  # hosted, and timed there (the next test)
    assert timed_call(graphs, encoder, small) == ((None, None) if eager else hosted)
    # a larger uncaptured shape: eager at once for good after an eager verdict (no capture, no timing), else
    # eager at its first use and captured at its second (`capture_at_use`)
    larger = zero_packed_batch([300] * 12, hidden)
    larger_shape = static_shape(3600, 12, 300)
    expected = [(None, None)] * 3 if eager else [(None, None), (larger_shape, None), (larger_shape, None)]
    assert [timed_call(graphs, encoder, larger) for _ in range(3)] == expected
    graphs.clear()
    assert not graphs._timings and not graphs._runs_eagerly and not graphs._eager_from
    assert graphs.take_timing_request() is None
    graphs.time_shapes = False
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = "graph"
    assert [timed_call(graphs, encoder, large) for _ in range(3)] == [(large_shape, None)] * 3
    assert graphs.clock.milliseconds == ([1.0, 5.0] if eager else [5.0])  # nothing more was timed


@pytest.mark.parametrize(
    ("eager_ms", "margin"),
    [(5.0, 0.0), (9.9, 0.0), (10.1, 0.0), (9.9, 0.03)],
    ids=["eager_faster", "eager_slightly_faster", "graph_kept", "graph_kept_in_a_margin"],
)
def test_a_batch_padded_into_a_larger_graph_is_timed_both_ways_and_runs_the_faster_way(eager_ms, margin):
    """A shape with no graph of its own, replayed padded in a larger captured one (`larger_graph_shape`), is timed too:
    that hosted replay, then one eager run, per token of its own batch. Graph kept: it stays hosted, its padding
    counted from the replays only (not the eager run), until that padding costs a capture of its own shape. Eager
    faster: it is no longer hosted but runs eagerly until its own shape is captured (`capture_at_use`), and that
    graph, without the host's padding, is timed afresh, not judged by the host's timing."""
    nv = make_nv_model(make_hf_model("wide_heads", seed=7)).eval()
    encoder, graphs, hidden = nv.esm.encoder, StaticShapeGraphs(), nv.config.hidden_size
    graphs.eager_margin = margin
    graphs.clock = FakeClock([10.0, eager_ms, 1.0])  # ms: the hosted replay and the eager run of the same 200 tokens
    large, small = zero_packed_batch([300] * 10, hidden), zero_packed_batch([1, 40, 40, 40, 79], hidden)
    large_shape, small_shape = static_shape(3000, 10, 300), static_shape(200, 5, 79)
    small_key = (*small_shape, *_graph_mode(encoder, small[0]))
    graphs._graphs[(*large_shape, *_graph_mode(encoder, large[0]))] = "graph"  # captured (the CPU captures none)
    assert timed_call(graphs, encoder, small) == (large_shape, "replay")
    assert timed_call(graphs, encoder, small) == (None, "eager")
    later = [timed_call(graphs, encoder, small)[0] for _ in range(5)]
    if (
        eager_ms < (1 - margin) * 10.0
    ):  # eager now; its 1st use eager, its 2nd asks for its own capture (`capture_at_use` 2)
        assert later == [None, None] + [small_shape] * 3 and not graphs._runs_eagerly
        graphs._graphs[small_key] = "graph"  # captured
        assert timed_call(graphs, encoder, small) == (small_shape, "replay")  # its own graph, timed afresh
    else:  # 2,816 padding tokens a replay; the 4th replay passes 4 x 3,072, so the 5th call captures its own shape
        assert later == [large_shape] * 3 + [small_shape] * 2 and graphs._runs_eagerly == {small_key: False}
        assert timed_call(graphs, encoder, large) == (large_shape, "replay")  # the host's own batches: timed apart


def test_replayable_finds_any_module_hook_and_drops_the_graphs_when_the_parameters_change():
    """`StaticShapeGraphs.replayable`, asked on every graphed call: any forward or backward hook on any module
    (the deepest one here) makes the call eager; the graphs are dropped when a parameter's storage or
    `requires_grad` changed (cast, replaced, frozen), and kept otherwise."""
    nv = make_nv_model(make_hf_model("wide_heads", seed=7)).eval()
    encoder, graphs = nv.esm.encoder, StaticShapeGraphs()
    assert graphs.replayable(encoder)
    graphs._graphs["shape"] = "graph"  # a captured graph, as `run` files it
    assert graphs.replayable(encoder) and graphs._graphs  # nothing changed: kept
    deepest = list(encoder.modules())[-1]
    for register in (
        deepest.register_forward_hook,
        deepest.register_forward_pre_hook,
        deepest.register_full_backward_hook,
        deepest.register_full_backward_pre_hook,
    ):
        handle = register(lambda *args: None)
        assert not graphs.replayable(encoder)
        handle.remove()
        assert graphs.replayable(encoder) and graphs._graphs
    layer = encoder.layers[-1]
    name, weight = next(layer.named_parameters())
    changes = {
        "frozen": lambda: weight.requires_grad_(False),
        "cast": lambda: encoder.to(torch.float64),
        "replaced": lambda: setattr(
            layer.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], torch.nn.Parameter(weight.detach())
        ),
    }
    for change, apply in changes.items():
        apply()
        assert graphs.replayable(encoder) and not graphs._graphs, change
        graphs._graphs["shape"] = "graph"


@pytest.mark.parametrize("process_setting", ["", "expandable_segments:True"])
def test_captures_use_expandable_segments_and_switch_back(monkeypatch, process_setting):
    """A capture switches the allocator to expandable segments and back, even when it fails; a process started
    with them keeps them (nothing is switched)."""
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", process_setting)
    with pytest.raises(RuntimeError, match="capture failed"), _expandable_segments():
        assert calls == ([] if process_setting else ["expandable_segments:True"])
        raise RuntimeError("capture failed")
    assert calls == ([] if process_setting else ["expandable_segments:True", "expandable_segments:False"])


@pytest.mark.parametrize("missing", [None, *ALLOCATOR_POOL_BINDINGS])
def test_warm_ups_are_routed_to_the_pool_only_where_torch_has_every_binding_it_needs(monkeypatch, missing):
    """Routing a warm-up into the graphs' pool needs three private allocator bindings (torch >= 2.8; torch 2.4-2.7
    name the second otherwise): where one is missing it runs beside the pool, as it did before, instead of failing
    half-way. It also needs the capture stream a first capture sets."""
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", object())
    for name in ALLOCATOR_POOL_BINDINGS:
        monkeypatch.setattr(torch._C, name, lambda *args: None, raising=False)
    if missing is not None:
        monkeypatch.delattr(torch._C, missing)
    assert WarmUpInPool((0, 1), routed=True).routed == (missing is None)
    assert not WarmUpInPool((0, 1), routed=False).routed
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    assert not WarmUpInPool((0, 1), routed=True).routed


def test_the_warm_up_hooks_are_passed_only_to_a_transformer_engine_that_takes_them():
    """TE < 2.14's `make_graphed_callables` has no `pre_warmup_hook` / `post_warmup_hook` (pyproject allows TE >=
    2.8): passing them would make every capture fail with a TypeError and run eagerly."""

    def te_2_13(modules, sample_args, num_warmup_iters=3, pool=None, enabled=None, recipe=None):
        return modules

    def te_2_14(modules, sample_args, num_warmup_iters=3, pool=None, pre_warmup_hook=None, post_warmup_hook=None):
        return modules

    def wrapper(*args, **kwargs):  # a wrapper (as tests patch it) passes them on
        return te_2_14(*args, **kwargs)

    warm_up = WarmUpInPool((0, 1), routed=False)
    assert warm_up_hooks(te_2_13, warm_up) == {}
    assert warm_up_hooks(wrapper, warm_up) == warm_up_hooks(te_2_14, warm_up)
    hooks = warm_up_hooks(te_2_14, warm_up)
    assert hooks == {"pre_warmup_hook": warm_up.begin, "post_warmup_hook": warm_up.end}
    te_2_13(None, None, **warm_up_hooks(te_2_13, warm_up))  # the call the model makes does not raise
