#!/bin/bash
# 4 x H100: the whole test suite (its 2-GPU tests included), then weak scaling of 650M at 16k tokens per GPU.
# From the repository root:
#   source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
#   bash bench/results/scale_h100x4_650M_2026-11-27/suite_and_scale16.sh
set -u
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m > $OUT/topo.txt
python -c "import torch, transformers, transformer_engine; print('torch', torch.__version__, 'transformers', transformers.__version__, 'TE', transformer_engine.__version__)"
timeout 270 python -m pytest -q -rfEs -n 14 -p no:cacheprovider --durations=10 tests > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; tail -n 30 $OUT/suite.log | grep -v "^  \|^$"
timeout $(( 580 - ($(date +%s) - start) )) python bench/recipe_checks.py scale --shape 650M --budgets 16384 --steps 50 \
    --gpus 2 4 --layouts replicate shard hsdp --out /tmp/scale16 > $OUT/scale16.log 2>&1
echo "scale16 rc=$? $(( $(date +%s) - start )) s"; tail -n 5 $OUT/scale16.log
cp /tmp/scale16/*.json $OUT/ 2>/dev/null
for f in /tmp/scale16/*.log; do tail -n 3 $f > $OUT/tail_$(basename $f); done
