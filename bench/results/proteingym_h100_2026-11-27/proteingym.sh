# one GPU, from the repository root (run's carry: [".gpu", "bench/data"]): nv-esm proteingym over all 217 reference
# wild types (650M, random weights, stand-in assays), ProteinGym's loop side by side on 3 wild types.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 570 python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_650M_bf16.json > $OUT/r/pg.log 2>&1
echo "pg rc=$?"; grep -v "Warning\|warn\|get_qkv_layout" $OUT/r/pg.log | tail -30
grep -v "Warning\|warn\|get_qkv_layout" $OUT/r/pg.log | tail -200 > $OUT/r/pg.log.tail; rm $OUT/r/pg.log
tar czf $OUT/r.tgz -C $OUT r
