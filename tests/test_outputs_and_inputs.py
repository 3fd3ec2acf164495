"""Issue 61 for `nv-esm score`, `embed` and `proteingym`: nothing lost, nothing outside the output, nothing stale.

A command never writes over, into or around what it reads (its output against its checkpoint and input files,
refused in one line before anything is read); `--overwrite` deletes only what the command wrote; a rerun keeps an
output only while the inputs it was computed from are the same; a file name read from data stays in its folder.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_proteingym import random_mutants, random_sequence, write_benchmark

from nv_esm import embed, proteingym, score

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")
WILD_TYPE = "MKTAYIAKQRQISFVKSHFSRQ"
OVERLAP = "a command never writes over, into or around what it reads"


def call(main, *argv: object) -> int:
    return main([str(arg) for arg in argv])


def one_line_error(capsys: pytest.CaptureFixture, command: str) -> str:
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith(f"nv-esm {command}: error: "), error
    return error


def unreachable(*args: object, **kwargs: object) -> None:
    raise AssertionError("the checkpoint was read: the refusal comes first")


@pytest.fixture
def score_inputs(tmp_path: Path) -> dict[str, Path]:
    """A wild type, a mutants CSV with measured scores, and a FASTA file of proteins."""
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n")
    (tmp_path / "m.csv").write_text("mutant,DMS_score\nM1A,0.5\nK2R,-1.0\nT3S,0.25\n")
    (tmp_path / "p.fasta").write_text(f">a\n{WILD_TYPE}\n>b\n{WILD_TYPE[:12]}\n")
    return {"wt": tmp_path / "wt.fasta", "mutants": tmp_path / "m.csv", "proteins": tmp_path / "p.fasta"}


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("output_is_the_wild_type", "is the FASTA file"),
        ("output_is_the_mutants", "is the mutants CSV"),
        ("output_is_the_pll_fasta", "is the FASTA file"),
        ("output_in_the_checkpoint", "lies inside the checkpoint"),
        ("plot_is_the_mutants", "its plot"),
        ("parts_folder_holds_an_input", "its parts folder"),
    ],
)
def test_score_never_writes_over_into_or_around_its_inputs(
    case, reason, checkpoint, score_inputs, tmp_path, capsys, monkeypatch
):
    """Every path score writes (OUTPUT, OUTPUT's .png, OUTPUT.parts/) is checked against the checkpoint, the FASTA
    file and the mutants CSV, in one line, before the checkpoint is read; the input is left as it was."""
    wt, mutants, proteins = score_inputs["wt"], score_inputs["mutants"], score_inputs["proteins"]
    if case == "plot_is_the_mutants":  # m.csv's plot would be m.png, the mutants CSV
        mutants = mutants.rename(tmp_path / "m.png")
    if case == "parts_folder_holds_an_input":  # o.csv.parts/ holds the FASTA file
        (tmp_path / "o.csv.parts").mkdir()
        proteins = proteins.rename(tmp_path / "o.csv.parts" / "p.fasta")
    argv = {
        "output_is_the_wild_type": [wt, wt, "--mutants", mutants],
        "output_is_the_mutants": [wt, mutants, "--mutants", mutants],
        "output_is_the_pll_fasta": [proteins, proteins],
        "output_in_the_checkpoint": [proteins, checkpoint / "config.json"],
        "plot_is_the_mutants": [wt, tmp_path / "m.csv", "--mutants", mutants],
        "parts_folder_holds_an_input": [proteins, tmp_path / "o.csv"],
    }[case]
    before = {path: path.read_bytes() for path in [*tmp_path.rglob("*"), *checkpoint.iterdir()] if path.is_file()}
    monkeypatch.setattr(score, "load_config", unreachable)
    assert call(score.main, checkpoint, *argv, *CPU) == 1
    error = one_line_error(capsys, "score")
    assert OVERLAP in error and reason in error
    after = {path: path.read_bytes() for path in [*tmp_path.rglob("*"), *checkpoint.iterdir()] if path.is_file()}
    assert after == before


def test_score_replaces_the_plot_beside_its_output_only_with_overwrite(checkpoint, score_inputs, tmp_path, capsys):
    """out.png beside out.csv is the picture a mutant run with measured scores draws: an existing one (the user's)
    is refused like an existing output, before the model loads, and replaced with --overwrite."""
    out, png = tmp_path / "out.csv", tmp_path / "out.png"
    png.write_bytes(b"the user's picture")
    argv = [checkpoint, score_inputs["wt"], out, "--mutants", score_inputs["mutants"], *CPU]
    assert call(score.main, *argv) == 1
    error = one_line_error(capsys, "score")
    assert f"{png} exists" in error and "--overwrite" in error
    assert png.read_bytes() == b"the user's picture" and not out.exists()
    assert call(score.main, *argv, "--overwrite") == 0
    assert out.exists()
    # an output named as its own plot would be written over by it
    assert call(score.main, checkpoint, score_inputs["wt"], png, "--mutants", score_inputs["mutants"], *CPU) == 1
    assert "is the name of the plot" in one_line_error(capsys, "score")


@pytest.mark.parametrize("case", ["in_the_checkpoint", "is_the_fasta", "is_the_checkpoint", "holds_the_fasta"])
def test_embed_never_writes_over_into_or_around_its_inputs(case, checkpoint, score_inputs, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    fasta = score_inputs["proteins"]
    out = {
        "in_the_checkpoint": checkpoint / "embeddings",
        "is_the_fasta": fasta,
        "is_the_checkpoint": checkpoint,
        "holds_the_fasta": tmp_path,
    }[case]
    before = sorted(checkpoint.rglob("*"))
    monkeypatch.setattr(embed, "load_config", unreachable)
    assert call(embed.main, checkpoint, fasta, out, *CPU) == 1
    assert OVERLAP in one_line_error(capsys, "embed")
    assert sorted(checkpoint.rglob("*")) == before and fasta.read_text().startswith(">a")


def test_embed_refuses_an_output_folder_of_other_settings_before_the_model_loads(
    checkpoint, score_inputs, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "emb"
    assert call(embed.main, checkpoint, score_inputs["proteins"], out, *CPU) == 0
    monkeypatch.setattr(embed, "load_model", unreachable)
    assert call(embed.main, checkpoint, score_inputs["proteins"], out, "--shard-size", "1", *CPU) == 1
    assert "holds a run with other settings" in one_line_error(capsys, "embed")


# -- nv-esm proteingym ------------------------------------------------------------------------------------------


@pytest.fixture
def reference_csv(tmp_path: Path) -> Path:
    """ProteinGym's layout under tmp_path/bench: the reference CSV (returned) and assays/ with S0, S1."""
    generator = torch.Generator().manual_seed(610)
    assays = {
        f"S{i}": (wt := random_sequence(20 + i, generator), random_mutants(wt, generator, [1, 7, 12], 4))
        for i in range(2)
    }
    return write_benchmark(tmp_path / "bench", assays, generator)


def run_proteingym(checkpoint: Path, reference: Path, out: Path, *options: object) -> int:
    return call(proteingym.main, checkpoint, reference, reference.parent / "assays", out, *options, *CPU)


@pytest.mark.parametrize("case", ["in_the_assays", "in_the_checkpoint", "holds_the_reference", "is_the_assays"])
def test_proteingym_never_writes_over_into_or_around_its_inputs(
    case, checkpoint, reference_csv, tmp_path, capsys, monkeypatch
):
    out = {
        "in_the_assays": reference_csv.parent / "assays" / "out",
        "in_the_checkpoint": checkpoint / "pg",
        "holds_the_reference": reference_csv.parent,
        "is_the_assays": reference_csv.parent / "assays",
    }[case]
    before = sorted(tmp_path.rglob("*")), sorted(checkpoint.rglob("*"))
    monkeypatch.setattr(proteingym, "load_config", unreachable)
    assert run_proteingym(checkpoint, reference_csv, out) == 1
    assert OVERLAP in one_line_error(capsys, "proteingym")
    assert (sorted(tmp_path.rglob("*")), sorted(checkpoint.rglob("*"))) == before


def rewrite_csv(path: Path, change) -> None:
    """`path` (a CSV) with `change(rows)` applied to its rows (dicts)."""
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        columns, rows = reader.fieldnames, list(reader)
    change(rows)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, columns)
        writer.writeheader()
        writer.writerows(rows)


def test_proteingym_overwrite_deletes_only_what_it_wrote(checkpoint, reference_csv, tmp_path, capsys):
    """A user's own files in OUT (a CSV, which OUT's names cannot tell from an assay's, a file in summary/) stay
    when --overwrite replaces a run of other settings; the earlier run's assays, records and summary go."""
    out = tmp_path / "out"
    assert run_proteingym(checkpoint, reference_csv, out) == 0
    (out / "notes.csv").write_text("mine,keep\n1,2\n")
    (out / "summary" / "my_plot.txt").write_text("mine")
    assert (
        run_proteingym(checkpoint, reference_csv, out, "--assays", "S1", "--methods", "wt-marginals", "--overwrite")
        == 0
    )
    assert (out / "notes.csv").read_text() == "mine,keep\n1,2\n"
    assert (out / "summary" / "my_plot.txt").read_text() == "mine"
    assert sorted(path.name for path in out.glob("*.csv")) == ["S1.csv", "notes.csv"]  # S0: the earlier run's
    assert sorted(path.name for path in (out / "inputs").iterdir()) == ["S1.json"]
    assert "esm2_tiny_nv_wt-marginals" in (out / "S1.csv").read_text()


@pytest.mark.parametrize("change", ["assay_file", "target_seq", "no_record"])
def test_proteingym_refuses_an_assay_whose_inputs_changed_unless_overwrite(
    change, checkpoint, reference_csv, tmp_path, capsys, monkeypatch
):
    """A rerun keeps an assay's file only while its assay file's bytes and its reference row's target_seq are the
    ones it was scored from (OUT/inputs/<DMS_id>.json): else one line naming the file and what changed, before the
    model loads; --overwrite scores it again (and only it)."""
    out = tmp_path / "out"
    assert run_proteingym(checkpoint, reference_csv, out) == 0
    capsys.readouterr()
    scored = {name: (out / name).read_bytes() for name in ("S0.csv", "S1.csv")}
    if change == "assay_file":  # a measured score corrected: the assay's file is not the one scored
        rewrite_csv(reference_csv.parent / "assays" / "S0.csv", lambda rows: rows[0].update(DMS_score="9.0"))
        reason = "was scored from other inputs (the assay file's content changed)"
    elif change == "target_seq":  # a residue no mutant touches

        def mutate_16(rows: list[dict[str, str]]) -> None:
            sequence = rows[0]["target_seq"]
            rows[0]["target_seq"] = sequence[:15] + ("W" if sequence[15] != "W" else "Y") + sequence[16:]

        rewrite_csv(reference_csv, mutate_16)
        reason = "was scored from other inputs (the reference's target_seq changed)"
    else:  # an earlier nv-esm wrote no record
        (out / "inputs" / "S0.json").unlink()
        reason = "has no record of the inputs it was scored from"
    loads = []
    real_load = proteingym.load_masked_lm
    monkeypatch.setattr(proteingym, "load_masked_lm", lambda *args: loads.append(1) or real_load(*args))
    assert run_proteingym(checkpoint, reference_csv, out) == 1
    error = one_line_error(capsys, "proteingym")
    assert f"{out / 'S0.csv'} {reason}" in error and "--overwrite" in error
    assert not loads and {name: (out / name).read_bytes() for name in scored} == scored
    written = []
    real_write = proteingym.write_assay
    monkeypatch.setattr(proteingym, "write_assay", lambda path, *a: (written.append(path.name), real_write(path, *a)))
    assert run_proteingym(checkpoint, reference_csv, out, "--overwrite") == 0
    assert written == ["S0.csv"] and (out / "S1.csv").read_bytes() == scored["S1.csv"]
    if change == "assay_file":
        assert "9.0" in (out / "S0.csv").read_text()
    assert run_proteingym(checkpoint, reference_csv, out) == 0  # the new record: a rerun keeps it
    assert written == ["S0.csv"]


def test_proteingym_an_assay_file_is_written_only_after_its_record(checkpoint, reference_csv, tmp_path, monkeypatch):
    """A run cut off after recording an assay's inputs but before its file leaves no file: the rerun scores it."""
    out = tmp_path / "out"
    real_write, killing = proteingym.write_assay, [True]

    def killed(path, *args):
        if killing:
            raise KeyboardInterrupt
        real_write(path, *args)

    monkeypatch.setattr(proteingym, "write_assay", killed)
    assert run_proteingym(checkpoint, reference_csv, out) == 130
    records = list((out / "inputs").glob("*.json"))
    assert len(records) == 1 and not list(out.glob("S*.csv"))
    killing.clear()
    assert run_proteingym(checkpoint, reference_csv, out) == 0
    assert {path.name for path in out.glob("S*.csv")} == {"S0.csv", "S1.csv"}
    record = json.loads((out / "inputs" / "S0.json").read_text())
    assert record["DMS_id"] == "S0" and len(record["assay_sha256"]) == 64


@pytest.mark.parametrize("name", ["../outside.csv", "ABSOLUTE"])
def test_proteingym_dms_filename_stays_in_the_assays_folder(name, checkpoint, reference_csv, tmp_path, capsys):
    outside = reference_csv.parent / "outside.csv"
    shutil.copy(reference_csv.parent / "assays" / "S0.csv", outside)
    name = str(outside) if name == "ABSOLUTE" else name
    rewrite_csv(reference_csv, lambda rows: rows[0].update(DMS_filename=name))
    assert run_proteingym(checkpoint, reference_csv, tmp_path / "out") == 1
    error = one_line_error(capsys, "proteingym")
    assert "column 'DMS_filename'" in error and "is not a file name inside" in error
    assert not (tmp_path / "out").exists()
