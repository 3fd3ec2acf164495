"""The one table of unsupported feature combinations (`configuration_nv_esm.UNSUPPORTED_COMBINATIONS`):
well formed, looked up whatever the order, worded as the model's refusals read, and the source of nv-esm train's
refusals of its options (`TrainConfig.validate`, `parallelize`): removing a pair lets it through, adding one
refuses it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from test_recipe_train import mlm_args
from torch import nn

from configuration_nv_esm import FEATURES, UNSUPPORTED_COMBINATIONS, refuse_combinations, refused_combination
from nv_esm.train.config import OPTION_FEATURES, ParallelConfig, parse_config, refuse_option_combinations
from nv_esm.train.parallel import Dist, parallelize

PAIRS = {frozenset(pair) for pair in UNSUPPORTED_COMBINATIONS}

# The options of `OPTION_FEATURES` as a command line asks for them (--backend: the model config's, in parallelize).
ASKING = {
    "--tp": ["--tp", "2"],
    "--cp": ["--cp", "2"],
    "--lora-rank": ["--lora-rank", "4"],
    "--offload-activations": ["--offload-activations"],
    "--activation-checkpointing": ["--activation-checkpointing"],
    "--compile": ["--compile"],
}

# The model's refusals, as enable_tensor_parallel / enable_context_parallel raise them.
SHARED_REASONS = {
    "padded_layers": "it needs packed layers (attn_input_format='thd')",
    "dropout": "dropout is not supported (attention_probs_dropout_prob and hidden_dropout_prob must be 0)",
    "lora": "LoRA adapters are not supported",
    "offload_activations": "activation offloading is not supported",
    "fp8_weights": "weights held in FP8 (fp8_weights) are not supported",
}
MODEL_MESSAGES = {
    ("tensor_parallel", "context_parallel"): "tensor parallelism: it does not combine with context parallelism yet.",
    ("context_parallel", "tensor_parallel"): "context parallelism: it does not combine with tensor parallelism yet.",
    **{
        (kind, other): f"{name}: {reason}."
        for kind, name in (("tensor_parallel", "tensor parallelism"), ("context_parallel", "context parallelism"))
        for other, reason in SHARED_REASONS.items()
    },
}


def validate(tiny_config: Path, out: Path, *options: str) -> None:
    parse_config([*mlm_args(tiny_config, 2, *options), "--out", str(out)]).validate()


def test_the_table_names_known_features_and_each_pair_once() -> None:
    assert len(PAIRS) == len(UNSUPPORTED_COMBINATIONS)  # no pair twice, in either order
    for (feature, other), reason in UNSUPPORTED_COMBINATIONS.items():
        assert feature != other and {feature, other} <= FEATURES.keys(), (feature, other)
        assert reason.format(other="X") and not reason.endswith("."), (feature, other)
    assert set(OPTION_FEATURES.values()) <= FEATURES.keys()
    assert set().union(*PAIRS) == FEATURES.keys()  # every feature named is refused with something


def test_every_pair_is_refused_in_either_order_and_only_the_pairs() -> None:
    for feature, other in itertools.permutations(FEATURES, 2):
        refused = refused_combination([feature, other])
        assert (refused is not None) == ({feature, other} in PAIRS), (feature, other)
        if refused:
            assert refused == refused_combination([other, feature])
            assert {refused[0], refused[1]} == {feature, other}
            assert refused_combination([other], subject=feature)[:2] == (feature, other)
    assert refused_combination(["lora", "compile", "dropout", "activation_checkpointing", "padded_layers"]) is None
    with pytest.raises(ValueError, match=r"unknown features \['pipeline_parallel'\]"):
        refused_combination(["tensor_parallel", "pipeline_parallel"])


def test_the_first_refused_pair_is_the_tables_first_and_a_subject_keeps_to_its_pairs() -> None:
    every = set(FEATURES)
    assert refused_combination(every)[:2] == next(iter(UNSUPPORTED_COMBINATIONS))
    assert refused_combination(every, subject="tensor_parallel")[:2] == ("tensor_parallel", "padded_layers")
    assert refused_combination(every - {"padded_layers"}, subject="context_parallel")[1] == "dropout"
    assert refused_combination({"offload_activations", "activation_checkpointing"}, subject="compile") is None


def test_the_reasons_give_the_models_refusals_word_for_word() -> None:
    """`refuse_combinations`' default message is what enable_tensor_parallel / enable_context_parallel raise; the
    offloading refusal words its message around the reason."""
    for (kind, other), message in MODEL_MESSAGES.items():
        with pytest.raises(ValueError) as error:
            refuse_combinations({other}, subject=kind)
        assert str(error.value) == message

    def offloading(feature: str, other: str, reason: str) -> str:
        return f"offload_activations with gradient checkpointing {reason}: use one of them."

    with pytest.raises(ValueError, match="^offload_activations with gradient checkpointing offloads nothing"):
        refuse_combinations({"activation_checkpointing", "offload_activations"}, offloading)
    refuse_combinations({"tensor_parallel", "activation_checkpointing", "te_layers"})  # these combine: no error


def test_each_pair_of_training_options_is_refused_exactly_when_the_table_refuses_its_features(
    tiny_config: Path, tmp_path: Path
) -> None:
    for option, other in itertools.combinations(ASKING, 2):
        refused = frozenset({OPTION_FEATURES[option], OPTION_FEATURES[other]}) in PAIRS
        if not refused:
            validate(tiny_config, tmp_path, *ASKING[option], *ASKING[other])
            continue
        with pytest.raises(ValueError) as error:
            validate(tiny_config, tmp_path, *ASKING[option], *ASKING[other])
        assert option in str(error.value) and other in str(error.value) and "use one of them" in str(error.value)


def test_the_trainer_keeps_its_messages_and_their_order(tiny_config: Path, tmp_path: Path) -> None:
    cases = {
        "--tp 2 with --lora-rank is not supported; use one of them.": ["--tp", "2", "--cp", "2", "--lora-rank", "4"],
        "--tp 2 with --compile is not supported; use one of them.": ["--tp", "2", "--cp", "2", "--compile"],
        "--cp 2 with --tp is not supported; use one of them.": ["--tp", "2", "--cp", "2"],
        "--cp 2 with --offload-activations is not supported; use one of them.": ["--cp", "2", "--offload-activations"],
        "--offload-activations with --activation-checkpointing offloads nothing (Transformer Engine's offloading "
        "does not reach the checkpointed layer inputs): use one of them.": [
            "--tp", "2", "--offload-activations", "--activation-checkpointing"
        ],
    }  # fmt: skip
    for message, options in cases.items():
        with pytest.raises(ValueError) as error:
            validate(tiny_config, tmp_path, *options)
        assert str(error.value) == message


def test_the_trainer_reads_the_table(tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair taken out of the table is accepted; one put in is refused with its reason."""
    monkeypatch.delitem(UNSUPPORTED_COMBINATIONS, ("tensor_parallel", "lora"))
    validate(tiny_config, tmp_path, "--tp", "2", "--lora-rank", "4")
    monkeypatch.setitem(UNSUPPORTED_COMBINATIONS, ("lora", "compile"), "cannot {other}")
    with pytest.raises(ValueError, match=r"^--lora-rank with --compile cannot torch\.compile: use one of them\.$"):
        validate(tiny_config, tmp_path, "--lora-rank", "4", "--compile")


def stub_model() -> nn.Module:
    """What `parallelize` needs of a model on one rank: its layers at `encoder.layers`."""
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.layers = nn.ModuleList([nn.Linear(2, 2)])
    return model


def test_compile_with_transformer_engine_layers_is_refused_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """`parallelize` knows the layers' backend: --compile with TE layers is refused there (validate cannot tell
    --backend auto's layers), with the table's reason; torch layers are compiled."""
    world, settings = Dist(0, 1, torch.device("cpu"), None), ParallelConfig(compile=True)
    message = r"^--compile is for --backend torch; Transformer Engine layers are fused already\.$"
    with pytest.raises(ValueError, match=message):
        parallelize(stub_model(), settings, world, "te")
    with pytest.raises(ValueError, match=message):
        refuse_option_combinations(settings, backend="te")
    refuse_option_combinations(settings, backend="torch")
    refuse_option_combinations(ParallelConfig(), backend="te")
    monkeypatch.delitem(UNSUPPORTED_COMBINATIONS, ("compile", "te_layers"))
    model = stub_model()
    parallelize(model, settings, world, "te")
    assert model.encoder.layers[0]._compiled_call_impl is not None
