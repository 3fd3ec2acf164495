"""`nv-esm score`: pseudo-log-likelihoods of a FASTA file's proteins, or variant-effect scores of a mutant table.

    nv-esm score ./esm2_650M_te proteins.fasta pll.csv                        # PLL + pseudo-perplexity per record
    nv-esm score ./esm2_650M_te wild_type.fasta scores.csv --mutants dms.csv --methods masked_marginal pseudo_likelihood
    torchrun --nproc-per-node 8 -m nv_esm score ./esm2_650M_te wild_type.fasta scores.csv --mutants dms.csv

FASTA mode: one output row per record (id, residues, pll, pseudo_perplexity, status). Mutant mode: the FASTA file
holds the wild type (one record) and the CSV a `--mutant-column` in ProteinGym's notation (`A24G`, `A24G:K30R`,
1-based); the output is the CSV with one column per method and a status column added, rows in the input order. A
`--score-column` (default `DMS_score`, where there is one) gets Spearman's rho per method, printed (of the scores as
written). The methods, the window rule for long proteins and the numerics are `nv_esm.scoring`'s. Scores (nats) are
written with 6 decimals (`nv_esm.scoring.score_text`: the fp32 log-probabilities they come from are good to about
1e-6, so no digit that carries information is dropped; scores closer than that read as ties).

Every input is checked before the model loads: FASTA records as `nv-esm embed` checks them, the CSV (parsed
strictly: a malformed line stops the run with its line), each mutant row (format, positions, the wild-type letter;
for the marginal methods, that its positions fit one window). The bad rows stop the run, every one named in one
error with its row, line and position (the first 20 listed, then how many more: `records.BadRecords`), or with
`--invalid skip` are left unscored (each one's status says why). So is the output: an existing one, or the plot a
mutant run draws beside it (`OUTPUT` with `.png`), without `--overwrite`, or parts of a run with other settings, are
refused before the model loads; and before anything is read, an OUTPUT, plot or parts folder that is, lies inside or
holds the checkpoint or an input file (`path_guard.refuse_overlap`).

Resumable: the work is cut into parts (`--shard-size` records, or about `--shard-size` rows; a mutant part holds
whole groups of rows changing the same positions, so each group is one forward), each written, when finished, to
`OUTPUT.parts/part-NNNNN.csv` beside the output (with `manifest.json`: the settings and fingerprints of the weights and
inputs). A rerun with the same settings computes only the missing parts (under torchrun, split over the ranks);
other settings are refused unless `--overwrite`. Rank 0 writes OUTPUT when every part is there and removes the parts;
an existing OUTPUT is replaced only with `--overwrite`. `--fp8` layers run with block scaling by default
(`embed_plan.COMMAND_FP8_RECIPE`): a token's FP8 scales come from that token alone, so a score depends neither on the
parts run before it nor on the copies packed beside it (`--fp8-scaling current`: one scale per tensor of a batch).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import math
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modeling_nv_esm_batch import protein_residues
from nv_esm.alphabet import iter_fasta
from nv_esm.checkpoint_io import TEMPORARY_SUFFIX, file_sha256, write_atomically
from nv_esm.cli import parse_score_args
from nv_esm.embed import barrier, run_on_ranks
from nv_esm.embed_model import load_config, load_model, runs_checkpoint_code
from nv_esm.embed_output import (
    MANIFEST_NAME,
    OutputFolder,
    check_output_folder,
    output_lock,
    prepare_output,
)
from nv_esm.embed_plan import (
    Record,
    checkpoint_fingerprint,
    command_backend,
    command_precision,
    fp8_setting,
    records_by_shard,
    scan_fasta,
    text_lines,
)
from nv_esm.hub_folder import remote_code_differences
from nv_esm.job_clock import JobClock, ReportingProgress
from nv_esm.path_guard import refuse_overlap
from nv_esm.plots import PLOTS_HINT, plot_scores
from nv_esm.rank_statistics import spearman
from nv_esm.records import BadRecords, plural
from nv_esm.scoring import (
    Scorer,
    SequenceLikelihood,
    Substitution,
    check_variant,
    progress_bar,
    resolve_window,
    score_text,
)

SCORE_FOLDER = OutputFolder(
    "nv-esm score",
    "nv-esm-score/1",
    re.compile(rf"(part-\d{{5,}}\.csv|manifest\.json)({TEMPORARY_SUFFIX})?|\.nv-esm-score\.lock"),
    ".nv-esm-score.lock",
    "parts",
)
PLL_COLUMNS = ("pll", "pseudo_perplexity")
STATUS_COLUMN = "status"
DEFAULT_SCORE_COLUMN = "DMS_score"
DEFAULT_METHODS = ["masked_marginal"]


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    """The command line (`nv_esm.cli.parse_score_args`: declared there, without torch, so `--help` is quick)."""
    return parse_score_args(argv, prog)


@dataclass(frozen=True)
class ScoreSettings:
    """Everything that decides the numbers written (the parts folder's manifest; a rerun resumes only if equal)."""

    checkpoint: str  # a fingerprint of the weights (`checkpoint_fingerprint`)
    model_code: str  # what runs them: "installed", or "checkpoint" (--trust-remote-code, where its code differs)
    fasta_sha256: str
    mutants_sha256: str  # "" in FASTA mode
    mutant_column: str
    methods: tuple[str, ...]  # () in FASTA mode: PLL
    window: int
    invalid: str
    strip_stop: bool
    shard_size: int
    precision: str
    backend: str
    fp8: str  # `fp8_setting`: the FP8 layers and their scaling
    # Not here: --tokens-per-batch only packs the same copies differently (scores move by rounding: bf16, or a
    # batch's FP8 scales), and a rerun after running out of memory must be able to lower it.


@dataclass
class ScoreJob:
    """What the first pass found: the settings, the units (records, or rows of the CSV), their statuses, and the
    parts (unit indices each; a part's index names its file)."""

    settings: ScoreSettings
    statuses: list[str]  # per unit: "scored", "scored in windows" or "skipped: ..."
    parts: list[list[int]]
    records: list[Record] | None = None  # FASTA mode
    wild_type: str = ""  # mutant mode: the wild type's residues
    rows: list[dict[str, str]] | None = None  # mutant mode: the CSV's rows
    columns: list[str] | None = None  # mutant mode: the CSV's columns
    variants: dict[int, tuple[Substitution, ...]] | None = None  # mutant mode: per valid row


def plan_job(args: argparse.Namespace, config: Any, device: torch.device, window: int) -> ScoreJob:
    """Check every input (before the model loads) and cut the work into parts."""
    backend = command_backend(args, device)
    records, fasta_sha256 = scan_fasta(args.fasta, window, "window", args.invalid, args.strip_stop)
    own_code = runs_checkpoint_code(remote_code_differences(args.checkpoint), args.trust_remote_code)
    settings = dict(
        checkpoint=checkpoint_fingerprint(args.checkpoint, config),
        model_code="checkpoint" if own_code else "installed",
        fasta_sha256=fasta_sha256,
        mutant_column=args.mutant_column if args.mutants else "",
        methods=args.methods,
        window=window,
        invalid=args.invalid,
        strip_stop=args.strip_stop,
        shard_size=args.shard_size,
        precision=command_precision(device),
        backend=backend.name,
        fp8=fp8_setting(args.fp8, args.fp8_scaling),
    )
    if args.mutants is None:
        statuses = [_record_status(record.status) for record in records]
        valid = [i for i, status in enumerate(statuses) if status.startswith("scored")]
        parts = [
            [i for i in valid if start <= i < start + args.shard_size]
            for start in range(0, len(records), args.shard_size)
        ]
        job_settings = ScoreSettings(mutants_sha256="", **settings)
        return ScoreJob(job_settings, statuses, [part for part in parts if part], records=records)
    return _plan_mutants(args, records, ScoreSettings(mutants_sha256=file_sha256(args.mutants), **settings))


def _record_status(status: str) -> str:
    return {"embedded": "scored", "windowed": "scored in windows"}.get(status, status)


def _plan_mutants(args: argparse.Namespace, records: list[Record], settings: ScoreSettings) -> ScoreJob:
    if len(records) != 1 or records[0].status.startswith("skipped"):
        problem = "holds no valid record" if len(records) == 1 else f"holds {len(records)} records"
        raise ValueError(f"{args.fasta} {problem}; with --mutants it must hold the wild type alone.")
    with open(args.fasta, "rb") as raw:
        (_, sequence), *_ = iter_fasta(text_lines(raw, args.fasta), args.fasta)
    wild_type = protein_residues(sequence[: records[0].residues], f"{args.fasta}: the wild type")
    columns, rows = read_csv(args.mutants)
    added = [name for name in (*args.methods, STATUS_COLUMN) if name in columns]
    if args.mutant_column not in columns or added:
        problem = f"has no column {args.mutant_column!r}" if not added else f"has columns named {', '.join(added)}"
        found = ", ".join(map(repr, columns[:20])) + (f" and {len(columns) - 20} more" if len(columns) > 20 else "")
        raise ValueError(f"{args.mutants} {problem} (its columns: {found}); see --mutant-column.")
    if args.score_column and args.score_column not in columns:
        raise ValueError(f"{args.mutants} has no --score-column {args.score_column!r}.")
    statuses, variants = [], {}
    bad = BadRecords(args.mutants)  # with --invalid error: every bad row, named in one error
    for number, (row, line) in enumerate(rows, 1):
        name = f"{args.mutants}: row {number} (line {line}), column {args.mutant_column!r}"
        try:
            variants[number - 1] = check_variant(
                row[args.mutant_column], wild_type, args.methods, settings.window, name
            )
            statuses.append("scored")
        except ValueError as error:
            if args.invalid == "error":
                bad.append(str(error))
            statuses.append(f"skipped: {str(error).removeprefix(name + ': ').removesuffix('.')}")
    bad.raise_if_any(["--invalid skip leaves {them} unscored"])
    order = sorted(variants, key=lambda row: tuple(s.position for s in variants[row]))
    parts: list[list[int]] = [[]]
    for previous, row in zip([None, *order], order):
        same_group = previous is not None and _positions(variants[previous]) == _positions(variants[row])
        if len(parts[-1]) >= args.shard_size and not same_group:
            parts.append([])
        parts[-1].append(row)
    return ScoreJob(
        settings,
        statuses,
        [sorted(part) for part in parts if part],
        wild_type=wild_type,
        rows=[row for row, _ in rows],
        columns=columns,
        variants=variants,
    )


def _positions(substitutions: tuple[Substitution, ...]) -> tuple[int, ...]:
    return tuple(s.position for s in substitutions)


def read_csv(path: Path) -> tuple[list[str], list[tuple[dict[str, str | None], int]]]:
    """(columns, [(row, line number), ...]) of a CSV file with a header line (UTF-8, a byte-order mark dropped),
    parsed strictly (an unterminated quote is an error, not a field that runs to the end of the file); blank lines
    are skipped, a short row's missing fields are None. ValueError naming the file and line for text that is not
    UTF-8 or not CSV, or a row with more fields than the header."""
    rows = []
    with open(path, newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file, strict=True)
        try:
            columns = next(reader, [])
            repeated = sorted({name for name in columns if columns.count(name) > 1})
            if repeated:
                names = ", ".join(map(repr, repeated[:5]))
                raise ValueError(f"{path}, line 1: the header repeats {names}; each column needs a name of its own.")
            for fields in reader:
                if len(fields) > len(columns):
                    raise ValueError(
                        f"{path}, line {reader.line_num}: {len(fields)} fields, more than the header's "
                        f"{len(columns)} (a field holding a ',' needs quotes)."
                    )
                if fields:
                    rows.append((dict(itertools.zip_longest(columns, fields)), reader.line_num))
        except csv.Error as error:
            raise ValueError(f"{path}, line {reader.line_num}: not a valid CSV file ({error}).") from None
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error.reason}).") from None
    if not columns or not rows:
        raise ValueError(f"{path}: no header line or no rows.")
    return columns, rows


def parts_folder(output: Path) -> Path:
    """Where a run keeps its finished parts: `OUTPUT.parts/` beside the output."""
    return output.with_name(output.name + ".parts")


def part_name(part: int) -> str:
    return f"part-{part:05d}.csv"


def main(argv: list[str] | None = None, prog: str = "nv-esm score") -> int:
    clock = JobClock()
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)

    def score_on(device: torch.device, rank: int, world_size: int) -> None:
        refuse_overlap(written_paths(args.output), {  # before anything is read or written
            "the checkpoint": args.checkpoint,
            "the FASTA file": args.fasta,
            "the mutants CSV": args.mutants,
        })  # fmt: skip
        with clock.phase("input"):
            config = load_config(args.checkpoint)
            window = resolve_window(config, args.window, "--window")
            job = plan_job(args, config, device, window)  # before loading: a bad record or row stops the run at once
        check_output(args, job)  # and a finished output, or a parts folder of other settings, as `run` would refuse
        check_output_folder(parts_folder(args.output), job.settings, args.overwrite, SCORE_FOLDER)
        barrier(world_size)  # every rank has read the parts folder before rank 0 changes it
        with clock.phase("load"):
            tokenizer = load_tokenizer(args.checkpoint)
            model = load_masked_lm(args, config, job.settings.backend, device)
            scorer = Scorer(model, tokenizer, window, args.tokens_per_batch)
        run(args, scorer, job, rank, world_size, clock)

    kept = f"finished parts in {parts_folder(args.output)} are kept, a rerun resumes"
    return run_on_ranks(args.device, score_on, kept, prog)


def load_masked_lm(args: argparse.Namespace, config: Any, backend: str, device: torch.device) -> torch.nn.Module:
    """The masked-LM model a scoring command (`nv-esm score`, `nv-esm proteingym`) runs: `load_model` with its
    options (`--fp8`, `--fp8-scaling`, `--cuda-graphs`, which the model uses on Transformer Engine only,
    `--trust-remote-code`, `--no-progress`), without the contact head."""
    return load_model(
        args.checkpoint,
        config,
        backend,
        args.fp8,
        args.cuda_graphs is not False,
        device,
        args.trust_remote_code,
        fp8_scaling=args.fp8_scaling,
        masked_lm=True,
        contacts=False,
        progress=not args.no_progress,
    )


def load_tokenizer(checkpoint: str) -> Any:
    """The checkpoint's vocabulary read by the installed `NVEsmTokenizer` (never the folder's code), or a one-line
    error."""
    from tokenization_nv_esm import NVEsmTokenizer

    try:
        return NVEsmTokenizer.from_pretrained(checkpoint)
    except (OSError, TypeError, ValueError) as error:
        raise ValueError(f"{checkpoint}: no ESM tokenizer to read (vocab.txt): {error}".splitlines()[0]) from None


def written_paths(output: Path) -> dict[str, Path]:
    """Every path a run writes (`{what: path}`): OUTPUT, the plot beside it (`scatter_path`), and its parts folder
    (which holds its temporary files)."""
    return {"OUTPUT": output, "its plot": scatter_path(output), "its parts folder": parts_folder(output)}


def check_output(args: argparse.Namespace, job: ScoreJob) -> None:
    """Refuse to replace an existing output, or the plot beside it where the run draws one (`measured_column`),
    unless `--overwrite`, or unless the parts folder beside it holds a manifest and the output is there: the output
    (and its plot) is then a run's that was cut short after writing it, and `check_output_folder` refuses the
    folder if that run had other settings. (An empty parts folder, or one holding only its lock, says nothing of
    the output's settings.) Refuses an output named as its own plot (`scores.png`) in any case."""
    png = scatter_path(args.output)
    plots = measured_column(args, job) is not None
    if plots and png == args.output:
        raise ValueError(
            f"{args.output} is the name of the plot written beside the output; name the CSV e.g. "
            f"{args.output.with_suffix('.csv')}."
        )
    unfinished = (parts_folder(args.output) / MANIFEST_NAME).exists() and args.output.exists()
    for path in (args.output, png) if plots else (args.output,):
        if path.exists() and not unfinished and not args.overwrite:
            raise FileExistsError(f"{path} exists; pass --overwrite to replace it, or choose another output.")


def measured_column(args: argparse.Namespace, job: ScoreJob) -> str | None:
    """The mutants CSV's column of measured scores that the run ranks its scores against and plots them with
    (`--score-column`, else `DEFAULT_SCORE_COLUMN` where the CSV has it), or None (FASTA mode, or no such column)."""
    if job.columns is None:
        return None
    return args.score_column or (DEFAULT_SCORE_COLUMN if DEFAULT_SCORE_COLUMN in job.columns else None)


def run(
    args: argparse.Namespace,
    scorer: Scorer,
    job: ScoreJob,
    rank: int = 0,
    world_size: int = 1,
    clock: JobClock | None = None,
) -> None:
    """Score the missing parts (this rank's share of them), then (rank 0, after every rank) write the output and say
    where the time went (`clock`'s line; a clock from here on without one)."""
    clock = JobClock(time.time()) if clock is None else clock
    _run(args, scorer, job, rank, world_size, clock)
    if rank == 0:
        print(clock.line())


def _run(args: argparse.Namespace, scorer: Scorer, job: ScoreJob, rank: int, world_size: int, clock: JobClock) -> None:
    folder = parts_folder(args.output)
    check_output(args, job)  # again: another run may have finished this output while the model loaded
    with output_lock(folder, SCORE_FOLDER) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            prepare_output(folder, job.settings, args.overwrite, SCORE_FOLDER)
        barrier(world_size)
        columns = list(job.settings.methods or PLL_COLUMNS)
        missing = [k for k, units in enumerate(job.parts) if _read_part(folder / part_name(k), units, columns) is None]
        barrier(world_size)  # every rank has its list before any writes a part: all share one list
        mine = missing[rank::world_size]
        todo = sum(len(job.parts[k]) for k in mine)
        tokens = _tokens(scorer, job, mine)
        progress = ReportingProgress(progress_bar(tokens, "scoring", args.no_progress or rank != 0), clock)
        started = time.perf_counter()
        with clock.phase("batches"):
            for part, values in _score_parts(args, scorer, job, mine, progress):
                lines = [",".join(["unit", *columns])]
                lines += [",".join([str(u), *map(score_text, vs)]) for u, vs in zip(job.parts[part], values)]
                with clock.phase("writing"):
                    write_atomically(folder / part_name(part), "\n".join(lines) + "\n")
        progress.close()
        seconds = time.perf_counter() - started
        clock.batches_done(tokens, scorer.model)
        barrier(world_size)
        if rank == 0:
            with clock.phase("writing"):
                scores = {}
                for k, units in enumerate(job.parts):
                    found = _read_part(folder / part_name(k), units, columns)
                    if found is None:
                        raise RuntimeError(f"{folder / part_name(k)} is missing or does not hold the rows of its part.")
                    scores.update(found)
                _write_output(args, job, columns, scores)
                _report(args, job, columns, scores, len(job.parts) - len(missing), todo, seconds, world_size)
                for path in folder.iterdir():
                    if path.name != SCORE_FOLDER.lock_name:
                        path.unlink()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _tokens(scorer: Scorer, job: ScoreJob, mine: list[int]) -> int:
    """The tokens `_score_parts` runs through the model for these parts (the progress bar's total)."""
    if job.records is not None:
        return scorer.pll_tokens([job.records[unit].residues for part in mine for unit in job.parts[part]])
    return sum(
        scorer.variant_tokens(len(job.wild_type), [job.variants[row] for row in job.parts[part]], method)
        for part in mine
        for method in job.settings.methods
    )


def _score_parts(
    args: argparse.Namespace, scorer: Scorer, job: ScoreJob, mine: list[int], progress: Any
) -> Iterator[tuple[int, list[list[float]]]]:
    """(part, [per unit: its values]) of this rank's parts, in order."""
    wanted = set(mine)
    if job.records is None:
        wild_type = scorer.encode(job.wild_type)
        for part in mine:
            variants = [job.variants[row] for row in job.parts[part]]
            scores = [scorer.variant_scores(wild_type, variants, method, progress) for method in job.settings.methods]
            yield part, torch.stack(scores, 1).tolist()
        return
    # FASTA mode: parts are the shards of `records_by_shard`, read in a second pass over the file
    with open(args.fasta, "rb") as raw:
        part_of_shard = {min(units) // args.shard_size: k for k, units in enumerate(job.parts)}
        for shard, shard_records in records_by_shard(
            iter_fasta(text_lines(raw, args.fasta), args.fasta, empty_ok=True), job.records, args.shard_size
        ):
            part = part_of_shard.get(shard)
            if part not in wanted:
                continue
            sequences = [
                scorer.encode(protein_residues(sequence[: record.residues], record.id))
                for record, sequence in shard_records
                if job.statuses[record.number - 1].startswith("scored")
            ]
            likelihoods = map(SequenceLikelihood.of, scorer.position_log_likelihoods(sequences, progress))
            yield part, [[likelihood.pll, likelihood.pseudo_perplexity] for likelihood in likelihoods]


def _read_part(path: Path, units: list[int], columns: list[str]) -> dict[int, list[str]] | None:
    """{unit: its values as written} of a finished part, or None if missing, cut off or not this part's."""
    try:
        header, *lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None
    values = {}
    for line in lines:
        fields = line.split(",")
        if len(fields) != len(columns) + 1 or not fields[0].isdigit():
            return None
        values[int(fields[0])] = fields[1:]
    return values if header == ",".join(["unit", *columns]) and sorted(values) == units else None


def _write_output(args: argparse.Namespace, job: ScoreJob, columns: list[str], scores: dict[int, list[str]]) -> None:
    """The output CSV, every unit in the input order (skipped ones with empty scores), written atomically; the scores
    as `score_text` writes them (a part of an earlier version's run held more digits)."""

    def values(unit: int) -> list[str]:
        found = scores.get(unit)
        return [""] * len(columns) if found is None else [score_text(float(value)) for value in found]

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    if job.rows is None:
        writer.writerow(["id", "residues", *columns, STATUS_COLUMN])
        for index, record in enumerate(job.records):
            writer.writerow([record.id, record.residues, *values(index), job.statuses[index]])
    else:
        writer.writerow([*job.columns, *columns, STATUS_COLUMN])
        for index, row in enumerate(job.rows):
            cells = [row.get(column) or "" for column in job.columns]
            writer.writerow([*cells, *values(index), job.statuses[index]])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(args.output, text.getvalue())


def _report(
    args: argparse.Namespace,
    job: ScoreJob,
    columns: list[str],
    scores: dict[int, list[str]],
    reused: int,
    todo: int,
    seconds: float,
    world_size: int = 1,
) -> None:
    counts: dict[str, int] = {}
    for status in job.statuses:  # skipped rows by kind only: the status column has each reason
        kind = status.split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
    unit = "record" if job.rows is None else "row"
    where = " on rank 0" if world_size > 1 else ""
    rate = f"this run: {plural(todo, unit)} in {seconds:.1f} s ({todo / max(seconds, 1e-9):.1f} {unit}s/s{where})"
    parts = f"{reused} of {plural(len(job.parts), 'part')} {'was' if len(job.parts) == 1 else 'were'} already done"
    print(f"{plural(len(job.statuses), unit)} ({summary}); {parts}; {rate}; wrote {args.output}")
    measured = measured_column(args, job)
    if job.rows is None or measured is None:
        return
    pairs = []
    for index, values in scores.items():
        try:
            target = float(job.rows[index][measured])
        except (TypeError, ValueError):
            continue
        if math.isfinite(target):
            pairs.append((target, [float(value) for value in values]))
    rhos, panels = [], {}
    for m, method in enumerate(columns):
        rho, count = method_spearman([p[1][m] for p in pairs], [p[0] for p in pairs])
        finite = "" if count == len(pairs) else f" ({plural(count, 'row')} with a finite score)"
        rhos.append(f"{method} {rho:.4f}{finite}")
        panels[f"{method}: Spearman {rho:.3f}"] = [p[1][m] for p in pairs]
    print(f"Spearman's rho with {measured} ({plural(len(pairs), 'row')}): {', '.join(rhos)}")
    png = scatter_path(args.output)
    if plot_scores(panels, [p[0] for p in pairs], png, measured) is None:
        print(PLOTS_HINT.format(what=f"the scores against {measured}"), file=sys.stderr)
    else:
        print(f"wrote {png} (each method's scores against {measured})")


def scatter_path(output: Path) -> Path:
    """The picture of the scores against the measured values, beside the output: `scores.csv` -> `scores.png`."""
    return output.with_name(f"{output.stem if output.suffix else output.name}.png")


def method_spearman(scores: list[float], measured: list[float]) -> tuple[float, int]:
    """Spearman's rho of one method's `scores [n]` with the `measured` values `[n]` (finite) over the rows where
    the score is finite (a NaN or infinite score is dropped, not ranked), and how many rows that is."""
    kept = [(x, y) for x, y in zip(scores, measured) if math.isfinite(x)]
    rho = spearman([x for x, _ in kept], [y for _, y in kept])
    return math.nan if rho is None else rho, len(kept)


if __name__ == "__main__":
    sys.exit(main())
