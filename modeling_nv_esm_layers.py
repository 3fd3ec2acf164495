"""The encoder layers: the backend decision (`resolve_backend`, Transformer Engine imported on demand), FP8 recipes
and weights held in FP8, the exact PyTorch twin (`NVEsmTorchLayer`), TE's `TransformerLayer` as NVEsm calls it
(`make_te_layer`) and the switch to cuDNN's LayerNorm kernels (`use_cudnn_layer_norm`). Part of the model's Hub
remote code: imports the batch, layout, LoRA and kernels siblings below it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

try:
    from .configuration_nv_esm import NVEsmConfig
    from .modeling_nv_esm_kernels import (
        TRITON_AVAILABLE,
        add_bias_residual,
        add_bias_residual_shapes_fit,
        hash_triton_installation_early,
        rotate_qk,
    )
    from .modeling_nv_esm_layout import RunLayout
    from .modeling_nv_esm_lora import (
        add_lora_targets,
        fused_module_repr,
        has_active_adapters_in,
        mlp_with_updates,
        refuse_adapters_on_fused_modules,
        with_qkv_updates,
        with_update,
    )
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import NVEsmConfig
    from modeling_nv_esm_kernels import (
        TRITON_AVAILABLE,
        add_bias_residual,
        add_bias_residual_shapes_fit,
        hash_triton_installation_early,
        rotate_qk,
    )
    from modeling_nv_esm_layout import RunLayout
    from modeling_nv_esm_lora import (
        add_lora_targets,
        fused_module_repr,
        has_active_adapters_in,
        mlp_with_updates,
        refuse_adapters_on_fused_modules,
        with_qkv_updates,
        with_update,
    )

logger = logging.get_logger(__name__)

TE_INSTALL_HINT = (
    "Install NVIDIA Transformer Engine for PyTorch on a CUDA machine "
    "(pip install --no-build-isolation 'transformer-engine[pytorch]'), "
    "or run the PyTorch implementation: from_pretrained(..., backend='torch'), or --backend torch on the nv-esm "
    "command line."
)


@functools.cache
def transformer_engine_available() -> bool:
    """Whether `transformer_engine.pytorch` imports in this environment."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # ImportError, or a broken install raising OSError/RuntimeError on load
        return False
    return True


def import_transformer_engine(module: str = "pytorch") -> Any:
    """Return `transformer_engine.<module>` (`transformer_engine.pytorch` by default), or raise an ImportError that
    says how to install it: the one way the model code imports Transformer Engine."""
    if not transformer_engine_available():
        raise ImportError(f"backend='te' needs Transformer Engine, which does not import here. {TE_INSTALL_HINT}")
    return importlib.import_module(f"transformer_engine.{module}")


@functools.cache
def _fp8_state_manager() -> Any:
    """Transformer Engine's `FP8GlobalStateManager` (found once: the model asks it at every forward), or None."""
    if not transformer_engine_available():
        return None
    for name in ("pytorch.quantization", "pytorch.fp8"):  # TE >= 2.8 / older
        try:
            return import_transformer_engine(name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    return None


def quantizes_attention(recipe: Any) -> bool:
    """Whether FP8 `recipe` (None: no FP8) quantizes attention too (`fp8_dpa` / `fp8_mha`): Transformer Engine's own
    layer forward wires that in, so such a layer leaves the rotation of q/k to TE (`NVEsmTELayer.forward`)."""
    return bool(getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False))


def caller_fp8_recipe() -> Any:
    """The recipe of a caller's FP8 autocast around the model's call (`te.autocast(enabled=True, recipe=...)`), or
    None where FP8 is off there or TE is missing."""
    manager = _fp8_state_manager()
    if manager is None or not manager.is_fp8_enabled():
        return None
    return manager.get_fp8_recipe()


def caller_fp8_weights_recipe() -> Any:
    """The recipe of a caller's `te.quantized_model_init` around the model's construction (TE modules built now hold
    their weights in FP8 with it), or None outside one."""
    manager = _fp8_state_manager()
    if manager is None or not manager.with_fp8_parameters():
        return None
    return manager.get_fp8_recipe()


def fp8_weights_init(recipe: Any) -> contextlib.AbstractContextManager:
    """Transformer Engine's `quantized_model_init` (`fp8_model_init` before TE 2.8): TE modules built inside hold
    their weights in FP8 quantized with `recipe`, or in high precision when `recipe` is None."""
    te = import_transformer_engine()
    init = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    return init(enabled=recipe is not None, recipe=recipe)


def fp8_value(parameter: torch.Tensor, value: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """What to copy into `parameter` to give it `value`: `value` itself, or for a weight held in FP8 (a TE quantized
    tensor) `value` quantized by the parameter's own quantizer, so that the copy takes the FP8 data and scales as
    they are. Per-tensor delayed scaling first gets the scale its recipe would reach for `value` (`fp8 max / amax`),
    not the 1.0 it starts with; `amax`, where `value` is one shard of a weight, is the whole weight's largest
    magnitude (every shard then gets the same scale, as FSDP2's all-gather of FP8 data assumes). Raises RuntimeError
    when the FP8 values are more than 10% (relative norm) from `value`: a quantization gone wrong must not become
    silently wrong outputs."""
    if not is_fp8_tensor(parameter):
        return value
    quantizer = parameter._quantizer
    value = value.detach().to(parameter.device, parameter.dtype)
    usages = parameter.get_usages()  # the copy takes FP8 data as it is only when the layouts match
    quantizer.set_usage(rowwise=usages.get("rowwise", True), columnwise=usages.get("columnwise", False))
    if type(quantizer).__name__ == "Float8Quantizer":  # delayed scaling
        name = getattr(quantizer.dtype, "name", str(quantizer.dtype))  # TE's DType enum: str() is its number
        fp8_max = torch.finfo(torch.float8_e4m3fn if "E4M3" in name else torch.float8_e5m2).max
        largest = (value.abs().max() if amax is None else amax).float().clamp(min=torch.finfo(torch.float32).tiny)
        quantizer.scale.copy_((fp8_max / largest).to(quantizer.scale))
    quantized = quantizer.quantize(value)
    error = (quantized.dequantize().float() - value.float()).norm() / value.float().norm().clamp(min=1e-30)
    if error > 0.1:
        raise RuntimeError(
            f"quantizing a weight to FP8 ({type(quantizer).__name__}) is off by {error.item():.0%}; this "
            "Transformer Engine version holds FP8 weights differently: load the model without fp8_weights"
        )
    return quantized


def is_fp8_tensor(tensor: object) -> bool:
    """Whether `tensor` is a Transformer Engine quantized (FP8) tensor: a weight held in FP8 (`fp8_weights`)."""
    return hasattr(tensor, "_quantizer") and hasattr(tensor, "dequantize")


def holds_fp8_weights(layer: nn.Module) -> bool:
    """Whether a TE layer's weights are FP8 tensors (`quantized_model_init`), also as FSDP2's shards (DTensors whose
    local tensors are)."""
    return any(is_fp8_tensor(getattr(parameter, "_local_tensor", parameter)) for parameter in layer.parameters())


def make_fp8_recipe(name: str) -> Any:
    """The Transformer Engine recipe object for `config.fp8_recipe`."""
    recipe = import_transformer_engine("common.recipe")
    return {
        "delayed": recipe.DelayedScaling,
        "current": recipe.Float8CurrentScaling,
        "block": recipe.Float8BlockScaling,
    }[name]()


def gelu(x: torch.Tensor) -> torch.Tensor:
    """ESM's exact (erf) GELU."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class NVEsmLayerNormLinear(nn.Module):
    """LayerNorm then Linear, with the parameter names of `transformer_engine.pytorch.LayerNormLinear` (split
    column-parallel from outside: `modeling_nv_esm_parallel.tensor_parallel_layer`)."""

    def __init__(self, in_features: int, out_features: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return with_qkv_updates(self, normed, F.linear(normed, self.weight, self.bias))

    def extra_repr(self) -> str:
        return fused_module_repr(self, "layernorm_qkv")


class NVEsmLinear(nn.Module):
    """Linear with the parameter names of `transformer_engine.pytorch.Linear` (the attention output projection;
    not an `nn.Linear`, so that PEFT adapts it only as `attention.output.dense`, as on TE; split row-parallel from
    outside)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_update(self.__dict__.get("lora_targets"), x, F.linear(x, self.weight, self.bias))

    def extra_repr(self) -> str:
        return fused_module_repr(self, "proj")


def recomputed(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """`function(x)`; with `recompute` and gradients, run again in the backward instead of keeping activations."""
    if recompute and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)
    return function(x)


class NVEsmLayerNormMLP(nn.Module):
    """LayerNorm, fc1, GELU, fc2, with the parameter names of `transformer_engine.pytorch.LayerNormMLP` (split from
    outside: `intermediate_size` a rank's part)."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float, recompute: bool = False) -> None:
        """`recompute` (`config.recompute_mlp`): `recomputed` (TE's `LayerNormMLP(checkpoint=True)` skips fc2)."""
        super().__init__()
        self.eps = eps
        self.recompute = recompute
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden_size))
        self.fc1_weight = nn.Parameter(torch.empty(intermediate_size, hidden_size))
        self.fc1_bias = nn.Parameter(torch.zeros(intermediate_size))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._mlp, x, self.recompute)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_with_updates(self, x, gelu, add_fc2_bias=True)

    def extra_repr(self) -> str:
        return fused_module_repr(self, "layernorm_mlp")


class NVEsmSelfAttention(nn.Module):
    """Pre-LN rotary self-attention with the parameter names of TE's `MultiheadAttention`.

    `layernorm_qkv.weight` rows are interleaved per head, `[h0: q, k, v | h1: q, k, v | ...]`, as TE's
    default `qkv_weight_interleaved=True`. Attention is `torch.nn.functional.scaled_dot_product_attention`.
    Of `parts` of the heads (tensor parallelism), one: `num_attention_heads / parts` heads.
    """

    def __init__(self, config: NVEsmConfig, parts: int = 1) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // parts
        self.head_dim = config.head_dim
        self.dropout = config.attention_probs_dropout_prob
        width = self.num_heads * self.head_dim
        self.layernorm_qkv = NVEsmLayerNormLinear(config.hidden_size, 3 * width, config.layer_norm_eps)
        self.proj = NVEsmLinear(width, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, layout: RunLayout) -> torch.Tensor:
        """`[B, S, hidden]` (BSHD) or `[T, hidden]` (THD) -> same shape; the layout gives the attention view."""
        view = layout.attention_view(self.layernorm_qkv(hidden_states), self.num_heads, self.head_dim)
        context = F.scaled_dot_product_attention(
            view.query,
            view.key,
            view.value,
            attn_mask=None if view.key_mask is None else view.key_mask[:, None, None, :],
            dropout_p=self.dropout if self.training else 0.0,
            scale=1.0,
        )
        return self.proj(layout.from_attention_view(context))


class NVEsmTorchLayer(nn.Module):
    """Pure-PyTorch twin of `transformer_engine.pytorch.TransformerLayer` as NVEsm configures it; with `parts`, the
    shapes of one of that many parts of the heads and MLP columns, which `modeling_nv_esm_parallel` makes a
    tensor-parallel layer of (as `set_parallel_mode=True, sequence_parallel=True` configures TE's)."""

    def __init__(self, config: NVEsmConfig, parts: int = 1) -> None:
        super().__init__()
        self.self_attention = NVEsmSelfAttention(config, parts)
        self.layernorm_mlp = NVEsmLayerNormMLP(
            config.hidden_size,
            config.intermediate_size // parts,
            config.layer_norm_eps,
            recompute=config.recompute_mlp,
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        attention = self.self_attention
        add_lora_targets(self, attention.layernorm_qkv, attention.proj, self.layernorm_mlp, config)

    def forward(self, hidden_states: torch.Tensor, layout: RunLayout) -> torch.Tensor:
        refuse_adapters_on_fused_modules(self)
        hidden_states = hidden_states + self.dropout(self.self_attention(hidden_states, layout))
        return hidden_states + self.dropout(self.layernorm_mlp(hidden_states))


@functools.cache
def te_layer_class() -> type[nn.Module]:
    """`NVEsmTELayer`: TE's `TransformerLayer` called as the twin is, `layer(hidden_states, layout)`.

    Built on first use, as it subclasses a Transformer Engine class. Its parameters and state dict are
    `TransformerLayer`'s, unchanged."""
    te = import_transformer_engine()
    hash_triton_installation_early()  # its kernels' first launch would wait for it
    try:
        onnx_export_mode = import_transformer_engine("pytorch.export").is_in_onnx_export_mode
    except (ImportError, AttributeError):
        onnx_export_mode = torch.onnx.is_in_onnx_export

    class NVEsmTELayerNormLinear(te.LayerNormLinear):
        """TE's fused LayerNorm + QKV projection, plus the query/key/value adapters' updates when PEFT added any."""

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
            qkv = super().forward(inp, *args, **kwargs)
            if not has_active_adapters_in(self.__dict__.get("lora_targets")):
                return qkv
            normed = F.layer_norm(inp, inp.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
            return with_qkv_updates(self, normed, qkv)

    class NVEsmTELinear(te.Linear):
        """TE's attention output projection, plus the `attention.output.dense` adapter's update."""

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            result = super().forward(inp, *args, **kwargs)
            targets = self.__dict__.get("lora_targets")
            if isinstance(result, tuple):  # (output, bias) with return_bias
                return (with_update(targets, inp, result[0]), *result[1:])
            return with_update(targets, inp, result)

    class NVEsmTELayerNormMLP(te.LayerNormMLP):
        """TE's fused LayerNorm + MLP; with fc1/fc2 adapters, the same computation unfused (TE's tanh GELU)."""

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            target_groups = self.__dict__.get("lora_targets", ())
            if not any(has_active_adapters_in(targets) for targets in target_groups):
                return super().forward(inp, *args, **kwargs)
            gelu_tanh = functools.partial(F.gelu, approximate="tanh")
            unfused = functools.partial(mlp_with_updates, self, activation=gelu_tanh, add_fc2_bias=not self.return_bias)
            output = recomputed(unfused, inp, getattr(self, "checkpoint", False))  # `recompute_mlp`, as TE's path
            return (output, self.fc2_bias) if self.return_bias else output

    split_along_dim = import_transformer_engine("pytorch.utils").SplitAlongDim

    class NVEsmTEMultiheadAttention(te.MultiheadAttention):
        """TE's self-attention block, with a forward that rotates the fused QKV projection where it lies."""

        def rotated_forward(self, hidden_states: torch.Tensor, layout: RunLayout) -> tuple[torch.Tensor, Any]:
            """`[T, hidden]` or `[B, S, hidden]` -> (projection output, its bias), as TE's forward returns them:
            LayerNorm + QKV (`[T', heads * 3 * head_dim]`; T' = all tokens under tensor parallelism, whose
            sequence-parallel input holds this rank's), `rotate_qk` on the queries and keys (`layout.qkv_rotation`),
            TE's attention on views of the packed `[..., heads, 3, head_dim]` projection (TE finds the packed
            layout: no copy, and its backward writes one packed gradient, which `SplitAlongDim`'s backward takes as
            it lies), output projection."""
            qkv = self.layernorm_qkv(hidden_states)
            rotation = layout.qkv_rotation
            heads, head_dim = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
            packed = (*qkv.shape[:-1], heads, 3, head_dim)
            qkv = rotate_qk(qkv.view(-1, heads, 3, head_dim), rotation.positions, rotation.cos, rotation.sin)
            query, key, value = (part.squeeze(-2) for part in split_along_dim.apply(qkv.view(packed), -2, (1, 1, 1)))
            context = self.core_attention(query, key, value, qkv_format=self.qkv_format, **layout.attention_kwargs)
            return self.proj(context)

    class NVEsmTELayer(te.TransformerLayer):
        def __init__(self, *args: Any, config: NVEsmConfig, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            attention = self.self_attention
            attention.__class__ = NVEsmTEMultiheadAttention
            attention.layernorm_qkv.__class__ = NVEsmTELayerNormLinear  # same state, forwards that add adapters
            attention.proj.__class__ = NVEsmTELinear
            self.layernorm_mlp.__class__ = NVEsmTELayerNormMLP
            # Unquantized GEMMs: fc1's bias and GELU in its cuBLASLt epilogue (and GELU's derivative in fc2's
            # backward one) instead of TE's separate bias + GELU kernel, which reads and writes fc1's output again.
            self.layernorm_mlp.bias_gelu_nvfusion = False
            if config.recompute_mlp and not hasattr(self.layernorm_mlp, "checkpoint"):
                raise ImportError("recompute_mlp needs TE >= 2.11 (LayerNormMLP(checkpoint=True)); upgrade it.")
            self.layernorm_mlp.checkpoint = config.recompute_mlp  # TE's selective checkpointing: fc1, GELU again
            add_lora_targets(self, attention.layernorm_qkv, attention.proj, self.layernorm_mlp, config)
            # `rotated_forward` hands TE's attention q/k/v views of the packed projection on purpose: the split's
            # backward takes TE's packed gradient as it lies. TE >= 2.20's declarative `qkv_layer=` derives the
            # views with `select`, whose backward adds three zero-filled copies of that gradient. TE's deprecation
            # note on the detection is silenced, that one message only (a TE without the detection makes q/k/v
            # contiguous: a copy, same numbers).
            warnings.filterwarnings("ignore", "Relying on pointer-based detection of packed q/k/v", DeprecationWarning)

        def forward(self, hidden_states: torch.Tensor, layout: RunLayout) -> torch.Tensor:  # type: ignore[override]
            """`[B, S, hidden]` (BSHD) or `[T, hidden]` (THD) -> same shape. TE's `TransformerLayer.forward` as
            NVEsm configures it (pre-LN encoder layer, bias-dropout-add residuals), with the attention block's
            `rotated_forward`; TE's own forward where the layout leaves the rotation to TE (`QKVRotation.of`; the
            encoder's `run_layers` also hands a layer that runs FP8 attention a layout without one)."""
            refuse_adapters_on_fused_modules(self)
            if layout.qkv_rotation is None:
                return super().forward(hidden_states, **layout.te_kwargs)
            hidden_states = hidden_states.contiguous()
            if torch.is_autocast_enabled("cuda"):
                hidden_states = hidden_states.to(torch.get_autocast_dtype("cuda"))
            attention_output, attention_bias = self.self_attention.rotated_forward(hidden_states, layout)
            hidden_states = self._bias_dropout_add(attention_output, attention_bias, hidden_states, self.drop_path)
            mlp_output, mlp_bias = self.layernorm_mlp(hidden_states)
            return self._bias_dropout_add(mlp_output, mlp_bias, hidden_states, self.drop_path)

        def _bias_dropout_add(
            self, hidden_state: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, drop_path: Any = None
        ) -> torch.Tensor:
            """`residual + (hidden_state + bias)` (`[..., hidden]`, bias `[hidden]`) where no dropout applies (ESM-2's
            hidden dropout is 0, and none in eval mode): one Triton kernel (`add_bias_residual`), not TE's
            `torch.compile`d function, which each new process compiles (seconds) and new shapes compile again. TE's
            own with dropout, a drop path, other shapes (e.g. TE's parallel attention + MLP), no Triton or in an
            ONNX export."""
            no_dropout = not self.training or self.hidden_dropout == 0
            fits = bias is not None and add_bias_residual_shapes_fit(hidden_state, bias, residual)
            plain = TRITON_AVAILABLE and hidden_state.is_cuda and not onnx_export_mode()
            if drop_path is None and no_dropout and fits and plain:
                return add_bias_residual(hidden_state, bias, residual)
            return super()._bias_dropout_add(hidden_state, bias, residual, drop_path)

    classes = (NVEsmTELayerNormLinear, NVEsmTELinear, NVEsmTELayerNormMLP, NVEsmTEMultiheadAttention, NVEsmTELayer)
    for cls in classes:
        cls.__qualname__ = cls.__name__  # module-level names, so that models pickle (torch.save(model))
        globals()[cls.__name__] = cls
    return NVEsmTELayer


def make_te_layer(
    config: NVEsmConfig,
    layer_number: int,
    tensor_parallel: Any = None,
    params_dtype: torch.dtype | None = None,
) -> nn.Module:
    """A Transformer Engine `TransformerLayer` (`te_layer_class`) shaped as ESM-2's layer `layer_number` (1-based);
    with `tensor_parallel` (a `RankGroup` of the parallel sibling), this rank's part of it (`set_parallel_mode`,
    sequence parallelism). Parameters in `params_dtype` (default: torch's default dtype)."""
    init_method = functools.partial(nn.init.normal_, mean=0.0, std=config.initializer_range)
    on_meta = torch.get_default_device().type == "meta"
    parallel: dict[str, Any] = {}
    if tensor_parallel is not None:
        parallel = dict(
            set_parallel_mode=True,
            tp_group=tensor_parallel.group,
            tp_size=tensor_parallel.size,
            sequence_parallel=True,
        )
    return te_layer_class()(
        config=config,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        layernorm_epsilon=config.layer_norm_eps,
        hidden_dropout=config.hidden_dropout_prob,
        attention_dropout=config.attention_probs_dropout_prob,
        init_method=init_method,
        output_layer_init_method=init_method,
        layer_number=layer_number,
        kv_channels=config.head_dim,
        self_attn_mask_type="padding",
        layer_type="encoder",
        fuse_qkv_params=True,
        qkv_weight_interleaved=True,
        bias=True,
        activation=config.hidden_act,
        normalization="LayerNorm",
        attn_input_format=config.attn_input_format,
        params_dtype=params_dtype or torch.get_default_dtype(),
        device="meta" if on_meta else "cuda",
        **parallel,
    )


def runs_in_fp32(hidden_states: torch.Tensor) -> bool:
    """Whether layers given `hidden_states` compute in fp32: fp32 states (the weights' dtype, also under FSDP2's
    mixed precision) and no autocast to a 16-bit dtype."""
    if torch.is_autocast_enabled(hidden_states.device.type):
        return torch.get_autocast_dtype(hidden_states.device.type) == torch.float32
    return hidden_states.dtype == torch.float32


class TorchBackend(str):
    """The PyTorch twin's layers (`NVEsmTorchLayer`): any device, no FP8, no CUDA graphs. One of the two backend
    objects (`resolve_backend`); the model asks its backend instead of testing a name. A `str` equal to its name
    (`"torch"`, `"te"`), so that code written when `resolve_backend` returned the name (comparing it, passing it as
    `backend=`) keeps working."""

    runs_fp8 = False
    runs_cuda_graphs = False  # CUDA graphs capture Transformer Engine's layers only

    @property
    def name(self) -> str:
        """`"torch"` or `"te"`, a plain `str`."""
        return str(self)

    def check_config(self, config: NVEsmConfig) -> None:
        """Refuse what this backend cannot run (`fp8_weights`); warn about what it runs without (FP8 layers, cuDNN's
        LayerNorm)."""
        if config.fp8_weights:
            raise ValueError("fp8_weights holds weights in Transformer Engine's FP8 tensors: needs backend='te'.")
        if config.uses_fp8:
            logger.warning_once("layer_precision asks for FP8, which needs backend='te'; running without FP8.")
        if config.cudnn_layer_norm:
            logger.warning_once("cudnn_layer_norm switches Transformer Engine's LayerNorm; backend='torch' ignores it.")

    def use_cudnn_layer_norm(self) -> None:
        """Run the LayerNorms of the layers with cuDNN's kernels (`config.cudnn_layer_norm`): nothing to switch here."""

    def fp8_recipe(self, config: NVEsmConfig) -> Any:
        """The FP8 recipe of the model's FP8 layers (None: none run in FP8)."""
        return None

    def caller_fp8_weights_recipe(self) -> Any:
        """The recipe of a caller's `te.quantized_model_init` around the model's construction, or None."""
        return None

    def caller_fp8_recipe(self) -> Any:
        """The recipe of a caller's FP8 autocast around the model's call, or None."""
        return None

    def make_layer(
        self,
        config: NVEsmConfig,
        layer_number: int,
        tensor_parallel: Any = None,
        params_dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """ESM-2's layer `layer_number` (1-based); with `tensor_parallel`, the shapes of this rank's part of it
        (`modeling_nv_esm_parallel.tensor_parallel_layer` makes the part)."""
        layer = NVEsmTorchLayer(config, 1 if tensor_parallel is None else tensor_parallel.size)
        return layer if params_dtype is None else layer.to(params_dtype)

    def make_layers(self, config: NVEsmConfig, weight_recipes: list[Any]) -> nn.ModuleList:
        """The encoder's `config.num_hidden_layers` layers; `weight_recipes`: per layer, the FP8 recipe its weights
        are to be held in, or None (`NVEsmEncoder.fp8_weight_recipes`; only Transformer Engine's layers hold any)."""
        return nn.ModuleList(self.make_layer(config, i + 1) for i in range(config.num_hidden_layers))

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError if the layers cannot run inputs on `device`."""

    def checkpoint(self, layer: nn.Module, states: torch.Tensor, layout: Any, checkpoint_function: Any) -> Any:
        """`layer(states, layout)`, recomputed in backward (`checkpoint_function`: the one transformers'
        `gradient_checkpointing_enable` set, with its arguments)."""
        return checkpoint_function(layer.__call__, states, layout)

    def precision_region(self, recipe: Any, group: Any) -> contextlib.AbstractContextManager:
        """The region all layers run in: FP8 with `recipe` (amaxes reduced over `group`), when there is one."""
        return contextlib.nullcontext()

    def high_precision(self) -> contextlib.AbstractContextManager:
        """Inside `precision_region`: FP8 off (a layer kept in high precision)."""
        return contextlib.nullcontext()

    def join_context_parallel(self, layers: nn.ModuleList, context_parallel: Any) -> None:
        """Let `layers` exchange keys and values over `context_parallel` (the twin gathers them in its layout)."""

    def check_context_parallel_dtype(self, hidden_states: torch.Tensor) -> None:
        """Raise ValueError if context-parallel attention cannot run in the layers' compute dtype."""


class TEBackend(TorchBackend):
    """Transformer Engine's `TransformerLayer` (`make_te_layer`) on CUDA: FP8 recipes, weights held in FP8, CUDA
    graphs, TE's checkpointing and context-parallel attention."""

    runs_fp8 = True
    runs_cuda_graphs = True

    def check_config(self, config: NVEsmConfig) -> None:
        pass

    def use_cudnn_layer_norm(self) -> None:
        """Switch TE's LayerNorms, forward and backward, in any model of the process, to cuDNN's kernels: TE's own
        flags (`nvte_enable_cudnn_norm_fwd/bwd`, which `NVTE_NORM_FWD_USE_CUDNN` / `NVTE_NORM_BWD_USE_CUDNN` set at
        TE's first LayerNorm), and those variables, which TE's PyTorch extension reads at each LayerNorm of an FP8
        layer under current scaling."""
        import_transformer_engine()
        library = getattr(import_transformer_engine("common"), "_TE_LIB_CTYPES", None)
        switches = [getattr(library, f"nvte_enable_cudnn_norm_{stage}", None) for stage in ("fwd", "bwd")]
        if None in switches:
            raise ImportError(
                "cudnn_layer_norm needs a Transformer Engine library with nvte_enable_cudnn_norm_fwd (TE 2.20 has "
                "it); or set NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1 before the process starts."
            )
        for switch in switches:
            switch.argtypes, switch.restype = [ctypes.c_bool], None
            switch(True)
        os.environ.update(NVTE_NORM_FWD_USE_CUDNN="1", NVTE_NORM_BWD_USE_CUDNN="1")

    def fp8_recipe(self, config: NVEsmConfig) -> Any:
        return make_fp8_recipe(config.fp8_recipe) if config.uses_fp8 else None

    def caller_fp8_weights_recipe(self) -> Any:
        return caller_fp8_weights_recipe()

    def caller_fp8_recipe(self) -> Any:
        return caller_fp8_recipe()

    def make_layer(
        self,
        config: NVEsmConfig,
        layer_number: int,
        tensor_parallel: Any = None,
        params_dtype: torch.dtype | None = None,
    ) -> nn.Module:
        return make_te_layer(config, layer_number, tensor_parallel, params_dtype)

    def make_layers(self, config: NVEsmConfig, weight_recipes: list[Any]) -> nn.ModuleList:
        """High precision first, inside a caller's `te.quantized_model_init` too: `hold_fp8_weights` quantizes the
        weights with fitting scales afterwards. On the meta device (no weights yet) each layer is built inside
        `quantized_model_init` with its `weight_recipes` entry instead: Transformer Engine makes its weights FP8
        tensors where they are materialised (`init_empty_weights`), FSDP2's shards too."""
        on_meta = torch.get_default_device().type == "meta"
        layers = []
        for index in range(config.num_hidden_layers):
            with fp8_weights_init(weight_recipes[index] if on_meta else None):
                layers.append(self.make_layer(config, index + 1))
        return nn.ModuleList(layers)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"This model runs Transformer Engine layers, which need CUDA tensors; got inputs on {device}. "
                "Move the model and inputs to a GPU, or load the model with backend='torch' (nv-esm: --backend torch) "
                "to run on the CPU."
            )

    def checkpoint(self, layer: nn.Module, states: torch.Tensor, layout: Any, checkpoint_function: Any) -> Any:
        """TE's checkpoint: it keeps FP8 scaling state consistent when recomputing."""
        return import_transformer_engine().checkpoint(layer, states, layout, use_reentrant=False)

    def precision_region(self, recipe: Any, group: Any) -> contextlib.AbstractContextManager:
        if recipe is None:
            return contextlib.nullcontext()
        return import_transformer_engine().autocast(enabled=True, recipe=recipe, amax_reduction_group=group)

    def high_precision(self) -> contextlib.AbstractContextManager:
        return import_transformer_engine().autocast(enabled=False)

    def join_context_parallel(self, layers: nn.ModuleList, context_parallel: Any) -> None:
        stream, ranks = torch.cuda.Stream(), list(context_parallel.ranks)
        for layer in layers:
            exchange = context_parallel.te_exchange(layer.self_attention.num_attention_heads_per_partition)
            layer.set_context_parallel_group(context_parallel.group, ranks, stream, cp_comm_type=exchange)

    def check_context_parallel_dtype(self, hidden_states: torch.Tensor) -> None:
        if runs_in_fp32(hidden_states):
            raise ValueError(
                "context parallelism on Transformer Engine needs 16-bit layers (its context-parallel attention "
                "kernels take bf16 or fp16): cast the model (model.to(torch.bfloat16)) or run under torch.autocast."
            )


Backend = TorchBackend | TEBackend  # either backend object (`resolve_backend`)
BACKEND_OBJECTS = {"te": TEBackend("te"), "torch": TorchBackend("torch")}


def resolve_backend(backend: str, device: torch.device | str | None = None) -> TorchBackend:
    """The backend object (`TEBackend` or `TorchBackend`) for a `config.backend` value (`"auto"`, `"te"`,
    `"torch"`) and a model to run on `device` (None: the GPU when one is visible). `"auto"` is Transformer Engine
    when it is installed and the model runs on CUDA; `"te"` where that does not hold raises ValueError saying what
    is missing. The one decider of the model and of every command (`nv-esm embed`, `nv-esm train`, `nv-esm convert
    verify`); `.name` is `"te"` or `"torch"`."""
    if backend not in ("auto", "te", "torch"):
        raise ValueError(f"backend must be 'auto', 'te' or 'torch', got {backend!r}.")
    if backend == "torch":
        return BACKEND_OBJECTS["torch"]
    on_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if backend == "te":
        if not on_cuda:
            where = "no CUDA GPU is visible" if device is None else f"this run is on {device}"
            raise ValueError(
                f"backend 'te' runs Transformer Engine layers on a CUDA GPU, and {where}. {TE_INSTALL_HINT}"
            )
        if not transformer_engine_available():
            raise ValueError(f"backend 'te' needs Transformer Engine, which does not import here. {TE_INSTALL_HINT}")
    return BACKEND_OBJECTS["te" if on_cuda and transformer_engine_available() else "torch"]
