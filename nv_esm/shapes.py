"""ESM-2 shapes, a transformers config of any of them, and model FLOPs for MFU.

MFU = model FLOP/s / peak dense bf16 FLOP/s of the GPU. Model FLOPs count every matmul of a step, 2 FLOPs per
multiply-add: per token and layer QKV + output projection (4 h^2) and the MLP (2 h i), the LM head dense layer and
decoder (h^2 + 64 h, the padded vocabulary); attention scores and values add 4 h s^2 per layer and protein of s
tokens (no causal halving: ESM attends both ways). Backward is twice forward, so a training step is 3x.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nv_esm.alphabet import ESM_VOCAB

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # dense, SXM
# The published ESM-2 sizes (config fields that differ between them), and the bundled tiny test checkpoint's.
ESM2_SHAPES = {
    "8M": dict(hidden_size=320, num_hidden_layers=6, num_attention_heads=20, intermediate_size=1280),
    "150M": dict(hidden_size=640, num_hidden_layers=30, num_attention_heads=20, intermediate_size=2560),
    "650M": dict(hidden_size=1280, num_hidden_layers=33, num_attention_heads=20, intermediate_size=5120),
    "3B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=40, intermediate_size=10240),
    "15B": dict(hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, intermediate_size=20480),
}
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def esm2_config(**fields: object) -> Any:
    """A transformers `EsmConfig` as `facebook/esm2_*` ship them; `fields` set the shape and override any default."""
    from transformers import EsmConfig

    defaults = dict(
        vocab_size=len(ESM_VOCAB),
        mask_token_id=ESM_VOCAB.index("<mask>"),
        pad_token_id=ESM_VOCAB.index("<pad>"),
        max_position_embeddings=1026,
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        architectures=["EsmForMaskedLM"],
    )
    return EsmConfig(**{**defaults, **fields})


def model_flops(
    hidden_size: int, num_layers: int, intermediate_size: int, lengths: Iterable[int], training: bool
) -> float:
    """FLOPs of one forward (x3 with `training`) over proteins of `lengths` tokens."""
    lengths = list(lengths)
    h, i = hidden_size, intermediate_size
    tokens = sum(lengths)
    matmul = 2 * (num_layers * (4 * h * h + 2 * h * i) + h * h + h * 64) * tokens
    attention = 4 * num_layers * h * sum(s * s for s in lengths)
    return (matmul + attention) * (3 if training else 1)


def peak_tflops(device_name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of a known GPU name (`torch.cuda.get_device_name()`), else None."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device_name), None)
