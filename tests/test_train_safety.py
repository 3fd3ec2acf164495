"""The trainer keeps what it is given and writes only where it is told (issue 61): `train export` never deletes the
checkpoint it reads nor a user's files, reads no tensor from outside a checkpoint and follows the umask; `nv-esm
train` refuses a run folder holding an earlier run's outputs or links among its own, an input inside its run folder
and a `--model` whose config disagrees with its weights, and `--resume` names the options it changes.

Every check runs in this process: export on a small DCP checkpoint written here (`training_checkpoint`), training
refusals through `train_here` (they come before the first step), the guards as functions."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from test_recipe_edges import one_line_error, train
from test_recipe_train import DEMO_FASTA, mlm_args, train_here

from nv_esm.hub_folder import HUB_FOLDER_FILES
from nv_esm.train import loop
from nv_esm.train.checkpoint import CheckpointReader, earlier_outputs, prepare_out
from nv_esm.train.config import ModelConfig, option_values, parse_config
from nv_esm.train.export import export
from nv_esm.train.materialize import MODEL_CLASSES, model_config
from nv_esm.train.metrics import open_log
from nv_esm.train.parallel import Dist
from nv_esm.train.resume import NOT_RECORDED, check_resume, resume_settings

CPU_WORLD = Dist(rank=0, world_size=1, device=torch.device("cpu"), mesh=None)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_checksums(folder: Path) -> None:
    """checksums.json of every other file of checkpoint `folder`, as `save_checkpoint` writes it."""
    sums = {p.name: sha256(p) for p in folder.iterdir() if p.is_file() and p.name != "checksums.json"}
    (folder / "checksums.json").write_text(json.dumps(sums, indent=1, sort_keys=True))


def training_checkpoint(folder: Path, config_file: Path, *extra: str) -> Path:
    """A training checkpoint as `save_checkpoint` lays it out (DCP files of a fresh tiny model, train_state.json
    recording the run of `mlm_args(config_file, 2, *extra)` at step 1, checksums.json), written in this process."""
    import torch.distributed.checkpoint as dcp

    config = parse_config(["--out", str(folder.parents[1]), *mlm_args(config_file, 2, "--backend", "torch", *extra)])
    nv_config = model_config(config.model, {}, torch.device("cpu"), config.data.max_length)
    model = MODEL_CLASSES["mlm"](nv_config)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder, no_dist=True)
    run = dict(
        config=nv_config.to_dict(),
        lora=None,
        start="scratch",
        settings=resume_settings(config),
        options={k: v for k, v in option_values(config).items() if k not in NOT_RECORDED},
    )
    state = {"step": 1, "world_size": 1, "tp": 1, "cp": 1, "data": [{}], "run": run}
    (folder / "train_state.json").write_text(json.dumps(state, indent=1))
    write_checksums(folder)
    return folder


@pytest.fixture
def step(tmp_path: Path, tiny_config: Path) -> Path:
    """run/checkpoints/step_0000001 of a run folder in `tmp_path`."""
    folder = tmp_path / "run" / "checkpoints" / "step_0000001"
    folder.mkdir(parents=True)
    return training_checkpoint(folder, tiny_config)


def export_here(*args: object) -> tuple[int, str]:
    """`nv-esm train export ARGS` in this process: its exit status and stderr."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = loop.main(["export", *map(str, args)])
        except SystemExit as exit_:
            status = exit_.code
    return status, stderr.getvalue()


def contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------------------
# train export
# --------------------------------------------------------------------------------------------------------------


def test_export_refuses_to_write_over_into_or_around_its_checkpoint(step: Path) -> None:
    """`train export STEP STEP --force` (and into the run folder or its checkpoints folder) deleted the checkpoint."""
    before = contents(step)
    run = step.parents[1]
    for out in (step, run, run / "checkpoints", step / "hub"):
        status, stderr = export_here(step, out, "--overwrite")
        assert status == 1 and len(stderr.strip().splitlines()) == 1, stderr
        assert "never writes over, into or around what it reads" in stderr and str(step) in stderr, stderr
        assert contents(step) == before, out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [step.name]


def test_export_force_replaces_an_earlier_export_only(step: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    assert export_here(step, hub)[0] == 0
    assert {p.name for p in hub.iterdir()} <= HUB_FOLDER_FILES  # what --force may replace covers what an export writes
    assert export_here(step, hub, "--overwrite")[0] == 0
    (hub / "notes.txt").write_text("mine")
    mine = tmp_path / "mine"
    (mine / "data").mkdir(parents=True)
    (mine / "data" / "x.csv").write_text("a,b\n")
    for out, needle in ((hub, "(notes.txt)"), (mine, "(data)")):
        status, stderr = export_here(step, out, "--overwrite")
        assert status == 1 and len(stderr.strip().splitlines()) == 1, stderr
        assert "no model folder write makes" in stderr and needle in stderr, stderr
    assert (hub / "notes.txt").read_text() == "mine" and (mine / "data" / "x.csv").read_text() == "a,b\n"


def test_export_follows_the_umask(step: Path, tmp_path: Path) -> None:
    """Exported files were made 644 (folder 755) whatever the umask; `copy_remote_code` (shutil.copy2) copies the
    installed files' 644 too."""
    previous = os.umask(0o077)
    try:
        export(step, tmp_path / "hub")
    finally:
        os.umask(previous)
    files = [p for p in (tmp_path / "hub").iterdir()]
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}
    assert oct((tmp_path / "hub").stat().st_mode & 0o777) == "0o700"


def test_a_checkpoint_whose_metadata_names_files_outside_it_is_refused(step: Path, tmp_path: Path) -> None:
    """DCP's `.metadata` names the file of each tensor; `../` made `train export` read tensors from outside the
    checkpoint, which its checksums do not cover."""
    metadata = pickle.loads((step / ".metadata").read_bytes())  # written by this test: trusted
    for name in {info.relative_path for info in metadata.storage_data.values()}:
        shutil.copyfile(step / name, step.parent / name)
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=f"../{info.relative_path}")
        for index, info in metadata.storage_data.items()
    }
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    write_checksums(step)
    with pytest.raises(ValueError, match=r"'\.\./__0_0\.distcp' is not a file name inside"):
        CheckpointReader(step).read_metadata()
    status, stderr = export_here(step, tmp_path / "hub")
    assert status == 1 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"{step} is damaged" in stderr and "'../__0_0.distcp' is not a file name inside" in stderr, stderr
    assert not (tmp_path / "hub").exists()


# --------------------------------------------------------------------------------------------------------------
# nv-esm train: the run folder
# --------------------------------------------------------------------------------------------------------------


def test_a_new_run_keeps_an_earlier_runs_final_and_metrics(tmp_path: Path, tiny_config: Path) -> None:
    """A new run into a folder holding an earlier run's final/ replaced it at its end, and appended its metrics to
    the earlier run's metrics.jsonl (steps 1, 2, 1, 2 in one log and one plot)."""
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"the earlier run's weights")
    one_line_error(train_here(*mlm_args(tiny_config, 2), out=out), "holds an earlier run's final, which a new run")
    shutil.rmtree(out / "final")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    one_line_error(train_here(*mlm_args(tiny_config, 2, "--no-export"), out=out), "earlier run's metrics.jsonl")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'


def test_a_model_or_data_inside_the_run_folder_is_refused(tmp_path: Path, tiny_config: Path, nv_tiny: Path) -> None:
    """`--model OUT/final` was the model the run's export replaced at its end."""
    out = tmp_path / "run"
    model = Path(shutil.copytree(nv_tiny, out / "final"))
    before = contents(model)
    args = ["--model", str(model), "--data", str(DEMO_FASTA), "--steps", "2", "--tokens-per-batch", "1024"]
    one_line_error(train_here(*args, out=out), f"--out {out} contains --model {model}")
    one_line_error(train_here(*args, out=model), f"--out {model} is --model {model}")
    (tmp_path / "data").mkdir()
    data = shutil.copyfile(DEMO_FASTA, tmp_path / "data" / "demo.fasta")
    one_line_error(train_here(*mlm_args(tiny_config, 2, "--data", data), out=tmp_path / "data"), "contains --data")
    assert contents(model) == before


def test_a_resume_keeps_the_runs_earlier_export(tmp_path: Path) -> None:
    """A resumed run replaced OUT/final at its end: refused before the run starts, unless it does not export."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_0000002").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "final" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds the run's earlier export.*or pass --no-export"):
        prepare_out(out, True, CPU_WORLD, export=True)
    assert earlier_outputs(out) == ["checkpoints", "final"]
    (out / "metrics.jsonl").touch()  # empty: nothing of an earlier run
    (out / "profile").mkdir()
    assert earlier_outputs(out) == ["checkpoints", "final"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoints", "tensorboard", "profile", "final"])
def test_links_among_the_run_outputs_are_refused(tmp_path: Path, tiny_config: Path, name: str) -> None:
    """A link planted at OUT/metrics.jsonl, OUT/checkpoints, ... made the run write outside OUT."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "file" if name == "metrics.jsonl" else outside
    if name == "metrics.jsonl":
        target.touch()
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(target)
    one_line_error(train_here(*mlm_args(tiny_config, 2, "--log-every", "1"), out=out), f"{out / name} (OUT/{name})")
    assert [p.name for p in outside.iterdir()] == (["file"] if name == "metrics.jsonl" else [])
    assert not (outside / "file").exists() or (outside / "file").stat().st_size == 0


def test_the_metrics_log_and_profile_traces_are_not_written_through_links(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "metrics.jsonl").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match="metrics.jsonl \\(the run's log\\) is a link"):
        open_log(tmp_path / "metrics.jsonl")
    with open_log(tmp_path / "new.jsonl") as file:
        file.write("{}\n")
    assert (tmp_path / "new.jsonl").read_text() == "{}\n"
    from nv_esm.train.metrics import StepProfiler

    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.json.gz").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match="rank0.json.gz \\(the profile trace\\) is a link"):
        StepProfiler(tmp_path, 2, 1, CPU_WORLD)


# --------------------------------------------------------------------------------------------------------------
# --resume, and --model checkpoints
# --------------------------------------------------------------------------------------------------------------


def test_resume_names_the_options_it_changes(tmp_path: Path, tiny_config: Path, capsys) -> None:
    """`--resume --clip-grad 0.5` ran on without saying that the run's --clip-grad 1.0 changed."""
    folder = tmp_path / "run" / "checkpoints" / "step_0000001"
    folder.mkdir(parents=True)
    recorded = json.loads((training_checkpoint(folder, tiny_config) / "train_state.json").read_text())["run"]
    argv = ["--out", str(tmp_path / "run"), "--resume", "--clip-grad", "0.5", "--log-every", "1", "--steps", "4"]
    config = parse_config(argv, recorded=recorded["options"])
    assert check_resume(folder, config, resume_settings(config), CPU_WORLD) == 1
    line = capsys.readouterr().out.strip()
    assert line == (
        "--resume from step_0000001 with changed options: --steps 2 -> 4, --clip-grad 1.0 -> 0.5, "
        "--log-every 10 -> 1 (from step 2 on)."
    )
    config = parse_config(["--out", str(tmp_path / "run"), "--resume"], recorded=recorded["options"])
    check_resume(folder, config, resume_settings(config), CPU_WORLD)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_hidden_layers": 1}, "2 tensors have no place in the model of its config (esm.encoder.layers.1."),
        ({"num_attention_heads": 2}, "esm.rotary_embeddings.inv_freq is [8] there, [16] for its config"),
        ({"intermediate_size": 96}, "is [128, 64] there, [96, 64] for its config"),
    ],
)
def test_a_model_whose_config_disagrees_with_its_weights_is_a_one_line_error(
    tmp_path: Path, nv_tiny: Path, change: dict, needle: str
) -> None:
    """It was a rank-0 traceback (`RuntimeError: The size of tensor a ...`), or a model silently cut short."""
    model = Path(shutil.copytree(nv_tiny, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    args = ["--model", str(model), "--data", str(DEMO_FASTA), "--steps", "2", "--tokens-per-batch", "1024"]
    done = train_here(*args, "--max-length", "254", out=tmp_path / "run")
    one_line_error(done, f"{model}: its config.json disagrees with its weights: ")
    assert needle in done.stderr, done.stderr


def test_the_shape_check_passes_a_model_that_agrees(nv_tiny: Path) -> None:
    from nv_esm.train.materialize import CheckpointReader as WeightsReader
    from nv_esm.train.materialize import check_checkpoint_shapes

    settings = ModelConfig(init_from=str(nv_tiny), backend="torch")
    nv_config = model_config(settings, {}, torch.device("cpu"), 256)
    with torch.device("meta"):
        model = MODEL_CLASSES["mlm"](nv_config)
    check_checkpoint_shapes(model, WeightsReader(nv_tiny, nv_config), CPU_WORLD)


@pytest.mark.slow
def test_a_finished_run_keeps_its_export_and_a_resume_says_what_it_changes(tmp_path: Path, tiny_config: Path) -> None:
    """The whole flow in a process: a resume that would replace OUT/final is refused before it starts; one that
    does not export runs, naming its changed options; a new run into the folder is refused."""
    out = tmp_path / "run"
    done = train(*mlm_args(tiny_config, 1), out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    final = contents(out / "final")
    one_line_error(train(*mlm_args(tiny_config, 2, "--resume"), out=out), "holds the run's earlier export")
    done = train("--resume", "--steps", "2", "--no-export", "--clip-grad", "0.5", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--resume from step_0000001 with changed options: --steps 1 -> 2, --clip-grad 1.0 -> 0.5, " in done.stdout
    assert "--no-export False -> True (from step 2 on)." in done.stdout
    assert contents(out / "final") == final
    one_line_error(train(*mlm_args(tiny_config, 2), out=out), "holds checkpoints (step_0000002)")
