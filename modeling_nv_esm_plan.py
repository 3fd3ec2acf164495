"""How one forward of the encoder runs, decided in one place: `plan_forward` makes a `ForwardPlan` when a forward
starts, and the encoder only reads it from then on.

A plan answers, once per forward:
- precision (`ForwardPrecision`): the FP8 recipe of the model's own FP8 layers and of a caller's `te.autocast`
  around the model, which layers run in FP8, the FP8 region's amax group, the token multiple FP8 GEMMs need;
- runner (`ForwardPlan.graphed`): a CUDA-graph replay or an eager run, from the model's state and what the caller
  asked (per-layer outputs, attention maps); a graphed forward's static shape, and whether this call times a shape
  both ways, come from the graphs (`StaticShapeGraphs.shape_for`), asked here;
- layout and parallel split (`ForwardPlan.lay_out`): padded (BSHD) or packed (THD) layers, the packed batch padded
  to a graph's static shape or to the token multiple of FP8 and tensor parallelism, or split across context-parallel
  ranks: the `RunLayout` every layer reads.
The precision every command runs in on CUDA (bf16 autocast, `inference_autocast`) is decided here too.

Part of the model's Hub remote code: imports the batch, layers, layout, LoRA and parallel siblings below it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    from .modeling_nv_esm_batch import FP8_TOKEN_MULTIPLE, InputBatch
    from .modeling_nv_esm_layers import Backend, quantizes_attention
    from .modeling_nv_esm_layout import PackedRun, PaddedRun, RotaryTable, RunLayout
    from .modeling_nv_esm_lora import has_active_adapters
    from .modeling_nv_esm_parallel import ContextParallelLayout, TensorParallelRun, is_sharded, several_ranks
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from modeling_nv_esm_batch import FP8_TOKEN_MULTIPLE, InputBatch
    from modeling_nv_esm_layers import Backend, quantizes_attention
    from modeling_nv_esm_layout import PackedRun, PaddedRun, RotaryTable, RunLayout
    from modeling_nv_esm_lora import has_active_adapters
    from modeling_nv_esm_parallel import ContextParallelLayout, TensorParallelRun, is_sharded, several_ranks


def inference_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The precision `model.esm.embed` and the commands run in: bf16 autocast on CUDA, none (the weights' dtype) on
    the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@dataclass(frozen=True)
class ForwardPrecision:
    """Every precision question of one forward, answered once (`plan_forward`, before the batch is laid out) and
    only read from then on: by the layout (the token multiple), the eager run and the CUDA graphs (`region`, `layer`,
    `recipe`) and the runner choice (`graphable`). Nothing below reads Transformer Engine's FP8 state for these.

    Attributes:
        recipe: the FP8 recipe of the model's own FP8 layers (`config.layer_precision`), or None.
        caller_fp8: FP8 turned on by the caller around the model (`te.autocast(enabled=True, recipe=...)`).
        layer_fp8: per layer, whether it runs in FP8 inside `region` (with `recipe`).
        backend: the layers' backend (`TEBackend` / `TorchBackend`), which makes the regions.
        amax_group: the process group FP8 amaxes are reduced over (tensor or context parallelism), or None.
        attention_fp8: the FP8 recipe in effect (the model's, else the caller's) quantizes attention too
            (`quantizes_attention`), so its FP8 layers run Transformer Engine's own forward (`fp8_attention`).
    """

    recipe: Any
    caller_fp8: bool
    layer_fp8: tuple[bool, ...]
    backend: Backend
    amax_group: Any = None
    attention_fp8: bool = False

    @classmethod
    def of(cls, encoder: nn.Module) -> ForwardPrecision:
        """The precision of a forward of `encoder` called now: its FP8 layers and recipe, and whether the caller
        turned FP8 on around it."""
        ranks = encoder.parallel_ranks  # one set of scales for the weights they share
        caller_recipe = encoder.backend.caller_fp8_recipe()
        return cls(
            recipe=encoder.fp8_recipe,
            caller_fp8=caller_recipe is not None,
            layer_fp8=tuple(precision == "fp8" for precision in encoder.config.run_options.layer_precision or ()),
            backend=encoder.backend,
            amax_group=None if ranks is None else ranks.group,
            attention_fp8=quantizes_attention(encoder.fp8_recipe if encoder.fp8_recipe is not None else caller_recipe),
        )

    @property
    def token_multiple(self) -> int:
        """The token count a run pads to a multiple of: `FP8_TOKEN_MULTIPLE` where FP8 GEMMs run (the model's own FP8
        layers, or the caller's FP8 around it, any recipe), else 1."""
        return FP8_TOKEN_MULTIPLE if self.recipe is not None or self.caller_fp8 else 1

    @property
    def graphable(self) -> bool:
        """False where only the caller's FP8 is on: its recipe and scaling state are not the graphs' to capture."""
        return self.recipe is not None or not self.caller_fp8

    def region(self) -> contextlib.AbstractContextManager:
        """One FP8 autocast around all layers when any layer is FP8 (TE backend only). One region, not one per layer:
        Transformer Engine reduces amaxes and updates scales when the outermost region exits, so per-layer regions
        would repeat that work for every layer."""
        return self.backend.precision_region(self.recipe, self.amax_group)

    def layer(self, index: int) -> contextlib.AbstractContextManager:
        """Inside `region`: FP8 stays on for the FP8 layers and is switched off for the others."""
        if self.recipe is None or self.layer_fp8[index]:
            return contextlib.nullcontext()
        return self.backend.high_precision()

    def fp8_attention(self, index: int) -> bool:
        """Whether layer `index` runs FP8 attention (inside `layer(index)`): Transformer Engine's own forward wires
        it in and rotates q/k itself, so the layer gets its layout without a QKV rotation."""
        return self.attention_fp8 and (self.recipe is None or self.layer_fp8[index])


@dataclass(frozen=True)
class ForwardPlan:
    """How one forward of the encoder runs (`plan_forward`).

    Attributes:
        precision: its `ForwardPrecision`.
        graphed: whether it replays CUDA graphs (eager otherwise; a graphed batch whose shape the graphs choose to
            run eagerly, or whose capture fails, still runs eagerly: `lay_out` and `NVEsmEncoder.forward`).
        per_layer_outputs: the caller asked for every layer's output (`output_hidden_states`).
    """

    precision: ForwardPrecision
    graphed: bool
    per_layer_outputs: bool = False

    def lay_out(
        self, encoder: nn.Module, hidden_states: torch.Tensor, batch: InputBatch, rotary: RotaryTable
    ) -> tuple[torch.Tensor, RunLayout]:
        """The run layout of `batch` (`RunLayout`) and its embeddings laid out for it: padded layers run
        `PaddedRun`; packed layers pad the tokens with dummy proteins (`pad_packed`) to a CUDA graph's static shape
        when this forward replays one (`StaticShapeGraphs.shape_for`), else to the multiple FP8
        (`precision.token_multiple`) and tensor parallelism's ranks need; context parallelism pads each protein
        (`ContextParallelLayout`)."""
        multiple = self.precision.token_multiple
        if batch.packed is None or encoder.config.run_options.attn_input_format == "bshd":
            return PaddedRun.of(hidden_states, batch, rotary, multiple > 1)
        if encoder.context_parallel is not None:
            encoder.backend.check_context_parallel_dtype(hidden_states)
            return hidden_states, ContextParallelLayout.of(
                batch.run_packing, encoder.context_parallel, multiple, rotary, batch
            )
        if encoder.tensor_parallel is not None:
            tp = encoder.tensor_parallel
            return TensorParallelRun.of(hidden_states, batch, rotary, multiple * tp.size, tp=tp)
        shape = encoder.graphs.shape_for(encoder, hidden_states, batch.run_packing) if self.graphed else None
        return PackedRun.of(hidden_states, batch, rotary, multiple, shape)


def plan_forward(encoder: nn.Module, per_layer_outputs: bool = False, attention_maps: bool = False) -> ForwardPlan:
    """The plan of a forward of `encoder` (`NVEsmEncoder`) called now, asking for every layer's output
    (`per_layer_outputs`) or attention maps (`attention_maps`). Made before the inputs are checked (whose device
    sync leaves the GPU idle while the host works). Raises ValueError for what cannot run: a model holding FP8
    weights without an FP8 recipe, attention maps under tensor or context parallelism; RuntimeError while a training
    replay waits for its backward (`_graphed`)."""
    precision = ForwardPrecision.of(encoder)
    if precision.recipe is None and any(encoder.fp8_weight_recipes) and not precision.caller_fp8:
        raise ValueError(
            "this model holds its layers' weights in FP8 (built inside te.quantized_model_init): run it under "
            "te.autocast(enabled=True, recipe=...), or load it with layer_precision and fp8_weights=True."
        )
    if encoder.parallel_ranks is not None and attention_maps:
        raise ValueError(
            "attention maps (output_attentions, predict_contacts) are not supported with tensor or context parallelism."
        )
    graphed = _graphed(encoder, per_layer_outputs or attention_maps, precision)
    return ForwardPlan(precision, graphed, per_layer_outputs)


def _graphed(encoder: nn.Module, per_layer_outputs: bool, precision: ForwardPrecision) -> bool:
    """Whether this forward replays CUDA graphs: `config.cuda_graphs` on the TE backend with packed layers, not
    paused (`NVEsmEncoder.eager`), in train mode with gradients or eval mode without, no per-layer outputs or
    attention maps, activation checkpointing or offloading, layers not sharded by FSDP, no module hooks
    (`StaticShapeGraphs.replayable`, which also drops the graphs when the parameters changed), not inside
    `torch.compile`, another CUDA graph's capture or an `nn.DataParallel` replica, and for training not in a process
    group of several ranks (DDP and DeepSpeed wait for each weight's gradient, which a graph adds to `main_grad`
    instead) unless the caller averages `.grad` itself (`NVEsmEncoder.reduce_gradients_after_backward`).

    Raises RuntimeError while a training replay still waits for its backward: the next call (graphed or not) would
    overwrite memory that backward reads. (A training forward must be followed by its backward; an eager call in
    between gave NaN gradients.)"""
    options = encoder.config.run_options
    if not (options.cuda_graphs and encoder.backend.runs_cuda_graphs and options.attn_input_format == "thd"):
        return False
    if encoder.parallel_ranks is not None:  # eager: the layers' collectives are not captured
        return False
    if encoder.graphs.awaiting_backward():
        raise RuntimeError(
            "cuda_graphs=True: this model ran a training forward whose backward has not run yet, and another "
            "forward now would overwrite what that backward reads. Call backward first (or, to drop that forward, "
            "model.esm.encoder.graphs.clear()), or load the model with cuda_graphs=False to run several forwards "
            "per backward."
        )
    if encoder.graphs_paused or per_layer_outputs or encoder.training != torch.is_grad_enabled():
        return False
    if encoder.training and (encoder.gradient_checkpointing or options.offload_activations):
        return False
    if encoder.training and several_ranks() and not encoder.gradients_reduced_after_backward:
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    if getattr(encoder, "_is_replica", False):  # an nn.DataParallel replica
        return False
    if any(has_active_adapters(layer) for layer in encoder.layers):  # PEFT's adapters: eager
        return False
    if not precision.graphable:
        return False
    return not is_sharded(encoder.layers[0]) and encoder.graphs.replayable(encoder)
