"""Outputs are written under fresh temporary names (`nv_esm.checkpoint_io.replaced_atomically`): a file or link
planted beside an output, under the temporary name an earlier version used or any other, is never written through.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nv_esm import embed, score
from nv_esm.alphabet import STANDARD_AMINO_ACIDS
from nv_esm.checkpoint_io import replaced_atomically, write_atomically

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")


def random_fasta(path: Path, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (3,), generator=generator).tolist()
    records = [
        "".join(STANDARD_AMINO_ACIDS[i] for i in torch.randint(0, 20, (n,), generator=generator)) for n in lengths
    ]
    path.write_text("".join(f">p{i}\n{sequence}\n" for i, sequence in enumerate(records)))
    return path


def plant_link(path: Path, victim: Path) -> bytes:
    """A link at `path` to `victim`, a file of random bytes; returns them."""
    content = os.urandom(64)
    victim.write_bytes(content)
    path.symlink_to(victim)
    return content


def test_score_never_writes_through_a_link_at_the_old_temporary_name(checkpoint, tmp_path):
    out = tmp_path / "out.csv"
    content = plant_link(tmp_path / "out.csv.tmp", tmp_path / "victim.txt")
    assert score.main([str(a) for a in (checkpoint, random_fasta(tmp_path / "p.fasta", 1), out, *CPU)]) == 0
    assert (tmp_path / "victim.txt").read_bytes() == content
    assert (tmp_path / "out.csv.tmp").readlink() == tmp_path / "victim.txt"
    assert out.read_text().startswith("id,residues,pll,pseudo_perplexity,status\n") and not out.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv", "out.csv.tmp", "p.fasta", "victim.txt"]


@pytest.mark.parametrize("command", ["embed", "score"])
def test_a_link_planted_at_the_lock_is_refused_and_left_alone(checkpoint, tmp_path, capsys, command):
    """The lock file a run writes its process into (`output_lock`) is not followed either: a link there is a file
    the command did not write."""
    fasta = random_fasta(tmp_path / "p.fasta", 2)
    if command == "embed":
        folder, out, lock, main = tmp_path / "out", tmp_path / "out", ".nv-esm-embed.lock", embed.main
    else:
        folder, out, lock, main = tmp_path / "out.csv.parts", tmp_path / "out.csv", ".nv-esm-score.lock", score.main
    folder.mkdir()
    content = plant_link(folder / lock, tmp_path / "victim.txt")
    assert main([str(a) for a in (checkpoint, fasta, out, *CPU)]) == 1
    error = capsys.readouterr().err.splitlines()[-1]  # (after transformers' bar of loading the weights, for embed)
    assert f"did not write ({lock})" in error or f"{lock} is a link, not nv-esm {command}'s lock file" in error, error
    assert (tmp_path / "victim.txt").read_bytes() == content and (folder / lock).is_symlink()


def test_replaced_atomically_makes_a_fresh_name_and_cleans_up(tmp_path):
    target = tmp_path / "target.txt"
    content = plant_link(tmp_path / "target.txt.tmp", tmp_path / "victim.txt")
    text = os.urandom(16).hex()
    write_atomically(target, text)
    assert target.read_text() == text and (tmp_path / "victim.txt").read_bytes() == content
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    with pytest.raises(RuntimeError), replaced_atomically(target) as temporary:  # a failed write: target as it was
        assert temporary.parent == tmp_path and temporary.name.startswith("target.txt.") and temporary.exists()
        temporary.write_text("half")
        raise RuntimeError
    assert target.read_text() == text and not temporary.exists()
    target.unlink()
    target.symlink_to(tmp_path / "victim.txt")  # the output itself a link: replaced, not written into
    write_atomically(target, text)
    assert not target.is_symlink() and target.read_text() == text and (tmp_path / "victim.txt").read_bytes() == content


def current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def test_a_picture_is_written_through_the_same_helper(tmp_path):
    """`nv_esm.plots.save_figure` (every PNG the commands draw) replaces its target through `replaced_atomically`: a
    link at the target is replaced, not written into; no temporary file is left."""
    pytest.importorskip("matplotlib")
    from nv_esm import plots

    png = tmp_path / "scores.png"
    content = plant_link(png, tmp_path / "victim.txt")
    scores = torch.randn(20, generator=torch.Generator().manual_seed(3)).tolist()
    assert plots.plot_scores({"masked marginal": scores}, scores[::-1], png) == png
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "victim.txt").read_bytes() == content
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scores.png", "victim.txt"]
