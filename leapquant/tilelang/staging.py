"""Staging: a program's inputs copied into its group's prefetch buffers, turned into what the rebuild reads, and the
program's window reset in the pool.

A program's checkpoint, window and gate are copied into shared memory by cp.async (:func:`prefetch`) as soon as the
previous program's codes are in registers, so the DRAM traffic overlaps the compute; the round's first program is
fetched in two commit groups (:func:`prefetch_first`). The staging then reads only shared memory: scales and gate
(fp32), old tokens, window values and keys (w_j kbuf_j D_j split into two bf16 parts) as the packed pairs the mma
fragments read. A round's first program is staged by the whole group (:func:`stage`); every later one by the staging
warps in the orthonormalisation's intervals, piece by piece (:func:`stage_column`, :func:`stage_row`,
:func:`stage_window_half`, :func:`window_reset`).

A program whose window is empty (every weight 0 and no decay: leapquant.reference.empty_window) is not flushed:
:func:`window_live` tests it where its window is reset and leaves a flag in shared memory for its checkpoint's
stores (:mod:`leapquant.tilelang.encode`); every store of the program is predicated on that test. The program is
computed like any other, so every warp of the group passes the same barriers.
"""
from __future__ import annotations

import tilelang.language as T

from ..layout import SK_WORD, SV_WORD, TOK_HALF, TOK_ROW
from ..numerics import K, L, R, V
from .buffers import code_chunk, col_word, region_word, row_word
from .config import (CHUNK_HALVES, CHUNK_WORDS, CK_CHUNKS, CODE_CHUNKS, CODES_PER_WORD, F16, F32, GROUP_THREADS,
                     HALF_WINDOW, I32, KEY_PARTS, QMAXF, QUADS, ROW_CHUNKS, ROW_STEP, TILE, TILE_WORDS, U32, WARP,
                     WINDOW_CHUNKS)


@T.macro
def copy_window(cfg, pool, pf, g, slot, head, t, nthreads):
    """The program's window and gate (kbuf, ubuf, gbuf, w, pcum / p) into group ``g``'s prefetch buffers (cp.async,
    issued by ``nthreads`` threads; the caller commits)."""
    for k in T.unroll(WINDOW_CHUNKS // nthreads):
        h0 = (k * nthreads + t) * CHUNK_HALVES  # a 16-byte chunk of an [L, 128] 16-bit tensor
        T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.kb[g, h0 // K, h0 % K]),
                                 T.address_of(pool.kbuf[slot, head, h0 // K, h0 % K])))
        T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.ub[g, h0 // V, h0 % V]),
                                 T.address_of(pool.ubuf[slot, head, h0 // V, h0 % V])))
        if cfg.kda:
            T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.gb[g, h0 // K, h0 % K]),
                                     T.address_of(pool.gbuf[slot, head, h0 // K, h0 % K])))
    if t < L // CHUNK_WORDS:
        T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.w[g, t * CHUNK_WORDS]),
                                 T.address_of(pool.w[slot, head, t * CHUNK_WORDS])))
    if cfg.kda:
        if t < K // CHUNK_WORDS:
            T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.pc[g, t * CHUNK_WORDS]),
                                     T.address_of(pool.pcum[slot, head, t * CHUNK_WORDS])))
    else:
        if t == 0:
            T.evaluate(T.call_extern("handle", "lq_cp4", T.address_of(pf.pc[g, 0]), T.address_of(pool.p[slot, head])))


@T.macro
def prefetch(cfg, pool, pf, g, slot, head, t, nthreads):
    """Start copying the program's checkpoint, window and gate into group ``g``'s prefetch buffers (cp.async, one
    commit group), issued by ``nthreads`` threads (t < nthreads: the whole group, or its staging warps); nothing is
    read from them before the issuing threads waited and synchronised with the readers."""
    base = region_word(slot, head, cfg.num_heads)
    for k in T.unroll(T.ceildiv(CK_CHUNKS, nthreads)):
        e = k * nthreads + t
        if e < CK_CHUNKS:
            dst = T.if_then_else(e < CODE_CHUNKS, code_chunk(e // ROW_CHUNKS, e % ROW_CHUNKS), e)
            T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.ck[g, dst * CHUNK_WORDS]),
                                     T.address_of(pool.raw32[base + e * CHUNK_WORDS])))
    copy_window(cfg, pool, pf, g, slot, head, t, nthreads)
    T.evaluate(T.call_extern("handle", "lq_cp_commit"))


@T.macro
def prefetch_first(cfg, pool, pf, g, slot, head, t):
    """The round's first program, by the whole group, in two commit groups: first what the staging reads (window,
    gate, the checkpoint's scales and tokens), then the codes (16 of the 32 KB), so that the staging can start while
    the codes are still landing (lq_cp_wait_but_last): when the round starts, every group of every SM requests its
    program at once and the codes arrive last."""
    base = region_word(slot, head, cfg.num_heads)
    for k in T.unroll(T.ceildiv(CK_CHUNKS - CODE_CHUNKS, GROUP_THREADS)):
        e = CODE_CHUNKS + k * GROUP_THREADS + t
        if e < CK_CHUNKS:
            T.evaluate(T.call_extern("handle", "lq_cp16", T.address_of(pf.ck[g, e * CHUNK_WORDS]),
                                     T.address_of(pool.raw32[base + e * CHUNK_WORDS])))
    copy_window(cfg, pool, pf, g, slot, head, t, GROUP_THREADS)
    T.evaluate(T.call_extern("handle", "lq_cp_commit"))
    for k in T.unroll(CODE_CHUNKS // GROUP_THREADS):
        e = k * GROUP_THREADS + t
        T.evaluate(T.call_extern("handle", "lq_cp16",
                                 T.address_of(pf.ck[g, code_chunk(e // ROW_CHUNKS, e % ROW_CHUNKS) * CHUNK_WORDS]),
                                 T.address_of(pool.raw32[base + e * CHUNK_WORDS])))
    T.evaluate(T.call_extern("handle", "lq_cp_commit"))


@T.macro
def window_live(cfg, pf, sh, g, t, live):
    """Whether group ``g``'s prefetched program has anything to fold: ``live[0]`` (a local int32) becomes 1 when some
    weight is not 0 or its gate decays the checkpoint (KDA: some pcum is not 0; GDN: p is not 1), 0 when its window is
    empty (a NaN counts as something, -0.0 as zero: the complement of leapquant.reference.empty_window); thread
    ``t == 0`` also records it in ``sh.live_s[g]`` for the program's own stores (read after a later barrier). Each
    calling warp reads the weights and gate whole, a 16-byte chunk per lane, after the barrier that follows their
    copies, and combines them by one vote, so its own stores can test ``live[0]`` without a barrier."""
    lane = t % WARP
    nz = T.alloc_local((1,), I32)
    nz[0] = 0
    if lane < L // CHUNK_WORDS:
        for c in T.unroll(CHUNK_WORDS):
            nz[0] = nz[0] | T.if_then_else(pf.w[g, lane * CHUNK_WORDS + c] != 0.0, 1, 0)
    if cfg.kda:
        if lane < K // CHUNK_WORDS:
            for c in T.unroll(CHUNK_WORDS):
                nz[0] = nz[0] | T.if_then_else(pf.pc[g, lane * CHUNK_WORDS + c] != 0.0, 1, 0)
    else:
        if lane == 0:
            nz[0] = nz[0] | T.if_then_else(pf.pc[g, 0] != 1.0, 1, 0)
    live[0] = T.if_then_else(T.call_extern(I32, "lq_warp_any", nz[0]) != 0, 1, 0)
    if t == 0:
        sh.live_s[g] = live[0]


@T.macro
def load_codes(pf, th, cw):
    """The program's old codes (the thread's 8 x 8 tile, two int32 words per row) from the prefetch buffer into the
    registers ``cw``."""
    chunk = th.col0 // (CODES_PER_WORD * CHUNK_WORDS)
    half = (th.col0 // (CODES_PER_WORD * TILE_WORDS)) % 2
    for i in T.unroll(TILE):
        row = th.rbase + ROW_STEP * i
        for c in T.vectorized(TILE_WORDS):
            cw[i * TILE_WORDS + c] = pf.ck[th.g, code_chunk(row, chunk) * CHUNK_WORDS + half * TILE_WORDS + c]


@T.macro
def stage_window_part(cfg, pf, sh, g, c, lo, n, decay):
    """Window entries [lo, lo + n) (lo, n even) of column and row ``c``, newest first: the keys w_j kbuf_j D_j split
    into two bf16 parts and the values as bf16 pairs, to shared memory as the mma operands. ``decay[0]`` carries the
    chain D_j = prod_{i > j} gbuf[i] (KDA): D_{lo + n - 1} on entry, D_{lo - 1} on exit, so parts staged newest first
    multiply the same gates in the same order as one chain from the last entry back (the keys do not depend on how the
    window is shared out)."""
    key = T.alloc_local((n,), F32)
    for jj in T.unroll(n):
        j = lo + n - 1 - jj
        key[n - 1 - jj] = T.cast(pf.kb[g, j, c], F32) * pf.w[g, j]
        if cfg.kda:
            key[n - 1 - jj] = key[n - 1 - jj] * decay[0]
            decay[0] = decay[0] * T.cast(pf.gb[g, j, c], F32)
    for pp in T.unroll(n // 2):
        pg = lo // 2 + pp                       # the pair's index in the window
        for part in T.unroll(KEY_PARTS):
            sh.kw_s[g, part, pg, col_word(pg % QUADS, c)] = T.call_extern(U32, "lq_key_part", key[2 * pp],
                                                                          key[2 * pp + 1], part)
        sh.ubw_s[g, pg, row_word(pg % QUADS, c)] = T.call_extern(
            U32, "lq_pack_bf16x2", T.cast(pf.ub[g, 2 * pg, c], F32), T.cast(pf.ub[g, 2 * pg + 1, c], F32))


@T.macro
def stage_window_half(cfg, pf, sh, g, c, h):
    """Window half ``h`` (entries [HALF_WINDOW h, HALF_WINDOW (h + 1))) of column and row ``c``
    (:func:`stage_window_part`); the older half starts its decay chain from the newer half's gate product."""
    decay = T.alloc_local((1,), F32)
    decay[0] = 1.0
    if cfg.kda:
        if h == 0:
            for jj in T.unroll(HALF_WINDOW):
                decay[0] = decay[0] * T.cast(pf.gb[g, L - 1 - jj, c], F32)
    stage_window_part(cfg, pf, sh, g, c, HALF_WINDOW * h, HALF_WINDOW, decay)


@T.macro
def stage_column(cfg, pf, sh, g, c):
    """Column ``c``: the dequantisation step s_k / 127, the gate, the old u tokens as fp16 mma pairs."""
    tok = T.alloc_local((R,), F32)
    sh.sko_s[g, c] = pf.ckf[g, SK_WORD + c] / QMAXF
    if cfg.kda:
        sh.gate_s[g, c] = T.exp(pf.pc[g, c])
    else:
        sh.gate_s[g, c] = pf.pc[g, 0]
    for r in T.unroll(R):
        tok[r] = T.cast(pf.ckh[g, TOK_HALF + r * TOK_ROW + c], F32)
    for pr in T.unroll(R // 2):
        sh.tok_old_s[g, 0, pr, col_word(pr, c)] = T.call_extern(U32, "lq_pack_f16x2", tok[2 * pr], tok[2 * pr + 1])


@T.macro
def stage_row(pf, sh, g, c):
    """Row ``c``: the old row scale, the old q tokens as fp16 mma pairs."""
    tok = T.alloc_local((R,), F32)
    sh.svo_s[g, c] = pf.ckf[g, SV_WORD + c]
    for r in T.unroll(R):
        tok[r] = T.cast(pf.ckh[g, TOK_HALF + r * TOK_ROW + K + c], F32)
    for pr in T.unroll(R // 2):
        sh.tok_old_s[g, 1, pr, row_word(pr, c)] = T.call_extern(U32, "lq_pack_f16x2", tok[2 * pr], tok[2 * pr + 1])


@T.macro
def window_reset(cfg, pool, slot, head, t, nthreads, live):
    """The program's window reset in the pool (w = 0, pcum = 0, gbuf = 1; GDN p = 1) by ``nthreads`` threads, 16 bytes
    per store, where ``live`` (its window is not empty: an empty one is left as it is). The staging reads the window
    from the prefetch buffers, so the reset only has to follow the copies: every issuing thread waited for its own
    and synchronised with the others."""
    if live:
        if t < L // CHUNK_WORDS:
            for c in T.vectorized(CHUNK_WORDS):
                pool.w[slot, head, t * CHUNK_WORDS + c] = 0.0
        if cfg.kda:
            for k in T.unroll(WINDOW_CHUNKS // nthreads):
                h0 = (k * nthreads + t) * CHUNK_HALVES
                for c in T.vectorized(CHUNK_HALVES):
                    pool.gbuf[slot, head, h0 // K, h0 % K + c] = T.cast(1.0, F16)
            if t < K // CHUNK_WORDS:
                for c in T.vectorized(CHUNK_WORDS):
                    pool.pcum[slot, head, t * CHUNK_WORDS + c] = 0.0
        else:
            if t == 0:
                pool.p[slot, head] = 1.0


@T.macro
def stage(cfg, pool, pf, sh, g, slot, head, t, live):
    """The whole staging of a program by the whole group (the first program of a round; the others are staged by the
    staging warps while the previous one is orthonormalised): scales and gate into shared memory (fp32); tokens,
    window values and the window keys into shared memory as the packed pairs the mma fragments read; then the window
    reset in the pool where ``live``. Thread t takes column and row c = t % K and window half t // K; the column work
    goes to half 0, the row work to half 1. (The codes stay in the prefetch buffer: :func:`load_codes`.)"""
    c = t % K
    h = t // K                                  # warp-uniform: warps 0-3 take the older half
    stage_window_half(cfg, pf, sh, g, c, h)
    if h == 0:
        stage_column(cfg, pf, sh, g, c)
    else:
        stage_row(pf, sh, g, c)
    window_reset(cfg, pool, slot, head, t, GROUP_THREADS, live)
