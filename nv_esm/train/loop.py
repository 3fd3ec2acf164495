"""The trainer: one optimizer step (`train_step`), the training loop (`train`) and the command line (`main`).

    torchrun --nproc-per-node 2 -m nv_esm.train --model runs/esm2_tiny_nv --data demo.fasta --steps 100 --out runs/x
    nv-esm train export runs/x/checkpoints/step_0000100 runs/x_hub

A step's loss is the sum over the masked tokens (or labels) of all its micro-batches on all ranks divided by their
global count, so the gradients are those of one big batch whatever the split into ranks and accumulation steps.
The model comes from `materialize.build_model` (which calls `parallel.parallelize`: the loop never wraps FSDP
itself), the batches from `feed`, checkpoints from `checkpoint`, logs from `metrics`, the Hub folder from `export`.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from configuration_nv_esm import NVEsmConfig
from modeling_nv_esm import sequence_loss, token_loss
from nv_esm.cli import print_error
from nv_esm.data import PackedBatch, to_device
from nv_esm.shapes import model_flops
from nv_esm.state_dict_mapping import is_contact_head
from nv_esm.train.checkpoint import (
    CHECKPOINT_PREFIX,
    FINAL,
    checkpoint_dirs,
    load_checkpoint,
    load_rng_state,
    prepare_out,
    run_folder_lock,
    save_checkpoint,
)
from nv_esm.train.config import PROG, OptimizerConfig, TrainConfig, option_values
from nv_esm.train.export import describe, export, export_main
from nv_esm.train.feed import DataFeed, make_batches
from nv_esm.train.lora import lora_fields
from nv_esm.train.materialize import (
    build_model,
    canonical_name,
    check_token_budget,
    data_parallel_layout,
    model_config,
)
from nv_esm.train.metrics import MetricsLog, StepProfiler, StepResult
from nv_esm.train.parallel import (
    Dist,
    clip_gradients,
    complete_gradients,
    forward_context,
    init_distributed,
)
from nv_esm.train.resume import check_resume, parse_command_line, resume_settings
from nv_esm.train.validation import evaluate, validation_stream


def summed_loss(model: nn.Module, batch: PackedBatch, task: str, nv_config: NVEsmConfig) -> torch.Tensor:
    """Sum (not mean) of the per-label losses of a micro-batch, a scalar; the caller divides by the step's label
    count. The head's own loss (`token_loss` for token logits `[1, T, V]` of mlm and token, `sequence_loss` by the
    config's problem type for protein logits `[N, C]`), in fp32."""
    logits = model(**batch.model_inputs()).logits.float()
    if task == "sequence":
        return sequence_loss(logits, batch.labels, nv_config, reduction="sum")
    return token_loss(logits, batch.labels, reduction="sum")


def learning_rate_factor(step: int, settings: OptimizerConfig) -> float:
    """Linear warm-up to 1, then linear or cosine decay to `min_lr_ratio` at `steps`."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps))
    shape = 1 - progress if settings.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * shape


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[PackedBatch],
    config: TrainConfig,
    world: Dist,
    nv_config: NVEsmConfig,
) -> StepResult:
    """Forward/backward every micro-batch of the step, then clip and step. The loss is the global mean over the
    step's labels: each micro-batch's summed loss is divided by the label count of all ranks' micro-batches, and
    scaled by the world size because FSDP averages gradients over ranks. (With `--tp T` or `--cp C`, the ranks of a
    group count the same micro-batches, so the count is R = T x C times too large, and FSDP averages over world
    size / T ranks, the "cp" ones included: with `complete_gradients`, the gradients are again those of one big
    batch.) Nothing here waits for the GPU."""
    counts = [sum(b.num_labels for b in micro_batches), sum(b.num_tokens for b in micro_batches)]
    counts = to_device(torch.tensor(counts, dtype=torch.float64), world.device)
    dist.all_reduce(counts)
    scale = world.world_size / counts[0].clamp(min=1)
    loss_sum = torch.zeros(1, device=world.device, dtype=torch.float64)
    for index, batch in enumerate(micro_batches):
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce the gradients after the last one only
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        with forward_context(config.parallel, world), record_function("nv_esm::forward"):
            loss = summed_loss(model, batch.to(world.device), config.model.task, nv_config)
        with record_function("nv_esm::backward"):
            (loss * scale).backward()
        loss_sum += loss.detach()
    with record_function("nv_esm::gradients"):  # completed over the ranks, clipped
        complete_gradients(model, world)
        grad_norm = clip_gradients(model, config.optimizer.clip_grad, world)
    skipped = config.optimizer.skip_nonfinite and not bool(torch.isfinite(grad_norm))  # waits for the GPU
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    lengths = [b.cu_seq_lens.diff().tolist() for b in micro_batches]  # CPU tensors: no sync
    shape = (nv_config.hidden_size, nv_config.num_hidden_layers, nv_config.intermediate_size)
    step_flops = sum(model_flops(*shape, ls, training=True) for ls in lengths) / world.ranks_per_batch
    totals = torch.cat([loss_sum, counts]) / world.ranks_per_batch  # each micro-batch was counted by its ranks
    return StepResult(totals, grad_norm, optimizer.param_groups[0]["lr"], step_flops, skipped)


def train(config: TrainConfig) -> None:
    """Validate `config`, join the process group (torchrun's, or a world of one) and run the training, holding the
    run folder."""
    config.validate()
    world = init_distributed(config.parallel)
    try:
        with run_folder_lock(config.out, world):
            run_training(config, world)
    finally:
        dist.destroy_process_group()


def run_training(config: TrainConfig, world: Dist) -> None:
    """Train from scratch, from a converted checkpoint or from the latest checkpoint of the run (`--resume`);
    checkpoint, log and profile as `config` asks, and export OUT/final when the schedule is complete."""
    out, settings = config.out, config.optimizer
    exports = config.checkpoint.export and config.checkpoint.enabled
    resume_from = prepare_out(out, config.checkpoint.resume, world, exports)
    settings_record = resume_settings(config)
    if resume_from:  # before the data and the model load
        check_resume(resume_from, config, settings_record, world)
    architecture = model_config(config.model, {}, world.device, config.data.max_length)  # before the data loads
    check_token_budget(config, architecture, world)
    world = data_parallel_layout(config, architecture, world)
    if world.is_main:
        print(world.describe(), flush=True)
    random.seed(config.seed + world.rank)
    torch.manual_seed(config.seed + world.rank)
    batches, labels = make_batches(config, world)
    validation = validation_stream(config, world, batches)
    nv_config = model_config(config.model, labels, world.device, config.data.max_length)
    model = build_model(config, nv_config, world)
    for name, parameter in model.named_parameters():
        if is_contact_head(
            canonical_name(name)
        ):  # carried for the checkpoint, unused by these losses: no optimizer state
            parameter.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=settings.lr,
        betas=tuple(settings.betas),
        weight_decay=settings.weight_decay,
        fused=world.device.type == "cuda",
    )
    run_info = dict(
        config=nv_config.to_dict(),
        lora=lora_fields(config.model),
        start=config.model.init_from or "scratch",
        settings=settings_record,
        options=option_values(config),
    )
    step = load_checkpoint(resume_from, model, optimizer, batches, world, run_info) if resume_from else 0
    feed = DataFeed(batches, config.data.workers)  # before restoring the RNG: the DataLoader draws from it
    if resume_from:
        load_rng_state(resume_from, world)
    last = min(settings.steps, config.checkpoint.stop_at_step or settings.steps)
    if resume_from and world.is_main:
        print(resume_line(out, step, last, settings.steps, exports), flush=True)
    log_every = config.logging.log_every
    metrics = MetricsLog(out, config.logging, settings.steps, world, step)
    profiler = StepProfiler(out, step + log_every, config.logging.profile_steps, world)
    model.train()
    checkpoint = resume_from
    pending: list[StepResult] = []
    interval_start = last_save = time.perf_counter()
    signals = StopSignals(world.is_main, config.checkpoint.enabled)
    vote = StopVote(world)
    with signals as stop, contextlib.closing(metrics), interrupted_at(lambda: step):
        while step < last:
            micro_batches = [next(feed) for _ in range(settings.grad_accum)]
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * learning_rate_factor(step, settings)
            with profiler.step(step):
                pending.append(train_step(model, optimizer, micro_batches, config, world, nv_config))
            step += 1
            save_every, val_every = config.checkpoint.save_every, config.validation.every
            saving = config.checkpoint.enabled and ((save_every and step % save_every == 0) or step == last)
            validating = validation is not None and ((val_every and step % val_every == 0) or step == last)
            interrupted = vote(stop.signum is not None)  # every step: a stop need not wait for a logging step
            if step % log_every == 0 or step == last or saving or validating or interrupted:
                metrics.log(step - len(pending) + 1, pending, interval_start)  # raises on a non-finite step
                pending = []
                minutes = config.checkpoint.save_minutes
                due = bool(minutes) and time.perf_counter() - last_save >= 60 * minutes
                now, due = agree(world, stop.signum is not None, due)
                interrupted = interrupted or now
                saving = config.checkpoint.enabled and (saving or due or interrupted)
            if validating and not interrupted:
                metrics.log_validation(step, evaluate(model, validation, config, world))
            if saving:
                checkpoint = save_checkpoint(out, step, model, optimizer, feed, world, config.checkpoint.keep, run_info)
                metrics.draw()
                last_save = time.perf_counter()
            if interrupted:
                vote.finish()
                raise Stopped(stop.signum or signal.SIGTERM, step, checkpoint, saved=saving)
            if not pending:
                interval_start = time.perf_counter()
        vote.finish()
    if world.is_main and step == settings.steps and config.checkpoint.export and checkpoint is not None:
        with interrupted_at(lambda: step):  # Ctrl-C now stops at once: the checkpoints are written
            print(describe(export(checkpoint, out / FINAL, force=True)), flush=True)


def resume_line(out: Path, step: int, last: int, steps: int, exports: bool) -> str:
    """What `--resume` says (rank 0) once the checkpoint is loaded: the step it continues from, and what it will do
    when there is nothing left to train (a finished run is exported again to OUT/final unless --no-export)."""
    line = f"resuming {out} at step {step} of {steps}"
    if step < last:
        return line
    if step >= steps:
        export_note = f"exporting step {step} to {out / FINAL} again" if exports else "nothing to export (--no-export)"
        return f"{line}: the run is complete, nothing to train; {export_note}"
    return f"{line}: --stop-at-step {last} is reached, nothing to train"


def checkpoint_state(out: Path | None, checkpoint: Path | None = None) -> str:
    """Where a stopped run can be continued from, in words: `checkpoint` (the run's last one) or, without it, the
    newest checkpoint in OUT/checkpoints on disk; never one that does not exist."""
    if checkpoint is None and out is not None:
        found = checkpoint_dirs(out)
        checkpoint = found[-1] if found else None
    if checkpoint is None or not checkpoint.is_dir():
        return f"no checkpoint in {out} yet: a rerun starts over" if out is not None else "nothing was written"
    step = int(checkpoint.name.removeprefix(CHECKPOINT_PREFIX))
    return f"the last checkpoint is {checkpoint} (step {step}); --resume continues from it"


class Stopped(Exception):
    """Ctrl-C or SIGTERM stopped the run after `step` (all ranks at the same step); `checkpoint` is the run's last
    checkpoint (or None), written at this step when `saved`."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, saved: bool = True) -> None:
        self.signum, self.step, self.checkpoint, self.saved = signum, step, checkpoint, saved
        super().__init__(signal.Signals(signum).name)


class Interrupted(Exception):
    """A second Ctrl-C (or SIGTERM) stopped the run at once, during step `step` + 1 (or the checkpoint of step
    `step`): what was saved is what is on disk."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"interrupted after step {step}")


@contextlib.contextmanager
def interrupted_at(step: Any) -> Any:
    """Within: a KeyboardInterrupt (a second signal) becomes `Interrupted(step())`, so `main` can say when."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(step()) from None


# A signal this soon after the first is taken as the same one: torchrun forwards to its ranks the Ctrl-C that the
# terminal has already sent them (its process group), and a scheduler may signal the launcher and the ranks alike.
REPEAT_SECONDS = 1.0


class StopSignals:
    """Within: Ctrl-C (SIGINT) and SIGTERM (what torchrun and job schedulers send) set `signum` instead of stopping
    the process at once, so the loop stops after the step it is in (`StopVote`) with a checkpoint; rank 0 says so at
    once (`announce`), without promising a checkpoint when `saves` is false. A second one (more than
    `REPEAT_SECONDS` later) stops at once (KeyboardInterrupt). The handlers are installed only in the main thread,
    and restored on exit."""

    def __init__(self, announce: bool = False, saves: bool = True, prog: str = PROG) -> None:
        self.signum: int | None = None
        self.announce, self.saves, self.prog = announce, saves, prog
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def acknowledgement(self, signum: int) -> str:
        """The line rank 0 prints on the first signal."""
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        saving = "a checkpoint is written first" if self.saves else "--no-checkpoint: nothing is saved"
        again = "Ctrl-C again" if signum == signal.SIGINT else f"a second {name}"
        return f"{self.prog}: {name}: stopping after this step ({saving}); {again} to stop now."

    def _handle(self, signum: int, _frame: object) -> None:
        now = time.monotonic()
        if self.signum is not None:
            if now - self._first < REPEAT_SECONDS:
                return
            raise KeyboardInterrupt
        self.signum, self._first = signum, now
        if self.announce:  # os.write: a print here could re-enter one it interrupted; a line of its own (tqdm)
            os.write(sys.stderr.fileno(), f"\n{self.acknowledgement(signum)}\n".encode())

    def __exit__(self, *_: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class StopVote:
    """Whether any rank has been signalled, agreed by all ranks after every step without waiting for the GPU: each
    step's flag is all-reduced asynchronously and read one step later (the GPU has then finished that step, and the
    next is queued), so every rank stops after the same step, at most two steps after the signal. A world of one
    reads its flag at once."""

    def __init__(self, world: Dist) -> None:
        self.world = world
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __call__(self, flag: bool) -> bool:
        if self.world.world_size == 1:
            return flag
        value = torch.full((1,), float(flag), device=self.world.device)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        previous, self._pending = self._pending, (work, value)
        if previous is None:
            return False
        previous[0].wait()
        return bool(previous[1].item())

    def finish(self) -> None:
        """Wait for the last all-reduce (every rank calls this at the same step)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def agree(world: Dist, *flags: bool) -> list[bool]:
    """Each flag, True if it is True on any rank (one small all-reduce, which waits for the GPU): ranks decide
    together to stop or save, at the same step."""
    values = torch.tensor([float(flag) for flag in flags], device=world.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [bool(value) for value in values.tolist()]


# How long the other ranks wait before exiting on an error that rank 0 reports.
REPORT_GRACE_SECONDS = 5.0
# Errors that the command reports in one line (the options, the data, the model folder, the run folder).
USER_ERRORS = (ValueError, OSError, ImportError)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """`prog [OPTIONS]` trains (see `--help`); `prog export CHECKPOINT OUT [--overwrite]` writes a Hub folder.
    `argv` defaults to `sys.argv[1:]`. Returns the exit status: 0 done, 1 an error (one line on stderr, from rank 0
    or from the rank it happened on), 2 a usage error, 128 + the signal's number after Ctrl-C or SIGTERM."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        export_main(argv[1:], prog=f"{prog} export")
        return 0
    report = int(os.environ.get("RANK", 0)) == 0  # every rank meets the same error (the data too: each checks all)
    out: Path | None = None
    try:
        config = parse_command_line(argv, prog)
        out = config.out
        train(config)
    except Stopped as stop:
        if report:
            if stop.saved and stop.checkpoint is not None:
                saved = f"{stop.checkpoint} saved; --resume continues"
            else:
                saved = f"no checkpoint written; {checkpoint_state(out, stop.checkpoint)}"
            name = signal.Signals(stop.signum).name
            print(f"{prog}: stopped by {name} after step {stop.step}: {saved}.", file=sys.stderr)
        return 128 + stop.signum
    except Interrupted as stop:
        if report:
            print(f"{prog}: stopped at once after step {stop.step}: {checkpoint_state(out)}.", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # before the training loop: one line, what OUT holds
        if report:
            print(f"{prog}: interrupted during start-up: {checkpoint_state(out)}.", file=sys.stderr)
        return 130
    except USER_ERRORS as error:
        if report:
            print_error(prog, error)
        else:  # torchrun stops the other ranks when one exits with an error: let rank 0 report first
            time.sleep(REPORT_GRACE_SECONDS)
        return 1
    return 0
