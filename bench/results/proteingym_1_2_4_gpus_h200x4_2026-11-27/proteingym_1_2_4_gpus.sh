# 4 GPUs (carry [".gpu", "bench/data"]): nv-esm proteingym over the 217 reference rows (2.48M stand-in rows, 650M random, bf16) on 1, 2 and 4 GPUs
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt
timeout 585 python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --gpus 1 2 4 --baseline-wild-types 0 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_gpus.json \
  > $OUT/r/proteingym.log 2>&1
echo "pg rc=$? $(( $(date +%s) - start )) s"; grep -v Warn $OUT/r/proteingym.log | tail -n 10 | cut -c1-300; pack
