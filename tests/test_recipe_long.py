"""Options of `nv-esm train` checked against the model: `--max-length N` trains on proteins of N residues whatever the
model's default guard (a crop the recipe was told to make is never refused by `max_protein_length`,
8,192 tokens by default), and LoRA on a fused module is refused with the options."""

from __future__ import annotations

import json
import random

import pytest
from test_recipe_edges import train
from test_recipe_train import DEMO_FASTA

from nv_esm.train.config import build_parser, config_from_args


@pytest.mark.slow
def test_a_protein_past_the_models_default_limit_trains_at_its_max_length(tmp_path, nv_tiny):
    """One random 8,200-residue protein (8,202 tokens, past the default 8,192) with --max-length 8200: one step runs
    on all of its tokens. On a197d12 every rank refused it ("max_length_q (8202) is longer than max_protein_length")."""
    rng = random.Random(0)
    residues = 8200
    fasta = tmp_path / "long.fasta"
    fasta.write_text(">long\n" + "".join(rng.choice("LAGVSERTIDPKQNFYMHWC") for _ in range(residues)) + "\n")
    args = ["--model", str(nv_tiny), "--data", str(fasta), "--steps", "1", "--no-export"]
    done = train(*args, "--tokens-per-batch", str(residues + 2), "--max-length", str(residues), out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["tokens"] == residues + 2


def test_lora_on_a_fused_module_is_refused_before_anything_loads(tiny_config):
    """`--lora-targets layernorm_qkv` (a fused TE module) is refused by the option checks, naming what to target
    instead; on a197d12 PEFT's generic error came only after the model loaded."""
    args = ["--config", str(tiny_config), "--data", str(DEMO_FASTA), "--steps", "1", "--out", "o", "--lora-rank", "4"]
    for target, instead in (("layernorm_qkv", '"query", "key", "value"'), ("layernorm_mlp", '"intermediate.dense"')):
        config = config_from_args(build_parser().parse_args([*args, "--lora-targets", "query", target]))
        with pytest.raises(
            ValueError, match=f"--lora-targets: a LoRA adapter on `{target}` is not supported.*{instead}"
        ):
            config.validate()
    config_from_args(build_parser().parse_args([*args, "--lora-targets", "query", "value"])).validate()
