# one GPU, from the repository root: 3B at 8k tokens per step: activation offloading (all layers but the last, a
# quarter, a half) against graphs, eager, activation checkpointing and --recompute-mlp (speed, peak memory, losses).
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 570 python bench/recipe_checks.py offload --shape 3B --gpus 1 --budget 8192 --steps 12 --out /tmp/offload \
  > $OUT/r/offload.log 2>&1
echo "offload rc=$?"; cp /tmp/offload/*.json $OUT/r/ 2>/dev/null
for f in /tmp/offload/*.log; do tail -n 3 $f > $OUT/r/tail_$(basename $f); done
tail -3 $OUT/r/offload.log; tar czf $OUT/r.tgz -C $OUT r
