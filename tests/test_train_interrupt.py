"""Ctrl-C and the trainer's words: a signal is acknowledged at once (rank 0) and the run stops after the step it is
in, with a checkpoint; the exit line names the checkpoint that exists (or says there is none); a second Ctrl-C stops
at once; Ctrl-C during start-up is one line. In-process: the wording of the layout, weights, resume and verify lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked_ranks
import pytest
from test_recipe_edges import TIMEOUT, records
from test_recipe_train import mlm_args

from conftest import ROOT, SHAPES
from nv_esm.train.loop import StopSignals, checkpoint_state, resume_line
from nv_esm.train.materialize import weights_line

ENV = {**os.environ, **forked_ranks.SERVER_ENV}
ACK = "nv-esm train: Ctrl-C: stopping after this step (a checkpoint is written first); Ctrl-C again to stop now."


def as_from_a_terminal() -> None:
    """In the child before it runs: Ctrl-C's disposition as a shell gives it (default, not blocked), whatever the
    test worker's own threads left behind (a blocked or ignored SIGINT is inherited across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def start(command: list[str], stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """COMMAND in a session (and process group) of its own, as from a terminal, its stderr read line by line."""
    return subprocess.Popen(
        command,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
    )


def trainer(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "nv_esm.train", "--backend", "torch", "--out", str(out), *args]


def wait_for_step(process: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.jsonl").exists() or not records(out):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)


def read_until(process: subprocess.Popen, text: str, seconds: float) -> float:
    """Seconds until a stderr line holds `text` (fails after `seconds`)."""
    begun = time.monotonic()
    for line in process.stderr:
        if text in line:
            return time.monotonic() - begun
        assert time.monotonic() - begun < seconds, f"no {text!r} within {seconds} s"
    raise AssertionError(f"stderr ended without {text!r}")


@pytest.mark.slow
def test_ctrl_c_is_acknowledged_at_once_and_the_exit_line_names_the_checkpoint(tmp_path, tiny_config):
    """--log-every 100000: the acknowledgement used to wait for the next logging step; the run stops after the
    step it is in, and its last line names the checkpoint written then."""
    out = tmp_path / "run"
    command = trainer(out, *mlm_args(tiny_config, 100_000, "--no-export", "--log-every", "100000"))
    process = start(command, stdout=subprocess.PIPE)
    assert any(line.startswith("weights: ") for line in process.stdout)  # the last line before the training
    time.sleep(3)  # no record before step 100000
    os.killpg(process.pid, signal.SIGINT)
    assert read_until(process, ACK, seconds=2) < 2
    err = process.stderr.read()
    process.wait(timeout=TIMEOUT)
    assert process.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    found = sorted((out / "checkpoints").iterdir())
    assert len(found) == 1 and last.endswith(f": {found[0]} saved; --resume continues."), last
    assert "Traceback" not in err


@pytest.mark.slow
def test_without_checkpoints_ctrl_c_promises_none(tmp_path, tiny_config):
    out = tmp_path / "run"
    process = start(trainer(out, *mlm_args(tiny_config, 100_000, "--no-checkpoint", "--log-every", "1")))
    wait_for_step(process, out)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 130, err[-3000:]
    assert "--no-checkpoint: nothing is saved); Ctrl-C again to stop now." in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(f"no checkpoint written; no checkpoint in {out} yet: a rerun starts over.")
    )


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_promises_no_checkpoint(tmp_path):
    """Steps of seconds (a wider model, longer batches): the second Ctrl-C lands in the step the first did."""
    fields = json.loads((ROOT / "config.json").read_text())
    fields.update(SHAPES["wide_heads"], num_hidden_layers=6)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(fields))
    out = tmp_path / "run"
    args = mlm_args(config, 100_000, "--log-every", "1", "--no-export", "--max-length", "1022")
    process = start(trainer(out, *args, "--token-budget", "16384"))
    wait_for_step(process, out)
    os.killpg(process.pid, signal.SIGINT)
    read_until(process, ACK, seconds=2)
    time.sleep(1.3)  # a repeat within a second is taken for the same Ctrl-C (torchrun forwards it)
    os.killpg(process.pid, signal.SIGINT)
    err = process.stderr.read()
    process.wait(timeout=TIMEOUT)
    assert process.returncode == 130, err[-3000:]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step_*")), err
    line = err.strip().splitlines()[-1]
    assert line.startswith("nv-esm train: stopped at once after step ") and line.endswith(
        f"no checkpoint in {out} yet: a rerun starts over."
    ), line


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1.0, 3.0])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, tiny_config, delay):
    out = tmp_path / "run"
    process = start(trainer(out, *mlm_args(tiny_config, 100_000)))
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 130 and err.count("\n") <= 2, err  # the note of a renamed option, at most
    line = err.strip().splitlines()[-1]  # during the imports (`cli.interrupted_start_up`) or after them (the trainer)
    assert line.startswith("nv-esm train: ") and "interrupted during start-up: " in line, err


@pytest.mark.slow
def test_ctrl_c_under_torchrun_is_acknowledged_once_and_saves(tmp_path, tiny_config):
    """torchrun forwards the Ctrl-C that the terminal already sent its ranks: that copy is not a second Ctrl-C."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    command += [str(ROOT / "recipes" / "train.py"), "--out", str(out), "--backend", "torch"]
    process = start([*command, *mlm_args(tiny_config, 100_000, "--no-export", "--log-every", "1")])
    wait_for_step(process, out)
    os.killpg(process.pid, signal.SIGINT)
    assert read_until(process, ACK, seconds=2) < 2
    err = process.stderr.read()
    process.wait(timeout=TIMEOUT)
    assert ACK not in err and "stopped at once" not in err, err[-3000:]
    step = max(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*"))
    assert f"nv-esm train: stopped by SIGINT after step {step}: {out / 'checkpoints' / f'step_{step:07d}'} saved" in err


def test_the_trainers_lines_in_words(tmp_path):
    assert StopSignals(True, saves=True).acknowledgement(signal.SIGINT) == ACK
    assert StopSignals(True, saves=True).acknowledgement(signal.SIGTERM) == (
        "nv-esm train: SIGTERM: stopping after this step (a checkpoint is written first); a second SIGTERM to stop now."
    )
    assert weights_line(34, [], True) == "weights: all 34 tensors from the checkpoint"
    assert weights_line(0, ["a"] * 34, False) == "weights: all 34 tensors initialised fresh (training from scratch)"
    fresh = [f"t{i}" for i in range(8)]
    assert weights_line(30, fresh, True) == (
        "weights: 30 tensors from the checkpoint, 8 initialised fresh: t0, t1, t2, t3, t4, t5, ..."
    )
    assert weights_line(30, fresh[:2], True).endswith("2 initialised fresh: t0, t1")
    out = tmp_path / "run"
    assert resume_line(out, 20, 100, 100, True) == f"resuming {out} at step 20 of 100"
    assert resume_line(out, 100, 100, 100, True) == (
        f"resuming {out} at step 100 of 100: the run is complete, nothing to train; exporting step 100 to "
        f"{out / 'final'} again"
    )
    assert resume_line(out, 100, 100, 100, False).endswith("nothing to export (--no-export)")
    assert checkpoint_state(out) == f"no checkpoint in {out} yet: a rerun starts over"  # OUT does not exist
    (out / "checkpoints" / "step_0000020").mkdir(parents=True)
    (out / "checkpoints" / "step_0000030.partial").mkdir()
    assert checkpoint_state(out) == (
        f"the last checkpoint is {out / 'checkpoints' / 'step_0000020'} (step 20); --resume continues from it"
    )
