"""The building blocks of every command's parser (`nv_esm.cli`'s, `nv-esm train`'s in `nv_esm.train.config`,
`nv-esm convert`'s in convert_checkpoint.py): the help format that states each option's default, old option names
that keep working (`add_renamed`), and the wording shared across commands. Free of torch, as the parsers are.
"""

from __future__ import annotations

import argparse
import re
import sys

from nv_esm.vocabulary import RENAMED

# The help of the commands' --backend (the model's `backend`).
BACKEND_HELP = "layers: Transformer Engine (te), PyTorch (torch), or TE on a GPU where installed (auto)"
FP8_NEEDS = "FP8 layers need Transformer Engine on a CUDA GPU (backend te)"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and after every option's help its default: "(required)" for a required option,
    "(default: on)" / "(default: off)" for a flag, "(default: none)" for an empty list, else argparse's "(default:
    VALUE)"; a None default is left to the help, which says what happens without the option (and says "default")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").replace(" (default: %(default)s)", "")  # BooleanOptionalAction's own
        if action.help is argparse.SUPPRESS or action.default is argparse.SUPPRESS:
            return action.help
        if not action.option_strings:  # a positional argument: always given
            return action.help
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0 and isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None or "%(default)" in text:
            return text
        if action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class RenamedOption(argparse.Action):
    """An old option name (`RENAMED`): says "note: OLD is now NEW" on stderr, then does what NEW does. Hidden from
    `--help`."""

    def __init__(self, option_strings: list[str], dest: str, target: argparse.Action, **_: object) -> None:
        super().__init__(
            option_strings,
            target.dest,
            nargs=target.nargs,
            type=target.type,
            choices=target.choices,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            metavar=target.metavar,
        )
        self.target = target
        self.quiet = False  # a second parse of the same command line (`nv_esm.train.config.given_options`) says nothing

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:  # fmt: skip
        new = self.target.option_strings[0]
        if not self.quiet:
            print(f"note: {option_string} is now {new}", file=sys.stderr)
        self.target(parser, namespace, values, new)


def add_renamed(container: argparse._ActionsContainer, new: argparse.Action) -> None:
    """Add the old names of `new` (an option `RENAMED` renamed) to `container`, as `RenamedOption`s."""
    for old, name in RENAMED.items():
        if name in new.option_strings:
            container.add_argument(old, action=RenamedOption, target=new)


def fp8_refusal(fp8: str, backend: str, device: object) -> str:
    """The one-line error of `--fp8 FP8` where the layers run on `backend` ("torch") on `device`: what the user
    passed, what FP8 needs, and the way out."""
    return f"--fp8 {fp8}: {FP8_NEEDS}; this run has backend {backend} on {device} (drop --fp8, or run on such a GPU)."


def parse_size(text: str) -> int:
    """`"5GB"` -> 5_000_000_000 (KB/MB/GB/TB: powers of 1000, KiB/MiB/GiB/TiB: powers of 1024, or plain bytes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "b").lower()
    base = 1024 if "i" in unit else 1000
    size = number * base ** "bkmgt".index(unit[0])
    if not 1 <= size <= 2**63:
        raise ValueError(f"size must be from 1 byte to 8 EiB: {text!r}")
    return int(size)
