"""A `transformers.Trainer` data collator that masks and packs masked-LM batches in one step.

    from nv_esm.collator import PackedMLMCollator
    trainer = Trainer(model, args, train_dataset=tokenized, data_collator=PackedMLMCollator())

transformers' `DataCollatorWithFlattening` packs but does not mask, and `DataCollatorForLanguageModeling` masks
but pads. This collator masks each protein as ESM-2 was trained (`nv_esm.data.mask_tokens`: 15% of the residues,
of those 80% `<mask>`, 10% a random standard residue, 10% unchanged; `<cls>`/`<eos>` never) and concatenates the
proteins into one packed row (THD) that NVEsm models take as they are.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nv_esm.alphabet import PAD
from nv_esm.data import mask_tokens, pack_batch


@dataclass
class PackedMLMCollator:
    """Mask and pack a list of tokenized proteins for `NVEsmForMaskedLM`.

    Each feature is a dict with `input_ids` (a list or 1-D tensor of token ids with `<cls>`/`<eos>`, as the ESM
    tokenizer gives them without padding); other fields are ignored, except that an `attention_mask` with zeros
    (a padded feature) or a `labels` field (this collator makes the labels) is refused with a `ValueError`.
    Returns `input_ids [1, T]`, `labels [1, T]` (the original id at selected residues, -100 elsewhere),
    `cu_seq_lens_q`/`cu_seq_lens_k` (`[N + 1]` int32) and `max_length_q`/`max_length_k` (the longest protein).

    Randomness: with `seed`, one `random.Random(seed)` for the collator's life (reproducible batches; each
    DataLoader worker has its own copy, so with workers prefer the default); without, each call draws its
    generator from torch's global RNG, which `Trainer` and DataLoader workers seed, as transformers' collators do.
    """

    mask_prob: float = 0.15
    mask_token_fraction: float = 0.8
    random_token_fraction: float = 0.1
    seed: int | None = None
    _random: random.Random | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.mask_prob <= 1:
            raise ValueError(f"mask_prob must be in (0, 1], got {self.mask_prob}.")
        if self.mask_token_fraction + self.random_token_fraction > 1:
            raise ValueError("mask_token_fraction + random_token_fraction must be at most 1.")
        if self.seed is not None:
            self._random = random.Random(self.seed)

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("PackedMLMCollator got an empty batch.")
        generator = self._random or random.Random(int(torch.randint(2**62, ())))
        inputs, labels = [], []
        for index, feature in enumerate(features):
            tokens = _token_list(feature, index)
            masked, masked_labels = mask_tokens(
                tokens, generator, self.mask_prob, self.mask_token_fraction, self.random_token_fraction
            )
            inputs.append(masked)
            labels.append(masked_labels)
        batch = pack_batch(inputs, labels)
        return {**batch.model_inputs(), "labels": batch.labels}


def _token_list(feature: dict[str, Any], index: int) -> list[int]:
    """The feature's token ids as a list, checked: present, 1-D, not empty, not padded, no labels of its own."""
    if "input_ids" not in feature:
        raise ValueError(f"Feature {index} has no input_ids (tokenize the sequences first).")
    if "labels" in feature:
        raise ValueError(f"Feature {index} has labels: PackedMLMCollator makes the MLM labels; drop that column.")
    tokens = feature["input_ids"]
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    if not tokens or not all(isinstance(token, int) for token in tokens):
        raise ValueError(f"Feature {index}: input_ids must be a non-empty 1-D list of token ids.")
    mask = feature.get("attention_mask")
    padded = mask is not None and not all(int(value) == 1 for value in mask)
    if padded or PAD in tokens:
        raise ValueError(
            f"Feature {index} is padded: tokenize without padding (the collator packs proteins end to end)."
        )
    return tokens
