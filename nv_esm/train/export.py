"""A consolidated Hub folder from a sharded training checkpoint, in the converter's NVEsm layout.

    nv-esm train export OUT/checkpoints/step_NNNNNNN FOLDER [--overwrite]

The trainer runs it at the end of training (OUT/final). LoRA adapters are merged into the weights they adapt. The
command lists what it wrote; it refuses with a one-line error a CHECKPOINT that is not one, a FOLDER that is the
checkpoint, lies in it or holds it (the run folder, its checkpoints folder), and a FOLDER that is not empty without
--overwrite; --overwrite replaces only an earlier export or conversion (a FOLDER holding files neither writes is
refused, so none of a user's files is deleted). Exported files have the permissions the user's umask gives new files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from configuration_nv_esm import NVEsmConfig
from nv_esm.checkpoint_io import WEIGHTS_NAME
from nv_esm.cli import parse_export_args, print_error
from nv_esm.hub_folder import (
    check_out,
    copy_remote_code,
    file_listing,
    nv_config_dict,
    staging_folder,
    write_esm_tokenizer,
    write_license,
)
from nv_esm.model_card import training_card
from nv_esm.path_guard import refuse_overlap
from nv_esm.train.checkpoint import TRAIN_STATE, CheckpointReader, damage, read_dcp
from nv_esm.train.lora import lora_settings, merged_weights
from nv_esm.train.materialize import MODEL_CLASSES, canonical_name


def export(checkpoint: Path, out: Path, force: bool = False) -> Path:
    """Write `out` in the converter's NVEsm layout (config, safetensors, tokenizer, remote code, LICENSE, card)
    from the model part of a DCP checkpoint. Runs in one process; needs CPU memory for the fp32 weights. Refuses
    (ValueError), before anything is written or deleted, an `out` that overlaps `checkpoint` and, with `force`, an
    `out` holding anything but an earlier conversion's or export's files (`check_out`)."""
    from safetensors.torch import save_file

    refuse_overlap({"OUT": out}, {"CHECKPOINT": checkpoint})
    if not (checkpoint / TRAIN_STATE).is_file():
        raise ValueError(f"{checkpoint} is not a training checkpoint (no {TRAIN_STATE}); give OUT/checkpoints/step_N.")
    problem = damage(checkpoint)
    if problem is not None:
        raise ValueError(f"{checkpoint} is damaged: {problem}.")
    run = json.loads((checkpoint / TRAIN_STATE).read_text())["run"]
    config, task = NVEsmConfig.from_dict(run["config"]), run["settings"]["task"]
    check_out(out, force)
    with staging_folder(out, force) as staging:
        weights = export_weights(read_model_state(checkpoint), config, task, run.get("lora"))
        save_file(weights, staging / WEIGHTS_NAME, metadata={"format": "pt"})
        # No load-time options (backend, FP8 layers, input checks): training-time ones are in train_state.json.
        config_dict = nv_config_dict(config, MODEL_CLASSES[task].__name__)
        config_dict["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        write_esm_tokenizer(staging, remote_code=True)
        copy_remote_code(staging)
        write_license(staging, with_code=True)
        (staging / "README.md").write_text(training_card(checkpoint, run, weights))
    return out


def read_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole (unsharded) model tensors of a DCP checkpoint, in one process and without the optimizer state; read
    as data (`CheckpointReader`, `CheckpointLoadPlanner`: no pickle runs)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = CheckpointReader(checkpoint).read_metadata()
    model_state = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    read_dcp(checkpoint, {"model": model_state}, single_process=True)
    return model_state


def describe(folder: Path) -> str:
    """What an exported folder holds: its model class, then one line per file with its size."""
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    summary, lines = file_listing(folder)
    return "\n".join([f"wrote {folder} ({architecture}, {summary}):", *lines])


def export_weights(
    model_state: dict[str, Any], config: NVEsmConfig, task: str, lora: dict[str, Any] | None
) -> dict[str, torch.Tensor]:
    """Checkpoint names, contiguous fp32 tensors; LoRA adapters (`lora`: the run's rank, alpha and targets) merged
    by PEFT into the weights they adapt (in place: `model_state`'s tensors change); the tied decoder weight and TE's
    `_extra_state` left out, as the converter writes them."""
    state = {k: v for k, v in model_state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    if lora is not None:
        with torch.device("meta"):  # the merge runs on the checkpoint's tensors (assigned), on the CPU
            model = MODEL_CLASSES[task](NVEsmConfig.from_dict({**config.to_dict(), "backend": "torch"}))
        state = merged_weights(model, lora_settings(lora, task), state)
    elif any(".lora_A." in key for key in state):
        raise ValueError(
            "this checkpoint's LoRA adapters come from an earlier nv-esm release: export it with that one."
        )
    state = {canonical_name(k): v for k, v in state.items()}
    tied = {"lm_head.decoder.weight"} if config.tie_word_embeddings else set()
    return {k: v.float().contiguous() for k, v in state.items() if k not in tied}


def export_main(argv: list[str], prog: str) -> None:
    """The `export` command: `prog CHECKPOINT OUT [--overwrite]` (`cli.parse_export_args`; `--force` is its old
    name). A refusal exits with status 1 after one line, as `nv-esm convert` and the other commands refuse an input
    or an output (2 is argparse's, for usage errors)."""
    args = parse_export_args(argv, prog)
    try:
        export(args.checkpoint, args.out, args.overwrite)
    except (ValueError, FileNotFoundError) as error:
        print_error(prog, error)
        raise SystemExit(1) from None
    print(describe(args.out))
