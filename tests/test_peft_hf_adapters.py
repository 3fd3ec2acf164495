"""PEFT adapters saved from transformers' ESM-2 on NVEsm: the same numbers, loaded as they are or converted.

An adapter trained on `EsmForMaskedLM` (or a classifier) names its tensors by transformers' module paths
(`esm.encoder.layer.N....`; a `modules_to_save` LM head with its own LayerNorm and unpadded vocabulary). Each test
saves one with random nonzero B (and a changed head), loads it onto the NVEsm twin with stock
`PeftModel.from_pretrained` (the model's `_checkpoint_conversion_mapping` renames the keys) or after
`nv-esm convert hf-to-te ADAPTER OUT`, and compares the logits with transformers + PEFT. An adapter that does not
fit after the renaming is refused (PEFT alone would only warn and run the model without it).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import EsmForSequenceClassification

import convert_checkpoint
from conftest import ATOL_FP32, make_head_models, make_hf_model, make_nv_model, max_abs_diff, pad_batch, random_proteins
from modeling_nv_esm import NVEsmForSequenceClassification

peft = pytest.importorskip("peft")

TARGETS = ["query", "key", "value", "dense"]


def saved_hf_adapter(hf_model: torch.nn.Module, folder: Path, seed: int, **lora: object) -> torch.nn.Module:
    """`hf_model` with a LoRA adapter on `TARGETS` (random A and B) and its `modules_to_save` changed, saved in
    `folder`; returns the PEFT model (eval)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **lora)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`")  # the LM head under modules_to_save
        hf_peft = peft.get_peft_model(hf_model, config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf_peft.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
            elif ".modules_to_save." in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    hf_peft.save_pretrained(folder)
    return hf_peft


def load_strictly(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """Stock `PeftModel.from_pretrained`, with PEFT's warning about adapter keys it did not find as an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Found missing adapter keys")
        warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`")
        return peft.PeftModel.from_pretrained(model, folder).eval()


def assert_same_logits(hf_peft: torch.nn.Module, nv_peft: torch.nn.Module, token_level: bool = True) -> None:
    input_ids, attention_mask = pad_batch(random_proteins([17, 1, 30, 9], seed=11))
    with torch.no_grad():
        expected = hf_peft(input_ids=input_ids, attention_mask=attention_mask).logits
        with hf_peft.disable_adapter():
            unadapted = hf_peft(input_ids=input_ids, attention_mask=attention_mask).logits
        ours = nv_peft(input_ids=input_ids, attention_mask=attention_mask).logits
    if token_level:
        keep = attention_mask.bool()
        expected, unadapted, ours = expected[keep], unadapted[keep], ours[keep]
    assert max_abs_diff(expected, unadapted) > 1e-2  # the adapter changes the output
    assert max_abs_diff(ours, expected) < ATOL_FP32


def convert_adapter(folder: Path, out: Path, command: str = "hf-to-te") -> Path:
    assert convert_checkpoint.main([command, str(folder), str(out)]) == 0
    return out


MASKED_LM_HEADS = {"lora only": None, "lm_head saved": ["lm_head"]}


@pytest.mark.parametrize("modules_to_save", MASKED_LM_HEADS.values(), ids=MASKED_LM_HEADS.keys())
@pytest.mark.parametrize("route", ["as saved", "converted"])
def test_masked_lm_adapter_from_transformers_gives_the_same_logits(tmp_path, modules_to_save, route):
    hf_model = make_hf_model("tiny", seed=20)
    nv_model = make_nv_model(hf_model)
    hf_peft = saved_hf_adapter(hf_model, tmp_path / "adapter", seed=20, modules_to_save=modules_to_save)
    folder = tmp_path / "adapter"
    if route == "converted":
        folder = convert_adapter(folder, tmp_path / "adapter_te")
        assert not any(".layer." in key for key in load_file(folder / "adapter_model.safetensors"))
    assert_same_logits(hf_peft, load_strictly(nv_model, folder))


@pytest.mark.parametrize("route", ["as saved", "converted"])
def test_sequence_classifier_adapter_from_transformers_gives_the_same_logits(tmp_path, route):
    hf_model, nv_model = make_head_models(EsmForSequenceClassification, NVEsmForSequenceClassification, seed=21)
    hf_peft = saved_hf_adapter(hf_model, tmp_path / "adapter", seed=21, modules_to_save=["classifier"])
    folder = tmp_path / "adapter"
    if route == "converted":
        folder = convert_adapter(folder, tmp_path / "adapter_te")
    assert_same_logits(hf_peft, load_strictly(nv_model, folder), token_level=False)


def test_converting_an_adapter_back_gives_transformers_tensors_bit_for_bit(tmp_path):
    hf_model = make_hf_model("tiny", seed=22)
    saved_hf_adapter(hf_model, tmp_path / "adapter", seed=22, modules_to_save=["lm_head"])
    converted = convert_adapter(tmp_path / "adapter", tmp_path / "adapter_te")
    back = convert_adapter(converted, tmp_path / "adapter_hf", "te-to-hf")
    original, returned = (load_file(folder / "adapter_model.safetensors") for folder in (tmp_path / "adapter", back))
    assert sorted(returned) == sorted(original)
    assert all(torch.equal(returned[key], tensor) for key, tensor in original.items())
    assert (back / "adapter_config.json").read_text() == (tmp_path / "adapter" / "adapter_config.json").read_text()
    assert convert_checkpoint.main(["hf-to-te", str(converted), str(tmp_path / "twice")]) == 1  # already NVEsm's
    before = {path.name: path.read_bytes() for path in (tmp_path / "adapter").iterdir()}
    into_itself = ["hf-to-te", str(tmp_path / "adapter"), str(tmp_path / "adapter"), "--overwrite"]
    assert convert_checkpoint.main(into_itself) == 1  # never over the adapter it converts
    assert {path.name: path.read_bytes() for path in (tmp_path / "adapter").iterdir()} == before
    again = ["hf-to-te", str(tmp_path / "adapter"), str(converted), "--overwrite"]
    assert convert_checkpoint.main(again) == 0  # over an earlier conversion of an adapter


@pytest.mark.parametrize("layers", [3, 1], ids=["more layers", "fewer layers"])
def test_an_adapter_that_does_not_fit_is_refused(tmp_path, layers):
    """An adapter of a model with another number of layers: tensors without a place (more layers) or adapter
    tensors the file lacks (fewer) are an error naming the conversion, not PEFT's warning."""
    saved_hf_adapter(make_hf_model("tiny", seed=23, num_hidden_layers=layers), tmp_path / "adapter", seed=23)
    nv_model = make_nv_model(make_hf_model("tiny", seed=23))
    assert nv_model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match=r"does not fit this NVEsmForMaskedLM: .*nv-esm convert hf-to-te") as error:
        load_strictly(nv_model, tmp_path / "adapter")
    assert "\n" not in str(error.value)
