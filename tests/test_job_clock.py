"""Where a command's time went (nv_esm/job_clock.py): phases charged to the innermost one open, the process's start
read from the system, and the one line `nv-esm embed`, `score` and `proteingym` end with, whose token count is
checked against the tokens of the proteins the command ran (counted here from the FASTA file)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from nv_esm import embed, job_clock, proteingym, score
from nv_esm.job_clock import JobClock, ReportingProgress

CPU = ("--device", "cpu", "--backend", "torch", "--no-progress")
TIME_LINE = re.compile(
    r"^time: start-up [\d.]+ s, .*batches [\d.]+ s \(first result at [\d.]+ s; ([\d,]+) tokens, [\d,]+k tokens/s\)"
    r".*; ([\d.]+) s in all$",
    re.MULTILINE,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_phases_charge_the_innermost_open_one(monkeypatch):
    clock_time = FakeTime()
    monkeypatch.setattr(job_clock.time, "time", clock_time)
    clock = JobClock(started=990.0)  # 10 s of start-up
    with clock.phase("input"):
        clock_time.now += 2
    with clock.phase("batches"):
        clock_time.now += 3
        clock.result_back()  # the first result, 3 s into the batches
        clock_time.now += 1
        clock.result_back()  # not the first: ignored
        with clock.phase("writing"):  # a write waited for inside the loop is writing, not batches
            clock_time.now += 4
        clock_time.now += 5
    clock_time.now += 0.5  # outside every phase
    clock.tokens = 2_500_000
    line = clock.line()  # charges the time since the last phase to "other"
    assert clock.seconds == {"start-up": 10, "input": 2, "load": 0, "batches": 9, "writing": 4, "other": 0.5}
    assert clock.first_result == 3
    assert line == (
        "time: start-up 10.0 s, input 2.0 s, batches 9.0 s (first result at 3.0 s; 2,500,000 tokens, 278k tokens/s), "
        "writing 4.0 s, other 0.5 s; 25.5 s in all"
    )
    with pytest.raises(ValueError, match="unknown phase"):
        with clock.phase("thinking"):
            pass


def test_reporting_progress_tells_the_clock_and_moves_the_bar(monkeypatch):
    clock_time = FakeTime()
    monkeypatch.setattr(job_clock.time, "time", clock_time)
    moved = []

    class Bar:
        def update(self, count):
            moved.append(count)

        def close(self):
            moved.append("closed")

    clock = JobClock(started=1000.0)
    progress = ReportingProgress(Bar(), clock)
    with clock.phase("batches"):
        clock_time.now += 1.5
        progress.update(7)
        clock_time.now += 1
        progress.update(3)
    progress.close()
    assert clock.first_result == 1.5 and moved == [7, 3, "closed"]


def test_the_process_start_is_read_from_the_system():
    """A child that sleeps before importing the clock: its start lies before the sleep, not at the import."""
    code = (
        "import time; time.sleep(0.6); from nv_esm.job_clock import process_start_time; "
        "print(time.time() - process_start_time())"
    )
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.6 <= age < 10, age


def residue_tokens(sequences: list[str]) -> int:
    return sum(len(sequence) + 2 for sequence in sequences)


def test_embed_ends_with_where_its_time_went(checkpoint, tmp_path, capsys):
    generator = torch.Generator().manual_seed(3)
    sequences = ["".join("ACDEFGHIKLMNPQRSTVWY"[i] for i in torch.randint(0, 20, (n,), generator=generator)) for n in
                 torch.randint(1, 60, (9,), generator=generator).tolist()]  # fmt: skip
    fasta = tmp_path / "p.fasta"
    fasta.write_text("".join(f">p{i}\n{s}\n" for i, s in enumerate(sequences)))
    started = time.time()
    assert embed.main([str(checkpoint), str(fasta), str(tmp_path / "out"), *CPU]) == 0
    [(tokens, total)] = TIME_LINE.findall(capsys.readouterr().out)
    assert int(tokens.replace(",", "")) == residue_tokens(sequences)
    assert float(total) >= time.time() - started - 0.1  # counted from the process's start, before this test


def test_score_and_proteingym_end_with_where_their_time_went(checkpoint, tmp_path, capsys):
    wild_type = "MKTAYIAKQRQISFVKSHFSRQ"
    (tmp_path / "wt.fasta").write_text(f">wt\n{wild_type}\n")
    (tmp_path / "m.csv").write_text("mutant,DMS_score\nK2A,0.5\nT3G,0.1\nK2A:Q11R,0.3\n")
    argv = [str(checkpoint), str(tmp_path / "wt.fasta"), str(tmp_path / "s.csv"), "--mutants", str(tmp_path / "m.csv")]
    assert score.main([*argv, *CPU]) == 0
    [(tokens, _)] = TIME_LINE.findall(capsys.readouterr().out)
    assert int(tokens.replace(",", "")) == 3 * residue_tokens([wild_type])  # masked copies: 2; 3; 2 and 11
    (tmp_path / "assays").mkdir()
    (tmp_path / "assays" / "A.csv").write_text((tmp_path / "m.csv").read_text())
    (tmp_path / "ref.csv").write_text(f"DMS_id,DMS_filename,target_seq\nA,A.csv,{wild_type}\n")
    argv = [str(checkpoint), str(tmp_path / "ref.csv"), str(tmp_path / "assays"), str(tmp_path / "pg")]
    assert proteingym.main([*argv, "--methods", "masked-marginals", *CPU]) == 0
    assert len(TIME_LINE.findall(capsys.readouterr().out)) == 1
