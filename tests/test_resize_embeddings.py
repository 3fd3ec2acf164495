"""`resize_token_embeddings`: the old tokens keep transformers' logits, added tokens are predicted by the LM head
(their logits follow from the resized rows; a few steps teach the model to predict one), and the resized model
saves and reloads. (transformers' own EsmForMaskedLM cannot run after a resize: its LM bias keeps 33 entries.)
fp32, PyTorch backend, 1e-5 (tests/test_model.py's tolerance)."""

from __future__ import annotations

import pytest
import torch
from transformers import EsmForTokenClassification

from conftest import ATOL_FP32, make_head_models, make_hf_model, make_nv_model, max_abs_diff, pad_batch, random_proteins
from modeling_nv_esm import NVEsmForMaskedLM, NVEsmForTokenClassification


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_batch(random_proteins([9, 1, 30, 14], seed=seed, mask_fraction=0.2))


@pytest.mark.parametrize("mean_resizing", [True, False])
@pytest.mark.parametrize("new_num_tokens,pad_to_multiple_of,padded_rows", [(40, None, 48), (37, 64, 64), (33, 8, 48)])
def test_old_tokens_keep_transformers_logits(mean_resizing, new_num_tokens, pad_to_multiple_of, padded_rows):
    hf_model = make_hf_model("tiny", seed=1)
    model = make_nv_model(hf_model)
    input_ids, attention_mask = batch(seed=2)
    tokens = attention_mask.bool()
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask).logits[tokens]
    embedding = model.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing=mean_resizing)
    assert embedding is model.get_input_embeddings() and embedding.weight.shape[0] == padded_rows
    assert model.lm_head.decoder.weight is embedding.weight  # still tied
    assert model.config.vocab_size == new_num_tokens and model.config.padded_vocab_size == padded_rows
    assert not embedding.weight[new_num_tokens:].any() and not model.lm_head.decoder.bias[new_num_tokens:].any()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits[tokens]
    assert logits.shape[-1] == new_num_tokens
    assert max_abs_diff(logits[:, :33], expected) < ATOL_FP32
    if mean_resizing and new_num_tokens > 33:
        # an added token's decoder row and bias are the old tokens' means, and logits are linear in both
        for token in range(33, new_num_tokens):
            assert max_abs_diff(logits[:, token], expected.mean(dim=-1)) < ATOL_FP32


def test_added_token_is_learned_and_the_model_saves_and_reloads(tmp_path):
    model = make_nv_model(make_hf_model("tiny", seed=3)).train()
    model.resize_token_embeddings(36, mean_resizing=False)
    new_token = 35
    input_ids, attention_mask = batch(seed=4)
    input_ids = torch.where(attention_mask.bool(), input_ids, 1)
    targets = (torch.rand(input_ids.shape, generator=torch.Generator().manual_seed(5)) < 0.3) & attention_mask.bool()
    input_ids = torch.where(targets, 34, input_ids)  # another added token as input: accepted as in the vocabulary
    labels = torch.where(targets, new_token, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(30):
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    assert (logits[targets].argmax(dim=-1) == new_token).all()
    model.save_pretrained(tmp_path)
    reloaded = NVEsmForMaskedLM.from_pretrained(tmp_path, backend="torch").eval()
    assert (
        reloaded.config.vocab_size == 36 and reloaded.lm_head.decoder.weight is reloaded.get_input_embeddings().weight
    )
    with torch.no_grad():
        again = reloaded(input_ids, attention_mask=attention_mask).logits
    assert torch.equal(again[attention_mask.bool()], logits[attention_mask.bool()])


def test_classifier_model_resizes_its_embedding():
    hf_model, model = make_head_models(EsmForTokenClassification, NVEsmForTokenClassification, seed=6)
    input_ids, attention_mask = batch(seed=7)
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask).logits[attention_mask.bool()]
        model.resize_token_embeddings(40)
        logits = model(input_ids, attention_mask=attention_mask).logits[attention_mask.bool()]
        model(torch.tensor([[0, 39, 2]]))  # an added token is a valid input
    assert max_abs_diff(logits, expected) < ATOL_FP32


@pytest.mark.parametrize("new_num_tokens", [32, 5, 40.0])
def test_resize_that_drops_special_tokens_or_is_not_an_int_raises(new_num_tokens):
    model = make_nv_model(make_hf_model("tiny", seed=8))
    with pytest.raises(ValueError, match="new_num_tokens must be an int above the special token ids"):
        model.resize_token_embeddings(new_num_tokens)


def test_resize_to_none_changes_nothing():
    model = make_nv_model(make_hf_model("tiny", seed=9))
    before = model.get_input_embeddings()
    assert model.resize_token_embeddings() is before and model.config.vocab_size == 33
