"""`nv-esm embed`: a FASTA file of any size -> embeddings of an NVEsm checkpoint, in safetensors shards + an index.

    nv-esm embed ./esm2_650M_te proteins.fasta ./embeddings                       # mean over residues, last layer
    nv-esm embed ./esm2_650M_te proteins.fasta ./out --layers -1 -5 --include mean per_residue contacts
    torchrun --nproc-per-node 8 -m nv_esm embed ./esm2_650M_te proteins.fasta ./out   # a slice of shards per rank

The FASTA file is read twice and never held: a first pass checks every record (ids unique, letters of ESM-2's
alphabet, lengths against `--max-length`) and fixes the plan, so a bad record stops the run before any work, with
its id; the second pass embeds shard after shard. Record k (0-based, in file order) belongs to shard
`k // --shard-size`; a shard is computed by rank `shard % world_size`, written to a temporary name and renamed, so
a rerun with the same settings skips finished shards. `index.tsv` (written last, by rank 0) has one row per record:
id, record number, residues, status, shard file, row, residues embedded and whether a stop mark was removed.

Shard `embeddings-00000.safetensors` holds, for the proteins it embedded (in file order; ids in its metadata):
`mean.layer_{L}` / `cls.layer_{L}` `[n, hidden]`; `per_residue.layer_{L}` `[R, hidden]` with `residue_offsets`
`[n + 1]` (protein i's residues are rows `residue_offsets[i]:residue_offsets[i + 1]`); `contacts` `[C]` with
`contact_offsets [n + 1]` (protein i's `[r, r]` contact probabilities flattened). L counts layers as
`hidden_states` does: 0 the embedding output, `num_hidden_layers` the last (final LayerNorm applied).
`iter_embeddings(folder)` reads them back.

Precision: bf16 weights and autocast on CUDA, fp32 on the CPU; `--fp8` runs Transformer Engine FP8 layers and
the layers replay as CUDA graphs on Transformer Engine (the model's `cuda_graphs` default; other layers than the
last, and contacts, run eagerly; `--no-cuda-graphs` runs all eagerly).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

import modeling_nv_esm
from configuration_nv_esm import BACKENDS, FP8_LAYER_CHOICES, fp8_layer_precision
from nv_esm.alphabet import CLS, EOS, iter_fasta
from nv_esm.checkpoint_io import update_digest
from nv_esm.data import residue_ids

FORMAT = "nv-esm-embed/1"
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.tsv"
SHARD_PREFIX = "embeddings-"
OUTPUTS = ("mean", "cls", "per_residue", "contacts")
TOO_LONG_POLICIES = ("error", "skip", "crop", "window")
INVALID_POLICIES = ("error", "skip")
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The process's umask, read once here (reading it sets it, which shard-writing threads must not race with).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
# Settings added to the manifest after runs were written without them: the value they had then.
_SETTINGS_BEFORE = {"strip_stop": False}
SHARD_PATTERN = re.compile(r"embeddings-(\d{5,})\.safetensors")
LOCK_NAME = ".nv-esm-embed.lock"
OUR_NAMES = re.compile(r"(embeddings-\d{5,}\.safetensors|manifest\.json|index\.tsv)(\.tmp)?|\.nv-esm-embed\.lock")


# --------------------------------------------------------------------------------------------------------------
# Settings and the plan of a run
# --------------------------------------------------------------------------------------------------------------


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
    fp8: str
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
    """First pass: every record's id, length and status, and the file's SHA-256. Raises `ValueError` naming the
    record for a duplicate or missing id, an empty record or an invalid letter (`modeling_nv_esm.protein_residues`,
    with `invalid="error"`; with "skip" the record is skipped and the index says why) or a protein longer than
    `max_length` residues (with `too_long="error"`). `strip_stop`: a trailing '*' is removed, not refused."""
    records: list[Record] = []
    first_seen: dict[str, int] = {}
    digest = hashlib.sha256()
    with open(path, "rb") as raw:
        lines = _text_lines(raw, path, digest)
        for number, (header, sequence) in enumerate(iter_fasta(lines, path, empty_ok=True), 1):
            record_id = header.split()[0] if header.split() else ""
            if not record_id:
                raise ValueError(f"{path}: record {number} has no id (an empty '>' header line).")
            if record_id in first_seen:
                raise ValueError(
                    f"{path}: id {record_id!r} appears twice (records {first_seen[record_id]} and {number}); "
                    "ids name the outputs, so they must be unique."
                )
            first_seen[record_id] = number
            stop_removed = strip_stop and sequence.endswith(modeling_nv_esm.STOP_MARK)
            residues = len(sequence) - stop_removed
            try:
                modeling_nv_esm.protein_residues(
                    sequence, f"{path}: record {record_id!r} (record {number})", strip_stop
                )
                problem = None
            except ValueError as error:
                problem = str(error)
            if problem is not None:
                if invalid == "error":
                    raise ValueError(f"{problem.removesuffix('.')} (--invalid skip skips it).")
                status = "skipped: empty" if residues == 0 else "skipped: invalid letter"
            elif residues <= max_length:
                status = "embedded"
            elif too_long == "error":
                raise ValueError(
                    f"{path}: record {record_id!r} (record {number}) has {residues} residues, more than "
                    f"--max-length {max_length}; choose --too-long skip, crop or window, or raise --max-length."
                )
            else:
                status = {"skip": "skipped: too long", "crop": "cropped", "window": "windowed"}[too_long]
            records.append(Record(record_id, number, residues, status, stop_removed))
    if not records:
        raise ValueError(f"{path}: no FASTA records.")
    return records, digest.hexdigest()


def _text_lines(raw: IO[bytes], path: Path, digest: Any = None) -> Iterator[str]:
    """UTF-8 lines of a binary file (a byte-order mark skipped), each fed to `digest` first."""
    for number, line in enumerate(raw, 1):
        if digest is not None:
            digest.update(line)
        try:
            yield line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}, line {number}: not UTF-8 text ({error.reason} at byte {error.start}).") from None


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


def shard_name(shard: int) -> str:
    return f"{SHARD_PREFIX}{shard:05d}.safetensors"


# --------------------------------------------------------------------------------------------------------------
# Embedding one shard
# --------------------------------------------------------------------------------------------------------------


class ShardEmbedder:
    """Runs the model over the proteins of one shard, length-sorted and packed to a token budget.

    On CUDA nothing in the loop waits for the GPU but the results of the batch before: inputs go up from pinned
    memory and results come back into pinned memory without blocking, so the GPU runs batch k while the CPU packs
    batch k + 1 and files the results of batch k - 1 (the model is loaded without data-dependent input checks, which
    would wait for the GPU: the command builds the packed inputs itself).
    """

    def __init__(self, model: torch.nn.Module, settings: EmbedSettings, max_tokens: int) -> None:
        self.model = model
        self.settings = settings
        self.max_tokens = max_tokens
        self.device = model.embeddings.word_embeddings.weight.device
        self.last_layer = model.config.num_hidden_layers

    def __call__(self, sequences: list[str], statuses: list[str], progress: Any) -> dict[str, torch.Tensor]:
        """The shard's tensors (see the module docstring) for `sequences` (all embedded; statuses say how)."""
        pieces = [
            piece
            for row, (sequence, status) in enumerate(zip(sequences, statuses))
            for piece in pieces_of(row, sequence, status, self.settings.max_length)
        ]
        lengths = [
            embedded_residues(len(sequence), status, self.settings.max_length)
            for sequence, status in zip(sequences, statuses)
        ]
        outputs = _ShardOutputs(lengths, statuses, self.settings, self.model.config.hidden_size)
        pieces_left = [0] * len(sequences)
        for piece in pieces:
            pieces_left[piece.row] += 1
        in_flight: _BatchResults | None = None
        for batch in modeling_nv_esm.length_sorted_batches([piece.tokens for piece in pieces], self.max_tokens):
            batch_pieces = [pieces[index] for index in batch]
            launched = self._launch(batch_pieces, outputs.needs_residues(batch_pieces))
            if in_flight is not None:
                progress.update(self._collect(in_flight, outputs, pieces_left))
            in_flight = launched
        if in_flight is not None:
            progress.update(self._collect(in_flight, outputs, pieces_left))
        return outputs.tensors()

    @torch.no_grad()
    def _launch(self, pieces: list[Piece], need_residues: bool) -> _BatchResults:
        """Queue one packed batch on the device; its results arrive in host memory once `ready` is reached."""
        packed = modeling_nv_esm.pack_proteins([piece.tokens for piece in pieces])
        num_tokens = packed["input_ids"].shape[1]
        input_ids = self._upload(packed["input_ids"])
        cu_seq_lens = self._upload(packed["cu_seq_lens_q"])
        packing = {"cu_seq_lens_q": cu_seq_lens, "max_length_q": packed["max_length_q"]}
        residue_positions = None
        if need_residues:  # found on the CPU: a boolean index on the device would wait for it
            is_residue = modeling_nv_esm.residue_token_mask(packed["cu_seq_lens_q"], num_tokens)
            residue_positions = self._upload(is_residue.nonzero().squeeze(1))
        layers = self.settings.layers
        with self._autocast():
            output = self.model(input_ids, output_hidden_states=layers != (self.last_layer,), **packing)
            contacts = (
                self.model.predict_contacts(input_ids, **packing) if "contacts" in self.settings.include else None
            )
        results = _BatchResults(pieces)
        for layer in layers:
            states = (output.last_hidden_state if output.hidden_states is None else output.hidden_states[layer])[0]
            states = states.float()
            results.cls[layer] = self._download(modeling_nv_esm.pool_proteins(states, cu_seq_lens, "cls"))
            results.mean[layer] = self._download(modeling_nv_esm.pool_proteins(states, cu_seq_lens, "mean"))
            if residue_positions is not None:
                results.residues[layer] = self._download(states.index_select(0, residue_positions))
        if contacts is not None:
            results.contacts = self._download(contacts.float())
        if self.device.type == "cuda":
            results.ready = torch.cuda.Event()
            results.ready.record()
        return results

    def _collect(self, results: _BatchResults, outputs: _ShardOutputs, pieces_left: list[int]) -> int:
        """File a launched batch's results (waiting for them if needed); the number of proteins it finished."""
        if results.ready is not None:
            results.ready.synchronize()
        for layer in self.settings.layers:
            residues = results.residues.get(layer)
            if residues is not None and residues.is_pinned():  # the shard keeps views of them: leave the pinned
                residues = residues.clone()  # buffer to the allocator's cache (the rest is copied out by `add`)
            outputs.add(layer, results.pieces, results.cls[layer], results.mean[layer], residues)
        if results.contacts is not None:
            outputs.add_contacts(results.pieces, results.contacts)
        finished = 0
        for piece in results.pieces:  # a protein is done when its last piece (window) is
            pieces_left[piece.row] -= 1
            finished += pieces_left[piece.row] == 0
        return finished

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return tensor.to(self.device)
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _download(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")


@dataclass
class _BatchResults:
    """One launched batch's per-layer results in host memory (complete once the `ready` event is reached)."""

    pieces: list[Piece]
    cls: dict[int, torch.Tensor] = field(default_factory=dict)  # [n, hidden]
    mean: dict[int, torch.Tensor] = field(default_factory=dict)  # [n, hidden]
    residues: dict[int, torch.Tensor] = field(default_factory=dict)  # [residues of the batch, hidden]
    contacts: torch.Tensor | None = None  # [n, L - 2, L - 2]
    ready: Any = None  # torch.cuda.Event on CUDA


class _ShardOutputs:
    """Per-protein results of a shard, filled piece by piece; windows are averaged residue by residue."""

    def __init__(self, lengths: list[int], statuses: list[str], settings: EmbedSettings, hidden: int) -> None:
        self.lengths = lengths
        self.statuses = statuses
        self.settings = settings
        count = len(lengths)
        self.cls = {layer: torch.zeros(count, hidden) for layer in settings.layers}
        self.mean = {layer: torch.zeros(count, hidden) for layer in settings.layers}
        self.residues: dict[int, list[torch.Tensor | None]] = {layer: [None] * count for layer in settings.layers}
        self.windows = [0] * count
        self.coverage: list[torch.Tensor | None] = [None] * count
        self.contacts: list[torch.Tensor | None] = [None] * count

    def needs_residues(self, pieces: list[Piece]) -> bool:
        """Whether a batch of `pieces` needs its residue states: per-residue outputs, or windows to stitch."""
        return "per_residue" in self.settings.include or any(self.statuses[p.row] == "windowed" for p in pieces)

    def add(
        self, layer: int, pieces: list[Piece], cls: torch.Tensor, mean: torch.Tensor, residues: torch.Tensor | None
    ) -> None:
        offset = 0
        for index, piece in enumerate(pieces):
            count = len(piece.tokens) - 2
            self.cls[layer][piece.row] += cls[index]
            if self.statuses[piece.row] != "windowed":
                self.mean[layer][piece.row] = mean[index]
                if "per_residue" in self.settings.include:
                    self.residues[layer][piece.row] = residues[offset : offset + count]
            else:
                total = self.residues[layer][piece.row]
                if total is None:
                    total = self.residues[layer][piece.row] = torch.zeros(self.lengths[piece.row], cls.shape[1])
                total[piece.start : piece.start + count] += residues[offset : offset + count]
                if layer == self.settings.layers[0]:
                    self.windows[piece.row] += 1
                    if self.coverage[piece.row] is None:
                        self.coverage[piece.row] = torch.zeros(self.lengths[piece.row])
                    self.coverage[piece.row][piece.start : piece.start + count] += 1
            offset += count

    def add_contacts(self, pieces: list[Piece], contacts: torch.Tensor) -> None:
        for index, piece in enumerate(pieces):
            count = len(piece.tokens) - 2
            self.contacts[piece.row] = contacts[index, :count, :count].clone()

    def tensors(self) -> dict[str, torch.Tensor]:
        dtype = SAVE_DTYPES[self.settings.save_dtype]
        for row, status in enumerate(self.statuses):
            if status == "windowed":  # residues: mean over the windows holding each; cls: mean over windows
                for layer in self.settings.layers:
                    self.residues[layer][row] /= self.coverage[row][:, None]
                    self.mean[layer][row] = self.residues[layer][row].mean(0)
                    self.cls[layer][row] /= self.windows[row]
        result: dict[str, torch.Tensor] = {}
        for layer in self.settings.layers:
            if "mean" in self.settings.include:
                result[f"mean.layer_{layer}"] = self.mean[layer].to(dtype)
            if "cls" in self.settings.include:
                result[f"cls.layer_{layer}"] = self.cls[layer].to(dtype)
            if "per_residue" in self.settings.include:
                result[f"per_residue.layer_{layer}"] = _cat(self.residues[layer], (0, self.cls[layer].shape[1]), dtype)
        if "per_residue" in self.settings.include:
            result["residue_offsets"] = _offsets(self.lengths)
        if "contacts" in self.settings.include:
            result["contacts"] = _cat([contacts.flatten() for contacts in self.contacts], (0,), dtype)
            result["contact_offsets"] = _offsets([length * length for length in self.lengths])
        return result


def _cat(tensors: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(tensors).to(dtype) if tensors else torch.zeros(empty_shape, dtype=dtype)


def _offsets(counts: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)


# --------------------------------------------------------------------------------------------------------------
# The output folder
# --------------------------------------------------------------------------------------------------------------


def prepare_output(folder: Path, settings: EmbedSettings, overwrite: bool) -> None:
    """Create `folder`, or check that it holds an earlier run of this command with equal settings (its finished
    shards are then kept). Refuses a folder with anything else in it; with other settings, refuses unless
    `overwrite`, which deletes only the files this command writes (the manifest last)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = list(folder.iterdir())
    foreign = sorted(path.name for path in entries if not (path.is_file() and OUR_NAMES.fullmatch(path.name)))
    if foreign:
        raise FileExistsError(
            f"{folder} holds files nv-esm embed did not write ({', '.join(foreign[:5])}); choose a new or empty folder."
        )
    manifest = folder / MANIFEST_NAME
    current = {"format": FORMAT, **_jsonable(settings)}
    if any(path.name != LOCK_NAME for path in entries) and not manifest.exists():
        raise FileExistsError(
            f"{folder} holds shards but no {MANIFEST_NAME}: their settings are unknown; choose a new or empty folder."
        )
    if manifest.exists():
        earlier = {**_SETTINGS_BEFORE, **_read_manifest(manifest)}
        changed = sorted(key for key in current.keys() | earlier.keys() if current.get(key) != earlier.get(key))
        if changed and not overwrite:
            details = "; ".join(f"{key}: {earlier.get(key)!r} -> {current.get(key)!r}" for key in changed)
            raise FileExistsError(
                f"{folder} holds a run with other settings ({details}). Its shards would not match: pass "
                "--overwrite to delete them, or choose another folder."
            )
        if changed:
            for path in sorted(entries, key=lambda path: path.name == MANIFEST_NAME):
                if path.name != LOCK_NAME:
                    path.unlink()
    for stale in folder.glob("*.tmp"):
        stale.unlink()
    _write_atomically(manifest, json.dumps(current, indent=2) + "\n")


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a manifest of nv-esm embed ({error}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a manifest of nv-esm embed (format {FORMAT}).")
    return manifest


def _jsonable(settings: EmbedSettings) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(settings).items()}


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def write_shard(path: Path, tensors: dict[str, torch.Tensor], ids: list[str]) -> None:
    """`tensors` as safetensors under `path` (written to a temporary name, synced, then renamed), ids in metadata."""
    temporary = path.with_name(path.name + ".tmp")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, temporary, {"ids": json.dumps(ids)})
    temporary.chmod(0o666 & ~_UMASK)  # as index.tsv and manifest.json (safetensors writes 0600)
    with open(temporary, "rb") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)


def shard_ids(path: Path) -> list[str] | None:
    """The ids a finished shard holds, or None if `path` is missing or not a readable shard."""
    try:
        with safe_open(path, "pt") as shard:
            return json.loads(shard.metadata()["ids"])
    except Exception:  # missing, cut off, or not ours: not finished
        return None


def index_rows(records: list[Record], shard_size: int, max_length: int) -> list[tuple[Record, int, str, int, int]]:
    """(record, shard, shard file, row, residues embedded) per record; skipped: ("", -1, 0)."""
    rows, row, current = [], 0, -1
    for position, record in enumerate(records):
        shard = position // shard_size
        row = 0 if shard != current else row
        current = shard
        if record.status.startswith("skipped"):
            rows.append((record, shard, "", -1, 0))
            continue
        used = embedded_residues(record.residues, record.status, max_length)
        rows.append((record, shard, shard_name(shard), row, used))
        row += 1
    return rows


def write_index(folder: Path, records: list[Record], shard_size: int, max_length: int) -> None:
    """`index.tsv`: id, record, residues, status, shard, row, embedded_residues. Checks first that every shard is
    there and holds the ids the index gives it."""
    rows = index_rows(records, shard_size, max_length)
    expected: dict[str, list[str]] = {}
    for record, _, name, _, _ in rows:
        if name:
            expected.setdefault(name, []).append(record.id)
    for name, ids in expected.items():
        if shard_ids(folder / name) != ids:
            raise RuntimeError(f"{folder / name} is missing or does not hold the proteins the index gives it.")
    lines = ["id\trecord\tresidues\tstatus\tshard\trow\tembedded_residues\tstop_removed"]
    for record, _, name, row, used in rows:
        stop = "yes" if record.stop_removed else "no"
        lines.append(f"{record.id}\t{record.number}\t{record.residues}\t{record.status}\t{name}\t{row}\t{used}\t{stop}")
    _write_atomically(folder / INDEX_NAME, "\n".join(lines) + "\n")


def iter_embeddings(folder: str | Path) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(id, outputs) of every embedded protein of a finished `nv-esm embed` folder, in FASTA order. Outputs are
    keyed as in the shards: `mean.layer_L`/`cls.layer_L` `[hidden]`, `per_residue.layer_L` `[residues, hidden]`,
    `contacts` `[residues, residues]`. Raises if the run has not finished (no index.tsv)."""
    folder = Path(folder)
    if not (folder / INDEX_NAME).exists():
        raise FileNotFoundError(f"{folder} has no {INDEX_NAME}: the run has not finished (a rerun completes it).")
    names = [path.name for path in folder.iterdir() if SHARD_PATTERN.fullmatch(path.name)]
    for name in sorted(names, key=lambda name: int(SHARD_PATTERN.fullmatch(name).group(1))):
        with safe_open(folder / name, "pt") as shard:
            ids = json.loads(shard.metadata()["ids"])
            tensors = {key: shard.get_tensor(key) for key in shard.keys()}
        residue_offsets = tensors.pop("residue_offsets", None)
        contact_offsets = tensors.pop("contact_offsets", None)
        for row, protein_id in enumerate(ids):
            outputs = {}
            for key, tensor in tensors.items():
                if key.startswith("per_residue."):
                    outputs[key] = tensor[residue_offsets[row] : residue_offsets[row + 1]]
                elif key == "contacts":
                    flat = tensor[contact_offsets[row] : contact_offsets[row + 1]]
                    side = int(round(flat.numel() ** 0.5))
                    outputs[key] = flat.view(side, side)
                else:
                    outputs[key] = tensor[row]
            yield protein_id, outputs


# --------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Embed the proteins of a FASTA file with an NVEsm checkpoint into safetensors shards + index.tsv.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("checkpoint", help="an NVEsm checkpoint folder or Hub id (see `nv-esm convert`)")
    parser.add_argument("fasta", type=Path, help="the proteins, one FASTA record each (ids: first word of headers)")
    parser.add_argument("output", type=Path, help="folder for the shards, index.tsv and manifest.json")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[-1], help="hidden states to keep: 0 = embeddings, -1 = last"
    )
    parser.add_argument(
        "--include", nargs="+", choices=OUTPUTS, default=["mean"], help="per-protein mean/cls, per-residue, contacts"
    )
    parser.add_argument(
        "--max-length", type=int, help="longest protein in residues (default: the checkpoint's max_protein_length - 2)"
    )
    parser.add_argument(
        "--too-long",
        choices=TOO_LONG_POLICIES,
        default="error",
        help="longer proteins: stop; skip; keep the first --max-length residues; or overlapping windows (averaged)",
    )
    parser.add_argument(
        "--invalid",
        choices=INVALID_POLICIES,
        default="error",
        help="records with letters outside ESM-2's alphabet, or none: stop, or skip them (index.tsv says why)",
    )
    parser.add_argument(
        "--strip-stop",
        action="store_true",
        help="remove a trailing '*' (a stop codon's mark, as in UniProt files) instead of refusing it; index.tsv's "
        "stop_removed column says where",
    )
    parser.add_argument("--shard-size", type=int, default=1000, help="proteins (FASTA records) per shard")
    parser.add_argument("--tokens-per-batch", type=int, default=16384, help="token budget of one packed batch")
    parser.add_argument("--save-dtype", choices=tuple(SAVE_DTYPES), default="float32")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument(
        "--fp8", choices=FP8_LAYER_CHOICES, default="off", help="FP8 layers (Transformer Engine on CUDA)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="replay the layers as CUDA graphs (default on Transformer Engine; last layer only, no contacts)",
    )
    parser.add_argument("--device", help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    parser.add_argument("--overwrite", action="store_true", help="delete an earlier run with other settings")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own model code where it differs from this package's (it runs as you: only for "
        "folders you trust; default: the installed code runs the checkpoint's weights)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.shard_size < 1 or args.tokens_per_batch < 1:
        parser.error("--shard-size and --tokens-per-batch must be positive")
    if "contacts" in args.include and args.too_long == "window":
        parser.error("contacts of windowed proteins are not defined: use --too-long crop, skip or error")
    return args


def command_device(name: str | None) -> torch.device:
    """The device of `--device` (default: cuda:LOCAL_RANK when CUDA is available, else cpu); ValueError for a name
    that is not a device, or a CUDA device where PyTorch sees none."""
    if name is None:
        return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device (cpu, cuda or cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is visible to PyTorch.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s).")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: nv-esm embed runs on cpu or cuda.")
    return device


def load_config(checkpoint: str) -> Any:
    """The NVEsm config of `checkpoint`, read as data (config.json); a transformers ESM-2 checkpoint is refused with
    the conversion command."""
    from transformers import PretrainedConfig

    from configuration_nv_esm import NVEsmConfig

    looks_local = checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") > 1
    if looks_local and not Path(checkpoint).expanduser().is_dir():
        raise ValueError(f"{checkpoint}: no such folder (a checkpoint is a local folder or a Hub id, org/name).")
    config_dict, _ = PretrainedConfig.get_config_dict(checkpoint)
    model_type = config_dict.get("model_type")
    if model_type != NVEsmConfig.model_type:
        raise ValueError(
            f"{checkpoint} is a {model_type!r} checkpoint, not NVEsm; convert it first: "
            f"nv-esm convert hf-to-te {checkpoint} OUT"
        )
    return NVEsmConfig.from_pretrained(checkpoint)


def checkpoint_fingerprint(checkpoint: str, config: Any) -> str:
    """What identifies the weights, however the path is spelled: for a folder, SHA-256 over config.json and every
    byte of each weight file (a file edited in place, even to the same size, changes it; reading them costs seconds
    next to an embedding run); for a Hub id, the id and its commit."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        return f"{checkpoint}@{getattr(config, '_commit_hash', None) or 'unknown revision'}"
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".safetensors", ".bin"):
            continue
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        update_digest(digest, path)
    return f"sha256:{digest.hexdigest()}"


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
    backend = modeling_nv_esm.resolve_backend(args.backend, device)
    if (args.fp8 != "off" or args.cuda_graphs) and backend != "te":  # --cuda-graphs asked for, not the default
        raise ValueError("--fp8 and --cuda-graphs need Transformer Engine on a CUDA device (backend 'te').")
    records, fasta_sha256 = scan_fasta(args.fasta, max_length, args.too_long, args.invalid, args.strip_stop)
    settings = EmbedSettings(
        checkpoint=checkpoint_fingerprint(args.checkpoint, config),
        fasta_sha256=fasta_sha256,
        precision="bf16" if device.type == "cuda" else "fp32",
        layers=tuple(sorted({layer % states for layer in args.layers})),
        include=tuple(output for output in OUTPUTS if output in args.include),
        max_length=max_length,
        too_long=args.too_long,
        invalid=args.invalid,
        strip_stop=args.strip_stop,
        shard_size=args.shard_size,
        backend=backend,
        fp8=args.fp8,
        save_dtype=args.save_dtype,
    )
    return settings, records


def load_model(
    checkpoint: str,
    config: Any,
    backend: str,
    fp8: str,
    cuda_graphs: bool,
    device: torch.device,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The base model (`NVEsmModel`, contact head included) of `checkpoint` on `device` in eval mode: bf16 weights
    on CUDA, fp32 on the CPU. `backend` as `modeling_nv_esm.resolve_backend` gives it. Without the data-dependent
    input checks, which wait for the device: `ShardEmbedder` packs the inputs itself from checked records. The
    installed package's model code runs the checkpoint's weights; the checkpoint's own code only with
    `trust_remote_code` and where it differs (`remote_code_differences`)."""
    from transformers import AutoModel

    from nv_esm.hub_folder import remote_code_differences

    options = {
        "layer_precision": fp8_layer_precision(fp8, config.num_hidden_layers),
        "cuda_graphs": cuda_graphs,
        "check_inputs": False,
        "dtype": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "backend": backend,
        "add_pooling_layer": False,
    }
    differing = remote_code_differences(checkpoint)
    if differing and trust_remote_code:
        print(f"running {checkpoint}'s own model code ({', '.join(differing)}: --trust-remote-code)", file=sys.stderr)
        model = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, **options)
    else:
        if differing:
            print(
                f"note: {checkpoint}'s {', '.join(differing)} differ from this nv-esm's; its weights run in the "
                "installed model code (--trust-remote-code runs its own, for folders you trust)",
                file=sys.stderr,
            )
        model = modeling_nv_esm.NVEsmModel.from_pretrained(checkpoint, use_safetensors=True, **options)
    return model.to(device).eval()


def main(argv: list[str] | None = None, prog: str = "nv-esm embed") -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        device = command_device(args.device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:  # ranks wait for each other only at the start and the end: a long timeout
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(hours=24))
    try:
        config = load_config(args.checkpoint)
        settings, records = plan_run(args, config, device)  # before loading: a bad record stops the run at once
        graphs = args.cuda_graphs is not False  # the model uses them on Transformer Engine only
        model = load_model(args.checkpoint, config, settings.backend, args.fp8, graphs, device, args.trust_remote_code)
        run(args, model, settings, records, rank, world_size)
        return 0
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: interrupted; finished shards in {args.output} are kept, a rerun resumes.", file=sys.stderr)
        return 130
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()


@dataclass
class RunStats:
    """What one rank did: proteins it embedded in how many seconds (model loading and the first pass excluded)."""

    proteins: int
    seconds: float


def run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    settings: EmbedSettings,
    records: list[Record],
    rank: int = 0,
    world_size: int = 1,
) -> RunStats:
    """Embed the unfinished shards (this rank's share of them) and, rank 0 after every rank, write the index.
    `args` as `parse_args` returns them; `settings` and `records` from `plan_run`. Rank 0 holds the output folder
    for the run (`output_lock`)."""
    with output_lock(args.output) if rank == 0 else contextlib.nullcontext():
        return _run(args, model, settings, records, rank, world_size)


@contextlib.contextmanager
def output_lock(folder: Path) -> Iterator[None]:
    """Hold `folder` while this run writes it: another run into it (one with --overwrite would replace this run's
    shards under it) is refused until this one ends. An advisory lock (`flock`) on `LOCK_NAME`, which the system
    releases if the process dies; the file is removed at the end."""
    import fcntl
    import socket

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    with open(path, "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            raise FileExistsError(
                f"{folder} is being written by another nv-esm embed run ({holder}); wait for it to end, or choose "
                "another folder."
            ) from None
        file.truncate(0)
        file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def _run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    settings: EmbedSettings,
    records: list[Record],
    rank: int,
    world_size: int,
) -> RunStats:
    if rank == 0:
        prepare_output(args.output, settings, args.overwrite)
    _barrier(world_size)
    num_shards = -(-len(records) // args.shard_size)
    missing = [shard for shard in range(num_shards) if shard_ids(args.output / shard_name(shard)) is None]
    _barrier(world_size)  # every rank has its list before any writes a shard: all share one list
    mine = set(missing[rank::world_size])
    todo = sum(
        not record.status.startswith("skipped")
        for shard in mine
        for record in records[shard * args.shard_size : (shard + 1) * args.shard_size]
    )
    embedder = ShardEmbedder(model, settings, args.tokens_per_batch)
    progress = tqdm(total=todo, unit="protein", desc="embedding", disable=args.no_progress or rank != 0)
    started = time.perf_counter()
    # A shard is written on a thread while the next one is embedded; at most one write is under way.
    with open(args.fasta, "rb") as raw, ThreadPoolExecutor(max_workers=1) as writer:
        writing: Future | None = None
        for shard, shard_records in _shards(
            iter_fasta(_text_lines(raw, args.fasta), args.fasta, empty_ok=True), records, args.shard_size
        ):
            if shard not in mine:
                continue
            kept = [
                (record, sequence[: record.residues])  # without a removed stop mark
                for record, sequence in shard_records
                if not record.status.startswith("skipped")
            ]
            tensors = embedder([sequence for _, sequence in kept], [record.status for record, _ in kept], progress)
            if writing is not None:
                writing.result()  # raises what the last write raised
            ids = [record.id for record, _ in kept]
            writing = writer.submit(write_shard, args.output / shard_name(shard), tensors, ids)
        if writing is not None:
            writing.result()
    progress.close()
    seconds = time.perf_counter() - started
    _barrier(world_size)
    if rank == 0:
        write_index(args.output, records, args.shard_size, settings.max_length)
        counts: dict[str, int] = {}
        for record in records:
            counts[record.status] = counts.get(record.status, 0) + 1
        summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
        reused = f"{num_shards - len(missing)} of {num_shards} shards were already done"
        rate = f"this run: {todo} proteins in {seconds:.1f} s ({todo / max(seconds, 1e-9):.1f} proteins/s on rank 0)"
        print(f"{len(records)} records ({summary}); {reused}; {rate}; wrote {args.output / INDEX_NAME}")
    return RunStats(todo, seconds)


def _shards(
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


if __name__ == "__main__":
    sys.exit(main())
