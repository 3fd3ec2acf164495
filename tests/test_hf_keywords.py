"""The keywords of transformers' `EsmModel` / `EsmForMaskedLM` forwards and constructor: accepted with
transformers' meaning (`add_pooling_layer` and `pooler_output`, `token_type_ids` of zeros, `num_items_in_batch`,
`seq_idx`, the no-op values of the rest) or refused with a ValueError naming them. fp32, PyTorch backend, 1e-5
(tests/test_model.py's tolerance)."""

from __future__ import annotations

import pytest
import torch
from transformers import EsmModel

from configuration_nv_esm import NVEsmConfig
from conftest import (
    ATOL_FP32,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_lengths,
    random_padded_batch,
    random_proteins,
)
from modeling_nv_esm import NVEsmForMaskedLM, NVEsmModel
from modeling_nv_esm_batch import UNSUPPORTED_INPUTS


def pooled_models(seed: int) -> tuple[EsmModel, NVEsmModel]:
    """transformers' EsmModel with a pooler (random weights throughout) and the NVEsmModel holding the same."""
    mlm = make_hf_model("tiny", seed=seed)
    hf_model = EsmModel(mlm.config, add_pooling_layer=True).eval()
    hf_model.load_state_dict(mlm.esm.state_dict(), strict=False)
    torch.manual_seed(seed + 1)
    for parameter in hf_model.pooler.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    nv_mlm = make_nv_model(mlm)
    nv_model = NVEsmModel(nv_mlm.config).eval()
    encoder = {k.removeprefix("esm."): v for k, v in nv_mlm.state_dict().items() if k.startswith("esm.")}
    pooler = {k: v for k, v in hf_model.state_dict().items() if k.startswith("pooler.")}
    nv_model.load_state_dict(encoder | pooler, strict=True)
    return hf_model, nv_model


@pytest.mark.parametrize("seed", range(3))
def test_pooler_output_matches_transformers(seed):
    """pooler_output (dense + tanh on `<cls>`) for right-padded, left-padded, padded-to-width and packed batches
    with a length-1 and a max-length protein, against transformers on the right-padded batch (transformers pools
    column 0, which is `<cls>` only under right padding)."""
    hf_model, nv_model = pooled_models(seed)
    generator = torch.Generator().manual_seed(seed)
    lengths = random_lengths(generator, 6) + [hf_model.config.max_position_embeddings]
    proteins = random_proteins(lengths, seed=seed)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask).pooler_output
        for side, width in (("right", "longest"), ("left", "multiple_of_16"), ("both", "wider")):
            ids, mask = random_padded_batch(proteins, side, width, generator)
            pooled = nv_model(ids, attention_mask=mask).pooler_output
            assert max_abs_diff(pooled, expected) < ATOL_FP32, (side, width)
        packed = nv_model(**pack_batch(proteins))
        assert packed.pooler_output.shape == expected.shape
        assert max_abs_diff(packed.pooler_output, expected) < ATOL_FP32
        as_tuple = nv_model(input_ids, attention_mask=attention_mask, return_dict=False)
        hf_tuple = hf_model(input_ids, attention_mask=attention_mask, return_dict=False)
        assert max_abs_diff(as_tuple[1], hf_tuple[1]) < ATOL_FP32  # (last_hidden_state, pooler_output, ...)


def test_add_pooling_layer_from_pretrained(tmp_path):
    """As transformers: a base model loaded from an ESM-2 masked-LM checkpoint gets an untrained pooler unless
    `add_pooling_layer=False`; the task models have none."""
    make_nv_model(make_hf_model("tiny", seed=3)).save_pretrained(tmp_path)
    with_pooler = NVEsmModel.from_pretrained(tmp_path, backend="torch")
    without = NVEsmModel.from_pretrained(tmp_path, backend="torch", add_pooling_layer=False)
    assert with_pooler.pooler is not None and without.pooler is None
    assert not any(name.startswith("pooler") for name, _ in without.named_parameters())
    assert NVEsmForMaskedLM.from_pretrained(tmp_path, backend="torch").esm.pooler is None
    input_ids, attention_mask = pad_batch(random_proteins([5, 9], seed=4))
    assert with_pooler(input_ids, attention_mask=attention_mask).pooler_output.shape == (
        2,
        with_pooler.config.hidden_size,
    )
    assert without(input_ids, attention_mask=attention_mask).pooler_output is None


def test_keywords_transformers_accepts_keep_their_meaning():
    """`token_type_ids` of zeros, `num_items_in_batch`, `seq_idx` and the no-op values (None, False) of the
    unsupported keywords change nothing: logits and loss as transformers' with the same keywords."""
    hf_model = make_hf_model("tiny", seed=5)
    nv_model = make_nv_model(hf_model)
    input_ids, attention_mask = pad_batch(random_proteins([7, 12, 3], seed=6, mask_fraction=0.3))
    labels = torch.where(attention_mask.bool(), input_ids, -100)
    extras = {"token_type_ids": torch.zeros_like(input_ids), "num_items_in_batch": torch.tensor(11)}
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask, labels=labels, **extras)
        noop = {name: None for name in UNSUPPORTED_INPUTS} | {"is_causal": False, "output_router_logits": False}
        got = nv_model(input_ids, attention_mask=attention_mask, labels=labels, **extras, **noop)
    tokens = attention_mask.bool()  # NVEsm's outputs at padding are zeros, transformers' are not
    assert max_abs_diff(got.logits[tokens], expected.logits[tokens]) < ATOL_FP32
    assert abs(got.loss.item() - expected.loss.item()) < ATOL_FP32


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_INPUTS))
def test_keywords_that_ask_for_what_esm2_lacks_raise_value_error(name):
    model = make_nv_model(make_hf_model("tiny", seed=7))
    input_ids, attention_mask = pad_batch(random_proteins([6, 4], seed=8))
    value = True if name in ("is_causal", "output_router_logits") else torch.ones(2, 6, 32)
    with pytest.raises(ValueError, match=f"{name} is not supported"):
        model(input_ids, attention_mask=attention_mask, **{name: value})
    with pytest.raises(ValueError, match=f"{name} is not supported"):
        model.esm(input_ids, attention_mask=attention_mask, **{name: value})


def test_token_type_ids_other_than_zeros_raise():
    model = make_nv_model(make_hf_model("tiny", seed=9))
    input_ids, attention_mask = pad_batch(random_proteins([6, 4], seed=10))
    with pytest.raises(ValueError, match="token_type_ids must be all zeros"):
        model(input_ids, attention_mask=attention_mask, token_type_ids=attention_mask)
    with pytest.raises(ValueError, match="token_type_ids must be a torch.Tensor"):
        model(input_ids, attention_mask=attention_mask, token_type_ids=[[0] * 6] * 2)


def test_config_keeps_no_constructor_keyword():
    """`add_pooling_layer` is a constructor keyword (as transformers), not a config field."""
    assert "add_pooling_layer" not in NVEsmConfig().to_dict()
