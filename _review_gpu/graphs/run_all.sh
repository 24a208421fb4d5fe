#!/usr/bin/env bash
# Runs every CUDA-graph cache repro in this folder; prints one PASS/FAIL line per script.
# Usage (from the repository root): bash _review_gpu/graphs/run_all.sh
# Each script's stdout/stderr go to $LOGS/<name>.{out,err} (LOGS defaults to $OUT/graphs_logs or /tmp/graphs_logs).
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
LOGS="${LOGS:-${OUT:-/tmp}/graphs_logs}"
mkdir -p "$LOGS"
for f in _review_gpu/graphs/*.py; do
  name="$(basename "$f" .py)"
  timeout 90 "$PY" "$f" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  rc=$?
  line="$(grep -E '^(PASS|FAIL) ' "$LOGS/$name.out" | tail -n 1)"
  if [ -z "$line" ]; then
    line="FAIL $name: no result line (rc=$rc$([ $rc = 124 ] && echo ', timed out'); stderr: $(tail -n 3 "$LOGS/$name.err" | tr '\n' ' ' | cut -c1-300))"
  fi
  echo "$line"
done
