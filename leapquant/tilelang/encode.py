"""The checkpoint written from S, Q and U = S^T Q: tokens, residual, scales (s_k, then s_v) and codes (the reference's
``encode``).

The residual runs on the tensor cores with the rounded tokens (exact fp16 products: no fp16 intermediate of the
state); each scale is a sum or maximum of 16 partials per output through padded shared-memory planes, two group
barriers each; the codes round once (``lq_pack_codes``: fma with RINT_MAGIC, ties to even, no conversion
instruction). Every store to the pool is one predicated instruction (prelude's lq_st_*_if) that stores only where
``code``, the program's code, is not negative: the program loop sets its sign bit where the program's window is
empty (staging.window_live), which leaves its checkpoint as it was; everything else, barriers included, runs
whatever the sign.
"""
from __future__ import annotations

import tilelang.language as T

from ..layout import SK_WORD, SV_WORD, TOK_HALF, TOK_ROW
from ..numerics import EPS, FP16_MAX, K, R, V
from .buffers import col_word, row_word
from .config import (CODE_WORDS_PER_ROW, CODES_PER_WORD, F16, F32, GROUP_THREADS, HALVES_PER_WORD, I32,
                     PROJECT_T_LAYOUT, QMAXF, ROW_STEP, SCALE_K_STRIDE, SCALE_V_STRIDE, STATE_ROW_BANDS, TILE,
                     TILE_WORDS, TILES_PER_SIDE, U32)
from .project import sum_partials
from .rebuild import add_token_product

assert TILE_WORDS == 2, "a row of a thread's codes is one lq_st_v2_if"


@T.macro
def tokens(pool, sh, th, base, code):
    """u = fp16(clamp(U^T)) (U summed here from its partials) and q = fp16(Q^T) to the pool at region word ``base``
    where ``code`` >= 0; the same fp16 values, q negated (exactly), to ``sh.tok_new_s`` as the operands of the
    residual's rank-4 update."""
    g, t, rawh = th.g, th.t, pool.rawh
    tok = T.alloc_local((R,), F32)
    if t < K:
        U4 = T.alloc_local((R,), F32)
        sum_partials(sh, g, t, U4, STATE_ROW_BANDS, PROJECT_T_LAYOUT)
        for r in T.unroll(R):
            uh = T.cast(T.min(T.max(U4[r], -FP16_MAX), FP16_MAX), F16)
            tok[r] = T.cast(uh, F32)
            T.evaluate(T.call_extern("handle", "lq_st_f16_if",
                                     T.address_of(rawh[base * HALVES_PER_WORD + TOK_HALF + r * TOK_ROW + t]),
                                     tok[r], code))
        for pr in T.unroll(R // 2):
            sh.tok_new_s[g, 0, pr, col_word(pr, t)] = T.call_extern(U32, "lq_pack_f16x2", tok[2 * pr],
                                                                    tok[2 * pr + 1])
    else:
        v = t - K
        for r in T.unroll(R):
            qh = T.cast(sh.qv_s[g, v, r], F16)
            T.evaluate(T.call_extern("handle", "lq_st_f16_if",
                                     T.address_of(rawh[base * HALVES_PER_WORD + TOK_HALF + r * TOK_ROW + K + v]),
                                     T.cast(qh, F32), code))
            tok[r] = -T.cast(qh, F32)
        for pr in T.unroll(R // 2):
            sh.tok_new_s[g, 1, pr, row_word(pr, v)] = T.call_extern(U32, "lq_pack_f16x2", tok[2 * pr],
                                                                    tok[2 * pr + 1])


@T.macro
def residual(sh, th, S):
    """E = S - q^T u with the fp16-rounded tokens, in place (tensor cores, exact products, fp32 sums)."""
    add_token_product(th, S, sh.tok_new_s)


@T.macro
def scales_k(pool, sh, th, S, base, code):
    """s_k = max(sqrt(mean_v |E|), EPS) to the pool where ``code`` >= 0, 1 / s_k to shared memory; then E / s_k in
    place (as a product with the reciprocal: an IEEE division per element costs more than the rest of the phase)."""
    g, t, col0, flat_s = th.g, th.t, th.col0, sh.flat_s
    part = T.alloc_local((TILE,), F32)
    for j in T.unroll(TILE):
        part[j] = 0.0
        for i in T.unroll(TILE):
            part[j] = part[j] + T.abs(S[i * TILE + j])
    for j in T.unroll(TILE):
        flat_s[g, th.tr * SCALE_K_STRIDE + col0 + j] = part[j]
    T.sync_threads(th.bar, GROUP_THREADS)
    if t < K:
        tot = T.alloc_local((1,), F32)
        tot[0] = 0.0
        for pl in T.unroll(TILES_PER_SIDE):
            tot[0] = tot[0] + flat_s[g, pl * SCALE_K_STRIDE + t]
        sk = T.max(T.sqrt(tot[0] / V), EPS)
        T.evaluate(T.call_extern("handle", "lq_st_f32_if", T.address_of(pool.rawf[base + SK_WORD + t]), sk, code))
        sh.skn_s[g, t] = 1.0 / sk                  # one division per column; the elements are multiplied
    T.sync_threads(th.bar, GROUP_THREADS)
    for j in T.vectorized(TILE):
        part[j] = sh.skn_s[g, col0 + j]
    for i in T.unroll(TILE):
        for j in T.unroll(TILE):
            S[i * TILE + j] = S[i * TILE + j] * part[j]


@T.macro
def scales_v(pool, sh, th, S, base, code):
    """s_v = max(max_k |E / s_k|, EPS) to the pool where ``code`` >= 0; 127 / s_v to shared memory."""
    g, t, flat_s = th.g, th.t, sh.flat_s
    part = T.alloc_local((TILE,), F32)
    for i in T.unroll(TILE):
        part[i] = 0.0
        for j in T.unroll(TILE):
            part[i] = T.max(part[i], T.abs(S[i * TILE + j]))
    for i in T.unroll(TILE):
        flat_s[g, th.tc * SCALE_V_STRIDE + th.rbase + ROW_STEP * i] = part[i]
    T.sync_threads(th.bar, GROUP_THREADS)
    if t < V:
        mx = T.alloc_local((1,), F32)
        mx[0] = 0.0
        for pl in T.unroll(TILES_PER_SIDE):
            mx[0] = T.max(mx[0], flat_s[g, pl * SCALE_V_STRIDE + t])
        sv = T.max(mx[0], EPS)
        T.evaluate(T.call_extern("handle", "lq_st_f32_if", T.address_of(pool.rawf[base + SV_WORD + t]), sv, code))
        sh.rsv_s[g, t] = QMAXF / sv
    T.sync_threads(th.bar, GROUP_THREADS)


@T.macro
def codes(pool, sh, th, S, base, code):
    """codes = round_half_even(x * fl(127 / s_v)) (the exact product rounded once, by lq_pack_codes), four to an int32
    word, to the pool where ``code`` >= 0 (a row's two words as one 8-byte store). No clamp: x = E / s_k with
    s_v >= max |x| over the row, so |x * fl(127 / s_v)| <= 127 (1 + 2^-22) < 127.5 rounds into [-127, 127]."""
    packed = T.alloc_local((TILE_WORDS,), I32)
    for i in T.unroll(TILE):
        row = th.rbase + ROW_STEP * i
        scale = sh.rsv_s[th.g, row]
        for c in T.unroll(TILE_WORDS):
            e = i * TILE + c * CODES_PER_WORD
            packed[c] = T.call_extern(I32, "lq_pack_codes", S[e], S[e + 1], S[e + 2], S[e + 3], scale)
        T.evaluate(T.call_extern("handle", "lq_st_v2_if",
                                 T.address_of(pool.raw32[base + row * CODE_WORDS_PER_ROW + th.col0 // CODES_PER_WORD]),
                                 packed[0], packed[1], code))
