"""`nv-esm embed` (nv_esm/embed.py) against transformers' `EsmForMaskedLM` on the same weights.

The reference runs each protein alone through transformers (fp32, CPU, eager attention) and pools it here:
mean over residues of `hidden_states[L]` (`<cls>`/`<eos>` excluded), the `<cls>` state, the residue states, and
`predict_contacts`. Windows and crops are cut here from the protein, independently of the command's code.
Tolerances: ATOL_FP32 (1e-5) on hidden states; 1e-4 on contact probabilities (tests/test_attention.py says why).
The command runs with `--device cpu --backend torch`, so the same numbers hold on a GPU machine with TE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer, EsmForMaskedLM, EsmTokenizer

import convert_checkpoint
from conftest import ATOL_FP32, max_abs_diff
from nv_esm import embed, embed_plan
from nv_esm.alphabet import STANDARD_AMINO_ACIDS

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")
ATOL_CONTACTS = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_source) -> EsmForMaskedLM:
    return EsmForMaskedLM.from_pretrained(tiny_source, attn_implementation="eager").eval()


def random_sequence(length: int, generator: torch.Generator) -> str:
    return "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (length,), generator=generator))


def write_fasta(path: Path, records: list[tuple[str, str]], width: int = 60) -> Path:
    with open(path, "w") as fasta:
        for record_id, sequence in records:
            fasta.write(f">{record_id} some description\n")
            fasta.writelines(sequence[i : i + width] + "\n" for i in range(0, len(sequence), width))
    return path


def run_embed(*argv: object) -> int:
    return embed.main([str(arg) for arg in argv])


def transformers_outputs(model: EsmForMaskedLM, sequence: str, layers: list[int]) -> dict[str, torch.Tensor]:
    """The command's outputs for one protein, computed by transformers on that protein alone."""
    from nv_esm.alphabet import CLS, EOS, RESIDUE_TO_ID

    ids = torch.tensor([[CLS, *(RESIDUE_TO_ID[c] for c in sequence.upper()), EOS]])
    with torch.no_grad():
        states = model.esm(ids, output_hidden_states=True).hidden_states
        contacts = model.predict_contacts(ids, torch.ones_like(ids))[0]
    result = {"contacts": contacts}
    for layer in layers:
        residues = states[layer][0, 1:-1]
        result |= {
            f"mean.layer_{layer}": residues.mean(0),
            f"cls.layer_{layer}": states[layer][0, 0],
            f"per_residue.layer_{layer}": residues,
        }
    return result


def read_index(folder: Path) -> list[dict[str, str]]:
    header, *rows = (folder / "index.tsv").read_text().splitlines()
    return [dict(zip(header.split("\t"), row.split("\t"))) for row in rows]


def test_tokenize_matches_the_esm_tokenizer_and_refuses_other_characters(checkpoint):
    tokenizer = EsmTokenizer.from_pretrained(checkpoint)  # transformers' own, the independent reference
    letters = "ACDEFGHIKLMNPQRSTVWYXBUZO"
    generator = torch.Generator().manual_seed(5)
    for length in (0, 1, 2, 7, 1022, 5000):
        picks = torch.randint(0, 2 * len(letters), (length,), generator=generator).tolist()
        sequence = "".join(letters[i % len(letters)].lower() if i >= len(letters) else letters[i] for i in picks)
        ids = embed_plan.tokenize(sequence)
        assert ids.dtype == torch.int64 and ids.shape == (length + 2,)
        assert ids.tolist() == tokenizer(sequence.upper())["input_ids"]
    for sequence in ("MK*L", "MK-L", "MK.L", "MKJ", "MK L", "MKé", "MK\u2603", "\x00"):
        with pytest.raises(ValueError, match="changed during the run"):
            embed_plan.tokenize(sequence)


def test_every_output_matches_transformers_per_protein(checkpoint, reference, tmp_path):
    """Random lengths (1 residue, the --max-length protein, lower-case letters), several shards and batches,
    layers given as negative and positive indices."""
    generator = torch.Generator().manual_seed(80)
    lengths = [1, 300, *torch.randint(2, 120, (9,), generator=generator).tolist()]
    records = [(f"prot_{i}", random_sequence(n, generator)) for i, n in enumerate(lengths)]
    records[3] = (records[3][0], records[3][1].lower())
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "out"
    include = ("--include", "mean", "cls", "per_residue", "contacts")
    assert run_embed(checkpoint, fasta, out, "--layers", "-1", "0", "-2", *include, *CPU, "--max-length", 300,
                     "--shard-size", 4, "--tokens-per-batch", 256) == 0  # fmt: skip
    last = reference.config.num_hidden_layers
    layers = [0, last - 1, last]
    shards = sorted(p.name for p in out.glob("embeddings-*.safetensors"))
    assert shards == [f"embeddings-0000{i}.safetensors" for i in range(3)]
    produced = dict(embed.iter_embeddings(out))
    assert list(produced) == [record_id for record_id, _ in records]
    for record_id, sequence in records:
        expected = transformers_outputs(reference, sequence, layers)
        assert set(produced[record_id]) == set(expected), record_id
        for name, value in expected.items():
            tolerance = ATOL_CONTACTS if name == "contacts" else ATOL_FP32
            assert produced[record_id][name].shape == value.shape, (record_id, name)
            assert max_abs_diff(produced[record_id][name], value) <= tolerance, (record_id, name)
    index = read_index(out)
    assert [row["id"] for row in index] == [record_id for record_id, _ in records]
    assert {row["status"] for row in index} == {"embedded"}
    assert [(row["shard"], row["row"]) for row in index[4:6]] == [
        ("embeddings-00001.safetensors", "0"),
        ("embeddings-00001.safetensors", "1"),
    ]
    import matplotlib.image  # the first 4 proteins' contact maps, side by side

    assert matplotlib.image.imread(out / "contacts.png").std() > 0


def test_per_protein_output_equals_model_embed(checkpoint, tmp_path):
    generator = torch.Generator().manual_seed(81)
    sequences = [random_sequence(n, generator) for n in torch.randint(1, 200, (12,), generator=generator).tolist()]
    fasta = write_fasta(tmp_path / "in.fasta", [(f"p{i}", s) for i, s in enumerate(sequences)])
    # other batches and shards than embed()'s 16,384-token batches: the same numbers
    other = ("--tokens-per-batch", 64, "--shard-size", 5)
    assert (
        run_embed(checkpoint, fasta, tmp_path / "out", "--include", "mean", "cls", "--layers", "-2", *other, *CPU) == 0
    )
    model = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, backend="torch").eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)
    produced = [outputs for _, outputs in embed.iter_embeddings(tmp_path / "out")]
    layer = model.config.num_hidden_layers - 1
    for pooling in ("mean", "cls"):
        expected = model.embed(sequences, tokenizer, layer=-2, pooling=pooling, show_progress=False)
        ours = torch.stack([outputs[f"{pooling}.layer_{layer}"] for outputs in produced])
        assert max_abs_diff(ours, expected) <= 1e-6


def test_long_proteins_crop_window_skip_and_error(checkpoint, reference, tmp_path):
    generator = torch.Generator().manual_seed(82)
    long_one, short_one, very_long = (random_sequence(n, generator) for n in (70, 20, 131))
    fasta = write_fasta(tmp_path / "in.fasta", [("long", long_one), ("short", short_one), ("very_long", very_long)])
    last = reference.config.num_hidden_layers
    common = (*CPU, "--max-length", 40, "--include", "mean", "cls", "per_residue")

    status = run_embed(checkpoint, fasta, tmp_path / "error", *common)
    assert status == 1 and not (tmp_path / "error").exists()

    assert run_embed(checkpoint, fasta, tmp_path / "skip", *common, "--too-long", "skip") == 0
    assert [row["status"] for row in read_index(tmp_path / "skip")] == [
        "skipped: too long",
        "embedded",
        "skipped: too long",
    ]
    assert [record_id for record_id, _ in embed.iter_embeddings(tmp_path / "skip")] == ["short"]

    assert run_embed(checkpoint, fasta, tmp_path / "crop", *common, "--too-long", "crop") == 0
    cropped = dict(embed.iter_embeddings(tmp_path / "crop"))
    for record_id, sequence in (("long", long_one), ("very_long", very_long)):
        expected = transformers_outputs(reference, sequence[:40], [last])
        for name in (f"mean.layer_{last}", f"per_residue.layer_{last}"):
            assert max_abs_diff(cropped[record_id][name], expected[name]) <= ATOL_FP32

    assert run_embed(checkpoint, fasta, tmp_path / "window", *common, "--too-long", "window") == 0
    windowed = dict(embed.iter_embeddings(tmp_path / "window"))
    for record_id, sequence in (("long", long_one), ("very_long", very_long)):
        # windows of 40 every 20 residues, the last ending at the end: 0, 20, (40,) ..., len - 40
        starts = sorted({*range(0, len(sequence) - 40, 20), len(sequence) - 40})
        total, count, cls = torch.zeros(len(sequence), reference.config.hidden_size), torch.zeros(len(sequence)), 0
        for start in starts:
            outputs = transformers_outputs(reference, sequence[start : start + 40], [last])
            total[start : start + 40] += outputs[f"per_residue.layer_{last}"]
            count[start : start + 40] += 1
            cls = cls + outputs[f"cls.layer_{last}"] / len(starts)
        per_residue = total / count[:, None]
        assert max_abs_diff(windowed[record_id][f"per_residue.layer_{last}"], per_residue) <= ATOL_FP32
        assert max_abs_diff(windowed[record_id][f"mean.layer_{last}"], per_residue.mean(0)) <= ATOL_FP32
        assert max_abs_diff(windowed[record_id][f"cls.layer_{last}"], cls) <= ATOL_FP32
    assert [row["status"] for row in read_index(tmp_path / "window")] == ["windowed", "embedded", "windowed"]
    index = read_index(tmp_path / "crop")
    assert [(row["residues"], row["embedded_residues"]) for row in index] == [("70", "40"), ("20", "20"), ("131", "40")]


def test_the_first_pass_names_the_bad_record(checkpoint, tmp_path, capsys):
    cases = {
        "invalid letter": ([("a", "MKV"), ("b2", "MKJV")], "record 'b2' (record 2): 'J' at residue 3"),
        "stop codon": ([("a", "MKV*")], "'*' at residue 4 is not a letter of ESM-2's alphabet (a stop codon"),
        "duplicate id": ([("x", "MK"), ("y", "MK"), ("x", "MV")], "id 'x' appears twice (records 1 and 3)"),
        "too long": ([("a", "M" * 5), ("tall", "M" * 41)], "record 'tall' (record 2) has 41 residues"),
        "gap": ([("aligned", "MK-V")], "'-' at residue 3 is not a letter of ESM-2's alphabet (an alignment gap)"),
        "non-ASCII": ([("a", "MKßV")], "'ß' at residue 3 is not a letter"),  # 'ß'.upper() would be 'SS'
        "dotless i": ([("a", "MıKV")], "'ı' at residue 2 is not a letter"),  # 'ı'.upper() would be 'I'
    }
    for name, (records, message) in cases.items():
        fasta = write_fasta(tmp_path / f"{name}.fasta", records)
        assert run_embed(checkpoint, fasta, tmp_path / name, *CPU, "--max-length", 40) == 1, name
        err = capsys.readouterr().err
        assert message in err, (name, err)
        assert not (tmp_path / name).exists(), name
    empty = tmp_path / "empty.fasta"
    empty.write_text("")
    assert run_embed(checkpoint, empty, tmp_path / "out", *CPU) == 1
    assert "no FASTA records" in capsys.readouterr().err


def test_invalid_skip_keeps_the_rest_and_says_so_in_the_index(checkpoint, tmp_path):
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV"), ("b", "MK1V"), ("c", "MKVL")])
    assert run_embed(checkpoint, fasta, tmp_path / "out", *CPU, "--invalid", "skip") == 0
    assert [row["status"] for row in read_index(tmp_path / "out")] == [
        "embedded",
        "skipped: invalid letter",
        "embedded",
    ]
    assert [record_id for record_id, _ in embed.iter_embeddings(tmp_path / "out")] == ["a", "c"]


def test_a_rerun_resumes_and_other_settings_are_refused(checkpoint, tmp_path, capsys):
    generator = torch.Generator().manual_seed(83)
    records = [(f"p{i}", random_sequence(n, generator)) for i, n in enumerate([5, 9, 30, 2, 17, 8, 44])]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "out"
    args = (checkpoint, fasta, out, *CPU, "--shard-size", 3)
    assert run_embed(*args) == 0
    first = dict(embed.iter_embeddings(out))
    shards = sorted(out.glob("embeddings-*.safetensors"))
    stamps = {path.name: path.stat().st_mtime_ns for path in shards}
    shards[1].unlink()
    (out / "embeddings-00001.safetensors.tmp").write_text("a shard cut off mid-write")
    capsys.readouterr()
    assert run_embed(*args) == 0
    assert "this run: 3 proteins" in capsys.readouterr().out
    assert not list(out.glob("*.tmp"))
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("embeddings-*.safetensors") if p.name != shards[1].name}
    assert kept == {name: stamp for name, stamp in stamps.items() if name != shards[1].name}
    again = dict(embed.iter_embeddings(out))
    assert list(again) == list(first) and all(
        torch.equal(again[k]["mean.layer_2"], first[k]["mean.layer_2"]) for k in first
    )

    assert run_embed(*args, "--layers", "0") == 1
    assert "layers: [2] -> [0]" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("embeddings-*.safetensors")) == [p.name for p in shards]  # nothing deleted
    assert run_embed(*args, "--layers", "0", "--overwrite") == 0
    assert set(next(embed.iter_embeddings(out))[1]) == {"mean.layer_0"}

    (out / "notes.txt").write_text("mine")
    assert run_embed(*args, "--layers", "0") == 1
    assert "did not write (notes.txt)" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_one_index_and_the_same_numbers(checkpoint, tmp_path):
    generator = torch.Generator().manual_seed(84)
    lengths = torch.randint(1, 60, (11,), generator=generator).tolist()
    records = [(f"p{i}", random_sequence(n, generator)) for i, n in enumerate(lengths)]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    args = [str(checkpoint), str(fasta), "--shard-size", "2", "--include", "mean", "per_residue", *CPU]
    assert run_embed(args[0], args[1], single, *args[2:]) == 0
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "nv_esm", "embed", args[0], args[1], str(ranks), *args[2:]]
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (ranks / "index.tsv").read_text() == (single / "index.tsv").read_text()
    ours, theirs = dict(embed.iter_embeddings(ranks)), dict(embed.iter_embeddings(single))
    assert list(ours) == list(theirs)
    for record_id in ours:
        for name, value in theirs[record_id].items():
            assert max_abs_diff(ours[record_id][name], value) <= ATOL_FP32


def test_a_transformers_checkpoint_is_refused_with_the_conversion_command(tiny_source, tmp_path, capsys):
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV")])
    assert run_embed(tiny_source, fasta, tmp_path / "out", *CPU) == 1
    assert f"nv-esm convert hf-to-te {tiny_source} OUT" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_folders_hold_only_what_the_command_wrote(checkpoint, tmp_path, capsys):
    """A folder with someone else's files, or shards without their manifest, is refused and left as it was; an
    unfinished folder does not read as complete."""
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV"), ("b", "MKVL")])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.tmp").write_text("mine")
    assert run_embed(checkpoint, fasta, foreign, *CPU) == 1
    assert "did not write (results.tmp)" in capsys.readouterr().err
    assert (foreign / "results.tmp").read_text() == "mine"

    out = tmp_path / "out"
    assert run_embed(checkpoint, fasta, out, *CPU) == 0
    (out / "manifest.json").unlink()
    assert run_embed(checkpoint, fasta, out, *CPU, "--layers", "0") == 1
    assert "holds shards but no manifest.json" in capsys.readouterr().err
    (out / "index.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="has not finished"):
        next(embed.iter_embeddings(out))


def test_the_checkpoint_is_recognised_by_its_weights_not_its_spelling(tiny_source, checkpoint, tmp_path, capsys):
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV"), ("b", "MKVL")])
    out = tmp_path / "out"
    assert run_embed(checkpoint, fasta, out, *CPU) == 0
    relative = os.path.relpath(checkpoint)
    capsys.readouterr()
    assert run_embed(relative, fasta, out, *CPU) == 0
    assert "1 of 1 shard was already done" in capsys.readouterr().out

    from conftest import make_hf_model
    from convert_helpers import save_hf

    other = save_hf(make_hf_model("tiny", seed=8), tmp_path / "other_hf")
    copy = tmp_path / "copy"
    assert convert_checkpoint.main(["hf-to-te", str(other), str(copy)]) == 0
    assert run_embed(copy, fasta, out, *CPU) == 1
    assert "checkpoint: 'sha256-64MiB-pieces:" in capsys.readouterr().err
