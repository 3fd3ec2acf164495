"""The trainer at its edges: one-line errors with the exit status of the other commands, work kept on
Ctrl-C/SIGTERM, runs extended, steps that go non-finite, metrics that say what they hold. Single-process runs
(`python -m nv_esm.train`, a world of one) unless a test needs ranks."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import MISSING, fields
from pathlib import Path

import forked_ranks
import pytest
from test_recipe_train import DEMO_FASTA, mlm_args, run_recipe, train_here

from nv_esm.train.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
    ValidationConfig,
    build_parser,
    config_from_args,
)

TIMEOUT = 300


def train(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m nv_esm.train --backend torch ARGS --out OUT` on CPU, forked from a process that has imported the
    trainer (`forked_ranks`)."""
    argv = ["--backend", "torch", *args, *(["--out", out] if out is not None else [])]
    return forked_ranks.run("nv_esm.train.loop:main", argv, timeout=TIMEOUT)


def train_in_a_process(*args: str, out: Path) -> subprocess.CompletedProcess:
    """`python -m nv_esm.train --backend torch ARGS --out OUT` in a fresh interpreter (a real process's exit status
    and stderr, import-time output included)."""
    command = [sys.executable, "-m", "nv_esm.train", "--backend", "torch", *args, "--out", str(out)]
    env = {**os.environ, **forked_ranks.SERVER_ENV}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_line_error(done: subprocess.CompletedProcess, needle: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("nv-esm train: error: ") and needle in lines[0], lines[0]


def test_bad_inputs_give_one_line_errors(tmp_path, tiny_config, tiny_source):
    bad = tmp_path / "bad.fasta"
    bad.write_text(">a\nMKV\n>b\nMKJV\n")
    cases = [
        (mlm_args(tiny_config, 2, "--data", str(bad)), "bad.fasta, record 2: the sequence: 'J' at residue 3"),
        (mlm_args(tiny_config, 2, "--data", str(tmp_path / "none.fasta")), "none.fasta does not exist"),
        (mlm_args(tiny_config, 2, "--mask-prob", "1.5"), "--mask-prob must be in (0, 1)"),
        (mlm_args(tiny_config, 2, "--mask-prob", "0"), "--mask-prob must be in (0, 1)"),
        (mlm_args(tiny_config, 2, "--save-every", "-1"), "--save-every must be at least 0"),
        (mlm_args(tiny_config, 2, "--max-length", "0"), "--max-length must be at least 1 residue, got 0"),
        (mlm_args(tiny_config, 2, "--resume"), "--resume: no checkpoint"),
        (["--model", str(tiny_source), "--data", str(DEMO_FASTA), "--steps", "2"], "convert"),
        (["--model", "facebook/esm2_t6_8M_UR50D", "--data", str(DEMO_FASTA), "--steps", "2"], "esm2_t6_8M_UR50D"),
    ]
    for index, (args, needle) in enumerate(cases):
        one_line_error(train_here(*args, out=tmp_path / f"run{index}"), needle)


@pytest.mark.slow
def test_a_refusal_exits_1_with_one_line_on_stderr(tmp_path, tiny_config):
    """The process behind the in-process checks (`train_here`): `python -m nv_esm.train` exits 1 with the refusal's
    one line on stderr, and 2 with argparse's one line for a usage error."""
    refused = train_in_a_process(*mlm_args(tiny_config, 2, "--mask-prob", "1.5"), out=tmp_path / "run")
    one_line_error(refused, "--mask-prob")
    done = train_in_a_process(*mlm_args(tiny_config, 2, "--seed", "1e23"), out=tmp_path / "usage")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "argument --seed: invalid int value: '1e23'" in lines[0]


@pytest.mark.slow
def test_an_existing_run_and_changed_options_on_resume_are_one_line_errors(tmp_path, tiny_config):
    out = tmp_path / "run"
    assert train(*mlm_args(tiny_config, 2, "--no-export"), out=out).returncode == 0
    one_line_error(train_here(*mlm_args(tiny_config, 2), out=out), "pass --resume to continue")
    one_line_error(train_here(*mlm_args(tiny_config, 2, "--resume", "--lr", "1e-3"), out=out), "--lr 0.003 -> 0.001")


@pytest.mark.slow
def test_a_finished_run_is_extended_with_a_larger_steps(tmp_path, tiny_config):
    out = tmp_path / "run"
    assert train(*mlm_args(tiny_config, 2, "--no-export", "--log-every", "1"), out=out).returncode == 0
    done = train(*mlm_args(tiny_config, 4, "--resume", "--no-export", "--log-every", "1"), out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    one_line_error(train(*mlm_args(tiny_config, 3, "--resume"), out=out), "at step 4, past --steps 3")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_resume_continues(tmp_path, tiny_config, signum):
    """The default --save-every 0 used to leave nothing to resume after a kill at step 19 of 50."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "nv_esm.train", "--backend", "torch", "--out", str(out)]
    command += mlm_args(tiny_config, 10_000, "--log-every", "1", "--no-export")
    env = {**os.environ, **forked_ranks.SERVER_ENV}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.jsonl").exists() or len(records(out)) < 3:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 128 + signum, err[-3000:]
    step = records(out)[-1]["step"]
    checkpoint = out / "checkpoints" / f"step_{step:07d}"
    assert err.strip().splitlines()[-1] == (
        f"nv-esm train: stopped by {signal.Signals(signum).name} after step {step}: {checkpoint} saved; --resume "
        "continues."
    )
    done = train(*mlm_args(tiny_config, 10_000, "--resume", "--stop-at-step", str(step + 2)), out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in records(out)][-2:] == [step + 1, step + 2]


@pytest.mark.slow
def test_a_non_finite_step_stops_the_run_or_is_skipped_when_asked(tmp_path, tiny_config):
    args = mlm_args(tiny_config, 4, "--lr", "1e30", "--log-every", "1")
    done = train(*args, out=tmp_path / "stop")
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("nv-esm train: error")]
    assert len(errors) == 1 and "training stopped without saving it" in errors[0], done.stderr[-3000:]
    assert errors[0].startswith("nv-esm train: error: step ") and "Traceback" not in done.stderr
    assert not (tmp_path / "stop" / "checkpoints").exists() and not (tmp_path / "stop" / "final").exists()
    done = train(*args, "--skip-nonfinite", "--no-export", out=tmp_path / "skip")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = records(tmp_path / "skip")
    assert len(rows) == 4 and any(row.get("skipped") for row in rows)


@pytest.mark.slow
def test_metrics_rows_say_which_figures_are_the_intervals(tmp_path, tiny_config):
    out = tmp_path / "run"
    assert train(*mlm_args(tiny_config, 4, "--log-every", "2", "--no-export"), out=out).returncode == 0
    rows = records(out)
    assert [row["interval"] for row in rows] == [[1, 2], [1, 2], [3, 4], [3, 4]]
    assert "max_memory_gb" not in rows[0]  # no GPU: no memory figure rather than 0.0
    assert len({row["loss"] for row in rows}) == 4  # each step's own loss


@pytest.mark.slow
def test_two_ranks_report_a_bad_record_once(tmp_path, tiny_config):
    bad = tmp_path / "bad.fasta"
    bad.write_text("".join(f">p{i}\nMKV{'J' if i == 5 else ''}L\n" for i in range(8)))
    done = run_recipe(tmp_path / "run", *mlm_args(tiny_config, 2, "--data", str(bad)), check=False)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if "nv-esm train: error" in line]
    assert len(ours) == 1 and "bad.fasta, record 6: the sequence: 'J' at residue 4" in ours[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr  # no worker traceback (the forked ranks print one as an interpreter does)


def flip_4_kib(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    path.write_bytes(bytes(data))


DAMAGED_RUN_ARGS = ("--save-every", "1", "--keep", "2", "--no-export", "--log-every", "1")


@pytest.fixture(scope="module")
def stopped_at_step_2(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> Path:
    """A 3-step run stopped after step 2 with both checkpoints kept: one run for the damage cases, each of which
    damages a copy."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    done = train(*mlm_args(tiny_config, 3, *DAMAGED_RUN_ARGS), "--stop-at-step", "2", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda step: flip_4_kib(step / "__0_0.distcp"), "__0_0.distcp differs from the file that was written"),
        (lambda step: (step / "__0_0.distcp").write_bytes((step / "__0_0.distcp").read_bytes()[:1000]), "differs"),
        (lambda step: (step / "train_state.json").write_text("{broken"), "JSONDecodeError"),
        (lambda step: (step / ".metadata").unlink(), "No such file"),
    ],
    ids=["flipped", "truncated", "train-state", "metadata-missing"],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
    tmp_path, tiny_config, stopped_at_step_2, damage, reason
):
    out = Path(shutil.copytree(stopped_at_step_2, tmp_path / "run"))
    args = mlm_args(tiny_config, 3, *DAMAGED_RUN_ARGS)
    damage(out / "checkpoints" / "step_0000002")
    done = train(*args, "--resume", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    warning = next(line for line in done.stderr.splitlines() if line.startswith("warning:"))
    assert "step_0000002 is damaged" in warning and reason in warning, warning
    assert [r["step"] for r in records(out)] == [1, 2, 2, 3]  # step 2 again, from step 1's checkpoint
    from test_recipe_train import export_command

    damage(out / "checkpoints" / "step_0000003")
    exported = export_command(str(out / "checkpoints" / "step_0000003"), str(tmp_path / "hub"))
    assert exported.returncode == 1 and len(exported.stderr.strip().splitlines()) == 1, exported.stderr
    assert "step_0000003 is damaged" in exported.stderr and not (tmp_path / "hub").exists()


@pytest.mark.slow
def test_a_resume_with_every_checkpoint_damaged_says_so_in_one_line(tmp_path, tiny_config):
    out = tmp_path / "run"
    args = mlm_args(tiny_config, 2, "--no-export")
    assert train(*args, "--stop-at-step", "1", out=out).returncode == 0
    flip_4_kib(out / "checkpoints" / "step_0000001" / "__0_0.distcp")
    done = train(*args, "--resume", out=out)
    lines = [line for line in done.stderr.splitlines() if line.startswith("nv-esm train: error")]
    assert done.returncode == 1 and len(lines) == 1 and "every checkpoint in" in lines[0], done.stderr[-3000:]


@pytest.mark.slow
def test_data_smaller_than_a_micro_batch_is_said_to_repeat(tmp_path, tiny_config):
    small = tmp_path / "small.fasta"
    small.write_text(">a\nMKTAYIAK\n>b\nMKVL\n")
    done = train(*mlm_args(tiny_config, 1, "--data", str(small), "--no-export"), out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warning: a data stream holds 16 tokens, fewer than --tokens-per-batch 1024" in done.stderr
    assert "repeats" not in train(*mlm_args(tiny_config, 1, "--no-export"), out=tmp_path / "big").stderr


def test_every_option_is_one_field_with_its_help_and_default():
    """Each field of every section (and `out`, `seed`) is one command-line option with its help text and default;
    --max-length is given in residues and held in tokens (<cls> and <eos>: 2 more)."""
    parser = build_parser()
    sections = (
        ModelConfig,
        DataConfig,
        ValidationConfig,
        OptimizerConfig,
        ParallelConfig,
        CheckpointConfig,
        LoggingConfig,
    )
    items = [item for section in sections for item in fields(section)]
    items += [item for item in fields(TrainConfig) if item.name in ("out", "seed")]
    actions = {
        action.option_strings[0]: action
        for action in parser._actions
        if action.dest != "help" and action.help != argparse.SUPPRESS  # not an old name (`cli.RENAMED`)
    }
    assert len(actions) == len(items)
    for item in items:
        flag = item.metadata.get("flag", "--" + item.name.replace("_", "-"))
        action = actions[flag]
        assert item.metadata["help"] and action.help.startswith(item.metadata["help"]), flag  # + "required" notes
        default = item.default if item.default_factory is MISSING else item.default_factory()
        if default is MISSING:
            assert action.required, flag
            continue
        if flag.startswith("--no-"):  # a field on by default, turned off by the flag
            default = not default
        expected = {"--max-length": DataConfig.max_length - 2}.get(flag, default)
        assert action.default == (list(expected) if isinstance(expected, tuple) else expected), flag
    minimal = ["--model", "m", "--data", "d", "--steps", "1", "--out", "o"]
    assert config_from_args(parser.parse_args(minimal)) == TrainConfig(
        model=ModelConfig(init_from="m"),
        data=DataConfig(files=["d"]),
        optimizer=OptimizerConfig(steps=1),
        out=Path("o"),
    )
