"""Helpers of the converter tests (tests/test_convert*.py): checkpoint folders, tensor comparison, running the CLI."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import EsmForMaskedLM

from convert_checkpoint import main
from nv_esm.checkpoint_io import DTYPES
from nv_esm.hub_folder import REMOTE_CODE_FILES, write_esm_tokenizer

# --verify on the CPU: the exact PyTorch path on every machine (with a GPU, "auto" runs Transformer Engine, whose
# tanh GELU moves float32 logits by ~3e-3; tests/test_gpu.py covers that path).
VERIFY_CPU = ("--verify", "--verify-device", "cpu")
# What a converted folder holds: the remote code (`REMOTE_CODE_FILES`, the one list of it, which
# tests/test_layout.py checks against pyproject.toml's install list) and these.
NV_FILES = {*REMOTE_CODE_FILES, "config.json", "LICENSE", "README.md", "vocab.txt", "tokenizer_config.json"}


def save_hf(model: EsmForMaskedLM, folder: Path, dtype: str = "float32", shard: int | None = None) -> Path:
    """A transformers checkpoint folder as `save_pretrained` writes it, with the ESM tokenizer."""
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(DTYPES[dtype]).save_pretrained(folder, **kwargs)
    write_esm_tokenizer(folder, remote_code=False)
    return folder


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, by stored name."""
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            state.update({key: file.get_tensor(key) for key in file.keys()})
    return state


def current_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 saves LayerNorms as gamma/beta and inv_freq under a `layer.*` name; use the module names."""
    renamed = {}
    for key, value in state.items():
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))
        key = re.sub(r"encoder\.layer\.\*\.attention\.self\.rotary_embeddings", "rotary_embeddings", key)
        renamed[key] = value
    return renamed


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key], expected[key]), key


def run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    status = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def write_fair_esm_checkpoint(model: EsmForMaskedLM, path: Path, regression_beside: bool) -> None:
    """The layout of fair-esm's esm2_*.pt (names written out here, independent of the converter's table)."""
    hf, config = model.state_dict(), model.config
    fair = {
        "encoder.sentence_encoder.embed_tokens.weight": hf["esm.embeddings.word_embeddings.weight"],
        "encoder.sentence_encoder.emb_layer_norm_after.weight": hf["esm.encoder.emb_layer_norm_after.weight"],
        "encoder.sentence_encoder.emb_layer_norm_after.bias": hf["esm.encoder.emb_layer_norm_after.bias"],
        "encoder.lm_head.weight": hf["esm.embeddings.word_embeddings.weight"],
        "encoder.lm_head.bias": hf["lm_head.bias"],
    }
    for part in ("weight", "bias"):
        fair[f"encoder.lm_head.dense.{part}"] = hf[f"lm_head.dense.{part}"]
        fair[f"encoder.lm_head.layer_norm.{part}"] = hf[f"lm_head.layer_norm.{part}"]
    for i in range(config.num_hidden_layers):
        fair_layer, hf_layer = f"encoder.sentence_encoder.layers.{i}.", f"esm.encoder.layer.{i}."
        fair[fair_layer + "self_attn.rot_emb.inv_freq"] = hf["esm.rotary_embeddings.inv_freq"].clone()
        for part in ("weight", "bias"):
            fair[fair_layer + f"self_attn.q_proj.{part}"] = hf[hf_layer + f"attention.self.query.{part}"]
            fair[fair_layer + f"self_attn.k_proj.{part}"] = hf[hf_layer + f"attention.self.key.{part}"]
            fair[fair_layer + f"self_attn.v_proj.{part}"] = hf[hf_layer + f"attention.self.value.{part}"]
            fair[fair_layer + f"self_attn.out_proj.{part}"] = hf[hf_layer + f"attention.output.dense.{part}"]
            fair[fair_layer + f"self_attn_layer_norm.{part}"] = hf[hf_layer + f"attention.LayerNorm.{part}"]
            fair[fair_layer + f"final_layer_norm.{part}"] = hf[hf_layer + f"LayerNorm.{part}"]
            fair[fair_layer + f"fc1.{part}"] = hf[hf_layer + f"intermediate.dense.{part}"]
            fair[fair_layer + f"fc2.{part}"] = hf[hf_layer + f"output.dense.{part}"]
    regression = {f"contact_head.regression.{p}": hf[f"esm.contact_head.regression.{p}"] for p in ("weight", "bias")}
    if regression_beside:
        torch.save({"model": regression}, path.with_name(path.stem + "-contact-regression.pt"))
    else:
        fair.update({"encoder." + key: value for key, value in regression.items()})
    args = argparse.Namespace(
        encoder_layers=config.num_hidden_layers,
        encoder_embed_dim=config.hidden_size,
        encoder_ffn_embed_dim=config.intermediate_size,
        encoder_attention_heads=config.num_attention_heads,
        token_dropout=True,
        arch="esm2",
    )
    torch.save({"model": {k: v.clone() for k, v in fair.items()}, "cfg": {"model": args}}, path)
