"""The plain Transformer Engine port of ESM-2 that `benchmark.py` compares against (variant `te_port`): the floor any
TE port gets. A stack of `te.TransformerLayer` fed the packed (THD) keyword arguments directly, as TE's examples do,
with ESM-2's embedding, final LayerNorm and LM head around it; nothing else: no input checks, no token-dropout
rescaling, no CUDA graphs, no padding logic (FP8 needs the caller's token count to be a multiple of 16).

The layers are configured as NVEsm's (`make_te_layer`: fused, interleaved QKV, rotary, exact GELU); the rotary
angles are TE's `RotaryPositionEmbedding` table, computed here.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te
from torch import nn


class TEPort(nn.Module):
    """ESM-2 MLM on a plain `te.TransformerLayer` stack. Called as NVEsm's packed forward: `input_ids [1, T]`,
    `cu_seq_lens_q [N + 1]`, `max_length_q`, optional `labels [1, T]`; returns `.logits` and `.loss`."""

    def __init__(self, hidden_size: int, num_hidden_layers: int, num_attention_heads: int, intermediate_size: int,
                 vocab_size: int = 33, padded_vocab_size: int = 64, **_: object) -> None:  # fmt: skip
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(padded_vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            te.TransformerLayer(
                hidden_size,
                intermediate_size,
                num_attention_heads,
                layernorm_epsilon=1e-5,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                layer_number=index + 1,
                kv_channels=head_dim,
                self_attn_mask_type="padding",
                layer_type="encoder",
                fuse_qkv_params=True,
                qkv_weight_interleaved=True,
                activation="gelu",
                normalization="LayerNorm",
                attn_input_format="thd",
                device="cuda",
            )
            for index in range(num_hidden_layers)
        )
        self.final_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.head_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        self.decoder = nn.Linear(hidden_size, padded_vocab_size)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, cu_seq_lens_q: torch.Tensor, max_length_q: int,
                labels: torch.Tensor | None = None) -> SimpleNamespace:  # fmt: skip
        positions = torch.arange(max_length_q, device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())
        rotary = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        kwargs = dict(
            self_attn_mask_type="padding",
            cu_seqlens_q=cu_seq_lens_q,
            cu_seqlens_kv=cu_seq_lens_q,
            max_seqlen_q=max_length_q,
            max_seqlen_kv=max_length_q,
            rotary_pos_emb=rotary,
        )
        hidden = self.embedding(input_ids[0])
        for layer in self.layers:
            hidden = layer(hidden, **kwargs)
        hidden = self.final_norm(hidden)
        hidden = self.head_norm(F.gelu(self.dense(hidden)))
        logits = self.decoder(hidden)[:, : self.vocab_size]
        loss = None if labels is None else F.cross_entropy(logits.float(), labels[0])
        return SimpleNamespace(logits=logits[None], loss=loss)
