"""The lock of an output folder that a command's run writes (`nv-esm embed`, `nv-esm score`, `nv-esm train`)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def folder_lock(folder: Path, lock_name: str, command: str) -> Iterator[None]:
    """Hold `folder` (created if needed) while this run writes it: another run of `command` into it is refused with
    a one-line FileExistsError naming the folder and the process that holds it. An advisory lock (`flock`) on
    `folder/lock_name`, which the system releases if the process dies; the file is removed at the end. A link planted
    at `folder/lock_name` is refused (FileExistsError), never written through."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / lock_name
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # never through a planted link
    except OSError as error:
        if not path.is_symlink():
            raise
        raise FileExistsError(f"{path} is a link, not {command}'s lock file ({error.strerror}); remove it.") from None
    with open(descriptor, "r+", encoding="utf-8") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            raise FileExistsError(
                f"{folder} is being written by another {command} run ({holder}); wait for it to end, or choose "
                "another folder."
            ) from None
        file.truncate(0)
        file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        try:
            yield
        finally:
            path.unlink(missing_ok=True)
