"""ProteinGym's zero-shot substitution metrics and their aggregation (the summary of `nv-esm proteingym`).

    from nv_esm.proteingym_metrics import assay_result, summarize, write_summary
    results = [assay_result(dms_id, uniprot_id, selection_type, dms_scores, dms_bins, {"masked-marginals": scores})
               for ... in assays]
    summary = summarize(results)                  # summary.metrics["Spearman"].average: [methods]
    write_summary(summary, out / "summary")       # CSV files laid out as ProteinGym's benchmarks/ folder
    plots.plot_category_bars(*category_bars(summary, "Spearman"), out / "spearman.png")

Each rule follows OATML-Markslab/ProteinGym's `proteingym/performance_DMS_benchmarks.py` (its `main`, `calc_ndcg`,
`calc_toprecall`, `minmax` and `compute_bootstrap_standard_error_functional_categories`), without its pandas:

- per assay and method (`assay_metrics`): Spearman's rho of the model score with `DMS_score`; the ROC AUC of the model
  score for `DMS_score_bin`; the MCC of `score >= median(score)` (ties at the median count as 1) with `DMS_score_bin`;
  NDCG over the model's top `floor(n * 10 / 100)` mutants with min-max normalised `DMS_score` as gains (tied model
  scores in row order, where theirs depends on numpy's unstable sort: see `ndcg`); the recall of the true top 10%
  (`DMS_score >= 90th percentile`, ties all in) among the model's top 10% (same rule);
- aggregation (`summarize`): each per-assay value rounded to 3 decimals (as their table is, before they average it);
  the mean per (UniProt_ID, coarse_selection_type) pair; the mean per coarse_selection_type; the mean over types;
- the bootstrap standard error (10,000 samples): within each selection type, its pairs are resampled with
  replacement; a sample's value is the mean over types of the resampled types' means; the standard error is the
  standard deviation (ddof 1) over samples of that value for each method's difference to the method with the best
  average (ProteinGym's column, 0 for the best method itself), and, in a column of ours, of the method's own value.

Checked against their script run in their environment (environments/proteingym_env.txt: pandas 1.5.1, numpy 1.24.4,
scipy 1.10.1, scikit-learn 1.3.2) on random assays: every per-assay value within 1e-15 (NDCG on untied scores), every
mean bit for bit, the bootstrap standard error bit for bit when their script starts with `np.random.seed(seed)`.

Inputs they would turn into NaN or a meaningless number (non-finite scores, a constant score column, a single
`DMS_score_bin` class) are refused with a ValueError naming the assay and the column instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nv_esm import rank_statistics
from nv_esm.checkpoint_io import write_atomically

METRICS = ("Spearman", "AUC", "MCC", "NDCG", "Top_recall")
"""ProteinGym's metric names, in the order their script computes (and bootstraps) them."""
TOP_PERCENT = 10
"""The top fraction (in percent) that NDCG and Top_recall look at (`calc_ndcg`'s `top`, `calc_toprecall`'s)."""
DECIMALS = 3
"""Per-assay values are rounded to this many decimals before they are averaged (their `.round(3)` of the table)."""
BOOTSTRAP_SAMPLES = 10_000
"""Resamples per metric (`number_assay_reshuffle`)."""


# ----------------------------------------------------------------------------------------------------------------
# One assay
# ----------------------------------------------------------------------------------------------------------------


def mcc(model_scores: np.ndarray, dms_bins: np.ndarray) -> float:
    """Matthews correlation of `model_scores >= median(model_scores)` (their `x >= median_cutoff`: ties at the median
    are predicted 1) with the bins; 0 where a marginal is empty (`sklearn.metrics.matthews_corrcoef`'s rule)."""
    predicted = model_scores >= np.median(model_scores)
    true = dms_bins == 1
    tp, tn = float(np.sum(predicted & true)), float(np.sum(~predicted & ~true))
    fp, fn = float(np.sum(predicted & ~true)), float(np.sum(~predicted & true))
    denominator = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)
    return (tp * tn - fp * fn) / math.sqrt(denominator) if denominator else 0.0


def ndcg(dms_scores: np.ndarray, model_scores: np.ndarray) -> float:
    """`calc_ndcg` with its defaults (quantile, top 10%): k = floor(n * 10 / 100) (0 below 10 mutants, and then
    NDCG = 0); gains = min-max normalised DMS scores; the model's ranks 1..n by descending score; DCG = sum of
    gain / log2(rank + 1) over ranks <= k with a non-zero gain (0 if there is none); IDCG the same over the k largest
    gains; NDCG = DCG / IDCG. Tied model scores are ranked in row order (a stable sort): theirs ranks them as numpy's
    default, unstable `argsort` happens to order them, which differs between numpy versions and CPUs (numpy 1.24,
    their environment's, and numpy 2 on AVX-512 give NDCGs 0.2 apart on heavily tied scores); row order is one of the
    orders their sort may produce. Without ties the two are the same."""
    k = int(np.floor(len(dms_scores) * (TOP_PERCENT / 100)))
    gains = (dms_scores - dms_scores.min()) / (dms_scores.max() - dms_scores.min())
    ranks = np.empty(len(model_scores), dtype=np.int64)
    ranks[np.argsort(-model_scores, kind="stable")] = np.arange(1, len(model_scores) + 1)
    kept = (ranks <= k) & (gains != 0)
    if not kept.any():
        return 0.0
    dcg = np.sum(gains[kept] / np.log2(ranks[kept] + 1))
    ideal = np.sort(gains)[::-1][:k]  # which of tied gains makes the cut changes no term
    ideal_ranks = np.arange(1, k + 1)[ideal != 0]
    return float(dcg / np.sum(ideal[ideal != 0] / np.log2(ideal_ranks + 1)))


def top_recall(dms_scores: np.ndarray, model_scores: np.ndarray) -> float:
    """`calc_toprecall`: the share of the true top 10% (`dms >= np.percentile(dms, 90)`, linear interpolation; ties
    at the cut all in) that is also in the model's top 10% (same rule on the model scores)."""
    cut = 100 - TOP_PERCENT
    true_top = dms_scores >= np.percentile(dms_scores, cut)
    model_top = model_scores >= np.percentile(model_scores, cut)
    return float(np.sum(true_top & model_top) / np.sum(true_top))


def assay_metrics(
    model_scores: Sequence[float], dms_scores: Sequence[float], dms_bins: Sequence[float], label: str
) -> dict[str, float]:
    """ProteinGym's five metrics (`METRICS`: Spearman, AUC, MCC, NDCG, Top_recall) of one method on one assay, as
    `performance_DMS_benchmarks.py`'s `main` computes them, at full precision. `model_scores [n]` (higher = fitter),
    `dms_scores [n]` (`DMS_score`) and `dms_bins [n]` (`DMS_score_bin`, 0 or 1) are the assay's rows in one order.

    Refused (ValueError starting with `label`, e.g. "BLAT_ECOLX_Stiffler_2015, column masked-marginals"): lengths that
    differ, a non-finite value, bins other than 0/1 or of one class only (their AUC would be NaN, their MCC 0), a
    constant score or DMS column (their Spearman NaN, top recall 1)."""
    scores, dms, bins = (np.asarray(values, dtype=np.float64) for values in (model_scores, dms_scores, dms_bins))
    if not scores.ndim == dms.ndim == bins.ndim == 1 or not len(scores) == len(dms) == len(bins):
        shapes = f"model scores {scores.shape}, DMS_score {dms.shape}, DMS_score_bin {bins.shape}"
        raise ValueError(f"{label}: one value per mutant expected in each column, got shapes {shapes}")
    for name, values in (("model score", scores), ("DMS_score", dms), ("DMS_score_bin", bins)):
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            raise ValueError(f"{label}: {len(bad)} non-finite {name} value(s), the first in row {bad[0]} of the assay")
    odd = np.flatnonzero((bins != 0) & (bins != 1))
    if len(odd):
        raise ValueError(f"{label}: DMS_score_bin {bins[odd[0]]:g} in row {odd[0]} of the assay (0 or 1 expected)")
    if bins.min() == bins.max():
        raise ValueError(f"{label}: every DMS_score_bin is {bins[0]:g}; AUC and MCC need both classes")
    for name, values in (("model score", scores), ("DMS_score", dms)):
        if values.min() == values.max():
            raise ValueError(f"{label}: every {name} is {float(values[0])!r}; a constant column has no ranking")
    return {
        "Spearman": rank_statistics.spearman(dms, scores),  # `scipy.stats.spearmanr`
        "AUC": rank_statistics.auroc(scores, bins == 1),  # `sklearn.metrics.roc_auc_score`
        "MCC": mcc(scores, bins),
        "NDCG": ndcg(dms, scores),
        "Top_recall": top_recall(dms, scores),
    }


@dataclass(frozen=True)
class AssayResult:
    """One assay's metrics for every method: `metrics[method][metric]` (full precision), with what the aggregation
    groups by (the reference file's `UniProt_ID` and `coarse_selection_type`) and the number of mutants."""

    DMS_id: str
    UniProt_ID: str
    selection_type: str
    number_mutants: int
    metrics: dict[str, dict[str, float]]


def assay_result(
    DMS_id: str,
    UniProt_ID: str,
    selection_type: str,
    dms_scores: Sequence[float],
    dms_bins: Sequence[float],
    scores: Mapping[str, Sequence[float]],
) -> AssayResult:
    """`assay_metrics` of every method's `scores[method] [n]` (a score column of the assay's CSV) on one assay."""
    metrics = {
        method: assay_metrics(values, dms_scores, dms_bins, f"{DMS_id}, column {method}")
        for method, values in scores.items()
    }
    return AssayResult(DMS_id, UniProt_ID, selection_type, len(dms_scores), metrics)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSummary:
    """One metric aggregated as ProteinGym's `main` does, each array's last axis over `Summary.methods`.

    pairs / pair_values [P, M]: the (UniProt_ID, selection type) pairs, sorted, and the mean of their assays' rounded
        values (their `groupby(['UniProt_ID', 'Selection Type']).mean()`);
    categories / category_values [C, M]: the selection types, sorted, and the mean of their pairs' values;
    average [M]: the mean over selection types (their `Average_<metric>`);
    top_method: the method with the highest average (the first of equals), the reference of `standard_error`;
    standard_error [M]: the bootstrap standard error of each method's average minus the top method's (their
        `Bootstrap_standard_error_<metric>`; 0 for the top method, and so for a single method);
    standard_error_own [M]: the same bootstrap samples' standard error of the method's own average (not theirs)."""

    metric: str
    pairs: list[tuple[str, str]]
    pair_values: np.ndarray
    categories: list[str]
    category_values: np.ndarray
    average: np.ndarray
    top_method: str
    standard_error: np.ndarray
    standard_error_own: np.ndarray


@dataclass(frozen=True)
class Summary:
    """Every metric of `METRICS` aggregated over `assays` (in the order given) for `methods` (their order), the
    bootstrap drawn from `numpy.random.RandomState(seed)`."""

    methods: list[str]
    assays: list[AssayResult]
    metrics: dict[str, MetricSummary]
    seed: int


def summarize(assays: Sequence[AssayResult], seed: int = 0) -> Summary:
    """Aggregate per-assay results as ProteinGym's `main` does (see the module's docstring), with the bootstrap of
    `compute_bootstrap_standard_error_functional_categories`: for each metric in `METRICS`' order, for each selection
    type in sorted order, `BOOTSTRAP_SAMPLES` draws of its pairs' row indices with replacement
    (`RandomState.randint(0, P_c, (samples, P_c))`, the draws pandas' `DataFrame.sample(frac=1.0, replace=True)`
    makes from numpy's global RandomState; their script never seeds it: run after `np.random.seed(seed)`, it draws
    these samples). Every assay must hold the same methods; DMS ids must be unique. Give the assays in the
    reference file's order: pandas sums a pair's assays in that order (the last bit of a mean, and so a rounded
    half-way value, can depend on it)."""
    if not assays:
        raise ValueError("no assay to summarize")
    methods = list(assays[0].metrics)
    seen: set[str] = set()
    for assay in assays:
        if assay.DMS_id in seen:
            raise ValueError(f"{assay.DMS_id}: the assay is listed twice")
        seen.add(assay.DMS_id)
        if list(assay.metrics) != methods:
            raise ValueError(
                f"{assay.DMS_id}: methods {list(assay.metrics)} differ from {assays[0].DMS_id}'s: {methods}"
            )
    random_state = np.random.RandomState(seed)
    metrics = {metric: _summarize_metric(metric, assays, methods, random_state) for metric in METRICS}
    return Summary(methods, list(assays), metrics, seed)


def _summarize_metric(
    metric: str, assays: Sequence[AssayResult], methods: list[str], random_state: np.random.RandomState
) -> MetricSummary:
    values = np.round([[assay.metrics[method][metric] for method in methods] for assay in assays], DECIMALS)
    pair_of = [(assay.UniProt_ID, assay.selection_type) for assay in assays]
    pairs = sorted(set(pair_of))
    pair_values = np.stack([_kahan_mean(values[[p == pair for p in pair_of]]) for pair in pairs])
    categories = sorted({category for _, category in pairs})
    members = [np.array([category == c for _, c in pairs]) for category in categories]
    category_values = np.stack([_kahan_mean(pair_values[member]) for member in members])
    average = category_values.mean(axis=0)
    top = int(np.argmax(average))
    differences = pair_values - pair_values[:, top : top + 1]
    sampled = np.zeros((2, len(methods), BOOTSTRAP_SAMPLES))  # [difference to the top method | own, M, samples]
    for member in members:
        draws = random_state.randint(0, int(member.sum()), size=(BOOTSTRAP_SAMPLES, int(member.sum())))
        for which, table in enumerate((differences, pair_values)):
            for m, column in enumerate(table[member].T):
                sampled[which, m] += column[draws].mean(axis=1)
    sampled /= len(categories)
    standard_error, standard_error_own = sampled.std(axis=2, ddof=1)
    return MetricSummary(
        metric,
        pairs,
        pair_values,
        categories,
        category_values,
        average,
        methods[top],
        standard_error,
        standard_error_own,
    )


def _kahan_mean(rows: np.ndarray) -> np.ndarray:
    """`[M]` mean of `rows [k, M]`, summed in row order with Kahan's compensation as pandas' groupby mean sums (their
    per-pair and per-type means), so a mean that lies half-way between two 3-decimal values rounds as theirs does."""
    total, compensation = np.zeros(rows.shape[1]), np.zeros(rows.shape[1])
    for row in rows:
        corrected = row - compensation
        updated = total + corrected
        compensation = (updated - total) - corrected
        total = updated
    return total / len(rows)


def category_bars(summary: Summary, metric: str = "Spearman") -> tuple[list[str], dict[str, list[float]]]:
    """The selection types then `Average`, and each method's values of `metric` at them: the input of
    `nv_esm.plots.plot_category_bars`."""
    result = summary.metrics[metric]
    groups = [*result.categories, "Average"]
    return groups, {
        m: [*map(float, result.category_values[:, i]), float(result.average[i])] for i, m in enumerate(summary.methods)
    }


# ----------------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------------


def write_summary(summary: Summary, folder: Path) -> list[Path]:
    """Write, for each metric, `folder/<metric>/` with the files ProteinGym's `benchmarks/DMS_zero_shot/
    substitutions/<metric>/` holds, named as theirs, values rounded to 3 decimals as theirs (columns: one per method):

    - `DMS_substitutions_<metric>_DMS_level.csv`: a row per assay (`DMS ID`, methods, `Number of Mutants`,
      `Selection Type`, `UniProt ID`);
    - `DMS_substitutions_<metric>_Uniprot_level.csv`: a row per (UniProt_ID, selection type) pair (methods,
      `Selection Type`, `UniProt_ID`; theirs repeats the UniProt mean on each of its assays' rows);
    - `DMS_substitutions_<metric>_Uniprot_Selection_Type_level.csv`: a row per selection type, then `Average`;
    - `Summary_performance_DMS_substitutions_<metric>.csv`: a row per method, best average first (`Model_rank`,
      `Model_name`, `Average_<metric>`, `Bootstrap_standard_error_<metric>`, `Bootstrap_standard_error_own_<metric>`,
      `Function_<selection type>`...).

    Files already there are replaced (each written whole under a temporary name, then renamed). Returns the paths."""
    written = []
    for metric, result in summary.metrics.items():
        (folder / metric).mkdir(parents=True, exist_ok=True)
        stem = f"DMS_substitutions_{metric}"
        for name, rows in (
            (f"{stem}_DMS_level.csv", _assay_rows(summary, metric)),
            (f"{stem}_Uniprot_level.csv", _pair_rows(summary.methods, result)),
            (f"{stem}_Uniprot_Selection_Type_level.csv", _category_rows(summary.methods, result)),
            (f"Summary_performance_{stem}.csv", _summary_rows(summary.methods, result)),
        ):
            path = folder / metric / name
            write_atomically(path, "".join(",".join(_cell(value) for value in row) + "\n" for row in rows))
            written.append(path)
    return written


def _assay_rows(summary: Summary, metric: str) -> list[list]:
    header = ["DMS ID", *summary.methods, "Number of Mutants", "Selection Type", "UniProt ID"]
    return [header] + [
        [a.DMS_id, *(a.metrics[m][metric] for m in summary.methods), a.number_mutants, a.selection_type, a.UniProt_ID]
        for a in summary.assays
    ]


def _pair_rows(methods: list[str], result: MetricSummary) -> list[list]:
    rows = [[*values, category, uniprot] for (uniprot, category), values in zip(result.pairs, result.pair_values)]
    return [[*methods, "Selection Type", "UniProt_ID"], *rows]


def _category_rows(methods: list[str], result: MetricSummary) -> list[list]:
    rows = [[*values, category] for category, values in zip(result.categories, result.category_values)]
    return [[*methods, "Selection Type"], *rows, [*result.average, "Average"]]


def _summary_rows(methods: list[str], result: MetricSummary) -> list[list]:
    metric = result.metric
    header = ["Model_rank", "Model_name", f"Average_{metric}", f"Bootstrap_standard_error_{metric}"]
    header += [f"Bootstrap_standard_error_own_{metric}", *(f"Function_{c}" for c in result.categories)]
    order = sorted(range(len(methods)), key=lambda m: -result.average[m])  # stable: equals keep the methods' order
    rows = [
        [rank, methods[m], result.average[m], result.standard_error[m], result.standard_error_own[m]]
        + list(result.category_values[:, m])
        for rank, m in enumerate(order, start=1)
    ]
    return [header, *rows]


def _cell(value: object) -> str:
    """A CSV cell: a float rounded to `DECIMALS` as their files hold it, a name quoted where it needs quotes."""
    if isinstance(value, (float, np.floating)):
        return repr(float(np.round(value, DECIMALS)))
    text = str(value)
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n\r') else text
