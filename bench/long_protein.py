"""One very long protein on Transformer Engine: time, peak memory, and agreement with the PyTorch backend.

    python bench/long_protein.py --residues 10000 --out bench/results/long_protein_h100

650M shape, random weights. The TE model (bf16 weights, packed THD and padded BSHD inputs) and the PyTorch backend
(fp32 weights, same weights, on the same GPU) embed one protein of `--residues` random residues; the JSON holds
each one's seconds (second of two calls) and peak allocated memory, and per-token cosine similarity and the largest
absolute difference of the final hidden states (TE bf16 vs PyTorch fp32).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformer_engine.pytorch  # noqa: F401  (before anything loads cuDNN)

from modeling_nv_esm import NVEsmModel, pack_proteins
from nv_esm.shapes import ESM2_SHAPES, esm2_config
from nv_esm.state_dict_mapping import nv_config_from_hf


def final_states(model: NVEsmModel, inputs: dict, hidden_size: int) -> tuple[torch.Tensor, float, float]:
    """(`[T, hidden]` float32 states, seconds, peak GB) of the second of two no-grad calls."""
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.no_grad():
            states = model(**inputs).last_hidden_state.float().reshape(-1, hidden_size)
        torch.cuda.synchronize()
    return states, time.perf_counter() - start, torch.cuda.max_memory_allocated() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--residues", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "long_protein_h100")
    args = parser.parse_args()
    hf_config = esm2_config(**ESM2_SHAPES["650M"]).to_dict()
    hidden_size, limit = hf_config["hidden_size"], args.residues + 2
    torch.manual_seed(1)
    reference = NVEsmModel(nv_config_from_hf(hf_config, max_protein_length=limit, backend="torch")).cuda().eval()
    tokens = [0, *torch.randint(4, 24, (args.residues,)).tolist(), 2]
    packed = {k: v.cuda() if torch.is_tensor(v) else v for k, v in pack_proteins([tokens]).items()}
    results: dict = {"device": torch.cuda.get_device_name(), "residues": args.residues}
    states = {}
    for layout in ("thd", "bshd"):
        config = nv_config_from_hf(hf_config, max_protein_length=limit, backend="te", attn_input_format=layout)
        model = NVEsmModel(config).cuda().eval()
        model.load_state_dict(reference.state_dict())
        model.to(torch.bfloat16)
        inputs = packed if layout == "thd" else {"input_ids": packed["input_ids"]}
        states[layout], seconds, peak = final_states(model, inputs, hidden_size)
        results[f"te_bf16_{layout}"] = dict(seconds=seconds, peak_gb=peak)
        del model
        torch.cuda.empty_cache()
    expected, seconds, peak = final_states(reference, packed, hidden_size)
    results["torch_fp32"] = dict(seconds=seconds, peak_gb=peak)
    for layout, ours in states.items():
        cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
        results[f"te_bf16_{layout}"].update(
            per_token_cosine_min=cosine.min().item(),
            mean_cosine=torch.nn.functional.cosine_similarity(ours.mean(0), expected.mean(0), dim=0).item(),
            max_abs_diff=(ours - expected).abs().max().item(),
            reference_abs_max=expected.abs().max().item(),
        )
    print(json.dumps(results, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_protein.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
