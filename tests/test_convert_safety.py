"""The converter never loses or half-writes anything: failures midway, overwriting, bad sources, tokenizer files
that would bring remote code, SIGTERM, staging folders of dead runs. (Round trips and --verify: test_convert.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from conftest import TINY_CHECKPOINT, make_hf_model
from convert_helpers import (
    NV_FILES,
    VERIFY_CPU,
    read_folder,
    run,
    save_hf,
    write_fair_esm_checkpoint,
)
from nv_esm import checkpoint_io, hub_folder
from nv_esm.alphabet import ESM_VOCAB, GFP
from nv_esm.hub_folder import write_esm_tokenizer

# ---- safety ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "forced-over-existing"])
def test_failure_midway_leaves_no_half_written_output(tmp_path, capsys, monkeypatch, tiny_source, existing):
    out = tmp_path / "te"
    if existing:
        out.mkdir()
        (out / "README.md").write_text("old conversion")  # a file a conversion writes: --force may replace it
    real_write, calls = checkpoint_io.SafetensorsWriter.write, []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 10:
            raise OSError(28, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(checkpoint_io.SafetensorsWriter, "write", failing_write)
    status, _, err = run(capsys, "hf-to-te", tiny_source, out, "--overwrite")
    assert status == 1 and "No space left on device" in err and len(calls) == 10
    assert sorted(path.name for path in tmp_path.iterdir()) == (["te"] if existing else [])
    if existing:
        assert [path.name for path in out.iterdir()] == ["README.md"]
        assert (out / "README.md").read_text() == "old conversion"


def test_refuses_to_overwrite_without_force(tmp_path, capsys, tiny_source):
    out = tmp_path / "te"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    status, _, err = run(capsys, "hf-to-te", tiny_source, out)
    assert status == 1 and "--overwrite" in err and (out / "keep.txt").read_text() == "precious"
    status, _, err = run(capsys, "hf-to-te", tiny_source, out, "--overwrite")  # no conversion wrote keep.txt
    assert status == 1 and "(keep.txt); --overwrite replaces" in err and (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    (out / "README.md").write_text("an earlier conversion's card")
    assert run(capsys, "hf-to-te", tiny_source, out, "--overwrite")[0] == 0
    assert {path.name for path in out.iterdir()} == NV_FILES | {"model.safetensors"}
    status, _, err = run(capsys, "te-to-hf", out, out, "--overwrite")  # would delete its own source
    assert status == 1 and "holds the source" in err and (out / "model.safetensors").exists()


def test_clear_errors_for_sources_that_are_not_esm2(tmp_path, capsys, tiny_source, monkeypatch):
    def broken_copy(name: str, edit) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for path in tiny_source.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        edit(folder)
        return folder

    def drop_tensor(folder):
        state = read_folder(folder)
        state.pop("esm.encoder.layer.1.output.dense.bias")
        state["classifier.weight"] = torch.zeros(2, 2)
        (folder / "model.safetensors").unlink()
        save_file(state, str(folder / "model.safetensors"))

    def edit_config(**fields):
        def edit(folder):
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(config | fields))

        return edit

    cases = {
        "missing": (drop_tensor, ["Missing (1): esm.encoder.layer.1.output.dense.bias", "classifier.weight"]),
        "bert": (edit_config(model_type="bert"), ["not an ESM-2 checkpoint", "'bert'"]),
        "shape": (edit_config(intermediate_size=96), ["intermediate_size=96", "expected [96, 32]"]),
    }
    for name, (edit, messages) in cases.items():
        status, _, err = run(capsys, "hf-to-te", broken_copy(name, edit), tmp_path / f"out_{name}")
        assert status == 1 and all(message in err for message in messages), (name, err)
        assert not (tmp_path / f"out_{name}").exists()
    status, _, err = run(capsys, "te-to-hf", tiny_source, tmp_path / "out_direction")
    assert status == 1 and "not an NVEsm checkpoint" in err

    def unreachable(*args, **kwargs):
        raise OSError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    status, _, err = run(capsys, "hf-to-te", "facebook/esm2_t99_does_not_exist", tmp_path / "out_hub")
    assert status == 1 and "Hub repository that can be reached" in err and "Failed to resolve" in err


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data))


def sharded_copy(folder: Path) -> Path:
    """tiny-shaped random checkpoint in 3 shards with an index."""
    model = make_hf_model("tiny", seed=9)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    return save_hf(model, folder, shard=nbytes // 3)


def edit_index(edit):
    def apply(tmp_path: Path) -> Path:
        source = sharded_copy(tmp_path / "src")
        index = source / "model.safetensors.index.json"
        edit(index, json.loads(index.read_text()))
        return source

    return apply


def leave_the_folder(absolute: bool):
    def edit(index: Path, data: dict) -> None:
        shard = sorted(set(data["weight_map"].values()))[0]
        outside = index.parent.parent / "elsewhere"
        outside.mkdir()
        (index.parent / shard).rename(outside / shard)
        target = str(outside / shard) if absolute else f"../elsewhere/{shard}"
        data["weight_map"] = {key: target if value == shard else value for key, value in data["weight_map"].items()}
        write_json(index, data)

    return edit


def float64_source(tmp_path: Path) -> Path:
    make_hf_model("tiny", seed=10).double().save_pretrained(tmp_path / "src")
    write_esm_tokenizer(tmp_path / "src", remote_code=False)
    return tmp_path / "src"


def fair_esm_file(edit):
    def apply(tmp_path: Path) -> Path:
        path = tmp_path / "esm2_t2_random_UR50D.pt"
        write_fair_esm_checkpoint(make_hf_model("tiny", seed=22), path, regression_beside=True)
        edit(path)
        return path

    return apply


def cfg_without_model(path: Path) -> None:
    data = torch.load(path, weights_only=False)
    torch.save({"model": data["model"], "cfg": {"optimizer": {}}}, path)


def regression_without_model(path: Path) -> None:
    regression = path.with_name(path.stem + "-contact-regression.pt")
    torch.save({"state": torch.load(regression)["model"]}, regression)


def copy_with(name: str, text: str):
    def apply(tmp_path: Path) -> Path:
        source = sharded_copy(tmp_path / "src")
        (source / name).write_text(text)
        return source

    return apply


@pytest.mark.parametrize(
    "make_source,extra,needles",
    [
        (float64_source, VERIFY_CPU, ["float64", "--dtype float32"]),
        (edit_index(lambda index, data: write_json(index, {"metadata": {}})), (), ["index.json", "weight_map"]),
        (edit_index(lambda index, data: index.write_text("{not json")), (), ["index.json", "not valid JSON"]),
        (edit_index(leave_the_folder(absolute=False)), (), ["index.json", "../elsewhere/model-", "refused"]),
        (edit_index(leave_the_folder(absolute=True)), (), ["index.json", "elsewhere/model-", "refused"]),
        (fair_esm_file(cfg_without_model), (), ["esm2_t2_random_UR50D.pt", "'model'"]),
        (fair_esm_file(regression_without_model), (), ["esm2_t2_random_UR50D-contact-regression.pt", "'model'"]),
        (copy_with("config.json", '{"model_type": "esm",'), (), ["config.json", "not valid JSON"]),
        (copy_with("vocab.txt", "\n".join(ESM_VOCAB * 2)), (), ["vocab.txt", "vocab_size 33"]),
        (copy_with("tokenizer_config.json", '{"mask_token": "<MASK>"}'), (), ["tokenizer_config.json", "<MASK>"]),
    ],
    ids=[
        "float64-verify",
        "index-without-weight-map",
        "index-not-json",
        "index-shard-outside",
        "index-shard-absolute",
        "fair-esm-cfg-without-model",
        "regression-without-model",
        "config-not-json",
        "vocab-too-long",
        "unknown-special-token",
    ],  # fmt: skip
)
def test_malformed_sources_get_a_one_line_error_naming_the_file(tmp_path, capsys, make_source, extra, needles):
    source = make_source(tmp_path)
    capsys.readouterr()  # transformers' progress bars while saving the source
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "te", *extra)
    assert status == 1 and err.startswith("nv-esm convert: error: ") and err.count("\n") == 1, err
    assert all(needle in err for needle in needles), err
    assert not (tmp_path / "te").exists() and not list(tmp_path.glob(".te.*"))


@pytest.mark.parametrize("direction", ["hf-to-te", "te-to-hf"])
def test_source_tokenizer_files_cannot_bring_remote_code(tmp_path, capsys, tiny_source, direction):
    source = tmp_path / "src"
    if direction == "hf-to-te":
        shutil.copytree(tiny_source, source)
    else:
        assert run(capsys, "hf-to-te", tiny_source, source)[0] == 0
    elsewhere = ["attacker/esm2--tokenization_evil.EvilTokenizer", None]
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    injected = {"auto_map": {"AutoTokenizer": elsewhere}, "tokenizer_class": "EvilTokenizer", "extra": 1}
    write_json(source / "tokenizer_config.json", tokenizer_config | injected)
    write_json(source / "special_tokens_map.json", {"mask_token": {"content": "<mask>"}, "auto_map": elsewhere})
    config = json.loads((source / "config.json").read_text())
    write_json(source / "config.json", config | {"auto_map": {"AutoTokenizer": elsewhere}, "extra": 1})
    status, _, err = run(capsys, direction, source, tmp_path / "out")
    assert status == 0, err
    written = {path.name: json.loads(path.read_text()) for path in (tmp_path / "out").glob("*.json")}
    assert set(written) == {"config.json", "tokenizer_config.json"}
    assert written["config.json"].get("auto_map") == (hub_folder.AUTO_MAP if direction == "hf-to-te" else None)
    assert "extra" not in written["config.json"]
    to_nv = direction == "hf-to-te"
    tokenizer_keys = {"added_tokens_decoder", "backend", "model_max_length", "tokenizer_class"}
    tokenizer_keys |= {"auto_map"} if to_nv else set()  # the output's own tokenizer code, never the source's
    assert set(written["tokenizer_config.json"]) == tokenizer_keys | set(hub_folder.SPECIAL_TOKENS)
    assert written["tokenizer_config.json"].get("auto_map") == (hub_folder.TOKENIZER_AUTO_MAP if to_nv else None)
    class_name = "NVEsmTokenizer" if to_nv else "EsmTokenizer"
    assert written["tokenizer_config.json"]["tokenizer_class"] == class_name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert type(tokenizer).__name__ == class_name
    reference = AutoTokenizer.from_pretrained(TINY_CHECKPOINT)
    assert tokenizer(GFP + "<mask>")["input_ids"] == reference(GFP + "<mask>")["input_ids"]


STALLED_CONVERSION = """
import sys, time
import convert_checkpoint
from nv_esm import checkpoint_io

def stall(self, name, tensor):
    print("writing", flush=True)
    time.sleep(300)

checkpoint_io.SafetensorsWriter.write = stall
sys.exit(convert_checkpoint.main(["hf-to-te", {source!r}, {out!r}]))
"""


def start_stalled_conversion(source: Path, out: Path) -> subprocess.Popen:
    """A conversion in another process that stops at its first tensor."""
    script = STALLED_CONVERSION.format(source=str(source), out=str(out))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until_writing(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    assert line == "writing\n", process.stderr.read()


def test_sigterm_removes_the_staging_folder(tmp_path, tiny_source):
    process = start_stalled_conversion(tiny_source, tmp_path / "te")
    wait_until_writing(process)
    assert len(list(tmp_path.glob(".te.partial-*"))) == 1
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and "interrupted (SIGTERM)" in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_run_removes_staging_folders_of_dead_runs_only(tmp_path, capsys, tiny_source):
    killed, live = (start_stalled_conversion(tiny_source, tmp_path / name) for name in ("killed", "live"))
    try:
        wait_until_writing(killed)
        wait_until_writing(live)
        killed.kill()  # kill -9: nothing runs in the process
        killed.communicate(timeout=60)
        assert len(list(tmp_path.glob(".killed.partial-*"))) == 1
        status, _, err = run(capsys, "hf-to-te", tiny_source, tmp_path / "te")
        assert status == 0 and "left by an interrupted run" in err
        names = sorted(path.name for path in tmp_path.iterdir())
        assert len(names) == 2 and names[0].startswith(".live.partial-") and names[1] == "te"
    finally:
        for process in (killed, live):
            process.kill()
            process.communicate(timeout=60)
