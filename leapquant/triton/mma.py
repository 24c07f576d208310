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
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

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
    """[K, L] window tiles (keys, gates), transposed: a whole column of the window per thread, so that the decay
    products D_j are multiplications inside a thread (:func:`_exclusive_suffix_products`); at 8 warps, warps 4-7
    repeat warps 0-3."""
    return gl.BlockedLayout([1, L], [32, 1], [warps, 1], [1, 0])


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
def bytes_layout(warps):
    """[V, K] int8 codes as 16-byte vectors: 16 consecutive codes of a row per thread."""
    return gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def halves_layout(warps):
    """[L, K] 16-bit window tensors as 16-byte vectors: 8 consecutive entries of a row per thread (for 8 warps)."""
    return gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])


@gluon.constexpr_function
def vector4_layout(warps):
    """Four 128-vectors stacked [128, 2, 2], each in the vector layout (split: four vector-layout tensors)."""
    return gl.BlockedLayout([4, 2, 2], [32, 1, 1], [warps, 1, 1], [0, 1, 2])


@gluon.constexpr_function
def stacked4_layout(vector):
    """Four stacked copies [n, 2, 2] of a 1-D layout given as its linear layout (``gl.to_linear_layout``): the two
    new dimensions in registers, so that splitting them gives four tensors of the original distribution."""
    def lift(bases):
        return [[b[0], 0, 0] for b in bases]
    return gl.DistributedLinearLayout(reg_bases=[[0, 1, 0], [0, 0, 1]] + lift(vector.reg_bases),
                                      lane_bases=lift(vector.lane_bases), warp_bases=lift(vector.warp_bases),
                                      block_bases=lift(vector.block_bases), shape=[vector.shape[0], 2, 2])


@gluon.jit
def _redistribute4(a, b, c, d, OUT: gl.constexpr):
    """Four vector-layout 128-vectors into layout OUT (a 1-D slice of the state layout) through one shared-memory
    exchange (one pair of barriers instead of four)."""
    OUT4: gl.constexpr = stacked4_layout(gl.to_linear_layout(OUT, [_V]))
    ab, cd = gl.split(gl.convert_layout(gl.join(gl.join(a, b), gl.join(c, d)), OUT4))
    a, b = gl.split(ab)
    c, d = gl.split(cd)
    return (gl.convert_layout(a, OUT, assert_trivial=True), gl.convert_layout(b, OUT, assert_trivial=True),
            gl.convert_layout(c, OUT, assert_trivial=True), gl.convert_layout(d, OUT, assert_trivial=True))


@gluon.constexpr_function
def tokens_layout(warps):
    """[R, K + V] fp16 token rows (and their zero padding): 4 consecutive halves (8 bytes) per thread, one row per
    two warps (8 warps)."""
    return gl.BlockedLayout([1, 4], [1, 32], [warps // 2, 2], [1, 0])


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
def _halves(x, N: gl.constexpr):
    """[K, N] (N in a thread's registers) -> its two halves [K, N / 2] along the last axis (no data moves)."""
    lo, hi = gl.split(gl.permute(gl.reshape(x, [_K, 2, N // 2]), [0, 2, 1]))
    return lo, hi


@gluon.jit
def _whole(lo, hi, N: gl.constexpr):
    """The inverse of :func:`_halves` (the halves' layouts are the same distribution)."""
    hi = gl.convert_layout(hi, lo.type.layout, assert_trivial=True)
    return gl.reshape(gl.permute(gl.join(lo, hi), [0, 2, 1]), [_K, N])


@gluon.jit
def _scaled(d, hi):
    """d [K, n] times the product of hi [K, n] along its last axis (in a thread)."""
    p = gl.convert_layout(gl.reduce(hi, 1, _mul), gl.SliceLayout(1, d.type.layout), assert_trivial=True)
    return d * p[:, None]


@gluon.jit
def _suffix2(x):
    """Exclusive suffix products along the last axis of [K, 2]: (x_1, 1)."""
    a, b = gl.split(x)
    return gl.join(b, gl.full_like(b, 1.0))


@gluon.jit
def _suffix4(x):
    lo, hi = _halves(x, 4)
    return _whole(_scaled(_suffix2(lo), hi), _suffix2(hi), 4)


@gluon.jit
def _suffix8(x):
    lo, hi = _halves(x, 8)
    return _whole(_scaled(_suffix4(lo), hi), _suffix4(hi), 8)


@gluon.jit
def _exclusive_suffix_products(x):
    """D_j = prod_{i > j} x_i along the last axis of x [K, L = 16] (the window in a thread's registers): halves
    recursively, each lower half times the product of its upper half (~20 multiplications, no shuffles)."""
    lo, hi = _halves(x, 16)
    return _whole(_scaled(_suffix8(lo), hi), _suffix8(hi), 16)


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
def _finish4(a, b, c, d, AXIS: gl.constexpr):
    """Four partial tensors ([16, K] with AXIS 0, or [V, 16] with AXIS 1) summed along AXIS into four 128-vectors
    (vector layout). All four go through ONE shared-memory exchange: each partial row (column) is gathered into two
    threads, which add its 8 + 8 values (a reduce-scatter: no thread reduces what it does not keep); the four sums
    then through one more, to every warp."""
    four = gl.join(gl.join(a, b), gl.join(c, d))
    four = gl.convert_layout(four, partials4_layout(gl.num_warps(), AXIS))
    ab, cd = gl.split(gl.convert_layout(gl.sum(four, AXIS), vector4_layout(gl.num_warps())))
    a, b = gl.split(ab)
    c, d = gl.split(cd)
    VEC: gl.constexpr = vector_layout(gl.num_warps())          # (the same distribution: no data moves)
    return (gl.convert_layout(a, VEC, assert_trivial=True), gl.convert_layout(b, VEC, assert_trivial=True),
            gl.convert_layout(c, VEC, assert_trivial=True), gl.convert_layout(d, VEC, assert_trivial=True))


@gluon.jit
def _finish1(part, AXIS: gl.constexpr, IS_MAX: gl.constexpr, OUT: gl.constexpr):
    """One partial tensor reduced along AXIS as in :func:`_finish4` (sum, or max)."""
    part = gl.convert_layout(part, partials_layout(gl.num_warps(), AXIS))
    if IS_MAX:
        return gl.convert_layout(gl.max(part, AXIS), OUT)
    return gl.convert_layout(gl.sum(part, AXIS), OUT)


@gluon.jit
def _column_products(S, x0, x1, x2, x3):
    """S^T x [K] (vector layout) for four V-vectors x (rows layout)."""
    return _finish4(_own_rows(S * x0[:, None], False), _own_rows(S * x1[:, None], False),
                    _own_rows(S * x2[:, None], False), _own_rows(S * x3[:, None], False), 0)


@gluon.jit
def _row_products(S, x0, x1, x2, x3):
    """S x [V] (vector layout) for four K-vectors x (columns layout)."""
    return _finish4(_own_columns(S * x0[None, :], False), _own_columns(S * x1[None, :], False),
                    _own_columns(S * x2[None, :], False), _own_columns(S * x3[None, :], False), 1)


@gluon.jit
def _region(code, H, SS):
    """Code slot * H + head (int64) -> (first fp32 word of the (slot, head) region, the program's window row)."""
    slot = code // H
    head = code % H
    return gl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN), slot * H + head


@gluon.jit
def _prefetch(bufs, raw_f32, raw_f16, raw_i8, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, code, valid, H, SS,
              IS_KDA: gl.constexpr):
    """Start copying program ``code``'s inputs (old checkpoint, window, gate) into the shared buffers (cp.async, one
    commit group; every copy is 16 bytes where the data allows). Nothing is copied where ``valid`` is false."""
    codes_s, sc_s, tok_s, kb_s, ub_s, gb_s, w_s, pc_s = bufs
    BYTES: gl.constexpr = bytes_layout(gl.num_warps())
    HALVES: gl.constexpr = halves_layout(gl.num_warps())
    WORDS: gl.constexpr = flat_layout(gl.num_warps())
    TOKENS: gl.constexpr = tokens_layout(gl.num_warps())
    region, prog = _region(code, H, SS)
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, BYTES))
    ck = gl.arange(0, _K, layout=gl.SliceLayout(0, BYTES))
    async_copy.async_copy_global_to_shared(codes_s, raw_i8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + ck[None, :],
                                           mask=valid)
    sc = gl.arange(0, _K + _V, layout=WORDS)
    async_copy.async_copy_global_to_shared(sc_s, raw_f32 + region + _SK_WORD + sc, mask=valid)
    tr = gl.arange(0, _R, layout=gl.SliceLayout(1, TOKENS))
    tc = gl.arange(0, _TOK_ROW, layout=gl.SliceLayout(0, TOKENS))
    async_copy.async_copy_global_to_shared(tok_s.slice(0, _R), raw_f16 + region * 2 + _TOK_HALF + tr[:, None] * _TOK_ROW
                                           + tc[None, :], mask=valid)
    wl = gl.arange(0, _L, layout=gl.SliceLayout(1, HALVES))
    wk = gl.arange(0, _K, layout=gl.SliceLayout(0, HALVES))
    window = gl.multiple_of(prog * (_L * _K), _L * _K) + wl[:, None] * _K + wk[None, :]
    async_copy.async_copy_global_to_shared(kb_s, kbuf_ptr + window, mask=valid)
    async_copy.async_copy_global_to_shared(ub_s, ubuf_ptr + window, mask=valid)
    wv = gl.arange(0, _L, layout=WORDS)
    async_copy.async_copy_global_to_shared(w_s, w_ptr + prog * _L + wv, mask=valid)
    if IS_KDA:
        async_copy.async_copy_global_to_shared(gb_s, gbuf_ptr + window, mask=valid)
        pk = gl.arange(0, _K, layout=WORDS)
        async_copy.async_copy_global_to_shared(pc_s, gate_ptr + prog * _K + pk, mask=valid)
    async_copy.commit_group()


@gluon.jit
def _token_operands(tok_s):
    """Tokens in shared memory [16, K + V] fp16 (rows R.. zero) as mma operands: q^T [V, 16] and u [16, K] (k = 16 of
    an fp16 mma; the zero ranks contribute exact zeros)."""
    STATE: gl.constexpr = state_layout(gl.num_warps())
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=STATE, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=STATE, k_width=2)
    return tok_s.slice(_K, _V, dim=1).permute([1, 0]).load(A_OP), tok_s.slice(0, _K, dim=1).load(B_OP)


@gluon.jit
def _rebuild(bufs, gate_ptr, prog, IS_KDA: gl.constexpr):
    """S [V, K] fp32 (state layout) = (codes s_k / 127 s_v + q^T u) * gate + ubuf^T keys, keys_j = w_j kbuf_j D_j
    (D_j = prod_{i > j} gbuf_i), from the shared buffers: the dequantisation on the CUDA cores, both rank updates on
    the tensor cores with exact operands."""
    codes_s, sc_s, tok_s, kb_s, ub_s, gb_s, w_s, pc_s = bufs
    STATE: gl.constexpr = state_layout(gl.num_warps())
    COLS: gl.constexpr = gl.SliceLayout(0, STATE)
    ROWS: gl.constexpr = gl.SliceLayout(1, STATE)
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=STATE, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=STATE, k_width=2)
    WINDOW: gl.constexpr = window_layout(gl.num_warps())
    codes = codes_s.load(STATE)
    col = sc_s.slice(0, _K).load(COLS) * (1.0 / _QMAX)
    s_v = sc_s.slice(_K, _V).load(ROWS)
    # a code c in [-127, 127] plus the bits of 2^23 + 128 is the float 2^23 + 128 + c, from which subtracting
    # 2^23 + 128 is exact (no integer-to-float conversion)
    biased = (codes.to(gl.int32) + _CODE_BIAS_BITS).to(gl.float32, bitcast=True)
    S = (biased - _CODE_OFFSET) * col[None, :] * s_v[:, None]
    # old tokens: q^T [V, 16] x u [16, K] in fp16 on the tensor cores: exact products, fp32 sums
    qT, u = _token_operands(tok_s)
    S = mma_v2(qT, u, S)
    if IS_KDA:
        S = S * gl.exp(pc_s.load(COLS))[None, :]
    else:
        S = S * gl.load(gate_ptr + prog)
    # the window: keys in fp32, split into bf16 hi + lo (hi = round(key), lo = round(key - hi): 2^-17 relative)
    keys = kb_s.permute([1, 0]).load(WINDOW).to(gl.float32) * w_s.load(gl.SliceLayout(0, WINDOW))[None, :]
    if IS_KDA:
        # (the products come back with the window's registers in another order: renamed, not moved)
        keys = keys * gl.convert_layout(_exclusive_suffix_products(gb_s.permute([1, 0]).load(WINDOW).to(gl.float32)),
                                        WINDOW)
    hi = gl.permute(keys.to(gl.bfloat16), [1, 0])
    lo = gl.permute((keys - keys.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), [1, 0])
    ubT = ub_s.permute([1, 0]).load(A_OP)
    S = mma_v2(ubT, gl.convert_layout(hi, B_OP), S)
    S = mma_v2(ubT, gl.convert_layout(lo, B_OP), S)
    return S


@gluon.jit
def _flush_one(bufs, new_s, q0_s, raw_f32, raw_u8, raw_f16, raw_i8, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr,
               code, code_next, has_next, H, SS, IS_KDA: gl.constexpr):
    """Flush program ``code`` (its inputs already in the shared buffers) in place, and start the copies of
    ``code_next``'s inputs as soon as the buffers are free."""
    STATE: gl.constexpr = state_layout(gl.num_warps())
    COLS: gl.constexpr = gl.SliceLayout(0, STATE)
    ROWS: gl.constexpr = gl.SliceLayout(1, STATE)
    VEC: gl.constexpr = vector_layout(gl.num_warps())
    FLAT: gl.constexpr = flat_layout(gl.num_warps())
    BYTES: gl.constexpr = bytes_layout(gl.num_warps())
    HALVES: gl.constexpr = halves_layout(gl.num_warps())
    rv = gl.arange(0, _V, layout=ROWS)
    rk = gl.arange(0, _K, layout=COLS)
    region, prog = _region(code, H, SS)

    # (1) rebuild, from the shared buffers; once every thread has read them, they take the next program's copies
    S = _rebuild(bufs, gate_ptr, prog, IS_KDA)
    gl.thread_barrier()
    _prefetch(bufs, raw_f32, raw_f16, raw_i8, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, code_next, has_next, H,
              SS, IS_KDA)

    # (2) one subspace iteration from q0: P = orth(S^T q0) (one CholeskyQR pass), Q = orth(S P), U = S^T Q
    p0, p1, p2, p3 = _column_products(S, q0_s.slice(0, _V).load(ROWS), q0_s.slice(_V, _V).load(ROWS),
                                      q0_s.slice(2 * _V, _V).load(ROWS), q0_s.slice(3 * _V, _V).load(ROWS))
    p0, p1, p2, p3 = _orthonormalize(p0, p1, p2, p3, 1)
    p0, p1, p2, p3 = _redistribute4(p0, p1, p2, p3, COLS)
    c0, c1, c2, c3 = _row_products(S, p0, p1, p2, p3)
    c0, c1, c2, c3 = _orthonormalize(c0, c1, c2, c3, 2)
    r0, r1, r2, r3 = _redistribute4(c0, c1, c2, c3, ROWS)
    U0, U1, U2, U3 = _column_products(S, r0, r1, r2, r3)

    # (3) tokens u = fp16(clamp(U^T)), q = fp16(Q^T), to the pool and to shared memory; (4) the residual
    #     E = S - q^T u with exactly those fp16 tokens, on the tensor cores (operands read back after a barrier)
    _store_tokens(raw_f16 + region * 2 + _TOK_HALF, new_s, gl.join(gl.join(U0, U1), gl.join(U2, U3)),
                  gl.join(gl.join(c0, c1), gl.join(c2, c3)))
    gl.thread_barrier()
    qT, u = _token_operands(new_s._reinterpret(gl.float16, [_RPAD, _TOK_ROW], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])))
    E = mma_v2(-qT, u, S)

    # (5) smoothing scales (one rsqrt per column: m * rsqrt(m) is sqrt(m) to ~2 ulp, as in the tl kernel)
    m = gl.maximum(_finish1(_own_rows(gl.abs(E), False), 0, False, COLS) * (1.0 / _V), _EPS * _EPS)
    inv_sk = gl.rsqrt(m)
    s_k = gl.maximum(m * inv_sk, _EPS)
    x = E * inv_sk[None, :]
    s_v = gl.maximum(_finish1(_own_columns(gl.abs(x), True), 1, True, ROWS), _EPS)
    gl.store(raw_f32 + region + _SK_WORD + rk, s_k)
    gl.store(raw_f32 + region + _SV_WORD + rv, s_v)

    # (6) codes = round_half_even(127 x / s_v), by the 1.5 * 2^23 addition (|x| <= s_v: no clamp needed); stored
    #     as 16-byte vectors after one exchange through shared memory (the state layout's two-byte pieces were 32
    #     stores per thread, and the store queue throttled the end of every item)
    y = x * (_QMAX / s_v)[:, None]
    codes = gl.convert_layout(((y + _RINT_MAGIC).to(gl.int32, bitcast=True) & _BYTE).to(gl.uint8), BYTES)
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, BYTES))
    ck = gl.arange(0, _K, layout=gl.SliceLayout(0, BYTES))
    gl.store(raw_u8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + ck[None, :], codes)

    # (7) window reset (hcnt stays L: "flushed, empty")
    gl.store(w_ptr + prog * _L + gl.arange(0, _L, layout=FLAT), gl.zeros([_L], gl.float32, layout=FLAT))
    if IS_KDA:
        gl.store(gate_ptr + prog * _K + gl.arange(0, _K, layout=FLAT), gl.zeros([_K], gl.float32, layout=FLAT))
        rl = gl.arange(0, _L, layout=gl.SliceLayout(1, HALVES))
        rk16 = gl.arange(0, _K, layout=gl.SliceLayout(0, HALVES))
        gl.store(gbuf_ptr + prog * (_L * _K) + rl[:, None] * _K + rk16[None, :],
                 gl.full([_L, _K], 1.0, gl.float16, layout=HALVES))
    else:
        gl.store(gate_ptr + prog, 1.0)


@gluon.jit
def _store_tokens(tok, new_s, U4, Q4):
    """The new tokens u = fp16(clamp(U^T)), q = fp16(Q^T) from U, Q stacked [V, 2, 2] (rank r = i + 2 j at [:, i, j],
    as the vector layout's join builds them) to the pool and to ``new_s`` (flat [16 (K + V)] fp16)."""
    V4: gl.constexpr = vector4_layout(gl.num_warps())
    u16 = gl.convert_layout(gl.minimum(gl.maximum(U4, -_FP16_MAX), _FP16_MAX).to(gl.float16), V4)
    q16 = gl.convert_layout(Q4.to(gl.float16), V4)
    v = gl.arange(0, _V, layout=gl.SliceLayout(1, gl.SliceLayout(2, V4)))
    i = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, V4)))
    j = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, V4)))
    at = tok + (i[None, :, None] + 2 * j[None, None, :]) * _TOK_ROW + v[:, None, None]
    gl.store(at, u16)
    gl.store(at + _K, q16)
    # new_s as [j, i, K + V]: the u and q halves of row i + 2 j, each viewed as [128, i, j]
    rows = new_s._reinterpret(gl.float16, [2, 2, _TOK_ROW], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    rows.slice(0, _K, dim=2).permute([2, 1, 0]).store(u16)
    rows.slice(_K, _V, dim=2).permute([2, 1, 0]).store(q16)


@gluon.jit(do_not_specialize=["N", "num_slots", "SS"], do_not_specialize_on_alignment=["q0_ptr", "idx_ptr"])
def flush_due(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, idx_ptr, hcnt_ptr,
              due_ptr, N, num_slots, SS, H: gl.constexpr, HP: gl.constexpr, G: gl.constexpr,
              IS_KDA: gl.constexpr, CHUNK: gl.constexpr, TW: gl.constexpr):
    """Persistent program ``pid`` of ``G``: the same arguments as flush._flush_due (the interpreter's kernel). Ranks
    the due programs, then flushes its items pid, pid + G, ..., each one's inputs copied into shared memory while the
    previous item computes."""
    HALVES: gl.constexpr = halves_layout(gl.num_warps())
    TOKENS: gl.constexpr = tokens_layout(gl.num_warps())
    pid = gl.program_id(0)
    total = _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H, HP, G, CHUNK, TW)

    # the shared buffers of one program's inputs: codes int8 [V, K] (16-byte chunks XOR-swizzled by row, so that the
    # state layout's reads down 8 rows hit 8 different banks), s_k | s_v fp32, tokens fp16 [16, K + V] (rows R.. stay
    # zero: the k = 16 padding of the token mma), kbuf, ubuf, gbuf, w, pcum; and the new
    # tokens [16, K + V] (rows R.. zero)
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    codes_s = gl.allocate_shared_memory(gl.int8, [_V, _K], gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
    sc_s = gl.allocate_shared_memory(gl.float32, [_K + _V], PLAIN1)
    tok_s = gl.allocate_shared_memory(gl.float16, [_RPAD, _TOK_ROW], PLAIN2)
    new_s = gl.allocate_shared_memory(gl.float16, [_RPAD * _TOK_ROW], PLAIN1)
    kb_s = gl.allocate_shared_memory(gl.bfloat16, [_L, _K], PLAIN2)
    ub_s = gl.allocate_shared_memory(gl.bfloat16, [_L, _V], PLAIN2)
    gb_s = gl.allocate_shared_memory(gl.float16, [_L, _K], PLAIN2)
    w_s = gl.allocate_shared_memory(gl.float32, [_L], PLAIN1)
    pc_s = gl.allocate_shared_memory(gl.float32, [_K], PLAIN1)
    q0_s = gl.allocate_shared_memory(gl.float32, [_R * _V], PLAIN1)
    bufs = (codes_s, sc_s, tok_s, kb_s, ub_s, gb_s, w_s, pc_s)
    raw_i8 = raw_u8.to(gl.pointer_type(gl.int8))

    t = pid
    if t < total:                                # (a program without items exits after the ranking)
        code = gl.load(due_ptr + t).to(gl.int64)
        _prefetch(bufs, raw_f32, raw_f16, raw_i8, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, code, t < total, H,
                  SS, IS_KDA)
        # while the first copies fly: the token buffers' zero padding (ranks R..15) and q0 [V, R] column by column
        # (q0_s[r V + v] = q0[v, r])
        tok_s.slice(_R, _R).store(gl.zeros([_R, _TOK_ROW], gl.float16, layout=TOKENS))
        tok_s.slice(2 * _R, 2 * _R).store(gl.zeros([2 * _R, _TOK_ROW], gl.float16, layout=TOKENS))
        new_s.store(gl.zeros([_RPAD * _TOK_ROW], gl.float16, layout=flat_layout(gl.num_warps())))
        qi = gl.arange(0, _R * _V, layout=flat_layout(gl.num_warps()))
        q0_s.store(gl.load(q0_ptr + (qi % _V) * _R + qi // _V))
        while t < total:
            t_next = t + G
            code_next = gl.load(due_ptr + t_next, mask=t_next < total, other=0).to(gl.int64)
            async_copy.wait_group(0)
            gl.thread_barrier()                  # every thread's copies of this item landed and are visible
            _flush_one(bufs, new_s, q0_s, raw_f32, raw_u8, raw_f16, raw_i8, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr,
                       gbuf_ptr, code, code_next, t_next < total, H, SS, IS_KDA)
            code = code_next
            t = t_next
