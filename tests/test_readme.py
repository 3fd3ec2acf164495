"""The README's commands and Python snippets run as written, in order, on a CPU, from a fresh clone's files: its
Quickstart conversion (of the bundled tiny checkpoint), its `nv-esm embed` command and its two `nv-esm score`
commands on the example inputs in examples/, in a temporary folder; and its first run tells how to reach `nv-esm`."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import demo  # noqa: E402  (examples/demo.py)

# Inputs the README names that a clone does not hold, each with why.
NOT_SHIPPED = {"uniref50.fasta": "the 650M pre-training example's data set (tens of GB)"}


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def readme_lines() -> list[str]:
    """The README's shell lines, comments dropped and continued lines joined."""
    text = "\n".join(readme_blocks("bash")).replace("\\\n", " ")
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def readme_command(start: str) -> list[str]:
    """The arguments (after `nv-esm COMMAND`) of the README's shell line that starts with `start`."""
    return shlex.split(next(line for line in readme_lines() if line.startswith(start)))[2:]


def input_files(words: list[str]) -> list[str]:
    """The files a `nv-esm embed|score|train` command line (`words`, after the command) reads."""
    command, *arguments = words
    named = {"--mutants", "--data", "--val-data"}
    files = [value for flag, value in zip(arguments, arguments[1:]) if flag in named]
    if command in ("embed", "score"):
        files.append([word for word in arguments if not word.startswith("-")][1])  # CHECKPOINT FASTA OUTPUT
    return files


def test_every_input_the_readme_names_is_in_the_repository():
    """A fresh clone runs each command as printed: the FASTA and CSV files it reads are shipped (examples/)."""
    used = []
    for line in readme_lines():
        words = shlex.split(line)
        if words[:1] == ["torchrun"]:
            if "-m" not in words:  # a script (bench/), not an nv-esm command
                continue
            words = words[words.index("-m") + 2 :]  # after `-m nv_esm` / `-m nv_esm.train`
            words = words if words[:1] in (["embed"], ["score"]) else ["train", *words]
        elif words[:1] == ["nv-esm"]:
            words = words[1:]
        else:
            continue
        if words[:1] in (["embed"], ["score"], ["train"]) and "..." not in words:
            used += input_files(words)
    missing = [name for name in used if not (ROOT / name).is_file() and name not in NOT_SHIPPED]
    assert used and not missing, missing
    assert {"examples/proteins.fasta", "examples/gfp.fasta", "examples/gfp_mutants.csv"} <= set(used)


def test_the_first_run_says_how_to_reach_nv_esm(tmp_path, monkeypatch, capsys):
    """`make demo` makes `.venv` and runs its Python without activating it: the README's Quickstart starts by
    activating it, and the demo ends by printing that line, the Quickstart's first command and nv-esm's full path."""
    assert re.search(r"^VENV \?= \.venv$", (ROOT / "Makefile").read_text(), re.M)
    quickstart = [line for line in readme_lines() if not line.startswith(("make ", "pip "))]
    assert quickstart[:2] == ["source .venv/bin/activate", demo.QUICKSTART]
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("activate", "nv-esm"):
        (venv / "bin" / name).touch()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    lines = demo.next_steps().splitlines()
    assert lines[1:] == [
        "    source .venv/bin/activate",
        f"    {demo.QUICKSTART}",
        f"  (or, without activating: {venv / 'bin' / demo.QUICKSTART})",
    ]
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))  # run from the activated venv: nothing to activate
    assert "source" not in demo.next_steps()
    if shutil.which("make"):  # `make test` ends with the same line (-n: prints the commands, runs none)
        # Under CI this test runs inside a make (e.g. `make suite VENV=.venv-oldest`): a nested make would inherit
        # that make's variables through MAKEFLAGS and print "Leaving directory"; the README's command has neither.
        outer_make = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VENV")
        env = {key: value for key, value in os.environ.items() if key not in outer_make}
        dry_run = subprocess.run(
            ["make", "-n", "--no-print-directory", "test"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert "source .venv/bin/activate" in dry_run.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_readme_snippets_run_as_written(tmp_path, monkeypatch):
    from convert_checkpoint import main as convert
    from nv_esm import embed, score

    monkeypatch.chdir(tmp_path)
    for shipped in ("assets", "examples"):  # what a clone holds, nothing else
        (tmp_path / shipped).symlink_to(ROOT / shipped)
    assert convert(readme_command("nv-esm convert hf-to-te assets/esm2_tiny")) == 0
    assert embed.main([*readme_command("nv-esm embed esm2_nv"), "--no-progress"]) == 0
    assert score.main([*readme_command("nv-esm score esm2_nv examples/proteins.fasta"), "--no-progress"]) == 0
    assert score.main([*readme_command("nv-esm score esm2_nv examples/gfp.fasta"), "--no-progress"]) == 0
    scores = (tmp_path / "gfp_scores.csv").read_text().splitlines()
    assert len(scores) == len((ROOT / "examples" / "gfp_mutants.csv").read_text().splitlines())
    blocks = readme_blocks("python")
    assert len(blocks) >= 4
    # As run on one device: with several GPUs in one process, Trainer would use nn.DataParallel, which the model
    # refuses for packed batches (tests/test_user_messages.py); the README says to start it with torchrun there.
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: min(self._n_gpu, 1)))
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"README.md python block {number} fails: {type(error).__name__}: {error}\n{block}")
    assert (tmp_path / "runs" / "mlm" / "final" / "config.json").exists()
    assert Path("out/index.tsv").read_text().count("\n") == 1 + 4  # header + examples/proteins.fasta's records
