#!/usr/bin/env bash
# Call 2: call 1's one failure again (a CPU test whose FSDP2 mesh now says cpu: with a GPU visible FSDP2 gathered onto
# it), then the steady-state speed table (bench/benchmark.py, the default nv_thd_graphs), 650M at 16 and 64 proteins,
# training and inference, at 296d1ce (this session's start, `git archive` into .old_tree/, carried) and after, in
# turns (old, new, old, new). From the repository root, .gpu/ and .old_tree/ carried:
#   source .gpu/activate.sh; bash bench/results/gpu_suite_quantized_init_h200_2026-11-29/call_2.sh
set -u
root=$PWD
PYTHONPATH="$root:$PYTHONPATH" timeout 120 python -m pytest -q -p no:cacheprovider tests/test_meta_init.py \
  > "$OUT/meta_init_test.log" 2>&1; echo "meta init tests exit $?"; tail -2 "$OUT/meta_init_test.log"
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
