#!/bin/bash
# After the review: the meta-init GPU tests with the initialisation rule's values made recognisable (ramps) and
# delayed scaling's fitted scale checked, the FP8-weight tests beside them, and the CPU meta-init tests (3 gloo ranks
# included) on the GPU machine. From the repository root, after `source .gpu/activate.sh`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -q -n 8 -rfEs -p no:cacheprovider tests/test_gpu_meta_init.py tests/test_meta_init.py \
  "tests/test_gpu.py::test_fp8_weights_load_infer_train_and_save" \
  "tests/test_gpu.py::test_a_callers_quantized_model_init_holds_every_layer_in_fp8" 2>&1 | tee "$OUT/call_3.log" | tail -25
