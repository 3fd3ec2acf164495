"""bench/proteingym_benchmark.py --quick on a 3-row reference in ProteinGym's layout (random wild types, two rows
sharing one): the JSON's workload against counts made here, its timings, speed-up and Spearman as numbers, and our
fp32 scores equal to the ProteinGym-rule transformers loop's."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nv_esm.alphabet import STANDARD_AMINO_ACIDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_run_writes_the_benchmark_fields(tmp_path, monkeypatch):
    generator = random.Random(4507)
    wild_types = ["".join(generator.choices(STANDARD_AMINO_ACIDS, k=k)) for k in (generator.randint(20, 40), 31)]
    reference = tmp_path / "DMS_substitutions.csv"
    columns = ["DMS_id", "DMS_filename", "UniProt_ID", "target_seq", "seq_len", "DMS_binarization_cutoff",
               "coarse_selection_type"]  # fmt: skip
    rows = [("A_ONE", wild_types[0], "Activity"), ("B_TWO", wild_types[1], "Stability"),
            ("B_THREE", wild_types[1], "Stability")]  # fmt: skip
    with reference.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for dms_id, wild_type, kind in rows:
            writer.writerow([dms_id, f"{dms_id}.csv", dms_id.split("_")[0], wild_type, len(wild_type), 0.1, kind])
    out = tmp_path / "result.json"
    path = os.pathsep.join([str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, str(ROOT / "bench" / "proteingym_benchmark.py"), "--quick", "--reference",
               str(reference), "--device", "cpu", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())

    lengths = [len(w) for w in wild_types]
    assert result["workload"] == {
        "assays": 3,
        "distinct_wild_types": 2,
        "masked_copies": sum(lengths),
        "tokens": sum(n * (n + 2) for n in lengths),
        "tokens_per_row": sum(n * (n + 2) for n in lengths) + lengths[1] * (lengths[1] + 2),
    }
    bf16 = result["variants"]["bf16"]
    assert bf16["assay_files_written"] == 3 and bf16["seconds"] > 0 and bf16["peak_rss_gb"] > 0
    assert abs(bf16["tokens_per_s"] * bf16["seconds"] - result["workload"]["tokens"]) < 1e-6 * bf16["tokens_per_s"]
    phases = bf16["rank0_set_up_seconds"] + bf16["rank0_scoring_seconds"]  # the command's own timing, within it
    assert 0 < bf16["rank0_scoring_seconds"] and phases < bf16["seconds"]
    assert phases < bf16["seconds_at_scored_line"] <= bf16["seconds_at_summary_line"] < bf16["seconds"]
    assert result["import_seconds"] > 0  # its own process (under a loaded test run it may take longer than the run)
    assert set(result["versions"]) >= {"torch", "transformers"} and result["device"] == "cpu"
    baseline = result["baseline"]
    assert len(baseline["assays"]) == 2 and baseline["assays"][0] != "B_THREE" != baseline["assays"][1]
    assert baseline["transformers_forwards"] == sum(lengths) + 4
    speedup = baseline["ours_bf16"]["x_transformers_loop"]
    assert isinstance(speedup, float) and speedup > 0
    assert abs(speedup - baseline["transformers_loop"]["seconds"] / baseline["ours_bf16"]["seconds"]) < 1e-9
    agreement = result["agreement"]
    assert set(agreement["per_assay"]) == set(baseline["assays"])
    assert isinstance(agreement["ours_bf16_vs_fp32_spearman_min"], float)
    assert agreement["ours_bf16_vs_fp32_spearman_min"] > 0.999  # fp32 on both sides on the CPU
    assert agreement["ours_fp32_vs_transformers_fp32_max_abs_diff"] < 1e-4
    assert agreement["command_bf16_vs_api_max_abs_diff"] < 1e-4  # the command's file, packed otherwise

    # the stand-in assays: ProteinGym's columns, one substitution at every position, the bins above 0 (the median)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from proteingym_benchmark import write_assays

    with reference.open(newline="") as handle:
        reference_rows = list(csv.DictReader(handle))
    mutants_of = write_assays(columns, reference_rows, tmp_path / "stand_in", seed=3)
    for dms_id, wild_type, _ in rows:
        with (tmp_path / "stand_in" / "assays" / f"{dms_id}.csv").open(newline="") as handle:
            assay = list(csv.DictReader(handle))
        assert list(assay[0]) == ["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"]
        assert [row["mutant"] for row in assay] == mutants_of[dms_id]
        assert [int(row["mutant"][1:-1]) for row in assay] == list(range(1, len(wild_type) + 1))
        for row in assay:
            position, letter = int(row["mutant"][1:-1]) - 1, row["mutant"][-1]
            assert row["mutant"][0] == wild_type[position] != letter and letter in STANDARD_AMINO_ACIDS
            assert row["mutated_sequence"] == wild_type[:position] + letter + wild_type[position + 1 :]
            assert row["DMS_score_bin"] == str(int(float(row["DMS_score"]) > 0))


def test_stand_in_assays_with_the_references_counts_have_its_numbers_of_single_and_multiple_mutants(
    tmp_path, monkeypatch
):
    """`--mutants reference`: a substitution at every position first, then the row's counts (singles up to
    `DMS_number_single_mutants`, `DMS_number_multiple_mutants` of 2 to 4 distinct sites), each row's
    `mutated_sequence` the wild type with its substitutions, every letter the wild type's at its site; and the
    ProteinGym rule's label scores sum over the sites."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from proteingym_benchmark import label_scores, write_assays

    generator = random.Random(11)
    wild_type = "".join(generator.choices(STANDARD_AMINO_ACIDS, k=30))
    columns = ["DMS_id", "DMS_filename", "target_seq", "DMS_number_single_mutants", "DMS_number_multiple_mutants"]
    rows = [
        dict(zip(columns, ("X", "X.csv", wild_type, "75", "40"))),
        dict(zip(columns, ("Y", "Y.csv", wild_type, "", ""))),
    ]
    mutants_of = write_assays(columns, rows, tmp_path, seed=5, reference_counts=True)
    assert len(mutants_of["X"]) == 75 + 40 and len(mutants_of["Y"]) == 30
    with (tmp_path / "assays" / "X.csv").open(newline="") as handle:
        assay = list(csv.DictReader(handle))
    assert [row["mutant"] for row in assay] == mutants_of["X"]
    assert [int(row["mutant"][1:-1]) for row in assay[:30]] == list(range(1, 31))
    for row in assay:
        parts = row["mutant"].split(":")
        sites = [int(part[1:-1]) - 1 for part in parts]
        assert len(parts) == 1 or (2 <= len(parts) <= 4 and len(set(sites)) == len(parts))
        expected = list(wild_type)
        for part, site in zip(parts, sites):
            assert part[0] == wild_type[site] != part[-1]
            expected[site] = part[-1]
        assert row["mutated_sequence"] == "".join(expected)
    assert sum(":" in mutant for mutant in mutants_of["X"]) == 40

    class Vocab:
        def get_vocab(self):
            return {letter: i for i, letter in enumerate(STANDARD_AMINO_ACIDS)}

    log_probs = torch.randn(32, len(STANDARD_AMINO_ACIDS), generator=torch.Generator().manual_seed(2))
    vocab = Vocab().get_vocab()
    mutant = next(m for m in mutants_of["X"] if ":" in m)
    expected_score = sum(
        log_probs[int(p[1:-1]), vocab[p[-1]]].double() - log_probs[int(p[1:-1]), vocab[p[0]]].double()
        for p in mutant.split(":")
    )
    assert abs(label_scores(log_probs, Vocab(), [mutant]).item() - expected_score.item()) < 1e-12


def test_the_commands_output_is_logged_line_by_line_with_the_seconds_its_last_lines_came(tmp_path, monkeypatch):
    """`logged_run`: every line of stdout and stderr in the log, the seconds at which the command's scoring line and
    summary line appeared (as they came: Python runs unbuffered), its exit status and its peak RSS (os.wait4)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from proteingym_benchmark import logged_run

    script = (
        "import sys, time\n"
        "print('set-up')\n"
        "time.sleep(0.4)\n"
        "print('2 assays (0 were already done); this run: ...')\n"
        "print('a warning', file=sys.stderr)\n"
        "time.sleep(0.4)\n"
        "print('average Spearman over selection types (2 assays): bench 0.1')\n"
        "time.sleep(0.2)\n"
        "sys.exit(3)\n"
    )
    log = tmp_path / "log.txt"
    status, seconds, usage, seen = logged_run([sys.executable, "-c", script], log)
    assert status == 3 and usage.ru_maxrss > 0
    lines = log.read_text().splitlines()
    assert lines[0] == "set-up" and lines[1].startswith("2 assays (") and lines[-1].startswith("average Spearman")
    assert "a warning" in lines
    scored, summary = seen["seconds_at_scored_line"], seen["seconds_at_summary_line"]
    assert 0.4 <= scored < summary < seconds and summary - scored >= 0.35 and seconds - summary >= 0.15
