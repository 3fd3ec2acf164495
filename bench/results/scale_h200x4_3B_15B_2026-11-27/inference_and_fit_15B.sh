# 4 GPUs (carry [".gpu"]): embed 10k / score 5k on 1, 2, 4 GPUs; then 15B at 8k tokens per GPU, bf16 and FP8 block, no recomputation (else --recompute-mlp), 24 steps
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
keep() { for d in $1/*/; do m=$OUT/r/$(basename $1)/$(basename $d); mkdir -p $m; cp $d/metrics.jsonl $m/ 2>/dev/null; done; for l in $1/*.log; do tail -n 8 $l > $OUT/r/$(basename $1)/$(basename $l).tail; done; cp $1/*.json $OUT/r/ 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 170 python bench/inference_scaling.py --shape 650M --proteins 10000 --mutants 5000 --gpus 1 2 4 --out $OUT/r/inference > $OUT/r/inference.log 2>&1
echo "inference rc=$? $(( $(date +%s) - start )) s"; grep -v Warn $OUT/r/inference.log | tail -n 10 | cut -c1-220; pack
mems=("" "--recompute-mlp"); [ $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0) -lt 100000 ] && mems=("--activation-checkpointing")
for fp8 in "" "--fp8 all --fp8-recipe block"; do for mem in "${mems[@]}"; do
  [ $(left 560) -lt 60 ] && break 2
  timeout $(left 585) python bench/recipe_checks.py fit --shape 15B --gpus 4 --budget 8192 --steps 24 --out /tmp/f15 \
    --extra $fp8 $mem > $OUT/r/fit15.log 2>&1; rc=$?
  echo "fit15 '$fp8' '$mem' rc=$rc $(( $(date +%s) - start )) s"; keep /tmp/f15; tail -n 3 $OUT/r/fit15.log | cut -c1-250; pack
  [ $rc = 0 ] && break
done; done
