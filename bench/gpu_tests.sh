#!/usr/bin/env bash
# The GPU test tier (bench/results/TESTS.md): the whole suite on the project's GPU, in one pytest run whose tests are
# spread over WORKERS processes by pytest-xdist (work stealing: a worker that runs out takes the tests another has not
# begun, so one long file does not hold the run up). The workers share the GPU and its compile caches; no test's
# verdict rests on a time but the benchmark timers' own tests, which compare medians. The compile tests for other
# targets are left to CPU CI.
# Usage: bench/gpu_tests.sh [OUT_DIR] [LIMIT_S] [WORKERS] [PYTEST_ARGS ...]
#   OUT_DIR (default /tmp/gpu-tests) receives tests.log (every line with its time), summary.txt (the summary line and
#   the passed / failed / skipped count of each file) and the failures; the run stops at LIMIT_S (default 540);
#   WORKERS defaults to half the cores; PYTEST_ARGS (default: tests/) narrow the run, e.g. a few files.
set -u
out=${1:-/tmp/gpu-tests}
limit=${2:-540}
workers=${3:-$(( $(nproc) / 2 ))}
shift 3 2>/dev/null || shift $#
[ $# -gt 0 ] || set -- tests
mkdir -p "$out"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
sel="not deployment_sizes and not other_head_counts and not compiles"
# Each worker's torch gets an equal share of the cores: one torch thread per core in every process left the CPU-bound
# tests (the reference, the CPU halves of the e2e and conformance tests) fighting over the cores.
threads=$(( $(nproc) / workers )); [ "$threads" -ge 1 ] || threads=1
stamp() { while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done; }   # each log line with its time
t0=$SECONDS
PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$threads timeout "$limit" python -m pytest -v -p no:cacheprovider -rfEs \
    --tb=short --durations=25 -n "$workers" --dist worksteal "$@" -k "$sel" 2>&1 | stamp > "$out/tests.log"
rc=${PIPESTATUS[0]}
{
    echo "rc=$rc $((SECONDS - t0)) s, $workers workers of $threads threads: $(grep -E '=+ .*(passed|failed).* =+$' \
        "$out/tests.log" | tail -1)"
    # per file: what each test ended as (xdist's -v lines: "[gwN] [ P%] OUTCOME tests/file.py::test")
    grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/[a-z_]+\.py" "$out/tests.log" | sort | uniq -c \
        | awk '{n[$3]=n[$3] " " $1 " " tolower($2)} END {for (f in n) print f ":" n[f]}' | sort
} > "$out/summary.txt"
cat "$out/summary.txt"
grep -E "^[0-9:]+ .*(FAILED|ERROR) tests/" "$out/tests.log" || true
