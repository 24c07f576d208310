#!/usr/bin/env bash
# Regenerates the tables of record in bench/results/ on the project's GPU (one command; the method: bench/README.md):
#   RECORD.*         the flush, every backend, KDA and GDN, batches 16 64 256 512, all / 1/16 / none due
#   RECORD-step.*    the decode step, every program stepping, window at fill 1 and 15, fla's decode beside it
#   RECORD-decode.*  one decode token (step + the flush it makes due) at the steady state, fla's decode beside it
#   E2E.md           512 decoded tokens against the fp64 recurrence, beside fp32- and bf16-state recurrences
#   EAGER.md         the host wall-clock of an eager flush_inplace call (not appended to history.csv)
# and appends every timed row to bench/results/history.csv. Usage: bench/record.sh [OUT_DIR] [extra bench options]
# (OUT_DIR defaults to bench/results; COMMIT=<sha> names the commit where the checkout has no .git).
set -euo pipefail
out=${1:-bench/results}
shift || true
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python -m leapquant bench --record "$out" --backends reference triton tilelang --gate kda gdn --ref-max-batch 16 \
    --commit "$commit" --quiet "$@"
python -m leapquant bench --op step --record "$out" --backends triton --gate kda gdn --commit "$commit" --quiet "$@"
python -m leapquant bench --op decode --record "$out" --backends auto triton --gate kda gdn --commit "$commit" --quiet "$@"
python -m leapquant.e2e --backend auto --out "$out/E2E.md" --commit "$commit"
python -m leapquant bench --backends triton tilelang --batch 256 --due none all --gate kda gdn --timer wall \
    --repeats 48 --no-refcheck --commit "$commit" --quiet --md "$out/EAGER.md"
