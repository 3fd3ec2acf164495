"""`nv-esm embed`: a FASTA file of any size -> embeddings of an NVEsm checkpoint, in safetensors shards + an index.

    nv-esm embed ./esm2_650M_te proteins.fasta ./embeddings                       # mean over residues, last layer
    nv-esm embed ./esm2_650M_te proteins.fasta ./out --layers -1 -5 --include mean per_residue contacts
    torchrun --nproc-per-node 8 -m nv_esm embed ./esm2_650M_te proteins.fasta ./out   # a slice of shards per rank

The FASTA file is read twice and never held: a first pass checks every record (ids unique, letters of ESM-2's
alphabet, lengths against `--max-length`) and fixes the plan, so a bad record stops the run before any work, with
its id; the second pass embeds shard after shard. OUT is never the checkpoint or the FASTA file, nor inside or
around them. Record k (0-based, in file order) belongs to shard
`k // --shard-size`; a shard is computed by rank `shard % world_size`, written to a temporary name and renamed, so
a rerun with the same settings skips finished shards. `index.tsv` (written last, by rank 0) has one row per record:
id, record number, residues, status, shard file, row, residues embedded and whether a stop mark was removed.

Shard `embeddings-00000.safetensors` holds, for the proteins it embedded (in file order; ids in its metadata):
`mean.layer_{L}` / `cls.layer_{L}` `[n, hidden]`; `per_residue.layer_{L}` `[R, hidden]` with `residue_offsets`
`[n + 1]` (protein i's residues are rows `residue_offsets[i]:residue_offsets[i + 1]`); `contacts` `[C]` with
`contact_offsets [n + 1]` (protein i's `[r, r]` contact probabilities flattened). L counts layers as
`hidden_states` does: 0 the embedding output, `num_hidden_layers` the last (final LayerNorm applied).
`iter_embeddings(folder)` reads them back.

Precision: bf16 weights and autocast on CUDA, fp32 on the CPU; `--fp8` runs Transformer Engine FP8 layers (block
scaling unless `--fp8-scaling current`), and the layers replay as CUDA graphs on Transformer Engine (the model's
`cuda_graphs` default; other layers than the last, and contacts, run eagerly; `--no-cuda-graphs` runs all eagerly).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from nv_esm.alphabet import iter_fasta
from nv_esm.cli import add_run_arguments as add_run_arguments  # score's and proteingym's shared options
from nv_esm.cli import parse_embed_args, print_error
from nv_esm.embed_model import ShardEmbedder, load_config, load_model
from nv_esm.embed_output import (
    CONTACTS_PICTURE,
    INDEX_NAME,
    check_output_folder,
    checksum_path,
    output_lock,
    prepare_output,
    shard_damage,
    shard_ids,
    shard_name,
    write_checked_shard,
    write_index,
)
from nv_esm.embed_output import iter_embeddings as iter_embeddings  # the reader of the command's folders (README)
from nv_esm.embed_plan import (
    EmbedSettings,
    Record,
    plan_run,
    records_by_shard,
    text_lines,
    token_budget_warning,
)
from nv_esm.job_clock import JobClock, ReportingProgress, progress_bar
from nv_esm.path_guard import refuse_overlap
from nv_esm.plots import PLOTS_HINT, plot_contact_maps, pyplot
from nv_esm.records import plural


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    """The command line (`nv_esm.cli.parse_embed_args`: declared there, without torch, so `--help` is quick)."""
    return parse_embed_args(argv, prog)


def command_device(name: str | None) -> torch.device:
    """The device of `--device` (default: cuda:LOCAL_RANK when CUDA is available, else cpu); ValueError for a name
    that is not a device, or a CUDA device where PyTorch sees none."""
    if name is None:
        return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device (cpu, cuda or cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is visible to PyTorch.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s).")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: nv-esm runs on cpu or cuda.")
    return device


def main(argv: list[str] | None = None, prog: str = "nv-esm embed") -> int:
    clock = JobClock()
    args = parse_args(sys.argv[1:] if argv is None else argv, prog)

    def embed_on(device: torch.device, rank: int, world_size: int) -> None:
        inputs = {"the checkpoint": args.checkpoint, "the FASTA file": args.fasta}
        refuse_overlap({"OUT": args.output}, inputs)  # before anything is read or written
        with clock.phase("input"):
            config = load_config(args.checkpoint)
            settings, records = plan_run(args, config, device)  # before loading: a bad record stops the run at once
        check_output_folder(args.output, settings, args.overwrite)  # and an OUT `prepare_output` would refuse
        warning = token_budget_warning(args.tokens_per_batch, records, settings.max_length, args.fasta)
        if warning is not None and rank == 0:
            print(f"warning: {warning}", file=sys.stderr)
        graphs = args.cuda_graphs is not False  # the model uses them on Transformer Engine only
        with clock.phase("load"):
            model = load_model(
                args.checkpoint,
                config,
                settings.backend,
                args.fp8,
                graphs,
                device,
                args.trust_remote_code,
                fp8_scaling=args.fp8_scaling,
                contacts="contacts" in settings.include,
                progress=not args.no_progress,
            )
        run(args, model, settings, records, rank, world_size, clock)

    return run_on_ranks(args.device, embed_on, f"finished shards in {args.output} are kept, a rerun resumes", prog)


def run_on_ranks(
    device_name: str | None, work: Callable[[torch.device, int, int], object], kept: str, prog: str
) -> int:
    """Run a command's `work(device, rank, world_size)` on this process's device (`command_device`), in a process
    group when torchrun started several ranks (NCCL on CUDA, else gloo). Returns the exit status: 0; 1 after a
    one-line `PROG: error:` (`prog`: the command) for ValueError, OSError and RuntimeError; 130 after Ctrl-C,
    saying what is `kept`."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        device = command_device(device_name)
    except ValueError as error:
        print_error(prog, error)
        return 1
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:  # ranks wait for each other only at the start and the end: a long timeout
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(hours=24))
    try:
        work(device, rank, world_size)
        return 0
    except (ValueError, OSError, RuntimeError) as error:
        print_error(prog, error)
        return 1
    except KeyboardInterrupt:
        print_error(prog, f"interrupted; {kept}.")
        return 130
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()


def remove_damaged_shards(folder: Path, num_shards: int) -> None:
    """Delete the finished shards of an earlier run that `shard_damage` finds wrong (a changed byte, no checksum),
    saying so on stderr: this run embeds them again."""
    for shard in range(num_shards):
        path = folder / shard_name(shard)
        problem = shard_damage(path) if path.exists() else None
        if problem is not None:
            print(f"note: {path} is damaged ({problem}); embedding its proteins again", file=sys.stderr)
            path.unlink()
            checksum_path(path).unlink(missing_ok=True)


def finish_write(writing: Future, path: Path) -> None:
    """Wait for the write of the shard at `path`; a failure (a full disk: safetensors' SafetensorError or an
    OSError) raises a one-line OSError naming the shard."""
    from safetensors import SafetensorError

    try:
        writing.result()
    except (SafetensorError, OSError) as error:
        text = str(error) if isinstance(error, SafetensorError) else error.strerror or str(error)
        reason = re.search(r'message: "([^"]+)"', text)  # safetensors' wrapping of the system's error
        raise OSError(
            f"{path}: writing the shard failed ({reason[1] if reason else text}); the finished shards are kept, a "
            "rerun resumes."
        ) from None


def barrier(world_size: int) -> None:
    """Wait for every rank (nothing to wait for on one)."""
    if world_size > 1:
        torch.distributed.barrier()


@dataclass
class RunStats:
    """What one rank did: proteins it embedded in how many seconds (model loading and the first pass excluded)."""

    proteins: int
    seconds: float


def run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    settings: EmbedSettings,
    records: list[Record],
    rank: int = 0,
    world_size: int = 1,
    clock: JobClock | None = None,
) -> RunStats:
    """Embed the unfinished shards (this rank's share of them) and, rank 0 after every rank, write the index.
    `args` as `parse_args` returns them; `settings` and `records` from `plan_run`. Rank 0 holds the output folder
    for the run (`output_lock`) and, at the end, says where the time went (`clock`'s line; a clock from here on
    without one)."""
    clock = JobClock(time.time()) if clock is None else clock
    with output_lock(args.output) if rank == 0 else contextlib.nullcontext():
        stats = _run(args, model, settings, records, rank, world_size, clock)
    if rank == 0:
        print(clock.line())
    return stats


def _run(
    args: argparse.Namespace,
    model: torch.nn.Module,
    settings: EmbedSettings,
    records: list[Record],
    rank: int,
    world_size: int,
    clock: JobClock,
) -> RunStats:
    num_shards = -(-len(records) // args.shard_size)
    if rank == 0:
        prepare_output(args.output, settings, args.overwrite)
        remove_damaged_shards(args.output, num_shards)
    barrier(world_size)
    missing = [shard for shard in range(num_shards) if shard_ids(args.output / shard_name(shard)) is None]
    barrier(world_size)  # every rank has its list before any writes a shard: all share one list
    mine = set(missing[rank::world_size])
    todo = sum(
        not record.status.startswith("skipped")
        for shard in mine
        for record in records[shard * args.shard_size : (shard + 1) * args.shard_size]
    )
    embedder = ShardEmbedder(model, settings, args.tokens_per_batch)
    bar = progress_bar(todo, "embedding", "protein", args.no_progress or rank != 0)
    progress = ReportingProgress(bar, clock)
    started = time.perf_counter()
    # A shard is written on a thread while the next one is embedded; at most one write is under way.
    with clock.phase("batches"), open(args.fasta, "rb") as raw, ThreadPoolExecutor(max_workers=1) as writer:
        writing: tuple[Future, Path] | None = None
        for shard, shard_records in records_by_shard(
            iter_fasta(text_lines(raw, args.fasta), args.fasta, empty_ok=True), records, args.shard_size
        ):
            if shard not in mine:
                continue
            kept = [
                (record, sequence[: record.residues])  # without a removed stop mark
                for record, sequence in shard_records
                if not record.status.startswith("skipped")
            ]
            tensors = embedder([sequence for _, sequence in kept], [record.status for record, _ in kept], progress)
            if writing is not None:
                with clock.phase("writing"):
                    finish_write(*writing)
            ids = [record.id for record, _ in kept]
            path = args.output / shard_name(shard)
            writing = writer.submit(write_checked_shard, path, tensors, ids), path
        if writing is not None:
            with clock.phase("writing"):
                finish_write(*writing)
    progress.close()
    seconds = time.perf_counter() - started
    clock.batches_done(embedder.tokens, model)
    barrier(world_size)
    if rank == 0:
        with clock.phase("writing"):
            write_index(args.output, records, args.shard_size, settings.max_length)
            counts: dict[str, int] = {}
            for record in records:
                counts[record.status] = counts.get(record.status, 0) + 1
            summary = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
            were = "was" if num_shards == 1 else "were"
            reused = f"{num_shards - len(missing)} of {plural(num_shards, 'shard')} {were} already done"
            where = " on rank 0" if world_size > 1 else ""
            rate = f"{todo / max(seconds, 1e-9):.1f} proteins/s{where}"
            rate = f"this run: {plural(todo, 'protein')} in {seconds:.1f} s ({rate})"
            print(f"{plural(len(records), 'record')} ({summary}); {reused}; {rate}; wrote {args.output / INDEX_NAME}")
            if "contacts" in settings.include:
                draw_contacts(args.output)
    return RunStats(todo, seconds)


CONTACT_MAP_PROTEINS = 4


def draw_contacts(folder: Path) -> None:
    """FOLDER/contacts.png: the contact maps of the finished run's first `CONTACT_MAP_PROTEINS` proteins (FASTA
    order), or a one-line hint without matplotlib."""
    first = islice(iter_embeddings(folder), CONTACT_MAP_PROTEINS)
    maps = [(name, outputs["contacts"].float().numpy()) for name, outputs in first]
    png = plot_contact_maps(maps, folder / CONTACTS_PICTURE)
    if png is None and pyplot() is None:
        print(PLOTS_HINT.format(what=f"the first {CONTACT_MAP_PROTEINS} contact maps"), file=sys.stderr)
    elif png is not None:
        which = (
            "the contact map of the first protein"
            if len(maps) == 1
            else f"the contact maps of the first {len(maps)} proteins"
        )
        print(f"wrote {png} ({which})")


if __name__ == "__main__":
    sys.exit(main())
