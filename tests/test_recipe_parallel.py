"""The recipe's scale-out options on CPU (gloo runs of the tiny model on up to 4 processes, fp32): hybrid sharding
(HSDP, `--dp-replicate`) against the flat FSDP2 run on the same data, tensor parallelism (`--tp`) against the run
with as many data-parallel ranks, resuming under another layout, and the refusals (activation offloading needs a
GPU: tests/test_gpu.py checks its gradients).

Losses of the same run under two layouts differ only by the order of the fp32 gradient reductions (a reduce-scatter
over 4 ranks, or over 2 and then an all-reduce over 2): within 1e-5 relative."""

from __future__ import annotations

import copy
import json
import subprocess
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_recipe_train import losses, mlm_args, run_recipe, train_here

import modeling_nv_esm_encoder as encoder_module
from conftest import make_hf_model, make_nv_model, pack_batch, random_proteins
from nv_esm.train.config import parse_config

RANKS = 4
LOSS_RTOL = 1e-5
BF16_REDUCE_LOSS_RTOL = 1e-3  # --reduce-dtype bf16 against fp32 sums, over 6 steps (measured: up to 4.3e-5)


def refusal_on_ranks(monkeypatch: pytest.MonkeyPatch, ranks: int, *args: str, out: Path) -> subprocess.CompletedProcess:
    """`train_here` as rank 0 of `ranks` started by torchrun (its environment), for the refusals made before the
    process group is joined: joining it fails the test (the other ranks are not there)."""
    for name, value in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", ranks), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, str(value))

    def join(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{ranks} ranks were joined: nothing refused before the process group")

    monkeypatch.setattr(torch.distributed, "init_process_group", join)
    return train_here(*args, out=out)


def grad_norms(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["grad_norm"] for record in records if "grad_norm" in record}


@pytest.mark.slow
def test_hybrid_sharding_matches_flat_sharding_and_resumes_under_either_layout(
    tiny_config: Path, tmp_path: Path
) -> None:
    """4 ranks: flat FSDP2, HSDP 2x2, FSDP2's pure replication (4x1) and whole models with all-reduced gradients
    (`--data-parallel replicate`, what `auto` picks for a model this small) give the flat run's losses; a run of
    whole models stopped at step 3 and resumed as HSDP goes on with the flat run's losses (DCP reshards the model
    and optimizer state). The gradient norms (what clipping scales by) of the sharded runs equal the whole models'.
    FSDP2 reducing in bf16 (`--reduce-dtype bf16`) trains within bf16's rounding of the flat run."""
    steps = 6
    run = {
        name: (tmp_path / name, mlm_args(tiny_config, steps, "--no-export", *extra))
        for name, extra in {
            "flat": ("--data-parallel", "shard"),
            "hybrid": ("--dp-replicate", "2"),
            "replicated": ("--dp-replicate", "4"),
            "whole": (),
            "bf16_reduce": ("--reduce-dtype", "bf16"),  # FSDP2's option: auto shards
        }.items()
    }
    meshes = {
        "flat": "FSDP over 4",
        "bf16_reduce": "FSDP over 4",
        "hybrid": "2 replicas x FSDP over 2 (mesh dp_replicate=2 x dp_shard=2)",
        "replicated": "4 replicas (mesh dp_replicate=4 x dp_shard=1)",
        "whole": "a whole model on each (gradients all-reduced)",
    }
    for name, (out, args) in run.items():
        assert f"4 processes: {meshes[name]}\n" in run_recipe(out, *args, ranks=RANKS).stdout, name
    switched = tmp_path / "switched"
    run_recipe(switched, *mlm_args(tiny_config, steps, "--stop-at-step", "3", "--no-export"), ranks=RANKS)
    resumed_run = run_recipe(
        switched, *mlm_args(tiny_config, steps, "--resume", "--dp-replicate", "2", "--no-export"), ranks=RANKS
    )
    assert f"4 processes: {meshes['hybrid']}\n" in resumed_run.stdout

    flat = losses(run["flat"][0])
    assert sorted(flat) == list(range(1, steps + 1))
    for name in ("hybrid", "replicated", "whole"):
        other = losses(run[name][0])
        assert sorted(other) == sorted(flat)
        for step in flat:
            assert other[step] == pytest.approx(flat[step], rel=LOSS_RTOL), (name, step)
        # the norm of sharded gradients (summed over the sharding ranks only) equals that of whole ones
        expected, actual = grad_norms(run["whole"][0]), grad_norms(run[name if name != "whole" else "flat"][0])
        assert sorted(actual) == sorted(expected) == sorted(flat)
        for step in expected:
            assert actual[step] == pytest.approx(expected[step], rel=LOSS_RTOL), (name, step)
    resumed = losses(switched)
    for step in flat:
        assert resumed[step] == pytest.approx(flat[step], rel=LOSS_RTOL), step
    # gradients summed in bf16 (8 bits of mantissa): the same training within bf16's rounding; the first step's
    # gradient norm (the same weights and data) is off by bf16's rounding, far more than the fp32 layouts differ
    bf16_reduced = losses(run["bf16_reduce"][0])
    assert sorted(bf16_reduced) == sorted(flat)
    for step in flat:
        assert bf16_reduced[step] == pytest.approx(flat[step], rel=BF16_REDUCE_LOSS_RTOL), step
    first_norm, flat_norm = grad_norms(run["bf16_reduce"][0])[1], grad_norms(run["flat"][0])[1]
    assert abs(first_norm - flat_norm) > 10 * LOSS_RTOL * flat_norm
    assert sum(list(flat.values())[-3:]) < sum(list(flat.values())[:3])


@pytest.mark.slow
@pytest.mark.parametrize("option", ["tp", "cp"])
def test_tensor_and_context_parallelism_match_the_runs_of_their_data_parallel_size_and_resume(
    tiny_config: Path, tmp_path: Path, option: str
) -> None:
    """`--tp 2` / `--cp 2`: the two ranks of a pair train on the same micro-batches, so a run equals the run with
    as many data-parallel ranks: 1 rank vs 2 ranks in one pair (dp_shard=1 x tp=2); 2 ranks vs 4 ranks in two pairs
    (dp_shard=2 x tp=2), also with `--dp-replicate 2` (dp_replicate=2 x dp_shard=1 x tp=2). With `--cp`, the
    default `--data-parallel auto` holds whole models (no FSDP2) but with `--dp-replicate 2`. Same losses (fp32: the
    split products and attention sum in another order), and the exported weights of the 2-rank run equal the 1-rank
    run's, so checkpoints hold whole parameters. A 4-rank run stopped at step 3 resumes with the unbroken run's
    losses; resuming it without the option is refused (its data positions belong to 2 data-parallel ranks)."""
    steps, flag = 6, f"--{option}"
    whole = "a whole model on each (gradients all-reduced)"  # `--data-parallel auto` for this small model: no FSDP2
    split_one = (
        "tensor parallel over 2 (mesh dp_shard=1 x tp=2)" if option == "tp" else f"context parallel over 2, {whole}"
    )
    split_two = (
        "FSDP over 2 x tensor parallel over 2 (mesh dp_shard=2 x tp=2)"
        if option == "tp"
        else f"context parallel over 2, {whole}"
    )
    name_of = {"tp": "tensor", "cp": "context"}[option]
    runs = {
        "one": (1, (), "1 process (no parallelism)"),
        "split_one": (2, (flag, "2"), f"2 processes: {split_one}"),
        "two": (2, (), f"2 processes: {whole}"),
        "split_two": (4, (flag, "2"), f"4 processes: {split_two}"),
        "replicated_split": (
            4,
            (flag, "2", "--dp-replicate", "2"),
            f"4 processes: 2 replicas x {name_of} parallel over 2 (mesh dp_replicate=2 x dp_shard=1 x {option}=2)",
        ),
    }
    for name, (ranks, extra, mesh) in runs.items():
        export = () if name in ("one", "split_one") else ("--no-export",)
        result = run_recipe(tmp_path / name, *mlm_args(tiny_config, steps, *export, *extra), ranks=ranks)
        assert f"{mesh}\n" in result.stdout, name
    stopped = tmp_path / "stopped"
    run_recipe(stopped, *mlm_args(tiny_config, steps, flag, "2", "--stop-at-step", "3", "--no-export"), ranks=4)
    refused = run_recipe(
        stopped, *mlm_args(tiny_config, steps, flag, "1", "--resume", "--no-export"), ranks=4, check=False
    )
    assert refused.returncode != 0 and f"was written with {flag} 2" in refused.stderr  # (left out: the recorded one)
    run_recipe(stopped, *mlm_args(tiny_config, steps, flag, "2", "--resume", "--no-export"), ranks=4)

    for split, reference in (
        ("split_one", "one"),
        ("split_two", "two"),
        ("replicated_split", "two"),
        ("stopped", "two"),
    ):
        expected, actual = losses(tmp_path / reference), losses(tmp_path / split)
        assert sorted(actual) == sorted(expected) == list(range(1, steps + 1)), split
        for step in expected:
            assert actual[step] == pytest.approx(expected[step], rel=LOSS_RTOL), (split, step)
        expected, actual = grad_norms(tmp_path / reference), grad_norms(tmp_path / split)
        for step in expected:  # the gradient norm counts split parameters once per part and whole ones once
            assert actual[step] == pytest.approx(expected[step], rel=1e-4), (split, step)
    assert losses(tmp_path / "two") != losses(tmp_path / "one")  # other data: the comparisons above can fail
    # Adam's steps amplify the summation-order differences of near-zero gradients: up to ~2e-6 in 6 steps; weights
    # put in the wrong place would be off by their own size (~2e-2).
    weights = {name: load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "split_one")}
    assert weights["one"].keys() == weights["split_one"].keys()
    for key, value in weights["one"].items():
        assert weights["split_one"][key].shape == value.shape, key
        torch.testing.assert_close(weights["split_one"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_what_tensor_and_context_parallelism_do_not_support_is_refused(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused = refusal_on_ranks(monkeypatch, 2, *mlm_args(tiny_config, 2, "--tp", "3"), out=tmp_path / "run")
    assert refused.returncode != 0 and "--tp 3 must divide the number of ranks (2)" in refused.stderr
    refused = refusal_on_ranks(
        monkeypatch, 2, *mlm_args(tiny_config, 2, "--tp", "2", "--dp-replicate", "2"), out=tmp_path / "run"
    )
    assert (
        refused.returncode != 0
        and "--dp-replicate 2 must divide the number of ranks (2 / --tp 2 = 1)" in refused.stderr
    )
    refused = refusal_on_ranks(monkeypatch, 2, *mlm_args(tiny_config, 2, "--cp", "3"), out=tmp_path / "run")
    assert refused.returncode != 0 and "--cp 3 must divide the number of ranks (2)" in refused.stderr
    for parallel in ("--tp", "--cp"):
        for option in ("--lora-rank 4", "--offload-activations", "--compile"):
            argv = [*mlm_args(tiny_config, 2, parallel, "2", *option.split()), "--out", str(tmp_path / "x")]
            with pytest.raises(ValueError, match=f"{parallel} 2 with {option.split()[0]} is not supported"):
                parse_config(argv).validate()
    argv = [*mlm_args(tiny_config, 2, "--cp", "2", "--tp", "2"), "--out", str(tmp_path / "x")]
    with pytest.raises(ValueError, match="--cp 2 with --tp is not supported"):
        parse_config(argv).validate()


@pytest.mark.parametrize("option", ["--tp 2", "--dp-replicate 2", "--keep-gathered", "--reduce-dtype bf16"])
def test_whole_models_refuse_the_options_of_sharded_ones(tiny_config: Path, tmp_path: Path, option: str) -> None:
    argv = [*mlm_args(tiny_config, 2, "--data-parallel", "replicate", *option.split()), "--out", str(tmp_path / "x")]
    with pytest.raises(
        ValueError, match=f"--data-parallel replicate holds a whole model on each rank; {option.split()[0]} "
    ):
        parse_config(argv).validate()


def test_auto_replicates_what_fits_a_device_and_shards_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--data-parallel auto` holds whole models when the training state (16 bytes a parameter) and a micro-batch's
    activations fit in 80% of a device; any of FSDP2's own options (--dp-replicate or --tp above 1, --keep-gathered,
    --reduce-dtype bf16) keeps FSDP2."""
    import dataclasses

    from configuration_nv_esm import NVEsmConfig
    from nv_esm.train import materialize
    from nv_esm.train.config import DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from nv_esm.train.parallel import Dist

    class Mesh:
        def __init__(self, names: tuple[str, ...]) -> None:
            self.mesh_dim_names = names

    nv_config = NVEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    parameters = 2 * (4 * 64 * 64 + 2 * 64 * 128) + nv_config.padded_vocab_size * 64 + 64 * 64
    config = TrainConfig(
        ModelConfig(), DataConfig(files=[], token_budget=1000), OptimizerConfig(steps=10), out=Path("x")
    )
    activations = 1000 * materialize.activation_bytes_per_token(config, nv_config, torch.device("cpu"))
    needed = 16 * parameters + activations
    for memory, replicated in ((needed / 0.8, True), (needed / 0.8 - 1, False)):
        monkeypatch.setattr(materialize, "device_memory", lambda device, memory=memory: int(memory))
        world = Dist(0, 2, torch.device("cpu"), Mesh(("dp_shard",)))
        assert materialize.data_parallel_layout(config, nv_config, world).replicated is replicated
        for sharding in (dict(dp_replicate=2), dict(tp=2), dict(keep_gathered=True), dict(reduce_dtype="bf16")):
            asks = dataclasses.replace(config, parallel=ParallelConfig(**sharding))
            assert not materialize.data_parallel_layout(asks, nv_config, world).replicated, sharding
        alone = Dist(0, 1, torch.device("cpu"), Mesh(("dp_shard",)))
        assert not materialize.data_parallel_layout(config, nv_config, alone).replicated


def test_ranks_holding_whole_models_replay_training_graphs() -> None:
    """Ranks holding whole models average `.grad` themselves after the step's backwards (`complete_gradients`), so
    the trainer tells their model so (`reduce_gradients_after_backward`: training forwards replay CUDA graphs on
    several ranks); FSDP2 shards are built without it."""
    from configuration_nv_esm import NVEsmConfig
    from nv_esm.train import materialize
    from nv_esm.train.config import DataConfig, ModelConfig, OptimizerConfig, TrainConfig
    from nv_esm.train.parallel import Dist

    config = TrainConfig(
        ModelConfig(), DataConfig(files=[], token_budget=1000), OptimizerConfig(steps=1), out=Path("x")
    )
    for replicated in (True, False):
        nv_config = NVEsmConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, backend="torch"
        )
        world = Dist(0, 1, torch.device("cpu"), None, replicated=replicated)
        model = materialize.build_model(config, nv_config, world)
        assert model.base_model.encoder.gradients_reduced_after_backward is replicated


def test_a_replica_count_that_does_not_divide_the_ranks_is_refused(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = mlm_args(tiny_config, 2, "--dp-replicate", "3")
    refused = refusal_on_ranks(monkeypatch, RANKS, *args, out=tmp_path / "run")
    assert refused.returncode != 0 and "--dp-replicate 3 must divide the number of ranks (4)" in refused.stderr
    config = parse_config([*mlm_args(tiny_config, 2, "--dp-replicate", "0"), "--out", str(tmp_path / "other")])
    with pytest.raises(ValueError, match="--dp-replicate must be at least 1"):
        config.validate()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recipe trains on the GPU here, where it offloads")
def test_the_recipe_refuses_activation_offloading_off_the_gpu(tiny_config: Path, tmp_path: Path) -> None:
    """`--offload-activations` moves GPU activations to host memory: on CPU the recipe refuses it before training."""
    refused = train_here(*mlm_args(tiny_config, 2, "--offload-activations"), out=tmp_path / "run")
    assert refused.returncode != 0 and "--offload-activations moves activations from GPU to host" in refused.stderr


def test_the_model_refuses_activation_offloading_off_the_gpu() -> None:
    """The model's `offload_activations` refuses a training forward on CPU tensors (eval forwards do not
    offload)."""
    hf = make_hf_model("tiny", seed=5)
    offloading, plain = make_nv_model(hf, offload_activations=True), make_nv_model(hf)
    batch = pack_batch(random_proteins([30, 1, 64], seed=6, mask_fraction=0.15))
    with torch.no_grad():
        torch.testing.assert_close(offloading(**batch).logits, plain(**batch).logits, rtol=0, atol=0)
    offloading.train()
    with pytest.raises(ValueError, match="offload_activations moves GPU activations to host memory"):
        offloading(**batch, labels=batch["input_ids"])
    offloading.esm.encoder._offload.awaiting_backward = True  # as after a GPU forward (tests/test_gpu.py runs one)
    with pytest.raises(RuntimeError, match="backward has not run yet"):
        offloading(**batch, labels=batch["input_ids"])
    copied = copy.deepcopy(offloading)  # the context (a CUDA stream) is not copied; nor is the waiting state
    assert copied.esm.encoder._offload.context is None and not copied.esm.encoder._offload.awaiting_backward


def test_offloaded_layers_sets_how_many_layers_offload(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--offloaded-layers N` (the model's `offloaded_layers`) offloads the first N layers, at most all but the last,
    and only with `--offload-activations`; the model hands N to Transformer Engine's offload context (None: all but
    the last). tests/test_gpu.py checks the gradients of such a run on the GPU."""
    alone = train_here(*mlm_args(tiny_config, 2, "--offloaded-layers", "1"), out=tmp_path / "alone")
    assert alone.returncode == 1 and "--offloaded-layers counts the layers that --offload-activations" in alone.stderr
    too_many = train_here(*mlm_args(tiny_config, 2, "--offload-activations", "--offloaded-layers", "2"), out=tmp_path)
    assert too_many.returncode == 1 and "this model has 2 layers, and the last one" in too_many.stderr
    hf = make_hf_model("wide_heads", seed=5)  # 3 layers
    for value, message in ((3, "offloaded_layers must be None or a layer count in .1, 2."), (0, "in .1, 2."),
                           (True, "in .1, 2."), (1.0, "in .1, 2."), (2, "set both")):  # fmt: skip
        offload = value != 2
        with pytest.raises(ValueError, match=message):
            make_nv_model(hf, offload_activations=offload, offloaded_layers=value)

    asked = []
    engine = types.SimpleNamespace(get_cpu_offload_context=lambda **kwargs: (asked.append(kwargs), (None, None))[1])
    offloading = types.SimpleNamespace(DefaultOffloadSynchronizer=object, NVTE_CPU_OFFLOAD_V1=False)
    monkeypatch.setattr(encoder_module, "transformer_engine_available", lambda: True)
    modules = {"pytorch": engine, "pytorch.cpu_offload": offloading}
    monkeypatch.setattr(encoder_module, "import_transformer_engine", lambda module="pytorch": modules[module])
    for offloaded_layers in (None, 1, 2):
        model = make_nv_model(hf, offload_activations=True, offloaded_layers=offloaded_layers)
        model.esm.encoder._offload.build(len(model.esm.encoder.layers), model.config.offloaded_layers)
    assert [(kwargs["num_layers"], kwargs["model_layers"]) for kwargs in asked] == [(2, 3), (1, 3), (2, 3)]


def test_activation_offloading_with_checkpointing_is_refused(tiny_config: Path, tmp_path: Path) -> None:
    """Transformer Engine's offload context does not reach the inputs `te.checkpoint` keeps (an H100 run offloaded
    0 MB): the recipe and the model refuse the combination rather than offload nothing silently."""
    argv = [*mlm_args(tiny_config, 2, "--offload-activations", "--activation-checkpointing"), "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="offloads nothing"):
        parse_config(argv).validate()
    model = make_nv_model(make_hf_model("tiny", seed=5), offload_activations=True).train()
    model.gradient_checkpointing_enable()
    batch = pack_batch(random_proteins([30, 1, 64], seed=6, mask_fraction=0.15))
    with pytest.raises(ValueError, match="offloads nothing"):
        model(**batch, labels=batch["input_ids"])


def test_recompute_mlp_keeps_less_for_the_backward_and_changes_no_gradient(tiny_config: Path, tmp_path: Path) -> None:
    """`recompute_mlp` (`--recompute-mlp`): a training forward saves fewer bytes for the backward (the MLP keeps its
    input only), and the loss and every gradient equal the plain model's (fp32: the same operations, run again);
    the recipe refuses it with --activation-checkpointing (the whole layer is recomputed there).
    tests/test_gpu.py checks TE's selective checkpointing the same way."""
    hf = make_hf_model("wide_heads", seed=7)
    plain, recomputing = make_nv_model(hf).train(), make_nv_model(hf, recompute_mlp=True).train()
    assert all(layer.layernorm_mlp.recompute for layer in recomputing.esm.encoder.layers)
    batch = pack_batch(random_proteins([40, 1, 77, 12], seed=8, mask_fraction=0.2))
    saved, loss_values = {}, {}
    for name, model in (("plain", plain), ("recomputing", recomputing)):
        sizes = []

        def pack(tensor: torch.Tensor, sizes: list = sizes) -> torch.Tensor:
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        saved[name], loss_values[name] = sum(sizes), loss.item()
    assert saved["recomputing"] < 0.8 * saved["plain"], saved
    assert loss_values["recomputing"] == pytest.approx(loss_values["plain"], rel=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputing.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)

    refused = train_here(*mlm_args(tiny_config, 2, "--recompute-mlp", "--activation-checkpointing"), out=tmp_path)
    assert refused.returncode == 1 and "--recompute-mlp recomputes the MLP of layers that" in refused.stderr


@pytest.mark.slow
def test_the_recipe_with_recompute_mlp_trains_to_the_same_losses(tiny_config: Path, tmp_path: Path) -> None:
    """`--recompute-mlp` on 2 ranks, whole models and FSDP2 shards (the recompute gathers nothing again: it runs
    inside the layer's backward): the losses of the run without it (fp32: within 1e-5)."""
    recompute = ("--recompute-mlp",)
    runs = {"plain": (), "recomputing": recompute, "sharded": (*recompute, "--data-parallel", "shard")}
    for name, extra in runs.items():
        run_recipe(tmp_path / name, *mlm_args(tiny_config, 4, "--no-export", "--log-every", "1", *extra))
    expected = losses(tmp_path / "plain")
    for name in ("recomputing", "sharded"):
        actual = losses(tmp_path / name)
        assert sorted(actual) == sorted(expected) == [1, 2, 3, 4], name
        for step in expected:
            assert actual[step] == pytest.approx(expected[step], rel=1e-5), (name, step)


def test_replayed_and_eager_backwards_issue_the_same_all_reduces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks holding whole models may differ in how their last backward ran (one replayed a CUDA graph, another
    fell back to eager after a failed capture): `average_gradients` plans its collectives from the weights alone,
    so both issue the same all-reduces (element counts, dtypes, order), and the eager one averages every gradient,
    a missing one as zeros. Layer buckets run from the last layer down, about `GRADIENT_BUCKET_BYTES` each."""
    from nv_esm.train import parallel

    monkeypatch.setattr(parallel, "GRADIENT_BUCKET_BYTES", 4 * 300)  # 300 fp32 values
    sizes = [[50, 70], [50, 70], [], [50, 70], [50, 70], [50, 70]]  # a layer without GEMM weights in the middle
    layers = [[torch.nn.Parameter(torch.randn(n)) for n in layer] for layer in sizes]
    flat = torch.zeros(sum(map(sum, sizes)))

    class Model(torch.nn.Module):  # the model's runtime interface for gradient reduction (`layer_gradients`)
        replayed = False

        def layer_gradients(self) -> tuple[list, list | None]:
            if not self.replayed:
                return layers, None
            views, start = [], 0
            for layer in layers:
                views.append(flat[start : start + sum(w.numel() for w in layer)])
                start += views[-1].numel()
            return layers, [(None, view) for view in views]

    model = Model()
    model.weights = torch.nn.ParameterList([w for layer in layers for w in layer])
    model.bias = torch.nn.Parameter(torch.randn(7))
    calls: list = []

    def all_reduce(tensor: torch.Tensor, **kwargs: object) -> types.SimpleNamespace:  # one rank: the sum is itself
        calls.append((tensor.numel(), tensor.dtype))
        return types.SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(parallel.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(
        parallel,
        "_all_reduce_when_recorded",
        lambda bucket, side, n: calls.append((sum(v.numel() for _, v in bucket), flat.dtype)),
    )
    monkeypatch.setattr(parallel.torch.cuda, "Stream", lambda: types.SimpleNamespace())
    monkeypatch.setattr(
        parallel.torch.cuda, "current_stream", lambda: types.SimpleNamespace(wait_stream=lambda s: None)
    )
    schedules = {}
    for replayed in (False, True):
        model.replayed = replayed
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        layers[0][1].grad = None  # unused on this rank: averaged as zeros
        calls.clear()
        parallel.average_gradients(model, world_size=2)
        schedules[replayed] = list(calls)
        if not replayed:
            assert torch.equal(layers[0][1].grad, torch.zeros(70)) and torch.equal(
                layers[5][0].grad, torch.full((50,), 0.5)
            )
            assert torch.equal(model.bias.grad, torch.full((7,), 0.5))
    # buckets of layers 5-4-3 (360 values), then 1-0 (240); then the bias
    assert schedules[False] == schedules[True] == [(360, torch.float32), (240, torch.float32), (7, torch.float32)]
