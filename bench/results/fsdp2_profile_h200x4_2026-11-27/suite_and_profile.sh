# 4-GPU machine, from the repository root (carry [".gpu"]): the whole suite, then the 2-GPU FSDP2 step traced
# (650M, 16k tokens per GPU) with host regions.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/tree.txt
timeout 360 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=15 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/r/suite.log | tail -12; pack
timeout $(left 570) python bench/recipe_checks.py profile --shape 650M --budget 16384 --out /tmp/prof \
  --extra --data-parallel shard > $OUT/r/profile.log 2>&1
echo "profile rc=$? $(( $(date +%s) - start )) s"; cp /tmp/prof/*.json $OUT/r/ 2>/dev/null; tail -3 $OUT/r/profile.log; pack
