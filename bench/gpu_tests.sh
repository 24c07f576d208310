#!/usr/bin/env bash
# The GPU test tier (bench/results/TESTS.md): the whole suite on the project's GPU in six shards run side by side
# (the shards share the GPU: no verdict rests on a time but the benchmark timers' own tests, which compare medians),
# the compile tests for other targets left to CPU CI.
# Usage: bench/gpu_tests.sh [OUT_DIR] [LIMIT_S] [SHARD ...]   (logs to OUT_DIR, default /tmp/gpu-tests; each shard
# stops at LIMIT_S, default 540; SHARDs: conformance tilelang triton pool e2e rest, default all six). Prints each shard's
# summary line and every failure. Six shards sharing one GPU take longer than a 600 s device call (bench/results/
# TESTS.md, e52ee08): run the tier as two calls, e.g. "conformance e2e rest", then "tilelang triton pool".
set -u
out=${1:-/tmp/gpu-tests}
limit=${2:-540}
shift 2 2>/dev/null || shift $#
wanted=" ${*:-conformance tilelang triton pool e2e rest} "
mkdir -p "$out"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
sel="not deployment_sizes and not other_head_counts and not compiles"
# Each shard's torch gets an equal share of the cores (OMP_NUM_THREADS) among the shards asked for: six processes of
# one torch thread per core each left the CPU-bound tests (the reference, the CPU halves of the e2e and conformance
# tests) fighting over 16 cores.
shards=$(echo $wanted | wc -w)
threads=$(( $(nproc) / shards )); [ "$threads" -ge 1 ] || threads=1
stamp() { while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done; }   # each log line with its time
shard() {   # shard NAME FILE...  (only the shards asked for)
    local name=$1 t0=$SECONDS rc
    shift
    case "$wanted" in *" $name "*) ;; *) return 0;; esac
    PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$threads timeout "$limit" python -m pytest -v -p no:cacheprovider -rfEs --tb=short \
        --durations=15 "$@" -k "$sel" 2>&1 | stamp > "$out/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name: rc=$rc $((SECONDS - t0)) s: $(grep -E '=+ .*(passed|failed).* =+$' "$out/$name.log" | tail -1)" \
        >> "$out/summary.txt"
}
: >> "$out/summary.txt"
all=$(ls tests/test_*.py)
tilelang="tests/test_tilelang.py tests/test_tilelang_sync.py"
triton="tests/test_triton.py tests/test_triton_step.py"
pool="tests/test_pool_helpers.py tests/test_reference.py tests/test_step_reference.py tests/test_step_pool.py"
e2e="tests/test_end_to_end.py"
rest=$(for f in $all; do case " tests/test_conformance.py $tilelang $triton $pool $e2e " in *" $f "*) ;;
                         *) echo "$f";; esac; done)
shard conformance tests/test_conformance.py &
shard tilelang $tilelang &
shard triton $triton &
shard pool $pool &
shard e2e $e2e &
shard rest $rest &
wait
cat "$out/summary.txt"
grep -hE "^[0-9:]+ (FAILED|ERROR) " "$out"/*.log || true
