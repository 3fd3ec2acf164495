"""Hub packaging: exported folders load with Auto* + trust_remote_code, save/load round trips, pipelines, heads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    EsmForMaskedLM,
    EsmForSequenceClassification,
    EsmForTokenClassification,
    pipeline,
)

import configuration_nv_esm
from configuration_nv_esm import LOAD_TIME_OPTIONS
from conftest import (
    ATOL_FP32,
    ROOT,
    TINY_CHECKPOINT,
    make_head_models,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pack_batch,
    pad_batch,
    random_proteins,
)
from modeling_nv_esm import NVEsmForSequenceClassification, NVEsmForTokenClassification
from nv_esm.alphabet import GFP
from nv_esm.conversion import convert_hf_to_nv, convert_nv_to_hf
from nv_esm.hub_folder import AUTO_MAP


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("hub") / "esm2_tiny_nv"
    convert_hf_to_nv(TINY_CHECKPOINT, out)
    return out


def test_repository_config_points_at_the_remote_code_as_exported_folders_do():
    config = json.loads((ROOT / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP
    assert not set(LOAD_TIME_OPTIONS) & set(config)


@pytest.fixture(scope="module")
def reference():
    return EsmForMaskedLM.from_pretrained(TINY_CHECKPOINT).eval()


def test_exported_folder_loads_with_auto_classes_and_matches_transformers(exported, reference):
    model = AutoModelForMaskedLM.from_pretrained(exported, trust_remote_code=True, backend="torch").eval()
    assert type(model).__name__ == "NVEsmForMaskedLM"
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    batch = tokenizer([GFP, GFP[:60].replace("L", "<mask>"), "M"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = model(**batch).logits
        theirs = reference(**batch).logits
    keep = batch["attention_mask"].bool()
    assert max_abs_diff(ours[keep], theirs[keep]) <= ATOL_FP32
    for auto_class in (AutoModel, AutoModelForTokenClassification, AutoModelForSequenceClassification):
        loaded = auto_class.from_pretrained(exported, trust_remote_code=True, backend="torch")
        assert type(loaded).__name__.startswith("NVEsm")


def test_fill_mask_pipeline_agrees_with_transformers(exported):
    ours = pipeline(
        "fill-mask", model=str(exported), trust_remote_code=True, device="cpu", model_kwargs={"backend": "torch"}
    )
    theirs = pipeline("fill-mask", model=str(TINY_CHECKPOINT), device="cpu")
    masked = GFP[:30] + "<mask>" + GFP[31:80]
    ours_top, theirs_top = ours(masked, top_k=5), theirs(masked, top_k=5)
    assert [p["token_str"] for p in ours_top] == [p["token_str"] for p in theirs_top]
    for a, b in zip(ours_top, theirs_top):
        assert abs(a["score"] - b["score"]) <= ATOL_FP32


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_save_and_load_round_trip(tmp_path, attn_input_format):
    model = make_nv_model(make_hf_model("wide_heads", seed=40), attn_input_format=attn_input_format)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_input_format=attn_input_format, backend="torch").eval()
    assert loaded.config.attn_input_format == attn_input_format
    original_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert original_state.keys() == loaded_state.keys()
    assert all(torch.equal(original_state[k], loaded_state[k]) for k in original_state)
    assert loaded.lm_head.decoder.weight is loaded.esm.embeddings.word_embeddings.weight
    batch = pack_batch(random_proteins([11, 3, 40], seed=41, mask_fraction=0.1))
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_checkpoint_loads_into_the_other_layout(tmp_path):
    padded = make_nv_model(make_hf_model("tiny", seed=42), attn_input_format="bshd")
    padded.save_pretrained(tmp_path)
    packed = type(padded).from_pretrained(tmp_path, attn_input_format="thd", backend="torch").eval()
    input_ids, attention_mask = pad_batch(random_proteins([8, 2], seed=43))
    with torch.no_grad():
        a = padded(input_ids, attention_mask=attention_mask).logits
        b = packed(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    assert max_abs_diff(a[keep], b[keep]) <= ATOL_FP32


def test_te_to_hf_folder_loads_in_plain_transformers(exported, reference, tmp_path):
    back = tmp_path / "back_to_hf"
    convert_nv_to_hf(exported, back)
    restored = EsmForMaskedLM.from_pretrained(back).eval()
    expected = reference.state_dict()
    assert restored.state_dict().keys() == expected.keys()
    assert all(torch.equal(restored.state_dict()[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "hf_class,nv_class",
    [
        (EsmForTokenClassification, NVEsmForTokenClassification),
        (EsmForSequenceClassification, NVEsmForSequenceClassification),
    ],
)
def test_classification_heads_match_transformers_padded_and_packed(hf_class, nv_class):
    hf_model, nv_model = make_head_models(hf_class, nv_class, seed=44)
    proteins = random_proteins([13, 1, 30], seed=46, mask_fraction=0.1)
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        expected = hf_model(input_ids, attention_mask=attention_mask).logits
        padded = nv_model(input_ids, attention_mask=attention_mask).logits
        packed = nv_model(**pack_batch(proteins)).logits
    if hf_class is EsmForTokenClassification:
        keep = attention_mask.bool()
        assert max_abs_diff(padded[keep], expected[keep]) <= ATOL_FP32
        assert max_abs_diff(packed[0], expected[keep]) <= ATOL_FP32
    else:
        assert packed.shape == expected.shape == (3, 2)
        assert max_abs_diff(padded, expected) <= ATOL_FP32
        assert max_abs_diff(packed, expected) <= ATOL_FP32


@pytest.mark.parametrize("layer,pooling", [(-1, "mean"), (1, "mean"), (0, "cls"), (2, "cls")])
def test_embed_matches_transformers_per_protein_in_input_order(exported, reference, layer, pooling):
    model = AutoModel.from_pretrained(exported, trust_remote_code=True, backend="torch").eval()
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    generator = torch.Generator().manual_seed(47)
    residues = "LAGVSERTIDPKQNFYMHWC"
    lengths = [5, 300, 1, 64, 1024, 17, 2, 150]
    sequences = ["".join(residues[i] for i in torch.randint(0, 20, (n,), generator=generator)) for n in lengths]
    embeddings = model.embed(sequences, tokenizer, layer=layer, pooling=pooling, max_tokens_per_batch=700)
    assert embeddings.shape == (len(sequences), reference.config.hidden_size)
    with torch.no_grad():
        for sequence, embedding in zip(sequences, embeddings):
            ids = tokenizer(sequence, return_tensors="pt")["input_ids"]
            states = reference(ids, output_hidden_states=True).hidden_states[layer][0]
            expected = states[0] if pooling == "cls" else states[1:-1].mean(0)
            assert max_abs_diff(embedding, expected) <= ATOL_FP32


def test_embed_rejects_bad_arguments(exported):
    model = AutoModel.from_pretrained(exported, trust_remote_code=True, backend="torch").eval()
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    with pytest.raises(ValueError, match="pooling"):
        model.embed(["MK"], tokenizer, pooling="max")
    with pytest.raises(ValueError, match="layer must be"):
        model.embed(["MK"], tokenizer, layer=5)
    with pytest.raises(ValueError, match="sequence 1 has no residues"):
        model.embed(["MK", ""], tokenizer)
    short_limit = AutoModel.from_pretrained(exported, trust_remote_code=True, backend="torch", max_protein_length=1026)
    with pytest.raises(ValueError, match="Sequence 0 has 1025 residues; embed needs 1 to 1024"):
        short_limit.embed(["A" * 1025], tokenizer)


def test_saved_configs_carry_no_load_time_options(tmp_path, monkeypatch):
    """A model saved with backend="torch" and the other machine choices loads with the defaults (TE where it runs),
    unless they are passed again; an older config.json that has them is read without them, with a warning."""
    choices = dict(
        backend="torch", attn_input_format="bshd", check_inputs=False, cuda_graphs=False, max_protein_length=9000
    )
    model = make_nv_model(make_hf_model("tiny", seed=43), **choices)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert not set(LOAD_TIME_OPTIONS) & set(saved)
    defaults = type(model.config)()
    loaded = type(model).from_pretrained(tmp_path / "saved")
    assert {name: getattr(loaded.config, name) for name in choices} == {
        name: getattr(defaults, name) for name in choices
    }
    again = type(model).from_pretrained(tmp_path / "saved", **choices)
    assert {name: getattr(again.config, name) for name in choices} == choices

    warnings: list[str] = []
    monkeypatch.setattr(configuration_nv_esm.logger, "warning", warnings.append)
    (tmp_path / "old").mkdir()
    older = saved | {"backend": "torch", "check_inputs": False, "attn_input_format": "thd", "cuda_graphs": True}
    (tmp_path / "old" / "config.json").write_text(json.dumps(older))
    config = type(model.config).from_pretrained(tmp_path / "old")
    assert (config.backend, config.check_inputs) == ("auto", True)
    assert len(warnings) == 1 and "backend='torch', check_inputs=False: load-time options" in warnings[0]


def test_converted_folders_have_no_default_labels_so_any_num_labels_loads_quietly(exported, monkeypatch):
    import transformers.configuration_utils

    config = json.loads((exported / "config.json").read_text())
    assert "id2label" not in config and not set(LOAD_TIME_OPTIONS) & set(config)
    warnings: list[str] = []
    monkeypatch.setattr(transformers.configuration_utils.logger, "warning", warnings.append)
    model = AutoModelForSequenceClassification.from_pretrained(
        exported, trust_remote_code=True, num_labels=3, backend="torch"
    )
    assert model.config.num_labels == 3 and model.classifier.out_proj.out_features == 3
    assert not [w for w in warnings if "num_labels" in w]


def test_a_folder_loads_as_the_hub_user_has_it_and_saves_every_sibling(exported, reference, tmp_path):
    """The Hub user's situation: a fresh process in an empty folder where neither this repository nor the installed
    package can be imported (their modules blocked), a fresh modules cache. `trust_remote_code=True` copies the
    folder's flat remote-code files (`modeling_nv_esm.py` and the siblings it imports relatively; the tokenizer's
    `tokenization_nv_esm.py`), the model runs and equals transformers on the ids the tokenizer gives a lower-case
    protein, and the model's and the tokenizer's `save_pretrained` write every remote-code file again."""
    from nv_esm.hub_folder import REMOTE_CODE_FILES

    tokens = torch.tensor([[0, 20, 5, 32, 11, 2]])  # <cls> M A <mask> T <eos>
    with torch.no_grad():
        expected = reference(tokens).logits
    blocked = [name.removesuffix(".py") for name in REMOTE_CODE_FILES] + ["nv_esm", "convert_checkpoint"]
    script = (
        "import sys, torch\n"
        f"for name in {blocked!r}:\n    sys.modules[name] = None\n"
        "from transformers import AutoModelForMaskedLM, AutoTokenizer\n"
        f"model = AutoModelForMaskedLM.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(exported)!r}, trust_remote_code=True)\n"
        "for loaded in (model, tokenizer):\n"
        "    assert type(loaded).__module__.startswith('transformers_modules'), type(loaded).__module__\n"
        "with torch.no_grad():\n"
        "    torch.save(model(**tokenizer(['ma<mask>t'], return_tensors='pt')).logits, 'logits.pt')\n"
        "model.save_pretrained('saved')\n"
        "tokenizer.save_pretrained('saved')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True, timeout=600)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=ATOL_FP32)
    assert set(REMOTE_CODE_FILES) <= {path.name for path in (tmp_path / "saved").iterdir()}
    for name in REMOTE_CODE_FILES:
        assert (tmp_path / "saved" / name).read_bytes() == (exported / name).read_bytes(), name
