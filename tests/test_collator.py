"""`nv_esm.collator.PackedMLMCollator`: ESM-2 masking statistics, a packed loss equal to transformers' loss on the
same masked proteins padded, reproducibility, clear errors, and a `Trainer` run on the packed batches.
fp32, PyTorch backend, 1e-5 (tests/test_model.py's tolerance)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments

from conftest import ATOL_FP32, TINY_CHECKPOINT, make_hf_model, make_nv_model, random_lengths
from nv_esm.alphabet import CLS, EOS, MASK, PAD, STANDARD_AMINO_ACIDS, STANDARD_IDS
from nv_esm.collator import PackedMLMCollator


def random_sequences(lengths: list[int], seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    letters = torch.randint(0, len(STANDARD_AMINO_ACIDS), (sum(lengths),), generator=generator).tolist()
    sequences, start = [], 0
    for length in lengths:
        sequences.append("".join(STANDARD_AMINO_ACIDS[i] for i in letters[start : start + length]))
        start += length
    return sequences


def tokenized(sequences: list[str]) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHECKPOINT)
    return [{"input_ids": tokenizer(sequence)["input_ids"], "sequence": sequence} for sequence in sequences]


def unpack(batch: dict, name: str) -> list[torch.Tensor]:
    bounds = batch["cu_seq_lens_q"].tolist()
    return [batch[name][0, start:end] for start, end in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(3))
def test_packed_loss_equals_transformers_on_the_same_masked_proteins_padded(seed):
    """Random lengths with an empty protein (<cls><eos>) and a max-length one (1024 residues)."""
    hf_model = make_hf_model("tiny", seed=seed)
    model = make_nv_model(hf_model)
    lengths = [max(n - 2, 0) for n in random_lengths(torch.Generator().manual_seed(seed), 7)] + [0, 1024]
    features = tokenized(random_sequences(lengths, seed))
    batch = PackedMLMCollator(seed=seed)(features)
    assert batch["input_ids"].shape == batch["labels"].shape == (1, sum(lengths) + 2 * len(lengths))
    inputs, labels = unpack(batch, "input_ids"), unpack(batch, "labels")
    width = max(map(len, inputs))
    padded_ids = torch.full((len(inputs), width), PAD)
    padded_labels = torch.full((len(inputs), width), -100)
    attention_mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(zip(inputs, labels)):
        padded_ids[row, : len(ids)], padded_labels[row, : len(ids)], attention_mask[row, : len(ids)] = (
            ids,
            row_labels,
            1,
        )
    with torch.no_grad():
        expected = hf_model(padded_ids, attention_mask=attention_mask, labels=padded_labels).loss
        loss = model(**batch).loss
    assert abs(loss.item() - expected.item()) < ATOL_FP32


def test_masking_follows_esm2():
    """Over 300 proteins (~60k residues): 15% of residues labelled with their own id, never <cls>/<eos>; of
    those 80% <mask>, 10% a standard residue (other or same), 10% unchanged (within 3 points)."""
    features = tokenized(random_sequences([200] * 300, seed=1))
    batch = PackedMLMCollator(seed=2)(features)
    original = torch.cat([torch.tensor(f["input_ids"]) for f in features])
    inputs, labels = batch["input_ids"][0], batch["labels"][0]
    labelled = labels != -100
    residues = (original != CLS) & (original != EOS)
    assert not labelled[~residues].any() and torch.equal(labels[labelled], original[labelled])
    assert torch.equal(inputs[~labelled], original[~labelled])
    assert abs(labelled.float().sum() / residues.sum() - 0.15) < 0.01
    selected = inputs[labelled]
    masked = (selected == MASK).float().mean()
    unchanged = (selected == original[labelled]).float().mean()
    assert abs(masked - 0.8) < 0.03 and abs(unchanged - (0.1 + 0.1 / 20)) < 0.03
    assert torch.isin(selected[selected != MASK], torch.tensor(STANDARD_IDS)).all()


def test_randomness_is_seeded_or_follows_torch():
    features = tokenized(random_sequences([50, 80, 120], seed=3))
    assert torch.equal(
        PackedMLMCollator(seed=4)(features)["input_ids"], PackedMLMCollator(seed=4)(features)["input_ids"]
    )
    collator = PackedMLMCollator()
    torch.manual_seed(5)
    first = collator(features)["input_ids"]
    torch.manual_seed(5)
    assert torch.equal(collator(features)["input_ids"], first)
    assert not torch.equal(collator(features)["input_ids"], first)  # the torch RNG moved on


@pytest.mark.parametrize(
    "features,message",
    [
        ([], "empty batch"),
        ([{"sequence": "MKV"}], "has no input_ids"),
        ([{"input_ids": [0, 5, 6, 2], "labels": [0, 5, 6, 2]}], "makes the MLM labels"),
        ([{"input_ids": [0, 5, 6, 2, 1], "attention_mask": [1, 1, 1, 1, 0]}], "is padded"),
        ([{"input_ids": [0, 5, 6, 2, 1]}], "is padded"),
        ([{"input_ids": []}], "non-empty 1-D list"),
    ],
)
def test_bad_features_raise(features, message):
    with pytest.raises(ValueError, match=message):
        PackedMLMCollator(seed=0)(features)


def test_trainer_trains_on_packed_masked_batches(tmp_path):
    model = make_nv_model(make_hf_model("tiny", seed=6)).train()
    before = model.esm.embeddings.word_embeddings.weight.detach().clone()
    dataset = tokenized(random_sequences([int(n) for n in torch.randint(20, 300, (32,)).tolist()], seed=7))
    arguments = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, remove_unused_columns=False,
    )  # fmt: skip
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset, data_collator=PackedMLMCollator())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
    assert not torch.equal(model.esm.embeddings.word_embeddings.weight.detach(), before)
