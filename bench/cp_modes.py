"""Diagnosis of Transformer Engine's context-parallel path (2 ranks, NCCL): the largest logit difference between
the unsplit model and the `--cp 2` split model on the same packed batch, per mode (train/eval, with/without
gradients) and per set of protein lengths (`tests/test_gpu_tensor_parallel.py`'s mixed lengths, only the long
ones, only the short ones). Needs the test helpers on the path:

    PYTHONPATH=$PWD:$PWD/tests torchrun --nproc-per-node 2 bench/cp_modes.py --out $OUT/cp_modes.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import transformer_engine.pytorch  # noqa: F401  (before cuDNN loads)

from conftest import make_hf_model, make_nv_model, pack_batch, random_proteins

LENGTHS = {"mixed": [1, 300, 37, 2, 1026, 129, 64, 5], "long": [300, 1026, 129, 64], "short": [1, 2, 5, 37]}
MODES = {"eval": (False, False), "eval_grad": (False, True), "train_no_grad": (True, False), "train": (True, True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    hf = make_hf_model("esm2_8M", seed=100)
    models = {}
    for name in ("whole", "split"):
        model = make_nv_model(hf, backend="te", attn_input_format="thd", cuda_graphs=False).cuda().to(torch.bfloat16)
        if name == "split":
            model.enable_context_parallel(dist.group.WORLD)
        models[name] = model
    results = {}
    for lengths_name, lengths in LENGTHS.items():
        proteins = random_proteins(lengths, seed=130, mask_fraction=0.15)
        packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in pack_batch(proteins).items()}
        for mode, (training, grad) in MODES.items():
            logits = {}
            for name, model in models.items():
                model.train(training)
                with torch.set_grad_enabled(grad):
                    logits[name] = model(**packed).logits[0].detach().float()
            results[f"{lengths_name}/{mode}"] = (logits["split"] - logits["whole"]).abs().max().item()
    if rank == 0:
        args.out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
