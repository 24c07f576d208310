#!/usr/bin/env bash
# The GPU test tier (bench/results/TESTS.md): the whole suite on the project's GPU, in one pytest run whose tests are
# spread over WORKERS processes by pytest-xdist (work stealing: a worker that runs out takes the tests another has not
# begun, so one long file does not hold the run up). The workers share the GPU and its compile caches, so the tests
# marked `timing` (the benchmark timers' own, whose verdicts compare medians of measured times) run afterwards, alone.
# The compile tests for other targets are left to CPU CI.
# Usage: bench/gpu_tests.sh [OUT_DIR] [LIMIT_S] [WORKERS] [PYTEST_ARGS ...]
#   OUT_DIR (default /tmp/gpu-tests) receives tests.log (every line with its time), timing.log (the tests marked
#   `timing`, run after the others with the GPU to themselves), summary.txt (the summary lines and the passed / failed /
#   skipped count of each file) and the failures; the run stops at LIMIT_S (default 540);
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
pytest=(python -m pytest -v -p no:cacheprovider -rfEs --tb=short "$@" -k "$sel")
t0=$SECONDS
PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$threads timeout "$limit" "${pytest[@]}" --durations=25 -n "$workers" \
    --dist worksteal -m "not timing" 2>&1 | stamp > "$out/tests.log"
rc=${PIPESTATUS[0]}
# the timing tests alone: beside seven other workers a tiny kernel's span held their kernels' time slices
# (bench/results/TESTS.md)
left=$(( limit - (SECONDS - t0) )); [ "$left" -ge 1 ] || left=1
PYTHONUNBUFFERED=1 timeout "$left" "${pytest[@]}" -m timing 2>&1 | stamp > "$out/timing.log"
rc_timing=${PIPESTATUS[0]}
{
    echo "rc=$rc, $workers workers of $threads threads: $(grep -E '=+ .*(passed|failed).* =+$' "$out/tests.log" | tail -1)"
    echo "timing tests alone: rc=$rc_timing: $(grep -E '=+ .*(passed|failed).* =+$' "$out/timing.log" | tail -1)"
    echo "$((SECONDS - t0)) s in all"
    # per file: what each test ended as (xdist's -v lines "[gwN] [ P%] OUTCOME tests/f.py::test", plain -v lines
    # "tests/f.py::test OUTCOME")
    python - "$out/tests.log" "$out/timing.log" <<'PY'
import collections, re, sys
counts = collections.defaultdict(collections.Counter)
for path in sys.argv[1:]:
    for line in open(path, errors="replace"):
        m = re.search(r"\[gw\d+\] \[\s*\d+%\] ([A-Z]+) (tests/\w+\.py)::", line)
        n = re.search(r" (tests/\w+\.py)::\S+ (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", line)
        if m or n:
            outcome, name = m.groups() if m else n.groups()[::-1]
            counts[name][outcome.lower()] += 1
for name in sorted(counts):
    print(f"{name}: " + ", ".join(f"{k} {v}" for v, k in sorted(counts[name].items())))
PY
} > "$out/summary.txt"
cat "$out/summary.txt"
grep -hE "^[0-9:]+ .*(FAILED|ERROR) tests/" "$out/tests.log" "$out/timing.log" || true
