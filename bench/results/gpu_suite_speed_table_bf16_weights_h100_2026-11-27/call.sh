# nvidia-h100-x1 (carry [".gpu"]), from the repository root: bash bench/results/gpu_suite_speed_table_bf16_weights_h100_2026-11-27/call.sh
# The whole suite at the head, then the speed table (650M, 16 and 64 proteins) with the plain TE port, eager, the
# default (graphs), graphs with bf16 weights and AdamW on fp32 master copies, and FP8 graphs, in one run.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }; left() { echo $(( $1 - $(el) )); }
R=$OUT/r; mkdir -p $R; nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt; pack() { tar czf $OUT/r.tgz -C $OUT r; }
timeout 290 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=15 tests > $R/suite.log 2>&1
echo "suite rc=$? $(el) s"; grep -E "passed|failed|FAILED|ERROR" $R/suite.log | tail -8; pack
timeout $(left 575) python bench/benchmark.py --shapes 650M --proteins 16 64 --modes train infer \
  --variants te_port nv_thd nv_thd_graphs nv_thd_graphs_bf16w nv_thd_graphs_fp8 --out $R/speed > $R/speed.log 2>&1
echo "speed rc=$? $(el) s"; grep '^{' $R/speed.log | cut -c1-170; pack
