source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
mkdir -p $OUT/r; nvidia-smi -L > $OUT/r/gpu.txt
timeout 420 torchrun --nproc-per-node 2 bench/fp8_weights_fsdp2.py --speed 650M 3B --recipes block delayed --tokens 16384 --steps 14 --out $OUT/r/fp8w_speed.json > $OUT/r/speed.log 2>&1; echo "rc=$?" >> $OUT/r/speed.log
grep -v Warning $OUT/r/speed.log | tail -n 30
