"""This rank's micro-batches: its data streams (`nv_esm.data`) as the run's config asks, prepared ahead of the
training loop in a background process, with the exact data position of each for checkpoints.
"""

from __future__ import annotations

import atexit
import signal
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from nv_esm.data import (
    Batches,
    ClassificationStream,
    Holdout,
    MLMStream,
    PackedBatch,
    rank_stream_indices,
    rank_streams,
)
from nv_esm.records import plural
from nv_esm.train.config import TrainConfig
from nv_esm.train.parallel import Dist


def make_batches(config: TrainConfig, world: Dist) -> tuple[Batches, dict[str, Any]]:
    """This rank's micro-batches (those of its data-parallel index: the ranks of a `--tp` group share them), and
    the config fields of a classification task's labels (`label_fields`). With `--val-fraction`, the records set
    aside for validation are left out."""
    data, task = config.data, config.model.task
    grad_accum = config.optimizer.grad_accum
    fraction = config.validation.fraction
    common = dict(
        token_budget=data.token_budget,
        max_length=data.max_length,
        seed=config.seed,
        holdout=Holdout(fraction, "train") if fraction else None,
        rules=data.rules,
    )
    if task == "mlm":
        batches = rank_streams(data.files, world.dp_rank, world.dp_size, grad_accum, mask_prob=data.mask_prob, **common)
        _warn_if_repeated(batches, data.token_budget, world)
        warn_if_skipped(batches.streams[0], world)
        return batches, {}
    if len(data.files) != 1:
        raise ValueError(f"--task {task} reads one labelled CSV, got {len(data.files)} files.")
    indices, num_streams = rank_stream_indices(world.dp_rank, world.dp_size, grad_accum)
    streams = [ClassificationStream(data.files[0], task, index, num_streams, **common) for index in indices]
    batches = Batches(streams)
    _warn_if_repeated(batches, data.token_budget, world)
    warn_if_skipped(streams[0], world)
    return batches, label_fields(streams[0])


def warn_if_skipped(stream: MLMStream | ClassificationStream, world: Dist, source: str = "--data") -> None:
    """Say (rank 0) how many records `--invalid skip` left out of `source`, and the first few (every stream read
    every record: any stream's list is the whole data set's)."""
    if stream.skipped and world.is_main:
        shown = [problem.removesuffix(".") for problem in stream.skipped[:SKIPPED_SHOWN]]
        more = "; ..." if len(stream.skipped) > SKIPPED_SHOWN else ""
        left = plural(len(stream.skipped), "record")
        message = f"warning: --invalid skip left {left} of {source} out: {'; '.join(shown)}"
        print(f"{message}{more}.", file=sys.stderr)


SKIPPED_SHOWN = 3  # records a warning names


def _warn_if_repeated(batches: Batches, token_budget: int, world: Dist) -> None:
    """Say so (rank 0) when a stream holds fewer tokens than one micro-batch: each micro-batch then holds some of
    its proteins more than once."""
    smallest = min(stream.tokens_per_pass for stream in batches.streams)
    if smallest < token_budget and world.is_main:
        print(
            f"warning: a data stream holds {smallest} tokens, fewer than --tokens-per-batch {token_budget}: each "
            "micro-batch repeats proteins. Lower --tokens-per-batch, or add data.",
            file=sys.stderr,
            flush=True,
        )


def label_fields(stream: ClassificationStream) -> dict[str, Any]:
    """num_labels, the label names (so the exported config names the classes) and the problem type."""
    if stream.regression:
        return dict(num_labels=1, problem_type="regression")
    names = dict(enumerate(stream.label_names))
    return dict(
        num_labels=stream.num_labels,
        id2label=names,
        label2id={name: index for index, name in names.items()},
        problem_type="single_label_classification",
    )


class DataFeed:
    """A rank's micro-batches, prepared ahead in `workers` background processes (0: in this one).

    Each item comes with the data position just after it, so `state_dict()` is exactly where the training loop is,
    however far the workers have read ahead."""

    def __init__(self, batches: Batches, workers: int) -> None:
        self.position = batches.state_dict()
        if workers == 0:
            self.items = _with_positions(batches)
        else:
            loader = torch.utils.data.DataLoader(
                _PositionedBatches(batches),
                batch_size=None,
                num_workers=workers,
                prefetch_factor=4,
                worker_init_fn=ignore_stop_signals,
            )
            self.items = iter(loader)
            atexit.register(_end_workers, weakref.ref(self.items))

    def __next__(self) -> PackedBatch:
        batch, self.position = next(self.items)
        return batch

    def state_dict(self) -> dict:
        """The `Batches.state_dict()` just after the last micro-batch returned."""
        return self.position


def ignore_stop_signals(_worker_id: int) -> None:
    """A data worker ignores Ctrl-C and SIGTERM: a terminal sends Ctrl-C to its whole process group, and a scheduler
    SIGTERM (`kill -TERM -- -PGID`), which would end the worker while the training process finishes its step and
    saves a checkpoint (`loop.StopSignals`), and then fails on the dead worker's next batch. The training process
    ends its workers when it exits, and a worker whose training process died ends on its own (DataLoader's
    watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _end_workers(items: weakref.ref) -> None:
    """At exit (an atexit function registered after torch's and multiprocessing's, so it runs before them), end the
    workers of a DataLoader iterator that is still alive, as after an error: DataLoader's shutdown asks them to stop,
    and one still running is killed. Without this, multiprocessing's exit handler would SIGTERM a worker that
    ignores it and wait for it forever (DataLoader's own shutdown does nothing once the interpreter exits)."""
    iterator = items()
    if iterator is None:  # collected: its shutdown ran then
        return
    iterator._shutdown_workers()
    for worker in iterator._workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


def _with_positions(batches: Batches) -> Iterator[tuple[PackedBatch, dict]]:
    for batch in batches:
        yield batch, batches.state_dict()


class _PositionedBatches(torch.utils.data.IterableDataset):
    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[PackedBatch, dict]]:
        return _with_positions(self.batches)
