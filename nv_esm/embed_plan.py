"""The plan of an `nv-esm embed` run: the first pass over the FASTA file and the settings it fixes.

`plan_run` checks the command's arguments against the checkpoint and reads every record once (`scan_fasta`: ids
unique, ESM-2's letters by `modeling_nv_esm.protein_residues`, lengths against `--max-length`), so a bad record
stops the run before any work, with its id. `EmbedSettings` are what decides the numbers written (the manifest);
`Record` is one record as the first pass found it. In the second pass, `records_by_shard` pairs the file's records
with the plan, shard by shard, and `pieces_of` cuts a protein into the model's inputs (`Piece`: whole, cropped or
windowed).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import modeling_nv_esm
from modeling_nv_esm_batch import STOP_MARK, protein_residues
from nv_esm.alphabet import CLS, EOS, iter_fasta, text_lines
from nv_esm.checkpoint_io import chunk_digests
from nv_esm.options import fp8_refusal
from nv_esm.records import BadRecords, residue_ids
from nv_esm.vocabulary import COMMAND_FP8_RECIPE as COMMAND_FP8_RECIPE
from nv_esm.vocabulary import FP8_SCALINGS as FP8_SCALINGS
from nv_esm.vocabulary import OUTPUTS as OUTPUTS
from nv_esm.vocabulary import SAVE_DTYPE_NAMES
from nv_esm.vocabulary import TOO_LONG_POLICIES as TOO_LONG_POLICIES

SAVE_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}  # --save-dtype's


# The commands' FP8 scaling (`--fp8-scaling`). Block scaling by default (Float8BlockScaling: one scale per 128 features
# of each token's activations, per 128 x 128 block of a weight): a token's FP8 values depend on that token alone, so
# an embedding or a score does not depend on the proteins packed beside it, nor on anything that ran before.
# Current scaling (one scale per tensor, from the batch's own tensors) is the faster option; its numbers move with
# the other proteins of a batch. Never delayed scaling (the model's default): TE updates its scales from the amax
# history only in forwards with gradients, so inference would run every batch at the initial scale 1.
# `FP8_SCALINGS` and `COMMAND_FP8_RECIPE` are declared in nv_esm.vocabulary (the parsers import no torch).


def fp8_setting(fp8: str, fp8_scaling: str) -> str:
    """What a manifest records of `--fp8` and `--fp8-scaling`: "off", or e.g. "all, block scaling"."""
    return fp8 if fp8 == "off" else f"{fp8}, {fp8_scaling} scaling"


@dataclass(frozen=True)
class EmbedSettings:
    """Everything that decides the numbers written (the manifest; a rerun resumes only if they are equal)."""

    checkpoint: str  # a fingerprint of the weights (`checkpoint_fingerprint`), not how the path was spelled
    fasta_sha256: str
    precision: str  # "bf16" (CUDA) or "fp32" (CPU)
    layers: tuple[int, ...]  # absolute: 0 (embedding output) .. num_hidden_layers
    include: tuple[str, ...]
    max_length: int  # residues
    too_long: str
    invalid: str
    strip_stop: bool
    shard_size: int
    backend: str
    fp8: str  # `fp8_setting`: "off", or the FP8 layers and their scaling
    save_dtype: str


@dataclass
class Record:
    """One FASTA record as the first pass found it."""

    id: str
    number: int  # 1-based position in the file
    residues: int  # after a stop mark is removed
    status: str  # embedded | cropped | windowed | skipped: too long | skipped: invalid letter | skipped: empty
    stop_removed: bool = False  # a trailing '*' removed (--strip-stop)


@dataclass
class Piece:
    """One model input: a whole protein, its crop, or one window of it."""

    row: int  # the protein's row in its shard
    start: int  # first residue of the piece in the protein
    tokens: torch.Tensor  # [residues + 2] int64, `<cls>` and `<eos>` included


def scan_fasta(
    path: Path, max_length: int, too_long: str, invalid: str, strip_stop: bool = False
) -> tuple[list[Record], str]:
    """First pass: every record's id, length and status, and the file's SHA-256. Raises one `ValueError` listing
    every bad record of the file (`BadRecords`: the first `LISTED_PROBLEMS`, and how many more), each named:
    a duplicate id (whatever `invalid` says: the error says which records --invalid skip would take, and that it
    does not apply to a duplicate id) or a missing one, an empty record or an invalid letter
    (`modeling_nv_esm.protein_residues`, with `invalid="error"`; with "skip" the record is skipped and the index
    says why) or a protein longer than `max_length` residues (with `too_long="error"`). `strip_stop`: a trailing
    '*' is removed, not refused."""
    records: list[Record] = []
    bad = BadRecords(path)  # every bad record, in file order
    hints: dict[str, None] = {}  # the options that would take the refused records, in the order first needed
    first_seen: dict[str, int] = {}
    counts = {"invalid": 0, "duplicate": 0}  # refused records: for their letters (or none), for a repeated id
    digest = hashlib.sha256()
    with open(path, "rb") as raw:
        lines = text_lines(raw, path, digest)
        for number, (header, sequence) in enumerate(iter_fasta(lines, path, empty_ok=True), 1):
            record_id = header.split()[0] if header.split() else ""
            if not record_id:
                bad.append(f"{path}: record {number} has no id (an empty '>' header line).")
                continue
            if record_id in first_seen:  # refused whatever --invalid says: which copy is meant is the user's call
                bad.append(
                    f"{path}: id {record_id!r} appears twice (records {first_seen[record_id]} and {number}); "
                    "ids name the outputs, so they must be unique: rename or remove a copy (--invalid skip does not "
                    "apply to duplicate ids)."
                )
                counts["duplicate"] += 1
                continue
            first_seen[record_id] = number
            stop_removed = strip_stop and sequence.endswith(STOP_MARK)
            residues = len(sequence) - stop_removed
            try:
                protein_residues(sequence, f"{path}: record {record_id!r} (record {number})", strip_stop)
                problem = None
            except ValueError as error:
                problem = str(error)
            if problem is not None:
                if invalid == "error":
                    bad.append(problem)
                    counts["invalid"] += 1
                    hints["--invalid skip skips {them}"] = None
                status = "skipped: empty" if residues == 0 else "skipped: invalid letter"
            elif residues <= max_length:
                status = "embedded"
            elif too_long == "error":
                bad.append(
                    f"{path}: record {record_id!r} (record {number}) has {residues} residues, more than "
                    f"--max-length {max_length}."
                )
                hints["choose --too-long skip, crop or window, or raise --max-length"] = None
                status = "skipped: too long"
            else:
                status = {"skip": "skipped: too long", "crop": "cropped", "window": "windowed"}[too_long]
            records.append(Record(record_id, number, residues, status, stop_removed))
    if bad:
        if counts["invalid"] and counts["duplicate"]:  # --invalid skip takes the records of bad letters, not those
            which = "the record" if counts["invalid"] == 1 else f"the {counts['invalid']} records"
            skip = (
                f"--invalid skip skips {which} with letters outside the alphabet or no residues, not the duplicate ids"
            )
            hints = {skip if hint.startswith("--invalid skip") else hint: None for hint in hints}
        raise bad.error(hints)
    if not records:
        raise ValueError(f"{path}: no FASTA records.")
    return records, digest.hexdigest()


def tokenize(sequence: str) -> torch.Tensor:
    """`[residues + 2]` int64 ids: `<cls>`, one per residue (either case; lower case reads as upper case), `<eos>`,
    by `nv_esm.data.residue_ids`' byte table (the GPU waits while a shard is tokenized). A character outside the
    alphabet raises ValueError: the first pass refused them, so the file changed since."""
    try:
        ids = residue_ids(sequence)
    except ValueError as error:
        raise ValueError(f"{error} The first pass took it: the FASTA file changed during the run.") from None
    return torch.frombuffer(bytearray([CLS]) + ids + bytearray([EOS]), dtype=torch.uint8).long()


def pieces_of(row: int, sequence: str, status: str, max_length: int) -> list[Piece]:
    """The model inputs of one protein: itself; its first `max_length` residues (`cropped`); or windows of
    `max_length` residues every `max_length // 2` residues, the last one ending at the protein's end (`windowed`)."""
    if status == "cropped":
        sequence = sequence[:max_length]
    if status != "windowed":
        return [Piece(row, 0, tokenize(sequence))]
    stride = max(max_length // 2, 1)
    starts = [*range(0, len(sequence) - max_length, stride), len(sequence) - max_length]
    return [Piece(row, start, tokenize(sequence[start : start + max_length])) for start in starts]


def embedded_residues(residues: int, status: str, max_length: int) -> int:
    """Residues of a protein that reach the outputs: a crop keeps `max_length` of them."""
    return min(residues, max_length) if status == "cropped" else residues


def checkpoint_fingerprint(checkpoint: str, config: Any) -> str:
    """What identifies the weights and the ids they read, however the path is spelled: for a folder, SHA-256 over
    config.json, vocab.txt and every byte of each weight file (as `chunk_digests`, the digests of its 64 MiB pieces,
    hashed in parallel: a file edited in place, even to the same size, changes it); for a Hub id, the id and its
    commit."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        return f"{checkpoint}@{getattr(config, '_commit_hash', None) or 'unknown revision'}"
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.iterdir()):
        if path.name == "vocab.txt":
            digest.update(b"vocab.txt:" + path.read_bytes())
        if path.suffix not in (".safetensors", ".bin"):
            continue
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        digest.update(chunk_digests(path))
    return f"sha256-64MiB-pieces:{digest.hexdigest()}"


def command_backend(args: argparse.Namespace, device: torch.device) -> Any:
    """The layers' backend of `--backend` on `device` (`modeling_nv_esm.resolve_backend`); ValueError, naming the
    option given, where `--fp8` (`options.fp8_refusal`, as `nv-esm train` says it) or an explicit `--cuda-graphs` asks
    for what it cannot run."""
    backend = modeling_nv_esm.resolve_backend(args.backend, device)
    if args.fp8 != "off" and not backend.runs_fp8:
        raise ValueError(fp8_refusal(args.fp8, backend.name, device))
    if args.cuda_graphs and not backend.runs_cuda_graphs:  # --cuda-graphs asked for, not the default
        raise ValueError(
            f"--cuda-graphs replays Transformer Engine layers on a CUDA GPU (backend te); this run has backend "
            f"{backend.name} on {device} (drop --cuda-graphs)."
        )
    return backend


def command_precision(device: torch.device) -> str:
    """The commands' precision on `device`, as the manifests record it: bf16 on CUDA (`embed_model.load_model`'s
    weights, `inference_autocast`), fp32 on the CPU."""
    return "bf16" if device.type == "cuda" else "fp32"


def plan_run(args: argparse.Namespace, config: Any, device: torch.device) -> tuple[EmbedSettings, list[Record]]:
    """Check the arguments against the checkpoint and make the first pass over the FASTA file."""
    longest = config.max_protein_length - 2
    max_length = longest if args.max_length is None else args.max_length
    if not 1 <= max_length <= longest:
        raise ValueError(f"--max-length must be 1 to {longest} (the checkpoint's max_protein_length - 2).")
    states = config.num_hidden_layers + 1
    if any(not -states <= layer < states for layer in args.layers):
        raise ValueError(
            f"--layers must be in [{-states}, {states - 1}] for this {config.num_hidden_layers}-layer model."
        )
    backend = command_backend(args, device)
    records, fasta_sha256 = scan_fasta(args.fasta, max_length, args.too_long, args.invalid, args.strip_stop)
    settings = EmbedSettings(
        checkpoint=checkpoint_fingerprint(args.checkpoint, config),
        fasta_sha256=fasta_sha256,
        precision=command_precision(device),
        layers=tuple(sorted({layer % states for layer in args.layers})),
        include=tuple(output for output in OUTPUTS if output in args.include),
        max_length=max_length,
        too_long=args.too_long,
        invalid=args.invalid,
        strip_stop=args.strip_stop,
        shard_size=args.shard_size,
        backend=backend.name,
        fp8=fp8_setting(args.fp8, args.fp8_scaling),
        save_dtype=args.save_dtype,
    )
    return settings, records


def token_budget_warning(tokens_per_batch: int, records: list[Record], max_length: int, path: Path) -> str | None:
    """What to tell the user when model inputs of the embedded `records` (their residues, or `max_length` of a crop
    or window, plus `<cls>` and `<eos>`) are longer than `--tokens-per-batch`: each runs alone, in a batch over the
    budget. None when every input fits."""
    over = [
        (min(record.residues, max_length) + 2, record)
        for record in records
        if not record.status.startswith("skipped") and min(record.residues, max_length) + 2 > tokens_per_batch
    ]
    if not over:
        return None
    tokens, longest = max(over, key=lambda pair: pair[0])
    return (
        f"{len(over)} of {path}'s proteins have more tokens than --tokens-per-batch {tokens_per_batch} (the longest, "
        f"record {longest.id!r}, {tokens}): each runs alone, in a batch over the budget; --tokens-per-batch {tokens} "
        "keeps every batch within it."
    )


def records_by_shard(
    sequences: Iterator[tuple[str, str]], records: list[Record], shard_size: int
) -> Iterator[tuple[int, list[tuple[Record, str]]]]:
    """(shard, [(record, sequence), ...]) in file order, pairing the second pass with the first pass's records."""
    batch: list[tuple[Record, str]] = []
    position = -1
    for position, (header, sequence) in enumerate(sequences):
        record = records[position] if position < len(records) else None
        if record is None or header.split()[0] != record.id or len(sequence) != record.residues + record.stop_removed:
            raise ValueError(f"the FASTA file changed during the run (at record {position + 1}); run again.")
        batch.append((record, sequence))
        if len(batch) == shard_size:
            yield position // shard_size, batch
            batch = []
    if position + 1 != len(records):
        raise ValueError(f"the FASTA file changed during the run (it ends after {position + 1} records); run again.")
    if batch:
        yield (len(records) - 1) // shard_size, batch
