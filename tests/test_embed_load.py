"""What `nv-esm embed`, `nv-esm score` and `nv-esm train --model` do with bad inputs and damaged checkpoints or
outputs: every bad FASTA record in one error; a checkpoint folder checked before its weights run
(config.json, vocab.txt, weight files, missing weights), with one-line errors naming the file; finished embedding
shards checked by their SHA-256 when a run resumes; a full disk during a shard write; the embedding API's
arguments; `--tokens-per-batch` below a protein's size; `--no-progress`.

Every folder a test damages is a copy of one converted random tiny checkpoint; which tensor, byte, field or line is
damaged is drawn from seeded generators.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from test_recipe_train import train_here
from transformers import EsmTokenizer

import convert_checkpoint
from conftest import ATOL_FP32, ROOT, max_abs_diff
from modeling_nv_esm import NVEsmModel
from nv_esm import embed, embed_output, score
from nv_esm.alphabet import ESM_VOCAB, STANDARD_AMINO_ACIDS

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")
DEMO_FASTA = ROOT / "recipes" / "demo_data" / "demo.fasta"
INTEGER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def random_sequence(length: int, generator: random.Random) -> str:
    return "".join(generator.choice(STANDARD_AMINO_ACIDS) for _ in range(length))


def write_fasta(path: Path, records: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f">{record_id} description\n{sequence}\n" for record_id, sequence in records))
    return path


def run_embed(*argv: object) -> int:
    return embed.main([str(arg) for arg in argv])


def run_score(*argv: object) -> int:
    return score.main([str(arg) for arg in argv])


def one_line(err: str) -> str:
    """The message of the one line `err` holds, without the command's error prefix (`error_message`)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return error_message(lines[0])


def error_message(line: str) -> str:
    """`line`'s message after its `error: ` prefix (`nv-esm COMMAND: error: ` or `error: `)."""
    prefix, found, message = line.partition("error: ")
    assert found and (not prefix or re.fullmatch(r"nv-esm \w+: ", prefix)), line
    return message


def copy_of(checkpoint: Path, folder: Path) -> Path:
    return shutil.copytree(checkpoint, folder)


def without_tensor(checkpoint: Path, folder: Path, name: str) -> Path:
    copy = copy_of(checkpoint, folder)
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors[name]
    save_file(tensors, copy / "model.safetensors", {"format": "pt"})
    return copy


def swap_vocabulary_lines(folder: Path, generator: random.Random) -> tuple[int, int]:
    """Swap two residue letters of `folder`'s vocab.txt; their 1-based line numbers, first the smaller."""
    first, second = sorted(generator.sample(range(4, 29), 2))
    lines = (folder / "vocab.txt").read_text().splitlines()
    lines[first], lines[second] = lines[second], lines[first]
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n")
    return first + 1, second + 1


# --------------------------------------------------------------------------------------------------------------
# Every bad record of a FASTA file in one error, before the model loads
# --------------------------------------------------------------------------------------------------------------


def bad_records(generator: random.Random, count: int, max_length: int) -> tuple[list[tuple[str, str]], list[str]]:
    """`count` records, about half of them bad in a random way, and the message expected for each bad one (as the
    first pass words it), in file order."""
    records, expected, ids = [], [], []
    for number in range(1, count + 1):
        record_id, sequence = f"p{number}", random_sequence(generator.randint(2, 30), generator)
        kind = generator.choice(["good", "good", "good", "letter", "stop", "empty", "duplicate", "too long"])
        if kind == "letter":
            position, char = generator.randint(1, len(sequence)), generator.choice("J1-.@ß")
            sequence = sequence[: position - 1] + char + sequence[position - 1 :]
            expected.append(f"record {record_id!r} (record {number}): {char!r} at residue {position} is not a letter")
        elif kind == "stop":
            sequence += "*"
            expected.append(f"record {record_id!r} (record {number}): '*' at residue {len(sequence)} is not a letter")
        elif kind == "empty":
            sequence = ""
            expected.append(f"record {record_id!r} (record {number}) has no residues")
        elif kind == "duplicate" and ids:
            record_id = generator.choice(ids)
            first = int(record_id[1:])
            expected.append(f"id {record_id!r} appears twice (records {first} and {number})")
        elif kind == "too long":
            sequence = random_sequence(max_length + generator.randint(1, 20), generator)
            expected.append(
                f"record {record_id!r} (record {number}) has {len(sequence)} residues, more than --max-length "
                f"{max_length}"
            )
        if record_id not in ids:
            ids.append(record_id)
        records.append((record_id, sequence))
    return records, expected


def test_every_bad_record_is_listed_in_one_error_before_the_model_loads(checkpoint, tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(embed, "load_model", no_loading)
    generator = random.Random(431)
    records, expected = bad_records(generator, 80, max_length=40)
    assert len(expected) > 20
    fasta = write_fasta(tmp_path / "many.fasta", records)
    assert run_embed(checkpoint, fasta, tmp_path / "out", *CPU, "--max-length", 40) == 1
    header, *listed = capsys.readouterr().err.strip().splitlines()
    assert error_message(header).startswith(f"{fasta}: {len(expected)} bad records ("), header
    assert "--invalid skip" in header and "--too-long" in header, header
    assert len(listed) == 21 and listed[-1] == f"  ... and {len(expected) - 20} more", listed
    for line, message in zip(listed[:20], expected):
        assert line.startswith(f"  {message}"), (line, message)
    assert not (tmp_path / "out").exists()

    # a file with several faults: a stop mark, then an empty record, then a good one; all said at once
    fasta = write_fasta(tmp_path / "three.fasta", [("a", "MKV*"), ("b", ""), ("c", "MKJ"), ("d", "MKVL")])
    for run, output in ((run_embed, tmp_path / "embedded"), (run_score, tmp_path / "scores.csv")):
        assert run(checkpoint, fasta, output, *CPU) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert error_message(lines[0]) == f"{fasta}: 3 bad records (--invalid skip skips them):", lines
        assert [line.split(":")[0] for line in lines[1:]] == [
            "  record 'a' (record 1)",
            "  record 'b' (record 2) has no residues.",
            "  record 'c' (record 3)",
        ]
        assert not output.exists()


# --------------------------------------------------------------------------------------------------------------
# The checkpoint folder: config.json, vocab.txt, weight files, missing weights
# --------------------------------------------------------------------------------------------------------------


def test_a_folder_without_config_json_says_so(checkpoint, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "te")
    (folder / "config.json").unlink()
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    for run, output in ((run_embed, tmp_path / "out"), (run_score, tmp_path / "out.csv")):
        assert run(folder, fasta, output, *CPU) == 1
        assert one_line(capsys.readouterr().err) == (
            f"{folder} holds no config.json: not a checkpoint folder (nv-esm convert hf-to-te SOURCE OUT writes one)."
        )


def test_a_number_written_as_a_string_in_config_json_is_one_line_naming_the_file(
    checkpoint, tiny_source, tmp_path, capsys
):
    generator = random.Random(432)
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])

    def stringified(source: Path, name: str) -> tuple[Path, str, str]:
        folder = copy_of(source, tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        field = generator.choice(INTEGER_FIELDS)
        config[field] = str(config[field])
        (folder / "config.json").write_text(json.dumps(config))
        return folder, field, config[field]

    runs = {
        "embed": lambda folder: run_embed(folder, fasta, tmp_path / "out", *CPU),
        "score": lambda folder: run_score(folder, fasta, tmp_path / "out.csv", *CPU),
        "te-to-hf": lambda folder: convert_checkpoint.main(["te-to-hf", str(folder), str(tmp_path / "hf")]),
    }
    for name, run in runs.items():
        folder, field, value = stringified(checkpoint, name)
        assert run(folder) == 1, name
        expected = f"{folder / 'config.json'}: {field} must be a positive integer, got {value!r}"
        assert one_line(capsys.readouterr().err) == expected, name
    folder, field, value = stringified(tiny_source, "transformers")
    assert convert_checkpoint.main(["hf-to-te", str(folder), str(tmp_path / "nv")]) == 1
    expected = f"{folder / 'config.json'}: {field} must be a positive integer, got {value!r}"
    assert one_line(capsys.readouterr().err) == expected
    assert not (tmp_path / "nv").exists() and not (tmp_path / "hf").exists()


def test_a_vocabulary_other_than_esm2s_is_refused_before_loading(checkpoint, tmp_path, capsys):
    generator = random.Random(433)
    folder = copy_of(checkpoint, tmp_path / "te")
    first, second = swap_vocabulary_lines(folder, generator)
    fasta = write_fasta(tmp_path / "in.fasta", [(f"p{i}", random_sequence(20, generator)) for i in range(3)])
    expected = (
        f"{folder / 'vocab.txt'} is not ESM-2's vocabulary: line {first} holds {ESM_VOCAB[second - 1]!r} where "
        f"ESM-2 has {ESM_VOCAB[first - 1]!r} (2 of its 33 tokens out of place); its ids would not match the weights."
    )
    for run, output in ((run_embed, tmp_path / "out"), (run_score, tmp_path / "out.csv")):
        assert run(folder, fasta, output, *CPU) == 1
        assert one_line(capsys.readouterr().err) == expected
        assert not output.exists()


def test_a_resume_after_the_vocabulary_file_changed_is_refused(checkpoint, tmp_path, capsys):
    """The manifest's fingerprint covers vocab.txt: even a change that reads as the same tokens (Windows line
    ends) is another checkpoint, whose shards are not mixed with the earlier ones."""
    generator = random.Random(434)
    folder = copy_of(checkpoint, tmp_path / "te")
    records = [(f"p{i}", random_sequence(generator.randint(5, 40), generator)) for i in range(5)]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "out"
    assert run_embed(folder, fasta, out, *CPU, "--shard-size", 2) == 0
    (out / "embeddings-00001.safetensors").unlink()  # an unfinished run
    vocabulary = (folder / "vocab.txt").read_text().splitlines()
    (folder / "vocab.txt").write_bytes(("\r\n".join(vocabulary) + "\r\n").encode())
    capsys.readouterr()
    assert run_embed(folder, fasta, out, *CPU, "--shard-size", 2) == 1
    err = capsys.readouterr().err
    assert "holds a run with other settings (checkpoint: 'sha256-64MiB-pieces:" in err and "--overwrite" in err, err
    assert run_embed(folder, fasta, out, *CPU, "--shard-size", 2, "--overwrite") == 0


def test_a_checkpoint_missing_a_weight_is_refused_where_the_weight_is_used(checkpoint, tmp_path, capsys):
    generator = random.Random(435)
    names = list(load_file(checkpoint / "model.safetensors"))
    encoder = [n for n in names if n.startswith("esm.") and "contact_head" not in n and "rotary" not in n]
    fasta = write_fasta(tmp_path / "in.fasta", [(f"p{i}", random_sequence(12, generator)) for i in range(2)])
    expected = dict(embed=(), contacts=(), score=())  # the tensors each run must name (none: it runs)

    trunk = generator.choice(encoder)
    folder = without_tensor(checkpoint, tmp_path / "trunk", trunk)
    expected = {"embed": trunk.removeprefix("esm."), "contacts": trunk.removeprefix("esm."), "score": trunk}
    check_runs(folder, fasta, tmp_path / "trunk_runs", expected, capsys)

    head = generator.choice([n for n in names if "contact_head" in n])  # used by --include contacts only
    folder = without_tensor(checkpoint, tmp_path / "contact", head)
    check_runs(folder, fasta, tmp_path / "contact_runs", {"contacts": head.removeprefix("esm.")}, capsys)

    lm_head = generator.choice([n for n in names if n.startswith("lm_head.") and "bias" not in n])
    folder = without_tensor(checkpoint, tmp_path / "lm_head", lm_head)  # scoring's head, not embedding's
    check_runs(folder, fasta, tmp_path / "lm_head_runs", {"score": lm_head}, capsys)

    folder = without_tensor(checkpoint, tmp_path / "rotary", "esm.rotary_embeddings.inv_freq")  # a buffer
    check_runs(folder, fasta, tmp_path / "rotary_runs", {}, capsys)


def check_runs(folder: Path, fasta: Path, out: Path, refusals: dict[str, str], capsys) -> None:
    """embed (mean), embed --include contacts and score on `folder`: each refused naming the tensor `refusals`
    gives it, or else it runs."""
    runs = {
        "embed": lambda: run_embed(folder, fasta, out / "embed", *CPU),
        "contacts": lambda: run_embed(folder, fasta, out / "contacts", "--include", "contacts", *CPU),
        "score": lambda: run_score(folder, fasta, out / "scores.csv", *CPU),
    }
    for name, run in runs.items():
        status = run()
        err = capsys.readouterr().err
        if name in refusals:
            line = err.strip().splitlines()[-1]
            assert status == 1 and error_message(line).startswith(f"{folder} has no weights for 1 tensors"), err
            assert f"({refusals[name]}), which would run with random values" in line, (name, line)
        else:
            assert status == 0, (name, err)


@pytest.mark.parametrize("damage", ["cut off", "garbage"])
def test_a_damaged_weight_file_is_one_line_naming_it(checkpoint, tmp_path, capsys, damage):
    generator = random.Random(436)
    folder = copy_of(checkpoint, tmp_path / "te")
    weights = folder / "model.safetensors"
    if damage == "cut off":
        with open(weights, "r+b") as file:
            file.truncate(generator.randrange(weights.stat().st_size))
    else:
        weights.write_bytes(generator.randbytes(generator.randint(1, 5000)))
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    for run, output in ((run_embed, tmp_path / "out"), (run_score, tmp_path / "out.csv")):
        assert run(folder, fasta, output, *CPU) == 1
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"{weights} is not a readable safetensors file ("), line
        assert line.endswith("the checkpoint is damaged: convert or download it again."), line


def test_train_refuses_a_checkpoint_that_embed_and_score_refuse(checkpoint, tmp_path):
    """`nv-esm train --model`: a swapped vocabulary, a missing weight of the base model and a cut-off weight file
    stop the run in one line naming the file, before any step."""
    generator = random.Random(437)
    swapped = copy_of(checkpoint, tmp_path / "swapped")
    swap_vocabulary_lines(swapped, generator)
    names = [n for n in load_file(checkpoint / "model.safetensors") if n.startswith("esm.") and "rotary" not in n]
    missing = generator.choice(names)
    cut = copy_of(checkpoint, tmp_path / "cut")
    with open(cut / "model.safetensors", "r+b") as file:
        file.truncate(generator.randrange((cut / "model.safetensors").stat().st_size))
    cases = {
        swapped: f"{swapped / 'vocab.txt'} is not ESM-2's vocabulary",
        without_tensor(checkpoint, tmp_path / "missing", missing): f"has no weights for 1 tensors of the base model "
        f"({missing}), which would start from random values",
        cut: f"{cut / 'model.safetensors'} is not a readable safetensors file",
    }
    for folder, needle in cases.items():
        args = ["--model", folder, "--data", DEMO_FASTA, "--steps", 1, "--tokens-per-batch", 1024, "--max-length", 254]
        done = train_here(*args, "--no-export", out=tmp_path / f"run_{folder.name}")
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and last.startswith("nv-esm train: error: ") and needle in last, done.stderr[-3000:]
        assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------------------------------------------
# Finished shards: checked on resume; a full disk
# --------------------------------------------------------------------------------------------------------------


def shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("embeddings-*")) if not p.name.endswith(".tmp")}


def test_a_changed_byte_in_a_finished_shard_is_found_on_resume_and_redone(checkpoint, tmp_path, capsys):
    generator = random.Random(438)
    records = [(f"p{i}", random_sequence(generator.randint(5, 60), generator)) for i in range(11)]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    out = tmp_path / "out"
    args = (checkpoint, fasta, out, *CPU, "--shard-size", 3, "--include", "mean", "per_residue")
    assert run_embed(*args) == 0
    clean = shard_files(out)
    index = (out / "index.tsv").read_text()
    assert sorted(clean) == [f"embeddings-0000{i}.safetensors{end}" for i in range(4) for end in ("", ".sha256")]

    shards = sorted(out.glob("embeddings-*.safetensors"))
    flipped, unchecked = generator.sample(shards, 2)
    data = bytearray(flipped.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")  # a byte of the tensors: the file still reads as a shard
    data[generator.randrange(header, len(data))] ^= 1 << generator.randrange(8)
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{flipped} is damaged \\(its SHA-256 is not the one"):
        list(embed.iter_embeddings(out))
    embed_output.checksum_path(unchecked).unlink()  # a run cut off between the shard and its checksum
    capsys.readouterr()
    assert run_embed(*args) == 0
    captured = capsys.readouterr()
    notes = [line for line in captured.err.splitlines() if line.startswith("note: ")]
    assert sorted(notes) == sorted(
        [
            f"note: {flipped} is damaged (its SHA-256 is not the one {flipped.name}.sha256 records); embedding its "
            "proteins again",
            f"note: {unchecked} is damaged (no {unchecked.name}.sha256 beside it: its writing was cut off, or an "
            "earlier nv-esm wrote it); embedding its proteins again",
        ]
    ), captured.err
    assert "2 of 4 shards were already done" in captured.out
    assert shard_files(out) == clean and (out / "index.tsv").read_text() == index


@pytest.mark.parametrize("failure", ["SafetensorError", "OSError"])
def test_a_full_disk_during_a_shard_write_is_one_line_and_a_rerun_completes_the_run(
    checkpoint, tmp_path, capsys, monkeypatch, failure
):
    generator = random.Random(439)
    records = [(f"p{i}", random_sequence(generator.randint(5, 60), generator)) for i in range(9)]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert run_embed(checkpoint, fasta, reference, *CPU, "--shard-size", 3) == 0
    full = generator.randrange(1, 3)  # the shard whose write finds the disk full
    write_shard = embed_output.write_shard

    def disk_fills(path: Path, tensors: dict, ids: list) -> None:
        if path.name != embed_output.shard_name(full):
            return write_shard(path, tensors, ids)
        path.with_name(path.name + ".tmp").write_bytes(b"half a shard")
        if failure == "SafetensorError":  # what safetensors' writer raises (as of 0.5)
            message = 'IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
            raise SafetensorError(f"Error while serializing: {message}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(embed_output, "write_shard", disk_fills)
    monkeypatch.setattr(embed, "write_shard", disk_fills, raising=False)  # where the command calls it directly
    capsys.readouterr()
    assert run_embed(checkpoint, fasta, out, *CPU, "--shard-size", 3) == 1
    assert one_line(capsys.readouterr().err) == (
        f"{out / embed_output.shard_name(full)}: writing the shard failed (No space left on device); the "
        "finished shards are kept, a rerun resumes."
    )
    kept = shard_files(out)
    assert kept and all(kept[name] == (reference / name).read_bytes() for name in kept)
    monkeypatch.undo()
    assert run_embed(checkpoint, fasta, out, *CPU, "--shard-size", 3) == 0
    assert shard_files(out) == shard_files(reference)
    assert (out / "index.tsv").read_text() == (reference / "index.tsv").read_text()


# --------------------------------------------------------------------------------------------------------------
# The embedding API, --tokens-per-batch and --no-progress
# --------------------------------------------------------------------------------------------------------------


def test_embed_api_refuses_arguments_of_the_wrong_kind_in_one_line(checkpoint):
    model = NVEsmModel.from_pretrained(checkpoint, backend="torch").eval()
    tokenizer = EsmTokenizer.from_pretrained(checkpoint)
    generator = random.Random(440)
    proteins = [random_sequence(generator.randint(3, 40), generator) for _ in range(4)]
    layer = generator.randrange(model.config.num_hidden_layers + 1)
    cases = [
        (dict(layer=float(layer)), f"layer must be an integer, got {float(layer)!r}"),
        (dict(layer=True), "layer must be an integer, got True"),
        (dict(max_tokens_per_batch=float("nan")), "max_tokens_per_batch must be an integer, got nan"),
        (dict(max_tokens_per_batch=512.0), "max_tokens_per_batch must be an integer, got 512.0"),
        (dict(max_tokens_per_batch=0), "max_tokens_per_batch must be at least 1, got 0"),
        (dict(tokenizer=None), "tokenizer must be this checkpoint's tokenizer"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
            model.embed(proteins, **{"tokenizer": tokenizer, "show_progress": False, **arguments})
    expected = model.embed(proteins, tokenizer, layer=layer, show_progress=False)
    numpy_arguments = dict(layer=np.int64(layer), max_tokens_per_batch=np.int32(64), show_progress=False)
    assert max_abs_diff(model.embed(proteins, tokenizer, **numpy_arguments), expected) <= ATOL_FP32


def test_a_token_budget_below_a_protein_is_warned_about_once(checkpoint, tmp_path, capsys):
    generator = random.Random(441)
    lengths = [generator.randint(5, 40) for _ in range(8)] + [generator.randint(80, 120) for _ in range(2)]
    generator.shuffle(lengths)
    records = [(f"p{i}", random_sequence(n, generator)) for i, n in enumerate(lengths)]
    fasta = write_fasta(tmp_path / "in.fasta", records)
    budget = generator.randint(60, 79)
    assert run_embed(checkpoint, fasta, tmp_path / "small", *CPU, "--tokens-per-batch", budget) == 0
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: 2 of {fasta}'s proteins have more tokens than --tokens-per-batch {budget} (the longest, record "
        f"'p{longest}', {lengths[longest] + 2}): each runs alone, in a batch over the budget; --tokens-per-batch "
        f"{lengths[longest] + 2} keeps every batch within it."
    ]
    assert run_embed(checkpoint, fasta, tmp_path / "large", *CPU) == 0
    assert "warning:" not in capsys.readouterr().err
    small, large = dict(embed.iter_embeddings(tmp_path / "small")), dict(embed.iter_embeddings(tmp_path / "large"))
    assert list(small) == list(large)
    assert all(max_abs_diff(small[k]["mean.layer_2"], large[k]["mean.layer_2"]) <= ATOL_FP32 for k in small)


def test_no_progress_turns_off_transformers_loading_bar_too(checkpoint, tmp_path, capsys):
    from transformers.utils import logging

    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAK")])
    assert logging.is_progress_bar_enabled()
    with_bars = [arg for arg in CPU if arg != "--no-progress"]
    assert run_embed(checkpoint, fasta, tmp_path / "bars", *with_bars) == 0
    assert "Loading weights" in capsys.readouterr().err
    assert run_embed(checkpoint, fasta, tmp_path / "quiet", *CPU) == 0
    assert run_score(checkpoint, fasta, tmp_path / "quiet.csv", *CPU) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "scoring" not in err and "embedding" not in err, err
    assert logging.is_progress_bar_enabled()  # as it was: only the command's loading was quiet


def test_embed_and_train_refuse_a_transformers_checkpoint_in_the_same_words(tiny_source, tmp_path, capsys):
    """A transformers ESM-2 folder given to a command is refused before anything runs, with the conversion command,
    in one sentence that embed (the model loader of embed/score/proteingym) and the trainer share
    (`checkpoint_checks.check_model_type`)."""
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV")])
    assert run_embed(tiny_source, fasta, tmp_path / "out", "--device", "cpu") == 1
    embed_line = one_line(capsys.readouterr().err)
    trained = train_here("--model", tiny_source, "--data", fasta, "--steps", "1", out=tmp_path / "run")
    assert trained.returncode == 1
    train_line = one_line(trained.stderr)
    expected = (
        f"{tiny_source} is not an NVEsm checkpoint (its config.json says model_type 'esm'); convert it first: "
        f"nv-esm convert hf-to-te {tiny_source} OUT"
    )
    assert embed_line == train_line == expected
