"""The model of a run: its config, a meta-device build, and per-rank materialisation of its FSDP2 shards.

The model is built on the meta device (no memory), prepared by `nv_esm.train.parallel.parallelize` (FSDP2 and
friends), then each rank fills only its own rows of every parameter: read from a converted checkpoint's
safetensors row slices (`--model`), or drawn fresh (`--config`, or tensors the checkpoint lacks, such as a new
head or LoRA adapters) from one seeded generator per tensor, so every world size starts from the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from configuration_nv_esm import NVEsmConfig, fp8_layer_precision
from modeling_nv_esm import (
    NVEsmForMaskedLM,
    NVEsmForSequenceClassification,
    NVEsmForTokenClassification,
    NVEsmRotaryEmbedding,
    initial_value,
    resolve_backend,
)
from modeling_nv_esm_parallel import tensor_parallel_part, tensor_parallel_whole_shape
from nv_esm.checkpoint_checks import check_checkpoint_tokens, check_finite, check_model_type
from nv_esm.checkpoint_io import checked_weight_files, format_bytes
from nv_esm.state_dict_mapping import CONTACT_HEAD_TENSORS
from nv_esm.train.config import ModelConfig, TrainConfig
from nv_esm.train.lora import add_lora
from nv_esm.train.parallel import Dist, compute_dtype, parallelize, sharded

MODEL_CLASSES = {
    "mlm": NVEsmForMaskedLM,
    "token": NVEsmForTokenClassification,
    "sequence": NVEsmForSequenceClassification,
}


def model_config(settings: ModelConfig, labels: dict[str, Any], device: torch.device, max_length: int) -> NVEsmConfig:
    """The NVEsm config of the run: the source's architecture, the layer backend for `device` (`auto`: TE on GPU
    when it is installed), packed (THD) inputs, FP8 layers, the classification `labels` fields (`label_fields`), and
    a `max_protein_length` (a load-time limit) that accepts the run's longest crop, `max_length` tokens: a protein the
    recipe was told to crop to N residues is never refused by the model's guard."""
    source = settings.source
    path = source / "config.json" if source.is_dir() else source
    try:
        fields = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not JSON ({error}).") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds a JSON {type(fields).__name__}, not a config's fields.")
    check_model_type(fields, source)
    for key in ("auto_map", "architectures", "dtype", "torch_dtype", "transformers_version", "model_type"):
        fields.pop(key, None)
    try:  # the architecture's own checks first: e.g. "hidden_size": "64" is refused, naming the file
        num_layers = NVEsmConfig(**fields).num_hidden_layers
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}".removesuffix(".") + ".") from None
    backend = resolve_backend(settings.backend, device).name
    fields.update(
        backend=backend, attn_input_format="thd", layer_precision=fp8_layer_precision(settings.fp8, num_layers)
    )
    # The recipe's own packer makes valid batches: skip the model's input checks (each would wait for the GPU).
    fields.update(fp8_recipe=settings.fp8_recipe, check_inputs=False, cuda_graphs=settings.cuda_graphs)
    fields.update(labels)
    fields.update(max_protein_length=max(NVEsmConfig().max_protein_length, max_length))
    return NVEsmConfig(**fields)


def activation_bytes_per_token(config: TrainConfig, nv_config: NVEsmConfig, device: torch.device) -> int:
    """A lower bound of the bytes that a token of a micro-batch on `device` keeps for the backward: in each layer
    its two layer norms' inputs and outputs, q, k, v and the attention output (7 x hidden values) and the MLP's
    two hidden activations (2 x intermediate; 6 x hidden in all with --recompute-mlp), in the compute dtype (1
    byte with --fp8), over the `--tp` x `--cp` ranks that share a token (each layer's input only, and one layer's
    whole set, with --activation-checkpointing; with --offload-activations, the whole set of the layers not
    offloaded and the input of the others); and for MLM the fp32 logits, their log-softmax and its gradient (3 x
    vocabulary)."""
    hidden, layers = nv_config.hidden_size, nv_config.num_hidden_layers
    parallel = config.parallel
    # with --recompute-mlp, the MLP keeps its input only (its LayerNorm output and two activations are recomputed)
    one_layer = 6 * hidden if parallel.recompute_mlp else 7 * hidden + 2 * nv_config.intermediate_size
    values = one_layer * layers
    if parallel.activation_checkpointing:
        values = hidden * layers + one_layer
    elif parallel.offload_activations:
        offloaded = parallel.offloaded_layers or layers - 1
        values = hidden * offloaded + one_layer * (layers - offloaded)
    itemsize = 1 if config.model.fp8 != "off" else compute_dtype(parallel, device).itemsize
    logits = 3 * nv_config.vocab_size * 4 if config.model.task == "mlm" else 0
    return (values * itemsize + logits) // (parallel.tp * parallel.cp)


def device_memory(device: torch.device) -> int:
    """The bytes of `device`: a GPU's memory, or the host's physical memory shared by the ranks on the host."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_here


def check_token_budget(config: TrainConfig, nv_config: NVEsmConfig, world: Dist) -> None:
    """ValueError, before the model is built, when `--tokens-per-batch` tokens keep more activations for the backward
    than the device has memory (`activation_bytes_per_token`: a lower bound, so a budget it lets through may still
    not fit)."""
    budget, per_token = config.data.token_budget, activation_bytes_per_token(config, nv_config, world.device)
    memory = device_memory(world.device)
    if budget * per_token > memory:
        raise ValueError(
            f"--tokens-per-batch {budget}: a micro-batch keeps at least {format_bytes(budget * per_token)} of "
            f"activations for its backward ({format_bytes(per_token)} a token), more than the {format_bytes(memory)} "
            f"of {world.device}; lower --tokens-per-batch (below {memory // per_token}), or use "
            "--activation-checkpointing."
        )


# `--data-parallel auto` replicates the model when its training state and a micro-batch's activations (lower bounds)
# take at most this fraction of a device: the rest is for what the bounds leave out (workspaces, CUDA graphs' pools).
REPLICATE_MEMORY_FRACTION = 0.8
# Bytes a trained parameter holds on a rank with a whole model: fp32 weight and gradient, AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 16


def training_state_bytes(nv_config: NVEsmConfig) -> int:
    """About what a whole model's training state takes (`STATE_BYTES_PER_PARAMETER` per parameter): the layers'
    attention and MLP weights and the (padded) embedding, whose decoder is tied to it, plus the LM head's dense."""
    hidden, layers = nv_config.hidden_size, nv_config.num_hidden_layers
    parameters = layers * (4 * hidden * hidden + 2 * hidden * nv_config.intermediate_size)
    parameters += nv_config.padded_vocab_size * hidden + hidden * hidden
    return STATE_BYTES_PER_PARAMETER * parameters


def data_parallel_layout(config: TrainConfig, nv_config: NVEsmConfig, world: Dist) -> Dist:
    """`world` with the run's data-parallel layout decided (`Dist.replicated`): whole models on every rank for
    `--data-parallel replicate`, or for `auto` when the training state and a micro-batch's activations fit in
    `REPLICATE_MEMORY_FRACTION` of a device and no option of FSDP2's is given (`ParallelConfig.sharding_options`;
    --cp ranks hold whole weights either way); else FSDP2 shards. One rank is neither."""
    mode = config.parallel.data_parallel
    if world.world_size == 1 or mode == "shard":
        return dataclasses.replace(world, replicated=False)
    if mode == "replicate":
        return dataclasses.replace(world, replicated=True)
    activations = config.data.token_budget * activation_bytes_per_token(config, nv_config, world.device)
    fits = training_state_bytes(nv_config) + activations <= REPLICATE_MEMORY_FRACTION * device_memory(world.device)
    return dataclasses.replace(world, replicated=fits and not config.parallel.sharding_options())


def build_model(config: TrainConfig, nv_config: NVEsmConfig, world: Dist) -> nn.Module:
    """The model of `nv_config` for `config.model.task` (with LoRA adapters if asked), parallelized
    (`parallelize`: FSDP2 and the rest) and materialised on `world.device`, one shard per rank. `--recompute-mlp`
    and `--offload-activations` are the model's load-time options, which its layers read when they are built.
    Ranks holding whole models average `.grad` after the step's backwards (`complete_gradients`) and tell the model
    so (`reduce_gradients_after_backward`): their training forwards may replay CUDA graphs."""
    nv_config.recompute_mlp = config.parallel.recompute_mlp
    if config.parallel.offload_activations:
        offload_activations(nv_config, config.parallel.offloaded_layers, world.device)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model.task](nv_config)
    model.reduce_gradients_after_backward(world.replicated)
    if config.model.lora_rank:
        model = add_lora(model, config.model)
    parallelize(model, config.parallel, world, nv_config.backend)
    model.to_empty(device=world.device)
    if not sharded(world):  # `to_empty` gave the tied decoder its own tensor (FSDP2 keeps it shared)
        model.tie_weights()
    source = CheckpointReader(Path(config.model.init_from), nv_config) if config.model.init_from else None
    if source is not None:
        check_checkpoint_shapes(model, source, world)
    materialise(model, nv_config, source, config.seed, world)
    return model


def offload_activations(nv_config: NVEsmConfig, offloaded_layers: int, device: torch.device) -> None:
    """`--offload-activations` (`--offloaded-layers`, 0: every layer but the last) as the model's load-time options
    `offload_activations` and `offloaded_layers`. ValueError naming the option where it cannot run."""
    layers = nv_config.num_hidden_layers
    if offloaded_layers >= layers:
        raise ValueError(
            f"--offloaded-layers {offloaded_layers}: this model has {layers} layers, and the last one is never "
            f"offloaded (at most {layers - 1})."
        )
    if device.type != "cuda":
        raise ValueError("--offload-activations moves activations from GPU to host memory: it needs GPUs.")
    nv_config.offload_activations = True
    nv_config.offloaded_layers = offloaded_layers or None


def whole_shape(name: str, tensor: torch.Tensor, world: Dist) -> tuple[int, ...]:
    """The shape of parameter `name` in a checkpoint: `tensor`'s whole shape (an FSDP2 shard's `shape` is the whole
    one), of the whole parameter with `--tp` (`tensor_parallel_whole_shape`)."""
    return tensor_parallel_whole_shape(name, tuple(tensor.shape), world.tp_size)


def check_checkpoint_shapes(model: nn.Module, source: CheckpointReader, world: Dist) -> None:
    """Refuse (one-line ValueError naming the checkpoint) a `--model` checkpoint whose config.json disagrees with
    its weights, before any is read: a tensor whose shape is not that of the model built from the config (a width,
    or `num_attention_heads`, which sets the rotary table's size), or base-model tensors (`esm.*`) the model has no
    place for (more layers than the config says). Too few layers are refused by `check_fresh_weights`."""
    expected = {canonical_name(name): whole_shape(name, tensor, world) for name, tensor in model.named_parameters()}
    expected.update({canonical_name(name): tuple(buffer.shape) for name, buffer in model.named_buffers()})
    wrong = [
        f"{name} is {list(stored)} there, {list(shape)} for its config"
        for name, shape in expected.items()
        if (stored := source.shape(name)) is not None and stored != shape
    ]
    unplaced = [name for name in source.where if name.startswith("esm.") and name not in expected]
    if not wrong and not unplaced:
        return
    problems = wrong[:2]
    if unplaced:
        listed = ", ".join(unplaced[:2]) + (", ..." if len(unplaced) > 2 else "")
        problems.append(f"{len(unplaced)} tensors have no place in the model of its config ({listed})")
    more = f" (and {len(wrong) - 2} more shapes)" if len(wrong) > 2 else ""
    raise ValueError(
        f"{source.folder}: its config.json disagrees with its weights: {'; '.join(problems)}{more}. Fix config.json "
        "(num_hidden_layers, hidden_size, num_attention_heads, ...) or convert the checkpoint again."
    )


class CheckpointReader:
    """Row ranges of the tensors of an NVEsm checkpoint folder (single or sharded safetensors), read lazily. A
    folder whose weight files are damaged (`checked_weight_files`), whose config.json, vocab.txt or tokenizer files
    name other tokens than ESM-2's for a model of `config` (`check_checkpoint_tokens`: the recipe tokenizes with
    ESM-2's ids), or whose rows hold NaN or Inf (`check_finite`, as they are read) is refused (ValueError)."""

    def __init__(self, folder: Path, config: NVEsmConfig) -> None:
        from safetensors import safe_open

        check_checkpoint_tokens(folder, config)
        self.folder = folder
        self.handles = [safe_open(path, framework="pt") for path in checked_weight_files(folder)]
        self.where = {key: handle for handle in self.handles for key in handle.keys()}

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of tensor `name`, or None when the checkpoint does not hold it."""
        handle = self.where.get(name)
        return None if handle is None else tuple(handle.get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int | None, columns: slice | None = None) -> torch.Tensor | None:
        """Rows `start:stop` (dim 0) of tensor `name`, only `columns` of them if given, or None when the checkpoint
        does not hold it."""
        handle = self.where.get(name)
        if handle is None:
            return None
        tensor = handle.get_slice(name)
        rows = tensor[start:stop] if columns is None else tensor[start:stop, columns]
        check_finite([(name, rows)], self.folder)
        return rows


def canonical_name(name: str) -> str:
    """The checkpoint key of a model parameter: without PEFT's wrapping."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def materialise(model: nn.Module, config: NVEsmConfig, source: CheckpointReader | None, seed: int, world: Dist) -> None:
    """Fill every parameter shard and buffer, from `source` where it has the tensor, else a fresh initialisation.

    A fresh tensor is drawn whole (on the device, one at a time) from a generator seeded by `seed` and the
    parameter's index, then cut to this rank's rows, so the weights do not depend on the world size. With `--tp`,
    a split parameter's rank part (`tensor_parallel_part`) is this rank's rows or columns of the whole one."""
    loaded, fresh = 0, []
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.named_parameters()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local is tensor:  # not sharded
                start = 0
            else:
                shard, shards = world.shard_position
                start = shard * math.ceil(tensor.shape[0] / shards)
            stop = min(start + local.shape[0], tensor.shape[0])
            whole, columns = whole_shape(name, tensor, world), None
            part = tensor_parallel_part(name, whole, world.tp_size, world.tp_rank)
            if part is not None:  # this rank's part of the whole parameter: its rows, or its columns
                if part[0] == 0:
                    start, stop = start + part[1].start, stop + part[1].start
                else:
                    columns = part[1]
            rows = source.rows(canonical_name(name), start, stop, columns) if source is not None else None
            if rows is None:
                fresh.append(name)
                generator = torch.Generator(device=world.device).manual_seed(seed * 100_003 + index)
                owner = model.get_submodule(name.rpartition(".")[0])
                drawn = initial_value(name, owner, whole, config, generator, world.device)
                rows = drawn[start:stop] if columns is None else drawn[start:stop, columns]
            else:
                loaded += 1
            local[: stop - start].copy_(rows)
        for module in model.modules():
            if isinstance(module, NVEsmRotaryEmbedding):
                stored = source.rows("esm.rotary_embeddings.inv_freq", 0, None) if source is not None else None
                module.inv_freq = (stored if stored is not None else module.default_inv_freq(config)).to(world.device)
    if source is not None:
        check_fresh_weights(fresh, source.folder)
    if world.is_main:
        print(weights_line(loaded, [canonical_name(name) for name in fresh], source is not None), flush=True)
        if source is not None and CONTACT_HEAD_TENSORS <= set(map(canonical_name, fresh)):
            print(
                f"note: {source.folder} has no contact head (NVIDIA's BioNeMo layout has none): it starts at random "
                "and is not trained, so the exported model's contact maps mean nothing",
                flush=True,
            )


FRESH_SHOWN = 6  # fresh tensors the weights line names


def weights_line(loaded: int, fresh: list[str], from_checkpoint: bool) -> str:
    """Where the weights came from, in words: all from the checkpoint, all fresh (a run from scratch), or how many
    of each, naming the first `FRESH_SHOWN` fresh tensors (", ..." when there are more)."""
    if not fresh:
        return f"weights: all {loaded} tensors from the checkpoint"
    if not loaded:
        reason = "the checkpoint holds none of them" if from_checkpoint else "training from scratch"
        return f"weights: all {len(fresh)} tensors initialised fresh ({reason})"
    listed = ", ".join(fresh[:FRESH_SHOWN]) + (", ..." if len(fresh) > FRESH_SHOWN else "")
    return f"weights: {loaded} tensors from the checkpoint, {len(fresh)} initialised fresh: {listed}"


def check_fresh_weights(fresh: list[str], folder: Path) -> None:
    """Refuse a `--model` checkpoint that lacks weights of the base model (`fresh`: the parameters it did not hold):
    they would start from random values (the contact head, which training leaves as it is, would be exported so).
    New heads (a classifier, an LM head) and LoRA adapters start fresh by design, and so does a contact head that the
    checkpoint lacks as a whole (a folder converted from NVIDIA's BioNeMo layout: `materialise` says so)."""
    names = list(map(canonical_name, fresh))
    if CONTACT_HEAD_TENSORS <= set(names):
        names = [name for name in names if name not in CONTACT_HEAD_TENSORS]
    encoder = [name for name in names if name.startswith("esm.") and "lora_" not in name]
    if encoder:
        listed = f"{', '.join(encoder[:3])}{', ...' if len(encoder) > 3 else ''}"
        raise ValueError(
            f"{folder} has no weights for {len(encoder)} tensors of the base model ({listed}), which would start from "
            "random values: the checkpoint is incomplete; convert it again."
        )
