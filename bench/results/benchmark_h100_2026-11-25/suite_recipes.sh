#!/bin/bash
# H100: the recipe tests of the GPU suite (-n 12), each test's cached GPU memory given back
# after it (tests/conftest.py).
set -u
start=$(date +%s)
timeout 560 python -m pytest -q -rfEs -n 12 -p no:cacheprovider --durations=8 tests/test_recipe_*.py > $OUT/suite_part2.log 2>&1
echo "suite part 2 rc=$? $(( $(date +%s) - start )) s"; tail -n 25 $OUT/suite_part2.log
