"""Two versions of the model code side by side in ONE process: throughput of each on the same weights and batches,
timed in alternation (old, new, new, old, ...), median over rounds.

    python bench/ab_model_code.py --old /path/to/old/tree --new . --out bench/results/ab.json
    python bench/ab_model_code.py --old te_port --new . --out bench/results/port_ab.json

`--old te_port` compares against the plain Transformer Engine port (`te_port.py`, always eager bf16, its own random
weights): every case's ratio is then ours (eager, graphs, FP8 graphs) over the floor any TE port gets.

Each tree's remote code (`configuration_nv_esm.py`, `modeling_nv_esm*.py`) is copied into a package of its own in a
temporary folder and imported from there, as transformers loads Hub remote code, so both run in one process. Separate
processes (`benchmark.py`) differ by up to +-30% from run to run on an H100 where the GPU waits for Python
(eager at 16 proteins, inference); in one process, with alternating rounds, both trees see the same machine state.

Cases (`--cases`): eager / graphs / FP8 graphs (every layer FP8, delayed scaling) x infer (bf16 weights, no grad) /
train (fp32 weights, bf16 autocast, forward + backward); ESM-2 650M; 16 and 64 packed proteins of log-normal lengths
(median 270 residues, as `benchmark.py`). Training graphs of two models at 64 proteins do not fit in 80 GB together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformer_engine.pytorch  # noqa: F401  (imported before anything loads cuDNN)

SHAPE = dict(hidden_size=1280, num_hidden_layers=33, num_attention_heads=20, intermediate_size=5120, vocab_size=33)
CASES = {  # name: (graphs, fp8, train, protein counts)
    "eager_infer": (False, False, False, (16, 64)),
    "eager_train": (False, False, True, (16, 64)),
    "graphs_infer": (True, False, False, (16, 64)),
    "graphs_train": (True, False, True, (16,)),
    "graphs_fp8_infer": (True, True, False, (16, 64)),
    "graphs_fp8_train": (True, True, True, (16,)),
}


def load_tree(tree: Path, package: str, folder: Path) -> object:
    """`tree`'s remote code as the package `package` (a copy under `folder`): its `modeling_nv_esm` module."""
    target = folder / package
    target.mkdir()
    (target / "__init__.py").write_text("")
    for path in [tree / "configuration_nv_esm.py", *sorted(tree.glob("modeling_nv_esm*.py"))]:
        shutil.copy(path, target / path.name)
    return importlib.import_module(f"{package}.modeling_nv_esm")


def build(module: object, graphs: bool, fp8: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if module == "te_port":
        from te_port import TEPort  # bench/te_port.py, beside this script

        return TEPort(**SHAPE).cuda()
    precision = {"layer_precision": ["fp8"] * SHAPE["num_hidden_layers"]} if fp8 else {}
    config = module.NVEsmConfig(
        **SHAPE, backend="te", attn_input_format="thd", check_inputs=False, cuda_graphs=graphs, **precision
    )
    return module.NVEsmForMaskedLM(config).cuda()


def draw_batches(module: object, count: int, proteins: int, seed: int) -> list[dict]:
    """Packed batches on the GPU with 15% of tokens labelled."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.exp(math.log(270) + 0.7 * torch.randn(proteins, generator=generator)).clamp(10, 1024).long()
        tokens = [
            torch.cat([torch.tensor([0]), torch.randint(4, 24, (n,), generator=generator), torch.tensor([2])])
            for n in lengths.tolist()
        ]
        labels = [torch.where(torch.rand(len(t), generator=generator) < 0.15, t, -100) for t in tokens]
        packed = module.pack_proteins(tokens, labels)
        batches.append(
            {
                "input_ids": packed["input_ids"].cuda(),
                "labels": packed["labels"].cuda(),
                "cu_seq_lens_q": packed["cu_seq_lens_q"].cuda(),
                "max_length_q": packed["max_length_q"],
            }
        )
    return batches


def step(model: torch.nn.Module, batch: dict, train: bool) -> None:
    if train:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(**{name: value for name, value in batch.items() if name != "labels"})


def compare(modules: dict, case: tuple, rounds: int) -> dict:
    graphs, fp8, train, protein_counts = case
    models = {name: build(module, graphs, fp8) for name, module in modules.items()}
    if modules["old"] != "te_port":
        models["new"].load_state_dict(models["old"].state_dict())
    for model in models.values():
        model.train(train)
        if not train:
            model.to(torch.bfloat16)
    results = {}
    for proteins in protein_counts:
        batches = draw_batches(modules["new"], 4, proteins, seed=proteins)
        tokens = sum(batch["input_ids"].shape[1] for batch in batches)
        for model in models.values():  # every shape seen (CUDA graphs captured) before timing
            for _ in range(2):
                for batch in batches:
                    step(model, batch, train)
        rates = {"old": [], "new": []}
        for index in range(rounds):
            for name in ("old", "new") if index % 2 == 0 else ("new", "old"):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for batch in batches:
                    step(models[name], batch, train)
                torch.cuda.synchronize()
                rates[name].append(tokens / (time.perf_counter() - started))
        old, new = statistics.median(rates["old"]), statistics.median(rates["new"])
        results[proteins] = {"old_tokens_per_s": old, "new_tokens_per_s": new, "new_over_old": new / old, **rates}
        print(f"{proteins:3d} proteins: old {old:9.0f} new {new:9.0f} tokens/s, new/old {new / old:.3f}", flush=True)
    del models
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="tree of the previous model code, or te_port")
    parser.add_argument("--new", type=Path, required=True, help="tree of the new model code")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, folder)
        modules = {
            "old": "te_port" if args.old == "te_port" else load_tree(Path(args.old), "ab_old", Path(folder)),
            "new": load_tree(args.new, "ab_new", Path(folder)),
        }
        results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for name in args.cases:
            print(name, flush=True)
            results[name] = compare(modules, CASES[name], args.rounds)
            args.out.write_text(json.dumps(results, indent=1))  # after each case


if __name__ == "__main__":
    main()
