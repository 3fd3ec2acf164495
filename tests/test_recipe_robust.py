"""The trainer against what happens to real runs: Ctrl-C from a terminal and SIGTERM from a scheduler sent
to the whole process group, two runs into one folder, checkpoints whose checksums were deleted or that are damaged
twice, a disk that fills up during a save, and library warnings that ask nothing of the user. Single-process runs
(`python -m nv_esm.train`) unless a test needs ranks."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import forked_ranks
import pytest
import torch
from safetensors import safe_open
from test_recipe_edges import TIMEOUT, flip_4_kib, one_line_error, records, train, train_in_a_process
from test_recipe_train import export_command, mlm_args, run_recipe

from nv_esm.train.checkpoint import damage

ENV = {**os.environ, **forked_ranks.SERVER_ENV}  # the environment of every test run of the trainer


def start(out: Path, *args: str, **popen: object) -> subprocess.Popen:
    """`python -m nv_esm.train ARGS --out OUT` in a session (and process group) of its own."""
    command = [sys.executable, "-m", "nv_esm.train", "--backend", "torch", "--out", str(out), *args]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True, **popen
    )


def wait_for_records(process: subprocess.Popen, out: Path, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not (out / "metrics.jsonl").exists() or len(records(out)) < count:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)


def group_ended(pgid: int, seconds: float = 30.0) -> bool:
    """Whether every process of group `pgid` (the trainer's data workers too) has ended within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("sender", ["terminal", "scheduler"])
def test_a_signal_to_the_process_group_saves_a_checkpoint(tmp_path, tiny_config, sender):
    """Default options (one data worker, a log every 10 steps). A terminal's Ctrl-C reaches the whole foreground
    process group, and `kill -TERM -- -PGID` the whole group: the data worker used to die first, and the trainer then
    failed on its next batch ("[Errno 2] No such file or directory", "DataLoader worker ... is killed by signal")
    with no checkpoint."""
    out = tmp_path / "run"
    args = mlm_args(tiny_config, 10_000, "--no-export")
    if sender == "terminal":
        controller, terminal = pty.openpty()
        # The pty becomes the controlling terminal of the trainer's new session, its group the foreground one.
        process = start(out, *args, stdin=terminal, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(terminal)
        wait_for_records(process, out, 1)
        os.write(controller, termios.tcgetattr(controller)[6][termios.VINTR])  # the user types Ctrl-C
        signum = signal.SIGINT
    else:
        process = start(out, *args)
        wait_for_records(process, out, 1)
        subprocess.run(["kill", "-TERM", "--", f"-{os.getpgid(process.pid)}"], check=True)
        signum = signal.SIGTERM
    _, err = process.communicate(timeout=TIMEOUT)
    if sender == "terminal":
        os.close(controller)
    assert process.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "error" not in err, err[-3000:]
    step = records(out)[-1]["step"]
    checkpoint = out / "checkpoints" / f"step_{step:07d}"
    assert err.strip().splitlines()[-1] == (
        f"nv-esm train: stopped by {signum.name} after step {step}: {checkpoint} saved; --resume continues."
    )
    assert group_ended(process.pid), "a data worker outlived the trainer"
    resume = mlm_args(tiny_config, 10_000, "--resume", "--stop-at-step", str(step + 1), "--log-every", "1")
    done = train(*resume, out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert records(out)[-1]["step"] == step + 1


@pytest.mark.slow
def test_a_second_run_into_a_run_folder_in_use_is_refused(tmp_path, tiny_config):
    """Two runs into one --out used to write into each other's checkpoints (or one died: "Directory not empty")."""
    out = tmp_path / "run"
    first = start(out, *mlm_args(tiny_config, 10_000, "--no-export", "--log-every", "1"))
    wait_for_records(first, out, 1)
    second = train(*mlm_args(tiny_config, 2, "--seed", "4"), out=out)
    one_line_error(second, f"{out} is being written by another nv-esm train run (process {first.pid} on ")
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=TIMEOUT)
    assert first.returncode == 128 + signal.SIGTERM, err[-3000:]
    step = records(out)[-1]["step"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{step:07d}"]
    assert [r["step"] for r in records(out)] == list(range(1, step + 1))  # the first run's steps only
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "metrics.png"]  # no lock left


@pytest.mark.slow
def test_a_checkpoint_without_its_checksums_is_damaged_and_a_step_can_be_set_aside_twice(tmp_path, tiny_config):
    """A deleted checksums.json used to let a resume (and export) take flipped weights as whole; and a step damaged,
    saved again by the resume and damaged again blocked --resume ("Directory not empty: step_0000002 ->
    step_0000002.damaged") although step 1 was whole."""
    out, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = mlm_args(tiny_config, 3, "--save-every", "1", "--no-export", "--log-every", "1", "--keep", "0")
    assert train(*args, "--stop-at-step", "2", out=out).returncode == 0
    (checkpoints / "step_0000002" / "checksums.json").unlink()
    flip_4_kib(checkpoints / "step_0000002" / "__0_0.distcp")
    exported = export_command(str(checkpoints / "step_0000002"), str(tmp_path / "hub"))
    assert exported.returncode == 1 and len(exported.stderr.strip().splitlines()) == 1, exported.stderr
    assert "step_0000002 is damaged: checksums.json is missing" in exported.stderr and not (tmp_path / "hub").exists()
    for again in ("", "-2"):
        done = train(*args, "--resume", "--stop-at-step", "2", out=out)
        assert done.returncode == 0, done.stderr[-3000:]
        warning = next(line for line in done.stderr.splitlines() if line.startswith("warning:"))
        assert "step_0000002 is damaged" in warning and f"kept as step_0000002.damaged{again};" in warning, warning
        flip_4_kib(checkpoints / "step_0000002" / "__0_0.distcp")  # damaged again, at the same step
    done = train(*args, "--resume", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in records(out)] == [1, 2, 2, 2, 2, 3]
    names = ["step_0000001", "step_0000002", "step_0000002.damaged", "step_0000002.damaged-2", "step_0000002.damaged-3"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [*names, "step_0000003"]


def as_an_earlier_release(step: Path) -> None:
    """Rewrite checkpoint `step` as releases before checksums wrote it: RNG states in rng_rank0.pt, no checksums."""
    with safe_open(step / "rng_rank0.safetensors", "pt") as file:
        state = {key: file.get_tensor(key) for key in file.keys()}
        metadata = file.metadata()
    python = (int(metadata["python_version"]), tuple(state.pop("python").tolist()))
    python += (json.loads(metadata["python_gauss_next"]),)
    torch.save({**state, "python": python}, step / "rng_rank0.pt")
    (step / "rng_rank0.safetensors").unlink()
    (step / "checksums.json").unlink()


@pytest.mark.slow
def test_an_earlier_releases_checkpoint_that_does_not_read_is_a_one_line_error(tmp_path, tiny_config):
    """Without checksums, a truncated .distcp is found only when it is read: a one-line error, not a traceback; a
    train_state.json without its fields is damage found before."""
    out, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = mlm_args(tiny_config, 3, "--save-every", "1", "--no-export", "--log-every", "1")
    assert train(*args, "--stop-at-step", "2", out=out).returncode == 0
    for step in checkpoints.iterdir():
        as_an_earlier_release(step)
    assert damage(checkpoints / "step_0000002") is None  # earlier releases' checkpoints still resume (unchecked)
    shard = checkpoints / "step_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    one_line_error(train(*args, "--resume", out=out), f"{checkpoints / 'step_0000002'} is damaged: ")
    exported = export_command(str(checkpoints / "step_0000002"), str(tmp_path / "hub"))
    assert exported.returncode == 1 and len(exported.stderr.strip().splitlines()) == 1, exported.stderr
    assert "step_0000002 is damaged: " in exported.stderr and not (tmp_path / "hub").exists()
    state_path = checkpoints / "step_0000002" / "train_state.json"
    state = json.loads(state_path.read_text())
    del state["world_size"]
    state_path.write_text(json.dumps(state))
    done = train(*args, "--resume", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step_0000002 is damaged (train_state.json has no world_size)" in done.stderr, done.stderr[-3000:]
    assert [r["step"] for r in records(out)] == [1, 2, 2, 3]


# Run as `python -c FULL_DISK ARGS`: the trainer with DCP's file writer failing as on a full disk at step 4's save.
FULL_DISK = """
import errno, sys
import torch.distributed.checkpoint.filesystem as filesystem
from nv_esm.train.loop import main

write_item = filesystem._write_item

def full_disk(transforms, stream, *args, **kwargs):
    if "step_0000004" in str(getattr(stream, "name", "")):
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_item(transforms, stream, *args, **kwargs)

filesystem._write_item = full_disk
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_save_is_a_one_line_error(tmp_path, tiny_config):
    out = tmp_path / "run"
    command = [sys.executable, "-c", FULL_DISK, "--backend", "torch", "--out", str(out)]
    command += mlm_args(tiny_config, 6, "--save-every", "2", "--no-export", "--no-progress")
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=TIMEOUT)
    one_line_error(done, "checkpoint step_0000004 was not written (OSError: [Errno 28] No space left on device; ")
    assert "; the earlier checkpoints are intact (newest: step_0000002)." in done.stderr, done.stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000002"]  # no .partial left taking space
    assert damage(out / "checkpoints" / "step_0000002") is None


@pytest.mark.slow
def test_train_runs_print_no_library_warnings(tmp_path, tiny_config):
    """DCP's "torch.distributed is disabled" (the export at the end of every run) and FSDP2's "returned a view
    tensor" (every step of a run on several ranks) asked nothing of the user. Real processes: a fork would hide
    what the imports print."""
    one = train_in_a_process(*mlm_args(tiny_config, 2), out=tmp_path / "one")
    two = run_recipe(tmp_path / "two", *mlm_args(tiny_config, 2), ranks=2, torchrun=True)
    for done in (one, two):
        assert done.returncode == 0 and (done.stdout.count("wrote ") == 1), done.stderr[-3000:]
        assert "Warning" not in done.stderr and "warn" not in done.stderr.lower(), done.stderr[-3000:]
