#!/bin/bash
# FSDP2 + block-scaled FP8 weights built on the meta device: the probe's variants, each in a fresh process.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
D=bench/results/meta_quantized_init_h200_2026-11-29
for v in as_is te_values grad te_values_grad; do
  python $D/fsdp2_block_probe.py $v block 2>&1 | grep '^{' | tee -a "$OUT/probe.jsonl"
done
python $D/fsdp2_block_probe.py as_is current 2>&1 | grep '^{' | tee -a "$OUT/probe.jsonl"
