#!/bin/bash
# The whole test suite on one H100 with TE (the carried .gpu/), in one pytest run (-n 14); log in $OUT/suite.log.
# Run from the repository root as:
#   source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1;
#   bash bench/results/gpu_suite_h100_2026-11-27/suite.sh
set -u
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers, transformer_engine; print('torch', torch.__version__, 'transformers', transformers.__version__, 'TE', transformer_engine.__version__)"
python -c "import matplotlib, peft, pyarrow; print('matplotlib', matplotlib.__version__, 'peft', peft.__version__)" 2>&1 | tail -1
timeout 570 python -m pytest -q -rfEs -n 14 -p no:cacheprovider --durations=10 tests > $OUT/suite.log 2>&1
echo "suite rc=$? $(( $(date +%s) - start )) s"; tail -n 40 $OUT/suite.log | grep -v "^  \|^$"
