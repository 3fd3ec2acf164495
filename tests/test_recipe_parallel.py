"""The recipe's scale-out options on CPU (4-process gloo runs of the tiny model, fp32): hybrid sharding (HSDP,
`--dp-replicate`) against the flat FSDP2 run on the same data, resuming under another layout, and the refusals.

Losses of the same run under two layouts differ only by the order of the fp32 gradient reductions (a reduce-scatter
over 4 ranks, or over 2 and then an all-reduce over 2): within 1e-5 relative."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recipe_train import losses, mlm_args, run_recipe

from nv_esm.train.config import parse_config

RANKS = 4
LOSS_RTOL = 1e-5


def test_hybrid_sharding_matches_flat_sharding_and_resumes_under_either_layout(
    tiny_config: Path, tmp_path: Path
) -> None:
    """4 ranks: flat FSDP2, HSDP 2x2 and pure replication (4x1) give the flat run's losses; a flat run stopped at
    step 3 and resumed as HSDP goes on with the flat run's losses (DCP reshards the model and optimizer state)."""
    steps = 6
    run = {
        name: (tmp_path / name, mlm_args(tiny_config, steps, "--no-export", *extra))
        for name, extra in {
            "flat": (),
            "hybrid": ("--dp-replicate", "2"),
            "replicated": ("--dp-replicate", "4"),
        }.items()
    }
    for out, args in run.values():
        run_recipe(out, *args, ranks=RANKS)
    switched = tmp_path / "switched"
    run_recipe(switched, *mlm_args(tiny_config, steps, "--stop-at-step", "3", "--no-export"), ranks=RANKS)
    run_recipe(switched, *mlm_args(tiny_config, steps, "--resume", "--dp-replicate", "2", "--no-export"), ranks=RANKS)

    flat = losses(run["flat"][0])
    assert sorted(flat) == list(range(1, steps + 1))
    for name in ("hybrid", "replicated"):
        other = losses(run[name][0])
        assert sorted(other) == sorted(flat)
        for step in flat:
            assert other[step] == pytest.approx(flat[step], rel=LOSS_RTOL), (name, step)
    resumed = losses(switched)
    for step in flat:
        assert resumed[step] == pytest.approx(flat[step], rel=LOSS_RTOL), step
    assert sum(list(flat.values())[-3:]) < sum(list(flat.values())[:3])


def test_a_replica_count_that_does_not_divide_the_ranks_is_refused(tiny_config: Path, tmp_path: Path) -> None:
    refused = run_recipe(tmp_path / "run", *mlm_args(tiny_config, 2, "--dp-replicate", "3"), ranks=RANKS, check=False)
    assert refused.returncode != 0 and "--dp-replicate 3 must divide the number of ranks (4)" in refused.stderr
    config = parse_config([*mlm_args(tiny_config, 2, "--dp-replicate", "0"), "--out", str(tmp_path / "other")])
    with pytest.raises(ValueError, match="--dp-replicate must be at least 1"):
        config.validate()
