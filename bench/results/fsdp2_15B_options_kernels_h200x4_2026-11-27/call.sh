# nvidia-h200-x4 (carry [".gpu"]), from the repository root: bash bench/results/fsdp2_15B_options_kernels_h200x4_2026-11-27/call.sh
# 1. One GPU each, side by side: 650M at 64 proteins against the plain TE port (speed table; kernel traces), the
#    graph/eager margin 0 vs 0.03 (inference, 64 proteins), 3B training at 16 proteins with fc2's dgelu epilogue vs
#    TE's bias+GELU kernels. 2. 15B, 4 GPUs, 8k tokens per GPU: head, TE's bias+GELU, --reduce-dtype bf16, FP8 block.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }; left() { echo $(( $1 - $(el) )); }
R=$OUT/r; mkdir -p $R; nvidia-smi -L > $R/gpu.txt; pack() { tar czf $OUT/r.tgz -C $OUT r; }
for alt in te_gelu margin03; do mkdir -p /tmp/$alt; tar cf - --exclude=./.gpu --exclude=./.git . | tar xf - -C /tmp/$alt; done
sed -i 's/bias_gelu_nvfusion = False/bias_gelu_nvfusion = True/' /tmp/te_gelu/modeling_nv_esm_layers.py
sed -i 's/^    eager_margin = 0.0 /    eager_margin = 0.03 /' /tmp/margin03/modeling_nv_esm_graphs.py
echo "alt trees: $(grep -c 'bias_gelu_nvfusion = True' /tmp/te_gelu/modeling_nv_esm_layers.py) $(grep -c 'eager_margin = 0.03 ' /tmp/margin03/modeling_nv_esm_graphs.py)"
in_tree() { t=$1; shift; (cd /tmp/$t && PYTHONPATH=/tmp/$t:/tmp/$t/bench:$PYTHONPATH "$@"); }
B="python bench/benchmark.py"
( export CUDA_VISIBLE_DEVICES=0; timeout $(left 240) $B --shapes 650M --proteins 64 --modes train infer \
    --variants te_port nv_thd nv_thd_graphs nv_thd_graphs_fp8 nv_thd_bf16w --out $R/speed64 > $R/speed64.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1; for tree in head margin03 head; do
    args="--shapes 650M --proteins 64 --modes infer --variants nv_thd nv_thd_graphs"
    if [ $tree = head ]; then timeout $(left 240) $B $args --out $R/margin_$tree; else
      in_tree $tree timeout $(left 240) $B $args --out $R/margin_$tree; fi; done > $R/margin.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=2; timeout $(left 240) python bench/profile_step.py --shape 650M --proteins 64 \
    --variants te_port nv_thd_graphs nv_thd_graphs_fp8 --trace-steps 4 --top 60 --out $R/kernels64 \
    --trace-dir /tmp/traces > $R/kernels64.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=3; args="--shapes 3B --proteins 16 --modes train"
  timeout $(left 240) $B $args --variants te_port nv_thd_graphs --out $R/gelu3B_epilogue
  in_tree te_gelu timeout $(left 240) $B $args --variants nv_thd_graphs --out $R/gelu3B_te_gelu ) > $R/gelu3B.log 2>&1 &
wait; echo "one-GPU block done $(el) s"; grep -h '^{' $R/*.log | cut -c1-160; pack
fit() { tree=$1; tag=$2; t=$3; shift 3; [ $(left $t) -lt 60 ] && { echo "fit $tag skipped"; return; }
  cmd="python bench/recipe_checks.py fit --shape 15B --gpus 4 --budget 8192 --steps 16 --out /tmp/f_$tag $*"
  if [ $tree = head ]; then timeout $(left $t) $cmd; else in_tree $tree timeout $(left $t) $cmd; fi > $R/fit_$tag.log 2>&1
  echo "fit $tag rc=$? $(el) s"; cp /tmp/f_$tag/*.json $R/fit_$tag.json 2>/dev/null
  grep -h '"tokens_per_s_per_gpu"\|"mfu"\|"max_memory_gb"' $R/fit_$tag.json; pack; }
fit head epilogue 320
fit te_gelu te_gelu 405
fit head bf16_reduce 490 --extra --reduce-dtype bf16
fit head fp8_block_bf16_reduce 570 --extra --fp8 all --fp8-recipe block --reduce-dtype bf16
