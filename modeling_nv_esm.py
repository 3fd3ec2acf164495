"""NVEsm: the ESM-2 protein language model on NVIDIA Transformer Engine, with an exact PyTorch twin.

The encoder layers are `transformer_engine.pytorch.TransformerLayer` when Transformer Engine (TE) is used,
and `NVEsmTorchLayer` otherwise: a pure-PyTorch layer with the same parameter names and shapes, so one
checkpoint loads into either. Everything else (embeddings, rotary table, heads) is plain PyTorch.

Inputs come padded (BSHD: `input_ids [B, S]` with `attention_mask [B, S]`) or packed (THD: the tokens of
N proteins concatenated, `input_ids [1, T]`, described by `cu_seq_lens_q [N + 1]` or by `position_ids`
that restart at 0 for every protein). The layers run in `config.attn_input_format`; inputs of the other
layout are converted inside the model and outputs come back in the layout of the inputs.

Transformer Engine is imported lazily: importing this file never needs it.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

# Every sibling is imported here directly: older transformers (5.6, the oldest supported) copies only the model
# file's direct relative imports into its modules cache (tests/test_layout.py checks it).
try:
    from .configuration_nv_esm import NVEsmConfig
    from .modeling_nv_esm_batch import (
        InputBatch,
        PackedSequences,
        check_extra_inputs,
        check_tensor,
        first_token_states,
        length_sorted_batches,
        pack_proteins,
        pool_proteins,
        protein_residues,
        raise_on_failed_checks,
        wants_dict,
    )
    from .modeling_nv_esm_encoder import NVEsmEncoder
    from .modeling_nv_esm_graphs import StaticShapeGraphs
    from .modeling_nv_esm_kernels import rotate_qk
    from .modeling_nv_esm_layers import (
        NVEsmLayerNormLinear,
        fp8_value,
        gelu,
        holds_fp8_weights,
        is_fp8_tensor,
        resolve_backend,
    )
    from .modeling_nv_esm_layout import RunLayout
    from .modeling_nv_esm_lora import (
        TRANSFORMERS_ADAPTER_KEYS,
        NVEsmLoraTarget,
        adapter_load_post_hook,
        adapter_load_pre_hook,
    )
    from .modeling_nv_esm_parallel import ContextParallel, ContextParallelLayout, RankGroup
    from .modeling_nv_esm_plan import inference_autocast, plan_forward
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import NVEsmConfig
    from modeling_nv_esm_batch import (
        InputBatch,
        PackedSequences,
        check_extra_inputs,
        check_tensor,
        first_token_states,
        length_sorted_batches,
        pack_proteins,
        pool_proteins,
        protein_residues,
        raise_on_failed_checks,
        wants_dict,
    )
    from modeling_nv_esm_encoder import NVEsmEncoder
    from modeling_nv_esm_graphs import StaticShapeGraphs
    from modeling_nv_esm_kernels import rotate_qk
    from modeling_nv_esm_layers import (
        NVEsmLayerNormLinear,
        fp8_value,
        gelu,
        holds_fp8_weights,
        is_fp8_tensor,
        resolve_backend,
    )
    from modeling_nv_esm_layout import RunLayout
    from modeling_nv_esm_lora import (
        TRANSFORMERS_ADAPTER_KEYS,
        NVEsmLoraTarget,
        adapter_load_post_hook,
        adapter_load_pre_hook,
    )
    from modeling_nv_esm_parallel import ContextParallel, ContextParallelLayout, RankGroup
    from modeling_nv_esm_plan import inference_autocast, plan_forward

# ESM-2 was trained masking 15% of tokens, 80% of those with <mask>: token dropout rescales to this ratio.
MASK_RATIO_TRAIN = 0.15 * 0.8


class NVEsmEmbeddings(nn.Module):
    """Token embeddings with ESM's token dropout. `padded_vocab_size` rows; rows past `vocab_size` are zero."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size, config.pad_token_id)
        self.token_dropout = config.token_dropout
        self.mask_token_id = config.mask_token_id

    def forward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, sequence_index: torch.Tensor | None
    ) -> torch.Tensor:
        """Embed `input_ids`, padded `[B, S]` (`sequence_index` None) or packed `[T]` (`sequence_index [T]`).

        `lengths [N]` are the tokens of each protein, for the token-dropout ratio of that protein.
        """
        embeddings = self.word_embeddings(input_ids)
        if not self.token_dropout:
            return embeddings
        is_mask = input_ids == self.mask_token_id
        embeddings = embeddings.masked_fill(is_mask.unsqueeze(-1), 0.0)
        if sequence_index is None:
            masked_per_protein = is_mask.sum(-1).float()
        else:
            masked_per_protein = torch.zeros(lengths.shape, device=input_ids.device).index_add_(
                0, sequence_index, is_mask.float()
            )
        scale = (1 - MASK_RATIO_TRAIN) / (1 - masked_per_protein / lengths)
        scale = scale[:, None, None] if sequence_index is None else scale[sequence_index][:, None]
        return (embeddings * scale).to(embeddings.dtype)


class NVEsmRotaryEmbedding(nn.Module):
    """Rotary angle table. `inv_freq` is a buffer, so checkpoints carry the exact values they trained with, and it
    stays float32 when the model is cast to bf16/fp16: a bf16 `inv_freq` (0.4% steps) would turn positions near
    1000 by up to a radian."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", self.default_inv_freq(config), persistent=True)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        original = self.inv_freq
        super()._apply(fn, recurse)
        if not original.is_meta and self.inv_freq.dtype != original.dtype:
            self.inv_freq = original.to(self.inv_freq.device)
        return self

    @staticmethod
    def default_inv_freq(config: NVEsmConfig) -> torch.Tensor:
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        return 1.0 / (config.rope_theta**exponents)

    def forward(self, length: int) -> torch.Tensor:
        """`[length, head_dim]` float32 angles `position * inv_freq`, the half table repeated twice."""
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        return torch.cat((freqs, freqs), dim=-1)


class NVEsmContactPredictionHead(nn.Module):
    """Weights of ESM's contact-prediction regression (`esm.contact_head` in transformers), used by
    `NVEsmModel.predict_contacts` through `StreamedContacts`."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.regression = nn.Linear(config.num_hidden_layers * config.num_attention_heads, 1)


class NVEsmLMHead(nn.Module):
    """dense -> GELU -> LayerNorm -> decoder (+bias); the LayerNorm is fused into `decoder` as in TE."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.decoder = NVEsmLayerNormLinear(config.hidden_size, config.padded_vocab_size, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` -> logits `[..., vocab_size]`: the padded vocabulary rows cut off, into a tensor of its own
        (a view of the padded product would lose FSDP2's backward hook to a caller's in-place op; torch warns so)."""
        return self.decoder(gelu(self.dense(hidden_states)))[..., : self.vocab_size].contiguous()


@dataclass
class NVEsmModelOutput(BaseModelOutputWithPooling):
    """`BaseModelOutputWithPooling` plus `cu_seq_lens` (`[N + 1]`) when the inputs were packed. `pooler_output`
    (models built with `add_pooling_layer=True`): `[B, hidden]` padded, `[N, hidden]` packed."""

    cu_seq_lens: torch.Tensor | None = None


class NVEsmPooler(nn.Module):
    """transformers' `EsmPooler`: dense -> tanh on each protein's first token (`<cls>`)."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N, hidden]`."""
        return torch.tanh(self.dense(first_token_states))


def initial_value(
    name: str,
    module: nn.Module,
    shape: tuple[int, ...],
    config: NVEsmConfig,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """NVEsm's one weight-initialisation rule: the initial value of parameter `name` (its name in `module`, or a
    longer name ending so) of `module`, of `shape`, on `device`, drawn from `generator` (the default one if None).
    `_init_weights` applies it to a new model, the trainer to every parameter it does not load
    (`nv_esm.train.materialize`, drawing each whole tensor from a generator of its own).

    - zeros: biases (`bias`, the fused modules' `*_bias`) and LoRA's B;
    - ones: LayerNorm gains (`nn.LayerNorm`'s `weight`, the fused modules' `layer_norm_weight`);
    - normal(0, `config.initializer_range`): every other weight; in an embedding, the padding row and the rows past
      `config.vocab_size` (the padded vocabulary) zero;
    - LoRA's A: normal(0, 1 / sqrt(fan_in)).
    """
    short = name.rsplit(".", 1)[-1]
    if short == "bias" or short.endswith("_bias") or "lora_B" in name:
        return torch.zeros(shape, device=device)
    if short == "layer_norm_weight" or (isinstance(module, nn.LayerNorm) and short == "weight"):
        return torch.ones(shape, device=device)
    std = 1 / math.sqrt(shape[1]) if "lora_A" in name else config.initializer_range
    value = torch.randn(shape, generator=generator, device=device) * std
    if isinstance(module, nn.Embedding):
        value[config.vocab_size :] = 0
        if module.padding_idx is not None:
            value[module.padding_idx] = 0
    return value


def assign_value(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """`parameter.copy_(value)`, `value` of the parameter's whole shape, whatever holds the parameter: a tensor, a
    Transformer Engine FP8 tensor (`value` quantized by its own quantizer: `fp8_value`), or a shard of FSDP2's (a
    DTensor: this rank's part of `value`, cut as its `Shard` placements cut the whole; an FP8 shard is scaled for
    the whole weight's largest magnitude, agreed over the mesh, so that every rank's FP8 data reads alike)."""
    amax = None
    if hasattr(parameter, "device_mesh"):  # a DTensor
        mesh, coordinate = parameter.device_mesh, parameter.device_mesh.get_coordinate()
        for mesh_dim, placement in enumerate(parameter.placements):
            if placement.is_shard() and type(placement).__name__ != "Shard":  # e.g. FSDP2 over DTensor TP's shards
                raise ValueError(
                    f"init_empty_weights: {placement} placements are not supported; shard with FSDP2 only."
                )
            if placement.is_shard():
                chunks = value.chunk(mesh.size(mesh_dim), dim=placement.dim)
                index = coordinate[mesh_dim]
                value = chunks[index] if index < len(chunks) else value.narrow(placement.dim, 0, 0)
        parameter = parameter.to_local()
        if is_fp8_tensor(parameter):
            amax = value.abs().amax() if value.numel() else value.new_zeros(())
            for mesh_dim in range(mesh.ndim):
                torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=mesh.get_group(mesh_dim))
    parameter.copy_(fp8_value(parameter, value, amax))


class NVEsmPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading rules shared by NVEsm models."""

    config_class = NVEsmConfig
    config: NVEsmConfig
    base_model_prefix = "esm"
    supports_gradient_checkpointing = True
    accepts_loss_kwargs = False
    _no_split_modules = ["NVEsmTorchLayer", "NVEsmTELayer", "NVEsmEmbeddings"]
    _keys_to_ignore_on_load_unexpected = [r"\._extra_state$"]
    # PEFT renames the keys of adapters saved from transformers' ESM-2 through it (`TRANSFORMERS_ADAPTER_KEYS`).
    _checkpoint_conversion_mapping = TRANSFORMERS_ADAPTER_KEYS

    def post_init(self) -> None:
        """transformers' `post_init`; then PEFT adapters loaded into the model get their vocabulary padding, and
        one that does not fit is refused instead of ignored (`adapter_load_pre_hook`, `adapter_load_post_hook`)."""
        super().post_init()
        self.register_load_state_dict_pre_hook(adapter_load_pre_hook)
        self.register_load_state_dict_post_hook(adapter_load_post_hook)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether activation checkpointing is on: transformers' deprecated name, which PEFT's `get_peft_model`
        still reads, answered without transformers' FutureWarning (a user could do nothing about it)."""
        return any(getattr(module, "gradient_checkpointing", False) for module in self.modules())

    @torch.no_grad()
    def _init_weights(self, module: nn.Module, initialised: set[int] | None = None, prefix: str = "") -> None:
        """transformers' per-module initialisation of a new model: `initial_value` for each parameter of `module`,
        ESM's rotary frequencies for its rotary table. `initialised`: the ids of parameters given their value
        already (a tied one is given the value of its first module's rule), to which `module`'s are added;
        `prefix`: the module's name in the model (LoRA's A and B are told by it)."""
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if tensors and all(getattr(tensor, "_is_hf_initialized", False) for tensor in tensors):
            return  # loaded by from_pretrained: transformers < 5.13 skips these itself only for Hub remote code
        if isinstance(module, NVEsmLoraTarget):
            return  # its `weight` is a fused module's, initialised there
        if isinstance(module, NVEsmRotaryEmbedding):
            module.inv_freq.copy_(module.default_inv_freq(self.config))
        for name, parameter in module.named_parameters(recurse=False):
            if initialised is not None:
                if id(parameter) in initialised:
                    continue
                initialised.add(id(parameter))
            full_name = f"{prefix}.{name}" if prefix else name
            value = initial_value(full_name, module, tuple(parameter.shape), self.config, device=parameter.device)
            assign_value(parameter, value)

    @torch.no_grad()
    def init_empty_weights(self, device: torch.device | str | None = None) -> None:
        """Materialise a model built on the meta device (`with torch.device("meta"): model = Class(config)`), also
        after FSDP2's `fully_shard` or PEFT's `get_peft_model`: every tensor moves to `device` (default: the current
        CUDA device, else the CPU) and takes its initial value (`initial_value`, from the default generator: seed
        every rank alike; the rotary table ESM's frequencies); the decoder is tied to the embedding again (FSDP2
        keeps them shared). The layers built to hold their weights in FP8 (`fp8_weights`, NVIDIA's
        `use_quantized_model_init`, or a caller's `te.quantized_model_init` around the build) get Transformer Engine
        FP8 tensors (DTensors of them under FSDP2) holding those values, with fitting scales. ValueError for a model
        that holds weights already (they would be lost) or a device its layers cannot run on. NVIDIA's BioNeMo
        ESM-2 has a method of this name."""
        if not any(parameter.is_meta for parameter in self.parameters()):
            raise ValueError(
                "init_empty_weights materialises a model built on the meta device; this one holds its weights already "
                "(they would be replaced by fresh ones)."
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        encoder = self.base_model.encoder
        encoder.backend.check_device(torch.device(device))
        self.to_empty(device=device)
        decoder = self.get_output_embeddings()
        if decoder is not None and decoder.weight is not self.get_input_embeddings().weight:
            self.tie_weights()  # `to_empty` gave the decoder a tensor of its own (FSDP2's keeps the one they share)
        for module in self.modules():  # built inside quantized_model_init: TE makes its weights FP8 tensors
            if getattr(module, "primary_weights_in_fp8", False) and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        initialised: set[int] = set()
        for name, module in self.named_modules():
            self._init_weights(module, initialised, name)
        for index, recipe in enumerate(encoder.fp8_weight_recipes):
            layer = encoder.layers[index]
            if recipe is not None and not holds_fp8_weights(layer):  # built on meta otherwise than torch.device
                if any(hasattr(parameter, "device_mesh") for parameter in layer.parameters()):
                    raise ValueError(
                        f"layer {index} was to hold its weights in FP8 but was built outside torch.device('meta') "
                        "(e.g. accelerate's init_empty_weights): build the model under torch.device('meta') before "
                        "fully_shard."
                    )
                encoder.hold_fp8_weights()  # rebuilt in FP8 from the values just given
                break

    def enable_tensor_parallel(self, tp_group: Any) -> None:
        """Split the encoder layers over the ranks of the `torch.distributed` process group `tp_group`
        (`NVEsmEncoder.enable_tensor_parallel`). Every rank of the group calls it, then runs the same batches and
        gets the same outputs. After each backward, call `reduce_partial_gradients` before the optimizer step: the
        LayerNorm and output-bias gradients of the layers hold each rank's share. `save_pretrained` is refused
        afterwards: each rank holds part of each layer."""
        self.base_model.encoder.enable_tensor_parallel(RankGroup.of(tp_group))

    def reduce_partial_gradients(self, averaged: bool = False) -> None:
        """Under tensor or context parallelism, after backward: sum over the group the layer gradients that each
        rank computed from its own tokens only (`NVEsmEncoder.partial_gradients`), so every rank holds the whole
        gradient. `averaged=True` where a wrapper (FSDP2 or DDP over the context-parallel ranks) already averaged
        them over the group: they are multiplied by the group's size instead."""
        self.base_model.encoder.reduce_partial_gradients(averaged)

    def runs_eagerly(self) -> contextlib.AbstractContextManager:
        """Within: every forward runs eagerly and the CUDA graphs captured before stay as they are
        (`NVEsmEncoder.eager`; e.g. a validation pass between training steps that replay graphs)."""
        return self.base_model.encoder.eager()

    def reduce_gradients_after_backward(self, enabled: bool = True) -> None:
        """For a training loop whose ranks each hold the whole model and average `.grad` themselves after the
        step's backwards: training forwards may replay CUDA graphs in a process group of several ranks
        (`NVEsmEncoder.reduce_gradients_after_backward`); `layer_gradients` says when each layer's are ready."""
        self.base_model.encoder.reduce_gradients_after_backward(enabled)

    def layer_gradients(self) -> tuple[list[list[nn.Parameter]], list[tuple[Any, torch.Tensor]] | None]:
        """Per layer, the GEMM weights whose gradients a training replay writes, and after a replayed backward the
        event and flat gradient view of each layer (`NVEsmEncoder.layer_gradients`)."""
        return self.base_model.encoder.layer_gradients()

    def enable_context_parallel(self, cp_group: Any) -> None:
        """Run the encoder layers across the ranks of the `torch.distributed` process group `cp_group`
        (`NVEsmEncoder.enable_context_parallel`). Every rank of the group calls it, then runs the same batches and
        gets the same outputs. After each backward, call `reduce_partial_gradients` before the optimizer step:
        every layer gradient holds each rank's share."""
        self.base_model.encoder.enable_context_parallel(ContextParallel.of(cp_group))

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' `from_pretrained`; then, with `fp8_weights=True` (or inside a caller's
        `te.quantized_model_init`), the loaded FP8 layers' weights are quantized (`NVEsmEncoder.hold_fp8_weights`)."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) when asked
        model.base_model.encoder.hold_fp8_weights()
        return loaded

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        if self.base_model.encoder.tensor_parallel is not None:
            raise ValueError(
                "save_pretrained: this model's layers are split over tensor-parallel ranks (each holds part of each "
                "weight); save a whole model (e.g. export the recipe's checkpoint: nv-esm train export)."
            )
        return super().save_pretrained(*args, **kwargs)

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """transformers' `resize_token_embeddings` for ESM-2's padded vocabulary and tied LM decoder.

        The vocabulary becomes `new_num_tokens` tokens (`config.vocab_size`; logits `[..., new_num_tokens]`); the
        embedding, the LM decoder (tied to it) and the decoder's bias get `padded_vocab_size` rows, a multiple of 16
        (and of `pad_to_multiple_of`), zero past the vocabulary. Added tokens start at the mean of the old tokens'
        embeddings and biases (`mean_resizing`, transformers' default) or as freshly initialised weights (normal
        embedding rows, zero bias). Shrinking keeps the first `new_num_tokens` tokens; the special tokens must stay.
        Returns the new input embedding; `new_num_tokens=None` changes nothing.
        """
        embedding = self.get_input_embeddings()
        if new_num_tokens is None:
            return embedding
        config = self.config
        special = max(config.pad_token_id, config.mask_token_id, config.bos_token_id, config.eos_token_id)
        if not isinstance(new_num_tokens, int) or new_num_tokens <= special:
            raise ValueError(f"new_num_tokens must be an int above the special token ids (> {special}).")
        multiple = math.lcm(16, pad_to_multiple_of or 1)
        padded_vocab_size = -(-new_num_tokens // multiple) * multiple
        old_vocab_size = config.vocab_size

        def resized(rows: torch.Tensor, initial: Callable[[torch.Tensor], None]) -> nn.Parameter:
            new_rows = rows.new_zeros(padded_vocab_size, *rows.shape[1:])
            kept = min(old_vocab_size, new_num_tokens)
            new_rows[:kept] = rows[:kept]
            if new_num_tokens > old_vocab_size:
                if mean_resizing:
                    new_rows[old_vocab_size:new_num_tokens] = rows[:old_vocab_size].mean(dim=0)
                else:
                    initial(new_rows[old_vocab_size:new_num_tokens])
            return nn.Parameter(new_rows, requires_grad=rows.requires_grad)

        std = config.initializer_range
        with torch.no_grad():
            new_embedding = nn.Embedding(padded_vocab_size, config.hidden_size, config.pad_token_id)
            new_embedding.weight = resized(embedding.weight, lambda rows: rows.normal_(0.0, std))
            self.set_input_embeddings(new_embedding)
            head = getattr(self, "lm_head", None)
            if head is not None:
                head.decoder.bias = resized(head.decoder.bias, lambda rows: rows.zero_())
                if config.tie_word_embeddings:
                    head.decoder.weight = new_embedding.weight
                else:
                    head.decoder.weight = resized(head.decoder.weight, lambda rows: rows.normal_(0.0, std))
                head.vocab_size = new_num_tokens
        config.vocab_size = new_num_tokens
        config.padded_vocab_size = padded_vocab_size
        return new_embedding


class NVEsmModel(NVEsmPreTrainedModel):
    """ESM-2 encoder: embeddings, rotary table, transformer layers, final LayerNorm.

    The layers' backend is resolved once, when the model is built (`resolve_backend`), and held by the encoder
    (`encoder.backend`, the object every backend-dependent step asks).
    """

    # The task models' heads, which a base model loaded from their checkpoints leaves out by design (transformers
    # would list them in a LOAD REPORT that the user can do nothing about).
    _keys_to_ignore_on_load_unexpected = [r"\._extra_state$", r"^lm_head\.", r"^classifier\."]

    def __init__(self, config: NVEsmConfig, add_pooling_layer: bool = True) -> None:
        """`add_pooling_layer`: as transformers' `EsmModel`, a dense + tanh pooler over each protein's `<cls>`
        state (`pooler_output`); ESM-2's checkpoints hold no pooler, so it starts untrained. The task models
        build their `esm` without it."""
        super().__init__(config)
        config.run_options.check(config.num_hidden_layers)  # as set by from_pretrained's keywords, after the config
        self.embeddings = NVEsmEmbeddings(config)
        self.rotary_embeddings = NVEsmRotaryEmbedding(config)
        self.encoder = NVEsmEncoder(config, resolve_backend(config.backend))
        self.contact_head = NVEsmContactPredictionHead(config)
        self.pooler = NVEsmPooler(config) if add_pooling_layer else None
        self.post_init()

    def _adjust_missing_and_unexpected_keys(self, loading_info: Any) -> None:
        """transformers' load-time filter of missing and unexpected keys, which also leaves the pooler out of the
        missing ones when the checkpoint has none of it (every ESM-2 checkpoint: the pooler starts untrained, as
        the class says, and a LOAD REPORT about it asks nothing of the user). A checkpoint holding part of a
        pooler still has the rest reported."""
        super()._adjust_missing_and_unexpected_keys(loading_info)
        if self.pooler is not None:
            pooler = {f"pooler.{name}" for name, _ in self.pooler.named_parameters()}
            if pooler <= loading_info.missing_keys:
                loading_info.missing_keys -= pooler

    @property
    def backend(self) -> str:
        """`"te"` or `"torch"`: the layers' backend, resolved from `config.backend` when the model was built."""
        return self.encoder.backend.name

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> NVEsmModelOutput | tuple:
        r"""Encode proteins.

        Padded (BSHD): `input_ids [B, S]` (or `inputs_embeds [B, S, hidden]`), optional `attention_mask [B, S]`
        (1 = token, 0 = padding, on the left and/or right of each protein). Outputs are `[B, S, ...]`, zeros at
        padding.

        Packed (THD): `input_ids [1, T]` or `[T]`, with `cu_seq_lens_q [N + 1]` (int32, as
        `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives; `cu_seq_lens_k` must equal it) and
        optionally `max_length_q`/`max_length_k` (int, at least the longest protein); or with
        `position_ids [1, T]` alone, restarting at 0 for each protein. Outputs are `[1, T, ...]`, and every
        protein's outputs equal what it gets alone.

        Returns `NVEsmModelOutput` with `last_hidden_state`, `hidden_states` (embedding output and each layer's
        output, the last one after the final LayerNorm), `attentions` (with `output_attentions`: one tensor of
        softmax probabilities per layer; padded inputs `[B, heads, S, S]` as transformers, zeros at padded queries
        and keys; packed inputs `[N, heads, L, L]`, protein i in the top-left `length_i x length_i` block of row i,
        L = `max_length`) and, for packed inputs, `cu_seq_lens`. Attention maps come from an explicit pass per layer
        (the fused kernels form none): memory grows with N x heads x L^2 per layer.
        """
        check_extra_inputs(kwargs, self.config.check_inputs)
        if getattr(self, "_is_replica", False) and (cu_seq_lens_q is not None or cu_seq_lens_k is not None):
            raise ValueError(
                "nn.DataParallel (what transformers' Trainer uses on several GPUs when the script is not started by "
                "torchrun or accelerate launch) cuts every input along its first dimension, which a packed batch (one "
                "row with cu_seq_lens) does not have. Start the script with `torchrun --nproc-per-node N` or "
                "`accelerate launch` (one process per GPU), or run it on one GPU (CUDA_VISIBLE_DEVICES=0)."
            )
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        # planned before the input checks: their device sync would leave the GPU idle through this host work
        plan = plan_forward(self.encoder, output_hidden_states, output_attentions)
        batch = self._prepare_inputs(
            input_ids,
            attention_mask,
            position_ids,
            inputs_embeds,
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            max_length_k,
        )
        hidden_states = self._embed(input_ids, inputs_embeds, batch)
        maps: list[torch.Tensor] = []
        last_hidden_state, all_hidden_states = self.encoder(
            hidden_states, batch, self.rotary_embeddings, plan, maps.append if output_attentions else None
        )
        cu_seq_lens = batch.packed.cu_seq_lens if batch.input_is_packed else None
        pooler_output = None
        if self.pooler is not None:
            pooler_output = self.pooler(first_token_states(last_hidden_state, cu_seq_lens, attention_mask))
        output = NVEsmModelOutput(
            last_hidden_state=last_hidden_state,
            pooler_output=pooler_output,
            hidden_states=all_hidden_states,
            attentions=tuple(batch.maps_to_input_layout(m).to(last_hidden_state.dtype) for m in maps) or None,
            cu_seq_lens=cu_seq_lens,
        )
        return output if wants_dict(return_dict, self.config) else output.to_tuple()

    @torch.no_grad()
    def predict_contacts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | None = None,
        max_length_k: int | None = None,
    ) -> torch.Tensor:
        """Contact probabilities between residues, as transformers' `EsmModel.predict_contacts`: ESM-2's contact
        regression over every layer's attention maps (symmetrized, average-product corrected), then a sigmoid.

        Streamed: each layer's maps go into the regression as they are formed, so memory stays near one layer's
        maps (a 1,000-residue protein through 33 layers x 20 heads would hold 2.6 GB of fp32 maps otherwise).

        Padded `input_ids [B, S]` (with `attention_mask`) give `[B, S - 2, S - 2]`; packed inputs (`cu_seq_lens_q`
        or `position_ids`, as in `forward`) give `[N, L - 2, L - 2]`, L the longest protein. Protein i's residues
        (its tokens after the first, `<cls>`, `<eos>` excluded) fill the top-left block of row i, in order; the
        rest is 0. For right-padded input this is transformers' output at every residue pair.
        """
        batch = self._prepare_inputs(
            input_ids, attention_mask, position_ids, None, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k
        )
        hidden_states = self._embed(input_ids, None, batch)
        contacts = StreamedContacts(self.contact_head.regression, batch.run_token_ids(input_ids), self.config)
        plan = plan_forward(self.encoder, attention_maps=True)
        self.encoder(hidden_states, batch, self.rotary_embeddings, plan, contacts.add_layer)
        result = contacts.probabilities()
        if batch.input_is_packed:
            return result
        room = input_ids.shape[1] - 2 - result.shape[-1]
        return F.pad(result, (0, room, 0, room))

    @torch.no_grad()
    def embed(
        self,
        sequences: list[str],
        tokenizer: Any,
        layer: int = -1,
        pooling: str = "mean",
        max_tokens_per_batch: int = 16384,
        show_progress: bool = True,
        strip_stop: bool = False,
    ) -> torch.Tensor:
        """Per-protein embeddings `[len(sequences), hidden]` (float32, on the CPU, in the input order).

        Proteins are tokenized, sorted by length and packed into THD batches of at most `max_tokens_per_batch`
        tokens (a longer protein runs alone); on CUDA the model runs under bf16 autocast.

        Args:
            sequences: A list of amino-acid strings (one-letter codes of ESM-2's alphabet, either case), any lengths
                up to `max_protein_length - 2`; another character, or one string instead of a list, raises
                ValueError (`protein_residues`: the rule of `nv-esm embed` and `nv-esm train` too).
            tokenizer: The ESM tokenizer of this checkpoint (`AutoTokenizer.from_pretrained(...)`).
            layer: Which hidden state: 0 is the embedding output, `num_hidden_layers` (or -1) the final one.
            pooling: `"mean"` over the residues (without `<cls>`/`<eos>`), or `"cls"` (the `<cls>` token).
            max_tokens_per_batch: Token budget of one packed batch.
            show_progress: Show a progress bar over proteins.
            strip_stop: Remove one trailing `*` (a stop codon's mark in UniProt-style files) instead of refusing it.
        """
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        num_states = self.config.num_hidden_layers + 1
        layer = _whole_number("layer", layer)
        if not -num_states <= layer < num_states:
            raise ValueError(f"layer must be in [{-num_states}, {num_states}), got {layer}")
        if _whole_number("max_tokens_per_batch", max_tokens_per_batch) < 1:
            raise ValueError(f"max_tokens_per_batch must be at least 1, got {max_tokens_per_batch}")
        if not callable(tokenizer):
            raise ValueError(
                f"tokenizer must be this checkpoint's tokenizer (AutoTokenizer.from_pretrained(...)), got {tokenizer!r}"
            )
        if isinstance(sequences, str):
            raise ValueError("embed takes a list of proteins and got one string; pass [sequence] to embed one.")
        proteins = [protein_residues(s, f"sequence {i}", strip_stop) for i, s in enumerate(sequences)]
        if not proteins:
            return torch.empty(0, self.config.hidden_size)
        token_lists = tokenizer(proteins, add_special_tokens=True)["input_ids"]
        for index, tokens in enumerate(token_lists):  # `protein_residues` refused empty proteins
            if len(tokens) > self.config.max_protein_length:
                raise ValueError(
                    f"Sequence {index} has {len(tokens) - 2} residues; embed needs 1 to "
                    f"{self.config.max_protein_length - 2} (config.max_protein_length - 2)."
                )
        device = self.embeddings.word_embeddings.weight.device
        embeddings = torch.empty(len(token_lists), self.config.hidden_size)
        progress = tqdm(total=len(token_lists), desc="embedding", unit="protein", disable=not show_progress)
        for batch in length_sorted_batches(token_lists, max_tokens_per_batch):
            packed = pack_proteins([token_lists[i] for i in batch])
            cu_seq_lens = packed["cu_seq_lens_q"].to(device)
            with inference_autocast(device):
                output = self(
                    packed["input_ids"].to(device),
                    cu_seq_lens_q=cu_seq_lens,
                    max_length_q=packed["max_length_q"],
                    output_hidden_states=layer not in (-1, num_states - 1),
                )
            states = (output.last_hidden_state if output.hidden_states is None else output.hidden_states[layer])[0]
            embeddings[batch] = pool_proteins(states.float(), cu_seq_lens, pooling).cpu()
            progress.update(len(batch))
        progress.close()
        return embeddings

    # ---- input handling ----------------------------------------------------------------------------------------

    def _prepare_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        cu_seq_lens_q: torch.Tensor | None,
        cu_seq_lens_k: torch.Tensor | None,
        max_length_q: int | None,
        max_length_k: int | None,
    ) -> InputBatch:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        name, tokens = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
        check_tensor(name, tokens, None)
        if inputs_embeds is not None and (
            inputs_embeds.dim() < 2 or inputs_embeds.shape[-1] != self.config.hidden_size
        ):
            raise ValueError(
                f"inputs_embeds must be [..., hidden_size={self.config.hidden_size}], got shape "
                f"{tuple(inputs_embeds.shape)}."
            )
        self.encoder.backend.check_device(tokens.device)
        packed = cu_seq_lens_q is not None or cu_seq_lens_k is not None or position_ids is not None
        if packed:
            return InputBatch.packed_from(
                self.config, input_ids, inputs_embeds, attention_mask, position_ids,
                cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
            )  # fmt: skip
        if max_length_q is not None or max_length_k is not None:
            raise ValueError("max_length_q/max_length_k describe packed inputs; pass cu_seq_lens_q with them.")
        return InputBatch.padded_from(self.config, input_ids, inputs_embeds, attention_mask)

    def _embed(
        self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, batch: InputBatch
    ) -> torch.Tensor:
        """Embeddings of the tokens alone, packed `[T, hidden]`; `[B, S, hidden]` for a padded batch without padding
        whose layers run padded (`batch.packed` is None). Padding positions are never read."""
        packing = batch.packed
        if packing is None:
            return inputs_embeds if input_ids is None else self.embeddings(input_ids, batch.lengths, None)
        if input_ids is None:
            return (
                inputs_embeds.reshape(-1, inputs_embeds.shape[-1])
                if batch.input_is_packed
                else packing.pack(inputs_embeds)
            )
        token_ids = input_ids.reshape(-1) if batch.input_is_packed else packing.pack(input_ids)
        return self.embeddings(token_ids, batch.lengths, packing.sequence_index)


class StreamedContacts:
    """ESM-2's contact prediction (transformers' `EsmContactPredictionHead`) fed one layer's attention maps at a
    time: per layer and head, the maps without `<eos>`, padding and the first token (`<cls>`) are symmetrized and
    average-product corrected, and the regression, linear over (layer, head) channels, adds that layer's share.

    Args:
        regression: The contact head's `Linear(layers * heads, 1)`.
        tokens: `[N, L]` token ids in the run layout and the `[N, L]` mask of real tokens (`run_token_ids`).
    """

    def __init__(self, regression: nn.Linear, tokens: tuple[torch.Tensor, torch.Tensor], config: NVEsmConfig) -> None:
        token_ids, key_mask = tokens
        self.keep = (key_mask & (token_ids != config.eos_token_id)).float()
        self.weight = regression.weight.detach().float().view(config.num_hidden_layers, config.num_attention_heads)
        self.bias = regression.bias.detach().float()
        count, length = token_ids.shape
        self.logits = torch.zeros(count, length - 2, length - 2, device=token_ids.device)
        self.layer = 0

    def add_layer(self, maps: torch.Tensor) -> None:
        """Add the regression's share of one layer: `maps [N', heads, L', L']` from `attention_probabilities`."""
        count, length = self.keep.shape
        maps = maps[:count, :, :length, :length].float() * self.keep[:, None, :, None] * self.keep[:, None, None, :]
        maps = maps[..., 1:-1, 1:-1]  # as transformers: drop the last position, then the first (<cls>)
        features = maps + maps.transpose(-1, -2)
        total = features.sum((-1, -2), keepdim=True)
        correction = features.sum(-1, keepdim=True) * features.sum(-2, keepdim=True) / total.where(total != 0, 1.0)
        self.logits += torch.einsum("nhij,h->nij", features - correction, self.weight[self.layer])
        self.layer += 1

    def probabilities(self) -> torch.Tensor:
        """`[N, L - 2, L - 2]` contact probabilities, 0 outside each protein's residues."""
        residues = self.keep[:, 1:-1].bool()
        probabilities = torch.sigmoid(self.logits + self.bias)
        return torch.where(residues[:, :, None] & residues[:, None, :], probabilities, 0.0)


class NVEsmForMaskedLM(NVEsmPreTrainedModel):
    """ESM-2 with its masked-language-model head; logits `[..., vocab_size]`."""

    _tied_weights_keys = {"lm_head.decoder.weight": "esm.embeddings.word_embeddings.weight"}

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__(config)
        self.esm = NVEsmModel(config, add_pooling_layer=False)
        self.lm_head = NVEsmLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.lm_head.decoder = new_embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> MaskedLMOutput | tuple:
        r"""`labels` has the shape of `input_ids`; -100 is ignored. Other inputs as `NVEsmModel.forward`."""
        outputs = self.esm(input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None if labels is None else token_loss(logits, labels, attention_mask, self.config.check_inputs)
        output = MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if wants_dict(return_dict, self.config) else output.to_tuple()

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **packing: Any):
        """Residue contact probabilities: `NVEsmModel.predict_contacts` (as transformers' `EsmForMaskedLM`)."""
        return self.esm.predict_contacts(input_ids, attention_mask, **packing)


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    check: bool = True,
    reduction: str = "mean",
) -> torch.Tensor:
    """The loss of the per-token heads (masked LM, token classification): cross-entropy of `logits [..., C]`, in
    fp32, against `labels` (the shape of the tokens; -100 ignored), averaged over the labelled tokens (`reduction`
    "mean", transformers' loss) or summed ("sum": the trainer adds micro-batches and validation batches). Padding
    (`attention_mask` 0) has no prediction here (its logits are zeros: the layers never run it), so a label there
    other than -100 raises ValueError instead of silently differing from transformers, which scores the padding
    token's logits (`check`: `config.check_inputs`, one device sync)."""
    labels = labels.to(logits.device)
    if attention_mask is not None and attention_mask.shape == labels.shape:
        padded_labels = ((attention_mask.to(labels.device) != 0) | (labels == -100)).all()
        message = (
            "labels must be -100 at padding (attention_mask 0): padding has no prediction in this model (transformers' "
            "data collators write -100 there)."
        )
        raise_on_failed_checks([(padded_labels, message)], check)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction=reduction)


def sequence_problem_type(config: NVEsmConfig, labels: torch.Tensor) -> str:
    """transformers' rule for a sequence head: `config.problem_type` where set, else "regression" for one label,
    "single_label_classification" for integer labels and "multi_label_classification" for float ones."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    return "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"


def sequence_loss(
    logits: torch.Tensor, labels: torch.Tensor, config: NVEsmConfig, reduction: str = "mean"
) -> torch.Tensor:
    """The loss of the sequence head's `logits [N, num_labels]` against `labels` (`[N]` class ids or targets, or
    `[N, num_labels]` floats), by `sequence_problem_type`: squared error, cross-entropy or binary cross-entropy with
    logits, averaged (`reduction` "mean", transformers' loss) or summed ("sum")."""
    labels = labels.to(logits.device)
    problem_type = sequence_problem_type(config, labels)
    if problem_type == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze(), reduction=reduction)
        return F.mse_loss(logits, labels, reduction=reduction)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1), reduction=reduction)
    return F.binary_cross_entropy_with_logits(logits, labels, reduction=reduction)


class NVEsmForTokenClassification(NVEsmPreTrainedModel):
    """ESM-2 with a per-token linear classifier (e.g. secondary structure)."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.esm = NVEsmModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> TokenClassifierOutput | tuple:
        r"""`labels` has the shape of `input_ids`; -100 is ignored. Logits `[..., num_labels]`."""
        outputs = self.esm(input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None if labels is None else token_loss(logits, labels, attention_mask, self.config.check_inputs)
        output = TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if wants_dict(return_dict, self.config) else output.to_tuple()


class NVEsmClassificationHead(nn.Module):
    """dense -> tanh -> out_proj on each protein's `<cls>` token, as transformers' `EsmClassificationHead`."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N, num_labels]`."""
        hidden = torch.tanh(self.dense(self.dropout(cls_states)))
        return self.out_proj(self.dropout(hidden))


class NVEsmForSequenceClassification(NVEsmPreTrainedModel):
    """ESM-2 with a per-protein classifier/regressor on the `<cls>` token. Logits `[N, num_labels]`."""

    def __init__(self, config: NVEsmConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.esm = NVEsmModel(config, add_pooling_layer=False)
        self.classifier = NVEsmClassificationHead(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput | tuple:
        r"""`labels [N]` (class ids, or floats for regression / multi-label). For packed inputs N is the number of
        proteins and each protein's first token is its `<cls>`."""
        outputs = self.esm(input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)
        logits = self.classifier(first_token_states(outputs.last_hidden_state, outputs.cu_seq_lens, attention_mask))
        loss = None
        if labels is not None:
            self.config.problem_type = sequence_problem_type(self.config, labels)  # saved with the model, as theirs
            loss = sequence_loss(logits, labels, self.config)
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if wants_dict(return_dict, self.config) else output.to_tuple()


def _whole_number(name: str, value: Any) -> int:
    """`value` as an int (a Python or NumPy integer); ValueError naming argument `name` for anything else (a bool,
    a float, NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


__all__ = [
    "NVEsmForMaskedLM",
    "NVEsmForSequenceClassification",
    "NVEsmForTokenClassification",
    "NVEsmModel",
    "NVEsmPreTrainedModel",
    "pack_proteins",
    "protein_residues",
    "resolve_backend",
    "sequence_loss",
    "sequence_problem_type",
    "token_loss",
    # imported here only so that every sibling file is a direct relative import of this one (see the imports)
    "ContextParallelLayout",
    "PackedSequences",
    "RunLayout",
    "StaticShapeGraphs",
    "rotate_qk",
]
