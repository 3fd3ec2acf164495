"""Protein data for the training recipe: read, tokenize, crop, mask and pack proteins into THD micro-batches.

A stream is one data-parallel shard: the sequences whose global index i (counting across the files in order)
satisfies `i % num_streams == stream_index`. Each epoch visits them in a seeded shuffled order and packs them
greedily into micro-batches of at most `token_budget` tokens; a batch may continue into the next epoch (no short
batch at epoch ends). All randomness of a protein (crop window, masking)
comes from `random.Random(seed * S**2 + epoch * S + global_index)`, S = 1_000_003 (no salted `hash()`), and an
epoch's order from `random.Random(seed + epoch)`, so a stream's `{"epoch", "position"}` resumes it exactly.
`Batches` round-robins a rank's streams: with world size W and gradient accumulation A, rank r owns streams
`r * A .. r * A + A - 1` of `W * A`, so a step's global batch is the same proteins for any W, A with equal W * A.

A validation split (`Holdout`) sets aside a fraction of the records (picked by a hash of their global index, the
same for every seed and world size); the training streams then shard the records left, the validation streams the
ones set aside, and `one_pass` reads a stream once with epoch 0's randomness (the same masks at every call).

Memory: a stream keeps its own sequences in memory as token ids, one byte per residue in one buffer plus one
8-byte offset per protein (about total residues / (W * A) bytes per stream, so a rank holds ~1/W of the data set).
The single buffer is shared copy-on-write by forked DataLoader workers.
"""

from __future__ import annotations

import csv
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from nv_esm.alphabet import CLS, EOS, MASK, RESIDUE_TO_ID, STANDARD_IDS, text_lines
from nv_esm.records import BadRecords, RecordRules, plural, read_records, residue_ids, row_message

_RESIDUE_ID_SET = frozenset(RESIDUE_TO_ID.values())
IGNORE_INDEX = -100
_RNG_STRIDE = 1_000_003
# --------------------------------------------------------------------------------------------------------------
# Cropping and masking
# --------------------------------------------------------------------------------------------------------------


def crop(tokens: list[int], max_length: int, generator: random.Random) -> list[int]:
    """`tokens` if at most `max_length` long, else a uniformly random contiguous window of `max_length` tokens."""
    start = _crop_start(len(tokens), max_length, generator)
    return tokens[start : start + max_length]


def _crop_start(length: int, max_length: int, generator: random.Random) -> int:
    return 0 if length <= max_length else generator.randrange(length - max_length + 1)


def mask_tokens(
    tokens: list[int],
    generator: random.Random,
    mask_prob: float = 0.15,
    mask_token_fraction: float = 0.8,
    random_token_fraction: float = 0.1,
) -> tuple[list[int], list[int]]:
    """BERT/ESM masking: `(input_ids, labels)`, labels the original id at selected residues and -100 elsewhere.

    Each residue (not CLS/EOS/PAD/MASK) is selected with probability `mask_prob`; a selected one becomes MASK with
    probability `mask_token_fraction`, a uniformly random standard amino acid with `random_token_fraction`, and
    stays unchanged otherwise.
    """
    if mask_token_fraction + random_token_fraction > 1:
        raise ValueError("mask_token_fraction + random_token_fraction must be at most 1.")
    input_ids, labels = list(tokens), [IGNORE_INDEX] * len(tokens)
    for position, token in enumerate(tokens):
        if token not in _RESIDUE_ID_SET or generator.random() >= mask_prob:
            continue
        labels[position] = token
        action = generator.random()
        if action < mask_token_fraction:
            input_ids[position] = MASK
        elif action < mask_token_fraction + random_token_fraction:
            input_ids[position] = generator.choice(STANDARD_IDS)
    return input_ids, labels


@dataclass(frozen=True)
class Holdout:
    """A validation split of a data set: the records whose global index `held_out` picks (about `fraction` of
    them). `part` says which side a stream reads: "train" (the others) or "validation" (those)."""

    fraction: float
    part: str

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1:
            raise ValueError(f"the validation fraction must be between 0 and 1, got {self.fraction}.")
        if self.part not in ("train", "validation"):
            raise ValueError(f"part must be 'train' or 'validation', got {self.part!r}.")

    def keeps(self, index: int) -> bool:
        """Whether the record with global index `index` belongs to `part`."""
        return held_out(index, self.fraction) == (self.part == "validation")


def held_out(index: int, fraction: float) -> bool:
    """Whether record `index` is in a validation split of `fraction`: a 64-bit mix of the index (splitmix64's
    finalizer), read as a number in [0, 1), below `fraction`."""
    mask = (1 << 64) - 1
    z = (index + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) / 2**64 < fraction


# --------------------------------------------------------------------------------------------------------------
# Packed batches
# --------------------------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    """N proteins concatenated (THD): `input_ids [1, T]`, `labels [1, T]` (token labels, -100 = none) or `[N]`
    (one per protein), `cu_seq_lens [N + 1]` int32 and the longest protein's token count `max_length`."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on `device` (see `to_device`)."""
        tensors = (self.input_ids, self.labels, self.cu_seq_lens)
        return PackedBatch(*(to_device(t, torch.device(device)) for t in tensors), self.max_length)

    def model_inputs(self) -> dict:
        """Keyword arguments of the NVEsm models' packed forward (labels excluded)."""
        return {
            "input_ids": self.input_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_proteins(self) -> int:
        return self.cu_seq_lens.numel() - 1

    @property
    def num_labels(self) -> int:
        """Loss terms: token labels other than -100, or N for per-protein labels."""
        if self.labels.dim() == 1:
            return self.labels.numel()
        return int((self.labels != IGNORE_INDEX).sum())


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; to a GPU through pinned memory without waiting for the GPU (a plain copy from pageable
    memory would first let the GPU run empty)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pad_proteins(
    proteins: Sequence[torch.Tensor | Sequence[int]], pad_token_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Padded (BSHD) model inputs for N proteins' token ids: `input_ids [N, S]` int64 with `pad_token_id` at
    padding and `attention_mask [N, S]` int64 (1 = token), S the longest protein, padding on `padding_side`."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    if not proteins:
        raise ValueError("pad_proteins needs at least one protein.")
    ids = [torch.as_tensor(protein, dtype=torch.int64).reshape(-1) for protein in proteins]
    empty = [index for index, protein in enumerate(ids) if len(protein) == 0]
    if empty:
        raise ValueError(f"protein {empty[0]} has no tokens.")
    width = max(len(protein) for protein in ids)
    input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.int64)
    for row, protein in enumerate(ids):
        columns = slice(width - len(protein), width) if padding_side == "left" else slice(0, len(protein))
        input_ids[row, columns] = protein
        attention_mask[row, columns] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def pack_batch(tokens: list[list[int]], labels: list[list[int]] | torch.Tensor) -> PackedBatch:
    """Pack proteins `tokens` (N lists of token ids) with per-token `labels` (N lists, each as long as its
    protein: `[1, T]` int64) or per-protein labels (a tensor `[N]`, kept as it is), by `pack_proteins`."""
    from modeling_nv_esm import pack_proteins  # the model's packing helper (imports transformers: on first batch)

    if isinstance(labels, torch.Tensor):
        packed = pack_proteins(tokens)
        packed_labels = labels
    else:
        packed = pack_proteins(tokens, labels)
        packed_labels = packed["labels"]
    return PackedBatch(packed["input_ids"], packed_labels, packed["cu_seq_lens_q"], packed["max_length_q"])


# --------------------------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------------------------


class _PackedStream:
    """Sharding, epoch order, greedy packing and resume state shared by `MLMStream` and `ClassificationStream`.

    Subclasses load their sequences with `_add` and make one protein's `(tokens, labels)` in `_example`.
    """

    def __init__(
        self,
        stream_index: int,
        num_streams: int,
        token_budget: int,
        max_length: int,
        seed: int,
        shuffle: bool,
        allow_empty: bool = False,
    ) -> None:
        if not 0 <= stream_index < num_streams:
            raise ValueError(f"stream_index {stream_index} is outside [0, num_streams={num_streams}).")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}.")
        if token_budget < max_length:
            raise ValueError(
                f"token_budget ({token_budget}) must be at least max_length ({max_length}): a cropped protein must fit."
            )
        self.stream_index, self.num_streams = stream_index, num_streams
        self.token_budget, self.max_length, self.seed, self.shuffle = token_budget, max_length, seed, shuffle
        self.allow_empty = allow_empty  # a validation stream may hold nothing (more ranks than records)
        self._parts: list[bytes] | None = []
        self._residues = b""
        self._offsets = array("q", [0])
        self._epoch = self._position = 0
        self._order_epoch, self._order = -1, []
        self.skipped: list[str] = []  # the records `RecordRules` left out (of the whole data set: all are read)

    # Loading ----------------------------------------------------------------------------------------------------

    def _add(self, ids: bytes) -> None:
        """Keep one of this stream's sequences, as its residue ids (`RecordRules.residue_ids`)."""
        self._parts.append(ids)
        self._offsets.append(self._offsets[-1] + len(ids))

    @property
    def tokens_per_pass(self) -> int:
        """Tokens of one pass over the stream's proteins, cropped to `max_length`."""
        return sum(map(self._length, range(len(self))))

    def _finish_loading(self, source: str) -> None:
        if not self._parts and not self.allow_empty:
            raise ValueError(
                f"{source} has no sequences for stream {self.stream_index} of {self.num_streams} "
                "(fewer sequences than streams?)."
            )
        self._residues, self._parts = b"".join(self._parts), None

    def __len__(self) -> int:
        """Proteins per epoch in this stream."""
        return len(self._offsets) - 1

    def global_index(self, local_index: int) -> int:
        return self.stream_index + local_index * self.num_streams

    def _tokens(self, local_index: int) -> list[int]:
        return [CLS, *self._residues[self._offsets[local_index] : self._offsets[local_index + 1]], EOS]

    def _generator(self, local_index: int) -> random.Random:
        """The randomness of one protein in the current epoch (string-hash free, so identical in every process)."""
        key = (self.seed * _RNG_STRIDE + self._epoch) * _RNG_STRIDE + self.global_index(local_index)
        return random.Random(key)

    def _example(self, local_index: int) -> tuple[list[int], list[int] | float | int]:
        raise NotImplementedError

    def _collate(self, tokens: list[list[int]], labels: list) -> PackedBatch:
        return pack_batch(tokens, labels)

    # Iteration --------------------------------------------------------------------------------------------------

    def _epoch_order(self) -> list[int]:
        """This epoch's visiting order of local indices: `random.Random(seed + epoch).shuffle`, or sorted."""
        if self._order_epoch != self._epoch:
            self._order = self._order_of(self._epoch)
            self._order_epoch = self._epoch
        return self._order

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _length(self, local_index: int) -> int:
        """Tokens of a protein in a batch: its residues, <cls> and <eos>, at most `max_length`."""
        return min(self._offsets[local_index + 1] - self._offsets[local_index] + 2, self.max_length)

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        return self._pack(within_epoch=False)

    def one_pass(self) -> Iterator[PackedBatch]:
        """Every protein of the stream once, as epoch 0 packs them (its order and randomness: the same batches at
        every call); the last batch may be short. Leaves the stream at the start of epoch 1 (at 0 if empty)."""
        self._epoch = self._position = 0
        while len(self) and self._epoch == 0:
            yield self._pack(within_epoch=True)

    def one_pass_length(self) -> int:
        """How many batches `one_pass` yields (from the proteins' lengths alone: nothing is masked or packed)."""
        batches, used = 0, 0
        for local_index in self._order_of(0):
            length = self._length(local_index)
            if not batches or used + length > self.token_budget:
                batches, used = batches + 1, 0
            used += length
        return batches

    def _pack(self, within_epoch: bool) -> PackedBatch:
        """The next micro-batch; it ends at the epoch's end if `within_epoch`, else it may go on into the next."""
        tokens, labels, used = [], [], 0
        while True:
            local_index = self._epoch_order()[self._position]
            length = self._length(local_index)
            if tokens and used + length > self.token_budget:
                return self._collate(tokens, labels)
            protein, label = self._example(local_index)
            tokens.append(protein)
            labels.append(label)
            used += length
            self._position += 1
            if self._position == len(self):
                self._epoch, self._position = self._epoch + 1, 0
                if within_epoch:
                    return self._collate(tokens, labels)

    def state_dict(self) -> dict:
        """`{"epoch", "position"}`: the first protein not yet in an emitted batch (index into the epoch's order)."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(f"invalid stream state {state} for a stream of {plural(len(self), 'protein')}.")
        self._epoch, self._position = (epoch + 1, 0) if position == len(self) else (epoch, position)


class MLMStream(_PackedStream):
    """One data-parallel stream of masked-language-model batches from FASTA/.txt/.parquet `files` (with `holdout`,
    of one side of a validation split).

    Proteins are tokenized, cropped to a random window of `max_length` tokens, masked (`mask_tokens` with
    `mask_prob`) and packed into micro-batches of at most `token_budget` tokens; labels are `[1, T]`. Infinite.
    Records are read by `rules` (`RecordRules`): one left out has no global index; with `invalid="error"` a file's
    bad records stop the reading at its end, every one named in one error (`BadRecords`).
    """

    def __init__(
        self,
        files: Sequence[str | Path],
        stream_index: int,
        num_streams: int,
        token_budget: int,
        max_length: int = 1024,
        mask_prob: float = 0.15,
        seed: int = 0,
        shuffle: bool = True,
        holdout: Holdout | None = None,
        allow_empty: bool = False,
        rules: RecordRules = RecordRules(),
    ) -> None:
        super().__init__(stream_index, num_streams, token_budget, max_length, seed, shuffle, allow_empty)
        if isinstance(files, (str, Path)):
            files = [files]
        self.files, self.mask_prob = [Path(f) for f in files], mask_prob
        self.file_counts: list[int] = []  # sequences per file (all streams, both sides of a holdout; none skipped)
        global_index = kept = 0
        for path in self.files:
            count = 0
            bad = BadRecords(path)  # with --invalid error, the file's bad records, named in one error after it
            for number, (sequence, line) in enumerate(read_records(path, empty_ok=True), 1):
                # every stream checks every record, so that every rank meets a bad one alike
                ids = rules.residue_ids(sequence, path, f"record {number}", self.skipped, bad, line)
                if ids is None:  # left out (or bad): not a record of the data set (no index, no stream)
                    continue
                if holdout is None or holdout.keeps(global_index):
                    if kept % num_streams == stream_index:
                        self._add(ids)
                    kept += 1
                global_index += 1
                count += 1
            bad.raise_if_any([rules.SKIP_HINT])
            self.file_counts.append(count)
        self._finish_loading(", ".join(map(str, self.files)))

    def _example(self, local_index: int) -> tuple[list[int], list[int]]:
        generator = self._generator(local_index)
        tokens = crop(self._tokens(local_index), self.max_length, generator)
        return mask_tokens(tokens, generator, self.mask_prob)


# --------------------------------------------------------------------------------------------------------------
# Fine-tuning data
# --------------------------------------------------------------------------------------------------------------


def read_labelled_csv(
    path: str | Path, task: str, rules: RecordRules = RecordRules(), skipped: list[str] | None = None
) -> tuple[list[str], list, list[str] | None]:
    """`(sequences, labels, label alphabet)` of a UTF-8 CSV with a header; the sequences upper-case residue letters.

    task "sequence": columns `sequence,label`, numeric labels (all integers: class ids; any float: regression);
    alphabet None. task "token": columns `sequence,labels`, one label character per residue; labels are lists of
    characters and the alphabet is their sorted set. Each sequence is read by `rules` (`RecordRules`); the problems
    of the rows it leaves out are appended to `skipped`. Every bad row (a bad sequence that `rules` does not skip, an
    empty label, a label that is not a number, as many token labels as residues) is named in one ValueError, with
    its row and line (`BadRecords`).
    """
    if task not in ("sequence", "token"):
        raise ValueError(f"task must be 'sequence' or 'token', got {task!r}.")
    label_column = "label" if task == "sequence" else "labels"
    sequences, raw_labels = [], []
    skipped = [] if skipped is None else skipped
    bad, bad_sequences = BadRecords(path), 0
    with open(path, "rb") as file:
        reader = csv.DictReader(text_lines(file, Path(path)))
        missing = {"sequence", label_column} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: the header needs columns sequence,{label_column}; missing {sorted(missing)}.")
        for row_number, row in enumerate(reader, 1):
            where = f"{path}, row {row_number} (line {reader.line_num})"
            sequence = "".join((row["sequence"] or "").split())
            label = "".join((row[label_column] or "").split())
            problems: list[str] = []  # this row's, on one line
            ids = rules.residue_ids(sequence, path, f"row {row_number} (line {reader.line_num})", skipped, problems)
            bad_sequences += bool(problems)
            if ids is None and not problems:  # left out by `rules`
                continue
            if not label:
                problems.append(f"{where}: empty {label_column}.")
            elif task == "sequence" and not _is_number(label):
                problems.append(f"{where}: label {label!r} is not a number.")
            elif task == "token" and ids is not None and len(label) != len(ids):
                problems.append(f"{where}: {plural(len(label), 'label')} for {plural(len(ids), 'residue')}.")
            if problems:
                bad.append(row_message(where, problems))
                continue
            sequences.append(sequence[: len(ids)].upper())  # one id per residue: a stripped stop mark was the last
            raw_labels.append(label)
    if bad_sequences == len(bad):
        hints = [rules.SKIP_HINT]
    elif bad_sequences:
        hints = ["--invalid skip leaves out rows with a bad sequence, not rows with a bad label"]
    else:
        hints = []
    bad.raise_if_any(hints)
    if not sequences:
        raise ValueError(f"{path}: no rows.")
    if task == "token":
        return sequences, [list(label) for label in raw_labels], sorted(set("".join(raw_labels)))
    try:
        return sequences, [int(label) for label in raw_labels], None
    except ValueError:
        return sequences, [float(label) for label in raw_labels], None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class ClassificationStream(_PackedStream):
    """One data-parallel stream of a labelled CSV (`read_labelled_csv`), packed like `MLMStream`, no masking.

    task "token": labels `[1, T]` int64, label ids at residues and -100 at CLS/EOS. task "sequence": labels `[N]`,
    int64 class ids or float32 regression targets. Proteins longer than `max_length` get a random window (for the
    sequence task a window of residues between their own <cls> and <eos>, which the classification head reads).
    `num_labels` is the number of classes (1 for regression); `label_names` the token alphabet or the class ids
    as strings (None for regression). Pass the training set's `label_names` when reading a validation set;
    `holdout` reads one side of a validation split of the CSV's rows (those `rules` keeps).
    """

    def __init__(
        self,
        csv_path: str | Path,
        task: str,
        stream_index: int,
        num_streams: int,
        token_budget: int,
        max_length: int = 1024,
        seed: int = 0,
        shuffle: bool = True,
        label_names: list[str] | None = None,
        holdout: Holdout | None = None,
        allow_empty: bool = False,
        rules: RecordRules = RecordRules(),
    ) -> None:
        super().__init__(stream_index, num_streams, token_budget, max_length, seed, shuffle, allow_empty)
        sequences, labels, alphabet = read_labelled_csv(csv_path, task, rules, self.skipped)
        self.task, self.regression = task, task == "sequence" and isinstance(labels[0], float)
        if self.regression:
            if label_names is not None:
                raise ValueError(f"{csv_path}: label_names given, but the labels are regression targets.")
            self.num_labels, self.label_names = 1, None
        elif task == "sequence":
            if min(labels) < 0:
                raise ValueError(f"{csv_path}: class ids must be non-negative, got {min(labels)}.")
            self.label_names = label_names if label_names is not None else [str(k) for k in range(max(labels) + 1)]
            self.num_labels = len(self.label_names)
            if max(labels) >= self.num_labels:
                raise ValueError(f"{csv_path}: class id {max(labels)} but only {self.num_labels} label names.")
        else:
            self.label_names = label_names if label_names is not None else alphabet
            self.num_labels = len(self.label_names)
            unknown = set(alphabet) - set(self.label_names)
            if unknown:
                raise ValueError(f"{csv_path}: labels {sorted(unknown)} are not in label_names {self.label_names}.")
        label_ids = {name: index for index, name in enumerate(self.label_names or ())}
        self._labels: list = []
        rows = [row for row in range(len(sequences)) if holdout is None or holdout.keeps(row)]
        for row in rows[stream_index::num_streams]:
            self._add(residue_ids(sequences[row]))  # `read_labelled_csv` checked them
            self._labels.append(bytes(label_ids[c] for c in labels[row]) if task == "token" else labels[row])
        self._finish_loading(str(csv_path))

    def _example(self, local_index: int) -> tuple[list[int], list[int] | float | int]:
        tokens = self._tokens(local_index)
        if self.task == "sequence":  # the head reads <cls>: crop the residues, keep <cls> and <eos>
            residues = tokens[1:-1]
            window = self.max_length - 2
            start = _crop_start(len(residues), window, self._generator(local_index))
            return [tokens[0], *residues[start : start + window], tokens[-1]], self._labels[local_index]
        start = _crop_start(len(tokens), self.max_length, self._generator(local_index))
        tokens = tokens[start : start + self.max_length]
        labels = [IGNORE_INDEX, *self._labels[local_index], IGNORE_INDEX]
        return tokens, labels[start : start + self.max_length]

    def _collate(self, tokens: list[list[int]], labels: list) -> PackedBatch:
        if self.task == "token":
            return pack_batch(tokens, labels)
        return pack_batch(tokens, torch.tensor(labels, dtype=torch.float32 if self.regression else torch.int64))


# --------------------------------------------------------------------------------------------------------------
# A rank's micro-batches
# --------------------------------------------------------------------------------------------------------------


class Batches:
    """A rank's micro-batches: round-robin over its `streams` (micro-batch k comes from `streams[k % len]`).

    With gradient accumulation A and world size W, rank r owns streams `r * A .. r * A + A - 1` of `W * A`, so the
    global batch of a step is the same set of proteins for any (W, A) with equal W * A.
    """

    def __init__(self, streams: list[_PackedStream]) -> None:
        if not streams:
            raise ValueError("Batches needs at least one stream.")
        self.streams, self.micro_step = streams, 0

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        batch = next(self.streams[self.micro_step % len(self.streams)])
        self.micro_step += 1
        return batch

    def state_dict(self) -> dict:
        return {"micro_step": self.micro_step, "streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["streams"]) != len(self.streams):
            raise ValueError(f"state has {len(state['streams'])} streams, this rank has {len(self.streams)}.")
        self.micro_step = int(state["micro_step"])
        for stream, stream_state in zip(self.streams, state["streams"]):
            stream.load_state_dict(stream_state)


def rank_stream_indices(rank: int, world_size: int, grad_accum: int) -> tuple[range, int]:
    """The streams of rank `rank`, `rank * grad_accum + j` for j < grad_accum, and the number of streams."""
    return range(rank * grad_accum, (rank + 1) * grad_accum), world_size * grad_accum


def rank_streams(files: Sequence[str | Path], rank: int, world_size: int, grad_accum: int, **stream_kwargs) -> Batches:
    """Rank `rank`'s `Batches` of MLM streams (`rank_stream_indices`)."""
    indices, num_streams = rank_stream_indices(rank, world_size, grad_accum)
    return Batches([MLMStream(files, index, num_streams, **stream_kwargs) for index in indices])
