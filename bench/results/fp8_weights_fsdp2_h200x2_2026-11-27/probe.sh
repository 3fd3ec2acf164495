source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r; nvidia-smi -L > $OUT/r/gpu.txt
timeout 200 torchrun --nproc-per-node 2 bench/fp8_weights_fsdp2.py --recipes delayed current block --out $OUT/r/fp8w_policy.json > $OUT/r/probe_policy.log 2>&1; echo "rc=$?" >> $OUT/r/probe_policy.log
timeout 200 torchrun --nproc-per-node 2 bench/fp8_weights_fsdp2.py --recipes delayed current block --no-mp-policy --out $OUT/r/fp8w_nopolicy.json > $OUT/r/probe_nopolicy.log 2>&1; echo "rc=$?" >> $OUT/r/probe_nopolicy.log
tail -n 5 $OUT/r/*.log
