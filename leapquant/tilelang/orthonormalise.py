"""Orthonormalise: CholeskyQR of P (K x R) and Q (V x R) on a group's warps 0-3, one row per thread.

A pass is X <- X L^-T with L L^T = X^T X, in two halves with a group barrier between them: :func:`gram` (the 4 x 4
Gram matrix, reduce-scattered over each warp's lanes, partials to shared memory) and :func:`cholesky` (the four warps'
partials summed, the factor in every thread's registers with the pivot floors of :mod:`leapquant.numerics`, the row
times L^-T). P gets ``P_CHOLQR_PASSES`` passes, Q ``Q_CHOLQR_PASSES`` (numerics says why); the program loop in
:mod:`leapquant.tilelang.kernel` places them.
"""
from __future__ import annotations

import tilelang.language as T

from ..numerics import CHOLQR_ABS_FLOOR, CHOLQR_RELATIVE_FLOOR, R
from .config import CHUNK_WORDS, F32, GRAM_ENTRIES, GRAM_SLOT, ORTH_WARPS, WARP


def tri(j, i):
    """Index of entry (j, i), i <= j, of a packed lower-triangular 4 x 4 matrix."""
    return j * (j + 1) // 2 + i


@T.macro
def gram(sh, th, x4, ps):
    """CholeskyQR pass ``ps``, first half (threads t < V, whose row t of the 128 x R matrix X is x4; K == V): this
    warp's part of the Gram matrix G = X^T X in fp32 (each thread its row's products) to ``sh.gram_s``, summed over the
    warp by a reduce-scatter: at each lane bit, from bit 4 down, a lane keeps half of its sums and adds the partner's
    (10 -> 5 -> 3 -> 2 -> 1 sums), so that entry b1 ? 2 + 5 b4 : b2 + 3 b3 + 5 b4 ends in the lanes of those bits and
    one of them writes it (12 shuffles where a butterfly per entry takes 50). The caller synchronises the group before
    :func:`cholesky` reads it."""
    lane = th.lane
    gr = T.alloc_local((GRAM_ENTRIES,), F32)
    sums = T.alloc_local((GRAM_ENTRIES // 2,), F32)
    warp = th.t // WARP
    for j in T.unroll(R):
        for i in T.unroll(R):
            if i <= j:
                gr[tri(j, i)] = x4[j] * x4[i]
    b4 = (lane >> 4) & 1
    b3 = (lane >> 3) & 1
    b2 = (lane >> 2) & 1
    b1 = (lane >> 1) & 1
    for k in T.unroll(GRAM_ENTRIES // 2):      # bit 4: entries k and k + 5
        sums[k] = (T.if_then_else(b4 == 1, gr[k + 5], gr[k])
                   + T.shfl_xor(T.if_then_else(b4 == 1, gr[k], gr[k + 5]), 16))
    for k in T.unroll(2):                       # bit 3: sums 0 and 3, 1 and 4; sum 2 whole
        sums[k] = (T.if_then_else(b3 == 1, sums[k + 3], sums[k])
                   + T.shfl_xor(T.if_then_else(b3 == 1, sums[k], sums[k + 3]), 8))
    sums[2] = sums[2] + T.shfl_xor(sums[2], 8)
    sums[0] = (T.if_then_else(b2 == 1, sums[1], sums[0])         # bit 2: sums 0 and 1; sum 2 whole
               + T.shfl_xor(T.if_then_else(b2 == 1, sums[0], sums[1]), 4))
    sums[2] = sums[2] + T.shfl_xor(sums[2], 4)
    sums[0] = (T.if_then_else(b1 == 1, sums[2], sums[0])         # bit 1: sums 0 and 2
               + T.shfl_xor(T.if_then_else(b1 == 1, sums[0], sums[2]), 2))
    sums[0] = sums[0] + T.shfl_xor(sums[0], 1)
    if ((lane & 1) == 0) & ((b1 == 0) | ((lane & 12) == 0)):
        sh.gram_s[th.g, ps, warp, T.if_then_else(b1 == 1, 2 + 5 * b4, b2 + 3 * b3 + 5 * b4)] = sums[0]


@T.macro
def cholesky(sh, th, x4, ps):
    """CholeskyQR pass ``ps``, second half (threads t < V): G from the four warps' partials summed in one fixed order
    (every thread holds the same G); its Cholesky factor with pivots d_j = max(G_jj - sum_{i<j} L_ji^2,
    CHOLQR_RELATIVE_FLOOR * G_jj, CHOLQR_ABS_FLOOR) in every thread's registers; then the row x <- L^-1 x (X <- X L^-T)
    by forward substitution. A zero column stays exactly zero."""
    gr = T.alloc_local((GRAM_SLOT,), F32)
    lf = T.alloc_local((GRAM_ENTRIES,), F32)    # L_ji below the diagonal, 1 / L_jj on it
    acc = T.alloc_local((1,), F32)
    for e in T.unroll(GRAM_SLOT):
        gr[e] = 0.0
    for w in T.unroll(ORTH_WARPS):
        for c in T.unroll(GRAM_SLOT // CHUNK_WORDS):
            for e in T.vectorized(CHUNK_WORDS):
                gr[c * CHUNK_WORDS + e] = gr[c * CHUNK_WORDS + e] + sh.gram_s[th.g, ps, w, c * CHUNK_WORDS + e]
    for j in T.unroll(R):                       # Cholesky, column by column
        acc[0] = gr[tri(j, j)]
        for i in T.unroll(R):
            if i < j:
                acc[0] = acc[0] - lf[tri(j, i)] * lf[tri(j, i)]
        lf[tri(j, j)] = T.rsqrt(T.max(T.max(acc[0], CHOLQR_RELATIVE_FLOOR * gr[tri(j, j)]), CHOLQR_ABS_FLOOR))
        for k in T.unroll(R):
            if k > j:
                acc[0] = gr[tri(k, j)]
                for i in T.unroll(R):
                    if i < j:
                        acc[0] = acc[0] - lf[tri(k, i)] * lf[tri(j, i)]
                lf[tri(k, j)] = acc[0] * lf[tri(j, j)]
    for j in T.unroll(R):                       # forward substitution: this thread's row
        for i in T.unroll(R):
            if i < j:
                x4[j] = x4[j] - lf[tri(j, i)] * x4[i]
        x4[j] = x4[j] * lf[tri(j, j)]


@T.macro
def store_basis(out_s, th, x4, split):
    """Row t (< V) of an orthonormal basis to ``out_s[g]``; ``split``: as its tf32 big parts, then small parts (P, the
    B operand of S P)."""
    g, t = th.g, th.t
    if split:
        for r in T.unroll(R):
            big = T.call_extern(F32, "lq_tf32_big", x4[r])
            out_s[g, t, r] = big
            out_s[g, t, R + r] = x4[r] - big
    else:
        for r in T.vectorized(R):
            out_s[g, t, r] = x4[r]
