"""Where a command may write and read (`nv_esm.path_guard`), and which code a command started with `python -m` runs
(`nv_esm.cli.keep_imports_installed`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nv_esm import cli
from nv_esm.path_guard import confined, overlap, refuse_links, refuse_overlap


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """An input file, an input folder with a file in it, and a link to the input file."""
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(">wt\nMKT\n")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    link = tmp_path / "link.fasta"
    link.symlink_to(fasta)
    hard = tmp_path / "hard.fasta"
    os.link(fasta, hard)
    return {"fasta": fasta, "folder": folder, "link": link, "hard": hard, "root": tmp_path}


def test_overlap_names_each_way_two_paths_meet(files: dict[str, Path]) -> None:
    fasta, folder, root = files["fasta"], files["folder"], files["root"]
    assert overlap(fasta, fasta) == "is"
    assert overlap(root / "." / "wt.fasta", fasta) == "is"  # another spelling
    assert overlap(files["link"], fasta) == "is"  # through a link
    assert overlap(files["hard"], fasta) == "is"  # a hard link: another name, the same file
    assert overlap(folder / "config.json", folder) == "lies inside"
    assert overlap(folder / "new" / "out.csv", folder) == "lies inside"  # not yet made
    assert overlap(root, fasta) == "contains"
    assert overlap(root / "scores.csv", fasta) is None
    assert overlap(root / "ckpt2", folder) is None  # a sibling whose name starts the same


def test_refuse_overlap_is_one_line_naming_both_paths(files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"^OUTPUT .*wt\.fasta is the wild-type FASTA .*wt\.fasta: .*") as error:
        refuse_overlap(
            {"OUTPUT": files["fasta"]}, {"the checkpoint": files["folder"], "the wild-type FASTA": files["fasta"]}
        )
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="its plot .* lies inside the checkpoint"):
        refuse_overlap(
            {"OUTPUT": files["root"] / "s.csv", "its plot": files["folder"] / "s.png"},
            {"the checkpoint": files["folder"]},
        )
    refuse_overlap(
        {"OUTPUT": files["root"] / "scores.csv", "unused": None},
        {"the checkpoint": "facebook/esm2_t6_8M_UR50D", "none": None, "the FASTA": files["fasta"]},
    )  # a Hub id is no local path; nothing meets


def test_confined_refuses_names_that_leave_the_folder(tmp_path: Path) -> None:
    assert confined(tmp_path, "A.csv", "DMS_filename") == tmp_path / "A.csv"
    assert confined(tmp_path, "sub/A.csv", "DMS_filename") == tmp_path / "sub" / "A.csv"
    for name in ("../A.csv", "sub/../../A.csv", "/etc/passwd", "", ".."):
        with pytest.raises(ValueError, match="DMS_filename"):
            confined(tmp_path, name, "DMS_filename")


def test_refuse_links(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").symlink_to(tmp_path / "elsewhere")
    refuse_links({"the metrics": tmp_path / "out" / "metrics.jsonl"})  # not there yet: fine
    with pytest.raises(FileExistsError, match="checkpoints .*is a link to .*elsewhere"):
        refuse_links({"the checkpoints folder": tmp_path / "out" / "checkpoints"})


def test_keep_imports_installed_drops_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for first in ("", str(tmp_path)):
        monkeypatch.setattr(sys, "path", [first, "/somewhere/else"])
        cli.keep_imports_installed()
        assert sys.path == ["/somewhere/else"]
    monkeypatch.setattr(sys, "path", ["/a/script/folder", "/somewhere/else"])  # the nv-esm script: left alone
    cli.keep_imports_installed()
    assert sys.path == ["/a/script/folder", "/somewhere/else"]
    monkeypatch.chdir(Path(cli.__file__).resolve().parents[1])  # a source checkout run in place: its own code
    monkeypatch.setattr(sys, "path", ["", "/somewhere/else"])
    cli.keep_imports_installed()
    assert sys.path == ["", "/somewhere/else"]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["nv_esm", "nv_esm.train"])
def test_a_checkpoint_folders_code_never_runs_from_the_current_directory(
    module: str, checkpoint: Path, tmp_path: Path
) -> None:
    """`python -m nv_esm embed` / `python -m nv_esm.train` started inside a folder holding a tampered
    `modeling_nv_esm.py` import the installed model code, not the folder's."""
    folder = tmp_path / "tampered"
    folder.mkdir()
    for path in checkpoint.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    marker = tmp_path / "ran"
    with open(folder / "modeling_nv_esm.py", "a") as code:
        code.write(f"\nopen({str(marker)!r}, 'w').write('the folder code ran')\n")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAK\n")
    if module == "nv_esm":
        argv = ["embed", str(folder), str(fasta), str(tmp_path / "out"), "--no-progress"]
    else:  # the trainer's help imports its model code too
        argv = ["--help"]
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), f"python -m {module} ran {folder}/modeling_nv_esm.py"
