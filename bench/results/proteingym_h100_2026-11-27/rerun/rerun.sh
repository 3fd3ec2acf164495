# One H100 (carry [".gpu","bench/data"]): nv-esm proteingym on all 217 reference wild types (650M, bf16) with the
# command's own set-up/scoring timing; the A/B of the tiled add_bias_residual; the speed table's variants.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 300 python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --baseline-wild-types 0 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_650M_bf16.json > $OUT/r/pg.log 2>&1
echo "pg rc=$? $(( $(date +%s) - start )) s"; grep -v "Warn\|warn" $OUT/r/pg.log | tail -5; rm $OUT/r/pg.log; pack
timeout $(left 400) python bench/ab_model_code.py --old bench/data/old_tree --new . --cases graphs_infer \
  --rounds 5 --out $OUT/r/ab_tiled.json > $OUT/r/ab.log 2>&1
echo "ab rc=$? $(( $(date +%s) - start )) s"; grep "new/old" $OUT/r/ab.log; pack
timeout $(left 560) python bench/benchmark.py --shapes 650M --proteins 16 64 --modes infer train \
  --variants te_port nv_thd nv_thd_graphs --out $OUT/r/bench > $OUT/r/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"; tail -12 $OUT/r/bench.log; pack
