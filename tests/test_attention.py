"""Attention maps (`output_attentions`) and contact prediction (`predict_contacts`) against transformers'
`EsmForMaskedLM` with `attn_implementation="eager"` on the same weights (PyTorch backend, fp32, CPU).

Tolerance: ATOL_MAPS_FP32 = 1e-4 on probabilities (and contact scores) in [0, 1]. Usually ~3e-7 here (1 to 16
threads, AVX-512/AVX2/SSE kernels), but not in every process: CI's machine once gave 2.4e-5 on one protein, and
this machine once 1.0e-5 in ~40 runs of the same comparison, neither reproduced since. Maps are softmaxes of logits
carried through the layers, so rounding differences show here magnified. A real fault is far above the tolerance:
rotary angles shifted by one position move these maps by 8e-3. Transformers' maps hold values at padded query
rows (softmax over the real keys); ours are 0 there, so comparisons cover the
positions both models define: real queries x real keys (transformers' padded keys are 0 too).
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

import modeling_nv_esm_encoder
from conftest import (
    PADDING_SIDES,
    PADDING_WIDTHS,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_lengths,
    random_padded_batch,
    random_proteins,
)
from nv_esm.data import pad_proteins

ATOL_MAPS_FP32 = 1e-4


@pytest.fixture(scope="module")
def hf_eager():
    return make_hf_model("wide_heads", seed=70, attn_implementation="eager")


def alone(hf, protein: torch.Tensor):
    """transformers' outputs for one protein on its own."""
    with torch.no_grad():
        return hf(protein[None], output_attentions=True)


# Each width, side and layout once in the fast set; the other combinations (about 10 s each on 2 cores) are slow.
FAST_MAPS_CASES = {("longest", "left", "thd"), ("multiple_of_16", "right", "bshd"), ("wider", "both", "bshd")}


@pytest.mark.parametrize(
    "width,side,attn_input_format",
    [
        pytest.param(*case, marks=() if case in FAST_MAPS_CASES else pytest.mark.slow)
        for case in itertools.product(PADDING_WIDTHS, PADDING_SIDES, ["thd", "bshd"])
    ],
)
def test_attention_maps_of_padded_batches_match_transformers_per_protein(hf_eager, attn_input_format, side, width):
    """Each row's maps at its own tokens equal transformers' maps of that protein alone (lengths 1 to 60 and a
    1,026-token protein), zeros at every padded query row and key column."""
    nv = make_nv_model(hf_eager, attn_input_format=attn_input_format)
    generator = torch.Generator().manual_seed(72)
    proteins = random_proteins(random_lengths(generator, 4) + [1026], seed=73, mask_fraction=0.1)
    input_ids, attention_mask = random_padded_batch(proteins, side, width, generator)
    with torch.no_grad():
        maps = nv(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
    assert len(maps) == hf_eager.config.num_hidden_layers
    keep = attention_mask.bool()
    for row, protein in enumerate(proteins):
        expected = alone(hf_eager, protein).attentions
        columns = keep[row].nonzero().squeeze(1)
        for ours, theirs in zip(maps, expected):
            assert ours.shape == (len(proteins), 2, input_ids.shape[1], input_ids.shape[1])
            block = ours[row][:, columns][:, :, columns]
            assert max_abs_diff(block, theirs[0]) <= ATOL_MAPS_FP32, (row, side, width)
            assert not ours[row][:, ~keep[row]].any() and not ours[row][:, :, ~keep[row]].any()


def test_right_padded_maps_equal_transformers_batch_and_packed_maps_are_per_protein(hf_eager):
    """The padded batch as transformers runs it (same shapes, same values at real positions), and the packed
    layout: `[N, heads, L, L]`, protein i's maps in the top-left block of row i, zeros elsewhere."""
    nv = make_nv_model(hf_eager)
    proteins = random_proteins([33, 1, 60, 7], seed=74)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = hf_eager(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        padded = nv(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        packed = nv(**pack_batch(proteins), output_attentions=True).attentions
    real = attention_mask.bool()[:, None, :, None] & attention_mask.bool()[:, None, None, :]
    for ours, flat, theirs in zip(padded, packed, expected):
        assert ours.shape == theirs.shape and flat.shape == (4, 2, 60, 60)
        assert max_abs_diff(ours[real.expand_as(ours)], theirs[real.expand_as(theirs)]) <= ATOL_MAPS_FP32
        assert max_abs_diff(flat, ours) <= ATOL_MAPS_FP32  # right padding to the longest: the same layout


def test_config_output_attentions_is_honoured_and_heads_return_maps(hf_eager):
    nv = make_nv_model(hf_eager)
    nv.config.output_attentions = True
    proteins = random_proteins([20, 9], seed=75)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        assert len(nv(input_ids, attention_mask=attention_mask).attentions) == hf_eager.config.num_hidden_layers
        assert nv(input_ids, attention_mask=attention_mask, output_attentions=False).attentions is None


@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_predict_contacts_match_transformers(hf_eager, layout):
    """Right-padded: transformers' `predict_contacts` on the same batch at every residue pair of every protein.
    Left-padded and packed: each protein's contacts equal transformers' for it alone (our layout is per protein:
    residues in the top-left block; transformers assumes right padding). A 1,026-token and a 3-token protein."""
    nv = make_nv_model(hf_eager)
    proteins = random_proteins([40, 3, 1026, 17], seed=76, mask_fraction=0.1)
    if layout == "packed":
        packed = pack_batch(proteins)
        contacts = nv.predict_contacts(
            packed["input_ids"], cu_seq_lens_q=packed["cu_seq_lens_q"], max_length_q=packed["max_length_q"]
        )
        assert contacts.shape == (4, 1024, 1024)
    else:
        padded = pad_proteins(proteins, 1, padding_side=layout)
        contacts = nv.predict_contacts(padded["input_ids"], padded["attention_mask"])
        assert contacts.shape == (4, 1024, 1024)
    if layout == "right":
        with torch.no_grad():
            expected = hf_eager.predict_contacts(padded["input_ids"], padded["attention_mask"])
    for row, protein in enumerate(proteins):
        residues = len(protein) - 2
        if layout != "right":
            with torch.no_grad():
                reference = hf_eager.predict_contacts(protein[None], torch.ones_like(protein)[None])[0]
        else:
            reference = expected[row]
        assert max_abs_diff(contacts[row, :residues, :residues], reference[:residues, :residues]) <= ATOL_MAPS_FP32
        assert not contacts[row, residues:].any() and not contacts[row, :, residues:].any()


def test_predict_contacts_streams_one_layer_of_maps_at_a_time(hf_eager, monkeypatch):
    """Each layer's maps are freed before the next layer's are formed (the regression takes them as they come)."""
    nv = make_nv_model(hf_eager)
    produced = []
    real = modeling_nv_esm_encoder.attention_probabilities

    def recording(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in produced), "an earlier layer's maps are still held"
        maps = real(*args, **kwargs)
        produced.append(weakref.ref(maps))
        return maps

    monkeypatch.setattr(modeling_nv_esm_encoder, "attention_probabilities", recording)
    input_ids, attention_mask = pad_batch(random_proteins([50, 20], seed=77))
    nv.predict_contacts(input_ids, attention_mask)
    assert len(produced) == hf_eager.config.num_hidden_layers
