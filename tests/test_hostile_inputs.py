"""A folder or a checkpoint is data, never code: hostile inputs are refused or reported, and no code in them runs.

Each test hands a command a folder or checkpoint that someone else could have prepared (a Hub download, a shared
training run) with a payload that, if run, writes a marker file; the marker must not appear. Everything the tests
write stays in their temporary folders.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from convert_helpers import run

# --------------------------------------------------------------------------------------------------------------
# Payloads
# --------------------------------------------------------------------------------------------------------------


def python_payload(marker: Path) -> str:
    """Python source that leaves `marker` behind when it runs."""
    return f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"


class Payload:
    """Unpickling this writes the marker file (pickle calls `__reduce__`'s function with its arguments)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


# --------------------------------------------------------------------------------------------------------------
# verify SRC OUT: OUT is read as data and every file of it is compared
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_source) -> Path:
    """tiny_source converted to NVEsm, untouched (tests change copies of it)."""
    out = tmp_path_factory.mktemp("converted") / "te"
    assert run_quiet("hf-to-te", tiny_source, out) == 0
    return out


def run_quiet(*argv: object) -> int:
    from convert_checkpoint import main

    return main([str(arg) for arg in argv])


def differences(text: str) -> list[str]:
    return [line.split("DIFFERS ", 1)[1] for line in text.splitlines() if "DIFFERS" in line]


def append_code(out: Path, marker: Path) -> None:
    with open(out / "modeling_nv_esm.py", "a") as file:
        file.write(python_payload(marker))


def point_auto_config_elsewhere(out: Path, marker: Path) -> None:
    (out / "evil_mod.py").write_text(python_payload(marker) + "\nfrom configuration_nv_esm import NVEsmConfig\n")
    config = json.loads((out / "config.json").read_text())
    config["auto_map"]["AutoConfig"] = "evil_mod.NVEsmConfig"
    (out / "config.json").write_text(json.dumps(config))


def swap_two_vocabulary_lines(out: Path, marker: Path) -> None:
    lines = (out / "vocab.txt").read_text().splitlines()
    lines[4], lines[5] = lines[5], lines[4]  # L and A
    (out / "vocab.txt").write_text("\n".join(lines) + "\n")


def add_a_link_and_a_folder(out: Path, marker: Path) -> None:
    """(A link out of OUT is refused outright, as for a source folder: see the tests of source folders.)"""
    (out / "notes").mkdir()
    (out / "LICENSE").rename(out / "LICENSE.orig")
    (out / "LICENSE").symlink_to("LICENSE.orig")


@pytest.mark.parametrize(
    "tamper,expected",
    [
        (append_code, ["modeling_nv_esm.py: its bytes differ"]),
        (point_auto_config_elsewhere, ["config.json auto_map:", "evil_mod.py: in OUT, not written by the converter"]),
        (swap_two_vocabulary_lines, ["vocab.txt: its bytes differ"]),
        (add_a_link_and_a_folder, ["LICENSE: a link in OUT", "LICENSE.orig: in OUT, not", "notes: a folder in OUT"]),
    ],
    ids=["code-appended", "auto-map-to-new-module", "vocabulary-swapped", "link-and-folder"],
)
def test_verify_reports_every_tampered_file_and_runs_none_of_its_code(
    tmp_path, capsys, tiny_source, converted, tamper, expected
):
    out = shutil.copytree(converted, tmp_path / "te")
    marker = tmp_path / "marker"
    tamper(out, marker)
    status, text, err = run(capsys, "verify", tiny_source, out, "--verify-device", "cpu")
    assert status == 3 and "verify failed" in err, text + err
    found = differences(text)
    assert len(found) == len(expected) and all(any(e in line for line in found) for e in expected), found
    # The files, not the tensors, differ: the body and the last line say so under their own labels.
    count = f"{len(expected)} difference{'s' * (len(expected) != 1)}"
    assert f"verify failed: files {count}, tensors all identical; logit table PASSED." in err, err
    assert (
        "bit for bit: all identical" in text
        and f"the weights are checked below; a model card is not compared): {count}" in text
    )
    # The weights are untouched: the logits, from SRC's tokenizer, agree; no PASSED before the failure.
    assert "logits agree (files or tensors above differ): " in text and "PASSED" not in text
    assert not marker.exists()


def test_verify_tokenizes_with_the_source_tokenizer(tmp_path, monkeypatch, tiny_source, converted):
    """A changed vocab.txt in OUT would change the token ids of both models alike; the reference ids come from the
    tokenizer made from SRC, so OUT's tokenizer files are never what the check runs on."""
    from transformers import EsmTokenizer

    out = shutil.copytree(converted, tmp_path / "te")
    swap_two_vocabulary_lines(out, tmp_path / "marker")
    folders = []
    real = EsmTokenizer.from_pretrained.__func__

    def recording(cls, folder, *args, **kwargs):
        folders.append(Path(folder))
        return real(cls, folder, *args, **kwargs)

    monkeypatch.setattr(EsmTokenizer, "from_pretrained", classmethod(recording))
    from nv_esm.conversion import verify_folder

    check = verify_folder(tiny_source, out, device="cpu")
    assert folders and out.resolve() not in {folder.resolve() for folder in folders}
    assert check.file_mismatches == ["vocab.txt: its bytes differ from the file the converter writes"]


def test_te_to_hf_output_may_hold_no_code(tmp_path, capsys, converted):
    back = tmp_path / "back"
    assert run(capsys, "te-to-hf", converted, back)[0] == 0
    (back / "modeling_esm.py").write_text(python_payload(tmp_path / "marker"))
    (back / "README.md").write_text("not written by te-to-hf")
    status, text, _ = run(capsys, "verify", converted, back, "--verify-device", "cpu")
    assert status == 3 and not (tmp_path / "marker").exists()
    assert sorted(differences(text)) == [
        "README.md: in OUT, not written by the converter",
        "modeling_esm.py: in OUT, not written by the converter",
    ]


def test_te_to_hf_verify_loads_the_nv_source_as_data(tmp_path, capsys, converted):
    """te-to-hf --verify runs the NVEsm source as the reference: in the installed model class, not its own code."""
    source = shutil.copytree(converted, tmp_path / "te")
    append_code(source, tmp_path / "marker")
    status, _, err = run(capsys, "te-to-hf", source, tmp_path / "back", "--verify", "--verify-device", "cpu")
    assert status == 0, err
    assert not (tmp_path / "marker").exists()


# --------------------------------------------------------------------------------------------------------------
# Source folders: no file from outside, an ESM-2 vocabulary
# --------------------------------------------------------------------------------------------------------------


def test_a_link_out_of_the_source_folder_is_refused(tmp_path, capsys, tiny_source):
    source = shutil.copytree(tiny_source, tmp_path / "src")
    (source / "tokenizer_config.json").unlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("password123\n")
    (source / "vocab.txt").unlink()
    (source / "vocab.txt").symlink_to(secret)
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "te")
    assert status == 1 and err.count("\n") == 1 and "leads out of" in err and "vocab.txt" in err, err
    assert not (tmp_path / "te").exists()


def test_links_inside_the_folder_and_into_the_hub_cache_are_read(tmp_path, capsys, tiny_source):
    """Links that stay in the folder are fine, and so is the Hugging Face cache's layout: a snapshot folder's
    files link to the repository's blobs."""
    repo = tmp_path / "hub" / "models--facebook--esm2_random_tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in tiny_source.iterdir():
        shutil.copy(path, blobs / f"blob_{path.name}")
        (snapshot / path.name).symlink_to(os.path.relpath(blobs / f"blob_{path.name}", snapshot))
    assert run(capsys, "hf-to-te", snapshot, tmp_path / "te")[0] == 0
    local = shutil.copytree(tiny_source, tmp_path / "local")
    (local / "vocab.txt").rename(local / "alphabet.txt")
    (local / "vocab.txt").symlink_to("alphabet.txt")
    assert run(capsys, "hf-to-te", local, tmp_path / "te2")[0] == 0
    assert (tmp_path / "te2" / "vocab.txt").read_text() == (tmp_path / "te" / "vocab.txt").read_text()


@pytest.mark.parametrize(
    "vocabulary,needle",
    [
        (lambda v: [v[0], v[2], v[1], *v[3:]], "line 2 holds '<eos>' where ESM-2 has '<pad>'"),
        (lambda v: ["password123"], "line 1 holds 'password123' where ESM-2 has '<cls>'"),
        (lambda v: v[:-1] + ["<MASK>"], "line 33 holds '<MASK>' where ESM-2 has '<mask>'"),
    ],
    ids=["two-swapped", "one-line", "renamed-token"],
)
def test_a_vocabulary_other_than_esm2s_is_refused(tmp_path, capsys, tiny_source, vocabulary, needle):
    from nv_esm.alphabet import ESM_VOCAB

    source = shutil.copytree(tiny_source, tmp_path / "src")
    (source / "vocab.txt").write_text("\n".join(vocabulary(list(ESM_VOCAB))) + "\n")
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "te")
    assert status == 1 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "te").exists()


# --------------------------------------------------------------------------------------------------------------
# nv-esm embed: the installed model code runs a folder's weights; its own code only when asked
# --------------------------------------------------------------------------------------------------------------


def embed_once(checkpoint: Path, tmp_path: Path, name: str, *extra: str) -> int:
    from nv_esm import embed

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAK\n>b\nMKV\n")
    return embed.main([str(checkpoint), str(fasta), str(tmp_path / name), "--device", "cpu", "--no-progress", *extra])


def test_embed_runs_the_installed_code_on_a_folder_with_changed_code(tmp_path, capsys, converted, modules_cache):
    folder = shutil.copytree(converted, tmp_path / "te")
    marker = tmp_path / "marker"
    append_code(folder, marker)
    assert embed_once(folder, tmp_path, "out") == 0
    err = capsys.readouterr().err
    assert not marker.exists() and "modeling_nv_esm.py differ from this nv-esm's" in err, err
    assert embed_once(folder, tmp_path, "own", "--trust-remote-code") == 0  # asked for: the folder's code runs
    assert marker.exists() and "own model code (modeling_nv_esm.py: --trust-remote-code)" in capsys.readouterr().err
    marker.unlink()
    assert embed_once(converted, tmp_path, "same", "--trust-remote-code") == 0  # nothing differs: installed code
    assert not marker.exists() and "own model code" not in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------
# nv-esm train: --resume and export read a checkpoint as data
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_config) -> Path:
    """A 2-rank run stopped after step 1 of 2: OUT/checkpoints/step_0000001, resumable."""
    from test_recipe_train import mlm_args, run_recipe

    out = tmp_path_factory.mktemp("run") / "run"
    run_recipe(out, *mlm_args(tiny_config, 2, "--stop-at-step", "1", "--no-export"))
    return out


def resume(run: Path, tiny_config: Path):
    from test_recipe_train import mlm_args, run_recipe

    return run_recipe(run, *mlm_args(tiny_config, 2, "--resume", "--no-export"), check=False)


def export(checkpoint: Path, out: Path):
    from test_recipe_train import export_command

    return export_command(str(checkpoint), str(out))


def write_pickle(path: Path, payload: object) -> None:
    import pickle

    path.write_bytes(pickle.dumps(payload))


@pytest.mark.slow
def test_the_rng_state_is_plain_data_and_an_earlier_releases_pickle_is_read_weights_only(
    tmp_path, tiny_config, stopped_run
):
    import torch

    run = shutil.copytree(stopped_run, tmp_path / "run")
    step = run / "checkpoints" / "step_0000001"
    assert sorted(p.name for p in step.glob("rng_rank*")) == ["rng_rank0.safetensors", "rng_rank1.safetensors"]
    marker = tmp_path / "marker"
    (step / "rng_rank0.safetensors").unlink()  # an earlier release's layout (no checksums), with a payload
    (step / "checksums.json").unlink()
    torch.save({"python": Payload(marker)}, step / "rng_rank0.pt")
    done = resume(run, tiny_config)
    assert done.returncode != 0 and not marker.exists()
    assert "rng_rank0.pt holds objects other than RNG states (not read)" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_an_earlier_releases_rng_files_still_resume(tmp_path, tiny_config, stopped_run):
    """Plain RNG states in `rng_rank{r}.pt` (read with weights_only=True) resume as before."""
    import torch
    from safetensors import safe_open

    run = shutil.copytree(stopped_run, tmp_path / "run")
    step = run / "checkpoints" / "step_0000001"
    for rank in (0, 1):
        with safe_open(step / f"rng_rank{rank}.safetensors", "pt") as file:
            state = {key: file.get_tensor(key) for key in file.keys()}
            metadata = file.metadata()
        python = (int(metadata["python_version"]), tuple(state.pop("python").tolist()))
        python += (json.loads(metadata["python_gauss_next"]),)
        torch.save({**state, "python": python}, step / f"rng_rank{rank}.pt")
        (step / f"rng_rank{rank}.safetensors").unlink()
    (step / "checksums.json").unlink()  # an earlier release wrote none
    done = resume(run, tiny_config)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["resume", "export"])
def test_a_payload_in_the_dcp_metadata_is_refused_not_run(tmp_path, tiny_config, stopped_run, command):
    run = shutil.copytree(stopped_run, tmp_path / "run")
    step = run / "checkpoints" / "step_0000001"
    marker = tmp_path / "marker"
    write_pickle(step / ".metadata", Payload(marker))
    done = resume(run, tiny_config) if command == "resume" else export(step, tmp_path / "hub")
    assert done.returncode != 0 and not marker.exists()
    assert "is not a checkpoint's metadata (not read" in done.stderr and "write_text" in done.stderr, done.stderr
    if command == "export":
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "hub").exists()


def test_a_payload_among_the_checkpoints_plain_entries_is_refused_not_run(tmp_path):
    """DCP stores non-tensor entries (the optimizer's settings) with torch.save and loads them with
    weights_only=False; the recipe's planner loads them with weights_only=True."""
    import io
    from types import SimpleNamespace

    import torch

    from nv_esm.train.checkpoint import CheckpointLoadPlanner

    marker = tmp_path / "marker"
    buffer = io.BytesIO()
    torch.save({"lr": 1e-3, "hook": Payload(marker)}, buffer)
    buffer.seek(0)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.lr"))
    with pytest.raises(ValueError, match="optim.param_groups.lr is not plain data"):
        CheckpointLoadPlanner().load_bytes(item, buffer)
    assert not marker.exists()


def test_an_fp8_scaling_file_is_plain_data(tmp_path):
    """`fp8_rank{r}.safetensors` holds tensors and JSON; a file that is not that is refused with its name. (The
    round trip through Transformer Engine is tests/test_gpu.py's.)"""
    from safetensors.torch import save_file
    from torch import nn

    from nv_esm.train.checkpoint import load_fp8_scaling

    path = tmp_path / "fp8_rank0.safetensors"
    write_pickle(path, Payload(tmp_path / "marker"))
    with pytest.raises(ValueError, match="fp8_rank0.safetensors is not this model's FP8 scaling state"):
        load_fp8_scaling(path, nn.Linear(2, 2))
    import torch

    save_file({"other.scale_fwd": torch.ones(1)}, path, metadata={"extra_fp8_variables": '{"other": {}}'})
    with pytest.raises(ValueError, match="its modules are not this model's"):
        load_fp8_scaling(path, nn.Linear(2, 2))
    assert not (tmp_path / "marker").exists()


# --------------------------------------------------------------------------------------------------------------
# The model card says what trust_remote_code runs, and its check and its code-free loading both work
# --------------------------------------------------------------------------------------------------------------


def test_the_model_cards_trust_section_runs_as_written(tmp_path, capsys, tiny_source, converted):
    import re

    import modeling_nv_esm

    card = (converted / "README.md").read_text()
    section = card[card.index("### What `trust_remote_code=True` runs") :]
    assert "run as Python with your permissions" in section
    verify_line = re.search(r"nv-esm convert verify (\S+) \./to_check (.*)", section)
    assert verify_line and verify_line[1] == f"PATH/TO/{tiny_source.name}"  # a local source: the user's own path
    status, text, _ = run(capsys, "verify", tiny_source, converted, *verify_line[2].split("#")[0].split())
    assert status == 0 and "all identical" in text
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    namespace: dict = {}
    exec(code, namespace)  # loads `converted` (the card names the folder it was written to)
    assert type(namespace["model"]) is modeling_nv_esm.NVEsmForMaskedLM
