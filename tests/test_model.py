"""Parity of NVEsm (PyTorch backend, fp32, CPU) with transformers' EsmForMaskedLM on the same weights.

Tolerance: fp32 on CPU, max |difference| <= 1e-5 for logits, hidden states, loss and gradients. The two
models do the same arithmetic in a different order (fused QKV GEMM instead of three, SDPA with a key mask of
another shape), which moves results by a few float32 ulps (~1e-7 relative) per layer; 1e-5 leaves room for
six layers of that on values of order 1-10 while catching any real error (a wrong weight, position or
token-dropout ratio moves logits by 1e-2 or more).
"""

from __future__ import annotations

import pytest
import torch

import modeling_nv_esm_batch
from conftest import (
    ATOL_FP32,
    EOS,
    MASK,
    PAD,
    SHAPES,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_proteins,
)
from nv_esm.data import pad_proteins
from nv_esm.state_dict_mapping import nv_to_hf_state_dict

MAX_TOKENS = 1026  # max_position_embeddings: 1024 residues + <cls> + <eos>


def hf_alone(hf_model, protein: torch.Tensor, labels: torch.Tensor | None = None):
    """transformers' outputs for one protein on its own (no padding)."""
    return hf_model(protein[None], output_hidden_states=True, labels=None if labels is None else labels[None])


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
@pytest.mark.parametrize("token_dropout,mask_fraction", [(True, 0.15), (True, 0.0), (False, 0.15)])
def test_padded_batch_matches_transformers(shape, attn_input_format, token_dropout, mask_fraction):
    hf = make_hf_model(shape, seed=1, token_dropout=token_dropout)
    nv = make_nv_model(hf, attn_input_format=attn_input_format)
    proteins = random_proteins([37, 1, 12, 64, 2], seed=2, mask_fraction=mask_fraction)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = hf(input_ids, attention_mask=attention_mask, output_hidden_states=True)
        actual = nv(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    keep = attention_mask.bool()
    assert actual.logits.shape == expected.logits.shape == (5, 64, 33)
    assert max_abs_diff(actual.logits[keep], expected.logits[keep]) <= ATOL_FP32
    assert len(actual.hidden_states) == len(expected.hidden_states) == SHAPES[shape]["num_hidden_layers"] + 1
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states):
        assert max_abs_diff(ours[keep], theirs[keep]) <= ATOL_FP32


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_loss_and_gradients_match_transformers(attn_input_format):
    hf = make_hf_model("wide_heads", seed=3)
    nv = make_nv_model(hf, attn_input_format=attn_input_format)
    proteins = random_proteins([50, 9, 33], seed=4, mask_fraction=0.15)
    input_ids, attention_mask = pad_batch(proteins)
    labels = torch.where(torch.rand(input_ids.shape) < 0.3, input_ids, -100)
    labels[attention_mask == 0] = -100
    expected = hf(input_ids, attention_mask=attention_mask, labels=labels)
    actual = nv(input_ids, attention_mask=attention_mask, labels=labels)
    assert abs(actual.loss.item() - expected.loss.item()) <= ATOL_FP32
    expected.loss.backward()
    actual.loss.backward()
    params = dict(nv.named_parameters(remove_duplicate=False))
    nv_grads = {  # map gradients with the checkpoint mapping; buffers and unused weights get zeros
        name: params[name].grad if name in params and params[name].grad is not None else torch.zeros_like(value)
        for name, value in nv.state_dict().items()
    }
    hf_grads = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    mapped = nv_to_hf_state_dict(nv_grads, nv.config)
    assert len(hf_grads) >= 6 * hf.config.num_hidden_layers
    for name, grad in hf_grads.items():
        assert max_abs_diff(mapped[name], grad) <= ATOL_FP32, name


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
@pytest.mark.parametrize("packing", ["cu_seq_lens", "position_ids", "both", "flat_ids"])
def test_packed_proteins_match_each_protein_alone(attn_input_format, packing):
    hf = make_hf_model("esm2_8M", seed=5)
    nv = make_nv_model(hf, attn_input_format=attn_input_format)
    proteins = random_proteins([1, 40, 2, 17, 120], seed=6, mask_fraction=0.2)
    packed = pack_batch(proteins)
    inputs = {
        "cu_seq_lens": {k: v for k, v in packed.items() if k != "position_ids"},
        "position_ids": {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]},
        "both": packed,
        "flat_ids": {"input_ids": packed["input_ids"][0], "cu_seq_lens_q": packed["cu_seq_lens_q"]},
    }[packing]
    with torch.no_grad():
        actual = nv(**inputs, output_hidden_states=True)
        total = sum(len(p) for p in proteins)
        assert actual.logits.shape == (1, total, 33)
        start = 0
        for protein in proteins:
            expected = hf_alone(hf, protein)
            span = slice(start, start + len(protein))
            assert max_abs_diff(actual.logits[0, span], expected.logits[0]) <= ATOL_FP32
            for ours, theirs in zip(actual.hidden_states, expected.hidden_states):
                assert max_abs_diff(ours[0, span], theirs[0]) <= ATOL_FP32
            start += len(protein)


def test_in_model_packing_matches_padded_run_and_zeroes_padding():
    hf = make_hf_model("esm2_8M", seed=7)
    padded_model = make_nv_model(hf, attn_input_format="bshd")
    packing_model = make_nv_model(hf, attn_input_format="thd")
    input_ids, attention_mask = pad_batch(random_proteins([3, 77, 25, 1], seed=8, mask_fraction=0.1))
    with torch.no_grad():
        padded = padded_model.esm(input_ids, attention_mask=attention_mask).last_hidden_state
        packed = packing_model.esm(input_ids, attention_mask=attention_mask).last_hidden_state
    keep = attention_mask.bool()
    assert max_abs_diff(packed[keep], padded[keep]) <= ATOL_FP32
    assert torch.count_nonzero(packed[~keep]) == 0


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_max_length_protein_in_heavily_padded_batch(attn_input_format):
    hf = make_hf_model("tiny", seed=9)
    nv = make_nv_model(hf, attn_input_format=attn_input_format)
    lengths = [MAX_TOKENS, 1, 5, 2, 30, 3]
    input_ids, attention_mask = pad_batch(random_proteins(lengths, seed=10, mask_fraction=0.15))
    assert 1 - attention_mask.float().mean().item() >= 0.8  # >= 80% padding
    with torch.no_grad():
        padded = nv(input_ids, attention_mask=attention_mask).logits
        packed = nv(**pack_batch(random_proteins(lengths, seed=10, mask_fraction=0.15))).logits
        expected = hf(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(padded[keep], expected[keep]) <= ATOL_FP32
    assert max_abs_diff(packed[0], expected[keep]) <= ATOL_FP32


def test_unpadded_batch_without_attention_mask():
    hf = make_hf_model("wide_heads", seed=11)
    input_ids, _ = pad_batch(random_proteins([20, 20, 20], seed=12, mask_fraction=0.1))
    with torch.no_grad():
        expected = hf(input_ids).logits
        for attn_input_format in ("bshd", "thd"):
            actual = make_nv_model(hf, attn_input_format=attn_input_format)(input_ids).logits
            assert max_abs_diff(actual, expected) <= ATOL_FP32


def test_packed_loss_equals_padded_loss():
    hf = make_hf_model("wide_heads", seed=13)
    nv = make_nv_model(hf)
    proteins = random_proteins([12, 30, 7], seed=14, mask_fraction=0.15)
    generator = torch.Generator().manual_seed(15)
    labels = [torch.where(torch.rand(len(p), generator=generator) < 0.4, p, -100) for p in proteins]
    input_ids, attention_mask = pad_batch(proteins)
    padded_labels = torch.full(input_ids.shape, -100)
    for row, label in enumerate(labels):
        padded_labels[row, : len(label)] = label
    with torch.no_grad():
        expected = hf(input_ids, attention_mask=attention_mask, labels=padded_labels).loss
        packed = nv(**pack_batch(proteins), labels=torch.cat(labels)[None]).loss
    assert abs(packed.item() - expected.item()) <= ATOL_FP32


def test_inputs_embeds_match_input_ids_without_token_dropout():
    hf = make_hf_model("tiny", seed=16, token_dropout=False)
    nv = make_nv_model(hf)
    input_ids, attention_mask = pad_batch(random_proteins([9, 4], seed=17))
    embeds = nv.esm.embeddings.word_embeddings(input_ids)
    with torch.no_grad():
        from_ids = nv(input_ids, attention_mask=attention_mask).logits
        from_embeds = nv(inputs_embeds=embeds, attention_mask=attention_mask).logits
        expected = hf(inputs_embeds=embeds, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(from_embeds[keep], from_ids[keep]) <= ATOL_FP32
    assert max_abs_diff(from_embeds[keep], expected[keep]) <= ATOL_FP32


def test_gradient_checkpointing_gives_the_same_gradients():
    hf = make_hf_model("wide_heads", seed=18)
    reference, checkpointed = make_nv_model(hf), make_nv_model(hf)
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)  # transformers >= 5.2x name
    (enable or checkpointed.gradient_checkpointing_enable)()
    checkpointed.train()
    reference.train()
    batch = pack_batch(random_proteins([14, 25], seed=19, mask_fraction=0.15))
    labels = batch["input_ids"].clone()
    reference(**batch, labels=labels).loss.backward()
    checkpointed(**batch, labels=labels).loss.backward()
    assert checkpointed.esm.encoder.gradient_checkpointing
    for (name, a), (_, b) in zip(reference.named_parameters(), checkpointed.named_parameters()):
        if name.startswith("esm.contact_head"):  # not part of the MLM graph
            assert a.grad is None and b.grad is None
            continue
        assert max_abs_diff(a.grad, b.grad) <= ATOL_FP32, name


def test_decoder_is_tied_to_embeddings_and_padded_rows_are_zero():
    nv = make_nv_model(make_hf_model("tiny", seed=20))
    assert nv.lm_head.decoder.weight is nv.esm.embeddings.word_embeddings.weight
    assert nv.lm_head.decoder.weight.shape[0] == nv.config.padded_vocab_size == 64
    assert torch.count_nonzero(nv.lm_head.decoder.weight[33:]) == 0
    assert torch.count_nonzero(nv.lm_head.decoder.bias[33:]) == 0


def test_token_dropout_ratio_is_per_protein_in_packed_batches():
    """A protein full of masks next to one without: each keeps its own rescaling (as when run alone)."""
    hf = make_hf_model("tiny", seed=21)
    nv = make_nv_model(hf)
    heavy = torch.tensor([0, MASK, MASK, MASK, 5, EOS])
    light = torch.tensor([0, 5, 6, 7, 8, EOS])
    with torch.no_grad():
        packed = nv(**pack_batch([heavy, light])).logits[0]
        assert max_abs_diff(packed[:6], hf(heavy[None]).logits[0]) <= ATOL_FP32
        assert max_abs_diff(packed[6:], hf(light[None]).logits[0]) <= ATOL_FP32


def test_pad_token_positions_do_not_change_real_tokens():
    nv = make_nv_model(make_hf_model("tiny", seed=22), attn_input_format="bshd")
    input_ids, attention_mask = pad_batch(random_proteins([10, 4], seed=23))
    noisy = input_ids.clone()
    noisy[attention_mask == 0] = torch.randint(4, 24, noisy[attention_mask == 0].shape)
    with torch.no_grad():
        a = nv(input_ids, attention_mask=attention_mask).logits
        b = nv(noisy, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(a[keep], b[keep]) <= ATOL_FP32


def test_rotary_inv_freq_stays_float32_when_the_model_is_cast():
    model = make_nv_model(make_hf_model("tiny", seed=24))
    original = model.esm.rotary_embeddings.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.lm_head.dense.weight.dtype == torch.bfloat16
    assert model.esm.rotary_embeddings.inv_freq.dtype == torch.float32
    assert torch.equal(model.esm.rotary_embeddings.inv_freq, original)


def test_tuple_outputs_when_return_dict_is_false():
    nv = make_nv_model(make_hf_model("tiny", seed=25))
    input_ids, attention_mask = pad_batch(random_proteins([6, 3], seed=26))
    labels = torch.where(attention_mask.bool(), input_ids, -100)
    with torch.no_grad():
        as_dict = nv(input_ids, attention_mask=attention_mask, labels=labels)
        loss, logits = nv(input_ids, attention_mask=attention_mask, labels=labels, return_dict=False)
        (states,) = nv.esm(input_ids, attention_mask=attention_mask, return_dict=False)
    assert torch.equal(loss, as_dict.loss) and torch.equal(logits, as_dict.logits)
    assert states.shape == (2, 6, nv.config.hidden_size)


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_proteins_longer_than_esm2_crops_match_transformers(monkeypatch, attn_input_format):
    """1,500 and 4,000 residues (past the 1,024 ESM-2 was trained on; transformers runs them, rotary positions have
    no table): every protein's logits and hidden states equal transformers' for it alone, padded (left padding,
    next to a short protein) and packed, with one warning that the model saw only 1,024-residue crops."""
    warnings = []
    monkeypatch.setattr(modeling_nv_esm_batch.logger, "warning_once", warnings.append)
    hf = make_hf_model("tiny", seed=60)
    nv = make_nv_model(hf, attn_input_format=attn_input_format)
    proteins = random_proteins([1502, 20, 4002], seed=61, mask_fraction=0.15)
    padded = pad_proteins(proteins, PAD, padding_side="left")
    with torch.no_grad():
        expected = [hf_alone(hf, protein) for protein in proteins]
        batch = nv(**padded, output_hidden_states=True)
        packed = nv(**pack_batch(proteins), output_hidden_states=True)
    keep = padded["attention_mask"].bool()
    starts = [0, *torch.tensor([len(p) for p in proteins]).cumsum(0).tolist()]
    spans = [slice(start, end) for start, end in zip(starts, starts[1:])]
    for row, reference in enumerate(expected):
        assert max_abs_diff(batch.logits[row, keep[row]], reference.logits[0]) <= ATOL_FP32, row
        assert max_abs_diff(packed.logits[0, spans[row]], reference.logits[0]) <= ATOL_FP32, row
        for ours, theirs in zip(batch.hidden_states, reference.hidden_states):
            assert max_abs_diff(ours[row, keep[row]], theirs[0]) <= ATOL_FP32, row
    longest = max(len(protein) for protein in proteins) - 2  # residues: <cls> and <eos> left out
    assert warnings and all(
        f"A protein of up to {longest} residues: ESM-2 was trained on proteins of at most 1024 residues." in message
        for message in warnings
    )
