"""The README's Python snippets run as written, in order, on a CPU: after its Quickstart conversion (of the bundled
tiny checkpoint), its `nv-esm embed` command and its two `nv-esm score` commands, in a temporary folder."""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import ROOT


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def readme_command(start: str) -> list[str]:
    """The arguments (after `nv-esm COMMAND`) of the README's shell line that starts with `start`, comment dropped."""
    line = next(line for block in readme_blocks("bash") for line in block.splitlines() if line.startswith(start))
    return shlex.split(line.split("#")[0])[2:]


def test_the_readme_snippets_run_as_written(tmp_path, monkeypatch):
    from convert_checkpoint import main as convert
    from nv_esm import embed, score
    from nv_esm.alphabet import GFP

    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").symlink_to(ROOT / "assets")
    assert convert(readme_command("nv-esm convert hf-to-te assets/esm2_tiny")) == 0
    (tmp_path / "proteins.fasta").write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nmskgeelftgvvpilvel\n")
    assert embed.main([*readme_command("nv-esm embed esm2_nv"), "--no-progress"]) == 0
    assert score.main([*readme_command("nv-esm score esm2_nv proteins.fasta"), "--no-progress"]) == 0
    (tmp_path / "gfp.fasta").write_text(f">GFP\n{GFP}\n")
    (tmp_path / "gfp_dms.csv").write_text("mutant,DMS_score\nS65T,1.2\nY66H,-0.4\nT203Y,0.3\nS65T:Y66H,-0.1\n")
    assert score.main([*readme_command("nv-esm score esm2_nv gfp.fasta"), "--no-progress"]) == 0
    blocks = readme_blocks("python")
    assert len(blocks) >= 4
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"README.md python block {number} fails: {type(error).__name__}: {error}\n{block}")
    assert (tmp_path / "runs" / "mlm" / "final" / "config.json").exists()
