# 4-GPU machine, from the repository root (run's carry: [".gpu"]): the whole test suite, the embed/score warm-up
# after add_bias_residual (one GPU), embed/score on 1/2/4 GPUs, and traces of 650M at 16k tokens on one GPU and
# on 2 with FSDP2 (--data-parallel shard).
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 270 python -m pytest -q -rfEs -n 14 -p no:cacheprovider --durations=5 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/r/suite.log | tail -12; pack
CUDA_VISIBLE_DEVICES=0 timeout $(left 360) python bench/inference_warmup.py --shape 650M --variants default \
  --out $OUT/r/warmup > $OUT/r/warmup.log 2>&1
echo "warmup rc=$? $(( $(date +%s) - start )) s"; grep "^default" $OUT/r/warmup.log; rm -f $OUT/r/warmup/*.log; pack
timeout $(left 480) python bench/inference_scaling.py --shape 650M --gpus 1 2 4 --out $OUT/r/inference \
  > $OUT/r/inference.log 2>&1
echo "inference rc=$? $(( $(date +%s) - start )) s"; grep gpu $OUT/r/inference.log; rm -f $OUT/r/inference/*.log; pack
timeout $(left 590) python bench/recipe_checks.py profile --shape 650M --budget 16384 --out /tmp/prof \
  --extra --data-parallel shard > $OUT/r/profile.log 2>&1
echo "profile rc=$? $(( $(date +%s) - start )) s"; cp /tmp/prof/*.json $OUT/r/ 2>/dev/null; tail -3 $OUT/r/profile.log; pack
