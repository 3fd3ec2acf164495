"""The edges a user meets first: inputs that used to give a silent wrong number, a traceback or a hang
now give the right number or a one-line reason. (The protein rule: tests/test_protein_rule.py.)"""

from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import EsmConfig

from configuration_nv_esm import NVEsmConfig
from conftest import ATOL_FP32, TINY_CHECKPOINT, make_hf_model, make_nv_model, random_padded_batch, random_proteins
from convert_helpers import run
from modeling_nv_esm import NVEsmForMaskedLM
from nv_esm.alphabet import PAD

# ---- configs ----------------------------------------------------------------------------------------------------


def test_a_transformers_esm2_config_dict_builds_an_nvesm_config():
    """transformers 5 writes bos_token_id None (and its own fields) into every EsmConfig."""
    esm = EsmConfig(
        vocab_size=33, hidden_size=320, num_hidden_layers=6, num_attention_heads=20, intermediate_size=1280,
        position_embedding_type="rotary", mask_token_id=32, pad_token_id=1, max_position_embeddings=1026,
    )  # fmt: skip
    config = NVEsmConfig(**esm.to_dict())
    assert config.bos_token_id is None and (config.hidden_size, config.num_hidden_layers) == (320, 6)
    assert NVEsmConfig.from_dict(json.loads((TINY_CHECKPOINT / "config.json").read_text()) | {"model_type": "nv_esm"})
    with pytest.raises(ValueError, match="bos_token_id must be a token id in \\[0, 33\\), got True"):
        NVEsmConfig(bos_token_id=True)


def test_fp8_weights_without_fp8_layers_or_off_transformer_engine_is_refused(tmp_path):
    """`fp8_weights` (weights held in TE's FP8 tensors) needs FP8 layers and the TE backend; it is a load-time
    option (never in config.json). Its GPU behaviour: tests/test_gpu.py."""
    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    with pytest.raises(ValueError, match="layer_precision marks no layer 'fp8'"):
        NVEsmConfig(**shape, fp8_weights=True)
    with pytest.raises(ValueError, match="fp8_weights .* needs backend='te'"):
        NVEsmForMaskedLM(NVEsmConfig(**shape, layer_precision=["fp8", None], fp8_weights=True, backend="torch"))
    with pytest.raises(ValueError, match="fp8_weights must be True or False"):
        NVEsmConfig(**shape, layer_precision=["fp8", None], fp8_weights="yes")
    NVEsmConfig(**shape, layer_precision=["fp8", None], fp8_weights=True).save_pretrained(tmp_path)
    assert "fp8_weights" not in json.loads((tmp_path / "config.json").read_text())


def test_cudnn_layer_norm_is_a_load_time_option_the_pytorch_backend_ignores(tmp_path, caplog):
    """`cudnn_layer_norm` switches TE's LayerNorm kernels (tests/test_gpu.py); the twin runs torch's LayerNorm with
    it as without it (a warning says so), and config.json never holds it."""
    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    with pytest.raises(ValueError, match="cudnn_layer_norm must be True or False"):
        NVEsmConfig(**shape, cudnn_layer_norm=1)
    torch.manual_seed(0)
    plain = NVEsmForMaskedLM(NVEsmConfig(**shape, backend="torch")).eval()
    with caplog.at_level(logging.WARNING):
        switched = NVEsmForMaskedLM(NVEsmConfig(**shape, backend="torch", cudnn_layer_norm=True)).eval()
    assert "backend='torch' ignores it" in caplog.text
    switched.load_state_dict(plain.state_dict())
    input_ids = torch.tensor([[0, 5, 6, 7, 2]])
    with torch.no_grad():
        assert torch.equal(switched(input_ids).logits, plain(input_ids).logits)
    switched.save_pretrained(tmp_path)
    assert "cudnn_layer_norm" not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("rope_theta", "10000", "rope_theta must be a positive number, got '10000'"),
        ("layer_norm_eps", "1e-5", "layer_norm_eps must be a positive number"),
        ("layer_norm_eps", float("nan"), "layer_norm_eps must be a positive number"),
        ("num_hidden_layers", 100_000_000, "num_hidden_layers must be at most 1024"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_in_one_line(tmp_path, capsys, field, value, message):
    with pytest.raises(ValueError, match=message):
        NVEsmConfig(**{field: value})
    source = shutil.copytree(TINY_CHECKPOINT, tmp_path / "src")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {field: value}))
    started = time.perf_counter()
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "te")
    assert status == 1 and err.count("\n") == 1 and message in err, err
    assert time.perf_counter() - started < 30  # no allocation without end


def test_the_converter_refuses_integer_weights(tmp_path, capsys):
    source = shutil.copytree(TINY_CHECKPOINT, tmp_path / "src")
    state = load_file(source / "model.safetensors")
    state = {k: v.to(torch.int8) if v.is_floating_point() and "inv_freq" not in k else v for k, v in state.items()}
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "te", "--dtype", "bfloat16")
    assert status == 1 and "is int8: ESM-2 weights are floating point" in err and err.count("\n") == 1
    assert not (tmp_path / "te").exists()


# ---- model inputs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    hf = make_hf_model("tiny", seed=31)
    return hf, make_nv_model(hf)


def test_max_length_q_past_the_models_limit_is_refused_at_once(models):
    _, nv = models
    ids = torch.randint(4, 24, (1, 78))
    cu = torch.tensor([0, 40, 78], dtype=torch.int32)
    started = time.perf_counter()
    for max_length in (50_000, 2_000_000):
        with pytest.raises(ValueError, match=f"max_length_q \\({max_length}\\) is longer than max_protein_length"):
            nv(input_ids=ids, cu_seq_lens_q=cu, max_length_q=max_length)
    assert time.perf_counter() - started < 5


def test_input_ids_and_inputs_embeds_of_the_wrong_kind_are_refused(models):
    _, nv = models
    with pytest.raises(ValueError, match="int64 or int32.*got dtype torch.uint8"):
        nv(input_ids=torch.randint(4, 24, (2, 9), dtype=torch.uint8))
    with pytest.raises(ValueError, match="inputs_embeds must be \\[..., hidden_size=32\\]"):
        nv.esm(inputs_embeds=torch.randn(2, 9, 31))


@pytest.mark.parametrize("side", ["right", "left"])
def test_labels_at_padding_are_refused_and_minus_100_there_matches_transformers(models, side):
    hf, nv = models
    generator = torch.Generator().manual_seed(5)
    proteins = random_proteins([30, 7, 1, 19], seed=9, mask_fraction=0.15)
    input_ids, attention_mask = random_padded_batch(proteins, side, "wider", generator)
    input_ids = input_ids.masked_fill(attention_mask == 0, PAD)  # as tokenizers pad (transformers' token dropout
    # counts <mask> ids at padding too)
    with pytest.raises(ValueError, match="labels must be -100 at padding"):
        nv(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        ours = nv(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        theirs = hf(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    assert abs(ours.item() - theirs.item()) <= ATOL_FP32


def test_a_run_killed_between_the_renames_of_force_gets_its_output_back(tmp_path, capsys):
    """--force sets the old OUT aside, renames the new one into place, then deletes the old one; a kill between
    the two renames left OUT missing. The next run in that folder puts it back (or deletes it if OUT is there)."""
    import subprocess

    from nv_esm.hub_folder import _host

    out = tmp_path / "te"
    assert run(capsys, "hf-to-te", TINY_CHECKPOINT, out)[0] == 0
    ended = subprocess.Popen(["true"])
    ended.wait()  # a process id that has ended: the killed run's
    aside = tmp_path / f".te.old-{_host()}-{ended.pid}-abcdefgh"
    out.rename(aside)
    staged = tmp_path / f".te.partial-{_host()}-{ended.pid}-abcdefgh"
    staged.mkdir()
    (staged / "model.safetensors").write_text("half written")
    status, _, err = run(capsys, "hf-to-te", TINY_CHECKPOINT, tmp_path / "other")
    assert status == 0 and f"restoring {out}, set aside by an interrupted run" in err
    assert (out / "model.safetensors").stat().st_size > 100 and not aside.exists() and not staged.exists()
    shutil.copytree(out, aside)  # OUT is back in place: a set-aside copy is only deleted
    assert run(capsys, "hf-to-te", TINY_CHECKPOINT, out, "--overwrite")[0] == 0
    assert not aside.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["other", "te"]


# ---- nv-esm embed: the output folder --------------------------------------------------------------------------


EMBED_CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


def embed_into(checkpoint, fasta, out, *extra) -> int:
    from nv_esm import embed

    return embed.main([str(checkpoint), str(fasta), str(out), *EMBED_CPU, *extra])


def test_a_checkpoint_edited_in_place_is_not_resumed_into(tmp_path, capsys):
    """A byte changed anywhere in a weight file (same size) changes the fingerprint: the folder never mixes two
    models' embeddings. (The 8M shape's file is larger than the 64 x 64 KiB an earlier fingerprint sampled.)"""
    from convert_helpers import save_hf
    from nv_esm.conversion import convert_hf_to_nv

    source = save_hf(make_hf_model("esm2_8M", seed=3), tmp_path / "hf")
    checkpoint = tmp_path / "nv"
    convert_hf_to_nv(source, checkpoint)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAK\n")
    assert embed_into(checkpoint, fasta, tmp_path / "out") == 0
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    offset = len(data) // 128 + 100_000  # between two of the earlier fingerprint's samples
    data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert embed_into(checkpoint, fasta, tmp_path / "out") == 1
    assert "holds a run with other settings (checkpoint: 'sha256-64MiB-pieces:" in capsys.readouterr().err


def test_a_second_run_into_a_folder_being_written_is_refused(nv_tiny, tmp_path, capsys):
    from nv_esm import embed_output

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAK\n")
    out = tmp_path / "out"
    with embed_output.output_lock(out):  # a run in progress
        assert embed_into(nv_tiny, fasta, out, "--overwrite") == 1
        assert "is being written by another nv-esm embed run (process" in capsys.readouterr().err
    assert embed_into(nv_tiny, fasta, out) == 0
    names = ["embeddings-00000.safetensors", "embeddings-00000.safetensors.sha256", "index.tsv", "manifest.json"]
    assert sorted(p.name for p in out.iterdir()) == names
