"""Where the time of `nv-esm embed` goes on a GPU, to see how far the command is from the model alone.

    python bench/embed_profile.py --shape 650M --proteins 10000 --out bench/results/x

For bf16 and FP8 (both with CUDA graphs), on the workload of `embed_benchmark.py`:
  model_only    the model and the mean pooling over length-sorted packed batches already on the GPU (no host work
                but launches): the ceiling of the command, per token budget
  command       `nv_esm.embed.run` (after a warm-up run on 512 proteins), per token budget and shard size
and for the default settings in bf16:
  cprofile      the host functions of one command run by own time (cProfile; it slows Python, not the GPU)
  trace         busy/idle of the GPU over a command run on the first 3,000 proteins (`nv_esm.trace_summary`)
and, with `--experiments captures`, what the CUDA-graph captures of a first run cost: per variant a fresh model, a
warm-up run on 512 proteins, then two runs over all proteins (the first captures the shapes the warm-up did not
meet), each with the number of captures, their seconds, the batches run eagerly before their shape was captured
and those run padded in a larger captured graph; variants `previous` (no batch runs in a larger graph: a shape is
captured at its second batch) and `default` (the model as it is). (Earlier variants: capture at a shape's first
batch in bench/results/embed_profile_h100_2026-11-23_capture_at_first_use/embed_captures.json, capture at its
second batch against capture at its first in
bench/results/embed_profile_h100_2026-11-23_capture_at_second_use/embed_captures.json.)
Writes OUT/embed_profile.json after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import shutil
import tempfile
import time
from pathlib import Path

import torch
from benchmark import SHAPES
from embed_benchmark import make_workload, write_fasta

import modeling_nv_esm
from nv_esm import embed, embed_model, embed_plan, trace_summary


def model_only(model, sequences: list[str], tokens_per_batch: int) -> dict:
    """Seconds of the model + mean pooling over the command's batches, inputs uploaded beforehand."""
    token_lists = [embed_plan.tokenize(sequence) for sequence in sequences]
    batches = []
    for batch in modeling_nv_esm.length_sorted_batches(token_lists, tokens_per_batch):
        packed = modeling_nv_esm.pack_proteins([token_lists[index] for index in batch])
        batches.append((packed["input_ids"].cuda(), packed["cu_seq_lens_q"].cuda(), packed["max_length_q"]))

    def one_pass() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for input_ids, cu_seq_lens, max_length in batches:
                states = model(input_ids, cu_seq_lens_q=cu_seq_lens, max_length_q=max_length).last_hidden_state
                modeling_nv_esm.pool_proteins(states[0].float(), cu_seq_lens, "mean")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    one_pass()  # captures
    seconds = one_pass()
    return {"seconds": seconds, "proteins_per_s": len(sequences) / seconds, "batches": len(batches)}


def timed_run(checkpoint: Path, config, model, source: Path, folder: Path, options: list[str], profiler=None) -> dict:
    """Seconds (and proteins/s) of one `nv_esm.embed.run` of `source` into a fresh `folder`, within `profiler` if
    given (a torch.profiler or cProfile context)."""
    shutil.rmtree(folder, ignore_errors=True)
    args = embed.parse_args([str(checkpoint), str(source), str(folder), "--no-progress", *options], "bench")
    settings, records = embed_plan.plan_run(args, config, torch.device("cuda"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profiler if profiler is not None else contextlib.nullcontext():
        embed.run(args, model, settings, records)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "proteins_per_s": len(records) / seconds}


def command(checkpoint: Path, config, model, fasta: Path, warm: Path, work: Path, options: list[str], profiler=None):
    """Seconds of `nv_esm.embed.run` over `fasta` with `options` (after a warm-up run on `warm`)."""
    timed_run(checkpoint, config, model, warm, work / "warm", options)
    return timed_run(checkpoint, config, model, fasta, work / "timed", options, profiler)


def patch_variant(model, variant: str) -> dict:
    """Apply `variant` to `model`: "default" leaves it as it is; "previous" restores the earlier policy (no
    batch runs in a larger captured graph: a shape runs eagerly until its second batch, which captures it). A dict
    that counts the captures, their seconds, the batches run eagerly before their shape's capture and the batches
    run padded in a larger captured graph."""
    import sys

    module = sys.modules[type(model).__module__]
    module.__dict__.setdefault("_host_shape", module.larger_graph_shape)
    module.larger_graph_shape = (lambda *args: None) if variant == "previous" else module._host_shape
    graphs = model.encoder.graphs
    capture, shape_for = graphs._capture, graphs.shape_for
    counts = {"captures": 0, "capture_seconds": 0.0, "eager_before_capture": 0, "in_larger_graph": 0}

    def timed_capture(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = capture(*args, **kwargs)
        torch.cuda.synchronize()
        counts["captures"] += 1
        counts["capture_seconds"] += time.perf_counter() - start
        return result

    def counted_shape_for(encoder, hidden_states, packed):
        shape = shape_for(encoder, hidden_states, packed)
        own = module.static_shape(packed.num_tokens, packed.cu_seq_lens.numel() - 1, packed.max_length)
        counts["eager_before_capture"] += shape is None
        counts["in_larger_graph"] += shape is not None and shape != own
        return shape

    graphs._capture, graphs.shape_for = timed_capture, counted_shape_for
    return counts


def captures(checkpoint: Path, config, fasta: Path, warm: Path, work: Path, report: dict, save) -> None:
    """First and second run of fresh models per variant, with their captures."""
    for fp8, variant in [("off", "previous"), ("off", "default"), ("all", "previous"), ("all", "default")]:
        model = embed_model.load_model(str(checkpoint), config, "te", fp8, True, torch.device("cuda"))
        counts = patch_variant(model, variant)
        entry = {}
        for run in ("warm", "first", "second"):
            source = warm if run == "warm" else fasta
            before = dict(counts)
            entry[run] = timed_run(checkpoint, config, model, source, work / run, ["--fp8", fp8])
            entry[run].update({name: counts[name] - before[name] for name in counts})
            entry[run]["captured_shapes"] = len(model.encoder.graphs._graphs)
        report[f"captures_fp8_{fp8}_{variant}"] = entry
        print(variant, fp8, entry, flush=True)
        save()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--proteins", type=int, default=10000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--experiments", nargs="+", default=["profile"], choices=["profile", "captures"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nv_esm_embed_profile_"))
    sequences, _, reference, checkpoint = make_workload(args.shape, args.proteins, work)
    del reference
    fasta, warm = write_fasta(work / "all.fasta", sequences), write_fasta(work / "warm.fasta", sequences[:512])
    first = write_fasta(work / "first.fasta", sequences[:3000])
    config = embed_model.load_config(str(checkpoint))
    report: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "proteins": len(sequences)}

    def save() -> None:
        (args.out / "embed_profile.json").write_text(json.dumps(report, indent=1) + "\n")

    if "captures" in args.experiments:
        captures(checkpoint, config, fasta, warm, work, report, save)
    plans = (
        {}
        if "profile" not in args.experiments
        else {  # fp8: (model-only token budgets, command option lists)
            "off": (
                [16384, 32768],
                [[], ["--shard-size", "10000"], ["--tokens-per-batch", "32768", "--shard-size", "10000"]],
            ),
            "all": ([16384, 32768], [[], ["--tokens-per-batch", "32768", "--shard-size", "10000"]]),
        }
    )
    for fp8, (budgets, option_lists) in plans.items():
        model = embed_model.load_model(str(checkpoint), config, "te", fp8, True, torch.device("cuda"))
        for tokens in budgets:
            report[f"model_only_fp8_{fp8}_{tokens}"] = model_only(model, sequences, tokens)
            print(report[f"model_only_fp8_{fp8}_{tokens}"], flush=True)
            save()
        for options in option_lists:
            key = f"command_fp8_{fp8}" + "".join(f"_{o.lstrip('-')}" for o in options)
            report[key] = command(checkpoint, config, model, fasta, warm, work, ["--fp8", fp8, *options])
            report[key]["captured_shapes"] = len(model.encoder.graphs._graphs)
            print(key, report[key], flush=True)
            save()
        if fp8 == "off":
            profile = cProfile.Profile()
            seconds = command(checkpoint, config, model, fasta, warm, work, ["--fp8", fp8], profiler=profile)
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            report["cprofile"] = {**seconds, "top_by_own_time": text.getvalue().splitlines()}
            save()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            profiler = torch.profiler.profile(activities=activities)
            seconds = command(checkpoint, config, model, first, warm, work, ["--fp8", fp8], profiler=profiler)
            path = args.out / "trace_command_3000.json.gz"
            profiler.export_chrome_trace(str(path))
            report["trace"] = {**seconds, **trace_summary.summarise(path, top=15)}
            save()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
