"""Variant scores and pseudo-log-likelihoods (`nv_esm.scoring`, `nv-esm score`) against transformers.

The reference runs transformers' `EsmForMaskedLM` (fp32, CPU, eager attention) on one masked copy at a time and is
written here from the documented rules, independently of the package's planning: the window of a long protein is
`[s, s + WINDOW)`, s = clip(ceil((first + last) / 2) - WINDOW // 2, 0, L - WINDOW) of the positions masked or read;
log-probabilities are the full-vocabulary log-softmax. The random checkpoints have `max_position_embeddings` 26, so
their window is 24 residues and windowed proteins stay cheap. Tolerances: every log-probability (and so every
marginal score, a sum of a few of their differences) within ATOL_FP32 = 1e-5; a PLL sums L of them, so it is
compared within L x ATOL_FP32 (observed: ~1e-5 at L = 60).
"""

from __future__ import annotations

import ast
import csv
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch
from transformers import EsmForMaskedLM

import convert_checkpoint
from conftest import ATOL_FP32, make_hf_model, make_nv_model
from convert_helpers import save_hf
from nv_esm import job_clock, rank_statistics, score, scoring
from nv_esm.alphabet import CLS, EOS, MASK, RESIDUE_TO_ID, STANDARD_AMINO_ACIDS
from nv_esm.embed_model import load_config

WINDOW = 24  # max_position_embeddings - 2 of the random checkpoints below
CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


@pytest.fixture(scope="module")
def reference() -> EsmForMaskedLM:
    return make_hf_model("tiny", seed=31, max_position_embeddings=WINDOW + 2, attn_implementation="eager")


@pytest.fixture(scope="module")
def model(reference):
    return make_nv_model(reference)


@pytest.fixture(scope="module")
def checkpoint(reference, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("score")
    source = save_hf(make_hf_model("tiny", seed=31, max_position_embeddings=WINDOW + 2), work / "hf")
    assert convert_checkpoint.main(["hf-to-te", str(source), str(work / "nv")]) == 0
    return work / "nv"


def random_sequence(length: int, generator: torch.Generator) -> str:
    return "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (length,), generator=generator))


# ---- the reference: transformers, one masked copy at a time --------------------------------------------------


def reference_log_probs(
    hf: EsmForMaskedLM, sequence: str, masked: list[int], positions: list[int], window: int = WINDOW
) -> dict:
    """{position: [33] log-probabilities (float64, CPU)} at 0-based `positions`, from one forward (on `hf`'s device)
    of the `window` residues around them with `masked` replaced by <mask>."""
    length = len(sequence)
    start = 0
    if length > window:
        centre = -(-(min(positions) + max(positions)) // 2)
        start = min(max(centre - window // 2, 0), length - window)
    residues = sequence[start : start + window]
    ids = [CLS, *(RESIDUE_TO_ID[letter] for letter in residues.upper()), EOS]
    for position in masked:
        ids[1 + position - start] = MASK
    with torch.no_grad():
        log_probs = hf(torch.tensor([ids], device=hf.device)).logits[0].float().log_softmax(-1).double().cpu()
    return {position: log_probs[1 + position - start] for position in positions}


def reference_per_position(hf: EsmForMaskedLM, sequence: str, window: int = WINDOW) -> torch.Tensor:
    sequence = sequence.upper()
    return torch.tensor(
        [
            reference_log_probs(hf, sequence, [i], [i], window)[i][RESIDUE_TO_ID[sequence[i]]]
            for i in range(len(sequence))
        ],
        dtype=torch.float64,
    )


def reference_score(hf: EsmForMaskedLM, wild_type: str, mutant: str, method: str, window: int = WINDOW) -> float:
    changes = [(part[0], int(part[1:-1]) - 1, part[-1]) for part in mutant.split(":")]
    positions = [position for _, position, _ in changes]
    if method == "pseudo_likelihood":
        mutated = list(wild_type)
        for _, position, letter in changes:
            mutated[position] = letter
        mutant_pll = reference_per_position(hf, "".join(mutated), window).sum()
        return (mutant_pll - reference_per_position(hf, wild_type, window).sum()).item()
    log_probs = reference_log_probs(hf, wild_type, positions if method == "masked_marginal" else [], positions, window)
    return sum((log_probs[p][RESIDUE_TO_ID[new]] - log_probs[p][RESIDUE_TO_ID[old]]).item() for old, p, new in changes)


def random_mutants(
    wild_type: str, generator: torch.Generator, count: int, most: int = 3, window: int = WINDOW
) -> list[str]:
    """Singles (two at one position, so they share a forward), and multi-mutants within one window."""
    mutants = []
    for number in range(count):
        changes = (
            1
            if number < count // 2 or len(wild_type) < 2
            else int(torch.randint(2, most + 1, (1,), generator=generator))
        )
        first = int(torch.randint(0, len(wild_type), (1,), generator=generator))
        span = range(first, min(len(wild_type), first + window))
        picks = sorted(
            {first, *(span[int(i)] for i in torch.randint(0, len(span), (changes - 1,), generator=generator))}
        )
        parts = []
        for position in picks:
            new = STANDARD_AMINO_ACIDS[int(torch.randint(0, 20, (1,), generator=generator))]
            parts.append(f"{wild_type[position]}{position + 1}{new}")
        mutants.append(":".join(parts))
    mutants.append(mutants[0][:-1] + ("A" if mutants[0][-1] != "A" else "C"))  # a second single at one position
    return mutants


# ---- the Python API ----------------------------------------------------------------------------------------------


def test_pseudo_log_likelihood_matches_transformers(model, reference, tokenizer):
    """1 residue, short, exactly the window, one more (windowed), long windowed and random lengths; lower case;
    a small token budget, so copies of several proteins share batches and proteins span batches."""
    generator = torch.Generator().manual_seed(40)
    lengths = [1, 2, WINDOW, WINDOW + 1, 61, *torch.randint(3, 40, (3,), generator=generator).tolist()]
    sequences = [random_sequence(n, generator) for n in lengths]
    sequences[2] = sequences[2].lower()
    results = scoring.pseudo_log_likelihood(model, sequences, tokenizer, per_position=True, max_tokens_per_batch=97)
    for sequence, result in zip(sequences, results):
        expected = reference_per_position(reference, sequence)
        assert result.per_position.shape == (len(sequence),)
        assert (result.per_position - expected).abs().max().item() <= ATOL_FP32, len(sequence)
        assert abs(result.pll - expected.sum().item()) <= ATOL_FP32 * len(sequence)
        assert result.pseudo_perplexity == pytest.approx(math.exp(-result.pll / len(sequence)), rel=1e-12)
    assert scoring.pseudo_log_likelihood(model, sequences[:1], tokenizer)[0].per_position is None


@pytest.mark.parametrize("length", [1, 17, WINDOW, 70], ids=["one_residue", "short", "exactly_max", "windowed"])
def test_each_method_matches_transformers(model, reference, tokenizer, length):
    generator = torch.Generator().manual_seed(41 + length)
    wild_type = random_sequence(length, generator)
    mutants = random_mutants(wild_type, generator, 6)
    if length == 70:  # the two ends and a double reaching across the middle of the protein
        mutants += [f"{wild_type[0]}1W", f"{wild_type[69]}70W", f"{wild_type[30]}31A:{wild_type[50]}51C"]
    for method in scoring.METHODS:
        ours = scoring.score_variants(model, wild_type.lower(), mutants, tokenizer, method, max_tokens_per_batch=80)
        expected = torch.tensor([reference_score(reference, wild_type, m, method) for m in mutants])
        tolerance = ATOL_FP32 * (2 * length if method == "pseudo_likelihood" else 1)
        assert ours.dtype == torch.float64 and ours.shape == (len(mutants),)
        assert (ours - expected).abs().max().item() <= tolerance, method


def test_the_window_rule():
    assert scoring.window_bounds(20, 3, 7, 24) == (0, 20)
    assert scoring.window_bounds(24, 0, 23, 24) == (0, 24)
    assert scoring.window_bounds(100, 0, 0, 24) == (0, 24)
    assert scoring.window_bounds(100, 50, 50, 24) == (38, 62)  # 12 residues before the position
    assert scoring.window_bounds(100, 99, 99, 24) == (76, 100)
    assert scoring.window_bounds(100, 50, 50, 25) == (38, 63)
    for window in (1, 2, 5, 24):
        for first in range(0, 40):
            for last in range(first, min(40, first + window)):
                start, stop = scoring.window_bounds(40, first, last, window)
                assert stop - start == window and start <= first and last < stop
    with pytest.raises(ValueError, match="positions 11 to 35 span more than the 24-residue window"):
        scoring.window_bounds(100, 10, 34, 24)


def test_bad_mutants_are_named_with_their_row_and_position(model, tokenizer):
    wild_type = "MK" + random_sequence(297, torch.Generator().manual_seed(42)) + "A" + "L" * 29  # 329 residues
    cases = {
        "A2G": "mutants[1]: mutant 'A2G' says position 2 is 'A', but the wild type has 'K' there.",
        "M0A": "mutants[1]: position 0 of mutant 'M0A' is outside the wild type (1 to 329).",
        "K2": "mutants[1]: 'K2' in mutant 'K2' is not a substitution such as 'A24G'",
        "K2J": "mutants[1]: mutant letter 'J' at position 2 of 'K2J' is not a residue of ESM-2's alphabet.",
        "K2A:K2G": "mutants[1]: mutant 'K2A:K2G' changes position 2 twice.",
        "": "mutants[1]: no mutant",
        "M1A:A300G": "mutants[1]: mutant 'M1A:A300G': positions 1 to 300 span more than the 24-residue window.",
    }
    for mutant, message in cases.items():
        with pytest.raises(ValueError) as error:
            scoring.score_variants(model, wild_type, ["K2A", mutant], tokenizer)
        assert message in str(error.value), mutant
    span = scoring.score_variants(
        model, wild_type[:40], [f"M1A:{wild_type[39]}40A"], tokenizer, "pseudo_likelihood", window=8
    )
    assert span.shape == (1,)  # PLLs window each residue: any span is fine
    assert scoring.score_variants(model, wild_type, [], tokenizer).shape == (0,)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parsing_a_whole_assay_equals_parsing_each_mutant(seed):
    """`parse_mutants` (an assay's mutants at once) gives each row what `parse_mutant` gives it alone, for random
    singles and multiples (2 to 5 sites, in any order, either case, leading zeros), and for a table with one bad row
    the error `parse_mutant` raises for the first bad row (with its name)."""
    generator = torch.Generator().manual_seed(seed)
    wild_type = random_sequence(int(torch.randint(1, 60, (1,), generator=generator)), generator)
    letters = STANDARD_AMINO_ACIDS

    def site(position: int) -> str:
        text = f"{wild_type[position]}{'0' * int(torch.randint(0, 2, (1,), generator=generator))}{position + 1}"
        text += letters[int(torch.randint(len(letters), (1,), generator=generator))]
        return text.lower() if torch.rand(1, generator=generator) < 0.1 else text

    mutants = []
    for _ in range(int(torch.randint(1, 400, (1,), generator=generator))):
        sites = min(len(wild_type), int(torch.randint(1, 6, (1,), generator=generator)))
        positions = torch.randperm(len(wild_type), generator=generator)[:sites].tolist()
        mutants.append(":".join(site(position) for position in positions))
    names = [f"row {i}" for i in range(len(mutants))]
    expected = [scoring.parse_mutant(mutant, wild_type, name) for mutant, name in zip(mutants, names)]
    assert scoring.parse_mutants(mutants, wild_type, names) == expected
    assert scoring.parse_mutants(numpy.array(mutants), wild_type, names) == expected  # a column as an array
    assert scoring.parse_mutants(mutants[:1], wild_type, names) == expected[:1]
    assert scoring.parse_mutants([], wild_type, []) == []
    first = f"{wild_type[0]}1A"
    other = next((m for m, sites in zip(mutants, expected) if all(s.position > 1 for s in sites)), None)
    for unusual in (f" {first}", f"{first}\t", *([f"{other} : {first}"] if other else [])):
        row = int(torch.randint(len(mutants) + 1, (1,), generator=generator))
        table = [*mutants[:row], unusual, *mutants[row:]]
        names = [f"row {i}" for i in range(len(table))]
        alone = [scoring.parse_mutant(mutant, wild_type, name) for mutant, name in zip(table, names)]
        assert scoring.parse_mutants(table, wild_type, names) == alone  # spaces: each row parsed on its own
    bad_rows = [f"{first}:{first.lower()}", "X1A", f"{wild_type[0]}{len(wild_type) + 1}A", "", None]
    for bad in bad_rows:
        row = int(torch.randint(len(mutants) + 1, (1,), generator=generator))
        table = [*mutants[:row], bad, *mutants[row:]]
        table_names = [f"row {i}" for i in range(len(table))]
        with pytest.raises(ValueError) as alone:
            for mutant, name in zip(table, table_names):
                scoring.parse_mutant(mutant, wild_type, name)  # type: ignore[arg-type]
        with pytest.raises(ValueError) as together:
            scoring.parse_mutants(table, wild_type, table_names)  # type: ignore[arg-type]
        assert str(together.value) == str(alone.value) and f"row {row}:" in str(alone.value), bad


def test_the_api_refuses_what_it_cannot_score(model, reference, tokenizer):
    for other in (model.esm, reference):  # the base model; transformers' model (it would read a packed row as one)
        with pytest.raises(TypeError, match="needs an NVEsm masked-LM model"):
            scoring.pseudo_log_likelihood(other, ["MKV"], tokenizer)
    with pytest.raises(ValueError, match="takes a list of proteins"):
        scoring.pseudo_log_likelihood(model, "MKV", tokenizer)
    with pytest.raises(ValueError, match="takes a list of mutants"):
        scoring.score_variants(model, "MKV", "M1A", tokenizer)
    with pytest.raises(ValueError, match="window must be 1 to 8190 residues"):
        scoring.pseudo_log_likelihood(model, ["MKV"], tokenizer, window=0)
    with pytest.raises(ValueError, match="method must be one of"):
        scoring.score_variants(model, "MKV", ["M1A"], tokenizer, "masked_marginals")
    with pytest.raises(ValueError, match="sequences\\[1\\]: 'J' at residue 2"):
        scoring.pseudo_log_likelihood(model, ["MKV", "MJ"], tokenizer)
    model.train()
    try:
        with pytest.raises(ValueError, match="call model.eval"):
            scoring.pseudo_log_likelihood(model, ["MKV"], tokenizer)
    finally:
        model.eval()


def one_line_error(kind: type[Exception], call: Callable[[], Any], *pattern: str) -> str:
    """The message of the `kind` error that `call()` raises: one line, holding each of `pattern`."""
    with pytest.raises(kind) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message and all(text in message for text in pattern), message
    return message


def test_the_api_names_an_argument_of_the_wrong_kind(model, tokenizer):
    """A float `window` (even a whole one), a NaN or float `max_tokens_per_batch`, a `tokenizer` that is none: a
    one-line error naming the argument, from both functions, instead of a traceback from deep inside."""
    generator = torch.Generator().manual_seed(48)
    wild_type = random_sequence(int(torch.randint(5, 40, (1,), generator=generator)), generator)
    window = int(torch.randint(1, WINDOW, (1,), generator=generator))
    calls = [
        partial(scoring.pseudo_log_likelihood, model, [wild_type]),
        partial(scoring.score_variants, model, wild_type, [f"{wild_type[0]}1A"]),
    ]
    for call in calls:
        for bad in (window + 0.5, float(window)):
            expected = f"window must be a whole number of residues, got {bad!r}."
            one_line_error(ValueError, partial(call, tokenizer=tokenizer, window=bad), expected)
        for bad in (math.nan, 4096.0, None):
            expected = f"max_tokens_per_batch must be a whole number of tokens, got {bad!r}."
            one_line_error(ValueError, partial(call, tokenizer=tokenizer, max_tokens_per_batch=bad), expected)
        for bad in (None, "esm2_t6_8M_UR50D"):
            expected = "tokenizer must be the checkpoint's ESM tokenizer "
            expected += f"(AutoTokenizer.from_pretrained(folder, trust_remote_code=True)), got {type(bad).__name__}."
            one_line_error(TypeError, partial(call, tokenizer=bad), expected)
        call(tokenizer=tokenizer, window=window, max_tokens_per_batch=window + 2)  # whole numbers: fine


def long_number(digits: int, generator: torch.Generator) -> str:
    """A random number of `digits` digits (no leading zero)."""
    return "".join(
        str(int(d))
        for d in [
            torch.randint(1, 10, (1,), generator=generator),
            *torch.randint(0, 10, (digits - 1,), generator=generator),
        ]
    )


def test_a_position_of_thousands_of_digits_is_outside_the_wild_type(model, tokenizer):
    """Too long for int() (Python refuses 4,300 digits and more): named as outside the wild type, in a short line;
    leading zeros are no part of the number."""
    generator = torch.Generator().manual_seed(49)
    wild_type = random_sequence(30, generator)
    position = long_number(5000, generator)
    mutant = f"{wild_type[0]}{position}A"
    message = one_line_error(
        ValueError,
        lambda: scoring.score_variants(model, wild_type, [f"{wild_type[1]}2C", mutant], tokenizer),
        f"mutants[1]: position {position[:40]}... (5000 characters) of mutant {mutant[:40]!r}... (5002 characters) "
        "is outside the wild type (1 to 30).",
    )
    assert len(message) < 300
    padded = scoring.score_variants(model, wild_type, [f"{wild_type[4]}{'0' * 5000}5A"], tokenizer)
    assert torch.equal(padded, scoring.score_variants(model, wild_type, [f"{wild_type[4]}5A"], tokenizer))


def count_forwards(model) -> tuple[list[int], object]:
    """`([n], handle)`: n counts the masked copies (packed proteins) that `model.esm` has run since."""
    copies = [0]

    def hook(module, args, kwargs):
        copies[0] += len(kwargs["cu_seq_lens_q"]) - 1

    return copies, model.esm.register_forward_pre_hook(hook, with_kwargs=True)


def test_singles_at_one_site_share_one_forward(model, reference, tokenizer):
    """masked_marginal: one masked copy per set of mutated positions (a site-saturation scan costs one per site),
    here each copy in a forward of its own; wildtype_marginal: one unmasked copy per window."""
    wild_type = random_sequence(17, torch.Generator().manual_seed(43))
    singles = [f"{wild_type[p]}{p + 1}{new}" for p in (4, 8) for new in STANDARD_AMINO_ACIDS]
    mutants = [*singles, f"{wild_type[4]}5A:{wild_type[8]}9C"]
    copies, handle = count_forwards(model)
    calls = [0]
    counter = model.esm.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        ours = scoring.score_variants(model, wild_type, mutants, tokenizer, max_tokens_per_batch=len(wild_type) + 2)
        assert copies[0] == calls[0] == 3  # sites 5, 9 and the double
        scoring.score_variants(model, wild_type, mutants, tokenizer, "wildtype_marginal")
        assert copies[0] == 4
    finally:
        handle.remove()
        counter.remove()
    expected = torch.tensor([reference_score(reference, wild_type, m, "masked_marginal") for m in mutants])
    assert (ours - expected).abs().max().item() <= ATOL_FP32


def test_a_synonymous_mutant_reuses_the_wild_type(model, tokenizer):
    """pseudo_likelihood: a mutant equal to the wild type (K2K) scores exactly 0 without a PLL of its own; a
    synonymous substitution beside a real one changes nothing."""
    wild_type = "MK" + random_sequence(15, torch.Generator().manual_seed(44))
    copies, handle = count_forwards(model)
    try:
        scores = scoring.score_variants(
            model, wild_type, ["K2K", "K2A", "K2A:M1M", "M1M:K2K"], tokenizer, "pseudo_likelihood"
        )
    finally:
        handle.remove()
    assert copies[0] == 2 * len(wild_type)  # the wild type's and K2A's masked copies only
    assert scores[0].item() == 0.0 and scores[3].item() == 0.0 and scores[1].item() == scores[2].item() != 0.0
    for method in scoring.MARGINAL_METHODS:
        assert scoring.score_variants(model, wild_type, ["K2K"], tokenizer, method).item() == 0.0


def test_the_wild_type_pll_runs_in_batches_of_its_own(model, tokenizer, monkeypatch):
    """pseudo_likelihood: no packed batch mixes the wild type's masked copies with a mutant's, so the wild type's
    PLL (every score's baseline) comes out the same in each call, i.e. in each part of `nv-esm score` (in bf16 or
    FP8 a copy's values depend on what shares its batch)."""
    wild_type = "M" + random_sequence(11, torch.Generator().manual_seed(45))
    batches, real = [], scoring.Scorer._launch

    def launch(self, sequences, copies, batch):
        batches.append({(len(sequences), copies[index].sequence) for index in batch})
        return real(self, sequences, copies, batch)

    monkeypatch.setattr(scoring.Scorer, "_launch", launch)
    scorer = scoring.Scorer(model, tokenizer, max_tokens_per_batch=10**6)  # room for every copy in one batch
    mutant = scoring.parse_mutant("M1A", wild_type, "row 0")
    scorer.variant_scores(scorer.encode(wild_type), [mutant], "pseudo_likelihood")
    assert batches == [{(1, 0)}, {(1, 0)}], batches  # the wild type alone, then the mutant alone


class RecordingBar:
    """Stands in for tqdm: records the total, the unit and every update (whether or not the bar is shown)."""

    def __init__(self, bars: list, total: int | None = None, unit: str = "it", **kwargs) -> None:
        self.total, self.unit, self.updates = total, unit, []
        bars.append(self)

    @property
    def n(self) -> int:
        return sum(self.updates)

    def update(self, count: int) -> None:
        assert count > 0 and self.n + count <= self.total, (self.updates, count, self.total)
        self.updates.append(count)

    def close(self) -> None:
        pass

    def __enter__(self) -> RecordingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def bars(monkeypatch) -> list[RecordingBar]:
    """The progress bars that scoring opens, recorded."""
    recorded: list[RecordingBar] = []
    monkeypatch.setattr(job_clock, "WholeBar", lambda **kwargs: RecordingBar(recorded, **kwargs))
    return recorded


def expected_tokens(wild_type: str, mutants: list[str], method: str, window: int = WINDOW) -> int:
    """The tokens the documented rules run through the model for `mutants` of `wild_type` (each masked copy: its
    window's residues, <cls> and <eos>): masked_marginal one copy per set of mutated positions, wildtype_marginal one
    per window, pseudo_likelihood L copies of the wild type and of each distinct mutant sequence."""
    length = len(wild_type)
    per_copy = min(length, window) + 2
    changes = [[(int(part[1:-1]) - 1, part[-1]) for part in mutant.split(":")] for mutant in mutants]
    if method == "pseudo_likelihood":
        sequences = {wild_type}
        for change in changes:
            mutated = list(wild_type)
            for position, letter in change:
                mutated[position] = letter
            sequences.add("".join(mutated))
        return len(sequences) * length * per_copy
    if method == "masked_marginal":
        return len({tuple(position for position, _ in change) for change in changes}) * per_copy
    starts = set()
    for change in changes:
        first, last = change[0][0], change[-1][0]
        centre = -(-(first + last) // 2)
        starts.add(0 if length <= window else min(max(centre - window // 2, 0), length - window))
    return len(starts) * per_copy


def mutants_with_repeats(wild_type: str, generator: torch.Generator) -> list[str]:
    """Random mutants, one of them twice, and a synonymous one (equal to the wild type: no PLL of its own)."""
    mutants = random_mutants(wild_type, generator, 9)
    return [*mutants, mutants[3], f"{wild_type[2]}3{wild_type[2]}"]


@pytest.mark.parametrize("length", [17, 40], ids=["short", "windowed"])
def test_the_api_progress_bar_counts_tokens_and_ends_at_its_total(model, tokenizer, bars, length):
    generator = torch.Generator().manual_seed(46 + length)
    wild_type = random_sequence(length, generator)
    mutants = mutants_with_repeats(wild_type, generator)
    for method in scoring.METHODS:
        scoring.score_variants(model, wild_type, mutants, tokenizer, method, show_progress=True)
        bar = bars.pop()
        assert bar.unit == "token" and bar.n == bar.total == expected_tokens(wild_type, mutants, method), method
    proteins = [random_sequence(int(n), generator) for n in torch.randint(1, 2 * WINDOW, (4,), generator=generator)]
    scoring.pseudo_log_likelihood(model, proteins, tokenizer, show_progress=True, max_tokens_per_batch=97)
    (bar,) = bars
    assert bar.unit == "token" and bar.n == bar.total == sum(len(p) * (min(len(p), WINDOW) + 2) for p in proteins)


def test_the_command_progress_bar_counts_tokens_and_ends_at_its_total(checkpoint, tmp_path, bars):
    """`nv-esm score` with every method: one bar over the tokens of all the methods' masked copies (not rows), ending
    at its total; in FASTA mode over the PLLs' tokens (not proteins), across parts."""
    generator = torch.Generator().manual_seed(53)
    wild_type = random_sequence(40, generator)
    mutants = mutants_with_repeats(wild_type, generator)
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", wild_type)])
    table = tmp_path / "dms.csv"
    table.write_text("mutant\n" + "\n".join(mutants) + "\n")
    assert (
        run_score(checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, "--methods", *scoring.METHODS, *CPU) == 0
    )
    (bar,) = bars
    expected = sum(expected_tokens(wild_type, mutants, method) for method in scoring.METHODS)
    assert bar.unit == "token" and bar.n == bar.total == expected

    lengths = [int(n) for n in torch.randint(1, 2 * WINDOW, (5,), generator=generator)]
    fasta = write_fasta(
        tmp_path / "in.fasta", [(f"p{i}", random_sequence(n, generator)) for i, n in enumerate(lengths)]
    )
    assert run_score(checkpoint, fasta, tmp_path / "pll.csv", *CPU, "--shard-size", 2) == 0
    bar = bars[-1]
    assert bar.unit == "token" and bar.n == bar.total == sum(n * (min(n, WINDOW) + 2) for n in lengths)


def test_the_default_window():
    """min(max_position_embeddings, max_protein_length) - 2: 1,024 for ESM-2; a config without max_protein_length
    (another version's) uses max_position_embeddings alone."""
    config = SimpleNamespace(max_position_embeddings=1026, max_protein_length=8192)
    assert scoring.default_window(config) == 1024
    config.max_protein_length = 500
    assert scoring.default_window(config) == 498
    assert scoring.default_window(SimpleNamespace(max_position_embeddings=26)) == 24


# ---- nv-esm score ------------------------------------------------------------------------------------------------


def write_fasta(path: Path, records: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f">{record_id} description\n{sequence}\n" for record_id, sequence in records))
    return path


def write_mutants(path: Path, wild_type: str, generator: torch.Generator, count: int) -> Path:
    mutants = random_mutants(wild_type, generator, count)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["mutant", "DMS_score", "note"])
        for number, mutant in enumerate(mutants):
            writer.writerow([mutant, f"{torch.randn(1, generator=generator).item():.4f}", f"n{number}, kept"])
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def run_score(*argv: object) -> int:
    return score.main([str(arg) for arg in argv])


def test_command_pll_of_a_fasta_file(checkpoint, model, tokenizer, tmp_path, capsys):
    generator = torch.Generator().manual_seed(50)
    records = [(f"p{i}", random_sequence(n, generator)) for i, n in enumerate([1, 30, WINDOW, 9, 5])]
    records[2] = ("bad", "MKJL")
    fasta = write_fasta(tmp_path / "in.fasta", records)
    assert run_score(checkpoint, fasta, tmp_path / "pll.csv", *CPU, "--shard-size", 2, "--invalid", "skip") == 0
    rows = read_csv(tmp_path / "pll.csv")
    assert [row["id"] for row in rows] == [record_id for record_id, _ in records]
    statuses = ["scored", "scored in windows", "skipped: invalid letter", "scored", "scored"]
    assert [row["status"] for row in rows] == statuses
    kept = [sequence for record_id, sequence in records if record_id != "bad"]
    expected = scoring.pseudo_log_likelihood(model, kept, tokenizer)
    for row, result in zip([row for row in rows if row["id"] != "bad"], expected):
        assert float(row["pll"]) == pytest.approx(result.pll, abs=ATOL_FP32)
        assert float(row["pseudo_perplexity"]) == pytest.approx(result.pseudo_perplexity, rel=ATOL_FP32)
    assert rows[2]["pll"] == "" and rows[2]["residues"] == "4"
    assert not (tmp_path / "pll.csv.parts").exists()
    assert "5 records (3 scored, 1 scored in windows, 1 skipped); 0 of 3 parts were already done" in (
        capsys.readouterr().out
    )

    assert run_score(checkpoint, fasta, tmp_path / "pll.csv", *CPU) == 1  # no --invalid skip: the record is named
    assert "record 'bad' (record 3): 'J' at residue 3" in capsys.readouterr().err


def test_command_scores_a_mutant_table(checkpoint, model, tokenizer, tmp_path, capsys):
    """Every method's column equals the Python API; other columns are kept; Spearman's rho is printed; the bad rows
    stop the run, every one named in one error with its row, line and position, or are left unscored with --invalid
    skip."""
    generator = torch.Generator().manual_seed(51)
    wild_type = random_sequence(40, generator)
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", wild_type)])
    table = write_mutants(tmp_path / "dms.csv", wild_type, generator, 10)
    out = tmp_path / "scores.csv"
    methods = ("--methods", *scoring.METHODS)
    assert run_score(checkpoint, fasta, out, "--mutants", table, *methods, *CPU, "--shard-size", 3) == 0
    rows, given = read_csv(out), read_csv(table)
    assert list(rows[0]) == ["mutant", "DMS_score", "note", *scoring.METHODS, "status"]
    assert [{key: row[key] for key in given[0]} for row in rows] == given
    mutants = [row["mutant"] for row in given]
    for method in scoring.METHODS:
        expected = scoring.score_variants(model, wild_type, mutants, tokenizer, method)
        assert torch.tensor([float(row[method]) for row in rows]).double().sub(expected).abs().max() <= 1e-5
    measured = [float(row["DMS_score"]) for row in given]
    rhos = {method: ranked_correlation([float(row[method]) for row in rows], measured) for method in scoring.METHODS}
    out_text = capsys.readouterr().out
    expected_line = ", ".join(f"{method} {rho:.4f}" for method, rho in rhos.items())
    assert f"Spearman's rho with DMS_score ({len(rows)} rows): {expected_line}" in out_text

    bad = tmp_path / "bad.csv"
    wrong = "G" if wild_type[4] != "G" else "A"
    bad.write_text(f"mutant,DMS_score\n{wild_type[0]}1A,1\n{wrong}5A,2\nX,3\n")
    assert run_score(checkpoint, fasta, tmp_path / "bad_out.csv", "--mutants", bad, *CPU) == 1
    error = capsys.readouterr().err.splitlines()
    assert error[0].endswith("bad.csv: 2 bad records (--invalid skip leaves them unscored):") and len(error) == 3
    assert error[1].startswith(f"  row 2 (line 3), column 'mutant': mutant '{wrong}5A' says position 5 is")
    assert error[2].startswith("  row 3 (line 4), column 'mutant': 'X' in mutant 'X' is not a substitution")
    assert not (tmp_path / "bad_out.csv").exists()
    assert run_score(checkpoint, fasta, tmp_path / "bad_out.csv", "--mutants", bad, *CPU, "--invalid", "skip") == 0
    statuses = [row["status"] for row in read_csv(tmp_path / "bad_out.csv")]
    assert statuses[0] == "scored" and statuses[1].startswith("skipped: mutant") and "'X'" in statuses[2]
    assert "(1 row): masked_marginal nan" in capsys.readouterr().out


def test_a_position_of_thousands_of_digits_names_its_file_row_and_column(checkpoint, tmp_path, capsys):
    generator = torch.Generator().manual_seed(54)
    wild_type = random_sequence(20, generator)
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", wild_type)])
    position = long_number(5000, generator)
    table = tmp_path / "dms.csv"
    table.write_text(f"variant,DMS_score\n{wild_type[0]}1A,1\n{wild_type[2]}{position}C,2\n")
    args = (checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, "--mutant-column", "variant", *CPU)
    assert run_score(*args) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and len(error) < 400, error
    assert f"dms.csv: row 2 (line 3), column 'variant': position {position[:40]}... (5000 characters)" in error
    assert run_score(*args, "--invalid", "skip") == 0
    statuses = [row["status"] for row in read_csv(tmp_path / "out.csv")]
    assert statuses == [
        "scored",
        f"skipped: position {position[:40]}... (5000 characters) of mutant "
        f"'{wild_type[2]}{position[:39]}'... (5002 characters) is outside the wild type (1 to 20)",
    ]


def ranked_correlation(x: list[float], y: list[float]) -> float:
    """Spearman's rho without ties: the Pearson correlation of the ranks."""
    rx, ry = (torch.tensor(v).argsort().argsort().double() for v in (x, y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return (rx @ ry / (rx.norm() * ry.norm())).item()


def test_spearman_ranks_ties_and_drops_non_finite_scores(capsys, tmp_path):
    """Ties get their average rank; a method's NaN or infinite scores are dropped from its rho (not ranked), per
    method, and the printed line says how many rows it kept."""
    assert rank_statistics.spearman([1.0, 1.0, 2.0, 3.0], [0.5, 0.7, 0.2, 0.9]) == pytest.approx(1.5 / math.sqrt(22.5))
    with_nan = score.method_spearman([1.0, math.nan, 1.0, 2.0, math.inf, 3.0], [0.5, 0.1, 0.7, 0.2, 0.3, 0.9])
    assert with_nan == (pytest.approx(1.5 / math.sqrt(22.5)), 4)
    assert rank_statistics.spearman([1.0, 1.0], [1.0, 2.0]) is None  # a constant side
    assert math.isnan(score.method_spearman([1.0, 1.0], [1.0, 2.0])[0])
    measured = [0.5, 0.1, 0.7, 0.2, 0.3, 0.9]
    job = SimpleNamespace(
        statuses=["scored"] * 6,
        parts=[[0]],
        columns=["mutant", "DMS_score"],
        rows=[{"mutant": "M1A", "DMS_score": str(value)} for value in measured],
    )
    values = {"masked_marginal": [1, "nan", 1, 2, "inf", 3], "wildtype_marginal": [1, 1.5, 1, 2, 2.5, 3]}
    scores = {i: [str(values["masked_marginal"][i]), str(values["wildtype_marginal"][i])] for i in range(6)}
    args = SimpleNamespace(output=tmp_path / "out.csv", score_column=None)
    score._report(args, job, list(values), scores, 0, 6, 1.0)
    rho_all = score.spearman([float(v) for v in values["wildtype_marginal"]], measured)
    line = f"(6 rows): masked_marginal {1.5 / math.sqrt(22.5):.4f} (4 rows with a finite score), "
    assert line + f"wildtype_marginal {rho_all:.4f}\n" in capsys.readouterr().out


def test_an_interrupted_run_resumes_without_recomputing(checkpoint, tmp_path, capsys, monkeypatch):
    generator = torch.Generator().manual_seed(52)
    wild_type = random_sequence(30, generator)
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", wild_type)])
    table = write_mutants(tmp_path / "dms.csv", wild_type, generator, 12)
    args = (checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, *CPU, "--shard-size", 4)
    assert run_score(checkpoint, fasta, tmp_path / "whole.csv", *args[3:]) == 0

    scored, real = [], scoring.Scorer.variant_scores

    def interrupted_at_the_second_part(self, wild_type, variants, method, progress=None):
        if scored:
            raise KeyboardInterrupt
        scored.append(len(variants))
        return real(self, wild_type, variants, method, progress)

    monkeypatch.setattr(scoring.Scorer, "variant_scores", interrupted_at_the_second_part)
    capsys.readouterr()
    assert run_score(*args) == 130
    assert "interrupted; finished parts in" in capsys.readouterr().err
    parts = tmp_path / "out.csv.parts"
    assert sorted(path.name for path in parts.iterdir()) == ["manifest.json", "part-00000.csv"]
    assert not (tmp_path / "out.csv").exists()
    stamp = (parts / "part-00000.csv").stat().st_mtime_ns

    loads, real_load = [], score.load_model
    monkeypatch.setattr(score, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    assert run_score(*args, "--methods", "wildtype_marginal") == 1  # other settings: refused, nothing deleted
    assert "holds a run with other settings (methods: ['masked_marginal'] -> ['wildtype_marginal'])" in (
        capsys.readouterr().err
    )
    assert (parts / "part-00000.csv").stat().st_mtime_ns == stamp
    assert loads == []  # refused before the model loaded

    rescored = []
    monkeypatch.setattr(
        scoring.Scorer, "variant_scores", lambda self, *a, **k: rescored.append(len(a[1])) or real(self, *a, **k)
    )
    assert run_score(*args) == 0
    assert sum(rescored) == 13 - scored[0]  # 13 rows: the first part is not scored again
    assert f"1 of {1 + len(rescored)} parts were already done" in capsys.readouterr().out
    assert (tmp_path / "out.csv").read_text().splitlines()[1:] == (tmp_path / "whole.csv").read_text().splitlines()[1:]
    assert not parts.exists()

    assert len(loads) == 1
    assert run_score(*args) == 1  # a finished output is not replaced without asking
    assert "out.csv exists; pass --overwrite" in capsys.readouterr().err
    finished = (tmp_path / "out.csv").read_bytes()
    parts.mkdir()  # an empty parts folder (or one with only its lock) is no unfinished run of these settings
    (parts / ".nv-esm-score.lock").touch()
    assert run_score(*args, "--methods", "wildtype_marginal") == 1
    assert "out.csv exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "out.csv").read_bytes() == finished
    assert len(loads) == 1  # refused before the model loaded
    assert run_score(*args, "--overwrite") == 0


def test_the_command_refuses_a_window_the_model_cannot_run(checkpoint, tmp_path, capsys):
    """`--window` is checked as the API checks `window` (`resolve_window`), before the model loads."""
    fasta = write_fasta(tmp_path / "p.fasta", [("p", "MKVLA")])
    longest = load_config(str(checkpoint)).max_protein_length - 2
    for window in (0, longest + 1):
        assert run_score(checkpoint, fasta, tmp_path / "out.csv", "--window", window, *CPU) == 1
        assert f"error: --window must be 1 to {longest} residues" in capsys.readouterr().err
    assert run_score(checkpoint, fasta, tmp_path / "out.csv", "--window", longest, *CPU) == 0


def test_a_folder_as_output_is_a_usage_error(checkpoint, tmp_path, capsys):
    fasta = write_fasta(tmp_path / "p.fasta", [("p", "MKVLA")])
    for output in (".", "/", tmp_path, tmp_path / "absent" / ".."):
        with pytest.raises(SystemExit) as exit_status:
            run_score(checkpoint, fasta, output, *CPU)
        error = capsys.readouterr().err.splitlines()[-1]
        assert exit_status.value.code == 2 and f"error: output {output} is a folder; name the CSV file" in error, error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["p.fasta"]


def test_a_checkpoint_without_its_tokenizer_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys):
    folder = tmp_path / "nv"
    shutil.copytree(checkpoint, folder)
    (folder / "vocab.txt").unlink()
    fasta = write_fasta(tmp_path / "p.fasta", [("p", "MKVLA")])
    loads = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(score, "load_model", lambda *a, **k: loads.append(a))
        assert run_score(folder, fasta, tmp_path / "out.csv", *CPU) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nv-esm score: error:")]
    assert len(errors) == 1 and "no ESM tokenizer to read (vocab.txt)" in errors[0], errors
    assert loads == []


def test_a_checkpoint_without_an_lm_head_is_refused(tmp_path, capsys):
    """A converted classifier is a valid NVEsm folder but has no LM head: scoring it would use a random one (a
    different score each run), so the command refuses it with one line naming the missing weights."""
    from transformers import EsmForSequenceClassification

    classifier = EsmForSequenceClassification(make_hf_model("tiny", seed=33).config)
    source = save_hf(classifier, tmp_path / "hf")
    assert convert_checkpoint.main(["hf-to-te", str(source), str(tmp_path / "nv")]) == 0
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", "MKVLA")])
    table = tmp_path / "dms.csv"
    table.write_text("mutant\nM1A\n", encoding="utf-8")
    capsys.readouterr()
    assert run_score(tmp_path / "nv", fasta, tmp_path / "out.csv", "--mutants", table, *CPU) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nv-esm score: error:")]
    assert len(errors) == 1 and "has no weights for 5 tensors" in errors[0] and "lm_head." in errors[0], errors
    assert "its config names NVEsmForSequenceClassification: scoring needs a masked-LM checkpoint" in errors[0]
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_the_same_scores(checkpoint, tmp_path):
    generator = torch.Generator().manual_seed(53)
    wild_type = random_sequence(30, generator)
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", wild_type)])
    table = write_mutants(tmp_path / "dms.csv", wild_type, generator, 9)
    common = ["--mutants", str(table), "--shard-size", "2", *CPU]
    assert run_score(checkpoint, fasta, tmp_path / "single.csv", *common) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "nv_esm"]
    command += ["score", str(checkpoint), str(fasta), str(tmp_path / "ranks.csv"), *common]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    single, ranks = read_csv(tmp_path / "single.csv"), read_csv(tmp_path / "ranks.csv")
    assert [row["mutant"] for row in ranks] == [row["mutant"] for row in single]
    for ours, theirs in zip(ranks, single):
        assert float(ours["masked_marginal"]) == pytest.approx(float(theirs["masked_marginal"]), abs=ATOL_FP32)


def test_the_settings_record_whose_model_code_runs(checkpoint, tmp_path):
    """--trust-remote-code changes the scores where the checkpoint's model code differs from the installed one (that
    code then runs): the manifest's settings say whose code runs. --tokens-per-batch only packs the same copies
    differently: a rerun may change it (after running out of memory) and keep the finished parts."""
    fasta = write_fasta(tmp_path / "in.fasta", [("p", "MKVL")])
    config = load_config(str(checkpoint))

    def settings(folder: Path, *options: str) -> score.ScoreSettings:
        args = score.parse_args([str(folder), str(fasta), str(tmp_path / "out.csv"), *CPU, *options], "nv-esm score")
        return score.plan_job(args, config, torch.device("cpu"), WINDOW).settings

    assert settings(checkpoint).model_code == settings(checkpoint, "--trust-remote-code").model_code == "installed"
    edited = tmp_path / "edited"
    shutil.copytree(checkpoint, edited)
    with open(edited / "modeling_nv_esm.py", "a", encoding="utf-8") as file:
        file.write("\n# the checkpoint's own edit\n")
    assert settings(edited, "--trust-remote-code").model_code == "checkpoint"
    assert settings(edited).model_code == "installed"
    assert settings(checkpoint, "--tokens-per-batch", "64") == settings(checkpoint)


def test_a_malformed_mutant_table_is_named_with_its_line(checkpoint, tmp_path, capsys):
    """A CSV Python's parser refuses (strictly: an unterminated quote would otherwise swallow the rows after it), a
    row with more fields than the header, text that is not UTF-8: one line naming the file and the line. A table
    without the mutant column names the columns it has."""
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", "MKVLA")])
    cases = {
        b'mutant,DMS_score\nM1A,1\nK2A,"0.5\nV3A,2\n': ", line 4: not a valid CSV file (unexpected end of data).",
        b'mutant,DMS_score\nM1A,"1"x\nK2A,2\n': ", line 2: not a valid CSV file (',' expected after '\"').",
        b"mutant,DMS_score\nM1A,1\nK2A,1,5\n": ", line 3: 3 fields, more than the header's 2 (a field holding a ','",
        b"mutant,DMS_score\nM1A,1\nK2A,\xff\n": ": not UTF-8 text (invalid start byte).",
        b"\xef\xbb\xbfvariant,DMS score\nM1A,1\n": " has no column 'mutant' (its columns: 'variant', 'DMS score'); see",
        b"mutant,score,note,score\nM1A,1,a,10\n": ", line 1: the header repeats 'score'; each column needs a name",
    }
    for number, (text, message) in enumerate(cases.items()):
        table = tmp_path / f"table{number}.csv"
        table.write_bytes(text)
        assert run_score(checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, *CPU) == 1, text
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"error: {table}{message}" in error, (text, error)
        assert not (tmp_path / "out.csv").exists() and not (tmp_path / "out.csv.parts").exists()
    short = tmp_path / "short.csv"  # blank lines are skipped; a short row's missing fields are empty
    short.write_bytes(b"mutant,DMS_score,note\n\nM1A,1\nK2A\n")
    assert run_score(checkpoint, fasta, tmp_path / "out.csv", "--mutants", short, *CPU) == 0
    rows = read_csv(tmp_path / "out.csv")
    assert [(row["mutant"], row["DMS_score"], row["note"], row["status"]) for row in rows] == [
        ("M1A", "1", "", "scored"),
        ("K2A", "", "", "scored"),
    ]


def test_every_file_the_command_reads_or_writes_names_its_encoding():
    """`nv-esm score`'s modules and the helpers they call open text files as UTF-8 whatever the locale: each
    `open`, `read_text` and `write_text` names its encoding, or opens the file in binary."""
    unnamed = []
    for module in ("score", "scoring", "embed_output", "embed_plan", "checkpoint_io", "folder_lock"):
        path = Path(score.__file__).with_name(f"{module}.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if (
                name not in ("open", "read_text", "write_text")
                or getattr(getattr(node.func, "value", None), "id", None) == "os"
            ):
                continue
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            positional = node.args[1:2] if isinstance(node.func, ast.Name) else node.args[:1]  # open(path, mode)
            mode = keywords.get("mode", positional[0] if positional and name == "open" else None)
            binary = isinstance(mode, ast.Constant) and "b" in str(mode.value)
            if "encoding" not in keywords and not binary:
                unnamed.append(f"{path.name}:{node.lineno}")
    assert not unnamed


@pytest.mark.slow
def test_the_command_writes_utf8_under_an_ascii_locale(checkpoint, tmp_path):
    """Non-ASCII text of the table (a column name, a cell) reaches the output CSV, and back, under a locale whose
    default encoding is ASCII."""
    fasta = write_fasta(tmp_path / "wt.fasta", [("wt", "MKVLA")])
    table = tmp_path / "dms.csv"
    table.write_text("mutant,DMS_score,r\u00e9sum\u00e9\nM1A,1,caf\u00e9 \u0394G\nK2A,2,\n", encoding="utf-8")
    command = [sys.executable, "-m", "nv_esm", "score", str(checkpoint), str(fasta), str(tmp_path / "out.csv")]
    environment = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, "--mutants", str(table), *CPU], capture_output=True, text=True, env=environment, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_csv(tmp_path / "out.csv")
    assert [row["r\u00e9sum\u00e9"] for row in rows] == ["caf\u00e9 \u0394G", ""]


def test_the_commands_load_fp8_layers_with_block_scaling_unless_asked_for_current(checkpoint, tmp_path, monkeypatch):
    """`nv-esm score` (and `nv-esm embed` and `nv-esm proteingym`, through `load_model`) ask for Float8BlockScaling
    (`COMMAND_FP8_RECIPE`: each token scaled on its own; delayed scaling, the config's default, would run inference
    at scale 1), or Float8CurrentScaling with `--fp8-scaling current`, and the manifest names the scaling. The
    recipes run only on a GPU (tests/test_gpu.py, tests/test_gpu_scoring.py)."""
    from nv_esm import embed_model, embed_plan

    loaded, real_load = [], score.load_model
    monkeypatch.setattr(score, "load_model", lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    fasta = write_fasta(tmp_path / "in.fasta", [("p", "MKVL")])
    assert run_score(checkpoint, fasta, tmp_path / "pll.csv", *CPU) == 0
    assert run_score(checkpoint, fasta, tmp_path / "current.csv", *CPU, "--fp8-scaling", "current") == 0
    assert [model.config.fp8_recipe for model in loaded] == [embed_plan.COMMAND_FP8_RECIPE, "current"]
    assert embed_plan.COMMAND_FP8_RECIPE == "block"
    config = load_config(str(checkpoint))
    assert config.fp8_recipe == "delayed"  # the model's own default, which the commands do not take
    embedding = embed_model.load_model(str(checkpoint), config, "torch", "off", False, torch.device("cpu"))
    assert embedding.config.fp8_recipe == "block"
    assert embed_plan.fp8_setting("off", "block") == "off"
    assert embed_plan.fp8_setting("inner", "current") == "inner, current scaling"
