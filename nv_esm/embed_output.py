"""The output folder of `nv-esm embed`: shards, `index.tsv`, `manifest.json`, and the lock of a run.

Every file is written under a temporary name and renamed (`write_shard`, `write_index`), so a folder never holds a
half-written file under its final name. `prepare_output` keeps the finished shards of an earlier run only when its
manifest holds equal settings (`EmbedSettings`, the checkpoint's fingerprint included); `output_lock` holds the
folder while a run writes it; `iter_embeddings` reads a finished folder back, protein by protein. `prepare_output`
(its decision alone, reading only: `check_output_folder`) and `output_lock` serve `nv-esm score`'s folder of
finished parts too (`OutputFolder` says whose folder it is).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nv_esm.checkpoint_io import TEMPORARY_SUFFIX, file_sha256, replaced_atomically, write_atomically
from nv_esm.embed_plan import Record, embedded_residues
from nv_esm.folder_lock import folder_lock

FORMAT = "nv-esm-embed/1"
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.tsv"
SHARD_PREFIX = "embeddings-"
# Settings added to the manifest after runs were written without them: the value they had then.
_SETTINGS_BEFORE = {"strip_stop": False}
SHARD_PATTERN = re.compile(r"embeddings-(\d{5,})\.safetensors")
LOCK_NAME = ".nv-esm-embed.lock"
CONTACTS_PICTURE = "contacts.png"  # --include contacts: the first proteins' contact maps (nv_esm.plots)
CHECKSUM_SUFFIX = ".sha256"  # a finished shard's SHA-256 beside it: embeddings-00000.safetensors.sha256
OUR_NAMES = re.compile(
    rf"(embeddings-\d{{5,}}\.safetensors(\.sha256)?|manifest\.json|index\.tsv|{CONTACTS_PICTURE})({TEMPORARY_SUFFIX})?"
    r"|\.nv-esm-embed\.lock"
)


@dataclass(frozen=True)
class OutputFolder:
    """Whose resumable folder `prepare_output` and `output_lock` keep: the command (named in errors), its manifest
    format, the names of the files it writes, its lock file, what it calls its finished pieces, the values of
    settings its manifests were once written without, the subfolders it writes (e.g. a summary), and, where `names`
    also matches files a user may keep there (`nv-esm proteingym`'s `*.csv`), `written`: the paths in the folder that
    its runs wrote, from their records (what `--overwrite` deletes; None: every entry `names` matches)."""

    command: str
    format: str
    names: re.Pattern
    lock_name: str
    pieces: str
    settings_before: tuple[tuple[str, Any], ...] = ()
    folders: tuple[str, ...] = ()
    written: Callable[[Path], list[Path]] | None = None


EMBED_FOLDER = OutputFolder("nv-esm embed", FORMAT, OUR_NAMES, LOCK_NAME, "shards", tuple(_SETTINGS_BEFORE.items()))


def shard_name(shard: int) -> str:
    return f"{SHARD_PREFIX}{shard:05d}.safetensors"


def prepare_output(folder: Path, settings: Any, overwrite: bool, kind: OutputFolder = EMBED_FOLDER) -> None:
    """Create `folder`, or check that it holds an earlier run of this command with equal settings (its finished
    shards are then kept). Refuses a folder with anything else in it; with other settings, refuses unless
    `overwrite`, which deletes only the files this command writes (`kind.written`'s where it has a record of them;
    the manifest last; subfolders of `kind.folders` left empty go too). `settings`: a dataclass (`EmbedSettings` for
    `nv-esm embed`); `kind`: whose folder it is. The decision is `check_output_folder`'s."""
    folder.mkdir(parents=True, exist_ok=True)
    if check_output_folder(folder, settings, overwrite, kind):
        doomed = kind.written(folder) if kind.written is not None else list(folder.iterdir())
        for path in sorted(doomed, key=lambda path: path.name == MANIFEST_NAME and path.parent == folder):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.name != kind.lock_name and (path.exists() or path.is_symlink()):
                path.unlink()
        for name in kind.folders:
            _remove_empty_folders(folder / name)
    for stale in folder.glob("*.tmp"):
        stale.unlink()
    write_atomically(folder / MANIFEST_NAME, json.dumps(_manifest(settings, kind), indent=2) + "\n")


def _remove_empty_folders(folder: Path) -> None:
    """Remove `folder` and the folders under it that hold nothing (after `--overwrite` deleted the files a command
    wrote there: a user's file keeps its folders)."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for path in folder.iterdir():
        _remove_empty_folders(path)
    with contextlib.suppress(OSError):
        folder.rmdir()


def check_output_folder(folder: Path, settings: Any, overwrite: bool, kind: OutputFolder = EMBED_FOLDER) -> bool:
    """Whether `prepare_output` may take `folder` for a run with `settings`, found by reading it only (a command
    asks before it loads its model; `prepare_output` asks again, holding the folder): FileExistsError for a folder
    with files `kind.command` did not write, finished pieces without a manifest, or a manifest of other settings
    without `overwrite`. Returns whether the earlier run's files are to be deleted (other settings, `overwrite`); a
    folder that does not exist yet is fine."""
    if not folder.exists():
        return False
    entries = list(folder.iterdir())
    ours = [
        path
        for path in entries
        if not path.is_symlink()
        and ((path.is_file() and kind.names.fullmatch(path.name)) or (path.is_dir() and path.name in kind.folders))
    ]
    foreign = sorted(path.name for path in entries if path not in ours)
    if foreign:
        raise FileExistsError(
            f"{folder} holds files {kind.command} did not write ({', '.join(foreign[:5])}); choose a new or empty "
            "folder."
        )
    manifest = folder / MANIFEST_NAME
    if any(path.name != kind.lock_name for path in entries) and not manifest.exists():
        raise FileExistsError(
            f"{folder} holds {kind.pieces} but no {MANIFEST_NAME}: their settings are unknown; choose a new or empty "
            "folder."
        )
    if not manifest.exists():
        return False
    current = _manifest(settings, kind)
    earlier = {**dict(kind.settings_before), **_read_manifest(manifest, kind)}
    changed = sorted(key for key in current.keys() | earlier.keys() if current.get(key) != earlier.get(key))
    if changed and not overwrite:
        details = "; ".join(f"{key}: {earlier.get(key)!r} -> {current.get(key)!r}" for key in changed)
        raise FileExistsError(
            f"{folder} holds a run with other settings ({details}). Its {kind.pieces} would not match: pass "
            "--overwrite to delete them, or choose another folder."
        )
    return bool(changed)


def _manifest(settings: Any, kind: OutputFolder) -> dict[str, Any]:
    return {"format": kind.format, **_jsonable(settings)}


def _read_manifest(path: Path, kind: OutputFolder) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a manifest of {kind.command} ({error}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != kind.format:
        raise ValueError(f"{path} is not a manifest of {kind.command} (format {kind.format}).")
    return manifest


def _jsonable(settings: Any) -> dict[str, Any]:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(settings).items()}


def write_shard(path: Path, tensors: dict[str, torch.Tensor], ids: list[str]) -> None:
    """`tensors` as safetensors under `path` (`replaced_atomically`), ids in metadata."""
    with replaced_atomically(path) as temporary:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, temporary, {"ids": json.dumps(ids)})


def shard_ids(path: Path) -> list[str] | None:
    """The ids a finished shard holds, or None if `path` is missing or not a readable shard."""
    try:
        with safe_open(path, "pt") as shard:
            return json.loads(shard.metadata()["ids"])
    except Exception:  # missing, cut off, or not ours: not finished
        return None


def checksum_path(shard: Path) -> Path:
    """Where the SHA-256 of the shard at `shard` is kept: beside it, `CHECKSUM_SUFFIX` added."""
    return shard.with_name(shard.name + CHECKSUM_SUFFIX)


def write_checked_shard(path: Path, tensors: dict[str, torch.Tensor], ids: list[str]) -> None:
    """`write_shard`, then the shard's SHA-256 beside it (`checksum_path`) in `sha256sum`'s format (`sha256sum -c`
    checks it): a shard without one was cut off before it was complete."""
    write_shard(path, tensors, ids)
    write_atomically(checksum_path(path), f"{file_sha256(path)}  {path.name}\n")


def shard_damage(path: Path) -> str | None:
    """What is wrong with the finished shard at `path`, or None: no checksum beside it (the run was cut off before
    it wrote it, or an earlier nv-esm wrote the shard), or a SHA-256 other than the one recorded."""
    checksum = checksum_path(path)
    if not checksum.is_file():
        return f"no {checksum.name} beside it: its writing was cut off, or an earlier nv-esm wrote it"
    if checksum.read_text(encoding="utf-8", errors="replace").split()[:1] != [file_sha256(path)]:
        return f"its SHA-256 is not the one {checksum.name} records"
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
    write_atomically(folder / INDEX_NAME, "\n".join(lines) + "\n")


def iter_embeddings(folder: str | Path) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(id, outputs) of every embedded protein of a finished `nv-esm embed` folder, in FASTA order. Outputs are
    keyed as in the shards: `mean.layer_L`/`cls.layer_L` `[hidden]`, `per_residue.layer_L` `[residues, hidden]`,
    `contacts` `[residues, residues]`. Raises if the run has not finished (no index.tsv), and for a shard whose SHA-256
    is not the one recorded beside it (`shard_damage`)."""
    folder = Path(folder)
    if not (folder / INDEX_NAME).exists():
        raise FileNotFoundError(f"{folder} has no {INDEX_NAME}: the run has not finished (a rerun completes it).")
    names = [path.name for path in folder.iterdir() if SHARD_PATTERN.fullmatch(path.name)]
    for name in sorted(names, key=lambda name: int(SHARD_PATTERN.fullmatch(name).group(1))):
        problem = shard_damage(folder / name) if checksum_path(folder / name).exists() else None  # earlier releases
        if problem is not None:  # wrote none
            raise ValueError(f"{folder / name} is damaged ({problem}); rerun nv-esm embed with the same arguments.")
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


def output_lock(folder: Path, kind: OutputFolder = EMBED_FOLDER) -> contextlib.AbstractContextManager[None]:
    """Hold `folder` while this run writes it (`folder_lock` on `kind.lock_name`): another run into it (one with
    --overwrite would replace this run's shards under it) is refused until this one ends."""
    return folder_lock(folder, kind.lock_name, kind.command)
