"""Convert ESM-2 checkpoints between transformers (`EsmForMaskedLM`), fair-esm (`.pt`), NVIDIA's BioNeMo layout
(bionemo-recipes, `nvidia/esm2_*`) and NVEsm (Transformer Engine).

One table, `RULES` and a head's rules (`HEADS`: masked LM, token or sequence classification, told by the tensors;
`nv_esm.state_dict_mapping`, with the pure state-dict and config mappings that the tests, benchmarks and trainer
use), maps every tensor; every direction reads it. This command streams it: it reads and
writes one rule's tensors at a time, so converting a checkpoint needs memory for its largest layer, not for the
whole model.

SRC is a local folder (single or sharded safetensors), a Hugging Face Hub id, or, for hf-to-te, an original
fair-esm checkpoint (`esm2_t33_650M_UR50D.pt`; its `-contact-regression.pt` is read when it lies beside it).
bionemo-to-te reads NVIDIA's BioNeMo ESM-2 checkpoints (told from NVEsm's by their config fields and `model.` tensor
names; `nv_esm.bionemo_mapping`), te-to-bionemo writes theirs (config.json for their code, which is not included;
their layout has no contact head).
OUT is written in a temporary folder next to it and moved into place only when everything succeeded.
SRC may also be a local PEFT adapter folder (`adapter_config.json`, as `save_pretrained` writes): hf-to-te renames the
tensors of an adapter saved from transformers' ESM-2 (LoRA, `modules_to_save` heads) to NVEsm's, te-to-hf back
(`PeftModel.from_pretrained` also loads transformers' adapters onto NVEsm as they are).
`verify SRC OUT` checks an existing conversion, reading OUT as data (none of its code runs): every file of OUT must be
what the converter writes from SRC, every tensor of SRC mapped through `RULES` must equal OUT's bit for bit, and
both models' logits must agree on real proteins.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from nv_esm.cli import interrupted_start_up, print_error
from nv_esm.options import HelpFormatter, add_renamed, parse_size
from nv_esm.vocabulary import (
    CONVERT_DTYPE_NAMES,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_VERIFY_ATOL,
    TE_FP32_VERIFY_ATOL,
    VERIFY_DEVICES,
)

EPILOG = f"""examples:
  # a transformers ESM-2 from the Hub -> NVEsm, checked against transformers on real proteins
  nv-esm convert hf-to-te facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify

  # bf16 weights in 2 GB shards, uploaded to a private Hub repository
  nv-esm convert hf-to-te facebook/esm2_t36_3B_UR50D ./esm2_3B_te --dtype bfloat16 \\
      --max-shard-size 2GB --push-to-hub my-org/esm2_t36_3B_te --private

  # an original fair-esm checkpoint (esm2_t33_650M_UR50D-contact-regression.pt beside it is read too)
  nv-esm convert hf-to-te ~/esm/esm2_t33_650M_UR50D.pt ./esm2_650M_te

  # back to a folder plain transformers loads (EsmForMaskedLM), replacing an older one
  nv-esm convert te-to-hf ./esm2_650M_te ./esm2_650M_hf --verify --overwrite

  # NVIDIA's BioNeMo checkpoint (bionemo-recipes' layout) -> NVEsm, and back to theirs
  nv-esm convert bionemo-to-te nvidia/esm2_t33_650M_UR50D ./esm2_650M_te --verify
  nv-esm convert te-to-bionemo ./esm2_650M_te ./esm2_650M_bionemo

  # a PEFT adapter trained on transformers' EsmForMaskedLM -> the same adapter under NVEsm's tensor names
  nv-esm convert hf-to-te ./esm2_lora ./esm2_lora_te

  # check an existing conversion: every tensor bit for bit through the mapping table, then the logit table (CPU)
  nv-esm convert verify facebook/esm2_t33_650M_UR50D ./esm2_650M_te --verify-device cpu

  # list what would be uploaded; nothing is sent
  nv-esm convert hf-to-te facebook/esm2_t6_8M_UR50D ./esm2_8M_te --push-to-hub me/esm2_8M_te --dry-run

Hub downloads and uploads use the usual huggingface_hub settings (HF_TOKEN or `hf auth login`, HF_HOME,
HF_HUB_OFFLINE). `verify SRC OUT` takes the direction from what SRC and OUT are and runs none of OUT's code: it
compares every file of OUT with what the converter writes from SRC (code and tokenizer byte for byte, config.json
field by field, nothing extra), maps every tensor of SRC through the table (cast to OUT's dtype, as converting does)
and compares it with OUT's bit for bit, naming each file, field or tensor that differs, then prints the logit
table. The logit table (--verify, verify) runs on the GPU when there is
one (--verify-device auto; Transformer Engine if installed), else on the CPU with the PyTorch backend; default
tolerances on max |logit difference| against the float32 source: float32 {DEFAULT_VERIFY_ATOL["float32"]:g} \
({TE_FP32_VERIFY_ATOL:g} when Transformer Engine runs: its GELU is the tanh approximation), bfloat16 \
{DEFAULT_VERIFY_ATOL["bfloat16"]:g}, float16 {DEFAULT_VERIFY_ATOL["float16"]:g}.

Staging folders (.OUT.partial-*) are removed on errors, Ctrl-C and SIGTERM; those of runs killed otherwise are
removed by the next run into the same parent folder.

exit status: 0 done; 1 conversion, verify or upload error (OUT untouched); 2 usage error;
3 --verify over tolerance (table printed, OUT not written) or verify found a difference;
130/143 interrupted by Ctrl-C/SIGTERM (OUT untouched)."""
COMMANDS = {
    "hf-to-te": "transformers/fair-esm -> NVEsm",
    "te-to-hf": "back",
    "bionemo-to-te": "NVIDIA's BioNeMo ESM-2 layout -> NVEsm",
    "te-to-bionemo": "back",
    "verify": "check an existing OUT against SRC",
}
# Options that only conversions take (verify reads, writes nothing).
CONVERT_ONLY = ("dtype", "max_shard_size", "overwrite", "verify", "push_to_hub", "private", "commit_message", "dry_run")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line (see EPILOG); `prog` names the command in the usage line (default nv-esm convert)."""
    parser = argparse.ArgumentParser(
        prog=prog or "nv-esm convert",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "command", choices=list(COMMANDS), help="; ".join(f"{name}: {text}" for name, text in COMMANDS.items())
    )
    parser.add_argument(
        "source", metavar="SRC", help="checkpoint folder, Hub id (org/name), fair-esm .pt file or PEFT adapter folder"
    )
    parser.add_argument(
        "out",
        metavar="OUT",
        type=Path,
        help="output folder (absent or empty unless --overwrite); verify: the converted one",
    )
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of SRC (default: the main branch)")
    parser.add_argument(
        "--dtype", choices=sorted(CONVERT_DTYPE_NAMES), help="dtype of the written weights (default: as SRC)"
    )
    parser.add_argument(
        "--max-shard-size", type=parse_size, metavar="SIZE",
        help=f"largest weights file, e.g. 500MB or 2GiB (default {DEFAULT_MAX_SHARD_SIZE}); more files get an index; "
        "at least the largest tensor (it is not split)",
    )  # fmt: skip
    add_renamed(parser, parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty"))
    parser.add_argument("--verify", action="store_true", help="compare both models' logits on 22 real proteins")
    parser.add_argument(
        "--verify-atol", type=float, metavar="ATOL", help="logit tolerance of --verify and verify (default: by dtype)"
    )
    parser.add_argument(
        "--verify-device", choices=VERIFY_DEVICES, help="where --verify and verify run the models (default: auto)"
    )
    parser.add_argument(
        "--push-to-hub", metavar="REPO_ID", help="upload OUT to this Hub model repository (default: no upload)"
    )
    parser.add_argument("--private", action="store_true", help="create the Hub repository private")
    parser.add_argument(
        "--commit-message", help="commit message of the upload (default: names OUT, the command and SRC)"
    )
    parser.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list the files, upload nothing")
    return parser


class Interrupted(KeyboardInterrupt):
    """A signal asked the process to stop; raised like Ctrl-C's KeyboardInterrupt so that staging is cleaned up."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises `Interrupted`, as Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command-line entry point; returns the exit status. `prog`: the command's name in usage and errors."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)  # --help answers here, before torch and transformers are imported
    with interrupted_start_up(parser.prog):  # Ctrl-C during these seconds of imports: one line, status 130
        from safetensors import SafetensorError

        from nv_esm.conversion import ConvertOptions, convert, is_adapter_folder
        from nv_esm.conversion_plan import DIRECTIONS
        from nv_esm.hub_folder import push_to_hub
        from nv_esm.verification import VerificationFailed

    given = {flag for flag, value in vars(args).items() if value not in (None, False)}
    if args.command == "verify":
        for flag in sorted(given & set(CONVERT_ONLY)):
            parser.error(f"--{flag.replace('_', '-')} does not apply to verify (it writes nothing)")
    if is_adapter_folder(args.source):  # a PEFT adapter: its tensors renamed, one file, no model to compare
        if args.command == "verify":
            parser.error("verify compares models; SRC is a PEFT adapter folder (load it onto the model instead)")
        for flag in sorted(given & {"verify", "max_shard_size"}):
            parser.error(f"--{flag.replace('_', '-')} does not apply to a PEFT adapter folder (SRC)")
    for flag, needed in (("private", "push_to_hub"), ("commit_message", "push_to_hub"), ("dry_run", "push_to_hub"),
                         ("verify_atol", "verify"), ("verify_device", "verify")):  # fmt: skip
        if flag in given and needed not in given and args.command != "verify":
            parser.error(f"--{flag.replace('_', '-')} needs --{needed.replace('_', '-')}")
    try:
        with sigterm_as_interrupt():
            if args.command == "verify":
                return _main_verify(args, parser.prog)
            options = ConvertOptions(
                revision=args.revision,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size or parse_size(DEFAULT_MAX_SHARD_SIZE),
                force=args.overwrite,
                verify=args.verify,
                verify_atol=args.verify_atol,
                verify_device=args.verify_device or "auto",
                hub_repo_id=args.push_to_hub,
            )
            result = convert(DIRECTIONS[args.command], args.source, args.out, options)
    except VerificationFailed as failure:
        print(failure.report.table(), file=sys.stderr)
        print_error(parser.prog, f"{failure}; {args.out} was not written.")
        return 3
    except (ValueError, OSError, SafetensorError) as error:
        print_error(parser.prog, error)
        return 1
    except KeyboardInterrupt as interrupt:
        signum = interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT
        untouched = "" if args.command == "verify" else f"; {args.out} was not written"
        print_error(parser.prog, f"interrupted ({signal.Signals(signum).name}){untouched}.")
        return 128 + signum
    if result.report is not None:
        print(result.report.table())
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(result.summary())
    if args.push_to_hub:
        message = args.commit_message or f"Upload {args.out.name} ({args.command} of {args.source})"
        try:
            push_to_hub(args.out, args.push_to_hub, args.private, message, args.dry_run)
        except Exception as error:
            print_error(parser.prog, f"upload to {args.push_to_hub} failed ({args.out} is complete): {error}")
            return 1
    return 0


def _main_verify(args: argparse.Namespace, prog: str) -> int:
    from nv_esm.conversion import verify_folder

    check = verify_folder(args.source, args.out, args.revision, args.verify_atol, args.verify_device or "auto")
    print(check.text())
    if check.passed:
        return 0
    print_error(prog, f"verify failed: {check.verdict()}.")
    return 3


if __name__ == "__main__":
    sys.exit(main())
