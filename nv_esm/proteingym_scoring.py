"""ProteinGym's zero-shot scores of ESM-2, with the masked copies of many assays packed together (the Python side of
`nv-esm proteingym`).

    from nv_esm.proteingym_scoring import Assay, score_assays
    assays = [Assay("MY_ASSAY", wild_type, ["A24G", "A24G:K30R"])]
    scores = score_assays(model, tokenizer, assays, ["masked-marginals", "wt-marginals"])  # {DMS_id: {method: [M]}}

`model` is an `NVEsmForMaskedLM` in eval mode, `tokenizer` its ESM tokenizer (as for `nv_esm.scoring`). Scores are
in nats (float64); log-probabilities are the fp32 log-softmax of the LM head over the full vocabulary
(`nv_esm.scoring.Scorer`). The methods follow ProteinGym's ESM baseline
(`proteingym/baselines/esm/compute_fitness.py`, its `label_row`, `compute_pppl`, and
`proteingym/utils/scoring_utils.py`'s `get_optimal_window`), with their names:

- `masked-marginals`: per site of a mutant, the wild type with that site alone masked;
  score = sum over sites of log p(mutant letter) - log p(wild-type letter) at that site's own copy. One copy per
  distinct (wild type, position) serves every mutant of every assay of that wild type.
- `wt-marginals`: the same sum read from unmasked forwards of the wild type.
- `pseudo-ppl`: what `compute_pppl` returns for the mutated sequence s of L residues (higher: more likely; not a
  perplexity, not a difference with the wild type): sum over token positions i = 1 .. L - 2 of the ESM token array
  `<cls> s <eos>` of log p(s[i] | token i masked). Token i holds residue i - 1 (0-based), so each term reads the
  probability of the letter of the residue AFTER the masked one, and the last two residues are never masked: their
  code's indexing, kept so the numbers are theirs. L - 2 copies per distinct mutated sequence: expensive.
- `masked_marginal`: `nv-esm score`'s joint mask (every site of a mutant masked in one copy, `nv_esm.scoring`).

Windows (`window`, W: `nv_esm.scoring.default_window`, 1,024 for ESM-2, ProteinGym's hard-coded `model_window`):

- `proteingym` (default): ProteinGym's slices of the token array `<cls> s <eos>` (T = L + 2 tokens), no special
  tokens added (a slice may lack `<cls>` or `<eos>`). Masked copies (`masked-marginals`): `optimal_window` of the
  masked token. `wt-marginals`: when T > W, `overlapping_windows` weighted by `overlap_weights`, the log-probabilities
  averaged per token with those weights (their `--scoring-window overlapping`; their default, `optimal`, runs the
  whole protein in one forward beyond the window); else one forward. `pseudo-ppl`: the whole sequence in every copy,
  as `compute_pppl` runs it (a protein over `config.max_protein_length - 2` residues is refused).
  `masked_marginal`: `nv_esm.scoring`'s window of its sites.
- `nv-esm`: `nv_esm.scoring.window_bounds` for every method: W residues between `<cls>` and `<eos>`, centred on the
  positions masked or read (a mutant whose sites span more than W residues is refused by the marginal methods).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial, reduce
from itertools import chain
from typing import Any

import torch

from modeling_nv_esm_batch import protein_residues
from nv_esm.scoring import MaskedCopy, Scorer, Substitution, copy_tokens, parse_mutants, progress_bar, window_bounds
from nv_esm.vocabulary import PROTEINGYM_METHODS, WINDOW_RULES

METHODS = PROTEINGYM_METHODS  # ProteinGym's names, and nv-esm score's joint mask (`nv_esm.vocabulary`)


def optimal_window(position: int, length: int, window: int) -> tuple[int, int]:
    """ProteinGym's `get_optimal_window(position, length, window)`: `[start, stop)` of a token array of `length`
    tokens (`<cls>` and `<eos>` included) for the token `position`: the whole array if it has at most `window`
    tokens, else `window` tokens: the first ones for a position before `window // 2`, the last ones for a position
    in the last `window // 2`, else `[position - window // 2, position + window // 2)`."""
    half = window // 2
    if length <= window:
        return 0, length
    if position < half:
        return 0, window
    if position >= length - half:
        return length - window, length
    return max(0, position - half), min(length, position + half)


def overlap_weights(window: int) -> torch.Tensor:
    """`[window]` float64: ProteinGym's weights of a window's tokens for `wt-marginals` (written there for 1,024
    tokens; their numbers 256, 128, 16 are window/4, window/8, window/64 here): 1, but a sigmoid rising over tokens
    1 .. window/4 (1 / (1 + exp(-(i - window/8) / (window/64)))) and one falling over tokens
    window - 2 - window/4 .. window - 2 (1 / (1 + exp((i - (window - 2) + window/8) / (window/64))))."""
    edge, centre, scale = window // 4, window // 8, window / 64
    weights = torch.ones(window, dtype=torch.float64)
    for i in range(1, edge + 1):
        weights[i] = 1 / (1 + math.exp(-(i - centre) / scale))
    for i in range(window - 2 - edge, window - 1):
        weights[i] = 1 / (1 + math.exp((i - (window - 2) + centre) / scale))
    return weights


def overlapping_windows(length: int, window: int) -> list[tuple[int, int]]:
    """ProteinGym's windows `[start, stop)` of `wt-marginals` over a token array of `length` > `window` tokens: a
    left window from token 0 and a right one ending at the last token, each moved inward by window/2 - 1 (511 for
    1,024) until the left one ends after the right one starts (each pair is run, the last one included); then, if
    that last pair overlaps by fewer than window/2 - 1 tokens, a central window starting at int(length / 2) -
    window/2. A token run by several windows gets the weighted mean of their log-probabilities."""
    step = window // 2 - 1
    left, right = 0, length - window  # starts
    windows = []
    while True:
        windows += [(left, left + window), (right, right + window)]
        if left + window - 1 > right:
            break
        left, right = left + step, right - step
    if (left + window - 1) - right + 1 < step:
        centre = int(length / 2) - window // 2
        windows.append((centre, centre + window))
    return windows


def token_slice(sequence: int, length: int, start: int, stop: int, masked: tuple[int, ...], read: tuple[int, ...]):
    """The `MaskedCopy` of tokens `[start, stop)` of the token array `<cls>` + `length` residues + `<eos>`;
    `masked` and `read` are 0-based residue positions."""
    return MaskedCopy(
        sequence, max(start - 1, 0), min(stop - 1, length), masked, read, bos=start == 0, eos=stop == length + 2
    )


@dataclass
class Assay:
    """One assay: its `DMS_id`, the wild type (`target_seq`), its mutants in ProteinGym's notation (1-based,
    `A24G:K30R`); `names` (per mutant, for errors: its file, row and column) default to `DMS_id[i]`."""

    dms_id: str
    wild_type: str
    mutants: Sequence[str]
    names: Sequence[str] | None = None
    variants: list[tuple[Substitution, ...]] = field(default_factory=list, init=False)

    def parse(self, bad: dict[int, str] | None = None) -> None:
        """Check the wild type and every mutant (`nv_esm.scoring.parse_mutants`: ValueError naming the first bad
        mutant, or with `bad`, every bad mutant's error put there by row, its variant `()`)."""
        self.wild_type = protein_residues(self.wild_type, f"{self.dms_id}: target_seq")
        if self.names is not None and len(self.names) != len(self.mutants):
            raise ValueError(f"{self.dms_id}: {len(self.names)} names for {len(self.mutants)} mutants.")
        self.names = self.names or RowNames(lambda i: f"{self.dms_id}[{i}]", len(self.mutants))
        self.variants = parse_mutants(self.mutants, self.wild_type, self.names, bad)


class RowNames(Sequence[str]):
    """Per row `i`, the name `name(i)` (for an error message), made only when asked for: an assay of half a million
    mutants would otherwise format as many strings that no error needs."""

    def __init__(self, name: Callable[[int], str], count: int) -> None:
        self.name, self.count = name, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.name(i) for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        return self.name(index % self.count)


def mutated_sequence(wild_type: str, substitutions: Sequence[Substitution]) -> str:
    """The wild type with `substitutions` applied."""
    residues = list(wild_type)
    for s in substitutions:
        residues[s.position - 1] = s.mutant
    return "".join(residues)


def check_assay(
    assay: Assay, methods: Sequence[str], windows: str, window: int, longest: int, bad: dict[int, str] | None = None
) -> None:
    """ValueError naming the mutant (`Assay.names`) for what `methods` cannot score: a mutant whose sites span more
    than `window` residues where one forward holds them all (`masked_marginal`; `wt-marginals` with nv-esm
    windows), and, with ProteinGym's windows, `pseudo-ppl` of a protein over `longest` residues
    (`config.max_protein_length - 2`: it runs whole). With `bad`, a mutant's error is put there by row instead (a
    row already there, or without substitutions, is not checked), and only the whole assay's raises."""
    if "pseudo-ppl" in methods and windows == "proteingym" and len(assay.wild_type) > longest:
        raise ValueError(
            f"{assay.dms_id}: pseudo-ppl runs the whole mutated sequence (as ProteinGym's compute_pppl) and its "
            f"{len(assay.wild_type)} residues are over config.max_protein_length - 2 ({longest}); use nv-esm windows."
        )
    joint = [m for m in methods if m == "masked_marginal" or (m == "wt-marginals" and windows == "nv-esm")]
    for i, variant in enumerate(assay.variants) if joint else ():
        if not variant:  # a bad row (`Assay.parse` with `bad`)
            continue
        try:
            window_bounds(len(assay.wild_type), variant[0].position - 1, variant[-1].position - 1, window)
        except ValueError as error:
            message = f"{assay.names[i]}: {error} {joint[0]} scores a mutant in one forward."
            if bad is None:
                raise ValueError(message) from None
            bad.setdefault(i, message)


class Plan:
    """The masked copies that `methods` need for `assays` (each `Assay.parse`d), deduplicated across assays and
    methods, and how each score reads their log-probabilities back. `run` scores them in one packed pass."""

    def __init__(self, scorer: Scorer, assays: Sequence[Assay], methods: Sequence[str], windows: str) -> None:
        if windows not in WINDOW_RULES:
            raise ValueError(f"windows must be one of {', '.join(WINDOW_RULES)}; got {windows!r}.")
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise ValueError(f"methods must be among {', '.join(METHODS)}; got {list(methods)!r}.")
        self.scorer, self.assays, self.methods, self.windows = scorer, assays, tuple(methods), windows
        for assay in assays:
            check_assay(assay, methods, windows, scorer.window, scorer.model.config.max_protein_length - 2)
        self.sequences: list[str] = []
        self.copies: list[MaskedCopy] = []
        self._sequence_of: dict[str, int] = {}
        self._copy_of: dict[tuple, int] = {}
        self._reads: list[dict[int, None]] = []  # per copy: the residues it reads (ordered)
        self.pll_targets: dict[int, tuple[int, str]] = {}  # pseudo-ppl copy -> (its sequence, the letter read)
        # per (assay, method): a joint method's terms per mutant [(weights [(copy, weight)], substitution)], or a
        # per-site method's weights per distinct substitution (every mutant holding it reads the same copies)
        self._terms: dict[tuple[int, str], list[list[tuple[list[tuple[int, float]], Substitution]]]] = {}
        self._site_terms: dict[tuple[int, str], dict[Substitution, list[tuple[int, float]]]] = {}
        self._plls: dict[tuple[int, int], int] = {}  # (assay, mutant) -> sequence of its pseudo-ppl
        self._weights: list[float] | None = None  # overlap_weights(window), once
        self._sites: dict[tuple[str, int, int], list[tuple[int, float]]] = {}  # (method, sequence, residue) -> copies
        for a, assay in enumerate(assays):
            for method in self.methods:
                if method == "pseudo-ppl":
                    for m, variant in enumerate(assay.variants):
                        self._plls[a, m] = self._pseudo_ppl_sequence(mutated_sequence(assay.wild_type, variant))
                elif self._joint(method):
                    self._terms[a, method] = [self._marginal_copies(assay, v, method) for v in assay.variants]
                else:
                    sequence, length = self._sequence(assay.wild_type), len(assay.wild_type)
                    distinct = dict.fromkeys(s for variant in assay.variants for s in variant)
                    self._site_terms[a, method] = {
                        s: self._site(method, sequence, length, s.position - 1) for s in distinct
                    }
        self.copies = [
            MaskedCopy(c.sequence, c.start, c.stop, c.masked, tuple(sorted(reads)), c.bos, c.eos)
            for c, reads in zip(self.copies, self._reads)
        ]

    def tokens(self) -> int:
        """Tokens the pass runs through the model (its progress bar's total)."""
        return copy_tokens(self.copies)

    def _sequence(self, residues: str) -> int:
        if residues not in self._sequence_of:
            self._sequence_of[residues] = len(self.sequences)
            self.sequences.append(residues)
        return self._sequence_of[residues]

    def _copy(self, key: tuple, make: Callable[[], MaskedCopy], read: int) -> int:
        """The index of the copy `key` (made by `make` the first time), reading residue `read` too."""
        index = self._copy_of.get(key)
        if index is None:
            index = self._copy_of[key] = len(self.copies)
            self.copies.append(make())
            self._reads.append({})
        self._reads[index][read] = None
        return index

    def _marginal_copies(self, assay: Assay, variant: tuple[Substitution, ...], method: str) -> list:
        """A joint method's terms (`_joint`): per site of `variant`, ([(the variant's one copy, 1.0)], the
        substitution)."""
        sequence, length, window = self._sequence(assay.wild_type), len(assay.wild_type), self.scorer.window
        sites = tuple(s.position - 1 for s in variant)
        start, stop = window_bounds(length, sites[0], sites[-1], window)
        masked = sites if method == "masked_marginal" else ()
        key = (sequence, start, stop, masked, True, True)
        return [([(self._copy(key, partial(MaskedCopy, sequence, start, stop, masked, ()), p), 1.0)], s)
                for p, s in zip(sites, variant)]  # fmt: skip

    def _joint(self, method: str) -> bool:
        """Whether `method` reads all sites of a mutant from one copy (`masked_marginal`'s joint mask;
        `wt-marginals` in nv-esm windows), rather than each site from the copies of its own residue."""
        return method == "masked_marginal" or (method == "wt-marginals" and self.windows == "nv-esm")

    def _site(self, method: str, sequence: int, length: int, p: int) -> list[tuple[int, float]]:
        """[(copy, weight)] of residue `p` of a wild type by a per-site `method` (the same for every mutant)."""
        key = (method, sequence, p)
        if key in self._sites:
            return self._sites[key]
        window = self.scorer.window
        if method == "wt-marginals":
            found = self._overlap_terms(sequence, length, p)
        elif self.windows == "nv-esm":
            start, stop = window_bounds(length, p, p, window)
            found = [(self._copy((sequence, start, stop, (p,), True, True),
                                 partial(MaskedCopy, sequence, start, stop, (p,), ()), p), 1.0)]  # fmt: skip
        else:
            start, stop = optimal_window(p + 1, length + 2, window)
            found = [(self._copy((sequence, start, stop, (p,), "tokens"),
                                 partial(token_slice, sequence, length, start, stop, (p,), ()), p), 1.0)]  # fmt: skip
        self._sites[key] = found
        return found

    def _overlap_terms(self, sequence: int, length: int, position: int) -> list[tuple[int, float]]:
        """[(copy, weight)] of the unmasked windows holding residue `position`, the weights normalised to sum 1."""
        window, tokens = self.scorer.window, length + 2
        if tokens <= window:
            key = (sequence, 0, tokens, (), "tokens")
            return [(self._copy(key, partial(token_slice, sequence, length, 0, tokens, (), ()), position), 1.0)]
        if self._weights is None:
            self._weights = overlap_weights(window).tolist()
        found = []
        for start, stop in overlapping_windows(tokens, window):
            if start <= position + 1 < stop:
                key = (sequence, start, stop, (), "tokens")
                copy = self._copy(key, partial(token_slice, sequence, length, start, stop, (), ()), position)
                found.append((copy, self._weights[position + 1 - start]))
        total = sum(weight for _, weight in found)
        return [(copy, weight / total) for copy, weight in found]

    def _pseudo_ppl_sequence(self, residues: str) -> int:
        sequence = self._sequence(residues)
        if ("pseudo-ppl", sequence) in self._copy_of:
            return sequence
        self._copy_of["pseudo-ppl", sequence] = -1
        length = len(residues)
        for token in range(1, length - 1):  # compute_pppl's range(1, len(sequence) - 1): residue token - 1 masked
            masked = token - 1
            start, stop = (0, length)
            if self.windows == "nv-esm":
                start, stop = window_bounds(length, masked, masked, self.scorer.window)
            self.pll_targets[len(self.copies)] = (sequence, residues[token])
            self._reads.append({masked: None})
            self.copies.append(MaskedCopy(sequence, start, stop, (masked,), ()))
        return sequence

    def run(self, progress: Any = None) -> list[dict[str, torch.Tensor]]:
        """Run the copies (packed, length-sorted: `Scorer.log_probs`); per assay {method: `[M]` float64 scores}."""
        return run_plans([self], progress)[0]

    def scores(self, rows: dict[tuple[int, int], list[float]], plls: list[float]) -> list[dict[str, torch.Tensor]]:
        """Per assay {method: `[M]` float64 scores}, from `rows[copy, residue]` (`[vocab]` log-probabilities) and
        the pseudo-ppl of each sequence (`plls`)."""
        ids = self.scorer.letter_ids
        results = []
        for a, assay in enumerate(self.assays):
            scores = {}
            for method in self.methods:
                if method == "pseudo-ppl":
                    values = [plls[self._plls[a, m]] for m in range(len(assay.variants))]
                elif self._joint(method):
                    values = [_marginal_score(rows, terms, ids) for terms in self._terms[a, method]]
                else:
                    values = _site_scores(rows, self._site_terms[a, method], assay.variants, ids)
                scores[method] = torch.tensor(values, dtype=torch.float64)
            results.append(scores)
        return results


def run_plans(plans: Sequence[Plan], progress: Any = None) -> list[list[dict[str, torch.Tensor]]]:
    """Run the copies of every plan (of one `Scorer`) in one packed pass; per plan, `Plan.scores`."""
    scorer = plans[0].scorer
    sequences, copies, owners = [], [], []  # owners: per copy, (its plan, its index there)
    for k, plan in enumerate(plans):
        offset = len(sequences)
        sequences += [scorer.encode(residues) for residues in plan.sequences]
        copies += [dataclasses.replace(copy, sequence=copy.sequence + offset) for copy in plan.copies]
        owners += [(k, index) for index in range(len(plan.copies))]
    rows: list[dict[tuple[int, int], list[float]]] = [{} for _ in plans]
    plls = [[0.0] * len(plan.sequences) for plan in plans]
    for batch, log_probs in scorer.log_probs(sequences, copies, progress):
        values, offset = log_probs.tolist(), 0
        for index in batch:
            (k, local), read = owners[index], copies[index].read
            target = plans[k].pll_targets.get(local)
            if target is not None:
                plls[k][target[0]] += values[offset][scorer.letter_ids[target[1]]]
            else:
                rows[k].update({(local, position): values[offset + j] for j, position in enumerate(read)})
            offset += len(read)
    return [plan.scores(rows[k], plls[k]) for k, plan in enumerate(plans)]


def _site_scores(
    rows: dict[tuple[int, int], list[float]],
    site_terms: dict[Substitution, list[tuple[int, float]]],
    variants: list[tuple[Substitution, ...]],
    ids: dict[str, int],
) -> list[float]:
    """A per-site method's score of each variant, as `_marginal_score` gives it, with each distinct substitution's
    terms (per copy of its residue, weight x (log p(mutant letter) - log p(wild-type letter))) computed once: a
    score adds its sites' terms from 0.0 one by one, in `_marginal_score`'s order (`sum` would not: Python >= 3.12
    compensates float sums)."""
    terms = {
        s: [
            weight * (rows[c, s.position - 1][ids[s.mutant]] - rows[c, s.position - 1][ids[s.wild_type]])
            for c, weight in weights
        ]
        for s, weights in site_terms.items()
    }
    single = {s: reduce(operator.add, values, 0.0) for s, values in terms.items()}
    return [
        single[v[0]] if len(v) == 1 else reduce(operator.add, chain.from_iterable(map(terms.__getitem__, v)), 0.0)
        for v in variants
    ]


def _marginal_score(rows: dict[tuple[int, int], list[float]], terms: list, ids: dict[str, int]) -> float:
    """sum over a mutant's sites of log p(mutant letter) - log p(wild-type letter), each log-probability the
    weighted mean of its copies' (`rows[copy, position]`: `[vocab]` log-probabilities)."""
    total = 0.0
    for weights, s in terms:
        for copy, weight in weights:
            values = rows[copy, s.position - 1]
            total += weight * (values[ids[s.mutant]] - values[ids[s.wild_type]])
    return total


def score_assays(
    model: Any,
    tokenizer: Any,
    assays: Sequence[Assay],
    methods: Sequence[str] = ("masked-marginals",),
    *,
    windows: str = "proteingym",
    window: int | None = None,
    max_tokens_per_batch: int = 16384,
    show_progress: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """Scores of every mutant of every assay by each of `methods` (see the module's docstring), the masked copies of
    all assays packed in one pass: {DMS_id: {method: `[M]` float64, in the assay's order}}.

    Args:
        model: `NVEsmForMaskedLM` in eval mode.
        tokenizer: The checkpoint's ESM tokenizer.
        assays: `Assay`s (distinct `dms_id`s); a mutant whose wild-type letter differs from `wild_type`, or a
            position outside it, raises ValueError naming it.
        methods: Among `METHODS`.
        windows: `proteingym` (their windows) or `nv-esm` (`nv_esm.scoring`'s).
        window: W (default `nv_esm.scoring.default_window(model.config)`: 1,024 for ESM-2).
        max_tokens_per_batch: Token budget of one packed batch.
        show_progress: A progress bar over the tokens of the copies.
    """
    ids = [assay.dms_id for assay in assays]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"DMS_id {repeated[0]!r} is given twice; each assay needs an id of its own.")
    scorer = Scorer(model, tokenizer, window, max_tokens_per_batch)
    for assay in assays:
        assay.parse()
    plan = Plan(scorer, assays, methods, windows)
    with progress_bar(plan.tokens(), "proteingym", not show_progress) as progress:
        return dict(zip(ids, plan.run(progress)))
