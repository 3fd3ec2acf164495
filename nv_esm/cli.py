"""`nv-esm`: the command-line door to the project.

    nv-esm convert hf-to-te facebook/esm2_t33_650M_UR50D ./esm2_650M_te   # convert_checkpoint.py, same arguments
    nv-esm convert verify facebook/esm2_t33_650M_UR50D ./esm2_650M_te
    nv-esm embed ./esm2_650M_te proteins.fasta ./embeddings              # FASTA -> embeddings (nv_esm/embed.py)
    nv-esm score ./esm2_650M_te wt.fasta scores.csv --mutants dms.csv    # variant effects, PLLs (nv_esm/score.py)
    nv-esm train --help                                                  # the FSDP2 recipe on one process
    torchrun --nproc-per-node 8 -m nv_esm.train ...                      # ... and on several GPUs

`python -m nv_esm` is the same command.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "convert": ("convert_checkpoint", "convert ESM-2 checkpoints between transformers, fair-esm and NVEsm; verify"),
    "embed": ("nv_esm.embed", "embed a FASTA file: per-protein/per-residue states and contacts, in shards + index"),
    "score": ("nv_esm.score", "score variants of a wild type (masked marginals, PLL ratios) or a FASTA file's PLLs"),
    "train": ("nv_esm.train.loop", "pre-train or fine-tune NVEsm with FSDP2 (torchrun -m nv_esm.train for many GPUs)"),
}


def usage() -> str:
    """The `nv-esm --help` text: the commands and what each does."""
    lines = ["usage: nv-esm COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "`nv-esm COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `nv-esm COMMAND ARGS...`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, *arguments = argv
    if command not in COMMANDS:
        print(f"nv-esm: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    status = module.main(arguments, prog=f"nv-esm {command}")
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
