"""Training checkpoints: sharded model and optimizer (`torch.distributed.checkpoint`), data positions, RNG and FP8
scaling state, and the guards of a resume.

A checkpoint is OUT/checkpoints/step_NNNNNNN (written as `step_NNNNNNN.partial` and renamed when whole):

- the DCP files of `{"model": ..., "optim": ...}` (each rank writes its own shards);
- `train_state.json`: the step, the world size, every rank's data position and `run` (the NVEsm config, the LoRA
  alpha, the starting point and the `resume_settings`, which a resume may not change);
- `rng_rank{r}.pt`: rank r's Python, torch and CUDA RNG states;
- `fp8_rank{r}.pt`: rank r's Transformer Engine FP8 scaling state, when there is one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from nv_esm.train.config import TrainConfig
from nv_esm.train.parallel import Dist, checkpoint_view

if TYPE_CHECKING:
    from nv_esm.data import Batches
    from nv_esm.train.feed import DataFeed

CHECKPOINT_PREFIX = "step_"
TRAIN_STATE = "train_state.json"
TE_PICKLE_OPT_IN = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (an interrupted save leaves only a `.partial` folder)."""
    folder = out / "checkpoints"
    found = [p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and not p.name.endswith(".partial")]
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


def prepare_out(out: Path, resume: bool, world: Dist) -> Path | None:
    """The checkpoint to resume from; refuses to train into a run folder that has one without --resume."""
    found = checkpoint_dirs(out)
    if found and not resume:
        raise ValueError(f"{out} holds checkpoints ({found[-1].name}); pass --resume to continue, or another --out.")
    if resume and not found:
        raise ValueError(f"--resume: no checkpoint in {out / 'checkpoints'}.")
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return found[-1] if found else None


def resume_settings(config: TrainConfig) -> dict[str, Any]:
    """The options that decide which data a step sees and its learning rate, keyed by option name (`data`: the
    files as given): a resume must not change them."""
    return {
        "data": [str(p) for p in config.data.files],
        "task": config.model.task,
        "seed": config.seed,
        "token_budget": config.data.token_budget,
        "max_length": config.data.max_length,
        "mask_prob": config.data.mask_prob,
        "grad_accum": config.optimizer.grad_accum,
        "steps": config.optimizer.steps,
        "warmup_steps": config.optimizer.warmup_steps,
        "lr": config.optimizer.lr,
        "min_lr_ratio": config.optimizer.min_lr_ratio,
        "decay": config.optimizer.decay,
        "val_fraction": config.validation.fraction,
    }


# Settings added to `resume_settings` after checkpoints were written without them: the value they had then.
_SETTINGS_BEFORE = {"val_fraction": 0.0}


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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = out / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    partial = final.with_name(final.name + ".partial")
    if world.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": checkpoint_view(model_state, world), "optim": checkpoint_view(optim_state, world)},
        checkpoint_id=partial,
    )
    streams: list[Any] = [None] * world.world_size
    dist.all_gather_object(streams, feed.state_dict())
    torch.save(rng_state(), partial / f"rng_rank{world.rank}.pt")
    scaling = fp8_scaling_state(model)
    if scaling:
        torch.save(scaling, partial / f"fp8_rank{world.rank}.pt")
    dist.barrier()
    if world.is_main:
        state = {
            "step": step,
            "world_size": world.world_size,
            "tp": world.tp_size,
            "cp": world.cp_size,
            "data": streams,
            "run": run_info,
        }
        (partial / TRAIN_STATE).write_text(json.dumps(state, indent=1))
        partial.rename(final)
        for old in checkpoint_dirs(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, world: Dist, run_info: dict
) -> int:
    """Restore the model, optimizer and data position that `save_checkpoint` wrote (the caller restores the RNG);
    returns the step it was taken after. The weights load under any layout (DCP reshards them); the data
    positions need the same number of ranks and of data-parallel ranks (the same `--tp` and `--cp`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((folder / TRAIN_STATE).read_text())
    if state["world_size"] != world.world_size:
        raise ValueError(
            f"{folder} was written by {state['world_size']} ranks; resume it with the same number of ranks "
            f"(got {world.world_size})."
        )
    for option, size in (("tp", world.tp_size), ("cp", world.cp_size)):
        written = state.get(option, 1)
        if written != size:
            raise ValueError(
                f"{folder} was written with --{option} {written}: its data positions belong to its data-parallel "
                f"ranks. Resume it with --{option} {written} (got --{option} {size})."
            )
    saved = {**_SETTINGS_BEFORE, **state["run"]["settings"]}
    changed = {k: (saved.get(k), v) for k, v in run_info["settings"].items() if saved.get(k) != v}
    if changed:
        listing = ", ".join(f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"--resume from {folder} with changed options ({listing}); resume with the same ones.")
    model_state, optim_state = get_state_dict(model, optimizer)
    # Loaded in place: the views share the state dicts' tensors.
    dcp.load(
        {"model": checkpoint_view(model_state, world), "optim": checkpoint_view(optim_state, world)},
        checkpoint_id=folder,
    )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    batches.load_state_dict(state["data"][world.rank])
    scaling = folder / f"fp8_rank{world.rank}.pt"
    if scaling.exists():
        fp8_settings = ("layer_precision", "fp8_recipe")
        if all(state["run"]["config"].get(k) == run_info["config"].get(k) for k in fp8_settings):
            set_fp8_scaling_state(model, torch.load(scaling, weights_only=True))
        elif world.is_main:
            print(f"FP8 settings changed since {folder.name}: its FP8 scaling history is not restored.", flush=True)
    return state["step"]


def load_rng_state(folder: Path, world: Dist) -> None:
    """Restore this rank's RNG state from checkpoint `folder`."""
    set_rng_state(torch.load(folder / f"rng_rank{world.rank}.pt", weights_only=False))


def fp8_scaling_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Transformer Engine's per-module FP8 state (delayed scaling's amax history and scales; this rank's own: amaxes
    are reduced only within a `--tp`/`--cp` group, not across data-parallel ranks), serialised by TE as uint8
    tensors; empty without FP8 state."""
    states = {
        name: module.get_extra_state()
        for name, module in model.named_modules()
        if type(module).get_extra_state is not nn.Module.get_extra_state
    }
    return {name: state for name, state in states.items() if isinstance(state, torch.Tensor) and state.numel()}


def set_fp8_scaling_state(model: nn.Module, states: dict[str, torch.Tensor]) -> None:
    """Restore `fp8_scaling_state`. TE unpickles it only with its opt-in for trusted checkpoints, which a run's
    own checkpoint is (resuming already trusts the folder: DCP's metadata is a pickle too)."""
    modules = dict(model.named_modules())
    with mock.patch.dict(os.environ, {TE_PICKLE_OPT_IN: "1"}):
        for name, state in states.items():
            modules[name].set_extra_state(state)


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
