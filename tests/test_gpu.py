"""GPU tests: Transformer Engine backend vs the PyTorch twin vs transformers, bf16 and FP8.

Run on a Hopper GPU with Transformer Engine: `python -m pytest -m gpu -s`. Skipped without CUDA or TE. Every test
runs twice, TE models with CUDA graphs (the default: they replay where `plan_forward` allows, i.e. in eval mode
under no_grad and in train mode with gradients) and without (`cuda_graphs=False`, all eager).

Tolerances (bf16): both transformers and NVEsm round every activation to bf16 (8 bits of mantissa, relative
step 2^-8 = 0.4%), so neither matches the fp32 result exactly. Each model is compared with transformers in
fp32 on the same GPU, and NVEsm must be no worse than transformers' own bf16 error (times 1.5, plus a small
floor for the differing kernel order). Transformer Engine's fused GELU is the tanh approximation
(|gelu_tanh - gelu_erf| <= 5e-4), far below bf16's step, which the fp32 TE comparison bounds separately.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

import convert_checkpoint
from conftest import (
    GPU_MARKS,
    PADDING_SIDES,
    PADDING_WIDTHS,
    TE_FP32_ATOL,
    make_hf_model,
    make_nv_model,
    pack_batch,
    packed_on_gpu,
    pad_batch,
    random_lengths,
    random_padded_batch,
    random_proteins,
    relative_error,
    share_random_adapters,
)
from convert_helpers import save_hf
from modeling_nv_esm import NVEsmForMaskedLM
from modeling_nv_esm_layers import import_transformer_engine
from modeling_nv_esm_plan import plan_forward
from nv_esm import embed
from nv_esm.alphabet import ESM_VOCAB
from nv_esm.state_dict_mapping import nv_to_hf_state_dict

pytestmark = GPU_MARKS

CUDA = "cuda"
LENGTHS = [1, 300, 37, 2, 1026, 129, 64]  # includes length 1 and max length; heavy padding when padded
BF16_FACTOR, BF16_FLOOR = 1.5, 2e-2
FP8_LOSS_RTOL = 0.02  # FP8 MLM loss within 2% of bf16 on the same batch


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def hf_fp32():
    return make_hf_model("esm2_8M", seed=100)


CUDA_GRAPHS = True  # the `cuda_graphs` of `te_model`'s models; each test runs with True and False


@pytest.fixture(autouse=True, params=[True, False], ids=["graphs", "eager"])
def cuda_graphs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "CUDA_GRAPHS", request.param)


def te_model(hf, dtype=torch.bfloat16, **overrides) -> NVEsmForMaskedLM:
    """The TE twin of `hf` on the GPU, with CUDA graphs as the running test's `cuda_graphs` parameter says."""
    return make_nv_model(hf, backend="te", **{"cuda_graphs": CUDA_GRAPHS, **overrides}).to(CUDA, dtype)


def hf_on_gpu(hf, dtype):
    """A fresh GPU copy of the transformers model (the fixture stays on the CPU)."""
    model = make_hf_model("esm2_8M", seed=100)
    model.load_state_dict(hf.state_dict())
    return model.to(CUDA, dtype)


def padded_inputs(seed=101, mask_fraction=0.15):
    input_ids, attention_mask = pad_batch(random_proteins(LENGTHS, seed=seed, mask_fraction=mask_fraction))
    return input_ids.to(CUDA), attention_mask.to(CUDA)


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_forward_bf16_te_and_twin_no_worse_than_transformers(hf_fp32, attn_input_format):
    input_ids, attention_mask = padded_inputs()
    keep = attention_mask.bool()
    with torch.no_grad():
        reference = hf_on_gpu(hf_fp32, torch.float32)(input_ids, attention_mask=attention_mask).logits[keep]
        hf_bf16 = hf_on_gpu(hf_fp32, torch.bfloat16)(input_ids, attention_mask=attention_mask).logits[keep]
        te = te_model(hf_fp32, attn_input_format=attn_input_format)(input_ids, attention_mask=attention_mask)
        twin = make_nv_model(hf_fp32, attn_input_format=attn_input_format).to(CUDA, torch.bfloat16)
        twin_logits = twin(input_ids, attention_mask=attention_mask).logits[keep]
    errors = {
        "transformers_bf16": max_err(hf_bf16, reference),
        "te_bf16": max_err(te.logits[keep], reference),
        "twin_bf16": max_err(twin_logits, reference),
    }
    print(f"\n[bf16 forward {attn_input_format}] max |logit - transformers fp32|: {errors}")
    bound = BF16_FACTOR * errors["transformers_bf16"] + BF16_FLOOR
    assert errors["te_bf16"] <= bound and errors["twin_bf16"] <= bound


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
def test_forward_fp32_te_matches_transformers_and_packed_matches_padded(hf_fp32, attn_input_format):
    input_ids, attention_mask = padded_inputs(seed=102)
    keep = attention_mask.bool()
    proteins = random_proteins(LENGTHS, seed=102, mask_fraction=0.15)
    packed = packed_on_gpu(proteins)
    model = te_model(hf_fp32, torch.float32, attn_input_format=attn_input_format)
    with torch.no_grad():
        reference = hf_on_gpu(hf_fp32, torch.float32)(input_ids, attention_mask=attention_mask).logits[keep]
        padded = model(input_ids, attention_mask=attention_mask).logits[keep]
        thd = model(**packed).logits[0]
    errors = {"te_padded_fp32": max_err(padded, reference), "te_packed_fp32": max_err(thd, reference)}
    print(f"\n[fp32 forward {attn_input_format}] max |logit - transformers fp32|: {errors}")
    assert max(errors.values()) <= TE_FP32_ATOL


@pytest.mark.parametrize("attn_input_format", ["thd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_padding_layouts_give_each_protein_its_own_outputs_on_te(hf_fp32, attn_input_format, dtype):
    """Padding on the left, right or both sides, batches as wide as the longest protein, a multiple of 16 or
    wider: each protein's logits equal what TE gives it alone and what transformers gives it alone in fp32, within
    TE's fp32 tolerance (a batch and a lone protein already differ by ~1e-3 in fp32 on an H100: other GEMM shapes),
    or in bf16 no worse than transformers' own bf16 error (plus the floor; a batch and a lone protein differ by up
    to a bf16 step of a logit). A misplaced position or mask moves logits by 0.1 or more (0.29 before the fix)."""
    model = te_model(hf_fp32, dtype, attn_input_format=attn_input_format)
    reference = hf_on_gpu(hf_fp32, torch.float32)
    hf_bf16 = hf_on_gpu(hf_fp32, torch.bfloat16)
    generator = torch.Generator().manual_seed(120)
    worst_vs_alone = worst_vs_transformers = 0.0
    for side in PADDING_SIDES:
        for width in PADDING_WIDTHS:
            proteins = random_proteins(random_lengths(generator, 5, longest=300), seed=121, mask_fraction=0.15)
            input_ids, attention_mask = random_padded_batch(proteins, side, width, generator)
            with torch.no_grad():
                batch = model(input_ids.to(CUDA), attention_mask=attention_mask.to(CUDA), output_hidden_states=True)
                for row, protein in enumerate(proteins):
                    keep = attention_mask[row].bool().to(CUDA)
                    ids = protein[None].to(CUDA)
                    ours, expected = batch.logits[row, keep], reference(ids).logits[0]
                    vs_alone, vs_transformers = max_err(ours, model(ids).logits[0]), max_err(ours, expected)
                    assert torch.count_nonzero(batch.hidden_states[-1][row, ~keep]) == 0
                    if dtype == torch.float32:
                        assert vs_alone <= TE_FP32_ATOL and vs_transformers <= TE_FP32_ATOL, (side, width, row)
                    else:
                        bound = BF16_FACTOR * max_err(hf_bf16(ids).logits[0], expected) + BF16_FLOOR
                        assert vs_alone <= bound and vs_transformers <= bound, (side, width, row)
                    worst_vs_alone = max(worst_vs_alone, vs_alone)
                    worst_vs_transformers = max(worst_vs_transformers, vs_transformers)
    print(
        f"\n[padding layouts {attn_input_format} {dtype}] max |logit diff| batch vs alone {worst_vs_alone:.2e}, "
        f"vs transformers fp32 alone {worst_vs_transformers:.2e}"
    )


def hf_gradients(model, input_ids, attention_mask, labels) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    return {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def nv_gradients(model, labels, **inputs) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(**inputs, labels=labels).loss.backward()
    params = dict(model.named_parameters(remove_duplicate=False))
    grads = {
        name: (params[name].grad if name in params and params[name].grad is not None else torch.zeros_like(v))
        .float()
        .cpu()
        for name, v in model.state_dict().items()
    }
    return nv_to_hf_state_dict(grads, model.config)


@pytest.mark.parametrize("attn_input_format", ["bshd", "thd"])
@pytest.mark.parametrize("packed_input", [False, True])
def test_backward_bf16_te_no_worse_than_transformers(hf_fp32, attn_input_format, packed_input):
    input_ids, attention_mask = padded_inputs(seed=103)
    labels = torch.where(attention_mask.bool(), input_ids, -100)
    reference = hf_gradients(hf_on_gpu(hf_fp32, torch.float32), input_ids, attention_mask, labels)
    hf_bf16 = hf_gradients(hf_on_gpu(hf_fp32, torch.bfloat16), input_ids, attention_mask, labels)
    model = te_model(hf_fp32, attn_input_format=attn_input_format)
    if packed_input:
        proteins = random_proteins(LENGTHS, seed=103, mask_fraction=0.15)
        packed = packed_on_gpu(proteins)
        te = nv_gradients(model, labels[attention_mask.bool()][None], **packed)
    else:
        te = nv_gradients(model, labels, input_ids=input_ids, attention_mask=attention_mask)
    worst = {"transformers_bf16": 0.0, "te_bf16": 0.0}
    for name, grad in reference.items():
        if grad.norm() == 0:
            continue
        hf_error, te_error = relative_error(hf_bf16[name], grad), relative_error(te[name], grad)
        worst = {
            "transformers_bf16": max(worst["transformers_bf16"], hf_error),
            "te_bf16": max(worst["te_bf16"], te_error),
        }
        assert te_error <= BF16_FACTOR * hf_error + BF16_FLOOR, name
    print(f"\n[bf16 backward {attn_input_format} packed={packed_input}] worst relative gradient error: {worst}")


@pytest.mark.parametrize(
    "recipe,layers_in_fp8", [("delayed", "all"), ("current", "all"), ("block", "all"), ("delayed", "inner")]
)
@pytest.mark.parametrize("attn_input_format", ["thd", "bshd"])
def test_fp8_runs_any_token_count_with_loss_close_to_bf16(hf_fp32, recipe, layers_in_fp8, attn_input_format):
    proteins = random_proteins([5, 250, 33, 1, 97], seed=104, mask_fraction=0.15)  # 386 tokens: not a multiple of 16
    packed = packed_on_gpu(proteins)
    labels = packed["input_ids"].clone()
    bf16 = te_model(hf_fp32, attn_input_format=attn_input_format)
    layers = hf_fp32.config.num_hidden_layers
    precision = ["fp8"] * layers if layers_in_fp8 == "all" else [None] + ["fp8"] * (layers - 2) + [None]
    fp8 = te_model(hf_fp32, attn_input_format=attn_input_format, layer_precision=precision, fp8_recipe=recipe)
    losses = {}
    for name, model in (("bf16", bf16), ("fp8", fp8)):
        output = model(**packed, labels=labels)
        output.loss.backward()
        assert output.logits.shape == (1, sum(len(p) for p in proteins), 33)
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        losses[name] = output.loss.item()
    input_ids, attention_mask = pad_batch(proteins)
    with torch.no_grad():
        padded_logits = fp8(input_ids.to(CUDA), attention_mask=attention_mask.to(CUDA)).logits
    assert padded_logits.shape == (5, 250, 33)
    label = f"fp8 {recipe} {layers_in_fp8} layers {attn_input_format}"
    print(f"\n[{label}] loss bf16 {losses['bf16']:.5f} fp8 {losses['fp8']:.5f}")
    assert abs(losses["fp8"] - losses["bf16"]) <= FP8_LOSS_RTOL * losses["bf16"]


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
@pytest.mark.parametrize("attn_input_format", ["thd", "bshd"])
def test_fp8_chosen_by_the_callers_autocast_runs_any_padded_batch(hf_fp32, recipe, attn_input_format):
    """FP8 turned on around the model (`te.autocast(enabled=True, recipe=...)`, not `layer_precision`): a padded
    batch whose token count is no multiple of 16 (5 x 79 = 395) runs, padded inside as for the model's own FP8, with
    the loss close to bf16; CUDA graphs stay off under the caller's autocast."""
    import transformer_engine.pytorch as te

    from modeling_nv_esm_layers import make_fp8_recipe

    proteins = random_proteins([5, 79, 33, 1, 61], seed=140, mask_fraction=0.15)
    input_ids, attention_mask = pad_batch(proteins)
    input_ids, attention_mask = input_ids.to(CUDA), attention_mask.to(CUDA)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model = te_model(hf_fp32, attn_input_format=attn_input_format)
    bf16 = model(input_ids, attention_mask=attention_mask, labels=labels).loss.item()
    captured = len(model.esm.encoder.graphs._graphs)
    with te.autocast(enabled=True, recipe=make_fp8_recipe(recipe)):
        output = model(input_ids, attention_mask=attention_mask, labels=labels)
    output.loss.backward()
    assert output.logits.shape == (5, 79, 33) and torch.isfinite(output.loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert len(model.esm.encoder.graphs._graphs) == captured  # nothing captured under the caller's FP8
    print(f"\n[caller fp8 {recipe} {attn_input_format}] loss bf16 {bf16:.5f} fp8 {output.loss.item():.5f}")
    assert abs(output.loss.item() - bf16) <= FP8_LOSS_RTOL * bf16


def test_te_checkpoint_loads_on_cpu_in_the_twin(hf_fp32, tmp_path):
    model = te_model(hf_fp32, torch.float32)
    model.save_pretrained(tmp_path)
    twin = NVEsmForMaskedLM.from_pretrained(tmp_path, backend="torch").eval()
    assert twin.esm.backend == "torch"
    gpu_state, cpu_state = model.state_dict(), twin.state_dict()
    assert gpu_state.keys() == cpu_state.keys()
    assert all(torch.equal(gpu_state[k].cpu(), cpu_state[k]) for k in gpu_state)
    input_ids, attention_mask = padded_inputs(seed=105)
    keep = attention_mask.bool()
    with torch.no_grad():
        te_logits = model(input_ids, attention_mask=attention_mask).logits[keep].cpu()
        cpu_logits = twin(input_ids.cpu(), attention_mask=attention_mask.cpu()).logits[keep.cpu()]
        reference = hf_fp32(input_ids.cpu(), attention_mask=attention_mask.cpu()).logits[keep.cpu()]
    print(
        f"\n[te->cpu] max |twin cpu - transformers cpu| {max_err(cpu_logits, reference):.2e}, "
        f"max |te gpu - twin cpu| {max_err(te_logits, cpu_logits):.2e}"
    )
    assert max_err(cpu_logits, reference) <= 1e-4
    assert max_err(te_logits, cpu_logits) <= TE_FP32_ATOL


def test_from_pretrained_builds_te_layers_on_gpu(hf_fp32, tmp_path):
    make_nv_model(hf_fp32).save_pretrained(tmp_path)
    model = NVEsmForMaskedLM.from_pretrained(
        tmp_path, backend="auto", dtype=torch.bfloat16, device_map=CUDA, cuda_graphs=CUDA_GRAPHS
    ).eval()
    assert model.esm.backend == "te"
    assert isinstance(model.esm.encoder.layers[0], import_transformer_engine().TransformerLayer)
    reference = te_model(hf_fp32)
    input_ids, attention_mask = padded_inputs(seed=106)
    with torch.no_grad():
        a = model(input_ids, attention_mask=attention_mask).logits
        b = reference(input_ids, attention_mask=attention_mask).logits
    keep = attention_mask.bool()
    # Both are the same fp32 weights rounded to bf16, run the same way (graphs or eager: a graph pads the batch, which
    # moves bf16 logits by several steps), but TE layers built in bf16 and layers cast to bf16 after building pick
    # their kernels separately: a few bf16 steps (0.4% each) apart, far from any loading error.
    assert max_err(a[keep], b[keep]) <= BF16_FLOOR


def test_gradient_checkpointing_with_te(hf_fp32):
    """te.checkpoint recomputes each layer in backward. cuDNN's attention backward accumulates with atomics, so
    two plain runs already differ slightly; checkpointing must stay within 1e-3 relative (a wrong recompute,
    e.g. missing rotary or mask, is off by >10%)."""
    plain, checkpointed = te_model(hf_fp32, torch.float32), te_model(hf_fp32, torch.float32)
    checkpointed.gradient_checkpointing_enable()
    plain.train()
    checkpointed.train()
    proteins = random_proteins([50, 7, 300], seed=107, mask_fraction=0.15)
    packed = packed_on_gpu(proteins)
    labels = packed["input_ids"].clone()
    plain(**packed, labels=labels).loss.backward()
    checkpointed(**packed, labels=labels).loss.backward()
    worst = 0.0
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        if a.grad is not None:
            worst = max(worst, relative_error(b.grad, a.grad))
            assert relative_error(b.grad, a.grad) <= 1e-3, name
    print(f"\n[te checkpointing] worst relative gradient difference {worst:.2e}")


@pytest.mark.parametrize("offloaded_layers", [None, 2])
def test_activation_offloading_moves_saved_tensors_to_the_host_and_changes_no_gradient(hf_fp32, offloaded_layers):
    """`offload_activations=True`, three fp32 training steps: tensors of every layer but the last (or of the first
    `offloaded_layers` of the 6, the copies overlapping the other layers) are offloaded (TE counts them after each
    forward), losses equal the plain model's exactly (the forward is the same) and gradients
    are within 1e-3 relative (cuDNN's attention backward accumulates with atomics, so two plain runs differ too;
    a stale or overwritten reload is off by far more). (Under bf16 autocast the gradients of the small LayerNorm
    weights differ by a bf16 step here and there: 1.7e-3 relative on an H100.) With gradient checkpointing TE's
    context offloaded nothing (0 MB), so that combination is refused (tests/test_recipe_parallel.py). A second
    training forward before the first one's backward is refused."""
    plain = te_model(hf_fp32, torch.float32)
    offloaded = te_model(hf_fp32, torch.float32, offload_activations=True, offloaded_layers=offloaded_layers)
    for model in (plain, offloaded):
        model.train()
    for step in range(3):
        proteins = random_proteins([300] * 8 + [1026, 57], seed=120 + step, mask_fraction=0.15)
        packed = packed_on_gpu(proteins)
        losses = []
        for model in (plain, offloaded):
            model.zero_grad(set_to_none=True)
            loss = model(**packed, labels=packed["input_ids"]).loss
            if model is offloaded:
                synchronizer = offloaded.esm.encoder._offload.context.offload_synchronizer
                assert synchronizer.get_offloaded_total_size_mb() > 0
            loss.backward()
            losses.append(loss.item())
        assert losses[1] == losses[0], step
        for (name, a), (_, b) in zip(plain.named_parameters(), offloaded.named_parameters()):
            if a.grad is not None:
                assert relative_error(b.grad, a.grad) <= 1e-3, (step, name)
    offloaded(**packed, labels=packed["input_ids"])  # its backward never runs: the next forward is refused
    with pytest.raises(RuntimeError, match="backward has not run yet"):
        offloaded(**packed, labels=packed["input_ids"])


def test_recompute_mlp_saves_less_and_changes_no_gradient(hf_fp32):
    """`recompute_mlp=True` (TE's `LayerNormMLP(checkpoint=True)`), training forward and backward of fp32 weights
    under bf16 autocast, eager (a graph's memory pool would hide what a forward keeps): less GPU memory held
    between forward and backward, the same loss, gradients within 1e-2 relative (bf16 compute; cuDNN's attention
    backward accumulates with atomics, as in the offloading test). Not fp32 compute: TE's fp32 attention is the
    unfused kernel, whose saved probabilities (proteins x heads x length^2) outweigh the MLP's activations."""
    plain = te_model(hf_fp32, torch.float32, cuda_graphs=False)
    recomputing = te_model(hf_fp32, torch.float32, cuda_graphs=False, recompute_mlp=True)
    assert all(layer.layernorm_mlp.checkpoint for layer in recomputing.esm.encoder.layers)
    proteins = random_proteins([300] * 8 + [1026, 57], seed=125, mask_fraction=0.15)
    packed = packed_on_gpu(proteins)
    saved, losses = {}, []
    for model in (plain, recomputing):
        model.train()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**packed, labels=packed["input_ids"]).loss
        saved[model is recomputing] = torch.cuda.memory_allocated() - before  # what the forward keeps for backward
        loss.backward()
        losses.append(loss.item())
    assert saved[True] < 0.8 * saved[False], saved
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputing.named_parameters()):
        if a.grad is not None:
            assert relative_error(b.grad, a.grad) <= 1e-2, name


def test_cudnn_layer_norm_runs_cudnns_kernels_within_bf16_error(hf_fp32, monkeypatch):
    """`cudnn_layer_norm=True` switches Transformer Engine's LayerNorms, forward and backward, to cuDNN's kernels:
    an eager training step that runs TE's `normalization::ln_` kernels without it runs none with it, and the packed
    bf16 logits stay within transformers' own bf16 error, as with TE's kernels. The switch is process-wide (TE's
    flags and environment variables): both are set back as they were after the test."""
    import ctypes
    import os

    library = importlib.import_module("transformer_engine.common")._TE_LIB_CTYPES
    names = {stage: f"NVTE_NORM_{stage.upper()}_USE_CUDNN" for stage in ("fwd", "bwd")}
    before = {stage: os.environ.get(name, "0") == "1" for stage, name in names.items()}
    for name in names.values():
        monkeypatch.setenv(name, os.environ.get(name, "0"))  # monkeypatch puts the environment back afterwards
    input_ids, attention_mask = padded_inputs(seed=131)
    keep = attention_mask.bool()
    proteins = random_proteins(LENGTHS, seed=131, mask_fraction=0.15)
    packed = packed_on_gpu(proteins)

    def te_layer_norm_kernels(model: NVEsmForMaskedLM) -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(**packed, labels=packed["input_ids"]).loss.backward()
            torch.cuda.synchronize()
        kernels = {event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA}
        assert kernels
        return [name for name in kernels if "normalization::ln_" in name]

    try:
        if not any(before.values()):  # without the switch, the step runs TE's kernels, found by their names
            assert te_layer_norm_kernels(te_model(hf_fp32, torch.float32, cuda_graphs=False).train())
        model = te_model(hf_fp32, cudnn_layer_norm=True)
        with torch.no_grad():
            reference = hf_on_gpu(hf_fp32, torch.float32)(input_ids, attention_mask=attention_mask).logits[keep]
            hf_bf16 = hf_on_gpu(hf_fp32, torch.bfloat16)(input_ids, attention_mask=attention_mask).logits[keep]
            logits = model(**packed).logits[0]
        assert max_err(logits, reference) <= BF16_FACTOR * max_err(hf_bf16, reference) + BF16_FLOOR
        trained = te_model(hf_fp32, torch.float32, cudnn_layer_norm=True, cuda_graphs=False).train()
        assert not te_layer_norm_kernels(trained)
        assert all(torch.isfinite(p.grad).all() for p in trained.parameters() if p.grad is not None)
    finally:
        for stage, enabled in before.items():
            getattr(library, f"nvte_enable_cudnn_norm_{stage}")(ctypes.c_bool(enabled))


def test_fp8_scaling_history_survives_the_recipe_checkpoint_round_trip(hf_fp32, tmp_path):
    """recipes/train.py saves TE's delayed-scaling state per rank as plain data (safetensors + JSON): a model
    restored from that file quantises like the original, a model without it (fresh amax history) does not."""
    from nv_esm.train.checkpoint import fp8_scaling_state, load_fp8_scaling, save_fp8_scaling

    layers = hf_fp32.config.num_hidden_layers
    fp8 = dict(attn_input_format="thd", layer_precision=["fp8"] * layers, fp8_recipe="delayed")
    batches = [pack_batch(random_proteins([120, 7, 300, 1], seed=110 + i, mask_fraction=0.15)) for i in range(4)]
    batches = [{k: v.to(CUDA) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    trained = te_model(hf_fp32, **fp8)
    for batch in batches[:3]:
        trained(**batch, labels=batch["input_ids"]).loss.backward()
    assert len(fp8_scaling_state(trained)) >= 2 * layers  # attention and MLP modules of every layer
    save_fp8_scaling(tmp_path / "fp8_rank0.safetensors", trained)
    restored, fresh = te_model(hf_fp32, **fp8), te_model(hf_fp32, **fp8)
    load_fp8_scaling(tmp_path / "fp8_rank0.safetensors", restored)
    with torch.no_grad():
        loss = {
            name: model(**batches[3], labels=batches[3]["input_ids"]).loss.item()
            for name, model in (("trained", trained), ("restored", restored), ("fresh", fresh))
        }
    print(f"\n[fp8 scaling state] next-batch loss {loss}")
    assert abs(loss["restored"] - loss["trained"]) <= 1e-6 * loss["trained"]
    assert abs(loss["fresh"] - loss["trained"]) > 1e-4 * loss["trained"]


def test_recipe_validation_leaves_the_training_state_as_it_found_it(hf_fp32):
    """The recipe's validation mode (`nv_esm.train.validation`): eval forwards move delayed scaling's amax history
    (checked inside), which is restored after; train mode, the graphed runs and the captured graphs are as before
    (validation runs eagerly, `runs_eagerly`: no inference graph joins the training graphs' pool)."""
    from nv_esm.train.validation import _validation_mode

    layers = hf_fp32.config.num_hidden_layers
    model = te_model(hf_fp32, layer_precision=["fp8"] * layers, fp8_recipe="delayed").train()
    batches = [pack_batch(random_proteins([120, 7, 300, 1], seed=140 + i, mask_fraction=0.15)) for i in range(3)]
    batches = [{k: v.to(CUDA) if torch.is_tensor(v) else v for k, v in b.items()} for b in batches]
    for batch in batches[:2]:
        model(**batch, labels=batch["input_ids"]).loss.backward()

    def scaling() -> list[torch.Tensor]:
        return [
            tensor.clone()
            for module in model.modules()
            if getattr(module, "fp8_meta", {}).get("scaling_fwd") is not None
            for tensor in (module.fp8_meta["scaling_fwd"].amax_history, module.fp8_meta["scaling_fwd"].scale)
        ]

    before, captured = scaling(), set(model.esm.encoder.graphs._graphs)
    with _validation_mode(model, fp8=True):
        with torch.no_grad():
            assert not model.training and not plan_forward(model.esm.encoder).graphed  # `runs_eagerly`
            model(**batches[2])
        assert any(not torch.equal(a, b) for a, b in zip(scaling(), before))
    assert all(torch.equal(a, b) for a, b in zip(scaling(), before)) and len(before) >= 2 * layers
    assert model.training and model.config.cuda_graphs == CUDA_GRAPHS
    assert plan_forward(model.esm.encoder).graphed == CUDA_GRAPHS  # graphs on again, as the model was loaded
    assert set(model.esm.encoder.graphs._graphs) == captured


def test_te_attention_maps_and_contacts_match_transformers_within_bf16():
    """TE layers form no maps: the explicit pass over their weights gives transformers' eager maps and contacts
    (fp32 reference on the GPU) no worse than transformers' own bf16 run does, plus the floor."""
    hf = make_hf_model("esm2_8M", seed=130, attn_implementation="eager")
    model = te_model(hf).eval()
    reference, hf_bf16 = hf.to(CUDA).eval(), make_hf_model("esm2_8M", seed=130, attn_implementation="eager")
    hf_bf16.load_state_dict(hf.state_dict())
    hf_bf16 = hf_bf16.to(CUDA, torch.bfloat16).eval()
    proteins = random_proteins([300, 37, 1, 129], seed=131)
    input_ids, attention_mask = (t.to(CUDA) for t in pad_batch(proteins))
    real = attention_mask.bool()[:, None, :, None] & attention_mask.bool()[:, None, None, :]
    with torch.no_grad():
        ours = model(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        expected = reference(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        theirs = hf_bf16(input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        contacts = [m.predict_contacts(input_ids, attention_mask) for m in (model, reference, hf_bf16)]
    for a, e, t in zip(ours, expected, theirs):
        bound = BF16_FACTOR * max_err(t[real.expand_as(t)], e[real.expand_as(e)]) + BF16_FLOOR
        assert max_err(a[real.expand_as(a)], e[real.expand_as(e)]) <= bound
    for row, protein in enumerate(proteins):
        r = len(protein) - 2
        if r > 0:
            bound = BF16_FACTOR * max_err(contacts[2][row, :r, :r], contacts[1][row, :r, :r]) + BF16_FLOOR
            assert max_err(contacts[0][row, :r, :r], contacts[1][row, :r, :r]) <= bound, row


@pytest.mark.parametrize("fp8", ["off", "inner"])
def test_embed_command_on_te_matches_transformers_and_model_embed(tmp_path, fp8):
    """`nv-esm embed` on the GPU (TE, bf16 weights; FP8 inner layers): per-protein means within cosine 0.9999
    (bf16) / 0.99 (FP8) of transformers' fp32 mean over residues, and equal to `model.esm.embed` (bf16)."""
    hf = make_hf_model("esm2_8M", seed=140)
    source = save_hf(hf, tmp_path / "hf")
    assert convert_checkpoint.main(["hf-to-te", str(source), str(tmp_path / "nv")]) == 0
    proteins = random_proteins([1024, 3, 300, 37, 129, 64, 500], seed=141)
    sequences = ["".join(ESM_VOCAB[t] for t in protein[1:-1].tolist()) for protein in proteins]
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(sequences)))
    assert embed.main([str(tmp_path / "nv"), str(fasta), str(tmp_path / "out"), "--fp8", fp8, "--no-progress"]) == 0
    ours = torch.stack([outputs["mean.layer_6"] for _, outputs in embed.iter_embeddings(tmp_path / "out")])
    with torch.no_grad():
        expected = torch.stack(
            [hf.esm(p[None], output_hidden_states=True).hidden_states[-1][0, 1:-1].mean(0) for p in proteins]
        )
    cosine = torch.nn.functional.cosine_similarity(ours, expected)
    print(f"\n[embed fp8={fp8}] cosine to transformers fp32: min {cosine.min().item():.6f}")
    assert cosine.min() >= (0.9999 if fp8 == "off" else 0.99)
    if fp8 == "off":
        model = AutoModel.from_pretrained(tmp_path / "nv", trust_remote_code=True, dtype=torch.bfloat16).to(CUDA).eval()
        assert model.backend == "te"
        via_model = model.embed(
            sequences, AutoTokenizer.from_pretrained(tmp_path / "nv", trust_remote_code=True), show_progress=False
        )
        # Both are bf16 runs of the same means, packed differently (the command's token budget and graph buckets vs
        # embed()'s batches), so they differ by bf16 rounding: held to the bound each meets against fp32 above. A
        # different pooling (special tokens or padding in the mean) moves a short protein's mean far more.
        agreement = torch.nn.functional.cosine_similarity(ours, via_model)
        print(f"[embed] cosine of the command to model.embed: min {agreement.min().item():.7f}")
        assert agreement.min() >= 0.9999


def test_embed_fp8_writes_the_same_shard_when_resumed(tmp_path, monkeypatch):
    """`nv-esm embed --fp8 all` runs its FP8 layers with block scaling (`COMMAND_FP8_RECIPE`: each token scaled on
    its own; delayed scaling would stay at scale 1 in inference), and the last shard, embedded again first by a
    resumed run, holds the same numbers, bit for bit, as when two shards ran before it: with CUDA graphs too, where
    the first run may replay the shard's batch padded into an earlier, larger captured shape (a token's FP8 values
    do not depend on the other tokens, and the mean is summed in float64, where the order of the adds does not
    show, `pool_proteins`)."""
    recipe_module = importlib.import_module("transformer_engine.common.recipe")
    loaded, load_model = [], embed.load_model
    monkeypatch.setattr(embed, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)) or loaded[-1])
    hf = make_hf_model("esm2_8M", seed=142)
    assert convert_checkpoint.main(["hf-to-te", str(save_hf(hf, tmp_path / "hf")), str(tmp_path / "nv")]) == 0
    proteins = random_proteins([300, 3, 129, 40, 500, 64], seed=143)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(
        "".join(f">p{i}\n{''.join(ESM_VOCAB[t] for t in p[1:-1].tolist())}\n" for i, p in enumerate(proteins))
    )
    command = [str(tmp_path / "nv"), str(fasta), str(tmp_path / "out"), "--fp8", "all", "--shard-size", "2"]
    command += ["--no-progress"] if CUDA_GRAPHS else ["--no-cuda-graphs", "--no-progress"]
    assert embed.main(command) == 0
    assert isinstance(loaded[0].base_model.encoder.fp8_recipe, recipe_module.Float8BlockScaling)
    first = dict(embed.iter_embeddings(tmp_path / "out"))
    for path in (tmp_path / "out").glob("embeddings-00002.safetensors*"):  # the last shard, as if never written
        path.unlink()
    (tmp_path / "out" / "index.tsv").unlink()
    assert embed.main(command) == 0
    again = dict(embed.iter_embeddings(tmp_path / "out"))
    assert first.keys() == again.keys() == {f"p{i}" for i in range(6)}
    for name in first:
        assert all(torch.equal(first[name][key], again[name][key]) for key in first[name]), name


@pytest.mark.parametrize("attn_input_format", ["thd", "bshd"])
def test_stock_peft_lora_on_te_matches_transformers_and_merges(hf_fp32, attn_input_format):
    """Stock PEFT LoRA on query/key/value/dense (attention and MLP) on TE layers: in fp32 the adapted TE model
    matches transformers + PEFT with the same adapters; `merge_and_unload` gives the same logits with the fused
    layers (and CUDA graphs) back; a bf16 training step reaches the adapters only; the fused modules are refused."""
    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["query", "key", "value", "dense"], lora_dropout=0.0)
    hf_peft = peft.get_peft_model(hf_on_gpu(hf_fp32, torch.float32), peft.LoraConfig(**config)).eval()
    model = te_model(hf_fp32, torch.float32, attn_input_format=attn_input_format)
    nv_peft = peft.get_peft_model(model, peft.LoraConfig(**config)).eval()
    share_random_adapters(hf_peft, nv_peft, seed=7, std=0.05)
    input_ids, attention_mask = padded_inputs(seed=107)
    keep = attention_mask.bool()
    with torch.no_grad():
        expected = hf_peft(input_ids, attention_mask=attention_mask).logits[keep]
        with hf_peft.disable_adapter():
            unadapted = hf_peft(input_ids, attention_mask=attention_mask).logits[keep]
        adapted = nv_peft(input_ids, attention_mask=attention_mask).logits[keep]
        merged = nv_peft.merge_and_unload()
        uses_graphs = plan_forward(merged.esm.encoder).graphed
        after_merge = merged(input_ids, attention_mask=attention_mask).logits[keep]
    errors = {
        "adapter_effect": max_err(expected, unadapted),
        "te_lora_fp32": max_err(adapted, expected),
        "merged_vs_adapter": max_err(after_merge, adapted),
    }
    print(f"\n[LoRA fp32 {attn_input_format}] {errors}")
    assert errors["adapter_effect"] > 0.1
    assert errors["te_lora_fp32"] <= TE_FP32_ATOL and errors["merged_vs_adapter"] <= TE_FP32_ATOL
    assert uses_graphs == (CUDA_GRAPHS and attn_input_format == "thd")

    trainable = peft.get_peft_model(te_model(hf_fp32, attn_input_format=attn_input_format), peft.LoraConfig(**config))
    trainable.train()
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        loss = trainable(input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(~keep, -100)).loss
    loss.backward()
    grads = {name: p.grad for name, p in trainable.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in name for name in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for name, g in grads.items() if "lora_A" in name or "lora_B" in name)

    refused = peft.get_peft_model(
        te_model(hf_fp32, attn_input_format=attn_input_format), peft.LoraConfig(r=4, target_modules=["proj"])
    )
    with pytest.raises(ValueError, match="not supported"), torch.no_grad():
        refused(input_ids, attention_mask=attention_mask)


def _layer_weight_bytes(model: NVEsmForMaskedLM) -> int:
    """Bytes the encoder layers' parameters occupy on the GPU (an FP8 tensor: its data, transpose and scales)."""
    total = 0
    for parameter in model.esm.encoder.layers.parameters():
        parts = [getattr(parameter, name, None) for name in ("_data", "_transpose", "_scale_inv")]
        parts += [getattr(parameter, name, None) for name in ("_rowwise_data", "_columnwise_data")]
        parts += [getattr(parameter, name, None) for name in ("_rowwise_scale_inv", "_columnwise_scale_inv")]
        quantized = [part for part in parts if torch.is_tensor(part)]
        tensors = quantized if hasattr(parameter, "_quantizer") else [parameter]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_weights_load_infer_train_and_save(hf_fp32, recipe, tmp_path):
    """`fp8_weights=True` (TE's quantized_model_init): the FP8 layers hold their weights in FP8 after
    `from_pretrained` and after a plain build, in fewer bytes; logits and loss stay within FP8's tolerance of the same
    layers computing in FP8 from bf16 weights; TE's FusedAdam with master weights trains them (the loss on a fixed
    batch falls); `save_pretrained` writes their values, which a plain bf16 load reproduces."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from modeling_nv_esm_layers import holds_fp8_weights

    layers = hf_fp32.config.num_hidden_layers
    make_nv_model(hf_fp32).save_pretrained(tmp_path / "nv")
    fp8 = dict(layer_precision=["fp8"] * layers, fp8_recipe=recipe, cuda_graphs=CUDA_GRAPHS)
    load = dict(backend="te", dtype=torch.bfloat16, device_map=CUDA)
    held = NVEsmForMaskedLM.from_pretrained(tmp_path / "nv", fp8_weights=True, **fp8, **load)
    computed = NVEsmForMaskedLM.from_pretrained(tmp_path / "nv", **fp8, **load)
    assert all(holds_fp8_weights(layer) for layer in held.esm.encoder.layers)
    assert not any(holds_fp8_weights(layer) for layer in computed.esm.encoder.layers)
    held_bytes, plain_bytes = _layer_weight_bytes(held), _layer_weight_bytes(computed)
    print(f"\n[fp8 weights {recipe}] layer bytes {held_bytes} vs bf16 {plain_bytes}")
    assert held_bytes < 0.6 * plain_bytes  # eval mode (from_pretrained's): the FP8 rows only
    built = make_nv_model(hf_fp32, backend="te", fp8_weights=True, **fp8)  # a plain build, weights loaded after
    assert all(holds_fp8_weights(layer) for layer in built.esm.encoder.layers)
    assert _layer_weight_bytes(built) > 1.5 * held_bytes  # train mode when built: rows and transposes

    proteins = random_proteins([5, 250, 33, 1, 97], seed=150, mask_fraction=0.15)
    input_ids, attention_mask = pad_batch(proteins)
    input_ids, attention_mask = input_ids.to(CUDA), attention_mask.to(CUDA)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    keep = attention_mask.bool()
    with torch.no_grad():
        outputs = {
            name: model.eval()(input_ids, attention_mask=attention_mask, labels=labels)
            for name, model in (("bf16", te_model(hf_fp32)), ("held", held), ("computed", computed))
        }
    logits = {name: output.logits[keep].float() for name, output in outputs.items()}
    losses = {name: round(output.loss.item(), 5) for name, output in outputs.items()}
    to_bf16 = torch.nn.functional.cosine_similarity(logits["held"], logits["bf16"], dim=-1).min().item()
    to_computed = torch.nn.functional.cosine_similarity(logits["held"], logits["computed"], dim=-1).min().item()
    print(
        f"[fp8 weights {recipe}] losses {losses}; logits cosine min to bf16 {to_bf16:.5f}, computed {to_computed:.5f}"
    )
    assert abs(losses["held"] - losses["bf16"]) <= FP8_LOSS_RTOL * losses["bf16"]
    assert to_bf16 >= 0.98
    if recipe != "delayed":  # the same quantization as a per-forward cast; delayed scaling's first cast uses scale 1
        assert to_computed >= 0.999

    held.train()
    optimizer = FusedAdam(held.parameters(), lr=1e-3, master_weights=True)
    train_losses = []
    for _ in range(8):
        loss = held(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
    print(f"[fp8 weights {recipe}] training losses {[round(x, 4) for x in train_losses]}")
    assert all(holds_fp8_weights(layer) for layer in held.esm.encoder.layers)
    assert all(torch.isfinite(torch.tensor(train_losses))) and train_losses[-1] < train_losses[0] - 0.05

    held.eval().save_pretrained(tmp_path / "saved")
    reloaded = NVEsmForMaskedLM.from_pretrained(tmp_path / "saved", backend="te", dtype=torch.bfloat16).to(CUDA)
    saved, state = reloaded.state_dict(), held.state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[key], state[key].to(saved[key].device)) for key in saved)


def test_a_callers_quantized_model_init_holds_every_layer_in_fp8(hf_fp32, tmp_path):
    """A model built or loaded inside the caller's `te.quantized_model_init` holds every layer's weights in FP8 (its
    recipe); it runs under the caller's `te.autocast` with the loss close to bf16, and without one it refuses in one
    line instead of computing with FP8 weights outside FP8."""
    import transformer_engine.pytorch as te

    from modeling_nv_esm_layers import holds_fp8_weights, make_fp8_recipe

    make_nv_model(hf_fp32).save_pretrained(tmp_path)
    recipe = make_fp8_recipe("current")
    load = dict(backend="te", dtype=torch.bfloat16, device_map=CUDA, cuda_graphs=CUDA_GRAPHS)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        model = NVEsmForMaskedLM.from_pretrained(tmp_path, **load).eval()
    assert all(holds_fp8_weights(layer) for layer in model.esm.encoder.layers)
    proteins = random_proteins([5, 79, 33, 1, 61], seed=151, mask_fraction=0.15)
    input_ids, attention_mask = pad_batch(proteins)
    input_ids, attention_mask = input_ids.to(CUDA), attention_mask.to(CUDA)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        bf16 = te_model(hf_fp32)(input_ids, attention_mask=attention_mask, labels=labels).loss.item()
        with te.autocast(enabled=True, recipe=recipe):
            loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss.item()
        with pytest.raises(ValueError, match="te.autocast"):
            model(input_ids, attention_mask=attention_mask)
    print(f"\n[caller quantized_model_init] loss bf16 {bf16:.5f} fp8 weights {loss:.5f}")
    assert abs(loss - bf16) <= FP8_LOSS_RTOL * bf16
