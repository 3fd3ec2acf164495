"""NVEsm's inputs: the protein rule, packing (`PackedSequences`), input checks with one device sync, the input batch
(`InputBatch`: padded or packed inputs, the layout the layers run in and back) and the per-protein helpers.

Part of the model's Hub remote code (a flat sibling of `modeling_nv_esm.py`): imports only `configuration_nv_esm`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import logging

try:
    from .configuration_nv_esm import NVEsmConfig
except ImportError:  # imported as top-level modules (tests, scripts) rather than as Hub remote code
    from configuration_nv_esm import NVEsmConfig

logger = logging.get_logger(__name__)

# FP8 GEMMs need the number of rows (tokens) to be a multiple of this.
FP8_TOKEN_MULTIPLE = 16


# Keywords that transformers' ESM forwards accept beyond the ones NVEsm names, with what NVEsm does with them.
IGNORED_INPUTS = {  # accepted and unused, as in transformers
    "seq_idx",  # from DataCollatorWithFlattening; cu_seq_lens carries the same
    "num_items_in_batch",  # Trainer's loss normaliser; ESM's loss is the mean over labelled tokens
}


UNSUPPORTED_INPUTS = {  # accepted only at the value that asks for nothing (None or False), else a ValueError
    "encoder_hidden_states": "ESM-2 has no cross-attention",
    "encoder_attention_mask": "ESM-2 has no cross-attention",
    "head_mask": "NVEsm runs fused attention, which takes no per-head mask",
    "is_causal": "ESM-2 attends in both directions",
    "output_router_logits": "ESM-2 has no mixture of experts",
}


# ESM-2's residue letters (the 20 standard amino acids, then X B U Z O), in the order of its vocabulary. Every
# reader of proteins in nv-esm applies `protein_residues`: `NVEsmModel.embed`, `nv-esm embed` and `nv-esm train`.
RESIDUE_LETTERS = "LAGVSERTIDPKQNFYMHWCXBUZO"


STOP_MARK = "*"


_RESIDUE_CASES = {ord(letter): None for letter in RESIDUE_LETTERS + RESIDUE_LETTERS.lower()}


_HINTS = {
    STOP_MARK: " (a stop codon's mark: remove it, or strip it with strip_stop=True / --strip-stop)",
    "-": " (an alignment gap)",
    ".": " (an alignment gap)",
}


def protein_residues(sequence: object, name: str, strip_stop: bool = False) -> str:
    """`sequence` as ESM-2 reads it: its residue letters (`RESIDUE_LETTERS`, either case) upper-cased, and with
    `strip_stop` one trailing `*` removed. ValueError naming `name` for anything else: not a `str`, no residues, or
    a character outside the letters (with its 1-based position), so that no protein silently becomes `<unk>`s."""
    if not isinstance(sequence, str):
        raise ValueError(f"{name} is a {type(sequence).__name__}, not a string of residue letters.")
    if strip_stop and sequence.endswith(STOP_MARK):
        sequence = sequence[:-1]
    if not sequence:
        raise ValueError(f"{name} has no residues.")
    if sequence.translate(_RESIDUE_CASES):
        position, char = next((i, c) for i, c in enumerate(sequence) if ord(c) not in _RESIDUE_CASES)
        raise ValueError(
            f"{name}: {char!r} at residue {position + 1} is not a letter of ESM-2's alphabet{_HINTS.get(char, '')}."
        )
    return sequence.upper()


class PackedSequences:
    """Where the tokens of N proteins lie when packed (THD) and in a padded view `[B, S]` of them.

    The padded view is either the layout a padded input came in (`from_attention_mask`: any padding on the left
    and/or right of each row) or the right-padded `[N, max_length]` layout (`right_padded`), in which the PyTorch
    attention and padded (BSHD) layers run.

    Attributes:
        cu_seq_lens: `[N + 1]` int32; protein i is packed tokens `cu_seq_lens[i]:cu_seq_lens[i + 1]`.
        max_length: Length of the longest protein (or more), in tokens.
        num_tokens: T, the number of packed tokens.
        padded_shape: `(B, S)` of the padded view.
    """

    def __init__(
        self,
        cu_seq_lens: torch.Tensor,
        max_length: int,
        num_tokens: int,
        padded_shape: tuple[int, int],
        token_index: torch.Tensor | None = None,
        sequence_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        self.cu_seq_lens = cu_seq_lens
        self.max_length = max_length
        self.num_tokens = num_tokens
        self.padded_shape = padded_shape
        # the per-token indices, each computed once (on first use, or given by whoever computed it already)
        self._token_index, self._sequence_index, self._positions = token_index, sequence_index, positions

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor, max_length: int) -> PackedSequences:
        """Describe the tokens that `attention_mask [B, S]` keeps (1 = token, 0 = padding) in that layout."""
        lengths = attention_mask.sum(dim=1, dtype=torch.int32)
        cu_seq_lens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        token_index = attention_mask.flatten().nonzero().squeeze(1)
        return cls(cu_seq_lens, max_length, token_index.numel(), tuple(attention_mask.shape), token_index)

    @classmethod
    def right_padded(
        cls,
        cu_seq_lens: torch.Tensor,
        max_length: int,
        num_tokens: int,
        sequence_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> PackedSequences:
        """Describe packed proteins whose padded view is `[N, max_length]`, each protein at the start of its row
        (`sequence_index`, `positions`: the per-token indices, where the caller has computed them)."""
        shape = (cu_seq_lens.numel() - 1, max_length)
        return cls(cu_seq_lens.to(torch.int32), max_length, num_tokens, shape, None, sequence_index, positions)

    @property
    def token_index(self) -> torch.Tensor:
        """`[T]` int64; index of each packed token in the flattened padded view `[B * S]` (computed on first use)."""
        if self._token_index is None:
            self._token_index = self.sequence_index * self.max_length + self.positions
        return self._token_index

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` tokens per protein."""
        return self.cu_seq_lens.diff()

    @property
    def sequence_index(self) -> torch.Tensor:
        """`[T]` the protein each packed token belongs to (computed on first use)."""
        if self._sequence_index is None:
            if self._token_index is not None:  # a padded input's layout: its row
                self._sequence_index = self._token_index // self.padded_shape[1]
            else:
                self._sequence_index = sequence_index_of_tokens(self.cu_seq_lens, self.num_tokens)
        return self._sequence_index

    def computed_indices(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(`sequence_index`, `positions`) where both are computed already, else None; computes nothing."""
        if self._sequence_index is None or self._positions is None:
            return None
        return self._sequence_index, self._positions

    @property
    def positions(self) -> torch.Tensor:
        """`[T]` each packed token's position in its protein, 0 at its first token (computed on first use)."""
        if self._positions is None:
            self._positions = positions_in_proteins(self.cu_seq_lens, self.num_tokens, self.sequence_index)
        return self._positions

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """`[B, S, ...]` -> `[T, ...]`, keeping only the tokens."""
        return padded.flatten(0, 1).index_select(0, self.token_index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> `[B, S, ...]`, zeros at padding."""
        batch, length = self.padded_shape
        flat = packed.new_zeros(batch * length, *packed.shape[1:])
        return flat.index_copy(0, self.token_index, packed).view(batch, length, *packed.shape[1:])

    def key_mask(self) -> torch.Tensor:
        """`[N, max_length]` bool, True where the right-padded view holds a token."""
        positions = torch.arange(self.max_length, device=self.cu_seq_lens.device)
        return positions < self.lengths[:, None]


def pack_proteins(
    proteins: Sequence[torch.Tensor | Sequence[int]], labels: Sequence[torch.Tensor | Sequence[int]] | None = None
) -> dict[str, Any]:
    """Packed (THD) model inputs for N proteins' token ids (1-D tensors or int lists, `<cls>`/`<eos>` included).

    Returns the keyword arguments of the packed forward, as `DataCollatorWithFlattening(return_flash_attn_kwargs=
    True)` gives them: `input_ids [1, T]` int64, `position_ids [1, T]` (restarting at 0 for each protein),
    `cu_seq_lens_q`/`cu_seq_lens_k [N + 1]` int32, `max_length_q`/`max_length_k` (longest protein, int), and with
    per-token `labels` (one sequence per protein, same lengths) `labels [1, T]` int64. Tensors are on the CPU.
    """
    if not proteins:
        raise ValueError("pack_proteins needs at least one protein.")
    ids = [torch.as_tensor(protein, dtype=torch.int64).reshape(-1) for protein in proteins]
    lengths = torch.tensor([len(protein) for protein in ids])
    if (lengths == 0).any():
        raise ValueError(f"protein {int((lengths == 0).nonzero()[0])} has no tokens.")
    cu_seq_lens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    max_length = int(lengths.max())
    inputs = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat([torch.arange(length) for length in lengths.tolist()])[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    if labels is not None:
        label_ids = [torch.as_tensor(label, dtype=torch.int64).reshape(-1) for label in labels]
        if [len(label) for label in label_ids] != lengths.tolist():
            raise ValueError("labels must hold one label per token of each protein.")
        inputs["labels"] = torch.cat(label_ids)[None]
    return inputs


def sequence_index_of_tokens(cu_seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[T]` index of the protein that each of `num_tokens` packed tokens belongs to."""
    boundaries = cu_seq_lens[1:-1].contiguous()
    return torch.bucketize(torch.arange(num_tokens, device=cu_seq_lens.device), boundaries, right=True)


def positions_in_proteins(
    cu_seq_lens: torch.Tensor, num_tokens: int, sequence_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`[T]` each of `num_tokens` packed tokens' position in its protein: the one place that computes it.
    `sequence_index` (`sequence_index_of_tokens`), if the caller has it already."""
    if sequence_index is None:
        sequence_index = sequence_index_of_tokens(cu_seq_lens, num_tokens)
    return torch.arange(num_tokens, device=cu_seq_lens.device) - cu_seq_lens[sequence_index]


def raise_on_failed_checks(checks: list[tuple[torch.Tensor, str]], enabled: bool = True) -> None:
    """Evaluate boolean scalar tensors with one device sync; raise ValueError with the first failing message.

    `enabled=False` (`config.check_inputs=False`) skips the sync for trusted training pipelines."""
    if not checks or not enabled:
        return
    passed = torch.stack([flag.reshape(()) for flag, _ in checks]).tolist()
    for ok, (_, message) in zip(passed, checks):
        if not ok:
            raise ValueError(message)


def length_sorted_batches(token_lists: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Indices of the proteins, longest first, grouped so each group holds at most `max_tokens` tokens (a longer
    protein forms a group of its own)."""
    order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
    batches: list[list[int]] = []
    used = max_tokens
    for index in order:
        if used + len(token_lists[index]) > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(index)
        used += len(token_lists[index])
    return batches


def first_token_states(
    states: torch.Tensor, cu_seq_lens: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """Each protein's first (`<cls>`) state, `[N, hidden]`: from packed `[1, T, hidden]` states at `cu_seq_lens`
    starts, or from padded `[B, S, hidden]` states at each row's first token of `attention_mask` (left padding
    too; column 0 without a mask)."""
    if cu_seq_lens is not None:
        return states[0, cu_seq_lens[:-1].long()]
    if attention_mask is None:
        return states[:, 0]
    first = attention_mask.to(torch.int32).argmax(dim=1).to(states.device)
    return states[torch.arange(states.shape[0], device=states.device), first]


def residue_token_mask(
    cu_seq_lens: torch.Tensor, num_tokens: int, sequence_index: torch.Tensor | None = None
) -> torch.Tensor:
    """`[T]` bool over packed tokens: True at residues, False at each protein's first (`<cls>`) and last (`<eos>`)
    token. `cu_seq_lens [N + 1]` covers the T tokens; `sequence_index` (`sequence_index_of_tokens`), if the caller
    has it already."""
    if sequence_index is None:
        sequence_index = sequence_index_of_tokens(cu_seq_lens, num_tokens)
    position = positions_in_proteins(cu_seq_lens.long(), num_tokens, sequence_index)
    lengths = cu_seq_lens.diff().long()
    return (position > 0) & (position < lengths[sequence_index] - 1)


def pool_proteins(states: torch.Tensor, cu_seq_lens: torch.Tensor, pooling: str) -> torch.Tensor:
    """`[T, hidden]` packed states -> `[N, hidden]`: the `<cls>` state (`pooling="cls"`), or the mean over the
    residues (`"mean"`; `<cls>`/`<eos>` excluded), in `states`' dtype. No boolean indexing, so nothing waits for the
    device. The sums run in float64: CUDA's `index_add_` adds in no fixed order (float32 sums then differed by
    ~1e-6 between runs), while float64 sums of up to 2^10 float32 values are exact in any order unless their
    magnitudes span more than about 2^19, and a float64 rounding would also have to fall on a float32 rounding
    boundary to show: a protein's mean comes out the same, bit for bit, in every run but for odds of about 1e-9 a
    value (and `torch.use_deterministic_algorithms` takes `index_add_`'s deterministic path)."""
    if pooling == "cls":
        return states[cu_seq_lens[:-1].long()]
    sequence_index = sequence_index_of_tokens(cu_seq_lens, states.shape[0])
    is_residue = residue_token_mask(cu_seq_lens, states.shape[0], sequence_index)
    lengths = cu_seq_lens.diff().long()
    sums = torch.zeros(len(lengths), states.shape[1], device=states.device, dtype=torch.float64)
    sums.index_add_(0, sequence_index, torch.where(is_residue[:, None], states, 0).double())
    return (sums / (lengths - 2).clamp_min(1)[:, None]).to(states.dtype)


@dataclass
class InputBatch:
    """A validated batch: its layout, per-protein lengths, and the packing used to change layout.

    Attributes:
        input_is_packed: Inputs came packed (`[1, T]`); else padded (`[B, S]`).
        lengths: `[N]` tokens per protein (float32, for token-dropout ratios).
        packed: Where the tokens lie in the input; None for a padded input without attention_mask when the
            layers run padded.
    """

    input_is_packed: bool
    lengths: torch.Tensor
    packed: PackedSequences | None = None

    def __post_init__(self) -> None:
        """`run_packing`: the packing the layers run, the proteins' tokens packed in order with the right-padded view
        `[N, max_length]` (the input's own packing when it came packed; None without `packed`). Made here, not on
        first use: `torch.compile` breaks on a lazily cached attribute."""
        packing = self.packed
        if packing is None or self.input_is_packed:
            self.run_packing = packing
        else:
            self.run_packing = PackedSequences.right_padded(packing.cu_seq_lens, packing.max_length, packing.num_tokens)

    def to_input_layout(self, states: torch.Tensor) -> torch.Tensor:
        """Packed outputs `[T, ...]` (the proteins' tokens in order) -> the input's layout: `[1, T, ...]` for packed
        inputs, `[B, S, ...]` with zeros at padding for padded ones."""
        return states.unsqueeze(0) if self.input_is_packed else self.packed.unpack(states)

    def maps_to_input_layout(self, maps: torch.Tensor) -> torch.Tensor:
        """One layer's attention probabilities from the run layout (`[N', heads, L', L']`, right-padded, maybe with
        FP8 padding) to the documented output layout: `[B, heads, S, S]` where each padded input row's tokens lie,
        or `[N, heads, L, L]` for packed inputs."""
        packing = self.packed
        if packing is None:  # a padded input without padding ran as it came
            width = int(self.lengths[0])  # every row is a protein of the input's width
            return maps[:, :, :width, :width]
        count, length = packing.cu_seq_lens.numel() - 1, packing.max_length
        maps = maps[:count, :, :length, :length]
        if self.input_is_packed:
            return maps
        rows, width = packing.padded_shape
        column = torch.full((count, length), width, dtype=torch.long, device=maps.device)  # `width`: off the input
        column[packing.sequence_index, packing.positions] = packing.token_index % width
        placed = maps.new_zeros(rows, width + 1, width + 1, maps.shape[1])
        row_index = torch.arange(count, device=maps.device)[:, None, None]
        placed[row_index, column[:, :, None], column[:, None, :]] = maps.permute(0, 2, 3, 1)
        return placed[:, :width, :width].permute(0, 3, 1, 2)

    def run_token_ids(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[N, L]` token ids in the right-padded run layout and the `[N, L]` bool mask of real tokens."""
        if self.packed is None:
            return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
        packed_ids = input_ids.reshape(-1) if self.input_is_packed else self.packed.pack(input_ids)
        return self.run_packing.unpack(packed_ids), self.run_packing.key_mask()

    @classmethod
    def padded_from(
        cls,
        config: NVEsmConfig,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> InputBatch:
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
        if tokens.dim() != 2:
            raise ValueError(
                f"Padded input_ids must be [batch, length] (inputs_embeds [batch, length, hidden]), got shape "
                f"{tuple(tokens.shape)}; packed inputs need cu_seq_lens_q or position_ids."
            )
        batch, length = tokens.shape
        if batch == 0 or length == 0:
            raise ValueError(f"The batch holds no tokens: input shape {tuple(tokens.shape)}.")
        if attention_mask is None:
            if length > config.max_protein_length:
                raise ValueError(_too_long_message(config))
            _warn_if_longer_than_trained(config, length)
            lengths = torch.full((batch,), float(length), device=tokens.device)
            raise_on_failed_checks(_token_id_checks(config, input_ids), config.check_inputs)
            packed = None
            if config.attn_input_format == "thd":
                cu_seq_lens = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=tokens.device)
                packed = PackedSequences.right_padded(cu_seq_lens, length, batch * length)
            return cls(False, lengths, packed)
        check_tensor("attention_mask", attention_mask, tokens.device)
        if attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} and the input {tuple(tokens.shape)}; "
                "they must match."
            )
        key_mask = attention_mask.bool()
        counts = key_mask.sum(-1)
        longest = counts.max()
        # One run of tokens per row: padding on the left, the right or both, never inside a protein.
        run_starts = key_mask[:, 0].int() + (key_mask[:, 1:] & ~key_mask[:, :-1]).sum(-1)
        checks = _token_id_checks(config, input_ids, key_mask) + [
            (((attention_mask == 0) | (attention_mask == 1)).all(), "attention_mask must hold only 0 and 1."),
            ((counts > 0).all(), "Every row of attention_mask must keep at least one token."),
            (
                (run_starts <= 1).all(),
                "attention_mask must keep one contiguous run of tokens per row (padding on the left and/or right "
                "of each protein, none inside it).",
            ),
            (longest <= config.max_protein_length, _too_long_message(config)),
        ]
        raise_on_failed_checks(checks, config.check_inputs)
        packed = PackedSequences.from_attention_mask(key_mask, int(longest))
        _warn_if_longer_than_trained(config, packed.max_length)
        return cls(False, counts.float(), packed)

    @classmethod
    def packed_from(
        cls,
        config: NVEsmConfig,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cu_seq_lens_q: torch.Tensor | None,
        cu_seq_lens_k: torch.Tensor | None,
        max_length_q: int | None,
        max_length_k: int | None,
    ) -> InputBatch:
        if attention_mask is not None:
            raise ValueError("attention_mask is for padded batches; packed inputs are described by cu_seq_lens_q.")
        tokens = input_ids if input_ids is not None else inputs_embeds[..., 0]
        if tokens.dim() == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dim() != 1:
            raise ValueError(
                f"Packed input_ids must be [1, total_tokens] or [total_tokens], got shape {tuple(tokens.shape)}."
            )
        num_tokens = tokens.shape[0]
        if num_tokens == 0:
            raise ValueError("Packed input holds no tokens.")
        for name, value in [("position_ids", position_ids), ("cu_seq_lens_q", cu_seq_lens_q)]:
            if value is not None:
                check_tensor(name, value, tokens.device)
        checks = _token_id_checks(config, input_ids)
        if position_ids is not None:
            checks += _position_id_checks(position_ids, num_tokens)
        if cu_seq_lens_q is None:
            if cu_seq_lens_k is not None:
                raise ValueError("cu_seq_lens_k was given without cu_seq_lens_q; pass both (they must be equal).")
            raise_on_failed_checks(checks, config.check_inputs)
            starts = (position_ids.reshape(-1) == 0).nonzero().squeeze(1)
            cu_seq_lens = F.pad(starts.to(torch.int32), (0, 1), value=num_tokens)
            checks = []
        else:
            cu_seq_lens = cu_seq_lens_q
            checks += _cu_seq_lens_checks(cu_seq_lens, cu_seq_lens_k, num_tokens)
        max_length_q, max_length_k = _as_length("max_length_q", max_length_q), _as_length("max_length_k", max_length_k)
        if max_length_q is not None and max_length_k is not None and max_length_q != max_length_k:
            raise ValueError(f"max_length_q ({max_length_q}) and max_length_k ({max_length_k}) must be equal.")
        max_length = max_length_q if max_length_q is not None else max_length_k
        if max_length is not None and max_length > config.max_protein_length:
            raise ValueError(
                f"max_length_q ({max_length}) is longer than max_protein_length ({config.max_protein_length} tokens): "
                "it is the longest protein of the batch, and none may be longer."
            )
        lengths = cu_seq_lens.diff()
        longest = lengths.max()
        checks.append((longest <= config.max_protein_length, _too_long_message(config)))
        if max_length is not None:
            checks.append(
                (longest <= int(max_length), f"max_length_q ({max_length}) is shorter than the longest protein.")
            )
        sequence_index = positions = None
        if position_ids is not None and cu_seq_lens_q is not None:  # the indices computed here serve the run too
            sequence_index = sequence_index_of_tokens(cu_seq_lens, num_tokens)
            positions = positions_in_proteins(cu_seq_lens, num_tokens, sequence_index)
            checks.append(((position_ids.reshape(-1) == positions).all(), "position_ids disagree with cu_seq_lens_q."))
        raise_on_failed_checks(checks, config.check_inputs)
        max_length = int(longest) if max_length is None else max_length
        _warn_if_longer_than_trained(config, max_length)
        packed = PackedSequences.right_padded(cu_seq_lens, max_length, num_tokens, sequence_index, positions)
        return cls(True, lengths.float(), packed)


def _token_id_checks(
    config: NVEsmConfig, input_ids: torch.Tensor | None, key_mask: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, str]]:
    """Token ids within the vocabulary, where `key_mask` (if given) keeps tokens: padding ids are never read."""
    if input_ids is None:
        return []
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids (int64 or int32), got dtype {input_ids.dtype}.")
    in_vocab = (input_ids >= 0) & (input_ids < config.vocab_size)
    in_vocab = (in_vocab if key_mask is None else in_vocab | ~key_mask).all()
    return [(in_vocab, f"input_ids must be token ids in [0, {config.vocab_size}) (the ESM vocabulary).")]


def _position_id_checks(position_ids: torch.Tensor, num_tokens: int) -> list[tuple[torch.Tensor, str]]:
    if position_ids.numel() != num_tokens:
        raise ValueError(f"position_ids has {position_ids.numel()} entries for {num_tokens} tokens.")
    positions = position_ids.reshape(-1)
    steps_ok = (positions[1:] == positions[:-1] + 1) | (positions[1:] == 0)
    message = "position_ids must start at 0 for every protein and count up by 1 (packed sequences)."
    return [((positions[0] == 0) & steps_ok.all(), message)]


def _cu_seq_lens_checks(
    cu_seq_lens: torch.Tensor, cu_seq_lens_k: torch.Tensor | None, num_tokens: int
) -> list[tuple[torch.Tensor, str]]:
    if cu_seq_lens.dim() != 1 or cu_seq_lens.numel() < 2 or cu_seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seq_lens_q must be a 1-D integer tensor [num_proteins + 1] of dtype int32 (or int64), got "
            f"{cu_seq_lens.dtype} of shape {tuple(cu_seq_lens.shape)}."
        )
    checks = [
        (cu_seq_lens[0] == 0, "cu_seq_lens_q must start at 0."),
        ((cu_seq_lens.diff() > 0).all(), "cu_seq_lens_q must be strictly increasing (no empty proteins)."),
        (cu_seq_lens[-1] == num_tokens, f"cu_seq_lens_q must end at the number of tokens ({num_tokens})."),
    ]
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens:
        check_tensor("cu_seq_lens_k", cu_seq_lens_k, cu_seq_lens.device)
        if cu_seq_lens_k.shape != cu_seq_lens.shape:
            raise ValueError("cu_seq_lens_k must equal cu_seq_lens_q (self-attention).")
        checks.append(
            ((cu_seq_lens_k == cu_seq_lens).all(), "cu_seq_lens_k must equal cu_seq_lens_q (self-attention).")
        )
    return checks


def check_tensor(name: str, value: Any, device: torch.device | None) -> None:
    """Raise ValueError unless `value` is a tensor (on `device`, when given)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device} and the input tokens on {device}; put them on one device.")


def _as_length(name: str, value: Any) -> int | None:
    """`max_length_q`/`max_length_k` as a Python int (a 0-d integer tensor is accepted)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer, got a {value.dtype} tensor of shape {tuple(value.shape)}.")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return int(value)


def _too_long_message(config: NVEsmConfig) -> str:
    return (
        f"A protein is longer than max_protein_length ({config.max_protein_length} tokens including <cls> and "
        "<eos>); crop it, or load the model with a larger max_protein_length (attention memory grows with the "
        "square of the length)."
    )


def _warn_if_longer_than_trained(config: NVEsmConfig, max_length: int) -> None:
    """Once per process: `max_length` (in tokens, `<cls>` and `<eos>` included: the longest protein, or the packed
    batch's stated max_length) is past the longest proteins ESM-2 was trained on. Said in residues, as users count."""
    if max_length > config.max_position_embeddings:
        logger.warning_once(
            f"A protein of up to {max_length - 2} residues: ESM-2 was trained on proteins of at most "
            f"{config.max_position_embeddings - 2} residues. It runs (rotary positions need no table), but outputs "
            "past that length are outside what the model saw in training."
        )


def check_extra_inputs(kwargs: dict[str, Any], check_values: bool) -> None:
    """Refuse what NVEsm cannot honour among the extra keywords: a ValueError naming a keyword of transformers'
    ESM that asks for something ESM-2 lacks, a TypeError for unknown ones. `token_type_ids` must be all zeros
    (ESM-2 has one token type; checked with one device sync when `check_values`)."""
    for name, reason in UNSUPPORTED_INPUTS.items():
        if kwargs.get(name) is not None and kwargs[name] is not False:
            raise ValueError(f"{name} is not supported: {reason}. Leave it out (or pass None).")
    token_type_ids = kwargs.get("token_type_ids")
    if token_type_ids is not None:
        if not isinstance(token_type_ids, torch.Tensor):
            raise ValueError("token_type_ids must be a torch.Tensor (all zeros: ESM-2 has one token type).")
        if check_values and bool(token_type_ids.ne(0).any()):
            raise ValueError("token_type_ids must be all zeros: ESM-2 has one token type (no segment embedding).")
    unknown = set(kwargs) - IGNORED_INPUTS - set(UNSUPPORTED_INPUTS) - {"token_type_ids"}
    if unknown:
        raise TypeError(f"Unexpected inputs: {sorted(unknown)}")


def wants_dict(return_dict: bool | None, config: NVEsmConfig) -> bool:
    return config.return_dict if return_dict is None else return_dict
