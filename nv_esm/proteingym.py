"""`nv-esm proteingym`: ProteinGym's zero-shot substitution benchmark in one command.

    nv-esm proteingym ./esm2_650M_te DMS_substitutions.csv DMS_ProteinGym_substitutions/ ./pg_out \\
        --model-name esm2_t33_650M_UR50D
    torchrun --nproc-per-node 8 -m nv_esm proteingym ./esm2_650M_te DMS_substitutions.csv assays/ ./pg_out

REFERENCE_CSV is ProteinGym's `reference_files/DMS_substitutions.csv` (columns `DMS_id`, `DMS_filename`,
`target_seq` read here), ASSAY_FOLDER holds the assays (`DMS_filename`; each with a `mutant` column: `A24G:K30R`,
1-based). OUT gets, per assay, `<DMS_id>.csv`: the assay's CSV with one score column per method
(`score_column`: `MODEL_NAME` for `masked-marginals`, the column ProteinGym's `config.json` reads as an ESM-2
model's `input_score_name`, and `MODEL_NAME_<method>` for the others; scores in nats with 6 decimals,
`nv_esm.scoring.score_text`: the fp32 log-probabilities they come from are good to about 1e-6, and the summary's
metrics are computed from the scores as written, so a rerun's summary is the same), and `manifest.json` (the
settings). Methods and windows: `nv_esm.proteingym_scoring`.

Then OUT/summary/ gets ProteinGym's metrics of every score column (`nv_esm.proteingym_metrics`: per assay, per
UniProt_ID and selection type, their mean and bootstrap standard error; CSV files named as their benchmarks/ folder's),
`Spearman.png` (per selection type) and `<DMS_id>.png` (one assay's scores against DMS_score, `--scatter-assay`).

Every input is checked before anything is scored or written: an error names the file, and every bad row of it with
its line and column (`raise_bad_rows`: the first 20 listed, then how many more), the reference before the model
loads, the assays in a thread while it loads (`AssayReading`; the first bad assay file stops the run). The assays
run in groups of whole wild types (`groups_of`; every copy of a group packed in one pass, each wild-type position
computed once for all the assays of that wild type); an assay's file is written, atomically, when its group is done,
by a thread while the next group is scored (`AssayWriter`), after a record of its inputs (OUT/inputs/<DMS_id>.json:
the SHA-256 of the assay file and of its `target_seq`). A rerun skips the assays whose file is there and was scored
from the same inputs; it refuses an assay whose file or `target_seq` changed since, and an OUT of other settings
(checkpoint, methods, windows...), unless `--overwrite` (which scores them again, and deletes only what runs of this
command wrote: a user's own files in OUT stay). OUT is never the checkpoint, REFERENCE_CSV or ASSAY_FOLDER, nor
inside or around them; a `DMS_filename` names a file inside ASSAY_FOLDER. Under torchrun each rank reads, checks and
scores its `shares` of the wild types (dealt out before any assay file is read); each assay's metrics are computed
as it is written, and rank 0 gathers them for the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import io
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modeling_nv_esm_batch import protein_residues
from nv_esm import proteingym_metrics
from nv_esm.checkpoint_io import write_atomically
from nv_esm.cli import parse_proteingym_args
from nv_esm.embed import barrier, run_on_ranks
from nv_esm.embed_model import load_config, runs_checkpoint_code
from nv_esm.embed_output import check_output_folder, output_lock, prepare_output
from nv_esm.embed_plan import checkpoint_fingerprint, command_backend, command_precision, fp8_setting
from nv_esm.hub_folder import remote_code_differences
from nv_esm.job_clock import JobClock, ReportingProgress
from nv_esm.path_guard import confined, refuse_overlap
from nv_esm.plots import PLOTS_HINT, plot_category_bars, plot_scores
from nv_esm.proteingym_output import (
    PROTEINGYM_FOLDER,
    SUMMARY_FOLDER,
    assay_path,
    finished_assays,
    inputs_fingerprint,
    record_inputs,
)
from nv_esm.proteingym_scoring import Assay, Plan, RowNames, check_assay, run_plans
from nv_esm.records import BadRecords, plural, row_message
from nv_esm.score import load_masked_lm, load_tokenizer, read_csv
from nv_esm.scoring import Scorer, progress_bar, resolve_window, score_text

SUMMARY_COLUMNS = ("UniProt_ID", "coarse_selection_type")  # of the reference, for the summary
MEASURED_COLUMNS = ("DMS_score", "DMS_score_bin")  # of each assay, for the summary
REFERENCE_COLUMNS = ("DMS_id", "DMS_filename", "target_seq")
MUTANT_COLUMN = "mutant"
# Tokens of masked copies per group of assays (whole wild types): one packed pass each, and what a killed run loses.
GROUP_TOKENS = 1 << 22
GROUPS_PER_RANK = 8  # at least this many groups per rank where the wild types allow: the ranks' loads even out
ROW_TOKENS = 4  # an assay row's host work (read, checked, planned, scored, written) in tokens of model work


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    """The command line (`nv_esm.cli.parse_proteingym_args`: declared there, without torch, so `--help` is quick)."""
    return parse_proteingym_args(argv, prog)


def score_column(model_name: str, method: str) -> str:
    """The output column of `method`: `model_name` for `masked-marginals` (ProteinGym's ESM-2 method, under the
    name their `config.json` reads), `model_name_method` for the others."""
    return model_name if method == "masked-marginals" else f"{model_name}_{method}"


@dataclass(frozen=True)
class ProteinGymSettings:
    """Everything that decides the numbers written (OUT's manifest; a rerun resumes only if equal)."""

    checkpoint: str  # `checkpoint_fingerprint`
    model_code: str  # "installed", or "checkpoint" (--trust-remote-code, where its code differs)
    methods: tuple[str, ...]
    windows: str
    window: int
    columns: tuple[str, ...]
    precision: str
    backend: str
    fp8: str  # `fp8_setting`


@dataclass(frozen=True)
class ReferenceEntry:
    """One assay of the reference, checked without opening its file (`read_reference`): its `DMS_id`, assay file,
    wild type (`target_seq`), its row (`where`, for errors) and what the summary groups it by (`UniProt_ID`,
    `coarse_selection_type`; None where the reference lacks the column)."""

    dms_id: str
    path: Path
    wild_type: str
    where: str
    uniprot: str | None
    selection_type: str | None


@dataclass
class AssayFile:
    """One assay read (`read_assay`): its `Assay` (mutants parsed), its CSV, its `MEASURED_COLUMNS` that it has,
    as floats, and the fingerprint of its inputs (`inputs_fingerprint`)."""

    assay: Assay
    table: AssayTable
    measured: dict[str, list[float]]
    inputs: dict[str, str]


@dataclass
class AssayTable:
    """An assay CSV as read (`read_table`): its `columns` and either `lines`, the rows' text where each is one plain
    line of the file (no quote, blank, short or long line: a row's fields are its text split at commas, and the
    output extends the lines as they are), or else each row's `fields` (None where a short row lacks one) and
    `line_numbers`."""

    columns: list[str]
    lines: list[str] | None = None
    fields: list[list[str | None]] | None = None
    line_numbers: list[int] | None = None

    def __len__(self) -> int:
        return len(self.lines if self.lines is not None else self.fields or ())

    def line(self, row: int) -> int:
        """The file's line number of `row` (0-based)."""
        return row + 2 if self.line_numbers is None else self.line_numbers[row]

    def column(self, name: str) -> list[str | None]:
        """The values of column `name`, row by row."""
        index = self.columns.index(name)
        if self.lines is None:
            return [fields[index] for fields in self.fields or ()]
        after = len(self.columns) - 1 - index  # split from the nearer end: the other fields are not copied
        if index <= after:
            return [line.split(",", index + 1)[index] for line in self.lines]
        return [line.rsplit(",", after + 1)[-after - 1] for line in self.lines]

    def floats(self, path: Path, name: str, bad: dict[int, str] | None = None) -> list[float]:
        """The column's values as floats; ValueError naming the file, row and column of the first one that is not a
        number, or with `bad`, every such row's error put there (by row; its value NaN)."""
        column = self.column(name)
        try:
            return list(map(float, column))  # type: ignore[arg-type]
        except (TypeError, ValueError):  # name the values that are not numbers, with their rows
            values = []
            for row, value in enumerate(column):
                try:
                    values.append(float(value))  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    message = f"{self.row_name(path, row)}, column {name!r}: {value!r} is not a number."
                    if bad is None:
                        raise ValueError(message) from None
                    bad[row] = message
                    values.append(float("nan"))
            return values

    def row_name(self, path: Path, row: int) -> str:
        """`row` (0-based) as errors name it: `path: row N (line L)`."""
        return f"{path}: row {row + 1} (line {self.line(row)})"


def read_table(path: Path) -> AssayTable:
    """`path` as `read_csv` reads it (its errors too). A file whose records are plain lines is split at commas
    directly (no field holds a comma, quote or line break there, so that is the csv module's parse), which keeps
    the lines for the output: about three times as fast over ProteinGym's 2.5 million rows."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason}).") from None
    # line endings read as universal newlines: "\r\n" and "\r" end a record, as in the csv module (which refuses a NUL
    # byte on Python 3.10: such a file takes its path)
    if '"' not in text and "\x00" not in text:
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        columns = lines[0].split(",") if lines else []
        commas = len(columns) - 1
        data = lines[1:]
        if commas > 0 and data and len(set(columns)) == len(columns) and all(row.count(",") == commas for row in data):
            return AssayTable(columns, lines=data)
    columns, rows = read_csv(path)
    return AssayTable(columns, fields=[[row[c] for c in columns] for row, _ in rows], line_numbers=[n for _, n in rows])


def read_reference(args: argparse.Namespace) -> list[ReferenceEntry]:
    """The reference's assays (`--assays` of them), each row checked without opening its assay file: ValueError
    naming the file, row and column of a missing column, a repeated or unknown DMS_id, a DMS_id that cannot name an
    output file, an assay file outside ASSAY_FOLDER (an absolute `DMS_filename`, or one with '..'), a missing one
    or a `target_seq` that is not a protein; every bad row in one error (`raise_bad_rows`)."""
    columns, rows = read_csv(args.reference)
    missing = [name for name in REFERENCE_COLUMNS if name not in columns]
    if missing:
        raise ValueError(f"{args.reference} has no column {', '.join(map(repr, missing))} (ProteinGym's reference).")
    bad: dict[int, list[str]] = {}  # per bad row (0-based), its problems

    def row_name(index: int) -> str:  # a row (0-based) as errors name it
        return f"{args.reference}: row {index + 1} (line {rows[index][1]})"

    seen: dict[str, int] = {}  # DMS_id: its first row (1-based)
    for index, (row, _) in enumerate(rows):
        dms_id = row["DMS_id"] or ""
        if dms_id in seen:
            repeat = f"{row_name(index)}, column 'DMS_id': {dms_id!r} repeats row {seen[dms_id]}."
            bad.setdefault(index, []).append(repeat)
        else:
            seen[dms_id] = index + 1
    wanted = list(dict.fromkeys(args.assays or [row["DMS_id"] for row, _ in rows]))
    unknown = [dms_id for dms_id in wanted if dms_id not in seen]
    if unknown:
        listed = ", ".join(map(repr, unknown[:5])) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        verb = "is not a DMS_id" if len(unknown) == 1 else "are not DMS_ids"
        raise ValueError(f"--assays: {listed} {verb} of {args.reference}.")
    if args.scatter_assay is not None and args.scatter_assay not in wanted:
        raise ValueError(f"--scatter-assay: {args.scatter_assay!r} is not among the assays scored.")
    entries = []
    for dms_id in wanted:
        index = seen[dms_id] - 1
        row, where = rows[index][0], row_name(index)
        problems = bad.setdefault(index, [])
        if not dms_id or "/" in dms_id or dms_id.startswith("."):
            problems.append(f"{where}, column 'DMS_id': {dms_id!r} cannot name an output file.")
        try:
            path = confined(args.assays_folder, row["DMS_filename"] or "", f"{where}, column 'DMS_filename':")
            if not path.is_file():
                problems.append(f"{where}, column 'DMS_filename': assay file {path} is missing.")
        except ValueError as error:
            problems.append(str(error))
        try:
            wild_type = protein_residues(row["target_seq"], f"{where}, column 'target_seq'")
        except ValueError as error:
            problems.append(str(error))
        if not problems:
            entries.append(ReferenceEntry(dms_id, path, wild_type, where, *(row.get(n) for n in SUMMARY_COLUMNS)))
    raise_bad_rows(args.reference, bad, row_name)
    return entries


def raise_bad_rows(path: Path, bad: dict[int, list[str]], row_name: Callable[[int], str]) -> None:
    """Raise one error naming every bad row of the CSV file at `path` (`bad`: per row, 0-based, its problems, each
    naming the row first: `row_name(row)`, `path: row N (line L)`), in row order, a row's problems on one line
    (`records.row_message`, `records.BadRecords`); nothing where no row has a problem."""
    errors = BadRecords(path)
    for index in sorted(index for index, problems in bad.items() if problems):
        errors.append(row_message(row_name(index), bad[index]))
    errors.raise_if_any()


def read_assay(args: argparse.Namespace, entry: ReferenceEntry, window: int, longest: int) -> AssayFile:
    """`entry`'s assay file, every row checked: ValueError naming the file, row and column of a missing column, a
    `DMS_score` or `DMS_score_bin` that is not a number, a malformed mutant, a position outside `target_seq` or a
    wild-type letter that differs from it, or what the methods cannot score (`check_assay`, with the model's
    `window` and `longest` protein)."""
    path = entry.path
    table = read_table(path)
    if MUTANT_COLUMN not in table.columns:
        raise ValueError(f"{path} has no column {MUTANT_COLUMN!r} (its columns: {', '.join(table.columns[:20])}).")
    taken = [name for name in args.columns if name in table.columns]
    if taken:
        raise ValueError(f"{path} already has a column {taken[0]!r}; choose another --model-name.")
    found: list[dict[int, str]] = []  # per check, the errors of the rows it finds bad
    # a value the summary cannot read is refused now, not after the scoring
    measured = {name: table.floats(path, name, _new(found)) for name in MEASURED_COLUMNS if name in table.columns}
    mutants = table.column(MUTANT_COLUMN)
    names = RowNames(lambda i: f"{table.row_name(path, i)}, column {MUTANT_COLUMN!r}", len(mutants))
    assay = Assay(entry.dms_id, entry.wild_type, mutants, names)  # type: ignore[arg-type]
    assay.parse(_new(found))
    check_assay(assay, args.methods, args.windows, window, longest, _new(found))
    bad: dict[int, list[str]] = {}
    for errors in found:
        for row, error in errors.items():
            bad.setdefault(row, []).append(error)
    raise_bad_rows(path, bad, lambda row: table.row_name(path, row))
    return AssayFile(assay, table, measured, inputs_fingerprint(entry.path, entry.wild_type))


def _new(found: list[dict[int, str]]) -> dict[int, str]:
    """A new dict for a check's bad rows, kept in `found`."""
    found.append({})
    return found[-1]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's automatic garbage collection off inside the block (back on after, if it was on), for the whole
    process, every thread: the objects made there are kept, not cycles to collect, and each full collection would
    walk them all again. Whoever else turns it off meanwhile finds it back on after the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class AssayReading:
    """This rank's assays (`entries`) read and checked (`read_assay`, in the reference's order) in a thread of its
    own while the main thread loads the model: `files` waits for them and raises the first bad assay's error.
    Leaving the `with` block on a ValueError, OSError or RuntimeError of the main thread (a model that does not
    load...), the reading finishes first and a bad assay's error is the one raised, as when the assays were read
    before anything else; on any other (Ctrl-C), the thread stops after the file it is reading."""

    def __init__(self, args: argparse.Namespace, entries: list[ReferenceEntry], window: int, longest: int) -> None:
        self.stopped = threading.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="proteingym-read")
        self.future = self.executor.submit(self._read, args, entries, window, longest)

    def _read(
        self, args: argparse.Namespace, entries: list[ReferenceEntry], window: int, longest: int
    ) -> list[AssayFile]:
        files = []
        with collection_paused():  # millions of small tuples: full collections took a third of the reading
            for entry in entries:
                if self.stopped.is_set():
                    break
                files.append(read_assay(args, entry, window, longest))
        return files

    def files(self) -> list[AssayFile]:
        """Every assay read, in the order of `entries`."""
        return self.future.result()

    def __enter__(self) -> AssayReading:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        try:
            if isinstance(error, (ValueError, OSError, RuntimeError)):
                failure = self.future.exception()  # waits for the reading
                if failure is not None and failure is not error:
                    raise failure
        finally:
            self.stopped.set()
            self.executor.shutdown(wait=False, cancel_futures=True)


def shares(entries: list[ReferenceEntry], methods: tuple[str, ...], window: int, world_size: int) -> list[list]:
    """Per rank, the assays it reads, checks and scores, in the reference's order: whole wild types (a wild type's
    copies serve all its assays), dealt out by `groups_of` over an estimate made before any assay file is read
    (the same on every rank): per wild type of L residues, a masked copy per position (`min(L + 2, window + 2)`
    tokens each; the most `masked-marginals` runs), plus per assay row `ROW_TOKENS` for its host work (rows from
    the file's size), plus what `pseudo-ppl` and `masked_marginal` run per row."""
    costs: dict[str, int] = {}
    for entry in entries:
        length = len(entry.wild_type)
        copy = min(length + 2, window + 2)
        if entry.wild_type not in costs:
            costs[entry.wild_type] = length * copy if {"masked-marginals", "wt-marginals"} & set(methods) else 0
        rows = entry.path.stat().st_size // (length + 24)
        per_row = ROW_TOKENS + copy * (("masked_marginal" in methods) + length * ("pseudo-ppl" in methods))
        costs[entry.wild_type] += rows * per_row
    ranks = [{wild_type for group in groups for wild_type in group} for groups in groups_of(costs, world_size)]
    return [[entry for entry in entries if entry.wild_type in wild_types] for wild_types in ranks]


def groups_of(tokens: dict[str, int], world_size: int) -> list[list[list[str]]]:
    """Per rank, its groups of wild types (`tokens`: what each one's copies cost, in the order of the runs'
    assays): consecutive wild types, about min(`GROUP_TOKENS`, all tokens / (`GROUPS_PER_RANK` x `world_size`))
    tokens per group; the groups dealt out largest first, each to the rank with the fewest tokens so far (the same
    on every rank)."""
    target = min(GROUP_TOKENS, max(1, sum(tokens.values()) // (GROUPS_PER_RANK * world_size)))
    groups, sizes = [[]], [0]
    for wild_type, size in tokens.items():
        if groups[-1] and sizes[-1] + size > target:
            groups.append([])
            sizes.append(0)
        groups[-1].append(wild_type)
        sizes[-1] += size
    ranks: list[list[list[str]]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for k in sorted(range(len(groups)), key=lambda k: -sizes[k]):
        if groups[k]:
            rank = loads.index(min(loads))
            ranks[rank].append(groups[k])
            loads[rank] += sizes[k]
    return ranks


def output_path(args: argparse.Namespace, dms_id: str) -> Path:
    return assay_path(args.output, dms_id)


def write_assay(path: Path, file: AssayFile, scores: dict[str, list[str]]) -> None:
    """The assay's CSV (its rows, in order) with one column per score column of `scores` (column name -> a value per
    row, as `score_text` wrote it), written atomically: each plain line as it was, the scores after it
    (`AssayTable.lines`), else each row written anew."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    table = file.table
    writer.writerow([*table.columns, *scores])
    values = list(zip(*scores.values()))
    if table.lines is not None:
        text.write("".join(f"{line},{','.join(row)}\n" for line, row in zip(table.lines, values)))
    else:
        writer.writerows([*fields, *row] for fields, row in zip(table.fields or (), values))
    write_atomically(path, text.getvalue())


def run(args: argparse.Namespace, scorer: Scorer, entries: list[ReferenceEntry], files: list[AssayFile],
        settings: ProteinGymSettings, rank: int = 0, world_size: int = 1,
        set_up_seconds: float | None = None, clock: JobClock | None = None) -> None:  # fmt: skip
    """Score this rank's assays (`files`, its `shares` of the reference's `entries`) that have no output file yet,
    each written when its group of wild types is done (by `AssayWriter`, while the next group is scored); then rank
    0 (after every rank) summarises OUT from every rank's assay metrics (`gathered_on_rank_0`). Rank 0
    says how long its scoring took (its last files written), and its set-up before (`set_up_seconds`: reading its
    assays, loading the model), if given, then where the time went (`clock`'s line; a clock from here on without
    one)."""
    clock = JobClock(time.time()) if clock is None else clock
    _run(args, scorer, entries, files, settings, rank, world_size, set_up_seconds, clock)
    if rank == 0:
        print(clock.line())


def _run(args: argparse.Namespace, scorer: Scorer, entries: list[ReferenceEntry], files: list[AssayFile],
         settings: ProteinGymSettings, rank: int, world_size: int, set_up_seconds: float | None,
         clock: JobClock) -> None:  # fmt: skip
    with output_lock(args.output, PROTEINGYM_FOLDER) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            prepare_output(args.output, settings, args.overwrite, PROTEINGYM_FOLDER)
        barrier(world_size)
        finished = finished_assays(args.output, {file.assay.dms_id: file.inputs for file in files}, args.overwrite)
        todo = [file for file in files if file.assay.dms_id not in finished]
        barrier(world_size)  # every rank has its list before any writes an assay
        by_wild_type: dict[str, list[AssayFile]] = {}
        for file in todo:
            by_wild_type.setdefault(file.assay.wild_type, []).append(file)
        plans = {
            wild_type: Plan(scorer, [file.assay for file in group], settings.methods, settings.windows)
            for wild_type, group in by_wild_type.items()
        }
        tokens = {wild_type: plan.tokens() for wild_type, plan in plans.items()}
        [groups] = groups_of(tokens, 1)
        total = sum(tokens.values())
        progress = ReportingProgress(progress_bar(total, "proteingym", args.no_progress or rank != 0), clock)
        started = time.perf_counter()
        with clock.phase("batches"), AssayWriter(args, settings.columns, entries) as writer:
            for group in groups:
                results = run_plans([plans[wild_type] for wild_type in group], progress)
                with clock.phase("writing"):
                    writer.write([pair for w, r in zip(group, results) for pair in zip(by_wild_type[w], r)])
            with clock.phase("writing"):
                writer.finish()
        progress.close()
        seconds = time.perf_counter() - started  # the last group's files written
        clock.batches_done(total, scorer.model)
        summarized, ids = writer.summarized, [file.assay.dms_id for file in files]
        report = {i: (summarized.get(i), tuple(file.measured), i in summarized) for i, file in zip(ids, files)}
        report = gathered_on_rank_0(report, rank, world_size)
        if rank == 0:
            done = sum(not scored for _, _, scored in report.values())
            where = " on rank 0" if world_size > 1 else ""
            rate = f"this run: {total:,} tokens of masked copies in {seconds:.2f} s{where}"
            rate += f" ({total / max(seconds, 1e-9):,.0f} tokens/s)"
            if set_up_seconds is not None:
                rate += f" after {set_up_seconds:.2f} s of set-up (assays read, model loaded)"
            done_text = f"{done} {'was' if done == 1 else 'were'} already done"
            print(f"{plural(len(entries), 'assay')} ({done_text}); {rate}; wrote {args.output}")
            missing = summary_gap(entries, report)
            if missing is None:
                with clock.phase("writing"):
                    summarize_output(args, entries, settings.columns, report)
            else:
                print(f"note: no summary of the metrics: {missing}", file=sys.stderr)


class AssayWriter:
    """One thread that writes the scored groups' assay files (`write_assay`, atomically, in the order handed over)
    while the main thread scores the next group, and computes each one's metrics for the summary there
    (`summarized`: per assay, `assay_summary`'s). After a failed write (an OSError such as a full disk, or any
    other error there) no later one runs, and the main thread raises the failure at its next `write` or at `finish`.
    Leaving the `with` block on an error of the main thread, the writes already handed over finish (their assays
    were scored), and a write that failed meanwhile is said in a note (before that error is reported), not lost."""

    def __init__(self, args: argparse.Namespace, columns: tuple[str, ...], entries: list[ReferenceEntry]) -> None:
        self.args, self.columns = args, columns
        self.entries = {entry.dms_id: entry for entry in entries}
        self.summarized: dict[str, proteingym_metrics.AssayResult | ValueError | None] = {}
        self.failed = threading.Event()
        self.pending: list[Future] = []  # in order of submission: one worker runs them first to last
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="proteingym-write")

    def write(self, done: list[tuple[AssayFile, dict[str, torch.Tensor]]]) -> None:
        """Hand over a group's assays with their scores (method -> `[rows]`); first raise a failed write's error."""
        self.check()
        self.pending.append(self.executor.submit(self._write, done))

    def check(self) -> None:
        """Raise the error of the first write that failed among those finished."""
        while self.pending and self.pending[0].done():
            self.pending.pop(0).result()

    def finish(self) -> None:
        """Wait for every write handed over; raise the first one's error that failed."""
        while self.pending:
            self.pending.pop(0).result()

    def _write(self, done: list[tuple[AssayFile, dict[str, torch.Tensor]]]) -> None:
        for file, scores in done:
            if self.failed.is_set():
                return
            try:
                # the scores as the file holds them (`score_text`), formatted once: the summary is computed from
                # those texts' values, the same from a rerun's files
                texts = {
                    column: list(map(score_text, tensor.tolist()))
                    for column, tensor in zip(self.columns, scores.values())
                }
                values = {column: list(map(float, column_texts)) for column, column_texts in texts.items()}
                path = output_path(self.args, file.assay.dms_id)
                path.unlink(missing_ok=True)  # scored again (--overwrite): never the old scores beside the new record
                record_inputs(self.args.output, file.assay.dms_id, file.inputs)
                write_assay(path, file, texts)
                entry = self.entries[file.assay.dms_id]
                self.summarized[entry.dms_id] = assay_summary(entry, {**values, **file.measured}, self.columns)
            except BaseException:
                self.failed.set()
                raise

    def __enter__(self) -> AssayWriter:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        self.executor.shutdown(wait=True)
        failures = [future.exception() for future in self.pending] if error is not None else []
        failure = next((failure for failure in failures if failure is not None), None)
        if failure is not None:  # the main thread's error is the one raised: this one is said here
            print(f"note: writing an assay failed too: {failure}", file=sys.stderr)


def summary_gap(entries: list[ReferenceEntry], report: dict[str, Any]) -> str | None:
    """Why the metrics cannot be summarised (`missing_for_summary` of the first assay that lacks a column), or None.
    `report`: per assay, (its `assay_summary` or None, the `MEASURED_COLUMNS` its file has, whether this run scored
    it)."""
    return next(filter(None, (missing_for_summary(entry, report[entry.dms_id][1]) for entry in entries)), None)


def missing_for_summary(entry: ReferenceEntry, columns: Collection[str]) -> str | None:
    """What the summary reads that `entry` lacks: a `SUMMARY_COLUMNS` value of the reference, or one of the
    `MEASURED_COLUMNS` among its assay's `columns`; None when it has everything."""
    if entry.uniprot is None or entry.selection_type is None:
        return f"the reference has no {' or '.join(SUMMARY_COLUMNS)} column"
    absent = [name for name in MEASURED_COLUMNS if name not in columns]
    return f"assay {entry.dms_id} has no {absent[0]} column" if absent else None


def gathered_on_rank_0(report: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Every rank's `report` (assay -> what it has of it), merged on rank 0 (an empty dict on the others), after
    every rank has written its assays."""
    if world_size == 1:
        return report
    parts: list[Any] | None = [None] * world_size if rank == 0 else None
    torch.distributed.gather_object(report, parts, dst=0)
    return {dms_id: values for part in parts or [] for dms_id, values in part.items()}


def assay_summary(
    entry: ReferenceEntry, values: dict[str, list[float]], columns: tuple[str, ...]
) -> proteingym_metrics.AssayResult | ValueError | None:
    """The assay's metrics for the summary (`values`: its score `columns` and `MEASURED_COLUMNS`, row by row), the
    ValueError saying why they cannot be computed (a constant column, bins of one class...: raised when the summary
    is made), or None where there will be no summary (`missing_for_summary`: a column it reads is missing)."""
    if missing_for_summary(entry, values) is not None:
        return None
    try:
        return proteingym_metrics.assay_result(
            entry.dms_id,
            entry.uniprot,
            entry.selection_type,
            values["DMS_score"],
            values["DMS_score_bin"],
            {name: values[name] for name in columns},
        )
    except ValueError as error:
        return error.with_traceback(None)  # not its frames: they hold the assay's values until the summary


def read_values(args: argparse.Namespace, dms_id: str, columns: tuple[str, ...]) -> dict[str, list[float]]:
    """An assay's score `columns` and `MEASURED_COLUMNS`, as its output file holds them."""
    path = output_path(args, dms_id)
    table = read_table(path)
    return {name: table.floats(path, name) for name in (*columns, *MEASURED_COLUMNS)}


def summarize_output(
    args: argparse.Namespace, entries: list[ReferenceEntry], columns: tuple[str, ...], report: dict[str, Any]
) -> None:
    """ProteinGym's metrics of every score column over the assays (`proteingym_metrics`), written to OUT/summary/
    with a bar plot of the Spearman per selection type and a scatter of one assay's scores. The metrics of this run's
    assays (`report`: assay -> (`assay_summary`'s, ...), computed as each was written) are used as they are (the
    first assay's error, in the reference's order, is raised); an assay an earlier run finished is read from its
    output file, as is the scatter's."""
    results, read = [], {}
    for entry in entries:
        result = report.get(entry.dms_id, (None,))[0]
        if result is None:
            read[entry.dms_id] = read_values(args, entry.dms_id, columns)
            result = assay_summary(entry, read[entry.dms_id], columns)
        if isinstance(result, ValueError):
            raise result
        results.append(result)
    summary = proteingym_metrics.summarize(results)
    folder = args.output / SUMMARY_FOLDER
    proteingym_metrics.write_summary(summary, folder)
    spearman = summary.metrics["Spearman"]
    averages = ", ".join(f"{name} {spearman.average[i]:.3f}" for i, name in enumerate(summary.methods))
    print(f"average Spearman over selection types ({plural(len(entries), 'assay')}): {averages}; wrote {folder}")
    chosen = args.scatter_assay or entries[0].dms_id
    result = next(result for result in results if result.DMS_id == chosen)
    values = read.get(chosen) or read_values(args, chosen, columns)
    panels = {f"{name}: Spearman {result.metrics[name]['Spearman']:.3f}": values[name] for name in columns}
    plotted = [
        plot_category_bars(*proteingym_metrics.category_bars(summary, "Spearman"), folder / "Spearman.png"),
        plot_scores(panels, values["DMS_score"], folder / f"{chosen}.png", "DMS_score"),
    ]
    if None in plotted:
        print(PLOTS_HINT.format(what="the summary"), file=sys.stderr)


def main(argv: list[str] | None = None, prog: str = "nv-esm proteingym") -> int:
    clock = JobClock()
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)

    def score_on(device: torch.device, rank: int, world_size: int) -> None:
        started = time.perf_counter()
        inputs = {
            "the checkpoint": args.checkpoint,
            "the reference CSV": args.reference,
            "the assays folder": args.assays_folder,
        }
        refuse_overlap({"OUT": args.output}, inputs)  # before anything is read or written
        with clock.phase("input"):
            config = load_config(args.checkpoint)
            window = resolve_window(config, None)
            args.columns = tuple(score_column(args.model_name, method) for method in args.methods)
            entries = read_reference(args)  # before loading: a bad row stops the run at once
            refuse_overlap({"OUT": args.output}, {f"the assay file of {e.dms_id}": e.path for e in entries})  # links
            mine = shares(entries, args.methods, window, world_size)[rank]  # each rank reads only its assays
        reading_and_loading = clock.phase("load")  # the assays are read beside it, on a thread
        with reading_and_loading, AssayReading(args, mine, window, config.max_protein_length - 2) as reading:
            own_code = runs_checkpoint_code(remote_code_differences(args.checkpoint), args.trust_remote_code)
            settings = ProteinGymSettings(
                checkpoint=checkpoint_fingerprint(args.checkpoint, config),
                model_code="checkpoint" if own_code else "installed",
                methods=args.methods,
                windows=args.windows,
                window=window,
                columns=args.columns,
                precision=command_precision(device),
                backend=command_backend(args, device).name,
                fp8=fp8_setting(args.fp8, args.fp8_scaling),
            )
            if not check_output_folder(args.output, settings, args.overwrite, PROTEINGYM_FOLDER):  # else deleted
                written = [entry for entry in mine if output_path(args, entry.dms_id).exists()]
                now = {entry.dms_id: inputs_fingerprint(entry.path, entry.wild_type) for entry in written}
                finished_assays(args.output, now, args.overwrite)
            tokenizer = load_tokenizer(args.checkpoint)
            model = load_masked_lm(args, config, settings.backend, device)
            scorer = Scorer(model, tokenizer, window, args.tokens_per_batch)
            with clock.phase("input"):  # what reading the assays takes longer than loading the model
                files = reading.files()  # a bad assay stops the run here, before OUT is touched
        barrier(world_size)  # every rank has read its assays and OUT before rank 0 changes it
        run(args, scorer, entries, files, settings, rank, world_size, time.perf_counter() - started, clock)

    return run_on_ranks(args.device, score_on, f"finished assays in {args.output} are kept, a rerun resumes", prog)


if __name__ == "__main__":
    sys.exit(main())
