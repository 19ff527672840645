#!/usr/bin/env bash
# The float8 forward on one GPU (sm_89 or later), in about 3-4 minutes: bash benchmarks/fp8_gpu.sh
#   1. side by side (compiles are CPU-bound, one kernel at a time per process): tests/test_fp8.py in five shards,
#      and benchmarks/fp8_forward.py --warm in six, which compiles every kernel the timed run will launch;
#   2. alone on the GPU: benchmarks/fp8_forward.py --sweep (accuracy, the speed table, the config sweep), every
#      kernel already in Triton's cache.
# Everything lands in $OUT (fp8_tests-*.log, fp8_bench.log, fp8_forward.json); the last lines printed summarize.
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/flashtile-fp8-triton-cache}
OUT=${OUT:-/tmp/flashtile-out}
mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
shards=("D64 and gpu_matches" "D128 and gpu_matches" "D256 and gpu_matches" "matches_oracle and not gpu_matches"
        "not matches_oracle and not compiles")
for i in "${!shards[@]}"; do
  timeout ${FP8_TEST_TIMEOUT:-150} python3 -m pytest tests/test_fp8.py -k "${shards[i]}" -q -p no:cacheprovider \
    > "$OUT/fp8_tests-$i.log" 2>&1 &
done
for i in 0 1 2 3 4 5; do
  timeout ${FP8_WARM_TIMEOUT:-150} python3 benchmarks/fp8_forward.py --out "$OUT" --sweep --warm $i/6 \
    > "$OUT/fp8_warm-$i.log" 2>&1 &
done
wait
timeout ${FP8_BENCH_TIMEOUT:-90} python3 benchmarks/fp8_forward.py --out "$OUT" --sweep 2>&1 | tee "$OUT/fp8_bench.log"
for i in "${!shards[@]}"; do echo "--- tests: ${shards[i]}"; tail -n 3 "$OUT/fp8_tests-$i.log"; done
for i in 0 1 2 3 4 5; do tail -n 1 "$OUT/fp8_warm-$i.log" | grep -i error; done
exit 0
