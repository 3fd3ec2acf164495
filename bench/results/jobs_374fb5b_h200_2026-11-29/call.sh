#!/usr/bin/env bash
# Side by side at 374fb5b: every job of bench/job_benchmark.py, nv-esm and the careful transformers script, each a
# fresh process (after one untimed import of both sides' modules, so neither side's first process reads them from
# disk), then the model alone on the embed and PLL jobs' batches.
# From the repository root on the GPU machine, .gpu/ (TE) carried, OUT a folder:
#   source .gpu/activate.sh; bash bench/results/jobs_374fb5b_h200_2026-11-29/call.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python bench/job_benchmark.py --jobs --in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
python -W ignore -c "import transformer_engine.pytorch, transformers, nv_esm.embed, nv_esm.score, nv_esm.proteingym; from transformers import EsmModel"
python bench/job_benchmark.py --in-process --work /tmp/jb --out "$OUT/jobs" > "$OUT/jobs.log" 2>&1
cd "$OUT"; cp jobs/job_benchmark.json .; tar czf jobs_logs.tgz jobs workload; rm -rf jobs workload; tail -14 jobs.log
