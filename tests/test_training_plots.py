"""metrics.png and contacts.png as matplotlib draws them (issue 62, item 9), checked on the Figure objects, not the
PNG: plain loss tick labels (no offset, no `×10^n`), the training and validation series named for what they are,
the validation metrics in their own panel, the throughput labelled for the device the run used, integer step ticks;
contact-map titles that do not overlap. The validation metrics the plot shows (masked-token accuracy, accuracy, F1,
AUROC) against hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nv_esm import plots
from nv_esm.data import IGNORE_INDEX
from nv_esm.train.validation import _scored, classification_metrics, mlm_metrics

plt = pytest.importorskip("matplotlib.pyplot")


def write_metrics(path: Path, steps: int, device: str | None, validation: dict[str, list[float]] | None = None,
                  losses: list[float] | None = None, old_cuda: bool = False) -> Path:  # fmt: skip
    """A metrics.jsonl as `nv-esm train` writes it: a record per step (logging intervals of 2 steps; `device` as the
    trainer records it, or None: left out, as before it did; the memory figures on CUDA, `old_cuda` included) and,
    every 5 steps, a validation record of `validation`'s keys (their values in turn)."""
    losses = losses or [3.55 - 0.04 * step for step in range(1, steps + 1)]
    lines, validated = [], 0
    for step in range(1, steps + 1):
        first = step - (step - 1) % 2
        record = dict(step=step, loss=losses[step - 1], lr=1e-4 * (1 - step / (steps + 1)), grad_norm=1.0, tokens=900)
        record.update(tokens_per_s=12000.0 + first, tokens_per_s_per_gpu=12000.0 + first, interval=[first, first + 1])
        if device is not None:
            record.update(device=device)
        if device == "cuda" or old_cuda:
            record.update(max_memory_gb=1.5, memory_gb_per_rank=[1.5])
        lines.append(json.dumps(record))
        if validation and step % 5 == 0:
            lines.append(json.dumps({"step": step, **{k: v[validated] for k, v in validation.items()}}))
            validated += 1
    path.write_text("\n".join(lines) + "\n")
    return path


def drawn(figure):
    """`figure` after a draw (tick labels and offset texts are set then)."""
    figure.canvas.draw()
    return figure


def axis_by_ylabel(figure) -> dict[str, object]:
    return {axis.get_ylabel(): axis for axis in figure.axes}


def assert_plain_ticks(axis) -> None:
    """No offset text; the labels of the ticks in view (major and minor) plain numbers, with no scientific factor
    (`×10^n`, `1e-4`), at least two of them."""
    assert axis.yaxis.get_offset_text().get_text() == "", axis.get_ylabel()
    low, high = sorted(axis.get_ylim())
    labels = [
        label.get_text()
        for minor in (False, True)
        for tick, label in zip(axis.get_yticks(minor=minor), axis.get_yticklabels(minor=minor))
        if low <= tick <= high and label.get_text()
    ]
    assert len(labels) >= 2, (axis.get_ylabel(), labels)
    for text in labels:
        assert not any(mark in text for mark in ("×", "\\times", "$", "e+", "e-", "10^")), (axis.get_ylabel(), text)
        float(text.replace("\N{MINUS SIGN}", "-"))  # a plain number


def assert_integer_steps(figure) -> None:
    for axis in figure.axes:
        low, high = axis.get_xlim()
        ticks = [tick for tick in axis.get_xticks() if low <= tick <= high]
        assert len(ticks) >= 2 and all(float(tick).is_integer() for tick in ticks), ticks
    labels = [label.get_text() for label in figure.axes[-1].get_xticklabels() if label.get_text()]
    assert labels and all("." not in text for text in labels), labels


MLM_VALIDATION = {"val_loss": [3.3, 3.2], "val_perplexity": [27.1, 24.5], "val_masked_accuracy": [0.07, 0.09],
                  "val_count": [2114, 2114]}  # fmt: skip
BINARY_VALIDATION = {"val_loss": [0.69, 0.6], "val_accuracy": [0.5, 0.7], "val_f1": [0.4, 0.66],
                     "val_f1_macro": [0.45, 0.68], "val_auroc": [0.55, 0.8], "val_count": [40, 40]}  # fmt: skip


@pytest.mark.parametrize("steps", [4, 10])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_metrics_figure_without_validation(tmp_path, steps, device):
    figure = drawn(plots.training_figure(write_metrics(tmp_path / "metrics.jsonl", steps, device)))
    try:
        axes = axis_by_ylabel(figure)
        speed = "tokens/s per GPU" if device == "cuda" else "tokens/s per process (CPU)"
        assert list(axes) == ["loss", "learning rate", speed]
        assert [text.get_text() for text in axes["loss"].get_legend().get_texts()] == ["training loss"]
        for axis in axes.values():
            assert_plain_ticks(axis)
        assert_integer_steps(figure)
        assert figure.axes[-1].get_xlabel() == "step"
    finally:
        plt.close(figure)


def test_the_device_of_an_older_metrics_file(tmp_path):
    """Records without a `device` key (written before it): CUDA where they hold the GPU-only memory figure."""
    cuda = write_metrics(tmp_path / "cuda.jsonl", 4, None, old_cuda=True)
    assert plots.training_device(cuda) == "cuda"
    cpu = write_metrics(tmp_path / "cpu.jsonl", 4, None)
    assert plots.training_device(cpu) == "cpu"
    assert plots.throughput_label("cuda") == "tokens/s per GPU"
    assert plots.throughput_label("cpu") == "tokens/s per process (CPU)"


@pytest.mark.parametrize(
    "validation, scores",
    [
        (MLM_VALIDATION, ["validation masked-token accuracy"]),
        (
            BINARY_VALIDATION,
            ["validation accuracy", "validation F1 (class 1)", "validation macro F1", "validation AUROC"],
        ),
        (
            {"val_loss": [0.5, 0.4], "val_rmse": [0.7, 0.63], "val_spearman": [0.2, 0.5], "val_count": [9, 9]},
            ["validation Spearman's rho"],
        ),
    ],
    ids=["mlm", "binary", "regression"],
)
def test_metrics_figure_with_validation(tmp_path, validation, scores):
    """The validation loss is named so in the loss panel; the other metrics (not perplexity, RMSE or the count:
    the loss in other units) have a panel of their own with each series named."""
    figure = drawn(plots.training_figure(write_metrics(tmp_path / "metrics.jsonl", 10, "cpu", validation)))
    try:
        axes = axis_by_ylabel(figure)
        assert list(axes) == ["loss", "validation", "learning rate", "tokens/s per process (CPU)"]
        assert [t.get_text() for t in axes["loss"].get_legend().get_texts()] == ["training loss", "validation loss"]
        assert [t.get_text() for t in axes["validation"].get_legend().get_texts()] == scores
        shown = [key for key in validation if key not in plots.RESTATED_VALIDATION_KEYS]
        for line, key in zip(axes["validation"].get_lines(), shown, strict=True):
            assert list(line.get_xdata()) == [5, 10] and list(line.get_ydata()) == validation[key]
        for axis in axes.values():
            assert_plain_ticks(axis)
        assert_integer_steps(figure)
    finally:
        plt.close(figure)


def test_a_loss_spanning_a_decade_is_drawn_on_a_log_axis_with_plain_labels(tmp_path):
    losses = [0.9 * 0.6**step for step in range(12)]  # 0.9 down to 0.003
    figure = drawn(plots.training_figure(write_metrics(tmp_path / "metrics.jsonl", 12, "cuda", losses=losses)))
    try:
        loss_axis = axis_by_ylabel(figure)["loss"]
        assert loss_axis.get_yscale() == "log"
        assert_plain_ticks(loss_axis)
        assert not [label.get_text() for label in loss_axis.get_yticklabels(minor=True) if label.get_text()]
    finally:
        plt.close(figure)


def test_plot_training_writes_the_figure(tmp_path):
    metrics = write_metrics(tmp_path / "metrics.jsonl", 4, "cpu", MLM_VALIDATION)
    assert plots.plot_training(metrics, tmp_path / "metrics.png") == tmp_path / "metrics.png"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plots.training_figure(tmp_path / "missing.jsonl") is None


def test_the_figure_reads_metrics_jsonl_once(tmp_path, monkeypatch):
    """The curves and the throughput panel's device come from one reading of the file (`metrics_records`); read
    or given already read, the file says the same."""
    metrics = write_metrics(tmp_path / "metrics.jsonl", 6, "cuda", MLM_VALIDATION)
    records = plots.metrics_records(metrics)
    assert plots.training_curves(records) == plots.training_curves(metrics)
    assert plots.training_device(records) == plots.training_device(metrics) == "cuda"
    reads: list[Path] = []
    read_text = Path.read_text

    def counted(path: Path, *args, **kwargs) -> str:
        reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    import matplotlib.pyplot as plt

    figure = drawn(plots.training_figure(metrics))
    try:
        assert reads == [metrics]
        assert axis_by_ylabel(figure).keys() >= {"loss", "tokens/s per GPU"}
    finally:
        plt.close(figure)


# --------------------------------------------------------------------------------------------------------------
# contacts.png
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [
        ["sp|P0DTC2|SPIKE_SARS2", "tr|A0A0K9P0T0|A0A0K9P0T0_ZOSMR", "sp|P69905|HBA_HUMAN", "UniRef50_A0A1B2C3D4"],
        ["p1", "a" * 120, "UniRef100_" + "X" * 60, "short"],
        ["only_one_protein_with_a_rather_long_identifier_from_some_metagenome_assembly_contig_0001"],
    ],
    ids=["uniprot", "very-long", "one"],
)
def test_contact_map_titles_do_not_overlap(names):
    rng = np.random.default_rng(0)
    maps = [(name, rng.random((length, length))) for name, length in zip(names, (312, 275, 1273, 9))]
    figure = drawn(plots.contact_figure(maps))
    try:
        renderer = figure.canvas.get_renderer()
        panels = [axis for axis in figure.axes if axis.get_title()]
        assert len(panels) == len(maps)
        boxes = [axis.title.get_window_extent(renderer) for axis in panels]
        for index, (axis, box) in enumerate(zip(panels, boxes)):
            name, contacts = maps[index]
            first, second = axis.get_title().split("\n")
            assert second == f"{contacts.shape[0]} residues"
            assert first == name or ("…" in first and name.startswith(first.split("…")[0]))
            panel = axis.get_window_extent(renderer)
            assert panel.x0 - 1 <= box.x0 and box.x1 <= panel.x1 + 1, (first, box, panel)
            assert 0 <= box.x0 and box.x1 <= figure.bbox.x1
            for other in boxes[index + 1 :]:
                assert not box.overlaps(other), (box, other)
    finally:
        plt.close(figure)


def test_shortened_keeps_both_ends():
    assert plots.shortened("sp|P69905|HBA_HUMAN", 30) == "sp|P69905|HBA_HUMAN"
    assert plots.shortened("abcdefghij", 7) == "abc…hij"
    assert plots.shortened("abcdefghij", 6) == "abc…ij"
    assert all(len(plots.shortened("abcdefghij", n)) == n for n in range(1, 11))


# --------------------------------------------------------------------------------------------------------------
# The validation metrics the plot shows, against hand-computed values
# --------------------------------------------------------------------------------------------------------------


def test_binary_metrics_of_a_hand_computed_example():
    """Six proteins, class-1 probabilities 0.9 0.8 0.3 0.6 0.2 0.1 for labels 1 1 1 0 0 0: predictions 1 1 0 1 0 0,
    so TP 2, FP 1, FN 1, TN 2: accuracy 4/6, class-1 F1 2*2/(2*2+1+1) = 2/3, class-0 F1 the same, macro F1 2/3.
    AUROC: of the 9 (positive, negative) pairs only (0.3, 0.6) is ordered wrong: 8/9."""
    probability = torch.tensor([0.9, 0.8, 0.3, 0.6, 0.2, 0.1], dtype=torch.float64)
    logits = torch.stack([torch.zeros(6, dtype=torch.float64), torch.log(probability / (1 - probability))], dim=1)
    labels = torch.tensor([1, 1, 1, 0, 0, 0])
    metrics = classification_metrics(logits, labels, loss=0.5)
    assert metrics == {
        "val_loss": 0.5,
        "val_accuracy": pytest.approx(4 / 6),
        "val_f1": pytest.approx(2 / 3),
        "val_f1_macro": pytest.approx(2 / 3),
        "val_auroc": pytest.approx(8 / 9),
        "val_count": 6,
    }


def test_binary_f1_when_class_one_is_rare_or_absent():
    """Labels 0 0 0 1, predictions 1 0 0 0: class 1 has TP 0: F1 0. Labels and predictions all 0: class 1's F1
    is undefined (None), AUROC too (one class only)."""
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    metrics = classification_metrics(logits, torch.tensor([0, 0, 0, 1]), loss=1.0)
    assert metrics["val_f1"] == 0.0 and metrics["val_accuracy"] == 0.5
    assert metrics["val_f1_macro"] == pytest.approx((0 + 2 * 2 / (2 * 2 + 1 + 1)) / 2)
    none = classification_metrics(logits[1:], torch.tensor([0, 0, 0]), loss=1.0)
    assert none["val_f1"] is None and none["val_auroc"] is None and none["val_accuracy"] == 1.0


def test_multiclass_metrics_have_no_binary_f1():
    logits = torch.eye(3)[[0, 1, 2, 2]]
    metrics = classification_metrics(logits, torch.tensor([0, 1, 2, 1]), loss=0.1)
    assert "val_f1" not in metrics and metrics["val_accuracy"] == 0.75


def test_masked_accuracy_of_a_known_batch():
    """A packed batch of 10 tokens over a vocabulary of 4, 5 of them masked; the logits put a 2 on one token's
    column (a 0 elsewhere): right at 3 of the 5 masked tokens (the unmasked ones count for nothing). Each masked
    token's cross-entropy is that of the logit row: ln(3 + e^2) - (2 if right else 0)."""
    guessed = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    logits = torch.nn.functional.one_hot(guessed, 4).double()[None] * 2
    labels = torch.full((1, 10), IGNORE_INDEX)
    labels[0, [1, 3, 4, 7, 9]] = torch.tensor([1, 0, 0, 2, 1])  # right at 1, 4 and 9
    sums = _scored(logits, labels, "mlm", regression=False)
    metrics = mlm_metrics(*sums.tolist())
    row = math.log(3 + math.e**2)
    assert metrics["val_masked_accuracy"] == 3 / 5 and metrics["val_count"] == 5
    assert metrics["val_loss"] == pytest.approx((5 * row - 3 * 2) / 5)
    assert metrics["val_perplexity"] == pytest.approx(math.exp((5 * row - 6) / 5))
