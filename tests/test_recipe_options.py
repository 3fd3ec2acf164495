"""`nv-esm train`'s options at their edges: the record rules of embed and score (`--invalid`,
`--strip-stop`), `--resume` with the options of the run record and its refusals made before the model loads, the
bounds of `--stop-at-step`, `--seed` and `--tokens-per-batch`, and one-line errors for bad files. Single-process runs
(`python -m nv_esm.train`, a world of one)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from test_recipe_data import assert_same_batches, random_sequences, write_fasta
from test_recipe_edges import one_line_error, records, train
from test_recipe_train import DEMO_FASTA, mlm_args, train_here

from modeling_nv_esm_layers import transformer_engine_available
from nv_esm.data import ClassificationStream, MLMStream, read_labelled_csv
from nv_esm.records import RecordRules
from nv_esm.train.config import build_parser, option_values, parse_config
from nv_esm.train.materialize import activation_bytes_per_token, model_config

BAD_LETTERS = "J*1#-"


def with_bad_records(sequences: list[str], seed: int) -> tuple[list[str], list[int]]:
    """`sequences` with a stop mark on some, and bad records (a letter outside the alphabet, or none) inserted at
    random places; the 1-based numbers of the bad records."""
    rng = random.Random(seed)
    mixed = [s + "*" if rng.random() < 0.3 else s for s in sequences]
    for _ in range(rng.randint(2, 5)):
        position = rng.randrange(len(mixed) + 1)
        good = rng.choice(sequences)
        cut = rng.randrange(len(good))
        mixed.insert(position, rng.choice(["", good[:cut] + rng.choice(BAD_LETTERS) + good[cut:]]))
    numbers = [index + 1 for index, s in enumerate(mixed) if s.rstrip("*") not in sequences]
    return mixed, numbers


def write_records(path: Path, sequences: list[str]) -> Path:
    path.write_text("".join(f">r{index}\n{sequence}\n" for index, sequence in enumerate(sequences)))
    return path


# --------------------------------------------------------------------------------------------------------------
# Record rules
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skipped_and_stripped_records_read_as_the_clean_file(tmp_path: Path, seed: int) -> None:
    """--strip-stop --invalid skip reads a file with stop marks and bad records as the file without them (the
    same batches: a record left out takes no index), and lists every bad record; without skip one error names every
    bad record of the file (a stop mark is one without --strip-stop) and the options that would take them."""
    sequences = random_sequences(30, seed=seed)
    mixed, bad = with_bad_records(sequences, seed)
    clean = write_fasta(tmp_path / "clean.fasta", sequences)
    dirty = write_records(tmp_path / "dirty.fasta", mixed)
    common = dict(stream_index=1, num_streams=2, token_budget=200, max_length=40, seed=seed)
    reference = MLMStream(clean, **common)
    skipping = MLMStream(dirty, **common, rules=RecordRules("skip", strip_stop=True))
    assert_same_batches([next(reference) for _ in range(6)], [next(skipping) for _ in range(6)])
    assert [problem.split(":")[0] for problem in skipping.skipped] == [f"{dirty}, record {n}" for n in bad]
    assert skipping.file_counts == [len(sequences)]
    message = rf"dirty.fasta: {len(bad)} bad records \(--invalid skip leaves them out\):"
    with pytest.raises(ValueError, match=message) as raised:
        MLMStream(dirty, **common, rules=RecordRules(strip_stop=True))
    assert [line.split(":")[0] for line in str(raised.value).splitlines()[1:]] == [f"  record {n}" for n in bad]
    stops = [index + 1 for index, sequence in enumerate(mixed) if sequence.endswith("*")]
    with pytest.raises(ValueError, match=r"--strip-stop") as raised:  # the stop marks are bad records too
        MLMStream(dirty, **common)
    listed = [int(line.split(":")[0].removeprefix("  record ")) for line in str(raised.value).splitlines()[1:]]
    assert listed == sorted({*bad, *stops})


def test_labelled_csv_rows_follow_the_record_rules(tmp_path: Path) -> None:
    rng = random.Random(5)
    sequences = random_sequences(12, seed=5)
    labels = [rng.randrange(3) for _ in sequences]
    rows = [f"{s}*,{label}" if i % 2 else f"{s.lower()},{label}" for i, (s, label) in enumerate(zip(sequences, labels))]
    rows.insert(4, "MKJL,1")
    rows.insert(9, ",2")
    path = tmp_path / "labelled.csv"
    path.write_text("sequence,label\n" + "\n".join(rows) + "\n")
    skipped: list[str] = []
    read = read_labelled_csv(path, "sequence", RecordRules("skip", strip_stop=True), skipped)
    assert read == (sequences, labels, None)
    assert [problem.split(":")[0] for problem in skipped] == [f"{path}, row 5 (line 6)", f"{path}, row 10 (line 11)"]
    with pytest.raises(ValueError, match=r"row 2 \(line 3\): .*'\*'.*--strip-stop"):
        read_labelled_csv(path, "sequence")
    stream = ClassificationStream(path, "sequence", 0, 1, 400, 100, rules=RecordRules("skip", strip_stop=True))
    assert len(stream) == len(sequences) and len(stream.skipped) == 2


@pytest.mark.slow
def test_train_offers_the_record_rules_of_embed_and_score(tmp_path: Path, tiny_config: Path) -> None:
    """The '*' error names --strip-stop, which train now takes; with --invalid skip the bad records are left out
    and counted in one warning."""
    sequences = random_sequences(40, seed=3)
    mixed, bad = with_bad_records(sequences, seed=3)
    data = write_records(tmp_path / "with_stop.fasta", mixed)
    args = mlm_args(tiny_config, 2, "--data", str(data), "--no-export")
    done = train(*args, out=tmp_path / "bad")
    first, *listed = done.stderr.strip().splitlines()  # every bad record (a stop mark is one) in one error
    count = len({*bad, *(index + 1 for index, sequence in enumerate(mixed) if sequence.endswith("*"))})
    assert done.returncode == 1 and first.startswith("nv-esm train: error: ") and "with_stop.fasta: " in first
    assert f"{count} bad records" in first and len(listed) == min(count, 20) + (count > 20), done.stderr
    assert "--strip-stop" in done.stderr or "--invalid skip" in done.stderr
    for option in ("--strip-stop", "--invalid"):
        assert option in build_parser().format_help()
    done = train(*args, "--strip-stop", "--invalid", "skip", out=tmp_path / "good")
    assert done.returncode == 0, done.stderr[-3000:]
    warning = next(line for line in done.stderr.splitlines() if "--invalid skip" in line)
    assert warning.startswith(f"warning: --invalid skip left {len(bad)} records of --data out: ")


def test_bad_data_files_are_named_in_one_line(tmp_path: Path, tiny_config: Path) -> None:
    latin1 = tmp_path / "latin1.fasta"
    latin1.write_bytes(b">a\nMKV\n>b caf\xe9\nMKL\n")
    not_parquet = tmp_path / "data.parquet"
    not_parquet.write_text(">a\nMKV\n")
    numbers = tmp_path / "numbers.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"sequence": [1, 2, 3]}), numbers)
    cases = [
        (latin1, "latin1.fasta, line 3: not UTF-8 text"),
        (not_parquet, "data.parquet: not a readable parquet file"),
        (numbers, "numbers.parquet: row 0 of column 'sequence' is a int, not text"),
    ]
    for index, (path, needle) in enumerate(cases):
        one_line_error(train_here(*mlm_args(tiny_config, 2, "--data", str(path)), out=tmp_path / f"run{index}"), needle)


# --------------------------------------------------------------------------------------------------------------
# --resume with the run record
# --------------------------------------------------------------------------------------------------------------


def test_the_options_a_run_records_parse_back_to_its_config() -> None:
    rng = random.Random(11)
    argv = ["--model", "m", "--data", "a.fasta", "b.parquet", "--steps", str(rng.randint(5, 99)), "--out", "o"]
    argv += ["--lr", str(rng.random()), "--betas", str(rng.random()), str(rng.random()), "--no-export"]
    argv += ["--max-length", str(rng.randint(10, 500)), "--strip-stop", "--lora-rank", "4", "--no-cuda-graphs"]
    argv += ["--stop-at-step", "3", "--seed", str(rng.randrange(2**32))]
    config = parse_config(argv)
    recorded = json.loads(json.dumps(option_values(config)))  # as train_state.json holds it
    recorded = {dest: value for dest, value in recorded.items() if dest not in ("out", "resume", "stop_at_step")}
    resumed = parse_config(["--out", "o", "--resume"], recorded=recorded)
    checkpoint = dataclasses.replace(config.checkpoint, resume=True, stop_at_step=None)
    assert resumed == dataclasses.replace(config, checkpoint=checkpoint)
    changed = parse_config(["--out", "o", "--resume", "--config", "c.json", "--steps", "200"], recorded=recorded)
    assert (changed.model.init_from, changed.model.config_file, changed.optimizer.steps) == (None, "c.json", 200)


@pytest.mark.slow
def test_resume_alone_takes_the_recorded_options(tmp_path: Path, tiny_config: Path) -> None:
    """`--out OUT --resume` continues with the options the run was started with (non-default --lr, --seed,
    --max-length, --strip-stop...): its steps are the unbroken run's."""
    data = write_records(tmp_path / "stops.fasta", [s + "*" for s in random_sequences(60, seed=4)])
    args = ["--config", str(tiny_config), "--data", str(data), "--steps", "3", "--tokens-per-batch", "700"]
    args += ["--max-length", "100", "--lr", "2e-3", "--seed", "9", "--strip-stop", "--no-export", "--log-every", "1"]
    assert train(*args, out=tmp_path / "whole").returncode == 0
    assert train(*args, "--stop-at-step", "1", out=tmp_path / "cut").returncode == 0
    done = train("--resume", out=tmp_path / "cut")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["step"], r["loss"]) for r in records(tmp_path / "cut")] == [
        (r["step"], r["loss"]) for r in records(tmp_path / "whole")
    ]


@pytest.fixture
def stopped_run(tmp_path: Path, nv_tiny: Path) -> tuple[list[str], Path, Path]:
    """A run from a copy of the converted tiny checkpoint stopped after step 1, whose weights file is then broken:
    a resume that loads the model fails on it, so a refusal naming an option was made before."""
    model = Path(shutil.copytree(nv_tiny, tmp_path / "model"))
    data = tmp_path / "data.fasta"
    shutil.copyfile(DEMO_FASTA, data)
    args = ["--model", str(model), "--data", str(data), "--steps", "3", "--tokens-per-batch", "1024", "--max-length"]
    args += ["254", "--no-export"]
    out = tmp_path / "run"
    done = train(*args, "--stop-at-step", "1", out=out)
    assert done.returncode == 0, done.stderr[-3000:]
    (model / "model.safetensors").write_bytes(b"not safetensors")
    return args, out, data


@pytest.mark.slow
def test_a_resume_refuses_what_it_cannot_honour_before_the_model_loads(stopped_run, tiny_config: Path) -> None:
    args, out, data = stopped_run
    step = out / "checkpoints" / "step_0000001"
    cases = [
        (["--lr", "1e-3"], "--lr 0.0004 -> 0.001"),
        (["--weight-decay", "0.5"], "--weight-decay 0.01 -> 0.5"),
        (["--betas", "0.8", "0.9"], "--betas [0.9, 0.98] -> [0.8, 0.9]"),
        (["--strip-stop"], "--strip-stop False -> True"),
        (["--lora-rank", "2"], "holds no LoRA adapters"),
        (["--config", str(tiny_config)], "another architecture"),
        (["--stop-at-step", "1"], "--stop-at-step 1: "),
    ]
    for extra, needle in cases:
        one_line_error(train_here("--resume", *extra, out=out), needle)
    one_line_error(train_here(*args, "--resume", "--lr", "1e-3", out=out), "--lr 0.0004 -> 0.001")  # all retyped
    with data.open("a") as file:  # the same path, other contents
        file.write(">added\nMKTAYIAKQR\n")
    one_line_error(train_here("--resume", out=out), f"--data {data} is not the file step_0000001 was trained on")
    state = json.loads((step / "train_state.json").read_text())
    del state["world_size"]
    (step / "train_state.json").write_text(json.dumps(state))
    sums = json.loads((step / "checksums.json").read_text())  # written so: the checksums hold
    sums["train_state.json"] = hashlib.sha256((step / "train_state.json").read_bytes()).hexdigest()
    (step / "checksums.json").write_text(json.dumps(sums))
    one_line_error(train_here("--resume", out=out), "train_state.json has no world_size")


# --------------------------------------------------------------------------------------------------------------
# Bounds of values, and config files
# --------------------------------------------------------------------------------------------------------------


def test_stop_at_step_seed_and_token_budget_are_bounded(tmp_path: Path, tiny_config: Path) -> None:
    cases = [
        (["--stop-at-step", "0"], "--stop-at-step must be at least 1"),
        (["--stop-at-step", "-1"], "--stop-at-step must be at least 1"),
        (["--seed", str(10**23)], "--seed must be in [0, 2**32)"),
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--tokens-per-batch", "10000000000000"], "--tokens-per-batch must be at most 2**31 - 1"),
    ]
    for index, (extra, needle) in enumerate(cases):
        one_line_error(train_here(*mlm_args(tiny_config, 2, *extra), out=tmp_path / f"run{index}"), needle)
    done = train_here(*mlm_args(tiny_config, 2, "--seed", "1e23"), out=tmp_path / "float-seed")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "argument --seed: invalid int value: '1e23'" in lines[0]


def independent_bytes_per_token(fields: dict, itemsize: int) -> int:
    h, i, layers, vocab = (fields[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    return layers * (7 * h + 2 * i) * itemsize + 3 * vocab * 4


def test_a_token_budget_beyond_the_memory_is_refused_before_the_model_loads(tmp_path: Path, tiny_config) -> None:
    rng = random.Random(8)
    for _ in range(5):
        fields = {"hidden_size": 16 * rng.randint(1, 40), "num_hidden_layers": rng.randint(1, 40), "vocab_size": 33}
        fields.update(num_attention_heads=8, intermediate_size=4 * fields["hidden_size"])
        path = tmp_path / "config.json"
        path.write_text(json.dumps(fields))
        config = parse_config(["--config", str(path), "--data", "d", "--steps", "1", "--out", "o"])
        nv_config = model_config(config.model, {}, torch.device("cpu"), config.data.max_length)
        assert activation_bytes_per_token(config, nv_config, torch.device("cpu")) == independent_bytes_per_token(
            fields, 4
        )
    tiny = json.loads(Path(tiny_config).read_text())
    if torch.cuda.is_available():  # the run trains on the GPU, in bf16
        memory, itemsize = torch.cuda.get_device_properties(0).total_memory, 2
    else:
        memory, itemsize = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 4
    budget = memory // independent_bytes_per_token(tiny, itemsize) + 1
    done = train_here(*mlm_args(tiny_config, 2, "--tokens-per-batch", str(budget)), out=tmp_path / "big")
    one_line_error(done, f"--tokens-per-batch {budget}: a micro-batch keeps at least")


def test_a_config_number_written_as_a_string_is_one_line(tmp_path: Path, tiny_config: Path) -> None:
    fields = json.loads(Path(tiny_config).read_text())
    for name in ("hidden_size", "num_hidden_layers"):
        written = {**fields, name: str(fields[name])}
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(written))
        # --fp8 all without Transformer Engine on a GPU is refused first (test_option_vocabulary's fp8 test).
        fp8_runs = torch.cuda.is_available() and transformer_engine_available()
        for fp8 in ((), ("--fp8", "all", "--backend", "te")) if fp8_runs else ((),):
            done = train_here("--config", path, "--data", DEMO_FASTA, "--steps", "2", *fp8, out=tmp_path / "run")
            one_line_error(done, f"{path}: {name} must be a positive integer, got '{written[name]}'")
