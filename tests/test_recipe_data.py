"""nv_esm.data: reading, tokenizing, cropping, masking, packing, sharding, exact resume, fine-tuning CSVs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import pickle
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import ROOT, make_hf_model, make_nv_model
from nv_esm.alphabet import ESM_VOCAB
from nv_esm.data import (
    Batches,
    ClassificationStream,
    Holdout,
    MLMStream,
    PackedBatch,
    crop,
    mask_tokens,
    rank_streams,
    read_labelled_csv,
)
from nv_esm.records import read_sequences, tokenize

DEMO = ROOT / "recipes" / "demo_data"
CLS, PAD, EOS, MASK = 0, 1, 2, 32
STANDARD = "LAGVSERTIDPKQNFYMHWC"


def random_sequences(count: int, seed: int, low: int = 5, high: int = 60) -> list[str]:
    """Distinct random protein sequences (a serial number in the first residues keeps them unique)."""
    rng = random.Random(seed)
    sequences = []
    for index in range(count):
        tag = "".join(STANDARD[int(digit)] for digit in f"{index:04d}")
        sequences.append("M" + tag + "".join(rng.choices(STANDARD, k=rng.randint(low, high))))
    return sequences


def write_fasta(path: Path, sequences: list[str], width: int = 7) -> Path:
    lines = ["; a comment"]
    for index, sequence in enumerate(sequences):
        lines.append(f">seq{index} description")
        lines.extend(sequence[i : i + width] for i in range(0, len(sequence), width))
    path.write_text("\n".join(lines) + "\n")
    return path


def decode(ids: list[int]) -> str:
    """Residue letters of token ids, CLS/EOS dropped (independent of nv_esm.data's tables)."""
    return "".join(ESM_VOCAB[i] for i in ids if i not in (CLS, EOS))


def segments(batch: PackedBatch) -> list[list[int]]:
    bounds = batch.cu_seq_lens.tolist()
    ids = batch.input_ids[0].tolist()
    return [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def take_proteins(stream, count: int) -> list[str]:
    """The residues of the next `count` proteins of a stream with no masking and no cropping."""
    proteins = []
    while len(proteins) < count:
        proteins.extend(decode(segment) for segment in segments(next(stream)))
    return proteins[:count]


def assert_same_batches(a: list[PackedBatch], b: list[PackedBatch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids)
        assert torch.equal(x.labels, y.labels) and x.labels.dtype == y.labels.dtype
        assert torch.equal(x.cu_seq_lens, y.cu_seq_lens)
        assert x.max_length == y.max_length


# --------------------------------------------------------------------------------------------------------------
# Reading and tokenizing
# --------------------------------------------------------------------------------------------------------------


def test_read_fasta_text_and_gzip(tmp_path: Path) -> None:
    sequences = random_sequences(20, seed=1)
    fasta = write_fasta(tmp_path / "a.fasta", [s.lower() if i % 3 == 0 else s for i, s in enumerate(sequences)])
    assert list(read_sequences(fasta)) == sequences
    for name in ("b.fa.gz", "b.faa.gz"):
        with gzip.open(tmp_path / name, "wt") as file:
            file.write(fasta.read_text())
        assert list(read_sequences(tmp_path / name)) == sequences
    text = "\n".join(f"  {s}  \n" for s in sequences)  # blank lines and surrounding whitespace
    (tmp_path / "c.txt").write_text(text)
    assert list(read_sequences(tmp_path / "c.txt")) == sequences
    with gzip.open(tmp_path / "c.txt.gz", "wt") as file:
        file.write(text)
    assert list(read_sequences(tmp_path / "c.txt.gz")) == sequences


def test_read_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.fasta").write_text(">first\nMKV\n>second record\n; comment\n>third\nMK\n")
    with pytest.raises(ValueError, match="second record"):
        list(read_sequences(tmp_path / "empty.fasta"))
    (tmp_path / "headless.fasta").write_text("MKV\n>x\nMK\n")
    with pytest.raises(ValueError, match="before the first"):
        list(read_sequences(tmp_path / "headless.fasta"))
    with pytest.raises(ValueError, match=r"\.fasta.*\.parquet"):
        read_sequences(tmp_path / "data.csv")  # raised at the call, before iterating


def test_read_parquet_in_batches(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    sequences = random_sequences(50, seed=2)
    table = pa.table({"id": list(range(50)), "seq": [s.lower() for s in sequences]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    assert list(read_sequences(tmp_path / "d.parquet", column="seq")) == sequences
    with pytest.raises(ValueError, match="no column 'sequence'"):
        list(read_sequences(tmp_path / "d.parquet"))
    pq.write_table(pa.table({"sequence": ["MKV", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="row 1"):
        list(read_sequences(tmp_path / "null.parquet"))


def test_tokenize() -> None:
    assert tokenize("LAGC") == [CLS, 4, 5, 6, 23, EOS]
    assert tokenize(STANDARD) == [CLS, *range(4, 24), EOS]
    assert tokenize("XBUZO") == [CLS, *range(24, 29), EOS]
    assert tokenize("Mk") == tokenize("MK")  # either case, as the embedding API and `nv-esm embed` read it
    for sequence, message in [("MKVJL", "'J' at residue 4"), ("MK.V", "'.' at residue 3"), ("-", "'-' at residue 1"),
                              ("", "has no residues")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            tokenize(sequence)


def test_stream_rejects_bad_residue_with_location(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "bad.fasta", ["MKV", "MK*", "MKL"])
    with pytest.raises(ValueError, match=r"bad.fasta, record 2: .*'\*' at residue 3"):
        MLMStream([fasta], 0, 1, token_budget=64, max_length=16)


# --------------------------------------------------------------------------------------------------------------
# Cropping and masking
# --------------------------------------------------------------------------------------------------------------


def test_crop_is_a_random_contiguous_window() -> None:
    rng = random.Random(0)
    tokens = list(range(100))
    assert crop(tokens, 100, rng) == tokens and crop(tokens, 200, rng) == tokens
    starts = Counter()
    for _ in range(2000):
        window = crop(tokens, 90, rng)
        assert len(window) == 90 and window == list(range(window[0], window[0] + 90))
        starts[window[0]] += 1
    assert set(starts) == set(range(11))  # every window, both ends included


def test_masking_statistics() -> None:
    rng = random.Random(123)
    residues = [4 + (i % 20) for i in range(500)] + [24]  # standard amino acids and one X
    tokens = [CLS, *residues, EOS]
    candidates = selected = masked = replaced = unchanged = 0
    for _ in range(200):
        input_ids, labels = mask_tokens(tokens, rng)
        assert len(input_ids) == len(labels) == len(tokens)
        assert input_ids[0] == CLS and input_ids[-1] == EOS and labels[0] == labels[-1] == -100
        for original, new, label in zip(tokens[1:-1], input_ids[1:-1], labels[1:-1]):
            candidates += 1
            if label == -100:
                assert new == original
                continue
            assert label == original
            selected += 1
            if new == MASK:
                masked += 1
            elif new == original:
                unchanged += 1
            else:
                assert 4 <= new <= 23
                replaced += 1

    def check(count: int, total: int, p: float) -> None:
        assert abs(count - total * p) <= 4 * math.sqrt(total * p * (1 - p)), (count, total, p)

    check(selected, candidates, 0.15)
    check(masked, selected, 0.8)
    check(replaced, selected, 0.1 * 19 / 20)  # a random draw equal to the original reads as unchanged
    check(unchanged, selected, 0.1 + 0.1 / 20)


def test_masking_never_selects_special_tokens() -> None:
    input_ids, labels = mask_tokens([CLS, EOS, PAD, MASK], random.Random(0), mask_prob=1.0)
    assert input_ids == [CLS, EOS, PAD, MASK] and labels == [-100] * 4
    input_ids, labels = mask_tokens(
        [CLS, 4, 5, EOS], random.Random(0), mask_prob=1.0, mask_token_fraction=1.0, random_token_fraction=0.0
    )
    assert input_ids == [CLS, MASK, MASK, EOS] and labels == [-100, 4, 5, -100]


# --------------------------------------------------------------------------------------------------------------
# Packing, sharding, resume
# --------------------------------------------------------------------------------------------------------------


def test_packing(tmp_path: Path) -> None:
    sequences = random_sequences(60, seed=3, low=1, high=120)
    fasta = write_fasta(tmp_path / "p.fasta", sequences)
    budget, max_length = 200, 64
    stream = MLMStream([fasta], 0, 1, token_budget=budget, max_length=max_length, mask_prob=0.0)
    full = {tuple(tokenize(s)) for s in sequences}
    batches = [next(stream) for _ in range(40)]
    for batch, following in zip(batches, batches[1:]):
        assert batch.input_ids.shape == batch.labels.shape == (1, batch.num_tokens)
        assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
        assert batch.cu_seq_lens.dtype == torch.int32 and batch.cu_seq_lens[0] == 0
        assert batch.cu_seq_lens[-1] == batch.num_tokens <= budget
        lengths = batch.cu_seq_lens.diff()
        assert (lengths > 0).all() and batch.max_length == lengths.max() <= max_length
        assert batch.num_proteins == len(lengths) and batch.num_labels == 0  # mask_prob 0
        # greedy: the next batch's first protein would not have fitted
        assert batch.num_tokens + following.cu_seq_lens[1] > budget
        for segment in segments(batch):
            if len(segment) < max_length:
                assert segment[0] == CLS and segment[-1] == EOS and tuple(segment) in full
            else:  # a cropped protein is a contiguous window of its tokens
                assert any(segment == list(f[i : i + max_length]) for f in full for i in range(len(f) - max_length + 1))
    assert any(len(segment) == max_length and segment[0] != CLS for b in batches for segment in segments(b))


def test_mlm_batch_labels_and_model_inputs(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "m.fasta", random_sequences(30, seed=4))
    batch = next(MLMStream([fasta], 0, 1, token_budget=512, max_length=128, mask_prob=0.3))
    selected = batch.labels != -100
    assert batch.num_labels == int(selected.sum()) > 0
    assert ((batch.labels[selected] >= 4) & (batch.labels[selected] <= 23)).all()
    assert (batch.input_ids[~selected] != MASK).all()
    inputs = batch.to("cpu").model_inputs()
    assert set(inputs) == {"input_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    model = make_nv_model(make_hf_model("tiny"))
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, batch.num_tokens, len(ESM_VOCAB))


@pytest.mark.parametrize("num_streams", [1, 2, 3, 7])
def test_streams_partition_the_data(tmp_path: Path, num_streams: int) -> None:
    first, second = random_sequences(23, seed=5), random_sequences(18, seed=6, low=70, high=80)
    files = [write_fasta(tmp_path / "one.fasta", first), write_fasta(tmp_path / "two.fa", second)]
    everything = first + second
    seen = []
    for index in range(num_streams):
        stream = MLMStream(files, index, num_streams, token_budget=300, max_length=200, mask_prob=0.0, seed=9)
        proteins = take_proteins(stream, len(stream))
        expected = [s for i, s in enumerate(everything) if i % num_streams == index]
        assert sorted(proteins) == sorted(expected)  # this stream's share, each once
        assert stream.file_counts == [23, 18]
        seen.extend(proteins)
    assert sorted(seen) == sorted(everything)


def test_epoch_order_is_shuffled_per_epoch_or_sorted(tmp_path: Path) -> None:
    sequences = random_sequences(40, seed=7)
    fasta = write_fasta(tmp_path / "o.fasta", sequences)
    kwargs = dict(token_budget=100, max_length=100, mask_prob=0.0, seed=3)
    stream = MLMStream([fasta], 1, 2, **kwargs)
    mine = sequences[1::2]
    proteins = take_proteins(stream, 40)  # a batch may span the epoch boundary
    epoch0, epoch1 = proteins[:20], proteins[20:]
    order = list(range(1, 40, 2))
    random.Random(3 + 0).shuffle(order)
    assert epoch0 == [sequences[i] for i in order]
    assert sorted(epoch1) == sorted(mine) and epoch1 != epoch0
    assert take_proteins(MLMStream([fasta], 1, 2, shuffle=False, **kwargs), 20) == mine


def test_global_batch_independent_of_world_size_split(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "g.fasta", random_sequences(50, seed=8))
    kwargs = dict(token_budget=150, max_length=100, seed=4)
    single = rank_streams([fasta], 0, 1, 2, **kwargs)
    ranks = [rank_streams([fasta], r, 2, 1, **kwargs) for r in range(2)]
    expected = [next(single) for _ in range(12)]
    interleaved = [next(ranks[k % 2]) for k in range(12)]
    assert_same_batches(expected, interleaved)
    assert not torch.equal(expected[0].input_ids, expected[1].input_ids)


@pytest.mark.parametrize("skip", [0, 3, 17])
def test_exact_resume_across_epochs(tmp_path: Path, skip: int) -> None:
    fasta = write_fasta(tmp_path / "r.fasta", random_sequences(25, seed=10, high=90))
    kwargs = dict(token_budget=160, max_length=64, seed=11)
    batches = rank_streams([fasta], 1, 2, 2, **kwargs)
    for _ in range(skip):
        next(batches)
    state = json.loads(json.dumps(batches.state_dict()))
    assert state["micro_step"] == skip and len(state["streams"]) == 2
    continued = [next(batches) for _ in range(30)]
    assert batches.state_dict()["streams"][0]["epoch"] >= 2  # 30 micro-batches span several epochs
    fresh = rank_streams([fasta], 1, 2, 2, **kwargs)
    fresh.load_state_dict(state)
    assert_same_batches(continued, [next(fresh) for _ in range(30)])


def test_state_after_an_epoch_and_per_protein_randomness(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "e.fasta", ["M" + "L" * 60] * 4)
    kwargs = dict(token_budget=84, max_length=42, seed=5, shuffle=False)  # two cropped proteins per batch
    stream = MLMStream([fasta], 0, 1, **kwargs)
    epoch0 = [next(stream), next(stream)]
    assert stream.state_dict() == {"epoch": 1, "position": 0}
    epoch1 = [next(stream), next(stream)]
    # protein g in epoch e draws its crop window, then its mask, from Random(seed * S**2 + e * S + g)
    tokens = [CLS, 20, *[4] * 60, EOS]
    for epoch, batches in enumerate([epoch0, epoch1]):
        for g in range(4):
            rng = random.Random(5 * 1_000_003**2 + epoch * 1_000_003 + g)
            input_ids, labels = mask_tokens(crop(tokens, 42, rng), rng)
            assert batches[g // 2].input_ids[0, 42 * (g % 2) :][:42].tolist() == input_ids
            assert batches[g // 2].labels[0, 42 * (g % 2) :][:42].tolist() == labels
    resumed = MLMStream([fasta], 0, 1, **kwargs)
    resumed.load_state_dict({"epoch": 0, "position": 4})  # the end of epoch 0 is the start of epoch 1
    assert_same_batches(epoch1, [next(resumed), next(resumed)])


def test_batches_survive_pickling_and_dataloader_workers(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "w.fasta", random_sequences(30, seed=16))
    batches = rank_streams([fasta], 0, 1, 2, token_budget=128, max_length=64)
    next(batches)
    copy = pickle.loads(pickle.dumps(batches))
    loader = torch.utils.data.DataLoader(_Iterable(pickle.loads(pickle.dumps(batches))), batch_size=None, num_workers=1)
    expected = [next(batches) for _ in range(6)]
    assert_same_batches(expected, [next(copy) for _ in range(6)])
    assert_same_batches(expected, [b for _, b in zip(range(6), loader)])


class _Iterable(torch.utils.data.IterableDataset):
    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_stream_validation(tmp_path: Path) -> None:
    fasta = write_fasta(tmp_path / "v.fasta", random_sequences(2, seed=12))
    with pytest.raises(ValueError, match="token_budget"):
        MLMStream([fasta], 0, 1, token_budget=100, max_length=128)
    with pytest.raises(ValueError, match="stream_index"):
        MLMStream([fasta], 2, 2, token_budget=128)
    with pytest.raises(ValueError, match="no sequences for stream 2 of 3"):
        MLMStream([fasta], 2, 3, token_budget=1024)
    stream = MLMStream([fasta], 0, 1, token_budget=1024)
    with pytest.raises(ValueError, match="invalid stream state"):
        stream.load_state_dict({"epoch": 0, "position": 3})
    with pytest.raises(ValueError, match="streams"):
        Batches([stream]).load_state_dict({"micro_step": 0, "streams": []})


# --------------------------------------------------------------------------------------------------------------
# Fine-tuning CSVs
# --------------------------------------------------------------------------------------------------------------


def structure_label(residue: str) -> str:
    return "H" if residue in "AELM" else "E" if residue in "VIY" else "C"


def test_token_classification_stream(tmp_path: Path) -> None:
    sequences = random_sequences(30, seed=13, high=100)
    rows = [f"{s},{''.join(structure_label(r) for r in s)}" for s in sequences]
    csv = tmp_path / "ss.csv"
    csv.write_text("sequence,labels\n" + "\n".join(rows) + "\n")
    stream = ClassificationStream(csv, "token", 0, 2, token_budget=128, max_length=48)
    assert stream.label_names == ["C", "E", "H"] and stream.num_labels == 3
    cropped = 0
    for _ in range(10):
        batch = next(stream)
        assert batch.labels.shape == batch.input_ids.shape and batch.labels.dtype == torch.int64
        ids, labels = batch.input_ids[0].tolist(), batch.labels[0].tolist()
        for token, label in zip(ids, labels):
            if token in (CLS, EOS):
                assert label == -100
            else:
                assert stream.label_names[label] == structure_label(ESM_VOCAB[token])
        cropped += sum(len(s) == 48 for s in segments(batch))
        assert batch.num_labels == sum(t not in (CLS, EOS) for t in ids)
    assert cropped > 0
    other = ClassificationStream(csv, "token", 1, 2, token_budget=128, max_length=48, label_names=[*"CEHX"])
    assert other.num_labels == 4
    with pytest.raises(ValueError, match="not in label_names"):
        ClassificationStream(csv, "token", 0, 1, token_budget=1024, label_names=["C", "H"])


def test_sequence_classification_and_regression_streams(tmp_path: Path) -> None:
    sequences = random_sequences(20, seed=14)
    classes = {s: len(s) % 3 for s in sequences}
    (tmp_path / "cls.csv").write_text("sequence,label\n" + "".join(f"{s},{classes[s]}\n" for s in sequences))
    stream = ClassificationStream(tmp_path / "cls.csv", "sequence", 0, 1, token_budget=256, max_length=256)
    assert stream.num_labels == 3 and stream.label_names == ["0", "1", "2"]
    batch = next(stream)
    assert batch.labels.dtype == torch.int64 and batch.labels.shape == (batch.num_proteins,)
    assert batch.num_labels == batch.num_proteins
    assert batch.labels.tolist() == [classes[decode(s)] for s in segments(batch)]

    values = {s: len(s) / 10 for s in sequences}
    (tmp_path / "reg.csv").write_text("sequence,label\n" + "".join(f"{s},{values[s]}\n" for s in sequences))
    stream = ClassificationStream(tmp_path / "reg.csv", "sequence", 0, 1, token_budget=256, max_length=256)
    assert stream.num_labels == 1 and stream.label_names is None
    batch = next(stream)
    assert batch.labels.dtype == torch.float32
    expected = torch.tensor([values[decode(s)] for s in segments(batch)])
    assert torch.equal(batch.labels, expected)


def test_classification_stream_resume(tmp_path: Path) -> None:
    (tmp_path / "c.csv").write_text(
        "sequence,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(random_sequences(40, seed=15)))
    )
    kwargs = dict(token_budget=120, max_length=40, seed=2)
    stream = ClassificationStream(tmp_path / "c.csv", "sequence", 1, 3, **kwargs)
    for _ in range(5):
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))
    continued = [next(stream) for _ in range(15)]
    fresh = ClassificationStream(tmp_path / "c.csv", "sequence", 1, 3, **kwargs)
    fresh.load_state_dict(state)
    assert_same_batches(continued, [next(fresh) for _ in range(15)])


def test_labelled_csv_errors(tmp_path: Path) -> None:
    def write(text: str) -> Path:
        (tmp_path / "x.csv").write_text(text)
        return tmp_path / "x.csv"

    with pytest.raises(ValueError, match="missing"):
        read_labelled_csv(write("MKV,1\nMKL,0\n"), "sequence")  # no header
    with pytest.raises(ValueError, match="missing"):
        read_labelled_csv(write("sequence,label\nMKV,1\n"), "token")
    with pytest.raises(ValueError, match=r"row 2 .*3 labels for 4 residues"):
        read_labelled_csv(write("sequence,labels\nMKV,CCH\nMKVL,CCH\n"), "token")
    with pytest.raises(ValueError, match=r"row 2 \(line 3\): label 'soluble'"):
        read_labelled_csv(write("sequence,label\nMKV,1.5\nMKL,soluble\n"), "sequence")
    with pytest.raises(ValueError, match=r"row 1 .*'J' at residue 3"):
        read_labelled_csv(write("sequence,label\nMKJ,1\n"), "sequence")
    with pytest.raises(ValueError, match="task"):
        read_labelled_csv(write("sequence,label\nMKV,1\n"), "contact")
    sequences, labels, alphabet = read_labelled_csv(write("id,sequence,label\na,mkv,1\nb,MKL,2.5\n"), "sequence")
    assert sequences == ["MKV", "MKL"] and labels == [1.0, 2.5] and alphabet is None


# --------------------------------------------------------------------------------------------------------------
# Demo data
# --------------------------------------------------------------------------------------------------------------


def test_demo_data_parses() -> None:
    sequences = list(read_sequences(DEMO / "demo.fasta"))
    assert len(sequences) == 600 and all(s[0] == "M" and len(tokenize(s)) >= 22 for s in sequences)
    assert sum(len(s) + 2 > 1024 for s in sequences) >= 2
    assert 200 < sorted(map(len, sequences))[300] < 350
    _, labels, alphabet = read_labelled_csv(DEMO / "secondary_structure.csv", "token")
    assert len(labels) == 200 and alphabet == ["C", "E", "H"]
    _, labels, _ = read_labelled_csv(DEMO / "solubility.csv", "sequence")
    assert len(labels) == 200 and set(labels) == {0, 1}
    assert sum(f.stat().st_size for f in DEMO.iterdir()) < 400_000


def test_demo_data_generator_is_deterministic(tmp_path: Path) -> None:
    # recipes/make_demo_data.py is a script, not part of the installed package: load it from its file.
    spec = importlib.util.spec_from_file_location("make_demo_data", ROOT / "recipes" / "make_demo_data.py")
    make_demo_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_demo_data)
    make_demo_data.main(tmp_path)
    for name in ("demo.fasta", "secondary_structure.csv", "solubility.csv"):
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), name


def test_sequence_task_crops_keep_cls_and_eos(tmp_path) -> None:
    """The sequence head reads each protein's first token: long proteins keep <cls> first and <eos> last."""
    path = tmp_path / "long.csv"
    rows = ["sequence,label"] + [f"{'ACDEFGHIKLMNPQRSTVWY' * (3 + k)},{k % 2}" for k in range(6)]
    path.write_text("\n".join(rows) + "\n")
    stream = ClassificationStream(path, "sequence", 0, 1, token_budget=64, max_length=32, seed=1)
    for _ in range(6):
        batch = next(stream)
        starts, ends = batch.cu_seq_lens[:-1].long(), batch.cu_seq_lens[1:].long() - 1
        assert batch.input_ids[0, starts].eq(0).all() and batch.input_ids[0, ends].eq(2).all()
        assert int(batch.cu_seq_lens.diff().max()) == 32


def stream_proteins(stream) -> list[str]:
    """The residues of every protein a stream holds (in local order)."""
    return [decode(stream._tokens(index)) for index in range(len(stream))]


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_a_holdout_splits_the_records_alike_for_every_world_size(tmp_path: Path, fraction: float) -> None:
    """--val-fraction: the records set aside are the same for 1, 2 or 3 streams and either side; the training side
    holds the others, each once; about `fraction` of them are set aside."""
    sequences = random_sequences(400, seed=11)
    files = [write_fasta(tmp_path / "a.fasta", sequences[:250]), write_fasta(tmp_path / "b.fasta", sequences[250:])]
    sides = {}
    for part in ("train", "validation"):
        seen = []
        for num_streams in (1, 2, 3):
            streams = [
                MLMStream(files, index, num_streams, 1024, holdout=Holdout(fraction, part), shuffle=False)
                for index in range(num_streams)
            ]
            proteins = sorted(p for stream in streams for p in stream_proteins(stream))
            assert len(proteins) == len(set(proteins))
            seen.append(proteins)
        assert seen[0] == seen[1] == seen[2]
        sides[part] = set(seen[0])
    assert not sides["train"] & sides["validation"] and sides["train"] | sides["validation"] == set(sequences)
    assert abs(len(sides["validation"]) - fraction * 400) < 4 * math.sqrt(400 * fraction * (1 - fraction))
    rows = [f"{sequence},{index % 2}" for index, sequence in enumerate(sequences[:120])]
    (tmp_path / "labels.csv").write_text("sequence,label\n" + "\n".join(rows) + "\n")
    csv_sides = [
        {p for i in range(2) for p in stream_proteins(ClassificationStream(
            tmp_path / "labels.csv", "sequence", i, 2, 1024, holdout=Holdout(fraction, part)))}
        for part in ("train", "validation")
    ]  # fmt: skip
    assert not csv_sides[0] & csv_sides[1] and csv_sides[0] | csv_sides[1] == set(sequences[:120])
    assert csv_sides[1] == {p for p in sides["validation"] if p in set(sequences[:120])}  # row i is record i
    with pytest.raises(ValueError, match="between 0 and 1"):
        Holdout(1.0, "train")


def test_one_pass_reads_each_protein_once_the_same_way_every_time(tmp_path: Path) -> None:
    """`one_pass`: every protein of the stream once, in file order, the same crops and masks at every call (also
    after the stream was read as an infinite stream), the last batch short rather than running into epoch 1."""
    sequences = random_sequences(90, seed=12, high=200)
    path = write_fasta(tmp_path / "v.fasta", sequences)
    stream = MLMStream(path, 1, 2, token_budget=512, max_length=64, seed=0, shuffle=False)
    first = list(stream.one_pass())
    for _ in range(7):
        next(stream)
    again = list(stream.one_pass())
    assert len(first) == len(again) and all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) for a, b in zip(first, again)
    )
    assert sum(batch.num_proteins for batch in first) == len(stream) == 45
    assert len(first) == stream.one_pass_length() > 1
    assert all(batch.num_tokens <= 512 for batch in first)
    unmasked = [torch.where(b.labels == -100, b.input_ids, b.labels)[0] for b in first]
    proteins = [decode(ids[start:end].tolist()) for ids, b in zip(unmasked, first) for start, end in
                zip(b.cu_seq_lens[:-1].tolist(), b.cu_seq_lens[1:].tolist())]  # fmt: skip
    assert all(seq.find(p) >= 0 for p, seq in zip(proteins, sequences[1::2]))  # crops of stream 1's proteins, in order
