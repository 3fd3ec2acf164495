"""Transformer Engine's tensor parallelism (`set_parallel_mode`, sequence parallelism) and context parallelism
(THD; an all-to-all over heads, or an all-gather where the heads do not divide: `ContextParallel.te_exchange`)
in NVEsm, 2 processes: each rank's outputs against transformers and the unsplit TE model, and its gradients, put
back together, against the unsplit model's (tests/test_tensor_parallel.py checks the PyTorch twin the same way on
CPU).

With two GPUs the ranks talk over NCCL, one GPU each. With one GPU both ranks share it over gloo (NCCL refuses two
ranks on one device): slower, the same numbers, for tensor parallelism; TE's context-parallel attention needs
NCCL (its ring aborted over gloo with gloo::IoException on an H100), so that check needs two.

Tolerances. Tensor parallelism in fp32 (TE's GEMMs may use TF32): logits within `TE_FP32_ATOL` of transformers fp32
and within half of it of the unsplit TE model; gradients within 1e-3 relative (L2) of the unsplit model's. Context
parallelism in bf16 (TE's context-parallel attention kernels take 16-bit inputs only): logits no further from
transformers fp32 than 1.5x the unsplit bf16 model's error plus 2e-2; gradients within 5e-2 relative. FP8 (bf16,
delayed scaling): the MLM loss within 2% of the unsplit FP8 model's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_tensor_parallel import RANKS, enable, free_port, leave_without_teardown, whole_gradient

from conftest import (
    GPU_MARKS,
    TE_FP32_ATOL,
    make_hf_model,
    make_nv_model,
    pack_batch,
    random_proteins,
    relative_error,
)

pytestmark = GPU_MARKS

LENGTHS = [1, 300, 37, 2, 1026, 129, 64, 5, 3]  # tokens: 1 and the maximum (TE's ring got 1 to 3 wrong)
# context parallelism with 20 heads (8M) runs TE's all-to-all; with 5, which 2 ranks cannot share, its all-gather
HEADS = {"tensor": 20, "context": 20, "context_gathered": 5}
GRAD_RTOL = 1e-3
BF16_FACTOR, BF16_FLOOR, BF16_GRAD_RTOL = 1.5, 2e-2, 5e-2
FP8_LOSS_RTOL = 0.02


def check_rank(rank: int, port: int, kind: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    backend = "nccl" if torch.cuda.device_count() >= RANKS else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=RANKS)
    try:
        import transformer_engine.pytorch  # noqa: F401  (before cuDNN loads)

        hf = make_hf_model("esm2_8M", seed=100, num_attention_heads=HEADS[kind])
        kind = kind.removesuffix("_gathered")
        with torch.no_grad():  # transformers one protein at a time (little memory beside the suite's other tests)
            proteins = random_proteins(LENGTHS, seed=130, mask_fraction=0.15)
            packed = {k: v.to(device) if torch.is_tensor(v) else v for k, v in pack_batch(proteins).items()}
            reference = hf.to(device)
            expected = torch.cat([reference(input_ids=p[None].to(device)).logits[0] for p in proteins])
            hf.cpu()
        models = {}
        dtype = torch.float32 if kind == "tensor" else torch.bfloat16  # TE's context-parallel attention: 16-bit
        for name in ("whole", "split"):
            model = make_nv_model(hf, backend="te", attn_input_format="thd", cuda_graphs=False).to(device, dtype)
            if name == "split":
                enable(model, kind)
            models[name] = model
        errors = {}
        with torch.no_grad():
            logits = {name: model(**packed).logits[0] for name, model in models.items()}
        errors["whole_vs_transformers"] = (logits["whole"].float() - expected).abs().max().item()
        errors["split_vs_transformers"] = (logits["split"].float() - expected).abs().max().item()
        errors["split_vs_whole"] = (logits["split"].float() - logits["whole"].float()).abs().max().item()
        labels = packed["input_ids"]
        for model in models.values():
            model.train()
            model(**packed, labels=labels).loss.backward()
        models["split"].reduce_partial_gradients()
        reference = dict(models["whole"].named_parameters())
        worst = 0.0
        for name, parameter in models["split"].named_parameters():
            if parameter.grad is None:
                assert reference[name].grad is None, name
                continue
            worst = max(worst, relative_error(whole_gradient(name, parameter.grad, kind), reference[name].grad))
        errors["gradient_relative"] = worst

        fp8_losses = []
        for split in (False, True):
            model = make_nv_model(
                hf,
                backend="te",
                attn_input_format="thd",
                cuda_graphs=False,
                layer_precision=["fp8"] * hf.config.num_hidden_layers,
            ).to(device, torch.bfloat16)
            if split:
                enable(model, kind)
            model.train()
            loss = model(**packed, labels=labels).loss
            loss.backward()
            fp8_losses.append(loss.item())
        errors["fp8_loss_relative"] = abs(fp8_losses[1] - fp8_losses[0]) / fp8_losses[0]
        results[rank] = {**errors, "backend": backend}
        dist.barrier()  # no rank leaves (tearing down its connections) while another still reads from it
    finally:
        dist.destroy_process_group()
    leave_without_teardown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(HEADS))
def test_te_split_layers_give_transformers_outputs_and_the_unsplit_gradients(kind: str) -> None:
    if kind.startswith("context") and torch.cuda.device_count() < RANKS:
        pytest.skip("TE's context-parallel attention needs NCCL, so one GPU per rank")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(check_rank, args=(free_port(), kind, results), nprocs=RANKS)
        results = dict(results)
    print(f"\n[TE {kind} parallelism, {RANKS} ranks] {results}")
    for errors in results.values():
        if kind == "tensor":
            assert errors["whole_vs_transformers"] <= TE_FP32_ATOL
            assert errors["split_vs_transformers"] <= TE_FP32_ATOL
            assert errors["split_vs_whole"] <= TE_FP32_ATOL / 2
            assert errors["gradient_relative"] <= GRAD_RTOL
        else:  # bf16: no worse than the unsplit bf16 model, within bf16's step
            assert errors["split_vs_transformers"] <= BF16_FACTOR * errors["whole_vs_transformers"] + BF16_FLOOR
            assert errors["gradient_relative"] <= BF16_GRAD_RTOL
        assert errors["fp8_loss_relative"] <= FP8_LOSS_RTOL


if __name__ == "__main__":  # a quick run outside pytest
    pytest.main([__file__, "-s", "-q"])
