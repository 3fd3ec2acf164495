"""README.md of NVEsm model folders: YAML front matter (Hub metadata) and a markdown description.

`model_card` describes a converted ESM-2 checkpoint (what it was converted from, usage, hardware, the `--verify`
table, license, citation); `bionemo_card` a folder converted into NVIDIA's BioNeMo layout; `training_card` a model
exported by the training recipe. They share `front_matter`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nv_esm.checkpoint_io import format_bytes
from nv_esm.state_dict_mapping import HEADS
from nv_esm.tasks import TASK_HEADS

if TYPE_CHECKING:
    import torch

    from configuration_nv_esm import NVEsmConfig
    from nv_esm.verification import VerifyReport

# Per head (a key of `state_dict_mapping.HEADS`): the Hub pipeline tag and the transformers Auto class that loads it.
HEAD_USAGE = {
    "masked_lm": ("fill-mask", "AutoModelForMaskedLM"),
    "token_classification": ("token-classification", "AutoModelForTokenClassification"),
    "sequence_classification": ("text-classification", "AutoModelForSequenceClassification"),
}
CONVERTED_TAGS = ("esm", "esm2", "protein-language-model", "biology", "transformer-engine")
TRAINED_TAGS = ("esm", "esm2", "protein", "biology", "transformer-engine", "nv-esm")
ESM2_CITATION = """@article{lin2023evolutionary,
  title   = {Evolutionary-scale prediction of atomic-level protein structure with a language model},
  author  = {Lin, Zeming and Akin, Halil and Rao, Roshan and Hie, Brian and Zhu, Zhongkai and Lu, Wenting and
             Smetanin, Nikita and Verkuil, Robert and Kabeli, Ori and Shmueli, Yaniv and dos Santos Costa, Allan and
             Fazel-Zarandi, Maryam and Sercu, Tom and Candido, Salvatore and Rives, Alexander},
  journal = {Science},
  volume  = {379},
  number  = {6637},
  pages   = {1123--1130},
  year    = {2023},
  doi     = {10.1126/science.ade2574}
}"""


def front_matter(pipeline_tag: str, tags: Sequence[str], base_model: str | None = None) -> str:
    """The card's YAML metadata block (MIT, transformers), between `---` lines."""
    lines = ["---", "license: mit", "library_name: transformers", f"pipeline_tag: {pipeline_tag}", "tags:"]
    lines += [f"  - {tag}" for tag in tags]
    if base_model:
        lines.append(f"base_model: {json.dumps(base_model)}")
    lines.append("---")
    return "\n".join(lines)


def _card(front: str, sections: Sequence[str]) -> str:
    return front + "\n\n" + "\n\n".join(sections) + "\n"


# --------------------------------------------------------------------------------------------------------------
# A converted checkpoint
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """What the model card says about a conversion.

    Attributes:
        name: The source's Hub id, or the name of its folder or `.pt` file.
        hub_id: The Hub repository of the source, when known (the card's `base_model`).
        source_kind: "transformers", "fair-esm", "bionemo" (NVIDIA's BioNeMo layout) or "nvesm".
        source_nbytes: Bytes of the source's tensors.
        source_dtype: dtype name of the source's weights (its embedding's), e.g. "float32".
        dtype: dtype name of the written weights.
        parameters: Parameters written (with vocabulary padding).
        nbytes: Bytes of the written weights.
    """

    name: str
    hub_id: str | None
    source_kind: str
    source_nbytes: int
    source_dtype: str
    dtype: str
    parameters: int
    nbytes: int


def model_card(
    checkpoint: ConvertedCheckpoint,
    config: NVEsmConfig,
    report: VerifyReport | None,
    repo: str,
    head: str = "masked_lm",
) -> str:
    """README.md of a converted NVEsm folder with `head` (a key of `HEADS`). `report` is `--verify`'s (None: not
    verified); `repo` is where the folder will be loaded from, for the examples."""
    sections = [
        _card_intro(checkpoint, config, head),
        _card_usage(repo, config, head),
        card_trust(repo, HEADS[head].nv_class, checkpoint.hub_id or f"PATH/TO/{checkpoint.name}"),
        _card_hardware(checkpoint.nbytes, checkpoint.dtype),
        _card_verification(report),
        "## License\n\nMIT, as ESM-2. The weights are Copyright (c) Meta Platforms, Inc. and affiliates; see LICENSE.",
        f"## Citation\n\n```bibtex\n{ESM2_CITATION}\n```",
    ]
    return _card(front_matter(HEAD_USAGE[head][0], CONVERTED_TAGS, checkpoint.hub_id), sections)


def _card_intro(checkpoint: ConvertedCheckpoint, config: NVEsmConfig, head: str) -> str:
    hub_id = checkpoint.hub_id
    origin = f"[{hub_id}](https://huggingface.co/{hub_id})" if hub_id else f"`{checkpoint.name}`"
    values = f"The weights are the source's values in {checkpoint.dtype}"
    if checkpoint.source_dtype != checkpoint.dtype:
        values = f"The weights are the source's {checkpoint.source_dtype} values rounded to {checkpoint.dtype}"
    layout = f"""the layout differs only in that query, key and value
are fused into one matrix per layer (rows interleaved per head), and the embedding and decoder rows are padded
with zeros from {config.vocab_size} to {config.padded_vocab_size}."""
    commands = ("hf-to-te", "te-to-hf", f"that plain transformers (`{HEADS[head].hf_class}`) loads")
    kind = {"bionemo": "NVIDIA BioNeMo"}.get(checkpoint.source_kind, checkpoint.source_kind)
    if checkpoint.source_kind == "bionemo":
        layout = f"""the layout differs from NVIDIA's BioNeMo one (bionemo-recipes) in the
prefix of the base model (`esm.`, theirs `model.`) and the vocabulary rows (padded with zeros to
{config.padded_vocab_size}). Their layout has no contact head, so this folder has none: `predict_contacts` and
`nv-esm embed --include contacts` need one (`from_pretrained` starts it at random)."""
        commands = ("bionemo-to-te", "te-to-bionemo", "in their layout")
    return f"""# {checkpoint.name} on NVIDIA Transformer Engine (NVEsm)

ESM-2 is Meta AI's protein language model (Lin et al., Science 2023), trained with masked language modelling
on protein sequences from UniRef. This repository holds the weights of {origin} ({kind} checkpoint,
{format_bytes(checkpoint.source_nbytes)}) for `{HEADS[head].nv_class}`, whose encoder layers are Transformer Engine
`TransformerLayer`s; a pure-PyTorch implementation with the same parameters runs where Transformer Engine is
not installed. {values}; {layout}

| layers | hidden size | heads | intermediate size | parameters (with vocabulary padding) | weights |
|---:|---:|---:|---:|---:|---:|
| {config.num_hidden_layers} | {config.hidden_size} | {config.num_attention_heads} | {config.intermediate_size} \
| {checkpoint.parameters:,} | {format_bytes(checkpoint.nbytes)} |

Converted with `nv-esm convert {commands[0]}`; `nv-esm convert {commands[1]}` gives back a folder
{commands[2]}."""


def bionemo_card(
    checkpoint: ConvertedCheckpoint, config: NVEsmConfig, padded: int, report: VerifyReport | None, head: str
) -> str:
    """README.md of a folder converted into NVIDIA's BioNeMo layout (`te-to-bionemo`) with `head`: what it holds and
    which code loads it (theirs, which it does not hold); `padded`: its vocabulary rows; `report`: `--verify`'s."""
    intro = f"""# {checkpoint.name} in NVIDIA's BioNeMo ESM-2 layout

ESM-2 (Lin et al., Science 2023) weights in the layout of NVIDIA's bionemo-recipes (`models/esm2`:
`modeling_esm_te.py`, as `nvidia/esm2_t*_UR50D`), converted from `{checkpoint.name}` with
`nv-esm convert te-to-bionemo`; `nv-esm convert bionemo-to-te` converts it back. The weights are the source's,
in {checkpoint.dtype}; the embedding and decoder rows are padded from {config.vocab_size} to {padded} as their
convert.py pads them. Their layout has no contact head and no rotary `inv_freq`, so this folder has neither.

This folder holds no model code. config.json is their config (model_type `nv_esm`, their fields at their defaults)
and its `auto_map` names `esm_nv.py`, the file their export writes beside the weights: copy bionemo-recipes'
`models/esm2/modeling_esm_te.py` here as `esm_nv.py` and load with `trust_remote_code=True`, or load with their
classes. The tokenizer is transformers' `EsmTokenizer` (ESM-2's vocabulary)."""
    sections = [intro, _card_verification(report), "## License\n\nMIT, as ESM-2 (the weights: Meta Platforms, Inc.)."]
    return _card(front_matter(HEAD_USAGE[head][0], CONVERTED_TAGS, checkpoint.hub_id), sections)


def _card_usage(repo: str, config: NVEsmConfig, head: str) -> str:
    auto_class = HEAD_USAGE[head][1]
    example = "MSKGEELFTGVVPILVELDGDVNGHKFSVSGEG<mask>GDATYGKLTLKFICTTGKLPVPWPTLVTTF"
    if head != "masked_lm":
        example = example.replace("<mask>", "E")
    return f"""## Usage

The model code ships with the weights, so loading with the Auto classes needs `trust_remote_code=True` (see
"What `trust_remote_code=True` runs" below). With Transformer Engine
installed and a CUDA GPU the layers run in Transformer Engine (`backend="auto"`, the default); anywhere else
`"auto"` picks the PyTorch implementation (same weights, same results up to float rounding), and
`backend="torch"` forces it, e.g. to run on the CPU of a machine that has a GPU.

```python
import torch
from transformers import {auto_class}, AutoTokenizer

repo = "{repo}"  # the Hub id, or the local folder
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = {auto_class}.from_pretrained(repo, trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
# without Transformer Engine (e.g. on a CPU):
# model = {auto_class}.from_pretrained(repo, trust_remote_code=True, backend="torch").eval()

batch = tokenizer(["{example}"], return_tensors="pt")
with torch.no_grad():
    logits = model(**batch.to(model.device)).logits
```

### Packed sequences (THD)

Proteins can be packed into one row without padding. Pass the packed `input_ids [1, T]` with either
`cu_seq_lens_q` (int32 `[N + 1]` offsets of the proteins) and `max_length_q`, or with `position_ids` restarting
at 0 for every protein; `transformers.DataCollatorWithFlattening` produces both
(`return_flash_attn_kwargs=True` for `cu_seq_lens_*`/`max_length_*`). Outputs come back packed, `[1, T, ...]`.

```python
from transformers import DataCollatorWithFlattening

collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
packed = collator([tokenizer(sequence) for sequence in ["MKTAYIAKQRQISFVKSHFSRQ", "MSKGEELFTGVVPILVELDG"]])
packed.pop("labels")  # the collator copies input_ids as labels; labels are your own
packed = {{key: value.to(model.device) if torch.is_tensor(value) else value for key, value in packed.items()}}
with torch.no_grad():
    logits = model(**packed).logits  # [1, total tokens, ...]
```

With `attn_input_format="thd"` (the default in config.json) the layers always run packed: padded batches
(`input_ids [B, S]` + `attention_mask`) are unpadded inside the model and the outputs scattered back, so no
compute is spent on padding. `attn_input_format="bshd"` runs padded batches as they are.

### FP8

On GPUs with FP8 tensor cores (Hopper, e.g. H100/H200, and newer) Transformer Engine can run the layers' GEMMs
in FP8. Choose the layers with `layer_precision`, one entry per layer (`"fp8"`, or `None` for bf16), and the
scaling with `fp8_recipe` (`"delayed"`, `"current"` or `"block"`):

```python
model = {auto_class}.from_pretrained(
    repo, trust_remote_code=True, dtype=torch.bfloat16,
    layer_precision=["fp8"] * {config.num_hidden_layers}, fp8_recipe="delayed",
)
```

FP8 changes the numerics; check the accuracy of your task before relying on it."""


def card_trust(repo: str, nv_class: str, source: str | None) -> str:
    """What `trust_remote_code=True` runs, and how to check the folder (with `nv-esm convert verify`, for a
    conversion of `source`) or do without its code."""
    check = ""
    if source is not None:
        check = f"""
`nv-esm convert verify` checks a copy of this folder without running any of it: every file against what the
converter writes from the source (the code byte for byte, config.json field by field, nothing extra), every tensor
bit for bit, then the logits on 22 real proteins (exit status 0: identical to a fresh conversion):

```bash
hf download {repo} --local-dir ./to_check   # a Hub repository; a local folder is checked where it is
nv-esm convert verify {source} ./to_check --verify-device cpu
```
"""
    return f"""### What `trust_remote_code=True` runs

`configuration_nv_esm.py`, `modeling_nv_esm.py` and the `modeling_nv_esm_*.py` files it imports
run as Python with your permissions, like any code you install; the weights (safetensors), config.json and the
tokenizer files are data. Read these files, or check them, before you trust them.
{check}
With nv-esm installed, its own code can run this folder's weights instead, with no code from the folder at all:

```python
from modeling_nv_esm import {nv_class}

model = {nv_class}.from_pretrained("{repo}", use_safetensors=True)
```

Pin a reviewed revision (`revision="<commit>"` in `from_pretrained`) so that a later push cannot change the code
you run."""


def _card_hardware(nbytes: int, dtype_name: str) -> str:
    return f"""## Hardware

- Transformer Engine backend: an NVIDIA GPU with CUDA and `transformer-engine[pytorch]>=2.8`; bf16 needs Ampere
  (sm_80) or newer, FP8 Hopper (sm_90) or newer.
- PyTorch backend (`backend="torch"`): any device PyTorch runs on, CPU included.
- Memory: the weights take {format_bytes(nbytes)} in {dtype_name}; activations come on top and grow with the
  number of tokens in a batch."""


def _card_verification(report: VerifyReport | None) -> str:
    if report is None:
        return "## Verification\n\nThe conversion was not verified with `--verify`."
    return (
        "## Verification\n\n`nv-esm convert --verify` ran the source model and this one on real UniProt "
        "proteins and compared the logits:\n\n" + report.table()
    )


# --------------------------------------------------------------------------------------------------------------
# A model exported by the training recipe
# --------------------------------------------------------------------------------------------------------------


def training_card(checkpoint: Path, run: dict, weights: dict[str, torch.Tensor]) -> str:
    """A short model card: what was trained, from what, on what, for how long.

    `checkpoint` is the training checkpoint folder exported; `run` the `run` record of its train_state.json
    (`config`, `settings` with `task`/`data`/`steps`, `start`); `weights` the exported tensors.
    """
    config, settings = run["config"], run["settings"]
    parameters = sum(t.numel() for t in weights.values())
    head = TASK_HEADS[settings["task"]]
    pipeline_tag, auto_class = HEAD_USAGE[head]
    body = f"""# NVEsm model trained with `nv-esm train`

ESM-2-shaped protein language model ({parameters / 1e6:.1f}M parameters: {config["num_hidden_layers"]} layers,
hidden size {config["hidden_size"]}, {config["num_attention_heads"]} heads) exported from `{checkpoint.name}` of a
`nv-esm train` run (task `{settings["task"]}`, started from `{run["start"]}`, data {settings["data"]},
{settings["steps"]} scheduled steps). Load it with

```python
from transformers import {auto_class}
model = {auto_class}.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
```

The weights are float32, in the nv-esm layout (`nv-esm convert te-to-hf` turns them into a transformers
`{HEADS[head].hf_class}` folder). Evaluate before use: this card records how the model was trained, not how
well it works."""
    trust = card_trust("PATH_OR_REPO", HEADS[head].nv_class, None)
    return _card(front_matter(pipeline_tag, TRAINED_TAGS), [body, trust])
