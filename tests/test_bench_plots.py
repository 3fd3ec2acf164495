"""The weak-scaling chart's numbers (`bench/plot_scale.py`): tokens/s per GPU over the group's one-GPU run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def scale_result(shape: str, budgets: dict[int, dict[str, float]]) -> dict:
    """A `recipe_checks.py scale` JSON: per budget, runs with their tokens/s per GPU (losses and failures beside)."""
    return {
        "shape": shape,
        "budgets": {
            str(budget): {
                "failed": [],
                "wall_seconds": {name: 1.0 for name in runs},
                **{name: {"tokens_per_s_per_gpu": value} for name, value in runs.items()},
                **{f"losses_{name}": [3.0] for name in runs},
            }
            for budget, runs in budgets.items()
        },
    }


def test_scaling_bars_divide_each_run_by_its_groups_one_gpu_run(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from plot_scale import plot, scaling_bars

    results = [
        scale_result("650M", {16384: {"one_gpu": 100.0, "replicate_2gpu": 95.0, "shard_4gpu": 40.0}}),
        scale_result("3B", {32768: {"one_gpu": 20.0, "replicate_2gpu": 19.0}}),
    ]
    groups, ratios = scaling_bars(results)
    assert groups == ["650M, 16k tokens/GPU", "3B, 32k tokens/GPU"]
    assert ratios == {"replicate_2gpu": [0.95, 0.95], "shard_4gpu": [0.4, None]}
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib draws the chart")
    plot(results, tmp_path / "scale.png", "test")
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
