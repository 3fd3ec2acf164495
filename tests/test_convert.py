"""The checkpoint converter: streaming round trips, fair-esm input, --verify, Hub upload, model card, memory.

Checkpoints are random ESM-2-shaped models saved by transformers itself; comparisons are against what transformers
loads, or against the pure state-dict functions that the model tests check against transformers' outputs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForMaskedLM, AutoTokenizer, EsmForMaskedLM

from conftest import SHAPES, TINY_CHECKPOINT, make_hf_model
from convert_checkpoint import main
from convert_helpers import (
    NV_FILES,
    VERIFY_CPU,
    assert_same_tensors,
    current_hf_names,
    read_folder,
    run,
    save_hf,
    write_fair_esm_checkpoint,
)
from nv_esm import alphabet, state_dict_mapping, verification
from nv_esm.alphabet import GFP
from nv_esm.checkpoint_io import DTYPES
from nv_esm.options import parse_size
from nv_esm.shapes import esm2_config
from nv_esm.state_dict_mapping import hf_to_nv_state_dict, nv_config_from_hf

try:
    import yaml
except ImportError:  # PyYAML is a dev dependency; huggingface_hub parses model-card metadata too
    yaml = None


# ---- round trips --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", ["tiny", "wide_heads", "esm2_8M"])
def test_hf_to_te_to_hf_is_bit_exact(tmp_path, capsys, shape, dtype, sharded):
    seed = 11 + list(SHAPES).index(shape)
    original = make_hf_model(shape, seed=seed).to(DTYPES[dtype])
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in original.state_dict().values())
    source = save_hf(original, tmp_path / "src", dtype, shard=nbytes // 3 if sharded else None)
    assert (source / "model.safetensors.index.json").exists() == sharded
    shard_args = ["--max-shard-size", str(nbytes // 4)] if sharded else []
    assert run(capsys, "hf-to-te", source, tmp_path / "te", *shard_args)[0] == 0
    assert run(capsys, "te-to-hf", tmp_path / "te", tmp_path / "back", *shard_args)[0] == 0

    # Every stored tensor comes back bit for bit, in its dtype.
    assert_same_tensors(current_hf_names(read_folder(tmp_path / "back")), current_hf_names(read_folder(source)))
    # transformers loads the result exactly as it loads the original.
    restored = EsmForMaskedLM.from_pretrained(tmp_path / "back", dtype=DTYPES[dtype]).state_dict()
    assert_same_tensors(restored, EsmForMaskedLM.from_pretrained(source, dtype=DTYPES[dtype]).state_dict())
    assert all(torch.equal(restored[key].to(value.dtype), value) for key, value in original.state_dict().items())
    # The streamed NVEsm checkpoint equals what the pure state-dict mapping gives.
    config = nv_config_from_hf(original.config.to_dict())
    expected = hf_to_nv_state_dict(original.state_dict(), config)
    expected.pop("lm_head.decoder.weight")  # tied to the embedding: transformers does not save it
    assert_same_tensors(read_folder(tmp_path / "te"), expected)
    for folder in (tmp_path / "te", tmp_path / "back"):
        index = folder / "model.safetensors.index.json"
        assert index.exists() == sharded
        if sharded:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert set(weight_map.values()) == {path.name for path in folder.glob("*.safetensors")}
            assert len(set(weight_map.values())) > 1
            assert set(weight_map) == set(read_folder(folder))


def test_dtype_option_casts_weights_and_keeps_rotary_frequencies(tmp_path, capsys, tiny_source):
    assert run(capsys, "hf-to-te", tiny_source, tmp_path / "te", "--dtype", "bfloat16")[0] == 0
    assert json.loads((tmp_path / "te" / "config.json").read_text())["dtype"] == "bfloat16"
    assert run(capsys, "te-to-hf", tmp_path / "te", tmp_path / "back")[0] == 0
    original, back = current_hf_names(read_folder(tiny_source)), current_hf_names(read_folder(tmp_path / "back"))
    inv_freq = "esm.rotary_embeddings.inv_freq"
    assert back[inv_freq].dtype == torch.float32 and torch.equal(back[inv_freq], original[inv_freq])
    expected = {key: value.to(torch.bfloat16) for key, value in original.items() if key != inv_freq}
    assert_same_tensors({key: value for key, value in back.items() if key != inv_freq}, expected)


# ---- fair-esm .pt input ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("regression_beside", [True, False], ids=["regression-file", "regression-inside"])
def test_fair_esm_checkpoint_converts_and_verifies(tmp_path, capsys, regression_beside):
    original = make_hf_model("wide_heads", seed=21)
    path = tmp_path / "esm2_t3_random_UR50D.pt"
    write_fair_esm_checkpoint(original, path, regression_beside)
    status, out, err = run(capsys, "hf-to-te", path, tmp_path / "te", *VERIFY_CPU)
    assert status == 0, err
    assert "PASSED" in out
    assert run(capsys, "te-to-hf", tmp_path / "te", tmp_path / "back")[0] == 0
    restored = EsmForMaskedLM.from_pretrained(tmp_path / "back")
    assert_same_tensors(restored.state_dict(), original.state_dict())
    # The .pt carries no tokenizer: the ESM-2 one is written, and tokenizes as the bundled checkpoint's does.
    ours = AutoTokenizer.from_pretrained(tmp_path / "te", trust_remote_code=True)
    assert (
        ours(GFP + "<mask>")["input_ids"] == AutoTokenizer.from_pretrained(TINY_CHECKPOINT)(GFP + "<mask>")["input_ids"]
    )


def test_fair_esm_without_contact_regression_says_where_to_put_it(tmp_path, capsys):
    path = tmp_path / "esm2_t2_random_UR50D.pt"
    write_fair_esm_checkpoint(make_hf_model("tiny", seed=22), path, regression_beside=True)
    path.with_name(path.stem + "-contact-regression.pt").unlink()
    status, _, err = run(capsys, "hf-to-te", path, tmp_path / "te")
    assert status == 1 and "esm2_t2_random_UR50D-contact-regression.pt" in err
    assert not (tmp_path / "te").exists()


class NotAWeight:
    """Unpickling this would run code; weights_only loading must refuse the file."""


def test_pt_file_with_other_objects_is_refused(tmp_path, capsys):
    path = tmp_path / "esm2_evil.pt"
    torch.save({"model": {}, "cfg": {"model": NotAWeight()}}, path)
    status, _, err = run(capsys, "hf-to-te", path, tmp_path / "te")
    assert status == 1 and "objects other than tensors" in err and "NotAWeight" in err


# ---- --verify -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_verify_passes_and_the_model_card_holds_the_table(tmp_path, capsys, tiny_source):
    status, out, _ = run(capsys, "hf-to-te", tiny_source, tmp_path / "te", *VERIFY_CPU)
    assert status == 0
    proteins = alphabet.read_fasta(verification.PROTEINS_FASTA)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| protein")]
    assert [row.split("|")[1].strip() for row in rows] == [name for name, _ in proteins]
    assert all(row.split("|")[5].strip() == "100.0%" for row in rows)  # argmax agreement
    assert "PASSED" in out
    card = (tmp_path / "te" / "README.md").read_text()
    assert all(row in card for row in rows) and "PASSED" in card
    status, out, _ = run(capsys, "te-to-hf", tmp_path / "te", tmp_path / "back", *VERIFY_CPU)
    assert status == 0 and "PASSED" in out and "transformers EsmForMaskedLM" in out


def test_verify_bf16_passes_with_default_tolerance(tmp_path, capsys):
    source = save_hf(make_hf_model("tiny", seed=8), tmp_path / "src")
    status, out, err = run(capsys, "hf-to-te", source, tmp_path / "te", "--dtype", "bfloat16", *VERIFY_CPU)
    assert status == 0, out + err
    assert f"tolerance {verification.DEFAULT_VERIFY_ATOL['bfloat16']:g}" in out and "bfloat16" in out


def swap_query_and_key(real):
    return lambda query, key, value, num_heads: real(key, query, value, num_heads)


def nudge_one_bias_logit(real):
    def pad(tensor, padded_vocab_size):
        padded = real(tensor, padded_vocab_size)
        if tensor.dim() == 1:  # lm_head.bias: one token's logit moves by 1e-3 everywhere
            padded[5] += 1e-3
        return padded

    return pad


@pytest.mark.parametrize(
    "target,corrupt", [("fuse_qkv", swap_query_and_key), ("pad_vocab", nudge_one_bias_logit)], ids=["qkv", "bias"]
)
def test_verify_fails_on_a_corrupted_conversion(tmp_path, capsys, monkeypatch, tiny_source, target, corrupt):
    monkeypatch.setattr(state_dict_mapping, target, corrupt(getattr(state_dict_mapping, target)))
    status, out, err = run(capsys, "hf-to-te", tiny_source, tmp_path / "te", *VERIFY_CPU)
    assert status == 3
    assert "FAILED" in err and "| P42212 | 238 |" in err and "was not written" in err
    assert not (tmp_path / "te").exists()
    assert not list(tmp_path.glob(".te.*"))


def test_verify_atol_sets_the_tolerance(tmp_path, capsys, monkeypatch, tiny_source):
    monkeypatch.setattr(state_dict_mapping, "pad_vocab", nudge_one_bias_logit(state_dict_mapping.pad_vocab))
    status, out, _ = run(capsys, "hf-to-te", tiny_source, tmp_path / "te", *VERIFY_CPU, "--verify-atol", "0.01")
    assert status == 0 and "tolerance 0.01" in out
    largest = float(re.search(r"largest max abs Δlogit ([0-9.e+-]+)", out).group(1))
    assert abs(largest - 1e-3) < 1e-5  # exactly the nudge of one bias


def test_verify_device_cpu_runs_the_exact_path_even_when_a_gpu_is_visible(tmp_path, capsys, monkeypatch, tiny_source):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine reports
    assert verification.verify_device("auto") == "cuda"
    status, out, err = run(capsys, "hf-to-te", tiny_source, tmp_path / "te", *VERIFY_CPU)
    assert status == 0, err
    assert "device cpu" in out and "backend torch" in out and "tolerance 0.0001" in out


def test_verify_device_cuda_without_a_gpu_is_refused_before_converting(tmp_path, capsys, monkeypatch, tiny_source):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, _, err = run(capsys, "hf-to-te", tiny_source, tmp_path / "te", "--verify", "--verify-device", "cuda")
    assert status == 1 and "no CUDA GPU" in err and not tmp_path.joinpath("te").exists()


# ---- verify SRC OUT: an existing conversion, tensor by tensor, then the logit table ---------------------------------


@pytest.fixture(scope="module")
def conversions(tmp_path_factory, tiny_source) -> Path:
    """tiny_source converted to NVEsm (float32 and bfloat16) and back to transformers."""
    folder = tmp_path_factory.mktemp("conversions")
    for argv in (
        ("hf-to-te", tiny_source, folder / "te"),
        ("hf-to-te", tiny_source, folder / "te_bf16", "--dtype", "bfloat16"),
        ("te-to-hf", folder / "te", folder / "back"),
    ):
        assert main([str(arg) for arg in argv]) == 0
    return folder


@pytest.mark.slow
def test_verify_command_passes_on_untouched_conversions(tmp_path, capsys, tiny_source, conversions):
    path = tmp_path / "esm2_t3_random_UR50D.pt"
    write_fair_esm_checkpoint(make_hf_model("wide_heads", seed=21), path, regression_beside=True)
    assert run(capsys, "hf-to-te", path, tmp_path / "from_pt")[0] == 0
    for source, out, label in (
        (tiny_source, conversions / "te", "hf-to-te, float32"),
        (tiny_source, conversions / "te_bf16", "hf-to-te, bfloat16"),  # compared with the source cast the same way
        (conversions / "te", conversions / "back", "te-to-hf, float32"),
        (path, tmp_path / "from_pt", "hf-to-te, float32"),
    ):
        status, out_text, err = run(capsys, "verify", source, out, "--verify-device", "cpu")
        assert status == 0, out_text + err
        assert f"({label}) and compared with OUT bit for bit: all identical" in out_text and "PASSED" in out_text


def nudge(tensor: torch.Tensor) -> torch.Tensor:
    """The same tensor with its first element one float step larger."""
    tensor = tensor.clone()
    first = tensor.view(-1)[:1]
    first.copy_(torch.nextafter(first, torch.full_like(first, torch.inf)))
    return tensor


def pad_row(tensor: torch.Tensor) -> torch.Tensor:
    """A vocabulary padding row (past vocab_size 33) set non-zero."""
    tensor = tensor.clone()
    tensor[40] = 0.5
    return tensor


@pytest.mark.parametrize(
    "folder,name,edit",
    [
        ("te", "esm.contact_head.regression.weight", lambda t: t + 0.5),
        ("back", "esm.contact_head.regression.bias", lambda t: t - 0.5),
        ("te", "esm.embeddings.word_embeddings.weight", pad_row),
        ("te", "lm_head.decoder.bias", pad_row),
        ("te", "esm.encoder.layers.1.layernorm_mlp.fc2_bias", nudge),  # moves logits far below the tolerance
    ],
    ids=["contact-head", "contact-head-te-to-hf", "embedding-padding-row", "decoder-padding-row", "one-ulp"],
)
def test_verify_command_names_each_changed_tensor(tmp_path, capsys, tiny_source, conversions, folder, name, edit):
    out = shutil.copytree(conversions / folder, tmp_path / folder)
    state = read_folder(out)
    state[name] = edit(state[name])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    source = tiny_source if folder == "te" else conversions / "te"
    status, out_text, err = run(capsys, "verify", source, out, "--verify-device", "cpu")
    assert status == 3 and "verify failed: files all identical, tensors 1 difference;" in err
    assert [line.split()[1] for line in out_text.splitlines() if "DIFFERS" in line] == [name + ":"]
    if edit is nudge:
        assert "logits agree (files or tensors above differ)" in out_text  # the logit table alone would not see it
        assert "PASSED" not in out_text  # never before a failure


def test_verify_command_reports_missing_and_extra_tensors_and_config_changes(
    tmp_path, capsys, tiny_source, conversions
):
    out = shutil.copytree(conversions / "te", tmp_path / "te")
    state = read_folder(out)
    state["extra.weight"] = state.pop("esm.contact_head.regression.bias")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"layer_norm_eps": 1e-6}))
    status, out_text, _ = run(capsys, "verify", tiny_source, out, "--verify-device", "cpu")
    differs = [line for line in out_text.splitlines() if "DIFFERS" in line]
    assert status == 3 and len(differs) == 3
    for needle in ("config.json layer_norm_eps: 1e-06, from SRC 1e-05", "esm.contact_head.regression.bias: missing",
                   "extra.weight: in OUT, not made from SRC"):  # fmt: skip
        assert any(needle in line for line in differs), needle
    status, _, err = run(capsys, "verify", tiny_source, conversions / "back")  # transformers twice
    assert status == 1 and "transformers and" in err


@pytest.mark.slow
def test_verifying_leaves_nothing_in_the_modules_cache(tmp_path, capsys, tiny_source, modules_cache):
    te, back = tmp_path / "work" / "te", tmp_path / "work" / "back"
    assert run(capsys, "hf-to-te", tiny_source, te, *VERIFY_CPU)[0] == 0
    assert run(capsys, "te-to-hf", te, back, *VERIFY_CPU)[0] == 0  # loads the NVEsm source with remote code
    assert run(capsys, "verify", tiny_source, te, "--verify-device", "cpu")[0] == 0
    assert run(capsys, "verify", te, back, "--verify-device", "cpu")[0] == 0
    assert sorted(modules_cache.rglob("*")) == []
    assert not any(name.split(".")[0] == "transformers_modules" for name in sys.modules)


# ---- Hub id source, model card, upload --------------------------------------------------------------------------


@pytest.fixture
def from_hub(monkeypatch, tiny_source):
    """A Hub id source without network: snapshot_download hands out the tiny checkpoint and records its call."""
    calls = []

    def snapshot_download(repo_id, revision=None, **kwargs):
        calls.append((repo_id, revision))
        return str(tiny_source)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_model_card_is_yaml_front_matter_and_markdown(tmp_path, capsys, from_hub):
    status, _, _ = run(capsys, "hf-to-te", "facebook/esm2_random_tiny", tmp_path / "te", "--revision", "v1")
    assert status == 0 and from_hub == [("facebook/esm2_random_tiny", "v1")]
    text = (tmp_path / "te" / "README.md").read_text()
    match = re.fullmatch(r"---\n(.*?)\n---\n(.*)", text, re.DOTALL)
    assert match, text[:200]
    meta = yaml.safe_load(match.group(1)) if yaml else huggingface_hub.metadata_load(tmp_path / "te" / "README.md")
    body = match.group(2)
    assert meta["license"] == "mit" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "fill-mask" and meta["base_model"] == "facebook/esm2_random_tiny"
    assert {"esm2", "protein-language-model", "transformer-engine"} <= set(meta["tags"])
    headings = re.findall(r"^#+ (.+)$", body, re.MULTILINE)
    assert headings[0].startswith("facebook/esm2_random_tiny")
    assert {"Usage", "Packed sequences (THD)", "FP8", "Hardware", "Verification", "License", "Citation"} <= set(
        headings
    )
    needles = ['backend="torch"', "cu_seq_lens_q", "max_length_q", "DataCollatorWithFlattening", "position_ids"]
    needles += ['attn_input_format="thd"', "layer_precision", "fp8_recipe", "Hopper", "Science 2023"]
    needles += ["Evolutionary-scale prediction of atomic-level protein structure with a language model"]
    for needle in needles:
        assert needle in body, needle
    assert body.count("```") % 2 == 0
    license_text = (tmp_path / "te" / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and "Meta Platforms" in license_text
    config = json.loads((tmp_path / "te" / "config.json").read_text())
    assert set(config["auto_map"]) == {
        "AutoConfig",
        "AutoModel",
        "AutoModelForMaskedLM",
        "AutoModelForTokenClassification",
        "AutoModelForSequenceClassification",
    }
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "te", trust_remote_code=True, backend="torch")
    assert type(model).__name__ == "NVEsmForMaskedLM"


def test_dry_run_lists_the_files_and_uploads_nothing(tmp_path, capsys, monkeypatch, tiny_source):
    def no_network(*args, **kwargs):
        raise AssertionError("--dry-run must not reach the Hub")

    for name in ("create_repo", "upload_folder", "HfApi"):
        monkeypatch.setattr(huggingface_hub, name, no_network)
    out = tmp_path / "te"
    status, stdout, _ = run(capsys, "hf-to-te", tiny_source, out, "--push-to-hub", "me/esm2_te", "--dry-run")
    assert status == 0
    listing = stdout[stdout.index("dry run:") :].splitlines()
    listed = [line.split()[0] for line in listing[1:] if line.startswith("  ") and "commit message" not in line]
    assert sorted(listed) == sorted(path.name for path in out.iterdir())
    assert set(listed) == NV_FILES | {"model.safetensors"}
    assert f"would upload {len(listed)} files" in listing[0] and "me/esm2_te" in listing[0]


def test_push_creates_the_repo_and_uploads_the_folder(tmp_path, capsys, monkeypatch, tiny_source):
    calls = {}
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.update(create=(repo_id, kw)))
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.update(upload=kw))
    args = ["--push-to-hub", "me/esm2_te", "--private", "--commit-message", "first upload"]
    status, _, _ = run(capsys, "hf-to-te", tiny_source, tmp_path / "te2", *args)
    assert status == 0
    assert calls["create"] == ("me/esm2_te", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls["upload"] == {
        "repo_id": "me/esm2_te",
        "folder_path": tmp_path / "te2",
        "commit_message": "first upload",
    }
    card = (tmp_path / "te2" / "README.md").read_text()
    assert 'repo = "me/esm2_te"' in card


def test_help_lists_every_option_and_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("hf-to-te", "te-to-hf", "verify", "--revision", "--dtype", "--max-shard-size", "--overwrite",
                   "--verify", "--verify-atol", "--verify-device", "--push-to-hub", "--private", "--commit-message",
                   "--dry-run", "examples:", "nv-esm convert verify ", ".pt", "exit status"):  # fmt: skip
        assert option in text, option
    for argv, message in (
        (["hf-to-te", "a", "b", "--dry-run"], "--dry-run needs --push-to-hub"),
        (["hf-to-te", "a", "b", "--verify-device", "cpu"], "--verify-device needs --verify"),
        (["verify", "a", "b", "--dtype", "bfloat16"], "--dtype does not apply to verify"),
        (["verify", "a", "b", "--max-shard-size", "1GB"], "--max-shard-size does not apply to verify"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,size", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("1.5MB", 1_500_000), ("100", 100), ("64kib", 65536)]
)
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_parse_size_rejects_nonsense():
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 gigs")


# ---- memory --------------------------------------------------------------------------------------------------------

MEMORY_PROBE = """
import convert_checkpoint
import nv_esm.conversion, nv_esm.hub_folder, nv_esm.verification  # what convert_checkpoint.main imports to run

def status(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
baseline = status("VmRSS")
code = convert_checkpoint.main([{direction!r}, {source!r}, {out!r}, "--max-shard-size", "60MB"])
print("probe", code, status("VmHWM") - baseline)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to measure peak RSS")
def test_streaming_peak_memory_is_a_fraction_of_the_checkpoint(tmp_path):
    torch.manual_seed(0)  # ~236 MB in fp32: 12 layers of width 640
    model = EsmForMaskedLM(
        esm2_config(hidden_size=640, num_hidden_layers=12, num_attention_heads=10, intermediate_size=2560)
    )
    source = save_hf(model, tmp_path / "src")
    del model
    size = sum(path.stat().st_size for path in source.glob("*.safetensors"))
    assert size > 200e6
    for direction, src, out in (
        ("hf-to-te", source, tmp_path / "te"),
        ("te-to-hf", tmp_path / "te", tmp_path / "back"),
    ):
        script = MEMORY_PROBE.format(direction=direction, source=str(src), out=str(out))
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        code, peak = map(int, result.stdout.splitlines()[-1].split()[1:])
        assert code == 0, result.stderr
        print(f"\n[{direction}] checkpoint {size / 1e6:.0f} MB, peak RSS above baseline {peak / 1e6:.0f} MB")
        assert peak < size / 4  # holding the checkpoint once would take `size`; the old converter took 2x
