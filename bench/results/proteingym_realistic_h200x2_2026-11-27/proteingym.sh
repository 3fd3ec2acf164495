# 2-GPU machine (carry [".gpu", "bench/data"]): nv-esm proteingym over the 217 reference rows with stand-in assays of
# the reference's own numbers of mutants (2.47M rows, ~1 GB of CSV), 650M random weights, bf16, on 1 and 2 GPUs.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt
nproc > $OUT/r/cpus.txt
timeout $(left 590) python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --gpus 1 2 --baseline-wild-types 0 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_gpus.json \
  > $OUT/r/proteingym.log 2>&1
echo "pg rc=$? $(( $(date +%s) - start )) s"; tail -25 $OUT/r/proteingym.log | cut -c1-250; pack
