"""CUDA graphs over static packed shapes (`cuda_graphs=True`, TE backend) give what the eager TE path gives.

The graphs run each batch padded to a static shape (dummy proteins and empty slots), so they differ from eager
only by the GEMMs' tiling over another token count: fp32 logits within FP32_ATOL of eager (TE fp32 moves by
~2e-3 between token counts on an H100), bf16 within a few bf16 steps (BF16_ATOL), losses within 1e-2 relative,
gradients within 5e-2 relative. A misplaced token, a stale static buffer or parameter, or a wrong `cu_seq_lens`
moves logits by far more. Skipped without CUDA and Transformer Engine.
"""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import (
    GPU_MARKS,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    packed_on_gpu,
    pad_batch,
    random_lengths,
    random_proteins,
    relative_error,
)
from modeling_nv_esm_plan import plan_forward

pytestmark = GPU_MARKS

CUDA = "cuda"
FP32_ATOL = 1e-2
BF16_ATOL = 0.1
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2  # relative L2 error of each gradient, graphs vs eager, both bf16 autocast
OVERLAP_RTOL = 1e-2  # averaged gradients of two replays of one batch (check_overlapped_average)


@pytest.fixture(scope="module")
def hf_fp32():
    return make_hf_model("esm2_8M", seed=200)


def te_pair(hf, dtype=torch.float32, **overrides):
    """Eager and graphed TE models with the same weights."""
    eager = make_nv_model(hf, backend="te", cuda_graphs=False, **overrides).to(CUDA, dtype)
    graphed = make_nv_model(hf, backend="te", cuda_graphs=True, **overrides).to(CUDA, dtype)
    return eager, graphed


def batches(seed: int, count: int, proteins: int = 6, longest: int = 300) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        random_proteins(random_lengths(generator, proteins, longest), seed=seed + i, mask_fraction=0.15)
        for i in range(count)
    ]


def test_inference_graphs_match_eager_and_outputs_are_not_overwritten(hf_fp32):
    """Several batches, some in one static shape: each output equals eager, and earlier outputs stay intact when
    the same graph replays again (the graph's output buffer is copied out)."""
    eager, graphed = te_pair(hf_fp32, torch.float32)
    eager.eval(), graphed.eval()
    outputs, expected = [], []
    with torch.no_grad():
        for proteins in batches(201, 5) + batches(201, 2):  # the last two repeat shapes already captured
            outputs.append(graphed(**packed_on_gpu(proteins)).logits)
            expected.append(eager(**packed_on_gpu(proteins)).logits)
            input_ids, attention_mask = pad_batch(proteins)
            padded = graphed(input_ids.to(CUDA), attention_mask=attention_mask.to(CUDA)).logits
            keep = attention_mask.bool().to(CUDA)
            assert max_abs_diff(padded[keep], expected[-1][0]) <= FP32_ATOL
    shapes = len(graphed.esm.encoder.graphs._graphs)
    assert 1 <= shapes < len(outputs)
    errors = [max_abs_diff(a, b) for a, b in zip(outputs, expected)]
    print(f"\n[graphs inference] {shapes} shapes captured, max |logit diff| vs eager per batch {errors}")
    assert max(errors) <= FP32_ATOL


@pytest.mark.parametrize("layer_precision", [None, "fp8_delayed", "fp8_current", "fp8_block", "fp8_inner"])
def test_training_with_graphs_follows_eager(hf_fp32, layer_precision):
    """Three optimizer steps of two micro-batches each under bf16 autocast (fp32 weights): losses and gradients of
    the graphed model follow the eager one (FP8: same recipe both sides)."""
    layers = hf_fp32.config.num_hidden_layers
    options = {}
    if layer_precision is not None:
        recipe = layer_precision.split("_")[1]
        precision = ["fp8"] * layers if recipe != "inner" else [None] + ["fp8"] * (layers - 2) + [None]
        options = dict(layer_precision=precision, fp8_recipe="delayed" if recipe == "inner" else recipe)
    eager, graphed = te_pair(hf_fp32, **options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    steps = batches(202, 6)
    worst_loss = worst_grad = 0.0
    for index in range(0, len(steps), 2):
        losses = []
        for model in (eager, graphed):
            model.train()
            total = 0.0
            for proteins in steps[index : index + 2]:
                batch = packed_on_gpu(proteins)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch, labels=batch["input_ids"]).loss
                loss.backward()
                total += loss.item()
            losses.append(total)
        for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            if a.grad is not None and a.grad.norm() > 0:
                worst_grad = max(worst_grad, relative_error(b.grad, a.grad))
                assert relative_error(b.grad, a.grad) <= GRAD_RTOL, (index, name)
        worst_loss = max(worst_loss, abs(losses[1] - losses[0]) / losses[0])
        assert abs(losses[1] - losses[0]) <= LOSS_RTOL * losses[0], index
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    shapes = len(graphed.esm.encoder.graphs._graphs)
    print(
        f"\n[graphs training {layer_precision}] {shapes} shapes, worst relative difference: loss {worst_loss:.2e}, "
        f"gradient {worst_grad:.2e}"
    )
    assert shapes >= 1


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_an_inference_shape_is_captured_at_its_second_batch(hf_fp32, monkeypatch, training):
    """The default `capture_at_use` (2): an inference shape's first batch runs eagerly (no capture), its second is
    captured and replayed, the third replays; a training shape is captured at its first batch. Outputs (and,
    training, gradients) follow the eager model at each."""
    from modeling_nv_esm_graphs import StaticShapeGraphs

    monkeypatch.setattr(StaticShapeGraphs, "capture_at_use", 2)
    eager, graphed = te_pair(hf_fp32)
    graphs = graphed.esm.encoder.graphs
    batch = packed_on_gpu(batches(210, 1)[0])
    captured = []
    for model in (eager, graphed):
        model.train(training)
    for _ in range(3):
        outputs = []
        for model in (eager, graphed):
            with torch.set_grad_enabled(training), torch.autocast("cuda", dtype=torch.bfloat16, enabled=training):
                output = model(**batch, labels=batch["input_ids"])
            if training:
                output.loss.backward()
            outputs.append(output)
        captured.append(len(graphs._graphs))
        assert max_abs_diff(outputs[1].logits.float(), outputs[0].logits.float()) <= (
            BF16_ATOL if training else FP32_ATOL
        )
    assert captured == ([1, 1, 1] if training else [0, 1, 1]) and None not in graphs._graphs.values()
    if training:
        for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            if a.grad is not None and a.grad.norm() > 0:
                assert relative_error(b.grad, a.grad) <= GRAD_RTOL, name


def test_the_shape_clock_takes_the_hosts_time_where_it_is_the_longer():
    """A timed span costs what a pipelined loop pays: the host's time to issue it when that is longer (a sleep on
    the host, nothing on the GPU), else the GPU's (a GPU spin issued at once)."""
    import time

    from modeling_nv_esm_graphs import CudaEventClock

    clock = CudaEventClock()
    started = clock.start()
    time.sleep(0.05)
    host_bound = clock.stop(started)
    started = clock.start()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles, issued in microseconds
    gpu_bound = clock.stop(started)
    torch.cuda.synchronize()
    assert 50 <= clock.elapsed_ms(host_bound) < 1000
    gpu_ms = gpu_bound[0].elapsed_time(gpu_bound[1])
    assert gpu_ms > 20 and clock.elapsed_ms(gpu_bound) == gpu_ms


@pytest.mark.parametrize("eager_ratio", [0.5, 2.0], ids=["eager_faster", "graph_faster"])
def test_a_captured_inference_shape_keeps_the_way_it_ran_faster(hf_fp32, monkeypatch, eager_ratio):
    """Shape timing on (the default; the other GPU tests switch it off): a captured inference shape's next replay
    and then one eager run of it are timed with CUDA events, and once both are done the shape replays or runs
    eagerly for good, whichever took less time per token (the eager run is reported here as `eager_ratio` times the
    replay's measured time, so that one way is clearly faster). Logits follow the eager model at every call."""
    from modeling_nv_esm_graphs import CudaEventClock, StaticShapeGraphs

    class RatioClock(CudaEventClock):
        def __init__(self) -> None:
            self.spans = []

        def stop(self, started):
            span = super().stop(started)
            self.spans.append(span)
            return span

        def elapsed_ms(self, span):
            replay = super().elapsed_ms(self.spans[0])  # the 1st span: the replay; the 2nd: the eager run
            return None if replay is None else replay * (1.0 if span is self.spans[0] else eager_ratio)

    monkeypatch.setattr(StaticShapeGraphs, "time_shapes", True)
    eager, graphed = te_pair(hf_fp32)
    graphs = graphed.esm.encoder.graphs
    graphs.clock = RatioClock()
    replayed, run = [], graphs.run
    monkeypatch.setattr(graphs, "run", lambda *args: replayed.append(len(replayed)) or run(*args))
    batch = packed_on_gpu(batches(213, 1)[0])
    for call in range(6):  # capture, timed replay, timed eager run, then the choice at each later call
        with torch.no_grad():
            logits = [model(**batch).logits for model in (eager, graphed)]
        assert max_abs_diff(logits[1], logits[0]) <= FP32_ATOL, call
        torch.cuda.synchronize()  # the spans are done before the next call reads them
    [key] = graphs._graphs
    assert len(graphs.clock.spans) == 2 and graphs._runs_eagerly == {key: eager_ratio < 1}
    assert len(replayed) == (2 if eager_ratio < 1 else 5)  # calls 0 and 1; or all but the eager run (call 2)


def test_smaller_inference_batches_replay_a_captured_graph_that_holds_them(hf_fp32, monkeypatch):
    """The default policy (`capture_at_use` 2): once a large batch's shape is captured, a smaller batch of another
    shape replays that graph, padded (no capture, no eager run), until its padding passes `padding_before_capture`
    replays; then its own shape is captured. Logits follow the eager model at each call."""
    from modeling_nv_esm_graphs import StaticShapeGraphs

    monkeypatch.setattr(StaticShapeGraphs, "capture_at_use", 2)
    monkeypatch.setattr(StaticShapeGraphs, "time_shapes", False)  # hosted batches are timed too: not here
    eager, graphed = te_pair(hf_fp32)
    graphs = graphed.esm.encoder.graphs
    large = packed_on_gpu(random_proteins([300] * 6 + [150] * 4, seed=211, mask_fraction=0.15))
    small = packed_on_gpu(random_proteins([1, 40, 60], seed=212, mask_fraction=0.15))
    captured = []
    for batch in [large, large] + [small] * 6:
        with torch.no_grad():
            logits = [model(**batch).logits for model in (eager, graphed)]
        assert max_abs_diff(logits[1], logits[0]) <= FP32_ATOL
        captured.append(len(graphs._graphs))
    # Shapes (2560 tokens, 32 slots, 512) and (256, 16, 64): 2304 padding tokens per small batch, 4 x 2560 allowed,
    # so 4 small batches replay the large graph and the 5th captures its own.
    assert captured == [0, 1, 1, 1, 1, 1, 2, 2] and None not in graphs._graphs.values(), captured


def test_a_second_forward_before_backward_is_refused(hf_fp32):
    """Two training forwards before one backward: the graphs' shared memory holds what the first backward reads, so
    the second forward raises (running it eagerly gave NaN gradients on an H100). After the backward, replays go
    on."""
    graphed = make_nv_model(hf_fp32, backend="te", cuda_graphs=True).to(CUDA).train()
    first, second = (packed_on_gpu(p) for p in batches(203, 2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = graphed(**first, labels=first["input_ids"]).loss
        assert graphed.esm.encoder.graphs.awaiting_backward()
        with pytest.raises(RuntimeError, match="backward has not run yet"):
            graphed(**second, labels=second["input_ids"])
        loss.backward()
        assert not graphed.esm.encoder.graphs.awaiting_backward()
        graphed(**second, labels=second["input_ids"]).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in graphed.parameters() if p.grad is not None)


def test_casting_the_model_recaptures(hf_fp32):
    """Graphs read the parameters' storage: after `.to(dtype)` they are captured again (into a new memory pool: the
    old one, its graphs freed, made the capture fail and broke the CUDA generator for the rest of the process),
    not replayed stale."""
    eager, graphed = te_pair(hf_fp32)
    graphed.eval(), eager.eval()
    batch = packed_on_gpu(batches(204, 1)[0])
    with torch.no_grad():
        graphed(**batch)
        graphed.to(torch.bfloat16)
        eager.to(torch.bfloat16)
        assert max_abs_diff(graphed(**batch).logits, eager(**batch).logits) <= BF16_ATOL
    captured = graphed.esm.encoder.graphs._graphs
    assert len(captured) == 1 and None not in captured.values()  # captured anew, not run eagerly
    torch.randn(8, device=CUDA)  # the CUDA generator still works


def test_graphed_and_eager_micro_batches_accumulate_into_one_gradient(hf_fp32):
    """A step of three micro-batches: graphed, eager (`output_hidden_states` runs eagerly), graphed in another shape.
    The summed gradients equal the eager model's (training graphs accumulate weight gradients into `main_grad`,
    which becomes `.grad`; the eager micro-batch adds to the same tensor)."""
    eager, graphed = te_pair(hf_fp32)
    micro_batches = batches(205, 3, longest=200) + batches(206, 1, proteins=12, longest=400)
    for model in (eager, graphed):
        model.train()
        for index, proteins in enumerate(micro_batches):
            batch = packed_on_gpu(proteins)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(**batch, labels=batch["input_ids"], output_hidden_states=index == 1).loss.backward()
    assert len(graphed.esm.encoder.graphs._graphs) >= 2
    for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
        if a.grad is not None and a.grad.norm() > 0:
            assert relative_error(b.grad, a.grad) <= GRAD_RTOL, name


def test_training_shapes_share_one_weight_gradient_buffer(hf_fp32):
    """Capturing more training shapes does not add a copy of the weight gradients per shape (it did before
    `main_grad`): after the first (largest) shape, whose pool memory the smaller ones reuse, memory allocated grows
    by less than half the weights' bytes per shape (a shape's own static buffers are ~1% of that here)."""
    graphed = make_nv_model(hf_fp32, backend="te", cuda_graphs=True).to(CUDA).train()
    weight_bytes = sum(p.numel() * p.element_size() for p in graphed.esm.encoder.layers.parameters())
    allocated = []
    for lengths in ([500, 480, 450], [250, 240, 200], [60, 50, 40]):  # 1536 / 768 / 256 tokens, max_length 512-64
        batch = packed_on_gpu(random_proteins(lengths, seed=207, mask_fraction=0.15))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            graphed(**batch, labels=batch["input_ids"]).loss.backward()
        graphed.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    growth = [b - a for a, b in zip(allocated, allocated[1:])]
    print(f"\n[graphs memory] weights {weight_bytes / 1e6:.1f} MB, growth per new shape {[g / 1e6 for g in growth]} MB")
    assert len(graphed.esm.encoder.graphs._graphs) == 3
    assert max(growth) < weight_bytes / 2


def test_a_capture_out_of_memory_frees_the_graphs_and_runs_eagerly(hf_fp32, monkeypatch):
    """A capture that runs out of GPU memory (simulated at the second shape) drops every graph and the shared
    weight-gradient buffers, and the model goes on eagerly (no capture tried again): the step's gradients, summed
    over a graphed and an eager micro-batch, equal the eager model's."""
    import transformer_engine.pytorch as te

    eager, graphed = te_pair(hf_fp32)
    first, second, third = (packed_on_gpu(p) for p in batches(208, 2, longest=200) + batches(209, 1, longest=400))
    calls = []
    real_capture = te.make_graphed_callables

    def capture_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(te, "make_graphed_callables", capture_once)
    graphs = graphed.esm.encoder.graphs
    for model in (eager, graphed):
        model.train()
        for batch in (first, third):  # third: another shape, whose capture fails
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(**batch, labels=batch["input_ids"]).loss.backward()
    assert len(calls) == 2 and graphs._out_of_memory and not graphs._graphs
    assert not [p for p in graphed.parameters() if hasattr(p, "main_grad")]
    for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
        if a.grad is not None and a.grad.norm() > 0:
            assert relative_error(b.grad, a.grad) <= GRAD_RTOL, name
    graphed.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed(**second, labels=second["input_ids"]).loss.backward()
    assert len(calls) == 2  # eager from now on
    graphs.clear()
    assert not graphs._out_of_memory


def test_graphs_stay_off_where_a_replay_would_be_wrong(hf_fp32, monkeypatch):
    """Training under a process group of several ranks (DDP waits for each weight's gradient) unless the caller
    averages `.grad` itself after the backward (`reduce_gradients_after_backward`), inside `runs_eagerly` (a
    validation pass), inside another capture, and in an `nn.DataParallel` replica: eager."""
    graphed = make_nv_model(hf_fp32, backend="te", cuda_graphs=True).to(CUDA).train()
    encoder = graphed.esm.encoder
    assert plan_forward(encoder).graphed
    monkeypatch.setattr("modeling_nv_esm_plan.several_ranks", lambda: True)
    assert not plan_forward(encoder).graphed
    graphed.reduce_gradients_after_backward()
    assert plan_forward(encoder).graphed
    graphed.reduce_gradients_after_backward(False)
    with graphed.runs_eagerly():
        graphed.reduce_gradients_after_backward()
        assert not plan_forward(encoder).graphed  # validation between training steps
    assert plan_forward(encoder).graphed
    graphed.reduce_gradients_after_backward(False)
    graphed.eval()
    with torch.no_grad():
        assert plan_forward(encoder).graphed  # inference graphs do not involve the ranks
        encoder._is_replica = True
        assert not plan_forward(encoder).graphed


def train_side_by_side(eager, graphed, lengths_per_step: list[list[int]], seed: int) -> None:
    """One SGD step per batch for both models (bf16 autocast); losses and gradients of the graphed model follow
    the eager one at every step."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    for index, lengths in enumerate(lengths_per_step):
        batch = packed_on_gpu(random_proteins(lengths, seed=seed + index, mask_fraction=0.15))
        losses = []
        for model in (eager, graphed):
            model.train()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch, labels=batch["input_ids"]).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[1] - losses[0]) <= LOSS_RTOL * losses[0], index
        for (name, a), (_, b) in zip(eager.named_parameters(), graphed.named_parameters()):
            if a.grad is not None and a.grad.norm() > 0:
                assert relative_error(b.grad, a.grad) <= GRAD_RTOL, (index, name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


LARGE, MEDIUM, SMALL = [500, 480, 450], [250, 240, 200], [60, 50, 40]  # 1536 / 768 / 256 tokens: three shapes


def captured_graphs(model) -> list:
    """The model's graphs, checking that each capture succeeded (a failed one is kept as None and runs eagerly)."""
    graphs = list(model.esm.encoder.graphs._graphs.values())
    assert all(graph is not None for graph in graphs)
    return graphs


def test_captures_after_the_first_warm_up_in_the_graphs_pool_and_earlier_graphs_replay_unharmed(hf_fp32, monkeypatch):
    """From the second capture on, TE's warm-up runs in the graphs' pool (`WarmUpInPool`), reusing blocks the
    earlier graphs use while they replay: replaying those graphs afterwards (new batches of the first two shapes)
    still follows eager, step by step."""
    from modeling_nv_esm_graphs import WarmUpInPool

    routed = []
    real_end = WarmUpInPool.end

    def end(self):
        real_end(self)
        routed.append((self.routed, self.left_in_pool))

    monkeypatch.setattr(WarmUpInPool, "end", end)
    eager, graphed = te_pair(hf_fp32)
    train_side_by_side(eager, graphed, [LARGE, MEDIUM, SMALL, LARGE, MEDIUM], seed=220)
    assert routed == [(False, 0), (True, 0), (True, 0)]  # three captures, the last two steps replays
    assert len(captured_graphs(graphed)) == 3


def test_a_new_shape_warms_up_without_memory_beside_the_graphs_pool(hf_fp32, monkeypatch):
    """The warm-up before a second training shape's capture reserves at most half the memory it reserves beside
    the pool (what let 3B's second shape run out of memory on an 80 GB H100): measured from its start to its end."""
    from modeling_nv_esm_graphs import WarmUpInPool

    real_init, real_begin, real_end = WarmUpInPool.__init__, WarmUpInPool.begin, WarmUpInPool.end
    growth = []

    def begin(self):
        real_begin(self)
        torch.cuda.synchronize()
        self.reserved_at_begin = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()

    def end(self):
        torch.cuda.synchronize()
        growth.append(torch.cuda.max_memory_reserved() - self.reserved_at_begin)
        real_end(self)

    monkeypatch.setattr(WarmUpInPool, "begin", begin)
    monkeypatch.setattr(WarmUpInPool, "end", end)
    for routed in (True, False):
        if not routed:
            monkeypatch.setattr(WarmUpInPool, "__init__", lambda self, pool, routed: real_init(self, pool, False))
        graphed = make_nv_model(hf_fp32, backend="te", cuda_graphs=True).to(CUDA).train()
        for index, lengths in enumerate((LARGE, MEDIUM)):
            batch = packed_on_gpu(random_proteins(lengths, seed=230 + index, mask_fraction=0.15))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                graphed(**batch, labels=batch["input_ids"]).loss.backward()
            graphed.zero_grad(set_to_none=True)
        assert len(captured_graphs(graphed)) == 2
        del graphed, batch
        gc.collect()
        torch.cuda.empty_cache()
    in_pool, beside = growth[1], growth[3]  # the second capture's warm-up of each model
    print(
        f"\n[graphs warm-up] reserved growth of the second warm-up, MB: in the pool {in_pool / 1e6:.1f}, beside "
        f"{beside / 1e6:.1f}"
    )
    assert beside > 0
    assert in_pool <= beside / 2


def test_a_warm_up_tensor_left_in_the_pool_is_found():
    """`WarmUpInPool` routes the capture stream's allocations to the pool between `begin` and `end`: a warm-up
    tensor takes the block an earlier graph uses only while it replays (so a replay would overwrite it, as shown),
    and `end` counts it in `left_in_pool` while it is alive; a freed one is not counted."""
    from modeling_nv_esm_graphs import WarmUpInPool

    pool = torch.cuda.graph_pool_handle()
    static = torch.ones(1 << 20, device=CUDA)  # 4 MiB
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):  # a graph in the pool, and the capture stream set
        doubled = static * 2  # a temporary of the graph: its block is free once captured, written by each replay
        output = doubled + 1
    temporary = doubled.data_ptr()
    del doubled
    for keep in (False, True):
        warm_up = WarmUpInPool(pool, routed=True)
        assert warm_up.routed
        with torch.cuda.stream(torch.cuda.Stream()):
            warm_up.begin()
            tensor = torch.full((1 << 20,), 7.0, device=CUDA)
            assert tensor.data_ptr() == temporary  # the graph's temporary block, from the pool
            if not keep:
                del tensor
            warm_up.end()
        assert warm_up.left_in_pool == (4 << 20 if keep else 0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(output, torch.full_like(output, 3.0))
    assert torch.equal(tensor, torch.full_like(tensor, 2.0))  # the replay overwrote the kept warm-up tensor


def test_a_warm_up_that_left_tensors_in_the_pool_drops_the_graphs_and_captures_anew(hf_fp32, monkeypatch):
    """Where a routed warm-up left tensors in the pool (simulated), the earlier graphs are dropped, the shape is
    captured into a new pool and later warm-ups run beside it; training goes on following eager."""
    from modeling_nv_esm_graphs import WarmUpInPool

    real_end = WarmUpInPool.end
    routed = []

    def end(self):
        real_end(self)
        routed.append(self.routed)
        if self.routed:
            self.left_in_pool = 1 << 20  # simulated

    monkeypatch.setattr(WarmUpInPool, "end", end)
    eager, graphed = te_pair(hf_fp32)
    train_side_by_side(eager, graphed, [LARGE, MEDIUM], seed=240)
    assert routed == [False, True, False]  # the second shape captured again, beside a new pool
    assert len(captured_graphs(graphed)) == 1  # only the second shape's
    train_side_by_side(eager, graphed, [MEDIUM, LARGE], seed=250)  # replays the second shape, captures the first
    assert routed == [False, True, False, False]
    assert len(captured_graphs(graphed)) == 2


def test_a_routed_warm_up_that_fails_drops_the_graphs(hf_fp32, monkeypatch):
    """A capture whose routed warm-up raised (simulated) drops the earlier graphs (what the failed warm-up still
    holds in their pool, their replays would overwrite) and runs that shape eagerly; training follows eager."""
    from modeling_nv_esm_graphs import WarmUpInPool

    real_begin = WarmUpInPool.begin

    def begin(self):
        real_begin(self)
        if self.routed:
            raise RuntimeError("simulated warm-up failure")

    monkeypatch.setattr(WarmUpInPool, "begin", begin)
    eager, graphed = te_pair(hf_fp32)
    train_side_by_side(eager, graphed, [LARGE, MEDIUM], seed=260)
    graphs = graphed.esm.encoder.graphs._graphs
    assert list(graphs.values()) == [None]  # the first shape's graph dropped, the second runs eagerly
    train_side_by_side(eager, graphed, [LARGE], seed=270)  # captured again, first in a new pool
    assert sum(graph is not None for graph in graphs.values()) == 1


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="whole models on 2 ranks: NCCL, one GPU per rank")
def test_two_ranks_holding_whole_models_replay_training_graphs_with_eager_losses(tmp_path):
    """`nv-esm train --data-parallel replicate` on 2 GPUs (NCCL): the ranks capture and replay training graphs
    (`reduce_gradients_after_backward`) and their losses follow the eager run's on the same data (bf16: each step
    within `LOSS_RTOL`, the first steps alike in both, so a gradient left out of the all-reduce shows)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT, SHAPES

    config = tmp_path / "config.json"  # ESM-2 8M's shape, random weights
    config.write_text(json.dumps({**json.loads((ROOT / "config.json").read_text()), **SHAPES["esm2_8M"]}))
    # recipes/train.py with the graphs module's INFO records shown (its logger is not under "transformers")
    recipe = tmp_path / "train_logging_captures.py"
    recipe.write_text(
        "import logging, runpy, sys\n"
        "logging.basicConfig()\n"
        "logging.getLogger('modeling_nv_esm_graphs').setLevel(logging.INFO)\n"
        f"sys.argv[0] = {str(ROOT / 'recipes' / 'train.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )

    def train(name: str, *extra: str) -> tuple[list[float], str]:
        out = tmp_path / name
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
        command += [str(recipe), "--config", str(config), "--out", str(out)]
        command += ["--data", str(ROOT / "recipes" / "demo_data" / "demo.fasta"), "--steps", "8", "--lr", "1e-3"]
        command += ["--tokens-per-batch", "2048", "--max-length", "254", "--data-parallel", "replicate", "--no-export"]
        command += ["--no-checkpoint", "--log-every", "1", *extra]
        result = subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [record["loss"] for record in records if "loss" in record], result.stdout + result.stderr

    graphed, graphed_log = train("graphed")
    eager, eager_log = train("eager", "--no-cuda-graphs")
    assert "Captured CUDA graphs for" in graphed_log and "Captured CUDA graphs" not in eager_log
    assert len(graphed) == len(eager) == 8
    for step, (a, b) in enumerate(zip(eager, graphed)):
        assert abs(a - b) <= LOSS_RTOL * a, (step, a, b)


def check_overlapped_average(rank: int, port: int, results: dict) -> None:
    """Rank `rank` of 2 (NCCL): the gradients `average_gradients` reduces while a replayed backward still runs
    equal those reduced after it, though the GPU sleeps before that backward: within `OVERLAP_RTOL`, as two
    replays of the same batch differ (cuDNN's attention backward accumulates with atomics: 6.5e-4 on an H100). A
    reduction that did not wait for the graph's events would read the zeroed buffers and leave each rank its own
    gradient, half the other rank's batch away (relative errors of order 1)."""
    import os

    import torch.distributed as dist
    from test_tensor_parallel import leave_without_teardown

    from nv_esm.train import parallel
    from nv_esm.train.parallel import all_reduce_gradients, average_gradients

    parallel.GRADIENT_BUCKET_BYTES = 8 << 20  # ~2 of the 8M shape's 6 layers a bucket: 3 buckets, 3 events waited on

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    try:
        import transformer_engine.pytorch  # noqa: F401  (before cuDNN loads)

        model = make_nv_model(make_hf_model("esm2_8M", seed=200), backend="te", cuda_graphs=True)
        model.reduce_gradients_after_backward()
        model = model.to(CUDA).train()
        batch = packed_on_gpu(batches(seed=300 + rank, count=1)[0])  # each rank its own proteins
        averaged = []
        for overlapped in (False, True, True):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch, labels=batch["input_ids"]).loss
            torch.cuda._sleep(1 << 30)  # about half a second of GPU time before the backward starts
            loss.backward()
            if overlapped:
                graphs = model.esm.encoder.graphs
                layers = graphs.replayed_layer_gradients(graphs.layer_weights(model.esm.encoder))
                assert layers is not None and len(layers) == model.config.num_hidden_layers
                average_gradients(model, 2)
            else:
                all_reduce_gradients([p for p in model.parameters() if p.grad is not None], 2)
            averaged.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        results[rank] = max(
            relative_error(grads[name], averaged[0][name]) for grads in averaged[1:] for name in averaged[0]
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_without_teardown()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 ranks over NCCL: one GPU per rank")
def test_gradients_averaged_during_a_replayed_backward_equal_those_averaged_after_it() -> None:
    import torch.multiprocessing as mp
    from test_tensor_parallel import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(check_overlapped_average, args=(free_port(), results), nprocs=2)
        results = dict(results)
    print(f"\n[overlapped gradient average, 2 ranks] largest relative difference {results}")
    assert len(results) == 2 and all(error <= OVERLAP_RTOL for error in results.values())
