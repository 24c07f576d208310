"""Project: the products S^T x (``project_t``: x = q0, then Q) and S x (``project``: x = P) of a group's state.

Each thread's partials are summed over the lanes that share its outputs before they reach shared memory (2 or 4
reduction planes instead of 16), and the orthonormalising warps sum the planes (:func:`sum_partials`). ``project``
runs on the tensor cores with the state registers as the A operand (3xTF32: the state and P split into big + small
tf32 parts), the only product that can use the registers without a transpose.
"""
from __future__ import annotations

import tilelang.language as T

from ..numerics import R, V
from .config import F32, M_TILES, MMA_M, PROJECT_LAYOUT, QUADS, ROW_STEP, TILE, TILE_BITS


def column_plane_row(pl, o):
    """Index of output row ``o`` of S^T x in reduction plane ``pl``: row o's low 3 bits advanced by twice its writer's
    quad (o >> 3), so that the 8 lanes of a quarter-warp of writers (grp = 2m, 2m + 1 x four quads) store to 8
    different bank quads; 8 consecutive rows (the readers) stay a permutation of one aligned group."""
    low = TILE - 1
    return pl * V + (o & ~low) + ((o + 2 * ((o >> TILE_BITS) & (QUADS - 1))) & low)


def row_plane_row(pl, o):
    """Index of row ``o`` in reduction plane ``pl`` of S P's partials: bit 2 flipped in the odd 8-row halves of a
    16-row mma tile, so that a half-warp's 8-byte stores (rows grp + 8 h, grp < 4, two column pairs) hit 32 different
    banks; the readers' 8 consecutive rows stay one aligned group."""
    return pl * V + (o ^ (((o >> TILE_BITS) & 1) << 2))


def partial_row(pl, o, layout):
    """Row ``o`` of plane ``pl`` as its writers laid it out (``layout``: PROJECT_T_LAYOUT or PROJECT_LAYOUT)."""
    return row_plane_row(pl, o) if layout == PROJECT_LAYOUT else column_plane_row(pl, o)


@T.macro
def scatter_sum(acc, red, lane, n, bit):
    """Reduce-scatter step over lane bit ``bit``: red[k] = the lane's kept half (k < n / 2) plus the partner's."""
    hi = ((lane >> bit) & 1) == 1
    for k in T.unroll(n // 2):
        keep = T.if_then_else(hi, acc[n // 2 + k], acc[k])
        give = T.if_then_else(hi, acc[k], acc[n // 2 + k])
        red[k] = keep + T.shfl_xor(give, 1 << bit)


@T.macro
def project_t(sh, th, S, x_s, xg):
    """S^T x (x = x_s[xg]: V x R) over the warp's 64 rows, to reduction plane ``th.wr`` (one per row band): the
    thread's partials over its 8 rows, then a reduce-scatter over the 8 lanes of a column octet (lane bits 2-4), after
    which lane grp holds column col0 + grp."""
    lane = th.lane
    acc = T.alloc_local((TILE * R,), F32)
    red = T.alloc_local((TILE * R // 2,), F32)
    xv = T.alloc_local((R,), F32)
    for e in T.unroll(TILE * R):
        acc[e] = 0.0
    for i in T.unroll(TILE):
        for r in T.vectorized(R):
            xv[r] = x_s[xg, th.rbase + ROW_STEP * i, r]
        for j in T.unroll(TILE):
            for r in T.unroll(R):
                acc[j * R + r] = acc[j * R + r] + S[i * TILE + j] * xv[r]
    scatter_sum(acc, red, lane, TILE * R, 4)
    scatter_sum(red, red, lane, TILE * R // 2, 3)
    scatter_sum(red, red, lane, TILE * R // 4, 2)
    for r in T.vectorized(R):
        sh.red_s[th.g, column_plane_row(th.wr, th.col0 + lane // QUADS), r] = red[r]


@T.macro
def project(sh, th, S):
    """S x (x = P, split into tf32 big and small parts: K x 2R, in ``sh.pv_s``) over the warp's 32 columns on the
    tensor cores, to reduction plane ``th.wc`` (one per column band). The thread's state tile is the A operand as it
    stands: k-step ks takes columns col0 + 2 ks (logical k = quad) and col0 + 2 ks + 1 (k = quad + 4), and B's rows are
    those columns of P. C's column n < R is S P_big, n >= R is S P_small: lanes quad and quad ^ 2 hold the two halves
    of the same outputs and exchange one row half each (one shuffle per value), after which quad m holds rows
    rbase + 16 mt + 8 (m // 2), outputs 2 (m % 2) + {0, 1}."""
    g, quad = th.g, th.quad
    acc = T.alloc_local((M_TILES * 4,), F32)
    bv = T.alloc_local((2,), F32)
    red = T.alloc_local((2,), F32)
    for e in T.unroll(M_TILES * 4):
        acc[e] = 0.0
    for ks in T.unroll(TILE // 2):
        for e in T.unroll(2):
            bv[e] = sh.pv_s[g, th.col0 + 2 * ks + e, th.grp]
        for mt in T.unroll(M_TILES):
            lo = 2 * mt * TILE + 2 * ks                 # rows grp (i = 2 mt) and grp + 8 (i = 2 mt + 1)
            T.evaluate(T.call_extern("handle", "lq_mma_tf32_split", T.address_of(acc[4 * mt]),
                                     T.address_of(acc[4 * mt + 1]), T.address_of(acc[4 * mt + 2]),
                                     T.address_of(acc[4 * mt + 3]), S[lo], S[lo + TILE], S[lo + 1],
                                     S[lo + TILE + 1], bv[0], bv[1]))
    hk = quad // 2
    for mt in T.unroll(M_TILES):
        for e in T.unroll(2):
            keep = T.if_then_else(hk == 1, acc[4 * mt + 2 + e], acc[4 * mt + e])
            give = T.if_then_else(hk == 1, acc[4 * mt + e], acc[4 * mt + 2 + e])
            red[e] = keep + T.shfl_xor(give, 2)
        for e in T.vectorized(2):
            sh.red_s[g, row_plane_row(th.wc, th.rbase + MMA_M * mt + ROW_STEP * hk), 2 * (quad % 2) + e] = red[e]


@T.macro
def sum_partials(sh, g, o, out4, planes, layout):
    """out4 = sum over the ``planes`` reduction planes of output row ``o`` (``layout``: the writers')."""
    part = T.alloc_local((R,), F32)
    for r in T.unroll(R):
        out4[r] = 0.0
    for pl in T.unroll(planes):
        for r in T.vectorized(R):
            part[r] = sh.red_s[g, partial_row(pl, o, layout), r]
        for r in T.unroll(R):
            out4[r] = out4[r] + part[r]
