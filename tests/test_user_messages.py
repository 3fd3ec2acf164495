"""What an ordinary run tells a user: nothing when nothing needs their action (no LOAD REPORT when a converted
folder loads, no FutureWarning when PEFT wraps a model), and what a real fault needs (a missing weight stays
reported; LoRA on a fused module names the projections to target)."""

from __future__ import annotations

import logging
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import peft
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForMaskedLM

from conftest import make_hf_model, make_nv_model, pack_batch, pad_batch, random_proteins


@contextmanager
def messages() -> Iterator[list[str]]:
    """Every Python warning and every log record of WARNING or above (transformers' loggers, the remote code's and
    any other) issued inside the block."""
    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    handler = Catch(logging.WARNING)
    loggers = [logging.getLogger(), logging.getLogger("transformers")]  # transformers' does not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as issued:
            warnings.simplefilter("always")
            yield caught
        caught += [str(warning.message) for warning in issued]
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


@pytest.mark.parametrize("auto_class", [AutoModelForMaskedLM, AutoModel], ids=["masked_lm", "base"])
def test_a_converted_folder_loads_without_a_report(nv_tiny, modules_cache, auto_class):
    """The base model (AutoModel) has transformers' pooler, which no ESM-2 checkpoint holds: not a LOAD REPORT."""
    with messages() as caught:
        model = auto_class.from_pretrained(nv_tiny, trust_remote_code=True)
    assert caught == []
    if auto_class is AutoModel:
        assert model.pooler is not None  # still built, as transformers' EsmModel's (untrained)


def test_a_missing_weight_is_still_reported(nv_tiny, tmp_path, modules_cache):
    """A real weight deleted from the folder (drawn at random), or part of a pooler a checkpoint holds, is still in
    transformers' LOAD REPORT."""
    folder = tmp_path / "damaged"
    shutil.copytree(nv_tiny, folder)
    weights = load_file(folder / "model.safetensors")
    deleted = random.Random(43).choice(sorted(weights))
    del weights[deleted]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with messages() as caught:
        AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True)
    assert any("LOAD REPORT" in message and deleted in message for message in caught), (deleted, caught)

    base = AutoModel.from_pretrained(nv_tiny, trust_remote_code=True)
    base.save_pretrained(tmp_path / "with_pooler")  # a base model's folder: its pooler is saved
    weights = load_file(tmp_path / "with_pooler" / "model.safetensors")
    del weights["pooler.dense.bias"]
    save_file(weights, tmp_path / "with_pooler" / "model.safetensors", metadata={"format": "pt"})
    with messages() as caught:
        AutoModel.from_pretrained(tmp_path / "with_pooler", trust_remote_code=True)
    assert any("LOAD REPORT" in message and "pooler.dense.bias" in message for message in caught), caught
    assert not any("pooler.dense.weight" in message for message in caught), caught


@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_wraps_the_model_without_a_future_warning(checkpointing):
    """PEFT reads transformers' deprecated `is_gradient_checkpointing`: the model answers it (the same value as
    `is_activation_checkpointing`, where transformers has it) without transformers' FutureWarning."""
    model = make_nv_model(make_hf_model("tiny", seed=11))
    if checkpointing:
        model.gradient_checkpointing_enable()
    with messages() as caught:
        assert model.is_gradient_checkpointing is checkpointing
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["query", "key", "value", "dense"]))
    assert caught == []
    if hasattr(type(model), "is_activation_checkpointing"):
        assert model.is_activation_checkpointing is checkpointing


@pytest.mark.parametrize(
    "target, instead",
    [
        ("layernorm_qkv", '"query", "key", "value"'),
        ("proj", '"attention.output.dense"'),
        ("layernorm_mlp", '"intermediate.dense", "output.dense"'),
    ],
)
def test_lora_on_a_fused_module_names_the_projections_to_target(target, instead):
    """PEFT refuses the PyTorch twins' fused modules (they are not `nn.Linear`); its message shows the module, which
    says what to target instead (on Transformer Engine, PEFT wraps them and the layer refuses: tests/test_gpu.py)."""
    model = make_nv_model(make_hf_model("tiny", seed=7))
    with pytest.raises(ValueError, match="not supported") as refusal:
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=[target]))
    assert f"fused: LoRA targets {instead}, not this module" in str(refusal.value)
    assert "fused" not in repr(model.lm_head.decoder)  # the LM head's LayerNorm + Linear is no layer's fused module


def test_a_packed_batch_in_a_data_parallel_replica_is_refused_with_what_to_do_instead() -> None:
    """`nn.DataParallel` (transformers' Trainer on several GPUs in one process) cuts every input along dim 0, which
    a packed batch does not have: its replicas refuse one, naming torchrun; padded batches split by rows work."""
    model = make_nv_model(make_hf_model("tiny", seed=21))
    proteins = random_proteins([12, 1, 30], seed=22)
    for module in model.modules():
        module._is_replica = True  # what nn.DataParallel's replicate() sets on every module of a replica
    with pytest.raises(ValueError, match=r"nn.DataParallel .* `torchrun --nproc-per-node N`"):
        model(**pack_batch(proteins))
    input_ids, attention_mask = pad_batch(proteins)
    assert model(input_ids=input_ids, attention_mask=attention_mask).logits.shape[:2] == input_ids.shape
