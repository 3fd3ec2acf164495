"""`nv-esm train --max-length N` trains on proteins of N residues whatever the model's default guard (issue 44, item
2): a crop the recipe was told to make is never refused by `max_protein_length` (8,192 tokens by default)."""

from __future__ import annotations

import json
import random

from test_recipe_edges import train


def test_a_protein_past_the_models_default_limit_trains_at_its_max_length(tmp_path, nv_tiny):
    """One random 8,200-residue protein (8,202 tokens, past the default 8,192) with --max-length 8200: one step runs
    on all of its tokens. On a197d12 every rank refused it ("max_length_q (8202) is longer than max_protein_length")."""
    rng = random.Random(0)
    residues = 8200
    fasta = tmp_path / "long.fasta"
    fasta.write_text(">long\n" + "".join(rng.choice("LAGVSERTIDPKQNFYMHWC") for _ in range(residues)) + "\n")
    args = ["--model", str(nv_tiny), "--data", str(fasta), "--steps", "1", "--no-export"]
    done = train(*args, "--token-budget", str(residues + 2), "--max-length", str(residues), out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["tokens"] == residues + 2
