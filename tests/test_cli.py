"""The `nv-esm` command: its commands, their help, and unknown commands."""

from __future__ import annotations

import argparse
import importlib.util
import re
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


@pytest.mark.slow
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


def test_version_is_the_installed_package_version(capsys):
    """`nv-esm --version` prints pyproject.toml's version (the installed package's), or says it is not installed
    (the GPU machine runs the tree from PYTHONPATH)."""
    import importlib.metadata

    expected = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    try:
        importlib.metadata.version("nv-esm")
    except importlib.metadata.PackageNotFoundError:
        expected = "unknown (not installed: pip install .)"
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"nv-esm {expected}\n"


def test_usage_lists_train_export(capsys):
    main(["--help"])
    assert re.search(
        r"^  train export +write a Hub model folder from a training checkpoint", capsys.readouterr().out, re.M
    )


def parsers(monkeypatch: pytest.MonkeyPatch) -> dict[str, argparse.ArgumentParser]:
    """The argument parser of each command and of `train export`, caught as the command parses."""
    caught = {}

    def catch(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        caught[parser.prog.removeprefix("nv-esm ")] = parser
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for argv in [[name, "x"] for name in COMMANDS] + [["train", "export", "x"]]:
        with pytest.raises(SystemExit):
            main(argv)
    return caught


def test_every_argument_has_help_and_one_default(monkeypatch):
    """Every argument of every command says what it is; a default is printed once, and only where there is one
    (never "(default: None)" after a help that explains what happens without the option)."""
    found = parsers(monkeypatch)
    assert sorted(found) == sorted([*COMMANDS, "train export"])
    for name, parser in found.items():
        formatter = parser.formatter_class(parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"nv-esm {name} {action.option_strings or action.dest}: no help"
            appended = formatter._get_help_string(action) != action.help  # "(default: ...)" after the help
            assert not (appended and "default" in action.help.lower()), (name, formatter._expand_help(action))
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, (name, text)


def test_config_help_says_it_is_the_model_config(monkeypatch):
    train = parsers(monkeypatch)["train"]
    config = next(action for action in train._actions if "--config" in action.option_strings)
    assert config.help.startswith("the model's config.json")


def error_lines(capsys: pytest.CaptureFixture) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("command", ["convert", "embed", "score", "train", "train export"])
def test_every_command_reports_an_error_in_one_line_as_argparse_does(tmp_path, capsys, command):
    """A missing checkpoint: one line, `nv-esm COMMAND: error: ...`, as argparse reports a usage error."""
    missing, fasta = tmp_path / "no_such_model", tmp_path / "p.fasta"
    fasta.write_text(">p\nMKTAYIAK\n")
    argv = {
        "convert": ["convert", "hf-to-te", missing, tmp_path / "out"],
        "embed": ["embed", missing, fasta, tmp_path / "out", "--no-progress"],
        "score": ["score", missing, fasta, tmp_path / "out.csv", "--no-progress"],
        "train": ["train", "--model", missing, "--data", fasta, "--steps", "1", "--out", tmp_path / "run"],
        "train export": ["train", "export", missing, tmp_path / "out"],
    }[command]
    try:
        status = main([str(arg) for arg in argv])
    except SystemExit as exit_info:  # train export exits as argparse does
        status = exit_info.code
    errors = [line for line in error_lines(capsys) if "error" in line.lower()]
    assert status != 0 and len(errors) == 1 and errors[0].startswith(f"nv-esm {command}: error: "), errors
    assert str(missing) in errors[0], errors


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="needs a machine without TE")
def test_the_transformer_engine_hint_names_the_command_line_option(nv_tiny, tmp_path, capsys):
    """A CLI user asking for Transformer Engine where it cannot run is told the option, not the Python keyword."""
    fasta = tmp_path / "p.fasta"
    fasta.write_text(">p\nMKTAYIAK\n")
    status = main(["embed", str(nv_tiny), str(fasta), str(tmp_path / "out"), "--backend", "te", "--device", "cpu"])
    lines = error_lines(capsys)
    assert status == 1 and lines[-1].startswith("nv-esm embed: error: backend 'te'"), lines
    assert "--backend torch" in lines[-1]
