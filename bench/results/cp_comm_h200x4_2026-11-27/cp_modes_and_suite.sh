# nvidia-h100-x4, from the repository root: TE context parallelism per communication type (cp 2 and 4),
# embed/score scaling over 1/2/4 GPUs, then the whole suite on 4 GPUs.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r
pack() { tar czf $OUT/r.tgz -C $OUT r; }
for cp in 2 4; do
  PYTHONPATH=$PWD/tests:$PYTHONPATH timeout 170 torchrun --nproc-per-node $cp bench/cp_modes.py \
    --out $OUT/r/cp_modes_$cp.json > $OUT/r/cp_modes_$cp.log 2>&1; echo "cp_modes $cp rc=$?"; pack
done
timeout 300 python -m pytest -q -rfEs -n 14 -p no:cacheprovider tests > $OUT/r/suite.log 2>&1; echo "suite rc=$?"
tail -5 $OUT/r/suite.log; pack
timeout 120 python bench/inference_scaling.py --shape 650M --gpus 1 2 4 --out $OUT/r/inference > $OUT/r/inference.log 2>&1
echo "inference rc=$?"; tail -15 $OUT/r/inference.log; pack
