"""Validation in the training recipe: the metric functions against brute-force definitions, and the `val_*`
metrics a 2-rank run logs against transformers' heads on the same validation inputs with the run's final weights
(fp32, CPU: losses within 1e-5 relative; accuracy, F1 and AUROC from the same predictions)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_recipe_train import DEMO_FASTA, SECONDARY_STRUCTURE, mlm_args, run_recipe

from configuration_nv_esm import NVEsmConfig
from conftest import ROOT, pad_batch
from modeling_nv_esm import sequence_loss, token_loss
from nv_esm.conversion import convert_nv_to_hf
from nv_esm.data import Holdout, MLMStream
from nv_esm.rank_statistics import auroc, average_ranks, spearman
from nv_esm.train.config import parse_config
from nv_esm.train.parallel import Dist
from nv_esm.train.validation import (
    VALIDATION_SEED,
    classification_metrics,
    regression_metrics,
    validation_stream,
)

SOLUBILITY = ROOT / "recipes" / "demo_data" / "solubility.csv"
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------------------------------------------
# Brute-force definitions
# --------------------------------------------------------------------------------------------------------------


def brute_ranks(values: list[float]) -> list[float]:
    """1-based rank of each value: the values below it, plus the mean position among its equals."""
    return [sum(v < x for v in values) + (sum(v == x for v in values) + 1) / 2 for x in values]


def brute_auroc(scores: list[float], positives: list[bool]) -> float:
    """The fraction of (positive, negative) pairs ordered right, ties counting half."""
    pairs = [(p, n) for p, is_p in zip(scores, positives) if is_p for n, is_n in zip(scores, positives) if not is_n]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def brute_pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def brute_f1_macro(predictions: list[int], labels: list[int]) -> float:
    scores = []
    for label in set(predictions) | set(labels):
        tp = sum(p == label and t == label for p, t in zip(predictions, labels))
        fp = sum(p == label and t != label for p, t in zip(predictions, labels))
        fn = sum(p != label and t == label for p, t in zip(predictions, labels))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def brute_f1(predictions: list[int], labels: list[int], positive: int = 1) -> float | None:
    """The F1 of class `positive`: the harmonic mean of its precision and recall; None where it is neither
    predicted nor labelled."""
    tp = sum(p == positive and t == positive for p, t in zip(predictions, labels))
    predicted, actual = predictions.count(positive), labels.count(positive)
    if not predicted and not actual:
        return None
    precision, recall = (tp / predicted if predicted else 0.0), (tp / actual if actual else 0.0)
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def brute_classification(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """Cross-entropy, accuracy, macro F1, AUROC (two classes: class 1; more: mean one-vs-rest) and, for two
    classes, class 1's F1, by the definitions."""
    rows, truth = logits.double().tolist(), labels.tolist()
    probabilities = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    predictions = [max(range(len(row)), key=row.__getitem__) for row in rows]
    classes = [1] if len(rows[0]) == 2 else range(len(rows[0]))
    areas = [
        brute_auroc([p[c] for p in probabilities], [t == c for t in truth])
        for c in classes
        if 0 < sum(t == c for t in truth) < len(truth)
    ]
    return {
        "val_loss": -sum(math.log(p[t]) for p, t in zip(probabilities, truth)) / len(truth),
        "val_accuracy": sum(p == t for p, t in zip(predictions, truth)) / len(truth),
        **({"val_f1": brute_f1(predictions, truth)} if len(rows[0]) == 2 else {}),
        "val_f1_macro": brute_f1_macro(predictions, truth),
        "val_auroc": sum(areas) / len(areas) if areas else None,
        "val_count": len(truth),
    }


def brute_regression(predictions: torch.Tensor, targets: torch.Tensor) -> dict:
    x, y = predictions.double().tolist(), targets.double().tolist()
    error = sum((a - b) ** 2 for a, b in zip(x, y)) / len(x)
    return {
        "val_loss": error,
        "val_rmse": math.sqrt(error),
        "val_spearman": brute_pearson(brute_ranks(x), brute_ranks(y)),
        "val_count": len(x),
    }


def assert_metrics_close(logged: dict, expected: dict, rel: float, loss_rel: float | None = None) -> None:
    """`loss_rel`: the tolerance of `val_loss` and `val_rmse` where it differs from `rel` (the heads' losses run in
    fp32)."""
    assert set(logged) == set(expected), (logged, expected)
    for key, value in expected.items():
        tolerance = loss_rel if key in ("val_loss", "val_rmse") and loss_rel is not None else rel
        assert logged[key] == (None if value is None else pytest.approx(value, rel=tolerance, abs=1e-12)), key


# --------------------------------------------------------------------------------------------------------------
# The metric functions
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_ranks_auroc_and_spearman_match_their_definitions(seed: int) -> None:
    """Random scores with many ties (rounded), random labels; constant inputs and one-class labels give None."""
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 60, (), generator=generator))
    scores = (torch.rand(n, generator=generator) * 5).round() / 5
    targets = (torch.randn(n, generator=generator) * 2).round()
    positives = torch.rand(n, generator=generator) < 0.4
    positives[0], positives[-1] = True, False
    assert average_ranks(scores).tolist() == pytest.approx(brute_ranks(scores.tolist()))
    assert auroc(scores, positives) == pytest.approx(brute_auroc(scores.tolist(), positives.tolist()))
    if len(set(targets.tolist())) > 1 and len(set(scores.tolist())) > 1:
        expected = brute_pearson(brute_ranks(scores.tolist()), brute_ranks(targets.tolist()))
        assert spearman(scores, targets) == pytest.approx(expected)
    assert auroc(scores, torch.ones(n, dtype=torch.bool)) is None
    assert spearman(torch.ones(n), targets) is None and spearman(scores[:1], targets[:1]) is None


@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_classification_and_regression_metrics_match_their_definitions(num_classes: int) -> None:
    generator = torch.Generator().manual_seed(num_classes)
    logits = torch.randn(80, num_classes, generator=generator) * 2
    labels = torch.randint(0, num_classes, (80,), generator=generator)
    labels[labels == num_classes - 1] = 0  # a class never labelled: out of AUROC's mean, in F1's when predicted
    config = NVEsmConfig(num_labels=num_classes, problem_type="single_label_classification")
    for loss in (token_loss(logits, labels), sequence_loss(logits, labels, config)):  # the heads' cross-entropy
        logged = classification_metrics(logits, labels, loss.item())
        assert_metrics_close(logged, brute_classification(logits, labels), rel=1e-9, loss_rel=1e-6)
    predictions, targets = torch.randn(50, generator=generator), torch.randn(50, generator=generator).round()
    loss = sequence_loss(predictions, targets, NVEsmConfig(num_labels=1)).item()  # the regression head's
    logged = regression_metrics(predictions, targets, loss)
    assert_metrics_close(logged, brute_regression(predictions, targets), rel=1e-9, loss_rel=1e-6)


# --------------------------------------------------------------------------------------------------------------
# Validation in a run, against transformers
# --------------------------------------------------------------------------------------------------------------


def validation_records(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in records if "val_loss" in r}


def transformers_logits(model: torch.nn.Module, batch) -> torch.Tensor:
    """transformers' logits of a packed batch's proteins, run right-padded: `[N, C]` for a sequence head, else the
    packed `[T, C]` (padding dropped)."""
    bounds = batch.cu_seq_lens.tolist()
    input_ids, attention_mask = pad_batch([batch.input_ids[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return logits if logits.dim() == 2 else logits[attention_mask.bool()]


@pytest.mark.slow
def test_mlm_validation_equals_transformers_on_the_held_out_proteins(tiny_config: Path, tmp_path: Path) -> None:
    """2 ranks, --val-fraction 0.1, validation at steps 2 and 4: loss, perplexity and masked accuracy at step 4
    equal transformers' `EsmForMaskedLM` with the exported weights on the held-out proteins with the same masks
    (rebuilt here in one stream: the masks do not depend on the world size); the validation streams the run builds
    do not depend on --seed either; step 2's weights differ, so its loss does."""
    from transformers import EsmForMaskedLM

    out = tmp_path / "run"
    run_recipe(out, *mlm_args(tiny_config, 4, "--val-fraction", "0.1", "--val-every", "2"))
    logged = validation_records(out)
    assert sorted(logged) == [2, 4] and logged[2]["val_loss"] != logged[4]["val_loss"]
    convert_nv_to_hf(out / "final", tmp_path / "hf")
    model = EsmForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    stream = MLMStream(
        DEMO_FASTA, 0, 1, 1024, 256, seed=VALIDATION_SEED, shuffle=False, holdout=Holdout(0.1, "validation")
    )
    loss_sum = correct = count = 0.0
    for batch in stream.one_pass():
        logits = transformers_logits(model, batch)
        labels = batch.labels[0]
        masked = labels != -100
        loss_sum += F.cross_entropy(logits[masked], labels[masked], reduction="sum").item()
        correct += (logits[masked].argmax(-1) == labels[masked]).sum().item()
        count += masked.sum().item()
    expected = {
        "val_loss": loss_sum / count,
        "val_perplexity": math.exp(loss_sum / count),
        "val_masked_accuracy": correct / count,
        "val_count": int(count),
    }
    assert_metrics_close(logged[4], expected, rel=LOSS_RTOL)
    assert 30 < expected["val_count"] / 0.15 / 270 < 100  # ~60 of 600 proteins of median length 270, 15% masked

    for seed, world_size in (("9", 2), ("3", 3)):  # rank 0 of 2 and rank 1 of 3: --seed is not used
        config = parse_config([*mlm_args(tiny_config, 4, "--val-fraction", "0.1"), "--seed", seed, "--out", "x"])
        world = Dist(rank=world_size - 2, world_size=world_size, device=torch.device("cpu"), mesh=None)
        with mock.patch("torch.distributed.all_reduce"):  # (no process group here)
            part = validation_stream(config, world, training=None)
        assert [(b.input_ids.tolist(), b.labels.tolist()) for b in part.one_pass()] == [
            (b.input_ids.tolist(), b.labels.tolist())
            for b in MLMStream(DEMO_FASTA, world_size - 2, world_size, 1024, 256, seed=VALIDATION_SEED,
                               shuffle=False, holdout=Holdout(0.1, "validation")).one_pass()
        ]  # fmt: skip


def regression_csv(path: Path) -> Path:
    """The solubility sequences with a float target: the fraction of charged residues (DEKR), rounded."""
    rows = [line.split(",")[0] for line in SOLUBILITY.read_text().splitlines()[1:]]
    lines = [f"{s},{round(sum(c in 'DEKR' for c in s) / len(s) * 10, 2):.2f}" for s in rows]
    path.write_text("sequence,label\n" + "\n".join(lines) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("task", ["sequence", "token", "regression"])
def test_head_validation_equals_transformers(nv_tiny: Path, tmp_path: Path, task: str) -> None:
    """Fine-tuning runs (2 ranks) with validation after the last step: sequence classification on --val-fraction
    0.25 of solubility.csv, token classification on a --val-data CSV (the last 50 rows of
    secondary_structure.csv), regression on --val-fraction 0.25. The logged metrics equal those of transformers'
    heads (converted from the export) on the same proteins, computed by the brute-force definitions above."""
    from transformers import EsmForSequenceClassification, EsmForTokenClassification

    from nv_esm.data import ClassificationStream

    args = [
        "--model",
        str(nv_tiny),
        "--steps",
        "3",
        "--lr",
        "5e-3",
        "--tokens-per-batch",
        "1024",
        "--max-length",
        "254",
    ]
    holdout = Holdout(0.25, "validation")
    if task == "token":
        rows = SECONDARY_STRUCTURE.read_text().splitlines()
        (tmp_path / "train.csv").write_text("\n".join(rows[:151]) + "\n")
        (tmp_path / "val.csv").write_text("\n".join(rows[:1] + rows[151:]) + "\n")
        data, holdout = tmp_path / "train.csv", None
        args += ["--task", "token", "--data", str(data), "--val-data", str(tmp_path / "val.csv")]
        validation_file, hf_class = tmp_path / "val.csv", EsmForTokenClassification
    else:
        data = SOLUBILITY if task == "sequence" else regression_csv(tmp_path / "regression.csv")
        args += ["--task", "sequence", "--data", str(data), "--val-fraction", "0.25"]
        validation_file, hf_class = data, EsmForSequenceClassification
    out = tmp_path / "run"
    run_recipe(out, *args)
    logged = validation_records(out)
    assert sorted(logged) == [3]
    convert_nv_to_hf(out / "final", tmp_path / "hf")
    model = hf_class.from_pretrained(tmp_path / "hf").eval()
    training = ClassificationStream(data, "token" if task == "token" else "sequence", 0, 1, 1024, 256)
    stream = ClassificationStream(
        validation_file,
        "token" if task == "token" else "sequence",
        0,
        1,
        1024,
        256,
        seed=VALIDATION_SEED,
        shuffle=False,
        label_names=training.label_names,
        holdout=holdout,
    )
    logits, labels = [], []
    for batch in stream.one_pass():
        batch_labels = batch.labels.reshape(-1)
        batch_logits = transformers_logits(model, batch)
        keep = batch_labels != -100
        logits.append(batch_logits[keep])
        labels.append(batch_labels[keep])
    logits, labels = torch.cat(logits), torch.cat(labels)
    if task == "regression":
        expected = brute_regression(logits.squeeze(-1), labels)
    else:
        expected = brute_classification(logits, labels)
    assert_metrics_close(logged[3], expected, rel=LOSS_RTOL)
    if task != "token":  # (token: the labelled residues of the crops)
        assert expected["val_count"] == len(stream)


def test_validation_options_are_checked_before_training(tiny_config: Path, tmp_path: Path) -> None:
    """Both a file and a fraction, a fraction outside [0, 1), --val-every without a set, a missing file, several
    CSVs for a head: ValueError (FileNotFoundError) naming the option, before anything runs."""
    base = [*mlm_args(tiny_config, 2), "--out", str(tmp_path / "run")]
    cases = {
        "not both": ["--val-data", str(DEMO_FASTA), "--val-fraction", "0.1"],
        r"--val-fraction must be in \[0, 1\)": ["--val-fraction", "1.5"],
        "--val-every needs a validation set": ["--val-every", "5"],
        "--val-every must be at least 0": ["--val-fraction", "0.1", "--val-every", "-1"],
        "--val-data .* does not exist": ["--val-data", str(tmp_path / "missing.fasta")],
    }
    for message, extra in cases.items():
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            parse_config([*base, *extra]).validate()
    head = ["--task", "token", "--val-data", str(SECONDARY_STRUCTURE), str(SECONDARY_STRUCTURE)]
    with pytest.raises(ValueError, match="validates on one labelled CSV"):
        parse_config([*base, *head]).validate()


@pytest.mark.slow
def test_regression_against_class_labels_is_refused(nv_tiny: Path, tmp_path: Path) -> None:
    """A validation CSV whose labels read as class ids (all integers) for a regression run: refused, with the fix."""
    train = regression_csv(tmp_path / "regression.csv")
    result = run_recipe(
        tmp_path / "run",
        *["--model", str(nv_tiny), "--task", "sequence", "--data", str(train), "--val-data", str(SOLUBILITY)],
        *["--steps", "1", "--tokens-per-batch", "1024", "--max-length", "254"],
        ranks=1,
        check=False,
    )
    assert result.returncode != 0 and "write regression targets with a decimal point" in result.stderr


def test_held_out_records_are_not_trained_on(tmp_path: Path) -> None:
    """--val-fraction takes its records out of the training streams (checked on the streams the run builds)."""
    from nv_esm.train.feed import make_batches

    config = parse_config(
        ["--config", "c.json", "--data", str(DEMO_FASTA), "--steps", "1", "--out", "x", "--val-fraction", "0.2"]
    )
    world = Dist(rank=0, world_size=1, device=torch.device("cpu"), mesh=None)
    batches, _ = make_batches(config, world)
    training = {tuple(batches.streams[0]._tokens(i)) for i in range(len(batches.streams[0]))}
    validation = MLMStream(DEMO_FASTA, 0, 1, 16384, holdout=Holdout(0.2, "validation"))
    held_out = {tuple(validation._tokens(i)) for i in range(len(validation))}
    assert held_out and not training & held_out and len(training) + len(held_out) == 600


@pytest.mark.slow
@pytest.mark.parametrize("task", ["mlm", "token"])
def test_a_rank_without_validation_records_runs_filler_forwards(nv_tiny: Path, tmp_path: Path, task: str) -> None:
    """A --val-data file of one protein on 2 ranks: rank 1 holds none, runs as many (unscored) forwards as rank 0
    (FSDP2 would hang otherwise) and the metrics count rank 0's protein alone. A validation set that is empty
    everywhere is refused."""
    rows = SECONDARY_STRUCTURE.read_text().splitlines()
    if task == "mlm":
        (tmp_path / "one.fasta").write_text(">one\n" + rows[1].split(",")[0] + "\n")
        data, validation = [str(DEMO_FASTA)], tmp_path / "one.fasta"
    else:
        (tmp_path / "one.csv").write_text("\n".join(rows[:2]) + "\n")
        data, validation = [str(SECONDARY_STRUCTURE), "--task", "token"], tmp_path / "one.csv"
    common = [
        "--model",
        str(nv_tiny),
        "--steps",
        "1",
        "--tokens-per-batch",
        "1024",
        "--max-length",
        "254",
        "--no-export",
    ]
    run_recipe(tmp_path / "run", *common, "--data", *data, "--val-data", str(validation))
    (record,) = validation_records(tmp_path / "run").values()
    if task == "mlm":
        alone = MLMStream(validation, 0, 1, 1024, 256, seed=VALIDATION_SEED, shuffle=False)
        assert record["val_count"] == sum(int((b.labels != -100).sum()) for b in alone.one_pass()) > 0
    else:
        assert record["val_count"] == min(len(rows[1].split(",")[0]), 254)
    empty = run_recipe(tmp_path / "empty", *common, "--data", *data, "--val-fraction", "1e-4", check=False)
    assert empty.returncode != 0 and "validation set (the --val-fraction records) is empty" in empty.stderr


def test_the_filler_batch_scores_nothing() -> None:
    """Ranks with fewer validation batches run `filler_batch`: one protein, every label ignored."""
    from nv_esm.data import IGNORE_INDEX
    from nv_esm.train.validation import filler_batch

    filler = filler_batch()
    assert filler.num_proteins == 1 and bool((filler.labels == IGNORE_INDEX).all())


def test_the_validation_line_shows_counts_in_full_and_metrics_to_four_digits():
    """`step N validation: ...`: a token count as a whole number ("29,418", not "2.942e+04"), a metric to 4
    significant digits, a metric that could not be computed as n/a."""
    from nv_esm.train.metrics import shown_value

    assert shown_value(29418.0) == "29,418"
    assert shown_value(29418) == "29,418"
    assert shown_value(3.50512) == "3.505"
    assert shown_value(0.0673712) == "0.06737"
    assert shown_value(1.0) == "1"
    assert shown_value(None) == "n/a"
