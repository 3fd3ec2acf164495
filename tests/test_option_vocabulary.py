"""One vocabulary across the commands (issue 62): renamed options keep working with a notice, `--help` shows the new
names and every option's default, answers without importing torch, and the commands refuse alike."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from conftest import ROOT
from nv_esm import cli, options, vocabulary

COMMAND_HELP = {
    "convert": "nv_esm.cli.parse_convert_args",
    "embed": "nv_esm.cli.parse_embed_args",
    "score": "nv_esm.cli.parse_score_args",
    "proteingym": "nv_esm.cli.parse_proteingym_args",
    "train": "nv_esm.cli.parse_train_args",
    "train export": "nv_esm.cli.parse_export_args",
}


def help_text(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The `--help` of `nv-esm COMMAND` (through `cli.main`, which exits 0 after printing it)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, as `--help` prints it (captured by raising in `print_help`)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def keep(parser: argparse.ArgumentParser, file: object = None) -> None:
        raise LookupError(parser)

    original = argparse.ArgumentParser.print_help
    argparse.ArgumentParser.print_help = keep  # type: ignore[method-assign]
    try:
        for command in (*cli.COMMANDS, "train export"):
            try:
                cli.main([*command.split(), "--help"])
            except LookupError as kept:
                found[command] = kept.args[0]
    finally:
        argparse.ArgumentParser.print_help = original  # type: ignore[method-assign]
    return found


@pytest.mark.parametrize("command", [*cli.COMMANDS, "train export"])
def test_help_shows_no_old_name(capsys, command):
    text = help_text(command, capsys)
    assert not [old for old in vocabulary.RENAMED if old in text]


def test_every_option_states_its_default_or_that_it_is_required():
    """`nv-esm train --help` (and every other command's) says each option's default, or that it is required."""
    formatter = options.HelpFormatter("x")
    missing = {}
    for command, parser in parsers().items():
        for action in parser._actions:
            if (
                not action.option_strings
                or action.help is argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction)
            ):
                continue
            text = formatter._get_help_string(action) or ""
            if "default" not in text and "required" not in text:
                missing.setdefault(command, []).append(action.option_strings[0])
    assert not missing


def test_train_help_marks_the_required_options_and_the_real_defaults(capsys):
    text = " ".join(help_text("train", capsys).split())
    for needed in ("--data", "--steps", "--out", "--model", "--config"):
        assert needed in text
    assert text.count("required; with --resume: the checkpoint's") == 5
    for default in ("(default: 0.0004)", "(default: 16384)", "(default: delayed)", "(default: 1022)"):
        assert default in text


@pytest.mark.parametrize("command", sorted(COMMAND_HELP))
def test_help_imports_no_torch(command):
    """`--help` answers without torch (4 s of imports): the parser modules import it only to run."""
    module, function = COMMAND_HELP[command].rsplit(".", 1)
    done = help_without_torch(f"from {module} import {function}; {function}(['--help'], 'nv-esm {command}')")
    assert "usage:" in done.stdout


def help_without_torch(statement: str) -> subprocess.CompletedProcess:
    """Run `statement` (a one-line --help, ending in SystemExit 0) in a fresh interpreter in the repository root;
    fails unless it exits 0 without importing torch or transformers."""
    code = (
        f"import runpy, sys\ntry:\n    {statement}\n"
        "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize(
    ("parse", "argv", "dest", "value", "old", "new"),
    [
        (
            cli.parse_embed_args,
            ["--token-budget", "99"],
            "tokens_per_batch",
            99,
            "--token-budget",
            "--tokens-per-batch",
        ),
        (cli.parse_score_args, ["--fp8-recipe", "current"], "fp8_scaling", "current", "--fp8-recipe", "--fp8-scaling"),
        (cli.parse_proteingym_args, ["--force"], "overwrite", True, "--force", "--overwrite"),
    ],
)
def test_old_names_of_the_inference_commands_work_with_a_notice(tmp_path, capsys, parse, argv, dest, value, old, new):
    positional = ["ckpt", "a.fasta", str(tmp_path / "out.csv")] if parse is not cli.parse_proteingym_args else []
    positional = positional or ["ckpt", "ref.csv", "assays", str(tmp_path / "out")]
    args = parse([*positional, *argv], "nv-esm x")
    assert getattr(args, dest) == value
    assert capsys.readouterr().err == f"note: {old} is now {new}\n"


def test_old_names_of_train_and_export_work_with_a_notice(capsys):
    from nv_esm.train.config import option_flag, parse_config

    argv = ["--model", "m", "--data", "d.fasta", "--steps", "3", "--out", "o"]
    config = parse_config([*argv, "--token-budget", "512", "--fp8-recipe", "block"])
    assert (config.data.token_budget, config.model.fp8_recipe) == (512, "block")
    err = capsys.readouterr().err
    assert "note: --token-budget is now --tokens-per-batch\n" in err
    assert "note: --fp8-recipe is now --fp8-scaling\n" in err
    config = parse_config([*argv, "--tokens-per-batch", "256", "--fp8-scaling", "current"])
    assert (config.data.token_budget, config.model.fp8_recipe) == (256, "current")
    assert option_flag("token_budget") == "--tokens-per-batch"
    assert cli.parse_export_args(["c", "o", "--force"], "nv-esm train export").overwrite
    assert capsys.readouterr().err == "note: --force is now --overwrite\n"


def test_convert_force_is_overwrite_with_a_notice(capsys):
    from convert_checkpoint import build_parser

    assert build_parser().parse_args(["hf-to-te", "src", "out", "--force"]).overwrite
    assert capsys.readouterr().err == "note: --force is now --overwrite\n"


def test_an_fp8_scaling_a_command_does_not_run_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_embed_args(["c", "f", "o", "--fp8-scaling", "delayed"], "nv-esm embed")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'block'" in err and "'current'" in err


def test_method_names_read_dashes_and_underscores_alike(tmp_path, capsys):
    args = cli.parse_score_args(
        ["c", "w.fasta", str(tmp_path / "s.csv"), "--mutants", "m.csv", "--methods", "masked-marginal"], "nv-esm score"
    )
    assert args.methods == ("masked_marginal",)
    args = cli.parse_proteingym_args(["c", "r", "a", str(tmp_path / "o"), "--methods", "wt_marginals"], "x")
    assert args.methods == ("wt-marginals",)
    with pytest.raises(SystemExit):  # ProteinGym's per-site method is not score's joint mask: said, not swapped
        cli.parse_score_args(
            ["c", "w", str(tmp_path / "s.csv"), "--mutants", "m", "--methods", "masked-marginals"], "x"
        )
    assert "masked-marginals is nv-esm proteingym's" in capsys.readouterr().err


def test_the_vocabulary_matches_the_modules_that_act_on_it():
    """nv_esm.vocabulary's repetition of the model's own choices (`configuration_nv_esm`, which imports
    transformers) agrees with them; the package's modules take their names from it."""
    import configuration_nv_esm
    from nv_esm import embed_plan, proteingym_scoring, records, scoring, vocabulary

    assert vocabulary.BACKENDS == configuration_nv_esm.BACKENDS
    assert vocabulary.FP8_LAYER_CHOICES == configuration_nv_esm.FP8_LAYER_CHOICES
    assert vocabulary.FP8_RECIPES == configuration_nv_esm.FP8_RECIPES
    assert set(vocabulary.FP8_SCALINGS) < set(vocabulary.FP8_RECIPES)
    assert records.INVALID_POLICIES is vocabulary.INVALID_POLICIES
    assert tuple(embed_plan.SAVE_DTYPES) == vocabulary.SAVE_DTYPE_NAMES
    import convert_checkpoint
    from nv_esm import checkpoint_io, conversion_plan

    assert tuple(checkpoint_io.DTYPES) == vocabulary.CONVERT_DTYPE_NAMES  # convert's --dtype
    assert set(conversion_plan.DIRECTIONS) == set(convert_checkpoint.COMMANDS) - {"verify"}  # convert's commands
    assert scoring.METHODS is vocabulary.SCORE_METHODS
    assert proteingym_scoring.METHODS is vocabulary.PROTEINGYM_METHODS


def test_a_non_empty_output_exits_1_in_convert_and_train_export(tmp_path, capsys):
    """The same refusal, the same status: 1 (2 is argparse's, for usage errors)."""
    import convert_checkpoint
    from nv_esm.train.export import export_main

    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000001"
    checkpoint.mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(checkpoint), str(out)], "nv-esm train export")
    assert exit_info.value.code == 1
    assert convert_checkpoint.main(["hf-to-te", str(ROOT / "assets" / "esm2_tiny"), str(out)]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(": error: " in line for line in errors)


def test_fp8_without_transformer_engine_errors_alike_in_embed_and_train(tmp_path):
    """`--fp8 all` where the layers cannot run FP8 (the CPU): one line naming what was passed and what FP8 needs, in
    both commands (train used to warn and run without FP8)."""
    import torch

    from nv_esm.embed_plan import command_backend
    from nv_esm.train.config import parse_config

    fasta = tmp_path / "a.fasta"
    fasta.write_text(">a\nMKT\n")
    embed_args = cli.parse_embed_args(["c", str(fasta), str(tmp_path / "o"), "--fp8", "all", "--backend", "torch"], "x")
    with pytest.raises(ValueError) as embed_error:
        command_backend(embed_args, torch.device("cpu"))
    argv = ["--model", "m", "--data", str(fasta), "--steps", "3", "--out", str(tmp_path / "run")]
    config = parse_config([*argv, "--fp8", "all", "--backend", "torch"])
    with pytest.raises(ValueError) as train_error:
        config.validate()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert str(train_error.value) == options.fp8_refusal("all", "torch", device)
    assert str(embed_error.value) == options.fp8_refusal("all", "torch", "cpu")
    assert "--cuda-graphs" not in str(embed_error.value) and "--fp8 all" in str(embed_error.value)
    assert "\n" not in str(embed_error.value)


@pytest.mark.parametrize(
    ("start", "argv"),
    [
        ("runpy.run_module('nv_esm.train', run_name='__main__', alter_sys=True)", ["--help"]),
        ("runpy.run_path('recipes/train.py', run_name='__main__')", ["--help"]),
        ("runpy.run_module('nv_esm', run_name='__main__', alter_sys=True)", ["train", "--help"]),
    ],
)
def test_every_entry_point_answers_help_without_torch(start, argv):
    """`python -m nv_esm.train --help`, `recipes/train.py --help` and `python -m nv_esm train --help` start the
    command as `nv-esm` does (`cli.run_command`): the help comes from the parser alone, torch not imported."""
    done = help_without_torch(f"sys.argv = ['x', *{argv!r}]; {start}")
    assert done.stdout.startswith("usage: nv-esm train ")
