"""All the bad rows at once (issue 62): `nv-esm score` (mutants CSV, FASTA), `nv-esm proteingym` (the reference and
the assays) and `nv-esm train`'s data reading (FASTA, text, parquet, labelled CSV) name every bad row of a file in
one error, with its line, as `nv-esm embed` does (`records.bad_records_error`: the first 20, then "... and N
more"); `--invalid skip` never claims to skip what it refuses; counts in messages are singular or plural; scores are
written with 6 decimals; a single-process run does not say "on rank 0"; a progress bar says 100% once.

CPU only, the tiny random checkpoint (`conftest.checkpoint`), each command run in-process.
"""

from __future__ import annotations

import csv
import io
import math
import random
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from nv_esm import embed, embed_plan, job_clock, proteingym, score, scoring
from nv_esm.alphabet import STANDARD_AMINO_ACIDS
from nv_esm.data import MLMStream, read_labelled_csv
from nv_esm.rank_statistics import spearman
from nv_esm.records import BadRecords, RecordRules, plural, row_message

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")
WILD_TYPE = "MKTAYIAKQRQISFVKSHFSRQ"  # 22 residues


def run(command, *argv: object) -> int:
    return command.main([str(arg) for arg in argv])


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def protein(length: int, seed: int) -> str:
    generator = random.Random(seed)
    return "".join(generator.choice(STANDARD_AMINO_ACIDS) for _ in range(length))


# ---- nv-esm score ------------------------------------------------------------------------------------------------


def test_score_names_every_bad_mutant_row_in_one_error(checkpoint, tmp_path, capsys):
    """Bad mutant strings, a wrong wild-type letter, a position outside the protein, a position changed twice and
    an empty mutant: one error, each row with its line, under one line that counts them and says what --invalid
    skip does with them; --invalid skip then scores the rest."""
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(f">wt\n{WILD_TYPE}\n")
    table = tmp_path / "dms.csv"
    table.write_text("mutant,DMS_score\nM1A,1\nK2,2\nW3A,3\nT3A,4\nA99G,5\nK2R:K2A,6\n,7\nA4G,8\n")
    out = tmp_path / "out.csv"
    assert run(score, checkpoint, fasta, out, "--mutants", table, *CPU) == 1
    lines = error_lines(capsys)
    assert lines[0] == f"nv-esm score: error: {table}: 5 bad records (--invalid skip leaves them unscored):"
    assert [line.split(",")[0] for line in lines[1:]] == [
        "  row 2 (line 3)",
        "  row 3 (line 4)",
        "  row 5 (line 6)",
        "  row 6 (line 7)",
        "  row 7 (line 8)",
    ]
    assert "'K2' in mutant 'K2' is not a substitution" in lines[1]
    assert "mutant 'W3A' says position 3 is 'W', but the wild type has 'T' there" in lines[2]
    assert "position 99 of mutant 'A99G' is outside the wild type (1 to 22)" in lines[3]
    assert "changes position 2 twice" in lines[4] and "no mutant" in lines[5]
    assert not out.exists()
    assert run(score, checkpoint, fasta, out, "--mutants", table, *CPU, "--invalid", "skip") == 0
    statuses = [row["status"] for row in csv.DictReader(out.open())]
    assert statuses.count("scored") == 3 and all(s.startswith("skipped: ") for s in statuses if s != "scored")
    assert "8 rows (3 scored, 5 skipped); 0 of 1 part was already done; this run: 3 rows in" in capsys.readouterr().out


def test_score_lists_the_first_20_bad_rows_and_counts_the_rest(checkpoint, tmp_path, capsys):
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(f">wt\n{WILD_TYPE}\n")
    table = tmp_path / "dms.csv"
    table.write_text("mutant\n" + "".join(f"Q{position}A\n" for position in range(30, 55)))  # 25 outside
    assert run(score, checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, *CPU) == 1
    lines = error_lines(capsys)
    assert lines[0].endswith("dms.csv: 25 bad records (--invalid skip leaves them unscored):")
    assert len(lines) == 1 + 20 + 1 and lines[-1] == "  ... and 5 more"
    assert lines[1].startswith("  row 1 (line 2), column 'mutant': position 30") and "row 20 (line 21)" in lines[20]


def test_one_bad_row_is_one_line_as_before(checkpoint, tmp_path, capsys):
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(f">wt\n{WILD_TYPE}\n")
    table = tmp_path / "dms.csv"
    table.write_text("mutant\nM1A\nW3A\n")
    assert run(score, checkpoint, fasta, tmp_path / "out.csv", "--mutants", table, *CPU) == 1
    [line] = error_lines(capsys)
    assert f"{table}: row 2 (line 3), column 'mutant': mutant 'W3A' says position 3 is 'W'" in line
    assert line.endswith("(--invalid skip leaves it unscored).")


def test_score_names_every_bad_fasta_record_in_one_error(checkpoint, tmp_path, capsys):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKJV\n>c\n\n>d\nMK-V\n>e\nMKL\n")
    assert run(score, checkpoint, fasta, tmp_path / "pll.csv", *CPU) == 1
    lines = error_lines(capsys)
    assert lines[0] == f"nv-esm score: error: {fasta}: 3 bad records (--invalid skip skips them):"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  record 'b' (record 2)",
        "  record 'c' (record 3) has no residues.",
        "  record 'd' (record 4)",
    ]


def test_invalid_skip_does_not_claim_to_skip_a_duplicate_id(checkpoint, tmp_path, capsys):
    """A duplicate id is refused whatever --invalid says (ids name the outputs; which copy is meant is the user's
    call): the error of a file with a bad letter and a duplicate id says --invalid skip takes the first, not the
    second, and with --invalid skip the duplicate is refused in words that say skip does not apply to it."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKJV\n>a\nMKL\n>c\nMKW\n")
    assert run(score, checkpoint, fasta, tmp_path / "pll.csv", *CPU) == 1
    lines = error_lines(capsys)
    assert lines[0].endswith("3 bad records") is False and "2 bad records" in lines[0]
    assert "--invalid skip skips them" not in lines[0] and "not the duplicate id" in lines[0]
    assert run(score, checkpoint, fasta, tmp_path / "pll.csv", *CPU, "--invalid", "skip") == 1
    [line] = error_lines(capsys)
    assert "id 'a' appears twice (records 1 and 3)" in line and "--invalid skip does not apply to duplicate ids" in line
    assert not (tmp_path / "pll.csv").exists()


# ---- nv-esm proteingym ------------------------------------------------------------------------------------------


def write_benchmark(folder: Path, assays: dict[str, list[str]], wild_type: str = WILD_TYPE) -> Path:
    """folder/reference.csv and folder/assays/<DMS_id>.csv: `assays` maps each DMS_id to its rows after the header
    `mutant,DMS_score,DMS_score_bin` (each row's text as given)."""
    (folder / "assays").mkdir(parents=True)
    rows = [f"{dms_id},{dms_id}.csv,P{index},{wild_type},Activity" for index, dms_id in enumerate(assays)]
    reference = folder / "reference.csv"
    reference.write_text("DMS_id,DMS_filename,UniProt_ID,target_seq,coarse_selection_type\n" + "\n".join(rows) + "\n")
    for dms_id, lines in assays.items():
        (folder / "assays" / f"{dms_id}.csv").write_text("mutant,DMS_score,DMS_score_bin\n" + "".join(lines))
    return reference


def run_proteingym(checkpoint: Path, reference: Path, out: Path, *options: object) -> int:
    return run(proteingym, checkpoint, reference, reference.parent / "assays", out, *options, *CPU)


def test_proteingym_names_every_bad_row_of_an_assay_in_one_error(checkpoint, tmp_path, capsys):
    """A bad mutant string, a wrong wild-type letter, a position outside the protein, a DMS_score that is not a
    number (one row bad in two columns: both said on its line): one error, rows in file order, with their lines."""
    good = ["M1A,0.5,1\n", "K2R,-0.5,0\n"]
    bad = ["M1A,0.1,1\n", "K2,0.2,0\n", "W3A,0.3,1\n", "A99G,n/a,0\n", "T3A,0.5,1\n", "A4G,high,x\n"]
    reference = write_benchmark(tmp_path, {"S0": good, "S1": bad})
    out = tmp_path / "out"
    assert run_proteingym(checkpoint, reference, out) == 1
    lines = error_lines(capsys)
    assay = tmp_path / "assays" / "S1.csv"
    assert lines[0] == f"nv-esm proteingym: error: {assay}: 4 bad records:"
    assert lines[1].startswith("  row 2 (line 3), column 'mutant': 'K2' in mutant 'K2' is not a substitution")
    assert lines[2].startswith("  row 3 (line 4), column 'mutant': mutant 'W3A' says position 3 is 'W'")
    assert lines[3] == (
        "  row 4 (line 5), column 'DMS_score': 'n/a' is not a number; column 'mutant': position 99 of mutant 'A99G' "
        "is outside the wild type (1 to 22)."
    )
    assert lines[4] == (
        "  row 6 (line 7), column 'DMS_score': 'high' is not a number; column 'DMS_score_bin': 'x' is not a number."
    )
    assert len(lines) == 5 and not out.exists()


def test_proteingym_lists_the_first_20_bad_rows_of_an_assay_and_counts_the_rest(checkpoint, tmp_path, capsys):
    reference = write_benchmark(tmp_path, {"S0": [f"A{position}G,0.5,1\n" for position in range(30, 60)]})
    assert run_proteingym(checkpoint, reference, tmp_path / "out") == 1
    lines = error_lines(capsys)
    assert lines[0].endswith("S0.csv: 30 bad records:") and len(lines) == 22 and lines[-1] == "  ... and 10 more"


def test_proteingym_names_every_bad_row_of_the_reference_in_one_error(checkpoint, tmp_path, capsys):
    reference = write_benchmark(tmp_path, {"S0": ["M1A,0.5,1\n"], "S1": ["M1A,0.5,1\n"]})
    text = reference.read_text().splitlines()
    text += [
        "S0,S0.csv,P9,MKV,Activity",  # a repeated DMS_id
        "S2,missing.csv,P2,MKJV,Activity",  # a missing assay file and a target_seq that is not a protein
        "S3,../S0.csv,P3,MKV,Stability",  # an assay file outside the folder
    ]
    reference.write_text("\n".join(text) + "\n")
    assert run_proteingym(checkpoint, reference, tmp_path / "out") == 1
    lines = error_lines(capsys)
    assert lines[0] == f"nv-esm proteingym: error: {reference}: 3 bad records:"
    assert lines[1] == "  row 3 (line 4), column 'DMS_id': 'S0' repeats row 1."
    assert lines[2].startswith("  row 4 (line 5), column 'DMS_filename': assay file ")
    assert "missing; column 'target_seq': 'J' at residue 3 is not a letter of ESM-2's alphabet." in lines[2]
    assert lines[3].startswith("  row 5 (line 6), column 'DMS_filename': '../S0.csv' is not a file name inside")
    assert len(lines) == 4


# ---- nv-esm train's data ------------------------------------------------------------------------------------------


STREAM = dict(stream_index=0, num_streams=1, token_budget=64, max_length=16)


def test_training_fasta_names_every_bad_record_with_its_line(tmp_path):
    fasta = tmp_path / "train.fasta"
    fasta.write_text(">a\nMKV\nLLA\n>b\nMKJV\n>c\n>d\nMKV\nL1A\n>e\nMKL\n>f\nMK*\n")
    with pytest.raises(ValueError) as raised:
        MLMStream(fasta, **STREAM)
    lines = str(raised.value).splitlines()
    assert lines[0] == f"{fasta}: 4 bad records (--invalid skip leaves them out):"
    assert lines[1] == (
        "  record 2: the sequence: 'J' at residue 3 is not a letter of ESM-2's alphabet; the record starts at line 4."
    )
    assert lines[2] == "  record 3: the sequence has no residues; the record starts at line 6."
    assert lines[3].startswith("  record 4: the sequence: '1' at residue 5") and lines[3].endswith("line 7.")
    assert lines[4].startswith("  record 6: the sequence: '*' at residue 3") and "--strip-stop" in lines[4]
    assert lines[4].endswith("; the record starts at line 12.")
    skipped: MLMStream = MLMStream(fasta, **STREAM, rules=RecordRules("skip"))
    assert len(skipped) == 2 and [problem.split(":")[0] for problem in skipped.skipped] == [
        f"{fasta}, record {number}" for number in (2, 3, 4, 6)
    ]


def test_training_text_and_parquet_files_name_every_bad_record(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("MKV\n\nMKJ\nMKL\nM-K\n")
    with pytest.raises(ValueError, match=r"train.txt: 2 bad records") as raised:
        MLMStream(text, **STREAM)
    assert [line.split(":")[0] for line in str(raised.value).splitlines()[1:]] == ["  record 2", "  record 4"]
    assert "line 3." in str(raised.value) and "line 5." in str(raised.value)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"sequence": ["MKV", "MKJ", None, "", "MKL"]}), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet: 3 bad records") as raised:
        MLMStream(tmp_path / "train.parquet", **STREAM)
    assert [line.split(":")[0] for line in str(raised.value).splitlines()[1:]] == [
        "  record 2",
        "  record 3",
        "  record 4",
    ]


def test_training_lists_the_first_20_bad_records_and_counts_the_rest(tmp_path):
    fasta = tmp_path / "train.fasta"
    fasta.write_text("".join(f">r{i}\nMK{'J' if i % 2 else ''}V\n" for i in range(60)))  # 30 bad
    with pytest.raises(ValueError) as raised:
        MLMStream(fasta, **STREAM)
    lines = str(raised.value).splitlines()
    assert lines[0] == f"{fasta}: 30 bad records (--invalid skip leaves them out):"
    assert len(lines) == 22 and lines[-1] == "  ... and 10 more" and lines[20].startswith("  record 40: ")
    bad = BadRecords(fasta)  # keeps what the error lists, counts the rest
    for number in range(1000):
        bad.append(f"{fasta}, record {number}: bad.")
    assert len(bad) == 1000 and len(bad.kept) == 20 and str(bad.error()).endswith("  ... and 980 more")


def test_a_labelled_csv_names_every_bad_row_and_says_what_skip_leaves_out(tmp_path):
    path = tmp_path / "labelled.csv"
    path.write_text("sequence,label\nMKV,1\nMKJ,0\nMKL,\nMKV,soluble\nMJK,\nMKW,2\n")
    with pytest.raises(ValueError) as raised:
        read_labelled_csv(path, "sequence")
    lines = str(raised.value).splitlines()
    assert lines[0] == (
        f"{path}: 4 bad records (--invalid skip leaves out rows with a bad sequence, not rows with a bad label):"
    )
    assert lines[1].startswith("  row 2 (line 3): the sequence: 'J' at residue 3")
    assert lines[2] == "  row 3 (line 4): empty label."
    assert lines[3] == "  row 4 (line 5): label 'soluble' is not a number."
    assert lines[4].startswith("  row 5 (line 6): the sequence: 'J' at residue 2") and lines[4].endswith(
        "; empty label."
    )
    skipped: list[str] = []
    with pytest.raises(ValueError, match=r"labelled.csv: 2 bad records:\n  row 3 \(line 4\): empty label"):
        read_labelled_csv(path, "sequence", RecordRules("skip"), skipped)  # no claim of skip: it cannot take them
    assert [problem.split(":")[0] for problem in skipped] == [f"{path}, row 2 (line 3)", f"{path}, row 5 (line 6)"]
    path.write_text("sequence,labels\nMKV,CCH\nMKVL,CCH\nMK,C\n")
    with pytest.raises(ValueError, match=r"2 bad records:\n  row 2 \(line 3\): 3 labels for 4 residues"):
        read_labelled_csv(path, "token")


def test_embed_lists_the_first_20_bad_records_and_counts_the_rest(tmp_path):
    """`nv-esm embed`'s first pass reports through `BadRecords` as the other readers do: 20 listed in file order,
    the rest counted, and its own advice (here: what --invalid skip takes, and that it does not take a duplicate id)."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">r{i}\nMK{'J' if i % 2 else ''}V\n" for i in range(60)) + ">r0\nMKV\n")  # 30 + 1 bad
    with pytest.raises(ValueError) as raised:
        embed_plan.scan_fasta(fasta, 100, "error", "error")
    lines = str(raised.value).splitlines()
    assert lines[0] == (
        f"{fasta}: 31 bad records (--invalid skip skips the 30 records with letters outside the alphabet or no "
        "residues, not the duplicate ids):"
    )
    assert lines[1].startswith("  record 'r1' (record 2): ") and lines[20].startswith("  record 'r39' (record 40): ")
    assert len(lines) == 22 and lines[-1] == "  ... and 11 more"


def test_a_rows_problems_are_one_message_on_its_line():
    """`row_message`: the first problem whole, the others without the row's name, in one sentence; whichever of
    ": " and ", " follows the name (the labelled CSV's, ProteinGym's)."""
    where = "data.csv, row 2 (line 3)"
    assert row_message(where, [f"{where}: empty label."]) == f"{where}: empty label."
    assert row_message(where, [f"{where}: bad sequence.", f"{where}: empty label."]) == (
        f"{where}: bad sequence; empty label."
    )
    where = "assay.csv: row 4 (line 5)"
    problems = [f"{where}, column 'DMS_score': 'n/a' is not a number.", f"{where}, column 'mutant': outside"]
    assert row_message(where, problems) == (
        f"{where}, column 'DMS_score': 'n/a' is not a number; column 'mutant': outside."
    )


# ---- messages, numbers and bars -----------------------------------------------------------------------------------


def test_plural():
    assert [plural(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert plural(1, "assay") == "1 assay" and plural(3, "assay") == "3 assays"
    assert plural(1, "copy", "copies") == "1 copy" and plural(2, "copy", "copies") == "2 copies"


def test_scores_are_written_with_6_decimals_and_rank_as_the_full_values():
    """`score_text`: fixed 6 decimals, no "-0.000000", NaN and infinities as Python writes them; a text read back
    and written again is the same text; Spearman's rho of the texts is that of the full values within 1e-6."""
    assert scoring.score_text(-0.31468677520751953) == "-0.314687"
    assert scoring.score_text(-267.3798825740814) == "-267.379883"
    assert [scoring.score_text(v) for v in (0.0, -0.0, -4e-7, 4e-7)] == ["0.000000"] * 4
    assert [scoring.score_text(v) for v in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]
    generator = torch.Generator().manual_seed(62)
    values = (torch.randn(5000, generator=generator, dtype=torch.float64) * 3).tolist()
    texts = [scoring.score_text(v) for v in values]
    assert [scoring.score_text(float(t)) for t in texts] == texts
    assert max(abs(float(t) - v) for t, v in zip(texts, values)) <= 5e-7
    measured = torch.randn(5000, generator=generator, dtype=torch.float64).tolist()
    # values closer than 1e-6 become ties (two pairs, about, of 5000 such values): rho moves by far less than 1e-6
    assert spearman([float(t) for t in texts], measured) == pytest.approx(spearman(values, measured), abs=1e-6)


def test_a_single_process_run_does_not_say_on_rank_0_and_counts_in_the_singular(checkpoint, tmp_path, capsys):
    """One record, one row, one assay, one shard, one part: singular nouns; no "on rank 0" without ranks."""
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(f">wt\n{WILD_TYPE}\n")
    table = tmp_path / "dms.csv"
    table.write_text("mutant,DMS_score\nM1A,1\n")
    assert run(score, checkpoint, fasta, tmp_path / "s.csv", "--mutants", table, *CPU) == 0
    said = capsys.readouterr().out
    assert "1 row (1 scored); 0 of 1 part was already done; this run: 1 row in " in said and " rows/s)" in said
    assert "rows):" not in said and "(1 row): masked_marginal" in said
    assert run(score, checkpoint, fasta, tmp_path / "p.csv", *CPU) == 0
    said += capsys.readouterr().out
    [row] = csv.DictReader((tmp_path / "p.csv").open())
    assert len(row["pll"].split(".")[1]) == 6 and len(row["pseudo_perplexity"].split(".")[1]) == 6
    assert run(embed, checkpoint, fasta, tmp_path / "emb", *CPU) == 0
    said += capsys.readouterr().out
    assert "1 record (1 embedded); 0 of 1 shard was already done; this run: 1 protein in" in said
    reference = write_benchmark(tmp_path / "pg", {"S0": ["M1A,0.5,1\n", "K2R,-0.5,0\n", "T3A,0.1,1\n"]})
    assert run_proteingym(checkpoint, reference, tmp_path / "pg_out") == 0
    said += capsys.readouterr().out
    assert "1 assay (0 were already done); this run:" in said and "(1 assay):" in said
    assert "rank 0" not in said, said
    for row in csv.DictReader((tmp_path / "pg_out" / "S0.csv").open()):
        assert len(row["esm2_tiny_nv"].split(".")[1]) == 6


def test_a_progress_bar_says_100_percent_once(monkeypatch):
    """tqdm rounds 99.6% to "100%" and prints the bar again when it closes: in a log, 100% twice. The commands' bar
    says 99% until the work is done, then 100% once."""

    def shown(bar_class) -> list[str]:
        log = io.StringIO()
        bar = bar_class(total=1000, desc="scoring", unit="token", file=log, mininterval=0, miniters=1)
        for step in (300, 696, 4):
            bar.update(step)
        bar.close()
        return [line.split("|")[0] for line in log.getvalue().replace("\r", "\n").splitlines() if line]

    assert shown(tqdm).count("scoring: 100%") == 3  # tqdm's: at 99.6%, at the end, and when it closes
    assert shown(job_clock.WholeBar) == ["scoring:   0%", "scoring:  30%", "scoring:  99%", "scoring: 100%"]
    bar = job_clock.progress_bar(10, "x", "protein", disable=True)
    bar.update(10)
    bar.close()
