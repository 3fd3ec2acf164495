"""One chart of weak-scaling runs (`bench/recipe_checks.py scale`): tokens/s per GPU as a fraction of the one-GPU
run's, one group of bars per (model, tokens per GPU), one bar per layout and GPU count.

    python bench/plot_scale.py bench/results/scale_h100x4_650M_2026-11-27/scale_650M_*.json \
        --title "650M, 4 x H100" --out bench/results/scale_h100x4_650M_2026-11-27/scale.png

Needs matplotlib (not a dependency of the package: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def scaling_bars(results: list[dict]) -> tuple[list[str], dict[str, list[float | None]]]:
    """From `recipe_checks.py scale` JSONs: the group labels ("650M, 16k tokens/GPU") and, per run name other than
    the one-GPU run ("replicate_2gpu", ...), its tokens/s per GPU over the one-GPU run's in each group (None where the
    group has no such run, or it failed)."""
    groups, ratios = [], {}
    for result in results:
        for budget, runs in result["budgets"].items():
            one = runs["one_gpu"]["tokens_per_s_per_gpu"]
            groups.append(f"{result['shape']}, {int(budget) // 1024}k tokens/GPU")
            for name, run in runs.items():
                if name == "one_gpu" or not isinstance(run, dict) or "tokens_per_s_per_gpu" not in run:
                    continue
                ratios.setdefault(name, [None] * (len(groups) - 1))
                ratios[name].append(run["tokens_per_s_per_gpu"] / one)
            for values in ratios.values():
                values.extend([None] * (len(groups) - len(values)))
    return groups, ratios


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups, ratios = scaling_bars(results)
    names = sorted(ratios, key=lambda name: (int(name.rsplit("_", 1)[1].removesuffix("gpu")), name))
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, name in enumerate(names):
        for i, value in enumerate(ratios[name]):
            if value is not None:
                bar = ax.bar(i + (k - (len(names) - 1) / 2) * width, value, width, color=f"C{k}")
                ax.bar_label(bar, [f"{value:.2f}"], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.95, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("tokens/s per GPU / one GPU's")
    ax.set_ylim(0, 1.15)
    ax.set_title(title)
    labels = [name.replace("_", ", ").replace("gpu", " GPUs") for name in names]
    ax.legend([Patch(color=f"C{k}") for k in range(len(names))], labels, fontsize=8, ncols=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="recipe_checks.py scale JSONs")
    parser.add_argument("--title", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plot([json.loads(path.read_text()) for path in args.results], args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
