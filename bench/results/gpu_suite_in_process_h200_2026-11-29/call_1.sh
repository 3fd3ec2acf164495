#!/usr/bin/env bash
# Call 1 (tree of the issue-61 work before its last fix): the in-process loop of bench/job_benchmark.py
# (from_pretrained, then 100 batches of 1-64 proteins: default, eager, transformers' sdpa; no warm-up run then: the
# default's process was the machine's first nv-esm process), then the whole test suite (aborted by an INTERNALERROR:
# a test fixture named `benchmark` clashed with pytest-benchmark's, installed on the GPU machine). From the repository
# root, .gpu/ carried, OUT a folder:  source .gpu/activate.sh; bash bench/results/gpu_suite_in_process_h200_2026-11-29/call_1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python bench/job_benchmark.py --no-jobs --no-in-process --no-steady --work /tmp/jb --out "$OUT/workload" > "$OUT/workload.log" 2>&1
timeout 150 python bench/job_benchmark.py --no-jobs --no-steady --no-warm-up --work /tmp/jb --out "$OUT/in_process" > "$OUT/in_process.log" 2>&1
cp "$OUT/in_process/job_benchmark.json" "$OUT/in_process.json" 2>/dev/null
tar czf "$OUT/in_process_logs.tgz" -C "$OUT" in_process; rm -rf "$OUT/in_process" "$OUT/workload"
timeout 300 python -m pytest -q -n 14 -rfEs -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
echo "exit $?" >> "$OUT/suite.log"; tail -25 "$OUT/suite.log"; python -c "import json; print(json.load(open('$OUT/in_process.json')).get('in_process'))"
