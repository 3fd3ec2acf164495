"""Convert an ESM-2 checkpoint to NVEsm, load it with `AutoModelForMaskedLM` + `trust_remote_code`, fill masks in
GFP, and print the largest logit difference against transformers' `EsmForMaskedLM` on the same weights; then the
README Quickstart's first commands, in this Python's environment (`make demo` runs `.venv/bin/python`, so `nv-esm`
is found only after `source .venv/bin/activate`, or by its full path).

    python examples/demo.py                                  # the bundled tiny random checkpoint, no network
    python examples/demo.py facebook/esm2_t6_8M_UR50D        # a real ESM-2 from the Hub
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, EsmForMaskedLM

from nv_esm.alphabet import GFP  # UniProt P42212, green fluorescent protein (Aequorea victoria)
from nv_esm.conversion import convert_hf_to_nv
from nv_esm.hub_folder import resolve_source
from nv_esm.verification import DEFAULT_VERIFY_ATOL, TE_FP32_VERIFY_ATOL

ROOT = Path(__file__).resolve().parents[1]
CHROMOPHORE = range(64, 67)  # residues 65-67 (S65, Y66, G67), 0-based
# fp32, as the converter's --verify; TE's fused GELU is the tanh approximation (see README)
TOLERANCE = {"torch": DEFAULT_VERIFY_ATOL["float32"], "te": TE_FP32_VERIFY_ATOL}
QUICKSTART = "nv-esm convert hf-to-te assets/esm2_tiny esm2_nv"  # README.md's first Quickstart command


def next_steps() -> str:
    """The README Quickstart's first commands for this Python's environment: activating it (unless it is the
    active one) and the conversion, with the full path of its `nv-esm` for a shell that does not activate it."""
    scripts = Path(sys.prefix) / "bin"
    if not (scripts / "nv-esm").exists():
        return f"Next: pip install . (the nv-esm command), then the README's Quickstart: {QUICKSTART}"
    lines = ["Next, the README's Quickstart (the nv-esm command is in this environment):"]
    if sys.prefix != sys.base_prefix and os.environ.get("VIRTUAL_ENV") != sys.prefix:
        activate = scripts / "activate"
        lines.append(f"    source {os.path.relpath(activate) if activate.is_relative_to(Path.cwd()) else activate}")
    lines.append(f"    {QUICKSTART}")
    lines.append(f"  (or, without activating: {scripts / QUICKSTART})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", default=str(ROOT / "assets" / "esm2_tiny"), help="folder or Hub id")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda uses Transformer Engine if installed)")
    args = parser.parse_args(argv)
    source = resolve_source(args.source)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "nv_esm"
        convert_hf_to_nv(source, out)
        print(f"converted {args.source} -> {out.name}: {sorted(p.name for p in out.iterdir())}")
        backend = "auto" if args.device.startswith("cuda") else "torch"
        ours = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, backend=backend)
        tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ours = ours.to(args.device).eval()
    reference = EsmForMaskedLM.from_pretrained(source).to(args.device).eval()
    masked = "".join("<mask>" if i in CHROMOPHORE or i % 25 == 0 else aa for i, aa in enumerate(GFP))
    batch = tokenizer([masked], return_tensors="pt").to(args.device)
    with torch.no_grad():
        logits, expected = ours(**batch).logits, reference(**batch).logits
    mask_positions = (batch["input_ids"][0] == tokenizer.mask_token_id).nonzero().squeeze(1)
    ours_fill = tokenizer.convert_ids_to_tokens(logits[0, mask_positions].argmax(-1).tolist())
    their_fill = tokenizer.convert_ids_to_tokens(expected[0, mask_positions].argmax(-1).tolist())
    print(f"GFP (P42212) with {len(mask_positions)} masks (chromophore S65-Y66-G67 and every 25th residue)")
    print(f"  true residues : {''.join(GFP[p - 1] for p in mask_positions.tolist())}")
    print(f"  NVEsm fills   : {''.join(ours_fill)}")
    print(f"  transformers  : {''.join(their_fill)}")
    if Path(args.source).resolve() == (ROOT / "assets" / "esm2_tiny").resolve():
        print("  (the bundled tiny checkpoint has random weights: its fills are nonsense; what counts is that both")
        print(
            "   implementations give the same logits. A real ESM-2: python examples/demo.py facebook/esm2_t6_8M_UR50D)"
        )
    difference = (logits.double() - expected.double()).abs().max().item()
    tolerance = TOLERANCE[ours.esm.backend]
    print(
        f"max |logit difference| vs transformers EsmForMaskedLM: {difference:.3g} (backend {ours.esm.backend}, "
        f"tolerance {tolerance:g})"
    )
    if difference > tolerance:
        return 1
    print(next_steps())
    return 0


if __name__ == "__main__":
    sys.exit(main())
