# 4-GPU machine, from the repository root: TE context parallelism's GPU tests (all-to-all and all-gather), the long
# protein check at 32k tokens on 1 / 2 / 4 GPUs, then embed/score scaling over 1/2/4 GPUs (graphs, and eager embed).
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
timeout 150 python -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_tensor_parallel.py > $OUT/r/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; tail -4 $OUT/r/tests.log; pack
timeout $(left 330) python bench/recipe_checks.py long --shape 650M --lengths 32768 --cps 2 4 --steps 16 \
  --out /tmp/long > $OUT/r/long.log 2>&1
echo "long rc=$? $(( $(date +%s) - start )) s"; cp /tmp/long/*.json $OUT/r/ 2>/dev/null
for f in /tmp/long/*/*.log /tmp/long/*.log; do [ -f $f ] && tail -n 3 $f > $OUT/r/tail_$(basename $f); done; pack
timeout $(left 530) python bench/inference_scaling.py --shape 650M --gpus 1 2 4 --out $OUT/r/inference \
  > $OUT/r/inference.log 2>&1
echo "inference rc=$? $(( $(date +%s) - start )) s"; grep gpu $OUT/r/inference.log; pack
timeout $(left 585) python bench/inference_scaling.py --shape 650M --gpus 1 2 --jobs embed --tag _eager \
  --out $OUT/r/inference --extra --no-cuda-graphs > $OUT/r/inference_eager.log 2>&1
echo "inference eager rc=$? $(( $(date +%s) - start )) s"; grep gpu $OUT/r/inference_eager.log; pack
