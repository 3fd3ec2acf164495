"""Rank statistics shared by the commands and the trainer: average ranks, Spearman's rho and the ROC AUC.

    from nv_esm.rank_statistics import auroc, spearman
    spearman([0.1, 0.4, 0.3], [1.0, 3.0, 2.0])  # 1.0
    auroc([0.2, 0.9, 0.4], [False, True, False])  # 1.0

Inputs are anything `numpy.asarray` reads (lists, numpy arrays, CPU tensors) of `[n]` numbers; the results are
Python floats, or None where the statistic is undefined.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def average_ranks(values: Any) -> np.ndarray:
    """`[n]` float64 ranks 1..n of `values [n]`, tied values sharing the mean of their ranks."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    counts = np.diff(np.r_[starts, len(values)])
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(starts + (counts + 1) / 2, counts)
    return ranks


def spearman(x: Any, y: Any) -> float | None:
    """Spearman's rho of `x [n]` and `y [n]` (`scipy.stats.spearmanr`): the Pearson correlation of their average
    ranks; None for n < 2 or a constant side."""
    if len(x) < 2:
        return None
    rank_x, rank_y = average_ranks(x), average_ranks(y)
    rank_x, rank_y = rank_x - rank_x.mean(), rank_y - rank_y.mean()
    spread = math.sqrt((rank_x @ rank_x) * (rank_y @ rank_y))
    return float(rank_x @ rank_y / spread) if spread else None


def auroc(scores: Any, positives: Any) -> float | None:
    """Area under the ROC curve of `scores [n]` for the boolean `positives [n]` (`sklearn.metrics.roc_auc_score`:
    Mann-Whitney U / (n+ n-), a tie between a positive and a negative counted half); None without both classes."""
    positives = np.asarray(positives, dtype=bool)
    num_positive = int(positives.sum())
    num_negative = len(positives) - num_positive
    if not num_positive or not num_negative:
        return None
    rank_sum = average_ranks(scores)[positives].sum()
    return float((rank_sum - num_positive * (num_positive + 1) / 2) / (num_positive * num_negative))
