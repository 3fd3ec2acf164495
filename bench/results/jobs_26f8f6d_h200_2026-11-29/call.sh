#!/usr/bin/env bash
# At 26f8f6d (the fixes of the first session of 2026-11-29 in place): the embed and PLL jobs side by side with the
# careful transformers scripts, after bench/job_benchmark.py's untimed warm-up run of each side (the model alone
# on their batches, the benchmark's last step, did not finish inside the 400 s given; it ran in the next call); then
# nv-esm embed of the 20,000 proteins at 32,768 and 65,536 tokens per batch (its `time:` lines). From the repository root on the GPU machine, .gpu/ (TE) carried, OUT a folder:
#   source .gpu/activate.sh; bash bench/results/jobs_26f8f6d_h200_2026-11-29/call.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt"
python bench/job_benchmark.py --no-jobs --no-in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
python -W ignore -c "import transformer_engine.pytorch, transformers, nv_esm.embed, nv_esm.score, nv_esm.proteingym; from transformers import EsmModel"
timeout 400 python bench/job_benchmark.py --jobs embed_2k embed_20k pll_60 --no-in-process --work /tmp/jb --out "$OUT/jobs" > "$OUT/jobs.log" 2>&1
for budget in 32768 65536; do
  started=$(date +%s.%N)
  timeout 70 python -m nv_esm embed /tmp/jb/nv /tmp/jb/proteins_20k.fasta /tmp/budget_$budget \
    --tokens-per-batch $budget --no-progress > "$OUT/budget_$budget.log" 2>&1
  echo "wall $(python -c "print(round($(date +%s.%N) - $started, 2))") s" >> "$OUT/budget_$budget.log"
  grep -h "^time:\|^wall" "$OUT/budget_$budget.log"
done
cd "$OUT"; cp jobs/job_benchmark.json . 2>/dev/null; tar czf jobs_logs.tgz jobs workload budget_*.log; rm -rf jobs workload; tail -14 jobs.log
