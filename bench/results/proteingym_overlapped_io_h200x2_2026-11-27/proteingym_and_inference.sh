# 2 GPUs (carry [".gpu", "bench/data"]): nv-esm proteingym over the 217 reference rows (2.48M stand-in rows), 650M random, bf16, 1 and 2 GPUs
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; nproc > $OUT/r/cpus.txt
timeout $(left 585) python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --gpus 1 2 --baseline-wild-types 0 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_gpus.json \
  > $OUT/r/proteingym.log 2>&1
echo "pg rc=$? $(( $(date +%s) - start )) s"; grep -v Warn $OUT/r/proteingym.log | tail -n 8 | cut -c1-300; pack
timeout $(left 590) python bench/inference_scaling.py --shape 650M --proteins 10000 --mutants 5000 --gpus 1 2 --out $OUT/r/inference > $OUT/r/inference.log 2>&1
echo "inference rc=$? $(( $(date +%s) - start )) s"; grep -v Warn $OUT/r/inference.log | tail -n 12 | cut -c1-250; pack
