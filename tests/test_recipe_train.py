"""The training recipe (nv_esm.train, launched as recipes/train.py) on CPU: 2-process gloo runs of the FSDP2
loop with the PyTorch twin, checkpoint resume, export.

The runs are torchrun's ranks forked from a process with the trainer imported (`forked_ranks`), a few seconds each,
of the tiny ESM-2 shape on the demo FASTA."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import forked_ranks
import pytest
import torch
from safetensors.torch import load_file
from transformers import EsmForSequenceClassification, EsmForTokenClassification

from conftest import (
    ATOL_FP32,
    ROOT,
    TINY_CHECKPOINT,
    make_head_models,
    make_hf_model,
    make_nv_model,
    max_abs_diff,
    pad_batch,
    random_lengths,
    random_proteins,
)
from modeling_nv_esm import (
    NVEsmForMaskedLM,
    NVEsmForSequenceClassification,
    NVEsmForTokenClassification,
)
from nv_esm import data, trace_summary
from nv_esm.conversion import convert_nv_to_hf
from nv_esm.hub_folder import REMOTE_CODE_FILES
from nv_esm.plots import training_curves
from nv_esm.train import loop
from nv_esm.train.config import ModelConfig, OptimizerConfig
from nv_esm.train.export import export_weights
from nv_esm.train.loop import learning_rate_factor
from nv_esm.train.lora import add_lora

DEMO_FASTA = ROOT / "recipes" / "demo_data" / "demo.fasta"
SECONDARY_STRUCTURE = ROOT / "recipes" / "demo_data" / "secondary_structure.csv"


def run_recipe(
    out: Path, *args: str, ranks: int = 2, check: bool = True, torchrun: bool = False
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node RANKS recipes/train.py --out OUT --backend torch ARGS` on CPU: its
    ranks forked from a process that has imported the trainer (`forked_ranks`: torchrun's variables, its stop of
    the other ranks when one fails), or (`torchrun`) that command itself. Raises with the output unless it succeeds
    or `check` is false."""
    argv = ["--out", str(out), "--backend", "torch", *args]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--standalone"]
        env = {**os.environ, **forked_ranks.SERVER_ENV}
        result = subprocess.run(
            [*command, str(ROOT / "recipes" / "train.py"), *argv], capture_output=True, text=True, env=env, timeout=300
        )
    else:
        result = forked_ranks.run("nv_esm.train.loop:main", argv, ranks=ranks)
    if check and result.returncode != 0:
        raise AssertionError(f"recipe failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def train_here(*args: object, out: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m nv_esm.train --backend torch ARGS --out OUT` (`test_recipe_edges.train`) in this process, for
    argument and refusal checks: `nv_esm.train.loop.main`'s exit status (argparse's for a usage error) and what it
    printed. `test_recipe_edges.test_a_refusal_exits_1_with_one_line_on_stderr` checks that a process gives the same."""
    argv = ["--backend", "torch", *map(str, args), *(["--out", str(out)] if out is not None else [])]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = loop.main(argv)
        except SystemExit as usage_error:
            status = usage_error.code
    return subprocess.CompletedProcess(argv, status, stdout.getvalue(), stderr.getvalue())


def losses(out: Path) -> dict[int, float]:
    """Step -> loss; a step logged twice (before a kill and after the resume) keeps its last value."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if "loss" in record}  # not validation records


def mlm_args(config: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", str(config), "--data", str(DEMO_FASTA), "--steps", str(steps), "--tokens-per-batch", "1024",
            "--max-length", "254", "--lr", "3e-3", "--seed", "3", *extra]  # fmt: skip


@pytest.mark.parametrize("task, num_labels", [("mlm", 0), ("token", 3), ("sequence", 3), ("sequence", 1)])
def test_the_trainers_summed_loss_is_transformers_head_loss(task: str, num_labels: int) -> None:
    """`loop.summed_loss` over a packed micro-batch, divided by its label count, is the loss transformers' head of
    the same weights gives for the same proteins right-padded (fp32): the trainer sums the heads' own losses. The
    proteins have random lengths, one of length 1; sequence labels are class ids, or float targets for one label."""
    generator = torch.Generator().manual_seed(11)
    lengths = random_lengths(generator, 6, longest=40)
    proteins = random_proteins(lengths, seed=12, mask_fraction=0.3)
    if task == "mlm":
        hf_model = make_hf_model("tiny", seed=13)
        nv_model = make_nv_model(hf_model)
    else:
        hf_class, nv_class = {
            "token": (EsmForTokenClassification, NVEsmForTokenClassification),
            "sequence": (EsmForSequenceClassification, NVEsmForSequenceClassification),
        }[task]
        hf_model, nv_model = make_head_models(hf_class, nv_class, seed=13, num_labels=num_labels)
    if task == "sequence" and num_labels == 1:
        labels = torch.randn(len(proteins), generator=generator)
    elif task == "sequence":
        labels = torch.randint(0, num_labels, (len(proteins),), generator=generator)
    else:  # per token: -100 where not scored (MLM: the unmasked tokens)
        classes = num_labels or hf_model.config.vocab_size
        labels = [torch.randint(0, classes, (len(p),), generator=generator) for p in proteins]
        labels = [torch.where(torch.rand(len(p), generator=generator) < 0.5, -100, t) for p, t in zip(proteins, labels)]
    packed_labels = labels if task == "sequence" else [t.tolist() for t in labels]
    batch = data.pack_batch([p.tolist() for p in proteins], packed_labels)
    input_ids, attention_mask = pad_batch(proteins)
    padded_labels = labels if task == "sequence" else data.pad_proteins(labels, -100)["input_ids"]
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, labels=padded_labels).loss
        summed = loop.summed_loss(nv_model, batch, task, nv_model.config)
    count = batch.labels.numel() if task == "sequence" else int((batch.labels != -100).sum())
    assert count and summed.item() / count == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_accumulation_and_resume_is_exact(tiny_config: Path, tmp_path: Path) -> None:
    """Same global batch (W=2, A=1 vs W=1, A=2), same fresh init: same losses. A run stopped at step 3 and resumed
    gives exactly the unbroken run's losses, and the loss goes down."""
    steps = 8
    run_recipe(tmp_path / "one", *mlm_args(tiny_config, steps, "--grad-accum", "2", "--no-export"), ranks=1)
    run_recipe(tmp_path / "two", *mlm_args(tiny_config, steps, "--no-export"))
    run_recipe(tmp_path / "resumed", *mlm_args(tiny_config, steps, "--stop-at-step", "3", "--no-export"))
    assert sorted(losses(tmp_path / "resumed")) == [1, 2, 3]
    refused = run_recipe(tmp_path / "resumed", *mlm_args(tiny_config, steps, "--no-export"), check=False)
    assert refused.returncode != 0 and "--resume" in refused.stderr
    changed = run_recipe(
        tmp_path / "resumed", *mlm_args(tiny_config, steps, "--resume", "--no-export"), "--seed", "4", check=False
    )
    assert changed.returncode != 0 and "--seed 3 -> 4" in changed.stderr
    run_recipe(tmp_path / "resumed", *mlm_args(tiny_config, steps, "--resume", "--no-export"))

    one, two, resumed = losses(tmp_path / "one"), losses(tmp_path / "two"), losses(tmp_path / "resumed")
    assert sorted(one) == sorted(two) == sorted(resumed) == list(range(1, steps + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
        assert resumed[step] == two[step], step  # bit-exact: same shards, data positions, RNG, optimizer state
    assert sum(list(two.values())[-3:]) < sum(list(two.values())[:3])
    import matplotlib.image

    for run in ("two", "resumed"):  # the picture of metrics.jsonl, redrawn at each checkpoint and at the end
        image = matplotlib.image.imread(tmp_path / run / "metrics.png")
        assert image.ndim == 3 and image.std() > 0
        steps, values = training_curves(tmp_path / run / "metrics.jsonl")["loss"]
        assert dict(zip(steps, values)) == losses(tmp_path / run)


@pytest.mark.slow
def test_checkpoint_weights_survive_training_and_export_exactly(nv_tiny: Path, tmp_path: Path) -> None:
    """Start from a converted checkpoint with lr 0: the exported Hub folder holds exactly the starting weights
    (per-rank row slices read from safetensors, DCP save, consolidation); the folder loads with from_pretrained."""
    args = [
        "--model",
        str(nv_tiny),
        "--data",
        str(DEMO_FASTA),
        "--steps",
        "2",
        "--lr",
        "0",
        "--tokens-per-batch",
        "1024",
    ]
    run_recipe(tmp_path / "run", *args, "--max-length", "254", "--weight-decay", "0")
    exported, original = (
        load_file(tmp_path / "run" / "final" / "model.safetensors"),
        load_file(nv_tiny / "model.safetensors"),
    )
    assert set(exported) == set(original)
    for name, tensor in original.items():
        torch.testing.assert_close(exported[name], tensor.float(), rtol=0, atol=0, msg=name)
    model = NVEsmForMaskedLM.from_pretrained(tmp_path / "run" / "final")
    assert model.config.backend == "auto"
    for name in (*REMOTE_CODE_FILES, "config.json", "vocab.txt", "tokenizer_config.json", "LICENSE", "README.md"):
        assert (tmp_path / "run" / "final" / name).exists(), name


def export_command(*args: str) -> subprocess.CompletedProcess:
    """`python -m nv_esm.train export ARGS` under umask 077 (forked: `forked_ranks`)."""
    return forked_ranks.run("nv_esm.train.loop:main", ["export", *args], timeout=120, umask=0o077)


@pytest.mark.slow
def test_export_command_lists_its_files_follows_the_umask_and_refuses_in_one_line(
    tiny_config: Path, tmp_path: Path
) -> None:
    run_recipe(tmp_path / "run", *mlm_args(tiny_config, 1, "--no-export"), ranks=1)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000001"
    done = export_command(str(checkpoint), str(tmp_path / "hub"))
    assert done.returncode == 0, done.stderr
    files = sorted(p for p in (tmp_path / "hub").rglob("*") if p.is_file())
    assert f"wrote {tmp_path / 'hub'} (NVEsmForMaskedLM, {len(files)} files" in done.stdout
    assert all(f"  {p.name} " in done.stdout for p in files)
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}  # umask 077
    assert oct((tmp_path / "hub").stat().st_mode & 0o777) == "0o700"
    again = export_command(str(checkpoint), str(tmp_path / "hub"))
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1 and "--overwrite" in again.stderr
    wrong = export_command(str(tmp_path / "run"), str(tmp_path / "other"))
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert "not a training checkpoint" in wrong.stderr and not (tmp_path / "other").exists()
    assert export_command(str(checkpoint), str(tmp_path / "hub"), "--overwrite").returncode == 0


@pytest.mark.slow
def test_token_classification_with_lora_trains_and_exports_merged(nv_tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    args = ["--model", str(nv_tiny), "--task", "token", "--data", str(SECONDARY_STRUCTURE), "--steps", "6"]
    args += ["--lora-rank", "4", "--lr", "1e-2", "--tokens-per-batch", "1024", "--max-length", "254"]
    run_recipe(tmp_path / "lora", *args)
    history = losses(tmp_path / "lora")
    assert len(history) == 6 and all(torch.isfinite(torch.tensor(list(history.values()))))
    model = NVEsmForTokenClassification.from_pretrained(tmp_path / "lora" / "final")
    assert model.config.num_labels == 3 and model.config.id2label == {0: "C", 1: "E", 2: "H"}
    exported = load_file(tmp_path / "lora" / "final" / "model.safetensors")
    assert not any("lora" in name for name in exported)
    original = load_file(nv_tiny / "model.safetensors")
    qkv = "esm.encoder.layers.0.self_attention.layernorm_qkv.weight"
    assert not torch.equal(exported[qkv], original[qkv].float())  # the trained adapter is merged in
    untouched = "esm.encoder.layers.0.layernorm_mlp.fc1_weight"
    torch.testing.assert_close(exported[untouched], original[untouched].float(), rtol=0, atol=0)

    card = (tmp_path / "lora" / "final" / "README.md").read_text()
    assert "pipeline_tag: token-classification" in card and "AutoModelForTokenClassification.from_pretrained" in card
    config = json.loads((tmp_path / "lora" / "final" / "config.json").read_text())
    assert config["architectures"] == ["NVEsmForTokenClassification"] and "backend" not in config
    convert_nv_to_hf(tmp_path / "lora" / "final", tmp_path / "hf")  # back to plain transformers, head and labels
    from transformers import EsmForTokenClassification

    plain = EsmForTokenClassification.from_pretrained(tmp_path / "hf").eval()
    assert plain.config.id2label == {0: "C", 1: "E", 2: "H"}
    ours = NVEsmForTokenClassification.from_pretrained(tmp_path / "lora" / "final", backend="torch").eval()
    input_ids = torch.randint(4, 24, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert max_abs_diff(plain(input_ids).logits, ours(input_ids).logits) <= ATOL_FP32


def test_lora_merge_reproduces_the_adapted_model(nv_tiny: Path) -> None:
    """export_weights merges the run's adapters with PEFT; the merged plain model gives the PEFT model's logits."""
    pytest.importorskip("peft")
    base = NVEsmForTokenClassification.from_pretrained(nv_tiny, num_labels=3, backend="torch").eval()
    targets = ("query", "key", "value", "dense")
    settings = ModelConfig(lora_rank=4, lora_alpha=8.0, task="token", lora_targets=targets)
    adapted = add_lora(base, settings).eval()
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                parameter.normal_(0, 0.3)
    lora = {"rank": 4, "alpha": 8.0, "targets": list(targets)}
    state = {key: tensor.clone() for key, tensor in adapted.state_dict().items()}  # the merge changes them
    weights = export_weights(state, base.config, "token", lora)
    assert not any("lora" in key or "modules_to_save" in key or "original_module" in key for key in weights)
    merged = NVEsmForTokenClassification(base.config).eval()
    merged.load_state_dict(weights, strict=True)
    input_ids = torch.randint(4, 24, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids).logits, adapted(input_ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", [0, 4, 9, 10, 55, 99])
def test_learning_rate_schedule(step: int) -> None:
    settings = OptimizerConfig(warmup_steps=10, steps=100, decay="cosine", min_lr_ratio=0.1)
    factor = learning_rate_factor(step, settings)
    if step < 10:
        assert factor == pytest.approx((step + 1) / 10)
    else:
        import math

        progress = (step - 10) / 90
        assert factor == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def test_fresh_init_follows_the_model_rules(tiny_config: Path) -> None:
    """The trainer's fresh tensors (drawn whole on meta-built shards) and a new model's `_init_weights` follow the
    one rule (`initial_value`): the same ones and zeros (LayerNorm gains, biases, the padding and padded-vocabulary
    rows), the same scale elsewhere."""
    from configuration_nv_esm import NVEsmConfig
    from nv_esm.train import materialize
    from nv_esm.train.parallel import Dist

    fields = {k: v for k, v in json.loads(tiny_config.read_text()).items() if k not in ("auto_map", "architectures")}
    fields.pop("model_type", None)
    config = NVEsmConfig(**{**fields, "backend": "torch"})
    torch.manual_seed(0)
    reference = NVEsmForMaskedLM(config)
    with torch.device("meta"):
        trained = NVEsmForMaskedLM(config)
    trained.to_empty(device="cpu")
    materialize.materialise(trained, config, None, seed=3, world=Dist(0, 1, torch.device("cpu"), None))
    fresh = {name: value.detach() for name, value in trained.named_parameters()}
    for name, parameter in reference.named_parameters():
        parameter = parameter.detach()
        if torch.all(parameter == parameter.flatten()[0]):
            torch.testing.assert_close(fresh[name], parameter, msg=name)  # ones / zeros
        else:  # scale checked where there are enough values for a stable std (not the 8-value contact head)
            if parameter.numel() >= 1000:
                assert fresh[name].std() == pytest.approx(parameter.std().item(), rel=0.3), name
            assert torch.equal(fresh[name] == 0, parameter == 0), name  # zero rows: padding and padded vocabulary
    assert torch.all(reference.lm_head.decoder.layer_norm_weight == 1)
    assert torch.all(reference.esm.embeddings.word_embeddings.weight[config.vocab_size :] == 0)


def test_transformers_checkpoint_is_refused_with_the_conversion_command(tmp_path: Path) -> None:
    result = train_here("--model", TINY_CHECKPOINT, "--data", DEMO_FASTA, "--steps", "1", out=tmp_path / "run")
    assert result.returncode != 0 and "nv-esm convert hf-to-te" in result.stderr


@pytest.mark.slow
def test_sequence_classification_with_activation_checkpointing(nv_tiny: Path, tmp_path: Path) -> None:
    """Fine-tune the <cls> head on the demo solubility CSV (2 classes) with activation checkpointing; the loss of the
    first step equals a run without checkpointing (recomputation changes nothing), and the export loads."""
    from modeling_nv_esm import NVEsmForSequenceClassification

    csv = ROOT / "recipes" / "demo_data" / "solubility.csv"
    args = ["--model", str(nv_tiny), "--task", "sequence", "--data", str(csv), "--steps", "3", "--lr", "1e-3"]
    args += ["--tokens-per-batch", "2048", "--max-length", "254", "--log-every", "1"]
    run_recipe(tmp_path / "plain", *args, "--no-export")
    run_recipe(tmp_path / "checkpointed", *args, "--activation-checkpointing")
    plain, checkpointed = losses(tmp_path / "plain"), losses(tmp_path / "checkpointed")
    for step in plain:
        assert checkpointed[step] == pytest.approx(plain[step], rel=1e-6), step
    model = NVEsmForSequenceClassification.from_pretrained(tmp_path / "checkpointed" / "final")
    assert model.config.num_labels == 2


@pytest.mark.slow
def test_profile_steps_writes_a_trace_per_rank(tmp_path: Path, tiny_config: Path) -> None:
    run_recipe(tmp_path / "run", *mlm_args(tiny_config, 6, "--log-every", "2", "--profile-steps", "3"))
    traces = sorted((tmp_path / "run" / "profile").glob("rank*.json.gz"))
    assert [t.name for t in traces] == ["rank0.json.gz", "rank1.json.gz"]
    for summary in map(trace_summary.summarise, traces, [100, 100]):  # every region
        assert summary["steps"] == 3
        assert summary["ms_per_step"]["cpu_step_spans"] > 0
        regions = {region["name"]: region for region in summary["top_host_regions_ms_per_step"]}
        assert regions["nv_esm::forward"]["calls"] == regions["nv_esm::backward"]["calls"] == 1  # a micro-batch
        assert regions["nv_esm::forward"]["ms"] > 0


@pytest.mark.parametrize(
    "name, region",
    [
        ("FSDP::all_gather (esm.encoder.layers.3)", "FSDP::all_gather"),
        ("FSDP::forward_prefetch for esm.encoder.layers.12", "FSDP::forward_prefetch"),
        ("Optimizer.step#AdamW.step", "Optimizer.step"),
        ("nv_esm::forward", "nv_esm::forward"),
    ],
)
def test_regions_of_all_layers_add_up_under_one_name(name: str, region: str) -> None:
    assert trace_summary.region_name(name) == region


def test_profile_steps_must_fit_in_the_run(tmp_path: Path, tiny_config: Path) -> None:
    result = train_here(*mlm_args(tiny_config, 4, "--log-every", "2", "--profile-steps", "3"), out=tmp_path / "run")
    assert result.returncode != 0 and "--profile-steps" in result.stderr


def test_interval_union_and_overlap_match_a_brute_force_count() -> None:
    generator = random.Random(0)
    for _ in range(50):
        a = [(s, s + generator.randint(1, 30)) for s in (generator.randint(0, 100) for _ in range(6))]
        b = [(s, s + generator.randint(1, 30)) for s in (generator.randint(0, 100) for _ in range(6))]
        covered_a = {t for start, end in a for t in range(start, end)}
        covered_b = {t for start, end in b for t in range(start, end)}
        assert trace_summary.union_length(a) == len(covered_a)
        assert trace_summary.overlap_length(a, b) == len(covered_a & covered_b)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("void transformer_engine::fused_rope_thd_linear_grid_backward_kernel<__nv_bfloat16>(", "rotary"),
        ("void transformer_engine::detail::cast_transpose_fused_kernel_notaligned<true, float>", "fp8_quantize"),
        ("void transformer_engine::delayed_scaling_recipe::kernel(", "fp8_quantize"),
        ("void transformer_engine::normalization::ln_bwd_finalize_general_kernel<__nv_bfloat16, float>", "norm"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
            "optimizer",
        ),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>",
            "copy_elementwise",
        ),
        ("some_kernel_nobody_knows", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert trace_summary.kernel_kind(name) == kind


@pytest.mark.slow
def test_tensorboard_logs_the_metrics(tiny_config: Path, tmp_path: Path) -> None:
    """--tensorboard writes OUT/tensorboard with the scalars of metrics.jsonl, step for step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_recipe(tmp_path / "run", *mlm_args(tiny_config, 4, "--log-every", "2", "--tensorboard", "--no-export"), ranks=1)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = {scalar.step: scalar.value for scalar in events.Scalars("loss")}
    assert logged == pytest.approx(losses(tmp_path / "run"), rel=1e-6)


@pytest.mark.slow
def test_no_checkpoint_logs_every_step_and_writes_no_checkpoint(tmp_path: Path, tiny_config: Path) -> None:
    run_recipe(tmp_path / "run", *mlm_args(tiny_config, 5, "--log-every", "2", "--no-checkpoint"))
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5]
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


def test_tensorboard_without_the_package_is_refused_before_training(tiny_config: Path, tmp_path: Path, monkeypatch):
    import importlib.util

    from nv_esm.train.config import parse_config

    config = parse_config([*mlm_args(tiny_config, 2, "--tensorboard"), "--out", str(tmp_path / "run")])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real_find_spec(name)
    )
    with pytest.raises(ValueError, match=r"--tensorboard needs the tensorboard package: pip install '\.\[train\]'"):
        config.validate()
