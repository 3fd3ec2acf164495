"""One rule for what a protein may hold (`modeling_nv_esm.protein_residues`), applied alike by the embedding API
(`model.esm.embed`), `nv-esm embed` and the trainer's data reader: either case of ESM-2's residue letters, nothing
else, positions 1-based; a trailing stop mark removed only when asked. No protein silently becomes `<unk>`s."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from conftest import ATOL_FP32, max_abs_diff
from modeling_nv_esm import NVEsmModel, protein_residues
from nv_esm import embed
from nv_esm.records import tokenize

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


@pytest.fixture(scope="module")
def model_and_tokenizer(nv_tiny: Path):
    model = NVEsmModel.from_pretrained(nv_tiny, backend="torch").eval()
    return model, AutoTokenizer.from_pretrained(nv_tiny, trust_remote_code=True)


@pytest.mark.parametrize(
    "sequence,strip_stop,expected",
    [
        ("mktayiakqr", False, "MKTAYIAKQR"),
        ("MkTaY", False, "MKTAY"),
        ("MKTAYIAK*", True, "MKTAYIAK"),
        ("XBUZOxbuzo", False, "XBUZOXBUZO"),
    ],
)
def test_residue_letters_of_either_case_are_read(sequence, strip_stop, expected):
    assert protein_residues(sequence, "p", strip_stop) == expected


@pytest.mark.parametrize(
    "sequence,strip_stop,message",
    [
        ("MKTAYIAK*", False, "p: '*' at residue 9 is not a letter of ESM-2's alphabet (a stop codon's mark"),
        ("MK*A*", True, "p: '*' at residue 3 is not a letter"),  # only a trailing mark is a stop
        ("MK-V", False, "p: '-' at residue 3 is not a letter of ESM-2's alphabet (an alignment gap)"),
        ("M.KV", False, "p: '.' at residue 2"),
        ("MKßV", False, "p: 'ß' at residue 3"),  # 'ß'.upper() would be 'SS'
        ("<mask>", False, "p: '<' at residue 1"),
        ("", False, "p has no residues"),
        ("*", True, "p has no residues"),
        (b"MKV", False, "p is a bytes, not a string"),
    ],
)
def test_anything_else_is_refused_naming_the_protein_and_its_1_based_position(sequence, strip_stop, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        protein_residues(sequence, "p", strip_stop)


def test_the_api_reads_lower_case_as_upper_case_and_refuses_what_it_cannot_read(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    upper = model.embed(["MKTAYIAKQR", "MSKGEELFTG"], tokenizer, show_progress=False)
    lower = model.embed(["mktayiakqr", "MskgeelFTG"], tokenizer, show_progress=False)
    assert torch.equal(lower, upper)
    stripped = model.embed(["MKTAYIAKQR*", "MSKGEELFTG"], tokenizer, show_progress=False, strip_stop=True)
    assert torch.equal(stripped, upper)
    with pytest.raises(ValueError, match="one string; pass \\[sequence\\]"):
        model.embed("MKTAYIAK", tokenizer)
    with pytest.raises(ValueError, match="sequence 1: '\\*' at residue 9"):
        model.embed(["MKV", "MKTAYIAK*"], tokenizer)
    assert model.embed([], tokenizer).shape == (0, model.config.hidden_size)


def write_fasta(path: Path, records: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f">{name}\n{sequence}\n" for name, sequence in records))
    return path


def read_index(folder: Path) -> list[dict[str, str]]:
    with open(folder / "index.tsv", newline="") as file:
        return list(csv.DictReader(file, delimiter="\t"))


def test_the_command_and_the_api_agree_per_protein(model_and_tokenizer, nv_tiny, tmp_path):
    model, tokenizer = model_and_tokenizer
    records = [("lower", "mktayiakqr"), ("stop", "MSKGEELFTG*"), ("empty", ""), ("gap", "MK-V"), ("mixed", "MkV")]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "out"
    argv = [str(nv_tiny), str(fasta), str(out), *CPU, "--invalid", "skip", "--strip-stop"]
    assert embed.main(argv) == 0
    index = read_index(out)
    assert [(row["status"], row["residues"], row["stop_removed"]) for row in index] == [
        ("embedded", "10", "no"),
        ("embedded", "10", "yes"),
        ("skipped: empty", "0", "no"),
        ("skipped: invalid letter", "4", "no"),
        ("embedded", "3", "no"),
    ]
    written = {name: outputs["mean.layer_2"] for name, outputs in embed.iter_embeddings(out)}
    expected = model.embed(["MKTAYIAKQR", "MSKGEELFTG", "MKV"], tokenizer, show_progress=False)
    for name, row in zip(("lower", "stop", "mixed"), expected):
        assert max_abs_diff(written[name], row) <= ATOL_FP32, name


def test_the_command_refuses_an_empty_record_unless_told_to_skip_it(nv_tiny, tmp_path, capsys):
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV"), ("hollow", "")])
    assert embed.main([str(nv_tiny), str(fasta), str(tmp_path / "out"), *CPU]) == 1
    err = capsys.readouterr().err
    assert "record 'hollow' (record 2) has no residues (--invalid skip skips it)" in err and err.count("\n") == 1


def test_the_trainers_reader_applies_the_same_rule():
    assert tokenize("MKV") == [0, 20, 15, 7, 2]
    for sequence, message in (
        ("MK.V", "'.' at residue 3"),
        ("MK-V", "'-' at residue 3"),
        ("MKV*", "'\\*' at residue 4"),
    ):
        with pytest.raises(ValueError, match=message):
            tokenize(sequence)
