"""LoRA fine-tuning (PEFT) of NVEsm: adapters on the attention QKV and output projections.

The QKV projection is a fused LayerNorm + Linear (`NVEsmLayerNormLinear`) that PEFT does not know, so it gets its
own LoRA layer class, whose adapters read the LayerNormed input as the fused weight does. PEFT is an optional
dependency: it is imported when LoRA is asked for. The export merges the adapters back
(`nv_esm.train.export.export_weights`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from modeling_nv_esm import NVEsmLayerNormLinear
from nv_esm.train.config import ModelConfig


def add_lora(model: nn.Module, settings: ModelConfig) -> nn.Module:
    """`model` wrapped by PEFT with LoRA adapters of rank `settings.lora_rank` (scale `lora_alpha / rank`) on the
    attention QKV and output projections; a classification head (`task` other than mlm) trains fully."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=["layernorm_qkv", "proj"],
        modules_to_save=None if settings.task == "mlm" else ["classifier"],
    )
    lora._register_custom_module({NVEsmLayerNormLinear: lora_layer_norm_linear_class()})
    return get_peft_model(model, lora)


def lora_layer_norm_linear_class() -> type[nn.Module]:
    """PEFT's LoRA layer for `NVEsmLayerNormLinear` (PEFT is optional, so the class is made on demand)."""
    from peft.tuners.lora import LoraLayer

    class LoraLayerNormLinear(nn.Module, LoraLayer):
        """The adapters see the LayerNormed input, as the fused weight does: y = W LN(x) + b + s * B A LN(x)."""

        def __init__(
            self,
            base_layer: nn.Module,
            adapter_name: str,
            config: Any,
            r: int = 0,
            lora_alpha: float = 1,
            **kwargs: Any,
        ):
            super().__init__()
            LoraLayer.__init__(self, base_layer, **kwargs)
            self.out_features, self.in_features = base_layer.weight.shape
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            """`x [..., hidden]` -> `[..., out_features]`: the fused layer's output plus the active adapters'."""
            base = self.base_layer
            result = base(x)
            if self.disable_adapters:
                return result
            normed = F.layer_norm(x, x.shape[-1:], base.layer_norm_weight, base.layer_norm_bias, base.eps)
            for name in self.active_adapters:
                if name in self.lora_A:
                    update = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](normed.to(result.dtype))))
                    result = result + update * self.scaling[name]
            return result

    return LoraLayerNormLinear
