#!/usr/bin/env bash
# Call 2: the steady-state speed table (bench/benchmark.py: the default, nv_thd_graphs), 650M at
# 16 and 64 proteins, training and inference, on the tree before the forward plan (64c915d, `git archive` into
# .old_tree/, carried) and after it, twice each in turns (old, new, old, new), so the two are compared side by side.
# From the repository root, .gpu/ and .old_tree/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_speed_forward_plan_h200_2026-11-29/call_2.sh
set -u
root=$PWD
# First, call 1's one failure again after its test was updated (validation no longer flips config.cuda_graphs).
PYTHONPATH="$root:$PYTHONPATH" timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k recipe_validation_leaves \
  > "$OUT/validation_test.log" 2>&1; echo "validation test exit $?"; tail -2 "$OUT/validation_test.log"
for round in 1 2; do
  for tree in old new; do
    dir=$root; [ "$tree" = old ] && dir=$root/.old_tree
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 115 python bench/benchmark.py --shapes 650M --proteins 16 64 \
      --modes train infer --variants nv_thd_graphs --out "$OUT/${tree}_$round" > "$OUT/${tree}_$round.log" 2>&1)
    echo "$tree round $round exit $?"
  done
done
cd "$OUT" && python - <<'PY'
import json, glob
rows = {}
for path in sorted(glob.glob("*_*/benchmark.json")):
    tree, round_ = path.split("/")[0].split("_")
    for r in json.load(open(path))["results"]:
        key = (r["variant"], r["proteins"], r["mode"])
        rows.setdefault(key, {}).setdefault(tree, []).append(r.get("tokens_per_second"))
for key, trees in sorted(rows.items()):
    print(key, {tree: [round(v) for v in values if v] for tree, values in trees.items()})
PY
