"""Shared helpers: random ESM-2 models with identical weights in transformers and NVEsm, random proteins."""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import forked_ranks
import pytest
import torch
from transformers import EsmForMaskedLM

from modeling_nv_esm import NVEsmForMaskedLM, pack_proteins
from modeling_nv_esm_layers import transformer_engine_available
from nv_esm.alphabet import CLS, EOS, MASK, PAD, STANDARD_IDS
from nv_esm.data import pad_proteins
from nv_esm.shapes import ESM2_SHAPES, esm2_config
from nv_esm.state_dict_mapping import hf_to_nv_state_dict, nv_config_from_hf

ROOT = Path(__file__).resolve().parents[1]

TINY_CHECKPOINT = ROOT / "assets" / "esm2_tiny"
# Marks of the GPU test modules. Asking whether TE imports imports it, before anything loads cuDNN in the process
# (see shared/gpu/README.md).
# CUDA graphs are captured at a shape's first use there (the default waits for the second) and no shape is timed
# against an eager run of it (`StaticShapeGraphs.time_shapes`), so every graphed call a GPU test checks replays a graph.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and transformer_engine_available()), reason="needs CUDA and Transformer Engine"
    ),
    pytest.mark.usefixtures("capture_at_first_use"),
]
# PyTorch twin vs transformers, fp32, CPU: logits, hidden states, losses, gradients (tests/test_model.py says why).
ATOL_FP32 = 1e-5
# TE fp32 vs transformers fp32 logits of the test models: TE's GELU is the tanh approximation (through 6 layers).
# Users' --verify default is looser (nv_esm.verification.TE_FP32_VERIFY_ATOL): trained models have larger logits.
TE_FP32_ATOL = 2e-2
AMINO_ACIDS = STANDARD_IDS  # the 20 standard residues of the ESM alphabet
# Shapes for CPU parity tests: ESM-2 8M itself and smaller ones of other aspect ratios.
SHAPES = {
    "esm2_8M": ESM2_SHAPES["8M"],
    "wide_heads": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=2, intermediate_size=200),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
}


@pytest.fixture(scope="session", autouse=True)
def files_stay_in_temporary_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the tests leave goes under pytest's temporary folder: transformers' modules cache (where
    `trust_remote_code` copies a folder's code) and the temporary files of this process and of the processes it
    starts (torchrun's `torchelastic_*` folders, multiprocessing's `pymp-*`)."""
    from transformers import dynamic_module_utils

    cache, scratch = tmp_path_factory.mktemp("hf_modules"), tmp_path_factory.mktemp("tmp")
    patch = pytest.MonkeyPatch()
    patch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(cache))
    patch.setenv("HF_MODULES_CACHE", str(cache))
    patch.setenv("TMPDIR", str(scratch))
    patch.setattr(tempfile, "tempdir", str(scratch))
    yield
    patch.undo()


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny ESM-2 checkpoint in transformers' format (the converter tests' source)."""
    from convert_helpers import save_hf

    return save_hf(make_hf_model("tiny", seed=7), tmp_path_factory.mktemp("src") / "esm2_random_tiny")


@pytest.fixture(scope="module")
def checkpoint(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_source` converted to NVEsm by `nv-esm convert hf-to-te` (the commands' input; a test module may
    define its own)."""
    import convert_checkpoint

    folder = tmp_path_factory.mktemp("nv") / "esm2_tiny_nv"
    assert convert_checkpoint.main(["hf-to-te", str(tiny_source), str(folder)]) == 0
    return folder


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """transformers' `EsmTokenizer` of the bundled tiny checkpoint (ESM-2's vocabulary)."""
    from transformers import EsmTokenizer

    return EsmTokenizer.from_pretrained(TINY_CHECKPOINT)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json of the repo's model in the tiny shape (for runs of the recipe from scratch)."""
    fields = json.loads((ROOT / "config.json").read_text())
    fields.update(SHAPES["tiny"])
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def nv_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tiny ESM-2 checkpoint, converted to NVEsm."""
    from nv_esm.conversion import convert_hf_to_nv

    out = tmp_path_factory.mktemp("nv") / "esm2_tiny_nv"
    convert_hf_to_nv(TINY_CHECKPOINT, out)
    return out


@pytest.fixture
def modules_cache(tmp_path, monkeypatch) -> Path:
    """transformers' modules cache (where trust_remote_code copies a folder's code) in a fresh folder."""
    from transformers import dynamic_module_utils

    cache, usual = tmp_path / "hf_modules", dynamic_module_utils.HF_MODULES_CACHE
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(cache))
    monkeypatch.setattr(sys, "path", [path for path in sys.path if path != usual])
    for name in [name for name in sys.modules if name.split(".")[0] == "transformers_modules"]:
        monkeypatch.delitem(sys.modules, name)
    return cache


@pytest.fixture
def capture_at_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """`StaticShapeGraphs` of the repo's modeling module capture a shape the first time it is met and replay it
    from then on, never timing it against an eager run (models loaded with trust_remote_code run their own copy of
    the module, with the defaults)."""
    from modeling_nv_esm_graphs import StaticShapeGraphs

    monkeypatch.setattr(StaticShapeGraphs, "capture_at_use", 1)
    monkeypatch.setattr(StaticShapeGraphs, "time_shapes", False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA and Transformer Engine (skipped otherwise)")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if workers > 1:  # pytest -n N: the cores shared among the workers, not N x all of them (that stalled tests)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# Longest a test may run (seconds; NVESM_TEST_TIMEOUT overrides): past it, the test's name and every thread's stack
# go to stderr and the process exits (pytest-xdist then reports "worker crashed while running <test>" too). The
# slowest test takes about 3 minutes on a 2-core machine.
TEST_TIMEOUT = float(os.environ.get("NVESM_TEST_TIMEOUT", 900))


def _time_is_up(nodeid: str, capture: Any) -> None:
    if capture is not None:  # pytest's output capture, which would swallow the report
        capture.suspend_global_capture(in_=False)
    sys.stderr.write(f"\n{nodeid} ran past {TEST_TIMEOUT:g} s (NVESM_TEST_TIMEOUT); its threads' stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)


@pytest.fixture(autouse=True)
def time_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    """Bound each test's time (`TEST_TIMEOUT`): a hang names its test instead of stalling the suite."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    timer = threading.Timer(TEST_TIMEOUT, _time_is_up, (request.node.nodeid, capture))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# What a test may start only when marked `slow` (pyproject.toml says what the mark means): torchrun, the trainer and
# the commands. Argument and refusal checks call the command's `main([...])` in-process instead.
SLOW_LAUNCHES = ("torch.distributed.run", "torchrun", "nv_esm", "nv_esm.train")


def launches_slowly(args: Any) -> bool:
    """Whether a `subprocess.Popen` command line (`args`: a list or a string) starts torchrun, the trainer or a
    command of nv-esm."""
    words = [str(word) for word in args] if isinstance(args, (list, tuple)) else str(args).split()
    return any(word in SLOW_LAUNCHES or word.endswith(("/torchrun", "/nv-esm", "recipes/train.py")) for word in words)


@pytest.fixture(autouse=True)
def slow_launches_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test outside the `slow` mark that starts torchrun, the trainer or a command, or runs ranks in forked or
    spawned processes, fails, naming the mark: the fast set (`make test`) stays fast as tests are added."""
    if request.node.get_closest_marker("slow"):
        return
    popen_init = subprocess.Popen.__init__

    def refuse_slow_launches(self: subprocess.Popen, args: Any, *rest: Any, **options: Any) -> None:
        if launches_slowly(args):
            raise AssertionError(f"{request.node.nodeid} starts {args!r}: mark it @pytest.mark.slow")
        popen_init(self, args, *rest, **options)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_slow_launches)

    def refuse_forked_runs(target: str, *args: Any, **options: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} runs {target} in forked processes: mark it @pytest.mark.slow")

    monkeypatch.setattr(forked_ranks, "run", refuse_forked_runs)

    def refuse_spawned_ranks(*args: Any, **options: Any) -> None:
        raise AssertionError(f"{request.node.nodeid} spawns ranks (torch.multiprocessing): mark it @pytest.mark.slow")

    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse_spawned_ranks)


# The GPU suite runs with pytest -n 12 on one 80 GB GPU: a test whose own tensors peak above this many GiB is named in
# the warnings summary (one worker once held 42.8 GB and a tensor-parallel test beside it ran out of memory).
GPU_MEMORY_NOTE_GIB = 8


class LargeGPUMemoryWarning(UserWarning):
    """A test's tensors took more GPU memory than `GPU_MEMORY_NOTE_GIB`."""


@pytest.fixture(autouse=True)
def note_large_gpu_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """Name the tests whose tensors peak above `GPU_MEMORY_NOTE_GIB` on the GPU (allocated, not the allocator's cache,
    which earlier tests of the process leave), then give the test's cached memory back: the GPU suite runs a dozen
    pytest workers on one GPU, and a worker that kept what its largest test reserved (33 GB) left too little for the
    tensor-parallel test's ranks. Nothing where CUDA was never initialized."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()  # models in reference cycles (layers and their adapter targets, graphs) hold their memory
        torch.cuda.empty_cache()
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        if peak > GPU_MEMORY_NOTE_GIB:
            message = f"{request.node.nodeid}: {peak:.1f} GiB of GPU tensors at its peak"
            warnings.warn(message, LargeGPUMemoryWarning, stacklevel=2)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every tensor random (LayerNorms, biases, contact head too), so no mapping error hides behind 0 or 1.

    Matrices get std 1/sqrt(fan_in) and LayerNorm gains 1 +- 0.2, so activations stay of order 1 as in trained
    ESM-2 (random std-0.1 matrices would blow the residual stream up to ~100 and test float32 rounding instead).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() == 2:
                parameter.copy_(noise / parameter.shape[1] ** 0.5)
            elif "norm" in name.lower() and name.endswith("weight"):
                parameter.copy_(1 + 0.2 * noise)
            else:
                parameter.copy_(0.2 * noise)
        model.esm.embeddings.word_embeddings.weight[model.config.pad_token_id].zero_()


def make_hf_model(shape: str = "tiny", seed: int = 0, **config: object) -> EsmForMaskedLM:
    """A transformers ESM-2 model of `shape` (its fields overridden by `config`) with random weights, eval, fp32."""
    torch.manual_seed(seed)
    model = EsmForMaskedLM(esm2_config(**{**SHAPES[shape], **config})).eval()  # `config` overrides the shape
    randomize_(model, seed)
    return model


def make_head_models(hf_class: type, nv_class: type, seed: int, num_labels: int = 2, **overrides: object) -> tuple:
    """A transformers head model (`EsmForSequenceClassification` / `EsmForTokenClassification`, eval, random
    encoder and classifier weights, `num_labels` outputs) and the NVEsm model of `nv_class` holding the same
    weights (the encoder through the converter; the heads have the same names), PyTorch backend unless
    overridden."""
    mlm = make_hf_model("wide_heads", seed=seed)
    mlm.config.num_labels = num_labels
    hf_model = hf_class(mlm.config).eval()
    hf_model.esm.load_state_dict(mlm.esm.state_dict(), strict=True)
    torch.manual_seed(seed + 1)
    for parameter in hf_model.classifier.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    overrides.setdefault("backend", "torch")
    labelled = nv_config_from_hf(hf_model.config.to_dict(), "sequence_classification", **overrides)  # its labels
    nv_model = nv_class(labelled).eval()
    encoder = {k: v for k, v in hf_to_nv_state_dict(mlm.state_dict(), nv_model.config).items() if k.startswith("esm.")}
    heads = {k: v for k, v in hf_model.state_dict().items() if not k.startswith("esm.")}
    nv_model.load_state_dict(encoder | heads, strict=True)
    return hf_model, nv_model


def make_nv_model(hf_model: EsmForMaskedLM, **overrides: object) -> NVEsmForMaskedLM:
    """The NVEsm twin of `hf_model` (same weights via the converter), PyTorch backend unless overridden."""
    overrides.setdefault("backend", "torch")
    config = nv_config_from_hf(hf_model.config.to_dict(), **overrides)
    model = NVEsmForMaskedLM(config).eval()
    model.load_state_dict(hf_to_nv_state_dict(hf_model.state_dict(), config), strict=True)
    return model


def share_random_adapters(hf_peft: torch.nn.Module, nv_peft: torch.nn.Module, seed: int, std: float) -> None:
    """The same random values (normal, `std`) in every LoRA tensor of transformers' PEFT model and NVEsm's (whose
    keys read `.layers.` where transformers' read `.layer.`), B included, so every adapter changes the output."""
    generator = torch.Generator().manual_seed(seed)
    hf_state, nv_state = hf_peft.state_dict(), nv_peft.state_dict()
    with torch.no_grad():
        for key in [k for k in nv_state if "lora_" in k]:
            values = torch.randn(nv_state[key].shape, generator=generator) * std
            nv_state[key].copy_(values)
            hf_state[key.replace(".layers.", ".layer.")].copy_(values)


def random_protein(length: int, generator: torch.Generator, mask_fraction: float = 0.0) -> torch.Tensor:
    """`<cls> residues <eos>` with `length` tokens in all (length 1: just `<cls>`), some residues masked."""
    residues = torch.tensor(list(AMINO_ACIDS))[torch.randint(0, 20, (max(length - 2, 0),), generator=generator)]
    if mask_fraction:
        residues[torch.rand(residues.shape, generator=generator) < mask_fraction] = MASK
    tokens = torch.cat([torch.tensor([CLS]), residues, torch.tensor([EOS])])
    return tokens[:length]


def random_proteins(lengths: list[int], seed: int, mask_fraction: float = 0.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [random_protein(length, generator, mask_fraction) for length in lengths]


def pad_batch(proteins: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids [B, S]` and `attention_mask [B, S]` (`modeling_nv_esm.pad_proteins`)."""
    padded = pad_proteins(proteins, PAD)
    return padded["input_ids"], padded["attention_mask"]


def pack_batch(proteins: list[torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """Packed inputs as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives them
    (`modeling_nv_esm.pack_proteins`)."""
    return pack_proteins(proteins)


def packed_on_gpu(proteins: list[torch.Tensor]) -> dict[str, torch.Tensor | int]:
    """`pack_batch` with its tensors on the GPU."""
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in pack_batch(proteins).items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (L2 over all elements)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


PADDING_SIDES = ("right", "left", "both")
PADDING_WIDTHS = ("longest", "multiple_of_16", "wider")


def random_padded_batch(
    proteins: list[torch.Tensor], side: str, width: str, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids [B, W]` and `attention_mask [B, W]` holding each protein in one row, as tokenizers and
    collators pad: on the `side` "right" or "left" of every row, or "both" (a random offset per row); `width`
    "longest" (W = longest protein, `padding=True`), "multiple_of_16" (`pad_to_multiple_of=16`) or "wider"
    (a random W past the longest, as `padding="max_length"`). Padding positions hold random token ids too, so
    a model that reads them gives itself away."""
    longest = max(len(p) for p in proteins)
    columns = {
        "longest": longest,
        "multiple_of_16": -(-longest // 16) * 16,
        "wider": longest + int(torch.randint(1, 40, (), generator=generator)),
    }[width]
    input_ids = torch.randint(0, 33, (len(proteins), columns), generator=generator)
    attention_mask = torch.zeros((len(proteins), columns), dtype=torch.long)
    for row, protein in enumerate(proteins):
        room = columns - len(protein)
        start = {"right": 0, "left": room, "both": int(torch.randint(0, room + 1, (), generator=generator))}[side]
        input_ids[row, start : start + len(protein)] = protein
        attention_mask[row, start : start + len(protein)] = 1
    return input_ids, attention_mask


def random_lengths(generator: torch.Generator, count: int, longest: int = 60) -> list[int]:
    """`count` protein lengths in tokens, uniform in [1, longest], with a length-1 protein among them."""
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist()
    lengths[int(torch.randint(0, count, (), generator=generator))] = 1
    return lengths
