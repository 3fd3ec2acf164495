# 4 GPUs (carry [".gpu"]): the whole suite at head; 650M inference at 64 proteins with eager_margin 0 (head) and 0.03 (one GPU); a traced 15B step (4 GPUs, 8k tokens per GPU, bf16)
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt
timeout 330 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=15 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "passed|failed|FAILED|ERROR" $OUT/r/suite.log | tail -8; pack
for m in 0.0 0.03; do sed -i "s/^    eager_margin = [0-9.]* /    eager_margin = $m /" modeling_nv_esm_graphs.py
  CUDA_VISIBLE_DEVICES=0 timeout $(left 420) python bench/benchmark.py --shapes 650M --proteins 64 --modes infer \
    --variants nv_thd nv_thd_graphs --out $OUT/r/bench_margin$m > $OUT/r/bench_margin$m.log 2>&1
  echo "bench $m rc=$? $(( $(date +%s) - start )) s"; grep '^{' $OUT/r/bench_margin$m.log | cut -c1-160; pack; done
git checkout modeling_nv_esm_graphs.py
timeout $(left 560) python bench/recipe_checks.py fit --shape 15B --gpus 4 --budget 8192 --steps 13 --out /tmp/p15 \
  --extra --profile-steps 3 --log-every 8 > $OUT/r/profile15.log 2>&1
echo "profile rc=$? $(( $(date +%s) - start )) s"; cp /tmp/p15/*.json $OUT/r/ 2>/dev/null
timeout $(left 595) python -m nv_esm.trace_summary /tmp/p15/fit_*/profile/rank*.json.gz --json $OUT/r/trace_15B.json > $OUT/r/trace_15B.txt 2>&1
echo "summary rc=$? $(( $(date +%s) - start )) s"; head -c 2000 $OUT/r/trace_15B.txt; pack
