# 2-GPU machine, from the repository root: the TE tensor/context-parallel GPU tests (all-to-all, all-gather) and the
# 2-rank graph tests (replicated graphs, overlapped gradient average).
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
timeout 280 python -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu_tensor_parallel.py tests/test_gpu_graphs.py \
  -k "split_layers or two_ranks or averaged_during" -s 2>&1 | grep -v "Warning\|warn" | tail -25
