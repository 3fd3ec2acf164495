"""The settings of a training run: typed sections (`TrainConfig`) and the command line that fills them.

    config = parse_config(["--config", "config.json", "--data", "demo.fasta", "--steps", "100", "--out", "runs/x"])
    config.optimizer.lr, config.data.token_budget, config.parallel.keep_gathered, config.checkpoint.save_every

Every section has the command line's defaults, so a test or a script builds only what it needs, e.g.
`OptimizerConfig(steps=100, warmup_steps=10)`. Each option is declared once, as its section's field (`option`:
default, help, and what argparse needs beyond them); `build_parser` and `config_from_args` are derived from the
fields. `TrainConfig.validate` makes the checks the trainer makes before it starts (argparse makes the others:
choices, required options, `--model` or `--config`).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, get_type_hints

# The parser imports neither torch nor transformers (`--help` answers at once): the choices come from
# nv_esm.vocabulary, the model code's checks are imported where they run (`TrainConfig.validate`,
# `refuse_option_combinations`).
from nv_esm.options import BACKEND_HELP, HelpFormatter, add_renamed, fp8_refusal
from nv_esm.path_guard import refuse_overlap
from nv_esm.tasks import TASK_HEADS
from nv_esm.vocabulary import (
    BACKENDS,
    FP8_LAYER_CHOICES,
    FP8_RECIPES,
    INVALID_POLICIES,
    STRIP_STOP_HELP,
    TOKENS_PER_BATCH,
)

if TYPE_CHECKING:
    from nv_esm.records import RecordRules

DATA_PARALLEL_CHOICES = ("auto", "replicate", "shard")
PROG = "nv-esm train"  # the documented command (also `python -m nv_esm.train`, `torchrun -m nv_esm.train`)
TASKS = tuple(TASK_HEADS)
DESCRIPTION = """\
Train NVEsm (ESM-2 on Transformer Engine) on one or many GPUs with FSDP2: MLM pretraining and fine-tuning.

    nv-esm convert hf-to-te assets/esm2_tiny runs/esm2_tiny_nv
    torchrun --nproc-per-node 2 -m nv_esm.train --model runs/esm2_tiny_nv \\
        --data recipes/demo_data/demo.fasta --steps 100 --out runs/demo

(`recipes/train.py` is the same command as a script: `torchrun --nproc-per-node 2 recipes/train.py ...`.)

One GPU holds the whole model (fp32 weights, bf16 autocast) and replays the Transformer Engine layers as CUDA
graphs (`--no-cuda-graphs`: eagerly). On several ranks, each holds the whole model the same way and the gradients
are all-reduced once per step when it fits a device (`--data-parallel auto`, or `replicate`); otherwise each
transformer layer and then the whole model are wrapped with `torch.distributed.fsdp.fully_shard` (bf16 compute,
fp32 master weights, gradient reduction in fp32 or `--reduce-dtype bf16`; `--data-parallel shard`). The model is
built on the meta device and each rank materialises only its own shard: read from a converted checkpoint's
safetensors row slices (`--model`) or drawn from scratch (`--config`) with one seeded generator per tensor, so every
world size starts from the same weights.

Batches are packed (THD) micro-batches of whole proteins up to `--tokens-per-batch` tokens. With W ranks and
`--grad-accum` A, the data is split into W*A streams and rank r owns streams r*A .. r*A+A-1, so a step sees the
same proteins for any W and A with the same product; the loss of a step is the sum over its masked tokens divided
by their global count, so the gradients are those of one big batch whatever the split.

Validation (`--val-data FILES` or `--val-fraction F` of --data set aside; every `--val-every` steps and after the
last): MLM loss, perplexity and accuracy on the masked tokens (masked the same way at every validation);
classification loss, accuracy, macro F1 and AUROC; regression MSE, RMSE and Spearman's rho. They go to
metrics.jsonl (`val_*` keys), TensorBoard and the console.

Checkpoints (`torch.distributed.checkpoint`, every `--save-every` steps, in OUT/checkpoints/step_NNNNNNN) hold the
sharded model and optimizer, the step, every data stream's position, every rank's RNG and FP8 scaling history
(delayed scaling); `--resume` continues exactly where the latest one stopped. `nv-esm train export
CHECKPOINT OUT` (also run at the end of training) writes a consolidated Hub folder in the converter's layout.
"""

# Packed micro-batches index their tokens with int32 offsets (`cu_seq_lens`).
MAX_TOKEN_BUDGET = 2**31 - 1

# The argument groups of `--help`, in order; each option's group is its own `group`, else its section's, and each
# group lists its options in the order of the fields (`TrainConfig`'s sections expanded in place).
GROUPS = ("model", "data", "validation", "optimisation", "run")


def option(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, **cli: Any) -> Any:
    """A command-line option as a dataclass field: its default (or `factory`), its help, and in `cli` what argparse
    needs beyond them: `flag` (not `--field-name`), `group` (not its section's), `offset` (the field holds the
    parsed value plus this), `one_of` (exactly one of these options) and `add_argument`'s choices, type, nargs and
    dest (where the flag was renamed: the run records of `option_values` keep the old key)."""
    return field(default=default, default_factory=factory, metadata={"help": help, **cli})


@dataclass
class ModelConfig:
    """What is trained: the starting point (exactly one of `init_from` and `config_file`, paths as given on the
    command line), the task head, the layer implementation, FP8 and LoRA."""

    init_from: str | None = option(
        None, "NVEsm checkpoint folder (nv-esm convert hf-to-te output) to start from", flag="--model", one_of=True
    )
    config_file: str | None = option(
        None,
        "the model's config.json (its architecture: layers, widths) to train from scratch, e.g. the repo's 650M one",
        flag="--config",
        one_of=True,
    )
    task: str = option("mlm", "mlm, or a fine-tuning head", choices=TASKS)
    backend: str = option("auto", BACKEND_HELP, choices=BACKENDS)
    fp8: str = option("off", "FP8 layers (TE): all, or all but first/last", choices=FP8_LAYER_CHOICES)
    fp8_recipe: str = option(
        "delayed",
        "the FP8 layers' scaling, as nv-esm embed's --fp8-scaling: delayed (from the amax history of earlier steps), "
        "current (per tensor, from this step) or block (per 128 values)",
        choices=FP8_RECIPES,
        flag="--fp8-scaling",
        dest="fp8_recipe",
    )
    cuda_graphs: bool = option(  # the model's `cuda_graphs`: used by TE layers on one GPU (not under FSDP2)
        True, "replay the TE layers as CUDA graphs (one GPU: FSDP2-sharded layers run eagerly)"
    )
    lora_rank: int = option(0, "train LoRA adapters of this rank (PEFT) and the head")  # 0: train all weights
    lora_alpha: float = option(16.0, "LoRA scaling: updates are multiplied by alpha / rank")
    lora_targets: tuple[str, ...] = option(
        ("query", "key", "value", "attention.output.dense"),
        "PEFT target_modules: transformers' ESM names (query key value dense, attention.output.dense, "
        "intermediate.dense, output.dense)",
        nargs="+",
    )

    @property
    def source(self) -> Path:
        """The checkpoint folder or config file the model's architecture comes from."""
        return Path(self.init_from or self.config_file)


@dataclass
class DataConfig:
    """The data (`files`, as given: they are compared on resume) and how it is cut into micro-batches."""

    files: list[str] = option(help="FASTA/.txt/.parquet (mlm) or a labelled CSV", flag="--data", nargs="+")
    token_budget: int = option(
        TOKENS_PER_BATCH,
        "tokens per micro-batch and rank: at most 2**31 - 1 (packed offsets are int32), and refused before the model "
        "loads when the activations its backward keeps (at least tokens x (layers x (7 x hidden + 2 x intermediate) "
        "+ 3 x vocabulary) values) exceed the device's memory",
        flag="--tokens-per-batch",
        dest="token_budget",
    )
    max_length: int = option(  # crop length in tokens: --max-length residues + <cls> and <eos>
        1024,
        "longest protein in residues, as in nv-esm embed: longer ones are cropped to a window of this many "
        "residues plus 2 tokens (a window of the tokenized protein, <cls>/<eos> where it reaches the ends, as "
        "ESM-2 was trained)",
        offset=2,
    )
    mask_prob: float = option(0.15, "MLM: fraction of residues to predict (80%% <mask>, 10%% random, 10%% kept)")
    workers: int = option(1, "1: a process prepares batches ahead; 0: none", flag="--data-workers", choices=(0, 1))
    invalid: str = option(
        "error",
        "records (and CSV rows) with letters outside ESM-2's alphabet, or none: stop before the model loads, or "
        "leave them out of training and validation (a warning counts them)",
        choices=INVALID_POLICIES,
    )
    strip_stop: bool = option(False, STRIP_STOP_HELP)

    @property
    def rules(self) -> RecordRules:
        """How the data's records are read (`--invalid`, `--strip-stop`)."""
        from nv_esm.records import RecordRules

        return RecordRules(self.invalid, self.strip_stop)


@dataclass
class ValidationConfig:
    """The validation set (`files`, or a `fraction` of the training data set aside; neither: no validation) and
    how often it is evaluated (every `every` steps, 0: only after the last step)."""

    files: list[str] = option(help="validation files, as --data", factory=list, flag="--val-data", nargs="+")
    fraction: float = option(
        0.0,
        "set this fraction of --data aside for validation (the same records for every seed and world size)",
        flag="--val-fraction",
    )
    every: int = option(0, "validate every N steps (0: after the last)", flag="--val-every")

    @property
    def enabled(self) -> bool:
        return bool(self.files) or self.fraction > 0


@dataclass
class OptimizerConfig:
    """AdamW and its schedule: `steps` optimizer steps of `grad_accum` micro-batches per rank, linear warm-up and
    linear or cosine decay to `min_lr_ratio * lr`."""

    steps: int = option(help="optimizer steps of the schedule", type=int)
    grad_accum: int = option(1, "micro-batches per rank and optimizer step")
    lr: float = option(4e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, "final LR / peak LR")
    warmup_steps: int = option(0, "steps of linear warm-up from 0 to --lr")
    decay: str = option(
        "linear",
        "learning-rate decay after the warm-up, to --min-lr-ratio x --lr at --steps",
        choices=("linear", "cosine"),
    )
    weight_decay: float = option(0.01, "AdamW decoupled weight decay")
    betas: tuple[float, float] = option((0.9, 0.98), "AdamW beta1 beta2", nargs=2)
    clip_grad: float = option(1.0, "max global grad norm (0: off)")
    skip_nonfinite: bool = option(
        False,
        "skip (and count) a step whose gradient norm is inf/nan instead of stopping the run; waits for the GPU "
        "every step",
    )


@dataclass
class ParallelConfig:
    """How the model runs on the ranks: compute precision, FSDP2 options (hybrid sharding included), tensor
    parallelism, activation checkpointing and offloading, compilation."""

    precision: str | None = option(  # None: bf16 on GPU, fp32 on CPU
        None, "compute dtype (default: bf16 on a GPU, fp32 on the CPU)", choices=("bf16", "fp32"), group="optimisation"
    )
    activation_checkpointing: bool = option(
        False, "recompute each layer in the backward instead of keeping its activations"
    )
    recompute_mlp: bool = option(  # the model's `recompute_mlp`
        False,
        "keep only each layer's MLP input and recompute its LayerNorm, fc1 and GELU in the backward (TE's selective "
        "checkpointing): most of the activation memory for one fc1 GEMM per layer; not with --activation-checkpointing",
    )
    offload_activations: bool = option(  # the model's `offload_activations`
        False,
        "keep every layer's saved activations (but the last layer's) in pinned host memory between forward "
        "and backward (Transformer Engine's offloading; GPUs only, not with --activation-checkpointing)",
    )
    offloaded_layers: int = option(  # the model's `offloaded_layers` (0: None)
        0,
        "with --offload-activations: offload only the first N layers (0: all but the last); the copies then "
        "overlap the compute of the other layers, which keep their activations on the GPU",
    )
    keep_gathered: bool = option(
        False,
        "keep layers gathered between forward and backward (FSDP2 "
        "reshard_after_forward=False): one all-gather less per layer and step, more memory",
    )
    reduce_dtype: str = option(
        "fp32",
        "dtype FSDP2 (sharded models) reduce-scatters gradients in: fp32 sums, or bf16 (half the bytes, as NVIDIA's "
        "ESM-2 recipes reduce when they train bf16 weights)",
        choices=("fp32", "bf16"),
    )
    data_parallel: str = option(
        "auto",
        "how the data-parallel ranks hold the model: replicate (each rank a whole copy in fp32, CUDA graphs on, "
        "gradients all-reduced once per step), shard (FSDP2), or auto: replicate when the weights, gradients, AdamW "
        "state and a micro-batch's activations fit in 80%% of a device, else shard (FSDP2's own options shard: --tp "
        "or --dp-replicate above 1, --keep-gathered, --reduce-dtype bf16)",
        choices=DATA_PARALLEL_CHOICES,
    )
    dp_replicate: int = option(
        1,
        "hybrid sharding (HSDP): replicate the model over R groups, each sharding it over the world size / R "
        "ranks (e.g. a node), so the all-gathers stay within a group",
    )
    tp: int = option(
        1,
        "tensor parallelism: split every layer (heads, MLP columns, and the tokens between them) over T "
        "consecutive ranks, e.g. the GPUs of a node; FSDP2 shards over the world size / T groups",
    )
    cp: int = option(
        1,
        "context parallelism: run each micro-batch's layers across C ranks, each holding its chunks of every "
        "protein (for proteins too long for one GPU; --max-length sets the crop)",
    )
    compile: bool = option(False, "torch.compile each layer (torch backend)")

    def sharding_options(self) -> list[str]:
        """The options given that only FSDP2 (sharded models) acts on, by flag: `--data-parallel replicate` refuses
        them and `auto` shards when any is given."""
        given = {
            "--tp": self.tp > 1,
            "--dp-replicate": self.dp_replicate > 1,
            "--keep-gathered": self.keep_gathered,
            "--reduce-dtype": self.reduce_dtype != "fp32",
        }
        return [flag for flag, asked in given.items() if asked]


@dataclass
class CheckpointConfig:
    """Checkpoints in OUT/checkpoints, resuming, and the final Hub export."""

    save_every: int = option(
        0, "checkpoint every N steps (0: by --save-minutes only); always at the end and on Ctrl-C/SIGTERM"
    )
    save_minutes: float = option(
        30.0,
        "also checkpoint when this many minutes passed since the last checkpoint (checked every --log-every "
        "steps; 0: off)",
    )
    keep: int = option(2, "checkpoints kept")
    resume: bool = option(
        False,
        "continue from the latest checkpoint in --out, with the options recorded in it: give only those to change "
        "(--steps, and those that do not change what a step computes; others are refused)",
    )
    stop_at_step: int | None = option(
        None,
        "stop (with a checkpoint) after this step, e.g. for job limits: at least 1, and past the step a --resume "
        "starts from (not taken from the run record); default: none, the run goes to --steps",
        type=int,
    )
    export: bool = option(True, "skip the consolidated Hub folder at the end", flag="--no-export")
    enabled: bool = option(True, "write no checkpoint, hence no export (throughput tests)", flag="--no-checkpoint")


@dataclass
class LoggingConfig:
    """metrics.jsonl every `log_every` steps, TensorBoard, and torch.profiler traces of `profile_steps` steps."""

    log_every: int = option(10, "steps between logs (each waits for the GPU)")
    tensorboard: bool = option(False, "also log to OUT/tensorboard")
    progress: bool = option(True, "no progress bar", flag="--no-progress")
    profile_steps: int = option(
        0,
        "trace this many steps after the first --log-every ones (torch.profiler, OUT/profile/rank*.json.gz; "
        "summarise with python -m nv_esm.trace_summary); their interval's tokens/s includes the tracing",
    )


# The options that ask for a feature of `configuration_nv_esm.UNSUPPORTED_COMBINATIONS`; refusals name them.
OPTION_FEATURES = {
    "--tp": "tensor_parallel",
    "--cp": "context_parallel",
    "--lora-rank": "lora",
    "--offload-activations": "offload_activations",
    "--activation-checkpointing": "activation_checkpointing",
    "--compile": "compile",
    "--backend": "te_layers",  # te, or auto where Transformer Engine runs: known once the model config is built
}


def asked_options(parallel: ParallelConfig, lora_rank: int = 0, backend: str | None = None) -> dict[str, Any]:
    """The options of `OPTION_FEATURES` that ask for their feature, with their values; `backend` is the model
    config's (te or torch), None before it is built."""
    values = {
        "--tp": parallel.tp > 1 and parallel.tp,
        "--cp": parallel.cp > 1 and parallel.cp,
        "--lora-rank": lora_rank,
        "--offload-activations": parallel.offload_activations,
        "--activation-checkpointing": parallel.activation_checkpointing,
        "--compile": parallel.compile,
        "--backend": backend == "te" and backend,
    }
    return {option: value for option, value in values.items() if value}


def refuse_option_combinations(parallel: ParallelConfig, lora_rank: int = 0, backend: str | None = None) -> None:
    """ValueError naming the options of the first pair of features they ask for (`asked_options`) that
    `UNSUPPORTED_COMBINATIONS` refuses: "--tp 2 with --lora-rank is not supported; use one of them." for
    --tp and --cp (the table's reasons name the model's settings), else with the table's reason."""
    from configuration_nv_esm import refused_combination

    asked = asked_options(parallel, lora_rank, backend)
    option_of = {OPTION_FEATURES[option]: option for option in asked}
    refused = refused_combination(option_of)
    if refused is None:
        return
    option, other = option_of[refused[0]], option_of[refused[1]]
    if option in ("--tp", "--cp"):
        raise ValueError(f"{option} {asked[option]} with {other} is not supported; use one of them.")
    if other == "--backend":
        raise ValueError(f"{option} is for --backend torch; {refused[2]}.")
    raise ValueError(f"{option} with {other} {refused[2]}: use one of them.")


@dataclass
class TrainConfig:
    """A training run: the sections above, the run folder `out` and the seed of data order, init and RNG."""

    model: ModelConfig = field(metadata={"group": "model"})
    data: DataConfig = field(metadata={"group": "data"})
    optimizer: OptimizerConfig = field(metadata={"group": "optimisation"})
    out: Path = option(
        help="run folder: checkpoints, metrics.jsonl, final export; a new run refuses one holding an earlier run's, "
        "and none may be, hold or lie in --model, --config or the data",
        type=Path,
        group="run",
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"group": "model"})
    seed: int = option(
        0, "seed of the data order, masking, a fresh initialisation and dropout: 0 to 2**32 - 1", group="optimisation"
    )
    validation: ValidationConfig = field(default_factory=ValidationConfig, metadata={"group": "validation"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"group": "run"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"group": "run"})

    def validate(self) -> None:
        """The checks made before training starts; messages name the command-line options."""
        from modeling_nv_esm_lora import FUSED_MODULE_TARGETS, fused_module_refusal

        if (self.model.init_from is None) == (self.model.config_file is None):
            raise ValueError("Give exactly one of --model and --config.")
        at_least_one = {
            "--steps": self.optimizer.steps,
            "--grad-accum": self.optimizer.grad_accum,
            "--tokens-per-batch": self.data.token_budget,
            "--max-length": self.data.max_length,
            "--log-every": self.logging.log_every,
            "--dp-replicate": self.parallel.dp_replicate,
            "--tp": self.parallel.tp,
            "--cp": self.parallel.cp,
        }
        for flag, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}.")
        fused = [target for target in self.model.lora_targets if target in FUSED_MODULE_TARGETS]
        if self.model.lora_rank and fused:
            raise ValueError(f"--lora-targets: {fused_module_refusal(fused[0])}")
        at_least_zero = {
            "save_every": self.checkpoint.save_every,
            "save_minutes": self.checkpoint.save_minutes,
            "keep": self.checkpoint.keep,
            "warmup_steps": self.optimizer.warmup_steps,
            "clip_grad": self.optimizer.clip_grad,
            "weight_decay": self.optimizer.weight_decay,
            "profile_steps": self.logging.profile_steps,
            "offloaded_layers": self.parallel.offloaded_layers,
        }
        for name, value in at_least_zero.items():
            if not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {value}.")
        if self.data.token_budget > MAX_TOKEN_BUDGET:
            raise ValueError(
                f"--tokens-per-batch must be at most 2**31 - 1 = {MAX_TOKEN_BUDGET} (packed offsets are int32), "
                f"got {self.data.token_budget}."
            )
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}.")
        stop_at_step = self.checkpoint.stop_at_step
        if stop_at_step is not None and stop_at_step < 1:
            raise ValueError(f"--stop-at-step must be at least 1 (the step to stop after), got {stop_at_step}.")
        if self.data.max_length < 3:
            raise ValueError(f"--max-length must be at least 1 residue, got {self.data.max_length - 2}.")
        if self.model.task == "mlm" and not 0 < self.data.mask_prob < 1:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.data.mask_prob}.")
        if not self.optimizer.lr >= 0 or not 0 <= self.optimizer.min_lr_ratio <= 1:
            raise ValueError("--lr must be at least 0 and --min-lr-ratio in [0, 1].")
        if not all(0 <= beta < 1 for beta in self.optimizer.betas):
            raise ValueError(f"--betas must be in [0, 1), got {list(self.optimizer.betas)}.")
        if self.model.lora_rank and importlib.util.find_spec("peft") is None:
            raise ValueError("--lora-rank needs the peft package: pip install '.[train]' (or peft).")
        profile_steps, log_every, steps = self.logging.profile_steps, self.logging.log_every, self.optimizer.steps
        if profile_steps and log_every + profile_steps > steps:
            raise ValueError("--profile-steps traces the steps after the first --log-every ones: raise --steps.")
        if self.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install '.[train]' (or tensorboard).")
        if self.optimizer.warmup_steps >= steps:
            raise ValueError(f"--warmup-steps ({self.optimizer.warmup_steps}) must be smaller than --steps ({steps}).")
        for option, paths in (("--data", self.data.files), ("--val-data", self.validation.files)):
            for path in paths:
                if not Path(path).exists():
                    raise FileNotFoundError(f"{option} {path} does not exist.")
        # The run writes only in --out (checkpoints, logs, final/ replaced at the end): never over what it reads.
        inputs = [("--model", self.model.init_from), ("--config", self.model.config_file)]
        inputs += [("--data", path) for path in self.data.files]
        inputs += [("--val-data", path) for path in self.validation.files]
        for option, path in inputs:
            refuse_overlap({"--out": self.out}, {option: path})
        validation = self.validation
        if validation.files and validation.fraction:
            raise ValueError("Give --val-data or --val-fraction, not both.")
        if not 0 <= validation.fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {validation.fraction}.")
        if validation.every < 0:
            raise ValueError(f"--val-every must be at least 0, got {validation.every}.")
        if validation.every and not validation.enabled:
            raise ValueError("--val-every needs a validation set: --val-data or --val-fraction.")
        if self.parallel.recompute_mlp and self.parallel.activation_checkpointing:
            raise ValueError(
                "--recompute-mlp recomputes the MLP of layers that --activation-checkpointing recomputes whole: "
                "give one of them."
            )
        if self.parallel.offloaded_layers and not self.parallel.offload_activations:
            raise ValueError("--offloaded-layers counts the layers that --offload-activations offloads: give both.")
        refuse_option_combinations(self.parallel, self.model.lora_rank)
        self.refuse_fp8_without_te()
        asked = self.parallel.sharding_options()
        if self.parallel.data_parallel == "replicate" and asked:
            raise ValueError(
                f"--data-parallel replicate holds a whole model on each rank; {asked[0]} is for sharded models "
                "(--data-parallel shard or auto)."
            )
        if validation.files and self.model.task != "mlm" and len(validation.files) != 1:
            raise ValueError(f"--task {self.model.task} validates on one labelled CSV, got {len(validation.files)}.")

    def refuse_fp8_without_te(self) -> None:
        """ValueError (`options.fp8_refusal`, as nv-esm embed says it) where `--fp8` asks for FP8 layers and the
        layers would run without Transformer Engine on a CUDA GPU (the model would warn and run them in bf16)."""
        if self.model.fp8 == "off":
            return
        import torch

        from modeling_nv_esm import resolve_backend

        device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = resolve_backend(self.model.backend, device)
        if not backend.runs_fp8:
            raise ValueError(fp8_refusal(self.model.fp8, backend.name, device))


def _options(cls: type, group: str = "") -> Iterator[tuple[str, Field]]:
    """The option fields of `cls` and of its sections, in order, with their argument group."""
    for item in fields(cls):
        if "help" in item.metadata:
            yield item.metadata.get("group", group), item
        else:  # a section
            yield from _options(get_type_hints(cls)[item.name], item.metadata["group"])


def _flag(item: Field) -> str:
    return item.metadata.get("flag", "--" + item.name.replace("_", "-"))


# What the help adds to the options a new run needs (none with --resume: the checkpoint's are taken).
REQUIRED_NOTE = "required; with --resume: the checkpoint's"


def _default(item: Field) -> Any:
    return item.default if item.default_factory is MISSING else item.default_factory()


def _argument(item: Field) -> dict[str, Any]:
    """`add_argument`'s keywords for the option of `item`: its metadata, and what its default implies: required
    without one, the type of a number, a flag for a bool (`--no-...`: stored negated; on by default: `--x/--no-x`)."""
    given = {k: v for k, v in item.metadata.items() if k not in ("flag", "group", "offset", "one_of")}
    default = _default(item)
    if default is MISSING:
        return {"required": True, **given, "help": f"{given['help']} ({REQUIRED_NOTE})"}
    if isinstance(default, bool):
        if default and not _flag(item).startswith("--no-"):
            return {"action": argparse.BooleanOptionalAction, "default": default, **given}
        return {"action": "store_true", **given}
    sample = default[0] if isinstance(default, (list, tuple)) and default else default
    derived = {"type": type(sample)} if isinstance(sample, (int, float)) else {}
    if isinstance(default, tuple):
        default = list(default)
    elif "offset" in item.metadata:
        default -= item.metadata["offset"]
    return {**derived, "default": default, **given}


def _value(item: Field, args: argparse.Namespace) -> Any:
    """The field value of what argparse parsed for the option of `item`."""
    value = getattr(args, _dest(item))
    default = _default(item)
    if isinstance(default, bool) and _flag(item).startswith("--no-"):
        return not value
    if isinstance(default, tuple):
        return tuple(value)
    return value + item.metadata["offset"] if "offset" in item.metadata else value


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (`prog: error: MESSAGE (see prog --help)`, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The training command line (usage names `prog`), one argument per `option` field in the groups of `GROUPS`;
    `config_from_args` turns what it parses into a `TrainConfig`."""
    parser = Parser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    one_of = None  # the required mutually exclusive group of the `one_of` options (--model, --config)
    for name, item in sorted(_options(TrainConfig), key=lambda pair: GROUPS.index(pair[0])):
        group = groups[name]
        arguments = _argument(item)
        if item.metadata.get("one_of"):
            group = one_of = one_of or group.add_mutually_exclusive_group(required=True)
            others = " or ".join(_flag(other) for _, other in _options(TrainConfig) if other.metadata.get("one_of"))
            arguments["help"] += f" ({others} {REQUIRED_NOTE})"
        add_renamed(group, group.add_argument(_flag(item), **arguments))
    return parser


def _section(cls: type, args: argparse.Namespace) -> Any:
    """`cls` (`TrainConfig` or a section) of the options `build_parser()` parsed."""
    return cls(
        **{
            item.name: _value(item, args) if "help" in item.metadata else _section(get_type_hints(cls)[item.name], args)
            for item in fields(cls)
        }
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of the options `build_parser()` parsed."""
    return _section(TrainConfig, args)


def _dest(item: Field) -> str:
    return item.metadata.get("dest") or _flag(item)[2:].replace("-", "_")


def option_flag(dest: str) -> str:
    """The command-line flag of the option argparse stores in `dest` (a run record's key): e.g. "--tokens-per-batch"
    for "token_budget", whose flag was renamed."""
    flags = {_dest(item): _flag(item) for _, item in _options(TrainConfig)}
    return flags.get(dest, "--" + dest.replace("_", "-"))


def _field_values(section: Any) -> Iterator[tuple[Field, Any]]:
    """The option fields of `section` (a `TrainConfig` or a section of it) and of its sections, with their values."""
    for item in fields(section):
        value = getattr(section, item.name)
        if "help" in item.metadata:
            yield item, value
        else:
            yield from _field_values(value)


def option_values(config: TrainConfig) -> dict[str, Any]:
    """Every option of `config` as what argparse would parse for it, by argparse's dest, in JSON types: the run
    record a `--resume` takes its options from (`parse_config(..., recorded=...)` gives `config` back)."""
    values = {}
    for item, value in _field_values(config):
        if isinstance(_default(item), bool) and _flag(item).startswith("--no-"):
            value = not value
        elif "offset" in item.metadata:
            value -= item.metadata["offset"]
        if isinstance(value, (tuple, Path)):
            value = list(value) if isinstance(value, tuple) else str(value)
        values[_dest(item)] = value
    return values


def given_options(argv: list[str] | None = None, prog: str = PROG) -> dict[str, Any]:
    """The options `argv` gives (by argparse's dest), as argparse parses them (an old option name without its
    notice); a usage error exits as in `parse_config`."""
    parser = build_parser(prog)
    for action in parser._actions:
        action.default, action.required = argparse.SUPPRESS, False
        action.quiet = True  # a `RenamedOption`'s notice: `parse_config` gives it
    for group in parser._mutually_exclusive_groups:
        group.required = False
    return vars(parser.parse_args(argv))


def parse_config(
    argv: list[str] | None = None, prog: str = PROG, recorded: dict[str, Any] | None = None
) -> TrainConfig:
    """The `TrainConfig` of a training command line (`sys.argv[1:]` when None); exits with usage on bad options.
    `recorded` (`option_values` of a run, by dest) are the defaults of the options `argv` does not give (--model or
    --config given replaces the recorded one), so none is required."""
    parser = build_parser(prog)
    if recorded:
        one_of = {_dest(item) for _, item in _options(TrainConfig) if item.metadata.get("one_of")}
        if one_of & given_options(argv, prog).keys():
            recorded = {dest: value for dest, value in recorded.items() if dest not in one_of}
        parser.set_defaults(**recorded)
        for action in parser._actions:
            action.required = action.required and action.dest not in recorded
        for group in parser._mutually_exclusive_groups:
            group.required = not one_of & recorded.keys()
    return config_from_args(parser.parse_args(argv))
