"""NVIDIA's `use_quantized_model_init` (NVEsm's `fp8_weights`) with `layer_precision` on the meta device, on a GPU
with Transformer Engine: built on meta, materialised by `init_empty_weights` (plainly, and after FSDP2's
`fully_shard` on one NCCL rank), every layer's GEMM weights are TE FP8 tensors holding the initialisation rule's
values, and a training forward and backward run with a finite loss and a gradient for every trained parameter.
The three FP8 recipes, padded (bshd) and packed (thd) layers. Also a caller's `te.quantized_model_init` around a
meta build (NVIDIA's `test_meta_fp8_init`). CPU twins of these paths: tests/test_meta_init.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from configuration_nv_esm import NVEsmConfig
from conftest import GPU_MARKS, SHAPES, pad_batch, random_proteins
from modeling_nv_esm import NVEsmForMaskedLM

pytestmark = GPU_MARKS

RECIPES = ["delayed", "current", "block"]
GEMM_WEIGHTS = (
    "self_attention.layernorm_qkv.weight",
    "self_attention.proj.weight",
    "layernorm_mlp.fc1_weight",
    "layernorm_mlp.fc2_weight",
)


def fp8_config(recipe: str | None, attn_input_format: str = "thd") -> NVEsmConfig:
    """ESM-2 8M's shape on TE; with `recipe`, every layer FP8 with its weights built in FP8 (their field names)."""
    config = NVEsmConfig(**SHAPES["esm2_8M"], backend="te", attn_input_format=attn_input_format)
    if recipe is not None:  # as NVIDIA's tests set them: after construction
        config.layer_precision = ["fp8"] * config.num_hidden_layers
        config.use_quantized_model_init = True
        config.fp8_recipe = recipe
    return config


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_on_meta(config: NVEsmConfig) -> NVEsmForMaskedLM:
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = NVEsmForMaskedLM(config)
    assert all(parameter.is_meta for parameter in model.parameters())
    return model


RAMP = 0.06  # the largest magnitude of `patterned_weights`' ramps


@pytest.fixture
def patterned_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The initialisation rule gives every layer's GEMM weights a ramp from -RAMP to RAMP, which no random draw
    (Transformer Engine's own `reset_parameters` included) gives: `check_fp8_weights` then sees that the rule's
    values, not TE's, reached the FP8 weights."""
    import modeling_nv_esm

    rule = modeling_nv_esm.initial_value

    def patterned(name: str, module: torch.nn.Module, shape: tuple[int, ...], *args: object, **kwargs: object):
        if ".layers." in name and name.endswith(GEMM_WEIGHTS):
            device = kwargs.get("device")
            return torch.linspace(-RAMP, RAMP, shape[0] * shape[1], device=device).reshape(shape)
        return rule(name, module, shape, *args, **kwargs)

    monkeypatch.setattr(modeling_nv_esm, "initial_value", patterned)


def check_fp8_weights(model: NVEsmForMaskedLM, delayed: bool = False) -> None:
    """Every layer's GEMM weights are FP8 tensors (the local shards of DTensors under FSDP2) holding the ramps of
    `patterned_weights` (within FP8's rounding: 5% of the norm); with delayed scaling, scaled for the ramp's
    largest magnitude (`fp8 max / RAMP`), not TE's initial 1.0."""
    from modeling_nv_esm_layers import is_fp8_tensor

    for layer in model.esm.encoder.layers:
        for name in GEMM_WEIGHTS:
            weight = layer.get_parameter(name)
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            assert is_fp8_tensor(local), f"{name}: {type(local).__name__}"
            expected = torch.linspace(-RAMP, RAMP, local.numel(), device=local.device).reshape(local.shape)
            values = local.dequantize().float()
            assert (values - expected).norm() < 0.05 * expected.norm(), name
            if delayed:
                fp8_max = torch.finfo(torch.float8_e4m3fn).max
                assert abs(local._scale_inv.item() * fp8_max - RAMP) < 0.01 * RAMP, name


def train_step(model: NVEsmForMaskedLM, region: contextlib.AbstractContextManager | None = None) -> float:
    """One training forward and backward on padded proteins (length 1 included); the loss, checked finite, and
    every trained parameter's gradient there (the contact head gets none from the MLM loss, as in transformers)."""
    proteins = random_proteins([5, 250, 33, 1, 97], seed=160, mask_fraction=0.15)
    input_ids, attention_mask = (tensor.cuda() for tensor in pad_batch(proteins))
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with region or contextlib.nullcontext():
        loss = model.train()(input_ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    missing = [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and parameter.grad is None and "contact_head" not in name
    ]
    assert not missing
    return loss.item()


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_init_on_the_meta_device(recipe, attn_input_format, patterned_weights):
    model = build_on_meta(fp8_config(recipe, attn_input_format))
    torch.manual_seed(0)
    model.init_empty_weights()
    check_fp8_weights(model, delayed=recipe == "delayed")
    embedding = model.esm.embeddings.word_embeddings.weight
    assert not embedding[model.config.pad_token_id].any() and not embedding[model.config.vocab_size :].any()
    assert model.lm_head.decoder.weight is embedding
    loss = train_step(model)
    print(f"\n[meta quantized init {recipe} {attn_input_format}] loss {loss:.4f}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_callers_quantized_model_init_on_the_meta_device(recipe, patterned_weights):
    """NVIDIA's `test_meta_fp8_init`: the caller's `te.quantized_model_init` around a meta build; its model runs
    under the caller's `te.autocast`."""
    import transformer_engine.pytorch as te

    from modeling_nv_esm_layers import make_fp8_recipe

    fp8_recipe = make_fp8_recipe(recipe)
    with te.quantized_model_init(enabled=True, recipe=fp8_recipe):
        model = build_on_meta(fp8_config(None))
    model.init_empty_weights()
    check_fp8_weights(model, delayed=recipe == "delayed")
    train_step(model, te.autocast(enabled=True, recipe=fp8_recipe))


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantized_init_under_fsdp2(recipe, tmp_path, patterned_weights):
    """FSDP2 shards the meta model first (one NCCL rank); `init_empty_weights` materialises the shards as DTensors
    of FP8 tensors, and the model trains a step."""
    from torch.distributed.fsdp import fully_shard

    if recipe == "block":
        pytest.skip(
            "needs two ranks: FSDP2 on one rank hands a parameter's all-gather extension its first tensor only "
            "(torch's _fsdp_param_group.wait_for_unshard, world_size == 1), and a block-scaled FP8 weight gathers "
            "two (data and scales); bench/results/meta_quantized_init_h200_2026-11-29/"
        )

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_on_meta(fp8_config(recipe))
        for layer in model.esm.encoder.layers:
            fully_shard(layer)
        fully_shard(model)
        torch.manual_seed(0)
        model.init_empty_weights()
        assert all(hasattr(layer.self_attention.proj.weight, "to_local") for layer in model.esm.encoder.layers)
        check_fp8_weights(model, delayed=recipe == "delayed")
        loss = train_step(model)
        print(f"\n[fsdp2 meta quantized init {recipe}] loss {loss:.4f}")
    finally:
        dist.destroy_process_group()
