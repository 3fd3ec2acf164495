"""Where a command may write and read: its outputs never meet its inputs, names read from data files stay in their
folder, and the folders it writes are not links to somewhere else.

Every command checks its paths here before it reads or writes anything (one place: a new command names its inputs
and outputs, nothing more):

    refuse_overlap({"OUTPUT": args.output, "the plot": png}, {"the checkpoint": ckpt, "the FASTA file": fasta}, ...)
    assay = confined(assays_folder, row["DMS_filename"], "DMS_filename")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def _resolved(path: Path) -> Path:
    """`path` made absolute with every link followed (as far as it exists), so two spellings of one place agree."""
    return Path(os.path.realpath(os.path.abspath(os.path.expanduser(path))))


def _same_file(first: Path, second: Path) -> bool:
    """Whether two existing paths are one file (hard links included)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def overlap(output: Path, input_path: Path) -> str | None:
    """How `output` meets `input_path`: "is" (the same file or folder, through links or hard links), "lies inside"
    (the output is under the input folder), "contains" (the input is under the output folder), or None."""
    out, source = _resolved(output), _resolved(input_path)
    if out == source or (output.exists() and input_path.exists() and _same_file(output, input_path)):
        return "is"
    if source in out.parents:
        return "lies inside"
    if out in source.parents:
        return "contains"
    return None


def refuse_overlap(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | str | None]) -> None:
    """Raise ValueError, one line, when any output path (`{what: path}`, e.g. {"OUTPUT": ..., "its plot": ...}) is an
    input path, lies inside an input folder, or contains an input (`{what: path}`; None, and names that are no
    local path such as a Hub repository id, are left out). Checked before anything is read or written."""
    for out_name, output in outputs.items():
        if output is None:
            continue
        for in_name, source in inputs.items():
            if source is None or not Path(source).exists():
                continue
            how = overlap(Path(output), Path(source))
            if how is not None:
                raise ValueError(
                    f"{out_name} {output} {how} {in_name} {source}: a command never writes over, into or around "
                    "what it reads; choose another output."
                )


def confined(folder: Path, name: str, what: str) -> Path:
    """`folder / name` for a file name read from data (a CSV column, a checkpoint's index), or ValueError when the
    name is empty, absolute or climbs out of `folder` with `..`. `what` names the field in the message. Links that
    the folder itself holds are the folder owner's choice (data kept with git-annex or DVC is links) and are read."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\0" in name:
        raise ValueError(f"{what} {name!r} is not a file name inside {folder} (absolute, empty, or with '..').")
    return folder / name


def refuse_links(paths: Mapping[str, Path]) -> None:
    """Raise FileExistsError, one line, when any of `paths` (`{what: path}`, paths a command is about to write or
    create, such as OUT/metrics.jsonl or OUT/checkpoints) is a symbolic link: writing through it would land outside
    the folder the user named."""
    for what, path in paths.items():
        if path.is_symlink():
            raise FileExistsError(
                f"{path} ({what}) is a link to {os.readlink(path)}; the command writes only inside its output "
                "folder. Remove the link."
            )
