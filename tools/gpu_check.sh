#!/usr/bin/env bash
# One call on the GPU machine: the whole test suite (CUDA tests included), then
# the benchmark and the profiler, logs and JSON under $OUT (dev tool, not shipped).
#   bash tools/gpu_check.sh [tests|bench|timeline|all] [extra bench args...]
set -u -o pipefail
what=${1:-all}; shift || true
export PYTHONPATH=. PYTHONUNBUFFERED=1
# The GPU machine has no nbclient/nbformat: the notebooks are executed by CPU CI, not here.
export PARALLEL_MODULES_ALLOW_MISSING_EXTRAS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout 420 python3 -m pytest -q -p no:cacheprovider -ra tests 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout 300 python3 -m parallel_modules.bench --quick --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" 2>&1 \
        | tee "$OUT/bench.log" | grep -v "^\[" | tail -80
fi
if [ "$what" = timeline ] || [ "$what" = all ]; then
    timeout 120 python3 tools/make_timeline_trace.py "$OUT/inception_timeline.json" --plot "$OUT/inception_timeline.png" \
        2>&1 | tee "$OUT/timeline.log" | tail -20
fi
