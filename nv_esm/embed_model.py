"""The model side of `nv-esm embed`: loading the checkpoint (`load_config`, `load_model`) and running it over the
proteins of one shard (`ShardEmbedder`), packed to a token budget, into the shard's tensors (see `nv_esm.embed`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import modeling_nv_esm
from configuration_nv_esm import fp8_layer_precision
from modeling_nv_esm_batch import length_sorted_batches, pack_proteins, pool_proteins, residue_token_mask
from modeling_nv_esm_plan import inference_autocast
from nv_esm.checkpoint_checks import check_checkpoint_tokens, check_finite, check_model_type, check_tensor_names
from nv_esm.checkpoint_io import checked_weight_files, read_json
from nv_esm.embed_plan import (
    COMMAND_FP8_RECIPE,
    SAVE_DTYPES,
    EmbedSettings,
    Piece,
    embedded_residues,
    pieces_of,
)
from nv_esm.hub_folder import remote_code_differences
from nv_esm.state_dict_mapping import is_contact_head


def load_config(checkpoint: str) -> Any:
    """The NVEsm config of `checkpoint`, read as data (config.json), after checking that its special-token ids,
    vocab.txt and tokenizer files are ESM-2's (`check_checkpoint_tokens`). ValueError naming the file for a folder
    without config.json, a config.json of a wrong field (a number written as a string, `mask_token_id` naming a
    residue), another vocabulary or special tokens; a transformers ESM-2 checkpoint is refused with the conversion
    command."""
    from transformers import PretrainedConfig

    from configuration_nv_esm import NVEsmConfig

    folder = Path(checkpoint).expanduser()
    looks_local = checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") > 1
    if looks_local and not folder.is_dir():
        raise ValueError(f"{checkpoint}: no such folder (a checkpoint is a local folder or a Hub id, org/name).")
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{checkpoint} holds no config.json: not a checkpoint folder (nv-esm convert hf-to-te SOURCE OUT "
                "writes one)."
            )
        config_dict = read_json(folder / "config.json")
    else:
        config_dict, _ = PretrainedConfig.get_config_dict(checkpoint)
    check_model_type(config_dict, checkpoint)
    try:
        config = NVEsmConfig.from_pretrained(checkpoint)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{Path(checkpoint) / 'config.json'}: {error}".splitlines()[0]) from None
    check_checkpoint_tokens(checkpoint, config)
    return config


def load_model(
    checkpoint: str,
    config: Any,
    backend: str,
    fp8: str,
    cuda_graphs: bool,
    device: torch.device,
    trust_remote_code: bool = False,
    masked_lm: bool = False,
    contacts: bool = True,
    progress: bool = True,
    fp8_scaling: str = COMMAND_FP8_RECIPE,
) -> torch.nn.Module:
    """The base model (`NVEsmModel`, contact head included; with `masked_lm`, `NVEsmForMaskedLM`) of `checkpoint` on
    `device` in eval mode: bf16 weights on CUDA, fp32 on the CPU. `backend` as `modeling_nv_esm.resolve_backend`
    gives it; `fp8` a `FP8_LAYER_CHOICES` mode, its layers scaled by `fp8_scaling` (an `FP8_SCALINGS` name). Without the
    data-dependent input checks, which wait for the device: the commands pack the inputs themselves from checked
    records. The installed package's model code runs the checkpoint's weights; the checkpoint's own code only with
    `trust_remote_code` and where it differs (`remote_code_differences`). A weight file that is not safetensors (cut
    off, garbage) is refused, naming it, and so are a folder's tensors that its config has no place for or gives
    another shape (`check_tensor_names`), a checkpoint without weights the model needs (`check_loaded_weights`: a
    classifier's has no LM head), which would otherwise run with random ones, and NaN or Inf weights
    (`check_finite`, on `device`: a few milliseconds on a GPU); `contacts`: whether the command uses the contact head
    (else it may be missing). `progress`: transformers' loading progress bar."""
    from safetensors import SafetensorError

    folder = Path(checkpoint).expanduser()
    if folder.is_dir():
        checked_weight_files(folder)  # a damaged file named, not a traceback
        check_tensor_names(folder, config)
    options = {
        "layer_precision": fp8_layer_precision(fp8, config.num_hidden_layers),
        "cuda_graphs": cuda_graphs,
        "check_inputs": False,
        "dtype": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "backend": backend,
        "fp8_recipe": fp8_scaling,
    }
    if not masked_lm:
        options["add_pooling_layer"] = False
    installed_class = modeling_nv_esm.NVEsmForMaskedLM if masked_lm else modeling_nv_esm.NVEsmModel
    differing = remote_code_differences(checkpoint)
    with transformers_progress(progress):
        try:
            if runs_checkpoint_code(differing, trust_remote_code):
                print(
                    f"running {checkpoint}'s own model code ({', '.join(differing)}: --trust-remote-code)",
                    file=sys.stderr,
                )
                # transformers' auto classes only here: importing them costs seconds (generation utilities)
                from transformers import AutoModel, AutoModelForMaskedLM

                auto_class = AutoModelForMaskedLM if masked_lm else AutoModel
                model, loading = auto_class.from_pretrained(
                    checkpoint, trust_remote_code=True, output_loading_info=True, **options
                )
            else:
                if differing:
                    print(
                        f"note: {checkpoint}'s {', '.join(differing)} differ from this nv-esm's; its weights run in "
                        "the installed model code (--trust-remote-code runs its own, for folders you trust)",
                        file=sys.stderr,
                    )
                model, loading = installed_class.from_pretrained(
                    checkpoint, use_safetensors=True, output_loading_info=True, **options
                )
        except SafetensorError as error:  # a Hub download's weights (a folder's are checked before)
            raise ValueError(f"{checkpoint}: a weight file is not readable safetensors ({error}).") from None
    check_loaded_weights(model, loading["missing_keys"], checkpoint, config, masked_lm, contacts)
    model = model.to(device).eval()
    check_finite([*model.named_parameters(), *model.named_buffers()], checkpoint)
    return model


def check_loaded_weights(
    model: torch.nn.Module, missing_keys: Any, checkpoint: str, config: Any, masked_lm: bool, contacts: bool
) -> None:
    """Refuse a model whose parameters the checkpoint did not all hold (`missing_keys`: transformers' loading
    info): transformers starts them at random values and only logs it. Buffers and TE's `_extra_state` are not
    weights; the contact head may be missing where the command does not use it (not `contacts`)."""
    parameters = {name for name, _ in model.named_parameters()}
    missing = sorted(name for name in set(missing_keys) & parameters if contacts or not is_contact_head(name))
    if not missing:
        return
    contact_head = {name for name in parameters if is_contact_head(name)}
    if set(missing) == contact_head:  # none of it, as in folders converted from NVIDIA's BioNeMo layout
        raise ValueError(
            f"{checkpoint} has no contact head ({', '.join(missing)}), which contacts need; folders converted from "
            "NVIDIA's BioNeMo layout (nv-esm convert bionemo-to-te) have none: leave out contacts."
        )
    listed = f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"
    problem = (
        f"{checkpoint} has no weights for {len(missing)} tensors the {type(model).__name__} needs ({listed}), which "
        "would run with random values"
    )
    kinds = getattr(config, "architectures", None) or ["no architectures named"]
    if masked_lm and "NVEsmForMaskedLM" not in kinds:
        raise ValueError(
            f"{problem}; its config names {', '.join(kinds)}: scoring needs a masked-LM checkpoint (NVEsmForMaskedLM)."
        )
    raise ValueError(f"{problem}: the checkpoint is incomplete; convert it again.")


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars (loading weights, downloads) on or off within the block."""
    import huggingface_hub.utils
    from transformers.utils import logging

    if enabled:
        yield
        return
    was_on, hub_was_on = logging.is_progress_bar_enabled(), not huggingface_hub.utils.are_progress_bars_disabled()
    logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
        if hub_was_on:
            huggingface_hub.utils.enable_progress_bars()


def runs_checkpoint_code(differing: list[str], trust_remote_code: bool) -> bool:
    """Whether `load_model` runs the checkpoint's own model code (`differing`: `remote_code_differences`' files):
    only with `trust_remote_code` and where it differs from the installed package's."""
    return bool(differing) and trust_remote_code


class ShardEmbedder:
    """Runs the model over the proteins of one shard, length-sorted and packed to a token budget.

    On CUDA nothing in the loop waits for the GPU but the results of the batch before: inputs go up from pinned
    memory and results come back into pinned memory without blocking, so the GPU runs batch k while the CPU packs
    batch k + 1 and files the results of batch k - 1 (the model is loaded without data-dependent input checks, which
    would wait for the GPU: the command builds the packed inputs itself).
    """

    def __init__(self, model: torch.nn.Module, settings: EmbedSettings, max_tokens: int) -> None:
        self.model = model
        self.settings = settings
        self.max_tokens = max_tokens
        self.device = model.embeddings.word_embeddings.weight.device
        self.last_layer = model.config.num_hidden_layers
        self.tokens = 0  # tokens run through the model so far

    def __call__(self, sequences: list[str], statuses: list[str], progress: Any) -> dict[str, torch.Tensor]:
        """The shard's tensors (see `nv_esm.embed`'s docstring) for `sequences` (all embedded; statuses say how)."""
        pieces = [
            piece
            for row, (sequence, status) in enumerate(zip(sequences, statuses))
            for piece in pieces_of(row, sequence, status, self.settings.max_length)
        ]
        lengths = [
            embedded_residues(len(sequence), status, self.settings.max_length)
            for sequence, status in zip(sequences, statuses)
        ]
        outputs = _ShardOutputs(lengths, statuses, self.settings, self.model.config.hidden_size)
        pieces_left = [0] * len(sequences)
        for piece in pieces:
            pieces_left[piece.row] += 1
        in_flight: _BatchResults | None = None
        for batch in length_sorted_batches([piece.tokens for piece in pieces], self.max_tokens):
            batch_pieces = [pieces[index] for index in batch]
            launched = self._launch(batch_pieces, outputs.needs_residues(batch_pieces))
            if in_flight is not None:
                progress.update(self._collect(in_flight, outputs, pieces_left))
            in_flight = launched
        if in_flight is not None:
            progress.update(self._collect(in_flight, outputs, pieces_left))
        return outputs.tensors()

    @torch.no_grad()
    def _launch(self, pieces: list[Piece], need_residues: bool) -> _BatchResults:
        """Queue one packed batch on the device; its results arrive in host memory once `ready` is reached."""
        packed = pack_proteins([piece.tokens for piece in pieces])
        num_tokens = packed["input_ids"].shape[1]
        self.tokens += num_tokens
        input_ids = self._upload(packed["input_ids"])
        cu_seq_lens = self._upload(packed["cu_seq_lens_q"])
        packing = {"cu_seq_lens_q": cu_seq_lens, "max_length_q": packed["max_length_q"]}
        residue_positions = None
        if need_residues:  # found on the CPU: a boolean index on the device would wait for it
            is_residue = residue_token_mask(packed["cu_seq_lens_q"], num_tokens)
            residue_positions = self._upload(is_residue.nonzero().squeeze(1))
        layers = self.settings.layers
        with self._autocast():
            output = self.model(input_ids, output_hidden_states=layers != (self.last_layer,), **packing)
            contacts = (
                self.model.predict_contacts(input_ids, **packing) if "contacts" in self.settings.include else None
            )
        results = _BatchResults(pieces)
        for layer in layers:
            states = (output.last_hidden_state if output.hidden_states is None else output.hidden_states[layer])[0]
            states = states.float()
            results.cls[layer] = self._download(pool_proteins(states, cu_seq_lens, "cls"))
            results.mean[layer] = self._download(pool_proteins(states, cu_seq_lens, "mean"))
            if residue_positions is not None:
                results.residues[layer] = self._download(states.index_select(0, residue_positions))
        if contacts is not None:
            results.contacts = self._download(contacts.float())
        if self.device.type == "cuda":
            results.ready = torch.cuda.Event()
            results.ready.record()
        return results

    def _collect(self, results: _BatchResults, outputs: _ShardOutputs, pieces_left: list[int]) -> int:
        """File a launched batch's results (waiting for them if needed); the number of proteins it finished."""
        if results.ready is not None:
            results.ready.synchronize()
        for layer in self.settings.layers:
            residues = results.residues.get(layer)
            if residues is not None and residues.is_pinned():  # the shard keeps views of them: leave the pinned
                residues = residues.clone()  # buffer to the allocator's cache (the rest is copied out by `add`)
            outputs.add(layer, results.pieces, results.cls[layer], results.mean[layer], residues)
        if results.contacts is not None:
            outputs.add_contacts(results.pieces, results.contacts)
        finished = 0
        for piece in results.pieces:  # a protein is done when its last piece (window) is
            pieces_left[piece.row] -= 1
            finished += pieces_left[piece.row] == 0
        return finished

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def _download(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_host(tensor)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return inference_autocast(self.device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`; to CUDA from pinned memory without waiting for the copy."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU; from CUDA into pinned memory without waiting (valid once the device reaches the copy:
    record a `torch.cuda.Event` after it and synchronize on that before reading)."""
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass
class _BatchResults:
    """One launched batch's per-layer results in host memory (complete once the `ready` event is reached)."""

    pieces: list[Piece]
    cls: dict[int, torch.Tensor] = field(default_factory=dict)  # [n, hidden]
    mean: dict[int, torch.Tensor] = field(default_factory=dict)  # [n, hidden]
    residues: dict[int, torch.Tensor] = field(default_factory=dict)  # [residues of the batch, hidden]
    contacts: torch.Tensor | None = None  # [n, L - 2, L - 2]
    ready: Any = None  # torch.cuda.Event on CUDA


class _ShardOutputs:
    """Per-protein results of a shard, filled piece by piece; windows are averaged residue by residue."""

    def __init__(self, lengths: list[int], statuses: list[str], settings: EmbedSettings, hidden: int) -> None:
        self.lengths = lengths
        self.statuses = statuses
        self.settings = settings
        count = len(lengths)
        self.cls = {layer: torch.zeros(count, hidden) for layer in settings.layers}
        self.mean = {layer: torch.zeros(count, hidden) for layer in settings.layers}
        self.residues: dict[int, list[torch.Tensor | None]] = {layer: [None] * count for layer in settings.layers}
        self.windows = [0] * count
        self.coverage: list[torch.Tensor | None] = [None] * count
        self.contacts: list[torch.Tensor | None] = [None] * count

    def needs_residues(self, pieces: list[Piece]) -> bool:
        """Whether a batch of `pieces` needs its residue states: per-residue outputs, or windows to stitch."""
        return "per_residue" in self.settings.include or any(self.statuses[p.row] == "windowed" for p in pieces)

    def add(
        self, layer: int, pieces: list[Piece], cls: torch.Tensor, mean: torch.Tensor, residues: torch.Tensor | None
    ) -> None:
        offset = 0
        for index, piece in enumerate(pieces):
            count = len(piece.tokens) - 2
            self.cls[layer][piece.row] += cls[index]
            if self.statuses[piece.row] != "windowed":
                self.mean[layer][piece.row] = mean[index]
                if "per_residue" in self.settings.include:
                    self.residues[layer][piece.row] = residues[offset : offset + count]
            else:
                total = self.residues[layer][piece.row]
                if total is None:
                    total = self.residues[layer][piece.row] = torch.zeros(self.lengths[piece.row], cls.shape[1])
                total[piece.start : piece.start + count] += residues[offset : offset + count]
                if layer == self.settings.layers[0]:
                    self.windows[piece.row] += 1
                    if self.coverage[piece.row] is None:
                        self.coverage[piece.row] = torch.zeros(self.lengths[piece.row])
                    self.coverage[piece.row][piece.start : piece.start + count] += 1
            offset += count

    def add_contacts(self, pieces: list[Piece], contacts: torch.Tensor) -> None:
        for index, piece in enumerate(pieces):
            count = len(piece.tokens) - 2
            self.contacts[piece.row] = contacts[index, :count, :count].clone()

    def tensors(self) -> dict[str, torch.Tensor]:
        dtype = SAVE_DTYPES[self.settings.save_dtype]
        for row, status in enumerate(self.statuses):
            if status == "windowed":  # residues: mean over the windows holding each; cls: mean over windows
                for layer in self.settings.layers:
                    self.residues[layer][row] /= self.coverage[row][:, None]
                    self.mean[layer][row] = self.residues[layer][row].mean(0)
                    self.cls[layer][row] /= self.windows[row]
        result: dict[str, torch.Tensor] = {}
        for layer in self.settings.layers:
            if "mean" in self.settings.include:
                result[f"mean.layer_{layer}"] = self.mean[layer].to(dtype)
            if "cls" in self.settings.include:
                result[f"cls.layer_{layer}"] = self.cls[layer].to(dtype)
            if "per_residue" in self.settings.include:
                result[f"per_residue.layer_{layer}"] = _cat(self.residues[layer], (0, self.cls[layer].shape[1]), dtype)
        if "per_residue" in self.settings.include:
            result["residue_offsets"] = _offsets(self.lengths)
        if "contacts" in self.settings.include:
            result["contacts"] = _cat([contacts.flatten() for contacts in self.contacts], (0,), dtype)
            result["contact_offsets"] = _offsets([length * length for length in self.lengths])
        return result


def _cat(tensors: list[torch.Tensor], empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(tensors).to(dtype) if tensors else torch.zeros(empty_shape, dtype=dtype)


def _offsets(counts: Sequence[int]) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
