# 2-GPU machine (carry [".gpu"]): the whole suite at head (not yet run on a GPU: precision object, per-token indices,
# hosted-shape timing fixes, float64 index_add_ pooling, CP gradient scaling), then 3B weak scaling at 16k per GPU.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt
timeout 380 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=15 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/r/suite.log | tail -12; pack
timeout $(left 585) python bench/recipe_checks.py scale --shape 3B --budgets 16384 --gpus 2 --layouts shard \
  --steps 30 --out /tmp/s3 --extra --recompute-mlp > $OUT/r/scale3B.log 2>&1
echo "scale rc=$? $(( $(date +%s) - start )) s"; cp /tmp/s3/*.json $OUT/r/ 2>/dev/null; tail -30 $OUT/r/scale3B.log | cut -c1-220; pack
