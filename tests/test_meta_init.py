"""NVIDIA's BioNeMo config fields in `NVEsmConfig` (each means what it means in their model, or is refused in one line
naming it), and a model built on the meta device materialised by `init_empty_weights` (plain, and after FSDP2's
`fully_shard` on one gloo rank). CPU, PyTorch twin; the FP8 weights of the same path are in tests/test_gpu_meta_init.py.

Expected values are written out here from their definitions: ESM's rotary frequencies, the initialisation rule's
constants (ones, zeros, normal(0, initializer_range), zero padding rows), transformers' logits for the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from configuration_nv_esm import NVEsmConfig
from conftest import ATOL_FP32, TINY_CHECKPOINT, make_hf_model, max_abs_diff, pad_batch, random_proteins
from modeling_nv_esm import NVEsmForMaskedLM, NVEsmModel
from nv_esm.state_dict_mapping import hf_to_nv_state_dict, nv_config_from_hf

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, backend="torch")

# NVIDIA's fields (bionemo-recipes models/esm2 `NVEsmConfig`): values that mean what NVEsm does, and values that
# do not, each with a word its refusal must say.
THEIR_ACCEPTED = {
    "qkv_weight_interleaved": [True],
    "fuse_qkv_params": [True],
    "encoder_activation": ["gelu"],
    "attn_mask_type": ["padding", "no_mask"],
    "add_pooling_layer": [False],
    "micro_batch_size": [None, 4],
    "max_seq_length": [None, 1024],
    "use_quantized_model_init": [False],
}
THEIR_REFUSED = {
    "qkv_weight_interleaved": (False, "bionemo-to-te"),
    "fuse_qkv_params": (False, "separate"),
    "encoder_activation": ("relu", "gelu"),
    "attn_mask_type": ("causal", "both ways"),
    "add_pooling_layer": (True, "NVEsmModel(config, add_pooling_layer=True)"),
    "use_quantized_model_init": ("yes", "fp8_weights"),
}


@pytest.mark.parametrize("name, value", [(name, value) for name, values in THEIR_ACCEPTED.items() for value in values])
def test_their_fields_that_mean_what_nvesm_does_are_accepted_and_never_saved(name, value, tmp_path):
    config = NVEsmConfig(**SMALL, **{name: value})
    NVEsmForMaskedLM(config)
    config.save_pretrained(tmp_path)
    assert name not in json.loads((tmp_path / "config.json").read_text())
    if name != "add_pooling_layer":  # NVEsmModel's keyword (`from_pretrained` hands it to the model)
        setattr(config, name, value)  # as their tests set them: after construction


@pytest.mark.parametrize("name", THEIR_REFUSED)
def test_their_fields_that_mean_another_model_are_refused_in_one_line(name):
    value, word = THEIR_REFUSED[name]
    makes = [lambda: NVEsmConfig(**SMALL, **{name: value})]
    if name != "add_pooling_layer":  # NVEsmModel's keyword, not an attribute of the config
        makes.append(lambda: setattr(NVEsmConfig(**SMALL), name, value))
    for make in makes:
        with pytest.raises(ValueError) as raised:
            make()
        message = str(raised.value)
        assert message.startswith(f"{name} {value!r} is refused") and word in message and "\n" not in message


def test_use_quantized_model_init_is_fp8_weights():
    """Their `use_quantized_model_init` is NVEsm's `fp8_weights`: as a keyword or set afterwards (their tests set
    `layer_precision` and then it), read under both names, checked against `layer_precision` when the model is
    built (a keyword at once); given twice with two values it is refused."""
    fp8 = dict(layer_precision=["fp8", "fp8"], use_quantized_model_init=True)
    assert NVEsmConfig(**{**SMALL, "backend": "auto"}, **fp8).fp8_weights is True
    config = NVEsmConfig(**SMALL)
    config.layer_precision = ["fp8", None]
    config.use_quantized_model_init = True
    assert config.fp8_weights is True and config.run_options.fp8_weights is True
    config.fp8_weights = False
    assert config.use_quantized_model_init is False
    with pytest.raises(ValueError, match="layer_precision marks no layer 'fp8'"):
        NVEsmConfig(**SMALL, use_quantized_model_init=True)
    config = NVEsmConfig(**SMALL)
    config.use_quantized_model_init = True  # an attribute is checked when the model is built
    with pytest.raises(ValueError, match="layer_precision marks no layer 'fp8'"):
        NVEsmForMaskedLM(config)
    with pytest.raises(ValueError, match="set one option two ways"):
        NVEsmConfig(**SMALL, use_quantized_model_init=True, fp8_weights=False)
    assert NVEsmConfig(**SMALL, use_quantized_model_init=False, fp8_weights=False).fp8_weights is False


def test_their_config_json_is_refused_with_its_conversion(tmp_path):
    """A folder holding their config.json (their weights are named `model.`): `from_pretrained` says to convert it
    instead of loading every weight at random."""
    fields = json.loads((TINY_CHECKPOINT / "config.json").read_text())
    fields.update(model_type="nv_esm", qkv_weight_interleaved=True, micro_batch_size=None, padded_vocab_size=64)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="NVIDIA's BioNeMo ESM-2 layout .*nv-esm convert bionemo-to-te"):
        NVEsmConfig.from_pretrained(tmp_path)


def build_on_meta(config: NVEsmConfig, cls: type = NVEsmForMaskedLM) -> torch.nn.Module:
    with torch.device("meta"):
        model = cls(config)
    assert all(tensor.is_meta for tensor in model.parameters())
    return model


def esm_inverse_frequencies(head_dim: int) -> torch.Tensor:
    """ESM-2's rotary frequencies, 1 / 10000^(2i / head_dim)."""
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def test_init_empty_weights_gives_every_tensor_its_initial_value():
    config = NVEsmConfig(**SMALL, padded_vocab_size=64)
    model = build_on_meta(config)
    torch.manual_seed(0)
    model.init_empty_weights(device="cpu")
    assert not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    assert model.lm_head.decoder.weight is model.esm.embeddings.word_embeddings.weight
    for name, parameter in model.named_parameters():
        short = name.rsplit(".", 1)[-1]
        if short.endswith("bias"):
            assert torch.equal(parameter, torch.zeros_like(parameter)), name
        elif short == "layer_norm_weight" or "emb_layer_norm_after.weight" in name:
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        elif parameter.numel() >= 4096:  # large enough for its spread to say which normal it was drawn from
            values = parameter[: config.vocab_size] if "word_embeddings" in name else parameter
            assert abs(values.std().item() - config.initializer_range) < 0.1 * config.initializer_range, name
    embedding = model.esm.embeddings.word_embeddings.weight
    assert not embedding[config.pad_token_id].any() and not embedding[config.vocab_size :].any()
    assert torch.equal(model.esm.rotary_embeddings.inv_freq, esm_inverse_frequencies(config.head_dim))
    ids = torch.randint(4, 24, (2, 9))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_a_meta_build_materialised_and_loaded_computes_transformers_logits():
    """Nothing of the meta build is left behind: loading the weights of a transformers model into the materialised
    model gives transformers' logits on padded proteins."""
    hf = make_hf_model("tiny", seed=41)
    config = nv_config_from_hf(hf.config.to_dict(), backend="torch")
    model = build_on_meta(config)
    model.init_empty_weights(device="cpu")
    model.load_state_dict(hf_to_nv_state_dict(hf.state_dict(), config), strict=True)
    input_ids, attention_mask = pad_batch(random_proteins([1, 17, 5, 30], seed=42))
    with torch.no_grad():
        expected = hf(input_ids, attention_mask=attention_mask).logits
        logits = model.eval()(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(logits[keep], expected[keep]) < ATOL_FP32


def test_init_empty_weights_of_a_base_model_with_a_pooler():
    model = build_on_meta(NVEsmConfig(**SMALL), NVEsmModel)
    model.init_empty_weights(device="cpu")
    assert model.pooler is not None and not model.pooler.dense.bias.any()


def materialised_plainly_and_sharded(config: NVEsmConfig, ranks: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The meta build of `config` materialised from one seed plainly, and after FSDP2 shards it over the `ranks`
    gloo ranks of the process group (a CPU mesh: FSDP2 would gather onto a GPU where one is visible). Asserts that
    the sharded weights, gathered, equal the plain ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain = build_on_meta(config)
    torch.manual_seed(7)
    plain.init_empty_weights(device="cpu")
    sharded = build_on_meta(config)
    mesh = init_device_mesh("cpu", (ranks,))
    for layer in sharded.esm.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    torch.manual_seed(7)
    sharded.init_empty_weights(device="cpu")
    whole = {name: getattr(t, "full_tensor", lambda t=t: t)() for name, t in sharded.state_dict().items()}
    expected = plain.state_dict()
    assert whole.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(whole[name], expected[name])]
    assert not differ, differ
    return plain, sharded


def test_init_empty_weights_after_fully_shard_equals_the_plain_materialisation(tmp_path):
    """FSDP2 (`fully_shard`, one gloo rank) shards the meta model first: the materialised shards hold what a plain
    materialisation from the same seed holds, and the model computes the same loss."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plain, sharded = materialised_plainly_and_sharded(NVEsmConfig(**SMALL), 1)
        ids = torch.randint(4, 24, (2, 9))
        assert torch.equal(sharded(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)
    finally:
        dist.destroy_process_group()


def test_init_empty_weights_refuses_a_model_that_holds_weights():
    model = NVEsmForMaskedLM(NVEsmConfig(**SMALL))
    with pytest.raises(ValueError, match="holds its weights already"):
        model.init_empty_weights(device="cpu")


def test_lora_adapters_start_as_loras_do():
    """After PEFT's `get_peft_model` on a meta build, `init_empty_weights` gives LoRA's B zeros and A
    normal(0, 1/sqrt(fan_in)) (told by their names): the adapted model computes what the model without them does."""
    from peft import LoraConfig, get_peft_model

    model = build_on_meta(NVEsmConfig(**SMALL))
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["query", "value"]))
    torch.manual_seed(3)
    peft_model.init_empty_weights(device="cpu")
    lora = {name: tensor for name, tensor in peft_model.named_parameters() if "lora_" in name}
    assert lora and all(not tensor.any() for name, tensor in lora.items() if "lora_B" in name)
    a = torch.cat([tensor.flatten() for name, tensor in lora.items() if "lora_A" in name])
    assert abs(a.std().item() - SMALL["hidden_size"] ** -0.5) < 0.1 * SMALL["hidden_size"] ** -0.5
    ids = torch.randint(4, 24, (2, 9))
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
    assert torch.equal(adapted, plain)


def test_add_pooling_layer_set_as_an_attribute_is_checked_and_not_kept(tmp_path):
    config = NVEsmConfig(**SMALL)
    config.add_pooling_layer = False
    assert not hasattr(config, "add_pooling_layer")
    with pytest.raises(ValueError, match="add_pooling_layer True is refused"):
        config.add_pooling_layer = True
    config.save_pretrained(tmp_path)
    assert "add_pooling_layer" not in json.loads((tmp_path / "config.json").read_text())


def test_one_option_under_both_names_with_two_values_is_refused_by_from_pretrained(tmp_path):
    NVEsmConfig(**SMALL).save_pretrained(tmp_path)
    fp8 = dict(layer_precision=["fp8", "fp8"])
    with pytest.raises(ValueError, match="set one option two ways"):
        NVEsmConfig.from_pretrained(tmp_path, use_quantized_model_init=True, fp8_weights=False, **fp8)
    assert NVEsmConfig.from_pretrained(tmp_path, use_quantized_model_init=True, **fp8).fp8_weights is True


RANKS = 3  # an uneven split: 24 hidden units, 40 MLP units and 64 vocabulary rows over 3 ranks


def materialise_on_rank(rank: int, store: str) -> None:
    """One of `RANKS` gloo ranks: FSDP2 shards a meta build over all of them; the gathered weights equal a plain
    materialisation from the same seed."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        config = NVEsmConfig(num_hidden_layers=2, hidden_size=24, num_attention_heads=4, intermediate_size=40)
        config.backend = "torch"
        materialised_plainly_and_sharded(config, RANKS)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_init_empty_weights_on_several_ranks_equals_the_plain_materialisation(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(materialise_on_rank, args=(str(tmp_path / "store"),), nprocs=RANKS)
