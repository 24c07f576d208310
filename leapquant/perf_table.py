"""Which GPU kernel ``auto`` prefers on each architecture, from committed measurements (not guesses).

sm_90 (H100 / H200): bench/results/RECORD.md, the table of record on the H200 (KDA and GDN, batch 16-512 x 32 heads):
the TileLang kernel is 1.21-1.34x faster than the Triton backend's Gluon kernel with every program due and 1.29-1.42x
at 1/16 due, at every batch; with nothing due Triton's call is 0.2-0.4 us cheaper up to batch 64 (2.4-2.7 against
2.8-2.9 us) and TileLang's from batch 256, but the host cannot know the due set, so TileLang is preferred at every
batch.
sm_100 (B200): the TileLang kernel is the design target (the seed kernel's architecture); not yet measured here.
Other CUDA GPUs: only the Triton backend serves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layout import Pool

#: compute capability -> GPU backends in order of preference (the reference is always appended last by the dispatch)
PREFERRED: dict[tuple[int, int], tuple[str, ...]] = {
    (9, 0): ("tilelang", "triton"),
    (10, 0): ("tilelang", "triton"),
}
OTHERS: tuple[str, ...] = ("triton",)


def preferred(pool: "Pool", num_rows: int) -> list[str]:
    """GPU backends in order of preference for a call of ``num_rows`` rows on ``pool``'s device (the measured order
    does not depend on the batch at the measured points; the argument keeps the choice free to)."""
    return list(PREFERRED.get(torch.cuda.get_device_capability(pool.device), OTHERS))
