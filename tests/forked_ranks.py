"""Commands' `main(argv)` run in processes forked from one that has imported them already, for the tests that train
on CPU: one process as `python -m MODULE ARGS` would be, or `ranks` processes as `torchrun --standalone
--nproc-per-node RANKS` starts them (its environment variables; when one rank fails, the others are stopped as
torchrun stops them). A fresh interpreter spends ~6 s of CPU importing torch, transformers and nv_esm, which was
most of a short training run in the test suite; a fork starts with them imported, and every run starts from the
same untouched interpreter (nothing of one run reaches the next).

What a real process and a real torchrun do that a fork does not check (signals to a process group, the module entry
points' exit status, import-time warnings) keeps real processes: `tests/test_recipe_robust.py`, `test_cli.py`.

Run as a script, this file is the forking server: it imports `PRELOADED` (with `OMP_NUM_THREADS=1` and no CUDA
device, as the tests' runs had), then reads one JSON request a line on stdin and answers each with one JSON line.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOADED = ("nv_esm.train.loop",)
# torchrun's grace between the SIGTERM and the SIGKILL of the ranks it stops after one failed
STOP_GRACE_SECONDS = 30.0
SERVER_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def run(
    target: str,
    argv: list[str],
    ranks: int = 0,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
    umask: int | None = None,
) -> subprocess.CompletedProcess:
    """`target` ("module:function", called with `argv`; its int return or SystemExit code is the exit status) in
    one forked process (`ranks` 0: no torchrun variables) or in `ranks` (torchrun's variables; the status is the
    first failed rank's, else 0). `env` replaces the process's environment (default: this one's, with
    `SERVER_ENV`); `umask` is the processes' (default: the server's). stdout and stderr hold what every process
    printed, as under torchrun. Raises `subprocess.TimeoutExpired` after `timeout` seconds (the processes are
    killed). Ranks whose rendezvous port was taken between its probe and their bind (EADDRINUSE, before the run
    touched anything: a concurrent test took it) are run again, up to twice."""
    for _ in range(2):
        done = _run_once(target, argv, ranks, env, timeout, umask)
        if not (ranks and done.returncode != 0 and "EADDRINUSE" in done.stderr):
            return done
    return _run_once(target, argv, ranks, env, timeout, umask)


def _run_once(
    target: str, argv: list[str], ranks: int, env: dict[str, str] | None, timeout: float, umask: int | None
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="forked_ranks_") as folder:
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        request = {
            "target": target,
            "argv": [str(word) for word in argv],
            "ranks": ranks,
            "env": {**os.environ, **SERVER_ENV} if env is None else env,
            "cwd": os.getcwd(),
            "stdout": str(stdout),
            "stderr": str(stderr),
            "timeout": timeout,
            "umask": umask,
        }
        answer = _server().ask(request)
        done = subprocess.CompletedProcess(
            ["forked", target, *request["argv"]], answer["returncode"], stdout.read_text(), stderr.read_text()
        )
    if answer.get("timed_out"):
        raise subprocess.TimeoutExpired(done.args, timeout, done.stdout, done.stderr)
    return done


class _Server:
    """The forking server, started at the first `run` of this test process and ended with it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **SERVER_ENV},
        )
        self.lock = threading.Lock()
        atexit.register(self.close)

    def ask(self, request: dict) -> dict:
        with self.lock:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the forking server {__file__} ended (status {self.process.poll()})")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # the server's loop ends at the end of its input
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.process.kill()


_started: list[_Server] = []


def _server() -> _Server:
    if not _started or _started[0].process.poll() is not None:
        _started[:] = [_Server()]
    return _started[0]


# ------------------------------------------------------------------------------------------------------------------
# The server side
# ------------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_env(request: dict, rank: int, port: int) -> dict[str, str]:
    env = dict(request["env"])
    if request["ranks"]:
        world = str(request["ranks"])
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), WORLD_SIZE=world,
                   LOCAL_WORLD_SIZE=world, ROLE_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")  # fmt: skip
    return env


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux's PR_SET_PDEATHSIG), so that neither the
    server (its parent: the test process) nor a run's ranks (theirs: the server) outlive what started them."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent ended before the request took effect
        os._exit(1)


def _child(request: dict, rank: int, port: int) -> int:
    """In the forked process: its environment, working folder and output files, then the target's exit status."""
    _die_with_parent()
    os.environ.clear()
    os.environ.update(_rank_env(request, rank, port))
    os.chdir(request["cwd"])
    if request["umask"] is not None:
        os.umask(request["umask"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    module, _, function = request["target"].partition(":")
    sys.argv = [module, *request["argv"]]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        status = getattr(importlib.import_module(module), function)(request["argv"])
    except SystemExit as exit_:
        status = exit_.code
    except BaseException:  # what an uncaught exception does to a process: `sys.excepthook` (a library's too), 1
        sys.excepthook(*sys.exc_info())
        status = 1
    if status is None or isinstance(status, int):
        return status or 0
    print(status, file=sys.stderr)
    return 1


def _exit_as_an_interpreter_does() -> None:
    """What a process's end runs before it exits: the wait for its non-daemon threads, then the atexit functions."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def _wait(children: dict[int, int], deadline: float) -> tuple[int, bool]:
    """The first failed rank's status (else 0), and whether the deadline passed; a failure or the deadline stops
    the other ranks (SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS`)."""
    status, timed_out, stop_at = 0, False, None
    while children:
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid:
            code = os.waitstatus_to_exitcode(wait_status)
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N
            children.pop(pid, None)
            if code and not status:
                status = code
                for other in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGTERM)
                stop_at = time.monotonic() + STOP_GRACE_SECONDS
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out, stop_at = True, now
        if stop_at is not None and now > stop_at:
            for other in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
        time.sleep(0.02)
    return status, timed_out


def _serve() -> None:
    _die_with_parent()
    for name in PRELOADED:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        port = _free_port()
        children = {}
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(max(1, request["ranks"])):
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    status = _child(request, rank, port)
                    _exit_as_an_interpreter_does()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)  # noqa: B012  (never back into the server's loop)
            children[pid] = rank
        status, timed_out = _wait(children, time.monotonic() + request["timeout"])
        print(json.dumps({"returncode": status, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    _serve()
