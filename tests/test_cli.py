"""The `nv-esm` command: its commands, their help, and unknown commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from nv_esm.cli import COMMANDS, main


def test_usage_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)


@pytest.mark.parametrize("argv", [[], ["embed-everything"]], ids=["none", "unknown"])
def test_no_or_unknown_command_exits_2_with_the_usage(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "usage: nv-esm COMMAND" in captured.out + captured.err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_prints_its_own_help_under_its_name(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: nv-esm {command} ")


def test_the_module_entry_points_run_the_same_commands():
    """`python -m nv_esm` is `nv-esm`; `python -m nv_esm.train` and `recipes/train.py` print the same help."""
    run = [sys.executable, "-m", "nv_esm", "--help"]
    assert "usage: nv-esm COMMAND" in subprocess.run(run, capture_output=True, text=True, check=True).stdout
    helps = [
        subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
        for command in (
            [sys.executable, "-m", "nv_esm.train", "--help"],
            [sys.executable, "recipes/train.py", "--help"],
        )
    ]
    assert helps[0] == helps[1] and "--model" in helps[0]
