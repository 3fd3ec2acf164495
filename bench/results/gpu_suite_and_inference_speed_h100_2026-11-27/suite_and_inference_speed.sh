# One H100 (carry [".gpu"]): the whole suite at the head, then 650M inference speed (default vs eager vs the port)
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 250 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=10 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/r/suite.log | tail -8; pack
timeout $(left 345) python bench/benchmark.py --shapes 650M --proteins 64 16 --modes infer \
  --variants te_port nv_thd nv_thd_graphs --out $OUT/r/bench > $OUT/r/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"; grep '^{' $OUT/r/bench.log | cut -c1-200; pack
