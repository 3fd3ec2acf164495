"""Write the recipe's demo data: synthetic proteins and synthetic labels, for smoke tests and demos only.

- `demo.fasta`: 600 random sequences that look like proteins (they have no biological meaning): lengths drawn
  from a log-normal distribution (median 270 residues, clipped to 20..1500, so a few exceed 1024 and get
  cropped), residues drawn independently from UniProtKB background amino-acid frequencies, each starting with M.
- `secondary_structure.csv` (`sequence,labels`, 200 rows): per-residue H/E/C labels from a made-up rule, a
  majority vote over a 5-residue window of helix formers (AELMQKRH -> H) and strand formers (VIYFWT -> E).
- `solubility.csv` (`sequence,label`, 200 rows): 1 when the fraction of charged residues (DEKR) is above the
  median of the set, else 0, also a made-up rule.

The labels are deterministic functions of the sequence, so a model can learn them; they say nothing about real
proteins. A fixed seed makes the output byte-identical on every run:

    python recipes/make_demo_data.py [--out-dir recipes/demo_data]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from pathlib import Path

SEED = 20240607
# Background amino-acid frequencies (%) of UniProtKB/Swiss-Prot, rounded.
AMINO_ACID_PERCENT = {
    "L": 9.9, "A": 8.3, "G": 7.1, "V": 6.9, "E": 6.8, "S": 6.6, "I": 5.9, "K": 5.8, "R": 5.5, "D": 5.5,
    "T": 5.3, "P": 4.7, "N": 4.1, "Q": 3.9, "F": 3.9, "Y": 2.9, "M": 2.4, "H": 2.3, "C": 1.4, "W": 1.1,
}  # fmt: skip
HELIX_FORMERS, STRAND_FORMERS, CHARGED = set("AELMQKRH"), set("VIYFWT"), set("DEKR")
LINE_WIDTH = 60


def random_protein(rng: random.Random, median: float, sigma: float, low: int, high: int) -> str:
    """M + residues drawn from the background frequencies; length log-normal around `median`, clipped."""
    length = min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))
    residues = rng.choices(list(AMINO_ACID_PERCENT), weights=list(AMINO_ACID_PERCENT.values()), k=length - 1)
    return "M" + "".join(residues)


def secondary_structure(sequence: str) -> str:
    """Synthetic H/E/C label per residue: H if >= 3 of the 5 residues around it are helix formers, else E if
    >= 2 are strand formers, else C."""
    labels = []
    for i in range(len(sequence)):
        window = sequence[max(0, i - 2) : i + 3]
        if sum(r in HELIX_FORMERS for r in window) >= 3:
            labels.append("H")
        elif sum(r in STRAND_FORMERS for r in window) >= 2:
            labels.append("E")
        else:
            labels.append("C")
    return "".join(labels)


def write_fasta(path: Path, sequences: list[str]) -> None:
    lines = [
        "; Synthetic protein sequences for nv-esm recipe demos and tests; they have no biological meaning.",
        f"; Written by recipes/make_demo_data.py (seed {SEED}): lengths log-normal (median 270, sigma 0.6,",
        "; clipped to 20..1500), residues i.i.d. from UniProtKB background amino-acid frequencies, first residue M.",
    ]
    for number, sequence in enumerate(sequences, 1):
        lines.append(f">DEMO_{number:06d} synthetic protein, length {len(sequence)}")
        lines.extend(sequence[i : i + LINE_WIDTH] for i in range(0, len(sequence), LINE_WIDTH))
    path.write_text("\n".join(lines) + "\n", newline="\n")


def write_csv(path: Path, header: str, rows: list[tuple[str, str]]) -> None:
    path.write_text("\n".join([header, *(f"{a},{b}" for a, b in rows)]) + "\n", newline="\n")


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    write_fasta(out_dir / "demo.fasta", [random_protein(rng, 270, 0.6, 20, 1500) for _ in range(600)])

    structure = [random_protein(rng, 120, 0.5, 30, 400) for _ in range(200)]
    write_csv(out_dir / "secondary_structure.csv", "sequence,labels", [(s, secondary_structure(s)) for s in structure])

    solubility = [random_protein(rng, 120, 0.5, 30, 400) for _ in range(200)]
    charged = [sum(r in CHARGED for r in s) / len(s) for s in solubility]
    median = statistics.median(charged)
    labels = [str(int(c > median)) for c in charged]
    write_csv(out_dir / "solubility.csv", "sequence,label", list(zip(solubility, labels)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "demo_data")
    main(parser.parse_args().out_dir)
