# 4-GPU machine, from the repository root (run's carry: [".gpu", "bench/data"]): nv-esm proteingym over all 217
# reference wild types on 1, 2 and 4 GPUs (650M, random weights, stand-in assays) with ProteinGym's loop side by
# side; then the model code before add_bias_residual (bench/data/old_tree: 4289175) against this tree, one process.
source .gpu/activate.sh
export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt
timeout 440 python bench/proteingym_benchmark.py --shape 650M --reference bench/data/DMS_substitutions.csv \
  --variants bf16 --gpus 1 2 4 --checkpoint-cache /tmp/pg --out $OUT/r/proteingym_650M_bf16.json > $OUT/r/pg.log 2>&1
echo "pg rc=$? $(( $(date +%s) - start )) s"; grep -v "Warning\|warn\|get_qkv_layout" $OUT/r/pg.log | tail -14
grep -v "Warning\|warn\|get_qkv_layout" $OUT/r/pg.log | tail -100 > $OUT/r/pg.log.tail; rm $OUT/r/pg.log; pack
CUDA_VISIBLE_DEVICES=0 timeout $(left 590) python bench/ab_model_code.py --old bench/data/old_tree --new . \
  --cases graphs_infer eager_infer eager_train --rounds 6 --out $OUT/r/ab_add_bias_residual.json > $OUT/r/ab.log 2>&1
echo "ab rc=$? $(( $(date +%s) - start )) s"; tail -12 $OUT/r/ab.log; pack
