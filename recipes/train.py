"""Train NVEsm (ESM-2 on Transformer Engine) on one or many GPUs with FSDP2: MLM pretraining and fine-tuning.

    python convert_checkpoint.py hf-to-te assets/esm2_tiny runs/esm2_tiny_nv
    torchrun --nproc-per-node 2 recipes/train.py --model runs/esm2_tiny_nv \
        --data recipes/demo_data/demo.fasta --steps 100 --out runs/demo

Each transformer layer and then the whole model are wrapped with `torch.distributed.fsdp.fully_shard` (bf16
compute, fp32 master weights and gradient reduction). The model is built on the meta device and each rank
materialises only its own shard: read from a converted checkpoint's safetensors row slices (`--model`) or drawn
from scratch (`--config`) with one seeded generator per tensor, so every world size starts from the same weights.

Batches are packed (THD) micro-batches of whole proteins up to `--token-budget` tokens. With W ranks and
`--grad-accum` A, the data is split into W*A streams and rank r owns streams r*A .. r*A+A-1, so a step sees the
same proteins for any W and A with the same product; the loss of a step is the sum over its masked tokens divided
by their global count, so the gradients are those of one big batch whatever the split.

Checkpoints (`torch.distributed.checkpoint`, every `--save-every` steps, in OUT/checkpoints/step_NNNNNNN) hold the
sharded model and optimizer, the step, every data stream's position, every rank's RNG and FP8 scaling history
(delayed scaling); `--resume` continues exactly where the latest one stopped. `python recipes/train.py export
CHECKPOINT OUT` (also run at the end of training) writes a consolidated Hub folder in the converter's layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "bench")) if p not in sys.path]

import flops  # noqa: E402
from configuration_nv_esm import NVEsmConfig  # noqa: E402
from convert_checkpoint import (  # noqa: E402
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    check_out,
    copy_remote_code,
    nv_config_dict,
    staging_folder,
    write_esm_tokenizer,
    write_license,
)
from modeling_nv_esm import (  # noqa: E402
    NVEsmForMaskedLM,
    NVEsmForSequenceClassification,
    NVEsmForTokenClassification,
    NVEsmLayerNormLinear,
    NVEsmRotaryEmbedding,
    transformer_engine_available,
)
from recipes.data import (  # noqa: E402
    Batches,
    ClassificationStream,
    PackedBatch,
    rank_stream_indices,
    rank_streams,
    to_device,
)

MODEL_CLASSES = {
    "mlm": NVEsmForMaskedLM,
    "token": NVEsmForTokenClassification,
    "sequence": NVEsmForSequenceClassification,
}
CHECKPOINT_PREFIX = "step_"
TRAIN_STATE = "train_state.json"
TE_PICKLE_OPT_IN = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    start = model.add_mutually_exclusive_group(required=True)
    start.add_argument("--model", help="NVEsm checkpoint folder (convert_checkpoint.py hf-to-te output) to start from")
    start.add_argument("--config", help="config.json of a model trained from scratch (e.g. the repo's 650M one)")
    model.add_argument("--task", choices=sorted(MODEL_CLASSES), default="mlm", help="mlm, or a fine-tuning head")
    model.add_argument("--backend", choices=("auto", "te", "torch"), default="auto")
    model.add_argument(
        "--fp8", choices=("off", "all", "inner"), default="off", help="FP8 layers (TE): all, or all but first/last"
    )
    model.add_argument("--fp8-recipe", choices=("delayed", "current", "block"), default="delayed")
    model.add_argument("--activation-checkpointing", action="store_true")
    model.add_argument(
        "--keep-gathered",
        action="store_true",
        help="keep layers gathered between forward and backward (FSDP2 "
        "reshard_after_forward=False): one all-gather less per layer and step, more memory",
    )
    model.add_argument("--compile", action="store_true", help="torch.compile each layer (torch backend)")
    model.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (PEFT) and the head")
    model.add_argument("--lora-alpha", type=float, default=16.0)

    data = parser.add_argument_group("data")
    data.add_argument("--data", nargs="+", required=True, help="FASTA/.txt/.parquet (mlm) or a labelled CSV")
    data.add_argument("--token-budget", type=int, default=16384, help="tokens per micro-batch and rank")
    data.add_argument("--max-length", type=int, default=1024, help="crop proteins to this many tokens")
    data.add_argument("--mask-prob", type=float, default=0.15)
    data.add_argument(
        "--data-workers", type=int, choices=(0, 1), default=1, help="1: a process prepares batches ahead; 0: none"
    )

    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--steps", type=int, required=True, help="optimizer steps of the schedule")
    optim.add_argument("--grad-accum", type=int, default=1)
    optim.add_argument("--lr", type=float, default=4e-4)
    optim.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR / peak LR")
    optim.add_argument("--warmup-steps", type=int, default=0)
    optim.add_argument("--decay", choices=("linear", "cosine"), default="linear")
    optim.add_argument("--weight-decay", type=float, default=0.01)
    optim.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.98))
    optim.add_argument("--clip-grad", type=float, default=1.0, help="max global grad norm (0: off)")
    optim.add_argument("--precision", choices=("bf16", "fp32"), help="compute dtype (default bf16 on GPU)")
    optim.add_argument("--seed", type=int, default=0)

    run = parser.add_argument_group("run")
    run.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, final export")
    run.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    run.add_argument("--stop-at-step", type=int, help="stop (with a checkpoint) after this step, e.g. for job limits")
    run.add_argument("--no-export", action="store_true", help="skip the consolidated Hub folder at the end")
    run.add_argument(
        "--no-checkpoint", action="store_true", help="write no checkpoint, hence no export (throughput tests)"
    )
    run.add_argument("--log-every", type=int, default=10, help="steps between logs (each waits for the GPU)")
    run.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    run.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="trace this many steps after the first --log-every ones (torch.profiler, OUT/profile/rank*.json.gz; "
        "summarise with bench/trace_summary.py); their interval's tokens/s includes the tracing",
    )
    return parser


# --------------------------------------------------------------------------------------------------------------
# Distributed set-up
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world_size: int
    device: torch.device
    mesh: Any

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """NCCL on GPUs, gloo on CPU; a plain `python train.py` runs as a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return Dist(dist.get_rank(), dist.get_world_size(), device, mesh)


# --------------------------------------------------------------------------------------------------------------
# Model: meta-device build, FSDP2, per-shard materialisation
# --------------------------------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace, world: Dist, labels: dict[str, Any]) -> NVEsmConfig:
    source = Path(args.model or args.config)
    path = source / "config.json" if source.is_dir() else source
    fields = json.loads(path.read_text())
    if fields.get("model_type", "nv_esm") != "nv_esm":
        raise ValueError(
            f"{source} is a {fields['model_type']!r} checkpoint; convert it first: "
            f"python convert_checkpoint.py hf-to-te {source} OUT"
        )
    for key in ("auto_map", "architectures", "dtype", "torch_dtype", "transformers_version", "model_type"):
        fields.pop(key, None)
    backend = args.backend
    if backend == "auto":
        backend = "te" if world.device.type == "cuda" and transformer_engine_available() else "torch"
    if args.lora_rank and backend == "te":
        raise ValueError("--lora-rank needs --backend torch: PEFT cannot wrap Transformer Engine's fused layers.")
    num_layers = fields.get("num_hidden_layers", NVEsmConfig().num_hidden_layers)
    fields.update(backend=backend, attn_input_format="thd", layer_precision=fp8_layers(args.fp8, num_layers))
    # The recipe's own packer makes valid batches: skip the model's input checks (each would wait for the GPU).
    fields.update(fp8_recipe=args.fp8_recipe, check_inputs=False)
    fields.update(labels)
    return NVEsmConfig(**fields)


def fp8_layers(mode: str, num_layers: int) -> list[str | None] | None:
    """`layer_precision` for --fp8: none, all layers, or all but the first and last (often kept in bf16)."""
    if mode == "off":
        return None
    if mode == "all" or num_layers <= 2:
        return ["fp8"] * num_layers
    return [None] + ["fp8"] * (num_layers - 2) + [None]


def build_model(args: argparse.Namespace, config: NVEsmConfig, world: Dist) -> nn.Module:
    """The model, sharded with FSDP2 and materialised on `world.device` one shard per rank."""
    with torch.device("meta"):
        model = MODEL_CLASSES[args.task](config)
    if args.lora_rank:
        model = add_lora(model, args)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = find_layers(model)
    if args.compile:
        if config.backend == "te":
            raise ValueError("--compile is for --backend torch; Transformer Engine layers are fused already.")
        for layer in layers:
            layer.compile()
    shard(model, layers, world, compute_dtype(args, world), reshard_after_forward=not args.keep_gathered)
    model.to_empty(device=world.device)
    source = CheckpointReader(Path(args.model)) if args.model else None
    materialise(model, config, source, args.seed, world)
    return model


def compute_dtype(args: argparse.Namespace, world: Dist) -> torch.dtype:
    precision = args.precision or ("bf16" if world.device.type == "cuda" else "fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def find_layers(model: nn.Module) -> list[nn.Module]:
    return list(next(m for name, m in model.named_modules() if name.endswith("encoder.layers")))


def shard(
    model: nn.Module, layers: list[nn.Module], world: Dist, dtype: torch.dtype, reshard_after_forward: bool
) -> None:
    """`fully_shard` each layer, then the rest (embeddings, tied LM decoder, heads) as the root group; each layer
    prefetches its neighbour's gather explicitly (FSDP2's implicit prefetch waits for the CPU to reach a layer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=world.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=world.mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # Gather layer i+1 while layer i computes (and i-1 during i's backward), even when the CPU is not ahead.
    for previous, current in zip(layers, layers[1:]):
        previous.set_modules_to_forward_prefetch([current])
        current.set_modules_to_backward_prefetch([previous])


class CheckpointReader:
    """Row ranges of the tensors of an NVEsm checkpoint folder (single or sharded safetensors), read lazily."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / WEIGHTS_INDEX_NAME
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (folder / WEIGHTS_NAME).exists():
            files = [WEIGHTS_NAME]
        else:
            raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; is it an NVEsm folder?")
        self.handles = [safe_open(folder / name, framework="pt") for name in files]
        self.where = {key: handle for handle in self.handles for key in handle.keys()}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        handle = self.where.get(name)
        return None if handle is None else handle.get_slice(name)[start:stop]


def canonical_name(name: str) -> str:
    """The checkpoint key of a model parameter: without PEFT's wrapping."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def materialise(model: nn.Module, config: NVEsmConfig, source: CheckpointReader | None, seed: int, world: Dist) -> None:
    """Fill every parameter shard and buffer, from `source` where it has the tensor, else a fresh initialisation.

    A fresh tensor is drawn whole (on the device, one at a time) from a generator seeded by `seed` and the
    parameter's index, then cut to this rank's rows, so the weights do not depend on the world size."""
    loaded, fresh = 0, []
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.named_parameters()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            start = world.rank * math.ceil(tensor.shape[0] / world.world_size) if local is not tensor else 0
            stop = min(start + local.shape[0], tensor.shape[0])
            rows = source.rows(canonical_name(name), start, stop) if source is not None else None
            if rows is None:
                fresh.append(name)
                rows = fresh_tensor(name, tuple(tensor.shape), config, seed * 100_003 + index, world.device)[start:stop]
            else:
                loaded += 1
            local[: stop - start].copy_(rows)
        for module in model.modules():
            if isinstance(module, NVEsmRotaryEmbedding):
                stored = source.rows("esm.rotary_embeddings.inv_freq", 0, None) if source is not None else None
                module.inv_freq = (stored if stored is not None else module.default_inv_freq(config)).to(world.device)
    if world.is_main:
        print(f"weights: {loaded} tensors from the checkpoint, {len(fresh)} initialised fresh {fresh[:6]}", flush=True)


def fresh_tensor(
    name: str, shape: tuple[int, ...], config: NVEsmConfig, seed: int, device: torch.device
) -> torch.Tensor:
    """The initialisation of `NVEsmPreTrainedModel._init_weights` (and LoRA's), by parameter name."""
    short = name.rsplit(".", 1)[-1]
    if short.endswith("bias") or "lora_B" in name:
        return torch.zeros(shape, device=device)
    if short == "layer_norm_weight" or name.endswith("emb_layer_norm_after.weight"):
        return torch.ones(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = 1 / math.sqrt(shape[1]) if "lora_A" in name else config.initializer_range
    tensor = torch.randn(shape, generator=generator, device=device) * std
    if name.endswith("word_embeddings.weight") or name.endswith("lm_head.decoder.weight"):
        tensor[config.vocab_size :] = 0
        tensor[config.pad_token_id] = 0
    return tensor


def add_lora(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """LoRA adapters (PEFT) on the attention QKV and output projections; a classification head trains fully."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        target_modules=["layernorm_qkv", "proj"],
        modules_to_save=None if args.task == "mlm" else ["classifier"],
    )
    lora._register_custom_module({NVEsmLayerNormLinear: lora_layer_norm_linear_class()})
    return get_peft_model(model, lora)


def lora_layer_norm_linear_class() -> type[nn.Module]:
    """PEFT's LoRA layer for `NVEsmLayerNormLinear` (PEFT is optional, so the class is made on demand)."""
    from peft.tuners.lora import LoraLayer

    class LoraLayerNormLinear(nn.Module, LoraLayer):
        """The adapters see the LayerNormed input, as the fused weight does: y = W LN(x) + b + s * B A LN(x)."""

        def __init__(
            self,
            base_layer: nn.Module,
            adapter_name: str,
            config: Any,
            r: int = 0,
            lora_alpha: float = 1,
            **kwargs: Any,
        ):
            super().__init__()
            LoraLayer.__init__(self, base_layer, **kwargs)
            self.out_features, self.in_features = base_layer.weight.shape
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            base = self.base_layer
            result = base(x)
            if self.disable_adapters:
                return result
            normed = F.layer_norm(x, x.shape[-1:], base.layer_norm_weight, base.layer_norm_bias, base.eps)
            for name in self.active_adapters:
                if name in self.lora_A:
                    update = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](normed.to(result.dtype))))
                    result = result + update * self.scaling[name]
            return result

    return LoraLayerNormLinear


# --------------------------------------------------------------------------------------------------------------
# Data and loss
# --------------------------------------------------------------------------------------------------------------


def make_batches(args: argparse.Namespace, world: Dist) -> tuple[Batches, dict[str, Any]]:
    """This rank's micro-batches, and the config fields of a classification task's labels."""
    common = dict(token_budget=args.token_budget, max_length=args.max_length, seed=args.seed)
    if args.task == "mlm":
        return rank_streams(
            args.data, world.rank, world.world_size, args.grad_accum, mask_prob=args.mask_prob, **common
        ), {}
    if len(args.data) != 1:
        raise ValueError(f"--task {args.task} reads one labelled CSV, got {len(args.data)} files.")
    indices, num_streams = rank_stream_indices(world.rank, world.world_size, args.grad_accum)
    streams = [ClassificationStream(args.data[0], args.task, index, num_streams, **common) for index in indices]
    return Batches(streams), label_fields(streams[0])


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
                _PositionedBatches(batches), batch_size=None, num_workers=workers, prefetch_factor=4
            )
            self.items = iter(loader)

    def __next__(self) -> PackedBatch:
        batch, self.position = next(self.items)
        return batch

    def state_dict(self) -> dict:
        return self.position


def _with_positions(batches: Batches) -> Iterator[tuple[PackedBatch, dict]]:
    for batch in batches:
        yield batch, batches.state_dict()


class _PositionedBatches(torch.utils.data.IterableDataset):
    def __init__(self, batches: Batches) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[PackedBatch, dict]]:
        return _with_positions(self.batches)


def summed_loss(model: nn.Module, batch: PackedBatch, task: str) -> torch.Tensor:
    """Sum (not mean) of the per-label losses of a micro-batch; the caller divides by the step's label count."""
    logits = model(**batch.model_inputs()).logits.float()
    labels = batch.labels.to(logits.device)
    if task == "sequence" and labels.is_floating_point():
        return F.mse_loss(logits.squeeze(-1), labels, reduction="sum")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def learning_rate_factor(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to 1, then linear or cosine decay to `min_lr_ratio` at `steps`."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    shape = 1 - progress if args.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * shape


# --------------------------------------------------------------------------------------------------------------
# One optimizer step
# --------------------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One step's numbers, left on the device (reading them would wait for the GPU) until they are logged.

    `sums` holds the global summed loss, label count and token count; `grad_norm` the global gradient norm."""

    sums: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    flops: float


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[PackedBatch],
    args: argparse.Namespace,
    world: Dist,
    config: NVEsmConfig,
) -> StepResult:
    """Forward/backward every micro-batch of the step, then clip and step. The loss is the global mean over the
    step's labels: each micro-batch's summed loss is divided by the label count of all ranks' micro-batches, and
    scaled by the world size because FSDP averages gradients over ranks. Nothing here waits for the GPU."""
    counts = [sum(b.num_labels for b in micro_batches), sum(b.num_tokens for b in micro_batches)]
    counts = to_device(torch.tensor(counts, dtype=torch.float64), world.device)
    dist.all_reduce(counts)
    scale = world.world_size / counts[0].clamp(min=1)
    loss_sum = torch.zeros(1, device=world.device, dtype=torch.float64)
    for index, batch in enumerate(micro_batches):
        model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        loss = summed_loss(model, batch.to(world.device), args.task)
        (loss * scale).backward()
        loss_sum += loss.detach()
    grad_norm = clip_gradients(model, args.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    lengths = [b.cu_seq_lens.diff().tolist() for b in micro_batches]  # CPU tensors: no sync
    shape = (config.hidden_size, config.num_hidden_layers, config.intermediate_size)
    step_flops = sum(flops.model_flops(*shape, ls, training=True) for ls in lengths)
    return StepResult(torch.cat([loss_sum, counts]), grad_norm, optimizer.param_groups[0]["lr"], step_flops)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm over all shards (clipped to `max_norm` unless 0), as a device tensor."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm > 0 else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# --------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first (an interrupted save leaves only a `.partial` folder)."""
    folder = out / "checkpoints"
    found = [p for p in folder.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and not p.name.endswith(".partial")]
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


def save_checkpoint(
    out: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: DataFeed,
    world: Dist,
    keep: int,
    run_info: dict,
) -> Path:
    """Sharded model + optimizer (DCP), every stream's position, every rank's RNG and FP8 scaling history; written
    to a `.partial` folder that is renamed when complete, so a kill mid-save never leaves a checkpoint that looks
    whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = out / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:07d}"
    partial = final.with_name(final.name + ".partial")
    if world.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
    streams: list[Any] = [None] * world.world_size
    dist.all_gather_object(streams, batches.state_dict())
    torch.save(rng_state(), partial / f"rng_rank{world.rank}.pt")
    scaling = fp8_scaling_state(model)
    if scaling:
        torch.save(scaling, partial / f"fp8_rank{world.rank}.pt")
    dist.barrier()
    if world.is_main:
        state = {"step": step, "world_size": world.world_size, "data": streams, "run": run_info}
        (partial / TRAIN_STATE).write_text(json.dumps(state, indent=1))
        partial.rename(final)
        for old in checkpoint_dirs(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def resume_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options that decide which data a step sees and its learning rate: a resume must not change them."""
    names = ("task", "seed", "token_budget", "max_length", "mask_prob", "grad_accum", "steps", "warmup_steps")
    names += ("lr", "min_lr_ratio", "decay")
    return {"data": [str(p) for p in args.data], **{name: getattr(args, name) for name in names}}


def load_checkpoint(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, world: Dist, run_info: dict
) -> int:
    """Restore the model, optimizer and data position that `save_checkpoint` wrote (the caller restores the RNG);
    returns the step it was taken after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = json.loads((folder / TRAIN_STATE).read_text())
    if state["world_size"] != world.world_size:
        raise ValueError(
            f"{folder} was written by {state['world_size']} ranks; resume it with the same number of ranks "
            f"(got {world.world_size})."
        )
    saved = state["run"]["settings"]
    changed = {k: (saved.get(k), v) for k, v in run_info["settings"].items() if saved.get(k) != v}
    if changed:
        listing = ", ".join(f"--{k.replace('_', '-')} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"--resume from {folder} with changed options ({listing}); resume with the same ones.")
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    batches.load_state_dict(state["data"][world.rank])
    scaling = folder / f"fp8_rank{world.rank}.pt"
    if scaling.exists():
        fp8_settings = ("layer_precision", "fp8_recipe")
        if all(state["run"]["config"].get(k) == run_info["config"].get(k) for k in fp8_settings):
            set_fp8_scaling_state(model, torch.load(scaling, weights_only=True))
        elif world.is_main:
            print(f"FP8 settings changed since {folder.name}: its FP8 scaling history is not restored.", flush=True)
    return state["step"]


def fp8_scaling_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Transformer Engine's per-module FP8 state (delayed scaling's amax history and scales; this rank's own,
    as amaxes are not reduced across ranks), serialised by TE as uint8 tensors; empty without FP8 state."""
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
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------------------
# Export: a consolidated Hub folder from a sharded checkpoint
# --------------------------------------------------------------------------------------------------------------


def export(checkpoint: Path, out: Path, force: bool = False) -> Path:
    """Write `out` in the converter's NVEsm layout (config, safetensors, tokenizer, remote code, LICENSE, card)
    from the model part of a DCP checkpoint. Runs in one process; needs CPU memory for the fp32 weights."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = json.loads((checkpoint / TRAIN_STATE).read_text())["run"]
    config, task = NVEsmConfig.from_dict(run["config"]), run["settings"]["task"]
    check_out(out, force)
    with staging_folder(out, force) as staging:
        consolidated = staging / "consolidated.pt"
        dcp_to_torch_save(checkpoint, consolidated)
        model_state = torch.load(consolidated, weights_only=False)["model"]
        consolidated.unlink()
        weights = export_weights(model_state, config, run["lora_alpha"])
        save_file(weights, staging / WEIGHTS_NAME, metadata={"format": "pt"})
        config_dict = nv_config_dict(config)
        # Inference defaults: whichever backend is there, no FP8 (training-time settings are in train_state.json).
        config_dict.update(architectures=[MODEL_CLASSES[task].__name__], backend="auto", layer_precision=None)
        config_dict["check_inputs"] = True
        config_dict["dtype"] = "float32"
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        write_esm_tokenizer(staging)
        copy_remote_code(staging)
        write_license(staging, with_code=True)
        (staging / "README.md").write_text(export_card(checkpoint, run, weights))
    return out


def export_weights(model_state: dict[str, Any], config: NVEsmConfig, lora_alpha: float) -> dict[str, torch.Tensor]:
    """Checkpoint names, contiguous fp32 tensors; LoRA adapters merged into the weights they adapt (W + alpha/r BA);
    the tied decoder weight and TE's `_extra_state` left out, as the converter writes them."""
    state = {canonical_name(k): v for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    for key in [k for k in state if ".lora_A." in k]:
        prefix, adapter = key.split(".lora_A.")
        down, up = state.pop(key).float(), state.pop(f"{prefix}.lora_B.{adapter}").float()
        state[f"{prefix}.weight"] = state[f"{prefix}.weight"].float() + lora_alpha / down.shape[0] * up @ down
    state = {k.replace(".modules_to_save.default.", "."): v for k, v in state.items() if ".original_module." not in k}
    tied = {"lm_head.decoder.weight"} if config.tie_word_embeddings else set()
    return {k: v.float().contiguous() for k, v in state.items() if not k.endswith("_extra_state") and k not in tied}


def export_card(checkpoint: Path, run: dict, weights: dict[str, torch.Tensor]) -> str:
    """A short model card: what was trained, from what, on what, for how long."""
    config, settings = run["config"], run["settings"]
    parameters = sum(t.numel() for t in weights.values())
    return f"""---
license: mit
library_name: transformers
pipeline_tag: {"fill-mask" if settings["task"] == "mlm" else "text-classification"}
tags: [esm, esm2, protein, biology, transformer-engine, nv-esm]
---

# NVEsm model trained with `recipes/train.py`

ESM-2-shaped protein language model ({parameters / 1e6:.1f}M parameters: {config["num_hidden_layers"]} layers,
hidden size {config["hidden_size"]}, {config["num_attention_heads"]} heads) exported from `{checkpoint.name}` of a
`recipes/train.py` run (task `{settings["task"]}`, started from `{run["start"]}`, data {settings["data"]},
{settings["steps"]} scheduled steps). Load it with

```python
from transformers import AutoModel
model = AutoModel.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
```

The weights are float32, in the nv-esm layout (`convert_checkpoint.py te-to-hf` turns them into a transformers
`EsmForMaskedLM` folder). Evaluate before use: this card records how the model was trained, not how well it works.
"""


# --------------------------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.jsonl (rank 0), a tqdm bar on rank 0, optional TensorBoard; peak GPU memory of every rank."""

    def __init__(self, out: Path, args: argparse.Namespace, world: Dist, first_step: int) -> None:
        from tqdm.auto import tqdm

        self.world = world
        self.peak = flops.peak_tflops(torch.cuda.get_device_name()) if world.device.type == "cuda" else None
        self.file = open(out / "metrics.jsonl", "a") if world.is_main else None  # noqa: SIM115
        self.bar = tqdm(
            total=args.steps, initial=first_step, disable=not world.is_main, unit="step", dynamic_ncols=True
        )
        self.tensorboard = None
        if args.tensorboard and world.is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(out / "tensorboard")

    def log(self, first_step: int, results: list[StepResult], started: float) -> None:
        """Write the steps `first_step`, `first_step + 1`, ... of `results`, launched since `started`
        (`time.perf_counter()`). One wait for the GPU per call; throughput is the interval's."""
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
            max_memory_gb=max(m.item() for m in memory),
            memory_gb_per_rank=[round(m.item(), 2) for m in memory],
            step_seconds=seconds / len(results),
        )
        self.bar.update(len(results))
        if not self.world.is_main:
            return
        for step, result, (loss_sum, labels, step_tokens, grad_norm) in zip(
            range(first_step, first_step + len(results)), results, values
        ):
            record = dict(step=step, loss=loss_sum / max(labels, 1), lr=result.lr, grad_norm=grad_norm)
            record.update(tokens=int(step_tokens), **interval)
            self.file.write(json.dumps(record) + "\n")
            if self.tensorboard is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.tensorboard.add_scalar(key, value, step)
        self.file.flush()
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{interval['tokens_per_s']:.0f}", refresh=False)

    def memory_gb(self) -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if self.world.device.type == "cuda" else 0.0

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


class StepProfiler:
    """torch.profiler over steps `first .. first + count - 1` (CPU ops and GPU kernels); each rank writes
    OUT/profile/rank{r}.json.gz (a Chrome/Perfetto trace; one `record_function` span per step)."""

    def __init__(self, out: Path, first: int, count: int, world: Dist) -> None:
        self.path = out / "profile" / f"rank{world.rank}.json.gz"
        self.first, self.last = first, first + count - 1
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


# --------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "grad_accum", "token_budget", "max_length", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
    if args.profile_steps and args.log_every + args.profile_steps > args.steps:
        raise ValueError("--profile-steps traces the steps after the first --log-every ones: raise --steps.")
    if args.warmup_steps >= args.steps:
        raise ValueError(f"--warmup-steps ({args.warmup_steps}) must be smaller than --steps ({args.steps}).")
    for path in args.data:
        if not Path(path).exists():
            raise FileNotFoundError(f"--data {path} does not exist.")


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


def train(args: argparse.Namespace) -> None:
    check_args(args)
    world = init_distributed()
    try:
        _train(args, world)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, world: Dist) -> None:
    out = Path(args.out)
    resume_from = prepare_out(out, args.resume, world)
    random.seed(args.seed + world.rank)
    torch.manual_seed(args.seed + world.rank)
    batches, labels = make_batches(args, world)
    config = model_config(args, world, labels)
    model = build_model(args, config, world)
    for name, parameter in model.named_parameters():
        if ".contact_head." in name:  # carried for the checkpoint, unused by these losses: no optimizer state
            parameter.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=args.lr,
        betas=tuple(args.betas),
        weight_decay=args.weight_decay,
        fused=world.device.type == "cuda",
    )
    run_info = dict(
        config=config.to_dict(),
        lora_alpha=args.lora_alpha,
        start=args.model or "scratch",
        settings=resume_settings(args),
    )
    step = load_checkpoint(resume_from, model, optimizer, batches, world, run_info) if resume_from else 0
    feed = DataFeed(batches, args.data_workers)  # before restoring the RNG: the DataLoader draws from it
    if resume_from:
        set_rng_state(torch.load(resume_from / f"rng_rank{world.rank}.pt", weights_only=False))
    last = min(args.steps, args.stop_at_step or args.steps)
    metrics = MetricsLog(out, args, world, step)
    profiler = StepProfiler(out, step + args.log_every, args.profile_steps, world)
    model.train()
    checkpoint = resume_from
    pending: list[StepResult] = []
    interval_start = time.perf_counter()
    while step < last:
        micro_batches = [next(feed) for _ in range(args.grad_accum)]
        for group in optimizer.param_groups:
            group["lr"] = args.lr * learning_rate_factor(step, args)
        with profiler.step(step):
            pending.append(train_step(model, optimizer, micro_batches, args, world, config))
        step += 1
        saving = not args.no_checkpoint and ((args.save_every and step % args.save_every == 0) or step == last)
        if step % args.log_every == 0 or step == last or saving:
            metrics.log(step - len(pending) + 1, pending, interval_start)
            pending = []
        if saving:
            checkpoint = save_checkpoint(out, step, model, optimizer, feed, world, args.keep, run_info)
        if not pending:
            interval_start = time.perf_counter()
    metrics.close()
    if world.is_main and step == args.steps and not args.no_export and checkpoint is not None:
        final = export(checkpoint, out / "final", force=True)
        print(f"exported {final}", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        parser = argparse.ArgumentParser(description="Write a Hub folder from a recipes/train.py checkpoint.")
        parser.add_argument("checkpoint", type=Path, help="OUT/checkpoints/step_NNNNNNN")
        parser.add_argument("out", type=Path)
        parser.add_argument("--force", action="store_true", help="replace a non-empty OUT")
        export_args = parser.parse_args(argv[1:])
        export(export_args.checkpoint, export_args.out, export_args.force)
        return
    train(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
