"""LoRA fine-tuning of NVEsm with stock PEFT: the recipe's `--lora-rank` is `LoraConfig` + `get_peft_model`.

Each NVEsm layer names its projections as transformers' `EsmLayer` does (`modeling_nv_esm.LORA_TARGETS`:
`attention.self.query`, ..., `output.dense`), on both backends, so PEFT adapts them as it adapts
`facebook/esm2_*`, and `merge_and_unload` merges into the fused weights. PEFT is an optional dependency: it is
imported when LoRA is asked for. The export merges the adapters with PEFT (`merged_weights`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nv_esm.train.config import ModelConfig


def lora_config(settings: ModelConfig) -> Any:
    """PEFT's `LoraConfig` of a run: rank `lora_rank`, scale `lora_alpha / rank` on `lora_targets`; a
    classification head (`task` other than mlm) trains fully."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.lora_rank,
        lora_alpha=settings.lora_alpha,
        target_modules=list(settings.lora_targets),
        modules_to_save=None if settings.task == "mlm" else ["classifier"],
    )


def lora_fields(settings: ModelConfig) -> dict[str, Any] | None:
    """What the export needs to rebuild a run's adapters (`train_state.json`): rank, alpha, targets; None without."""
    if not settings.lora_rank:
        return None
    return {"rank": settings.lora_rank, "alpha": settings.lora_alpha, "targets": list(settings.lora_targets)}


def lora_settings(fields: dict[str, Any], task: str) -> ModelConfig:
    """The `ModelConfig` LoRA part of a run from its `lora_fields` (what the export rebuilds the adapters with)."""
    return ModelConfig(
        task=task, lora_rank=fields["rank"], lora_alpha=fields["alpha"], lora_targets=tuple(fields["targets"])
    )


def add_lora(model: nn.Module, settings: ModelConfig) -> nn.Module:
    """`model` wrapped by PEFT with the run's LoRA adapters (`lora_config`)."""
    from peft import get_peft_model

    return get_peft_model(model, lora_config(settings))


def merged_weights(model: nn.Module, settings: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict of `model` (a plain NVEsm model, any device, meta included) after taking the PEFT-wrapped
    `state` of a run with `settings` and merging its adapters into the weights (`merge_and_unload`). The tensors
    of `state` are taken, not copied: the merge changes them (one copy of a 15B model's weights in memory)."""
    adapted = add_lora(model, settings)
    adapted.load_state_dict(state, strict=True, assign=True)
    return adapted.merge_and_unload().state_dict()
