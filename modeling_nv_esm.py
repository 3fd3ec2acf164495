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
import functools
import gc
import importlib
import math
import numbers
import os
import time
from collections.abc import Callable, Iterable, Sequence
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
from transformers.utils import logging

try:
    from .configuration_nv_esm import NVEsmConfig
except ImportError:  # imported as a top-level module (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import NVEsmConfig

logger = logging.get_logger(__name__)

# ESM-2 was trained masking 15% of tokens, 80% of those with <mask>: token dropout rescales to this ratio.
MASK_RATIO_TRAIN = 0.15 * 0.8
# FP8 GEMMs need the number of rows (tokens) to be a multiple of this.
FP8_TOKEN_MULTIPLE = 16
TE_INSTALL_HINT = (
    "Install NVIDIA Transformer Engine for PyTorch on a CUDA machine "
    "(pip install --no-build-isolation 'transformer-engine[pytorch]'), "
    "or pass backend='torch' to run the PyTorch implementation."
)
# Keywords that transformers' ESM forwards accept beyond the ones NVEsm names, with what NVEsm does with them.
IGNORED_INPUTS = {  # accepted and unused, as in transformers
    "seq_idx",  # from DataCollatorWithFlattening; cu_seq_lens carries the same
    "num_items_in_batch",  # Trainer's loss normaliser; ESM's loss is the mean over labelled tokens
}
UNSUPPORTED_INPUTS = {  # accepted only at the value that asks for nothing (None or False), else a ValueError
    "encoder_hidden_states": "ESM-2 has no cross-attention",
    "encoder_attention_mask": "ESM-2 has no cross-attention",
    "head_mask": "NVEsm runs fused attention, which takes no per-head mask",
    "is_causal": "ESM-2 attends in both directions",
    "output_router_logits": "ESM-2 has no mixture of experts",
}


# --------------------------------------------------------------------------------------------------------------
# Proteins: the one rule for what a protein may hold
# --------------------------------------------------------------------------------------------------------------

# ESM-2's residue letters (the 20 standard amino acids, then X B U Z O), in the order of its vocabulary. Every
# reader of proteins in nv-esm applies `protein_residues`: `NVEsmModel.embed`, `nv-esm embed` and `nv-esm train`.
RESIDUE_LETTERS = "LAGVSERTIDPKQNFYMHWCXBUZO"
STOP_MARK = "*"
_RESIDUE_CASES = {ord(letter): None for letter in RESIDUE_LETTERS + RESIDUE_LETTERS.lower()}
_HINTS = {
    STOP_MARK: " (a stop codon's mark: remove it, or strip it with strip_stop=True / --strip-stop)",
    "-": " (an alignment gap)",
    ".": " (an alignment gap)",
}


def protein_residues(sequence: object, name: str, strip_stop: bool = False) -> str:
    """`sequence` as ESM-2 reads it: its residue letters (`RESIDUE_LETTERS`, either case) upper-cased, and with
    `strip_stop` one trailing `*` removed. ValueError naming `name` for anything else: not a `str`, no residues, or
    a character outside the letters (with its 1-based position), so that no protein silently becomes `<unk>`s."""
    if not isinstance(sequence, str):
        raise ValueError(f"{name} is a {type(sequence).__name__}, not a string of residue letters.")
    if strip_stop and sequence.endswith(STOP_MARK):
        sequence = sequence[:-1]
    if not sequence:
        raise ValueError(f"{name} has no residues.")
    if sequence.translate(_RESIDUE_CASES):
        position, char = next((i, c) for i, c in enumerate(sequence) if ord(c) not in _RESIDUE_CASES)
        raise ValueError(
            f"{name}: {char!r} at residue {position + 1} is not a letter of ESM-2's alphabet{_HINTS.get(char, '')}."
        )
    return sequence.upper()


# --------------------------------------------------------------------------------------------------------------
# Transformer Engine, imported on demand
# --------------------------------------------------------------------------------------------------------------


# Transformer Engine is imported through importlib: transformers scans remote code for `import` statements and
# refuses to load a model whose imports are not installed, and TE must stay optional.


@functools.cache
def transformer_engine_available() -> bool:
    """Whether `transformer_engine.pytorch` imports in this environment."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # ImportError, or a broken install raising OSError/RuntimeError on load
        return False
    return True


def import_transformer_engine() -> Any:
    """Return `transformer_engine.pytorch`, or raise an ImportError that says how to install it."""
    if not transformer_engine_available():
        raise ImportError(f"backend='te' needs Transformer Engine, which does not import here. {TE_INSTALL_HINT}")
    return importlib.import_module("transformer_engine.pytorch")


def resolve_backend(backend: str, device: torch.device | str | None = None) -> str:
    """Turn a `config.backend` value (`"auto"`, `"te"`, `"torch"`) into `"te"` or `"torch"` for a model built now,
    to run on `device` (None: the GPU when one is visible). `"auto"` is Transformer Engine when it is installed and
    the model runs on CUDA; `"te"` where that does not hold raises ValueError saying what is missing. The one
    decider of the model and of every command (`nv-esm embed`, `nv-esm train`)."""
    if backend not in ("auto", "te", "torch"):
        raise ValueError(f"backend must be 'auto', 'te' or 'torch', got {backend!r}.")
    if backend == "torch":
        return "torch"
    on_cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    if backend == "te":
        if not on_cuda:
            where = "no CUDA GPU is visible" if device is None else f"this run is on {device}"
            raise ValueError(
                f"backend 'te' runs Transformer Engine layers on a CUDA GPU, and {where}. {TE_INSTALL_HINT}"
            )
        if not transformer_engine_available():
            raise ValueError(f"backend 'te' needs Transformer Engine, which does not import here. {TE_INSTALL_HINT}")
        return "te"
    return "te" if on_cuda and transformer_engine_available() else "torch"


@functools.cache
def _fp8_state_manager() -> Any:
    """Transformer Engine's `FP8GlobalStateManager` (found once: the model asks it at every forward), or None."""
    if not transformer_engine_available():
        return None
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):  # TE >= 2.8 / older
        try:
            return importlib.import_module(name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
    return None


def caller_fp8_enabled() -> bool:
    """Whether Transformer Engine's FP8 autocast is on where the model is called (a caller's `te.autocast`); False
    without TE."""
    manager = _fp8_state_manager()
    return manager is not None and bool(manager.is_fp8_enabled())


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


def fp8_value(parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """What to copy into `parameter` to give it `value`: `value` itself, or for a weight held in FP8 (a TE quantized
    tensor) `value` quantized by the parameter's own quantizer, so that the copy takes the FP8 data and scales as
    they are. Per-tensor delayed scaling first gets the scale its recipe would reach for `value` (`fp8 max / amax`),
    not the 1.0 it starts with. Raises RuntimeError when the FP8 values are more than 10% (relative norm) from
    `value`: a quantization gone wrong must not become silently wrong outputs."""
    quantizer = getattr(parameter, "_quantizer", None)
    if quantizer is None:
        return value
    value = value.detach().to(parameter.device, parameter.dtype)
    usages = parameter.get_usages()  # the copy takes FP8 data as it is only when the layouts match
    quantizer.set_usage(rowwise=usages.get("rowwise", True), columnwise=usages.get("columnwise", False))
    if type(quantizer).__name__ == "Float8Quantizer":  # delayed scaling
        name = getattr(quantizer.dtype, "name", str(quantizer.dtype))  # TE's DType enum: str() is its number
        fp8_max = torch.finfo(torch.float8_e4m3fn if "E4M3" in name else torch.float8_e5m2).max
        largest = value.abs().max().float().clamp(min=torch.finfo(torch.float32).tiny)
        quantizer.scale.copy_((fp8_max / largest).to(quantizer.scale))
    quantized = quantizer.quantize(value)
    error = (quantized.dequantize().float() - value.float()).norm() / value.float().norm().clamp(min=1e-30)
    if error > 0.1:
        raise RuntimeError(
            f"quantizing a weight to FP8 ({type(quantizer).__name__}) is off by {error.item():.0%}; this "
            "Transformer Engine version holds FP8 weights differently: load the model without fp8_weights"
        )
    return quantized


def holds_fp8_weights(layer: nn.Module) -> bool:
    """Whether a TE layer's weights are FP8 tensors (`quantized_model_init`)."""
    return any(hasattr(parameter, "_quantizer") for parameter in layer.parameters())


def make_fp8_recipe(name: str) -> Any:
    """The Transformer Engine recipe object for `config.fp8_recipe`."""
    recipe = importlib.import_module("transformer_engine.common.recipe")
    return {
        "delayed": recipe.DelayedScaling,
        "current": recipe.Float8CurrentScaling,
        "block": recipe.Float8BlockScaling,
    }[name]()


# --------------------------------------------------------------------------------------------------------------
# Sequence layouts
# --------------------------------------------------------------------------------------------------------------


class PackedSequences:
    """Where the tokens of N proteins lie when packed (THD) and in a padded view `[B, S]` of them.

    The padded view is either the layout a padded input came in (`from_attention_mask`: any padding on the left
    and/or right of each row) or the right-padded `[N, max_length]` layout (`right_padded`), in which the PyTorch
    attention and padded (BSHD) layers run.

    Attributes:
        cu_seq_lens: `[N + 1]` int32; protein i is packed tokens `cu_seq_lens[i]:cu_seq_lens[i + 1]`.
        max_length: Length of the longest protein (or more), in tokens.
        num_tokens: T, the number of packed tokens.
        padded_shape: `(B, S)` of the padded view.
    """

    def __init__(
        self,
        cu_seq_lens: torch.Tensor,
        max_length: int,
        num_tokens: int,
        padded_shape: tuple[int, int],
        token_index: torch.Tensor | None = None,
    ) -> None:
        self.cu_seq_lens = cu_seq_lens
        self.max_length = max_length
        self.num_tokens = num_tokens
        self.padded_shape = padded_shape
        self._token_index = token_index

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor, max_length: int) -> PackedSequences:
        """Describe the tokens that `attention_mask [B, S]` keeps (1 = token, 0 = padding) in that layout."""
        lengths = attention_mask.sum(dim=1, dtype=torch.int32)
        cu_seq_lens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        token_index = attention_mask.flatten().nonzero().squeeze(1)
        return cls(cu_seq_lens, max_length, token_index.numel(), tuple(attention_mask.shape), token_index)

    @classmethod
    def right_padded(cls, cu_seq_lens: torch.Tensor, max_length: int, num_tokens: int) -> PackedSequences:
        """Describe packed proteins whose padded view is `[N, max_length]`, each protein at the start of its row."""
        return cls(cu_seq_lens.to(torch.int32), max_length, num_tokens, (cu_seq_lens.numel() - 1, max_length))

    @property
    def token_index(self) -> torch.Tensor:
        """`[T]` int64; index of each packed token in the flattened padded view `[B * S]` (computed on first use)."""
        if self._token_index is None:
            sequence_index = sequence_index_of_tokens(self.cu_seq_lens, self.num_tokens)
            position = torch.arange(self.num_tokens, device=self.cu_seq_lens.device) - self.cu_seq_lens[sequence_index]
            self._token_index = sequence_index * self.max_length + position
        return self._token_index

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` tokens per protein."""
        return self.cu_seq_lens.diff()

    @property
    def sequence_index(self) -> torch.Tensor:
        """`[T]` the protein each packed token belongs to."""
        return self.token_index // self.padded_shape[1]

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """`[B, S, ...]` -> `[T, ...]`, keeping only the tokens."""
        return padded.flatten(0, 1).index_select(0, self.token_index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> `[B, S, ...]`, zeros at padding."""
        batch, length = self.padded_shape
        flat = packed.new_zeros(batch * length, *packed.shape[1:])
        return flat.index_copy(0, self.token_index, packed).view(batch, length, *packed.shape[1:])

    def key_mask(self) -> torch.Tensor:
        """`[N, max_length]` bool, True where the right-padded view holds a token."""
        positions = torch.arange(self.max_length, device=self.cu_seq_lens.device)
        return positions < self.lengths[:, None]


def pack_proteins(
    proteins: Sequence[torch.Tensor | Sequence[int]], labels: Sequence[torch.Tensor | Sequence[int]] | None = None
) -> dict[str, Any]:
    """Packed (THD) model inputs for N proteins' token ids (1-D tensors or int lists, `<cls>`/`<eos>` included).

    Returns the keyword arguments of the packed forward, as `DataCollatorWithFlattening(return_flash_attn_kwargs=
    True)` gives them: `input_ids [1, T]` int64, `position_ids [1, T]` (restarting at 0 for each protein),
    `cu_seq_lens_q`/`cu_seq_lens_k [N + 1]` int32, `max_length_q`/`max_length_k` (longest protein, int), and with
    per-token `labels` (one sequence per protein, same lengths) `labels [1, T]` int64. Tensors are on the CPU.
    """
    if not proteins:
        raise ValueError("pack_proteins needs at least one protein.")
    ids = [torch.as_tensor(protein, dtype=torch.int64).reshape(-1) for protein in proteins]
    lengths = torch.tensor([len(protein) for protein in ids])
    if (lengths == 0).any():
        raise ValueError(f"protein {int((lengths == 0).nonzero()[0])} has no tokens.")
    cu_seq_lens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    max_length = int(lengths.max())
    inputs = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat([torch.arange(length) for length in lengths.tolist()])[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    if labels is not None:
        label_ids = [torch.as_tensor(label, dtype=torch.int64).reshape(-1) for label in labels]
        if [len(label) for label in label_ids] != lengths.tolist():
            raise ValueError("labels must hold one label per token of each protein.")
        inputs["labels"] = torch.cat(label_ids)[None]
    return inputs


def pad_proteins(
    proteins: Sequence[torch.Tensor | Sequence[int]], pad_token_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Padded (BSHD) model inputs for N proteins' token ids: `input_ids [N, S]` int64 with `pad_token_id` at
    padding and `attention_mask [N, S]` int64 (1 = token), S the longest protein, padding on `padding_side`."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    if not proteins:
        raise ValueError("pad_proteins needs at least one protein.")
    ids = [torch.as_tensor(protein, dtype=torch.int64).reshape(-1) for protein in proteins]
    empty = [index for index, protein in enumerate(ids) if len(protein) == 0]
    if empty:
        raise ValueError(f"protein {empty[0]} has no tokens.")
    width = max(len(protein) for protein in ids)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.int64)
    for row, protein in enumerate(ids):
        columns = slice(width - len(protein), width) if padding_side == "left" else slice(0, len(protein))
        input_ids[row, columns] = protein
        attention_mask[row, columns] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def sequence_index_of_tokens(cu_seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[T]` index of the protein that each of `num_tokens` packed tokens belongs to."""
    boundaries = cu_seq_lens[1:-1].contiguous()
    return torch.bucketize(torch.arange(num_tokens, device=cu_seq_lens.device), boundaries, right=True)


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
    dummies = -(-(tokens - num_tokens) // length)
    slots = max(16, 1 << (max(num_sequences + dummies, tokens // (length // 4)) - 1).bit_length())
    return tokens, slots, length


def raise_on_failed_checks(checks: list[tuple[torch.Tensor, str]], enabled: bool = True) -> None:
    """Evaluate boolean scalar tensors with one device sync; raise ValueError with the first failing message.

    `enabled=False` (`config.check_inputs=False`) skips the sync for trusted training pipelines."""
    if not checks or not enabled:
        return
    passed = torch.stack([flag.reshape(()) for flag, _ in checks]).tolist()
    for ok, (_, message) in zip(passed, checks):
        if not ok:
            raise ValueError(message)


@dataclass
class EncoderInputs:
    """What every encoder layer needs besides the hidden states, in the layout the layers run in.

    Attributes:
        rotary_angles: `[L, head_dim]` float32 rotary angles for positions `0..L-1`.
        key_mask: BSHD only: `[B, S]` bool, True for tokens; None when nothing is padded.
        packed: THD only: the packing of the hidden states `[T, hidden]`.
        static_shape: THD only: the batch was padded to a bucket (`static_shape`) to run as a CUDA graph.
        context_parallel: THD with context parallelism only: which tokens this rank's layers run (`packed` is then
            the whole batch's packing).
    """

    rotary_angles: torch.Tensor
    key_mask: torch.Tensor | None = None
    packed: PackedSequences | None = None
    static_shape: bool = False
    context_parallel: ContextParallelLayout | None = None

    @functools.cached_property
    def te_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `transformer_engine.pytorch.TransformerLayer.forward` (built once per batch)."""
        kwargs: dict[str, Any] = {"rotary_pos_emb": self.rotary_angles[:, None, None, :]}
        layout = self.context_parallel
        if layout is not None:  # real and padded lengths of the whole batch; TE finds this rank's part
            kwargs.update(
                self_attn_mask_type="padding",
                cu_seqlens_q=layout.cu_seq_lens,
                cu_seqlens_kv=layout.cu_seq_lens,
                cu_seqlens_q_padded=layout.cu_seq_lens_padded,
                cu_seqlens_kv_padded=layout.cu_seq_lens_padded,
                max_seqlen_q=layout.max_length,
                max_seqlen_kv=layout.max_length,
                pad_between_seqs=True,
            )
        elif self.packed is not None:
            cu_seq_lens, max_length = self.packed.cu_seq_lens, self.packed.max_length
            kwargs.update(
                self_attn_mask_type="padding",
                cu_seqlens_q=cu_seq_lens,
                cu_seqlens_kv=cu_seq_lens,
                max_seqlen_q=max_length,
                max_seqlen_kv=max_length,
            )
        elif self.key_mask is not None:
            kwargs.update(self_attn_mask_type="padding", attention_mask=~self.key_mask[:, None, None, :])
        else:
            kwargs.update(self_attn_mask_type="no_mask")
        return kwargs


# --------------------------------------------------------------------------------------------------------------
# Tensor parallelism (Transformer Engine's `set_parallel_mode` with sequence parallelism, and the twin's copy)
# --------------------------------------------------------------------------------------------------------------

# The layer parameters that tensor parallelism splits across its ranks, by name inside a layer, with the dimension
# they are split along: query/key/value rows (interleaved per head, so each rank gets whole heads) and fc1 rows
# (column-parallel), and the columns of the attention output projection and of fc2 (row-parallel). Every other
# layer parameter (LayerNorms, the two output biases) is whole on each rank and sees only that rank's tokens, so
# its gradient there is a partial sum over the tensor-parallel ranks.
TENSOR_PARALLEL_SPLITS = {
    "self_attention.layernorm_qkv.weight": 0,
    "self_attention.layernorm_qkv.bias": 0,
    "self_attention.proj.weight": 1,
    "layernorm_mlp.fc1_weight": 0,
    "layernorm_mlp.fc1_bias": 0,
    "layernorm_mlp.fc2_weight": 1,
}


def tensor_parallel_split_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits the parameter `name` (a model's, an encoder's or a layer
    list's: `....layers.<i>.<name in the layer>`; `TENSOR_PARALLEL_SPLITS`), or None for one every rank holds
    whole."""
    _, in_layers, rest = f".{name}".partition(".layers.")
    return TENSOR_PARALLEL_SPLITS.get(rest.split(".", 1)[-1]) if in_layers else None


@dataclass(frozen=True)
class RankGroup:
    """The ranks that share a batch under tensor or context parallelism: the process `group`, its `size` and this
    process's `rank` in it. Tensor parallelism: each rank holds `1/size` of every layer's heads and MLP columns
    and, between the layers' matrix products, `1/size` of the tokens (sequence parallelism)."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> RankGroup:
        distributed = torch.distributed
        return cls(group, distributed.get_world_size(group), distributed.get_rank(group))


def _collective(name: str, older_name: str) -> Callable:
    distributed = torch.distributed
    return getattr(distributed, name, None) or getattr(distributed, older_name)


def _all_gather_tokens(x: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """`[t, ...]` on each rank -> `[size * t, ...]`, the ranks' tokens in rank order."""
    gathered = x.new_empty((ranks.size * x.shape[0], *x.shape[1:]))
    _collective("all_gather_single", "all_gather_into_tensor")(gathered, x.contiguous(), group=ranks.group)
    return gathered


def _reduce_scatter_tokens(x: torch.Tensor, ranks: RankGroup) -> torch.Tensor:
    """`[T, ...]` partial sums on each rank -> this rank's `[T / size, ...]` of their sum."""
    part = x.new_empty((x.shape[0] // ranks.size, *x.shape[1:]))
    _collective("reduce_scatter_single", "reduce_scatter_tensor")(part, x.contiguous(), group=ranks.group)
    return part


class _GatherTokens(torch.autograd.Function):
    """All-gather the tokens `[T / size, ...] -> [T, ...]`. Backward: when the ranks use the gathered tokens
    differently (they feed split weights), each rank's gradient is partial and is reduce-scattered; when every
    rank computes the same from them (`replicated`), each keeps its own part of its (whole) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: RankGroup, replicated: bool) -> torch.Tensor:
        ctx.ranks, ctx.replicated = ranks, replicated
        return _all_gather_tokens(x, ranks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.replicated:
            return grad.chunk(ctx.ranks.size)[ctx.ranks.rank].contiguous(), None, None
        return _reduce_scatter_tokens(grad, ctx.ranks), None, None


class _ScatterTokens(torch.autograd.Function):
    """This rank's tokens `[T, ...] -> [T / size, ...]`: of the ranks' sum (`summed`: the partial products of a
    row-parallel weight, reduce-scattered) or of a tensor every rank holds whole. Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranks: RankGroup, summed: bool) -> torch.Tensor:
        ctx.ranks = ranks
        return _reduce_scatter_tokens(x, ranks) if summed else x.chunk(ranks.size)[ranks.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_tokens(grad, ctx.ranks), None, None


def gather_tokens(x: torch.Tensor, ranks: RankGroup, replicated: bool = False) -> torch.Tensor:
    """`_GatherTokens`: `[T / size, ...] -> [T, ...]`."""
    return _GatherTokens.apply(x, ranks, replicated)


def scatter_tokens(x: torch.Tensor, ranks: RankGroup, summed: bool) -> torch.Tensor:
    """`_ScatterTokens`: `[T, ...] -> [T / size, ...]`."""
    return _ScatterTokens.apply(x, ranks, summed)


# --------------------------------------------------------------------------------------------------------------
# Context parallelism (Transformer Engine's context-parallel attention on packed layers, and the twin's copy)
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextParallel(RankGroup):
    """A context-parallel group: each of its `size` ranks runs the layers on part of every protein's tokens
    (`ContextParallelLayout`) and exchanges keys and values with the others in attention. `ranks`: the group's
    global ranks (Transformer Engine's ring needs them)."""

    ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, group: Any) -> ContextParallel:
        distributed = torch.distributed
        ranks = tuple(distributed.get_process_group_ranks(group))
        return cls(group, len(ranks), distributed.get_rank(group), ranks)


@dataclass
class ContextParallelLayout:
    """Where each token of a packed batch runs under context parallelism, Transformer Engine's THD layout: every
    protein is padded to a multiple of `2 * size` tokens and cut into `2 * size` chunks; rank r runs chunks r and
    `2 * size - 1 - r` of each (the early and late chunks of a protein attend to few and many keys: one of each
    balances the work), protein after protein. Every rank runs `num_tokens_padded / size` tokens.

    Attributes:
        cp: the group.
        cu_seq_lens: `[N + 1]` int32, the real lengths (with a dummy protein when the token count was rounded up).
        cu_seq_lens_padded: `[N + 1]` int32, the padded lengths (each a multiple of `2 * size`).
        max_length: the longest padded protein (an upper bound).
        to_padded: `[T]` each real token's place in the padded batch.
        rank_order: `[T_padded]` the padded batch's tokens in rank order (rank 0's, then rank 1's, ...), as places
            in the padded batch; `from_rank_order` is its inverse.
        local_positions: `[T_padded / size]` their positions in their protein.
        local: the packing of this rank's tokens (each protein's two chunks side by side).
        padded: the packing of the padded batch.
        key_mask: `[N, max_length]` True for the real tokens of each padded protein.
    """

    cp: ContextParallel
    cu_seq_lens: torch.Tensor
    cu_seq_lens_padded: torch.Tensor
    max_length: int
    to_padded: torch.Tensor
    rank_order: torch.Tensor
    from_rank_order: torch.Tensor
    local_positions: torch.Tensor
    local: PackedSequences
    padded: PackedSequences
    key_mask: torch.Tensor

    @classmethod
    def of(cls, packed: PackedSequences, cp: ContextParallel, token_multiple: int = 1) -> ContextParallelLayout:
        """The layout of `packed` (real proteins); the padded token count is also rounded up to a multiple of
        `token_multiple * size` (FP8), with a dummy protein. One device sync (the padded token count)."""
        unit, device = 2 * cp.size, packed.cu_seq_lens.device
        lengths = packed.cu_seq_lens.diff().long()
        padded_lengths = (lengths + unit - 1) // unit * unit
        num_padded = int(padded_lengths.sum())
        multiple = math.lcm(unit, token_multiple * cp.size)
        max_length = -(-packed.max_length // unit) * unit
        if num_padded % multiple:
            extra = -num_padded % multiple
            dummy = torch.tensor([extra], device=device)
            lengths, padded_lengths = torch.cat([lengths, dummy]), torch.cat([padded_lengths, dummy])
            max_length, num_padded = max(max_length, extra), num_padded + extra
        cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        cu_seq_lens_padded = F.pad(padded_lengths.cumsum(0), (1, 0)).to(torch.int32)
        sequences = torch.arange(len(lengths), device=device)
        protein = torch.repeat_interleave(sequences, padded_lengths, output_size=num_padded)
        position = torch.arange(num_padded, device=device) - cu_seq_lens_padded[protein]
        chunk = position // (padded_lengths[protein] // unit)
        owner = torch.where(chunk < cp.size, chunk, unit - 1 - chunk)
        rank_order = torch.argsort(owner * num_padded + torch.arange(num_padded, device=device))
        from_rank_order = torch.empty_like(rank_order)
        from_rank_order[rank_order] = torch.arange(num_padded, device=device)
        num_local = num_padded // cp.size
        own = rank_order[cp.rank * num_local : (cp.rank + 1) * num_local]
        num_real = packed.cu_seq_lens.numel() - 1
        real = torch.repeat_interleave(sequences[:num_real], lengths[:num_real], output_size=packed.num_tokens)
        to_padded = cu_seq_lens_padded[real] + torch.arange(packed.num_tokens, device=device) - packed.cu_seq_lens[real]
        return cls(
            cp=cp,
            cu_seq_lens=cu_seq_lens,
            cu_seq_lens_padded=cu_seq_lens_padded,
            max_length=max_length,
            to_padded=to_padded,
            rank_order=rank_order,
            from_rank_order=from_rank_order,
            local_positions=position[own],
            local=PackedSequences.right_padded(cu_seq_lens_padded // cp.size, max_length // cp.size, num_local),
            padded=PackedSequences.right_padded(cu_seq_lens_padded, max_length, num_padded),
            key_mask=torch.arange(max_length, device=device) < lengths[:, None],
        )

    def own_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` (every rank holds them all) -> this rank's `[T_padded / size, ...]` (zeros at padding).
        Backward gathers every rank's part, so what computed `states` gets its whole gradient on each rank."""
        padded = states.new_zeros((self.padded.num_tokens, *states.shape[1:])).index_copy(0, self.to_padded, states)
        return scatter_tokens(padded[self.rank_order], self.cp, summed=False)

    def all_tokens(self, states: torch.Tensor) -> torch.Tensor:
        """This rank's `[T_padded / size, ...]` -> every real token `[T, ...]` (the same on every rank)."""
        gathered = gather_tokens(states, self.cp, replicated=True)
        return gathered[self.from_rank_order][self.to_padded]


# --------------------------------------------------------------------------------------------------------------
# PyTorch twin of Transformer Engine's TransformerLayer
# --------------------------------------------------------------------------------------------------------------


def gelu(x: torch.Tensor) -> torch.Tensor:
    """ESM's exact (erf) GELU."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> `[-x2, x1]` for halves x1, x2 of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, heads, S, d]` by `angles [S, d]` (float32 math, result in x's dtype)."""
    x32 = x.float()
    return (x32 * angles.cos() + rotate_half(x32) * angles.sin()).to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# LoRA targets: where stock PEFT attaches adapters
# --------------------------------------------------------------------------------------------------------------

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
    """A folder of `NVEsmLoraTarget`s (as transformers' `EsmAttention`, `EsmIntermediate`, ... are of Linears)."""


def add_lora_targets(layer: nn.Module, qkv: nn.Module, proj: nn.Module, mlp: nn.Module, config: NVEsmConfig) -> None:
    """Give `layer` its `LORA_TARGETS` and tell each fused module (`qkv`: LayerNorm + QKV, `proj`, `mlp`: LayerNorm
    + fc1 + GELU + fc2; TE's or the twins) which targets' updates to add (`lora_targets`, plain attributes)."""
    hidden, heads = config.hidden_size, config.num_attention_heads

    def folder(**targets: nn.Module) -> NVEsmLoraTargets:
        module = NVEsmLoraTargets()
        for name, target in targets.items():
            module.add_module(name.rstrip("_"), target)
        return module

    attention_self = folder(
        **{
            name: NVEsmLoraTarget(qkv, "", hidden, hidden, part, heads)
            for part, name in enumerate(("query", "key", "value"))
        }
    )
    attention_self.num_heads = heads  # how `with_qkv_updates` interleaves the updates
    attention_output = folder(dense=NVEsmLoraTarget(proj, "", hidden, hidden, None, heads))
    intermediate = folder(dense=NVEsmLoraTarget(mlp, "fc1_", hidden, config.intermediate_size, None, heads))
    output = folder(dense=NVEsmLoraTarget(mlp, "fc2_", config.intermediate_size, hidden, None, heads))
    layer.attention = folder(self_=attention_self, output=attention_output)
    layer.intermediate, layer.output = intermediate, output
    qkv.__dict__["lora_targets"] = attention_self
    proj.__dict__["lora_targets"] = attention_output
    mlp.__dict__["lora_targets"] = (intermediate, output)


def _updates(folder: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The updates of `folder`'s targets for input `x` (0 where an adapter is off), or None when none has one."""
    if not has_active_adapters_in(folder):
        return None
    return [target(x) for target in folder._modules.values()]


def with_qkv_updates(fused: nn.Module, normed: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """`qkv [..., 3 * hidden]` (rows interleaved per head) plus the query/key/value adapters' updates of the
    LayerNormed input `normed`."""
    folder = fused.__dict__.get("lora_targets")
    updates = None if folder is None else _updates(folder, normed)
    if updates is None:
        return qkv
    heads = folder.num_heads
    shape = (*qkv.shape[:-1], qkv.shape[-1] // 3)
    parts = [update.to(qkv.dtype).expand(shape).unflatten(-1, (heads, -1)) for update in updates]
    return qkv + torch.stack(parts, dim=-2).flatten(-3)


def with_update(folder: nn.Module | None, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """`output` plus the update of `folder`'s one target (`dense`) for its input `x`."""
    updates = None if folder is None else _updates(folder, x)
    return output if updates is None else output + updates[0].to(output.dtype)


def has_active_adapters_in(folder: nn.Module | None) -> bool:
    """Whether PEFT has wrapped any target of `folder` (a `NVEsmLoraTargets`)."""
    return folder is not None and any(type(target) is not NVEsmLoraTarget for target in folder._modules.values())


def has_active_adapters(layer: nn.Module) -> bool:
    """Whether PEFT has wrapped any of `layer`'s `LORA_TARGETS`."""
    folders = (layer.attention.self, layer.attention.output, layer.intermediate, layer.output)
    return any(has_active_adapters_in(folder) for folder in folders)


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
            raise ValueError(
                f"a LoRA adapter on `{name}` is not supported: it is a fused module. Target the projections by "
                'their transformers names: "query", "key", "value", "dense" (attention.output.dense, '
                "intermediate.dense, output.dense)."
            )


class NVEsmLayerNormLinear(nn.Module):
    """LayerNorm then Linear, with the parameter names of `transformer_engine.pytorch.LayerNormLinear`.

    With `tensor_parallel` (column-parallel): `out_features` is this rank's rows; the LayerNormed tokens of all
    ranks are gathered before the product, `[T / size, in] -> [T, out]`."""

    def __init__(
        self, in_features: int, out_features: int, eps: float, tensor_parallel: RankGroup | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tensor_parallel = tensor_parallel
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features))
        self.layer_norm_bias = nn.Parameter(torch.zeros(in_features))
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        if self.tensor_parallel is not None:
            normed = gather_tokens(normed, self.tensor_parallel)
        return with_qkv_updates(self, normed, F.linear(normed, self.weight, self.bias))


class NVEsmLinear(nn.Module):
    """Linear with the parameter names of `transformer_engine.pytorch.Linear` (the attention output projection;
    not an `nn.Linear`, so that PEFT adapts it only as `attention.output.dense`, as on TE).

    With `tensor_parallel` (row-parallel): `in_features` is this rank's columns; the ranks' partial products are
    summed and scattered by tokens before the bias is added, `[T, in] -> [T / size, out]`."""

    def __init__(self, in_features: int, out_features: int, tensor_parallel: RankGroup | None = None) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensor_parallel is not None:
            return scatter_tokens(F.linear(x, self.weight), self.tensor_parallel, summed=True) + self.bias
        return with_update(self.__dict__.get("lora_targets"), x, F.linear(x, self.weight, self.bias))


class NVEsmLayerNormMLP(nn.Module):
    """LayerNorm, fc1, GELU, fc2, with the parameter names of `transformer_engine.pytorch.LayerNormMLP`.

    With `tensor_parallel`: `intermediate_size` is this rank's part; fc1 is column-parallel and fc2 row-parallel
    (tokens gathered after the LayerNorm, summed and scattered before fc2's bias), `[T / size, hidden]` in and out.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, eps: float, tensor_parallel: RankGroup | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.tensor_parallel = tensor_parallel
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden_size))
        self.fc1_weight = nn.Parameter(torch.empty(intermediate_size, hidden_size))
        self.fc1_bias = nn.Parameter(torch.zeros(intermediate_size))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tensor_parallel
        if tp is None:
            return mlp_with_updates(self, x, gelu, add_fc2_bias=True)
        normed = gather_tokens(
            F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps), tp
        )
        activated = gelu(F.linear(normed, self.fc1_weight, self.fc1_bias))
        return scatter_tokens(F.linear(activated, self.fc2_weight), tp, summed=True) + self.fc2_bias


class NVEsmSelfAttention(nn.Module):
    """Pre-LN rotary self-attention with the parameter names of TE's `MultiheadAttention`.

    `layernorm_qkv.weight` rows are interleaved per head, `[h0: q, k, v | h1: q, k, v | ...]`, as TE's
    default `qkv_weight_interleaved=True`. Attention is `torch.nn.functional.scaled_dot_product_attention`.
    With `tensor_parallel`, this rank's `num_heads / size` heads attend over all tokens.
    """

    def __init__(self, config: NVEsmConfig, tensor_parallel: RankGroup | None = None) -> None:
        super().__init__()
        size = 1 if tensor_parallel is None else tensor_parallel.size
        self.num_heads = config.num_attention_heads // size
        self.head_dim = config.head_dim
        self.dropout = config.attention_probs_dropout_prob
        width = self.num_heads * self.head_dim
        self.layernorm_qkv = NVEsmLayerNormLinear(config.hidden_size, 3 * width, config.layer_norm_eps, tensor_parallel)
        self.proj = NVEsmLinear(width, config.hidden_size, tensor_parallel)

    def forward(self, hidden_states: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor:
        """`[B, S, hidden]` (BSHD) or `[T, hidden]` (THD) -> same shape."""
        qkv = self.layernorm_qkv(hidden_states)
        if inputs.context_parallel is not None:
            return self.proj(self.attend_across_ranks(qkv, inputs))
        key_mask = inputs.key_mask
        if inputs.packed is not None:  # attention runs on the padded view, the rest stays packed
            qkv, key_mask = inputs.packed.unpack(qkv), inputs.packed.key_mask()
        batch, length = qkv.shape[:2]
        query, key, value = qkv.view(batch, length, self.num_heads, 3, self.head_dim).transpose(1, 2).unbind(3)
        # ESM scales the query before the rotation (as transformers does), then attends with scale 1.
        query = apply_rotary(query * self.head_dim**-0.5, inputs.rotary_angles[:length])
        key = apply_rotary(key, inputs.rotary_angles[:length])
        context = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=None if key_mask is None else key_mask[:, None, None, :],
            dropout_p=self.dropout if self.training else 0.0,
            scale=1.0,
        )
        context = context.transpose(1, 2).reshape(batch, length, -1)
        if inputs.packed is not None:
            context = inputs.packed.pack(context)
        return self.proj(context)

    def attend_across_ranks(self, qkv: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor:
        """Context parallelism: this rank's queries `[T_local, 3 * hidden] -> [T_local, hidden]` attend to the
        keys and values of every rank (all-gathered: simpler than Transformer Engine's ring, the same result)."""
        layout = inputs.context_parallel
        qkv = qkv.view(qkv.shape[0], self.num_heads, 3, self.head_dim)
        keys_values = gather_tokens(qkv[:, :, 1:].contiguous(), layout.cp)[layout.from_rank_order]
        key, value = layout.padded.unpack(keys_values).permute(0, 2, 1, 3, 4).unbind(3)  # [N, heads, L, d]
        query = layout.local.unpack(qkv[:, :, 0]).transpose(1, 2)  # [N, heads, L / size, d]
        query_angles = layout.local.unpack(inputs.rotary_angles[layout.local_positions])[:, None]
        query = apply_rotary(query * self.head_dim**-0.5, query_angles)
        key = apply_rotary(key, inputs.rotary_angles[: key.shape[2]])
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=layout.key_mask[:, None, None, :], scale=1.0
        )
        return layout.local.pack(context.transpose(1, 2).flatten(2))


class NVEsmTorchLayer(nn.Module):
    """Pure-PyTorch twin of `transformer_engine.pytorch.TransformerLayer` as NVEsm configures it (with
    `tensor_parallel`: as `set_parallel_mode=True, sequence_parallel=True` configures it)."""

    def __init__(self, config: NVEsmConfig, tensor_parallel: RankGroup | None = None) -> None:
        super().__init__()
        self.self_attention = NVEsmSelfAttention(config, tensor_parallel)
        size = 1 if tensor_parallel is None else tensor_parallel.size
        self.layernorm_mlp = NVEsmLayerNormMLP(
            config.hidden_size, config.intermediate_size // size, config.layer_norm_eps, tensor_parallel
        )
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        attention = self.self_attention
        add_lora_targets(self, attention.layernorm_qkv, attention.proj, self.layernorm_mlp, config)

    def forward(self, hidden_states: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor:
        refuse_adapters_on_fused_modules(self)
        hidden_states = hidden_states + self.dropout(self.self_attention(hidden_states, inputs))
        return hidden_states + self.dropout(self.layernorm_mlp(hidden_states))


@functools.cache
def te_layer_class() -> type[nn.Module]:
    """`NVEsmTELayer`: TE's `TransformerLayer` called as the twin is, `layer(hidden_states, inputs)`.

    Built on first use, as it subclasses a Transformer Engine class. Its parameters and state dict are
    `TransformerLayer`'s, unchanged."""
    te = import_transformer_engine()

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
            folder = self.__dict__.get("lora_targets")
            if isinstance(result, tuple):  # (output, bias) with return_bias
                return (with_update(folder, inp, result[0]), *result[1:])
            return with_update(folder, inp, result)

    class NVEsmTELayerNormMLP(te.LayerNormMLP):
        """TE's fused LayerNorm + MLP; with fc1/fc2 adapters, the same computation unfused (TE's tanh GELU)."""

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            folders = self.__dict__.get("lora_targets", ())
            if not any(has_active_adapters_in(folder) for folder in folders):
                return super().forward(inp, *args, **kwargs)
            gelu_tanh = functools.partial(F.gelu, approximate="tanh")
            output = mlp_with_updates(self, inp, gelu_tanh, add_fc2_bias=not self.return_bias)
            return (output, self.fc2_bias) if self.return_bias else output

    class NVEsmTELayer(te.TransformerLayer):
        def __init__(self, *args: Any, config: NVEsmConfig, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            attention = self.self_attention
            attention.layernorm_qkv.__class__ = NVEsmTELayerNormLinear  # same state, forwards that add adapters
            attention.proj.__class__ = NVEsmTELinear
            self.layernorm_mlp.__class__ = NVEsmTELayerNormMLP
            add_lora_targets(self, attention.layernorm_qkv, attention.proj, self.layernorm_mlp, config)

        def forward(self, hidden_states: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor:  # type: ignore[override]
            """`[B, S, hidden]` (BSHD) or `[T, hidden]` (THD) -> same shape."""
            refuse_adapters_on_fused_modules(self)
            return super().forward(hidden_states, **inputs.te_kwargs)

    for cls in (NVEsmTELayerNormLinear, NVEsmTELinear, NVEsmTELayerNormMLP, NVEsmTELayer):
        cls.__qualname__ = cls.__name__  # module-level names, so that models pickle (torch.save(model))
        globals()[cls.__name__] = cls
    return NVEsmTELayer


def make_te_layer(
    config: NVEsmConfig,
    layer_number: int,
    tensor_parallel: RankGroup | None = None,
    params_dtype: torch.dtype | None = None,
) -> nn.Module:
    """A Transformer Engine `TransformerLayer` (`te_layer_class`) shaped as ESM-2's layer `layer_number` (1-based);
    with `tensor_parallel`, this rank's part of it (`set_parallel_mode`, sequence parallelism). Parameters in
    `params_dtype` (default: torch's default dtype)."""
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


# --------------------------------------------------------------------------------------------------------------
# Model parts
# --------------------------------------------------------------------------------------------------------------


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


def attention_probabilities(
    layer: nn.Module, hidden_states: torch.Tensor, inputs: EncoderInputs, config: NVEsmConfig
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
    key_mask = inputs.key_mask
    if inputs.packed is not None:
        qkv, key_mask = inputs.packed.unpack(qkv), inputs.packed.key_mask()
    batch, length = qkv.shape[:2]
    if key_mask is None:
        key_mask = torch.ones((batch, length), dtype=torch.bool, device=qkv.device)
    heads, head_dim = config.num_attention_heads, config.head_dim
    query, key, _ = qkv.view(batch, length, heads, 3, head_dim).transpose(1, 2).unbind(3)
    query = apply_rotary(query * head_dim**-0.5, inputs.rotary_angles[:length])
    key = apply_rotary(key, inputs.rotary_angles[:length])
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2))
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return scores.softmax(-1).nan_to_num() * key_mask[:, None, :, None]


class FreshWhenCopied:
    """Runtime state of one model object (captured CUDA graphs, an offload context holding a CUDA stream) that
    `copy.deepcopy` and pickling give as new, empty state: a copied or loaded model builds its own."""

    def __deepcopy__(self, memo: dict) -> FreshWhenCopied:
        return type(self)()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class ActivationOffload(FreshWhenCopied):
    """Transformer Engine's CPU offload context for the encoder's layers (`config.offload_activations`), built on
    first use, and whether an offloaded training forward still waits for its backward. TE hands saved tensors back
    by layer and position, so a second forward before the first one's backward would give that backward the second
    forward's activations: it is refused."""

    def __init__(self) -> None:
        self.context: Any = None  # entered around each layer's forward
        self.sync: Callable[[torch.Tensor], torch.Tensor] | None = None  # each layer's output passes through it
        self.awaiting_backward = False

    def build(self, num_layers: int) -> None:
        """Offload every layer but the last. TE then finishes copying layer i out before layer i + 1 runs and
        copies it back when layer i's backward starts (no overlap with compute)."""
        if not transformer_engine_available():
            raise ImportError(f"offload_activations uses Transformer Engine's offloading. {TE_INSTALL_HINT}")
        offloading = importlib.import_module("transformer_engine.pytorch.cpu_offload")
        if not hasattr(offloading, "DefaultOffloadSynchronizer") or offloading.NVTE_CPU_OFFLOAD_V1:
            raise ImportError(
                "offload_activations needs Transformer Engine's offloading of any saved tensor (TE 2.20's default; "
                "not the NVTE_CPU_OFFLOAD_V1=1 code path, which offloads only what TE modules mark)."
            )
        self.context, self.sync = import_transformer_engine().get_cpu_offload_context(
            enabled=True, num_layers=num_layers - 1, model_layers=num_layers
        )

    def forward_done(self, output: torch.Tensor) -> None:
        """An offloaded forward finished with `output` (the last layer's): no other until its backward starts."""
        if output.requires_grad:
            self.awaiting_backward = True
            output.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        self.awaiting_backward = False


class NVEsmEncoder(nn.Module):
    """The transformer layers (TE or PyTorch twin) and the final LayerNorm.

    With `config.cuda_graphs` (TE backend, packed layers), batches padded to a static shape run as CUDA graphs
    captured once per shape (when, `StaticShapeGraphs` says) with Transformer Engine's `make_graphed_callables`:
    one graph for the forward of all layers and one for their backward, replayed instead of launching every kernel
    from Python.
    """

    def __init__(self, config: NVEsmConfig, backend: str) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        if backend == "te":
            self.fp8_recipe = make_fp8_recipe(config.fp8_recipe) if config.uses_fp8 else None
            self.fp8_weight_recipes = self._fp8_weight_recipes()
            with fp8_weights_init(None):  # high precision first: `hold_fp8_weights` quantizes with fitting scales
                self.layers = nn.ModuleList(make_te_layer(config, i + 1) for i in range(config.num_hidden_layers))
        else:
            if config.fp8_weights:
                raise ValueError("fp8_weights holds weights in Transformer Engine's FP8 tensors: needs backend='te'.")
            self.layers = nn.ModuleList(NVEsmTorchLayer(config) for _ in range(config.num_hidden_layers))
            self.fp8_recipe = None
            self.fp8_weight_recipes = [None] * config.num_hidden_layers
            if config.uses_fp8:
                logger.warning_once("layer_precision asks for FP8, which needs backend='te'; running without FP8.")
        self.emb_layer_norm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.tensor_parallel: RankGroup | None = None  # set by `enable_tensor_parallel`
        self.context_parallel: ContextParallel | None = None  # set by `enable_context_parallel`
        self.graphs = StaticShapeGraphs()
        self._offload = ActivationOffload()
        self.register_state_dict_post_hook(_drop_te_extra_state)
        self.register_load_state_dict_post_hook(_ignore_missing_te_extra_state)
        self.register_load_state_dict_pre_hook(_quantize_fp8_weights)
        self.hold_fp8_weights()  # on the meta device (from_pretrained), after loading instead

    def _fp8_weight_recipes(self) -> list[Any]:
        """Per layer, the recipe its weights are held in FP8 with, or None: `config.fp8_weights` holds the FP8
        layers' weights with `fp8_recipe`; a caller's `te.quantized_model_init` around the construction holds
        every layer's with its recipe."""
        config = self.config
        if config.fp8_weights:
            return [self.fp8_recipe if precision == "fp8" else None for precision in config.layer_precision]
        return [caller_fp8_weights_recipe()] * config.num_hidden_layers

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
                    new = make_te_layer(self.config, index + 1, params_dtype=dtype)
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
        inputs: EncoderInputs,
        output_hidden_states: bool,
        attention_sink: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """Run all layers. Returns the final (LayerNormed) states and, if asked, the embedding output, every
        layer's output, with the last one LayerNormed as in ESM and transformers. `attention_sink`, if given,
        receives each layer's attention probabilities (`attention_probabilities`) as the layers run."""
        if self.fp8_recipe is None and any(self.fp8_weight_recipes) and not caller_fp8_enabled():
            raise ValueError(
                "this model holds its layers' weights in FP8 (built inside te.quantized_model_init): run it under "
                "te.autocast(enabled=True, recipe=...), or load it with layer_precision and fp8_weights=True."
            )
        if inputs.static_shape:
            states = self.graphs.run(self, hidden_states, inputs)
            if states is not None:
                return states, None
        all_hidden_states = [hidden_states] if output_hidden_states else None
        tp = self.tensor_parallel
        layout = inputs.context_parallel
        if (tp is not None or layout is not None) and attention_sink is not None:
            raise ValueError(
                "attention maps (output_attentions, predict_contacts) are not supported with tensor or context "
                "parallelism."
            )
        if tp is not None:  # each rank runs its share of the tokens between the layers' products
            hidden_states = scatter_tokens(hidden_states, tp, summed=False)
        elif layout is not None:  # each rank runs its chunks of every protein
            if self.backend == "te" and _runs_in_fp32(hidden_states):
                raise ValueError(
                    "context parallelism on Transformer Engine needs 16-bit layers (its context-parallel attention "
                    "kernels take bf16 or fp16): cast the model (model.to(torch.bfloat16)) or run under "
                    "torch.autocast."
                )
            hidden_states = layout.own_tokens(hidden_states)
        with self.fp8_region():
            hidden_states = self.run_layers(hidden_states, inputs, all_hidden_states, attention_sink)
        if tp is not None or layout is not None:
            whole = (lambda h: gather_tokens(h, tp, replicated=True)) if tp is not None else layout.all_tokens
            hidden_states = whole(hidden_states)
            if all_hidden_states is not None:
                all_hidden_states[1:] = [whole(h) for h in all_hidden_states[1:]]
        hidden_states = self.emb_layer_norm_after(hidden_states)
        if all_hidden_states is None:
            return hidden_states, None
        all_hidden_states[-1] = hidden_states
        return hidden_states, tuple(all_hidden_states)

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        inputs: EncoderInputs,
        all_hidden_states: list | None = None,
        attention_sink: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """The layers alone (inside `fp8_region`), appending each layer's output to `all_hidden_states` and
        handing each layer's attention probabilities to `attention_sink`."""
        offload = self.activation_offload(hidden_states)
        try:
            for index, layer in enumerate(self.layers):
                if attention_sink is not None:
                    attention_sink(attention_probabilities(layer, hidden_states, inputs, self.config))
                with self.layer_precision(index), offload.context if offload else contextlib.nullcontext():
                    hidden_states = self.run_layer(layer, hidden_states, inputs)
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
        sequence parallelism, `TENSOR_PARALLEL_SPLITS`): the layers are rebuilt as this rank's part, holding the
        matching slices of the current weights (none on the meta device). Packed (THD) layers only; the model's
        inputs and outputs stay whole on every rank. Raises ValueError for what it does not support: padded
        layers, dropout, head or MLP sizes the group size does not divide, LoRA adapters, activation offloading,
        a second call."""
        config, size = self.config, tensor_parallel.size
        self._refuse_parallelism(
            "tensor parallelism",
            {
                "it was enabled already": self.tensor_parallel is not None,
                "it does not combine with context parallelism yet": self.context_parallel is not None,
                f"{config.num_attention_heads} heads do not split over {size} ranks": (
                    config.num_attention_heads % size
                ),
                f"intermediate_size {config.intermediate_size} does not split over {size} ranks": (
                    config.intermediate_size % size
                ),
            },
        )
        old = self.layers
        device, dtype = next(old.parameters()).device, next(old.parameters()).dtype
        with torch.device("meta"):
            layers = nn.ModuleList(
                make_te_layer(config, i + 1, tensor_parallel)
                if self.backend == "te"
                else NVEsmTorchLayer(config, tensor_parallel)
                for i in range(len(old))
            ).to(dtype)
        if device.type != "meta":
            layers.to_empty(device=device)
            with torch.no_grad():
                for new_layer, old_layer in zip(layers, old):
                    whole = dict(old_layer.named_parameters())
                    for name, parameter in new_layer.named_parameters():
                        dim = TENSOR_PARALLEL_SPLITS.get(name)
                        value = whole[name] if dim is None else whole[name].chunk(size, dim)[tensor_parallel.rank]
                        parameter.copy_(value)
        layers.train(self.training)
        self.layers, self.tensor_parallel = layers, tensor_parallel
        self.graphs.clear()

    def enable_context_parallel(self, context_parallel: ContextParallel) -> None:
        """Run each batch's layers across the ranks of `context_parallel`: each rank runs its chunks of every
        protein (`ContextParallelLayout`) and attention exchanges keys and values (Transformer Engine's ring of
        point-to-point transfers on the TE backend, an all-gather in the twin), so a protein too long for one GPU
        runs on several. Every rank keeps whole weights and gets the whole batch's outputs. Packed (THD) layers
        only. Raises ValueError for what it does not support: padded layers, dropout, tensor parallelism, LoRA
        adapters, activation offloading, a second call."""
        self._refuse_parallelism(
            "context parallelism",
            {
                "it was enabled already": self.context_parallel is not None,
                "it does not combine with tensor parallelism yet": self.tensor_parallel is not None,
            },
        )
        if self.backend == "te":
            stream = torch.cuda.Stream()
            for layer in self.layers:
                layer.set_context_parallel_group(
                    context_parallel.group, list(context_parallel.ranks), stream, cp_comm_type="p2p"
                )
        self.context_parallel = context_parallel
        self.graphs.clear()

    def _refuse_parallelism(self, kind: str, refusals: dict[str, Any]) -> None:
        """ValueError naming the first true reason among `refusals` and the ones tensor and context parallelism
        share: padded layers, dropout, LoRA adapters, activation offloading."""
        config = self.config
        shared = {
            "it needs packed layers (attn_input_format='thd')": config.attn_input_format != "thd",
            "dropout is not supported (attention_probs_dropout_prob and hidden_dropout_prob must be 0)": (
                config.attention_probs_dropout_prob > 0 or config.hidden_dropout_prob > 0
            ),
            "LoRA adapters are not supported": any(hasattr(module, "lora_A") for module in self.modules()),
            "activation offloading is not supported": config.offload_activations,
            "weights held in FP8 (fp8_weights) are not supported": any(self.fp8_weight_recipes),
        }
        for reason, refused in {**refusals, **shared}.items():
            if refused:
                raise ValueError(f"{kind}: {reason}.")

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

    def reduce_partial_gradients(self) -> None:
        """Sum the `partial_gradients` over their group (one all-reduce)."""
        ranks, grads = self.partial_gradients()
        if not grads:
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
        if self.gradient_checkpointing:
            raise ValueError(
                "offload_activations with gradient checkpointing offloads nothing (Transformer Engine's context does "
                "not reach the checkpointed layer inputs; measured on an H100): use one of them."
            )
        if hidden_states.device.type != "cuda":
            raise ValueError(
                f"offload_activations moves GPU activations to host memory; this model runs on "
                f"{hidden_states.device.type}. Load it with offload_activations=False."
            )
        if self._offload.context is None:
            self._offload.build(len(self.layers))
        return self._offload

    def run_layer(self, layer: nn.Module, hidden_states: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor:
        """One layer, `layer(hidden_states, inputs)` on both backends; recomputed in backward under gradient
        checkpointing (TE's checkpoint on the TE backend: it keeps FP8 scaling state consistent when recomputing)."""
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return layer(hidden_states, inputs)
        if self.backend == "te":
            return import_transformer_engine().checkpoint(layer, hidden_states, inputs, use_reentrant=False)
        return self._gradient_checkpointing_func(layer.__call__, hidden_states, inputs)

    def uses_cuda_graphs(self, output_hidden_states: bool) -> bool:
        """Whether this call runs as a CUDA graph: `config.cuda_graphs` on the TE backend with packed layers, in
        train mode with gradients or eval mode without, no per-layer outputs, activation checkpointing or
        offloading, layers not sharded by FSDP, no module hooks (a replay would not call them), not inside
        `torch.compile`, another CUDA graph's capture or an `nn.DataParallel` replica, and for training not in a
        process group of several ranks (DDP and DeepSpeed wait for each weight's gradient, which a graph adds to
        `main_grad` instead).

        Raises RuntimeError while a training replay still waits for its backward: the next call (graphed or not)
        would overwrite memory that backward reads. (A training forward must be followed by its backward; an
        eager call in between gave NaN gradients.)"""
        if not (self.config.cuda_graphs and self.backend == "te" and self.config.attn_input_format == "thd"):
            return False
        if self.parallel_ranks is not None:  # eager: the layers' collectives are not captured
            return False
        if self.graphs.awaiting_backward():
            raise RuntimeError(
                "cuda_graphs=True: this model ran a training forward whose backward has not run yet, and another "
                "forward now would overwrite what that backward reads. Call backward first (or, to drop that forward, "
                "model.esm.encoder.graphs.clear()), or load the model with cuda_graphs=False to run several forwards "
                "per backward."
            )
        if output_hidden_states or self.training != torch.is_grad_enabled():
            return False
        if self.training and (self.gradient_checkpointing or self.config.offload_activations or _several_ranks()):
            return False
        if (
            torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()
            or getattr(self, "_is_replica", False)
        ):
            return False
        if any(has_active_adapters(layer) for layer in self.layers):  # PEFT's adapters: eager
            return False
        if self.fp8_recipe is None and caller_fp8_enabled():  # the caller's te.autocast: not in our graphs' state
            return False
        return not _is_sharded(self.layers[0]) and not _has_module_hooks(self)

    def pads_for_fp8(self) -> bool:
        """Whether this call's FP8 GEMMs need the token count padded (`FP8_TOKEN_MULTIPLE`): FP8 layers of the
        model's own (`layer_precision`), or FP8 turned on by the caller around it (`te.autocast(enabled=True,
        recipe=...)`, any recipe)."""
        return self.fp8_recipe is not None or (self.backend == "te" and caller_fp8_enabled())

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self.graphs.clear()  # moved or cast parameters are new tensors: the graphs read the old ones
        self._offload = ActivationOffload()  # its stream belongs to the device the model was on
        return super()._apply(fn, recurse)

    def fp8_region(self) -> contextlib.AbstractContextManager:
        """One FP8 autocast around all layers when any layer is FP8 (TE backend only).

        One region, not one per layer: Transformer Engine reduces amaxes and updates scales when the outermost
        region exits, so per-layer regions would repeat that work for every layer."""
        if self.fp8_recipe is None:
            return contextlib.nullcontext()
        ranks = self.parallel_ranks  # one set of scales for the weights they share
        group = None if ranks is None else ranks.group
        return import_transformer_engine().autocast(enabled=True, recipe=self.fp8_recipe, amax_reduction_group=group)

    def layer_precision(self, index: int) -> contextlib.AbstractContextManager:
        """Inside `fp8_region`: FP8 stays on for layers marked "fp8" and is switched off for the others."""
        if self.fp8_recipe is None or self.config.layer_precision[index] == "fp8":
            return contextlib.nullcontext()
        return import_transformer_engine().autocast(enabled=False)


class StaticShapeLayers(nn.Module):
    """The encoder's layers and final LayerNorm for one static packed shape: what one CUDA graph holds.

    Not a submodule of the encoder (it holds the encoder, whose parameters are the graph's); its `training` flag
    is set directly, as `.train()` would also switch the encoder's layers.
    """

    def __init__(self, encoder: NVEsmEncoder, max_length: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.max_length = max_length

    def forward(
        self, hidden_states: torch.Tensor, cu_seq_lens: torch.Tensor, rotary_angles: torch.Tensor
    ) -> torch.Tensor:
        """`[T, hidden]` packed states with `cu_seq_lens [slots + 1]` and `rotary_angles [max_length, head_dim]`."""
        packed = PackedSequences.right_padded(cu_seq_lens, self.max_length, hidden_states.shape[0])
        states = self.encoder.run_layers(hidden_states, EncoderInputs(rotary_angles, packed=packed))
        return self.encoder.emb_layer_norm_after(states)


def host_shape(
    captured: Iterable[tuple[int, int, int]], num_tokens: int, num_sequences: int, max_length: int
) -> tuple[int, int, int] | None:
    """The smallest of the `captured` static shapes `(tokens, slots, max_length)` that holds a packed batch of
    `num_tokens` tokens in `num_sequences` proteins of at most `max_length` tokens (its padding in dummy proteins of
    the shape's `max_length`, as `_pad_packed` lays it out), by tokens, then slots x max_length; None if none does."""
    fitting = [
        (tokens, slots, length)
        for tokens, slots, length in captured
        if tokens >= num_tokens
        and length >= max_length
        and slots >= num_sequences + -(-(tokens - num_tokens) // length)
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


class StaticShapeGraphs(FreshWhenCopied):
    """CUDA graphs of the encoder, one per static shape and mode, captured into one memory pool. A training shape is
    captured at first use (so that a resumed run replays where the run it continues did). An inference batch whose
    shape is not captured runs padded in the smallest captured graph that holds it (`host_shape`), which costs less
    than an eager run, until the padding it has added there comes to `padding_before_capture` replays of that graph
    (about what a capture costs): then its own shape is captured. Padding is counted in tokens, so a shape held by a
    graph of as many tokens (more slots or a longer `max_length`, which cost the attention kernels next to nothing)
    stays there. With no graph to hold it, its shape is captured the `capture_at_use`-th time it is met and runs
    eagerly before. A shape met once, such as the last, partly filled batch of each `nv-esm embed` shard, so never
    pays a capture.

    A replay's memory (its saved activations included) is shared with the other graphs, so between the forward
    replay of a training graph and its backward no other forward may run (`uses_cuda_graphs` refuses it). The
    output is copied out
    of the graph's static buffer, which the next replay overwrites. Parameters must keep their storage (in-place
    optimizer steps and `load_state_dict` do); when any parameter's storage or `requires_grad` changes, the graphs
    are captured anew. Gradient hooks on parameters also see TE's warm-up gradients while a shape is captured.
    A capture that runs out of GPU memory frees every graph, their memory pool and the shared weight-gradient
    buffers, and the model runs eagerly from then on (until `clear()`), with a warning.
    """

    capture_at_use = 2  # inference; the tests capture at first use (1), so each graphed call they check replays
    padding_before_capture = 4  # graph replays' worth of tokens

    def __init__(self) -> None:
        self._graphs: dict[tuple, nn.Module | None] = {}
        self._uses: dict[tuple, int] = {}  # eager runs of each shape not captured yet
        self._padding: dict[tuple, int] = {}  # padding tokens each shape not captured yet added to hosting graphs
        self._pool: Any = None
        self._parameter_storage: tuple[tuple[int, bool], ...] = ()
        self._awaiting_backward = False
        self._weights: list[nn.Parameter] | None = None  # GEMM weights with a main_grad (training graphs)
        self._out_of_memory = False  # a capture ran out of memory: no more graphs until clear()

    def clear(self) -> None:
        """Drop every graph and their memory pool: a pool whose graphs are all freed cannot take a new capture
        (PyTorch's allocator asserts, the capture fails and leaves the CUDA generator in capture mode, so every
        later random op on the GPU raises)."""
        self._graphs.clear()
        self._uses.clear()
        self._padding.clear()
        self._pool = None
        self._awaiting_backward = False
        self._weights = None
        self._out_of_memory = False

    def awaiting_backward(self) -> bool:
        """Whether a training replay's backward has not started yet."""
        return self._awaiting_backward

    def shape_for(
        self, encoder: NVEsmEncoder, hidden_states: torch.Tensor, packed: PackedSequences
    ) -> tuple[int, int, int] | None:
        """The static shape `(tokens, slots, max_length)` to pad this packed batch (`[T, hidden]` states) to before
        `run`, or None: run it eagerly, unpadded (an inference shape not captured yet, with no graph to hold it)."""
        if self._out_of_memory:
            return None
        self._check_parameters(encoder)
        num_sequences = packed.cu_seq_lens.numel() - 1
        own = static_shape(packed.num_tokens, num_sequences, packed.max_length)
        mode = _graph_mode(encoder, hidden_states)
        key = (*own, *mode)
        if key in self._graphs or encoder.training:  # training: captured at first use
            return own
        captured = [shape[:3] for shape, graph in self._graphs.items() if graph is not None and shape[3:] == mode]
        host = host_shape(captured, packed.num_tokens, num_sequences, packed.max_length)
        if host is not None:
            padding = self._padding.get(key, 0) + host[0] - own[0]
            if padding <= self.padding_before_capture * host[0]:
                self._padding[key] = padding
                return host
            return own  # its padding has cost about a capture: capture its own shape
        self._uses[key] = self._uses.get(key, 0) + 1
        return own if self._uses[key] >= self.capture_at_use else None

    def run(self, encoder: NVEsmEncoder, hidden_states: torch.Tensor, inputs: EncoderInputs) -> torch.Tensor | None:
        """Replay (capturing first if new) `encoder`'s graph for the shape of `hidden_states` (padded to a shape
        `shape_for` gave); `[T, hidden]` final states, a fresh tensor. None when its capture failed or an earlier
        one ran out of memory: the encoder then runs it eagerly."""
        if self._out_of_memory:
            return None
        autocast_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        packed = inputs.packed
        key = (hidden_states.shape[0], packed.cu_seq_lens.numel() - 1, packed.max_length)
        key = (*key, *_graph_mode(encoder, hidden_states))
        if key not in self._graphs:
            graph = self._capture(encoder, hidden_states, inputs, autocast_dtype)
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
        with encoder.fp8_region():
            states = graph(hidden_states, packed.cu_seq_lens, inputs.rotary_angles).clone()
        if states.requires_grad:
            self._awaiting_backward = True
            states.register_hook(self._backward_started)
        return states

    def _check_parameters(self, encoder: NVEsmEncoder) -> None:
        """Graphs read the parameters' storage and fix at capture which parameters get gradients: when either
        changed, drop them."""
        storage = tuple((parameter.data_ptr(), parameter.requires_grad) for parameter in encoder.parameters())
        if storage != self._parameter_storage:
            self.clear()
            self._parameter_storage = storage

    def _free_after_out_of_memory(self, encoder: NVEsmEncoder) -> None:
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
        self, encoder: NVEsmEncoder, hidden_states: torch.Tensor, inputs: EncoderInputs, autocast_dtype: Any
    ) -> nn.Module | None:
        te = import_transformer_engine()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        layers = StaticShapeLayers(encoder, inputs.packed.max_length)
        layers.training = encoder.training
        sample = (
            hidden_states.detach().clone().requires_grad_(hidden_states.requires_grad),
            inputs.packed.cu_seq_lens.clone(),
            inputs.rotary_angles.clone(),
        )
        shape = f"{hidden_states.shape[0]} tokens, {inputs.packed.cu_seq_lens.numel() - 1} slots, " + (
            f"max_length {inputs.packed.max_length}, {'training' if encoder.training else 'inference'}"
        )
        started = time.perf_counter()
        parameters = list(encoder.parameters())
        grads = [parameter.grad for parameter in parameters]  # TE does not put them back if capture fails
        training = hidden_states.requires_grad
        weights = _graph_weights(encoder) if training else []
        accumulated = _main_grads_in_use(weights)  # TE's warm-up steps add to main_grad; restored after capture
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
                    enabled=encoder.fp8_recipe is not None,
                    recipe=encoder.fp8_recipe,
                    pool=self._pool,
                    # Inference needs one eager forward before capture (lazy set-up: cuDNN plans, workspaces); it
                    # halves a capture's time (0.4 -> 0.17 s at 650M, `bench/embed_profile.py --experiments
                    # captures`). Training keeps TE's three forward+backward passes.
                    num_warmup_iters=3 if training else 1,
                    post_warmup_hook=torch.cuda.empty_cache,  # warm-up memory (a side stream) back before capture
                )
        except Exception as error:  # e.g. a capture that meets another live autograd graph: run this shape eagerly
            importlib.import_module("transformer_engine.pytorch.graph").set_capture_end()
            if "__call__" in vars(StaticShapeLayers):  # TE's FP8 wrapper, left in place when capture fails
                del StaticShapeLayers.__call__
            for parameter, grad in zip(parameters, grads):
                parameter.grad = grad
            _restore_main_grads(weights, accumulated)
            if isinstance(error, torch.OutOfMemoryError):
                self._free_after_out_of_memory(encoder)
                logger.warning(
                    f"CUDA graph capture ran out of GPU memory ({shape}); the graphs are freed and this model runs "
                    "eagerly from now on (load it with cuda_graphs=False to skip capturing)."
                )
                return None
            logger.warning(
                f"CUDA graph capture failed ({shape}); this shape runs eagerly. {type(error).__name__}: {error}"
            )
            return None
        _restore_main_grads(weights, accumulated)
        torch.cuda.empty_cache()
        logger.info(f"Captured CUDA graphs for {shape} in {time.perf_counter() - started:.2f} s")
        return graph


@contextlib.contextmanager
def _expandable_segments() -> Any:
    """Within: the CUDA caching allocator maps new memory as expandable segments (unless the process already does).

    The graphs' shared pool keeps every segment it gets; with fixed-size segments each new, larger shape needed
    new ones beside the blocks of the smaller shapes (650M at 64 proteins: 42 GB in the pool for 33 GB of tensors,
    then out of memory at the third shape). Expandable segments grow in place, so freed blocks merge and the
    shapes share them. The warm-up's eager memory is mapped the same way and unmapped by `empty_cache`."""
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


# Training graphs: Transformer Engine's `fuse_wgrad_accumulation` makes each GEMM weight's gradient accumulate into
# `weight.main_grad`, one buffer outside the graph pool shared by every captured shape (without it, each shape's
# backward graph held its own copy of all weight gradients: 2.6 GB fp32 per shape at 650M). Before a training
# replay, each weight's `.grad` becomes its `main_grad` (zeroed when `.grad` was None, as after `zero_grad()`;
# holding `.grad` when an eager step made one), so `loss.backward(); opt.step(); opt.zero_grad()` and gradient
# accumulation see what they see eagerly. Eager calls keep TE's ordinary gradients and add into the same `.grad`.


def _graph_weights(encoder: NVEsmEncoder, create: bool = True) -> list[nn.Parameter]:
    """The GEMM weights of the TE layers that get gradients (QKV, projection, fc1, fc2), each given a `main_grad`
    (`create`), or those that have one (not `create`)."""
    weights = []
    for module in encoder.layers.modules():
        if hasattr(module, "fuse_wgrad_accumulation"):
            for name, parameter in module.named_parameters(recurse=False):
                if name in ("weight", "fc1_weight", "fc2_weight") and parameter.requires_grad:
                    weights.append(parameter)
    if not create:
        return [weight for weight in weights if hasattr(weight, "main_grad")]
    for weight in weights:
        main_grad = getattr(weight, "main_grad", None)
        layout = (weight.shape, weight.dtype, weight.device)
        if not isinstance(main_grad, torch.Tensor) or (main_grad.shape, main_grad.dtype, main_grad.device) != layout:
            weight.main_grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    return weights


@contextlib.contextmanager
def _fused_wgrad_accumulation(encoder: NVEsmEncoder, enabled: bool) -> Any:
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


def _has_module_hooks(module: nn.Module) -> bool:
    """Whether any submodule has forward or backward hooks."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(m, kind, None) for m in module.modules() for kind in kinds)


def _runs_in_fp32(hidden_states: torch.Tensor) -> bool:
    """Whether layers given `hidden_states` compute in fp32: fp32 states (the weights' dtype, also under FSDP2's
    mixed precision) and no autocast to a 16-bit dtype."""
    if torch.is_autocast_enabled(hidden_states.device.type):
        return torch.get_autocast_dtype(hidden_states.device.type) == torch.float32
    return hidden_states.dtype == torch.float32


def _several_ranks() -> bool:
    """Whether this process is one of several ranks of a `torch.distributed` process group."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def _is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) manages `module`: its parameters move between calls, so no graphs."""
    fsdp = importlib.import_module("torch.distributed.fsdp") if torch.distributed.is_available() else None
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))


def _drop_te_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: TE's `_extra_state` (FP8 scaling history) is neither saved nor required; weights held in
    FP8 (`fp8_weights`) appear as the plain tensors of their values (`dequantize`), which any checkpoint holds."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key.endswith("._extra_state"):
            del state_dict[key]
        elif hasattr(state_dict[key], "_quantizer") and hasattr(state_dict[key], "dequantize"):
            state_dict[key] = state_dict[key].dequantize()


def _quantize_fp8_weights(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: the values loaded into weights held in FP8 are quantized here (`fp8_value`: scales fitted,
    result checked), so that `load_state_dict` copies FP8 data as it is."""
    with torch.no_grad():
        for name, parameter in module.named_parameters(prefix=prefix.rstrip(".")):
            if hasattr(parameter, "_quantizer") and torch.is_tensor(state_dict.get(name)):
                state_dict[name] = fp8_value(parameter, state_dict[name])


def _ignore_missing_te_extra_state(module: nn.Module, incompatible_keys: Any) -> None:
    """Load hook: strict loading does not require TE's `_extra_state` entries."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if not key.endswith("._extra_state")]


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
        """`[..., hidden]` -> logits `[..., vocab_size]` (the padded vocabulary rows are cut off)."""
        return self.decoder(gelu(self.dense(hidden_states)))[..., : self.vocab_size]


# --------------------------------------------------------------------------------------------------------------
# Pre-trained models
# --------------------------------------------------------------------------------------------------------------


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


class NVEsmPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading rules shared by NVEsm models."""

    config_class = NVEsmConfig
    config: NVEsmConfig
    base_model_prefix = "esm"
    supports_gradient_checkpointing = True
    accepts_loss_kwargs = False
    _no_split_modules = ["NVEsmTorchLayer", "NVEsmTELayer", "NVEsmEmbeddings"]
    _keys_to_ignore_on_load_unexpected = [r"\._extra_state$"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if tensors and all(getattr(tensor, "_is_hf_initialized", False) for tensor in tensors):
            return  # loaded by from_pretrained: transformers < 5.13 skips these itself only for Hub remote code
        std = self.config.initializer_range
        if isinstance(module, NVEsmLoraTarget):
            return  # its `weight` is a fused module's, initialised there
        if isinstance(module, (nn.Linear, NVEsmLinear)):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
            module.weight[self.config.vocab_size :].zero_()
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (NVEsmLayerNormLinear, NVEsmLayerNormMLP)):
            module.layer_norm_weight.fill_(1.0)
            module.layer_norm_bias.zero_()
            for name, parameter in module.named_parameters(recurse=False):
                if name.startswith("layer_norm"):
                    continue
                if name.endswith("weight"):
                    parameter.normal_(0.0, std)
                else:
                    parameter.zero_()
        elif isinstance(module, NVEsmRotaryEmbedding):
            module.inv_freq.copy_(module.default_inv_freq(self.config))

    def enable_tensor_parallel(self, tp_group: Any) -> None:
        """Split the encoder layers over the ranks of the `torch.distributed` process group `tp_group`
        (`NVEsmEncoder.enable_tensor_parallel`). Every rank of the group calls it, then runs the same batches and
        gets the same outputs. After each backward, call `reduce_partial_gradients` before the optimizer step: the
        LayerNorm and output-bias gradients of the layers hold each rank's share. `save_pretrained` is refused
        afterwards: each rank holds part of each layer."""
        self.base_model.encoder.enable_tensor_parallel(RankGroup.of(tp_group))

    def reduce_partial_gradients(self) -> None:
        """Under tensor or context parallelism, after backward: sum over the group the layer gradients that each
        rank computed from its own tokens only (`NVEsmEncoder.partial_gradients`), so every rank holds the whole
        gradient. Not needed when a wrapper already reduces them over the group, but FSDP2 or DDP over the
        context-parallel ranks average them: multiply by the group size instead (the recipe does)."""
        self.base_model.encoder.reduce_partial_gradients()

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

    Attributes:
        backend: `"te"` or `"torch"`, resolved from `config.backend` when the model was built.
    """

    # The task models' heads, which a base model loaded from their checkpoints leaves out by design (transformers
    # would list them in a LOAD REPORT that the user can do nothing about).
    _keys_to_ignore_on_load_unexpected = [r"\._extra_state$", r"^lm_head\.", r"^classifier\."]

    def __init__(self, config: NVEsmConfig, add_pooling_layer: bool = True) -> None:
        """`add_pooling_layer`: as transformers' `EsmModel`, a dense + tanh pooler over each protein's `<cls>`
        state (`pooler_output`); ESM-2's checkpoints hold no pooler, so it starts untrained. The task models
        build their `esm` without it."""
        super().__init__(config)
        self.backend = resolve_backend(config.backend)
        self.embeddings = NVEsmEmbeddings(config)
        self.rotary_embeddings = NVEsmRotaryEmbedding(config)
        self.encoder = NVEsmEncoder(config, self.backend)
        self.contact_head = NVEsmContactPredictionHead(config)
        self.pooler = NVEsmPooler(config) if add_pooling_layer else None
        self.post_init()

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
        _check_extra_inputs(kwargs, self.config.check_inputs)
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
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
        eager = output_hidden_states or output_attentions
        hidden_states, inputs, restore = self._to_run_layout(hidden_states, batch, eager)
        maps: list[torch.Tensor] = []
        last_hidden_state, all_hidden_states = self.encoder(
            hidden_states, inputs, output_hidden_states, maps.append if output_attentions else None
        )
        last_hidden_state = restore(last_hidden_state)
        cu_seq_lens = batch.packed.cu_seq_lens if batch.input_is_packed else None
        pooler_output = None
        if self.pooler is not None:
            pooler_output = self.pooler(first_token_states(last_hidden_state, cu_seq_lens, attention_mask))
        output = NVEsmModelOutput(
            last_hidden_state=last_hidden_state,
            pooler_output=pooler_output,
            hidden_states=None if all_hidden_states is None else tuple(map(restore, all_hidden_states)),
            attentions=tuple(_maps_to_input_layout(m, batch).to(last_hidden_state.dtype) for m in maps) or None,
            cu_seq_lens=cu_seq_lens,
        )
        return output if _wants_dict(return_dict, self.config) else output.to_tuple()

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
        hidden_states, inputs, _ = self._to_run_layout(hidden_states, batch, True)
        contacts = StreamedContacts(self.contact_head.regression, _run_token_ids(input_ids, batch), self.config)
        self.encoder(hidden_states, inputs, False, contacts.add_layer)
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
        if not -num_states <= layer < num_states:
            raise ValueError(f"layer must be in [{-num_states}, {num_states}), got {layer}")
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
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
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
        _check_tensor(name, tokens, None)
        if inputs_embeds is not None and (
            inputs_embeds.dim() < 2 or inputs_embeds.shape[-1] != self.config.hidden_size
        ):
            raise ValueError(
                f"inputs_embeds must be [..., hidden_size={self.config.hidden_size}], got shape "
                f"{tuple(inputs_embeds.shape)}."
            )
        device = tokens.device
        if self.backend == "te" and device.type != "cuda":
            raise ValueError(
                f"This model runs Transformer Engine layers, which need CUDA tensors; got inputs on {device}. "
                "Move the model and inputs to a GPU, or load the model with backend='torch' to run on the CPU."
            )
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

    def _to_run_layout(
        self, hidden_states: torch.Tensor, batch: InputBatch, eager: bool
    ) -> tuple[torch.Tensor, EncoderInputs, Callable[[torch.Tensor], torch.Tensor]]:
        """Move embeddings from `_embed`'s layout to the layout the layers run in (`config.attn_input_format`).

        Packed runs take `[T, hidden]`. Padded runs take the right-padded view `[N, max_length, hidden]`: a padded
        input with padding on the left, or wider than its longest protein, is laid out anew, so every protein
        sees positions `0..length-1` and none of the padding. FP8 runs pad the token count to a multiple of
        `FP8_TOKEN_MULTIPLE`, tensor-parallel runs to a multiple of the group size (times that with FP8), which
        splits the tokens; context-parallel runs pad each protein (`ContextParallelLayout`); CUDA-graph runs pad
        the packed batch to its static shape (`static_shape`) unless the call needs the layers run `eager`
        (per-layer outputs or attention maps).

        Returns the states, the per-layer inputs, and `restore`, which maps an output of the layers back to the
        input layout: `[B, S, ...]` with zeros at padding for padded inputs, `[1, T, ...]` for packed ones.
        """
        packing = batch.packed
        if packing is None:  # a padded input without padding, run padded: nothing moves
            return self._padded_run(hidden_states, None, lambda states: states)
        if batch.input_is_packed:
            run, to_input = packing, lambda states: states.unsqueeze(0)
        else:
            run = PackedSequences.right_padded(packing.cu_seq_lens, packing.max_length, packing.num_tokens)
            to_input = packing.unpack
        if self.config.attn_input_format == "bshd":
            return self._padded_run(
                run.unpack(hidden_states), run.key_mask(), lambda states: to_input(run.pack(states))
            )
        num_tokens = run.num_tokens
        graphed = self.encoder.uses_cuda_graphs(eager)
        shape = self.encoder.graphs.shape_for(self.encoder, hidden_states, run) if graphed else None
        multiple = FP8_TOKEN_MULTIPLE if self.encoder.pads_for_fp8() else 1
        if self.encoder.context_parallel is not None:
            layout = ContextParallelLayout.of(run, self.encoder.context_parallel, multiple)
            inputs = EncoderInputs(self.rotary_embeddings(layout.max_length), packed=run, context_parallel=layout)
            return hidden_states, inputs, lambda states: to_input(states)
        if self.encoder.tensor_parallel is not None:
            multiple *= self.encoder.tensor_parallel.size
        if shape is not None:
            hidden_states, run = _pad_packed(hidden_states, run, *shape)
        elif num_tokens % multiple:
            hidden_states, run = _pad_packed_to_multiple(hidden_states, run, multiple)
        inputs = EncoderInputs(self.rotary_embeddings(run.max_length), packed=run, static_shape=shape is not None)
        return hidden_states, inputs, lambda states: to_input(states[:num_tokens])

    def _padded_run(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        to_input: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, EncoderInputs, Callable[[torch.Tensor], torch.Tensor]]:
        """`_to_run_layout` for right-padded states `[B, L, hidden]` with `key_mask [B, L]` (None: no padding)."""
        length = hidden_states.shape[1]
        if self.encoder.pads_for_fp8() and (hidden_states.shape[0] * length) % FP8_TOKEN_MULTIPLE:
            hidden_states, key_mask = _pad_padded_for_fp8(hidden_states, key_mask)
        inputs = EncoderInputs(self.rotary_embeddings(hidden_states.shape[1]), key_mask=key_mask)
        return hidden_states, inputs, lambda states: to_input(states[:, :length])


def _maps_to_input_layout(maps: torch.Tensor, batch: InputBatch) -> torch.Tensor:
    """One layer's attention probabilities from the run layout (`[N', heads, L', L']`, right-padded, maybe with
    FP8 padding) to the documented output layout: `[B, heads, S, S]` where each padded input row's tokens lie,
    or `[N, heads, L, L]` for packed inputs."""
    packing = batch.packed
    if packing is None:  # a padded input without padding ran as it came
        width = int(batch.lengths[0])  # every row is a protein of the input's width
        return maps[:, :, :width, :width]
    count, length = packing.cu_seq_lens.numel() - 1, packing.max_length
    maps = maps[:count, :, :length, :length]
    if batch.input_is_packed:
        return maps
    rows, width = packing.padded_shape
    sequence = packing.sequence_index
    position = torch.arange(packing.num_tokens, device=maps.device) - packing.cu_seq_lens[sequence]
    column = torch.full((count, length), width, dtype=torch.long, device=maps.device)  # `width`: off the input
    column[sequence, position] = packing.token_index % width
    placed = maps.new_zeros(rows, width + 1, width + 1, maps.shape[1])
    row_index = torch.arange(count, device=maps.device)[:, None, None]
    placed[row_index, column[:, :, None], column[:, None, :]] = maps.permute(0, 2, 3, 1)
    return placed[:, :width, :width].permute(0, 3, 1, 2)


def _run_token_ids(input_ids: torch.Tensor, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, L]` token ids in the right-padded run layout and the `[N, L]` bool mask of real tokens."""
    packing = batch.packed
    if packing is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    packed_ids = input_ids.reshape(-1) if batch.input_is_packed else packing.pack(input_ids)
    run = PackedSequences.right_padded(packing.cu_seq_lens, packing.max_length, packing.num_tokens)
    return run.unpack(packed_ids), run.key_mask()


class StreamedContacts:
    """ESM-2's contact prediction (transformers' `EsmContactPredictionHead`) fed one layer's attention maps at a
    time: per layer and head, the maps without `<eos>`, padding and the first token (`<cls>`) are symmetrized and
    average-product corrected, and the regression, linear over (layer, head) channels, adds that layer's share.

    Args:
        regression: The contact head's `Linear(layers * heads, 1)`.
        tokens: `[N, L]` token ids in the run layout and the `[N, L]` mask of real tokens (`_run_token_ids`).
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


def length_sorted_batches(token_lists: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Indices of the proteins, longest first, grouped so each group holds at most `max_tokens` tokens (a longer
    protein forms a group of its own)."""
    order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
    batches: list[list[int]] = []
    used = max_tokens
    for index in order:
        if used + len(token_lists[index]) > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(index)
        used += len(token_lists[index])
    return batches


def first_token_states(
    states: torch.Tensor, cu_seq_lens: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Each protein's first (`<cls>`) state, `[N, hidden]`: from packed `[1, T, hidden]` states at `cu_seq_lens`
    starts, or from padded `[B, S, hidden]` states at each row's first token of `attention_mask` (left padding
    too; column 0 without a mask)."""
    if cu_seq_lens is not None:
        return states[0, cu_seq_lens[:-1].long()]
    if attention_mask is None:
        return states[:, 0]
    first = attention_mask.to(torch.int32).argmax(dim=1).to(states.device)
    return states[torch.arange(states.shape[0], device=states.device), first]


def residue_token_mask(
    cu_seq_lens: torch.Tensor, num_tokens: int, sequence_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`[T]` bool over packed tokens: True at residues, False at each protein's first (`<cls>`) and last (`<eos>`)
    token. `cu_seq_lens [N + 1]` covers the T tokens; `sequence_index` (`sequence_index_of_tokens`), if the caller
    has it already."""
    if sequence_index is None:
        sequence_index = sequence_index_of_tokens(cu_seq_lens, num_tokens)
    starts = cu_seq_lens[:-1].long()
    position = torch.arange(num_tokens, device=cu_seq_lens.device) - starts[sequence_index]
    lengths = cu_seq_lens.diff().long()
    return (position > 0) & (position < lengths[sequence_index] - 1)


def pool_proteins(states: torch.Tensor, cu_seq_lens: torch.Tensor, pooling: str) -> torch.Tensor:
    """`[T, hidden]` packed states -> `[N, hidden]`: the `<cls>` state (`pooling="cls"`), or the mean over the
    residues (`"mean"`; `<cls>`/`<eos>` excluded). No boolean indexing, so nothing waits for the device."""
    if pooling == "cls":
        return states[cu_seq_lens[:-1].long()]
    sequence_index = sequence_index_of_tokens(cu_seq_lens, states.shape[0])
    is_residue = residue_token_mask(cu_seq_lens, states.shape[0], sequence_index)
    lengths = cu_seq_lens.diff().long()
    sums = torch.zeros(len(lengths), states.shape[1], device=states.device, dtype=states.dtype)
    sums.index_add_(0, sequence_index, torch.where(is_residue[:, None], states, 0))
    return sums / (lengths - 2).clamp_min(1)[:, None]


def _pad_packed_to_multiple(
    hidden_states: torch.Tensor, packed: PackedSequences, multiple: int
) -> tuple[torch.Tensor, PackedSequences]:
    """Append a dummy protein of zeros so the token count is a multiple of `multiple` (FP8 GEMMs need
    `FP8_TOKEN_MULTIPLE`; tensor parallelism splits the tokens over its ranks)."""
    extra = -packed.num_tokens % multiple
    num_sequences = packed.cu_seq_lens.numel() - 1
    return _pad_packed(
        hidden_states, packed, packed.num_tokens + extra, num_sequences + 1, max(packed.max_length, extra)
    )


def _pad_packed(
    hidden_states: torch.Tensor, packed: PackedSequences, tokens: int, slots: int, max_length: int
) -> tuple[torch.Tensor, PackedSequences]:
    """Pad `[T, hidden]` to `[tokens, hidden]` with zero tokens in dummy proteins of at most `max_length` tokens
    each, then empty proteins (`cu_seq_lens` repeats its last entry) up to `slots` proteins in all."""
    num_sequences = packed.cu_seq_lens.numel() - 1
    hidden_states = F.pad(hidden_states, (0, 0, 0, tokens - packed.num_tokens))
    extra_slots = torch.arange(1, slots - num_sequences + 1, device=packed.cu_seq_lens.device)
    ends = (packed.num_tokens + extra_slots * max_length).clamp_max(tokens).to(torch.int32)
    cu_seq_lens = torch.cat([packed.cu_seq_lens.to(torch.int32), ends])
    return hidden_states, PackedSequences.right_padded(cu_seq_lens, max_length, tokens)


def _pad_padded_for_fp8(
    hidden_states: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the sequence dimension to a multiple of `FP8_TOKEN_MULTIPLE`, masking the new positions."""
    batch, length = hidden_states.shape[:2]
    extra = -length % FP8_TOKEN_MULTIPLE
    if key_mask is None:
        key_mask = torch.ones(batch, length, dtype=torch.bool, device=hidden_states.device)
    return F.pad(hidden_states, (0, 0, 0, extra)), F.pad(key_mask, (0, extra), value=False)


@dataclass
class InputBatch:
    """A validated batch: its layout, per-protein lengths, and the packing used to change layout.

    Attributes:
        input_is_packed: Inputs came packed (`[1, T]`); else padded (`[B, S]`).
        lengths: `[N]` tokens per protein (float32, for token-dropout ratios).
        packed: Where the tokens lie in the input; None for a padded input without attention_mask when the
            layers run padded.
    """

    input_is_packed: bool
    lengths: torch.Tensor
    packed: PackedSequences | None = None

    @classmethod
    def padded_from(
        cls,
        config: NVEsmConfig,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> InputBatch:
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
        if tokens.dim() != 2:
            raise ValueError(
                f"Padded input_ids must be [batch, length] (inputs_embeds [batch, length, hidden]), got shape "
                f"{tuple(tokens.shape)}; packed inputs need cu_seq_lens_q or position_ids."
            )
        batch, length = tokens.shape
        if batch == 0 or length == 0:
            raise ValueError(f"The batch holds no tokens: input shape {tuple(tokens.shape)}.")
        if attention_mask is None:
            if length > config.max_protein_length:
                raise ValueError(_too_long_message(config))
            _warn_if_longer_than_trained(config, length)
            lengths = torch.full((batch,), float(length), device=tokens.device)
            raise_on_failed_checks(_token_id_checks(config, input_ids), config.check_inputs)
            packed = None
            if config.attn_input_format == "thd":
                cu_seq_lens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=tokens.device)
                packed = PackedSequences.right_padded(cu_seq_lens, length, batch * length)
            return cls(False, lengths, packed)
        _check_tensor("attention_mask", attention_mask, tokens.device)
        if attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} and the input {tuple(tokens.shape)}; "
                "they must match."
            )
        key_mask = attention_mask.bool()
        counts = key_mask.sum(-1)
        longest = counts.max()
        # One run of tokens per row: padding on the left, the right or both, never inside a protein.
        run_starts = key_mask[:, 0].int() + (key_mask[:, 1:] & ~key_mask[:, :-1]).sum(-1)
        checks = _token_id_checks(config, input_ids, key_mask) + [
            (((attention_mask == 0) | (attention_mask == 1)).all(), "attention_mask must hold only 0 and 1."),
            ((counts > 0).all(), "Every row of attention_mask must keep at least one token."),
            (
                (run_starts <= 1).all(),
                "attention_mask must keep one contiguous run of tokens per row (padding on the left and/or right "
                "of each protein, none inside it).",
            ),
            (longest <= config.max_protein_length, _too_long_message(config)),
        ]
        raise_on_failed_checks(checks, config.check_inputs)
        packed = PackedSequences.from_attention_mask(key_mask, int(longest))
        _warn_if_longer_than_trained(config, packed.max_length)
        return cls(False, counts.float(), packed)

    @classmethod
    def packed_from(
        cls,
        config: NVEsmConfig,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cu_seq_lens_q: torch.Tensor | None,
        cu_seq_lens_k: torch.Tensor | None,
        max_length_q: int | None,
        max_length_k: int | None,
    ) -> InputBatch:
        if attention_mask is not None:
            raise ValueError("attention_mask is for padded batches; packed inputs are described by cu_seq_lens_q.")
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError(
                f"Packed input_ids must be [1, total_tokens] or [total_tokens], got shape {tuple(tokens.shape)}."
            )
        num_tokens = tokens.shape[0]
        if num_tokens == 0:
            raise ValueError("Packed input holds no tokens.")
        for name, value in [("position_ids", position_ids), ("cu_seq_lens_q", cu_seq_lens_q)]:
            if value is not None:
                _check_tensor(name, value, tokens.device)
        checks = _token_id_checks(config, input_ids)
        if position_ids is not None:
            checks += _position_id_checks(position_ids, num_tokens)
        if cu_seq_lens_q is None:
            if cu_seq_lens_k is not None:
                raise ValueError("cu_seq_lens_k was given without cu_seq_lens_q; pass both (they must be equal).")
            raise_on_failed_checks(checks, config.check_inputs)
            starts = (position_ids.reshape(-1) == 0).nonzero().squeeze(1)
            cu_seq_lens = F.pad(starts.to(torch.int32), (0, 1), value=num_tokens)
            checks = []
        else:
            cu_seq_lens = cu_seq_lens_q
            checks += _cu_seq_lens_checks(cu_seq_lens, cu_seq_lens_k, num_tokens)
        max_length_q, max_length_k = _as_length("max_length_q", max_length_q), _as_length("max_length_k", max_length_k)
        if max_length_q is not None and max_length_k is not None and max_length_q != max_length_k:
            raise ValueError(f"max_length_q ({max_length_q}) and max_length_k ({max_length_k}) must be equal.")
        max_length = max_length_q if max_length_q is not None else max_length_k
        if max_length is not None and max_length > config.max_protein_length:
            raise ValueError(
                f"max_length_q ({max_length}) is longer than max_protein_length ({config.max_protein_length} tokens): "
                "it is the longest protein of the batch, and none may be longer."
            )
        lengths = cu_seq_lens.diff()
        longest = lengths.max()
        checks.append((longest <= config.max_protein_length, _too_long_message(config)))
        if max_length is not None:
            checks.append(
                (longest <= int(max_length), f"max_length_q ({max_length}) is shorter than the longest protein.")
            )
        if position_ids is not None and cu_seq_lens_q is not None:
            expected = (
                torch.arange(num_tokens, device=cu_seq_lens.device)
                - cu_seq_lens[sequence_index_of_tokens(cu_seq_lens, num_tokens)]
            )
            checks.append(((position_ids.reshape(-1) == expected).all(), "position_ids disagree with cu_seq_lens_q."))
        raise_on_failed_checks(checks, config.check_inputs)
        max_length = int(longest) if max_length is None else max_length
        _warn_if_longer_than_trained(config, max_length)
        packed = PackedSequences.right_padded(cu_seq_lens, max_length, num_tokens)
        return cls(True, lengths.float(), packed)


def _token_id_checks(
    config: NVEsmConfig, input_ids: torch.Tensor | None, key_mask: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, str]]:
    """Token ids within the vocabulary, where `key_mask` (if given) keeps tokens: padding ids are never read."""
    if input_ids is None:
        return []
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids (int64 or int32), got dtype {input_ids.dtype}.")
    in_vocab = (input_ids >= 0) & (input_ids < config.vocab_size)
    in_vocab = (in_vocab if key_mask is None else in_vocab | ~key_mask).all()
    return [(in_vocab, f"input_ids must be token ids in [0, {config.vocab_size}) (the ESM vocabulary).")]


def _position_id_checks(position_ids: torch.Tensor, num_tokens: int) -> list[tuple[torch.Tensor, str]]:
    if position_ids.numel() != num_tokens:
        raise ValueError(f"position_ids has {position_ids.numel()} entries for {num_tokens} tokens.")
    positions = position_ids.reshape(-1)
    steps_ok = (positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)
    message = "position_ids must start at 0 for every protein and count up by 1 (packed sequences)."
    return [((positions[0] == 0) & steps_ok.all(), message)]


def _cu_seq_lens_checks(
    cu_seq_lens: torch.Tensor, cu_seq_lens_k: torch.Tensor | None, num_tokens: int
) -> list[tuple[torch.Tensor, str]]:
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 2 or cu_seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seq_lens_q must be a 1-D integer tensor [num_proteins + 1] of dtype int32 (or int64), got "
            f"{cu_seq_lens.dtype} of shape {tuple(cu_seq_lens.shape)}."
        )
    checks = [
        (cu_seq_lens[0] == 0, "cu_seq_lens_q must start at 0."),
        ((cu_seq_lens.diff() > 0).all(), "cu_seq_lens_q must be strictly increasing (no empty proteins)."),
        (cu_seq_lens[-1] == num_tokens, f"cu_seq_lens_q must end at the number of tokens ({num_tokens})."),
    ]
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens:
        _check_tensor("cu_seq_lens_k", cu_seq_lens_k, cu_seq_lens.device)
        if cu_seq_lens_k.shape != cu_seq_lens.shape:
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (self-attention).")
        checks.append(
            ((cu_seq_lens_k == cu_seq_lens).all(), "cu_seq_lens_k must equal cu_seq_lens_q (self-attention).")
        )
    return checks


def _check_tensor(name: str, value: Any, device: torch.device | None) -> None:
    """Raise ValueError unless `value` is a tensor (on `device`, when given)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device} and the input tokens on {device}; put them on one device.")


def _as_length(name: str, value: Any) -> int | None:
    """`max_length_q`/`max_length_k` as a Python int (a 0-d integer tensor is accepted)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer, got a {value.dtype} tensor of shape {tuple(value.shape)}.")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def _too_long_message(config: NVEsmConfig) -> str:
    return (
        f"A protein is longer than max_protein_length ({config.max_protein_length} tokens including <cls> and "
        "<eos>); crop it, or load the model with a larger max_protein_length (attention memory grows with the "
        "square of the length)."
    )


def _warn_if_longer_than_trained(config: NVEsmConfig, max_length: int) -> None:
    """Once per process: `max_length` (the longest protein, or the packed batch's stated max_length) is past the
    crops ESM-2 was trained on."""
    if max_length > config.max_position_embeddings:
        logger.warning_once(
            f"A protein of up to {max_length} tokens: ESM-2 was trained on crops of {config.max_position_embeddings} "
            "tokens (1024 residues). It runs (rotary positions need no table), but outputs past that length are "
            "outside what the model saw in training."
        )


def _check_extra_inputs(kwargs: dict[str, Any], check_values: bool) -> None:
    """Refuse what NVEsm cannot honour among the extra keywords: a ValueError naming a keyword of transformers'
    ESM that asks for something ESM-2 lacks, a TypeError for unknown ones. `token_type_ids` must be all zeros
    (ESM-2 has one token type; checked with one device sync when `check_values`)."""
    for name, reason in UNSUPPORTED_INPUTS.items():
        if kwargs.get(name) is not None and kwargs[name] is not False:
            raise ValueError(f"{name} is not supported: {reason}. Leave it out (or pass None).")
    token_type_ids = kwargs.get("token_type_ids")
    if token_type_ids is not None:
        if not isinstance(token_type_ids, torch.Tensor):
            raise ValueError("token_type_ids must be a torch.Tensor (all zeros: ESM-2 has one token type).")
        if check_values and bool(token_type_ids.ne(0).any()):
            raise ValueError("token_type_ids must be all zeros: ESM-2 has one token type (no segment embedding).")
    unknown = set(kwargs) - IGNORED_INPUTS - set(UNSUPPORTED_INPUTS) - {"token_type_ids"}
    if unknown:
        raise TypeError(f"Unexpected inputs: {sorted(unknown)}")


def _wants_dict(return_dict: bool | None, config: NVEsmConfig) -> bool:
    return config.return_dict if return_dict is None else return_dict


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
        return output if _wants_dict(return_dict, self.config) else output.to_tuple()

    def predict_contacts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **packing: Any):
        """Residue contact probabilities: `NVEsmModel.predict_contacts` (as transformers' `EsmForMaskedLM`)."""
        return self.esm.predict_contacts(input_ids, attention_mask, **packing)


def token_loss(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None, check: bool = True
) -> torch.Tensor:
    """Mean cross-entropy of per-token `logits [..., C]` against `labels` (the shape of the tokens; -100 ignored).
    Padding (`attention_mask` 0) has no prediction here (its logits are zeros: the layers never run it), so a label
    there other than -100 raises ValueError instead of silently differing from transformers, which scores the
    padding token's logits (`check`: `config.check_inputs`, one device sync)."""
    labels = labels.to(logits.device)
    if attention_mask is not None and attention_mask.shape == labels.shape:
        padded_labels = ((attention_mask.to(labels.device) != 0) | (labels == -100)).all()
        message = (
            "labels must be -100 at padding (attention_mask 0): padding has no prediction in this model (transformers' "
            "data collators write -100 there)."
        )
        raise_on_failed_checks([(padded_labels, message)], check)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


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
        return output if _wants_dict(return_dict, self.config) else output.to_tuple()


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
        loss = None if labels is None else self._loss(logits, labels.to(logits.device))
        output = SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if _wants_dict(return_dict, self.config) else output.to_tuple()

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' rule: regression for one label, single-label CE for integer labels, else multi-label BCE."""
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        if self.config.problem_type == "regression":
            return (
                F.mse_loss(logits.squeeze(), labels.squeeze()) if self.num_labels == 1 else F.mse_loss(logits, labels)
            )
        if self.config.problem_type == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels)


__all__ = [
    "NVEsmForMaskedLM",
    "NVEsmForSequenceClassification",
    "NVEsmForTokenClassification",
    "NVEsmModel",
    "NVEsmPreTrainedModel",
    "PackedSequences",
]
