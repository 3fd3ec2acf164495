"""The settings of a training run: typed sections (`TrainConfig`) and the command line that fills them.

    config = parse_config(["--config", "config.json", "--data", "demo.fasta", "--steps", "100", "--out", "runs/x"])
    config.optimizer.lr, config.data.token_budget, config.parallel.keep_gathered, config.checkpoint.save_every

Every section has the command line's defaults, so a test or a script builds only what it needs, e.g.
`OptimizerConfig(steps=100, warmup_steps=10)`. `TrainConfig.validate` makes the checks the trainer makes before
it starts (argparse makes the others: choices, required options, `--model` or `--config`).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from configuration_nv_esm import BACKENDS, FP8_LAYER_CHOICES, FP8_RECIPES
from nv_esm.tasks import TASK_HEADS

PROG = "nv-esm train"  # the documented command (also `python -m nv_esm.train`, `torchrun -m nv_esm.train`)
TASKS = tuple(TASK_HEADS)
DESCRIPTION = """\
Train NVEsm (ESM-2 on Transformer Engine) on one or many GPUs with FSDP2: MLM pretraining and fine-tuning.

    nv-esm convert hf-to-te assets/esm2_tiny runs/esm2_tiny_nv
    torchrun --nproc-per-node 2 -m nv_esm.train --model runs/esm2_tiny_nv \\
        --data recipes/demo_data/demo.fasta --steps 100 --out runs/demo

(`recipes/train.py` is the same command as a script: `torchrun --nproc-per-node 2 recipes/train.py ...`.)

On several ranks each transformer layer and then the whole model are wrapped with
`torch.distributed.fsdp.fully_shard` (bf16 compute, fp32 master weights and gradient reduction); a world of one
is not sharded (fp32 weights, bf16 autocast) and replays the Transformer Engine layers as CUDA graphs
(`--no-cuda-graphs`: eagerly). The model is built on the meta device and each rank
materialises only its own shard: read from a converted checkpoint's safetensors row slices (`--model`) or drawn
from scratch (`--config`) with one seeded generator per tensor, so every world size starts from the same weights.

Batches are packed (THD) micro-batches of whole proteins up to `--token-budget` tokens. With W ranks and
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


@dataclass
class ModelConfig:
    """What is trained: the starting point (exactly one of `init_from` and `config_file`, paths as given on the
    command line), the task head, the layer implementation, FP8 and LoRA."""

    init_from: str | None = None  # --model: an NVEsm folder (nv-esm convert hf-to-te output)
    config_file: str | None = None  # --config: config.json of a model trained from scratch
    task: str = "mlm"  # one of TASKS
    backend: str = "auto"  # auto, te or torch
    fp8: str = "off"  # off, all, or inner (all layers but the first and last)
    fp8_recipe: str = "delayed"  # delayed, current or block
    lora_rank: int = 0  # 0: train all weights
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("query", "key", "value", "attention.output.dense")  # PEFT target_modules
    cuda_graphs: bool = True  # the model's `cuda_graphs`: used by TE layers on one GPU (not under FSDP2)

    @property
    def source(self) -> Path:
        """The checkpoint folder or config file the model's architecture comes from."""
        return Path(self.init_from or self.config_file)


@dataclass
class DataConfig:
    """The data (`files`, as given: they are compared on resume) and how it is cut into micro-batches."""

    files: list[str]  # --data: FASTA/.txt/.parquet (mlm) or one labelled CSV
    token_budget: int = 16384  # tokens per micro-batch and rank
    max_length: int = 1024  # crop length in tokens: --max-length residues + <cls> and <eos>
    mask_prob: float = 0.15
    workers: int = 1  # --data-workers: 1 process prepares batches ahead, or 0


@dataclass
class ValidationConfig:
    """The validation set (`files`, or a `fraction` of the training data set aside; neither: no validation) and
    how often it is evaluated (every `every` steps, 0: only after the last step)."""

    files: list[str] = field(default_factory=list)  # --val-data: like --data (one labelled CSV for a head)
    fraction: float = 0.0  # --val-fraction: records of --data set aside (the same ones for every seed and world)
    every: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.files) or self.fraction > 0


@dataclass
class OptimizerConfig:
    """AdamW and its schedule: `steps` optimizer steps of `grad_accum` micro-batches per rank, linear warm-up and
    linear or cosine decay to `min_lr_ratio * lr`."""

    steps: int
    grad_accum: int = 1
    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    decay: str = "linear"  # linear or cosine
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    clip_grad: float = 1.0  # max global gradient norm; 0: no clipping
    skip_nonfinite: bool = False  # skip a step whose gradient norm is not finite (waits for the GPU every step)


@dataclass
class ParallelConfig:
    """How the model runs on the ranks: compute precision, FSDP2 options (hybrid sharding included), tensor
    parallelism, activation checkpointing and offloading, compilation."""

    precision: str | None = None  # bf16 or fp32; None: bf16 on GPU, fp32 on CPU
    dp_replicate: int = 1  # HSDP: shard within groups of world_size / dp_replicate ranks, replicate across groups
    tp: int = 1  # tensor parallelism (with sequence parallelism) over groups of this many consecutive ranks
    cp: int = 1  # context parallelism: each batch's layers run across groups of this many ranks
    activation_checkpointing: bool = False
    offload_activations: bool = False  # the model's `offload_activations` (GPU, Transformer Engine)
    keep_gathered: bool = False  # FSDP2 reshard_after_forward=False
    compile: bool = False  # torch.compile each layer (torch backend)


@dataclass
class CheckpointConfig:
    """Checkpoints in OUT/checkpoints, resuming, and the final Hub export."""

    enabled: bool = True  # False: --no-checkpoint (no checkpoint, hence no export)
    save_every: int = 0  # every N steps; 0: by time only
    save_minutes: float = 30.0  # also when this many minutes passed since the last one (checked at log steps); 0: off
    keep: int = 2
    resume: bool = False
    stop_at_step: int | None = None  # stop (with a checkpoint) after this step
    export: bool = True  # False: --no-export


@dataclass
class LoggingConfig:
    """metrics.jsonl every `log_every` steps, TensorBoard, and torch.profiler traces of `profile_steps` steps."""

    log_every: int = 10
    tensorboard: bool = False
    profile_steps: int = 0
    progress: bool = True  # False: --no-progress (no progress bar)


@dataclass
class TrainConfig:
    """A training run: the sections above, the run folder `out` and the seed of data order, init and RNG."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    out: Path
    seed: int = 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """The checks made before training starts; messages name the command-line options."""
        if (self.model.init_from is None) == (self.model.config_file is None):
            raise ValueError("Give exactly one of --model and --config.")
        at_least_one = {
            "steps": self.optimizer.steps,
            "grad_accum": self.optimizer.grad_accum,
            "token_budget": self.data.token_budget,
            "max_length": self.data.max_length,
            "log_every": self.logging.log_every,
            "dp_replicate": self.parallel.dp_replicate,
            "tp": self.parallel.tp,
            "cp": self.parallel.cp,
        }
        for name, value in at_least_one.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
        at_least_zero = {
            "save_every": self.checkpoint.save_every,
            "save_minutes": self.checkpoint.save_minutes,
            "keep": self.checkpoint.keep,
            "warmup_steps": self.optimizer.warmup_steps,
            "clip_grad": self.optimizer.clip_grad,
            "weight_decay": self.optimizer.weight_decay,
            "profile_steps": self.logging.profile_steps,
        }
        for name, value in at_least_zero.items():
            if not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {value}.")
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
        validation = self.validation
        if validation.files and validation.fraction:
            raise ValueError("Give --val-data or --val-fraction, not both.")
        if not 0 <= validation.fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {validation.fraction}.")
        if validation.every < 0:
            raise ValueError(f"--val-every must be at least 0, got {validation.every}.")
        if validation.every and not validation.enabled:
            raise ValueError("--val-every needs a validation set: --val-data or --val-fraction.")
        if self.parallel.offload_activations and self.parallel.activation_checkpointing:
            raise ValueError(
                "--offload-activations with --activation-checkpointing offloads nothing (Transformer Engine's "
                "offloading does not reach the checkpointed layer inputs): use one of them."
            )
        for option, size in (("--tp", self.parallel.tp), ("--cp", self.parallel.cp)):
            unsupported = {
                "--lora-rank": self.model.lora_rank,
                "--offload-activations": self.parallel.offload_activations,
                "--compile": self.parallel.compile,
                "--tp": option == "--cp" and self.parallel.tp > 1,
            }
            for other, value in unsupported.items():
                if size > 1 and value:
                    raise ValueError(f"{option} {size} with {other} is not supported; use one of them.")
        if validation.files and self.model.task != "mlm" and len(validation.files) != 1:
            raise ValueError(f"--task {self.model.task} validates on one labelled CSV, got {len(validation.files)}.")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default after its help (unless it has none: a flag off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The training command line (usage names `prog`); `config_from_args` turns what it parses into a
    `TrainConfig`."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    model = parser.add_argument_group("model")
    start = model.add_mutually_exclusive_group(required=True)
    start.add_argument("--model", help="NVEsm checkpoint folder (nv-esm convert hf-to-te output) to start from")
    start.add_argument("--config", help="config.json of a model trained from scratch (e.g. the repo's 650M one)")
    model.add_argument("--task", choices=TASKS, default=ModelConfig.task, help="mlm, or a fine-tuning head")
    model.add_argument(
        "--backend",
        choices=BACKENDS,
        default=ModelConfig.backend,
        help="layers: Transformer Engine (te), PyTorch (torch), or TE on a GPU where installed (auto)",
    )
    model.add_argument(
        "--fp8",
        choices=FP8_LAYER_CHOICES,
        default=ModelConfig.fp8,
        help="FP8 layers (TE): all, or all but first/last",
    )
    model.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default=ModelConfig.fp8_recipe,
        help="FP8 scaling of --fp8 layers",
    )
    model.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each layer in the backward instead of keeping its activations",
    )
    model.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep every layer's saved activations (but the last layer's) in pinned host memory between forward "
        "and backward (Transformer Engine's offloading; GPUs only, not with --activation-checkpointing)",
    )
    model.add_argument(
        "--keep-gathered",
        action="store_true",
        help="keep layers gathered between forward and backward (FSDP2 "
        "reshard_after_forward=False): one all-gather less per layer and step, more memory",
    )
    model.add_argument(
        "--dp-replicate",
        type=int,
        default=ParallelConfig.dp_replicate,
        help="hybrid sharding (HSDP): replicate the model over R groups, each sharding it over the world size / R "
        "ranks (e.g. a node), so the all-gathers stay within a group",
    )
    model.add_argument(
        "--tp",
        type=int,
        default=ParallelConfig.tp,
        help="tensor parallelism: split every layer (heads, MLP columns, and the tokens between them) over T "
        "consecutive ranks, e.g. the GPUs of a node; FSDP2 shards over the world size / T groups",
    )
    model.add_argument(
        "--cp",
        type=int,
        default=ParallelConfig.cp,
        help="context parallelism: run each micro-batch's layers across C ranks, each holding its chunks of every "
        "protein (for proteins too long for one GPU; --max-length sets the crop)",
    )
    model.add_argument("--compile", action="store_true", help="torch.compile each layer (torch backend)")
    model.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=ModelConfig.cuda_graphs,
        help="replay the TE layers as CUDA graphs (one GPU: FSDP2-sharded layers run eagerly)",
    )
    model.add_argument(
        "--lora-rank",
        type=int,
        default=ModelConfig.lora_rank,
        help="train LoRA adapters of this rank (PEFT) and the head",
    )
    model.add_argument(
        "--lora-alpha",
        type=float,
        default=ModelConfig.lora_alpha,
        help="LoRA scaling: updates are multiplied by alpha / rank",
    )
    model.add_argument(
        "--lora-targets",
        nargs="+",
        default=list(ModelConfig.lora_targets),
        help="PEFT target_modules: transformers' ESM names (query key value dense, attention.output.dense, "
        "intermediate.dense, output.dense)",
    )

    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", required=True, help="FASTA/.txt/.parquet (mlm) or a labelled CSV")
    data.add_argument(
        "--token-budget", type=int, default=DataConfig.token_budget, help="tokens per micro-batch and rank"
    )
    data.add_argument(
        "--max-length",
        type=int,
        default=DataConfig.max_length - 2,
        help="longest protein in residues, as in nv-esm embed: longer ones are cropped to a window of this many "
        "residues plus 2 tokens (a window of the tokenized protein, <cls>/<eos> where it reaches the ends, as "
        "ESM-2 was trained)",
    )
    data.add_argument(
        "--mask-prob",
        type=float,
        default=DataConfig.mask_prob,
        help="MLM: fraction of residues to predict (80%% <mask>, 10%% random, 10%% kept)",
    )
    data.add_argument(
        "--data-workers",
        type=int,
        choices=(0, 1),
        default=DataConfig.workers,
        help="1: a process prepares batches ahead; 0: none",
    )

    validation = parser.add_argument_group("validation")
    validation.add_argument("--val-data", nargs="+", default=[], help="validation files, as --data")
    validation.add_argument(
        "--val-fraction",
        type=float,
        default=ValidationConfig.fraction,
        help="set this fraction of --data aside for validation (the same records for every seed and world size)",
    )
    validation.add_argument(
        "--val-every", type=int, default=ValidationConfig.every, help="validate every N steps (0: after the last)"
    )

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--steps", type=int, required=True, help="optimizer steps of the schedule")
    optim.add_argument(
        "--grad-accum", type=int, default=OptimizerConfig.grad_accum, help="micro-batches per rank and optimizer step"
    )
    optim.add_argument("--lr", type=float, default=OptimizerConfig.lr, help="peak learning rate (AdamW)")
    optim.add_argument("--min-lr-ratio", type=float, default=OptimizerConfig.min_lr_ratio, help="final LR / peak LR")
    optim.add_argument(
        "--warmup-steps", type=int, default=OptimizerConfig.warmup_steps, help="steps of linear warm-up from 0 to --lr"
    )
    optim.add_argument(
        "--decay",
        choices=("linear", "cosine"),
        default=OptimizerConfig.decay,
        help="learning-rate decay after the warm-up, to --min-lr-ratio x --lr at --steps",
    )
    optim.add_argument(
        "--weight-decay", type=float, default=OptimizerConfig.weight_decay, help="AdamW decoupled weight decay"
    )
    optim.add_argument("--betas", type=float, nargs=2, default=OptimizerConfig.betas, help="AdamW beta1 beta2")
    optim.add_argument(
        "--clip-grad", type=float, default=OptimizerConfig.clip_grad, help="max global grad norm (0: off)"
    )
    optim.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip (and count) a step whose gradient norm is inf/nan instead of stopping the run; waits for the GPU "
        "every step",
    )
    optim.add_argument("--precision", choices=("bf16", "fp32"), help="compute dtype (default bf16 on GPU)")
    optim.add_argument(
        "--seed",
        type=int,
        default=TrainConfig.seed,
        help="seed of the data order, masking, a fresh initialisation and dropout",
    )

    run = parser.add_argument_group("run")
    run.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, final export")
    run.add_argument(
        "--save-every",
        type=int,
        default=CheckpointConfig.save_every,
        help="checkpoint every N steps (0: by --save-minutes only); always at the end and on Ctrl-C/SIGTERM",
    )
    run.add_argument(
        "--save-minutes",
        type=float,
        default=CheckpointConfig.save_minutes,
        help="also checkpoint when this many minutes passed since the last checkpoint (checked every --log-every "
        "steps; 0: off)",
    )
    run.add_argument("--keep", type=int, default=CheckpointConfig.keep, help="checkpoints kept")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    run.add_argument("--stop-at-step", type=int, help="stop (with a checkpoint) after this step, e.g. for job limits")
    run.add_argument("--no-export", action="store_true", help="skip the consolidated Hub folder at the end")
    run.add_argument(
        "--no-checkpoint", action="store_true", help="write no checkpoint, hence no export (throughput tests)"
    )
    run.add_argument(
        "--log-every", type=int, default=LoggingConfig.log_every, help="steps between logs (each waits for the GPU)"
    )
    run.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--profile-steps",
        type=int,
        default=LoggingConfig.profile_steps,
        help="trace this many steps after the first --log-every ones (torch.profiler, OUT/profile/rank*.json.gz; "
        "summarise with python -m nv_esm.trace_summary); their interval's tokens/s includes the tracing",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of the options `build_parser()` parsed."""
    return TrainConfig(
        model=ModelConfig(
            init_from=args.model,
            config_file=args.config,
            task=args.task,
            backend=args.backend,
            fp8=args.fp8,
            fp8_recipe=args.fp8_recipe,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_targets=tuple(args.lora_targets),
            cuda_graphs=args.cuda_graphs,
        ),
        data=DataConfig(
            files=list(args.data),
            token_budget=args.token_budget,
            max_length=args.max_length + 2,  # tokens: the residues with <cls> and <eos>
            mask_prob=args.mask_prob,
            workers=args.data_workers,
        ),
        optimizer=OptimizerConfig(
            steps=args.steps,
            grad_accum=args.grad_accum,
            lr=args.lr,
            min_lr_ratio=args.min_lr_ratio,
            warmup_steps=args.warmup_steps,
            decay=args.decay,
            weight_decay=args.weight_decay,
            betas=tuple(args.betas),
            clip_grad=args.clip_grad,
            skip_nonfinite=args.skip_nonfinite,
        ),
        out=Path(args.out),
        seed=args.seed,
        parallel=ParallelConfig(
            precision=args.precision,
            dp_replicate=args.dp_replicate,
            tp=args.tp,
            cp=args.cp,
            activation_checkpointing=args.activation_checkpointing,
            offload_activations=args.offload_activations,
            keep_gathered=args.keep_gathered,
            compile=args.compile,
        ),
        validation=ValidationConfig(files=list(args.val_data), fraction=args.val_fraction, every=args.val_every),
        checkpoint=CheckpointConfig(
            enabled=not args.no_checkpoint,
            save_every=args.save_every,
            save_minutes=args.save_minutes,
            keep=args.keep,
            resume=args.resume,
            stop_at_step=args.stop_at_step,
            export=not args.no_export,
        ),
        logging=LoggingConfig(
            log_every=args.log_every,
            tensorboard=args.tensorboard,
            profile_steps=args.profile_steps,
            progress=not args.no_progress,
        ),
    )


def parse_config(argv: list[str] | None = None, prog: str = PROG) -> TrainConfig:
    """The `TrainConfig` of a training command line (`sys.argv[1:]` when None); exits with usage on bad options."""
    return config_from_args(build_parser(prog).parse_args(argv))
