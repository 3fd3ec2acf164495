#!/bin/bash
# The GPU tests of quantized (FP8) initialisation on the meta device, and the FP8-weight tests beside them.
# Run from the repository root on the GPU machine, after `source .gpu/activate.sh`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
python -m pytest -q -n 8 -rfEs -p no:cacheprovider -s tests/test_gpu_meta_init.py \
  "tests/test_gpu.py::test_fp8_weights_load_infer_train_and_save" \
  "tests/test_gpu.py::test_a_callers_quantized_model_init_holds_every_layer_in_fp8" 2>&1 | tee "$OUT/call_1.log" | tail -60
