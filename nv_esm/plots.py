"""Pictures the commands write beside their outputs, for a person to look at: a training run's loss, validation
metrics, learning rate and throughput (`nv-esm train`: OUT/metrics.png), scores against measurements (`nv-esm score
--score-column`), and contact maps (`nv-esm embed --include contacts`). `training_figure` and `contact_figure` return
the matplotlib Figure (for a test to look at); `plot_training` and `plot_contact_maps` write it.

matplotlib is optional (`pip install matplotlib`, or the `plots` extra: `pip install ".[plots]"` in a clone):
without it each function returns None and writes nothing, and the command says once how to get the picture. Files
are written under a fresh temporary name in the target's folder and renamed into place, so a reader never sees half
a PNG.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
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

TRAINING_KEYS = ("loss", "lr", "tokens_per_s_per_gpu")
# validation metrics that restate `val_loss` in other units (exp of the MLM loss, square root of the MSE): the loss
# panel shows them already, so the validation panel leaves them out, with `val_count` (not a metric)
RESTATED_VALIDATION_KEYS = ("val_loss", "val_perplexity", "val_rmse", "val_count")
VALIDATION_LABELS = {
    "val_masked_accuracy": "masked-token accuracy",
    "val_accuracy": "accuracy",
    "val_f1": "F1 (class 1)",
    "val_f1_macro": "macro F1",
    "val_auroc": "AUROC",
    "val_spearman": "Spearman's rho",
}


MetricsRecords = Sequence[Mapping[str, Any]]  # the records of a metrics.jsonl, as `metrics_records` reads them


def metrics_records(metrics: Path | MetricsRecords) -> MetricsRecords:
    """The records of a metrics.jsonl, in file order (blank lines skipped): `metrics` read, or, already read, as
    they are (a figure reads the file once for all its curves)."""
    if not isinstance(metrics, (str, Path)):
        return metrics
    return [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]


def training_curves(metrics: Path | MetricsRecords) -> dict[str, tuple[list[int], list[float]]]:
    """The curves of a run's metrics.jsonl (the file, or its `metrics_records`), each `(steps, values)` in step
    order: `loss`, `lr`, `tokens_per_s_per_gpu` (the logging interval's, at its steps) and every validation metric
    (`val_*`). A step logged twice (a run resumed from an earlier checkpoint redoes the steps after it) keeps its
    last record; non-finite values and skipped steps' losses are left out."""
    latest: dict[str, dict[int, float]] = {}
    for record in metrics_records(metrics):
        step = record.get("step")
        for key, value in record.items():
            wanted = key in TRAINING_KEYS or key.startswith("val_")
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


def training_device(metrics: Path | MetricsRecords) -> str:
    """The device type (`cuda`, `cpu`, ...) the run's last training record (of the metrics.jsonl, or of its
    `metrics_records`) was logged on: its `device` key, or, in a metrics.jsonl written before records had one,
    `cuda` where the record has the GPU-only `max_memory_gb`, else `cpu`."""
    device = "cpu"
    for record in metrics_records(metrics):
        if "loss" in record:
            device = record.get("device") or ("cuda" if "max_memory_gb" in record else "cpu")
    return str(device)


def throughput_label(device: str) -> str:
    """The throughput panel's label: per GPU on CUDA, per process otherwise (`tokens_per_s_per_gpu` is the run's
    tokens/s divided by its processes)."""
    return "tokens/s per GPU" if device == "cuda" else f"tokens/s per process ({device.upper()})"


def plain_numbers(axis: Any) -> None:
    """Tick labels of `axis` (an Axis: `ax.yaxis`) as plain decimals: no offset (`+3.5`), no `1e-3` or `×10^n`
    factor."""
    from matplotlib.ticker import ScalarFormatter

    formatter = ScalarFormatter(useOffset=False, useMathText=False)
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)


def loss_scale(axis: Any, values: Sequence[float]) -> None:
    """The loss axis: linear with plain labels, or (positive losses spanning a factor of 10 or more, as a
    fine-tune's falling from ~1 to ~0.05 do) log, its ticks at 1, 2 and 5 times powers of ten labelled plainly
    (`0.05`, `2`), none between them."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if values and min(values) > 0 and max(values) / min(values) >= 10:
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    else:
        plain_numbers(axis.yaxis)


def training_figure(metrics: Path) -> Any | None:
    """The figure of OUT/metrics.png from OUT/metrics.jsonl, against the step (integer ticks): training and validation
    loss; the validation metrics other than the loss (accuracy, F1, AUROC, Spearman: `VALIDATION_LABELS`), where the
    run validated; learning rate; tokens/s (per GPU on CUDA, per process on the CPU: `training_device`). Tick
    labels are plain numbers. None without matplotlib or before the first logged step; the caller closes it
    (`save_figure` does)."""
    plt = pyplot()
    records = metrics_records(metrics) if metrics.is_file() else []  # read once, for the curves and the device
    curves = training_curves(records)
    if plt is None or "loss" not in curves:
        return None
    from matplotlib.ticker import MaxNLocator

    scores = [key for key in curves if key.startswith("val_") and key not in RESTATED_VALIDATION_KEYS]
    scores.sort(key=lambda key: (list(VALIDATION_LABELS).index(key) if key in VALIDATION_LABELS else 99, key))
    count = 3 + bool(scores)
    figure, axes = plt.subplots(count, 1, figsize=(7, 2.2 * count + 0.6), sharex=True, layout="constrained")
    loss_axis, *middle, lr_axis, speed_axis = axes
    loss_axis.plot(*curves["loss"], label="training loss", linewidth=1)
    losses = list(curves["loss"][1])
    if "val_loss" in curves:
        loss_axis.plot(*curves["val_loss"], "o-", label="validation loss")
        losses += curves["val_loss"][1]
    loss_scale(loss_axis, losses)
    loss_axis.set_ylabel("loss")
    loss_axis.legend()
    if scores:
        (score_axis,) = middle
        for key in scores:
            label = VALIDATION_LABELS.get(key, key.removeprefix("val_").replace("_", " "))
            score_axis.plot(*curves[key], "o-", label=f"validation {label}")
        plain_numbers(score_axis.yaxis)
        score_axis.set_ylabel("validation")
        score_axis.legend(fontsize=8)
    if "lr" in curves:
        lr_axis.plot(*curves["lr"], color="tab:orange")
    plain_numbers(lr_axis.yaxis)
    lr_axis.set_ylabel("learning rate")
    if "tokens_per_s_per_gpu" in curves:
        speed_axis.plot(*curves["tokens_per_s_per_gpu"], color="tab:green")
    plain_numbers(speed_axis.yaxis)
    speed_axis.set_ylabel(throughput_label(training_device(records)))
    speed_axis.set_xlabel("step")
    speed_axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # the axes share it
    for axis in axes:
        axis.grid(alpha=0.3)
    figure.suptitle(metrics.parent.name)
    return figure


def plot_training(metrics: Path, png: Path) -> Path | None:
    """OUT/metrics.png from OUT/metrics.jsonl (`training_figure`). None without matplotlib or before the first logged
    step."""
    figure = training_figure(metrics)
    return None if figure is None else save_figure(figure, png)


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


def shortened(name: str, length: int) -> str:
    """`name` cut to `length` characters, its middle replaced by an ellipsis (both ends of an id tell it apart)."""
    if len(name) <= length:
        return name
    kept = max(length - 1, 0)
    head = (kept + 1) // 2
    return name[:head] + "…" + name[len(name) - (kept - head) :]


def contact_figure(maps: Sequence[tuple[str, np.ndarray]]) -> Any | None:
    """The figure of contacts.png: contact probabilities `[L, L]` of a few proteins, one panel each, side by side,
    titled with its id over its length. An id wider than its panel is shortened in the middle (`…`), so that no two
    titles overlap. None without matplotlib or without maps; the caller closes it (`save_figure` does)."""
    plt = pyplot()
    if plt is None or not maps:
        return None
    figure, axes = plt.subplots(1, len(maps), figsize=(3.2 * len(maps) + 1.0, 3.9), squeeze=False, layout="constrained")
    for axis, (name, contacts) in zip(axes[0], maps):
        image = axis.imshow(contacts, cmap="Blues", vmin=0.0, vmax=1.0, origin="upper")
        axis.set_title(f"{name}\n{contacts.shape[0]} residues", fontsize=9)
        axis.set_xlabel("residue")
    axes[0][0].set_ylabel("residue")
    figure.colorbar(image, ax=list(axes[0]), shrink=0.8, label="contact probability")
    renderer = figure.canvas.get_renderer()
    for _ in range(3):  # shortening a title may let the layout widen the panels: measure again
        figure.draw_without_rendering()
        changed = False
        for axis, (name, contacts) in zip(axes[0], maps):
            width, length = axis.get_window_extent(renderer).width, len(name)
            while length > 1 and axis.title.get_window_extent(renderer).width > width:
                length -= 1
                axis.set_title(f"{shortened(name, length)}\n{contacts.shape[0]} residues", fontsize=9)
                changed = True
        if not changed:
            break
    return figure


def plot_contact_maps(maps: Sequence[tuple[str, np.ndarray]], png: Path) -> Path | None:
    """contacts.png (`contact_figure`): the contact maps of a few proteins side by side. None without matplotlib or
    without maps."""
    figure = contact_figure(maps)
    return None if figure is None else save_figure(figure, png)


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
