"""Which GPU kernel ``auto`` prefers, from committed measurements (not guesses).

On sm_100 the TileLang kernel is the design target and is preferred. On sm_90 the choice between TileLang and Triton
follows the H200 results committed under ``bench/results/``: :data:`SM90_TILELANG_FASTER_FROM` is the smallest batch
(rows per call) at which the TileLang kernel was measured faster than the Triton kernel (``None``: never measured
faster, so Triton is preferred at every batch).
"""
from __future__ import annotations

import torch

from .layout import Pool

#: source: bench/results/h200_82c9c59_all-backends.md (one run, KDA and GDN): TileLang all due 26.7 / 86.1 / 311.6 /
#: 612.8 us at batch 16 / 64 / 256 / 512 against the Triton backend's (Gluon kernel) 33.2 / 105.9 / 393.5 / 785.9 us
#: (1.23-1.30x, both gates), and 1.24-1.37x faster at 1/16 due; with nothing due Triton's call is 0.2-0.4 us cheaper up
#: to batch 256 (2.4-2.8 against 2.8-3.0 us; 4.4 against 3.1 at 512), but the host cannot know the due set: TileLang is
#: preferred from batch 1
SM90_TILELANG_FASTER_FROM: int | None = 1


def preferred(pool: Pool, num_rows: int) -> list[str]:
    """GPU backends in order of preference for a call of ``num_rows`` rows on ``pool``'s device."""
    major, minor = torch.cuda.get_device_capability(pool.device)
    if major == 10:
        return ["tilelang", "triton"]
    if (major, minor) == (9, 0):
        if SM90_TILELANG_FASTER_FROM is not None and num_rows >= SM90_TILELANG_FASTER_FROM:
            return ["tilelang", "triton"]
        return ["triton", "tilelang"]
    return ["triton"]
