"""NVIDIA's BioNeMo ESM-2 layout (bionemo-recipes' `models/esm2`, `nvidia/esm2_t*`) in and out of NVEsm:
`nv-esm convert bionemo-to-te` and `te-to-bionemo`, their refusals, and the commands' refusal of an unconverted folder.

The NVIDIA-layout checkpoints are made here from the tiny transformers checkpoint by their published transform,
written out in plain torch from bionemo-recipes' `convert.py` (`mapping`; `_pack_qkv_weight`: rows viewed as
(3, heads, head_dim) and transposed to (heads, 3, head_dim); `_pad_weights`: zero rows; `_pad_bias`: the dtype's
lowest value) and `modeling_esm_te.py` (`NVEsmConfig`'s fields; `state_dict` without `inv_freq`; the decoder weight
tied, so not saved), independently of the converter's table.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_embed_load import DEMO_FASTA, one_line, run_embed, write_fasta
from test_one_place import code_of, places
from test_recipe_train import train_here
from transformers import EsmForMaskedLM

from conftest import ATOL_FP32, ROOT, max_abs_diff, pad_batch, random_lengths, random_proteins
from convert_helpers import VERIFY_CPU, assert_same_tensors, read_folder, run
from modeling_nv_esm import NVEsmForMaskedLM
from nv_esm.conversion import convert
from nv_esm.conversion_plan import BIONEMO_TO_TE, CONVERTED_BY, DIRECTIONS, INVERSE, TE_TO_BIONEMO

# Their `NVEsmConfig`'s fields with its defaults, and the `auto_map` their export.py writes.
THEIR_FIELDS = {
    "qkv_weight_interleaved": True,
    "encoder_activation": "gelu",
    "attn_input_format": "bshd",
    "fuse_qkv_params": True,
    "micro_batch_size": None,
    "max_seq_length": None,
    "padded_vocab_size": 64,
    "attn_mask_type": "padding",
    "add_pooling_layer": False,
    "layer_precision": None,
    "use_quantized_model_init": False,
}
THEIR_AUTO_MAP = {
    "AutoConfig": "esm_nv.NVEsmConfig",
    "AutoModel": "esm_nv.NVEsmModel",
    "AutoModelForMaskedLM": "esm_nv.NVEsmForMaskedLM",
    "AutoModelForTokenClassification": "esm_nv.NVEsmForTokenClassification",
}
NO_CONTACT_HEAD = "NVIDIA's BioNeMo layout has no contact head"


def their_layout(hf: dict[str, torch.Tensor], config: dict, padded: int, interleaved: bool, prefix: str) -> dict:
    """transformers' `EsmForMaskedLM` state dict -> their `NVEsmForMaskedLM` checkpoint, as their convert.py makes
    it (`prefix`: "model." now, "esm." before March 2026)."""
    heads, dtype = config["num_attention_heads"], hf["lm_head.bias"].dtype

    def padded_rows(tensor: torch.Tensor, fill: float) -> torch.Tensor:
        rows = torch.full((padded - tensor.shape[0], *tensor.shape[1:]), fill, dtype=tensor.dtype)
        return torch.cat([tensor, rows])

    out = {
        f"{prefix}embeddings.word_embeddings.weight": padded_rows(hf["esm.embeddings.word_embeddings.weight"], 0.0),
        "lm_head.decoder.bias": padded_rows(hf["lm_head.bias"], torch.finfo(dtype).min),
    }
    for part in ("weight", "bias"):
        out[f"{prefix}encoder.emb_layer_norm_after.{part}"] = hf[f"esm.encoder.emb_layer_norm_after.{part}"]
        out[f"lm_head.dense.{part}"] = hf[f"lm_head.dense.{part}"]
        out[f"lm_head.decoder.layer_norm_{part}"] = hf[f"lm_head.layer_norm.{part}"]
    for i in range(config["num_hidden_layers"]):
        theirs, ours = f"{prefix}encoder.layers.{i}.", f"esm.encoder.layer.{i}."
        for part in ("weight", "bias"):
            q, k, v = (hf[f"{ours}attention.self.{name}.{part}"] for name in ("query", "key", "value"))
            qkv = torch.cat((q, k, v))
            if interleaved:  # their _pack_qkv_weight / _pack_qkv_bias
                qkv = qkv.view(3, heads, -1, *q.shape[1:]).transpose(0, 1).contiguous().view(qkv.shape)
            out[f"{theirs}self_attention.layernorm_qkv.{part}"] = qkv
            out[f"{theirs}self_attention.layernorm_qkv.layer_norm_{part}"] = hf[f"{ours}attention.LayerNorm.{part}"]
            out[f"{theirs}self_attention.proj.{part}"] = hf[f"{ours}attention.output.dense.{part}"]
            out[f"{theirs}layernorm_mlp.fc1_{part}"] = hf[f"{ours}intermediate.dense.{part}"]
            out[f"{theirs}layernorm_mlp.fc2_{part}"] = hf[f"{ours}output.dense.{part}"]
            out[f"{theirs}layernorm_mlp.layer_norm_{part}"] = hf[f"{ours}LayerNorm.{part}"]
    return {key: value.contiguous() for key, value in out.items()}


def write_their_folder(
    folder: Path,
    source: Path,
    padded: int = 64,
    interleaved: bool = True,
    prefix: str = "model.",
    dtype: torch.dtype = torch.float32,
    **fields: object,
) -> Path:
    """A folder as their export.py writes it: config.json (transformers' EsmConfig fields, theirs, their auto_map),
    model.safetensors and their fast tokenizer's files (no vocab.txt), from the transformers folder `source`."""
    model = EsmForMaskedLM.from_pretrained(source).to(dtype)
    config = model.config.to_dict()
    folder.mkdir(parents=True)
    tensors = their_layout(model.state_dict(), config, padded, interleaved, prefix)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    esm_fields = {key: config[key] for key in json.loads((source / "config.json").read_text()) if key in config}
    their_fields = THEIR_FIELDS | {"padded_vocab_size": padded, "qkv_weight_interleaved": interleaved} | fields
    written = esm_fields | their_fields | {"dtype": str(dtype).removeprefix("torch.")}
    written |= {"architectures": ["NVEsmForMaskedLM"], "auto_map": THEIR_AUTO_MAP, "model_type": "nv_esm"}
    (folder / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True))
    vocab = (source / "vocab.txt").read_text().split()
    fast = {"model": {"type": "WordLevel", "vocab": {token: i for i, token in enumerate(vocab)}, "unk_token": "<unk>"}}
    (folder / "tokenizer.json").write_text(json.dumps(fast))
    special = {"cls_token": "<cls>", "eos_token": "<eos>", "mask_token": "<mask>", "pad_token": "<pad>"}
    settings = special | {"unk_token": "<unk>", "bos_token": "<cls>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings | {"model_max_length": 10**30}))
    return folder


@pytest.fixture(scope="module")
def theirs(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_source` in NVIDIA's BioNeMo layout, made by their transform."""
    return write_their_folder(tmp_path_factory.mktemp("bionemo") / "esm2_tiny_bionemo", tiny_source)


@pytest.fixture(scope="module")
def converted(theirs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bionemo_te") / "te"
    convert(BIONEMO_TO_TE, theirs, out)
    return out


def transformers_logits(source: Path, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        model = EsmForMaskedLM.from_pretrained(source).eval()
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def assert_logits_match_transformers(folder: Path, source: Path, seed: int) -> None:
    """The NVEsm model of `folder` gives transformers' logits on `source`'s weights (fp32, PyTorch backend), on a
    padded batch of random proteins of random lengths (one of them just `<cls>`), some residues masked."""
    generator = torch.Generator().manual_seed(seed)
    proteins = random_proteins(random_lengths(generator, 6), seed, mask_fraction=0.1)
    input_ids, attention_mask = pad_batch(proteins)
    model = NVEsmForMaskedLM.from_pretrained(folder, backend="torch").eval()
    with torch.no_grad():
        ours = model(input_ids=input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(ours[keep], transformers_logits(source, input_ids, attention_mask)[keep]) <= ATOL_FP32


# ---- in, out, and round trips -----------------------------------------------------------------------------------


def test_their_checkpoint_converts_in_and_gives_transformers_logits(tmp_path, capsys, theirs, tiny_source, checkpoint):
    """Their folder gives the tensors hf-to-te gives from transformers' (`checkpoint`), the contact head aside: every
    check of hf-to-te's folders (the GPU parity tests too) holds for it."""
    status, out, err = run(capsys, "bionemo-to-te", theirs, tmp_path / "te")
    assert status == 0, err
    assert NO_CONTACT_HEAD in err
    assert_logits_match_transformers(tmp_path / "te", tiny_source, seed=3)
    written = read_folder(tmp_path / "te")
    assert_same_tensors(written, {k: v for k, v in read_folder(checkpoint).items() if "contact_head" not in k})
    assert written["esm.embeddings.word_embeddings.weight"].shape[0] == 64
    assert not written["lm_head.decoder.bias"][33:].any()  # our padding: zeros, not their lowest float
    assert "bionemo-to-te" in (tmp_path / "te" / "README.md").read_text()


def test_round_trip_gives_back_their_tensors_bit_for_bit_and_their_config(tmp_path, capsys, theirs, converted):
    status, _, err = run(capsys, "te-to-bionemo", converted, tmp_path / "back")
    assert status == 0, err
    assert_same_tensors(read_folder(tmp_path / "back"), read_folder(theirs))
    written, original = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "back", theirs))
    assert {key: written[key] for key in THEIR_FIELDS} == THEIR_FIELDS
    assert (written["model_type"], written["architectures"], written["auto_map"]) == (
        "nv_esm",
        ["NVEsmForMaskedLM"],
        THEIR_AUTO_MAP,
    )
    shared = set(written) & set(original) - {"transformers_version", "rope_theta"}
    assert {key: written[key] for key in shared} == {key: original[key] for key in shared}
    card = (tmp_path / "back" / "README.md").read_text()
    assert "esm_nv.py" in card and "no contact head" in card


def test_ours_from_transformers_goes_out_as_their_convert_writes_it(tmp_path, capsys, tiny_source, theirs):
    """hf-to-te then te-to-bionemo gives exactly their transform of the same weights; the contact head is left
    out, with a note."""
    assert run(capsys, "hf-to-te", tiny_source, tmp_path / "te")[0] == 0
    status, _, err = run(capsys, "te-to-bionemo", tmp_path / "te", tmp_path / "theirs")
    assert status == 0 and NO_CONTACT_HEAD in err, err
    assert_same_tensors(read_folder(tmp_path / "theirs"), read_folder(theirs))


@pytest.mark.parametrize(
    "padded, interleaved, prefix",
    [(33, True, "model."), (64, False, "model."), (64, True, "esm.")],
    ids=["unpadded-vocab", "qkv-not-interleaved", "esm-prefix-before-2026-03"],
)
def test_their_variants_convert_in(tmp_path, capsys, tiny_source, padded, interleaved, prefix):
    """Their export since March 2026 (vocabulary rows unpadded), `qkv_weight_interleaved` false (rows [q | k | v])
    and their earlier `esm.` prefix all give transformers' logits."""
    source = write_their_folder(tmp_path / "theirs", tiny_source, padded, interleaved, prefix)
    status, _, err = run(capsys, "bionemo-to-te", source, tmp_path / "te")
    assert status == 0, err
    assert_logits_match_transformers(tmp_path / "te", tiny_source, seed=4)
    if padded == 33:  # ours pads to 64 (a multiple of 16); back to their 33 rows when asked, bit for bit
        convert(dataclasses.replace(TE_TO_BIONEMO, padded_vocab_size=33), tmp_path / "te", tmp_path / "back")
        assert_same_tensors(read_folder(tmp_path / "back"), read_folder(source))
        assert json.loads((tmp_path / "back" / "config.json").read_text())["padded_vocab_size"] == 33


def test_bfloat16_weights_with_infinite_padding_convert_both_ways(tmp_path, capsys, tiny_source):
    """Their float32 lowest value turns -inf in bfloat16: rows past the vocabulary are not read, so it converts;
    going out, their padding is bfloat16's lowest value, finite."""
    source = write_their_folder(tmp_path / "theirs", tiny_source, dtype=torch.bfloat16)
    tensors = read_folder(source)
    tensors["lm_head.decoder.bias"][33:] = -torch.inf
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert run(capsys, "bionemo-to-te", source, tmp_path / "te")[0] == 0
    assert run(capsys, "te-to-bionemo", tmp_path / "te", tmp_path / "back")[0] == 0
    back = read_folder(tmp_path / "back")
    bias = back["lm_head.decoder.bias"]
    assert bias.dtype == torch.bfloat16 and torch.equal(bias[:33], tensors["lm_head.decoder.bias"][:33])
    assert (bias[33:] == torch.finfo(torch.bfloat16).min).all()
    assert_same_tensors({k: v for k, v in back.items() if k != "lm_head.decoder.bias"},
                        {k: v for k, v in tensors.items() if k != "lm_head.decoder.bias"})  # fmt: skip


def test_a_token_classifier_round_trips(tmp_path, capsys, theirs):
    """Their `NVEsmForTokenClassification` (the base model and `classifier`) converts in and out bit for bit."""
    source = tmp_path / "theirs"
    source.mkdir()
    tensors = {k: v for k, v in read_folder(theirs).items() if not k.startswith("lm_head.")}
    generator = torch.Generator().manual_seed(5)
    tensors |= {"classifier.weight": torch.randn(3, 32, generator=generator), "classifier.bias": torch.randn(3)}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((theirs / "config.json").read_text())
    labels = {"id2label": {"0": "H", "1": "E", "2": "C"}, "label2id": {"H": 0, "E": 1, "C": 2}}
    config |= {"architectures": ["NVEsmForTokenClassification"], **labels}
    (source / "config.json").write_text(json.dumps(config))
    assert run(capsys, "bionemo-to-te", source, tmp_path / "te")[0] == 0
    assert json.loads((tmp_path / "te" / "config.json").read_text())["architectures"] == ["NVEsmForTokenClassification"]
    assert run(capsys, "te-to-bionemo", tmp_path / "te", tmp_path / "back")[0] == 0
    assert_same_tensors(read_folder(tmp_path / "back"), tensors)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == ["NVEsmForTokenClassification"] and written["id2label"] == labels["id2label"]


def test_verify_checks_both_directions(tmp_path, capsys, theirs, converted):
    """--verify converting in, and `verify` of a folder converted out (their folder run as transformers' model,
    through the table: their code is neither shipped nor run)."""
    status, out, err = run(capsys, "bionemo-to-te", theirs, tmp_path / "te", *VERIFY_CPU)
    assert status == 0 and "PASSED" in out, err
    assert run(capsys, "te-to-bionemo", converted, tmp_path / "back")[0] == 0
    status, out, err = run(capsys, "verify", converted, tmp_path / "back", "--verify-device", "cpu")
    assert status == 0 and "all identical" in out and "NVIDIA's BioNeMo layout, mapped" in out, out + err


@pytest.mark.slow
def test_verify_checks_both_directions_the_other_way(tmp_path, capsys, theirs, converted):
    status, out, err = run(capsys, "te-to-bionemo", converted, tmp_path / "back", *VERIFY_CPU)
    assert status == 0 and "PASSED" in out and "NVIDIA's BioNeMo layout, mapped" in out, err
    status, out, err = run(capsys, "verify", theirs, converted, "--verify-device", "cpu")
    assert status == 0 and "all identical" in out, out + err


# ---- refusals ---------------------------------------------------------------------------------------------------


def test_each_direction_refuses_the_other_layouts_naming_the_one_that_reads_them(
    tmp_path, capsys, theirs, converted, tiny_source
):
    cases = [
        ("hf-to-te", theirs, "NVIDIA's BioNeMo ESM-2 layout (bionemo-recipes), which hf-to-te does not read; convert "
         "it with bionemo-to-te."),
        ("te-to-hf", theirs, "convert it with bionemo-to-te first."),
        ("te-to-bionemo", theirs, "convert it with bionemo-to-te first."),
        ("bionemo-to-te", tiny_source, "a transformers ESM-2 checkpoint, which bionemo-to-te does not read; convert it "
         "with hf-to-te."),
        ("bionemo-to-te", converted, "is already an NVEsm checkpoint; convert it back with te-to-bionemo."),
    ]  # fmt: skip
    for command, source, needle in cases:
        status, _, err = run(capsys, command, source, tmp_path / "out")
        assert status == 1 and err.count("\n") == 1 and needle in err, (command, err)
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "config.json").write_text(json.dumps({"model_type": "bert"}))
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(2, 2)}, neither / "model.safetensors")
    status, _, err = run(capsys, "bionemo-to-te", neither, tmp_path / "out")
    assert status == 1 and "is not an ESM-2 checkpoint" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field, value",
    [("encoder_activation", "relu"), ("fuse_qkv_params", False), ("attn_mask_type", "causal"), ("rope_theta", 5e5)],
)
def test_a_field_their_model_would_honour_differently_is_refused(tmp_path, capsys, theirs, field, value):
    source = tmp_path / "theirs"
    source.mkdir()
    (source / "model.safetensors").write_bytes((theirs / "model.safetensors").read_bytes())
    config = json.loads((theirs / "config.json").read_text()) | {field: value}
    (source / "config.json").write_text(json.dumps(config))
    status, _, err = run(capsys, "bionemo-to-te", source, tmp_path / "te")
    assert status == 1 and err.count("\n") == 1, err
    assert f"config.json: {field} {value!r} is refused: " in err


def test_their_run_options_are_dropped_with_a_note(tmp_path, capsys, tiny_source):
    source = write_their_folder(tmp_path / "theirs", tiny_source, layer_precision=["fp8", None], micro_batch_size=4)
    status, _, err = run(capsys, "bionemo-to-te", source, tmp_path / "te")
    assert status == 0 and "micro_batch_size=4, layer_precision=['fp8', None]." in err, err
    assert "layer_precision" not in json.loads((tmp_path / "te" / "config.json").read_text())


def test_the_commands_refuse_an_unconverted_folder_naming_the_conversion(tmp_path, capsys, theirs):
    """embed (the loader of embed, score and proteingym) and train refuse their folder in the same line, by its
    config.json; a config.json without their fields is refused by the tensor names."""
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKV")])
    assert run_embed(theirs, fasta, tmp_path / "out", "--device", "cpu") == 1
    embed_line = one_line(capsys.readouterr().err)
    trained = train_here("--model", theirs, "--data", fasta, "--steps", "1", out=tmp_path / "run")
    assert trained.returncode == 1
    assert embed_line == one_line(trained.stderr)
    assert embed_line.startswith(f"{theirs} is NVIDIA's BioNeMo ESM-2 layout (its config.json has ")
    assert embed_line.endswith(f"not nv-esm's; convert it first: nv-esm convert bionemo-to-te {theirs} OUT")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes((theirs / "model.safetensors").read_bytes())
    config = json.loads((theirs / "config.json").read_text())
    ours = {key: value for key, value in config.items() if key not in {*THEIR_FIELDS, "auto_map"}}
    (plain / "config.json").write_text(json.dumps(ours))
    assert run_embed(plain, fasta, tmp_path / "out2", "--device", "cpu") == 1
    line = one_line(capsys.readouterr().err)
    assert line == f"{plain} is NVIDIA's BioNeMo ESM-2 layout (its tensors are under model.), not nv-esm's; " + (
        f"convert it first: nv-esm convert bionemo-to-te {plain} OUT"
    )


def test_a_converted_folder_embeds_but_refuses_contacts(tmp_path, capsys, converted):
    fasta = write_fasta(tmp_path / "in.fasta", [("a", "MKTAYIAKQR")])
    assert run_embed(converted, fasta, tmp_path / "out", "--device", "cpu", "--no-progress") == 0
    capsys.readouterr()
    status = run_embed(
        converted, fasta, tmp_path / "contacts", "--device", "cpu", "--no-progress", "--include", "contacts"
    )
    assert status == 1
    assert "has no contact head" in one_line(capsys.readouterr().err)


def test_train_starts_a_converted_folder_with_a_fresh_contact_head_and_says_so(tmp_path, converted):
    from nv_esm.train.materialize import CONTACT_HEAD_TENSORS, check_fresh_weights

    check_fresh_weights([*CONTACT_HEAD_TENSORS, "lm_head.dense.weight"], converted)  # the whole head: accepted
    with pytest.raises(ValueError, match="has no weights for 1 tensors of the base model"):
        check_fresh_weights(sorted(CONTACT_HEAD_TENSORS)[:1], converted)  # a part of it: damaged
    args = ["--model", converted, "--data", DEMO_FASTA, "--steps", 1, "--tokens-per-batch", 1024, "--max-length", 254]
    done = train_here(*args, "--no-export", out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"note: {converted} has no contact head (NVIDIA's BioNeMo layout has none)" in done.stdout


def test_a_tokenizer_or_a_head_their_code_lacks_is_refused(tmp_path, capsys, theirs, converted):
    """Their tokenizer.json must give ESM-2's tokens ESM-2's ids; a sequence classifier has no class of theirs."""
    source = tmp_path / "theirs"
    source.mkdir()
    for name in ("model.safetensors", "config.json"):
        (source / name).write_bytes((theirs / name).read_bytes())
    fast = json.loads((theirs / "tokenizer.json").read_text())
    fast["model"]["vocab"] |= {"L": 5, "A": 4}
    (source / "tokenizer.json").write_text(json.dumps(fast))
    status, _, err = run(capsys, "bionemo-to-te", source, tmp_path / "te")
    assert status == 1 and "tokenizer.json is not ESM-2's vocabulary ('L' out of place)" in err, err
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    tensors = {k: v for k, v in read_folder(converted).items() if not k.startswith("lm_head.")}
    generator = torch.Generator().manual_seed(6)
    for name, shape in (("dense.weight", (32, 32)), ("dense.bias", (32,)), ("out_proj.weight", (2, 32))):
        tensors[f"classifier.{name}"] = torch.randn(shape, generator=generator)
    tensors["classifier.out_proj.bias"] = torch.zeros(2)
    save_file(tensors, classifier / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((converted / "config.json").read_text())
    config |= {"architectures": ["NVEsmForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}
    (classifier / "config.json").write_text(json.dumps(config | {"label2id": {"a": 0, "b": 1}}))
    status, _, err = run(capsys, "te-to-bionemo", classifier, tmp_path / "out")
    assert status == 1 and "their code has no sequence classification class" in err and err.count("\n") == 1, err


# ---- each choice of a direction in one place --------------------------------------------------------------------


def test_the_way_back_and_the_hints_are_read_from_the_directions(tmp_path, capsys, tiny_source, converted):
    """`INVERSE` and `CONVERTED_BY` are derived from `DIRECTIONS`, and the refusals name what they say: the way
    back, the directions that write what one reads, the directions that convert adapters."""
    assert {name: back.name for name, back in INVERSE.items()} == {
        "hf-to-te": "te-to-hf",
        "te-to-hf": "hf-to-te",
        "bionemo-to-te": "te-to-bionemo",
        "te-to-bionemo": "bionemo-to-te",
    }
    assert all(direction.inverse.inverse is direction for direction in DIRECTIONS.values())
    assert CONVERTED_BY == {"transformers": "hf-to-te", "fair-esm": "hf-to-te", "bionemo": "bionemo-to-te"}
    cases = [
        ("hf-to-te", converted, "is already an NVEsm checkpoint; convert it back with te-to-hf."),
        ("te-to-hf", tiny_source, "te-to-hf reads folders written by hf-to-te or bionemo-to-te: convert it with "
         "hf-to-te first."),
    ]  # fmt: skip
    for command, source, needle in cases:
        status, _, err = run(capsys, command, source, tmp_path / "out")
        assert status == 1 and err.count("\n") == 1 and needle in err, (command, err)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"adapter folder: adapters convert with hf-to-te and te-to-hf only\.$"):
        convert(TE_TO_BIONEMO, adapter, tmp_path / "out")


def test_the_converter_asks_the_direction_and_names_each_thing_once():
    """conversion.py never tests a direction's type; the contact head's tensor names are spelled in
    `state_dict_mapping` only (`CONTACT_HEAD`), not in the modules that read them; their vocabulary row count is
    resolved by `bionemo_vocab_rows` only."""
    package = sorted((ROOT / "nv_esm").rglob("*.py"))
    conversion = code_of(ROOT / "nv_esm" / "conversion.py")
    assert "BionemoDirection" not in conversion and "isinstance(direction" not in conversion
    assert places(r"padded_vocab_size or ", package) == {"nv_esm/bionemo_mapping.py"}
    readers = ["conversion", "conversion_plan", "bionemo_mapping", "checkpoint_io", "embed_model", "train/materialize"]
    spelled = {
        path.relative_to(ROOT).as_posix()
        for path in [ROOT / "nv_esm" / f"{name}.py" for name in ("state_dict_mapping", *readers)]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "contact_head." in node.value
    }
    assert spelled == {"nv_esm/state_dict_mapping.py"}


def test_each_direction_verifies_its_output_with_the_loader_of_what_it_writes():
    """`verify` takes one loader, which the direction chooses: NVEsm's class, plain transformers, or their layout read
    as data."""
    from nv_esm.conversion import converted_loader, load_bionemo
    from nv_esm.conversion_plan import HF_TO_TE, TE_TO_HF
    from nv_esm.verification import load_nv, load_transformers

    loaders = {name: converted_loader(direction) for name, direction in DIRECTIONS.items()}
    assert loaders == {
        HF_TO_TE.name: load_nv,
        TE_TO_HF.name: load_transformers,
        BIONEMO_TO_TE.name: load_nv,
        TE_TO_BIONEMO.name: load_bionemo,
    }
