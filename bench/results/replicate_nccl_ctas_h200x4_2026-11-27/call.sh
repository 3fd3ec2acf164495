# nvidia-h200-x4 (carry [".gpu"]), from the repository root: bash bench/results/replicate_nccl_ctas_h200x4_2026-11-27/call.sh
# 650M replicated at 16k tokens per GPU, 1 vs 4 GPUs (40 steps): NCCL's default number of CTAs for the gradient
# all-reduces against NCCL_MAX_CTAS=4 and 8 (fewer SMs taken from the GEMMs the all-reduces overlap).
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }; left() { echo $(( $1 - $(el) )); }
R=$OUT/r; mkdir -p $R; nvidia-smi -L > $R/gpu.txt; pack() { tar czf $OUT/r.tgz -C $OUT r; }
i=0
for ctas in default 4 8; do
  i=$((i + 1)); if [ $ctas = default ]; then unset NCCL_MAX_CTAS; else export NCCL_MAX_CTAS=$ctas; fi
  timeout $(left $((95 * i))) python bench/recipe_checks.py scale --shape 650M --budgets 16384 --gpus 4 \
    --layouts replicate --steps 40 --out /tmp/ctas_$ctas > $R/scale_ctas_$ctas.log 2>&1
  echo "ctas $ctas rc=$? $(el) s"; cp /tmp/ctas_$ctas/scale_*.json $R/scale_ctas_$ctas.json 2>/dev/null
  grep -h '"tokens_per_s_per_gpu"\|"per_gpu_vs_one_gpu"' $R/scale_ctas_$ctas.json; pack
done
