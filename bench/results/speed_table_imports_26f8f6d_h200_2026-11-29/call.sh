#!/usr/bin/env bash
# At 26f8f6d: the model alone on the embed/PLL jobs' batches (bench/job_benchmark.py; written here in
# today's options: the call ran `--jobs --in-process`, which then meant no job and no user loop, the loop it was
# meant to run too came in a later call); the import profile of a fresh `nv-esm embed` of 2,000 proteins; three
# fresh imports of nv_esm.embed; the steady-state table's default (nv_thd_graphs) against eager (nv_thd), 650M at 16 and
# 64 proteins, training and inference. From the repository root on the GPU machine, .gpu/ (TE) carried:
#   source .gpu/activate.sh; bash bench/results/speed_table_imports_26f8f6d_h200_2026-11-29/call.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python bench/job_benchmark.py --no-jobs --no-in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
python -W ignore -c "import transformer_engine.pytorch, transformers, nv_esm.embed, nv_esm.score, nv_esm.proteingym; from transformers import EsmModel"
python -m nv_esm embed /tmp/jb/nv /tmp/jb/proteins_2k.fasta /tmp/first --no-progress > "$OUT/embed_first.log" 2>&1
timeout 200 python bench/job_benchmark.py --no-jobs --no-in-process --work /tmp/jb --out "$OUT/jobs" > "$OUT/jobs.log" 2>&1
python -X importtime -m nv_esm embed /tmp/jb/nv /tmp/jb/proteins_2k.fasta /tmp/importtime --no-progress > "$OUT/embed_importtime.log" 2> "$OUT/embed_importtime.txt"
for k in 1 2 3; do
  python -c "import time, nv_esm.job_clock as c; s=c.process_start_time(); import nv_esm.embed; print('import nv_esm.embed', round(time.time()-s, 2), 's from process start')" >> "$OUT/import_repeats.txt" 2>&1
done
timeout 240 python bench/benchmark.py --shapes 650M --proteins 16 64 --modes train infer --variants nv_thd nv_thd_graphs --out "$OUT/table" > "$OUT/table.log" 2>&1
cd "$OUT"; cp jobs/job_benchmark.json . 2>/dev/null; tar czf logs.tgz jobs workload table embed_*.txt embed_*.log; rm -rf jobs workload; tail -5 jobs.log; cat import_repeats.txt; tail -12 table.log
