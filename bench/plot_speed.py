"""One chart of a `bench/benchmark.py` run: k unpadded tokens/s per step kind, one bar per variant.

    python bench/plot_speed.py bench/results/graphs_h100/benchmark.json     # writes benchmark.png beside it

Needs matplotlib (not a dependency of the package: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LABELS = {
    "transformers": "transformers (sdpa, padded)",
    "nv_thd": "NVEsm packed",
    "nv_thd_unchecked": "NVEsm packed, eager",
    "nv_thd_fp8": "NVEsm packed FP8, eager",
    "nv_thd_graphs": "NVEsm packed, CUDA graphs",
    "nv_thd_graphs_fp8": "NVEsm packed FP8, CUDA graphs",
}


def plot(results: list[dict], path: Path, title: str) -> None:
    """Grouped bars: x = (shape, mode, proteins per step), one bar per variant in run order; OOM marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "tokens_per_second" in r or r.get("oom")]
    groups = sorted({(r["shape"], r["mode"], r["proteins"]) for r in rows}, key=lambda g: (g[0], g[1] != "train", g[2]))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, variant in enumerate(variants):
        for i, group in enumerate(groups):
            match = [r for r in rows if r["variant"] == variant and (r["shape"], r["mode"], r["proteins"]) == group]
            if not match:
                continue
            x = i + (k - (len(variants) - 1) / 2) * width
            value = 0.0 if match[0]["oom"] else match[0]["tokens_per_second"] / 1e3
            ax.bar(x, value, width, color=f"C{k}", label=LABELS.get(variant, variant) if i == 0 else None)
            ax.text(x, value, "OOM" if match[0]["oom"] else f"{value:.0f}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)), [f"{shape} {mode}\n{proteins} proteins/step" for shape, mode, proteins in groups])
    ax.set_ylabel("k unpadded tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="benchmark.json of a bench/benchmark.py run")
    args = parser.parse_args()
    run = json.loads(args.results.read_text())
    meta = run["meta"]
    plot(run["results"], args.results.with_suffix(".png"), f"ESM-2 throughput, {meta['device']}, {meta['date']}")


if __name__ == "__main__":
    main()
