"""Variant effects and sequence likelihoods from an NVEsm masked-LM model, with the masked copies packed into THD
batches (the Python side of `nv-esm score`).

    from nv_esm.scoring import pseudo_log_likelihood, score_variants
    scores = score_variants(model, wild_type, ["A24G", "A24G:K30R"], tokenizer, method="masked_marginal")  # [2]
    likelihoods = pseudo_log_likelihood(model, sequences, tokenizer)  # .pll, .pseudo_perplexity per protein

`model` is an `NVEsmForMaskedLM` (`AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)`) in eval
mode, on any device; `tokenizer` its ESM tokenizer.

Methods (scores are log-probability ratios in nats; the sum runs over the mutated positions i of a mutant):

- `masked_marginal` (Meier et al. 2021): one forward of the wild type with every mutated position masked;
  score = sum_i log p(mutant_i) - log p(wild_type_i) at those masks. Mutants that change the same positions share
  that forward (so a site-saturation scan costs one forward per site). For multi-mutants the positions are masked
  together, as in the paper's formula (ProteinGym instead adds single-site marginals, each masked alone).
- `wildtype_marginal`: one unmasked forward of the wild type (per window); the same sum at the mutated positions.
- `pseudo_likelihood`: PLL(mutant) - PLL(wild type).
- The pseudo-log-likelihood of a protein x of L residues: PLL = sum_i log p(x_i | x with residue i masked), one
  masked copy per residue (all L packed densely); pseudo-perplexity = exp(-PLL / L).

Log-probabilities are the log-softmax, in fp32, of the LM head's logits over the full vocabulary (all 33 tokens,
special tokens included), as fair-esm's and transformers' users compute them. On CUDA the encoder runs under bf16
autocast (as `model.esm.embed` and `nv-esm embed`), on the CPU in the weights' precision; the LM head and the
log-softmax run in fp32 (autocast off, fp32 copies of the head's weights) on the rows read only, so scores (differences
of two log-probabilities) do not snap to bf16's grid of logits.

Windows: a protein longer than `window` residues (default `default_window`: min(config.max_position_embeddings,
config.max_protein_length) - 2, 1,024 for ESM-2's checkpoints) runs as a window of `window` consecutive residues
chosen per forward: residues `[s, s + window)` with `s = clip(c - window // 2, 0, L - window)`, where
c = ceil((first + last) / 2) of the 0-based positions the forward masks or reads (the mutated positions; for a PLL
the one masked residue, which thus has `window // 2` residues before it where the protein allows, as fair-esm's
1,022/1,024-residue windows centred on the mutation). A mutant whose changed positions span more than `window`
residues fits no window: the marginal methods refuse it.

Every masked copy is its own protein in a packed batch (ESM's token-dropout ratio is per protein, as if it ran
alone); copies are length-sorted and packed to `max_tokens_per_batch` tokens, and on CUDA batch k + 1 is queued
before the results of batch k are read back.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from modeling_nv_esm_batch import RESIDUE_LETTERS, length_sorted_batches, pack_proteins, protein_residues
from modeling_nv_esm_plan import inference_autocast
from nv_esm import job_clock
from nv_esm.embed_model import to_device, to_host
from nv_esm.vocabulary import SCORE_METHODS

METHODS = SCORE_METHODS  # `nv_esm.vocabulary`
MARGINAL_METHODS = ("masked_marginal", "wildtype_marginal")
_SUBSTITUTION = re.compile(r"([A-Za-z])([0-9]+)([A-Za-z])")


@dataclass(frozen=True)
class Substitution:
    """One substitution of a mutant, as ProteinGym writes it (`A24G`): 1-based position, two residue letters."""

    position: int
    wild_type: str
    mutant: str


@dataclass
class SequenceLikelihood:
    """One protein's pseudo-log-likelihood (natural log), pseudo-perplexity exp(-pll / L), and, when asked for,
    `per_position [L]` float64: log p(x_i | x with residue i masked)."""

    pll: float
    pseudo_perplexity: float
    per_position: torch.Tensor | None = None

    @classmethod
    def of(cls, per_position: torch.Tensor, keep: bool = False) -> SequenceLikelihood:
        """From `per_position [L]` (`Scorer.position_log_likelihoods`), kept in the result if `keep`."""
        pll = per_position.sum().item()
        return cls(pll, math.exp(-pll / len(per_position)), per_position if keep else None)


@dataclass(frozen=True, slots=True)
class MaskedCopy:
    """One model input: residues `start:stop` of sequence `sequence`, after `<cls>` if `bos` and before `<eos>` if
    `eos` (a slice of the protein's token array, as ProteinGym's windows cut it, may lack either), residues
    `masked` (0-based, in the protein) replaced by `<mask>`; the log-probabilities at residues `read` come back."""

    sequence: int
    start: int
    stop: int
    masked: tuple[int, ...]
    read: tuple[int, ...]
    bos: bool = True
    eos: bool = True

    @property
    def tokens(self) -> int:
        """Tokens the model runs for this copy: its residues and its `<cls>` and `<eos>` where it has them."""
        return self.stop - self.start + self.bos + self.eos


_POSITION = operator.attrgetter("position")


def parse_mutant(
    mutant: str,
    wild_type: str,
    name: str | Callable[[], str],
    known: dict[str, Substitution] | None = None,
) -> tuple[Substitution, ...]:
    """The substitutions of `mutant` in ProteinGym's notation (`A24G`, `A24G:K30R`; 1-based positions; either
    case), sorted by position. `wild_type` is the protein as `protein_residues` gives it (upper case). ValueError
    naming `name` (the row; or a function that gives it, called only for an error) and the position for: an empty
    or malformed mutant, a position outside the wild type, a wild-type letter that differs from the wild type's, a
    mutant letter outside ESM-2's alphabet, a position changed twice. `known`: the substitutions already checked
    against this wild type, by their text (filled here; an assay's mutants repeat a few thousand of them)."""
    if not isinstance(mutant, str) or not mutant.strip():
        raise ValueError(f"{_named(name)}: no mutant (expected e.g. 'A24G' or 'A24G:K30R').")
    substitutions: dict[int, Substitution] = {}
    for part in mutant.strip().split(":"):
        part = part.strip()
        substitution = None if known is None else known.get(part)
        if substitution is None:
            substitution = _substitution(part, mutant, wild_type, name)
            if known is not None:
                known[part] = substitution
        position = substitution.position
        if position in substitutions:
            raise ValueError(f"{_named(name)}: mutant {_quoted(mutant)} changes position {position} twice.")
        substitutions[position] = substitution
    return tuple(substitutions[position] for position in sorted(substitutions))


def parse_mutants(
    mutants: Sequence[str], wild_type: str, names: Sequence[str], bad: dict[int, str] | None = None
) -> list[tuple[Substitution, ...]]:
    """`parse_mutant` of every one of `mutants` (a whole assay; errors name `names[i]`, made only for an error). The
    quick way checks each distinct substitution's text once and assembles the rows from them; where it finds
    anything unusual (a value that is not text, spaces, a bad substitution, a position changed twice), every row is
    parsed on its own, so a bad row's error is `parse_mutant`'s: the first one raised, or with `bad`, every bad
    row's error put there (`bad[i]`; the row's substitutions are then `()`)."""
    quick = _assembled(mutants, wild_type) if len(mutants) else []
    if quick is not None:
        return quick
    known: dict[str, Substitution] = {}
    if bad is None:
        return [parse_mutant(mutant, wild_type, lambda i=i: names[i], known) for i, mutant in enumerate(mutants)]
    variants: list[tuple[Substitution, ...]] = []
    for i, mutant in enumerate(mutants):
        try:
            variants.append(parse_mutant(mutant, wild_type, lambda i=i: names[i], known))
        except ValueError as error:
            bad[i] = str(error)
            variants.append(())
    return variants


def _assembled(mutants: Sequence[str], wild_type: str) -> list[tuple[Substitution, ...]] | None:
    """`parse_mutants`' quick way: the rows' substitutions, sorted by position, or None where a row needs
    `parse_mutant`."""
    try:
        parts = ":".join(mutants).split(":")
    except TypeError:  # a value that is not text
        return None
    known: dict[str, Substitution] = {}
    for part in set(parts):
        try:
            known[part] = _substitution(part, part, wild_type, part)
        except ValueError:
            return None
    found = list(map(known.__getitem__, parts))
    if len(found) == len(mutants):
        return [(substitution,) for substitution in found]
    variants: list[tuple[Substitution, ...]] = []
    append, i = variants.append, 0
    for colons in map(str.count, mutants, repeat(":")):
        if colons == 0:
            append((found[i],))
        elif colons == 1:
            first, second = found[i], found[i + 1]
            if first.position < second.position:
                append((first, second))
            elif first.position > second.position:
                append((second, first))
            else:
                return None
        else:
            row = sorted(found[i : i + colons + 1], key=_POSITION)
            if len(set(map(_POSITION, row))) < len(row):
                return None
            append(tuple(row))
        i += colons + 1
    return variants


def _named(name: str | Callable[[], str]) -> str:
    return name if isinstance(name, str) else name()


def _substitution(part: str, mutant: str, wild_type: str, name: str | Callable[[], str]) -> Substitution:
    """One substitution (`A24G`) of `mutant`, checked against `wild_type` (`parse_mutant`'s errors)."""
    match = _SUBSTITUTION.fullmatch(part)
    if match is None:
        raise ValueError(
            f"{_named(name)}: {_quoted(part)} in mutant {_quoted(mutant)} is not a substitution such as 'A24G' "
            "(wild-type letter, 1-based position, mutant letter; ':' between substitutions)."
        )
    wild_letter, digits, mutant_letter = match[1].upper(), match[2].lstrip("0") or "0", match[3].upper()
    # A position longer than the wild type's length in digits is outside it (and may be too long for int()).
    position = int(digits) if len(digits) <= len(str(len(wild_type))) else len(wild_type) + 1
    if not 1 <= position <= len(wild_type):
        raise ValueError(
            f"{_named(name)}: position {_shortened(digits)} of mutant {_quoted(mutant)} is outside the wild type "
            f"(1 to {len(wild_type)})."
        )
    if wild_type[position - 1] != wild_letter:
        raise ValueError(
            f"{_named(name)}: mutant {_quoted(mutant)} says position {position} is {wild_letter!r}, but the wild "
            f"type has {wild_type[position - 1]!r} there."
        )
    if mutant_letter not in RESIDUE_LETTERS:
        raise ValueError(
            f"{_named(name)}: mutant letter {mutant_letter!r} at position {position} of {_quoted(mutant)} is not a "
            "residue of ESM-2's alphabet."
        )
    return Substitution(position, wild_letter, mutant_letter)


def _shortened(text: str, most: int = 40) -> str:
    """`text`, or its first `most` characters and how long it is, for an error message."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def _quoted(text: str, most: int = 40) -> str:
    """`repr(text)`, or that of its first `most` characters and how long it is, for an error message."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text)} characters)"


def window_bounds(length: int, first: int, last: int, window: int) -> tuple[int, int]:
    """`(start, stop)`: the residues of a protein of `length` residues that one forward holds, so that 0-based
    positions `first..last` lie inside: the whole protein if it has at most `window` residues, else `window`
    residues `[s, s + window)`, s = clip(ceil((first + last) / 2) - window // 2, 0, length - window). ValueError
    if `first..last` spans more than `window` residues."""
    if length <= window:
        return 0, length
    if last - first >= window:
        raise ValueError(f"positions {first + 1} to {last + 1} span more than the {window}-residue window.")
    start = min(max((first + last + 1) // 2 - window // 2, 0), length - window)
    return start, start + window


def default_window(config: Any) -> int:
    """Residues per forward unless asked otherwise: min(`max_position_embeddings`, `max_protein_length` where the
    config has it) - 2, the longest protein the model was trained on and accepts (1,024 for ESM-2: 1,026 and
    8,192)."""
    tokens = config.max_position_embeddings
    if getattr(config, "max_protein_length", None) is not None:
        tokens = min(tokens, config.max_protein_length)
    return tokens - 2


def resolve_window(config: Any, window: int | None, name: str = "window") -> int:
    """`window` (None: `default_window`), checked: a whole number, 1 to `config.max_protein_length - 2` residues,
    else ValueError naming it as `name` (the command's `--window`)."""
    window = default_window(config) if window is None else _whole_number(window, name, "residues")
    longest = config.max_protein_length - 2
    if not 1 <= window <= longest:
        raise ValueError(f"{name} must be 1 to {longest} residues (config.max_protein_length - 2), got {window}.")
    return window


def _whole_number(value: Any, name: str, unit: str) -> int:
    """`value` as an int; ValueError naming it as `name` for anything else (a float, NaN, a bool, None...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number of {unit}, got {value!r}.")
    return int(value)


def check_method(method: str) -> None:
    """ValueError unless `method` is one of `METHODS`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}.")


def check_variant(
    mutant: str, wild_type: str, methods: Sequence[str], window: int, name: str
) -> tuple[Substitution, ...]:
    """`parse_mutant`, and for the marginal methods (one forward per mutant) a check that the mutant's positions fit
    one `window` of the wild type; ValueError naming `name` otherwise."""
    substitutions = parse_mutant(mutant, wild_type, name)
    if any(method in MARGINAL_METHODS for method in methods):
        try:
            window_bounds(len(wild_type), substitutions[0].position - 1, substitutions[-1].position - 1, window)
        except ValueError as error:
            raise ValueError(
                f"{name}: mutant {_quoted(mutant)}: {error} Marginal methods score it in one forward."
            ) from None
    return substitutions


class Scorer:
    """Runs masked copies of proteins through a masked-LM model, packed, and turns their log-probabilities into
    PLLs and variant scores (`pseudo_log_likelihood` and `score_variants` are its one-call forms).

    Args:
        model: `NVEsmForMaskedLM` (packed inputs go to its `esm`, the read positions' states to its `lm_head`),
            in eval mode.
        tokenizer: The checkpoint's ESM tokenizer: residue letters and `<cls>`, `<eos>`, `<mask>` ids come from it.
        window: Residues per forward for longer proteins (default `default_window(config)`).
        max_tokens_per_batch: Token budget of one packed batch (a longer copy runs alone).
    """

    def __init__(
        self, model: Any, tokenizer: Any, window: int | None = None, max_tokens_per_batch: int = 16384
    ) -> None:
        nv_esm = getattr(getattr(model, "config", None), "model_type", None) == "nv_esm"
        if not (nv_esm and hasattr(model, "esm") and hasattr(model, "lm_head")):
            raise TypeError(
                "scoring needs an NVEsm masked-LM model (AutoModelForMaskedLM of a converted folder, "
                f"NVEsmForMaskedLM), not a {type(model).__name__}."
            )
        if model.training:
            raise ValueError("the model is in training mode; call model.eval() before scoring.")
        config = model.config
        window = resolve_window(config, window)
        max_tokens_per_batch = _whole_number(max_tokens_per_batch, "max_tokens_per_batch", "tokens")
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}.")
        self.model, self.window, self.max_tokens = model, window, max_tokens_per_batch
        self.device = model.esm.embeddings.word_embeddings.weight.device
        self.head_weights = {name: p.detach().float() for name, p in model.lm_head.named_parameters()}  # fp32 head
        self.letter_ids = _letter_ids(tokenizer, config.vocab_size)
        self.cls, self.eos, self.mask = tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id

    def encode(self, residues: str) -> torch.Tensor:
        """`[L]` int64 token ids of `residues` (upper-case letters of ESM-2's alphabet, as `protein_residues` gives)."""
        return torch.tensor([self.letter_ids[letter] for letter in residues], dtype=torch.int64)

    def pll_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens that `position_log_likelihoods` runs through the model for proteins of `lengths` residues (its
        progress bar's total): L masked copies of min(L, window) residues, `<cls>` and `<eos>` each."""
        return sum(length * (min(length, self.window) + 2) for length in lengths)

    def variant_tokens(self, length: int, variants: Sequence[Sequence[Substitution]], method: str) -> int:
        """Tokens that `variant_scores` runs through the model for `variants` of a wild type of `length` residues by
        `method` (its progress bar's total)."""
        check_method(method)
        if not variants:
            return 0
        if method == "pseudo_likelihood":  # the wild type's PLL and one per distinct mutant sequence
            return self.pll_tokens([length] * len({(), *map(_changes, variants)}))
        return copy_tokens(self._marginal_copies(length, variants, method)[0])

    def position_log_likelihoods(self, sequences: Sequence[torch.Tensor], progress: Any = None) -> list[torch.Tensor]:
        """Per protein `[L]` float64: log p(x_i | x with residue i masked), from L masked copies packed densely.

        `sequences`: `[L]` token ids each (`encode`). `progress`: a tqdm bar (or None) advanced by the tokens of each
        packed batch once it has come back (`pll_tokens` in all)."""
        copies, positions = [], []
        for index, tokens in enumerate(sequences):
            length = len(tokens)
            for position in range(length):
                start, stop = window_bounds(length, position, position, self.window)
                copies.append(MaskedCopy(index, start, stop, (position,), (position,)))
            positions.append(length)
        offsets = [0, *torch.tensor(positions, dtype=torch.int64).cumsum(0).tolist()]
        flat = torch.empty(offsets[-1], dtype=torch.float64)
        targets = torch.cat(list(sequences)) if sequences else torch.empty(0, dtype=torch.int64)
        for batch, log_probs in self.log_probs(sequences, copies, progress):
            where = torch.tensor([offsets[copies[i].sequence] + copies[i].read[0] for i in batch])
            flat[where] = log_probs.gather(1, targets[where][:, None])[:, 0].double()
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(sequences))]

    def variant_scores(
        self,
        wild_type: torch.Tensor,
        variants: Sequence[Sequence[Substitution]],
        method: str,
        progress: Any = None,
    ) -> torch.Tensor:
        """`[M]` float64 scores of `variants` (`check_variant`'s) of the wild type `[L]` (`encode`) by `method`
        (see the module's docstring). `progress`: a tqdm bar (or None) advanced by the tokens of each packed batch
        once it has come back (`variant_tokens` in all)."""
        check_method(method)
        if not variants:
            return torch.empty(0, dtype=torch.float64)
        if method == "pseudo_likelihood":
            return self._pseudo_likelihood_scores(wild_type, variants, progress)
        plans, row_copies = self._marginal_copies(len(wild_type), variants, method)
        rows_of_copy: dict[int, dict[int, torch.Tensor]] = {}
        for batch, log_probs in self.log_probs([wild_type], plans, progress):
            offset = 0
            for index in batch:
                read = plans[index].read
                rows_of_copy[index] = dict(zip(read, log_probs[offset : offset + len(read)]))
                offset += len(read)
        scores = torch.empty(len(variants), dtype=torch.float64)
        for row, substitutions in enumerate(variants):
            rows = rows_of_copy[row_copies[row]]
            log_probs = [(rows[s.position - 1], s) for s in substitutions]
            scores[row] = sum(
                float(values[self.letter_ids[s.mutant]]) - float(values[self.letter_ids[s.wild_type]])
                for values, s in log_probs
            )
        return scores

    def _marginal_copies(
        self, length: int, variants: Sequence[Sequence[Substitution]], method: str
    ) -> tuple[list[MaskedCopy], list[int]]:
        """The copies of the wild type (of `length` residues) that a marginal `method` runs, and per variant the
        index of the copy it reads: masked_marginal one per set of mutated positions (masked), wildtype_marginal one
        per window (unmasked)."""
        masked = method == "masked_marginal"
        keys: dict[tuple[int, ...], int] = {}
        copies: list[tuple[int, int, set[int]]] = []
        row_copies = []
        for substitutions in variants:
            positions = tuple(s.position - 1 for s in substitutions)
            start, stop = window_bounds(length, positions[0], positions[-1], self.window)
            key = positions if masked else (start, stop)
            if key not in keys:
                keys[key] = len(copies)
                copies.append((start, stop, set()))
            copies[keys[key]][2].update(positions)
            row_copies.append(keys[key])
        plans = [MaskedCopy(0, a, b, tuple(sorted(p)) if masked else (), tuple(sorted(p))) for a, b, p in copies]
        return plans, row_copies

    def _pseudo_likelihood_scores(
        self, wild_type: torch.Tensor, variants: Sequence[Sequence[Substitution]], progress: Any
    ) -> torch.Tensor:
        """PLL(mutant) - PLL(wild type); mutants of the same sequence are scored once, and one equal to the wild
        type (only synonymous substitutions, e.g. K2K) reuses the wild type's PLL: its score is exactly 0. The wild
        type's copies run in batches of their own, so its PLL is the same in every call (`nv-esm score` calls once
        per part): in bf16 or FP8 a copy's values depend on what shares its batch, and a wild type packed with each
        part's mutants would shift the scores of each part by a different rounding."""
        wild_type_pll = self.position_log_likelihoods([wild_type], progress)[0].sum().item()
        distinct: dict[tuple[Substitution, ...], int] = {(): 0}
        sequences = [wild_type]
        keys = [_changes(substitutions) for substitutions in variants]
        for key in keys:
            if key not in distinct:
                distinct[key] = len(sequences)
                mutant = wild_type.clone()
                for s in key:
                    mutant[s.position - 1] = self.letter_ids[s.mutant]
                sequences.append(mutant)
        mutants = self.position_log_likelihoods(sequences[1:], progress)
        plls = [wild_type_pll, *(values.sum().item() for values in mutants)]
        return torch.tensor([plls[distinct[key]] - wild_type_pll for key in keys], dtype=torch.float64)

    def log_probs(
        self, sequences: Sequence[torch.Tensor], copies: Sequence[MaskedCopy], progress: Any = None
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Per packed batch: (indices of its copies, `[R, vocab_size]` float32 log-probabilities on the CPU, the
        rows of each copy's `read` positions in order). Batch k + 1 is queued before batch k is read back; `progress`
        (a tqdm bar or None) advances by a batch's tokens when it has come back."""

        def collect(batch: list[int], log_probs: torch.Tensor, ready: Any) -> tuple[list[int], torch.Tensor]:
            result = self._collect(batch, log_probs, ready)
            if progress is not None:
                progress.update(copy_tokens(copies[index] for index in batch))
            return result

        lengths = [range(copy.tokens) for copy in copies]  # length_sorted_batches reads len() only
        in_flight = None
        for batch in length_sorted_batches(lengths, self.max_tokens):
            launched = self._launch(sequences, copies, batch)
            if in_flight is not None:
                yield collect(*in_flight)
            in_flight = launched
        if in_flight is not None:
            yield collect(*in_flight)

    @torch.no_grad()
    def _launch(
        self, sequences: Sequence[torch.Tensor], copies: Sequence[MaskedCopy], batch: list[int]
    ) -> tuple[list[int], torch.Tensor, Any]:
        pieces, reads, offset = [], [], 0
        for index in batch:
            copy = copies[index]
            piece = torch.empty(copy.tokens, dtype=torch.int64)
            if copy.bos:
                piece[0] = self.cls
            if copy.eos:
                piece[-1] = self.eos
            piece[int(copy.bos) : len(piece) - copy.eos] = sequences[copy.sequence][copy.start : copy.stop]
            if copy.masked:
                piece[[copy.bos + position - copy.start for position in copy.masked]] = self.mask
            reads.extend(offset + copy.bos + position - copy.start for position in copy.read)
            offset += len(piece)
            pieces.append(piece)
        packed = pack_proteins(pieces)
        with inference_autocast(self.device):
            states = self.model.esm(
                to_device(packed["input_ids"], self.device),
                cu_seq_lens_q=to_device(packed["cu_seq_lens_q"], self.device),
                max_length_q=packed["max_length_q"],
                return_dict=True,
            ).last_hidden_state[0]
        log_probs = to_host(self._head_log_probs(states.index_select(0, to_device(torch.tensor(reads), self.device))))
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return batch, log_probs, ready

    def _head_log_probs(self, states: torch.Tensor) -> torch.Tensor:
        """`[R, hidden]` final states of the read positions -> `[R, vocab_size]` float32 log-probabilities: the LM
        head and log-softmax in fp32 (autocast off, the head's weights as fp32), so that a score, a difference of two
        log-probabilities, carries no bf16 rounding of the logits."""
        with torch.autocast("cuda", enabled=False):
            logits = torch.func.functional_call(self.model.lm_head, self.head_weights, (states.float(),))
        return logits.float().log_softmax(-1)

    @staticmethod
    def _collect(batch: list[int], log_probs: torch.Tensor, ready: Any) -> tuple[list[int], torch.Tensor]:
        if ready is not None:
            ready.synchronize()
        return batch, log_probs


def progress_bar(total: int, desc: str, disable: bool) -> Any:
    """A progress bar (`job_clock.progress_bar`) over the `total` tokens that scoring runs through the model (the
    masked copies' tokens, each copy's `<cls>` and `<eos>` included): the work, whatever the number of proteins or
    mutant rows."""
    return job_clock.progress_bar(total, desc, "token", disable, unit_scale=True)


# Decimals of a score in the commands' CSV files (`score_text`).
SCORE_DECIMALS = 6


def score_text(value: float) -> str:
    """A score (nats) as `nv-esm score` and `nv-esm proteingym` write it: fixed-point with `SCORE_DECIMALS` decimals
    ("-0.314687"; "nan", "inf" as Python writes them; never "-0.000000"). A score is a sum of differences of fp32
    log-probabilities, each good to about 1e-6 nats (fp32's spacing at the log-probabilities of a protein's
    letters), so the digits dropped are rounding noise; values closer than 1e-6 are written equal, as ties."""
    text = f"{value:.{SCORE_DECIMALS}f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text


def copy_tokens(copies: Iterable[MaskedCopy]) -> int:
    """Tokens the model runs for `copies`: each copy's residues, `<cls>` and `<eos>` (`MaskedCopy.tokens`)."""
    return sum(copy.tokens for copy in copies)


def _changes(substitutions: Sequence[Substitution]) -> tuple[Substitution, ...]:
    """The substitutions that change a residue (synonymous ones, such as K2K, dropped): equal for equal mutants."""
    return tuple(s for s in substitutions if s.mutant != s.wild_type)


def _letter_ids(tokenizer: Any, vocab_size: int) -> dict[str, int]:
    """Residue letter -> token id, from the tokenizer; ValueError if it lacks one of ESM-2's letters or specials,
    TypeError if it is not a tokenizer."""
    if not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        raise TypeError(
            "tokenizer must be the checkpoint's ESM tokenizer "
            f"(AutoTokenizer.from_pretrained(folder, trust_remote_code=True)), got {type(tokenizer).__name__}."
        )
    special = (tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.mask_token_id)
    ids = {letter: tokenizer.convert_tokens_to_ids(letter) for letter in RESIDUE_LETTERS}
    known = [i for i in (*ids.values(), *special) if isinstance(i, int) and i != tokenizer.unk_token_id]
    if len(known) != len(RESIDUE_LETTERS) + 3 or max(known) >= vocab_size:
        raise ValueError(
            "the tokenizer is not ESM-2's (residue letters, <cls>, <eos> and <mask> within the model's vocabulary)."
        )
    return ids


def pseudo_log_likelihood(
    model: Any,
    sequences: Sequence[str],
    tokenizer: Any,
    *,
    per_position: bool = False,
    window: int | None = None,
    max_tokens_per_batch: int = 16384,
    show_progress: bool = False,
) -> list[SequenceLikelihood]:
    """Pseudo-log-likelihood and pseudo-perplexity of each protein (see the module's docstring).

    Args:
        model: `NVEsmForMaskedLM` in eval mode.
        sequences: N proteins (letters of ESM-2's alphabet, either case; any length: longer ones run in windows).
        tokenizer: The checkpoint's ESM tokenizer.
        per_position: Also return each protein's `[L]` per-residue log-probabilities.
        window: Residues per forward (default `default_window(model.config)`).
        max_tokens_per_batch: Token budget of one packed batch of masked copies.
        show_progress: A progress bar over the tokens of the masked copies (`Scorer.pll_tokens` in all).

    Returns:
        N `SequenceLikelihood`, in the input order.
    """
    if isinstance(sequences, str):
        raise ValueError("pseudo_log_likelihood takes a list of proteins and got one string; pass [sequence].")
    scorer = Scorer(model, tokenizer, window, max_tokens_per_batch)
    encoded = [scorer.encode(protein_residues(s, f"sequences[{i}]")) for i, s in enumerate(sequences)]
    total = scorer.pll_tokens([len(tokens) for tokens in encoded])
    with progress_bar(total, "PLL", not show_progress) as progress:
        values = scorer.position_log_likelihoods(encoded, progress)
    return [SequenceLikelihood.of(per_residue, per_position) for per_residue in values]


def score_variants(
    model: Any,
    wild_type: str,
    mutants: Sequence[str],
    tokenizer: Any,
    method: str = "masked_marginal",
    *,
    window: int | None = None,
    max_tokens_per_batch: int = 16384,
    show_progress: bool = False,
) -> torch.Tensor:
    """Scores `[M]` (float64, CPU) of M mutants of `wild_type` by `method`: `masked_marginal`, `wildtype_marginal`
    or `pseudo_likelihood` (see the module's docstring). Positive: the model prefers the mutant.

    Args:
        model: `NVEsmForMaskedLM` in eval mode.
        wild_type: The wild-type protein (letters of ESM-2's alphabet, either case).
        mutants: ProteinGym notation, 1-based: `A24G`, multi-mutants `A24G:K30R`. A wild-type letter that differs
            from the wild type's raises ValueError naming the mutant (`mutants[i]`) and the position.
        tokenizer: The checkpoint's ESM tokenizer.
        method: The scoring method.
        window: Residues per forward for long wild types (default `default_window(model.config)`).
        max_tokens_per_batch: Token budget of one packed batch of masked copies.
        show_progress: A progress bar over the tokens of the masked copies (`Scorer.variant_tokens` in all).
    """
    check_method(method)
    if isinstance(mutants, str):
        raise ValueError("score_variants takes a list of mutants and got one string; pass [mutant].")
    scorer = Scorer(model, tokenizer, window, max_tokens_per_batch)
    residues = protein_residues(wild_type, "wild_type")
    variants = [check_variant(m, residues, (method,), scorer.window, f"mutants[{i}]") for i, m in enumerate(mutants)]
    total = scorer.variant_tokens(len(residues), variants, method)
    with progress_bar(total, method, not show_progress) as progress:
        return scorer.variant_scores(scorer.encode(residues), variants, method, progress)
