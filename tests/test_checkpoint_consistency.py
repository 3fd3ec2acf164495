"""Checkpoints whose parts disagree, and what the converter writes (issue 61): a config.json, vocab.txt or tokenizer
file whose special tokens are not ESM-2's; NaN or Inf weights; tensors of a layer the config does not have, or of
another shape; a shard size below the largest tensor; the output's permissions under the user's umask.

Each case is refused before anything runs by `nv-esm embed`, `nv-esm score` and `nv-esm convert` (called in-process)
in one line naming the file or tensor, and by the trainer's checkpoint reader.
Every folder a test damages is a copy of one converted random tiny checkpoint (conftest's `checkpoint`) or of its
transformers source (`tiny_source`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import convert_checkpoint
from configuration_nv_esm import NVEsmConfig
from modeling_nv_esm import NVEsmModel
from nv_esm import embed, score
from nv_esm.alphabet import ESM_VOCAB, MASK, STANDARD_AMINO_ACIDS
from nv_esm.checkpoint_checks import check_finite, check_tensor_names
from nv_esm.checkpoint_io import WEIGHTS_INDEX_NAME
from nv_esm.train.materialize import CheckpointReader

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


def one_line(err: str) -> str:
    """The message of the one line `err` holds, after the command's `nv-esm CMD: error: ` prefix."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    prefix, found, message = lines[0].partition("error: ")
    assert found and prefix.startswith("nv-esm "), lines[0]
    return message


def copy_of(folder: Path, copy: Path) -> Path:
    return shutil.copytree(folder, copy)


def edit_json(path: Path, **fields: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})


@pytest.fixture(scope="module")
def fasta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    generator = random.Random(610)
    path = tmp_path_factory.mktemp("fasta") / "in.fasta"
    records = ["".join(generator.choice(STANDARD_AMINO_ACIDS) for _ in range(generator.randint(8, 30))) for _ in "abc"]
    path.write_text("".join(f">p{i}\n{sequence}\n" for i, sequence in enumerate(records)))
    return path


def refusals(
    folder: Path, fasta: Path, out: Path, capsys: pytest.CaptureFixture, trainer: bool = True
) -> dict[str, str]:
    """The one-line message with which `nv-esm embed`, `nv-esm score` and `nv-esm convert te-to-hf` refuse `folder`
    (each must refuse, exit 1, and write nothing), and, with `trainer`, that of the trainer's checkpoint reader
    reading every tensor whole (`nv_esm.train.materialize.CheckpointReader`: the tokens as it opens the folder, the
    values as it reads rows; the trainer's check of names and shapes needs its model: tests/test_train_safety.py)."""
    runs = {
        "embed": lambda: embed.main([str(folder), str(fasta), str(out / "embed"), *CPU]),
        "score": lambda: score.main([str(folder), str(fasta), str(out / "scores.csv"), *CPU]),
        "te-to-hf": lambda: convert_checkpoint.main(["te-to-hf", str(folder), str(out / "hf")]),
    }
    messages = {}
    for name, run in runs.items():
        assert run() == 1, name
        messages[name] = one_line(capsys.readouterr().err)
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    if trainer:
        with pytest.raises(ValueError) as refused:
            reader = CheckpointReader(folder, NVEsmConfig.from_pretrained(folder))
            for name in sorted(reader.where):
                reader.rows(name, 0, None)
        messages["trainer"] = str(refused.value)
    return messages


# --------------------------------------------------------------------------------------------------------------
# Special tokens: config.json, vocab.txt, tokenizer files
# --------------------------------------------------------------------------------------------------------------


def test_a_mask_token_id_naming_a_residue_is_refused_naming_config_json(
    checkpoint, tiny_source, fasta, tmp_path, capsys
):
    generator = random.Random(611)
    residue = generator.randrange(4, 24)
    folder = copy_of(checkpoint, tmp_path / "te")
    edit_json(folder / "config.json", mask_token_id=residue)
    expected = (
        f"{folder / 'config.json'}: mask_token_id is {residue} ({ESM_VOCAB[residue]!r} in ESM-2's vocabulary), but "
        f"ESM-2's <mask> is {MASK}; the model would take another token for <mask>."
    )
    for name, message in refusals(folder, fasta, tmp_path / "out", capsys).items():
        assert message == expected, name
    source = copy_of(tiny_source, tmp_path / "hf")
    edit_json(source / "config.json", mask_token_id=residue)
    assert convert_checkpoint.main(["hf-to-te", str(source), str(tmp_path / "nv")]) == 1
    assert one_line(capsys.readouterr().err) == expected.replace(str(folder), str(source))
    assert not (tmp_path / "nv").exists()


@pytest.mark.parametrize("field", ["eos_token_id", "pad_token_id"])
def test_other_special_token_ids_are_refused(checkpoint, fasta, tmp_path, capsys, field):
    folder = copy_of(checkpoint, tmp_path / "te")
    edit_json(folder / "config.json", **{field: 3})
    for name, message in refusals(folder, fasta, tmp_path / "out", capsys).items():
        assert message.startswith(f"{folder / 'config.json'}: {field} is 3 ('<unk>' in ESM-2's vocabulary)"), name


def test_swapped_mask_and_cls_tokens_in_tokenizer_config_are_refused(checkpoint, tiny_source, fasta, tmp_path, capsys):
    folder = copy_of(checkpoint, tmp_path / "te")
    edit_json(folder / "tokenizer_config.json", mask_token="<cls>", cls_token="<mask>")
    path = folder / "tokenizer_config.json"
    expected = f"{path}: cls_token '<mask>' is not ESM-2's '<cls>'."
    for name, message in refusals(folder, fasta, tmp_path / "out", capsys).items():
        assert message == expected, name


def test_an_added_token_at_another_tokens_id_is_refused(checkpoint, tiny_source, fasta, tmp_path, capsys):
    """tokenizer_config.json's `added_tokens_decoder` with `<mask>` and `<cls>` at each other's ids: the tokenizer
    would write 0 for `<mask>`."""
    for name, source in (("te", checkpoint), ("hf", tiny_source)):
        folder = copy_of(source, tmp_path / name)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        added = config["added_tokens_decoder"]
        added["0"], added[str(MASK)] = added[str(MASK)], added["0"]
        edit_json(folder / "tokenizer_config.json", added_tokens_decoder=added)
        expected = (
            f"{folder / 'tokenizer_config.json'}: added_tokens_decoder gives '0' to '<mask>', but vocab.txt's id 0 is "
            "'<cls>'; the tokenizer's ids would not match the weights."
        )
        if name == "te":
            for command, message in refusals(folder, fasta, tmp_path / "out", capsys).items():
                assert message == expected, command
        else:
            assert convert_checkpoint.main(["hf-to-te", str(folder), str(tmp_path / "nv")]) == 1
            assert one_line(capsys.readouterr().err) == expected


def test_a_vocabulary_without_a_letter_is_refused(checkpoint, fasta, tmp_path, capsys):
    generator = random.Random(612)
    folder = copy_of(checkpoint, tmp_path / "te")
    lines = (folder / "vocab.txt").read_text().splitlines()
    line = generator.randrange(4, 29)
    del lines[line]
    (folder / "vocab.txt").write_text("\n".join(lines) + "\n")
    for name, message in refusals(folder, fasta, tmp_path / "out", capsys).items():
        assert message.startswith(f"{folder / 'vocab.txt'} is not ESM-2's vocabulary: line {line + 1} holds "), name


# --------------------------------------------------------------------------------------------------------------
# Weights: NaN or Inf, tensors the config has no place for, other shapes
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(checkpoint, tiny_source, fasta, tmp_path, capsys, value):
    generator = random.Random(613)
    names = [name for name in load_file(checkpoint / "model.safetensors") if "layers" in name]
    damaged = generator.choice(names)
    folder = copy_of(checkpoint, tmp_path / "te")

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        flat = tensors[damaged].view(-1)
        flat[generator.randrange(flat.numel())] = value

    edit_weights(folder, poison)
    suffix = " holds NaN or Inf values, which would make the outputs NaN; the weights are damaged: convert or download"
    messages = refusals(folder, fasta, tmp_path / "out", capsys)
    assert messages.pop("embed").startswith(f"{folder}: {damaged.removeprefix('esm.')}{suffix}")  # the model's name
    for name, message in messages.items():
        assert message.startswith(f"{folder}: {damaged}{suffix}"), name

    source = copy_of(tiny_source, tmp_path / "hf")
    hf_names = [name for name in load_file(source / "model.safetensors") if "layer." in name]
    damaged = generator.choice(hf_names)
    edit_weights(source, poison)
    assert convert_checkpoint.main(["hf-to-te", str(source), str(tmp_path / "nv")]) == 1
    assert one_line(capsys.readouterr().err).startswith(f"{source}: {damaged}{suffix}")
    assert not (tmp_path / "nv").exists()


def test_check_finite_confirms_a_sum_that_overflows_value_by_value():
    """Finite weights near the dtype's largest value sum to Inf: they are not refused."""
    large = torch.full((64,), torch.finfo(torch.float32).max / 2)
    check_finite([("large", large), ("bf16", large.bfloat16())], "here")
    with pytest.raises(ValueError, match=r"^here: second holds NaN or Inf values"):
        check_finite([("first", large), ("second", torch.tensor([1.0, -float("inf")]))], "here")


def test_tensors_of_a_layer_the_config_does_not_have_are_refused(checkpoint, fasta, tmp_path, capsys):
    """A copy of the last layer's tensors as layer N (the config has N layers) holds no place in the model:
    transformers would drop them with a log line and run."""
    folder = copy_of(checkpoint, tmp_path / "te")
    layers = NVEsmConfig.from_pretrained(checkpoint).num_hidden_layers

    def extra_layer(tensors: dict[str, torch.Tensor]) -> None:
        last = f"esm.encoder.layers.{layers - 1}."
        for name in [name for name in tensors if name.startswith(last)]:
            tensors[name.replace(last, f"esm.encoder.layers.{layers}.")] = tensors[name].clone()

    edit_weights(folder, extra_layer)
    messages = refusals(folder, fasta, tmp_path / "out", capsys, trainer=False)
    converter = messages.pop("te-to-hf")  # the converter's own check of names
    assert (
        f"shape its config describes: Unexpected (12): esm.encoder.layers.{layers}.layernorm_mlp.fc1_bias, "
        in converter
    )
    for name, message in messages.items():
        assert message.startswith(f"{folder} holds 12 tensors that a model of its config.json "), name
        assert f"has no place for (esm.encoder.layers.{layers}.layernorm_mlp.fc1_bias, " in message, name
        assert message.endswith("its weights and its config disagree; convert it again."), name


def test_tensors_of_another_shape_are_refused_in_one_line(checkpoint, fasta, tmp_path, capsys):
    """An embedding of other rows than the config's padded vocabulary: transformers raises with a table."""
    folder = copy_of(checkpoint, tmp_path / "te")
    config = NVEsmConfig.from_pretrained(checkpoint)
    rows = config.padded_vocab_size - 16

    def fewer_rows(tensors: dict[str, torch.Tensor]) -> None:
        name = "esm.embeddings.word_embeddings.weight"
        tensors[name] = tensors[name][:rows].clone()

    edit_weights(folder, fewer_rows)
    shapes = f"esm.embeddings.word_embeddings.weight [{rows}, {config.hidden_size}], expected "
    shapes += f"[{config.padded_vocab_size}, {config.hidden_size}]"
    messages = refusals(folder, fasta, tmp_path / "out", capsys, trainer=False)
    converter = messages.pop("te-to-hf")  # the converter's own check of shapes
    assert converter.startswith("The tensors do not have the shapes the config describes (") and (
        f"): {shapes.replace(' [', ': [', 1)}." in converter
    )
    for name, message in messages.items():
        assert message.startswith(f"{folder} holds 1 tensors of other shapes than its config.json "), name
        assert f"gives ({shapes}): its weights and its config disagree" in message, name


def test_a_base_model_saved_on_its_own_is_not_refused(tmp_path):
    """`NVEsmModel.save_pretrained`: names without the `esm.` prefix, a pooler."""
    config = NVEsmConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    NVEsmModel(config).save_pretrained(tmp_path / "base")
    names = check_tensor_names(tmp_path / "base", config).info
    assert "pooler.dense.weight" in names and not any(name.startswith("esm.") for name in names)


# --------------------------------------------------------------------------------------------------------------
# The converter: shard sizes, permissions
# --------------------------------------------------------------------------------------------------------------


def test_a_shard_size_below_the_largest_tensor_is_refused_and_one_above_loads(
    checkpoint, tiny_source, fasta, tmp_path, capsys
):
    out = tmp_path / "nv"
    assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(out), "--max-shard-size", "1KB"]) == 1
    message = one_line(capsys.readouterr().err)
    largest = max(load_file(checkpoint / "model.safetensors").values(), key=lambda tensor: tensor.nbytes).nbytes
    assert message.startswith("--max-shard-size 1.00 kB is smaller than esm.") and message.endswith(
        f"which a weights file holds whole; pass at least {largest} bytes."
    )
    assert not out.exists() and not list(tmp_path.glob(".nv.partial-*"))
    args = ["hf-to-te", str(tiny_source), str(out), "--max-shard-size", str(largest)]
    assert convert_checkpoint.main(args) == 0
    capsys.readouterr()
    assert len(json.loads((out / WEIGHTS_INDEX_NAME).read_text())["weight_map"]) == len(
        load_file(checkpoint / "model.safetensors")
    )
    for folder, name in ((out, "sharded"), (checkpoint, "single")):
        assert embed.main([str(folder), str(fasta), str(tmp_path / name), *CPU]) == 0
    shards = sorted(path.name for path in (tmp_path / "single").glob("embeddings-*.safetensors"))
    assert shards == sorted(path.name for path in (tmp_path / "sharded").glob("embeddings-*.safetensors")) != []
    for shard in shards:
        sharded, single = load_file(tmp_path / "sharded" / shard), load_file(tmp_path / "single" / shard)
        assert sharded.keys() == single.keys()
        assert all(torch.equal(sharded[key], single[key]) for key in single)


@pytest.mark.parametrize("mask", [0o077, 0o022, 0o027])
def test_converted_files_and_folders_follow_the_umask(tiny_source, tmp_path, capsys, mask):
    previous = os.umask(mask)
    try:
        assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(tmp_path / "nv")]) == 0
        assert convert_checkpoint.main(["te-to-hf", str(tmp_path / "nv"), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(previous)
    for out in (tmp_path / "nv", tmp_path / "hf"):
        paths = [out, *out.rglob("*")]
        modes = {path.relative_to(tmp_path): path.stat().st_mode & 0o777 for path in paths}
        expected = {path.relative_to(tmp_path): (0o777 if path.is_dir() else 0o666) & ~mask for path in paths}
        assert modes == expected


def test_force_replaces_an_earlier_conversion_only(tiny_source, tmp_path, capsys):
    """`--force` over a folder holding a file no conversion writes (a user's notes, a cloned repository's `.git`)
    is refused and the folder kept as it was; over an earlier conversion (sharded, then not) it replaces it."""
    out = tmp_path / "nv"
    assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(out)]) == 0
    largest = max(tensor.nbytes for tensor in load_file(out / "model.safetensors").values())
    sharded = ["--max-shard-size", str(largest), "--overwrite"]
    assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(out), *sharded]) == 0
    assert (out / WEIGHTS_INDEX_NAME).exists() and not (out / "model.safetensors").exists()
    assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(out), "--overwrite"]) == 0
    assert not (out / WEIGHTS_INDEX_NAME).exists() and (out / "model.safetensors").exists()
    capsys.readouterr()
    for foreign in ("notes.txt", ".git"):
        (out / foreign).mkdir() if foreign == ".git" else (out / foreign).write_text("mine")
        before = sorted(path.relative_to(out) for path in out.rglob("*"))
        assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(out), "--overwrite"]) == 1
        message = one_line(capsys.readouterr().err)
        assert f"holds 1 entries that no model folder write makes ({foreign}); --overwrite replaces" in message
        assert sorted(path.relative_to(out) for path in out.rglob("*")) == before
        (out / foreign).rmdir() if foreign == ".git" else (out / foreign).unlink()
