"""Rebuild: S = (codes s_k s_v / 127 + q^T u) * gate + sum_j ubuf_j (w_j kbuf_j D_j), a thread's 8 x 8 block of it.

The dequantisation runs on the CUDA cores (a byte permute and an exact subtraction instead of a conversion,
``lq_code``), both rank updates on the tensor cores (mma.sync: fp16 tokens, bf16 window values x the keys' bf16 hi +
lo parts; the products are exact, the accumulation fp32). S is an 8 x 8 fp32 block per thread in the mma accumulator
layout (:mod:`leapquant.tilelang.config`, the state tile) and stays in registers until the codes.
"""
from __future__ import annotations

import tilelang.language as T

from .buffers import col_word, row_word
from .config import (CODE_SIGN_BITS, CODES_PER_WORD, F32, KEY_PARTS, M_TILES, MMA_M, N_TILES, QUADS, ROW_STEP, TILE,
                     TILE_WORDS, U32)


def acc_ptr(S, mt, nt, half, e):
    """Pointer to the state element of mma tile (mt, nt) that the C fragment's register 2 * half + e holds."""
    return T.address_of(S[(2 * mt + half) * TILE + 2 * nt + e])


@T.macro
def add_token_product(th, S, tok_s):
    """S += A^T B for the rank-4 tokens in ``tok_s[g]`` (side 1: the rows' A = q, side 0: the columns' B = u, fp16
    pairs), on the tensor cores: mma.m16n8k8 with k = the token rank padded to 8 by zero pairs. fp16 x fp16 products
    are exact in fp32, so this is the fp32 rank-4 update up to the order of the sums."""
    g, grp, quad = th.g, th.grp, th.quad
    a = T.alloc_local((M_TILES * 2,), U32)
    bfr = T.alloc_local((1,), U32)
    for mt in T.unroll(M_TILES):
        r0 = th.band_r + MMA_M * mt + grp
        a[2 * mt] = tok_s[g, 1, quad, row_word(quad, r0)]
        a[2 * mt + 1] = tok_s[g, 1, quad, row_word(quad, r0 + ROW_STEP)]
    for nt in T.unroll(N_TILES):
        c = th.band_c + TILE * (grp // 2) + 2 * nt + grp % 2   # the physical column of B's column grp
        bfr[0] = tok_s[g, 0, quad, col_word(quad, c)]
        for mt in T.unroll(M_TILES):
            T.evaluate(T.call_extern("handle", "lq_mma_f16_k8", acc_ptr(S, mt, nt, 0, 0), acc_ptr(S, mt, nt, 0, 1),
                                     acc_ptr(S, mt, nt, 1, 0), acc_ptr(S, mt, nt, 1, 1), a[2 * mt], a[2 * mt + 1],
                                     bfr[0]))


@T.macro
def rebuild(sh, th, S, cw):
    """S = (codes s_k / 127 s_v + q_old^T u_old) * gate + sum_j ubuf_j (w_j kbuf_j D_j), this thread's 8 x 8 part,
    from the codes in ``cw`` and the staged operands in ``sh``."""
    g, grp, quad = th.g, th.grp, th.quad
    colv = T.alloc_local((TILE,), F32)
    for j in T.unroll(TILE):
        colv[j] = sh.sko_s[g, th.col0 + j]
    for i in T.unroll(TILE):
        sv = sh.svo_s[g, th.rbase + ROW_STEP * i]
        for j in T.unroll(TILE):
            word = T.cast(cw[i * TILE_WORDS + j // CODES_PER_WORD], U32) ^ T.uint32(CODE_SIGN_BITS)
            S[i * TILE + j] = T.call_extern(F32, "lq_code", word, j % CODES_PER_WORD) * colv[j] * sv
    add_token_product(th, S, sh.tok_old_s)
    for j in T.vectorized(TILE):
        colv[j] = sh.gate_s[g, th.col0 + j]
    for i in T.unroll(TILE):
        for j in T.unroll(TILE):
            S[i * TILE + j] = S[i * TILE + j] * colv[j]
    # the window: A = ubuf^T (rows x 16 entries, bf16), B = the keys' two bf16 parts (16 entries x columns)
    a = T.alloc_local((M_TILES * 4,), U32)
    bfr = T.alloc_local((2,), U32)
    for mt in T.unroll(M_TILES):
        r0 = th.band_r + MMA_M * mt + grp
        a[4 * mt] = sh.ubw_s[g, quad, row_word(quad, r0)]
        a[4 * mt + 1] = sh.ubw_s[g, quad, row_word(quad, r0 + ROW_STEP)]
        a[4 * mt + 2] = sh.ubw_s[g, quad + QUADS, row_word(quad, r0)]
        a[4 * mt + 3] = sh.ubw_s[g, quad + QUADS, row_word(quad, r0 + ROW_STEP)]
    for nt in T.unroll(N_TILES):
        c = th.band_c + TILE * (grp // 2) + 2 * nt + grp % 2
        for part in T.unroll(KEY_PARTS):
            bfr[0] = sh.kw_s[g, part, quad, col_word(quad, c)]
            bfr[1] = sh.kw_s[g, part, quad + QUADS, col_word(quad, c)]
            for mt in T.unroll(M_TILES):
                T.evaluate(T.call_extern("handle", "lq_mma_bf16", acc_ptr(S, mt, nt, 0, 0),
                                         acc_ptr(S, mt, nt, 0, 1), acc_ptr(S, mt, nt, 1, 0),
                                         acc_ptr(S, mt, nt, 1, 1), a[4 * mt], a[4 * mt + 1], a[4 * mt + 2],
                                         a[4 * mt + 3], bfr[0], bfr[1]))
