"""Bad configs and bad inputs raise clear errors; the code imports and runs without Transformer Engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import modeling_nv_esm
import modeling_nv_esm_layers
from configuration_nv_esm import NVEsmConfig
from conftest import PAD, ROOT, make_hf_model, make_nv_model, pack_batch, pad_batch, random_proteins
from nv_esm.data import pad_proteins


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("padded_vocab_size", 40, "padded_vocab_size"),
        ("padded_vocab_size", 32, "padded_vocab_size"),
        ("num_attention_heads", 7, "divisible by num_attention_heads"),
        ("position_embedding_type", "absolute", "ESM-1"),
        ("emb_layer_norm_before", True, "ESM-1b"),
        ("backend", "jax", "backend must be one of"),
        ("attn_input_format", "sbhd", "attn_input_format must be one of"),
        ("fp8_recipe", "mxfp4", "fp8_recipe must be one of"),
        ("layer_precision", ["fp8"], "one entry per layer"),
        ("layer_precision", ["fp4"] * 33, "layer_precision entries must be one of"),
        ("hidden_act", "relu", "hidden_act must be one of"),
        ("hidden_dropout_prob", 1.5, "hidden_dropout_prob"),
        ("mask_token_id", 40, "mask_token_id"),
        ("hidden_size", 0, "hidden_size must be a positive integer"),
        ("token_dropout", "yes", "token_dropout"),
    ],
)
def test_bad_config_values_raise(field, value, message):
    with pytest.raises(ValueError, match=message):
        NVEsmConfig(**{field: value})


def test_config_round_trips_through_json(tmp_path):
    """Model fields survive save/load; load-time options (layer_precision, ...) come back only when passed."""
    config = NVEsmConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, layer_precision=["fp8", None])
    config.save_pretrained(tmp_path)
    loaded = NVEsmConfig.from_pretrained(tmp_path)
    assert (loaded.num_hidden_layers, loaded.hidden_size, loaded.padded_vocab_size) == (2, 64, 64)
    assert loaded.layer_precision is None
    options = NVEsmConfig.from_pretrained(
        tmp_path, layer_precision=["fp8", None], fp8_recipe="current", backend="torch"
    )
    assert (options.layer_precision, options.fp8_recipe, options.backend) == (["fp8", None], "current", "torch")


@pytest.fixture(scope="module")
def model():
    return make_nv_model(make_hf_model("tiny", seed=30))


def packed(lengths=(5, 3)):
    return pack_batch(random_proteins(list(lengths), seed=31))


def with_changes(batch, **changes):
    return {**batch, **changes}


BAD_PACKED_INPUTS = {
    "cu_seq_lens not starting at 0": (
        lambda b: with_changes(b, cu_seq_lens_q=torch.tensor([1, 5, 8], dtype=torch.int32), cu_seq_lens_k=None),
        "start at 0",
    ),
    "cu_seq_lens not increasing": (
        lambda b: with_changes(b, cu_seq_lens_q=torch.tensor([0, 5, 5, 8], dtype=torch.int32), cu_seq_lens_k=None),
        "strictly increasing",
    ),
    "cu_seq_lens last entry != tokens": (
        lambda b: with_changes(b, cu_seq_lens_q=torch.tensor([0, 5, 7], dtype=torch.int32), cu_seq_lens_k=None),
        "end at the number of tokens",
    ),
    "cu_seq_lens float": (
        lambda b: with_changes(b, cu_seq_lens_q=torch.tensor([0.0, 5.0, 8.0]), cu_seq_lens_k=None),
        "1-D integer tensor",
    ),
    "cu_seq_lens_k differs": (
        lambda b: with_changes(b, cu_seq_lens_k=torch.tensor([0, 4, 8], dtype=torch.int32)),
        "cu_seq_lens_k must equal",
    ),
    "max_length too small": (lambda b: with_changes(b, max_length_q=4, max_length_k=4), "shorter than the longest"),
    "max_length q != k": (lambda b: with_changes(b, max_length_q=5, max_length_k=6), "must be equal"),
    "position_ids not restarting at 0": (
        lambda b: {"input_ids": b["input_ids"], "position_ids": b["position_ids"] + 1},
        "start at 0",
    ),
    "position_ids skipping": (
        lambda b: {"input_ids": b["input_ids"], "position_ids": torch.tensor([[0, 1, 2, 4, 5, 0, 1, 2]])},
        "count up by 1",
    ),
    "position_ids disagree with cu_seq_lens": (
        lambda b: with_changes(b, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])),
        "disagree",
    ),
    "attention_mask with packed input": (
        lambda b: with_changes(b, attention_mask=torch.ones_like(b["input_ids"])),
        "attention_mask is for padded",
    ),
    "batch of 2 packed": (
        lambda b: with_changes(b, input_ids=b["input_ids"].repeat(2, 1)),
        "Packed input_ids must be",
    ),
    "token id past vocabulary (padded rows)": (
        lambda b: with_changes(b, input_ids=torch.where(b["input_ids"] == 2, 40, b["input_ids"])),
        "token ids in \\[0, 33\\)",
    ),
    "negative token id": (lambda b: with_changes(b, input_ids=-b["input_ids"] - 1), "token ids in"),
    "cu_seq_lens as a list": (lambda b: with_changes(b, cu_seq_lens_q=[0, 5, 8], cu_seq_lens_k=None), "torch.Tensor"),
    "cu_seq_lens_k as a list": (lambda b: with_changes(b, cu_seq_lens_k=[0, 5, 8]), "torch.Tensor"),
    "cu_seq_lens uint8": (
        lambda b: with_changes(b, cu_seq_lens_q=b["cu_seq_lens_q"].to(torch.uint8), cu_seq_lens_k=None),
        "dtype int32",
    ),
    "cu_seq_lens on another device": (
        lambda b: with_changes(b, cu_seq_lens_q=b["cu_seq_lens_q"].to("meta"), cu_seq_lens_k=None),
        "is on meta",
    ),
    "position_ids as a list": (
        lambda b: {"input_ids": b["input_ids"], "position_ids": b["position_ids"].tolist()},
        "position_ids must be a torch.Tensor",
    ),
    "max_length a float": (lambda b: with_changes(b, max_length_q=5.0, max_length_k=None), "positive integer"),
    "max_length zero": (lambda b: with_changes(b, max_length_q=0, max_length_k=None), "positive integer"),
    "no tokens": (
        lambda b: with_changes(b, input_ids=b["input_ids"][:, :0], position_ids=None, cu_seq_lens_q=None),
        "holds no tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PACKED_INPUTS))
def test_bad_packed_inputs_raise(model, case):
    make, message = BAD_PACKED_INPUTS[case]
    with pytest.raises(ValueError, match=message):
        model(**make(packed()))


def test_bad_padded_inputs_raise(model):
    input_ids, attention_mask = pad_batch(random_proteins([6, 3], seed=32))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(input_ids, inputs_embeds=torch.zeros(2, 6, 32))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model()
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(input_ids, attention_mask=attention_mask[:, :4])
    with pytest.raises(ValueError, match="at least one token"):
        model(input_ids, attention_mask=attention_mask * torch.tensor([[1], [0]]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        model(input_ids, attention_mask=attention_mask * 2)
    with pytest.raises(ValueError, match="integer token ids"):
        model(input_ids.float())
    with pytest.raises(ValueError, match="token ids in"):
        model(torch.full((1, 4), 33))
    with pytest.raises(ValueError, match="max_length_q/max_length_k describe packed inputs"):
        model(input_ids, max_length_q=6)
    with pytest.raises(ValueError, match=r"holds no tokens: input shape \(0, 6\)"):
        model(input_ids[:0], attention_mask=attention_mask[:0])
    with pytest.raises(ValueError, match=r"holds no tokens: input shape \(1, 0\)"):
        model(torch.zeros((1, 0), dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be a torch.Tensor"):
        model(input_ids.tolist())
    with pytest.raises(ValueError, match="attention_mask must be a torch.Tensor"):
        model(input_ids, attention_mask=attention_mask.tolist())
    with pytest.raises(TypeError, match="Unexpected inputs"):
        model(input_ids, segment_ids=input_ids)


@pytest.mark.parametrize("layout", ["padded_no_mask", "padded_mask", "packed"])
def test_protein_longer_than_max_protein_length_raises(layout):
    model = make_nv_model(make_hf_model("tiny", seed=30), max_protein_length=100)
    too_long = random_proteins([40, 101], seed=33)
    with pytest.raises(ValueError, match="longer than max_protein_length .100 tokens"):
        if layout == "packed":
            model(**pack_batch(too_long))
        else:
            input_ids, attention_mask = pad_batch(too_long)
            model(input_ids, attention_mask=attention_mask if layout == "padded_mask" else None)


@pytest.mark.parametrize("cuda", [True, False])
def test_asking_for_te_without_it_says_how_to_install(monkeypatch, cuda):
    """backend="te" where Transformer Engine does not import (with or without a GPU): an error that says how to
    install it. TE and CUDA are hidden, so this runs the same on a CPU machine and on a GPU machine with TE."""
    monkeypatch.setattr(modeling_nv_esm_layers, "transformer_engine_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match="Transformer Engine"):  # resolve_backend: one error for every command
        make_nv_model(make_hf_model("tiny", seed=34), backend="te")


@pytest.mark.parametrize("te,cuda", [(False, True), (True, False), (False, False)])
def test_auto_backend_is_torch_without_te_or_cuda(monkeypatch, te, cuda):
    monkeypatch.setattr(modeling_nv_esm_layers, "transformer_engine_available", lambda: te)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    model = make_nv_model(make_hf_model("tiny", seed=35), backend="auto")
    assert model.esm.backend == "torch"
    assert model.config.backend == "auto"  # the saved config keeps the user's choice


def test_remote_code_imports_and_runs_with_transformer_engine_blocked():
    """Block `transformer_engine` (as on a machine without it) and run a forward pass."""
    script = (
        "import sys; sys.modules['transformer_engine'] = None; sys.modules['transformer_engine.pytorch'] = None\n"
        "import torch, modeling_nv_esm as m, modeling_nv_esm_layers as layers, configuration_nv_esm as c\n"
        "assert not layers.transformer_engine_available()\n"
        "cfg = c.NVEsmConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)\n"
        "model = m.NVEsmForMaskedLM(cfg).eval()\n"
        "print(model.esm.backend, tuple(model(torch.tensor([[0, 5, 6, 2]])).logits.shape))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "(1,", "4,", "33)"]


def test_unchecked_inputs_give_the_same_outputs():
    hf = make_hf_model("tiny", seed=36)
    checked, unchecked = make_nv_model(hf), make_nv_model(hf, check_inputs=False)
    batch = packed((7, 1, 12))
    with torch.no_grad():
        assert torch.equal(checked(**batch).logits, unchecked(**batch).logits)


def test_ids_at_padding_positions_are_not_checked_or_read(model):
    """Collators that pad input_ids with -100 or any other id: only kept positions must hold vocabulary ids."""
    input_ids, attention_mask = pad_batch(random_proteins([6, 3], seed=37))
    odd = input_ids.masked_fill(attention_mask == 0, -100)
    odd[1, -1] = 999
    keep = attention_mask.bool()
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits[keep]
        assert torch.equal(model(odd, attention_mask=attention_mask).logits[keep], expected)
    with pytest.raises(ValueError, match="token ids in"):
        model(odd)  # without a mask every position is a token


def test_max_length_accepts_numpy_and_tensor_integers(model):
    import numpy as np

    batch = packed()
    with torch.no_grad():
        expected = model(**batch).logits
        for value in (np.int64(5), torch.tensor(5), 7):
            actual = model(**with_changes(batch, max_length_q=value, max_length_k=None)).logits
            assert (actual - expected).abs().max() <= 1e-5


def test_pack_proteins_gives_what_data_collator_with_flattening_gives():
    """The packing helper that the data pipeline, the benchmark and the tests use, against transformers' own
    collator: same input_ids, position_ids, cu_seq_lens and max lengths (and labels, with -100 kept)."""
    from transformers import DataCollatorWithFlattening

    proteins = random_proteins([1, 37, 5, 120, 2], seed=31)
    labels = [torch.where(torch.rand(len(p)) < 0.3, p, -100) for p in proteins]
    features = [{"input_ids": p.tolist(), "labels": lab.tolist()} for p, lab in zip(proteins, labels)]
    expected = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(features)
    ours = modeling_nv_esm.pack_proteins(proteins, labels)
    for name in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        assert torch.equal(ours[name], expected[name].to(ours[name].dtype)), name
    assert ours["max_length_q"] == ours["max_length_k"] == int(expected["max_length_q"]) == 120
    # The collator sets the first label of each protein to -100 (it shifts labels for causal models); ours keep them.
    starts = ours["cu_seq_lens_q"][:-1].long()
    keep = torch.ones(ours["labels"].shape[1], dtype=torch.bool)
    keep[starts] = False
    assert torch.equal(ours["labels"][0, keep], expected["labels"][0, keep])
    assert torch.equal(ours["labels"][0, starts], torch.stack([lab[0] for lab in labels]))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: modeling_nv_esm.pack_proteins([]), "at least one protein"),
        (lambda: modeling_nv_esm.pack_proteins([[0, 5, 2], []]), "protein 1 has no tokens"),
        (lambda: modeling_nv_esm.pack_proteins([[0, 5, 2]], labels=[[1, 2]]), "one label per token"),
        (lambda: pad_proteins([], PAD), "at least one protein"),
        (lambda: pad_proteins([[0, 2], []], PAD), "protein 1 has no tokens"),
        (lambda: pad_proteins([[0, 2]], PAD, padding_side="top"), "padding_side"),
        (lambda: modeling_nv_esm.resolve_backend("cuda"), "backend must be"),
    ],
)
def test_packing_helpers_and_backend_names_refuse_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_pad_proteins_pads_either_side():
    padded = pad_proteins([[0, 5, 2], [0, 2]], PAD, padding_side="left")
    assert padded["input_ids"].tolist() == [[0, 5, 2], [PAD, 0, 2]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    padded = pad_proteins([[0, 5, 2], [0, 2]], PAD)
    assert padded["input_ids"].tolist() == [[0, 5, 2], [0, 2, PAD]]
