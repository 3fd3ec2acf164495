"""The pictures the commands write: the curves read from metrics.jsonl, and PNG files that
matplotlib reads back; nothing written, and None returned, without matplotlib."""

from __future__ import annotations

import json
import math
import random
import sys

import numpy as np
import pytest

from nv_esm import plots


def random_metrics(path, seed: int) -> dict[str, dict[int, float]]:
    """A metrics.jsonl as `nv-esm train` writes it, with a resume that redoes steps, a skipped step, a non-finite
    loss and validation records; returns the values each curve must show (the last record of each step)."""
    rng = random.Random(seed)
    expected: dict[str, dict[int, float]] = {"loss": {}, "lr": {}, "tokens_per_s_per_gpu": {}, "val_loss": {}}
    lines = []
    steps = [*range(1, 31), *range(21, 41)]  # resumed from step 20: steps 21-30 logged twice
    for step in steps:
        record = dict(step=step, loss=rng.uniform(1, 3), lr=rng.uniform(0, 1e-3), grad_norm=1.0, tokens=100)
        record.update(tokens_per_s_per_gpu=rng.uniform(1e3, 2e3), interval=[step, step])
        if step == 33:
            record.update(skipped=True)
        if step == 35:
            record["loss"] = math.nan
        lines.append(json.dumps(record))
        for key in ("loss", "lr", "tokens_per_s_per_gpu"):
            if not (key == "loss" and step in (33, 35)):
                expected[key][step] = record[key]
        if step % 10 == 0:
            value = rng.uniform(1, 3)
            lines.append(json.dumps({"step": step, "val_loss": value, "val_accuracy": None}))
            expected["val_loss"][step] = value
    path.write_text("\n".join(lines) + "\n")
    return expected


@pytest.mark.parametrize("seed", range(3))
def test_training_curves_keep_each_steps_last_finite_record(tmp_path, seed):
    expected = random_metrics(tmp_path / "metrics.jsonl", seed)
    curves = plots.training_curves(tmp_path / "metrics.jsonl")
    assert set(curves) == set(expected)
    for key, values in expected.items():
        steps, got = curves[key]
        assert steps == sorted(values) and got == [values[step] for step in sorted(values)], key


def test_the_pictures_are_pngs_matplotlib_reads_back(tmp_path):
    import matplotlib.image

    random_metrics(tmp_path / "metrics.jsonl", 0)
    rng = np.random.default_rng(0)
    contacts = rng.random((30, 30))
    methods = {"a": rng.normal(size=50), "b": rng.normal(size=50)}
    written = [
        plots.plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png"),
        plots.plot_scores(methods, rng.normal(size=50), tmp_path / "a.png"),
        plots.plot_contact_maps([("p1", contacts), ("p2", contacts[:9, :9])], tmp_path / "contacts.png"),
    ]
    for png in written:
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0, png
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.png", "contacts.png", "metrics.jsonl", "metrics.png"]


def test_without_matplotlib_nothing_is_written(tmp_path, monkeypatch):
    random_metrics(tmp_path / "metrics.jsonl", 0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plots.plot_training(tmp_path / "metrics.jsonl", tmp_path / "metrics.png") is None
    assert plots.plot_scores({"x": [1.0]}, [2.0], tmp_path / "scores.png") is None
    assert plots.plot_contact_maps([("p", np.zeros((3, 3)))], tmp_path / "contacts.png") is None
    assert [path.name for path in tmp_path.iterdir()] == ["metrics.jsonl"]
