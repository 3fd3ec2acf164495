"""Scoring on the GPU: `nv_esm.scoring` with Transformer Engine in bf16 (CUDA graphs on and off; loaded with
`check_inputs=False`, as `nv-esm score` loads it) against the fp32 transformers reference of tests/test_scoring.py
(one masked copy at a time, fp32).

Tolerance as tests/test_gpu.py's bf16 rule: NVEsm's error (max |log-probability or score - fp32 reference|) must be
no worse than transformers' own bf16 error on the GPU (the same reference loop in bf16) times 1.5, plus a floor of
2e-2 per log-probability, times sqrt(n) for a score summing n log-probabilities (2 per mutated position; 2L for
pseudo_likelihood: independent rounding errors grow as the square root of their number). Skipped without CUDA and
Transformer Engine.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_scoring import random_mutants, random_sequence, reference_per_position, reference_score
from transformers import EsmTokenizer

from conftest import GPU_MARKS, TINY_CHECKPOINT, make_hf_model, make_nv_model, packed_on_gpu, random_proteins
from nv_esm import scoring

pytestmark = GPU_MARKS

BF16_FACTOR, BF16_FLOOR = 1.5, 2e-2
WINDOW = 48  # residues per forward here, so the 80- and 130-residue proteins run windowed


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_bf16_scores_are_as_close_to_fp32_as_transformers_bf16(cuda_graphs, capture_at_first_use):
    """With graphs, every shape is captured at first use, and at least one captured graph must have replayed."""
    hf_fp32 = make_hf_model("esm2_8M", seed=300)
    hf_bf16 = make_hf_model("esm2_8M", seed=300).to("cuda", torch.bfloat16)
    model = make_nv_model(hf_fp32, backend="te", cuda_graphs=cuda_graphs, check_inputs=False)
    model = model.to("cuda", torch.bfloat16)
    tokenizer = EsmTokenizer.from_pretrained(TINY_CHECKPOINT)
    generator = torch.Generator().manual_seed(301)

    sequences = [random_sequence(n, generator) for n in (1, 30, WINDOW, 130)]
    ours = scoring.pseudo_log_likelihood(model, sequences, tokenizer, per_position=True, window=WINDOW)
    for sequence, result in zip(sequences, ours):
        expected = reference_per_position(hf_fp32, sequence, WINDOW)
        hf_error = (reference_per_position(hf_bf16, sequence, WINDOW) - expected).abs().max().item()
        error = (result.per_position - expected).abs().max().item()
        print(
            f"\n[PLL {len(sequence)} residues] max |log p - fp32|: ours {error:.4f}, transformers bf16 {hf_error:.4f}"
        )
        assert error <= BF16_FACTOR * hf_error + BF16_FLOOR

    wild_type = random_sequence(80, generator)
    mutants = random_mutants(wild_type, generator, 8, window=WINDOW)
    for method in scoring.METHODS:
        scores = scoring.score_variants(model, wild_type, mutants, tokenizer, method, window=WINDOW)
        expected = torch.tensor([reference_score(hf_fp32, wild_type, m, method, WINDOW) for m in mutants])
        hf_scores = torch.tensor([reference_score(hf_bf16, wild_type, m, method, WINDOW) for m in mutants])
        error, hf_error = (scores - expected).abs().max().item(), (hf_scores - expected).abs().max().item()
        terms = 2 * (len(wild_type) if method == "pseudo_likelihood" else max(m.count(":") + 1 for m in mutants))
        print(f"\n[{method}] max |score - fp32|: ours {error:.4f}, transformers bf16 {hf_error:.4f}")
        assert error <= BF16_FACTOR * hf_error + BF16_FLOOR * math.sqrt(terms), method

    replayed = [graph for graph in model.esm.encoder.graphs._graphs.values() if graph is not None]
    assert bool(replayed) == cuda_graphs, "with cuda_graphs, no captured graph replayed"


def test_fp8_scores_do_not_depend_on_the_batches_before():
    """`nv-esm score --fp8` (every layer FP8 with `COMMAND_FP8_RECIPE`, block scaling): a scan's scores are the
    same, bit for bit, before and after other batches ran (each token is scaled on its own), and stay near
    the fp32 reference (FP8's error: a loose bound, the premise here is the
    independence). Eager, so that both runs take the same path (a first-use capture runs its batch eagerly, later
    batches replay)."""
    from nv_esm.embed_plan import COMMAND_FP8_RECIPE

    hf_fp32 = make_hf_model("esm2_8M", seed=302)
    layers = hf_fp32.config.num_hidden_layers
    model = make_nv_model(
        hf_fp32,
        backend="te",
        layer_precision=["fp8"] * layers,
        fp8_recipe=COMMAND_FP8_RECIPE,
        cuda_graphs=False,
        check_inputs=False,
    )
    model = model.to("cuda", torch.bfloat16)
    tokenizer = EsmTokenizer.from_pretrained(TINY_CHECKPOINT)
    generator = torch.Generator().manual_seed(303)
    wild_type = random_sequence(64, generator)
    mutants = random_mutants(wild_type, generator, 12)
    first = scoring.score_variants(model, wild_type, mutants, tokenizer)
    other = random_sequence(120, generator)  # different activations: other amaxes
    scoring.pseudo_log_likelihood(model, [other.replace("A", "W"), other], tokenizer)
    again = scoring.score_variants(model, wild_type, mutants, tokenizer)
    assert torch.equal(first, again)
    expected = torch.tensor([reference_score(hf_fp32, wild_type, m, "masked_marginal", 10**6) for m in mutants])
    assert (first - expected).abs().max().item() < 1.0


def test_command_fp8_keeps_a_proteins_log_probabilities_whatever_is_packed_beside_it():
    """Block scaling (`COMMAND_FP8_RECIPE`: one scale per 128 features of a token's activations, per 128 x 128
    block of a weight) quantizes each token on its own, so a protein's log-probabilities alone and packed beside a
    longer protein differ only as bf16 does (the GEMMs' other row count may change their kernels): at most twice
    the bf16 model's own difference, plus 2e-3. The positive control: under current scaling (one scale per tensor,
    from the whole batch) the neighbour moves them by FP8 rounding, more than twice as far as under block scaling.
    Eager: both batches take the same path."""
    from nv_esm.embed_plan import COMMAND_FP8_RECIPE

    hf_fp32 = make_hf_model("esm2_8M", seed=304)
    layers = hf_fp32.config.num_hidden_layers
    protein, neighbour = random_proteins([70, 400], seed=305, mask_fraction=0.15)
    moved = {}
    for name, precision, recipe in (
        ("bf16", None, "delayed"),
        ("block", ["fp8"] * layers, COMMAND_FP8_RECIPE),
        ("current", ["fp8"] * layers, "current"),
    ):
        model = make_nv_model(
            hf_fp32, backend="te", layer_precision=precision, fp8_recipe=recipe, cuda_graphs=False, check_inputs=False
        )
        model = model.to("cuda", torch.bfloat16)
        with torch.no_grad():
            log_probs = [
                model(**packed_on_gpu(batch)).logits[0, : len(protein)].float().log_softmax(-1)
                for batch in ([protein], [protein, neighbour])
            ]
        moved[name] = (log_probs[0] - log_probs[1]).abs().max().item()
    print(f"\n[a protein alone vs beside another] max |log p difference|: {moved}")
    assert COMMAND_FP8_RECIPE == "block"
    assert moved["block"] <= 2 * moved["bf16"] + 2e-3
    assert moved["current"] > 2 * moved["block"]
