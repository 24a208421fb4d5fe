#!/bin/sh
# Run from the repository root: sh _review_gpu/pipeline/run_all.sh
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD:$PWD/_review_gpu/pipeline${PYTHONPATH:+:$PYTHONPATH}"
for f in _review_gpu/pipeline/[a-z]*.py; do
  out=$(timeout 60 python "$f" 2>&1 | tail -1)
  [ -n "$out" ] || out="FAIL $(basename "$f" .py): no output (timeout or crash)"
  echo "$out"
done
