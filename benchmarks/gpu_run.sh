#!/usr/bin/env bash
# Tests and benchmarks on a GPU machine, in steps: bash benchmarks/gpu_run.sh STEP [STEP ...]
#   test     the whole test suite on the GPU (larger shapes, int64 offsets, races)
#   ptest    the GPU-relevant test files as fourteen pytest processes side by side (kernel compiles are CPU-bound;
#            PTEST_GPUS=2 spreads them over two GPUs; test_gluon_sm90 in four shards: one process took 291 s, four
#            took 60-82 s each; test_kvcache in two: 203-238 s as one, over a 240 s PTEST_TIMEOUT once). From a
#            branch's folder (see `branches`) it tests that tree.
#   tune     tile-config sweep per pass and head dim (benchmarks/tune_configs.py)
#   decode   the decode (KV cache) benchmark (DECODE_ARGS="--batches 1" for a subset)
#   tunedecode  decode tile-config and split-count sweep, host profile (benchmarks/tune_decode.py)
#   profdecode  the kernels of one decode step and their device times against SDPA's (benchmarks/profile_decode.py;
#            PROFDECODE_ARGS, e.g. "--paged")
#   kvtests  tests/test_kvcache.py on the GPU
#   varlen   packed against padded batches
#   latency  launch overhead (eager vs CUDA graph) and first-call compile time
#   hosttrace  where the host time of eager forward (+ backward) steps goes, per function (latency.py --host-trace)
#   gputests tests/test_gpu.py and the deterministic backward test
#   quick    the benchmark's quick table against every peer (flashtile bench --quick)
#   bench    the full standard table (bf16) against every peer (BENCH_TIMEOUT, default 400 s; with FA4 and the
#            D=256 rows it has taken over 390 s: give it ~540)
#   memory   fwd+bwd peak extra memory against SDPA flash
#   versus   flashtile against one peer on chosen standard rows in interleaved rounds (benchmarks/versus.py;
#            VERSUS_ARGS, e.g. "--row bf16,128,2048,0 --row bf16,64,1024,1 --peer cudnn --rounds 5")
#   sanitize compute-sanitizer memcheck of forward + backward cases (benchmarks/sanitize_cases.py)
#   ncubwd   Nsight Compute on one D=128 backward, full and causal (benchmarks/ncu_attention.py; NCU_ARGS to change
#            it, e.g. "--head-dim 64 --seqlen 1024"): the details page, the raw metrics (every stall reason) and the
#            source page (SASS with its stall samples) as text in $OUT
#   ncufwd   the same for one forward (the Gluon kernel; NCU_KERNEL=_attention_forward_kernel for the Triton one)
#   ncudecode   the same for decode steps (benchmarks/ncu_decode.py): NCUDECODE_CASES "B,CONTEXT,SPLITS ...", default
#            "1,1024,0 1,16384,0" (0: the heuristic's split count); the same three pages per case
#   tunegluon   config variants of the sm_90 Gluon kernels (benchmarks/tune_gluon.py; TUNEGLUON_ARGS="--variant ...")
#   branches    (2 GPUs) other branches against this tree: each branch's GPU tests (BRANCH_TESTS, default
#            tests/test_gluon_sm90.py) side by side on GPU 1 (compiles are CPU-bound), while GPU 0 times this tree
#            and then each branch with tune_gluon.py $TUNEGLUON_ARGS (branches.log). BRANCH_DIRS: their folders, made
#            beforehand with `git archive BRANCH pyproject.toml src tests benchmarks | tar -x -C .branches/BRANCH`
#            (.branches/ in .git/info/exclude). The tests' compiles perturb the timing (+-5%, some rows 15%); for
#            clean numbers run the two halves apart:
#   branchtests  the branches' GPU tests alone, spread over both GPUs (BRANCH_K: a pytest -k expression;
#            BRANCH_SHARDS: several processes per branch, see branch_tests)
#   branchtimes  the timing alone on GPU 0
# Everything lands in $OUT; the last lines printed are summaries.
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps a path set before (fa4_setup.sh)
OUT=${OUT:-/tmp/flashtile-out}
mkdir -p "$OUT"
commit=$(cat benchmarks/.commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# Each branch's GPU tests side by side, branch i on the i-th GPU of the list given (cycling). BRANCH_SHARDS: pytest
# -k expressions separated by ';' (e.g. "D64;D128;D256;not D64 and not D128 and not D256"): each branch's tests then
# run as one process per shard, the shards cycling over the GPUs too (one process compiles its kernels one by one).
branch_tests() {
  local gpus=("$@") i=0 shards shard name
  rm -rf /tmp/branchtests && mkdir -p /tmp/branchtests
  IFS=';' read -r -a shards <<< "${BRANCH_SHARDS:-}"
  [ ${#shards[@]} -eq 0 ] && shards=("")
  for dir in ${BRANCH_DIRS:?set BRANCH_DIRS}; do
    for shard in "${shards[@]}"; do
      local k=${BRANCH_K:-}
      [ -n "$shard" ] && k="${k:+($k) and }($shard)"
      name=$(basename "$dir")${shard:+-$i}
      (cd "$dir" && CUDA_VISIBLE_DEVICES=${gpus[i % ${#gpus[@]}]} PYTHONPATH=src timeout ${BRANCH_TEST_TIMEOUT:-330} \
         python3 -m pytest ${BRANCH_TESTS:-tests/test_gluon_sm90.py} ${k:+-k "$k"} -q -p no:cacheprovider \
         > "/tmp/branchtests/$name.log" 2>&1) &
      i=$((i + 1))
    done
  done
  wait
  # one file for all branches and shards
  for log in /tmp/branchtests/*.log; do echo "=== $(basename "$log" .log)"; cat "$log"; done > "$OUT/branchtests.log"
  for log in /tmp/branchtests/*.log; do echo "--- $(basename "$log" .log)"; tail -n 2 "$log"; done
}
# Nsight Compute on the second launch of kernels matching $2 in `python3 $4 ...` (limit $3 s): the report's details
# page, raw metrics (every stall reason) and source page (SASS with its stall samples) as $OUT/ncu-$1-*.csv, and
# the headline metrics printed.
ncu_profile() {
  local name=$1 kernel=$2 limit=$3
  shift 3
  timeout "$limit" ncu --set full --import-source yes -k "regex:$kernel" -s 1 -c 1 -o "/tmp/$name" -f \
    python3 "$@" 2>&1 | tail -2
  for page in details raw; do
    ncu --import "/tmp/$name.ncu-rep" --page $page --csv > "$OUT/ncu-$name-$page.csv" 2>&1
  done
  ncu --import "/tmp/$name.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu-$name-source.csv" 2>&1
  grep -E '"(Duration|DRAM Throughput|Issue Slots Busy|No Eligible)"' "$OUT/ncu-$name-details.csv" | cut -d, -f13-15
}
# This tree and then each branch timed with tune_gluon.py on GPU 0, one after the other.
branch_times() {
  for tree in . ${BRANCH_DIRS:?set BRANCH_DIRS}; do
    echo "### $tree" >> "$OUT/branches.log"
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$tree/src timeout ${GLUON_TIMEOUT:-150} \
      python3 "$tree/benchmarks/tune_gluon.py" ${TUNEGLUON_ARGS:-} >> "$OUT/branches.log" 2>&1
  done
}
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case $step in
    test) timeout 420 python3 -m pytest tests -q --maxfail=10 -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/test.log" | tail -25 ;;
    ptest)
      groups=("tests/test_attention.py -k seqlens"
              "tests/test_attention.py -k head_dim"
              "tests/test_attention.py -k not(seqlens)and(not(head_dim))"
              "tests/test_gpu.py tests/test_sdpa.py tests/test_padding.py"
              "tests/test_variants.py"
              "tests/test_dropout.py tests/test_varlen.py tests/test_varlen_paged.py"
              "tests/test_kvcache.py -k (decode_step)or(rotary)or(softcap)or(window)"
              "tests/test_kvcache.py -k not((decode_step)or(rotary)or(softcap)or(window))"
              "tests/test_compile.py tests/test_validation.py tests/test_cli.py tests/test_distributed.py"
              "tests/test_check_values.py tests/test_flash_attn_api.py tests/test_host_path.py tests/test_bench_decode.py"
              "tests/test_gluon_sm90.py -k D64" "tests/test_gluon_sm90.py -k D128" "tests/test_gluon_sm90.py -k D256"
              "tests/test_gluon_sm90.py -k not(D64)and(not(D128))and(not(D256))")
      for i in "${!groups[@]}"; do
        gpu=${PTEST_GPUS:+$((i % PTEST_GPUS))}  # PTEST_GPUS=2: groups alternate between GPU 0 and 1
        CUDA_VISIBLE_DEVICES=${gpu:-${CUDA_VISIBLE_DEVICES:-0}} timeout ${PTEST_TIMEOUT:-300} \
          python3 -m pytest ${groups[$i]} -q -p no:cacheprovider --durations=3 > "/tmp/ptest$i.log" 2>&1 &
      done
      wait
      for i in "${!groups[@]}"; do echo "=== ${groups[$i]}"; cat "/tmp/ptest$i.log"; done > "$OUT/ptest.log"
      for i in "${!groups[@]}"; do echo "--- ${groups[$i]}"; grep -E "passed|failed|error|FAILED|Timeout" "/tmp/ptest$i.log" | tail -6; done ;;
    tune) timeout 400 python3 benchmarks/tune_configs.py --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tail -12 ;;
    decode) timeout ${DECODE_TIMEOUT:-300} python3 benchmarks/bench_decode.py --out "$OUT/decode" --commit "$commit" ${DECODE_ARGS:-} 2>&1 | tail -40 ;;
    varlen) timeout ${VARLEN_TIMEOUT:-300} python3 benchmarks/bench_varlen.py --out "$OUT/varlen" --commit "$commit" 2>&1 | tail -12 ;;
    tunedecode) timeout ${TUNEDECODE_TIMEOUT:-300} python3 benchmarks/tune_decode.py --out "$OUT" ${TUNEDECODE_ARGS:-} 2>&1 | tee "$OUT/tunedecode.log" | grep -v '^ *[0-9]' | tail -40 ;;
    profdecode) timeout ${PROFDECODE_TIMEOUT:-150} python3 benchmarks/profile_decode.py --out "$OUT" ${PROFDECODE_ARGS:-} 2>&1 | tee "$OUT/profdecode.log" | tail -60 ;;
    kvtests) timeout 200 python3 -m pytest tests/test_kvcache.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/kvtests.log" | tail -6 ;;
    latency) timeout ${LATENCY_TIMEOUT:-320} python3 benchmarks/latency.py --out "$OUT" --commit "$commit" 2>&1 | tail -22 ;;
    hosttrace) timeout 120 python3 benchmarks/latency.py --out "$OUT" --host-trace 2>&1 | tail -8 ;;
    firstcall) timeout 120 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import latency; print(latency.first_call(Path('$OUT')))" 2>&1 | tail -4 ;;
    gputests) timeout 240 python3 -m pytest tests/test_gpu.py tests/test_attention.py -k "gpu or determin" -q -p no:cacheprovider 2>&1 | tee "$OUT/gputests.log" | tail -6 ;;
    ring) mkdir -p "$OUT/ring"; timeout 270 python3 -m pytest tests/test_distributed.py -k nccl -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/ring/test.log" | tail -8; timeout ${RING_TIMEOUT:-300} python3 benchmarks/bench_ring.py --out "$OUT/ring" --time-budget ${RING_BUDGET:-240} --commit "$commit" 2>&1 | tee "$OUT/ring/bench.log" | tail -45 ;;
    quick) timeout 400 python3 -m flashtile.bench.attention --out "$OUT" --quick --commit "$commit" 2>&1 | tail -60 ;;
    bench) timeout ${BENCH_TIMEOUT:-400} python3 -m flashtile.bench.attention --out "$OUT" --commit "$commit" 2>&1 | tail -80 ;;
    versus) timeout ${VERSUS_TIMEOUT:-400} python3 benchmarks/versus.py --out "$OUT" ${VERSUS_ARGS:-} 2>&1 | tail -30 ;;
    memory) timeout 80 python3 -m flashtile.bench.attention --out "$OUT/memory" --shapes memory --commit "$commit" 2>&1 | tail -15 ;;
    variants) timeout 300 python3 -m flashtile.bench.attention --out "$OUT/variants" --shapes variants --commit "$commit" 2>&1 | tail -40 ;;
    sanitize) timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool memcheck python3 benchmarks/sanitize_cases.py 2>&1 | tee "$OUT/sanitize.log" | tail -8 ;;
    ncubwd|ncufwd)
      pass=backward kernel=_attention_backward_sm90
      [ "$step" = ncufwd ] && pass=forward kernel=_attention_forward_sm90
      for causal in "" --causal; do
        ncu_profile "$pass${causal:+-causal}" "${NCU_KERNEL:-$kernel}" 150 \
          benchmarks/ncu_attention.py --pass $pass $causal ${NCU_ARGS:-}
      done ;;
    ncudecode)
      for case in ${NCUDECODE_CASES:-1,1024,0 1,16384,0}; do
        IFS=, read -r batch context splits <<< "$case"
        ncu_profile "decode-b$batch-ctx$context-s$splits" _split_kv_kernel 120 \
          benchmarks/ncu_decode.py --batch "$batch" --context "$context" --num-splits "$splits"
      done ;;
    tunegluon) timeout ${GLUON_TIMEOUT:-300} python3 benchmarks/tune_gluon.py --out "$OUT" ${TUNEGLUON_ARGS:-} 2>&1 | tail -80 ;;
    branches)
      branch_tests 1 & branch_times; wait
      grep -v "^ " "$OUT/branches.log" | tail -60 ;;
    branchtests) branch_tests 1 0 ;;
    branchtimes) branch_times; grep -v "^ " "$OUT/branches.log" | tail -80 ;;
    *) echo "unknown step $step" ;;
  esac
done
