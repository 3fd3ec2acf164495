"""`nv-esm proteingym`'s output folder: which files its runs wrote (all that `--overwrite` deletes), and what each
assay's scores were computed from, so that a rerun keeps only scores of unchanged inputs.

OUT holds one `<DMS_id>.csv` per assay, `summary/` (`proteingym_metrics`' files and the plots, rewritten by each run),
`inputs/<DMS_id>.json` (the SHA-256 of the assay file and of its `target_seq`, written before the assay's file) and
`manifest.json` (the settings, `embed_output`'s).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from nv_esm.checkpoint_io import TEMPORARY_SUFFIX, file_sha256, write_atomically
from nv_esm.embed_output import MANIFEST_NAME, OutputFolder

SUMMARY_FOLDER = "summary"
INPUTS_FOLDER = "inputs"
INPUTS_FORMAT = "nv-esm-proteingym-inputs/1"
# What the summary holds (`proteingym_metrics.write_summary`'s files, the plots), temporaries of them included
SUMMARY_NAMES = re.compile(
    rf"([^/]+/(DMS_substitutions_[^/]+_level|Summary_performance_DMS_substitutions_[^/]+)\.csv|[^/]+\.png)"
    rf"({TEMPORARY_SUFFIX})?"
)
# The inputs an assay's scores are computed from besides the settings (`inputs_fingerprint`), as messages name them
INPUT_NAMES = {"assay_sha256": "the assay file's content", "target_seq_sha256": "the reference's target_seq"}


def assay_path(folder: Path, dms_id: str) -> Path:
    """An assay's scores in OUT `folder`: `<DMS_id>.csv`."""
    return folder / f"{dms_id}.csv"


def written_files(folder: Path) -> list[Path]:
    """What runs of `nv-esm proteingym` wrote in OUT `folder`, the files `--overwrite` deletes (a user's own CSV
    files there, which OUT's names cannot tell from assays', stay): each assay file with a record of its inputs
    (`INPUTS_FOLDER`) and the records, the summary's files (`SUMMARY_NAMES`) and the manifest. (Temporaries of
    OUT's names are deleted by every run.)"""
    paths = []
    records = folder / INPUTS_FOLDER
    if records.is_dir() and not records.is_symlink():
        ids = [path.name.removesuffix(".json") for path in records.glob("*.json")]
        paths += [assay_path(folder, dms_id) for dms_id in ids] + [*records.glob("*.json"), *records.glob("*.tmp")]
    summary = folder / SUMMARY_FOLDER
    if summary.is_dir() and not summary.is_symlink():
        paths += [
            path
            for path in summary.rglob("*")
            if path.is_file() and SUMMARY_NAMES.fullmatch(path.relative_to(summary).as_posix())
        ]
    return [*paths, folder / MANIFEST_NAME]


PROTEINGYM_FOLDER = OutputFolder(
    "nv-esm proteingym",
    "nv-esm-proteingym/1",
    re.compile(rf"([^/]+\.(csv|png)|manifest\.json)({TEMPORARY_SUFFIX})?|\.nv-esm-proteingym\.lock"),
    ".nv-esm-proteingym.lock",
    "assay scores",
    folders=(SUMMARY_FOLDER, INPUTS_FOLDER),
    written=written_files,
)


def inputs_fingerprint(assay_file: Path, wild_type: str) -> dict[str, str]:
    """What an assay's scores are computed from besides the settings: the SHA-256 of its assay file's bytes and of
    its reference row's wild type (`target_seq`). Recorded with its output file (`record_inputs`): a rerun keeps
    the file only while both are the same."""
    return {
        "assay_sha256": file_sha256(assay_file),
        "target_seq_sha256": hashlib.sha256(wild_type.encode()).hexdigest(),
    }


def inputs_path(folder: Path, dms_id: str) -> Path:
    """Where the fingerprint of the inputs of an assay's output file is recorded: OUT/inputs/<DMS_id>.json."""
    return folder / INPUTS_FOLDER / f"{dms_id}.json"


def recorded_inputs(folder: Path, dms_id: str) -> dict[str, str] | None:
    """The fingerprint recorded for an assay's output file, or None where there is none (an earlier nv-esm, or not
    nv-esm, wrote the file) or it cannot be read."""
    try:
        record = json.loads(inputs_path(folder, dms_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != INPUTS_FORMAT:
        return None
    return {key: record.get(key) for key in INPUT_NAMES}


def record_inputs(folder: Path, dms_id: str, inputs: dict[str, str]) -> None:
    """Record the fingerprint of an assay's inputs, before its output file is written (a run cut off between the
    two leaves a record without a file: the assay is scored again)."""
    path = inputs_path(folder, dms_id)
    path.parent.mkdir(exist_ok=True)
    write_atomically(path, json.dumps({"format": INPUTS_FORMAT, "DMS_id": dms_id, **inputs}, indent=2) + "\n")


def finished_assays(folder: Path, fingerprints: dict[str, dict[str, str]], overwrite: bool) -> set[str]:
    """The assays of `fingerprints` (DMS_id -> the fingerprint of its inputs now) whose output file in OUT `folder`
    was scored from these inputs: a rerun keeps them. One scored from other inputs, or without a record of them, is
    refused (FileExistsError naming the file and what changed) unless `overwrite`, which scores it again."""
    finished = set()
    for dms_id, now in fingerprints.items():
        path = assay_path(folder, dms_id)
        if not path.exists():
            continue
        earlier = recorded_inputs(folder, dms_id)
        if earlier == now:
            finished.add(dms_id)
        elif not overwrite:
            if earlier is None:
                why = f"has no record of the inputs it was scored from ({inputs_path(folder, dms_id)})"
            else:
                changed = " and ".join(name for key, name in INPUT_NAMES.items() if earlier.get(key) != now[key])
                why = f"was scored from other inputs ({changed} changed)"
            raise FileExistsError(
                f"{path} {why}: its scores would be stale; pass --overwrite to score it again, or choose another "
                "folder."
            )
    return finished
