"""Training checkpoints: sharded model and optimizer (`torch.distributed.checkpoint`), data positions, RNG and FP8
scaling state, and the guards of a resume.

A checkpoint is OUT/checkpoints/step_NNNNNNN (written as `step_NNNNNNN.partial` and renamed when whole):

- the DCP files of `{"model": ..., "optim": ...}` (each rank writes its own shards);
- `train_state.json`: the step, the world size, every rank's data position and `run` (the NVEsm config, the LoRA
  alpha, the starting point and the `resume_settings`, which a resume may not change);
- `rng_rank{r}.safetensors`: rank r's Python, torch and CUDA RNG states;
- `fp8_rank{r}.safetensors`: rank r's Transformer Engine FP8 scaling state, when there is one;
- `checksums.json`: the SHA-256 of every other file, checked on resume and export (`damage`; without it a
  checkpoint is damaged): a resume takes the newest checkpoint that is whole, with a warning for each damaged one it
  passes over (`set_aside`).

A save that fails on any rank (a full disk) fails on every rank with `CheckpointNotWritten`, leaving the earlier
checkpoints as they were; a run holds its folder (`run_folder_lock`) so that no second run writes into it.

A checkpoint is read as data, never as code, so a shared or downloaded one cannot run code when it is resumed or
exported: JSON and safetensors are plain data; DCP's `.metadata` is a pickle, read by `CheckpointReader` with an
allow-list of the classes DCP writes there (anything else raises), and its non-tensor entries (optimizer settings)
with `torch.load(weights_only=True)` (`CheckpointLoadPlanner`). Checkpoints of earlier releases (`rng_rank{r}.pt`,
`fp8_rank{r}.pt`) resume: their RNG states are read with `weights_only=True`; their FP8 history, a pickle inside a
tensor, is not restored.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import pickle
import random
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from nv_esm.checkpoint_io import file_sha256, format_bytes
from nv_esm.folder_lock import folder_lock
from nv_esm.path_guard import confined, refuse_links
from nv_esm.train.config import PROG
from nv_esm.train.parallel import Dist, checkpoint_view

if TYPE_CHECKING:
    from nv_esm.data import Batches
    from nv_esm.train.feed import DataFeed

CHECKPOINT_PREFIX = "step_"
FINAL = "final"  # OUT/final: the Hub folder exported at the end of the run
# What a run writes in its folder (besides its lock): never through a link, and never mixed with an earlier run's.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.png", FINAL, "tensorboard", "profile")
TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums.json"
LOCK_NAME = ".nv-esm-train.lock"
# What `load_checkpoint` reads from `TRAIN_STATE` (`damage` checks they are there).
TRAIN_STATE_FIELDS = ("step", "world_size", "data", "run")
TE_PICKLE_OPT_IN = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
RNG_FILE = "rng_rank{rank}.safetensors"
FP8_FILE = "fp8_rank{rank}.safetensors"
# Transformer Engine's delayed-scaling tensors in a module's extra state.
FP8_TENSORS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


def earlier_outputs(out: Path) -> list[str]:
    """The names of `RUN_OUTPUTS` that run folder `out` holds with something in them (a file that is not empty, a
    folder that is not), in `RUN_OUTPUTS`' order."""
    held = []
    for name in RUN_OUTPUTS:
        path = out / name
        if path.is_symlink() or (path.is_file() and path.stat().st_size) or (path.is_dir() and any(path.iterdir())):
            held.append(name)
    return held


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (an interrupted save leaves only a `.partial` folder, and a
    damaged one passed over by a resume is renamed: `set_aside`)."""
    folder = out / "checkpoints"
    found = [
        p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


@contextlib.contextmanager
def run_folder_lock(out: Path, world: Dist) -> Iterator[None]:
    """Hold the run folder `out` for this run (rank 0 holds `folder_lock`): a second run into it is refused, on every
    rank, with a one-line FileExistsError naming the folder and the process that holds it. A folder made here for a
    run that wrote nothing (an error before training) is removed again."""
    with contextlib.ExitStack() as stack:
        problem = None
        if world.is_main:
            if not out.exists():
                stack.callback(lambda: out.rmdir() if not any(out.iterdir()) else None)  # after the lock's exit
            try:
                stack.enter_context(folder_lock(out, LOCK_NAME, PROG))
            except FileExistsError as error:
                problem = str(error)
        everyone: list[str | None] = [None] * world.world_size
        dist.all_gather_object(everyone, problem)
        if everyone[0] is not None:
            raise FileExistsError(everyone[0])
        yield


def prepare_out(out: Path, resume: bool, world: Dist, export: bool = True) -> Path | None:
    """The checkpoint to resume from: the newest that `damage` finds whole (a damaged one is named in a warning and
    the one before it tried). Refuses (one line, before anything is written) to train into a run folder whose
    outputs (`RUN_OUTPUTS`) include a link, one that has checkpoints without --resume, one holding an earlier run's
    outputs (`earlier_outputs`: metrics.jsonl would mix two runs, final/ would be replaced) unless it resumes that
    run, and, when the run `export`s at its end, one whose final/ holds an earlier export of the run it resumes."""
    refuse_links({f"OUT/{name}": out / name for name in RUN_OUTPUTS})
    found = checkpoint_dirs(out)
    if found and not resume:
        raise ValueError(f"{out} holds checkpoints ({found[-1].name}); pass --resume to continue, or another --out.")
    if resume and not found:
        raise ValueError(f"--resume: no checkpoint in {out / 'checkpoints'}.")
    earlier = earlier_outputs(out)
    if earlier and not resume:
        raise ValueError(
            f"{out} holds an earlier run's {', '.join(earlier)}, which a new run would mix with its own or replace: "
            "choose another --out, or move them away first."
        )
    if resume and export and FINAL in earlier:
        raise ValueError(
            f"{out / FINAL} holds the run's earlier export, which the export at the end of this run would replace: "
            "move it away first, or pass --no-export."
        )
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    damaged: list[tuple[Path, str]] = []
    for folder in reversed(found):
        mine = damage(folder, world.rank, world.world_size)
        everyone: list[str | None] = [None] * world.world_size
        dist.all_gather_object(everyone, mine)  # every rank takes the same checkpoint
        problem = next((p for p in everyone if p is not None), None)
        if problem is None:
            if world.is_main:
                for bad, reason in damaged:  # renamed: their steps will be saved again
                    kept = set_aside(bad)
                    print(
                        f"warning: {bad.name} is damaged ({reason}), kept as {kept.name}; resuming from {folder.name}.",
                        file=sys.stderr,
                    )
            dist.barrier()
            return folder
        damaged.append((folder, problem))
    if found:
        listing = "; ".join(f"{folder.name}: {problem}" for folder, problem in damaged)
        raise ValueError(f"--resume: every checkpoint in {out / 'checkpoints'} is damaged ({listing}).")
    return None


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint `folder` to NAME.damaged, or NAME.damaged-2, -3, ...: the first name not taken (a
    step saved again after a resume can be damaged again). Returns the new path."""
    for count in itertools.count(1):
        kept = folder.with_name(f"{folder.name}.damaged{f'-{count}' if count > 1 else ''}")
        if not kept.exists():  # the run folder is locked (`run_folder_lock`): no other run renames into it
            return folder.rename(kept)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------------------------
# Checksums: a checkpoint's files as they were written
# --------------------------------------------------------------------------------------------------------------


def own_files(folder: Path, rank: int) -> list[Path]:
    """The files of a checkpoint folder that rank `rank` wrote: its DCP shards, RNG and FP8 state."""
    patterns = (f"__{rank}_*.distcp", RNG_FILE.format(rank=rank), FP8_FILE.format(rank=rank))
    return sorted(path for pattern in patterns for path in folder.glob(pattern))


def damage(folder: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """What is wrong with checkpoint `folder`, or None: `train_state.json` (with its fields) and the DCP metadata must
    read, and `CHECKSUMS` must list files that are there with their SHA-256 (rank `rank` of `world_size` checks its
    share of them). A missing `CHECKSUMS` is damage, but in a checkpoint of an earlier release (`_written_unchecked`),
    which has only the first two checks (a file that then does not read is named by `read_dcp`)."""
    try:
        state = json.loads((folder / TRAIN_STATE).read_text())
        missing = [key for key in TRAIN_STATE_FIELDS if key not in state]
        if missing:
            return f"{TRAIN_STATE} has no {', '.join(missing)}"
        CheckpointReader(folder).read_metadata()
        sums_path = folder / CHECKSUMS
        if not sums_path.exists():
            return None if _written_unchecked(folder) else f"{CHECKSUMS} is missing"
        sums = json.loads(sums_path.read_text())
        for name in sorted(sums)[rank::world_size]:
            if not (folder / name).is_file():
                return f"{name} is missing"
            if file_sha256(folder / name) != sums[name]:
                return f"{name} differs from the file that was written (checksum)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _written_unchecked(folder: Path) -> bool:
    """Whether `folder` is a checkpoint of a release that wrote no checksums: those kept the RNG state in
    `rng_rank{r}.pt`; the checkpoints of later ones have `rng_rank{r}.safetensors` and `CHECKSUMS` (both came within
    an hour of each other), so a missing `CHECKSUMS` beside a safetensors RNG file was deleted."""
    return (folder / "rng_rank0.pt").is_file() and not (folder / RNG_FILE.format(rank=0)).exists()


def save_checkpoint(
    out: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    feed: DataFeed,
    world: Dist,
    keep: int,
    run_info: dict,
) -> Path:
    """Sharded model + optimizer (DCP), every stream's position, every rank's RNG and FP8 scaling history; written
    to a `.partial` folder that is renamed when complete, so a kill mid-save never leaves a checkpoint that looks
    whole. Keeps the newest `keep` checkpoints (all if 0); returns the new one."""
    final = out / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    partial = final.with_name(final.name + ".partial")
    try:
        on_every_rank(world, lambda: _make_partial(partial) if world.is_main else None)
        rank_parts = on_every_rank(world, lambda: _write_rank_files(partial, model, optimizer, feed, world))
        on_every_rank(
            world, lambda: _finish(partial, final, step, world, rank_parts, run_info) if world.is_main else None
        )
    except CheckpointNotWritten as error:
        if world.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # gives back the space it took
        earlier = [p.name for p in checkpoint_dirs(out) if p != final]
        intact = f"the earlier checkpoints are intact (newest: {earlier[-1]})" if earlier else "no earlier checkpoint"
        raise CheckpointNotWritten(
            f"checkpoint {final.name} was not written ({error}; {_free_space(out)} free in {out}); {intact}."
        ) from None
    if world.is_main and keep > 0:
        for old in checkpoint_dirs(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)  # what stays of one is not a checkpoint (no train_state.json)
    dist.barrier()
    return final


class CheckpointNotWritten(OSError):
    """A checkpoint save failed on some rank (a full disk, most often); every rank raises it."""


# What writing a checkpoint's files raises when the disk is full or failing: OSError (ENOSPC, EIO), torch's zip
# writer's RuntimeError ("enforce fail at inline_container.cc"), safetensors' error, and DCP's CheckpointException
# (a BaseException) around them.
_WRITE_ERRORS = (OSError, RuntimeError, SafetensorError, CheckpointException)


def on_every_rank(world: Dist, write: Callable[[], Any]) -> list[Any]:
    """Run this rank's part of a save (`write`); returns every rank's result. If the part failed on any rank, every
    rank raises `CheckpointNotWritten` (so none waits at a collective for a rank that gave up)."""
    try:
        result, problem = write(), None
    except _WRITE_ERRORS as error:
        result, problem = None, _one_line(error)
    everyone: list[Any] = [None] * world.world_size
    dist.all_gather_object(everyone, (result, problem))
    problems = [f"rank {rank}: {problem}" for rank, (_, problem) in enumerate(everyone) if problem is not None]
    if problems:
        raise CheckpointNotWritten(problems[0] if world.world_size > 1 else problems[0].removeprefix("rank 0: "))
    return [result for result, _ in everyone]


def _one_line(error: BaseException) -> str:
    """What went wrong in a read or write of checkpoint files, in one line (the first failure DCP wrapped)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _free_space(folder: Path) -> str:
    try:
        return format_bytes(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown space"


def _make_partial(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)


def _write_rank_files(
    partial: Path, model: nn.Module, optimizer: torch.optim.Optimizer, feed: DataFeed, world: Dist
) -> tuple[dict, dict[str, str]]:
    """This rank's DCP shards (DCP's collectives make every rank raise if one fails), RNG and FP8 state; returns its
    data position and the SHA-256 of the files it wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": checkpoint_view(model_state, world), "optim": checkpoint_view(optim_state, world)},
        checkpoint_id=partial,
    )
    save_rng_state(partial / RNG_FILE.format(rank=world.rank))
    save_fp8_scaling(partial / FP8_FILE.format(rank=world.rank), model)
    return feed.state_dict(), {path.name: file_sha256(path) for path in own_files(partial, world.rank)}


def _finish(
    partial: Path, final: Path, step: int, world: Dist, rank_parts: list[tuple[dict, dict]], run_info: dict
) -> None:
    """Rank 0: `train_state.json` and `checksums.json`, then the rename that makes the checkpoint whole."""
    state = {
        "step": step,
        "world_size": world.world_size,
        "tp": world.tp_size,
        "cp": world.cp_size,
        "data": [position for position, _ in rank_parts],
        "run": run_info,
    }
    (partial / TRAIN_STATE).write_text(json.dumps(state, indent=1))
    checksums = {name: digest for _, rank_sums in rank_parts for name, digest in rank_sums.items()}
    checksums.update({name: file_sha256(partial / name) for name in (TRAIN_STATE, ".metadata")})
    (partial / CHECKSUMS).write_text(json.dumps(checksums, indent=1, sort_keys=True))
    partial.rename(final)


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, world: Dist, run_info: dict
) -> int:
    """Restore the model, optimizer and data position that `save_checkpoint` wrote (the caller restores the RNG);
    returns the step it was taken after. The weights load under any layout (DCP reshards them); the data
    positions need the same number of ranks and of data-parallel ranks (the same `--tp` and `--cp`), and the run
    the same settings: `nv_esm.train.resume.check_resume` checked them before the model loaded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((folder / TRAIN_STATE).read_text())  # checked by `resume.check_resume`
    # `folder` comes from `prepare_out`, whose `damage` check has read its metadata: a bad one was named there (torch
    # 2.11's dcp.load would swallow the error as "metadata is None").
    model_state, optim_state = get_state_dict(model, optimizer)
    # Loaded in place: the views share the state dicts' tensors.
    read_dcp(folder, {"model": checkpoint_view(model_state, world), "optim": checkpoint_view(optim_state, world)})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    batches.load_state_dict(state["data"][world.rank])
    scaling = folder / FP8_FILE.format(rank=world.rank)
    fp8_settings = ("layer_precision", "fp8_recipe")
    if scaling.exists() and all(state["run"]["config"].get(k) == run_info["config"].get(k) for k in fp8_settings):
        load_fp8_scaling(scaling, model)
    elif scaling.exists() and world.is_main:
        print(f"FP8 settings changed since {folder.name}: its FP8 scaling history is not restored.", flush=True)
    elif (folder / f"fp8_rank{world.rank}.pt").exists() and world.is_main:
        print(f"{folder.name} holds FP8 scaling history in an earlier release's pickled format: not restored.")
    return state["step"]


# --------------------------------------------------------------------------------------------------------------
# Reading DCP files as data
# --------------------------------------------------------------------------------------------------------------

# What DCP pickles into `.metadata` (torch 2.4-2.13): its metadata dataclasses, tensor sizes, dtypes and layouts.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


def read_dcp(folder: Path, state: dict[str, Any], single_process: bool = False) -> None:
    """Load `state`'s tensors in place from the DCP files of checkpoint `folder`, read as data (`CheckpointReader`,
    `CheckpointLoadPlanner`); with `single_process`, in this process alone (no collectives). A file that does not
    read (truncated or garbled in a checkpoint without checksums, or not plain data) raises ValueError naming the
    checkpoint."""
    import torch.distributed.checkpoint as dcp

    try:
        with warnings.catch_warnings():
            # DCP warns that it loads "in a single process" even when told to (no_dist=True): what we asked for.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(
                state,
                storage_reader=CheckpointReader(folder),
                planner=CheckpointLoadPlanner(),
                no_dist=single_process,
            )
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, CheckpointException) as error:
        raise ValueError(f"{folder} is damaged: {_one_line(error)}.") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: a global outside `_METADATA_GLOBALS` (and torch's dtypes) raises,
    so a payload (`__reduce__` naming `os.system`, ...) cannot run."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class CheckpointReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allow-list (`_MetadataUnpickler`) and every file it
    names confined to the checkpoint folder (`confined`: no absolute name, no `..`; `checksums.json` covers the
    folder's files only, so a name leading out of it would read tensors from elsewhere); its tensors are read with
    `weights_only=True` as DCP does."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
            raise ValueError(f"{path} is not a checkpoint's metadata (not read: {error}).") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} is not a checkpoint's metadata (it holds a {type(metadata).__name__}).")
        for entry in (metadata.storage_data or {}).values():  # the files its tensors are read from: the folder's own
            relative = getattr(entry, "relative_path", None)
            if not isinstance(relative, str):
                raise ValueError(f"{path} is not a checkpoint's metadata (a storage entry names no file).")
            confined(Path(self.path), relative, f"{path}: the file")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with the checkpoint's non-tensor entries read by `torch.load(weights_only=True)` (plain
    values and tensors; anything else raises) instead of DCP's `weights_only=False`."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            fqn = read_item.dest_index.fqn
            raise ValueError(f"checkpoint entry {fqn} is not plain data (not read): {error}") from None
        plain = io.BytesIO()  # what DCP's own load_bytes reads, now holding only what weights_only let through
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


# --------------------------------------------------------------------------------------------------------------
# RNG and FP8 state, in safetensors
# --------------------------------------------------------------------------------------------------------------


def save_rng_state(path: Path) -> None:
    """This process's RNG states (`rng_state`) as safetensors: torch's and CUDA's byte tensors, Python's 625 words
    as int64 and its version and cached Gaussian in the metadata."""
    state = rng_state()
    version, words, gauss_next = state.pop("python")
    tensors = {**state, "python": torch.tensor(words, dtype=torch.int64)}
    save_file(tensors, path, metadata={"python_version": str(version), "python_gauss_next": json.dumps(gauss_next)})


def load_rng_state(folder: Path, world: Dist) -> None:
    """Restore this rank's RNG state from checkpoint `folder` (`save_rng_state`'s file, or an earlier release's
    `.pt`, read with `weights_only=True`)."""
    path = folder / RNG_FILE.format(rank=world.rank)
    legacy = folder / f"rng_rank{world.rank}.pt"
    if not path.exists() and legacy.exists():
        try:
            state = torch.load(legacy, weights_only=True)
        except pickle.UnpicklingError as error:
            raise ValueError(f"{legacy} holds objects other than RNG states (not read): {error}") from None
        set_rng_state(state)
        return
    try:
        with safe_open(path, "pt") as file:
            metadata = file.metadata() or {}
            state = {key: file.get_tensor(key) for key in file.keys()}
        words = tuple(int(word) for word in state.pop("python").tolist())
        gauss_next = json.loads(metadata["python_gauss_next"])
        state["python"] = (int(metadata["python_version"]), words, None if gauss_next is None else float(gauss_next))
        set_rng_state(state)
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, RuntimeError) as error:
        raise ValueError(f"{path} is not this rank's RNG state: {type(error).__name__}: {error}") from None


def fp8_scaling_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Transformer Engine's per-module FP8 state (delayed scaling's amax history and scales, kept per rank: amaxes are
    reduced within a `--tp`/`--cp` group where there is one, else over every rank of the run, TE's default group),
    serialised by TE as uint8 tensors; empty without FP8 state."""
    states = {
        name: module.get_extra_state()
        for name, module in model.named_modules()
        if type(module).get_extra_state is not nn.Module.get_extra_state
    }
    return {name: state for name, state in states.items() if isinstance(state, torch.Tensor) and state.numel()}


def set_fp8_scaling_state(model: nn.Module, states: dict[str, torch.Tensor]) -> None:
    """Restore `fp8_scaling_state` taken from this process's model (validation does). TE serialises it with pickle
    and unpickles it only with its opt-in for trusted bytes, which these are: never pass bytes read from a file
    (`load_fp8_scaling` rebuilds them from plain data)."""
    modules = dict(model.named_modules())
    with mock.patch.dict(os.environ, {TE_PICKLE_OPT_IN: "1"}):
        for name, state in states.items():
            modules[name].set_extra_state(state)


def save_fp8_scaling(path: Path, model: nn.Module) -> None:
    """`fp8_scaling_state` as plain data in safetensors (nothing is written without FP8 state): per module its
    delayed-scaling tensors (`FP8_TENSORS`, named `module.tensor`) and, in the metadata as JSON, the plain values
    TE keeps beside them (`extra_fp8_variables`; values of other types are left out)."""
    tensors, extras = {}, {}
    for name, blob in fp8_scaling_state(model).items():
        state = pickle.loads(blob.numpy().tobytes())  # TE's serialisation of this process's own live state
        tensors.update({f"{name}.{key}": state[key].contiguous() for key in FP8_TENSORS if key in state})
        extras[name] = {key: value for key, value in state.get("extra_fp8_variables", {}).items() if _plain(value)}
    if extras:
        save_file(tensors, path, metadata={"extra_fp8_variables": json.dumps(extras)})


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def load_fp8_scaling(path: Path, model: nn.Module) -> None:
    """Restore `save_fp8_scaling`'s file: TE's extra state is rebuilt here from the file's tensors and JSON and the
    model's own FP8 recipe, so the only bytes TE unpickles are made in this process."""
    modules = dict(model.named_modules())
    recipe = next((m.fp8_recipe for m in modules.values() if getattr(m, "fp8_recipe", None) is not None), None)
    try:
        with safe_open(path, "pt") as file:
            extras = json.loads((file.metadata() or {})["extra_fp8_variables"])
            tensors = {key: file.get_tensor(key) for key in file.keys()}
        if (
            not isinstance(extras, dict)
            or set(extras) - set(modules)
            or not all(isinstance(v, dict) for v in extras.values())
        ):
            raise ValueError("its modules are not this model's")
    except (SafetensorError, OSError, KeyError, ValueError) as error:
        raise ValueError(f"{path} is not this model's FP8 scaling state: {error}") from None
    states = {}
    for name, extra in extras.items():
        state = {"recipe": recipe, "extra_fp8_variables": extra}
        state.update({key: tensors[f"{name}.{key}"] for key in FP8_TENSORS if f"{name}.{key}" in tensors})
        states[name] = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    set_fp8_scaling_state(model, states)


def rng_state() -> dict:
    """This process's Python, torch CPU and (if any) CUDA RNG states."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
