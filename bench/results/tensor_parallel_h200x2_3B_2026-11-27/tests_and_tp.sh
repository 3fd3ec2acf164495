# 2-GPU machine (carry [".gpu"]): GPU tests of the changed paths (FP8 attention layout, graphs handed the body), then
# 3B at 16k tokens per GPU: tensor parallelism (--tp 2) against FSDP2 on 2 GPUs and one GPU, --recompute-mlp on all.
source .gpu/activate.sh; export PYTHONPATH=$PWD:$PWD/bench:$PYTHONPATH OMP_NUM_THREADS=1
start=$(date +%s); left() { echo $(( $1 - ($(date +%s) - start) )); }
mkdir -p $OUT/r; pack() { tar czf $OUT/r.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/r/gpu.txt; git log --oneline -1 > $OUT/r/head.txt
timeout 230 python -m pytest -q -rfEs -n 12 -p no:cacheprovider tests/test_gpu_graphs.py tests/test_static_shapes.py \
  tests/test_gpu.py tests/test_gpu_scoring.py tests/test_gpu_tensor_parallel.py tests/test_proteingym.py > $OUT/r/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; tail -4 $OUT/r/tests.log; pack
timeout $(left 585) python bench/recipe_checks.py scale --shape 3B --budgets 16384 --gpus 2 --layouts tp2 shard \
  --steps 30 --out /tmp/tp --extra --recompute-mlp > $OUT/r/tp3B.log 2>&1
echo "tp rc=$? $(( $(date +%s) - start )) s"; cp /tmp/tp/*.json $OUT/r/ 2>/dev/null; pack
python - <<'P'
import json,glob
for f in glob.glob("/tmp/tp/scale_*.json"):
    d=json.load(open(f))
    for b,r in d.get("budgets",{}).items():
        for k,v in r.items():
            if isinstance(v,dict) and "tokens_per_s_per_gpu" in v: print(b,k,round(v["tokens_per_s_per_gpu"]),v.get("per_gpu_vs_one_gpu"),v.get("mfu"),v.get("max_memory_gb"))
        print("failed",r.get("failed"))
P
