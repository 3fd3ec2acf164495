"""`nv-esm`: the command-line door to the project.

    nv-esm convert hf-to-te facebook/esm2_t33_650M_UR50D ./esm2_650M_te   # convert_checkpoint.py, same arguments
    nv-esm convert verify facebook/esm2_t33_650M_UR50D ./esm2_650M_te
    nv-esm embed ./esm2_650M_te proteins.fasta ./embeddings              # FASTA -> embeddings (nv_esm/embed.py)
    nv-esm score ./esm2_650M_te wt.fasta scores.csv --mutants dms.csv    # variant effects, PLLs (nv_esm/score.py)
    nv-esm proteingym ./esm2_650M_te DMS_substitutions.csv assays/ out/  # ProteinGym (nv_esm/proteingym.py)
    nv-esm train --help                                                  # the FSDP2 recipe on one process
    torchrun --nproc-per-node 8 -m nv_esm.train ...                      # ... and on several GPUs

`python -m nv_esm` is the same command. Every command reports a failure as one line on stderr, as argparse reports
a usage error: `nv-esm COMMAND: error: ...` (`print_error`), and its `--help` lists each option's default
(`HelpFormatter`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

COMMANDS = {
    "convert": ("convert_checkpoint", "convert ESM-2 checkpoints between transformers, fair-esm and NVEsm; verify"),
    "embed": ("nv_esm.embed", "embed a FASTA file: per-protein/per-residue states and contacts, in shards + index"),
    "score": ("nv_esm.score", "score variants of a wild type (masked marginals, PLL ratios) or a FASTA file's PLLs"),
    "proteingym": ("nv_esm.proteingym", "score ProteinGym's substitution assays (their ESM-2 methods and windows)"),
    "train": ("nv_esm.train.loop", "pre-train or fine-tune NVEsm with FSDP2 (torchrun -m nv_esm.train for many GPUs)"),
}
# The help of the commands' --backend (the model's `backend`).
BACKEND_HELP = "layers: Transformer Engine (te), PyTorch (torch), or TE on a GPU where installed (auto)"
# Commands after which the process ends at once (`console`): every file they write is closed when they return.
QUICK_EXIT = ("embed", "score", "proteingym")
# Commands of a command, listed in the usage under it: (command, subcommand) -> what it does.
SUBCOMMANDS = {("train", "export"): "write a Hub model folder from a training checkpoint (LoRA merged)"}


def version() -> str:
    """The installed nv-esm's version (pyproject.toml's), or "unknown" where it is not installed."""
    try:
        return importlib.metadata.version("nv-esm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install .)"


def usage() -> str:
    """The `nv-esm --help` text: the commands and what each does."""
    lines = ["usage: nv-esm COMMAND [ARGS...]", "       nv-esm --version", "", "commands:"]
    for name, (_, summary) in COMMANDS.items():
        lines.append(f"  {name:<14} {summary}")
        lines += [f"  {f'{name} {sub}':<14} {text}" for (parent, sub), text in SUBCOMMANDS.items() if parent == name]
    lines += ["", "`nv-esm COMMAND --help` describes a command's arguments."]
    return "\n".join(lines)


def print_error(prog: str, message: object) -> None:
    """Report a failure of the command `prog` (e.g. "nv-esm embed") as one line on stderr, in argparse's own form
    for usage errors: `PROG: error: MESSAGE`."""
    print(f"{prog}: error: {message}", file=sys.stderr)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default after its help, unless it has none (None, a flag
    that is off, an empty list): then the help says what happens without it, and "(default: None)" would not."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    """Run `nv-esm COMMAND ARGS...`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"nv-esm {version()}")
        return 0
    command, *arguments = argv
    if command not in COMMANDS:
        print(f"nv-esm: error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    status = module.main(arguments, prog=f"nv-esm {command}")
    return status or 0


def keep_imports_installed() -> None:
    """Under `python -m`, Python puts the current directory first on `sys.path`; a checkpoint folder holds
    `modeling_nv_esm*.py`, so a command started inside one would import that folder's code instead of the installed
    package's (and run it without `--trust-remote-code`). Take that entry away, as `python -P` does, unless the
    current directory is where nv-esm itself was imported from (a source checkout run in place). Called by the `-m`
    entry points (`nv_esm/__main__.py`, `nv_esm/train/__main__.py`) before any model code is imported."""
    here = os.path.realpath(os.getcwd())
    package_root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if sys.path and sys.path[0] in ("", here, os.getcwd()) and here != package_root:
        del sys.path[0]


def console() -> None:
    """The `nv-esm` script and `python -m nv_esm`: `main`, then exit with its status. After the `QUICK_EXIT` commands
    the process ends at once (`os._exit`, once stdout and stderr are flushed), skipping the teardown of CUDA and of
    the interpreter's objects: about a second after a GPU run, which those commands' short jobs would pay."""
    argv = sys.argv[1:]
    status = main(argv)
    if argv and argv[0] in QUICK_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    console()
