"""Triton flush on the tensor cores, written in Gluon (Triton's explicit-layout dialect): the GPU kernel of the Triton
backend on sm_80 and newer.

Same contract, ranking and algorithm as :mod:`leapquant.triton.flush` (the ``tl`` kernel, which the interpreter runs);
what differs is that every tensor has a layout chosen here instead of by Triton:

- the state S [V, K] fp32 lives in the accumulator layout of the tensor cores' mma.m16n8 (``STATE``: 8 warps as
  2 row bands x 4 column bands, each thread 8 rows x 8 columns), so the three rank updates - the old tokens q^T u, the
  window ubuf^T keys, and nothing else - run as ``mma_v2`` with exact operands (fp16 tokens; bf16 window values times
  the keys split into two bf16 parts, 2^-17 relative) accumulating into S in fp32;
- both reduction directions stay cheap in that layout: a column sum S^T x adds 8 terms in a thread, then 3 shuffle
  levels and one exchange between the 2 row bands; a row sum S x 8 terms, 2 shuffle levels and the 4 column bands;
- the state is 64 registers per thread, so two programs of 8 warps can share an SM (the ``tl`` kernel's layout,
  chosen by its fp32 ``tl.dot``, needs ~230 registers: one program per SM).
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ..layout import (CODES_BYTE, EPS, FP16_MAX, K, L, OFF, QMAX, R, REGION_WORDS, SK_BYTE, SV_BYTE, TOK_BYTE, V)

assert R == 4 and V == 128 and K == 128 and L == 16, "the layouts below are written for a 128 x 128 state"

_V = gl.constexpr(V)
_K = gl.constexpr(K)
_L = gl.constexpr(L)
_R = gl.constexpr(R)
#: the rank-4 tokens padded to the k = 16 of an fp16 mma (the padding rows / columns are zeros)
_RPAD = gl.constexpr(16)
_TOK_ROW = gl.constexpr(K + V)
_QMAX = gl.constexpr(float(QMAX))
_EPS = gl.constexpr(EPS)
_FP16_MAX = gl.constexpr(FP16_MAX)
_OFF = gl.constexpr(OFF)
_REGION_WORDS = gl.constexpr(REGION_WORDS)
_CODES_BYTE = gl.constexpr(CODES_BYTE)
_SK_WORD = gl.constexpr(SK_BYTE // 4)
_SV_WORD = gl.constexpr(SV_BYTE // 4)
_TOK_HALF = gl.constexpr(TOK_BYTE // 2)
_ALIGN = gl.constexpr(math.gcd(OFF, REGION_WORDS))
#: CholeskyQR pivot floors, as the TileLang kernel's (their reasons are given there: CHOL_RELATIVE_FLOOR,
#: CHOL_ABS_FLOOR); P = S^T q0 gets one CholeskyQR pass and Q two, as there (P only seeds the iteration)
_REL_FLOOR = gl.constexpr(1e-6)
_ABS_FLOOR = gl.constexpr(1e-36)
# the code conversions of the tl kernel (their reasons are given there)
_RINT_MAGIC = gl.constexpr(12582912.0)
_CODE_BIAS_BITS = gl.constexpr(0x4B000080)
_CODE_OFFSET = gl.constexpr(8388736.0)
_BYTE = gl.constexpr(0xFF)

# ---- layouts -----------------------------------------------------------------------------------------------------------
@gluon.constexpr_function
def state_layout(warps):
    """The state and every [V, K] tensor: mma.m16n8 accumulators, warps in (warps / 4) row bands x 4 column bands
    (8 warps: 8 rows x 8 columns per thread)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps // 4, 4], instr_shape=[16, 8])


@gluon.constexpr_function
def window_layout(warps):
    """[L, K] window tiles (keys, gates): 64 / warps consecutive entries of one column per thread, so the decay
    products D_j (a reverse scan along the window) stay mostly inside a thread."""
    per = 64 // warps
    return gl.BlockedLayout([per, 1], [L // per, 32 * per // L], [1, warps], [0, 1])


@gluon.constexpr_function
def window_t_layout(warps):
    """[V, L] window values ubuf^T (ubuf is [L, V] row-major: consecutive values of one entry per thread)."""
    per = 64 // warps
    return gl.BlockedLayout([per, 1], [V // per, 32 * per // V], [1, warps], [0, 1])


@gluon.constexpr_function
def vector_layout(warps):
    """A 128-vector (a column of P, Q) for the orthonormalisation: 4 per thread over the 32 lanes of a warp, every
    warp holding all of it. Its reductions (the Gram matrices) stay inside a warp: shuffles, no barrier; the state
    layout's vectors would repeat the same work 16 times over more registers."""
    return gl.BlockedLayout([4], [32], [warps], [0])


@gluon.constexpr_function
def partials_layout(warps, axis):
    """One partial tensor [16, K] (axis 0) or [V, 16] (axis 1) as the reduce-scatter gathers it."""
    if axis == 0:
        return gl.BlockedLayout([warps, 1], [2, 16], [1, warps], [0, 1])
    return gl.BlockedLayout([1, 8], [16, 2], [warps, 1], [1, 0])


@gluon.constexpr_function
def partials4_layout(warps, axis):
    """Four stacked partial tensors [16, K, 2, 2] (axis 0) or [V, 16, 2, 2] (axis 1) as the reduce-scatter gathers
    them: along the summed axis 8 partials per thread and two lanes; the four operands in the same thread."""
    if axis == 0:
        return gl.BlockedLayout([warps, 1, 2, 2], [2, 16, 1, 1], [1, warps, 1, 1], [3, 2, 0, 1])
    return gl.BlockedLayout([1, 8, 2, 2], [16, 2, 1, 1], [warps, 1, 1, 1], [3, 2, 1, 0])


@gluon.constexpr_function
def flat_layout(warps):
    return gl.BlockedLayout([1], [32], [warps], [0])


# ---- the ranking (as in flush._rank_due, with explicit layouts) -------------------------------------------------------
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _mul(a, b):
    return a * b


@gluon.jit
def _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H: gl.constexpr, HP: gl.constexpr, G: gl.constexpr,
              CHUNK: gl.constexpr, TW: gl.constexpr):
    """Rank the call's due programs in flag order (row, head); write the code ``slot * H + head`` of each whose rank r
    is ``pid (mod G)`` to ``due[r]``; return their total. TW = lanes along the heads (min(HP, 32))."""
    FLAGS: gl.constexpr = gl.BlockedLayout([1, HP // TW], [32 // TW, TW], [gl.num_warps(), 1], [1, 0])
    FLAT: gl.constexpr = flat_layout(gl.num_warps())
    NROWS: gl.constexpr = CHUNK // HP
    heads = gl.arange(0, HP, layout=gl.SliceLayout(0, FLAGS))
    rows0 = gl.arange(0, NROWS, layout=gl.SliceLayout(1, FLAGS))
    total = 0
    r0 = 0
    while r0 < N:
        rows = r0 + rows0
        slot = gl.load(idx_ptr + rows, mask=rows < N, other=0)
        ok = (rows < N) & (slot > 0) & (slot < num_slots)
        live = ok[:, None] & (heads[None, :] < H)
        fill = gl.load(hcnt_ptr + slot.to(gl.int64)[:, None] * H + heads[None, :], mask=live, other=0)
        due = (live & (fill == _L)).to(gl.int32)
        per_row = gl.sum(due, 1)
        n = gl.sum(per_row, 0)
        if n > 0:
            # (Triton scans 1-D tensors of a blocked layout only: the row totals through FLAT and back)
            flat = gl.convert_layout(per_row, FLAT)
            before = gl.convert_layout(gl.associative_scan(flat, 0, _add) - flat, gl.SliceLayout(1, FLAGS))
            rank = total + before[:, None] + gl.associative_scan(due, 1, _add) - 1
            gl.store(due_ptr + rank, slot[:, None] * H + heads[None, :], mask=(due > 0) & (rank % G == pid))
        total += n
        r0 += NROWS
    return total


# ---- one item -----------------------------------------------------------------------------------------------------------
@gluon.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@gluon.jit
def _add10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9


@gluon.jit
def _inv_pivot(d, g):
    """1 / sqrt of a Cholesky pivot floored at REL_FLOOR * G_jj and ABS_FLOOR (flush._inv_pivot)."""
    return gl.rsqrt(gl.maximum(gl.maximum(d, _REL_FLOOR * g), _ABS_FLOOR))


@gluon.jit
def _cholqr(x0, x1, x2, x3):
    """One CholeskyQR pass over four column vectors: G = X^T X in one 10-operand reduction, its Cholesky factor on
    scalars (floored pivots), X L^-T by forward substitution."""
    g00, g10, g11, g20, g21, g22, g30, g31, g32, g33 = gl.reduce(
        (x0 * x0, x1 * x0, x1 * x1, x2 * x0, x2 * x1, x2 * x2, x3 * x0, x3 * x1, x3 * x2, x3 * x3), 0, _add10)
    i00 = _inv_pivot(g00, g00)
    l10 = g10 * i00
    l20 = g20 * i00
    l30 = g30 * i00
    i11 = _inv_pivot(g11 - l10 * l10, g11)
    l21 = (g21 - l20 * l10) * i11
    l31 = (g31 - l30 * l10) * i11
    i22 = _inv_pivot(g22 - l20 * l20 - l21 * l21, g22)
    l32 = (g32 - l30 * l20 - l31 * l21) * i22
    i33 = _inv_pivot(g33 - l30 * l30 - l31 * l31 - l32 * l32, g33)
    y0 = x0 * i00
    y1 = (x1 - l10 * y0) * i11
    y2 = (x2 - l20 * y0 - l21 * y1) * i22
    y3 = (x3 - l30 * y0 - l31 * y1 - l32 * y2) * i33
    return y0, y1, y2, y3


@gluon.jit
def _orthonormalize(c0, c1, c2, c3, PASSES: gl.constexpr):
    """CholeskyQR with PASSES passes on four 128-vectors (vector layout: every warp holds them whole, so the Gram
    matrices are warp-local shuffle reductions)."""
    for _ in gl.static_range(PASSES):
        c0, c1, c2, c3 = _cholqr(c0, c1, c2, c3)
    return c0, c1, c2, c3


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _own_rows(T, IS_MAX: gl.constexpr):
    """[16 (8 at 16 warps: WR * 8), K]: each thread's sum (or max) over its own rows of T [V, K] (state layout), no
    data crossing threads. Rows of the state layout: row = 16 WR m + 16 wr + 8 h + grp (m: repeats down the rows, wr:
    the row band, h: the two row halves of an mma tile, grp: the lane group); a thread holds every m and h of its
    (wr, grp), brought together so that a sum of products becomes one chain of FMAs."""
    WR: gl.constexpr = gl.num_warps() // 4
    part = gl.permute(gl.reshape(T, [_V // (16 * WR), WR, 2, 8, _K]), [0, 2, 1, 3, 4])
    part = gl.reshape(part, [_V // (8 * WR), WR * 8, _K])
    if IS_MAX:
        return gl.max(part, 0)
    return gl.sum(part, 0)


@gluon.jit
def _own_columns(T, IS_MAX: gl.constexpr):
    """[V, 16]: each thread's sum (or max) over its own columns of T [V, K] (state layout). Columns: col = 32 n +
    8 wc + 2 quad + j (n: repeats across, wc: the column band, quad: the lane in its group, j: the two columns of an
    mma fragment); a thread holds every n and j of its (wc, quad)."""
    part = gl.permute(gl.reshape(T, [_V, _K // 32, 4, 4, 2]), [0, 1, 4, 2, 3])
    part = gl.reshape(part, [_V, _K // 16, 16])
    if IS_MAX:
        return gl.max(part, 1)
    return gl.sum(part, 1)


@gluon.jit
def _finish4(a, b, c, d, AXIS: gl.constexpr, OUT: gl.constexpr):
    """Four partial tensors ([16, K] with AXIS 0, or [V, 16] with AXIS 1) summed along AXIS, all four through ONE
    shared-memory exchange (one pair of barriers): each partial row (column) is gathered into two threads, which add
    its 8 + 8 values (a reduce-scatter: no thread reduces what it does not keep)."""
    four = gl.join(gl.join(a, b), gl.join(c, d))
    four = gl.convert_layout(four, partials4_layout(gl.num_warps(), AXIS))
    ab, cd = gl.split(gl.sum(four, AXIS))
    a, b = gl.split(ab)
    c, d = gl.split(cd)
    return (gl.convert_layout(a, OUT), gl.convert_layout(b, OUT), gl.convert_layout(c, OUT),
            gl.convert_layout(d, OUT))


@gluon.jit
def _finish1(part, AXIS: gl.constexpr, IS_MAX: gl.constexpr, OUT: gl.constexpr):
    """One partial tensor reduced along AXIS as in :func:`_finish4` (sum, or max)."""
    part = gl.convert_layout(part, partials_layout(gl.num_warps(), AXIS))
    if IS_MAX:
        return gl.convert_layout(gl.max(part, AXIS), OUT)
    return gl.convert_layout(gl.sum(part, AXIS), OUT)


@gluon.jit
def _column_products(S, x0, x1, x2, x3, OUT: gl.constexpr):
    """S^T x [K] (layout OUT) for four V-vectors x (rows layout)."""
    return _finish4(_own_rows(S * x0[:, None], False), _own_rows(S * x1[:, None], False),
                    _own_rows(S * x2[:, None], False), _own_rows(S * x3[:, None], False), 0, OUT)


@gluon.jit
def _row_products(S, x0, x1, x2, x3, OUT: gl.constexpr):
    """S x [V] (layout OUT) for four K-vectors x (columns layout)."""
    return _finish4(_own_columns(S * x0[None, :], False), _own_columns(S * x1[None, :], False),
                    _own_columns(S * x2[None, :], False), _own_columns(S * x3[None, :], False), 1, OUT)


@gluon.jit
def _store_token(tok, r: gl.constexpr, U_r, Q_r, rk, rv):
    """Token row r: u = fp16(clamp(U_r)), q = fp16(Q_r) to the pool."""
    gl.store(tok + r * _TOK_ROW + rk, gl.minimum(gl.maximum(U_r, -_FP16_MAX), _FP16_MAX).to(gl.float16))
    gl.store(tok + r * _TOK_ROW + _K + rv, Q_r.to(gl.float16))


@gluon.jit
def _load_tokens(tok):
    """The checkpoint's tokens as mma operands: q^T [V, 16] and u [16, K] fp16, ranks 4..15 zero (k = 16 of an fp16
    mma; the padding contributes exact zeros)."""
    STATE: gl.constexpr = state_layout(gl.num_warps())
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=STATE, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=STATE, k_width=2)
    ta_r = gl.arange(0, _RPAD, layout=gl.SliceLayout(0, A_OP))
    ta_v = gl.arange(0, _V, layout=gl.SliceLayout(1, A_OP))
    qT = gl.load(tok + ta_r[None, :] * _TOK_ROW + _K + ta_v[:, None], mask=ta_r[None, :] < _R, other=0.0)
    tb_r = gl.arange(0, _RPAD, layout=gl.SliceLayout(1, B_OP))
    tb_k = gl.arange(0, _K, layout=gl.SliceLayout(0, B_OP))
    u = gl.load(tok + tb_r[:, None] * _TOK_ROW + tb_k[None, :], mask=tb_r[:, None] < _R, other=0.0)
    return qT, u


@gluon.jit
def _rebuild(codes_p, sk_p, sv_p, tok, kb, ub, wp, gb, gp, gate_ptr, prog, rv, rk, IS_KDA: gl.constexpr):
    """S [V, K] fp32 (state layout) = (codes s_k / 127 s_v + q^T u) * gate + ubuf^T keys, keys_j = w_j kbuf_j D_j
    (D_j = prod_{i > j} gbuf_i): the dequantisation on the CUDA cores, both rank updates on the tensor cores with
    exact operands."""
    STATE: gl.constexpr = state_layout(gl.num_warps())
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=STATE, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=STATE, k_width=2)
    WINDOW: gl.constexpr = window_layout(gl.num_warps())
    WINDOW_T: gl.constexpr = window_t_layout(gl.num_warps())
    codes = gl.load(codes_p.to(gl.pointer_type(gl.int8)))
    col = gl.load(sk_p) * (1.0 / _QMAX)
    s_v = gl.load(sv_p)
    # a code c in [-127, 127] plus the bits of 2^23 + 128 is the float 2^23 + 128 + c, from which subtracting
    # 2^23 + 128 is exact (no integer-to-float conversion)
    biased = (codes.to(gl.int32) + _CODE_BIAS_BITS).to(gl.float32, bitcast=True)
    S = (biased - _CODE_OFFSET) * col[None, :] * s_v[:, None]
    # old tokens: q^T [V, 16] x u [16, K] in fp16 on the tensor cores: exact products, fp32 sums
    qT, u = _load_tokens(tok)
    S = mma_v2(qT, u, S)
    if IS_KDA:
        S = S * gl.exp(gl.load(gp + rk))[None, :]
    else:
        S = S * gl.load(gate_ptr + prog)
    # the window: keys in fp32, split into bf16 hi + lo (hi = round(key), lo = round(key - hi): 2^-17 relative)
    wl = gl.arange(0, _L, layout=gl.SliceLayout(1, WINDOW))
    wk = gl.arange(0, _K, layout=gl.SliceLayout(0, WINDOW))
    keys = gl.load(kb + wl[:, None] * _K + wk[None, :]).to(gl.float32) * gl.load(wp + wl)[:, None]
    if IS_KDA:
        g_next = gl.load(gb + (wl[:, None] + 1) * _K + wk[None, :], mask=wl[:, None] + 1 < _L, other=1.0)
        keys = keys * gl.associative_scan(g_next.to(gl.float32), 0, _mul, reverse=True)
    hi = keys.to(gl.bfloat16)
    lo = (keys - hi.to(gl.float32)).to(gl.bfloat16)
    ul = gl.arange(0, _L, layout=gl.SliceLayout(0, WINDOW_T))
    uv = gl.arange(0, _V, layout=gl.SliceLayout(1, WINDOW_T))
    ubT = gl.convert_layout(gl.load(ub + ul[None, :] * _V + uv[:, None]), A_OP)
    S = mma_v2(ubT, gl.convert_layout(hi, B_OP), S)
    S = mma_v2(ubT, gl.convert_layout(lo, B_OP), S)
    return S


@gluon.jit
def _flush_one(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
               slot, head, H, SS, IS_KDA: gl.constexpr):
    """Flush program (slot, head) in place (slot, head int64 scalars)."""
    STATE: gl.constexpr = state_layout(gl.num_warps())
    WINDOW: gl.constexpr = window_layout(gl.num_warps())
    FLAT: gl.constexpr = flat_layout(gl.num_warps())
    rv = gl.arange(0, _V, layout=gl.SliceLayout(1, STATE))
    rk = gl.arange(0, _K, layout=gl.SliceLayout(0, STATE))
    region = gl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN)
    prog = slot * H + head
    kb = kbuf_ptr + gl.multiple_of(prog * (_L * _K), _L * _K)
    ub = ubuf_ptr + gl.multiple_of(prog * (_L * _V), _L * _V)
    wp = w_ptr + gl.multiple_of(prog * _L, _L)
    gb = gbuf_ptr + gl.multiple_of(prog * (_L * _K), _L * _K)
    gp = gate_ptr + gl.multiple_of(prog * _K, _K)
    codes_p = raw_u8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + rk[None, :]
    sk_p = raw_f32 + region + _SK_WORD + rk
    sv_p = raw_f32 + region + _SV_WORD + rv
    tok = raw_f16 + region * 2 + _TOK_HALF

    # (1) rebuild (its loads of the old checkpoint all complete before the first cross-warp reduction below, whose
    #     barrier orders them before any thread's stores of the new one)
    S = _rebuild(codes_p, sk_p, sv_p, tok, kb, ub, wp, gb, gp, gate_ptr, prog, rv, rk, IS_KDA)

    # (2) one subspace iteration from q0: P = orth(S^T q0) (one CholeskyQR pass), Q = orth(S P), U = S^T Q
    q0c0 = gl.load(q0_ptr + rv * _R + 0)
    q0c1 = gl.load(q0_ptr + rv * _R + 1)
    q0c2 = gl.load(q0_ptr + rv * _R + 2)
    q0c3 = gl.load(q0_ptr + rv * _R + 3)
    VEC: gl.constexpr = vector_layout(gl.num_warps())
    COLS: gl.constexpr = gl.SliceLayout(0, STATE)
    ROWS: gl.constexpr = gl.SliceLayout(1, STATE)
    p0, p1, p2, p3 = _column_products(S, q0c0, q0c1, q0c2, q0c3, VEC)
    p0, p1, p2, p3 = _orthonormalize(p0, p1, p2, p3, 1)
    p0 = gl.convert_layout(p0, COLS)
    p1 = gl.convert_layout(p1, COLS)
    p2 = gl.convert_layout(p2, COLS)
    p3 = gl.convert_layout(p3, COLS)
    c0, c1, c2, c3 = _row_products(S, p0, p1, p2, p3, VEC)
    c0, c1, c2, c3 = _orthonormalize(c0, c1, c2, c3, 2)
    c0 = gl.convert_layout(c0, ROWS)
    c1 = gl.convert_layout(c1, ROWS)
    c2 = gl.convert_layout(c2, ROWS)
    c3 = gl.convert_layout(c3, ROWS)
    U0, U1, U2, U3 = _column_products(S, c0, c1, c2, c3, COLS)

    # (3) tokens; (4) residual E = S - q^T u with exactly the stored (fp16) tokens, on the tensor cores: they are
    #     read back as mma operands after a barrier (the CTA's stores are then visible to all its threads)
    _store_token(tok, 0, U0, c0, rk, rv)
    _store_token(tok, 1, U1, c1, rk, rv)
    _store_token(tok, 2, U2, c2, rk, rv)
    _store_token(tok, 3, U3, c3, rk, rv)
    gl.thread_barrier()
    qT, u = _load_tokens(tok)
    E = mma_v2(-qT, u, S)

    # (5) smoothing scales (one rsqrt per column, as the tl kernel)
    m = gl.maximum(_finish1(_own_rows(gl.abs(E), False), 0, False, COLS) * (1.0 / _V), _EPS * _EPS)
    inv_sk = gl.rsqrt(m)
    s_k = gl.maximum(m * inv_sk, _EPS)
    x = E * inv_sk[None, :]
    s_v = gl.maximum(_finish1(_own_columns(gl.abs(x), True), 1, True, ROWS), _EPS)
    gl.store(sk_p, s_k)
    gl.store(sv_p, s_v)

    # (6) codes = round_half_even(127 x / s_v), by the 1.5 * 2^23 addition
    y = x * (_QMAX / s_v)[:, None]
    gl.store(codes_p, ((y + _RINT_MAGIC).to(gl.int32, bitcast=True) & _BYTE).to(gl.uint8))

    # (7) window reset
    wl = gl.arange(0, _L, layout=gl.SliceLayout(1, WINDOW))
    wk = gl.arange(0, _K, layout=gl.SliceLayout(0, WINDOW))
    gl.store(wp + gl.arange(0, _L, layout=FLAT), gl.zeros([_L], gl.float32, layout=FLAT))
    if IS_KDA:
        gl.store(gp + gl.arange(0, _K, layout=FLAT), gl.zeros([_K], gl.float32, layout=FLAT))
        gl.store(gb + wl[:, None] * _K + wk[None, :], gl.full([_L, _K], 1.0, gl.float16, layout=WINDOW))
    else:
        gl.store(gate_ptr + prog, 1.0)


@gluon.jit(do_not_specialize=["N", "num_slots", "SS"], do_not_specialize_on_alignment=["q0_ptr", "idx_ptr"])
def flush_due(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, idx_ptr, hcnt_ptr,
              due_ptr, N, num_slots, SS, H: gl.constexpr, HP: gl.constexpr, G: gl.constexpr,
              IS_KDA: gl.constexpr, CHUNK: gl.constexpr, TW: gl.constexpr):
    """Persistent program ``pid`` of ``G``: the same arguments as flush._flush_due (the interpreter's kernel)."""
    pid = gl.program_id(0)
    total = _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H, HP, G, CHUNK, TW)
    gl.thread_barrier()
    t = pid
    code = gl.load(due_ptr + t, mask=t < total, other=0).to(gl.int64)
    while t < total:
        t_next = t + G
        code_next = gl.load(due_ptr + t_next, mask=t_next < total, other=0).to(gl.int64)
        _flush_one(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
                   code // H, code % H, H, SS, IS_KDA)
        code = code_next
        t = t_next
