#!/bin/bash
# H100: where graphed 650M steps at 64 proteins leave the GPU idle (host time
# from the input-check sync to the graph launch, with Python stacks; checked vs unchecked), then `nv-esm embed` vs
# the transformers loop (650M, 10k proteins).
set -u
CALL_START=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
timeout 200 python bench/host_gap.py --shape 650M --proteins 64 --modes infer train \
  --variants nv_thd_graphs nv_thd_graphs_unchecked --out $OUT/gap > $OUT/gap.log 2>&1
echo "host_gap rc=$? $(( $(date +%s) - start )) s"; grep "step ms" $OUT/gap.log
pkill -f host_gap.py; sleep 2
start=$(date +%s)
timeout $(( 590 - start + CALL_START )) python bench/embed_benchmark.py --shape 650M --proteins 10000 --out $OUT/embed > $OUT/embed.log 2>&1
echo "embed rc=$? $(( $(date +%s) - start )) s"; grep -v Warning $OUT/embed.log | tail -n 60 | grep -n "proteins_per_s\|x_trans\|\"[a-z_8()]*\": {" 
