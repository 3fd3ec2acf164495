# 4-GPU machine (the one of warmup_scaling_profile.sh), from the repository root (with .gpu/): the whole suite again
# with each test's result as it ends (that run was cut at 270 s with one failure unnamed), then embed on 4 GPUs and
# score on 1/2/4 (its inference step stopped at its time limit after embed on 1 and 2).
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
timeout 400 python -m pytest -v -rfEs -n 14 -p no:cacheprovider --durations=15 tests > $OUT/r/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/r/suite.log | grep -v "^\[gw" | tail -8
grep -E "^\[gw.*(FAILED|ERROR)" $OUT/r/suite.log | head; grep -E "^[0-9.]+s (call|setup)" $OUT/r/suite.log | head -15; pack
timeout $(left 570) python bench/inference_scaling.py --shape 650M --gpus 1 2 4 --jobs score --out $OUT/r/inference \
  > $OUT/r/inference.log 2>&1
echo "score rc=$? $(( $(date +%s) - start )) s"; grep gpu $OUT/r/inference.log; rm -f $OUT/r/inference/*.log; pack
timeout $(left 590) python bench/inference_scaling.py --shape 650M --gpus 4 --jobs embed --out $OUT/r/inference \
  > $OUT/r/inference_embed4.log 2>&1
echo "embed4 rc=$? $(( $(date +%s) - start )) s"; grep gpu $OUT/r/inference_embed4.log; rm -f $OUT/r/inference/*.log; pack
