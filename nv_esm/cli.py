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
(`nv_esm.options.HelpFormatter`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from nv_esm.options import BACKEND_HELP, HelpFormatter, add_renamed
from nv_esm.vocabulary import (
    BACKENDS,
    COMMAND_FP8_RECIPE,
    FP8_LAYER_CHOICES,
    FP8_SCALINGS,
    INVALID_POLICIES,
    OUTPUTS,
    PROTEINGYM_METHODS,
    SAVE_DTYPE_NAMES,
    SCORE_METHODS,
    STRIP_STOP_HELP,
    TOKENS_PER_BATCH,
    TOO_LONG_POLICIES,
    WINDOW_RULES,
)

COMMANDS = {
    "convert": ("convert_checkpoint", "convert ESM-2 checkpoints: transformers, fair-esm, BioNeMo <-> NVEsm; verify"),
    "embed": ("nv_esm.embed", "embed a FASTA file: per-protein/per-residue states and contacts, in shards + index"),
    "score": ("nv_esm.score", "score variants of a wild type (masked marginals, PLL ratios) or a FASTA file's PLLs"),
    "proteingym": ("nv_esm.proteingym", "score ProteinGym's substitution assays (their ESM-2 methods and windows)"),
    "train": ("nv_esm.train.loop", "pre-train or fine-tune NVEsm with FSDP2 (torchrun -m nv_esm.train for many GPUs)"),
}
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


# ---------------------------------------------------------------------------------------------------------------
# The commands' parsers, built from `nv_esm.vocabulary` and free of torch, so that `--help` answers at once; one
# name per option across the commands, old names kept (`add_renamed`).
# ---------------------------------------------------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser, graphs_note: str) -> None:
    """The options `nv-esm embed`, `score` and `proteingym` share: the token budget, the backend, its FP8 layers and
    their scaling, CUDA graphs (`graphs_note`: where the command replays them), the device, `--overwrite`,
    `--trust-remote-code` and `--no-progress`."""
    add_renamed(
        parser,
        parser.add_argument(
            "--tokens-per-batch", type=int, default=TOKENS_PER_BATCH, help="token budget of one packed batch"
        ),
    )
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help=BACKEND_HELP)
    parser.add_argument(
        "--fp8", choices=FP8_LAYER_CHOICES, default="off", help="FP8 layers (Transformer Engine on CUDA): all or inner"
    )
    scaling = parser.add_argument(
        "--fp8-scaling",
        choices=FP8_SCALINGS,
        default=COMMAND_FP8_RECIPE,
        help="the FP8 layers' scaling: block (one scale per 128 features of each token, so a protein's numbers do "
        "not depend on the proteins batched with it) or current (one scale per tensor from the batch: faster; a "
        "protein's numbers move with its batch); delayed is nv-esm train's only",
    )
    add_renamed(parser, scaling)
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help=f"replay the layers as CUDA graphs (default: on with Transformer Engine; {graphs_note})",
    )
    parser.add_argument("--device", help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    add_renamed(
        parser,
        parser.add_argument("--overwrite", action="store_true", help="delete an earlier run with other settings"),
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the checkpoint's own model code where it differs from this package's (it runs as you: only for "
        "folders you trust; without it the installed code runs the checkpoint's weights)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (loading the weights included)")


SCORE_DEFAULT_COLUMN = "DMS_score"
CHECKPOINT_HELP = "an NVEsm checkpoint folder or Hub id (see `nv-esm convert`)"
# What nv-esm score says of a method name that is nv-esm proteingym's (a different computation, not a spelling).
PROTEINGYM_ONLY = {
    "masked_marginals": "masked-marginals is nv-esm proteingym's (each site masked alone, the sites' scores added); "
    "nv-esm score's masked_marginal masks a mutant's sites together (the same for single mutants)",
}


def method_type(methods: tuple[str, ...], elsewhere: dict[str, str] | None = None) -> Callable[[str], str]:
    """argparse's `type` of a `--methods` value: the name in `methods` spelled with "-" or "_" alike (normalised to
    the listed spelling); a name of `elsewhere` (by its "_" spelling) is refused with its explanation."""
    spelled = {name.replace("-", "_"): name for name in methods}

    def method(value: str) -> str:
        key = value.replace("-", "_")
        if key in spelled:
            return spelled[key]
        if elsewhere and key in elsewhere:
            raise argparse.ArgumentTypeError(elsewhere[key])
        return value  # argparse's choices error names the methods

    return method


def parse_embed_args(argv: list[str], prog: str) -> argparse.Namespace:
    """`nv-esm embed`'s command line (`nv_esm.embed.parse_args`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Embed the proteins of a FASTA file with an NVEsm checkpoint into safetensors shards + index.tsv.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("checkpoint", help=CHECKPOINT_HELP)
    parser.add_argument("fasta", type=Path, help="the proteins, one FASTA record each (ids: first word of headers)")
    parser.add_argument("output", type=Path, help="folder for the shards, index.tsv and manifest.json")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[-1], help="hidden states to keep: 0 = embeddings, -1 = last"
    )
    parser.add_argument(
        "--include", nargs="+", choices=OUTPUTS, default=["mean"], help="per-protein mean/cls, per-residue, contacts"
    )
    parser.add_argument(
        "--max-length", type=int, help="longest protein in residues (default: the checkpoint's max_protein_length - 2)"
    )
    parser.add_argument(
        "--too-long",
        choices=TOO_LONG_POLICIES,
        default="error",
        help="longer proteins: stop; skip; keep the first --max-length residues; or overlapping windows (averaged)",
    )
    parser.add_argument(
        "--invalid",
        choices=INVALID_POLICIES,
        default="error",
        help="records with letters outside ESM-2's alphabet, or none: stop, or skip them (index.tsv says why)",
    )
    parser.add_argument(
        "--strip-stop", action="store_true", help=f"{STRIP_STOP_HELP}; index.tsv's stop_removed column says where"
    )
    parser.add_argument("--shard-size", type=int, default=1000, help="proteins (FASTA records) per shard")
    parser.add_argument("--save-dtype", choices=SAVE_DTYPE_NAMES, default="float32", help="dtype of the saved arrays")
    add_run_arguments(parser, "last layer only, no contacts")
    args = parser.parse_args(argv)
    if args.shard_size < 1 or args.tokens_per_batch < 1:
        parser.error("--shard-size and --tokens-per-batch must be positive")
    if "contacts" in args.include and args.too_long == "window":
        parser.error("contacts of windowed proteins are not defined: use --too-long crop, skip or error")
    return args


def parse_score_args(argv: list[str], prog: str) -> argparse.Namespace:
    """`nv-esm score`'s command line (`nv_esm.score.parse_args`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pseudo-log-likelihoods of a FASTA file's proteins, or variant-effect scores of a CSV of mutants "
        "of one wild type, with an NVEsm masked-LM checkpoint.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("checkpoint", help=CHECKPOINT_HELP)
    parser.add_argument("fasta", type=Path, help="proteins to score (PLL), or with --mutants the wild type (1 record)")
    parser.add_argument("output", type=Path, help="the output CSV (finished parts are kept in OUTPUT.parts/)")
    parser.add_argument(
        "--mutants", type=Path, help="a CSV of mutants of the wild type, one per row (ProteinGym's; default: none)"
    )
    default_methods = [SCORE_METHODS[0]]
    parser.add_argument(
        "--methods",
        nargs="+",
        type=method_type(SCORE_METHODS, PROTEINGYM_ONLY),
        choices=SCORE_METHODS,
        default=default_methods,
        help="with --mutants: one output column each, named as the method ('-' reads as '_')",
    )
    parser.add_argument("--mutant-column", default="mutant", help="with --mutants: the column of A24G / A24G:K30R")
    parser.add_argument(
        "--score-column",
        help="with --mutants: measured scores to rank against (Spearman's rho, printed; default "
        f"{SCORE_DEFAULT_COLUMN} where the CSV has it)",
    )
    parser.add_argument(
        "--window",
        type=int,
        help="residues per forward for longer proteins (default: min(max_position_embeddings, max_protein_length) - 2)",
    )
    parser.add_argument(
        "--invalid",
        choices=INVALID_POLICIES,
        default="error",
        help="FASTA records outside ESM-2's alphabet, or bad mutant rows: stop, or leave them unscored (the status "
        "column says why)",
    )
    parser.add_argument("--strip-stop", action="store_true", help=STRIP_STOP_HELP)
    parser.add_argument(
        "--shard-size", type=int, help="records (default 100), or mutant rows (default 2000), per resumable part"
    )
    add_run_arguments(parser, "every forward of masked copies")
    args = parser.parse_args(argv)
    if args.mutants is None and (args.methods is not default_methods or args.score_column):
        parser.error("--methods and --score-column score mutants: pass --mutants CSV")
    args.methods = tuple(dict.fromkeys(args.methods)) if args.mutants else ()
    if args.shard_size is None:
        args.shard_size = 2000 if args.mutants else 100
    if args.shard_size < 1 or args.tokens_per_batch < 1:
        parser.error("--shard-size and --tokens-per-batch must be positive")
    if args.output.name in ("", "..") or args.output.is_dir():
        parser.error(f"output {args.output} is a folder; name the CSV file to write, e.g. {args.output / 'scores.csv'}")
    return args


def parse_proteingym_args(argv: list[str], prog: str) -> argparse.Namespace:
    """`nv-esm proteingym`'s command line (`nv_esm.proteingym.parse_args`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Score ProteinGym's substitution assays with an NVEsm masked-LM checkpoint, their ESM-2 methods "
        "and windows, the masked copies of all assays packed together.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("checkpoint", help=CHECKPOINT_HELP)
    parser.add_argument("reference", type=Path, help="ProteinGym's reference_files/DMS_substitutions.csv")
    parser.add_argument("assays_folder", type=Path, help="the assays' CSV files (DMS_ProteinGym_substitutions/)")
    parser.add_argument("output", type=Path, help="the output folder: <DMS_id>.csv per assay")
    parser.add_argument(
        "--methods",
        nargs="+",
        type=method_type(PROTEINGYM_METHODS),
        choices=PROTEINGYM_METHODS,
        default=[PROTEINGYM_METHODS[0]],
        help="one score column each: MODEL_NAME for masked-marginals, MODEL_NAME_<method> for the others ('-' and "
        "'_' read alike); masked_marginal is nv-esm score's joint mask",
    )
    parser.add_argument(
        "--windows",
        choices=WINDOW_RULES,
        default="proteingym",
        help="long proteins: ProteinGym's slices of the token array, or nv-esm score's windows",
    )
    parser.add_argument("--assays", nargs="+", metavar="DMS_ID", help="score these assays only (default: all)")
    parser.add_argument(
        "--scatter-assay", metavar="DMS_ID", help="the assay of the score-vs-DMS_score plot (default: the first one)"
    )
    parser.add_argument(
        "--model-name",
        help="the score columns' name (ProteinGym's config.json reads e.g. esm2_t33_650M_UR50D; default: the "
        "checkpoint folder's name)",
    )
    add_run_arguments(parser, "every forward of masked copies")
    args = parser.parse_args(argv)
    args.methods = tuple(dict.fromkeys(args.methods))
    args.model_name = args.model_name or Path(args.checkpoint.rstrip("/")).name
    if args.tokens_per_batch < 1:
        parser.error("--tokens-per-batch must be positive")
    if args.output.exists() and not args.output.is_dir():
        parser.error(f"output {args.output} is a file; name a folder")
    return args


def parse_export_args(argv: list[str], prog: str) -> argparse.Namespace:
    """`nv-esm train export`'s command line (`nv_esm.train.export.export_main`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Write a Hub folder from a training checkpoint.", formatter_class=HelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="OUT/checkpoints/step_NNNNNNN")
    parser.add_argument("out", type=Path, help="the Hub model folder to write (absent or empty unless --overwrite)")
    add_renamed(parser, parser.add_argument("--overwrite", action="store_true", help="replace an earlier export"))
    return parser.parse_args(argv)


def parse_train_args(argv: list[str], prog: str) -> object:
    """`nv-esm train`'s command line (`nv_esm.train.config.parse_config`; `export` its `parse_export_args`)."""
    if argv[:1] == ["export"]:
        return parse_export_args(argv[1:], f"{prog} export")
    from nv_esm.train.config import parse_config

    return parse_config(argv, prog)


def parse_convert_args(argv: list[str], prog: str) -> argparse.Namespace:
    """`nv-esm convert`'s command line (`convert_checkpoint.build_parser`)."""
    from convert_checkpoint import build_parser

    return build_parser(prog).parse_args(argv)


# Each command's parser, which imports neither torch nor transformers: `--help` answers at once (`main`).
PARSERS: dict[str, Callable[[list[str], str], object]] = {
    "convert": parse_convert_args,
    "embed": parse_embed_args,
    "score": parse_score_args,
    "proteingym": parse_proteingym_args,
    "train": parse_train_args,
}


def asks_for_help(arguments: list[str]) -> bool:
    """Whether argparse would print the help of `arguments` (-h or --help before a `--`)."""
    before = arguments[: arguments.index("--")] if "--" in arguments else arguments
    return "-h" in before or "--help" in before


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
    return run_command(command, arguments)


def run_command(command: str, arguments: list[str]) -> int:
    """Run `nv-esm COMMAND ARGS...` (`command` one of `COMMANDS`), the one way every entry point starts a command
    (`nv-esm`, `python -m nv_esm`, `python -m nv_esm.train`, `recipes/train.py`): `--help` from the parser alone
    (torch is not imported; prints, exits 0), Ctrl-C during the imports one line (`interrupted_start_up`), then the
    command's `main`. Returns the exit status."""
    prog = f"nv-esm {command}"
    if asks_for_help(arguments):
        PARSERS[command](arguments, prog)
    with interrupted_start_up(prog):
        module = importlib.import_module(COMMANDS[command][0])
    return module.main(arguments, prog=prog) or 0


@contextlib.contextmanager
def interrupted_start_up(prog: str) -> Iterator[None]:
    """Around a command's imports (torch, transformers, the model code: seconds): Ctrl-C there ends the process at
    once with one line and status 130, not a traceback through the import machinery (nor a KeyboardInterrupt that
    a library's bare `except` would swallow); nothing has been read or written yet. Only where Ctrl-C would raise
    KeyboardInterrupt (not where it is ignored, nor off the main thread); the handler before is put back after."""

    def stop(_signum: int, _frame: object) -> None:
        os.write(2, f"{prog}: error: interrupted during start-up: nothing was read or written.\n".encode())
        os._exit(130)

    previous = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with contextlib.suppress(ValueError):  # not the main thread
            previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


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
