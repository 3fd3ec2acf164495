# 4 GPUs (carry [".gpu"]): 3B weak scaling at 16k tokens per GPU (1, 2, 4 GPUs, FSDP2, --recompute-mlp, 50 steps), then one 64k-token protein on 3B with --cp 4
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
keep() { for d in $1/*/; do m=$OUT/r/$(basename $1)/$(basename $d); mkdir -p $m; cp $d/metrics.jsonl $m/ 2>/dev/null; done; for l in $1/*.log; do tail -n 8 $l > $OUT/r/$(basename $1)/$(basename $l).tail; done; cp $1/*.json $OUT/r/ 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt 2>/dev/null
timeout $(left 380) python bench/recipe_checks.py scale --shape 3B --budgets 16384 --gpus 2 4 --layouts shard \
  --steps 50 --out /tmp/s3 --extra --recompute-mlp > $OUT/r/scale3B.log 2>&1
echo "scale rc=$? $(( $(date +%s) - start )) s"; keep /tmp/s3; tail -n 30 $OUT/r/scale3B.log | cut -c1-200; pack
timeout $(left 590) python bench/recipe_checks.py long --shape 3B --lengths 65536 --cps 4 --steps 14 --out /tmp/l3 \
  > $OUT/r/long3B.log 2>&1
echo "long rc=$? $(( $(date +%s) - start )) s"; keep /tmp/l3; tail -n 30 $OUT/r/long3B.log | cut -c1-200; pack
