"""Pictures the commands write beside their outputs, for a person to look at: a training run's loss, learning rate and
throughput (`nv-esm train`: OUT/metrics.png), scores against measurements (`nv-esm score --score-column`), and
contact maps (`nv-esm embed --contacts`).

matplotlib is optional (`pip install matplotlib`, or the `plots` extra: `pip install ".[plots]"` in a clone):
without it each function returns None and writes nothing, and the command says once how to get the picture. Files
are written under a fresh temporary name in the target's folder and renamed into place, so a reader never sees half
a PNG.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nv_esm.checkpoint_io import replaced_atomically

PLOTS_HINT = "pip install matplotlib to get {what} as a PNG"


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend (files only, no display), or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, png: Path) -> Path:
    """Write `figure` to `png` through a fresh temporary file in the same folder (`replaced_atomically`), then close
    it."""
    try:
        with replaced_atomically(png) as temporary:
            figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    finally:
        pyplot().close(figure)
    return png


# ----------------------------------------------------------------------------------------------------------------
# nv-esm train
# ----------------------------------------------------------------------------------------------------------------


def training_curves(metrics: Path) -> dict[str, tuple[list[int], list[float]]]:
    """The curves of a run's metrics.jsonl, each `(steps, values)` in step order: `loss`, `lr`, `tokens_per_s_per_gpu`
    (the logging interval's, at its steps) and every validation metric (`val_*`). A step logged twice (a run resumed
    from an earlier checkpoint redoes the steps after it) keeps its last record; non-finite values and skipped steps'
    losses are left out."""
    latest: dict[str, dict[int, float]] = {}
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        step = record.get("step")
        for key, value in record.items():
            wanted = key in ("loss", "lr", "tokens_per_s_per_gpu") or key.startswith("val_")
            if (
                not wanted
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not isinstance(step, int)
            ):
                continue
            if key == "loss" and record.get("skipped"):
                continue
            if math.isfinite(value):
                latest.setdefault(key, {})[step] = float(value)
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in latest.items()}


def plot_training(metrics: Path, png: Path) -> Path | None:
    """OUT/metrics.png from OUT/metrics.jsonl: loss (training, and validation where present) on a log scale, learning
    rate, tokens/s per GPU, against the step. None without matplotlib or before the first logged step."""
    plt = pyplot()
    curves = training_curves(metrics) if metrics.is_file() else {}
    if plt is None or "loss" not in curves:
        return None
    figure, (loss_axis, lr_axis, speed_axis) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    loss_axis.plot(*curves["loss"], label="training", linewidth=1)
    validation = sorted(key for key in curves if key.startswith("val_") and "loss" in key)
    for key in validation:
        loss_axis.plot(*curves[key], "o-", label=key.removeprefix("val_").replace("_", " "))
    if all(value > 0 for key in ("loss", *validation) for value in curves[key][1]):
        loss_axis.set_yscale("log")
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    if "lr" in curves:
        lr_axis.plot(*curves["lr"], color="tab:orange")
    lr_axis.set_ylabel("learning rate")
    if "tokens_per_s_per_gpu" in curves:
        speed_axis.plot(*curves["tokens_per_s_per_gpu"], color="tab:green")
    speed_axis.set_ylabel("tokens/s per GPU")
    speed_axis.set_xlabel("step")
    for axis in (loss_axis, lr_axis, speed_axis):
        axis.grid(alpha=0.3)
    figure.suptitle(metrics.parent.name)
    return save_figure(figure, png)


# ----------------------------------------------------------------------------------------------------------------
# nv-esm score and nv-esm embed
# ----------------------------------------------------------------------------------------------------------------


def plot_scores(
    scores: dict[str, Sequence[float]], measured: Sequence[float], png: Path, measured_name: str = "measured"
) -> Path | None:
    """Scatters of model scores (x) against measured values (y), one panel per entry of `scores` (its key, e.g. the
    method and its Spearman, on top; each value one score per measured row), one point per variant, rows with a
    missing (NaN) value left out. None without matplotlib."""
    plt = pyplot()
    if plt is None or not scores:
        return None
    y = np.asarray(measured, dtype=float)
    figure, axes = plt.subplots(1, len(scores), figsize=(4.5 * len(scores), 4.3), squeeze=False, sharey=True)
    for axis, (title, values) in zip(axes[0], scores.items()):
        x = np.asarray(values, dtype=float)
        kept = np.isfinite(x) & np.isfinite(y)
        axis.scatter(x[kept], y[kept], s=8, alpha=0.6, linewidths=0)
        axis.set_xlabel("model score")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel(measured_name)
    return save_figure(figure, png)


def plot_contact_maps(maps: Sequence[tuple[str, np.ndarray]], png: Path) -> Path | None:
    """Contact probabilities `[L, L]` of a few proteins, one panel each with its id, side by side. None without
    matplotlib or without maps."""
    plt = pyplot()
    if plt is None or not maps:
        return None
    figure, axes = plt.subplots(1, len(maps), figsize=(3.6 * len(maps), 3.6), squeeze=False)
    for axis, (name, contacts) in zip(axes[0], maps):
        image = axis.imshow(contacts, cmap="Blues", vmin=0.0, vmax=1.0, origin="upper")
        axis.set_title(f"{name} ({contacts.shape[0]} residues)", fontsize=9)
        axis.set_xlabel("residue")
    axes[0][0].set_ylabel("residue")
    figure.colorbar(image, ax=list(axes[0]), shrink=0.8, label="contact probability")
    return save_figure(figure, png)


# ----------------------------------------------------------------------------------------------------------------
# nv-esm proteingym
# ----------------------------------------------------------------------------------------------------------------


def plot_category_bars(
    categories: Sequence[str], values: dict[str, Sequence[float]], png: Path, metric: str = "Spearman"
) -> Path | None:
    """Grouped bars of one metric: a group per entry of `categories` (ProteinGym's selection types, then `Average`),
    a bar per method in each (`values[method]`, one value per category), the value written above each bar. The
    scatter of one assay's scores against its DMS_score is `plot_scores`. None without matplotlib or methods."""
    plt = pyplot()
    if plt is None or not values:
        return None
    width = 0.8 / len(values)
    figure, axis = plt.subplots(figsize=(1.2 + len(categories) * (0.5 + 0.45 * len(values)), 4.3))
    for index, (method, heights) in enumerate(values.items()):
        positions = np.arange(len(categories)) + (index - (len(values) - 1) / 2) * width
        bars = axis.bar(positions, heights, width, label=method)
        axis.bar_label(bars, fmt="%.3f", fontsize=7)
    axis.set_xticks(np.arange(len(categories)), list(categories), rotation=20)
    axis.set_ylabel(metric)
    axis.axhline(0, color="black", linewidth=0.6)
    axis.grid(axis="y", alpha=0.3)
    axis.margins(y=0.12)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(figure, png)
