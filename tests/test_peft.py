"""Stock PEFT LoRA on NVEsm: the same `LoraConfig` as for transformers' ESM-2, the same numbers.

Each test wraps transformers' `EsmForMaskedLM` and the NVEsm twin (same weights) with the same `LoraConfig`, gives
both the same random adapters (nonzero B, so every adapter changes the output), and compares: outputs for padded
(right, left, both sides, wider) and packed batches with a length-1 and a max-length protein, merged weights
against transformers' merged weights mapped by the converter, attention maps, a saved and reloaded adapter.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import (
    ATOL_FP32,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_lengths,
    random_padded_batch,
    random_proteins,
    share_random_adapters,
)
from nv_esm.alphabet import GFP
from nv_esm.state_dict_mapping import hf_to_nv_state_dict

peft = pytest.importorskip("peft")

TARGET_SETS = {
    "attention and mlp": ["query", "key", "value", "dense"],
    "one of qkv": ["key"],
    "paths": ["attention.self.value", "intermediate.dense", "output.dense"],
    "all-linear": "all-linear",
}


def adapted_pair(targets, seed: int, **lora: object):
    """transformers' and NVEsm's masked-LM models with the same weights and the same random LoRA adapters."""
    hf_model = make_hf_model("tiny", seed=seed)
    nv_model = make_nv_model(hf_model)
    config = dict(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **lora)
    hf_peft = peft.get_peft_model(hf_model, peft.LoraConfig(**config)).eval()
    nv_peft = peft.get_peft_model(nv_model, peft.LoraConfig(**config)).eval()
    nv_adapters = sorted(key for key in nv_peft.state_dict() if "lora_" in key)
    assert nv_adapters == sorted(key.replace(".layer.", ".layers.") for key in hf_peft.state_dict() if "lora_" in key)
    share_random_adapters(hf_peft, nv_peft, seed, std=0.2)
    return hf_peft, nv_peft


def unpadded(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, S, ...]` -> `[tokens, ...]`: the positions the mask keeps, row after row (the packed order)."""
    return values[attention_mask.bool()]


@pytest.mark.parametrize("targets", TARGET_SETS.values(), ids=TARGET_SETS.keys())
@pytest.mark.parametrize("seed", [0, 1])
def test_adapted_outputs_match_transformers_with_the_same_adapters(targets, seed):
    hf_peft, nv_peft = adapted_pair(targets, seed)
    generator = torch.Generator().manual_seed(seed)
    proteins = random_proteins(random_lengths(generator, 5) + [hf_peft.config.max_position_embeddings], seed=seed)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = unpadded(hf_peft(input_ids=input_ids, attention_mask=attention_mask).logits, attention_mask)
        with hf_peft.disable_adapter():
            unadapted = unpadded(hf_peft(input_ids=input_ids, attention_mask=attention_mask).logits, attention_mask)
        assert max_abs_diff(expected, unadapted) > 1e-2  # the adapters change the output
        for side, width in (("right", "longest"), ("left", "multiple_of_16"), ("both", "wider")):
            ids, mask = random_padded_batch(proteins, side, width, generator)
            ours = unpadded(nv_peft(input_ids=ids, attention_mask=mask).logits, mask)
            assert max_abs_diff(ours, expected) < ATOL_FP32, (side, width)
        packed = nv_peft(**pack_batch(proteins)).logits[0]
        assert max_abs_diff(packed, expected) < ATOL_FP32
        with nv_peft.disable_adapter():
            assert max_abs_diff(nv_peft(**pack_batch(proteins)).logits[0], unadapted) < ATOL_FP32


@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_and_unload_writes_transformers_merged_weights_into_the_fused_layout(safe_merge):
    """Merging writes each adapter into its rows of the fused QKV weight (interleaved per head), the output
    projection, fc1 and fc2: the merged state dict is transformers' merged model through the converter."""
    hf_peft, nv_peft = adapted_pair(["query", "key", "value", "dense"], seed=3)
    input_ids, attention_mask = pad_batch(random_proteins([9, 1, 30], seed=3))
    with torch.no_grad():
        adapted = nv_peft(input_ids=input_ids, attention_mask=attention_mask).logits
        merged = nv_peft.merge_and_unload(safe_merge=safe_merge)
        hf_merged = hf_peft.merge_and_unload(safe_merge=safe_merge)
    assert type(merged).__name__ == "NVEsmForMaskedLM" and not any("lora" in key for key in merged.state_dict())
    expected = hf_to_nv_state_dict(hf_merged.state_dict(), merged.config)
    ours = merged.state_dict()
    assert sorted(ours) == sorted(expected)
    for key, tensor in expected.items():
        assert max_abs_diff(ours[key], tensor) < 1e-6, key
    with torch.no_grad():
        assert max_abs_diff(merged(input_ids=input_ids, attention_mask=attention_mask).logits, adapted) < ATOL_FP32


def test_attention_maps_see_the_adapters():
    hf_peft, nv_peft = adapted_pair(["query", "key"], seed=4)
    hf_peft.base_model.model.set_attn_implementation("eager")
    input_ids, attention_mask = pad_batch(random_proteins([12, 7, 1], seed=4))
    with torch.no_grad():
        expected = hf_peft(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        ours = nv_peft(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    for layer, (a, b) in enumerate(zip(ours, expected)):
        assert max_abs_diff(a * attention_mask[:, None, :, None], b * attention_mask[:, None, :, None]) < 1e-5, layer


def test_a_saved_adapter_reloads_onto_a_fresh_model(tmp_path):
    _, nv_peft = adapted_pair(["query", "value", "intermediate.dense"], seed=5)
    nv_peft.save_pretrained(tmp_path / "adapter")
    saved = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert set(saved.target_modules) == {"query", "value", "intermediate.dense"}
    fresh = make_nv_model(make_hf_model("tiny", seed=5))
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    inputs = pack_batch(random_proteins([20, 1, 8], seed=5))
    with torch.no_grad():
        assert max_abs_diff(reloaded(**inputs).logits, nv_peft(**inputs).logits) == 0.0


def test_training_moves_only_the_adapters_and_lowers_the_loss():
    """A few steps of masked-LM training on GFP with LoRA: only lora_A/lora_B change, the loss falls."""
    nv_model = make_nv_model(make_hf_model("tiny", seed=6)).train()
    before = copy.deepcopy(nv_model.state_dict())
    model = peft.get_peft_model(
        nv_model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"])
    )
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    from nv_esm.alphabet import CLS, EOS, MASK, RESIDUE_TO_ID

    tokens = torch.tensor([CLS, *(RESIDUE_TO_ID[c] for c in GFP[:120]), EOS])
    generator = torch.Generator().manual_seed(6)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def masked(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = (torch.rand(tokens.shape, generator=generator) < 0.15) & (tokens > EOS)
        return torch.where(chosen, MASK, tokens)[None], torch.where(chosen, tokens, -100)[None]

    held_out = masked(tokens)
    with torch.no_grad():
        loss_before = model(input_ids=held_out[0], labels=held_out[1]).loss.item()
    for _ in range(40):
        input_ids, labels = masked(tokens)
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        loss_after = model(input_ids=held_out[0], labels=held_out[1]).loss.item()
    assert loss_after < 0.9 * loss_before, (loss_before, loss_after)
    after = {key.replace(".base_layer.", "."): value for key, value in model.base_model.model.state_dict().items()}
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key  # the base stays frozen


@pytest.mark.parametrize("target", ["layernorm_qkv", "layernorm_mlp", "proj"])
def test_fused_modules_are_not_targets(target):
    """The fused modules would take an adapter on the input before their LayerNorm and could not merge: PEFT
    refuses them on the PyTorch backend (on Transformer Engine the layer does, tests/test_gpu.py)."""
    nv_model = make_nv_model(make_hf_model("tiny", seed=7))
    with pytest.raises(ValueError, match="not supported"):
        peft.get_peft_model(nv_model, peft.LoraConfig(r=4, target_modules=[target]))
