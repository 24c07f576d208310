"""The snapshot a decode call splits on: which of its programs its step makes due.

On a GPU the Triton backend's :func:`leapquant.decode_inplace` runs in two halves side by side
(:func:`leapquant.triton.launch.decode`): the programs whose window this step fills, about 1/16 of them at the steady
state, are stepped and then flushed on a second stream while the others are stepped on the caller's stream, so that
the flush's long per-program chain runs under the step's memory traffic instead of after it. The fill counts change
under both halves (each step writes its own), so both, and the flush's ranking, decide by one snapshot of them taken
before either starts: :func:`snapshot_due`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..numerics import L

_L = tl.constexpr(L)
#: flags per program of the snapshot
BLOCK = 1024


@triton.jit(do_not_specialize=["total", "num_slots"])
def snapshot_due(idx_ptr, hcnt_ptr, flags_ptr, total, num_slots, H: tl.constexpr, BLOCK: tl.constexpr):
    """flags[row * H + head] = 1 where the step of this call makes program (idx[row], head) due, else 0, for the
    ``total`` = N * H programs of the call (grid: cdiv(total, BLOCK)). A program becomes due when the entry its step
    appends is the window's last: its fill count h, read as the step reads it (L as 0, then clamped to [0, L - 1]),
    is L - 1, i.e. hcnt == L - 1 or hcnt > L. Rows without a sequence (slot <= 0 or >= num_slots) are never due.

    idx int32 [N], hcnt int32 [NS, H], flags int8 [>= total]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    row = offs // H
    head = offs % H
    slot = tl.load(idx_ptr + row, mask=inside, other=0).to(tl.int64)
    ok = inside & (slot > 0) & (slot < num_slots)
    fill = tl.load(hcnt_ptr + slot * H + head, mask=ok, other=0)
    due = ok & ((fill == _L - 1) | (fill > _L))
    tl.store(flags_ptr + offs, due.to(tl.int8), mask=inside)
