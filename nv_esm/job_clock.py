"""Where a command's time went, from process start to exit: `JobClock` charges each stretch of wall time to the phase
running then, and the command prints it as one line at the end (rank 0), e.g.

    time: start-up 4.2 s, input 0.3 s, load 3.1 s, batches 12.0 s (first result at 1.3 s; 9 CUDA graph captures
    1.5 s; 7,213,456 tokens, 601k tokens/s), writing 0.2 s, other 0.1 s; 21.0 s in all

Phases: `start-up` (the interpreter, imports and argument parsing: process start to the command's `main`), `input`
(reading and checking the input), `load` (the checkpoint: config, weights, tokenizer, model set-up), `batches` (the
model's work, from the first batch queued to the last result back; the first-shape work, CUDA graph captures and
their timing, happens inside it and is said apart), `writing` (waiting for output files, the index, summaries and
pictures), `other` (anything else: the output folder's checks and locks). Phases nest: time goes to the innermost
one open (a shard's write waited for inside the batch loop is writing, not batches).

`progress_bar` is the commands' progress bar (`WholeBar`: 100% said once, when the work is done), `ReportingProgress`
one that also tells the clock when the first results are back.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

PHASES = ("start-up", "input", "load", "batches", "writing", "other")


def process_start_time() -> float:
    """When this process started, in `time.time()` seconds (Linux: its age from /proc, to 1/CLK_TCK); elsewhere when
    this module was first imported."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22 of stat(5), after boot
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        return time.time() - (since_boot - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class JobClock:
    """Wall time per phase (`PHASES`) of one command run; made at the start of its `main` (start-up: the time
    before). `tokens` (the model's tokens the batches ran), `first_result` and the CUDA graph captures are filled in
    by the command."""

    def __init__(self, started: float | None = None) -> None:
        self.started = process_start_time() if started is None else started
        now = time.time()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["start-up"] = max(now - self.started, 0.0)
        self._open: list[str] = []
        self._mark = now
        self._batches_began: float | None = None
        self.first_result: float | None = None  # seconds from the first batch queued to its result back
        self.tokens = 0
        self.captures = 0
        self.capture_seconds = 0.0

    def _charge(self) -> None:
        now = time.time()
        self.seconds[self._open[-1] if self._open else "other"] += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside to `name` (one of `PHASES`; a phase opened inside takes its own time)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}")
        self._charge()
        self._open.append(name)
        if name == "batches" and self._batches_began is None:
            self._batches_began = self._mark
        try:
            yield
        finally:
            self._charge()
            self._open.pop()

    def result_back(self) -> None:
        """Note that a batch's results came back (the first one's time is reported)."""
        if self.first_result is None and self._batches_began is not None:
            self.first_result = time.time() - self._batches_began

    def batches_done(self, tokens: int, model: Any) -> None:
        """Note the batches' `tokens` (the model's, padding of CUDA graphs aside), and take the CUDA graph captures
        `model` (an NVEsm model) made, and their seconds, from its encoder."""
        self.tokens += tokens
        graphs = getattr(getattr(getattr(model, "base_model", model), "encoder", None), "graphs", None)
        seconds = getattr(graphs, "capture_seconds", [])
        self.captures, self.capture_seconds = len(seconds), sum(seconds)

    def line(self) -> str:
        """`time: PHASE S s, ...; TOTAL s in all`, the phases that took any time, in `PHASES` order."""
        self._charge()
        total = time.time() - self.started
        parts = []
        for name in PHASES:
            seconds = self.seconds[name]
            if seconds < 0.05 and name != "batches":
                continue
            text = f"{name} {seconds:.1f} s"
            if name == "batches":
                text += f" ({'; '.join(self._batch_details())})"
            parts.append(text)
        return f"time: {', '.join(parts)}; {total:.1f} s in all"

    def _batch_details(self) -> list[str]:
        details = []
        if self.first_result is not None:
            details.append(f"first result at {self.first_result:.1f} s")
        if self.captures:
            captures = "1 CUDA graph capture" if self.captures == 1 else f"{self.captures} CUDA graph captures"
            details.append(f"{captures} {self.capture_seconds:.1f} s")
        seconds = self.seconds["batches"]
        rate = f", {self.tokens / seconds / 1e3:,.0f}k tokens/s" if seconds > 0 else ""
        details.append(f"{self.tokens:,} tokens{rate}")
        return details


def progress_bar(total: int, desc: str, unit: str, disable: bool, unit_scale: bool = False) -> WholeBar:
    """The commands' progress bar over `total` units of work: it says 100% once, when the work is done."""
    return WholeBar(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable)


class WholeBar(tqdm):
    """A tqdm bar (`tqdm.auto`'s) that says "100%" once, at the end. tqdm rounds the percentage (99.6% of the work
    reads "100%") and, closing, prints the bar once more: a bar whose last update was printed said 100% twice in a
    log (where each refresh is a line of its own), or 100% before the work was done. Here the percentage is rounded
    down, and the update that completes the work is left to `close` to print."""

    @property
    def format_dict(self) -> dict:
        values = super().format_dict
        if values.get("total") and values.get("n", 0) < values["total"]:
            bar = self.bar_format or "{l_bar}{bar}{r_bar}"
            values["bar_format"] = bar.replace("{l_bar}", "{desc}: {percent_done:3d}%|")
            values["percent_done"] = min(int(100 * values["n"] / values["total"]), 99)
        return values

    def update(self, n: float = 1) -> bool | None:
        if not self.disable and self.total and self.n < self.total <= self.n + n:
            self.n += n  # the work is done: `close` prints the bar, once
            return None
        return super().update(n)


class ReportingProgress:
    """A progress bar (tqdm's, or anything with `update` and `close`) that also tells `clock` when the first
    batch's results are back (`JobClock.result_back`)."""

    def __init__(self, bar: Any, clock: JobClock) -> None:
        self.bar, self.clock = bar, clock

    def update(self, count: int) -> None:
        self.clock.result_back()
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()
