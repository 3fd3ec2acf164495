#!/usr/bin/env bash
# Where a fresh command's time goes at 7a5119c's model code (with the commands' time line added): import times,
# a py-spy wall-clock profile of a fresh `nv-esm embed` of 2,000 proteins (run first: nothing compiled or cached yet),
# then the nv-esm side of bench/job_benchmark.py, the in-process loop (default, eager) and the model alone.
# From the repository root on the GPU machine, with .gpu/ (TE) and .tools/ (py-spy) carried; OUT a folder:
#   source .gpu/activate.sh; bash bench/results/jobs_7a5119c_h200_2026-11-29/call.sh
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repository's modules (not pip-installed there)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
python bench/job_benchmark.py --jobs --in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
python -c "import time; t=time.time(); import transformer_engine.pytorch; t1=time.time(); import nv_esm.embed; print(f'te {t1-t:.2f} s, nv_esm.embed after it {time.time()-t1:.2f} s')" > "$OUT/import_seconds.txt" 2>&1
python -X importtime -c "import transformer_engine.pytorch; import nv_esm.embed" 2> "$OUT/importtime.txt"
TRANSFORMERS_VERBOSITY=info .tools/py_spy-0.4.3.data/scripts/py-spy record --idle --format raw -r 100 \
  -o "$OUT/embed_2k_py_spy.txt" -- python -m nv_esm embed /tmp/jb/nv /tmp/jb/proteins_2k.fasta /tmp/jb/spy_out \
  --no-progress > "$OUT/embed_2k_py_spy.log" 2>&1
python bench/job_benchmark.py --sides nv --in-process default eager --work /tmp/jb --out "$OUT/jobs" > "$OUT/jobs.log" 2>&1
tail -20 "$OUT/jobs.log"; cat "$OUT/import_seconds.txt"; tail -3 "$OUT/embed_2k_py_spy.log"
