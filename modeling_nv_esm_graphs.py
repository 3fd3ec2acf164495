"""CUDA graphs of the encoder layers: the static-shape buckets (`static_shape`), capture and replay
(`StaticShapeGraphs`), and the `main_grad` buffers training replays accumulate into.

Part of the model's Hub remote code: imports the batch, parallel and layers siblings below it.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

try:
    from .modeling_nv_esm_batch import PackedSequences
    from .modeling_nv_esm_layers import import_transformer_engine
    from .modeling_nv_esm_layout import PackedRun, dummy_proteins
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from modeling_nv_esm_batch import PackedSequences
    from modeling_nv_esm_layers import import_transformer_engine
    from modeling_nv_esm_layout import PackedRun, dummy_proteins

logger = logging.get_logger(__name__)


def static_shape(num_tokens: int, num_sequences: int, max_length: int) -> tuple[int, int, int]:
    """The bucket a packed batch runs in under CUDA graphs: `(tokens, sequence slots, max_length)`.

    Tokens round up in steps of 1/8 of the power of two below them, and of 256 below 4096 tokens (padding under
    1/8 of the tokens or under 256; multiples of 256, so also of `FP8_TOKEN_MULTIPLE`). `max_length` rounds up to
    a power of two (at least 64) up to 512, to 1026 above (ESM-2's longest protein: 1024 residues, <cls> and
    <eos>) and to a multiple of 512 past 1026. The slots (proteins, dummy proteins of at most `max_length` tokens
    holding the padding, then empty ones) round up to a power of two, at least 16 and at least the number of
    proteins a quarter of `max_length` long that fill the tokens: full batches of length-sorted proteins under one
    token budget (`nv-esm embed`) then share one shape per `max_length` bucket (empty slots cost the attention
    kernels next to nothing), and a run of similar batches uses a few.
    """
    step = max(256, 1 << max(num_tokens.bit_length() - 4, 0))
    tokens = -(-num_tokens // step) * step
    if max_length <= 512:
        length = max(64, 1 << (max_length - 1).bit_length())
    else:
        length = 1026 if max_length <= 1026 else -(-max_length // 512) * 512
    dummies = dummy_proteins(tokens - num_tokens, length)
    slots = max(16, 1 << (max(num_sequences + dummies, tokens // (length // 4)) - 1).bit_length())
    return tokens, slots, length


class FreshWhenCopied:
    """Runtime state of one model object (captured CUDA graphs, an offload context holding a CUDA stream) that
    `copy.deepcopy` and pickling give as new, empty state: a copied or loaded model builds its own."""

    def __deepcopy__(self, memo: dict) -> FreshWhenCopied:
        return type(self)()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class StaticShapeLayers(nn.Module):
    """What one CUDA graph holds: `body` (the encoder's, handed down: layers and final LayerNorm) for one static
    packed shape, on the parameters of `owner` (not its submodule: `training` is set directly, as `.train()` would
    also switch the owner's layers)."""

    def __init__(
        self, body: Callable, owner: nn.Module, max_length: int, precision: Any, backward_events: list | None = None
    ) -> None:
        """`body(states, run, precision, backward_events=...)`; `precision`: the `ForwardPrecision` the graph is
        captured with; `backward_events`: per layer, a CUDA event its backward records once done (training graphs)."""
        super().__init__()
        self.body = body
        self.owner = owner
        self.max_length = max_length
        self.precision = precision
        self.backward_events = backward_events

    def forward(
        self, hidden_states: torch.Tensor, cu_seq_lens: torch.Tensor, rotary_angles: torch.Tensor
    ) -> torch.Tensor:
        """`[T, hidden]` packed states with `cu_seq_lens [slots + 1]` and `rotary_angles [max_length, head_dim]`."""
        num_tokens = hidden_states.shape[0]
        packed = PackedSequences.right_padded(cu_seq_lens, self.max_length, num_tokens)
        run = PackedRun(packed, rotary_angles, num_tokens)
        return self.body(hidden_states, run, self.precision, backward_events=self.backward_events)


def larger_graph_shape(
    captured: Iterable[tuple[int, int, int]], num_tokens: int, num_sequences: int, max_length: int
) -> tuple[int, int, int] | None:
    """The smallest of the `captured` static shapes `(tokens, slots, max_length)` that holds a packed batch of
    `num_tokens` tokens in `num_sequences` proteins of at most `max_length` tokens (its padding in dummy proteins of
    the shape's `max_length`, as `pad_packed` lays it out), by tokens, then slots x max_length; None if none does."""
    fitting = [
        (tokens, slots, length)
        for tokens, slots, length in captured
        if tokens >= num_tokens
        and length >= max_length
        and slots >= num_sequences + dummy_proteins(tokens - num_tokens, length)
    ]
    return min(fitting, key=lambda shape: (shape[0], shape[1] * shape[2]), default=None)


def _graph_mode(encoder: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """What besides the shape tells the graphs apart: train mode, gradients, dtype, autocast, inference mode."""
    return (
        encoder.training,
        hidden_states.requires_grad,
        hidden_states.dtype,
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
        torch.is_inference_mode_enabled(),
    )


class CudaEventClock:
    """Times work as a pipelined loop pays for it: the longer of the GPU's time (CUDA events on the current stream,
    read without waiting: None until done) and the host's time to issue it (which the events need not show)."""

    def start(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event, time.perf_counter()

    def stop(self, started: Any) -> Any:
        stopped, host_stopped = self.start()
        return started[0], stopped, (host_stopped - started[1]) * 1e3

    def elapsed_ms(self, span: Any) -> float | None:
        started, stopped, host_ms = span
        return max(started.elapsed_time(stopped), host_ms) if stopped.query() else None


class TimingRequest:
    """What `StaticShapeGraphs.shape_for` asks the call it planned to time: its `kind` ("replay" of the captured
    graph of `key`, or "eager", the same shape run eagerly) for a batch of `tokens` real tokens."""

    def __init__(self, key: tuple, kind: str, tokens: int) -> None:
        self.key, self.kind, self.tokens = key, kind, tokens


class StaticShapeGraphs(FreshWhenCopied):
    """CUDA graphs of the encoder, one per static shape and mode, captured into one memory pool. A training shape is
    captured at first use (so that a resumed run replays where the run it continues did). An inference batch whose
    shape is not captured runs padded in the smallest captured graph that holds it (`larger_graph_shape`), which
    usually costs less than an eager run (timed, below), until the padding it has added there comes to
    `padding_before_capture` replays of that graph (about what a capture costs): then its own shape is captured.
    Padding is counted in tokens, so a shape held by a graph of as many tokens (more slots or a longer `max_length`,
    which cost the attention kernels next to nothing) stays there. With no graph to hold it, its shape is captured
    the `capture_at_use`-th time it is met and runs eagerly before. A shape met once, such as the last, partly
    filled batch of each `nv-esm embed` shard, so never pays a capture.

    A replay's memory (its saved activations included) is shared with the other graphs, so between the forward
    replay of a training graph and its backward no other forward may run (`plan_forward` refuses it). The
    output is copied out
    of the graph's static buffer, which the next replay overwrites. Parameters must keep their storage (in-place
    optimizer steps and `load_state_dict` do); when any parameter's storage or `requires_grad` changes, the graphs
    are captured anew. Gradient hooks on parameters also see TE's warm-up gradients while a shape is captured.
    From the second capture on, TE's eager warm-up before a training capture runs in the pool's memory
    (`WarmUpInPool`), not beside it. A capture that runs out of GPU memory frees every graph, their memory pool and
    the shared weight-gradient buffers, and the model runs eagerly from then on (until `clear()`), with a warning.

    An inference shape that replays (in its own graph, or padded in a larger one that hosts it) is timed once each
    way (`CudaEventClock`: the GPU's time or the host's, whichever is longer): its first replay, then one batch of it
    run eagerly. When the eager run took less time per token of the batch, by more than the fraction `eager_margin`
    (0: any less), the GPU was busy enough that the graph saved no launch time and its padding cost more: the shape
    runs eagerly from then on (and, if captured, hosts no other batch), so graphs stay on only where they are
    faster. A shape found faster eagerly in its own graph also sends every uncaptured shape of as many tokens or
    more (same mode) to eager runs, with no capture or timing: a larger batch keeps the GPU busier still.
    """

    capture_at_use = 2  # inference; the tests capture at first use (1), so each graphed call they check replays
    padding_before_capture = 4  # graph replays' worth of tokens
    time_shapes = True  # time captured inference shapes both ways (the GPU tests switch it off, but where they test it)
    eager_margin = 0.0  # how much faster per token an eager run of a captured shape must be for it to stay eager
    clock: Any = CudaEventClock()

    def __init__(self) -> None:
        self._graphs: dict[tuple, nn.Module | None] = {}
        self._uses: dict[tuple, int] = {}  # eager runs of each shape not captured yet
        self._padding: dict[tuple, int] = {}  # padding tokens each shape not captured yet added to hosting graphs
        self._pool: Any = None
        self._parameter_storage: tuple[tuple[int, bool], ...] = ()
        self._awaiting_backward = False
        self._weights: list[nn.Parameter] | None = None  # GEMM weights with a main_grad (training graphs)
        self._backward_events: list[Any] | None = None  # per layer, recorded by training replays' backward
        self.last_training_call_replayed = False  # set by the encoder at every training call
        self._out_of_memory = False  # a capture ran out of memory: no more graphs until clear()
        self._warm_up_in_pool = True  # off for good once a warm-up in the pool left tensors there
        self._timings: dict[tuple, dict[str, tuple[Any, int]]] = {}  # inference key -> kind -> (span, tokens)
        self._runs_eagerly: dict[tuple, bool] = {}  # timed inference keys -> whether they ran faster eagerly
        self._timed_in: dict[tuple, tuple[int, int, int]] = {}  # inference key -> the graph its replay is timed in
        self._own_graph_only: set[tuple] = set()  # keys faster eagerly than padded in a host: their own graph is timed
        self._eager_from: dict[tuple, int] = {}  # mode -> fewest tokens of a shape found faster eagerly in its graph
        self._request: TimingRequest | None = None  # what the call `shape_for` planned last should time
        self.capture_seconds: list[float] = []  # each capture's seconds (`clear` keeps them): what graphs cost

    def clear(self) -> None:
        """Drop every graph and their memory pool: a pool whose graphs are all freed cannot take a new capture
        (PyTorch's allocator asserts, the capture fails and leaves the CUDA generator in capture mode, so every
        later random op on the GPU raises)."""
        shapes = (self._graphs, self._uses, self._padding, self._timings, self._runs_eagerly, self._timed_in)
        for per_shape in (*shapes, self._own_graph_only, self._eager_from):
            per_shape.clear()
        self._pool = self._weights = self._backward_events = self._request = None
        self._awaiting_backward = self.last_training_call_replayed = self._out_of_memory = False

    def awaiting_backward(self) -> bool:
        """Whether a training replay's backward has not started yet."""
        return self._awaiting_backward

    def shape_for(
        self, encoder: nn.Module, hidden_states: torch.Tensor, packed: PackedSequences
    ) -> tuple[int, int, int] | None:
        """The static shape `(tokens, slots, max_length)` to pad this packed batch (`[T, hidden]` states) to before
        `run`, or None: run it eagerly, unpadded (an inference shape not captured yet, with no graph to hold it)."""
        self._request = None
        if self._out_of_memory:
            return None
        num_sequences = packed.cu_seq_lens.numel() - 1
        own = static_shape(packed.num_tokens, num_sequences, packed.max_length)
        mode = _graph_mode(encoder, hidden_states)
        key = (*own, *mode)
        if encoder.training:  # training: captured at first use
            return own
        if key in self._graphs:  # its own graph (or its failed capture); `_timed_choice` says replay or eager
            return self._timed_choice(key, own, packed.num_tokens)
        if own[0] >= self._eager_from.get(mode, own[0] + 1):  # as large as a shape that ran faster eagerly
            return None
        captured = [
            shape[:3]
            for shape, graph in self._graphs.items()
            if graph is not None and shape[3:] == mode and not self._runs_eagerly.get(shape)
        ]
        host = larger_graph_shape(captured, packed.num_tokens, num_sequences, packed.max_length)
        if host is not None and key not in self._own_graph_only:
            padding = self._padding.get(key, 0) + host[0] - own[0]
            if padding <= self.padding_before_capture * host[0]:
                choice = self._timed_choice(key, host, packed.num_tokens)
                if choice is not None:  # padded into the host (not its eager timing run)
                    self._padding[key] = padding
                return choice
            return own  # its padding has cost about a capture: capture its own shape
        self._uses[key] = self._uses.get(key, 0) + 1
        return own if self._uses[key] >= self.capture_at_use else None

    def _timed_choice(self, key: tuple, shape: tuple[int, int, int], tokens: int) -> tuple[int, int, int] | None:
        """An inference shape (`key`) that replays in the captured graph of `shape` (its own, or a larger one that
        hosts it): time one replay and one eager run, then run it the faster way per token (`eager_margin`) for
        good. A hosted shape faster eagerly is only no longer hosted: its own graph, once captured, is timed afresh
        (without the host's padding it may still beat eager)."""
        if self._graphs.get(key, shape) is None:  # its own capture failed
            return None
        if key in self._runs_eagerly or not self.time_shapes:
            return None if self._runs_eagerly.get(key) else shape
        if self._timed_in.get(key, shape) != shape:  # timed in another graph (a host): time this one
            self._timings.pop(key, None)
        self._timed_in[key] = shape
        timings = self._timings.setdefault(key, {})
        if "replay" not in timings:
            self._request = TimingRequest(key, "replay", tokens)
            return shape
        if "eager" not in timings:
            self._request = TimingRequest(key, "eager", tokens)
            return None
        per_token = {}
        for kind, (span, counted) in timings.items():
            milliseconds = self.clock.elapsed_ms(span)
            if milliseconds is None:  # still running: read again at the next batch of this shape
                return shape
            per_token[kind] = milliseconds / counted
        eagerly = per_token["eager"] < (1 - self.eager_margin) * per_token["replay"]
        del self._timings[key], self._timed_in[key]
        if eagerly and shape != key[:3]:
            self._own_graph_only.add(key)
        else:
            self._runs_eagerly[key] = eagerly
            if eagerly:
                self._eager_from[key[3:]] = min(key[0], self._eager_from.get(key[3:], key[0]))
        if eagerly:
            logger.info(f"cuda_graphs: shape {key[:3]} runs eagerly, faster than graph {shape} ({per_token} ms/token)")
        return None if eagerly else shape

    def take_timing_request(self) -> TimingRequest | None:
        """What the call just planned (`shape_for`) should time, handed to that call once: for `run` (a replay) or
        for `timed` around its eager run."""
        request, self._request = self._request, None
        return request

    @contextlib.contextmanager
    def timed(self, request: TimingRequest | None, kind: str) -> Any:
        """Time what runs inside when `request` asks for `kind` (`take_timing_request`); else nothing."""
        if request is None or request.kind != kind:
            yield
            return
        started = self.clock.start()
        yield
        self._timings.setdefault(request.key, {})[kind] = (self.clock.stop(started), request.tokens)

    def run(
        self,
        encoder: nn.Module,
        body: Callable,
        hidden_states: torch.Tensor,
        layout: PackedRun,
        precision: Any,
        timing: TimingRequest | None = None,
    ) -> torch.Tensor | None:
        """Replay (capturing first if new) the graph of `body` (`encoder.body`, handed down) for the shape of
        `hidden_states` (padded to a shape `shape_for` gave) in `precision` (the encoder's `ForwardPrecision`:
        captured with its recipe, replayed in its region); `[T, hidden]` final states, a fresh tensor. None when
        its capture failed or an earlier one ran out of memory: the encoder then runs it eagerly. `timing`
        (`take_timing_request`): a replay of a graph captured before this call is timed when it asks."""
        if self._out_of_memory:
            return None
        autocast_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        packed = layout.packed
        key = (hidden_states.shape[0], packed.cu_seq_lens.numel() - 1, packed.max_length)
        key = (*key, *_graph_mode(encoder, hidden_states))
        if key not in self._graphs:
            timing = None  # a capture's first replay is not what the next ones cost
            graph = self._capture(encoder, body, hidden_states, packed, layout.rotary_angles, autocast_dtype, precision)
            if self._out_of_memory:
                return None
            self._graphs[key] = graph
        graph = self._graphs[key]
        if graph is None:
            return None
        if hidden_states.requires_grad:  # the graph's backward accumulates into main_grad: make it each .grad
            if self._weights is None:
                self._weights = _graph_weights(encoder)
            _point_grads_at_main_grads(self._weights)
        with precision.region(), self.timed(timing, "replay"):
            states = graph(hidden_states, packed.cu_seq_lens, layout.rotary_angles).clone()
        if states.requires_grad:
            self._awaiting_backward = True
            states.register_hook(self._backward_started)
        return states

    def replayable(self, encoder: nn.Module) -> bool:
        """Whether a replay would do what an eager call does: no module of `encoder` has forward or backward hooks
        (a replay would not call them). Graphs read the parameters' storage and fix at capture which parameters
        get gradients: when either changed since the last call, they are dropped. One pass over the modules: it
        runs on every graphed call."""
        modules = list(encoder.modules())
        if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules):
            return False
        storage = tuple(
            (parameter.data_ptr(), parameter.requires_grad)
            for module in modules
            for parameter in module._parameters.values()
            if parameter is not None
        )
        if storage != self._parameter_storage:
            self.clear()
            self._parameter_storage = storage
        return True

    def layer_weights(self, encoder: nn.Module) -> list[list[nn.Parameter]]:
        """Per layer of `encoder`, the GEMM weights of its TE modules that get gradients (QKV, projection, fc1,
        fc2): those a training replay writes to `main_grad`; none on the PyTorch twin."""
        return _layer_weights(encoder)

    def replayed_layer_gradients(self, layers: list[list[nn.Parameter]]) -> list[tuple[Any, torch.Tensor]] | None:
        """For a data-parallel caller that reduces gradients itself (`NVEsmEncoder.reduce_gradients_after_backward`),
        to start on each layer's as soon as its backward is done: when the last training call replayed a graph, per
        layer of `layers` (`layer_weights`, in `encoder.layers` order) the CUDA event that replay's backward records
        once the layer's weight gradients are complete, and those gradients (`main_grad`, which is each GEMM
        weight's `.grad`) as one flat view; the views of consecutive layers are adjacent in one buffer. None when the
        last training call ran eagerly or the gradients are not laid out so (other dtypes, a `.grad` that is not the
        `main_grad`). The layers' other parameters (LayerNorms, biases) get their gradients after the graph, as
        ordinary `.grad`s."""
        if not self.last_training_call_replayed or self._weights is None or self._backward_events is None:
            return None
        weights = [weight for layer in layers for weight in layer]
        if not weights or any(weight.grad is not getattr(weight, "main_grad", None) for weight in weights):
            return None
        flat = weights[0].main_grad._base
        if flat is None:
            return None
        offset, views = weights[0].main_grad.storage_offset() - flat.storage_offset(), []
        for layer in layers:
            first = offset
            for weight in layer:
                grad = weight.main_grad
                if grad._base is not flat or grad.storage_offset() - flat.storage_offset() != offset:
                    return None
                offset += grad.numel()
            views.append(flat[first:offset])
        return list(zip(self._backward_events, views))

    def _free_after_out_of_memory(self, encoder: nn.Module) -> None:
        """Drop every graph, the pool and the `main_grad` buffers (`.grad` keeps one it accumulates into)."""
        self.clear()
        self._out_of_memory = True
        for weight in _graph_weights(encoder, create=False):
            del weight.main_grad
        gc.collect()
        torch.cuda.empty_cache()

    def _backward_started(self, grad: torch.Tensor) -> None:
        self._awaiting_backward = False

    def _capture(
        self,
        encoder: nn.Module,
        body: Callable,
        hidden_states: torch.Tensor,
        packed: PackedSequences,
        rotary_angles: torch.Tensor,
        autocast_dtype: Any,
        precision: Any,
    ) -> nn.Module | None:
        te = import_transformer_engine()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        training = hidden_states.requires_grad
        events = None
        if training:
            self._backward_events = self._backward_events or [torch.cuda.Event(external=True) for _ in encoder.layers]
            events = self._backward_events
        layers = StaticShapeLayers(body, encoder, packed.max_length, precision, events)
        layers.training = encoder.training
        sample = (
            hidden_states.detach().clone().requires_grad_(hidden_states.requires_grad),
            packed.cu_seq_lens.clone(),
            rotary_angles.clone(),
        )
        shape = f"{hidden_states.shape[0]} tokens, {packed.cu_seq_lens.numel() - 1} slots, " + (
            f"max_length {packed.max_length}, {'training' if encoder.training else 'inference'}"
        )
        started = time.perf_counter()
        parameters = list(encoder.parameters())
        grads = [parameter.grad for parameter in parameters]  # TE does not put them back if capture fails
        weights = _graph_weights(encoder) if training else []
        accumulated = _main_grads_in_use(weights)  # TE's warm-up steps add to main_grad; restored after capture
        routed = training and self._warm_up_in_pool and any(graph is not None for graph in self._graphs.values())
        warm_up = WarmUpInPool(self._pool, routed)
        out_of_memory, failure = False, ""
        try:  # TE refuses the autocast weight cache while capturing; the layers' casts are part of the graph
            with (
                _expandable_segments(),
                _fused_wgrad_accumulation(encoder, training),
                torch.autocast(
                    "cuda",
                    dtype=autocast_dtype or torch.bfloat16,
                    enabled=autocast_dtype is not None,
                    cache_enabled=False,
                ),
            ):
                graph = te.make_graphed_callables(
                    layers,
                    sample,
                    enabled=precision.recipe is not None,
                    recipe=precision.recipe,
                    pool=self._pool,
                    # One eager forward sets up what inference captures (cuDNN plans, workspaces); training keeps
                    # TE's three forward+backward passes.
                    num_warmup_iters=3 if training else 1,
                    **warm_up_hooks(te.make_graphed_callables, warm_up),
                )
        except Exception as error:  # e.g. a capture that meets another live autograd graph: run this shape eagerly
            warm_up.close()
            import_transformer_engine("pytorch.graph").set_capture_end()
            if "__call__" in vars(StaticShapeLayers):  # TE's FP8 wrapper, left in place when capture fails
                del StaticShapeLayers.__call__
            for parameter, grad in zip(parameters, grads):
                parameter.grad = grad
            out_of_memory = isinstance(error, torch.OutOfMemoryError)
            failure = f"{type(error).__name__}: {error}"
            graph = None  # handled below, once the traceback (which holds the warm-up's tensors) is gone
        _restore_main_grads(weights, accumulated)
        if warm_up.left_in_pool:  # the earlier graphs' replays would overwrite them: drop those graphs
            logger.warning(
                f"The CUDA-graph warm-up left {warm_up.left_in_pool} bytes alive in the graphs' memory pool: the "
                f"graphs are dropped and {shape} is captured into a new pool; from now on warm-ups run beside it."
            )
            self._warm_up_in_pool = False
            graph = None
            self.clear()
            gc.collect()  # the dropped graphs' pool goes back once they are collected
            torch.cuda.empty_cache()
            return self._capture(encoder, body, hidden_states, packed, rotary_angles, autocast_dtype, precision)
        if graph is None:
            if out_of_memory:
                self._free_after_out_of_memory(encoder)
                logger.warning(
                    f"CUDA graph capture ran out of GPU memory ({shape}); the graphs are freed and this model runs "
                    "eagerly from now on (load it with cuda_graphs=False to skip capturing)."
                )
                return None
            if warm_up.routed:  # what the failed warm-up still holds in the pool, the earlier graphs would overwrite
                self.clear()
            logger.warning(f"CUDA graph capture failed ({shape}); this shape runs eagerly. {failure}")
            return None
        torch.cuda.empty_cache()
        self.capture_seconds.append(seconds := time.perf_counter() - started)
        where = "in the graphs' memory pool" if warm_up.routed else "beside the graphs' memory pool"
        logger.info(f"Captured CUDA graphs for {shape} in {seconds:.2f} s (warm-up {where})")
        return graph


# PyTorch's private allocator bindings the routing uses (torch >= 2.8; before, the second was named otherwise):
# without them every warm-up runs beside the pool.
ALLOCATOR_POOL_BINDINGS = ("_cuda_beginAllocateCurrentStreamToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")


class WarmUpInPool:
    """TE's eager warm-up before a capture (`make_graphed_callables`' `pre_warmup_hook` / `post_warmup_hook`), run
    in the memory the captured graphs use, not beside it, once the pool holds graphs (`routed`). Only training
    captures are routed: their warm-up keeps a step's activations for its backward, while an inference warm-up is
    one forward without saved activations (a layer's temporaries beside the pool).

    A captured graph's temporaries and saved activations are blocks of the shared pool that only its replays use, so
    while no replay runs (and none is awaiting its backward) they are free memory. The caching allocator reuses a pool's
    blocks only for allocations on the stream they were made on, so the warm-up runs on the stream the graphs are
    captured on (`torch.cuda.graph.default_capture_stream`) and that stream's allocations, the warm-up's backward
    included (autograd runs a node on its forward's stream), come from the pool. A training step's activations then
    exist once, not twice, while a new shape is captured. Safe only if the warm-up leaves nothing alive there (a replay
    would overwrite it): `end` records the bytes of blocks it allocated that are still alive (`left_in_pool`), and the
    caller then drops the graphs. The first capture into a pool warms up beside it, and that memory is returned
    (`empty_cache`) before capture. Routing needs PyTorch's private allocator bindings (torch >= 2.8); without them
    every warm-up runs beside the pool."""

    def __init__(self, pool: Any, routed: bool) -> None:
        capture_stream = torch.cuda.graph.default_capture_stream
        bindings = [getattr(torch._C, name, None) for name in ALLOCATOR_POOL_BINDINGS]
        self.pool = pool
        self.routed = routed and capture_stream is not None and all(bindings)
        self.left_in_pool = 0
        self._capture_stream = capture_stream
        self._begin, self._end, self._release = bindings
        self._device = 0  # set in `begin`
        self._blocks_before: set[int] = set()
        self._routing = False

    def begin(self) -> None:
        """Called inside TE's `with torch.cuda.stream(warm-up stream)`, which restores the stream afterwards."""
        if not self.routed:
            return
        torch.cuda.synchronize()  # the pool's blocks were last used by replays on other streams
        torch.cuda.empty_cache()  # while routing, the allocator cannot free cached blocks beside the pool to grow it
        torch.cuda.set_stream(self._capture_stream)
        self._device = torch.cuda.current_device()
        self._blocks_before = set(live_blocks_in_pool(self.pool))
        self._begin(self._device, self.pool)  # takes a use of the pool, given back in `close`
        self._routing = True

    def end(self) -> None:
        self.close()
        if self.routed:
            left = live_blocks_in_pool(self.pool).keys() - self._blocks_before
            if left:  # a reference cycle may still hold them: collect, then look again
                gc.collect()
                blocks = live_blocks_in_pool(self.pool)
                self.left_in_pool = sum(blocks[address] for address in blocks.keys() - self._blocks_before)
        torch.cuda.empty_cache()  # the warm-up's memory beside the pool, back before capture

    def close(self) -> None:
        """Stop routing allocations to the pool (also where the warm-up raised)."""
        if self._routing:
            torch.cuda.synchronize()
            self._end(self._device, self.pool)
            self._release(self._device, self.pool)
            self._routing = False


def warm_up_hooks(make_graphed_callables: Any, warm_up: WarmUpInPool) -> dict[str, Any]:
    """`warm_up`'s hooks as `make_graphed_callables`' keyword arguments, where it takes them (TE >= 2.14); none
    before (the warm-up then runs beside the pool, its memory not returned before capture)."""
    parameters = inspect.signature(make_graphed_callables).parameters
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    if not takes_any and ("pre_warmup_hook" not in parameters or "post_warmup_hook" not in parameters):
        return {}
    return {"pre_warmup_hook": warm_up.begin, "post_warmup_hook": warm_up.end}


def live_blocks_in_pool(pool: Any) -> dict[int, int]:
    """Address -> bytes of each live (allocated) block in CUDA memory pool `pool`, from the allocator's snapshot."""
    return {
        block["address"]: block["size"]
        for segment in torch.cuda.memory_snapshot()
        if tuple(segment["segment_pool_id"]) == tuple(pool)
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


@contextlib.contextmanager
def _expandable_segments() -> Any:
    """Within: the CUDA caching allocator maps new memory as expandable segments (unless the process already does).

    The graphs' shared pool keeps every segment it gets; with fixed-size segments each new, larger shape needs new ones
    beside the blocks of the smaller shapes, until the GPU runs out of memory. Expandable segments grow in place, so
    freed blocks merge and the shapes share them. The warm-up's eager memory is mapped the same way and unmapped by
    `empty_cache`."""
    process_setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    set_allocator = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )  # the first from torch 2.12 on
    if set_allocator is None or "expandable_segments:True" in process_setting:
        yield
        return
    set_allocator("expandable_segments:True")
    try:
        yield
    finally:
        set_allocator("expandable_segments:False")


def _layer_weights(encoder: nn.Module) -> list[list[nn.Parameter]]:
    """Per layer, the GEMM weights of its TE modules that get gradients (QKV, projection, fc1, fc2)."""
    return [
        [
            parameter
            for module in layer.modules()
            if hasattr(module, "fuse_wgrad_accumulation")
            for name, parameter in module.named_parameters(recurse=False)
            if name in ("weight", "fc1_weight", "fc2_weight") and parameter.requires_grad
        ]
        for layer in encoder.layers
    ]


def _graph_weights(encoder: nn.Module, create: bool = True) -> list[nn.Parameter]:
    """The GEMM weights of the TE layers that get gradients, each given a `main_grad` (`create`), or those that
    have one (not `create`). New `main_grad`s are views of one zeroed buffer, in layer order, when the weights
    share a dtype and device (`replayed_layer_gradients` hands out each layer's part), else tensors of their own."""
    weights = [weight for layer in _layer_weights(encoder) for weight in layer]
    if not create:
        return [weight for weight in weights if hasattr(weight, "main_grad")]

    def fits(weight: nn.Parameter) -> bool:
        main_grad = getattr(weight, "main_grad", None)
        layout = (weight.shape, weight.dtype, weight.device)
        return isinstance(main_grad, torch.Tensor) and (main_grad.shape, main_grad.dtype, main_grad.device) == layout

    if all(map(fits, weights)):
        return weights
    if len({(weight.dtype, weight.device) for weight in weights}) == 1 and all(
        type(weight.data) is torch.Tensor for weight in weights
    ):
        flat = torch.zeros(sum(weight.numel() for weight in weights), dtype=weights[0].dtype, device=weights[0].device)
        for weight, piece in zip(weights, flat.split([weight.numel() for weight in weights])):
            weight.main_grad = piece.view(weight.shape)
        return weights
    for weight in weights:
        if not fits(weight):
            weight.main_grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return weights


@contextlib.contextmanager
def _fused_wgrad_accumulation(encoder: nn.Module, enabled: bool) -> Any:
    """Within: TE modules write weight gradients into `main_grad` (captured so in a graph); after: ordinary grads."""
    modules = [m for m in encoder.layers.modules() if hasattr(m, "fuse_wgrad_accumulation")]
    for module in modules:
        module.fuse_wgrad_accumulation = enabled
    try:
        yield
    finally:
        for module in modules:
            module.fuse_wgrad_accumulation = False


def _point_grads_at_main_grads(weights: list[nn.Parameter]) -> None:
    """Make each weight's `.grad` its `main_grad`: zeroed if `.grad` was None, holding `.grad` if it was another
    tensor, untouched if it already is (gradient accumulation across replays)."""
    unset = [weight for weight in weights if weight.grad is None]
    if unset:
        torch._foreach_zero_([weight.main_grad for weight in unset])
    for weight in weights:
        if weight.grad is not weight.main_grad:
            if weight.grad is not None:
                weight.main_grad.copy_(weight.grad)
            weight.grad = weight.main_grad


def _main_grads_in_use(weights: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """CPU copies of the `main_grad`s that hold accumulated gradients (`.grad` is `main_grad`), else None."""
    return [weight.main_grad.cpu() if weight.grad is weight.main_grad else None for weight in weights]


def _restore_main_grads(weights: list[nn.Parameter], accumulated: list[torch.Tensor | None]) -> None:
    """Undo what a capture's warm-up steps added to the `main_grad`s."""
    for weight, saved in zip(weights, accumulated):
        if saved is None:
            weight.main_grad.zero_()
        else:
            weight.main_grad.copy_(saved)
