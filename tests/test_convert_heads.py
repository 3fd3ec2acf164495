"""Fine-tuned classification checkpoints through the converter, both ways: transformers' `EsmForTokenClassification`
/ `EsmForSequenceClassification` (single-label, multi-label, regression) -> NVEsm -> transformers, with their labels,
bit-exact tensors and the same logits and losses (fp32, CPU, ATOL_FP32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    EsmForSequenceClassification,
    EsmForTokenClassification,
)

from conftest import ATOL_FP32, SHAPES, max_abs_diff, pad_batch, random_proteins, randomize_
from convert_helpers import assert_same_tensors, current_hf_names, read_folder, run, save_hf
from nv_esm.shapes import esm2_config

# (transformers class, NVEsm Auto class, problem_type, labels); regression has one output.
CASES = {
    "token": (EsmForTokenClassification, AutoModelForTokenClassification, None, ["coil", "strand", "helix"]),
    "sequence_single": (
        EsmForSequenceClassification,
        AutoModelForSequenceClassification,
        "single_label_classification",
        ["soluble", "insoluble", "membrane"],
    ),
    "sequence_multi": (
        EsmForSequenceClassification,
        AutoModelForSequenceClassification,
        "multi_label_classification",
        ["nucleus", "cytoplasm", "membrane", "secreted"],
    ),
    "sequence_regression": (EsmForSequenceClassification, AutoModelForSequenceClassification, "regression", ["y"]),
}
PIPELINE_TAGS = {EsmForTokenClassification: "token-classification", EsmForSequenceClassification: "text-classification"}


def make_classifier(case: str, seed: int) -> torch.nn.Module:
    """A transformers classifier of the tiny shape, every tensor random (the head's too), with named labels."""
    hf_class, _, problem_type, labels = CASES[case]
    config = esm2_config(**SHAPES["tiny"], id2label=dict(enumerate(labels)), problem_type=problem_type)
    config.label2id = {label: index for index, label in enumerate(labels)}
    torch.manual_seed(seed)
    model = hf_class(config).eval()
    randomize_(model, seed)
    return model


def random_labels(case: str, input_ids: torch.Tensor, attention_mask: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    _, _, problem_type, labels = CASES[case]
    batch = input_ids.shape[0]
    if case == "token":
        drawn = torch.randint(0, len(labels), input_ids.shape, generator=generator)
        return drawn.masked_fill(attention_mask == 0, -100)
    if problem_type == "single_label_classification":
        return torch.randint(0, len(labels), (batch,), generator=generator)
    if problem_type == "multi_label_classification":
        return torch.randint(0, 2, (batch, len(labels)), generator=generator).float()
    return torch.randn(batch, 1, generator=generator)


@pytest.mark.parametrize("case", list(CASES))
def test_classifiers_convert_both_ways_with_labels_and_identical_outputs(case: str, tmp_path: Path, capsys) -> None:
    hf_class, auto_class, problem_type, labels = CASES[case]
    original = make_classifier(case, seed=len(case))
    source = save_hf(original, tmp_path / "hf")
    assert run(capsys, "hf-to-te", source, tmp_path / "nv")[0] == 0
    assert run(capsys, "te-to-hf", tmp_path / "nv", tmp_path / "back")[0] == 0

    nv_config = json.loads((tmp_path / "nv" / "config.json").read_text())
    assert nv_config["architectures"] == ["NV" + hf_class.__name__]
    card = (tmp_path / "nv" / "README.md").read_text()
    assert f"pipeline_tag: {PIPELINE_TAGS[hf_class]}" in card and auto_class.__name__ in card
    back_config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back_config["architectures"] == [hf_class.__name__]
    assert_same_tensors(current_hf_names(read_folder(tmp_path / "back")), current_hf_names(read_folder(source)))

    nv = auto_class.from_pretrained(tmp_path / "nv", trust_remote_code=True, backend="torch").eval()
    back = hf_class.from_pretrained(tmp_path / "back").eval()
    for model in (nv, back):
        assert model.config.id2label == dict(enumerate(labels))
        assert model.config.label2id == {label: index for index, label in enumerate(labels)}
        assert model.config.problem_type == (problem_type if case != "token" else None)

    proteins = random_proteins([1, 30, 9, 2], seed=3)  # a <cls>-only protein and one without residues too
    input_ids, attention_mask = pad_batch(proteins)
    targets = random_labels(case, input_ids, attention_mask, seed=4)
    with torch.no_grad():
        expected = original(input_ids, attention_mask=attention_mask, labels=targets)
        for model in (nv, back):
            got = model(input_ids, attention_mask=attention_mask, labels=targets)
            keep = attention_mask.bool() if case == "token" else slice(None)
            assert max_abs_diff(got.logits[keep], expected.logits[keep]) <= ATOL_FP32
            assert abs(got.loss.item() - expected.loss.item()) <= ATOL_FP32


def test_a_masked_lm_with_a_stray_classifier_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    model = make_classifier("token", seed=5)
    state = {**model.state_dict(), "lm_head.bias": torch.zeros(33)}
    folder = save_hf(model, tmp_path / "hf")
    for path in folder.glob("*.safetensors"):
        path.unlink()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    status, _, err = run(capsys, "hf-to-te", folder, tmp_path / "nv")
    assert status == 1 and "classifier.weight" in err and "Missing" in err
    assert not (tmp_path / "nv").exists()


def test_verify_refuses_a_classifier_before_converting(tmp_path: Path, capsys) -> None:
    source = save_hf(make_classifier("sequence_single", seed=6), tmp_path / "hf")
    status, _, err = run(capsys, "hf-to-te", source, tmp_path / "nv", "--verify", "--verify-device", "cpu")
    assert status == 1 and "compare masked-LM logits" in err and "sequence classification" in err
    assert not (tmp_path / "nv").exists()
