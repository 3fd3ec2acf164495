# 4-GPU machine, repo root (carry [".gpu","bench/data"]). GPU0: A/B of the tiled add_bias_residual vs 4289175's
# model code; GPU1: ProteinGym side by side (20 rows; bf16, fp8); GPU2: kernel tests. Then 15B on 4 GPUs.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
keep() { for d in $1/*/; do m=$OUT/r/$(basename $1)/$(basename $d); mkdir -p $m; cp $d/metrics.jsonl $m/ 2>/dev/null; tail -5 $d/*.log > $m/tail.log 2>/dev/null; done; cp $1/*.json $OUT/r/ 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
CUDA_VISIBLE_DEVICES=0 timeout 200 python bench/ab_model_code.py --old bench/data/old_tree --new . \
  --cases graphs_infer eager_infer --rounds 5 --out $OUT/r/ab_tiled.json > $OUT/r/ab.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 250 python bench/proteingym_benchmark.py --shape 650M --limit 20 \
  --reference bench/data/DMS_substitutions.csv --variants bf16 fp8 --checkpoint-cache /tmp/pg \
  --out $OUT/r/proteingym_650M_side_by_side.json > $OUT/r/pg.log 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 200 python -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py > $OUT/r/kernels.log 2>&1 &
wait; echo "phase1 $(( $(date +%s) - start )) s"; grep "new/old" $OUT/r/ab.log; tail -2 $OUT/r/kernels.log
grep -v "Warn\|warn" $OUT/r/pg.log | tail -12 > $OUT/r/pg.tail; rm $OUT/r/pg.log; cat $OUT/r/pg.tail; pack
for fp8 in "" "--fp8 all --fp8-recipe block"; do
timeout $(left 540) python bench/recipe_checks.py fit --shape 15B --gpus 4 --budget 8192 --steps 14 \
  --activation-checkpointing --out /tmp/f15 --extra $fp8 > $OUT/r/fit15.log 2>&1
echo "fit15 '$fp8' rc=$? $(( $(date +%s) - start )) s"; keep /tmp/f15; tail -4 $OUT/r/fit15.log; pack
done
