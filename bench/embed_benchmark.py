"""Proteins/s of `NVEsmModel.embed` (length-sorted THD packing, bf16) vs the naive transformers loop.

    python bench/embed_benchmark.py --shape 650M --proteins 10000 --out bench/results

Naive loop: `EsmModel` in bf16, proteins in input order, padded batches of 32, mean over residues. Both models
hold the same random weights; the script also reports the cosine similarity of the two embeddings per protein.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from benchmark import ROOT, SHAPES, draw_batches

from modeling_nv_esm import NVEsmForMaskedLM
from nv_esm.alphabet import STANDARD_AMINO_ACIDS
from nv_esm.state_dict_mapping import hf_to_nv_state_dict, nv_config_from_hf


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


def timed(function, *args, **kwargs) -> tuple[torch.Tensor, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function(*args, **kwargs)
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    from transformers import AutoTokenizer, EsmForMaskedLM

    from nv_esm.shapes import esm2_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="650M", choices=sorted(SHAPES))
    parser.add_argument("--proteins", type=int, default=10000)
    parser.add_argument("--max-tokens-per-batch", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets" / "esm2_tiny")
    lengths = [len(p) for batch in draw_batches(args.proteins // 100, 100, seed=3) for p in batch]
    generator = torch.Generator().manual_seed(4)
    sequences = [
        "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (n,), generator=generator)) for n in lengths
    ]
    torch.manual_seed(0)
    reference = EsmForMaskedLM(esm2_config(**SHAPES[args.shape]))
    config = nv_config_from_hf(reference.config.to_dict(), backend="te", check_inputs=False)
    ours = NVEsmForMaskedLM(config)
    ours.load_state_dict(hf_to_nv_state_dict(reference.state_dict(), config))
    ours = ours.cuda().to(torch.bfloat16).eval()
    reference = reference.esm.cuda().to(torch.bfloat16).eval()
    ours.esm.embed(sequences[:64], tokenizer, show_progress=False)  # warm-up
    naive_transformers(reference, tokenizer, sequences[:64])
    embed_kwargs = dict(max_tokens_per_batch=args.max_tokens_per_batch, show_progress=False)
    our_embeddings, our_seconds = timed(ours.esm.embed, sequences, tokenizer, **embed_kwargs)
    their_embeddings, their_seconds = timed(naive_transformers, reference, tokenizer, sequences)
    cosine = torch.nn.functional.cosine_similarity(our_embeddings, their_embeddings, dim=1)
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": args.shape,
        "proteins": len(sequences),
        "residues": sum(lengths),
        "nv_esm_embed_proteins_per_s": len(sequences) / our_seconds,
        "transformers_naive_proteins_per_s": len(sequences) / their_seconds,
        "speedup": their_seconds / our_seconds,
        "cosine_similarity_min": cosine.min().item(),
        "cosine_similarity_mean": cosine.mean().item(),
    }
    print(json.dumps(result, indent=1))
    (args.out / "embed_benchmark.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
