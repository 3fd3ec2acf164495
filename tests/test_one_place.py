"""Each decision about how a batch runs has one place (`modeling_nv_esm_plan.py`), and the trainer reaches the model
through its runtime interface only: these tests read the sources and fail when a second place appears.

- graph or eager: only the plan reads `config.cuda_graphs` and asks whether a stream is capturing or the layers are
  sharded (`_graphed`);
- the inference precision (bf16 autocast on CUDA): only the plan makes it (`inference_autocast`); the trainer's
  compute dtype (`forward_context`) and the CUDA-graph capture (which re-enters the caller's autocast) are not
  choices of it;
- the trainer never duck-types the model (`hasattr(module, "graphs")`, "partial_gradients") nor flips its config
  fields after it is built (`model.config.X = ...`): it calls `runs_eagerly`, `reduce_gradients_after_backward`,
  `layer_gradients`, `reduce_partial_gradients`;
- Transformer Engine is imported in one guarded place (`import_transformer_engine`);
- a tensor-parallel rank's part of a weight is computed in one place (`tensor_parallel_part`);
- weights are initialised by one rule (`modeling_nv_esm.initial_value`);
- the trainer's configuration does not import the command-line module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import ROOT

REMOTE_CODE = sorted(ROOT.glob("*_nv_esm*.py"))
PACKAGE = sorted((ROOT / "nv_esm").rglob("*.py"))
TRAINER = sorted((ROOT / "nv_esm" / "train").glob("*.py"))
PLAN = ROOT / "modeling_nv_esm_plan.py"


def code_of(path: Path) -> str:
    """The code of `path` without its comments, docstrings and other strings (each string becomes '')."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.unparse(tree)


def places(pattern: str, files: list[Path]) -> set[str]:
    """The files (relative names) among `files` whose code (`code_of`) matches `pattern`."""
    return {path.relative_to(ROOT).as_posix() for path in files if re.search(pattern, code_of(path))}


@pytest.mark.parametrize(
    ("what", "pattern"),
    [
        ("the model's cuda_graphs option", r"\b(config|options|run_options)\.cuda_graphs\b"),
        ("a capture in progress", r"is_current_stream_capturing"),
        ("sharded layers", r"(?<!def )\bis_sharded\("),
        ("the training ranks", r"(?<!def )\bseveral_ranks\(\)"),
        ("bf16 inference autocast", r"torch\.autocast\('', dtype=torch\.bfloat16"),
    ],
)
def test_how_a_batch_runs_is_decided_in_the_plan_only(what, pattern):
    assert places(pattern, REMOTE_CODE + PACKAGE) == {PLAN.name}, what


@pytest.mark.parametrize(
    "pattern",
    [
        r"hasattr\(\w+, [\"'](graphs|partial_gradients|reduce_partial_gradients)[\"']\)",
        r"\.graphs\.",
        r"(?<!\w)(\w+\.)?config\.\w+ = ",  # a built model's config (not `nv_config` before it is built)
    ],
)
def test_the_trainer_reaches_the_model_through_its_interface(pattern):
    found = set()
    for path in TRAINER:
        text = path.read_text()
        if re.search(pattern, text):
            found.add(path.name)
    assert not found, f"{pattern!r} in {sorted(found)}"


def test_a_weight_is_cut_for_a_tensor_parallel_rank_in_one_place():
    """`modeling_nv_esm_parallel.tensor_parallel_part` (and `tensor_parallel_whole_shape`, its inverse) say which part
    of a weight a rank holds: the encoder's split and the trainer's loading and checkpoints do not compute it."""
    cuts = r"\*=? ?world\.tp_size|tp_rank \*|\.chunk\(size|TENSOR_PARALLEL_SPLITS"
    assert places(cuts, [ROOT / "modeling_nv_esm_encoder.py", *TRAINER]) == set()


def test_weights_are_initialised_by_one_rule():
    """`modeling_nv_esm.initial_value` is the rule: the trainer's fresh tensors come from it, not from a rule of
    their own (a second reader of `initializer_range`, or random draws, in the package)."""
    assert places(r"initializer_range", PACKAGE) == set()
    assert places(r"\b(randn|normal_)\(", [ROOT / "nv_esm" / "train" / "materialize.py"]) == set()


def test_transformer_engine_is_imported_in_one_guarded_place():
    """The model code and the package import Transformer Engine through `import_transformer_engine` (which says how
    to install it), never directly: only `transformer_engine_available` tries the import itself."""
    direct = r"import_module\(f?'transformer_engine|\bimport transformer_engine\b(?!_)|\bfrom transformer_engine\b(?!_)"
    found = {path.name for path in REMOTE_CODE + PACKAGE if re.search(direct, ast.unparse(ast.parse(path.read_text())))}
    assert found == {"modeling_nv_esm_layers.py"}
    layers = (ROOT / "modeling_nv_esm_layers.py").read_text()
    assert layers.count('importlib.import_module("transformer_engine') == 1  # the guard
    assert layers.count('importlib.import_module(f"transformer_engine.{module}")') == 1  # after the guard


def test_the_trainer_configuration_does_not_import_the_command_line():
    tree = ast.parse((ROOT / "nv_esm" / "train" / "config.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "nv_esm.cli" not in imported


def test_the_architecture_and_the_run_options_are_apart(tmp_path):
    """`NVEsmConfig`'s own fields are the architecture (what config.json holds); the run options are one
    `RunOptions`, given as keywords, read as attributes, never written."""
    import inspect
    import json

    from configuration_nv_esm import LOAD_TIME_OPTIONS, NVEsmConfig, RunOptions

    architecture = set(inspect.signature(NVEsmConfig.__init__).parameters) - {"self", "kwargs"}
    assert not architecture & set(LOAD_TIME_OPTIONS) and len(architecture) <= 22
    config = NVEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         backend="torch", cuda_graphs=False, layer_precision=(None, None))  # fmt: skip
    assert config.run_options == RunOptions(backend="torch", cuda_graphs=False, layer_precision=[None, None])
    assert config.backend == "torch" and not config.cuda_graphs
    config.save_pretrained(tmp_path)
    assert not set(json.loads((tmp_path / "config.json").read_text())) & set(LOAD_TIME_OPTIONS)
    assert NVEsmConfig.from_pretrained(tmp_path, cuda_graphs=False).run_options == RunOptions(cuda_graphs=False)


def test_a_moved_option_is_refused_with_what_replaces_it(tmp_path):
    """`gradients_reduced_after_backward` is the model's runtime interface now, not a config option: passing it
    says what to call; a config.json that still holds it (never meant to) loads without it."""
    import json

    from configuration_nv_esm import NVEsmConfig

    with pytest.raises(ValueError, match=r"call model\.reduce_gradients_after_backward\(\) on the model"):
        NVEsmConfig(gradients_reduced_after_backward=True)
    config = NVEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    fields = {**config.to_saved_dict(use_diff=False), "gradients_reduced_after_backward": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    loaded = NVEsmConfig.from_json_file(path)
    assert not hasattr(loaded, "gradients_reduced_after_backward")


def test_run_options_given_to_from_pretrained_are_checked_and_older_configs_still_read(tmp_path):
    """`from_pretrained` sets its keywords on the built config (property setters, unchecked there): the model
    checks them when it is built, as `__init__` checks its own. A config dict of an older version that still holds a
    moved option (a training checkpoint's train_state.json) is read without it."""
    from configuration_nv_esm import NVEsmConfig
    from modeling_nv_esm import NVEsmForMaskedLM

    config = NVEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         backend="torch")  # fmt: skip
    NVEsmForMaskedLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fp8_weights holds the FP8 layers' weights in FP8"):
        NVEsmForMaskedLM.from_pretrained(tmp_path, backend="torch", fp8_weights=True)
    with pytest.raises(ValueError, match=r"layer_precision must have one entry per layer \(2\)"):
        NVEsmForMaskedLM.from_pretrained(tmp_path, backend="torch", layer_precision=["fp8"])
    old = {**config.to_dict(), "gradients_reduced_after_backward": True}
    assert NVEsmConfig.from_dict(old).run_options == config.run_options
