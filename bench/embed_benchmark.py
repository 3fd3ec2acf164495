"""Proteins/s of `nv-esm embed` (and of `NVEsmModel.embed`) vs the naive transformers loop, in one run.

    python bench/embed_benchmark.py --shape 650M --proteins 10000 --out bench/results

Naive loop: transformers' `EsmModel` in bf16, proteins in input order, padded batches of 32, mean over residues.
`embed()`: `NVEsmModel.embed` of the converted checkpoint (bf16 weights). The command: `nv_esm.embed.run` on a
FASTA file of the same proteins (model loading and the first pass over the file excluded; shard writing and any
CUDA-graph captures included), eager and with `--cuda-graphs`, bf16 and FP8, each after a warm-up run on 512 of
the proteins. All hold the same random weights; the JSON also
has the cosine similarity of each variant's embeddings to the transformers loop's, per protein.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from benchmark import ROOT, SHAPES, draw_batches
from random_checkpoint import random_checkpoint  # bench/random_checkpoint.py, beside this script

from nv_esm import embed, embed_model, embed_plan
from nv_esm.alphabet import STANDARD_AMINO_ACIDS

COMMAND_VARIANTS = {  # name: (--fp8, --cuda-graphs)
    "command": ("off", False),
    "command_graphs": ("off", True),
    "command_fp8": ("all", False),
    "command_fp8_graphs": ("all", True),
}


def naive_transformers(model, tokenizer, sequences: list[str], batch_size: int = 32) -> torch.Tensor:
    embeddings = []
    for start in range(0, len(sequences), batch_size):
        batch = tokenizer(sequences[start : start + batch_size], return_tensors="pt", padding=True).to("cuda")
        with torch.no_grad():
            states = model(**batch).last_hidden_state.float()
        residues = batch["attention_mask"].clone()
        residues[:, 0] = 0
        residues[torch.arange(len(residues)), batch["attention_mask"].sum(1) - 1] = 0  # <eos>
        embeddings.append(((states * residues[..., None]).sum(1) / residues.sum(1, keepdim=True)).cpu())
    return torch.cat(embeddings)


def timed(function, *args, **kwargs) -> tuple[object, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def write_fasta(path: Path, sequences: list[str]) -> Path:
    path.write_text("".join(f">p{i}\n{sequence}\n" for i, sequence in enumerate(sequences)))
    return path


def command_variant(checkpoint: Path, fasta: Path, warm_fasta: Path, work: Path, fp8: str, graphs: bool, tokens: int):
    """(embeddings [N, hidden], seconds, peak GB) of `nv_esm.embed.run` over `fasta` (after a warm-up run)."""
    device = torch.device("cuda")
    config = embed_model.load_config(str(checkpoint))
    model = None
    for name, source in (("warm", warm_fasta), ("timed", fasta)):
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        argv = [str(checkpoint), str(source), str(folder), "--tokens-per-batch", str(tokens), "--fp8", fp8]
        args = embed.parse_args([*argv, "--cuda-graphs" if graphs else "--no-cuda-graphs"], "bench")
        settings, records = embed_plan.plan_run(args, config, device)
        if model is None:
            model = embed_model.load_model(str(checkpoint), config, settings.backend, fp8, graphs, device)
        torch.cuda.reset_peak_memory_stats()
        stats, seconds = timed(embed.run, args, model, settings, records)
    peak = torch.cuda.max_memory_allocated() / 1e9
    embeddings = torch.stack([outputs[next(iter(outputs))] for _, outputs in embed.iter_embeddings(work / "timed")])
    del model
    torch.cuda.empty_cache()
    return embeddings.float(), seconds, peak


def make_workload(shape: str, proteins: int, work: Path) -> tuple[list[str], list[int], object, Path]:
    """(sequences, their lengths, transformers' `EsmForMaskedLM` with random weights, its converted checkpoint
    folder): `proteins` random proteins of UniRef50-like lengths, the model of `shape`, both written under `work`."""
    lengths = [len(p) for batch in draw_batches(proteins // 100, 100, seed=3) for p in batch]
    generator = torch.Generator().manual_seed(4)
    sequences = [
        "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (n,), generator=generator)) for n in lengths
    ]
    reference, checkpoint = random_checkpoint(shape, work)
    return sequences, lengths, reference, checkpoint


def main() -> None:
    import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)
    from transformers import AutoModel, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--proteins", type=int, default=10000)
    parser.add_argument("--tokens-per-batch", type=int, default=16384)
    parser.add_argument("--variants", nargs="+", default=[*COMMAND_VARIANTS], choices=[*COMMAND_VARIANTS])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nv_esm_embed_bench_"))
    sequences, lengths, reference, checkpoint = make_workload(args.shape, args.proteins, work)
    fasta, warm_fasta = write_fasta(work / "all.fasta", sequences), write_fasta(work / "warm.fasta", sequences[:512])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=True)

    results: dict[str, dict] = {}
    base = reference.esm.cuda().to(torch.bfloat16).eval()
    naive_transformers(base, tokenizer, sequences[:64])  # warm-up
    torch.cuda.reset_peak_memory_stats()
    expected, seconds = timed(naive_transformers, base, tokenizer, sequences)
    results["transformers_loop"] = {"seconds": seconds, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
    del base, reference
    torch.cuda.empty_cache()

    model = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.bfloat16).cuda().eval()
    model.embed(sequences[:512], tokenizer, show_progress=False)  # warm-up, as the command variants get
    torch.cuda.reset_peak_memory_stats()
    ours, seconds = timed(model.embed, sequences, tokenizer, max_tokens_per_batch=args.tokens_per_batch)
    results["embed()"] = {"seconds": seconds, "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "embeddings": ours}
    del model
    torch.cuda.empty_cache()

    for name in args.variants:
        fp8, graphs = COMMAND_VARIANTS[name]
        embeddings, seconds, peak = command_variant(
            checkpoint, fasta, warm_fasta, work / name, fp8, graphs, args.tokens_per_batch
        )
        results[name] = {"seconds": seconds, "peak_gb": peak, "embeddings": embeddings}

    summary = {
        "device": torch.cuda.get_device_name(),
        "shape": args.shape,
        "proteins": len(sequences),
        "residues": sum(lengths),
        "tokens_per_batch": args.tokens_per_batch,
        "variants": {},
    }
    loop_seconds, embed_seconds = results["transformers_loop"]["seconds"], results["embed()"]["seconds"]
    for name, result in results.items():
        entry = {
            "proteins_per_s": len(sequences) / result["seconds"],
            "x_transformers_loop": loop_seconds / result["seconds"],
            "x_embed()": embed_seconds / result["seconds"],
            "peak_gb": result["peak_gb"],
        }
        if "embeddings" in result:
            cosine = torch.nn.functional.cosine_similarity(result["embeddings"], expected, dim=1)
            entry |= {"cosine_to_loop_min": cosine.min().item(), "cosine_to_loop_mean": cosine.mean().item()}
        summary["variants"][name] = entry
    print(json.dumps(summary, indent=1))
    (args.out / "embed_benchmark.json").write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
