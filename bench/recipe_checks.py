"""Checks of the training recipe, `recipes/train.py` (`nv_esm.train`), on a host with TE and 2+ GPUs (graphs: 1).

    python bench/recipe_checks.py scaling --out $OUT/recipe   # 1 vs 2 GPUs, same global batch: losses, tokens/s
    python bench/recipe_checks.py resume --out $OUT/recipe    # kill -9 mid-run, resume, compare with an unbroken run
    python bench/recipe_checks.py fp8 --out $OUT/recipe       # FP8 vs bf16 over 200 steps from the same init
    python bench/recipe_checks.py profile --out $OUT/recipe   # where a step's time goes, 1 vs 2 (--gpus) GPUs
    python bench/recipe_checks.py fit --shape 15B --gpus 4 --activation-checkpointing --out $OUT/r --extra --fp8 all
    python bench/recipe_checks.py graphs --out $OUT/recipe    # 1 GPU: eager vs CUDA graphs vs graphs + FP8
    python bench/recipe_checks.py offload --shape 3B --gpus 1 --out $OUT/recipe   # activation offloading vs not
    python bench/recipe_checks.py layouts --shape 650M --out $OUT/recipe   # 2 GPUs: HSDP, TP, CP, offloading
    python bench/recipe_checks.py long --shape 650M --out $OUT/recipe      # 2 GPUs: CP on 8k- and 32k-token proteins
    python bench/recipe_checks.py scale --shape 650M --out $OUT/recipe     # weak scaling: replicate and shard vs 1 GPU

Each check launches `torchrun` runs of the recipe from scratch (random init, identical for any world size), reads
their metrics.jsonl and writes CHECK.json next to the runs. Timing skips the first `WARMUP_STEPS` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nv_esm import trace_summary
from nv_esm.shapes import ESM2_SHAPES

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "demo_data" / "demo.fasta"
WARMUP_STEPS = 10


def write_config(out: Path, shape: str) -> Path:
    """config.json of an ESM-2 shape."""
    fields = json.loads((ROOT / "config.json").read_text())
    fields.update(ESM2_SHAPES[shape])
    path = out / f"config_{shape}.json"
    path.write_text(json.dumps(fields))
    return path


def write_long_proteins(out: Path, tokens: int, count: int) -> Path:
    """A FASTA of `count` random proteins of `tokens` tokens each (with <cls> and <eos>), seeded."""
    import random

    rng = random.Random(tokens)
    residues = "ACDEFGHIKLMNPQRSTVWY"
    path = out / f"long_{tokens}.fasta"
    path.write_text("".join(f">p{i}\n{''.join(rng.choices(residues, k=tokens - 2))}\n" for i in range(count)))
    return path


def launch(
    run: Path,
    gpus: int,
    config: Path,
    *extra: str,
    wait: bool = True,
    env: dict | None = None,
    data: Path = DATA,
):
    """torchrun the recipe into `run` (its log in run.log); returns the process, finished when `wait`."""
    run.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", "--master-port", str(29500 + gpus),
        str(ROOT / "recipes" / "train.py"), "--config", str(config), "--data", str(data), "--out", str(run),
        "--no-export", *extra,
    ]  # fmt: skip
    log = open(run.with_suffix(".log"), "w")  # noqa: SIM115
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )
    if wait and process.wait() != 0:
        raise RuntimeError(f"{run.name} failed; see {run.with_suffix('.log')}")
    return process


def option_tag(extra: tuple[str, ...]) -> str:
    """A file-name suffix for recipe options: ("--fp8", "all") -> "_fp8all"."""
    return "".join(extra).replace("--", "_")


def metrics(run: Path) -> list[dict]:
    """The training records of a run's metrics.jsonl (validation records, `val_*` keys, left out)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "loss" in record]


def throughput(records: list[dict]) -> dict:
    timed = [r for r in records if r["step"] > WARMUP_STEPS]
    return dict(
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_gpu"] for r in timed),
        mfu=statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,  # None on CPU
        max_memory_gb=max(r.get("max_memory_gb", 0.0) for r in timed),  # absent on the CPU
    )


def check_weak_scaling(out: Path, shape: str, steps: int, budget: int, *extra: str) -> dict:
    """Tokens/s per GPU with one micro-batch of `budget` tokens per GPU and step, on 2 GPUs vs 1."""
    config = write_config(out, shape)
    common = ["--steps", str(steps), "--token-budget", str(budget), "--log-every", "5", "--no-checkpoint", *extra]
    tag = f"weak_{shape}_{budget}{option_tag(extra)}"
    launch(out / f"{tag}_1gpu", 1, config, *common)
    launch(out / f"{tag}_2gpu", 2, config, *common)
    one, two = throughput(metrics(out / f"{tag}_1gpu")), throughput(metrics(out / f"{tag}_2gpu"))
    efficiency = two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    return dict(shape=shape, token_budget=budget, options=extra, one_gpu=one, two_gpus=two, efficiency=efficiency)


def check_profile(out: Path, shape: str, budget: int, several: list[int], *extra: str) -> dict:
    """Traces of 3 steps (after 10) on 1 GPU and on each of `several` GPUs with `budget` tokens per GPU, summarised
    per rank; the runs on several GPUs with the recipe options `extra` too (e.g. `--data-parallel shard`)."""
    config = write_config(out, shape)
    summaries = {}
    for gpus in sorted({1, *several}):
        run = out / f"profile_{shape}_{budget}_{gpus}gpu{option_tag(extra) if gpus > 1 else ''}"
        common = ["--steps", "13", "--token-budget", str(budget), "--profile-steps", "3", "--no-checkpoint"]
        launch(run, gpus, config, *common, *(extra if gpus > 1 else ()))
        traces = sorted((run / "profile").glob("rank*.json.gz"))
        summaries[f"{gpus}gpu"] = [trace_summary.summarise(trace, top=12) for trace in traces]
    return dict(shape=shape, token_budget=budget, **summaries)


def check_fit(out: Path, shape: str, steps: int, budget: int, gpus: int, *extra: str) -> dict:
    """`shape` trained from scratch on `gpus` GPUs with the recipe options `extra`: losses, tokens/s (after
    `WARMUP_STEPS`), MFU and peak memory of every rank."""
    config = write_config(out, shape)
    run = out / f"fit_{shape}_{budget}_{gpus}gpu{option_tag(extra)}"
    allocator = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    common = ["--steps", str(steps), "--token-budget", str(budget), "--log-every", "2", "--no-checkpoint", *extra]
    launch(run, gpus, config, *common, env=allocator)
    records = metrics(run)
    return dict(
        shape=shape,
        token_budget=budget,
        gpus=gpus,
        options=extra,
        losses=[r["loss"] for r in records],
        memory_gb_per_rank=max((r.get("memory_gb_per_rank", [0.0]) for r in records), key=max),
        **throughput(records),
    )


def check_scaling(out: Path, shape: str, steps: int, budget: int) -> dict:
    """Losses: 1 GPU with 2 micro-batches per step vs 2 GPUs with 1 each (same proteins per step, same init).
    Weak scaling: tokens/s per GPU with one micro-batch per GPU and step, on 2 GPUs vs 1."""
    config = write_config(out, shape)
    common = ["--steps", str(steps), "--token-budget", str(budget), "--warmup-steps", "5", "--lr", "2e-4"]
    common += ["--log-every", "5"]
    launch(out / f"scaling_{shape}_1gpu", 1, config, *common, "--grad-accum", "2")
    launch(out / f"scaling_{shape}_2gpu", 2, config, *common, "--grad-accum", "1")
    launch(out / f"scaling_{shape}_1gpu_accum1", 1, config, *common, "--grad-accum", "1")
    one, two = metrics(out / f"scaling_{shape}_1gpu"), metrics(out / f"scaling_{shape}_2gpu")
    single = metrics(out / f"scaling_{shape}_1gpu_accum1")
    relative = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(one, two)]
    result = dict(
        shape=shape,
        steps=steps,
        token_budget_per_micro_batch=budget,
        losses_1gpu=[r["loss"] for r in one],
        losses_2gpu=[r["loss"] for r in two],
        max_relative_loss_difference=max(relative),
        same_tokens_per_step=all(a["tokens"] == b["tokens"] for a, b in zip(one, two)),
        one_gpu_two_micro_batches=throughput(one),
        one_gpu=throughput(single),
        two_gpus=throughput(two),
    )
    result["weak_scaling_efficiency"] = (
        result["two_gpus"]["tokens_per_s_per_gpu"] / result["one_gpu"]["tokens_per_s_per_gpu"]
    )
    return result


def check_resume(out: Path, shape: str, steps: int, kill_after: int, *extra: str) -> dict:
    """An unbroken run vs one killed (SIGKILL) once checkpoint `kill_after` exists and resumed with --resume."""
    config = write_config(out, shape)
    common = ["--steps", str(steps), "--save-every", str(kill_after), "--token-budget", "8192", "--log-every", "1"]
    common += extra
    tag = option_tag(extra)
    launch(out / f"resume{tag}_unbroken", 2, config, *common)
    broken = out / f"resume{tag}_killed"
    process = launch(broken, 2, config, *common, wait=False)
    marker = broken / "checkpoints" / f"step_{kill_after:07d}"
    while not marker.exists() and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = len(metrics(broken))
    launch(broken, 2, config, *common, "--resume")
    unbroken, resumed = metrics(out / f"resume{tag}_unbroken"), metrics(broken)
    after = {r["step"]: r["loss"] for r in resumed if r["step"] > kill_after}
    differences = [abs(after[r["step"]] - r["loss"]) for r in unbroken if r["step"] in after]
    return dict(
        shape=shape,
        options=extra,
        steps=steps,
        checkpoint_step=kill_after,
        steps_logged_before_kill=killed_at,
        resumed_steps=sorted(after),
        max_abs_loss_difference_after_resume=max(differences),
        losses_unbroken=[r["loss"] for r in unbroken],
        losses_resumed=[after.get(r["step"]) for r in unbroken],
    )


def check_fp8(out: Path, shape: str, steps: int, gpus: int) -> dict:
    """bf16 vs FP8 (delayed scaling, all layers) from the same init on the same data, on `gpus` GPUs (one: CUDA
    graphs, the recipe's default there)."""
    config = write_config(out, shape)
    common = ["--steps", str(steps), "--token-budget", "16384", "--warmup-steps", "20", "--lr", "4e-4"]
    common += ["--log-every", "5"]
    launch(out / f"fp8_off_{gpus}gpu", gpus, config, *common)
    launch(out / f"fp8_on_{gpus}gpu", gpus, config, *common, "--fp8", "all")
    bf16, fp8 = metrics(out / f"fp8_off_{gpus}gpu"), metrics(out / f"fp8_on_{gpus}gpu")
    tail = 20
    mean = lambda records: statistics.fmean(r["loss"] for r in records[-tail:])  # noqa: E731
    return dict(
        shape=shape,
        steps=steps,
        gpus=gpus,
        losses_bf16=[r["loss"] for r in bf16],
        losses_fp8=[r["loss"] for r in fp8],
        final_loss_bf16=mean(bf16),
        final_loss_fp8=mean(fp8),
        relative_difference=abs(mean(fp8) - mean(bf16)) / mean(bf16),
        bf16=throughput(bf16),
        fp8=throughput(fp8),
    )


def check_graphs(out: Path, shape: str, steps: int, budget: int) -> dict:
    """One GPU (unsharded), same init and data: eager (`--no-cuda-graphs`), CUDA graphs, CUDA graphs with FP8 (all
    layers, delayed scaling): losses and tokens/s."""
    config = write_config(out, shape)
    common = ["--steps", str(steps), "--token-budget", str(budget), "--warmup-steps", "5", "--lr", "2e-4"]
    common += ["--log-every", "1", "--no-checkpoint"]
    variants = {"eager": ["--no-cuda-graphs"], "graphs": [], "graphs_fp8": ["--fp8", "all"]}
    records = {}
    for name, extra in variants.items():
        launch(out / f"graphs_{shape}_{name}", 1, config, *common, *extra)
        records[name] = metrics(out / f"graphs_{shape}_{name}")
    eager, graphs = records["eager"], records["graphs"]
    relative = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(eager, graphs)]
    return dict(
        shape=shape,
        steps=steps,
        token_budget=budget,
        max_relative_loss_difference_graphs_vs_eager=max(relative),
        **{f"losses_{name}": [r["loss"] for r in rows] for name, rows in records.items()},
        **{name: throughput(rows) for name, rows in records.items()},
    )


def check_offload(out: Path, shape: str, steps: int, budget: int, gpus: int) -> dict:
    """Activation offloading (`--offload-activations`, all layers but the last, and the first quarter and half of
    them: `--offloaded-layers`) against the default (CUDA graphs on one GPU), eager, activation checkpointing and
    `--recompute-mlp`,
    same init and data on `gpus` GPUs: losses, tokens/s and peak memory per rank (expandable segments, as `fit`).
    A variant that failed (e.g. out of memory) is listed under "failed". (The
    first H100 run, bench/results/offload_h100_2026-11-23/, also ran offloading with checkpointing: it offloaded
    nothing, and the recipe now refuses it.)"""
    config = write_config(out, shape)
    layers = ESM2_SHAPES[shape]["num_hidden_layers"]
    allocator = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    common = ["--steps", str(steps), "--token-budget", str(budget), "--warmup-steps", "2", "--lr", "1e-4"]
    common += ["--log-every", "1", "--no-checkpoint"]
    variants = {
        "default": [],
        "eager": ["--no-cuda-graphs"],
        "offload": ["--offload-activations"],
        **{
            f"offload_{part}": ["--offload-activations", "--offloaded-layers", str(layers * fraction // 4)]
            for part, fraction in (("quarter", 1), ("half", 2))
        },
        "checkpointing": ["--activation-checkpointing"],
        "recompute_mlp": ["--recompute-mlp"],
    }
    records, failed = {}, []
    for name, extra in variants.items():
        run = out / f"offload_{shape}_{budget}_{name}"
        try:
            launch(run, gpus, config, *common, *extra, env=allocator)
        except RuntimeError:  # e.g. out of memory: recorded, the other variants still run
            failed.append(name)
            continue
        records[name] = metrics(run)
    eager = records.get("eager", [])
    return dict(
        shape=shape,
        gpus=gpus,
        steps=steps,
        token_budget=budget,
        failed=failed,
        max_relative_loss_difference_vs_eager={
            name: max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(eager, rows))
            for name, rows in records.items()
            if eager
        },
        **{f"losses_{name}": [r["loss"] for r in rows] for name, rows in records.items()},
        **{name: throughput(rows) for name, rows in records.items()},
    )


def compare_runs(out: Path, tag: str, config: Path, runs: dict, common: list[str], data: Path = DATA) -> dict:
    """Launch `runs` (name -> (GPUs, options, name of the run whose losses it must equal, or None)); a failed run
    (e.g. out of memory) is listed under "failed". Per run: tokens/s (per GPU), MFU, peak memory per rank, and the
    largest relative loss difference to its reference run."""
    allocator = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    records, failed, seconds = {}, [], {}
    for name, (gpus, extra, _) in runs.items():
        run = out / f"{tag}_{name}"
        started = time.perf_counter()
        try:
            launch(run, gpus, config, *common, *extra, env=allocator, data=data)
        except RuntimeError:
            failed.append(name)
            continue
        finally:
            seconds[name] = round(time.perf_counter() - started, 1)
        records[name] = metrics(run)
    result: dict = {"failed": failed, "wall_seconds": seconds}
    for name, (gpus, extra, reference) in runs.items():
        if name not in records:
            continue
        rows = records[name]
        entry = dict(gpus=gpus, options=list(extra), **throughput(rows))
        entry["memory_gb_per_rank"] = max((r.get("memory_gb_per_rank", [0.0]) for r in rows), key=max)
        if reference in records:
            pairs = zip(records[reference], rows)
            entry["reference"] = reference
            entry["max_relative_loss_difference"] = max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in pairs)
        result[name] = entry
        result[f"losses_{name}"] = [r["loss"] for r in rows]
    return result


def add_ratio_to_one_gpu(compared: dict, key: str, metric: str) -> None:
    """Give each run of `compared` (`compare_runs`' result) but "one_gpu" its `metric` over the "one_gpu" run's, as
    `key`; nothing when the one-GPU run failed."""
    one = compared.get("one_gpu")
    for name, entry in compared.items():
        if one and name != "one_gpu" and isinstance(entry, dict) and metric in entry:
            entry[key] = entry[metric] / one[metric]


def check_layouts(out: Path, shape: str, steps: int, budget: int) -> dict:
    """Each scale-out option at 2-way on 2 GPUs against the run it must equal (same init and data): hybrid sharding
    and activation offloading against the flat 2-GPU run; tensor and context parallelism (the two ranks share
    micro-batches) against the 1-GPU run, which sees the same data. `budget` tokens per micro-batch."""
    common = ["--steps", str(steps), "--token-budget", str(budget), "--warmup-steps", "5", "--lr", "2e-4"]
    common += ["--log-every", "1", "--no-checkpoint"]
    runs = {
        "one_gpu": (1, ["--no-cuda-graphs"], None),
        "flat": (2, [], None),
        "hsdp": (2, ["--dp-replicate", "2"], "flat"),
        "offload": (2, ["--offload-activations"], "flat"),
        "checkpointing": (2, ["--activation-checkpointing"], "flat"),
        "tp": (2, ["--tp", "2"], "one_gpu"),
        "cp": (2, ["--cp", "2"], "one_gpu"),
    }
    compared = compare_runs(out, f"layouts_{shape}", write_config(out, shape), runs, common)
    return dict(shape=shape, steps=steps, token_budget=budget, **compared)


# The data-parallel layouts `scale` compares: recipe options of each.
LAYOUTS = {
    "replicate": ["--data-parallel", "replicate"],
    "shard": ["--data-parallel", "shard"],
    "hsdp": ["--data-parallel", "shard", "--dp-replicate", "2"],  # 2 replica groups, each sharding over the rest
    "tp2": ["--tp", "2"],  # pairs of ranks split each layer (FSDP2 over the pairs): a pair runs one micro-batch
}


def check_scale(
    out: Path, shape: str, steps: int, budgets: list[int], gpus: list[int], layouts: list[str], *extra: str
) -> dict:
    """Weak scaling of the data-parallel layouts: per budget (tokens per micro-batch and GPU), the 1-GPU default
    (CUDA graphs) and each of `layouts` (`LAYOUTS`) on each number of `gpus`, one micro-batch per GPU and step,
    `steps` steps (the first `WARMUP_STEPS` untimed), all with the recipe options `extra`. Per run: tokens/s per
    GPU, its ratio to the 1-GPU run, MFU, peak memory per rank and, where the data agree (a 2-GPU step sees 2
    micro-batches), losses as they are."""
    results = {}
    for budget in budgets:
        common = ["--steps", str(steps), "--token-budget", str(budget), "--warmup-steps", "5", "--lr", "2e-4"]
        common += ["--log-every", "5", "--no-checkpoint", *extra]
        runs = {"one_gpu": (1, [], None)}
        runs.update({f"{layout}_{n}gpu": (n, LAYOUTS[layout], None) for n in gpus for layout in layouts})
        compared = compare_runs(out, f"scale_{shape}_{budget}", write_config(out, shape), runs, common)
        add_ratio_to_one_gpu(compared, "per_gpu_vs_one_gpu", "tokens_per_s_per_gpu")
        results[str(budget)] = compared
    return dict(shape=shape, steps=steps, gpus=gpus, options=list(extra), budgets=results)


def check_long(out: Path, shape: str, steps: int, lengths: list[int], cps: list[int], *extra: str) -> dict:
    """Context parallelism on long proteins: per length, one protein per step of `length` tokens on 1 GPU (eager,
    as context-parallel ranks run) and with `--cp C` on C GPUs for each C of `cps` (the same protein each step:
    losses must agree), all with the recipe options `extra`. A run that does not fit (one GPU, say) is listed
    under "failed"; each run's ratio of whole-job tokens/s to the 1-GPU run's is `speedup_vs_one_gpu`."""
    results = {}
    for length in lengths:
        data = write_long_proteins(out, length, count=steps + 2)
        common = ["--steps", str(steps), "--token-budget", str(length), "--max-length", str(length - 2)]
        common += ["--warmup-steps", "2", "--lr", "1e-4", "--log-every", "1", "--no-checkpoint", *extra]
        runs = {"one_gpu": (1, ["--no-cuda-graphs"], None)}
        runs.update({f"cp{cp}": (cp, ["--cp", str(cp)], "one_gpu") for cp in cps})
        config = write_config(out, shape)
        compared = compare_runs(out, f"long_{shape}_{length}", config, runs, common, data=data)
        add_ratio_to_one_gpu(compared, "speedup_vs_one_gpu", "tokens_per_s")
        results[str(length)] = compared
    return dict(shape=shape, steps=steps, options=list(extra), lengths=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "check",
        choices=("scaling", "weak", "resume", "fp8", "profile", "fit", "graphs", "offload", "layouts", "long", "scale"),
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768], help="scale: tokens per GPU")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["replicate", "shard"], help="scale")
    parser.add_argument("--cps", type=int, nargs="+", default=[2], help="long: --cp values (GPUs per run)")
    parser.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="scale, long, profile, fit: recipe options"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="long: protein lengths")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch (scaling, weak)")
    parser.add_argument("--keep-gathered", action="store_true", help="weak: pass --keep-gathered to the recipe")
    parser.add_argument("--fp8", action="store_true", help="resume: train with --fp8 all (delayed scaling)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(ESM2_SHAPES), default=None)
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="fit: pass --activation-checkpointing to the recipe"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--gpus", type=int, nargs="+", default=[2], help="fp8, offload, fit: GPUs per run; scale, profile: each"
    )
    args = parser.parse_args()
    gpus = args.gpus[0]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.check == "scaling":
        result = check_scaling(args.out, args.shape or "650M", args.steps or 50, args.budget)
    elif args.check == "weak":
        extra = ("--keep-gathered",) if args.keep_gathered else ()
        result = check_weak_scaling(args.out, args.shape or "650M", args.steps or 30, args.budget, *extra)
    elif args.check == "resume":
        extra = ("--fp8", "all") if args.fp8 else ()
        result = check_resume(args.out, args.shape or "150M", args.steps or 20, 10, *extra)
    elif args.check == "fit":
        extra = (*args.extra, *(("--activation-checkpointing",) if args.activation_checkpointing else ()))
        result = check_fit(args.out, args.shape or "3B", args.steps or 12, args.budget, gpus, *extra)
    elif args.check == "graphs":
        result = check_graphs(args.out, args.shape or "650M", args.steps or 40, args.budget)
    elif args.check == "offload":
        result = check_offload(args.out, args.shape or "3B", args.steps or 16, args.budget, gpus)
    elif args.check == "profile":
        result = check_profile(args.out, args.shape or "650M", args.budget, args.gpus, *args.extra)
    elif args.check == "layouts":
        result = check_layouts(args.out, args.shape or "650M", args.steps or 24, args.budget)
    elif args.check == "scale":
        shape, steps = args.shape or "650M", args.steps or 50
        result = check_scale(args.out, shape, steps, args.budgets, args.gpus, args.layouts, *args.extra)
    elif args.check == "long":
        result = check_long(args.out, args.shape or "650M", args.steps or 20, args.lengths, args.cps, *args.extra)
    else:
        result = check_fp8(args.out, args.shape or "150M", args.steps or 200, gpus)
    name = args.check + ("_fp8" if args.fp8 else "") + (f"_{gpus}gpu" if args.check in ("fp8", "offload") else "")
    if args.check == "weak":
        name = f"weak_{args.budget}{'_keep_gathered' if args.keep_gathered else ''}"
    if args.check == "fit":
        name = f"fit_{result['shape']}_{args.budget}_{gpus}gpu{option_tag(tuple(args.extra))}"
    if args.check == "scale":
        name = f"scale_{result['shape']}_{'_'.join(map(str, args.budgets))}"
    if args.check in ("layouts", "long"):
        name = f"{args.check}_{result['shape']}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("losses")}, indent=1))


if __name__ == "__main__":
    main()
