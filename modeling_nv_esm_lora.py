"""LoRA for fused layers: `NVEsmLoraTarget`s under transformers' names for stock PEFT to wrap, and the updates the
fused modules (TE's or the twin's) add to their outputs.

Part of the model's Hub remote code: imports nothing of the model's other files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .configuration_nv_esm import NVEsmConfig
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import NVEsmConfig

# PEFT target names: transformers' `EsmLayer` paths of each layer's projections, so that a `LoraConfig` written for
# `facebook/esm2_*` (e.g. `target_modules=["query", "key", "value", "dense"]`) adapts the same projections here.
LORA_TARGETS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)

# transformers' ESM module paths -> NVEsm's, for PEFT adapters saved from transformers' ESM-2 models (`EsmForMaskedLM`,
# token or sequence classification; `EsmModel` without `esm.`): the models' `_checkpoint_conversion_mapping`, which
# `PeftModel.from_pretrained` and `load_adapter` apply to an adapter's keys (regex -> replacement, the first match
# only, without the `base_model.model.` prefix). Each layer is `layers.N` here, its projections keep transformers'
# names (`LORA_TARGETS`), and the LM head's LayerNorm and bias live in its fused decoder (a `modules_to_save` head);
# no NVEsm key matches. Vocabulary-sized tensors get their padding rows on load (`adapter_load_pre_hook`).
TRANSFORMERS_ADAPTER_KEYS = {
    r"^((?:esm\.)?encoder)\.layer\.(\d+)\.": r"\1.layers.\2.",
    r"^lm_head\.layer_norm\.(weight|bias)$": r"lm_head.decoder.layer_norm_\1",
    r"^lm_head\.bias$": "lm_head.decoder.bias",
}
# A PEFT adapter's tensor in a model's state dict (LoRA's `lora_A.NAME...`, `modules_to_save.NAME...`): group 1 is
# the adapter's name.
ADAPTER_TENSOR = re.compile(r"\.(?:lora_\w+|modules_to_save)\.([^.]+)(?:\.|$)")
ADAPTER_CONVERSION = "nv-esm convert hf-to-te ADAPTER_DIR OUT_DIR"

# The fused modules of a layer and the `LORA_TARGETS` inside each: what to target instead of the module itself.
FUSED_MODULE_TARGETS = {
    "layernorm_qkv": '"query", "key", "value"',
    "proj": '"attention.output.dense"',
    "layernorm_mlp": '"intermediate.dense", "output.dense"',
}


def fused_module_refusal(name: str) -> str:
    """Why a LoRA adapter on the fused module `name` (a key of `FUSED_MODULE_TARGETS`) is refused, and what to
    target instead."""
    return (
        f"a LoRA adapter on `{name}` is not supported: it is a fused module (its adapter would see the input before "
        f"the LayerNorm and could not merge). Target its projections by their transformers names: "
        f'{FUSED_MODULE_TARGETS[name]} ("dense" alone: all three dense projections).'
    )


def fused_module_repr(module: nn.Module, name: str) -> str:
    """The `extra_repr` of a twin's fused module `name`: what LoRA should target instead (PEFT's error for an
    adapter on it shows the module's repr), or "" for a module no layer fuses (the LM head's decoder)."""
    if "lora_targets" not in module.__dict__:
        return ""
    return f"fused: LoRA targets {FUSED_MODULE_TARGETS[name]}, not this module"


class _FusedRows(torch.Tensor):
    """Rows of a fused weight, gathered into a tensor; assigning its `.data` writes them back.

    `NVEsmLoraTarget.weight` for query/key/value, whose rows interleave per head in `layernorm_qkv.weight`: PEFT
    merges an adapter with `weight.data += delta` (or `weight.data = merged`), so the fused weight takes it."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results of operations are plain tensors

    @staticmethod
    def __new__(cls, fused: torch.Tensor, rows: torch.Tensor) -> _FusedRows:
        gathered = fused.detach().index_select(0, rows)
        tensor = torch.Tensor._make_subclass(cls, gathered)
        tensor._fused, tensor._rows, tensor._gathered = fused, rows, gathered
        return tensor

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return self._gathered

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._fused.data.index_copy_(0, self._rows, value.to(self._fused.dtype))
        self._gathered = value


class NVEsmLoraTarget(nn.Linear):
    """One projection of a layer under its transformers name (`LORA_TARGETS`), for PEFT to attach LoRA adapters to.

    Stock PEFT wraps it as it wraps any `nn.Linear`. It holds no weight of its own: `forward` returns 0, so PEFT's
    wrapper returns just the adapters' update, which the fused module it stands for (QKV, output projection, fc1 or
    fc2, on both backends) adds to its own output. `weight` and `bias` are that module's parameters (for query, key
    and value, their rows of the fused QKV weight), so PEFT's merge (`merge_and_unload`) writes into them.
    """

    def __init__(
        self, fused: nn.Module, parameter: str, in_features: int, out_features: int, part: int | None, heads: int
    ) -> None:
        nn.Module.__init__(self)  # no parameters: nn.Linear's __init__ would make some
        self.in_features, self.out_features = in_features, out_features
        self.__dict__["_fused"] = fused  # a plain reference: the layer holds the fused module
        self._parameter, self._part, self._heads = parameter, part, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(())

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self._fused_part(f"{self._parameter}weight")

    @property
    def bias(self) -> torch.Tensor:  # type: ignore[override]
        return self._fused_part(f"{self._parameter}bias")

    def _fused_part(self, name: str) -> torch.Tensor:
        tensor = getattr(self._fused, name)
        if self._part is None:
            return tensor
        head_dim = tensor.shape[0] // (3 * self._heads)  # rows [h0: q, k, v | h1: q, k, v | ...]
        heads = torch.arange(self._heads, device=tensor.device)[:, None] * 3 * head_dim
        rows = heads + self._part * head_dim + torch.arange(head_dim, device=tensor.device)
        return _FusedRows(tensor, rows.flatten())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class NVEsmLoraTargets(nn.Module):
    """A group of `NVEsmLoraTarget`s (as transformers' `EsmAttention`, `EsmIntermediate`, ... are of Linears)."""


def add_lora_targets(layer: nn.Module, qkv: nn.Module, proj: nn.Module, mlp: nn.Module, config: NVEsmConfig) -> None:
    """Give `layer` its `LORA_TARGETS` and tell each fused module (`qkv`: LayerNorm + QKV, `proj`, `mlp`: LayerNorm
    + fc1 + GELU + fc2; TE's or the twins) which targets' updates to add (`lora_targets`, plain attributes)."""
    hidden, heads = config.hidden_size, config.num_attention_heads

    def target_group(**targets: nn.Module) -> NVEsmLoraTargets:
        module = NVEsmLoraTargets()
        for name, target in targets.items():
            module.add_module(name.rstrip("_"), target)
        return module

    attention_self = target_group(
        **{
            name: NVEsmLoraTarget(qkv, "", hidden, hidden, part, heads)
            for part, name in enumerate(("query", "key", "value"))
        }
    )
    attention_self.num_heads = heads  # how `with_qkv_updates` interleaves the updates
    attention_output = target_group(dense=NVEsmLoraTarget(proj, "", hidden, hidden, None, heads))
    intermediate = target_group(dense=NVEsmLoraTarget(mlp, "fc1_", hidden, config.intermediate_size, None, heads))
    output = target_group(dense=NVEsmLoraTarget(mlp, "fc2_", config.intermediate_size, hidden, None, heads))
    layer.attention = target_group(self_=attention_self, output=attention_output)
    layer.intermediate, layer.output = intermediate, output
    qkv.__dict__["lora_targets"] = attention_self
    proj.__dict__["lora_targets"] = attention_output
    mlp.__dict__["lora_targets"] = (intermediate, output)


def _updates(targets: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The updates of the targets in `targets` for input `x` (0 where an adapter is off), or None when none has one."""
    if not has_active_adapters_in(targets):
        return None
    return [target(x) for target in targets._modules.values()]


def with_qkv_updates(fused: nn.Module, normed: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """`qkv [..., 3 * hidden]` (rows interleaved per head) plus the query/key/value adapters' updates of the
    LayerNormed input `normed`."""
    targets = fused.__dict__.get("lora_targets")
    updates = None if targets is None else _updates(targets, normed)
    if updates is None:
        return qkv
    heads = targets.num_heads
    shape = (*qkv.shape[:-1], qkv.shape[-1] // 3)
    parts = [update.to(qkv.dtype).expand(shape).unflatten(-1, (heads, -1)) for update in updates]
    return qkv + torch.stack(parts, dim=-2).flatten(-3)


def with_update(targets: nn.Module | None, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`output` plus the update of the one target (`dense`) in `targets` for its input `x`."""
    updates = None if targets is None else _updates(targets, x)
    return output if updates is None else output + updates[0].to(output.dtype)


def has_active_adapters_in(targets: nn.Module | None) -> bool:
    """Whether PEFT has wrapped any target of `targets` (a `NVEsmLoraTargets`)."""
    return targets is not None and any(type(target) is not NVEsmLoraTarget for target in targets._modules.values())


def has_active_adapters(layer: nn.Module) -> bool:
    """Whether PEFT has wrapped any of `layer`'s `LORA_TARGETS`."""
    folders = (layer.attention.self, layer.attention.output, layer.intermediate, layer.output)
    return any(has_active_adapters_in(targets) for targets in folders)


def mlp_with_updates(
    mlp: nn.Module, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor], add_fc2_bias: bool
) -> torch.Tensor:
    """LayerNorm -> fc1 (+ update) -> `activation` -> fc2 (+ update), unfused, from `mlp`'s parameters (the twin's
    or TE's `LayerNormMLP`); without fc2's bias unless `add_fc2_bias`."""
    intermediate, output = mlp.__dict__.get("lora_targets", (None, None))
    normed = F.layer_norm(x, x.shape[-1:], mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps)
    hidden = with_update(intermediate, normed, F.linear(normed, mlp.fc1_weight, mlp.fc1_bias))
    activated = activation(hidden)
    return with_update(output, activated, F.linear(activated, mlp.fc2_weight, mlp.fc2_bias if add_fc2_bias else None))


def refuse_adapters_on_fused_modules(layer: nn.Module) -> None:
    """ValueError when PEFT wrapped a fused module of `layer` itself: its adapter would see the input before the
    LayerNorm (or TE's tuple output) and could not merge; the `LORA_TARGETS` are the projections inside."""
    for name, module in (
        ("layernorm_qkv", layer.self_attention.layernorm_qkv),
        ("proj", layer.self_attention.proj),
        ("layernorm_mlp", layer.layernorm_mlp),
    ):
        if getattr(module, "base_layer", None) is not None:
            raise ValueError(fused_module_refusal(name))


def adapter_load_pre_hook(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Before `model` (an NVEsm model) loads a state dict: pad the vocabulary-sized tensors of PEFT adapters (a
    `modules_to_save` LM head or a LoRA on the embedding, saved from transformers' ESM-2 with `vocab_size` rows)
    with zero rows to the model's `padded_vocab_size`, as the converter pads the model's own; and note which
    adapters the state dict holds, for `adapter_load_post_hook`. A head model does it for its encoder model too."""
    if model.__dict__.pop("_adapter_load_in_outer_model", False):
        return  # the head model holding this one (its `base_model`) pads and checks for both
    if model.base_model is not model:
        model.base_model.__dict__["_adapter_load_in_outer_model"] = True
    config = model.config
    adapters, padded = set(), {}
    for key, tensor in state_dict.items():
        match = ADAPTER_TENSOR.search(key) if key.startswith(prefix) else None
        if match is None:
            continue
        adapters.add(match.group(1))
        target = _tensor_at(model, key[len(prefix) :])
        if target is None or target.shape == tensor.shape or target.ndim != tensor.ndim:
            continue
        grown = [d for d, (a, b) in enumerate(zip(tensor.shape, target.shape)) if a != b]
        if len(grown) == 1 and (tensor.shape[grown[0]], target.shape[grown[0]]) == (
            config.vocab_size,
            config.padded_vocab_size,
        ):
            padding = list(tensor.shape)
            padding[grown[0]] = config.padded_vocab_size - config.vocab_size
            padded[key] = torch.cat([tensor, tensor.new_zeros(padding)], dim=grown[0])
    state_dict.update(padded)
    loading_adapters = adapters or prefix.startswith("base_model.")  # a PeftModel loads (`set_peft_model_state_dict`)
    model.__dict__["_adapter_load"] = (prefix, adapters) if loading_adapters else None


def adapter_load_post_hook(model: nn.Module, incompatible: Any) -> None:
    """After `model` loaded a PEFT adapter's state dict (see `adapter_load_pre_hook`): ValueError, in one line,
    when a tensor of it has no place in the model or a tensor of the loaded adapters is not in it. PEFT would only
    warn and run the model without them."""
    loading = model.__dict__.pop("_adapter_load", None)
    if loading is None:
        return
    prefix, adapters = loading
    unexpected = [
        key[len(prefix) :]
        for key in incompatible.unexpected_keys
        if key.startswith(prefix) and not key.endswith("._extra_state")
    ]
    missing = []
    for key in incompatible.missing_keys:
        match = ADAPTER_TENSOR.search(key) if key.startswith(prefix) else None
        if match is not None and match.group(1) in adapters:
            missing.append(key[len(prefix) :])
    if not unexpected and not missing:
        return
    parts = [f"{len(names)} {what} (e.g. {', '.join(names[:3])})" for what, names in (
        ("tensors of the adapter have no place in this model", unexpected),
        ("tensors of the adapter are not in the file", missing),
    ) if names]  # fmt: skip
    raise ValueError(
        f"The PEFT adapter does not fit this {type(model).__name__}: {'; '.join(parts)}. An adapter saved from "
        f"transformers' ESM-2 loads as it is (keys renamed by `_checkpoint_conversion_mapping`), or convert it "
        f"with `{ADAPTER_CONVERSION}`; an adapter of another model or shape does not load."
    )


def _tensor_at(module: nn.Module, name: str) -> torch.Tensor | None:
    """The parameter or buffer `name` (a state dict key relative to `module`), or None if there is none."""
    found: nn.Module | torch.Tensor | None = module
    for part in name.split("."):
        if not isinstance(found, nn.Module):
            return None
        children = (found._parameters, found._buffers, found._modules)
        found = next((child[part] for child in children if child.get(part) is not None), None)
    return found if isinstance(found, torch.Tensor) else None
