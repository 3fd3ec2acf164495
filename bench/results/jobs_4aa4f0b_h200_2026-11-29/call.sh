#!/usr/bin/env bash
# Side by side at 4aa4f0b: every job of bench/job_benchmark.py, nv-esm and the careful transformers script, each a
# fresh process; before it, a py-spy wall-clock profile of `nv-esm score` on the PLL job's 60 proteins (the graphs'
# decisions logged), and what importing each side's modules takes in a fresh process.
# From the repository root on the GPU machine, .gpu/ (TE) and .tools/ (py-spy) carried, OUT a folder:
#   source .gpu/activate.sh; bash bench/results/jobs_4aa4f0b_h200_2026-11-29/call.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python bench/job_benchmark.py --jobs --in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
for what in "import torch" "import torch; from transformers import EsmModel, EsmTokenizer" \
    "import transformer_engine.pytorch" "import transformer_engine.pytorch; import nv_esm.embed" "import nv_esm.score"; do
  python -W ignore -c "import time; t = time.time(); $what; print(f'{time.time() - t:.2f} s: $what')" >> "$OUT/import_seconds.txt" 2>&1
done
TRANSFORMERS_VERBOSITY=info .tools/py_spy-0.4.3.data/scripts/py-spy record --idle --format raw -r 100 \
  -o "$OUT/pll_60_py_spy.txt" -- python -m nv_esm score /tmp/jb/nv /tmp/jb/pll.fasta /tmp/jb/spy_pll.csv \
  --no-progress > "$OUT/pll_60_py_spy.log" 2>&1
python bench/job_benchmark.py --in-process --no-steady --work /tmp/jb --out "$OUT/jobs" > "$OUT/jobs.log" 2>&1
gzip -9 "$OUT/pll_60_py_spy.txt"; cd "$OUT"; cp jobs/job_benchmark.json .; tar czf jobs_logs.tgz jobs workload; rm -rf jobs workload
tail -12 jobs.log; cat import_seconds.txt; grep -v "^\s*\"\|Warn\|warn" pll_60_py_spy.log | tail -8
