"""The ESM-2 alphabet, FASTA reading and an example protein.

`ESM_VOCAB` is the 33-token vocabulary of every `facebook/esm2_*` checkpoint, in id order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

ESM_VOCAB = "<cls> <pad> <eos> <unk> L A G V S E R T I D P K Q N F Y M H W C X B U Z O . - <null_1> <mask>".split()
CLS, PAD, EOS, UNK, MASK = (ESM_VOCAB.index(t) for t in ("<cls>", "<pad>", "<eos>", "<unk>", "<mask>"))
RESIDUE_TO_ID = {token: index for index, token in enumerate(ESM_VOCAB) if len(token) == 1}  # 20 standard + XBUZO.-
STANDARD_AMINO_ACIDS = "LAGVSERTIDPKQNFYMHWC"
STANDARD_IDS = tuple(RESIDUE_TO_ID[a] for a in STANDARD_AMINO_ACIDS)  # 4..23

# UniProt P42212, green fluorescent protein (Aequorea victoria): the demo's and the tests' real protein.
GFP = (
    "MSKGEELFTGVVPILVELDGDVNGHKFSVSGEGEGDATYGKLTLKFICTTGKLPVPWPTLVTTFSYGVQCFSRYPDHMKQHDFFKSAMPEGYVQERTIFF"
    "KDDGNYKTRAEVKFEGDTLVNRIELKGIDFKEDGNILGHKLEYNYNSHNVYIMADKQKNGIKVNFKIRHNIEDGSVQLADHYQQNTPIGDGPVLLPDNHY"
    "LSTQSALSKDPNEKRDHMVLLEFVTAAGITHGMDELYK"
)


def read_fasta(path: Path) -> list[tuple[str, str]]:
    """(first word of the header, sequence) of each record."""
    with open(path) as lines:
        return [(header.split()[0], sequence) for header, sequence in iter_fasta(lines, path)]


def iter_fasta(lines: Iterable[str], path: Path, empty_ok: bool = False) -> Iterator[tuple[str, str]]:
    """(header, sequence) of each FASTA record of `lines` (`iter_fasta_lines` without the line numbers)."""
    for header, sequence, _ in iter_fasta_lines(lines, path, empty_ok):
        yield header, sequence


def iter_fasta_lines(lines: Iterable[str], path: Path, empty_ok: bool = False) -> Iterator[tuple[str, str, int]]:
    """(header, sequence, the header's line number, from 1) of each FASTA record of `lines`, read from `path` (named
    in errors). Records may span lines; `;` lines are comments. A sequence line before the first header raises
    ValueError, and so does an empty record unless `empty_ok` (then its sequence is "")."""
    header, parts, header_line = None, [], 0
    for number, line in enumerate(lines, 1):
        if line.startswith(";"):
            continue
        if line.startswith(">"):
            if header is not None:
                yield header, _fasta_sequence(header, parts, path, empty_ok), header_line
            header, parts, header_line = line[1:].strip(), [], number
        elif line.strip():
            if header is None:
                raise ValueError(f"{path}, line {number}: sequence before the first '>' header.")
            parts.append("".join(line.split()))
    if header is not None:
        yield header, _fasta_sequence(header, parts, path, empty_ok), header_line


def _fasta_sequence(header: str, parts: list[str], path: Path, empty_ok: bool) -> str:
    if not parts and not empty_ok:
        raise ValueError(f"{path}: FASTA record '>{header}' has an empty sequence.")
    return "".join(parts)


def text_lines(raw: IO[bytes], path: Path, digest: Any = None) -> Iterator[str]:
    """UTF-8 lines of a binary file (a byte-order mark skipped), each fed to `digest` first."""
    for number, line in enumerate(raw, 1):
        if digest is not None:
            digest.update(line)
        try:
            yield line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}, line {number}: not UTF-8 text ({error.reason} at byte {error.start}).") from None
