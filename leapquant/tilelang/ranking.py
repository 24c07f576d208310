"""Ranking: every CTA finds the call's due programs and keeps its share of them.

Every CTA ranks alike (in the order of the mask words below) and keeps the ranks congruent to its block index modulo
the grid size, so due programs are spread evenly over the CTAs (+-1) however they cluster in the pool.
"""
from __future__ import annotations

import tilelang.language as T

from ..numerics import L
from .config import CHUNK_WORDS, CTA_THREADS, CTA_WARPS, I32, LIST_CAP, U32, WARP, WARP_LEVELS


@T.macro
def ranking(cfg, pool, rk, rank_lo, bid, tx, clock):
    """Rank the due programs of the call; keep those with rank = bid (mod grid) and rank in
    [rank_lo, rank_lo + grid * LIST_CAP) in ``rk.dlist`` (slot * H + head). ``rk.ranked[0]`` ends as the total count.
    The rows are taken a scan step at a time: one 32-program mask word per CTA thread. (``clock``: the prologue build's
    stamps after the step's first three barriers.)"""
    H = cfg.num_heads
    G = cfg.num_sms
    STEP_ROWS = cfg.rows_per_scan_step
    SLOTS_PER_THREAD = STEP_ROWS // CTA_THREADS
    WORDS_PER_WARP = CTA_THREADS // CTA_WARPS   # mask words built by one warp per step (32)
    HCNT_VEC = CHUNK_WORDS                      # fill counters per 16-byte load (H is a multiple of 4)
    idx, hcnt, n_rows, num_slots = pool.idx, pool.hcnt, pool.n_rows, pool.num_slots
    slot_s, mask_s, wsum_s, dlist, ranked = rk.slot_s, rk.mask_s, rk.wsum_s, rk.dlist, rk.ranked
    lane = tx % WARP
    warp = tx // WARP
    ranked[0] = 0
    for scan_step in T.serial(T.ceildiv(n_rows, STEP_ROWS)):
        row0 = scan_step * STEP_ROWS
        for i in T.unroll(SLOTS_PER_THREAD):
            n = row0 + i * CTA_THREADS + tx
            s = idx[T.min(n, n_rows - 1)]
            slot_s[i * CTA_THREADS + tx] = T.if_then_else((n < n_rows) & (s > 0) & (s < num_slots), s, 0)
        T.sync_threads()
        clock.prologue_cta(17)
        # the fill counters four heads (16 bytes) per load: load i of lane covers programs 4 q .. 4 q + 3 with
        # q = (warp + CTA_WARPS i) WARP + lane, and mask word 4 (warp + CTA_WARPS i) + c holds their c-th flags
        # (bit = lane). Rows past the call read slot 0's counters, which the slot check masks
        flags = T.alloc_local((WORDS_PER_WARP,), I32)
        sls = T.alloc_local((WORDS_PER_WARP // HCNT_VEC,), I32)
        for i in T.unroll(WORDS_PER_WARP // HCNT_VEC):      # all loads in flight before the first ballot
            q = (warp + CTA_WARPS * i) * WARP + lane
            sls[i] = slot_s[q * HCNT_VEC // H]
            for c in T.vectorized(HCNT_VEC):
                flags[i * HCNT_VEC + c] = hcnt[sls[i], q * HCNT_VEC % H + c]
        for i in T.unroll(WORDS_PER_WARP // HCNT_VEC):
            for c in T.unroll(HCNT_VEC):
                bal = T.cast(T.ballot_sync((sls[i] > 0) & (flags[i * HCNT_VEC + c] == L)), U32)
                if lane == 0:
                    mask_s[HCNT_VEC * (warp + CTA_WARPS * i) + c] = bal
        T.sync_threads()
        clock.prologue_cta(18)
        # exclusive prefix of the per-word counts: warp scan, then the warp totals
        cnt = T.call_extern(I32, "__popc", mask_s[tx])
        incl = T.alloc_local((1,), I32)
        incl[0] = cnt
        for s in T.unroll(WARP_LEVELS):
            up = T.shfl_up(incl[0], 1 << s)
            incl[0] = incl[0] + T.if_then_else(lane >= (1 << s), up, 0)
        if lane == WARP - 1:
            wsum_s[warp] = incl[0]
        T.sync_threads()
        clock.prologue_cta(19)
        before = T.alloc_local((2,), I32)
        before[0] = 0
        before[1] = 0
        for w in T.unroll(CTA_WARPS):
            before[0] = before[0] + T.if_then_else(w < warp, wsum_s[w], 0)
            before[1] = before[1] + wsum_s[w]
        first_rank = ranked[0] + before[0] + incl[0] - cnt
        mine = first_rank + (bid - first_rank % G + G) % G      # first rank >= first_rank owned by this CTA
        if (mine < first_rank + cnt) & (mine >= rank_lo) & (mine < rank_lo + G * LIST_CAP):
            bit = T.call_extern(I32, "lq_nth_set_bit", mask_s[tx], mine - first_rank)
            prog = ((tx // HCNT_VEC) * WARP + bit) * HCNT_VEC + tx % HCNT_VEC
            dlist[(mine - rank_lo) // G] = slot_s[prog // H] * H + prog % H
        ranked[0] = ranked[0] + before[1]
        T.sync_threads()
