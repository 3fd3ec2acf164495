"""What `--resume` takes from the run it continues, and what it refuses before the data and the model load.

Every checkpoint's `train_state.json` records, under `run`, the run's options (`option_values`: what argparse parsed
for each) and its `resume_settings`. `nv-esm train --out OUT --resume` takes its options from the newest checkpoint of
OUT (`parse_command_line`); the options given on the command line replace them. `check_resume` then compares the
run with the checkpoint it continues, before anything heavy: the options that decide which data a step sees, its
learning rate and its optimizer (`resume_settings`; `--steps` may change), the contents of the data files (their
SHA-256, not only their paths), the model's architecture and LoRA adapters, the number of ranks and `--stop-at-step`,
and names the other options that differ from the recorded ones (`--clip-grad`, `--log-every`, ...): those apply
from the resumed step on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from nv_esm.checkpoint_io import file_sha256
from nv_esm.cli import asks_for_help
from nv_esm.train.checkpoint import TRAIN_STATE, checkpoint_dirs
from nv_esm.train.config import PROG, TrainConfig, given_options, option_flag, option_values, parse_config
from nv_esm.train.lora import lora_fields
from nv_esm.train.materialize import model_config
from nv_esm.train.parallel import Dist

# Options of one invocation, not taken from the run record.
NOT_RECORDED = ("out", "resume", "stop_at_step")
# Of `resume_settings`, what a resume may change: --steps (a finished run is extended, or a run shortened; the
# schedule is then that of the new step count from the checkpoint's step on).
CHANGEABLE_ON_RESUME = ("steps",)
# Settings added to `resume_settings` after checkpoints were written without them: the value they had then. Others
# that such a checkpoint lacks (the data's SHA-256, --weight-decay, --betas) are not compared.
_SETTINGS_BEFORE = {"val_fraction": 0.0, "invalid": "error", "strip_stop": False}
# The NVEsm config fields that decide the model's tensors and what they compute: a resume must keep them.
ARCHITECTURE = (
    "vocab_size",
    "padded_vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "position_embedding_type",
    "rope_theta",
    "layer_norm_eps",
    "emb_layer_norm_before",
    "token_dropout",
    "tie_word_embeddings",
)


def parse_command_line(argv: list[str] | None, prog: str = PROG) -> TrainConfig:
    """The `TrainConfig` of a training command line; with `--resume`, the options it does not give are those
    recorded in the newest checkpoint of `--out` (`recorded_options`). Usage errors exit (status 2)."""
    if asks_for_help(sys.argv[1:] if argv is None else argv):  # the help of the one parser (`nv-esm train --help`'s)
        return parse_config(argv, prog)
    given = given_options(argv, prog)
    recorded = recorded_options(Path(given["out"])) if given.get("resume") and "out" in given else None
    return parse_config(argv, prog, recorded)


def recorded_options(out: Path) -> dict[str, Any] | None:
    """The options recorded in the newest checkpoint of run folder `out` whose `train_state.json` reads, less
    `NOT_RECORDED`; None without one (no checkpoint, or checkpoints of a release that did not record them)."""
    for folder in reversed(checkpoint_dirs(out)):
        try:
            options = json.loads((folder / TRAIN_STATE).read_text())["run"]["options"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(options, dict):
            return {dest: value for dest, value in options.items() if dest not in NOT_RECORDED}
    return None


def resume_settings(config: TrainConfig) -> dict[str, Any]:
    """The options that decide which data a step sees, its learning rate and optimizer, keyed by option name
    (`data`: the files as given; `data_sha256`: their contents): a resume must not change them, but for
    `CHANGEABLE_ON_RESUME`. Reads every data file once (its SHA-256)."""
    return {
        "data": [str(p) for p in config.data.files],
        "data_sha256": [file_sha256(Path(p)) for p in config.data.files],
        "task": config.model.task,
        "seed": config.seed,
        "token_budget": config.data.token_budget,
        "max_length": config.data.max_length,
        "mask_prob": config.data.mask_prob,
        "invalid": config.data.invalid,
        "strip_stop": config.data.strip_stop,
        "grad_accum": config.optimizer.grad_accum,
        "steps": config.optimizer.steps,
        "warmup_steps": config.optimizer.warmup_steps,
        "lr": config.optimizer.lr,
        "min_lr_ratio": config.optimizer.min_lr_ratio,
        "decay": config.optimizer.decay,
        "weight_decay": config.optimizer.weight_decay,  # the saved optimizer's groups hold them: not applied anew
        "betas": list(config.optimizer.betas),
        "val_fraction": config.validation.fraction,
    }


def read_train_state(folder: Path) -> dict[str, Any]:
    """Checkpoint `folder`'s `train_state.json`, the types of its fields checked (ValueError naming the file and
    field; `checkpoint.damage` found them there)."""
    path = folder / TRAIN_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} does not read ({type(error).__name__}: {error}).") from None
    expected = {"step": int, "world_size": int, "data": list, "run": dict}
    for name, kind in expected.items():
        if not isinstance(state, dict) or not isinstance(state.get(name), kind) or isinstance(state.get(name), bool):
            raise ValueError(f"{path}: no {name} (a {kind.__name__}): the checkpoint is damaged.")
    for name in ("config", "settings"):
        if not isinstance(state["run"].get(name), dict):
            raise ValueError(f"{path}: run.{name} is missing: the checkpoint is damaged.")
    return state


def check_resume(folder: Path, config: TrainConfig, settings: dict[str, Any], world: Dist) -> int:
    """The step checkpoint `folder` was taken after, once the run of `config` (with `resume_settings` `settings`)
    is found to continue it on `world`; ValueError naming what differs otherwise."""
    state = read_train_state(folder)
    step = state["step"]
    written = {"world_size": state["world_size"], "tp": state.get("tp", 1), "cp": state.get("cp", 1)}
    if written["world_size"] != world.world_size:
        raise ValueError(
            f"{folder} was written by {written['world_size']} ranks; resume it with the same number of ranks "
            f"(got {world.world_size})."
        )
    for option, size in (("tp", world.tp_size), ("cp", world.cp_size)):
        if written[option] != size:
            raise ValueError(
                f"{folder} was written with --{option} {written[option]}: its data positions belong to its "
                f"data-parallel ranks. Resume it with --{option} {written[option]} (got --{option} {size})."
            )
    if step > config.optimizer.steps:
        raise ValueError(f"{folder} is at step {step}, past --steps {config.optimizer.steps}: pass a larger --steps.")
    stop_at_step = config.checkpoint.stop_at_step
    if stop_at_step is not None and stop_at_step <= step:
        raise ValueError(f"--stop-at-step {stop_at_step}: {folder} is at step {step} already; give a later step.")
    _compare_settings(folder, {**_SETTINGS_BEFORE, **state["run"]["settings"]}, settings)
    _compare_model(folder, state["run"], config, world)
    changed = changed_options(state["run"].get("options"), config)
    if changed and world.is_main:
        listing = ", ".join(f"{option_flag(k)} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        print(f"--resume from {folder.name} with changed options: {listing} (from step {step + 1} on).", flush=True)
    return step


def changed_options(recorded: Any, config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The options of `config` (by argparse's dest, less `NOT_RECORDED`) whose values differ from those `recorded`
    in the checkpoint a resume continues (`option_values`; nothing for a checkpoint that recorded none), as
    (recorded, now). `check_resume` has refused the changes a resume cannot honour; it names these, which apply
    from the resumed step on."""
    if not isinstance(recorded, dict):
        return {}
    return {
        dest: (recorded[dest], value)
        for dest, value in option_values(config).items()
        if dest in recorded and dest not in NOT_RECORDED and recorded[dest] != value
    }


def _compare_settings(folder: Path, saved: dict[str, Any], settings: dict[str, Any]) -> None:
    if saved.get("data") == settings["data"] and "data_sha256" in saved:
        for path, old, new in zip(settings["data"], saved["data_sha256"], settings["data_sha256"]):
            if old != new:
                raise ValueError(
                    f"--resume: --data {path} is not the file {folder.name} was trained on (its SHA-256 differs); "
                    "resume with that data, or start a new run in another --out."
                )
    changed = {
        name: (saved[name], value)
        for name, value in settings.items()
        if name in saved and name != "data_sha256" and saved[name] != value and name not in CHANGEABLE_ON_RESUME
    }
    if changed:
        listing = ", ".join(f"{option_flag(k)} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"--resume from {folder} with changed options ({listing}): a resume continues the run's data order, "
            "schedule and optimizer; resume with the same ones (or leave them out: the checkpoint records them)."
        )


def _compare_model(folder: Path, run: dict[str, Any], config: TrainConfig, world: Dist) -> None:
    lora = lora_fields(config.model)
    if run.get("lora") != lora:

        def adapters(fields: dict | None) -> str:
            return "no LoRA adapters" if fields is None else f"LoRA adapters {fields}"

        raise ValueError(
            f"--resume: {folder} holds {adapters(run.get('lora'))}, the options ask for {adapters(lora)}; resume with "
            "the run's --lora-rank, --lora-alpha and --lora-targets (or leave them out)."
        )
    fields = model_config(config.model, {}, world.device, config.data.max_length).to_dict()
    differ = [name for name in ARCHITECTURE if name in run["config"] and run["config"][name] != fields.get(name)]
    if differ:
        listing = ", ".join(f"{name} {run['config'][name]!r} -> {fields.get(name)!r}" for name in differ)
        option = "--model" if config.model.init_from else "--config"
        raise ValueError(
            f"--resume: {option} {config.model.source} is another architecture than {folder} ({listing}); resume with "
            "the run's model (or leave --model/--config out)."
        )
