"""Options of `nv-esm train` checked against the model: `--max-length N` trains on proteins of N residues whatever the
model's default guard (a crop the recipe was told to make is never refused by `max_protein_length`,
8,192 tokens by default), and LoRA on a fused module is refused with the options."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
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
    done = train(*args, "--token-budget", str(residues + 2), "--max-length", str(residues), out=tmp_path / "run")
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


def test_context_parallel_on_te_refuses_data_holding_short_proteins(tmp_path: Path) -> None:
    """`--cp` on Transformer Engine: every rank learns the data's shortest protein (an all-reduce of its streams')
    and refuses data holding one under 64 residues before the model loads, naming where; cropping counts (a
    protein is as long as `--max-length` makes it); the PyTorch twin and runs without `--cp` take any length."""
    import torch.distributed as dist

    from modeling_nv_esm_parallel import TE_CONTEXT_PARALLEL_MIN_TOKENS
    from nv_esm.data import MLMStream
    from nv_esm.train.feed import refuse_short_proteins_for_context_parallel
    from nv_esm.train.parallel import Dist

    class Mesh:
        mesh_dim_names = ("dp_shard", "cp")

        def size(self, index: int) -> int:
            return (1, 2)[index]

    fasta = tmp_path / "data.fasta"
    fasta.write_text(">a\n" + "A" * 100 + "\n>b\n" + "C" * 63 + "\n>c\n" + "D" * 300 + "\n")
    streams = [MLMStream([fasta], index, 2, token_budget=512, max_length=256) for index in range(2)]
    assert sorted(stream.shortest_tokens() for stream in streams) == [65, 102]  # b in one stream, a in the other
    assert MLMStream([fasta], 0, 1, token_budget=512, max_length=40).shortest_tokens() == 40  # cropped
    world = Dist(0, 2, torch.device("cpu"), Mesh())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="--data holds a protein of 65 tokens"):
            refuse_short_proteins_for_context_parallel(streams, world, "te", "--data")
        long_only = [stream for stream in streams if stream.shortest_tokens() == 102]  # a and c
        refuse_short_proteins_for_context_parallel(long_only, world, "te", "--data")
        refuse_short_proteins_for_context_parallel(streams, world, "torch", "--data")
        refuse_short_proteins_for_context_parallel(streams, Dist(0, 2, torch.device("cpu"), None), "te", "--data")
        refuse_short_proteins_for_context_parallel([], world, "te", "the validation set")
    finally:
        dist.destroy_process_group()
    assert TE_CONTEXT_PARALLEL_MIN_TOKENS == 66
