"""`nv-esm proteingym` and `nv_esm.proteingym_scoring` against ProteinGym's rules run literally with transformers.

The reference follows `proteingym/baselines/esm/compute_fitness.py` and `proteingym/utils/scoring_utils.py` of
OATML-Markslab/ProteinGym, written here from their rules (not from the package's planning): transformers'
`EsmForMaskedLM` (fp32, CPU, eager attention), batch size 1, the token array `<cls> s <eos>` sliced by
`get_optimal_window(i, len(s) + 2, 1024)` around the masked token i for masked-marginals, one position masked per
forward; wt-marginals of a protein over 1,024 tokens from their overlapping windows (left and right windows moved by
511, a central one when the last pair overlaps by fewer than 511 tokens, sigmoid weights of tokens 1..256 and
766..1022); pseudo-ppl as `compute_pppl` sums it. The random model has 1,026 positions (window 1,024 tokens, as
ESM-2), and the wild types of 1,598 and 2,200 residues are longer than it (its layers are tiny, so the long
forwards stay cheap): every case of each window rule runs. Scores are compared within 1e-4 nats.
"""

from __future__ import annotations

import csv
import gc
import importlib.util
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr
from transformers import EsmForMaskedLM

import convert_checkpoint
from conftest import make_hf_model, make_nv_model
from convert_helpers import save_hf
from nv_esm import proteingym, proteingym_scoring, scoring
from nv_esm.alphabet import CLS, EOS, MASK, RESIDUE_TO_ID, STANDARD_AMINO_ACIDS
from nv_esm.proteingym_scoring import Assay, score_assays

ATOL = 1e-4
CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


@pytest.fixture(scope="module")
def reference() -> EsmForMaskedLM:
    return make_hf_model("tiny", seed=45, attn_implementation="eager")


@pytest.fixture(scope="module")
def model(reference):
    return make_nv_model(reference)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("proteingym")
    source = save_hf(make_hf_model("tiny", seed=45), work / "hf")
    assert convert_checkpoint.main(["hf-to-te", str(source), str(work / "esm2_tiny_nv")]) == 0
    return work / "esm2_tiny_nv"


def random_sequence(length: int, generator: torch.Generator) -> str:
    return "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (length,), generator=generator))


def random_mutants(wild_type: str, generator: torch.Generator, sites: list[int], count: int) -> list[str]:
    """Singles and doubles/triples at 0-based `sites` (letters drawn at random), distinct."""
    mutants: dict[str, None] = {}
    while len(mutants) < count:
        changes = 1 if len(mutants) < count // 2 else int(torch.randint(2, 4, (1,), generator=generator))
        picks = sorted({sites[int(i)] for i in torch.randint(0, len(sites), (changes,), generator=generator)})
        letters = torch.randint(0, 20, (len(picks),), generator=generator)
        mutants[":".join(f"{wild_type[p]}{p + 1}{STANDARD_AMINO_ACIDS[int(k)]}" for p, k in zip(picks, letters))] = None
    return list(mutants)


# ---- the reference: ProteinGym's loops, literally -----------------------------------------------------------------


def get_optimal_window(mutation_position_relative: int, seq_len_wo_special: int, model_window: int) -> list[int]:
    half_model_window = model_window // 2
    if seq_len_wo_special <= model_window:
        return [0, seq_len_wo_special]
    elif mutation_position_relative < half_model_window:
        return [0, model_window]
    elif mutation_position_relative >= seq_len_wo_special - half_model_window:
        return [seq_len_wo_special - model_window, seq_len_wo_special]
    return [
        max(0, mutation_position_relative - half_model_window),
        min(seq_len_wo_special, mutation_position_relative + half_model_window),
    ]


def tokens_of(sequence: str) -> torch.Tensor:
    return torch.tensor([[CLS, *(RESIDUE_TO_ID[letter] for letter in sequence), EOS]])


def log_softmax(hf: EsmForMaskedLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(tokens).logits, dim=-1)


def label_row(mutant: str, sequence: str, token_probs: dict[int, torch.Tensor]) -> float:
    """compute_fitness.py's label_row: token_probs[1 + idx] per site (idx 0-based)."""
    score = 0.0
    for mutation in mutant.split(":"):
        wt, idx, mt = mutation[0], int(mutation[1:-1]) - 1, mutation[-1]
        assert sequence[idx] == wt
        score += (token_probs[1 + idx][RESIDUE_TO_ID[mt]] - token_probs[1 + idx][RESIDUE_TO_ID[wt]]).item()
    return score


def masked_marginals(hf: EsmForMaskedLM, sequence: str, mutants: list[str]) -> list[float]:
    batch_tokens = tokens_of(sequence)
    needed = {int(part[1:-1]) for mutant in mutants for part in mutant.split(":")}  # token i = 1 + idx
    token_probs = {}
    for i in sorted(needed):
        batch_tokens_masked = batch_tokens.clone()
        batch_tokens_masked[0, i] = MASK
        start = 0
        if batch_tokens.size(1) > 1024:
            start, end = get_optimal_window(i, len(sequence) + 2, 1024)
            batch_tokens_masked = batch_tokens_masked[:, start:end]
        token_probs[i] = log_softmax(hf, batch_tokens_masked)[0, i - start]
    return [label_row(mutant, sequence, token_probs) for mutant in mutants]


def wt_marginals(hf: EsmForMaskedLM, sequence: str, mutants: list[str]) -> list[float]:
    batch_tokens = tokens_of(sequence)
    if batch_tokens.size(1) <= 1024:
        token_probs = log_softmax(hf, batch_tokens)[0]
        return [label_row(mutant, sequence, token_probs) for mutant in mutants]
    seq_len = batch_tokens.size(1)
    token_probs = torch.zeros((seq_len, 33))
    token_weights = torch.zeros(seq_len)
    weights = torch.ones(1024)
    for i in range(1, 257):
        weights[i] = 1 / (1 + math.exp(-(i - 128) / 16))
    for i in range(1022 - 256, 1023):
        weights[i] = 1 / (1 + math.exp((i - 1022 + 128) / 16))
    start_left, end_left = 0, 1023
    start_right, end_right = seq_len - 1024, seq_len - 1

    def add(start: int, end: int) -> None:
        token_probs[start : end + 1] += log_softmax(hf, batch_tokens[:, start : end + 1])[0] * weights.view(-1, 1)
        token_weights[start : end + 1] += weights

    while True:
        add(start_left, end_left)
        add(start_right, end_right)
        if end_left > start_right:
            break
        start_left, end_left, start_right, end_right = (
            start_left + 511,
            end_left + 511,
            start_right - 511,
            end_right - 511,
        )
    if end_left - start_right + 1 < 511:
        start_central = int(seq_len / 2) - 512
        add(start_central, start_central + 1023)
    token_probs = token_probs / token_weights.view(-1, 1)
    return [label_row(mutant, sequence, token_probs) for mutant in mutants]


def pseudo_ppl(hf: EsmForMaskedLM, sequence: str) -> float:
    batch_tokens = tokens_of(sequence)
    log_probs = []
    for i in range(1, len(sequence) - 1):
        batch_tokens_masked = batch_tokens.clone()
        batch_tokens_masked[0, i] = MASK
        log_probs.append(log_softmax(hf, batch_tokens_masked)[0, i, RESIDUE_TO_ID[sequence[i]]].item())
    return sum(log_probs)


def mutate(wild_type: str, mutant: str) -> str:
    residues = list(wild_type)
    for part in mutant.split(":"):
        residues[int(part[1:-1]) - 1] = part[-1]
    return "".join(residues)


# ---- assays --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assays() -> dict[str, tuple[str, list[str]]]:
    """{DMS_id: (target_seq, mutants)}: two assays of one 1,598-residue wild type (tokens 1,600: overlapping windows
    with a central one), one of 2,200 residues (the windows move once), one of 40; sites in every window case."""
    generator = torch.Generator().manual_seed(450)
    long_a, long_b, short = (random_sequence(n, generator) for n in (1598, 2200, 40))
    sites_a = [0, 5, 300, 510, 511, 512, 700, 900, 1087, 1088, 1089, 1400, 1597]
    sites_b = [3, 600, 1100, 1500, 1690, 2199]
    return {
        "A_one": (long_a, random_mutants(long_a, generator, sites_a[:9], 10)),
        "A_two": (long_a, random_mutants(long_a, generator, sites_a[4:], 10)),
        "B": (long_b, random_mutants(long_b, generator, sites_b, 8)),
        "short": (short, random_mutants(short, generator, list(range(40)), 8)),
    }


@pytest.fixture(scope="module")
def expected(reference, assays) -> dict[str, dict[str, list[float]]]:
    values = {}
    for dms_id, (wild_type, mutants) in assays.items():
        values[dms_id] = {
            "masked-marginals": masked_marginals(reference, wild_type, mutants),
            "wt-marginals": wt_marginals(reference, wild_type, mutants),
        }
    return values


def test_the_window_rules_are_proteingyms():
    """optimal_window is get_optimal_window on random inputs; overlapping_windows and overlap_weights at 1,024 are
    their loop's windows and weights (cases: one pair, moved pairs, a central window)."""
    generator = torch.Generator().manual_seed(4501)
    for _ in range(2000):
        window = int(torch.randint(2, 40, (1,), generator=generator))
        length = int(torch.randint(1, 90, (1,), generator=generator))
        position = int(torch.randint(0, length, (1,), generator=generator))
        assert list(proteingym_scoring.optimal_window(position, length, window)) == get_optimal_window(
            position, length, window
        )
    weights = proteingym_scoring.overlap_weights(1024)
    assert weights[0] == 1 and weights[1023] == 1 and weights[257:766].eq(1).all()
    assert weights[128].item() == pytest.approx(0.5) and weights[894].item() == pytest.approx(0.5)
    assert weights[256].item() == pytest.approx(1 / (1 + math.exp(-8)))
    assert proteingym_scoring.overlapping_windows(1600, 1024) == [(0, 1024), (576, 1600), (288, 1312)]
    assert proteingym_scoring.overlapping_windows(2202, 1024) == [(0, 1024), (1178, 2202), (511, 1535), (667, 1691)]


def test_every_score_matches_proteingyms_loop(model, tokenizer, assays, expected):
    """masked-marginals and wt-marginals of four assays (two sharing a wild type), packed in one pass, equal
    ProteinGym's loop per mutant."""
    scores = score_assays(
        model,
        tokenizer,
        [Assay(dms_id, wild_type, mutants) for dms_id, (wild_type, mutants) in assays.items()],
        ["masked-marginals", "wt-marginals"],
        max_tokens_per_batch=5000,
    )
    for dms_id, methods in expected.items():
        for method, values in methods.items():
            assert scores[dms_id][method].tolist() == pytest.approx(values, abs=ATOL), (dms_id, method)


def test_each_wild_type_position_is_one_copy_for_all_its_assays(model, tokenizer, assays):
    """masked-marginals: one copy per distinct (wild type, site), shared by the two assays of one wild type."""
    from nv_esm.scoring import Scorer

    scorer = Scorer(model, tokenizer)
    parsed = [Assay(dms_id, wild_type, mutants) for dms_id, (wild_type, mutants) in assays.items()]
    for assay in parsed:
        assay.parse()
    plan = proteingym_scoring.Plan(scorer, parsed, ["masked-marginals"], "proteingym")
    sites = {
        (wild_type, int(part[1:-1]))
        for wild_type, mutants in assays.values()
        for mutant in mutants
        for part in mutant.split(":")
    }
    assert len(plan.copies) == len(sites)
    assert all(len(copy.masked) == 1 and copy.read == copy.masked for copy in plan.copies)


def test_pseudo_ppl_and_the_joint_mask(model, tokenizer, reference):
    """pseudo-ppl as compute_pppl sums it (of the mutated sequence); masked_marginal as nv-esm score's rule (all
    sites masked in one forward, its window around them), and nv-esm windows for masked-marginals and wt-marginals
    on a long wild type."""
    generator = torch.Generator().manual_seed(4502)
    short, long = random_sequence(16, generator), random_sequence(1100, generator)
    short_mutants = random_mutants(short, generator, list(range(16)), 4)
    long_mutants = random_mutants(long, generator, [2, 540, 1000], 4)
    assays = [Assay("short", short, short_mutants), Assay("long", long, long_mutants)]
    got = score_assays(model, tokenizer, assays, ["masked_marginal"], max_tokens_per_batch=3000)
    got["short"] |= score_assays(model, tokenizer, assays[:1], ["pseudo-ppl", "masked_marginal"])["short"]
    want = [pseudo_ppl(reference, mutate(short, mutant)) for mutant in short_mutants]
    assert got["short"]["pseudo-ppl"].tolist() == pytest.approx(want, abs=ATOL)
    nv_windows = score_assays(model, tokenizer, assays[1:], ["masked-marginals", "wt-marginals"], windows="nv-esm")
    for dms_id, wild_type, mutants in (("short", short, short_mutants), ("long", long, long_mutants)):
        joint, unmasked = [], []
        for mutant in mutants:
            sites = [int(part[1:-1]) - 1 for part in mutant.split(":")]
            start = min(max(-(-(sites[0] + sites[-1]) // 2) - 512, 0), max(len(wild_type) - 1024, 0))
            tokens = tokens_of(wild_type[start : start + 1024])
            token_probs = log_softmax(reference, tokens)[0]
            unmasked.append(label_row(mutant, wild_type, {1 + p: token_probs[1 + p - start] for p in sites}))
            for site in sites:
                tokens[0, 1 + site - start] = MASK
            token_probs = log_softmax(reference, tokens)[0]
            joint.append(label_row(mutant, wild_type, {1 + p: token_probs[1 + p - start] for p in sites}))
        assert got[dms_id]["masked_marginal"].tolist() == pytest.approx(joint, abs=ATOL), dms_id
        if dms_id == "long":
            assert nv_windows["long"]["wt-marginals"].tolist() == pytest.approx(unmasked, abs=ATOL)
    want = []
    for mutant in long_mutants:
        token_probs = {}
        for part in mutant.split(":"):
            site = int(part[1:-1]) - 1
            start = min(max(site - 512, 0), len(long) - 1024)
            tokens = tokens_of(long[start : start + 1024])
            tokens[0, 1 + site - start] = MASK
            token_probs[1 + site] = log_softmax(reference, tokens)[0, 1 + site - start]
        want.append(label_row(mutant, long, token_probs))
    assert nv_windows["long"]["masked-marginals"].tolist() == pytest.approx(want, abs=ATOL)


# ---- the command ---------------------------------------------------------------------------------------------------


def write_benchmark(folder: Path, assays: dict[str, tuple[str, list[str]]], generator: torch.Generator) -> Path:
    """ProteinGym's layout: folder/DMS_substitutions.csv and folder/assays/<DMS_id>.csv."""
    (folder / "assays").mkdir(parents=True)
    with open(folder / "DMS_substitutions.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["DMS_index", "DMS_id", "DMS_filename", "UniProt_ID", "target_seq", "coarse_selection_type"])
        for index, (dms_id, (wild_type, _)) in enumerate(assays.items()):
            kind = ("Activity", "Stability")[index % 2]
            writer.writerow([index, dms_id, f"{dms_id}.csv", f"P{wild_type[:6]}", wild_type, kind])
    for dms_id, (wild_type, mutants) in assays.items():
        with open(folder / "assays" / f"{dms_id}.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"])
            for number, mutant in enumerate(mutants):
                score = torch.randn(1, generator=generator).item()
                writer.writerow([mutant, mutate(wild_type, mutant), f"{score:.4f}", number % 2])
    return folder / "DMS_substitutions.csv"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def run_command(checkpoint: Path, reference: Path, out: Path, *options: object) -> int:
    return proteingym.main(
        [str(checkpoint), str(reference), str(reference.parent / "assays"), str(out), *map(str, options), *CPU]
    )


def summary_texts(folder: Path) -> dict[str, str]:
    return {path.relative_to(folder).as_posix(): path.read_text() for path in sorted(folder.rglob("*.csv"))}


def summary_from_the_files(checkpoint: Path, reference: Path, out: Path, tmp_path: Path) -> dict[str, str]:
    """The summary's CSV files as `summarize_output` writes them from a copy of `out`'s assay files alone (no score
    of the run in memory), for the summary the command wrote to compare with."""
    import shutil

    copy = tmp_path / f"{out.name}_from_files"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("summary"))
    args = proteingym.parse_args([str(checkpoint), str(reference), str(reference.parent / "assays"), str(copy)], "t")
    args.columns = tuple(proteingym.score_column(args.model_name, method) for method in args.methods)
    proteingym.summarize_output(args, proteingym.read_reference(args), args.columns, {})
    return summary_texts(copy / "summary")


def test_the_command_writes_each_assay_with_its_scores(checkpoint, assays, expected, tmp_path):
    """OUT/<DMS_id>.csv: the assay's columns and rows, then esm2_tiny_nv (masked-marginals, the column ProteinGym's
    config reads) and esm2_tiny_nv_wt-marginals, equal to ProteinGym's loop."""
    reference = write_benchmark(tmp_path, assays, torch.Generator().manual_seed(4503))
    assert run_command(checkpoint, reference, tmp_path / "out", "--methods", "masked-marginals", "wt-marginals") == 0
    for dms_id in assays:
        given, rows = read_csv(tmp_path / "assays" / f"{dms_id}.csv"), read_csv(tmp_path / "out" / f"{dms_id}.csv")
        assert list(rows[0]) == [*given[0], "esm2_tiny_nv", "esm2_tiny_nv_wt-marginals"]
        assert [{k: row[k] for k in given[0]} for row in rows] == given
        got = [float(row["esm2_tiny_nv"]) for row in rows]
        assert got == pytest.approx(expected[dms_id]["masked-marginals"], abs=ATOL)
        got = [float(row["esm2_tiny_nv_wt-marginals"]) for row in rows]
        assert got == pytest.approx(expected[dms_id]["wt-marginals"], abs=ATOL)
    # the summary: ProteinGym's per-assay Spearman of each column (proteingym_metrics), and the plots
    summary = read_csv(tmp_path / "out" / "summary" / "Spearman" / "DMS_substitutions_Spearman_DMS_level.csv")
    assert [row["DMS ID"] for row in summary] == list(assays)
    for row in summary:
        scored = read_csv(tmp_path / "out" / f"{row['DMS ID']}.csv")
        for column in ("esm2_tiny_nv", "esm2_tiny_nv_wt-marginals"):
            rho = spearmanr([float(r["DMS_score"]) for r in scored], [float(r[column]) for r in scored])[0]
            assert float(row[column]) == pytest.approx(rho, abs=5e-4)
    if importlib.util.find_spec("matplotlib"):
        assert {path.name for path in (tmp_path / "out" / "summary").glob("*.png")} == {"Spearman.png", "A_one.png"}


def test_an_assay_whose_metrics_cannot_be_computed_is_named_after_every_file_is_written(checkpoint, tmp_path, capsys):
    """An assay whose `DMS_score_bin` is of one class has no AUC (ProteinGym's script would write NaN): the run writes
    every assay's scores, then stops with a one-line error naming that assay and column, whether its metrics were
    computed as it was written (this run) or from its file (a rerun: every assay done)."""
    generator = torch.Generator().manual_seed(4506)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7, 12], 6))
        for i in range(3)
    }
    reference = write_benchmark(tmp_path, small, generator)
    path = tmp_path / "assays" / "S1.csv"
    rows = read_csv(path)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**row, "DMS_score_bin": "1"} for row in rows)
    out = tmp_path / "out"
    for run in ("scored", "rerun"):
        assert run_command(checkpoint, reference, out) == 1, run
        error = capsys.readouterr().err
        assert error.startswith("nv-esm proteingym: error: S1, column esm2_tiny_nv: every DMS_score_bin is 1;"), run
        assert len(error.splitlines()) == 1 and sorted(p.name for p in out.glob("*.csv")) == [
            "S0.csv",
            "S1.csv",
            "S2.csv",
        ]
        assert not (out / "summary").exists()


def drop_column(path: Path, column: str) -> None:
    rows = read_csv(path)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[name for name in rows[0] if name != column])
        writer.writeheader()
        writer.writerows({name: value for name, value in row.items() if name != column} for row in rows)


@pytest.mark.parametrize(
    ("dropped", "why"),
    [
        ("UniProt_ID", "the reference has no UniProt_ID or coarse_selection_type column"),
        ("DMS_score_bin", "assay S2 has no DMS_score_bin column"),
    ],
)
def test_without_a_column_the_summary_reads_the_assays_are_scored_and_the_summary_left_out(
    checkpoint, tmp_path, capsys, dropped, why
):
    """A reference without `UniProt_ID`, or an assay without `DMS_score_bin`: every assay is scored and written, no
    summary is made (a note says why), and the count of assays done by earlier runs counts only those."""
    generator = torch.Generator().manual_seed(4507)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7, 12], 4))
        for i in range(3)
    }
    reference = write_benchmark(tmp_path, small, generator)
    drop_column(reference if dropped == "UniProt_ID" else tmp_path / "assays" / "S2.csv", dropped)
    out = tmp_path / "out"
    for done in (0, 2):
        assert run_command(checkpoint, reference, out) == 0
        captured = capsys.readouterr()
        assert f"3 assays ({done} were already done); this run:" in captured.out
        assert f"note: no summary of the metrics: {why}" in captured.err
        assert sorted(p.name for p in out.glob("*.csv")) == ["S0.csv", "S1.csv", "S2.csv"]
        assert not (out / "summary").exists()
        (out / "S1.csv").unlink()  # the rerun scores S1 alone


def test_a_rerun_scores_only_the_missing_assays_and_refuses_other_settings(checkpoint, tmp_path, monkeypatch, capsys):
    generator = torch.Generator().manual_seed(4504)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7, 12], 4))
        for i in range(3)
    }
    reference = write_benchmark(tmp_path, small, generator)
    out = tmp_path / "out"
    assert run_command(checkpoint, reference, out, "--assays", "S1") == 0
    assert sorted(path.name for path in out.glob("*.csv")) == ["S1.csv"]
    # S1's 21 residues masked at its mutants' 3 sites: 3 copies of <cls> + 21 + <eos>, and the time they took
    assert re.search(r"this run: 69 tokens of masked copies in [\d.]+ s \([\d,]+ tokens/s\) after "
                     r"[\d.]+ s of set-up", capsys.readouterr().out)  # fmt: skip
    first = (out / "S1.csv").read_bytes()
    written = []
    real_write = proteingym.write_assay

    def killed_after_one(path, *args):  # the run is killed after writing its first assay
        if written:
            raise KeyboardInterrupt
        written.append(path.name)
        real_write(path, *args)

    monkeypatch.setattr(proteingym, "write_assay", killed_after_one)
    assert run_command(checkpoint, reference, out) == 130
    assert "a rerun resumes" in capsys.readouterr().err
    monkeypatch.setattr(
        proteingym, "write_assay", lambda path, *args: (written.append(path.name), real_write(path, *args))
    )
    assert run_command(checkpoint, reference, out) == 0
    assert sorted(written) == ["S0.csv", "S2.csv"]  # S1 by the first run, one by the killed one: each written once
    assert (out / "S1.csv").read_bytes() == first
    # the summary of assays finished by earlier runs (read back) and by this one (its scores as written)
    assert summary_texts(out / "summary") == summary_from_the_files(checkpoint, reference, out, tmp_path)
    capsys.readouterr()
    for changed in (["--methods", "wt-marginals"], ["--windows", "nv-esm"], ["--model-name", "other"]):
        assert run_command(checkpoint, reference, out, *changed) == 1
        error = capsys.readouterr().err
        assert "holds a run with other settings" in error and "--overwrite" in error and len(error.splitlines()) == 1
    assert run_command(checkpoint, reference, out, "--methods", "wt-marginals", "--overwrite") == 0
    assert "esm2_tiny_nv_wt-marginals" in read_csv(out / "S1.csv")[0]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("reference_column", "DMS_substitutions.csv has no column 'target_seq'"),
        ("duplicate", "DMS_substitutions.csv: row 2 (line 3), column 'DMS_id': 'S0' repeats row 1"),
        ("missing_file", "DMS_substitutions.csv: row 2 (line 3), column 'DMS_filename': assay file"),
        ("mutant_column", "S1.csv has no column 'mutant'"),
        ("wild_type_letter", "S1.csv: row 1 (line 2), column 'mutant': mutant 'W3A' says position 3 is 'W'"),
        ("position", "S1.csv: row 1 (line 2), column 'mutant': position 99 of mutant 'A99G' is outside the wild type"),
        ("unknown_assay", "--assays: 'nope' is not a DMS_id"),
        ("score", "S1.csv: row 2 (line 3), column 'DMS_score': 'n/a' is not a number"),
    ],
)
def test_malformed_inputs_are_one_line_errors_naming_file_row_and_column(checkpoint, tmp_path, capsys, damage, message):
    wild_type = "MKTAYIAKQRQISFVKSHFSRQ"
    reference = write_benchmark(
        tmp_path, {"S0": (wild_type, ["M1A", "K2R"]), "S1": (wild_type, ["T3A", "A4G"])}, torch.Generator()
    )
    text = reference.read_text()
    assay = tmp_path / "assays" / "S1.csv"
    options = []
    if damage == "reference_column":
        reference.write_text(text.replace("target_seq", "sequence"))
    elif damage == "duplicate":
        reference.write_text(text.replace(",S1,", ",S0,"))
    elif damage == "missing_file":
        assay.unlink()
    elif damage == "mutant_column":
        assay.write_text(assay.read_text().replace("mutant,", "variant,", 1))
    elif damage == "wild_type_letter":
        assay.write_text(assay.read_text().replace("T3A", "W3A"))
    elif damage == "position":
        assay.write_text(assay.read_text().replace("T3A", "A99G"))
    elif damage == "score":  # refused before the scoring, not after it when the summary reads the column
        lines = assay.read_text().splitlines(keepends=True)
        fields = lines[2].split(",")
        lines[2] = ",".join([*fields[:2], "n/a", *fields[3:]])
        assay.write_text("".join(lines))
    else:
        options = ["--assays", "nope"]
    assert run_command(checkpoint, reference, tmp_path / "out", *options) == 1
    error = capsys.readouterr().err
    assert message in error and error.startswith("nv-esm proteingym: error:") and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_groups_spread_the_wild_types_over_the_ranks():
    """Each wild type in one group of one rank, in their order within a group; the ranks' loads within the largest
    group of each other."""
    generator = torch.Generator().manual_seed(4505)
    tokens = {f"W{i}": int(torch.randint(1, 1000, (1,), generator=generator)) for i in range(30)}
    for world_size in (1, 2, 3):
        ranks = proteingym.groups_of(tokens, world_size)
        assert len(ranks) == world_size and all(ranks)
        flat = [wild_type for groups in ranks for group in groups for wild_type in group]
        assert sorted(flat) == sorted(tokens)
        assert all(group == sorted(group, key=list(tokens).index) for groups in ranks for group in groups)
        loads = [sum(tokens[w] for group in groups for w in group) for groups in ranks]
        largest = max(sum(tokens[w] for w in group) for groups in ranks for group in groups)
        assert max(loads) - min(loads) <= largest


def test_each_rank_reads_whole_wild_types_of_the_reference_dealt_out_by_their_estimated_cost(tmp_path):
    """`shares`: every assay on exactly one rank, in the reference's order, the assays of one wild type together;
    the same split at every call (each rank computes it alone, before reading any assay); the ranks' estimated
    loads within the largest wild type's of each other; one rank reads all."""
    generator = torch.Generator().manual_seed(4508)
    small = {}
    for i in range(12):
        wild_type = random_sequence(int(torch.randint(20, 60, (1,), generator=generator)), generator)
        rows = int(torch.randint(1, 40, (1,), generator=generator))
        small[f"S{i}"] = (wild_type, random_mutants(wild_type, generator, [1, 5, 9], rows))
    small["T0"] = (small["S3"][0], small["S3"][1][:2])  # another assay of S3's wild type
    reference = write_benchmark(tmp_path, small, generator)
    args = proteingym.parse_args([str(tmp_path), str(reference), str(tmp_path / "assays"), str(tmp_path / "out")], "t")
    entries = proteingym.read_reference(args)
    assert [entry.dms_id for entry in entries] == list(small)
    assert proteingym.shares(entries, args.methods, 1022, 1) == [entries]
    for world_size in (2, 3):
        ranks = proteingym.shares(entries, args.methods, 1022, world_size)
        assert ranks == proteingym.shares(entries, args.methods, 1022, world_size) and len(ranks) == world_size
        assert sorted(entry.dms_id for rank in ranks for entry in rank) == sorted(small)
        assert all(rank == [entry for entry in entries if entry in rank] for rank in ranks)  # reference order
        owner = {entry.dms_id: r for r, rank in enumerate(ranks) for entry in rank}
        assert owner["T0"] == owner["S3"]


@pytest.mark.slow
def test_two_ranks_under_torchrun_stop_with_the_error_of_the_rank_that_reads_a_bad_assay(checkpoint, tmp_path):
    """Each rank checks only the assays it reads: a wrong wild-type letter in one assay stops the run with that
    rank's one-line error naming the file, row and column, and a non-zero exit status, before OUT is made (the
    ranks wait for each other's reading before rank 0 makes it)."""
    generator = torch.Generator().manual_seed(4509)
    small = {
        f"S{i}": (wt := random_sequence(30 + i, generator), random_mutants(wt, generator, [2, 6], 5)) for i in range(4)
    }
    reference = write_benchmark(tmp_path, small, generator)
    bad = tmp_path / "assays" / "S2.csv"
    rows = bad.read_text().splitlines()
    wrong = "W" if small["S2"][0][2] != "W" else "Y"
    rows[3] = f"{wrong}3A," + rows[3].split(",", 1)[1]
    bad.write_text("\n".join(rows) + "\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "nv_esm"]
    command += ["proteingym", str(checkpoint), str(reference), str(tmp_path / "assays"), str(tmp_path / "out"), *CPU]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode != 0
    assert f"S2.csv: row 3 (line 4), column 'mutant': mutant '{wrong}3A' says position 3 is {wrong!r}" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_the_same_scores(checkpoint, tmp_path):
    generator = torch.Generator().manual_seed(4506)
    small = {}
    for i in range(4):
        wild_type = random_sequence(20 + i, generator)
        small[f"S{i}"] = (wild_type, random_mutants(wild_type, generator, [1, 7, 12, 15], 6))
    reference = write_benchmark(tmp_path, small, generator)
    assert run_command(checkpoint, reference, tmp_path / "single") == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "nv_esm"]
    command += ["proteingym", str(checkpoint), str(reference), str(tmp_path / "assays"), str(tmp_path / "ranks"), *CPU]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for dms_id in small:
        single, ranks = read_csv(tmp_path / "single" / f"{dms_id}.csv"), read_csv(tmp_path / "ranks" / f"{dms_id}.csv")
        assert [row["mutant"] for row in ranks] == [row["mutant"] for row in single]
        for ours, theirs in zip(ranks, single):
            assert float(ours["esm2_tiny_nv"]) == pytest.approx(float(theirs["esm2_tiny_nv"]), abs=1e-5)
    # rank 0 summarises every rank's assay metrics, computed as each was written
    ranks_summary = summary_texts(tmp_path / "ranks" / "summary")
    assert len(ranks_summary) > 3
    assert ranks_summary == summary_from_the_files(checkpoint, reference, tmp_path / "ranks", tmp_path)


def test_what_a_method_cannot_score_is_refused_before_anything_is_scored_or_written(
    checkpoint, tmp_path, capsys, monkeypatch
):
    """masked_marginal masks a mutant's sites in one forward: sites over 1,024 residues apart are refused, naming
    the row, before anything is scored or OUT is made."""
    generator = torch.Generator().manual_seed(4507)
    wild_type = random_sequence(1100, generator)
    far = f"{wild_type[0]}1A:{wild_type[1099]}1100C"
    reference = write_benchmark(tmp_path, {"far": (wild_type, [f"{wild_type[4]}5A", far])}, generator)
    monkeypatch.setattr(proteingym, "run", lambda *args, **kwargs: pytest.fail("the assays were scored"))
    assert run_command(checkpoint, reference, tmp_path / "out", "--methods", "masked_marginal") == 1
    error = capsys.readouterr().err
    assert (
        "far.csv: row 2 (line 3), column 'mutant': positions 1 to 1100 span more than the 1024-residue window" in error
    )
    assert "masked_marginal scores a mutant in one forward" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def slow_reading_benchmark(tmp_path: Path, monkeypatch, count: int, seconds: float) -> tuple[Path, list]:
    """`count` assays of their own wild types (S0, S1...), each `read_assay` taking `seconds` longer; the list
    gets (DMS_id, reading thread, start, end) per assay read."""
    generator = torch.Generator().manual_seed(4511)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7], 3))
        for i in range(count)
    }
    reference = write_benchmark(tmp_path, small, generator)
    reads = []
    real_read = proteingym.read_assay

    def slow_read(args, entry, *rest):
        start = time.perf_counter()
        time.sleep(seconds)
        try:
            return real_read(args, entry, *rest)
        finally:
            reads.append((entry.dms_id, threading.current_thread(), start, time.perf_counter()))

    monkeypatch.setattr(proteingym, "read_assay", slow_read)
    return reference, reads


@pytest.mark.parametrize("load", ["loads", "fails"])
def test_the_assays_are_read_while_the_model_loads_and_the_first_bad_ones_error_comes_first(
    checkpoint, tmp_path, capsys, monkeypatch, load
):
    """The assays are read in a thread while the model loads: two bad assays (S1, S2) stop the run with the first
    one's one-line error, before OUT is made. A model that fails to load meanwhile (a RuntimeError) gives way to
    the bad assay's error, as when the assays were read before it loaded; with good assays, its own is reported."""
    reference, reads = slow_reading_benchmark(tmp_path, monkeypatch, 4, 0.1)
    real_load = proteingym.load_masked_lm
    loading = []

    def slow_load(*args, **kwargs):
        start = time.perf_counter()
        time.sleep(0.3)
        if load == "fails":
            raise RuntimeError("the model does not load")
        model = real_load(*args, **kwargs)
        loading.append((threading.current_thread(), start, time.perf_counter()))
        return model

    monkeypatch.setattr(proteingym, "load_masked_lm", slow_load)
    assays = tmp_path / "assays"
    good = {}
    for dms_id in ("S1", "S2"):
        good[dms_id] = (assays / f"{dms_id}.csv").read_text()
        lines = good[dms_id].splitlines(keepends=True)
        lines[2] = "Q99A" + lines[2][lines[2].index(",") :]
        (assays / f"{dms_id}.csv").write_text("".join(lines))
    assert run_command(checkpoint, reference, tmp_path / "out") == 1
    error = capsys.readouterr().err
    assert error.startswith("nv-esm proteingym: error:") and len(error.splitlines()) == 1
    assert "S1.csv: row 2 (line 3), column 'mutant': position 99 of mutant 'Q99A' is outside the wild type" in error
    assert not (tmp_path / "out").exists()
    assert gc.isenabled()  # the reading pauses the garbage collector, and turns it back on after an error too
    assert [read[0] for read in reads] == ["S0", "S1"]  # in the reference's order, stopped at the first bad one
    assert all(read[1] is not threading.main_thread() for read in reads)
    if load == "loads":
        [(thread, start, end)] = loading
        assert thread is threading.main_thread() and reads[0][2] < end and start < reads[-1][3]  # at the same time
    else:
        for dms_id, text in good.items():
            (assays / f"{dms_id}.csv").write_text(text)
        assert run_command(checkpoint, reference, tmp_path / "out") == 1
        assert capsys.readouterr().err == "nv-esm proteingym: error: the model does not load\n"
        assert not (tmp_path / "out").exists()


def test_ctrl_c_while_the_model_loads_stops_the_reading(checkpoint, tmp_path, capsys, monkeypatch):
    """Ctrl-C while the model loads: exit status 130 at once, the reading thread stops after the assay it is
    reading, OUT untouched."""
    reference, reads = slow_reading_benchmark(tmp_path, monkeypatch, 6, 0.5)

    def interrupted(*args, **kwargs):
        time.sleep(0.1)
        raise KeyboardInterrupt

    monkeypatch.setattr(proteingym, "load_masked_lm", interrupted)
    started = time.perf_counter()
    assert run_command(checkpoint, reference, tmp_path / "out") == 130
    assert time.perf_counter() - started < 2.0  # not the 3 s of reading every assay
    assert "interrupted" in capsys.readouterr().err
    for _ in range(50):
        if not any(thread.name.startswith("proteingym-read") for thread in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(thread.name.startswith("proteingym-read") for thread in threading.enumerate())
    assert len(reads) <= 2 and not (tmp_path / "out").exists()


def test_a_failed_write_stops_the_run_and_no_later_assay_is_written(checkpoint, tmp_path, capsys, monkeypatch):
    """The files are written by a thread while the next group is scored: an OSError writing the second assay stops
    the run with exit status 1 and a one-line error; the first assay's file is there, no later one is written (the
    groups run largest first: S3, S2...)."""
    generator = torch.Generator().manual_seed(4512)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7], 3)) for i in range(4)
    }
    reference = write_benchmark(tmp_path, small, generator)
    real_write = proteingym.write_assay
    written = []

    def full_disk_at_the_second(path, *args):
        written.append(path.name)
        if len(written) == 2:
            raise OSError(28, "No space left on device", str(path))
        real_write(path, *args)

    monkeypatch.setattr(proteingym, "write_assay", full_disk_at_the_second)
    out = tmp_path / "out"
    assert run_command(checkpoint, reference, out) == 1
    error = capsys.readouterr().err
    assert error.startswith("nv-esm proteingym: error:") and len(error.splitlines()) == 1
    assert "No space left on device" in error and written[1] in error and len(written) == 2
    assert [path.name for path in out.glob("*.csv")] == written[:1]
    assert not any(thread.name.startswith("proteingym-write") for thread in threading.enumerate())


def test_a_write_that_fails_while_the_next_group_fails_too_is_not_lost(checkpoint, tmp_path, capsys, monkeypatch):
    """A write failing in its thread while the next group's scoring fails: the run stops with the scoring's one-line
    error, after a note that the write failed too."""
    generator = torch.Generator().manual_seed(4513)
    small = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7], 3)) for i in range(4)
    }
    reference = write_benchmark(tmp_path, small, generator)

    def full_disk(path, *args):
        raise OSError(28, "No space left on device", str(path))

    real_run_plans, calls = proteingym.run_plans, []

    def second_group_fails(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            time.sleep(0.3)  # the first group's write fails meanwhile
            raise RuntimeError("CUDA error: an illegal memory access")
        return real_run_plans(*args, **kwargs)

    monkeypatch.setattr(proteingym, "write_assay", full_disk)
    monkeypatch.setattr(proteingym, "run_plans", second_group_fails)
    assert run_command(checkpoint, reference, tmp_path / "out") == 1
    error = capsys.readouterr().err.splitlines()
    assert error[0].startswith("note: writing an assay failed too:") and "No space left on device" in error[0]
    assert error[1] == "nv-esm proteingym: error: CUDA error: an illegal memory access"
    assert len(error) == 2 and not list((tmp_path / "out").glob("*.csv"))


@pytest.mark.parametrize("layout", ["plain", "quoted", "crlf", "blank_line", "short_row", "empty_fields"])
def test_assay_files_are_read_and_written_as_the_csv_module_does(tmp_path, layout):
    """`read_table` splits a file of plain lines itself and keeps them for the output; any other file goes through
    `read_csv`. Either way the fields and line numbers are the csv module's, and `write_assay` writes what
    csv.writer writes for the fields and the scores' texts (`scoring.score_text`: 6 decimals)."""
    from nv_esm.score import read_csv as module_read_csv

    generator = random.Random(hash(layout) % 1000)
    columns = ["mutant", "mutated_sequence", "DMS_score", "note"]
    rows = [
        [f"A{i}G", "".join(generator.choices("ACDEFGHIK", k=12)), repr(generator.gauss(0, 1)), f"n{i}"]
        for i in range(1, 30)
    ]
    if layout == "empty_fields":
        rows[3][3], rows[7][1] = "", ""
    lines = [",".join(columns), *(",".join(row) for row in rows)]
    if layout == "quoted":
        lines[5] = lines[5].rsplit(",", 1)[0] + ',"a, b"'
    elif layout == "blank_line":
        lines.insert(9, "")
    elif layout == "short_row":
        lines[4] = lines[4].rsplit(",", 1)[0]
    path = tmp_path / "assay.csv"
    path.write_bytes(("\r\n" if layout == "crlf" else "\n").join(lines).encode() + b"\n")
    table = proteingym.read_table(path)
    expected_columns, expected_rows = module_read_csv(path)
    assert table.columns == expected_columns
    assert len(table) == len(expected_rows)
    for column in expected_columns:
        assert table.column(column) == [row[column] for row, _ in expected_rows], column
    assert [table.line(i) for i in range(len(table))] == [line for _, line in expected_rows]
    assert (table.lines is not None) == (layout in ("plain", "crlf", "empty_fields"))
    scores = {
        "masked-marginals": torch.randn(len(table), dtype=torch.float64),
        "wt": torch.randn(len(table)),
    }
    file = proteingym.AssayFile(None, table, {}, {})
    texts = (list(map(scoring.score_text, t.tolist())) for t in scores.values())
    proteingym.write_assay(tmp_path / "out.csv", file, dict(zip(("x", "y"), texts)))
    with open(tmp_path / "expected.csv", "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow([*expected_columns, "x", "y"])
        values = zip(*(tensor.tolist() for tensor in scores.values()))
        writer.writerows(
            [*(row[c] for c in expected_columns), *(f"{x:.6f}" for x in v)]
            for (row, _), v in zip(expected_rows, values)
        )
    assert (tmp_path / "out.csv").read_text() == (tmp_path / "expected.csv").read_text()


def test_per_site_scores_equal_the_per_mutant_sum_bit_for_bit():
    """`_site_scores` (each distinct substitution's terms once) gives every mutant exactly the float that
    `_marginal_score` adds up term by term for it, also where a site reads several weighted copies (overlapping
    windows) and a mutant has several sites."""
    from nv_esm.scoring import Substitution

    generator = random.Random(4510)
    letters = list(STANDARD_AMINO_ACIDS)
    ids = {letter: i for i, letter in enumerate(letters)}
    rows = {(c, p): [generator.uniform(-9, 0) for _ in letters] for c in range(6) for p in range(40)}
    site_terms, variants = {}, []
    for _ in range(300):
        sites = generator.sample(range(1, 41), generator.randint(1, 4))
        variant = []
        for position in sorted(sites):
            wild, mutant = generator.sample(letters, 2)
            s = Substitution(position, wild, mutant)
            copies = generator.sample(range(6), generator.randint(1, 3))
            site_terms.setdefault(s, [(c, generator.uniform(0.1, 1.0)) for c in copies])
            variant.append(s)
        variants.append(tuple(variant))
    expected = [proteingym_scoring._marginal_score(rows, [(site_terms[s], s) for s in v], ids) for v in variants]
    assert proteingym_scoring._site_scores(rows, site_terms, variants, ids) == expected
