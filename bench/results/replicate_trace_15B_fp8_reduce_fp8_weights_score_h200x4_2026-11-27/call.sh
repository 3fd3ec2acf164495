# nvidia-h200-x4 (carry [".gpu"]), from the repository root: bash bench/results/replicate_trace_15B_fp8_reduce_fp8_weights_score_h200x4_2026-11-27/call.sh
# 650M replicated at 16k tokens per GPU: traces of 3 steps on 1 and 4 GPUs, weak scaling 1 vs 4 GPUs (50 steps);
# 15B FP8 block scaling with fp32 vs bf16 reduce-scatters (20 steps); FP8 weights under FSDP2 on 4 GPUs; score 5k
# substitutions on 1, 2, 4 GPUs.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }; left() { echo $(( $1 - $(el) )); }
R=$OUT/r; mkdir -p $R; nvidia-smi -L > $R/gpu.txt; pack() { tar czf $OUT/r.tgz -C $OUT r; }
C="python bench/recipe_checks.py"
timeout $(left 90) $C profile --shape 650M --budget 16384 --gpus 4 --out /tmp/prof --extra --data-parallel replicate \
  > $R/profile.log 2>&1; echo "profile rc=$? $(el) s"; cp /tmp/prof/*.json $R/ 2>/dev/null; pack
timeout $(left 200) $C scale --shape 650M --budgets 16384 --gpus 4 --layouts replicate --steps 50 --out /tmp/scale \
  > $R/scale.log 2>&1; echo "scale rc=$? $(el) s"; cp /tmp/scale/*.json $R/ 2>/dev/null; pack
for reduce in fp32 bf16; do
  timeout $(left $([ $reduce = fp32 ] && echo 275 || echo 350)) $C fit --shape 15B --gpus 4 --budget 8192 --steps 20 \
    --out /tmp/fp8_$reduce --extra --fp8 all --fp8-recipe block --reduce-dtype $reduce > $R/fit_fp8_$reduce.log 2>&1
  echo "fit fp8 $reduce rc=$? $(el) s"; grep -h '"tokens_per_s_per_gpu"' $R/fit_fp8_$reduce.log; pack; done
timeout $(left 470) torchrun --nproc-per-node 4 bench/fp8_weights_fsdp2.py --speed 650M 3B --recipes block \
  --tokens 16384 --steps 14 --out $R/fp8w_speed.json > $R/fp8w_speed.log 2>&1; echo "fp8 weights rc=$? $(el) s"; pack
timeout $(left 570) python bench/inference_scaling.py --shape 650M --mutants 5000 --jobs score --gpus 1 2 4 \
  --out $R/score > $R/score.log 2>&1; echo "score rc=$? $(el) s"; grep -v Warn $R/score.log | tail -n 4 | cut -c1-200; pack
