"""Protein records as every command reads them: sequence files (FASTA, text, parquet; gzipped or not), ESM-2's
token ids of a record's residues (one byte table), and what a reader does with a bad record (`RecordRules`:
`--invalid` and `--strip-stop`, shared by `nv-esm embed`, `score` and `train`). The letters' rule itself is
`modeling_nv_esm.protein_residues`.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from modeling_nv_esm import protein_residues
from modeling_nv_esm_batch import RESIDUE_LETTERS, STOP_MARK
from nv_esm.alphabet import CLS, EOS, RESIDUE_TO_ID, iter_fasta, text_lines
from nv_esm.vocabulary import INVALID_POLICIES as INVALID_POLICIES
from nv_esm.vocabulary import STRIP_STOP_HELP as STRIP_STOP_HELP

FASTA_SUFFIXES = (".fasta", ".fa", ".faa")
SEQUENCE_SUFFIXES = (*FASTA_SUFFIXES, ".txt", *(s + ".gz" for s in (*FASTA_SUFFIXES, ".txt")), ".parquet")
# `residue_ids`' bytes.translate table: a residue letter's token id (either case), any other byte `_NOT_A_RESIDUE`
# (the rule, and the message naming what is wrong, is modeling_nv_esm.protein_residues).
_NOT_A_RESIDUE = 255
_ID_OF_BYTE = bytes(
    RESIDUE_TO_ID[chr(byte).upper()] if byte < 128 and chr(byte).upper() in RESIDUE_LETTERS else _NOT_A_RESIDUE
    for byte in range(256)
)
# What `nv-esm embed`, `score` and `train` do with a record outside ESM-2's alphabet, or without residues (`--invalid`).


# --------------------------------------------------------------------------------------------------------------
# Reading and tokenizing
# --------------------------------------------------------------------------------------------------------------


def read_sequences(path: str | Path, column: str = "sequence", empty_ok: bool = False) -> Iterator[str]:
    """Stream the sequences of a FASTA (.fasta/.fa/.faa), text (.txt, one per line) or parquet file, uppercased.

    FASTA and text files may be gzipped (`.gz`) and must be UTF-8. FASTA records may span lines; `;` lines are
    comments. Parquet is read batch by batch from `column`. An empty FASTA record or parquet value (null included)
    raises `ValueError`, or is read as "" with `empty_ok`; so does a file that is not what its name says, naming it.
    """
    path = Path(path)
    name = path.name.lower()
    suffix = next((s for s in sorted(SEQUENCE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"{path}: unknown sequence file type; expected one of {', '.join(SEQUENCE_SUFFIXES)}.")
    if suffix == ".parquet":
        return _read_parquet(path, column, empty_ok)
    return _read_text_file(path, suffix, empty_ok)


def _read_text_file(path: Path, suffix: str, empty_ok: bool) -> Iterator[str]:
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(path, "rb") as raw:
        lines = text_lines(raw, path)
        try:
            if suffix.removesuffix(".gz") in FASTA_SUFFIXES:
                yield from _read_fasta(lines, path, empty_ok)
            else:
                yield from _read_text(lines)
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise ValueError(f"{path}: not a whole gzip file ({error}).") from None


def _read_text(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        sequence = "".join(line.split()).upper()
        if sequence:
            yield sequence


def _read_fasta(lines: Iterator[str], path: Path, empty_ok: bool) -> Iterator[str]:
    for _, sequence in iter_fasta(lines, path, empty_ok):
        yield sequence.upper()


def _read_parquet(path: Path, column: str, empty_ok: bool) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        if column not in file.schema_arrow.names:
            raise ValueError(f"{path}: no column {column!r}; columns: {', '.join(file.schema_arrow.names)}.")
        row = 0
        for batch in file.iter_batches(columns=[column], batch_size=8192):
            for value in batch.column(0).to_pylist():
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"{path}: row {row} of column {column!r} is a {type(value).__name__}, not text.")
                if not empty_ok and (not value or not value.strip()):
                    raise ValueError(f"{path}: row {row} of column {column!r} is empty or null.")
                yield "".join((value or "").split()).upper()
                row += 1
    except pa.ArrowException as error:
        raise ValueError(f"{path}: not a readable parquet file ({error}).") from None


def tokenize(sequence: str) -> list[int]:
    """`[CLS] + one id per residue + [EOS]` of an upper-case protein; anything but ESM-2's residue letters raises
    `ValueError` (`modeling_nv_esm.protein_residues`, the rule of `embed` and `nv-esm embed` too)."""
    return [CLS, *(RESIDUE_TO_ID[letter] for letter in protein_residues(sequence, "the sequence")), EOS]


def residue_ids(sequence: str) -> bytes:
    """The token ids of `sequence`'s residues (either case; no `<cls>`/`<eos>`) as bytes, by one byte table: a
    million residues in milliseconds (`nv-esm embed`'s GPU waits while a shard is tokenized). A character outside
    ESM-2's residue letters raises `protein_residues`' ValueError; an empty sequence gives no ids."""
    ids = sequence.encode("latin-1", errors="replace").translate(_ID_OF_BYTE)  # one byte per character
    if _NOT_A_RESIDUE in ids:
        protein_residues(sequence, "the sequence")  # raises, naming the character and its 1-based position
    return ids


@dataclass(frozen=True)
class RecordRules:
    """What a reader does with its records (`nv-esm train`'s `--invalid` and `--strip-stop`, as `nv-esm embed` and
    `nv-esm score` do): `strip_stop` removes one trailing '*'; a record that then has a character outside ESM-2's
    alphabet, or no residues, stops the run (`invalid="error"`) or is left out (`"skip"`). The letters' rule is
    `modeling_nv_esm.protein_residues`, the one of every reader of proteins."""

    invalid: str = "error"
    strip_stop: bool = False

    def __post_init__(self) -> None:
        if self.invalid not in INVALID_POLICIES:
            raise ValueError(f"invalid must be one of {INVALID_POLICIES}, got {self.invalid!r}.")

    def residue_ids(self, sequence: str, source: str | Path, record: str, skipped: list[str]) -> bytes | None:
        """`residue_ids` of a record (`record` of `source`, named in errors), or None for one `invalid="skip"` leaves
        out: its problem is appended to `skipped`."""
        if self.strip_stop and sequence.endswith(STOP_MARK):
            sequence = sequence[: -len(STOP_MARK)]
        try:
            return _check_record(sequence, source, record)
        except ValueError as error:
            if self.invalid == "error":
                raise ValueError(f"{str(error).removesuffix('.')} (--invalid skip leaves it out).") from None
            skipped.append(str(error))
            return None


def _check_record(sequence: str, source: str | Path, record: str) -> bytes:
    """`residue_ids` of a record that must hold residues; its errors name `source` and `record`."""
    try:
        ids = residue_ids(sequence)
        if not ids:
            protein_residues(sequence, "the sequence")  # raises: no residues
        return ids
    except ValueError as error:
        raise ValueError(f"{source}, {record}: {error}") from None
