# one GPU, from the repository root (run's carry: [".gpu"]): embed and score twice per process, four variants.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 560 python bench/inference_warmup.py --shape 650M --proteins 10000 --mutants 5000 --out $OUT/r > $OUT/r/warmup.log 2>&1
echo "warmup rc=$?"; tail -6 $OUT/r/warmup.log
for f in $OUT/r/*.log; do grep -v "Warning\|warn\|get_qkv_layout" $f | tail -40 > $f.tail; rm $f; done
tar czf $OUT/r.tgz -C $OUT r
