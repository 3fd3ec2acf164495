"""What a training run reports: per-step numbers (`StepResult`) and validation metrics in metrics.jsonl / tqdm /
TensorBoard, and their picture, metrics.png (`MetricsLog`), and torch.profiler traces of chosen steps (`StepProfiler`;
summarised by `nv_esm.trace_summary`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from nv_esm.path_guard import refuse_links
from nv_esm.plots import PLOTS_HINT, plot_training, pyplot
from nv_esm.shapes import peak_tflops
from nv_esm.train.config import LoggingConfig
from nv_esm.train.parallel import Dist


@dataclass
class StepResult:
    """One step's numbers, left on the device (reading them would wait for the GPU) until they are logged.

    `sums` `[3]` float64 holds the global summed loss, label count and token count; `grad_norm` (a scalar) the
    global gradient norm; `lr` the learning rate and `flops` the model FLOPs of the step on this rank."""

    sums: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    flops: float
    skipped: bool = False  # --skip-nonfinite skipped the update (its gradient norm was not finite)


class NonFiniteStep(ValueError):
    """A step's loss or gradient norm was inf or nan (and --skip-nonfinite was not given): training stops."""


def open_log(path: Path) -> TextIO:
    """`path` opened to append to (created with the umask's permissions), never through a link planted there: a
    link is refused with a one-line FileExistsError (`refuse_links`), and one planted after that check fails to
    open (O_NOFOLLOW)."""
    refuse_links({"the run's log": path})
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    return open(descriptor, "a", encoding="utf-8")


def shown_value(value: float | None) -> str:
    """A validation metric as the console line shows it: 4 significant digits, a count (`val_count`) in full."""
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1e4:
        return f"{int(value):,}"
    return f"{value:.4g}"


class MetricsLog:
    """metrics.jsonl (rank 0): one record per step, and one of `val_*` keys per validation; a tqdm bar on rank 0,
    optional TensorBoard; peak GPU memory of every rank."""

    def __init__(self, out: Path, settings: LoggingConfig, total_steps: int, world: Dist, first_step: int) -> None:
        from nv_esm.job_clock import WholeBar

        self.world, self.out, self.missing_plot = world, out, False
        self.peak = peak_tflops(torch.cuda.get_device_name()) if world.device.type == "cuda" else None
        self.file = open_log(out / "metrics.jsonl") if world.is_main else None
        self.bar = WholeBar(
            total=total_steps,
            initial=first_step,
            disable=not world.is_main or not settings.progress,
            unit="step",
            dynamic_ncols=True,
        )
        self.tensorboard = None
        if settings.tensorboard and world.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(out / "tensorboard")

    def log(self, first_step: int, results: list[StepResult], started: float) -> None:
        """Write the steps `first_step`, `first_step + 1`, ... of `results`, launched since `started`
        (`time.perf_counter()`). One wait for the GPU per call. Each record holds its step's loss, gradient norm,
        learning rate and tokens; the throughput, time and memory fields are those of the logging interval
        (`interval`: its first and last step), the same in each of its records, and `device`, the device type the
        ranks run on (`cuda`, `cpu`: `tokens_per_s_per_gpu` is per process on the CPU). Raises `NonFiniteStep`
        (every rank alike: the numbers are global) after writing a step whose loss or gradient norm is not
        finite."""
        memory = [torch.zeros(1, device=self.world.device) for _ in range(self.world.world_size)]
        dist.all_gather(memory, torch.tensor([self.memory_gb()], device=self.world.device))
        values = torch.stack([torch.cat([r.sums.float(), r.grad_norm.reshape(1).float()]) for r in results]).tolist()
        seconds = time.perf_counter() - started
        tokens = sum(v[2] for v in values)
        tflops_per_gpu = sum(r.flops for r in results) / seconds / 1e12
        interval = dict(
            tokens_per_s=tokens / seconds,
            tokens_per_s_per_gpu=tokens / seconds / self.world.world_size,
            tflops_per_gpu=tflops_per_gpu,
            mfu=None if self.peak is None else tflops_per_gpu / self.peak,
            step_seconds=seconds / len(results),
            interval=[first_step, first_step + len(results) - 1],
            device=self.world.device.type,  # "cuda" or "cpu": what `tokens_per_s_per_gpu` is per (metrics.png)
        )
        if self.world.device.type == "cuda":
            interval.update(max_memory_gb=max(m.item() for m in memory))
            interval.update(memory_gb_per_rank=[round(m.item(), 2) for m in memory])
        steps = range(first_step, first_step + len(results))
        records = []
        for step, result, (loss_sum, labels, step_tokens, grad_norm) in zip(steps, results, values):
            record = dict(step=step, loss=loss_sum / max(labels, 1), lr=result.lr, grad_norm=grad_norm)
            record.update(tokens=int(step_tokens), **({"skipped": True} if result.skipped else {}), **interval)
            records.append(record)
        if self.world.is_main:
            for record in records:
                self.file.write(json.dumps(record) + "\n")
                if self.tensorboard is not None:
                    for key, value in record.items():
                        if key != "step" and isinstance(value, (int, float)):
                            self.tensorboard.add_scalar(key, value, record["step"])
            self.file.flush()
            last = records[-1]
            self.bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{interval['tokens_per_s']:.0f}", refresh=False)
        self.bar.update(len(results))  # drawn with the interval's loss; at the last step, by `close` alone
        if self.bar.n >= self.bar.total:  # 100% once, not again after the final validation
            self.bar.close()
        for record in records:
            if not record.get("skipped") and not math.isfinite(record["loss"] + record["grad_norm"]):
                raise NonFiniteStep(
                    f"step {record['step']}: loss {record['loss']}, gradient norm {record['grad_norm']}: training "
                    "stopped without saving it. Lower --lr, check the data, or pass --skip-nonfinite."
                )

    def log_validation(self, step: int, values: dict[str, float | None]) -> None:
        """Write the validation metrics after `step` (rank 0): a metrics.jsonl record, TensorBoard, a console line."""
        if not self.world.is_main:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in values.items():
                if value is not None:
                    self.tensorboard.add_scalar(key, value, step)
        shown = ", ".join(f"{key.removeprefix('val_')} {shown_value(value)}" for key, value in values.items())
        self.bar.write(f"step {step} validation: {shown}")

    def memory_gb(self) -> float:
        """This rank's peak GPU memory allocated so far, in GiB (0 on CPU)."""
        return torch.cuda.max_memory_allocated() / 2**30 if self.world.device.type == "cuda" else 0.0

    def draw(self) -> None:
        """OUT/metrics.png from metrics.jsonl (rank 0; `nv_esm.plots.plot_training`): at each checkpoint and at the
        end. Without matplotlib, one line at the end says how to get it."""
        if not self.world.is_main:
            return
        if pyplot() is None:
            self.missing_plot = True
            return
        plot_training(self.out / "metrics.jsonl", self.out / "metrics.png")

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
            self.draw()
            if self.missing_plot:
                print(PLOTS_HINT.format(what="the loss curve (OUT/metrics.png)"), file=sys.stderr)
        if self.tensorboard is not None:
            self.tensorboard.close()


class StepProfiler:
    """torch.profiler over steps `first .. first + count - 1` (CPU ops and GPU kernels); each rank writes
    OUT/profile/rank{r}.json.gz (a Chrome/Perfetto trace; one `record_function` span per step)."""

    def __init__(self, out: Path, first: int, count: int, world: Dist) -> None:
        self.path = out / "profile" / f"rank{world.rank}.json.gz"
        self.first, self.last = first, first + count - 1
        if count:  # the profile folder itself is checked with the run folder (`checkpoint.prepare_out`)
            refuse_links({"the profile trace": self.path})
        self.profiler = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around step `step`: starts the trace before the first traced step, writes it after the last."""
        if not self.first <= step <= self.last:
            yield
            return
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        with torch.profiler.record_function(f"train_step_{step}"):
            yield
        if step == self.last:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            self.profiler = None
