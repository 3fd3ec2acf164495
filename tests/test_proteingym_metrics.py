"""ProteinGym's metrics and their aggregation: each metric against scipy / scikit-learn or a plain loop of
the formula in ProteinGym's performance_DMS_benchmarks.py, the aggregation against a hand-built example, the
bootstrap against an independent loop that draws as pandas' DataFrame.sample does, the CSV files, the picture."""

from __future__ import annotations

import csv
import functools
import math
import operator
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pytest
from scipy.stats import spearmanr
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from nv_esm import plots
from nv_esm.proteingym_metrics import (
    BOOTSTRAP_SAMPLES,
    METRICS,
    AssayResult,
    assay_metrics,
    assay_result,
    category_bars,
    summarize,
    write_summary,
)


def random_assay(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(model scores, DMS_score, DMS_score_bin) of a random size (below 10 mutants at times, where NDCG's top 10% is
    empty), rounded to few decimals so both score columns hold ties, with both bin classes."""
    n = int(rng.integers(2, 12)) if rng.random() < 0.3 else int(rng.integers(12, 600))
    while True:
        dms = np.round(rng.normal(size=n), int(rng.integers(0, 3)))
        scores = np.round(rng.random() * dms + rng.normal(size=n), int(rng.integers(0, 3)))
        bins = rng.integers(0, 2, size=n)
        if np.ptp(dms) and np.ptp(scores) and 0 < bins.sum() < n:
            return scores, dms, bins


def plain_ndcg(dms: list[float], scores: list[float]) -> float:
    """calc_ndcg, written out: the top floor(n / 10) of the model's ranking (tied scores in row order), min-max gains,
    zero gains left out, discount log2(rank + 1), over the same sum of the best k gains; 0 when no term is left."""
    k = math.floor(len(dms) * 10 / 100)
    low, high = min(dms), max(dms)
    gains = [(d - low) / (high - low) for d in dms]
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]  # Python's sort is stable
    dcg = sum(gains[i] / math.log2(rank + 1) for rank, i in enumerate(ranked, start=1) if gains[i] != 0)
    best = sorted(gains, reverse=True)[:k]
    ideal = sum(g / math.log2(rank + 1) for rank, g in enumerate(best, start=1) if g != 0)
    kept = any(gains[i] != 0 for i in ranked)
    return dcg / ideal if kept else 0.0


def plain_percentile_90(values: list[float]) -> float:
    """numpy's linear percentile 90: the value at position (n - 1) * 0.9 of the sorted values, interpolated."""
    ordered = sorted(values)
    index, remainder = divmod((len(values) - 1) * 90, 100)
    if remainder == 0:
        return ordered[index]
    return ordered[index] + (ordered[index + 1] - ordered[index]) * remainder / 100


def plain_top_recall(dms: list[float], scores: list[float]) -> float:
    """calc_toprecall, written out: of the mutants at or above the DMS scores' 90th percentile, the share at or above
    the model scores' 90th percentile."""
    true_cut, model_cut = plain_percentile_90(dms), plain_percentile_90(scores)
    top = [i for i, d in enumerate(dms) if d >= true_cut]
    return sum(scores[i] >= model_cut for i in top) / len(top)


@pytest.mark.parametrize("seed", range(40))
def test_each_metric_equals_their_formula(seed):
    rng = np.random.default_rng(seed)
    scores, dms, bins = random_assay(rng)
    got = assay_metrics(list(scores), list(dms), list(bins), "assay")
    median = statistics.median(scores.tolist())
    expected = {
        "Spearman": spearmanr(dms, scores)[0],
        "AUC": roc_auc_score(bins, scores),
        "MCC": matthews_corrcoef(bins, [1 if s >= median else 0 for s in scores]),
        "NDCG": plain_ndcg(dms.tolist(), scores.tolist()),
        "Top_recall": plain_top_recall(dms.tolist(), scores.tolist()),
    }
    assert list(got) == list(METRICS)
    for metric, value in expected.items():
        assert abs(got[metric] - value) <= 1e-9, (metric, got[metric], value, len(dms))


def test_ties_at_the_median_are_predicted_positive_and_ndcg_needs_ten_mutants():
    """Their MCC cut-off is `score >= median`: with ties at the median, > would predict differently."""
    scores, bins = [1.0, 2.0, 2.0, 2.0, 3.0], [0, 1, 0, 1, 1]  # median 2: predicted 0,1,1,1,1
    got = assay_metrics(scores, [0.1, 0.5, 0.2, 0.4, 0.9], bins, "assay")
    assert got["MCC"] == pytest.approx(matthews_corrcoef(bins, [0, 1, 1, 1, 1]), abs=1e-12)
    assert got["MCC"] != pytest.approx(matthews_corrcoef(bins, [0, 0, 0, 0, 1]), abs=1e-3)
    assert got["NDCG"] == 0.0  # floor(5 * 10 / 100) = 0: nothing in the top 10%


@pytest.mark.parametrize(
    ("scores", "dms", "bins", "message"),
    [
        ([1.0, math.nan, 3.0], [1.0, 2.0, 3.0], [0, 1, 1], r"1 non-finite model score value\(s\), the first in row 1"),
        ([1.0, 2.0, 3.0], [1.0, math.inf, 3.0], [0, 1, 1], r"1 non-finite DMS_score value\(s\), the first in row 1"),
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0, 2, 1], "DMS_score_bin 2 in row 1 of the assay"),
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1, 1, 1], "every DMS_score_bin is 1; AUC and MCC need both classes"),
        ([2.0, 2.0, 2.0], [1.0, 2.0, 3.0], [0, 1, 1], "every model score is 2.0"),
        ([1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [0, 1, 1], "every DMS_score is 4.0"),
        (
            [1.0, 2.0],
            [1.0, 2.0, 3.0],
            [0, 1, 1],
            r"one value per mutant expected in each column, got shapes model scores \(2,\)",
        ),
    ],
)
def test_inputs_their_script_turns_into_nan_are_refused(scores, dms, bins, message):
    with pytest.raises(ValueError, match="^BLAT_ECOLX, column m: " + message) as error:
        assay_metrics(scores, dms, bins, "BLAT_ECOLX, column m")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="^BLAT_ECOLX, column (ok|m): " + message):
        assay_result("BLAT_ECOLX", "P1", "Activity", dms, bins, {"ok": [1.0, 2.5, 3.0][: len(dms)], "m": scores})


def with_values(name: str, uniprot: str, category: str, values: dict[str, float]) -> AssayResult:
    """An assay whose every metric of method `m` is `values[m]`."""
    return AssayResult(name, uniprot, category, 10, {m: dict.fromkeys(METRICS, v) for m, v in values.items()})


def test_aggregation_by_hand():
    """Rounded to 3 decimals, then per (UniProt, type) pair, per type, mean of the types; P1 has assays of two types
    and counts once in each; the standard error is of the difference to the best average (b's)."""
    assays = [
        with_values("D1", "P1", "Stability", {"a": 0.2, "b": 0.4}),
        with_values("D2", "P1", "Stability", {"a": 0.4, "b": 0.0}),
        with_values("D3", "P2", "Stability", {"a": 0.6, "b": 0.2}),
        with_values("D4", "P1", "Binding", {"a": 0.1, "b": 0.3}),
        with_values("D5", "P3", "Activity", {"a": 0.5004, "b": 0.9}),
    ]
    summary = summarize(assays, seed=3)
    assert summary.methods == ["a", "b"] and list(summary.metrics) == list(METRICS)
    for result in summary.metrics.values():
        assert result.pairs == [("P1", "Binding"), ("P1", "Stability"), ("P2", "Stability"), ("P3", "Activity")]
        np.testing.assert_allclose(result.pair_values, [[0.1, 0.3], [0.3, 0.2], [0.6, 0.2], [0.5, 0.9]], atol=1e-12)
        assert result.categories == ["Activity", "Binding", "Stability"]
        np.testing.assert_allclose(result.category_values, [[0.5, 0.9], [0.1, 0.3], [0.45, 0.2]], atol=1e-12)
        np.testing.assert_allclose(result.average, [1.05 / 3, 1.4 / 3], atol=1e-12)
        assert result.top_method == "b"
        # Only Stability's two pairs vary under resampling: a - b is 0.1 or 0.4 there, the mean of two draws has
        # variance 0.15^2 / 2, divided by 3 types; a alone 0.3 or 0.6 (the same spread), b alone 0.2 and 0.2.
        spread = 0.15 / math.sqrt(2) / 3
        assert result.standard_error[1] == 0 and result.standard_error_own[1] == pytest.approx(0, abs=1e-12)
        assert result.standard_error[0] == pytest.approx(spread, rel=0.05)
        assert result.standard_error_own[0] == pytest.approx(spread, rel=0.05)


def random_results(rng: np.random.Generator, methods: int = 0) -> list[AssayResult]:
    """Random metric values of 1 to 3 methods (or `methods`) on assays of random UniProt ids and types."""
    methods = [f"method {i}" for i in range(methods or int(rng.integers(1, 4)))]
    categories = ["Activity", "Binding", "Expression", "OrganismalFitness", "Stability"][: int(rng.integers(1, 6))]
    return [
        AssayResult(
            f"D{i}",
            f"P{int(rng.integers(0, 12))}",
            categories[i] if i < len(categories) else str(rng.choice(categories)),
            int(rng.integers(10, 1000)),
            {m: {metric: float(rng.uniform(-1, 1)) for metric in METRICS} for m in methods},
        )
        for i in range(int(rng.integers(len(categories), 30)))
    ]


@pytest.mark.parametrize("seed", range(2))
def test_bootstrap_equals_a_loop_drawing_as_pandas_sample(seed):
    """Their compute_bootstrap_standard_error_functional_categories, looped: for each metric in their order, each type
    in sorted order, 10,000 times `RandomState.choice(P, P, replace=True)` (DataFrame.sample(frac=1, replace=True)) of
    the type's pairs, the mean of the types' resampled means, its sample standard deviation."""
    rng = np.random.default_rng(seed)
    assays = random_results(rng)
    methods = list(assays[0].metrics)
    summary = summarize(assays, seed=seed + 11)
    random_state = np.random.RandomState(seed + 11)
    for metric in METRICS:
        result = summary.metrics[metric]
        pairs: dict[tuple[str, str], list[list[float]]] = {}
        for assay in assays:
            row = [round(assay.metrics[m][metric], 3) for m in methods]
            pairs.setdefault((assay.UniProt_ID, assay.selection_type), []).append(row)
        pair_means = {key: [statistics.fmean(column) for column in zip(*rows)] for key, rows in sorted(pairs.items())}
        categories = sorted({category for _, category in pair_means})
        by_category = {c: [v for (_, category), v in pair_means.items() if category == c] for c in categories}
        averages = [
            statistics.fmean(statistics.fmean(v[m] for v in by_category[c]) for c in categories)
            for m in range(len(methods))
        ]
        top = methods.index(result.top_method)
        assert averages[top] == pytest.approx(max(averages), abs=1e-12)
        np.testing.assert_allclose(result.average, averages, atol=1e-12)
        samples = [[0.0] * len(methods) for _ in range(BOOTSTRAP_SAMPLES)]
        for category in categories:
            rows = by_category[category]
            for sample in samples:
                drawn = [rows[i] for i in random_state.choice(len(rows), size=len(rows), replace=True)]
                for m in range(len(methods)):
                    sample[m] += statistics.fmean(row[m] - row[top] for row in drawn) / len(categories)
        expected = [statistics.stdev(sample[m] for sample in samples) for m in range(len(methods))]
        np.testing.assert_allclose(result.standard_error, expected, rtol=0, atol=1e-9)
        assert result.standard_error[top] == 0


def test_summarize_refuses_what_it_cannot_aggregate():
    one = with_values("D1", "P1", "Stability", {"a": 0.2})
    with pytest.raises(ValueError, match="^D1: the assay is listed twice$"):
        summarize([one, one])
    with pytest.raises(ValueError, match=r"^D2: methods \['b'\] differ from D1's: \['a'\]$"):
        summarize([one, with_values("D2", "P1", "Stability", {"b": 0.2})])
    with pytest.raises(ValueError, match="no assay"):
        summarize([])


def read_csv(path) -> list[list[str]]:
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_the_summary_files_are_laid_out_as_proteingyms(tmp_path):
    rng = np.random.default_rng(5)
    names = ("a, quoted", "b")  # a method name with a comma is quoted
    assays = [
        AssayResult(a.DMS_id, a.UniProt_ID, a.selection_type, a.number_mutants, dict(zip(names, a.metrics.values())))
        for a in random_results(rng, methods=2)
    ]
    summary = summarize(assays)
    (tmp_path / "Spearman").mkdir()
    (tmp_path / "Spearman" / "Summary_performance_DMS_substitutions_Spearman.csv").write_text("an older run\n")
    written = write_summary(summary, tmp_path)
    assert len(written) == 4 * len(METRICS) and all(path.is_file() for path in written)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(METRICS)
    for metric in METRICS:
        result, stem = summary.metrics[metric], f"DMS_substitutions_{metric}"
        assert sorted(p.name for p in (tmp_path / metric).iterdir()) == sorted(
            [f"{stem}_DMS_level.csv", f"{stem}_Uniprot_level.csv", f"{stem}_Uniprot_Selection_Type_level.csv"]
            + [f"Summary_performance_{stem}.csv"]
        )
        rows = read_csv(tmp_path / metric / f"{stem}_DMS_level.csv")
        assert rows[0] == ["DMS ID", "a, quoted", "b", "Number of Mutants", "Selection Type", "UniProt ID"]
        for row, assay in zip(rows[1:], assays, strict=True):
            values = [float(np.round(assay.metrics[name][metric], 3)) for name in names]  # pandas' round
            assert row == [assay.DMS_id, *map(str, values), str(assay.number_mutants)] + [
                assay.selection_type,
                assay.UniProt_ID,
            ]
        rows = read_csv(tmp_path / metric / f"{stem}_Uniprot_level.csv")
        assert rows[0] == ["a, quoted", "b", "Selection Type", "UniProt_ID"]
        assert [(r[3], r[2]) for r in rows[1:]] == result.pairs
        np.testing.assert_allclose([[float(v) for v in r[:2]] for r in rows[1:]], result.pair_values, atol=5e-4)
        rows = read_csv(tmp_path / metric / f"{stem}_Uniprot_Selection_Type_level.csv")
        assert [r[2] for r in rows] == ["Selection Type", *result.categories, "Average"]
        assert [float(v) for v in rows[-1][:2]] == [float(np.round(v, 3)) for v in result.average]
        rows = read_csv(tmp_path / metric / f"Summary_performance_{stem}.csv")
        assert rows[0] == [
            "Model_rank",
            "Model_name",
            f"Average_{metric}",
            f"Bootstrap_standard_error_{metric}",
            f"Bootstrap_standard_error_own_{metric}",
            *(f"Function_{c}" for c in result.categories),
        ]
        order = sorted(range(2), key=lambda m: -result.average[m])
        assert [r[:2] for r in rows[1:]] == [["1", summary.methods[order[0]]], ["2", summary.methods[order[1]]]]
        for row, m in zip(rows[1:], order):
            expected = [result.average[m], result.standard_error[m], result.standard_error_own[m]]
            expected += list(result.category_values[:, m])
            assert [float(v) for v in row[2:]] == [float(np.round(v, 3)) for v in expected]
        assert float(rows[1][3]) == 0.0  # the best method's difference to itself


def test_the_category_bars_are_a_png_matplotlib_reads_back(tmp_path, monkeypatch):
    import matplotlib.image

    assays = [
        with_values("D1", "P1", "Stability", {"masked-marginals": 0.2, "wt": 0.4}),
        with_values("D2", "P2", "Stability", {"masked-marginals": 0.4, "wt": -0.1}),
        with_values("D3", "P1", "Binding", {"masked-marginals": 0.7, "wt": 0.3}),
    ]
    categories, values = category_bars(summarize(assays), "Spearman")
    assert categories == ["Binding", "Stability", "Average"]
    assert list(values) == ["masked-marginals", "wt"]
    assert values["masked-marginals"] == pytest.approx([0.7, 0.3, 0.5], abs=1e-12)
    assert values["wt"] == pytest.approx([0.3, 0.15, 0.225], abs=1e-12)
    png = plots.plot_category_bars(categories, values, tmp_path / "spearman.png")
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["spearman.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plots.plot_category_bars(categories, values, tmp_path / "none.png") is None
    assert [p.name for p in tmp_path.iterdir()] == ["spearman.png"]


def test_a_mean_half_way_between_two_thousandths_rounds_as_their_pandas_mean():
    """pandas' groupby mean (pandas 1.5.1, their environment) sums with Kahan's compensation: the mean of 0.308,
    0.374, 0.695, 0.317 is 0.4235 there (correctly rounded, as math.fsum gives) and is written 0.424, where a plain
    left-to-right sum gives 0.42349999999999993 and 0.423. The same at the type level, over pairs."""
    values = [0.308, 0.374, 0.695, 0.317]
    plain_sum = functools.reduce(operator.add, values)  # left to right (Python >= 3.12's sum() compensates)
    assert float(np.round(plain_sum / 4, 3)) == 0.423  # the naive mean would round down
    expected = float(np.round(math.fsum(values) / 4, 3))
    assert expected == 0.424
    one_pair = [with_values(f"D{i}", "P1", "Stability", {"a": v}) for i, v in enumerate(values)]
    four_pairs = [with_values(f"D{i}", f"P{i}", "Stability", {"a": v}) for i, v in enumerate(values)]
    for assays, level in ((one_pair, "Uniprot_level"), (four_pairs, "Uniprot_Selection_Type_level")):
        summary = summarize(assays)
        assert summary.metrics["AUC"].category_values[0, 0] == math.fsum(values) / 4
        with TemporaryDirectory() as folder:
            write_summary(summary, Path(folder))
            rows = read_csv(Path(folder) / "AUC" / f"DMS_substitutions_AUC_{level}.csv")
        assert float(rows[1][0]) == expected, level
