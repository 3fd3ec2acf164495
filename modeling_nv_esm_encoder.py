"""`NVEsmEncoder`: the layers and the final LayerNorm, how a batch runs through them (eager or as CUDA graphs, FP8
regions, tensor and context parallelism, activation checkpointing and offloading), its state-dict hooks for TE's
extra state and FP8 weights, and the attention maps it hands out (`attention_probabilities`).

Part of the model's Hub remote code: imports the siblings below it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

try:
    from .configuration_nv_esm import FEATURES, NVEsmConfig, refuse_combinations
    from .modeling_nv_esm_batch import InputBatch
    from .modeling_nv_esm_graphs import FreshWhenCopied, StaticShapeGraphs
    from .modeling_nv_esm_layers import (
        TE_INSTALL_HINT,
        Backend,
        fp8_value,
        fp8_weights_init,
        holds_fp8_weights,
        import_transformer_engine,
        is_fp8_tensor,
        transformer_engine_available,
    )
    from .modeling_nv_esm_layout import RotaryTable, RunLayout
    from .modeling_nv_esm_lora import with_qkv_updates
    from .modeling_nv_esm_parallel import (
        ContextParallel,
        RankGroup,
        tensor_parallel_layers,
        tensor_parallel_split_dim,
    )
    from .modeling_nv_esm_plan import ForwardPlan, ForwardPrecision
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import FEATURES, NVEsmConfig, refuse_combinations
    from modeling_nv_esm_batch import InputBatch
    from modeling_nv_esm_graphs import FreshWhenCopied, StaticShapeGraphs
    from modeling_nv_esm_layers import (
        TE_INSTALL_HINT,
        Backend,
        fp8_value,
        fp8_weights_init,
        holds_fp8_weights,
        import_transformer_engine,
        is_fp8_tensor,
        transformer_engine_available,
    )
    from modeling_nv_esm_layout import RotaryTable, RunLayout
    from modeling_nv_esm_lora import with_qkv_updates
    from modeling_nv_esm_parallel import (
        ContextParallel,
        RankGroup,
        tensor_parallel_layers,
        tensor_parallel_split_dim,
    )
    from modeling_nv_esm_plan import ForwardPlan, ForwardPrecision

logger = logging.get_logger(__name__)


class ActivationOffload(FreshWhenCopied):
    """Transformer Engine's CPU offload context for the encoder's layers (`config.offload_activations`), built on
    first use, and whether an offloaded training forward still waits for its backward. TE hands saved tensors back
    by layer and position, so a second forward before the first one's backward would give that backward the second
    forward's activations: it is refused."""

    def __init__(self) -> None:
        self.context: Any = None  # entered around each layer's forward
        self.sync: Callable[[torch.Tensor], torch.Tensor] | None = None  # each layer's output passes through it
        self.awaiting_backward = False

    def build(self, num_layers: int, offloaded_layers: int | None) -> None:
        """Offload the first `offloaded_layers` of `num_layers` (None: every layer but the last). TE copies layer i
        out while the next layers run, finishing before layer i + num_layers - offloaded_layers (every layer but
        the last: before layer i + 1, no overlap with compute), and copies it back while the later layers'
        backward runs."""
        if not transformer_engine_available():
            raise ImportError(f"offload_activations uses Transformer Engine's offloading. {TE_INSTALL_HINT}")
        offloading = import_transformer_engine("pytorch.cpu_offload")
        if not hasattr(offloading, "DefaultOffloadSynchronizer") or offloading.NVTE_CPU_OFFLOAD_V1:
            raise ImportError(
                "offload_activations needs Transformer Engine's offloading of any saved tensor (TE 2.20's default; "
                "not the NVTE_CPU_OFFLOAD_V1=1 code path, which offloads only what TE modules mark)."
            )
        offloaded = num_layers - 1 if offloaded_layers is None else offloaded_layers
        self.context, self.sync = import_transformer_engine().get_cpu_offload_context(
            enabled=True, num_layers=offloaded, model_layers=num_layers
        )

    def forward_done(self, output: torch.Tensor) -> None:
        """An offloaded forward finished with `output` (the last layer's): no other until its backward starts."""
        if output.requires_grad:
            self.awaiting_backward = True
            output.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        self.awaiting_backward = False


def drop_te_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: TE's `_extra_state` (FP8 scaling history) is neither saved nor required; weights held in
    FP8 (`fp8_weights`) appear as the plain tensors of their values (`dequantize`), which any checkpoint holds."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key.endswith("._extra_state"):
            del state_dict[key]
        elif is_fp8_tensor(state_dict[key]):
            state_dict[key] = state_dict[key].dequantize()


def quantize_fp8_weights(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: the values loaded into weights held in FP8 are quantized here (`fp8_value`: scales fitted,
    result checked), so that `load_state_dict` copies FP8 data as it is."""
    with torch.no_grad():
        for name, parameter in module.named_parameters(prefix=prefix.rstrip(".")):
            if is_fp8_tensor(parameter) and torch.is_tensor(state_dict.get(name)):
                state_dict[name] = fp8_value(parameter, state_dict[name])


def ignore_missing_te_extra_state(module: nn.Module, incompatible_keys: Any) -> None:
    """Load hook: strict loading does not require TE's `_extra_state` entries."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if not key.endswith("._extra_state")]


class NVEsmEncoder(nn.Module):
    """The transformer layers (TE or PyTorch twin, made by the `backend` object) and the final LayerNorm, and how a
    batch runs through them: `plan` lays it out (`RunLayout`) and decides graph or eager, `body` runs it.

    With `config.cuda_graphs` (TE backend, packed layers), batches padded to a static shape run as CUDA graphs
    captured once per shape (when, `StaticShapeGraphs` says) with Transformer Engine's `make_graphed_callables`:
    one graph for the forward of all layers and one for their backward, replayed instead of launching every kernel
    from Python.
    """

    def __init__(self, config: NVEsmConfig, backend: Backend) -> None:
        """`backend`: the object `resolve_backend` gives (`TEBackend` or `TorchBackend`)."""
        super().__init__()
        self.config = config
        self.backend = backend
        backend.check_config(config)
        if config.cudnn_layer_norm:
            backend.use_cudnn_layer_norm()
        self.fp8_recipe = backend.fp8_recipe(config)
        self.fp8_weight_recipes = self._fp8_weight_recipes()
        self.layers = backend.make_layers(config, self.fp8_weight_recipes)
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.tensor_parallel: RankGroup | None = None  # set by `enable_tensor_parallel`
        self.context_parallel: ContextParallel | None = None  # set by `enable_context_parallel`
        self.graphs = StaticShapeGraphs()
        self.graphs_paused = False  # `eager`
        self.gradients_reduced_after_backward = False  # `reduce_gradients_after_backward`
        self._offload = ActivationOffload()
        self.register_state_dict_post_hook(drop_te_extra_state)
        self.register_load_state_dict_post_hook(ignore_missing_te_extra_state)
        self.register_load_state_dict_pre_hook(quantize_fp8_weights)
        self.hold_fp8_weights()  # on the meta device (from_pretrained), after loading instead

    def _fp8_weight_recipes(self) -> list[Any]:
        """Per layer, the recipe its weights are held in FP8 with, or None: `config.fp8_weights` holds the FP8
        layers' weights with `fp8_recipe`; a caller's `te.quantized_model_init` around the construction holds
        every layer's with its recipe."""
        config = self.config
        if config.fp8_weights:
            return [self.fp8_recipe if precision == "fp8" else None for precision in config.layer_precision]
        return [self.backend.caller_fp8_weights_recipe()] * config.num_hidden_layers

    def hold_fp8_weights(self) -> None:
        """Hold the weights of the layers `fp8_weight_recipes` names in FP8: each is rebuilt on the GPU inside
        `quantized_model_init` and its current weights quantized into it (`fp8_value`). Runs when the model is
        built, and in `from_pretrained` after loading (a model built on the meta device has no weights yet); layers
        already in FP8 are left as they are. The rebuild draws no random numbers from the caller's generators.

        In eval mode (as `from_pretrained` leaves a model) or without gradients (a build under `torch.no_grad()`)
        only the FP8 rows are kept, half the bytes of bf16: what inference reads. Otherwise their transposes too
        (Hopper's backward GEMMs read them); a training forward of a rows-only model makes them when it needs
        them."""
        converted, grad = False, torch.is_grad_enabled()
        for index, recipe in enumerate(self.fp8_weight_recipes):
            old = self.layers[index]
            if recipe is None or holds_fp8_weights(old):
                continue
            weights = dict(old.named_parameters())
            if any(value.device.type == "meta" for value in weights.values()):
                continue
            dtype = next(iter(weights.values())).dtype
            devices = [torch.cuda.current_device()]
            with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(self.training and grad):
                with fp8_weights_init(recipe):  # the FP8 layouts quantized now follow torch.is_grad_enabled()
                    new = self.backend.make_layer(self.config, index + 1, params_dtype=dtype)
                with torch.no_grad():
                    for name, parameter in new.named_parameters():
                        parameter.copy_(fp8_value(parameter, weights[name]))
            self.layers[index], converted = new.train(old.training), True
        if converted:
            gc.collect()  # the old layers' fused modules and adapter targets refer to each other
            self.graphs.clear()

    def forward(
        self,
        hidden_states: torch.Tensor,
        batch: InputBatch,
        rotary: RotaryTable,
        plan: ForwardPlan,
        attention_sink: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Run the layers and the final LayerNorm on `batch`'s embeddings (packed `[T, hidden]`, or `[B, S, hidden]`
        when `batch.packed` is None: `NVEsmModel._embed`) as `plan` says (`plan_forward`, made when the forward
        started): laid out for the layers (`ForwardPlan.lay_out`), replayed as a CUDA graph or run eagerly. Returns
        the final states in the input's layout and, with `plan.per_layer_outputs`, the embedding output and every
        layer's output (the last one LayerNormed, as in ESM and transformers). `attention_sink`, if given, receives
        each layer's attention probabilities in the run layout (`attention_probabilities`) as the layers run."""
        precision = plan.precision
        hidden_states, layout = plan.lay_out(self, hidden_states, batch, rotary)
        timing = self.graphs.take_timing_request() if plan.graphed else None  # what `lay_out` chose to time
        states = (
            self.graphs.run(self, self.body, hidden_states, layout, precision, timing) if layout.static_shape else None
        )
        if hidden_states.requires_grad:
            self.graphs.last_training_call_replayed = states is not None
        if states is not None:
            return layout.to_input(states), None
        if layout.static_shape:  # its capture failed: the padded batch runs eagerly, rotated as an eager run is
            layout = layout.with_qkv_rotation(layout.make_qkv_rotation())
        all_hidden_states = [hidden_states] if plan.per_layer_outputs else None
        with precision.region(), self.graphs.timed(timing, "eager"):
            states = self.body(hidden_states, layout, precision, all_hidden_states, attention_sink)
        if all_hidden_states is None:
            return layout.to_input(states), None
        all_hidden_states[-1] = states
        return layout.to_input(states), tuple(map(layout.to_input, all_hidden_states))

    def body(
        self,
        hidden_states: torch.Tensor,
        layout: RunLayout,
        precision: ForwardPrecision,
        all_hidden_states: list | None = None,
        attention_sink: Callable[[torch.Tensor], None] | None = None,
        backward_events: list | None = None,
    ) -> torch.Tensor:
        """The layers and the final LayerNorm on states in the run layout (inside `precision.region()`): what an
        eager call runs and what each CUDA graph holds (`StaticShapeLayers`). Each rank runs its tokens
        (`own_tokens`), and every output is gathered back (`all_tokens`) before the LayerNorm."""
        own_tokens = layout.own_tokens(hidden_states)
        states = self.run_layers(own_tokens, layout, precision, all_hidden_states, attention_sink, backward_events)
        if all_hidden_states is not None:
            all_hidden_states[1:] = [layout.all_tokens(h) for h in all_hidden_states[1:]]
        return self.emb_layer_norm_after(layout.all_tokens(states))

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        layout: RunLayout,
        precision: ForwardPrecision,
        all_hidden_states: list | None = None,
        attention_sink: Callable[[torch.Tensor], None] | None = None,
        backward_events: list | None = None,
    ) -> torch.Tensor:
        """The layers alone, appending each layer's output to `all_hidden_states` and handing each layer's attention
        probabilities to `attention_sink`. With `backward_events` (a training graph's capture), layer i's backward
        records event i once it is done: when the gradient of the layer's input is complete, after its weight
        gradients (TE computes them in the same backward calls, on the same stream)."""
        offload = self.activation_offload(hidden_states)
        unrotated = layout.with_qkv_rotation(None) if precision.attention_fp8 else None  # TE's FP8 attention rotates
        try:
            for index, layer in enumerate(self.layers):
                if backward_events is not None and hidden_states.requires_grad:
                    hidden_states.register_hook(lambda grad, event=backward_events[index]: event.record())
                if attention_sink is not None:
                    attention_sink(attention_probabilities(layer, hidden_states, layout, self.config))
                with precision.layer(index), offload.context if offload else contextlib.nullcontext():
                    layer_layout = unrotated if precision.fp8_attention(index) else layout
                    hidden_states = self.run_layer(layer, hidden_states, layer_layout)
                if offload and hidden_states.requires_grad:  # its backward hook starts the layer's reload
                    hidden_states = offload.sync(hidden_states)
                if all_hidden_states is not None:
                    all_hidden_states.append(hidden_states)
        except BaseException:
            if offload:  # TE's context counts layers: a forward cut short leaves it out of step
                self._offload = ActivationOffload()
            raise
        if offload:
            offload.forward_done(hidden_states)
        return hidden_states

    def enable_tensor_parallel(self, tensor_parallel: RankGroup) -> None:
        """Split every layer across the ranks of `tensor_parallel` (Megatron-style tensor parallelism with
        sequence parallelism, `TENSOR_PARALLEL_SPLITS`): the layers are replaced by this rank's parts of them
        (`tensor_parallel_layers`), holding the matching slices of the current weights (none on the meta device).
        Packed (THD) layers only; the model's inputs and outputs stay whole on every rank. Raises ValueError for
        what it does not support: padded layers, dropout, head or MLP sizes the group size does not divide, LoRA
        adapters, activation offloading, a second call."""
        config, size = self.config, tensor_parallel.size
        self._refuse_parallelism(
            "tensor_parallel",
            {
                "it was enabled already": self.tensor_parallel is not None,
                f"{config.num_attention_heads} heads do not split over {size} ranks": (
                    config.num_attention_heads % size
                ),
                f"intermediate_size {config.intermediate_size} does not split over {size} ranks": (
                    config.intermediate_size % size
                ),
            },
        )
        layers = tensor_parallel_layers(self.layers, self.backend, config, tensor_parallel)
        self.layers, self.tensor_parallel = layers, tensor_parallel
        self.graphs.clear()

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None:
        """Run each batch's layers across the ranks of `context_parallel`: each rank runs its chunks of every
        protein (`ContextParallelLayout`) and attention exchanges their tokens (on Transformer Engine an all-to-all
        or an all-gather, `ContextParallel.te_exchange`; an all-gather in the twin), so a protein too long for one GPU
        runs on several. Every rank keeps whole weights and gets the whole batch's outputs. Packed (THD) layers
        only. Raises ValueError for what it does not support: padded layers, dropout, tensor parallelism, LoRA
        adapters, activation offloading, a second call."""
        self._refuse_parallelism("context_parallel", {"it was enabled already": self.context_parallel is not None})
        self.backend.join_context_parallel(self.layers, context_parallel)
        self.context_parallel = context_parallel
        self.graphs.clear()

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Within: every forward runs eagerly, and the CUDA graphs captured before stay as they are (e.g. a
        validation pass between training steps that replay graphs)."""
        paused, self.graphs_paused = self.graphs_paused, True
        try:
            yield
        finally:
            self.graphs_paused = paused

    def reduce_gradients_after_backward(self, enabled: bool = True) -> None:
        """Tell the model that its caller, whose ranks each hold the whole model, averages `.grad` over them itself
        after the step's backwards (not DDP's or DeepSpeed's per-gradient hooks, which a replay does not call): its
        training forwards may then replay CUDA graphs in a process group of several ranks (`plan_forward`)."""
        self.gradients_reduced_after_backward = enabled

    def layer_gradients(self) -> tuple[list[list[nn.Parameter]], list[tuple[Any, torch.Tensor]] | None]:
        """For a caller that reduces gradients itself: per layer, the GEMM weights whose gradients a training replay
        writes (`StaticShapeGraphs.layer_weights`), and, when the last training call replayed a graph, per layer
        the CUDA event its backward records once that layer's gradients are complete with those gradients as one
        flat view (`StaticShapeGraphs.replayed_layer_gradients`; None after an eager backward)."""
        layers = self.graphs.layer_weights(self)
        return layers, self.graphs.replayed_layer_gradients(layers)

    def _refuse_parallelism(self, subject: str, own: dict[str, Any]) -> None:
        """ValueError naming the first true reason among `own` (the limits of `subject`, "tensor_parallel" or
        "context_parallel", itself), then the first of this encoder's features that `UNSUPPORTED_COMBINATIONS`
        refuses with it: "tensor parallelism: LoRA adapters are not supported."."""
        for reason, refused in own.items():
            if refused:
                raise ValueError(f"{FEATURES[subject]}: {reason}.")
        refuse_combinations(self.features(), subject=subject)

    def features(self) -> set[str]:
        """The features of `UNSUPPORTED_COMBINATIONS` this encoder runs with now."""
        config = self.config
        active = {
            "tensor_parallel": self.tensor_parallel is not None,
            "context_parallel": self.context_parallel is not None,
            "padded_layers": config.attn_input_format != "thd",
            "dropout": config.attention_probs_dropout_prob > 0 or config.hidden_dropout_prob > 0,
            "lora": any(hasattr(module, "lora_A") for module in self.modules()),
            "offload_activations": config.offload_activations,
            "activation_checkpointing": self.gradient_checkpointing,
            "fp8_weights": any(self.fp8_weight_recipes),
        }
        return {feature for feature, on in active.items() if on}

    @property
    def parallel_ranks(self) -> RankGroup | None:
        """The tensor- or context-parallel group the layers run across (they share each batch), or None."""
        return self.tensor_parallel or self.context_parallel

    def partial_gradients(self) -> tuple[RankGroup | None, list[torch.Tensor]]:
        """The tensor- or context-parallel group and the gradients (local shards under FSDP2) that each of its ranks
        computed from its own tokens only, so that their sum over the group is the gradient: with tensor
        parallelism the whole layer parameters (LayerNorms, output biases), with context parallelism every layer
        parameter. (None, []) without either."""
        ranks = self.parallel_ranks
        if ranks is None:
            return None, []
        grads = []
        for name, parameter in self.layers.named_parameters(prefix="layers"):
            split = self.tensor_parallel is not None and tensor_parallel_split_dim(name) is not None
            if parameter.grad is not None and not split:
                grads.append(parameter.grad.to_local() if hasattr(parameter.grad, "to_local") else parameter.grad)
        return ranks, grads

    def reduce_partial_gradients(self, averaged: bool = False) -> None:
        """Sum the `partial_gradients` over their group (one all-reduce); `averaged`: a wrapper (FSDP2, DDP) already
        averaged them over the group's ranks, so they are multiplied by the group's size instead."""
        ranks, grads = self.partial_gradients()
        if not grads:
            return
        if averaged:
            torch._foreach_mul_(grads, float(ranks.size))
            return
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        torch.distributed.all_reduce(flat, group=ranks.group)
        for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(summed.view_as(grad))

    def activation_offload(self, hidden_states: torch.Tensor) -> ActivationOffload | None:
        """With `config.offload_activations`, in train mode with gradients: the built `ActivationOffload` whose
        context each layer runs in. None otherwise. Raises RuntimeError while an offloaded forward waits for its
        backward, and ValueError with gradient checkpointing or off CUDA."""
        if not (self.config.offload_activations and self.training and torch.is_grad_enabled()):
            return None
        if self._offload.awaiting_backward:
            raise RuntimeError(
                "offload_activations: this model ran a training forward whose backward has not run yet; another "
                "one now would give that backward the wrong activations. Call backward first, or load the model "
                "with offload_activations=False to run several forwards per backward."
            )
        refuse_combinations(
            {"offload_activations", *(["activation_checkpointing"] if self.gradient_checkpointing else [])},
            lambda _, __, reason: f"offload_activations with gradient checkpointing {reason}: use one of them.",
            subject="offload_activations",
        )
        if hidden_states.device.type != "cuda":
            raise ValueError(
                f"offload_activations moves GPU activations to host memory; this model runs on "
                f"{hidden_states.device.type}. Load it with offload_activations=False."
            )
        if self._offload.context is None:
            self._offload.build(len(self.layers), self.config.offloaded_layers)
        return self._offload

    def run_layer(self, layer: nn.Module, hidden_states: torch.Tensor, layout: RunLayout) -> torch.Tensor:
        """One layer, `layer(hidden_states, layout)` on both backends; recomputed in backward under gradient
        checkpointing (TE's checkpoint on the TE backend: it keeps FP8 scaling state consistent when recomputing)."""
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return layer(hidden_states, layout)
        checkpoint_function = getattr(self, "_gradient_checkpointing_func", None)  # TE's needs none
        return self.backend.checkpoint(layer, hidden_states, layout, checkpoint_function)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self.graphs.clear()  # moved or cast parameters are new tensors: the graphs read the old ones
        self._offload = ActivationOffload()  # its stream belongs to the device the model was on
        return super()._apply(fn, recurse)


def attention_probabilities(
    layer: nn.Module, hidden_states: torch.Tensor, layout: RunLayout, config: NVEsmConfig
) -> torch.Tensor:
    """`[N, heads, L, L]` float32 softmax attention of `layer` on the right-padded view of its input states.

    An explicit (unfused) pass from the layer's own LayerNorm + QKV weights, which both backends name alike, so it
    serves Transformer Engine layers too (their fused kernels form no maps). Zeros at padded keys and queries.
    """
    qkv_weights = layer.self_attention.layernorm_qkv
    normed = F.layer_norm(
        hidden_states,
        hidden_states.shape[-1:],
        qkv_weights.layer_norm_weight,
        qkv_weights.layer_norm_bias,
        config.layer_norm_eps,
    )
    qkv = with_qkv_updates(qkv_weights, normed, F.linear(normed, qkv_weights.weight, qkv_weights.bias))
    view = layout.attention_view(qkv, config.num_attention_heads, config.head_dim)
    key_mask = view.key_mask
    if key_mask is None:
        key_mask = torch.ones(view.key.shape[0], view.key.shape[2], dtype=torch.bool, device=qkv.device)
    scores = torch.matmul(view.query.float(), view.key.float().transpose(-1, -2))
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1).nan_to_num() * key_mask[:, None, :, None]
