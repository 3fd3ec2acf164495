"""Validation during training: this rank's share of the validation set (`validation_stream`), one pass of the
model over it (`evaluate`), and the metrics of each task, computed from all ranks' predictions.

    mlm                  val_loss (cross-entropy per masked token), val_perplexity, val_masked_accuracy
    token / sequence     val_loss (cross-entropy), val_accuracy, val_f1_macro, val_auroc; two classes: also val_f1
    sequence regression  val_loss (mean squared error), val_rmse, val_spearman

plus `val_count`, the masked tokens, labelled residues or proteins scored. The set is read in file order and masked
or cropped with a fixed seed, so every validation of a run, and of runs with other seeds or world sizes, scores the
same inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modeling_nv_esm import sequence_loss, token_loss
from nv_esm.alphabet import CLS, EOS
from nv_esm.data import IGNORE_INDEX, Batches, ClassificationStream, Holdout, MLMStream, PackedBatch, pack_batch
from nv_esm.rank_statistics import auroc, spearman
from nv_esm.train.checkpoint import fp8_scaling_state, set_fp8_scaling_state
from nv_esm.train.config import TrainConfig
from nv_esm.train.feed import warn_if_skipped
from nv_esm.train.parallel import Dist, forward_context

VALIDATION_SEED = 0  # masks and crops of the validation proteins, whatever --seed says


def validation_stream(config: TrainConfig, world: Dist, training: Batches) -> MLMStream | ClassificationStream | None:
    """This rank's part of the validation set (records `i`, `i + n`, ... of `--val-data` or of the records
    `--val-fraction` set aside, for data-parallel index i of n: the ranks of a `--tp`/`--cp` group share it; possibly
    none when there are more ranks than records), or None without
    validation. A classification set uses the training set's label names. Raises ValueError (on every rank) for
    an empty set."""
    settings, data, task = config.validation, config.data, config.model.task
    if not settings.enabled:
        return None
    files = settings.files or data.files
    common = dict(
        stream_index=world.dp_rank,
        num_streams=world.dp_size,
        token_budget=data.token_budget,
        max_length=data.max_length,
        seed=VALIDATION_SEED,
        shuffle=False,
        holdout=Holdout(settings.fraction, "validation") if settings.fraction else None,
        allow_empty=True,
        rules=data.rules,
    )
    source = "the --val-fraction records" if settings.fraction else "--val-data"
    try:
        if task == "mlm":
            stream = MLMStream(files, mask_prob=data.mask_prob, **common)
        else:
            reference = training.streams[0]
            stream = ClassificationStream(files[0], task, label_names=reference.label_names, **common)
    except ValueError as error:
        raise ValueError(f"validation set ({source}): {error}") from None
    if settings.files:  # --val-fraction records were counted with --data's
        warn_if_skipped(stream, world, "--val-data")
    total = torch.tensor([len(stream)], device=world.device)
    dist.all_reduce(total)
    if not total.item():
        raise ValueError(f"validation set ({source}) is empty: raise --val-fraction, or give --val-data.")
    if task != "mlm" and stream.regression != reference.regression:
        kinds = {True: "regression targets", False: "class ids"}
        raise ValueError(
            f"validation set ({source}): its labels read as {kinds[stream.regression]}, the training labels as "
            f"{kinds[reference.regression]} (write regression targets with a decimal point, e.g. 3.0)."
        )
    return stream


def filler_batch() -> PackedBatch:
    """An unscored batch (`evaluate`): one protein of <cls> and <eos>, both labels ignored."""
    return pack_batch([[CLS, EOS]], [[IGNORE_INDEX, IGNORE_INDEX]])


@torch.no_grad()
def evaluate(
    model: nn.Module, stream: MLMStream | ClassificationStream, config: TrainConfig, world: Dist
) -> dict[str, float | None]:
    """One pass over every rank's validation proteins in eval mode, eagerly (no CUDA graphs: their captures would
    share the training graphs' memory pool), leaving FP8 scaling state as training left it; the metrics of the
    whole set (same on every rank). Ranks with fewer batches run unscored filler forwards, so that every rank runs
    as many (FSDP2 gathers each layer's weights from all ranks)."""
    task = config.model.task
    regression = isinstance(stream, ClassificationStream) and stream.regression
    own = stream.one_pass_length()
    count = torch.tensor([own], device=world.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    filler = filler_batch()
    batches = itertools.chain(zip(stream.one_pass(), itertools.repeat(False)), [(filler, True)] * (count.item() - own))
    scored = []
    with _validation_mode(model, fp8=config.model.fp8 != "off"):
        for batch, is_filler in batches:
            batch = batch.to(world.device)
            with forward_context(config.parallel, world):
                logits = model(**batch.model_inputs()).logits.float()
            if not is_filler:
                scored.append(_scored(logits, batch.labels, task, regression))
    if task == "mlm":
        sums = torch.stack(scored).sum(0) if scored else torch.zeros(3, device=world.device, dtype=torch.float64)
        dist.all_reduce(sums)
        return mlm_metrics(*(sums / world.ranks_per_batch).tolist())  # a --tp/--cp group scored the same tokens
    own_part = scored and world.rank % world.ranks_per_batch == 0  # a --tp/--cp group scored the same proteins
    local = [torch.cat(parts).cpu() for parts in zip(*scored)] if own_part else None
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, local)
    outputs, labels = (torch.cat(parts) for parts in zip(*(part for part in gathered if part is not None)))
    # the head's own loss (as training computes it, in fp32), averaged over the scored residues or proteins
    head_loss = token_loss(outputs, labels) if task == "token" else sequence_loss(outputs, labels, model.config)
    if regression:
        return regression_metrics(outputs, labels, head_loss.item())
    return classification_metrics(outputs, labels, head_loss.item())


@contextlib.contextmanager
def _validation_mode(model: nn.Module, fp8: bool) -> Iterator[None]:
    """Within: eval mode, CUDA graphs off; after: the previous mode and graphs, and (`fp8`) the FP8 scaling state
    from before (delayed scaling updates it at every FP8 forward, eval ones included)."""
    was_training = model.training
    scaling = fp8_scaling_state(model) if fp8 else {}
    model.eval()
    try:
        with model.runs_eagerly():
            yield
    finally:
        model.train(was_training)
        if scaling:
            set_fp8_scaling_state(model, scaling)


def _scored(
    logits: torch.Tensor, labels: torch.Tensor, task: str, regression: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What one batch contributes: MLM `[3]` float64 (summed loss, correct predictions, masked tokens); else the
    scored logits `[n, C]` (predictions `[n]` for regression) and their labels `[n]`."""
    if task == "mlm":
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        masked = labels != IGNORE_INDEX
        logits, labels = logits[masked], labels[masked]
        loss = token_loss(logits, labels, reduction="sum")  # the head's loss, as training sums it
        correct = (logits.argmax(-1) == labels).sum()
        return torch.stack([loss.double(), correct.double(), masked.sum().double()])
    if task == "token":
        logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        labelled = labels != IGNORE_INDEX
        return logits[labelled], labels[labelled]
    return (logits.squeeze(-1), labels) if regression else (logits, labels)


# --------------------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------------------


def mlm_metrics(loss_sum: float, correct: float, count: float) -> dict[str, float | None]:
    """Mean cross-entropy per masked token, its exponential and the fraction of masked tokens predicted."""
    if not count:
        return {"val_loss": None, "val_perplexity": None, "val_masked_accuracy": None, "val_count": 0}
    loss = loss_sum / count
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(loss) if loss < 700 else math.inf,
        "val_masked_accuracy": correct / count,
        "val_count": int(count),
    }


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, loss: float) -> dict[str, float | None]:
    """The head's `loss` (cross-entropy), and accuracy, macro F1 and AUROC of `logits [n, C]` against class ids
    `labels [n]`; for two classes also `val_f1`, the F1 of class 1 (the positive class).

    F1 of a class: 2 TP / (2 TP + FP + FN), None for the binary `val_f1` where class 1 is neither labelled nor
    predicted. Macro F1 averages the F1 of every class that occurs in the labels or the predictions. AUROC: of class
    1's probability for two classes, else the mean one-vs-rest AUROC over the classes with positives and negatives
    among the labels; None where no class has both."""
    logits, labels = logits.double(), labels.long()
    predictions = logits.argmax(-1)
    f1 = {}
    for label in torch.unique(torch.cat([labels, predictions])).tolist():
        true_positives = ((predictions == label) & (labels == label)).sum().item()
        predicted, actual = (predictions == label).sum().item(), (labels == label).sum().item()
        f1[label] = 2 * true_positives / (predicted + actual)
    probabilities = logits.softmax(-1)
    classes = [1] if logits.shape[-1] == 2 else range(logits.shape[-1])
    areas = [auroc(probabilities[:, label].cpu(), (labels == label).cpu()) for label in classes]
    areas = [area for area in areas if area is not None]
    return {
        "val_loss": loss,
        "val_accuracy": (predictions == labels).double().mean().item(),
        **({"val_f1": f1.get(1)} if logits.shape[-1] == 2 else {}),
        "val_f1_macro": sum(f1.values()) / len(f1),
        "val_auroc": sum(areas) / len(areas) if areas else None,
        "val_count": labels.numel(),
    }


def regression_metrics(predictions: torch.Tensor, targets: torch.Tensor, loss: float) -> dict[str, float | None]:
    """The head's `loss` (mean squared error), its square root and Spearman's rank correlation of `predictions [n]`
    and `targets [n]`."""
    return {
        "val_loss": loss,
        "val_rmse": math.sqrt(loss),
        "val_spearman": spearman(predictions.double().cpu(), targets.double().cpu()),
        "val_count": targets.numel(),
    }
