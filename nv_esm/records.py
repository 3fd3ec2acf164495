"""Protein records as every command reads them: sequence files (FASTA, text, parquet; gzipped or not), ESM-2's
token ids of a record's residues (one byte table), and what a reader does with a bad record (`RecordRules`:
`--invalid` and `--strip-stop`, shared by `nv-esm embed`, `score` and `train`). The letters' rule itself is
`modeling_nv_esm.protein_residues`.

A file's bad records are reported all at once, as `nv-esm embed` reports them: a reader collects them in
`BadRecords` (the first `LISTED_PROBLEMS` kept in file order, the rest counted) and raises one error
(`bad_records_error`: one line for one record, else a line per record and "... and N more"); a row with several
problems is one of them (`row_message`: its problems on its line). `plural` says a count with its noun ("1 row",
"2 rows") in the commands' messages.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from modeling_nv_esm import protein_residues
from modeling_nv_esm_batch import RESIDUE_LETTERS, STOP_MARK
from nv_esm.alphabet import CLS, EOS, RESIDUE_TO_ID, iter_fasta_lines, text_lines
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
# Messages
# --------------------------------------------------------------------------------------------------------------


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` with its noun: "1 row", "2 rows", "0 rows" (`nouns`: the plural where it is not `noun` + "s")."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


# How many bad records one error lists (the rest are counted).
LISTED_PROBLEMS = 20


def bad_records_error(
    path: str | Path, problems: Sequence[str], hints: Iterable[str] = (), count: int = 0
) -> ValueError:
    """The one error of a file's bad records, every command's: `problems` name them in file order, each a message
    naming `path` first (`"{path}: record 3 ..."` or `"{path}, record 3: ..."`), `count` how many there are (0: as
    many as `problems`; more where only the first were kept); `hints` are the options that would take them
    ("{them}": the records). One record: its message, one line. Several: a summary line, then a line per record
    without the file's name, the first `LISTED_PROBLEMS`, then how many more."""
    count = count or len(problems)
    them = "it" if count == 1 else "them"
    advice = f" ({'; '.join(hint.format(them=them) for hint in hints)})" if hints else ""
    if count == 1:
        return ValueError(f"{problems[0].removesuffix('.')}{advice}.")
    listed = [f"  {_under(problem, path).removeprefix(f'{path}: ')}" for problem in problems[:LISTED_PROBLEMS]]
    if count > LISTED_PROBLEMS:
        listed.append(f"  ... and {count - LISTED_PROBLEMS} more")
    return ValueError("\n".join([f"{path}: {count} bad records{advice}:", *listed]))


class BadRecords:
    """The bad records (or rows) a reader found in one file, for one error listing them all
    (`bad_records_error`). `append` a problem per bad record, in file order; the first `LISTED_PROBLEMS` are kept,
    the others only counted (a file of millions of bad records holds no million messages). `len`: every problem
    found."""

    def __init__(self, path: str | Path) -> None:
        self.path = path
        self.kept: list[str] = []
        self.count = 0

    def append(self, problem: str) -> None:
        self.count += 1
        if len(self.kept) < LISTED_PROBLEMS:
            self.kept.append(problem)

    def __len__(self) -> int:
        return self.count

    def error(self, hints: Iterable[str] = ()) -> ValueError:
        """The one error of the file's bad records (there is at least one; `bad_records_error`)."""
        return bad_records_error(self.path, self.kept, hints, self.count)

    def raise_if_any(self, hints: Iterable[str] = ()) -> None:
        """Raise `error(hints)` if a problem was found."""
        if self.count:
            raise self.error(hints)


def row_message(where: str, problems: Sequence[str]) -> str:
    """The one message of a row (or record) with several problems, as a reader appends it to `BadRecords`:
    `problems` are messages naming the row first (`where` then ": " or ", ", as `"{path}, row 3 (line 4): ..."` or
    `"{path}: row 3 (line 4), column 'x': ..."`); the first is kept whole, the others follow without `where`, all
    joined by "; " in one sentence."""
    rest = [_without_where(problem, where).removesuffix(".") for problem in problems[1:]]
    return "; ".join([problems[0].removesuffix("."), *rest]) + "."


def _without_where(problem: str, where: str) -> str:
    """`problem` without the `where` it starts with, and the ": " or ", " after it."""
    for separator in (": ", ", "):
        if problem.startswith(where + separator):
            return problem[len(where + separator) :]
    return problem


def _under(problem: str, path: str | Path) -> str:
    """`problem` as listed under its file's name: `"{path}, record 3: ..."` as `"{path}: record 3: ..."` (the
    listing drops `"{path}: "`)."""
    return f"{path}: {problem[len(f'{path}, ') :]}" if problem.startswith(f"{path}, ") else problem


# --------------------------------------------------------------------------------------------------------------
# Reading and tokenizing
# --------------------------------------------------------------------------------------------------------------


def read_sequences(path: str | Path, column: str = "sequence", empty_ok: bool = False) -> Iterator[str]:
    """Stream the sequences of a FASTA (.fasta/.fa/.faa), text (.txt, one per line) or parquet file, uppercased.

    FASTA and text files may be gzipped (`.gz`) and must be UTF-8. FASTA records may span lines; `;` lines are
    comments. Parquet is read batch by batch from `column`. An empty FASTA record or parquet value (null included)
    raises `ValueError`, or is read as "" with `empty_ok`; so does a file that is not what its name says, naming it.
    """
    return (sequence for sequence, _ in read_records(path, column, empty_ok))


def read_records(
    path: str | Path, column: str = "sequence", empty_ok: bool = False
) -> Iterator[tuple[str, int | None]]:
    """`read_sequences` with where each record is: (sequence, the file's line of the record) for FASTA (its header
    line) and text files, (sequence, None) for parquet."""
    path = Path(path)
    name = path.name.lower()
    suffix = next((s for s in sorted(SEQUENCE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)
    if suffix is None:
        raise ValueError(f"{path}: unknown sequence file type; expected one of {', '.join(SEQUENCE_SUFFIXES)}.")
    if suffix == ".parquet":
        return ((sequence, None) for sequence in _read_parquet(path, column, empty_ok))
    return _read_text_file(path, suffix, empty_ok)


def _read_text_file(path: Path, suffix: str, empty_ok: bool) -> Iterator[tuple[str, int]]:
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


def _read_text(lines: Iterator[str]) -> Iterator[tuple[str, int]]:
    for number, line in enumerate(lines, 1):
        sequence = "".join(line.split()).upper()
        if sequence:
            yield sequence, number


def _read_fasta(lines: Iterator[str], path: Path, empty_ok: bool) -> Iterator[tuple[str, int]]:
    for _, sequence, header_line in iter_fasta_lines(lines, path, empty_ok):
        yield sequence.upper(), header_line


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
    alphabet, or no residues, stops the run (`invalid="error"`: every bad record of the file named in one error,
    `BadRecords`) or is left out (`"skip"`). The letters' rule is `modeling_nv_esm.protein_residues`, the one of
    every reader of proteins."""

    invalid: str = "error"
    strip_stop: bool = False

    # What the error of a file's bad records says `--invalid skip` would do with them.
    SKIP_HINT = "--invalid skip leaves {them} out"

    def __post_init__(self) -> None:
        if self.invalid not in INVALID_POLICIES:
            raise ValueError(f"invalid must be one of {INVALID_POLICIES}, got {self.invalid!r}.")

    def residue_ids(
        self,
        sequence: str,
        source: str | Path,
        record: str,
        skipped: list[str],
        problems: list[str] | BadRecords | None = None,
        line: int | None = None,
    ) -> bytes | None:
        """`residue_ids` of a record (`record` of `source`, named in errors; `line`: the file's line where the
        record starts, if it has one), or None for a bad one: `invalid="skip"` leaves it out (its problem appended
        to `skipped`); with `invalid="error"` its problem is appended to `problems` (the reader raises one error for
        all of them at the end of the file, `BadRecords.raise_if_any` with `SKIP_HINT`), or without `problems`
        raised at once."""
        if self.strip_stop and sequence.endswith(STOP_MARK):
            sequence = sequence[: -len(STOP_MARK)]
        try:
            return _check_record(sequence, source, record, line)
        except ValueError as error:
            if self.invalid == "skip":
                skipped.append(str(error))
            elif problems is not None:
                problems.append(str(error))
            else:
                raise ValueError(f"{str(error).removesuffix('.')} ({self.SKIP_HINT.format(them='it')}).") from None
            return None


def _check_record(sequence: str, source: str | Path, record: str, line: int | None = None) -> bytes:
    """`residue_ids` of a record that must hold residues; its errors name `source`, `record` and `line` (where the
    record starts)."""
    try:
        ids = residue_ids(sequence)
        if not ids:
            protein_residues(sequence, "the sequence")  # raises: no residues
        return ids
    except ValueError as error:
        where = "" if line is None else f"; the record starts at line {line}"
        raise ValueError(f"{source}, {record}: {str(error).removesuffix('.')}{where}.") from None
