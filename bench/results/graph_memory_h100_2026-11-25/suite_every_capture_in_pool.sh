#!/bin/bash
# H100: the whole GPU suite on the warm-up-in-pool commit, in two parts.
set -u
CALL_START=$(date +%s)
tests=$(ls tests/test_*.py | grep -v test_recipe_)
timeout 260 python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=5 $tests > $OUT/suite_part1.log 2>&1
echo "suite part 1 rc=$? $(( $(date +%s) - CALL_START )) s"; tail -n 8 $OUT/suite_part1.log
grep -h "graphs warm-up\]" -A0 $OUT/suite_part1.log
pkill -f pytest; sleep 2
start=$(date +%s)
timeout $(( 590 - start + CALL_START )) python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=5 tests/test_recipe_*.py > $OUT/suite_part2.log 2>&1
echo "suite part 2 rc=$? $(( $(date +%s) - start )) s"; tail -n 8 $OUT/suite_part2.log
