"""Every padded batch gives each protein exactly what it gets alone (PyTorch backend, fp32, CPU).

Padding on the left, the right or both sides of each row, batches exactly as wide as their longest protein,
rounded up to a multiple of 16 or wider still, rows of any length including 1 and 1026 (max_position_embeddings):
for each protein the logits, every hidden state and its share of the loss must equal transformers'
`EsmForMaskedLM` run on that protein alone (no padding), within the fp32 tolerance of tests/test_model.py (1e-5).
The layouts are drawn at random (seeded), and the padding positions hold random token ids.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import EsmForSequenceClassification, EsmForTokenClassification

from conftest import (
    ATOL_FP32,
    PADDING_SIDES,
    PADDING_WIDTHS,
    make_head_models,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    random_lengths,
    random_padded_batch,
    random_proteins,
)
from modeling_nv_esm import NVEsmForSequenceClassification, NVEsmForTokenClassification, pack_proteins

MAX_TOKENS = 1026


@pytest.fixture(scope="module")
def hf():
    return make_hf_model("wide_heads", seed=40)


@pytest.fixture(scope="module", params=["thd", "bshd"])
def nv(request, hf):
    return make_nv_model(hf, attn_input_format=request.param)


def random_labels(proteins: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """MLM labels for each protein: its own token ids at ~40% of positions (at least one), -100 elsewhere."""
    labels = []
    for protein in proteins:
        chosen = torch.rand(len(protein), generator=generator) < 0.4
        chosen[int(torch.randint(0, len(protein), (), generator=generator))] = True
        labels.append(torch.where(chosen, protein, -100))
    return labels


def spread_labels(labels: list[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-protein labels placed where `attention_mask` puts each protein's tokens; -100 at padding."""
    padded = torch.full(attention_mask.shape, -100)
    padded[attention_mask.bool()] = torch.cat(labels)
    return padded


def assert_each_protein_as_alone(hf, nv, proteins, input_ids, attention_mask, labels):
    with torch.no_grad():
        actual = nv(
            input_ids,
            attention_mask=attention_mask,
            labels=spread_labels(labels, attention_mask),
            output_hidden_states=True,
        )
        loss_sum, label_count = 0.0, 0
        for row, (protein, protein_labels) in enumerate(zip(proteins, labels)):
            alone = hf(protein[None], labels=protein_labels[None], output_hidden_states=True)
            keep = attention_mask[row].bool()
            assert max_abs_diff(actual.logits[row, keep], alone.logits[0]) <= ATOL_FP32, f"logits of row {row}"
            for layer, (ours, theirs) in enumerate(zip(actual.hidden_states, alone.hidden_states)):
                assert max_abs_diff(ours[row, keep], theirs[0]) <= ATOL_FP32, f"hidden state {layer}, row {row}"
                assert torch.count_nonzero(ours[row, ~keep]) == 0, f"hidden state {layer} at padding, row {row}"
            count = int((protein_labels != -100).sum())
            loss_sum, label_count = loss_sum + alone.loss.item() * count, label_count + count
    assert len(actual.hidden_states) == len(alone.hidden_states)
    assert abs(actual.loss.item() - loss_sum / label_count) <= ATOL_FP32


@pytest.mark.parametrize("width", PADDING_WIDTHS)
@pytest.mark.parametrize("side", PADDING_SIDES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_padding_layouts_give_each_protein_its_own_outputs(hf, nv, side, width, seed):
    generator = torch.Generator().manual_seed(
        1000 * seed + 10 * PADDING_SIDES.index(side) + PADDING_WIDTHS.index(width)
    )
    count = int(torch.randint(1, 7, (), generator=generator))
    proteins = random_proteins(random_lengths(generator, count), seed=seed, mask_fraction=0.15)
    input_ids, attention_mask = random_padded_batch(proteins, side, width, generator)
    assert_each_protein_as_alone(hf, nv, proteins, input_ids, attention_mask, random_labels(proteins, generator))


@pytest.mark.parametrize("side", PADDING_SIDES)
def test_max_length_protein_with_padding_on_any_side(side):
    """A 1026-token protein next to short ones, in a batch wider than max_position_embeddings."""
    hf = make_hf_model("tiny", seed=41)
    generator = torch.Generator().manual_seed(42)
    proteins = random_proteins([MAX_TOKENS, 1, 37, 2], seed=43, mask_fraction=0.15)
    input_ids, attention_mask = random_padded_batch(proteins, side, "wider", generator)
    assert input_ids.shape[1] > MAX_TOKENS
    labels = random_labels(proteins, generator)
    for attn_input_format in ("thd", "bshd"):
        nv = make_nv_model(hf, attn_input_format=attn_input_format)
        assert_each_protein_as_alone(hf, nv, proteins, input_ids, attention_mask, labels)


def test_left_padded_gradients_equal_the_sum_over_proteins_alone(hf):
    """Training on a left-padded batch: the gradient of the summed loss is the sum of each protein's own."""
    generator = torch.Generator().manual_seed(44)
    proteins = random_proteins([23, 1, 9], seed=45, mask_fraction=0.15)
    labels = random_labels(proteins, generator)
    input_ids, attention_mask = random_padded_batch(proteins, "left", "multiple_of_16", generator)
    for attn_input_format in ("thd", "bshd"):
        nv = make_nv_model(hf, attn_input_format=attn_input_format)
        logits = nv(input_ids, attention_mask=attention_mask).logits
        F.cross_entropy(
            logits.flatten(0, 1), spread_labels(labels, attention_mask).flatten(), reduction="sum"
        ).backward()
        batch_grads = {name: p.grad.clone() for name, p in nv.named_parameters() if p.grad is not None}
        nv.zero_grad()
        for protein, protein_labels in zip(proteins, labels):
            F.cross_entropy(nv(protein[None]).logits[0], protein_labels, reduction="sum").backward()
        assert batch_grads
        for name, p in nv.named_parameters():
            if name in batch_grads:
                assert max_abs_diff(batch_grads[name], p.grad) <= 1e-4 * max(1.0, p.grad.abs().max().item()), name


def test_padding_inside_a_protein_is_refused(nv):
    input_ids = torch.tensor([[0, 5, 6, 7, 2], [0, 5, 6, 7, 2]])
    with pytest.raises(ValueError, match="one contiguous run of tokens per row"):
        nv(input_ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]))


@pytest.mark.parametrize(
    "hf_class,nv_class",
    [
        (EsmForSequenceClassification, NVEsmForSequenceClassification),
        (EsmForTokenClassification, NVEsmForTokenClassification),
    ],
)
@pytest.mark.parametrize("side", PADDING_SIDES)
def test_classification_heads_give_each_protein_its_own_outputs(hf_class, nv_class, side):
    """The sequence head reads each protein's own <cls> (not column 0 of a left-padded row); the token head each
    token's state: per protein, what transformers' head model gives that protein alone."""
    generator = torch.Generator().manual_seed(48)
    proteins = random_proteins(random_lengths(generator, 5), seed=49, mask_fraction=0.1)
    input_ids, attention_mask = random_padded_batch(proteins, side, "wider", generator)
    for attn_input_format in ("thd", "bshd"):
        hf_model, nv_model = make_head_models(hf_class, nv_class, seed=46, attn_input_format=attn_input_format)
        with torch.no_grad():
            logits = nv_model(input_ids, attention_mask=attention_mask).logits
            for row, protein in enumerate(proteins):
                alone = hf_model(protein[None]).logits[0]
                ours = (
                    logits[row] if hf_class is EsmForSequenceClassification else logits[row, attention_mask[row].bool()]
                )
                assert max_abs_diff(ours, alone) <= ATOL_FP32, (attn_input_format, row)


@pytest.mark.parametrize("inputs", ["packed", "padded"])
@pytest.mark.parametrize("attn_input_format", ["thd", "bshd"])
def test_the_per_token_indices_are_computed_once_a_forward(monkeypatch, inputs, attn_input_format):
    """A token's protein (`sequence_index_of_tokens`) and its position in it (`positions_in_proteins`) are computed
    once per training forward and backward, packed or padded input, and every module below reads them."""
    import modeling_nv_esm_batch
    import modeling_nv_esm_layout
    import modeling_nv_esm_parallel

    calls = {"sequence_index_of_tokens": 0, "positions_in_proteins": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return counted

    for module in (modeling_nv_esm_batch, modeling_nv_esm_layout, modeling_nv_esm_parallel):
        for name in calls:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    model = make_nv_model(make_hf_model("tiny", seed=41), attn_input_format=attn_input_format).train()
    generator = torch.Generator().manual_seed(42)
    proteins = random_proteins(random_lengths(generator, 5), seed=43)
    if inputs == "packed":
        batch = pack_proteins(proteins)
    else:
        input_ids, attention_mask = random_padded_batch(proteins, "both", "wider", generator)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    model(**batch).logits.sum().backward()
    assert calls == {"sequence_index_of_tokens": 1, "positions_in_proteins": 1}


@pytest.mark.parametrize("seed", range(4))
def test_padding_a_packing_extends_its_per_token_indices_instead_of_computing_them(monkeypatch, seed):
    """`pad_packed` (FP8's and tensor parallelism's token multiples, CUDA graphs' static shapes) gives the padded
    packing the source's per-token indices extended over the dummy proteins, computing none anew: they equal what
    the padded packing would compute for itself. A source that has not computed them passes nothing on."""
    import modeling_nv_esm_batch
    from modeling_nv_esm_batch import PackedSequences
    from modeling_nv_esm_graphs import static_shape
    from modeling_nv_esm_layout import pad_packed, pad_packed_to_multiple

    generator = torch.Generator().manual_seed(seed)
    lengths = random_lengths(generator, int(torch.randint(1, 12, (), generator=generator)), longest=300)
    cu_seq_lens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    tokens = int(cu_seq_lens[-1])
    calls = []
    for name in ("sequence_index_of_tokens", "positions_in_proteins"):
        real = getattr(modeling_nv_esm_batch, name)
        monkeypatch.setattr(
            modeling_nv_esm_batch, name, lambda *a, real=real, name=name: calls.append(name) or real(*a)
        )
    for pad in (
        lambda states, packed: pad_packed(states, packed, *static_shape(tokens, len(lengths), max(lengths))),
        lambda states, packed: pad_packed_to_multiple(states, packed, 16),
    ):
        source = PackedSequences.right_padded(cu_seq_lens, max(lengths), tokens)
        _, untouched = pad_packed(torch.zeros(tokens, 4), source, tokens + 3, len(lengths) + 1, 3)
        assert untouched.computed_indices() is None and not calls
        assert source.positions.numel() == tokens  # computed, as the input checks do
        calls.clear()
        states, padded = pad(torch.zeros(tokens, 4), source)
        assert calls == [] and padded.computed_indices() is not None
        fresh = PackedSequences.right_padded(padded.cu_seq_lens, padded.max_length, padded.num_tokens)
        assert states.shape[0] == padded.num_tokens
        assert torch.equal(padded.sequence_index, fresh.sequence_index)
        assert torch.equal(padded.positions, fresh.positions)
        assert torch.equal(padded.token_index, fresh.token_index)
        calls.clear()


def test_the_twins_key_mask_is_made_once_a_forward_and_only_where_the_twin_attends(monkeypatch):
    """The right-padded view's key mask of a packed run (`PackedRun.key_mask`) is the twin's: made once per forward
    by the first layer that attends in the view, however many layers there are, and not when a run layout is only
    built, as for Transformer Engine's layers, which take `cu_seq_lens` instead."""
    from modeling_nv_esm_batch import PackedSequences
    from modeling_nv_esm_layout import PackedRun

    calls = []
    key_mask = PackedSequences.key_mask
    monkeypatch.setattr(PackedSequences, "key_mask", lambda self: calls.append(1) or key_mask(self))
    model = make_nv_model(make_hf_model("esm2_8M", seed=44)).eval()  # 6 layers
    batch = pack_proteins(random_proteins([5, 40, 1, 17], seed=45))
    with torch.no_grad():
        model(**batch)
    assert len(calls) == 1
    cu_seq_lens = batch["cu_seq_lens_q"]
    PackedRun(PackedSequences.right_padded(cu_seq_lens, 40, int(cu_seq_lens[-1])), None, int(cu_seq_lens[-1]))
    assert len(calls) == 1
