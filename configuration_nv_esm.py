"""Configuration of NVEsm: ESM-2 on NVIDIA Transformer Engine, with an exact PyTorch twin.

Two things, kept apart: the architecture (`NVEsmConfig`'s fields: what config.json says to rebuild the weights,
those of `transformers.EsmConfig` that ESM-2 uses plus `padded_vocab_size`) and the run options (`RunOptions`: how
this machine runs the model: backend, layout, FP8, CUDA graphs, checks, memory options; `from_pretrained` keywords,
never written to config.json, held as `config.run_options`). Every value is checked when it is given: an
inconsistent one raises `ValueError` naming the field and what is allowed.
`UNSUPPORTED_COMBINATIONS` is the one table of features that do not combine, which the model and nv-esm train
refuse from (`refused_combination`). This file imports nothing from Transformer Engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

BACKENDS = ("auto", "te", "torch")
ATTN_INPUT_FORMATS = ("bshd", "thd")
LAYER_PRECISIONS = ("fp8", None)
FP8_RECIPES = ("delayed", "current", "block")
FP8_LAYER_CHOICES = ("off", "all", "inner")  # `fp8_layer_precision`'s modes: the commands' --fp8
HIDDEN_ACTS = ("gelu",)
# Former load-time options that are now the model's runtime interface, each with what replaces it.
MOVED_OPTIONS = {"gradients_reduced_after_backward": "model.reduce_gradients_after_backward()"}


# NVIDIA's BioNeMo ESM-2 config (bionemo-recipes' models/esm2 `NVEsmConfig`): the fields it adds to transformers'
# `EsmConfig` that NVEsm has no field of its own for, each with their default, the values that mean what NVEsm does
# (None: any value, none changes what the model computes) and what the field is here. `NVEsmConfig` takes them as
# keywords and attributes: `use_quantized_model_init` is the run option `fp8_weights`; a value outside the accepted
# ones is refused in one line naming the field (`check_bionemo_field`); nothing of theirs is stored or saved. Their
# `attn_input_format`, `layer_precision` and `padded_vocab_size` are NVEsm's own fields, with the same meaning.
@dataclass(frozen=True)
class BionemoField:
    default: Any
    accepted: tuple | None
    meaning: str
    run_option: str | None = None  # NVEsm's run option of the same meaning


BIONEMO_CONFIG_FIELDS: dict[str, BionemoField] = {
    "use_quantized_model_init": BionemoField(
        False, (True, False), "NVEsm's fp8_weights: the FP8 layers' weights built in FP8", run_option="fp8_weights"
    ),
    "qkv_weight_interleaved": BionemoField(
        True,
        (True,),
        "NVEsm's fused query/key/value rows are interleaved per head; a checkpoint with [q | k | v] rows converts "
        "with nv-esm convert bionemo-to-te",
    ),
    "fuse_qkv_params": BionemoField(
        True,
        (True,),
        "NVEsm fuses query, key and value into one parameter (false stores them as separate Transformer Engine "
        "parameters, which their convert.py never writes)",
    ),
    "encoder_activation": BionemoField("gelu", ("gelu",), "ESM-2's layers use gelu; another is another model"),
    "attn_mask_type": BionemoField(
        "padding", ("padding", "no_mask"), "ESM-2 attends both ways; NVEsm masks padding only (no_mask: none to mask)"
    ),
    "add_pooling_layer": BionemoField(
        False,
        (False,),
        "NVEsm's pooler is NVEsmModel's argument, as in transformers' EsmModel: NVEsmModel(config, "
        "add_pooling_layer=True); the heads have none",
    ),
    "micro_batch_size": BionemoField(None, None, "a size their model warms TE's fused kernels up with; not needed"),
    "max_seq_length": BionemoField(None, None, "a size their model warms TE's fused kernels up with; not needed"),
}


# Their fields that an NVEsm config.json never holds: any one of them tells their config.json from ours.
BIONEMO_MARKER_FIELDS = tuple(name for name in BIONEMO_CONFIG_FIELDS if name != "add_pooling_layer")


def check_bionemo_field(name: str, value: Any) -> None:
    """ValueError, one line naming the field, when `value` of NVIDIA's config field `name` (`BIONEMO_CONFIG_FIELDS`)
    means something NVEsm does not do."""
    accepted = BIONEMO_CONFIG_FIELDS[name].accepted
    if accepted is not None and not any(type(value) is type(option) and value == option for option in accepted):
        raise ValueError(f"{name} {value!r} is refused: {BIONEMO_CONFIG_FIELDS[name].meaning}.")


def check_one_value_per_option(keywords: dict[str, Any]) -> None:
    """ValueError where `keywords` give one run option under NVIDIA's name and NVEsm's with two values
    (`use_quantized_model_init=True, fp8_weights=False`)."""
    for name, field in BIONEMO_CONFIG_FIELDS.items():
        option = field.run_option
        if option is not None and name in keywords and option in keywords and keywords[name] != keywords[option]:
            raise ValueError(f"{name}={keywords[name]!r} and {option}={keywords[option]!r} set one option two ways.")


# An ESM-2 has at most 48 layers (15B); the bound stops a mistyped config from allocating without end.
MAX_LAYERS = 1024

# The features some others do not combine with (`UNSUPPORTED_COMBINATIONS`), each with how messages name it.
FEATURES = {
    "tensor_parallel": "tensor parallelism",  # layers split over ranks: enable_tensor_parallel, nv-esm train --tp
    "context_parallel": "context parallelism",  # each batch's layers across ranks: enable_context_parallel, --cp
    "padded_layers": "padded layers",  # attn_input_format="bshd"
    "dropout": "dropout",  # attention_probs_dropout_prob or hidden_dropout_prob above 0
    "lora": "LoRA adapters",  # PEFT's adapters in the layers: nv-esm train --lora-rank
    "offload_activations": "activation offloading",  # offload_activations, --offload-activations
    "activation_checkpointing": "activation checkpointing",  # gradient checkpointing, --activation-checkpointing
    "fp8_weights": "weights held in FP8",  # fp8_weights
    "compile": "torch.compile",  # of each layer: nv-esm train --compile
    "te_layers": "Transformer Engine layers",  # the layers of the te backend
}

# What tensor and context parallelism each refuse, in the order they are checked, as their refusals read
# ("tensor parallelism: LoRA adapters are not supported.").
_PARALLELISM_REFUSALS = {
    "padded_layers": "it needs packed layers (attn_input_format='thd')",
    "dropout": "dropout is not supported (attention_probs_dropout_prob and hidden_dropout_prob must be 0)",
    "lora": "LoRA adapters are not supported",
    "offload_activations": "activation offloading is not supported",
    "fp8_weights": "weights held in FP8 (fp8_weights) are not supported",
    "compile": "torch.compile is not supported",
}

# The pairs of `FEATURES` that do not combine, (feature, other): reason, in the order they are checked (the first
# refused pair is reported). Messages name `feature` first; the reason is a short clause that they word around it,
# "{other}" standing for the other feature's name. The model and nv-esm train read it (`refused_combination`).
UNSUPPORTED_COMBINATIONS: dict[tuple[str, str], str] = {
    ("offload_activations", "activation_checkpointing"): (
        "offloads nothing (Transformer Engine's offloading does not reach the checkpointed layer inputs)"
    ),
    **{
        (parallelism, other): reason
        for parallelism in ("tensor_parallel", "context_parallel")
        for other, reason in _PARALLELISM_REFUSALS.items()
    },
    ("context_parallel", "tensor_parallel"): "it does not combine with {other} yet",
    ("compile", "te_layers"): "Transformer Engine layers are fused already",
}


@dataclass
class RunOptions:
    """How this machine runs an NVEsm model: load-time options (`from_pretrained` keywords), never written to
    config.json (a model fine-tuned on a CPU with backend="torch" must not run the slow path on every GPU it is shared
    to). The forward's plan (`modeling_nv_esm_plan`) reads them; `check` validates them against the architecture.

    Attributes:
        backend: `"auto"` uses Transformer Engine when it imports and CUDA is available when the model is
            built, else PyTorch; `"te"` requires both; `"torch"` always uses the PyTorch twin. Both
            backends have the same parameter names, so one checkpoint loads into either.
        attn_input_format: Layout the encoder layers run in. `"thd"`: tokens of all proteins packed into one
            sequence with `cu_seq_lens` (padded batches are unpadded inside the model and the outputs
            scattered back). `"bshd"`: padded batches run padded with a key mask (packed inputs are
            padded inside the model). Outputs always come back in the layout of the inputs.
        layer_precision: `None` (all layers in the autocast/param dtype) or one entry per layer:
            `"fp8"` runs that layer's GEMMs in FP8 (Transformer Engine only), `None` keeps it in bf16.
        fp8_recipe: Transformer Engine FP8 scaling recipe, by name: `"delayed"` (DelayedScaling),
            `"current"` (Float8CurrentScaling) or `"block"` (Float8BlockScaling).
        fp8_weights: Hold the GEMM weights of the FP8 layers (`layer_precision`) in FP8 only, quantized with
            `fp8_recipe` (Transformer Engine's `quantized_model_init`; TE backend): a quarter of their fp32 memory,
            half of their bf16 memory, and no per-forward weight cast. The weights become the FP8 values: a
            checkpoint saved from such a model holds them (dequantized). To train, use an optimizer with master
            weights (`transformer_engine.pytorch.optimizers.FusedAdam(..., master_weights=True)`). Load with
            `dtype` and `device_map` rather than casting the model afterwards.
        check_inputs: Validate data-dependent input properties (token ids within the vocabulary, `cu_seq_lens`
            and `position_ids` consistent, proteins not longer than `max_protein_length`) and raise
            `ValueError` on violations. This costs one device synchronisation per forward; a training loop whose
            data pipeline is trusted can set it to False. Shape and type errors are always raised.
        cuda_graphs: Transformer Engine backend, packed layers (`attn_input_format="thd"`) only (ignored otherwise;
            on by default): round each batch up to a static shape (a bucket of token count, protein count and
            longest protein; the extra tokens form dummy proteins whose outputs are dropped) and replay the layers
            as CUDA graphs captured once per bucket, for training (train mode with gradients) and inference (eval
            mode without gradients). Other calls, and `output_hidden_states`, run eagerly. A training forward must
            be followed by its backward before the next forward; set False to run several forwards per backward.
            Training calls in a process group of several ranks run eagerly unless the caller says it reduces the
            gradients itself (`model.reduce_gradients_after_backward()`).
        offload_activations: Training forwards (train mode with gradients, on a CUDA GPU, Transformer Engine
            installed) keep what every layer but the last saves for backward in pinned host memory (Transformer
            Engine's `get_cpu_offload_context`: layer i is copied out before layer i + 1 runs and back when its
            backward starts). Less GPU memory for activations, at the cost of host-device traffic. Such calls run
            eagerly (no CUDA graphs); each must be followed by its backward before the next. Not with gradient
            checkpointing (it would offload nothing: refused).
        offloaded_layers: With `offload_activations`, how many layers, from the first, keep their saved tensors in
            host memory (default None: all but the last). Layer i's copy must have finished before layer
            i + num_hidden_layers - offloaded_layers runs, so fewer offloaded layers leave the copies that much
            compute to overlap, and keep that many layers' activations on the GPU.
        recompute_mlp: Training forwards keep only each layer's MLP input and recompute its LayerNorm, fc1 and
            GELU in the backward (Transformer Engine's selective checkpointing of `LayerNormMLP`, TE >= 2.11; fc2
            is not recomputed; the PyTorch twin recomputes the whole MLP): most of a layer's activation memory
            (the two `intermediate_size` activations) for about one fc1 GEMM more per layer. Redundant with
            gradient checkpointing, which recomputes the whole layer (`nv-esm train` refuses the pair).
        cudnn_layer_norm: Transformer Engine backend: run TE's LayerNorms (forward and backward) with cuDNN's
            kernels, which TE otherwise uses only when `NVTE_NORM_FWD_USE_CUDNN=1` / `NVTE_NORM_BWD_USE_CUDNN=1`
            are set before its first LayerNorm. It is TE's switch for the whole process (its
            `nvte_enable_cudnn_norm_*` flags and those variables), set when the model is built: from then on every
            TE LayerNorm of any model runs cuDNN's (CUDA graphs captured before keep what they captured), and
            False does not switch them back. Off by default (the PyTorch backend ignores it, with a warning).
        max_protein_length: Longest protein accepted, in tokens with `<cls>` and `<eos>` (default 8192); longer ones
            raise `ValueError`. Raise it (e.g. `from_pretrained(..., max_protein_length=20_000)`) for longer
            proteins: attention memory grows with the square of the length on the PyTorch backend.
    """

    backend: str = "auto"
    attn_input_format: str = "thd"
    layer_precision: list[str | None] | None = None
    fp8_recipe: str = "delayed"
    fp8_weights: bool = False
    check_inputs: bool = True
    cuda_graphs: bool = True
    offload_activations: bool = False
    offloaded_layers: int | None = None
    recompute_mlp: bool = False
    cudnn_layer_norm: bool = False
    max_protein_length: int = 8192

    def __post_init__(self) -> None:
        if self.layer_precision is not None:
            self.layer_precision = list(self.layer_precision)

    @property
    def uses_fp8(self) -> bool:
        """Whether any layer is configured to run in FP8."""
        return self.layer_precision is not None and "fp8" in self.layer_precision

    def check(self, num_hidden_layers: int) -> None:
        """Raise `ValueError` on the first option that is not allowed, or does not fit a model of `num_hidden_layers`
        layers."""
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("attn_input_format", self.attn_input_format, ATTN_INPUT_FORMATS)
        _check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        value = self.max_protein_length
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_protein_length must be a positive integer, got {value!r}")
        for name in ("fp8_weights", "check_inputs", "cuda_graphs", "offload_activations", "recompute_mlp",
                     "cudnn_layer_norm"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.offloaded_layers is not None:
            layers = self.offloaded_layers
            if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < num_hidden_layers:
                raise ValueError(
                    f"offloaded_layers must be None or a layer count in [1, {num_hidden_layers - 1}] (all but "
                    f"the last at most), got {layers!r}"
                )
            if not self.offload_activations:
                raise ValueError("offloaded_layers counts the layers that offload_activations offloads: set both.")
        if self.layer_precision is not None:
            if len(self.layer_precision) != num_hidden_layers:
                raise ValueError(
                    f"layer_precision must have one entry per layer ({num_hidden_layers}), "
                    f"got {len(self.layer_precision)}"
                )
            for entry in self.layer_precision:
                _check_choice("layer_precision entries", entry, LAYER_PRECISIONS)
        if self.fp8_weights and not self.uses_fp8:
            raise ValueError(
                "fp8_weights holds the FP8 layers' weights in FP8, and layer_precision marks no layer 'fp8': "
                "pass e.g. layer_precision=['fp8'] * num_hidden_layers"
            )


# The run options' names: what `save_pretrained` leaves out of config.json.
LOAD_TIME_OPTIONS = tuple(field.name for field in fields(RunOptions))


class NVEsmConfig(PretrainedConfig):
    r"""Configuration of an ESM-2 model run by `NVEsmModel` and its heads.

    Defaults give the ESM-2 650M shape (`facebook/esm2_t33_650M_UR50D`).

    Args:
        vocab_size: Number of tokens of the ESM alphabet (33).
        padded_vocab_size: Rows of the embedding and of the LM decoder; the extra rows are zeros and the
            logits are cut back to `vocab_size`. Must be >= `vocab_size` and a multiple of 16 (FP8 GEMMs).
        hidden_size: Width of the residual stream.
        num_hidden_layers: Number of transformer layers.
        num_attention_heads: Attention heads; `hidden_size` must divide into them, with an even head size.
        intermediate_size: Width of the MLP.
        hidden_act: MLP activation. Only `"gelu"` (ESM's). The PyTorch backend uses the exact erf GELU as
            transformers does; Transformer Engine's fused `gelu` is the tanh approximation (see README).
        hidden_dropout_prob: Dropout after the attention projection and after the MLP.
        attention_probs_dropout_prob: Dropout on the attention probabilities.
        max_position_embeddings: Longest protein ESM-2 was trained on, in tokens with `<cls>` and `<eos>` (1026:
            crops of 1024 residues). Longer proteins run (rotary positions need no table), with a one-time warning.
        initializer_range: Standard deviation of the normal initialisation of fresh weights.
        layer_norm_eps: Epsilon of every LayerNorm.
        position_embedding_type: Only `"rotary"` (ESM-2). `"absolute"` is ESM-1 and is refused.
        rope_theta: Base period of the rotary embedding.
        emb_layer_norm_before: Only `False` (ESM-2). `True` is ESM-1b and is refused.
        token_dropout: ESM's mask-dropout: `<mask>` embeddings are zeroed and the rest rescaled by
            `(1 - 0.15 * 0.8) / (1 - observed mask ratio of the protein)`.
        mask_token_id, pad_token_id, bos_token_id, eos_token_id: Special tokens of the ESM alphabet.
        tie_word_embeddings: The LM decoder shares the embedding matrix (ESM-2 does).

    Run options (`RunOptions`: `backend`, `attn_input_format`, `layer_precision`, `fp8_recipe`, `fp8_weights`,
    `check_inputs`, `cuda_graphs`, `offload_activations`, `offloaded_layers`, `recompute_mlp`, `cudnn_layer_norm`,
    `max_protein_length`) are keywords of `__init__` and `from_pretrained` too, held in `run_options` and read as
    attributes (`config.backend` is `config.run_options.backend`). `save_pretrained` leaves them out of config.json,
    and a config.json that has them (written by an older version) is read without them, with a warning for values
    other than the defaults.
    """

    model_type = "nv_esm"

    def __init__(
        self,
        vocab_size: int = 33,
        padded_vocab_size: int = 64,
        hidden_size: int = 1280,
        num_hidden_layers: int = 33,
        num_attention_heads: int = 20,
        intermediate_size: int = 5120,
        hidden_act: str = "gelu",
        hidden_dropout_prob: float = 0.0,
        attention_probs_dropout_prob: float = 0.0,
        max_position_embeddings: int = 1026,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-5,
        position_embedding_type: str = "rotary",
        rope_theta: float = 10000.0,
        emb_layer_norm_before: bool | None = False,
        token_dropout: bool = True,
        mask_token_id: int = 32,
        pad_token_id: int = 1,
        bos_token_id: int | None = 0,
        eos_token_id: int = 2,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.position_embedding_type = position_embedding_type
        self.rope_theta = rope_theta
        self.emb_layer_norm_before = emb_layer_norm_before
        self.token_dropout = token_dropout
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        for name in MOVED_OPTIONS.keys() & kwargs.keys():
            raise ValueError(f"{name} is not a config option any more: call {MOVED_OPTIONS[name]} on the model.")
        check_one_value_per_option(kwargs)
        for name in BIONEMO_CONFIG_FIELDS.keys() & kwargs.keys():  # NVIDIA's: checked; a run option, or dropped
            value, option = kwargs.pop(name), BIONEMO_CONFIG_FIELDS[name].run_option
            check_bionemo_field(name, value)
            if option is not None:
                kwargs[option] = value
        self.run_options = RunOptions(**{name: kwargs.pop(name) for name in LOAD_TIME_OPTIONS if name in kwargs})
        self._check()  # before transformers' own validators, which would fail on a mistyped field with a traceback
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def uses_fp8(self) -> bool:
        """Whether any layer is configured to run in FP8 (`RunOptions.uses_fp8`)."""
        return self.run_options.uses_fp8

    def to_dict(self) -> dict[str, Any]:
        """transformers' `to_dict`, with the run options as fields of their own (as `__init__` takes them)."""
        output = super().to_dict()
        output.pop("run_options", None)
        output.update(asdict(self.run_options))
        return output

    def to_saved_dict(self, use_diff: bool = True) -> dict[str, Any]:
        """The config as config.json holds it: `to_diff_dict()` (or `to_dict()`) without the load-time options."""
        saved = self.to_diff_dict() if use_diff else self.to_dict()
        for name in LOAD_TIME_OPTIONS:
            saved.pop(name, None)
        return saved

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True) -> None:
        """`PretrainedConfig.to_json_file` (what `save_pretrained` writes) of `to_saved_dict`."""
        saved = self._encode_special_floats(self.to_saved_dict(use_diff))
        with open(json_file_path, "w", encoding="utf-8") as writer:
            writer.write(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    def __setattr__(self, name: str, value: Any) -> None:
        """NVIDIA's `add_pooling_layer` set as an attribute is checked (`check_bionemo_field`) and not kept: it is
        `NVEsmModel`'s keyword (`from_pretrained` hands a keyword to the model only where the config has no
        attribute of its name), and a config.json must not carry it."""
        if name == "add_pooling_layer":
            check_bionemo_field(name, value)
            return
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers' `from_dict`, reading a dict that still holds a `MOVED_OPTIONS` field without it: older
        versions wrote them into `to_dict()` (a training checkpoint's train_state.json holds its config so). One
        option given under both its names (`from_pretrained(..., use_quantized_model_init=True, fp8_weights=False)`)
        with two values is refused, as `__init__` refuses it."""
        check_one_value_per_option(kwargs)
        return super().from_dict({k: v for k, v in config_dict.items() if k not in MOVED_OPTIONS}, **kwargs)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike) -> dict[str, Any]:
        """A config.json as a dict, load-time options dropped (warning about those that were not defaults). NVIDIA's
        BioNeMo config.json (`BIONEMO_MARKER_FIELDS`) is refused, with its conversion."""
        config_dict = super()._dict_from_json_file(json_file)
        markers = [name for name in BIONEMO_MARKER_FIELDS if name in config_dict]
        if markers:  # their weights are named otherwise (`model.`): loading would leave every weight random
            raise ValueError(
                f"{json_file} is NVIDIA's BioNeMo ESM-2 layout (it has {', '.join(markers)}), not NVEsm's; convert "
                "its folder first: nv-esm convert bionemo-to-te FOLDER OUT"
            )
        defaults = asdict(RunOptions())
        ignored = {}
        for name in MOVED_OPTIONS:  # load-time options once, never meant for config.json
            config_dict.pop(name, None)
        for name in LOAD_TIME_OPTIONS:
            if name in config_dict:
                value = config_dict.pop(name)
                if value != defaults[name]:
                    ignored[name] = value
        if ignored:
            settings = ", ".join(f"{name}={value!r}" for name, value in ignored.items())
            logger.warning(
                f"{json_file} sets {settings}: load-time options, which config files no longer carry; ignored. "
                "Pass them to from_pretrained to use them."
            )
        return config_dict

    def _check(self) -> None:
        """Raise `ValueError` on the first inconsistent field (the architecture's, then the run options')."""
        for name in (
            "vocab_size",
            "padded_vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_hidden_layers > MAX_LAYERS:
            raise ValueError(f"num_hidden_layers must be at most {MAX_LAYERS}, got {self.num_hidden_layers}")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % 16:
            raise ValueError(
                f"padded_vocab_size must be >= vocab_size ({self.vocab_size}) and a multiple of 16, "
                f"got {self.padded_vocab_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"hidden_size / num_attention_heads must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.position_embedding_type != "rotary":
            raise ValueError(
                f"position_embedding_type must be 'rotary' (ESM-2), got {self.position_embedding_type!r}: "
                "absolute position embeddings are ESM-1 and are not supported"
            )
        if self.emb_layer_norm_before:
            raise ValueError("emb_layer_norm_before must be False (ESM-2); True is ESM-1b and is not supported")
        _check_choice("hidden_act", self.hidden_act, HIDDEN_ACTS)
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        for name in ("layer_norm_eps", "initializer_range", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("token_dropout", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if name == "bos_token_id" and value is None:  # transformers' ESM configs write None: <cls> is not used
                continue  # as a generation start token
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        self.run_options.check(self.num_hidden_layers)


def _run_option(name: str) -> property:
    """`config.<name>`: the run option `config.run_options.<name>` (read and set; `from_pretrained` sets it so)."""

    def get(config: NVEsmConfig) -> Any:
        return getattr(config.run_options, name)

    def set_(config: NVEsmConfig, value: Any) -> None:
        setattr(config.run_options, name, value)

    return property(get, set_, doc=f"The run option `run_options.{name}` (`RunOptions`).")


def _bionemo_field(name: str) -> property:
    """`config.<name>` for NVIDIA's config field `name` (`BIONEMO_CONFIG_FIELDS`): its run option, or the one value
    that means what NVEsm does; setting it checks the value (`check_bionemo_field`) and sets the run option."""
    field = BIONEMO_CONFIG_FIELDS[name]

    def get(config: NVEsmConfig) -> Any:
        return field.default if field.run_option is None else getattr(config.run_options, field.run_option)

    def set_(config: NVEsmConfig, value: Any) -> None:
        check_bionemo_field(name, value)
        if field.run_option is not None:
            setattr(config.run_options, field.run_option, value)

    return property(get, set_, doc=f"NVIDIA's config field {name}: {field.meaning}.")


for _name in LOAD_TIME_OPTIONS:
    setattr(NVEsmConfig, _name, _run_option(_name))
# Not `add_pooling_layer` (`NVEsmConfig.__setattr__` checks it).
for _name in BIONEMO_CONFIG_FIELDS.keys() - {"add_pooling_layer"}:
    setattr(NVEsmConfig, _name, _bionemo_field(_name))


def fp8_layer_precision(mode: str, num_layers: int) -> list[str | None] | None:
    """`layer_precision` for a `FP8_LAYER_CHOICES` mode: "off" (None), "all" layers, or "inner": all but the first
    and last (often kept in bf16; with two layers or fewer, all)."""
    _check_choice("fp8 mode", mode, FP8_LAYER_CHOICES)
    if mode == "off":
        return None
    if mode == "all" or num_layers <= 2:
        return ["fp8"] * num_layers
    return [None] + ["fp8"] * (num_layers - 2) + [None]


def refused_combination(features: Iterable[str], subject: str | None = None) -> tuple[str, str, str] | None:
    """The first pair of `features` that `UNSUPPORTED_COMBINATIONS` refuses, as (feature, other, reason with
    "{other}" filled in), or None. With `subject` (asked for too), only its pairs count and it is `feature`.
    Raises ValueError for a name that is not in `FEATURES`."""
    asked = set(features) | ({subject} if subject else set())
    if asked - FEATURES.keys():
        raise ValueError(f"unknown features {sorted(asked - FEATURES.keys())}; known: {list(FEATURES)}")
    for (feature, other), reason in UNSUPPORTED_COMBINATIONS.items():
        if feature in asked and other in asked and subject in (None, feature, other):
            if subject == other:
                feature, other = other, feature
            return feature, other, reason.format(other=FEATURES[other])
    return None


def refuse_combinations(
    features: Iterable[str],
    message: Callable[[str, str, str], str] | None = None,
    subject: str | None = None,
) -> None:
    """Raise ValueError(message(feature, other, reason)) for the `refused_combination` of `features` and `subject`,
    if any. The default message names the feature and gives the reason: "tensor parallelism: LoRA adapters are not
    supported."."""
    refused = refused_combination(features, subject)
    if refused is not None:
        raise ValueError(message(*refused) if message else f"{FEATURES[refused[0]]}: {refused[2]}.")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


__all__ = ["NVEsmConfig"]
