"""Triton flush: one launch, CUDA-graph safe (no host sync, no allocation, a fixed grid).

Two kernels share this launcher, its workspace and its ranking: on a GPU the Gluon kernel of
:mod:`leapquant.triton.mma` (tensor-core rank updates in layouts chosen for the algorithm; 3x faster on the H200),
and this module's ``tl`` kernel, which the interpreter runs (the CPU test tier) and which serves where Gluon cannot
(:func:`kernel_for`). What follows describes the ``tl`` kernel; the Gluon kernel computes the same thing.

A fixed grid of ``G`` persistent programs (about as many as fit on the GPU at once). Each first ranks the call's due
programs itself (:func:`_rank_due`: every (row, head) flag of ``idx`` in flag order, ``CHUNK`` flags per step, a prefix
count) and writes the ones whose rank is ``pid (mod G)`` into its own entries of a workspace list indexed by rank;
then it flushes them. Every program ranks alike, so the split is balanced (+-1 item) however unevenly the due
programs are spread over the rows, and no program waits for another; a call with nothing due is this one launch.

One due item = one (slot, head) program, processed top-down as the algorithm (SPEC section 2), all in fp32 registers:
rebuild the state S [V, K] (the window as one fp32 FMA matrix product), one subspace iteration from
q0 (P = orth(S^T q0), Q = orth(S P), U = S^T Q; orth = CholeskyQR with floored pivots, one pass for P and two for Q
as in every kernel (leapquant.numerics); each of P, Q, U one batched reduction), fp16 tokens, residual E = S - q^T u with the rounded tokens, smoothing scales, codes; then the window
reset.

The kernel runs unchanged under ``TRITON_INTERPRET=1`` (the CPU test tier): bf16/fp16 values are converted to fp32
right after each load, and the codes are converted with fp32 and integer arithmetic only (no libdevice, which the
interpreter lacks).
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layout import CODES_BYTE, OFF, REGION_WORDS, SK_BYTE, SV_BYTE, TOK_BYTE, Pool, slot_stride
from ..numerics import (CHOLQR_ABS_FLOOR, CHOLQR_RELATIVE_FLOOR, EPS, FP16_MAX, K, L, P_CHOLQR_PASSES, Q_CHOLQR_PASSES,
                        QMAX, R, RINT_MAGIC, V)

assert R == 4, "the kernel unrolls the rank-4 subspace iteration by hand"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"   #: triton.jit read the same variable at decoration


def _const(value):
    """A global the kernels read: compiled kernels need tl.constexpr globals; the interpreter needs plain values
    (there, constexpr arithmetic with a tensor would wrap the tensor in a constexpr)."""
    return value if INTERPRETED else tl.constexpr(value)


# ---- compile-time constants (named once; the kernels read these globals) -----------------------------------------
_V = _const(V)
_K = _const(K)
_L = _const(L)
_R = _const(R)
_TOK_ROW = _const(K + V)                        # fp16 words per token row (u[r, :K] | q[r, :V])
_QMAX = _const(float(QMAX))
_EPS = _const(EPS)
_FP16_MAX = _const(FP16_MAX)
#: CholeskyQR pivot floors and passes: leapquant.numerics (shared with the Gluon and TileLang kernels)
_REL_FLOOR = _const(CHOLQR_RELATIVE_FLOOR)
_ABS_FLOOR = _const(CHOLQR_ABS_FLOOR)
_P_PASSES = _const(P_CHOLQR_PASSES)
_Q_PASSES = _const(Q_CHOLQR_PASSES)
_OFF = _const(OFF)
_REGION_WORDS = _const(REGION_WORDS)
_CODES_BYTE = _const(CODES_BYTE)
_SK_WORD = _const(SK_BYTE // 4)
_SV_WORD = _const(SV_BYTE // 4)
_TOK_HALF = _const(TOK_BYTE // 2)
#: rounding to the nearest code without a rounding or conversion instruction: leapquant.numerics.RINT_MAGIC
_RINT_MAGIC = _const(RINT_MAGIC)
#: a code byte b (unsigned view) as a float: (b ^ 0x80) is code + 128 in 0..255; as the low mantissa byte of 2^23 it
#: gives the float 2^23 + code + 128, and subtracting 2^23 + 128 is exact (no I2F)
_CODE_BIAS_BITS = _const(0x4B000000)
_CODE_SIGN = _const(0x80)
_CODE_OFFSET = _const(8388736.0)
_BYTE = _const(0xFF)
#: every region starts on a multiple of this many fp32 words (OFF, the slot stride and the region size are)
_ALIGN = _const(math.gcd(OFF, REGION_WORDS))

#: (row, head) flags a program ranks per step of its scan (rows x heads padded to a power of two). On a GPU one step
#: covers batch 256 x 32 heads, all its loads in flight at once (each step costs two dependent trips to memory: idx,
#: then the fill counters); under the interpreter a short step lets the CPU tests span several steps at small sizes
CHUNK = 1024 if INTERPRETED else 8192


# ---- the ranking: each persistent program finds its own due programs ---------------------------------------------
@triton.jit
def _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
              CHUNK: tl.constexpr):
    """Rank the call's due programs in flag order (row, head) and write the code ``slot * H + head`` of each one whose
    rank r is ``pid (mod G)`` to ``due[r]``; return their total (int32).

    idx int32 [N] (slot per row; 0, negative or >= num_slots: skip), hcnt int32 [NS, H], due int32 [>= N * H]; HP =
    H rounded up to a power of two. Each rank has one writer and one reader, the same program: no program waits for
    another."""
    ROWS: tl.constexpr = CHUNK // HP
    heads = tl.arange(0, HP)
    total = 0
    r0 = 0
    while r0 < N:
        rows = r0 + tl.arange(0, ROWS)
        slot = tl.load(idx_ptr + rows, mask=rows < N, other=0)
        # out-of-range slots are skipped (under graph capture the API cannot check idx values)
        ok = (rows < N) & (slot > 0) & (slot < num_slots)
        live = ok[:, None] & (heads[None, :] < H)
        fill = tl.load(hcnt_ptr + slot.to(tl.int64)[:, None] * H + heads[None, :], mask=live, other=0)
        due = (live & (fill == _L)).to(tl.int32)
        per_row = tl.sum(due, 1)
        n = tl.sum(per_row, 0)
        if n > 0:                                   # (a step with nothing due skips the prefix sums)
            rank = total + (tl.cumsum(per_row, 0) - per_row)[:, None] + tl.cumsum(due, 1) - 1
            tl.store(due_ptr + rank, slot[:, None] * H + heads[None, :], mask=(due > 0) & (rank % G == pid))
        total += n
        r0 += ROWS
    return total


# ---- one item --------------------------------------------------------------------------------------------------------
@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    """Combine function of a 4-operand sum: the R = 4 products S^T x (or S x) in one reduction."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _add10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8, b9):
    """Combine function of a 10-operand sum: one reduction (one set of shuffles and barriers) for all ten."""
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7, a8 + b8, a9 + b9


if INTERPRETED:
    @triton.jit
    def _sum4(a0, a1, a2, a3, AXIS: tl.constexpr):
        """Four sums along AXIS (the interpreter runs a custom combine function element by element: too slow)."""
        return tl.sum(a0, AXIS), tl.sum(a1, AXIS), tl.sum(a2, AXIS), tl.sum(a3, AXIS)

    @triton.jit
    def _sum10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
        """Ten sums of 1-D vectors (interpreter form)."""
        return (tl.sum(a0, 0), tl.sum(a1, 0), tl.sum(a2, 0), tl.sum(a3, 0), tl.sum(a4, 0), tl.sum(a5, 0),
                tl.sum(a6, 0), tl.sum(a7, 0), tl.sum(a8, 0), tl.sum(a9, 0))
else:
    @triton.jit
    def _sum4(a0, a1, a2, a3, AXIS: tl.constexpr):
        """Four sums along AXIS as ONE 4-operand reduction."""
        return tl.reduce((a0, a1, a2, a3), AXIS, _add4)

    @triton.jit
    def _sum10(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
        """Ten sums of 1-D vectors as ONE 10-operand reduction."""
        return tl.reduce((a0, a1, a2, a3, a4, a5, a6, a7, a8, a9), 0, _add10)


@triton.jit
def _inv_pivot(d, g):
    """1 / sqrt of the Cholesky pivot d (column j's squared norm left after the earlier columns), the pivot floored at
    RELATIVE_FLOOR * g (g = G_jj: the column's own squared norm) and at ABS_FLOOR. One MUFU.RSQ (~2 ulp): the second
    pass renormalises whatever the first leaves, and the second's own ulps are far below the fp16 token rounding."""
    return tl.math.rsqrt(tl.maximum(tl.maximum(d, _REL_FLOOR * g), _ABS_FLOOR))


@triton.jit
def _cholqr(x0, x1, x2, x3):
    """One CholeskyQR pass over four columns x_j (1-D vectors of one layout): the 10 entries of G = X^T X in ONE
    multi-operand reduction, the Cholesky factor G = L L^T on scalars (pivots floored: _inv_pivot), then X L^-T by
    forward substitution, elementwise on the columns. A zero column comes out zero."""
    g00, g10, g11, g20, g21, g22, g30, g31, g32, g33 = _sum10(
        x0 * x0, x1 * x0, x1 * x1, x2 * x0, x2 * x1, x2 * x2, x3 * x0, x3 * x1, x3 * x2, x3 * x3)
    i00 = _inv_pivot(g00, g00)                    # i_jj = 1 / L_jj; L_ji = (G_ji - sum_{m<i} L_jm L_im) / L_ii
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


@triton.jit
def _orthonormalize(c0, c1, c2, c3, PASSES: tl.constexpr):
    """CholeskyQR with PASSES passes (leapquant.numerics: one for P, two for Q). A pass on a nearly orthonormal input
    brings the columns to working precision; the floors bound what a rank-deficient column can blow up to."""
    for _ in tl.static_range(PASSES):
        c0, c1, c2, c3 = _cholqr(c0, c1, c2, c3)
    return c0, c1, c2, c3


@triton.jit
def _code_to_f32(b):
    """int8 codes read as unsigned bytes (uint8) -> their value as fp32, by integer ops and one exact FADD."""
    biased = (b.to(tl.int32) ^ _CODE_SIGN) | _CODE_BIAS_BITS
    return biased.to(tl.float32, bitcast=True) - _CODE_OFFSET


@triton.jit
def _f32_to_code(y):
    """round_half_even(y) for |y| < 2^22 as an int8 code byte (uint8 bits), by one FADD and integer ops."""
    return ((y + _RINT_MAGIC).to(tl.int32, bitcast=True) & _BYTE).to(tl.uint8)


@triton.jit
def _store_token(tok, r, U_r, Q_r, rk, rv):
    """Round column r of U (clamped to fp16's range) and of Q to fp16, store them as token row r, and return the
    rounded values in fp32 (the residual uses exactly what is stored)."""
    u16 = tl.minimum(tl.maximum(U_r, -_FP16_MAX), _FP16_MAX).to(tl.float16)
    q16 = Q_r.to(tl.float16)
    tl.store(tok + r * _TOK_ROW + rk, u16)
    tl.store(tok + r * _TOK_ROW + _K + rv, q16)
    return u16.to(tl.float32), q16.to(tl.float32)


@triton.jit
def _flush_one(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
               slot, head, H, SS, IS_KDA: tl.constexpr, ALIGN: tl.constexpr):
    """Flush program (slot, head) in place: slot, head int64 scalars; q0 fp32 [V, R]."""
    rv = tl.arange(0, _V)
    rk = tl.arange(0, _K)
    # first fp32 word of the (slot, head) region, and the row of the dense window tensors. The alignment hints
    # (OFF, SS and the region size are multiples of _ALIGN words) let loads and stores use 16-byte vectors.
    region = _OFF + slot * SS + head * _REGION_WORDS
    prog = slot * H + head
    if ALIGN:
        region = tl.multiple_of(region, _ALIGN)
        kb = kbuf_ptr + tl.multiple_of(prog * (_L * _K), _L * _K)
        ub = ubuf_ptr + tl.multiple_of(prog * (_L * _V), _L * _V)
        wp = w_ptr + tl.multiple_of(prog * _L, _L)
        gb = gbuf_ptr + tl.multiple_of(prog * (_L * _K), _L * _K)
        gp = gate_ptr + tl.multiple_of(prog * _K, _K)          # pcum row (KDA)
    else:
        kb = kbuf_ptr + prog * (_L * _K)
        ub = ubuf_ptr + prog * (_L * _V)
        wp = w_ptr + prog * _L
        gb = gbuf_ptr + prog * (_L * _K)
        gp = gate_ptr + prog * _K
    codes_p = raw_u8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + rk[None, :]
    sk_p = raw_f32 + region + _SK_WORD + rk
    sv_p = raw_f32 + region + _SV_WORD + rv
    tok = raw_f16 + region * 2 + _TOK_HALF

    # ---- (1) rebuild: S = (q^T u + codes * s_k / 127 * s_v) * gate + sum_j w_j ubuf_j (outer) (kbuf_j * D_j) ----
    # (everything here keeps S in a blocked layout whose column sums stay inside each thread: a tensor-core tl.dot
    #  moved S to the MMA layout and made every later reduction dearer, 17 % slower, bench/notes/triton.md.
    #  The gate is folded into the column factors (KDA) or the row factors (GDN): one multiply per element less.)
    codes = tl.load(codes_p)
    s_k = tl.load(sk_p)
    s_v = tl.load(sv_p)
    if IS_KDA:
        gate = tl.exp(tl.load(gp + rk))                         # [K]
        col = s_k / _QMAX * gate
        row = s_v
    else:
        gate = tl.load(gate_ptr + prog)                         # scalar p
        col = s_k / _QMAX
        row = s_v * gate
    S = _code_to_f32(codes) * col[None, :] * row[:, None]
    for r in tl.static_range(_R):
        u_old = tl.load(tok + r * _TOK_ROW + rk).to(tl.float32) * gate
        q_old = tl.load(tok + r * _TOK_ROW + _K + rv).to(tl.float32)
        S += q_old[:, None] * u_old[None, :]
    # the window's effective keys kbuf[j] * w[j] * D_j as one [L, K] tile (8 elements per thread, none replicated; D_j
    # an exclusive reverse product scan of gbuf), then S += ubuf^T keys as one fp32 dot. input_precision="ieee" keeps
    # it off the tensor cores: Triton lowers it to FMAs with operands through shared memory and S in a blocked layout
    # (4 x 4 per thread), the same fp32 products and sums as 16 rank-1 updates, without their 32 global loads per
    # thread (the rank-1 loop's vectors were loaded per entry: 14 % slower, bench/notes/triton.md)
    rl = tl.arange(0, _L)
    keys = tl.load(kb + rl[:, None] * _K + rk[None, :]).to(tl.float32) * tl.load(wp + rl)[:, None]
    if IS_KDA:
        g_next = tl.load(gb + (rl[:, None] + 1) * _K + rk[None, :], mask=rl[:, None] + 1 < _L, other=1.0)
        keys = keys * tl.cumprod(g_next.to(tl.float32), 0, reverse=True)      # D_j = prod_{i > j} gbuf[i]
    ubT = tl.load(ub + rl[None, :] * _V + rv[:, None]).to(tl.float32)          # [V, L]
    S = tl.dot(ubT, keys, S, input_precision="ieee")

    # ---- (2) one subspace iteration from q0: P = orth(S^T q0) [K, R], Q = orth(S P) [V, R], U = S^T Q [K, R] ----
    # (q0's columns are re-read per item from L1/L2: held across the item loop they cost 4 row vectors of registers)
    q0c0 = tl.load(q0_ptr + rv * _R + 0)
    q0c1 = tl.load(q0_ptr + rv * _R + 1)
    q0c2 = tl.load(q0_ptr + rv * _R + 2)
    q0c3 = tl.load(q0_ptr + rv * _R + 3)
    p0, p1, p2, p3 = _sum4(S * q0c0[:, None], S * q0c1[:, None], S * q0c2[:, None], S * q0c3[:, None], 0)
    p0, p1, p2, p3 = _orthonormalize(p0, p1, p2, p3, _P_PASSES)
    c0, c1, c2, c3 = _sum4(S * p0[None, :], S * p1[None, :], S * p2[None, :], S * p3[None, :], 1)
    c0, c1, c2, c3 = _orthonormalize(c0, c1, c2, c3, _Q_PASSES)
    # ---- (3) tokens u = fp16(U^T), q = fp16(Q^T); (4) residual E = S - q^T u with the rounded tokens ----
    # (every U column before the residual: S then dies into E in place instead of both living at once)
    U0, U1, U2, U3 = _sum4(S * c0[:, None], S * c1[:, None], S * c2[:, None], S * c3[:, None], 0)
    u0, q0_ = _store_token(tok, 0, U0, c0, rk, rv)
    u1, q1_ = _store_token(tok, 1, U1, c1, rk, rv)
    u2, q2_ = _store_token(tok, 2, U2, c2, rk, rv)
    u3, q3_ = _store_token(tok, 3, U3, c3, rk, rv)
    E = S - q0_[:, None] * u0[None, :]
    E = E - q1_[:, None] * u1[None, :]
    E = E - q2_[:, None] * u2[None, :]
    E = E - q3_[:, None] * u3[None, :]

    # ---- (5) smoothing: s_k = max(sqrt(mean_v |E|), eps); x = E / s_k; s_v = max(max_k |x|, eps) ----
    # (one MUFU.RSQ per column instead of a rounded sqrt and a division: m * rsqrt(m) is sqrt(m) to ~2 ulp, and the
    #  stored s_k and the 1 / s_k the codes are made with agree to those ulps, far below the codes' resolution.
    #  m is floored at EPS^2 (fp32-normal) first, so an all-zero column gets s_k = EPS and 1 / s_k = 1 / EPS.)
    m = tl.maximum(tl.sum(tl.abs(E), 0) * (1.0 / _V), _EPS * _EPS)
    inv_sk = tl.math.rsqrt(m)
    s_k = tl.maximum(m * inv_sk, _EPS)
    x = E * inv_sk[None, :]
    s_v = tl.maximum(tl.max(tl.abs(x), 1), _EPS)
    tl.store(sk_p, s_k)
    tl.store(sv_p, s_v)

    # ---- (6) codes = round_half_even(127 x / s_v) ----
    # |x| <= s_v by construction, so |y| <= 127 (1 + a few ulp) rounds into [-127, 127]: no clamp needed
    tl.store(codes_p, _f32_to_code(x * (_QMAX / s_v)[:, None]))

    # ---- (7) window reset (hcnt stays L: "flushed, empty") ----
    tl.store(wp + tl.arange(0, _L), tl.zeros([_L], tl.float32))
    if IS_KDA:
        tl.store(gp + rk, tl.zeros([_K], tl.float32))
        rl = tl.arange(0, _L)
        tl.store(gb + rl[:, None] * _K + rk[None, :], tl.full([_L, _K], 1.0, tl.float16))
    else:
        tl.store(gate_ptr + prog, 1.0)


# ---- the kernel -----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N", "num_slots", "SS"], do_not_specialize_on_alignment=["q0_ptr", "idx_ptr"])
def _flush_due(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, idx_ptr, hcnt_ptr,
               due_ptr, N, num_slots, SS, H: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
               IS_KDA: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr):
    """Persistent program ``pid`` of ``G`` (the grid): ranks the due programs (:func:`_rank_due`), then flushes its
    items pid, pid + G, ... of them. H (heads) and G are compile-time: the ranking's tile is rows x HP and its
    remainder by G a multiplication and shifts (a run-time divisor costs ~20 instructions per flag).

    raw as fp32 / int8 / fp16 pointers (one buffer), the window tensors of the pool (gate_ptr: pcum fp32 [NS, H, K]
    for KDA, p fp32 [NS, H] for GDN; gbuf fp16 [NS, H, L, K], unused for GDN), q0 fp32 [V, R], idx int32 [N],
    hcnt int32 [NS, H], the workspace list due int32 [>= N * H]."""
    pid = tl.program_id(0)
    total = _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H, HP, G, CHUNK)
    tl.debug_barrier()                             # the list entries written by this program's threads, visible to all
    t = pid
    code = tl.load(due_ptr + t, mask=t < total, other=0).to(tl.int64)
    while t < total:                               # (a while loop: the interpreter cannot range over tensors)
        t_next = t + G
        code_next = tl.load(due_ptr + t_next, mask=t_next < total, other=0).to(tl.int64)   # in flight meanwhile
        _flush_one(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
                   code // H, code % H, H, SS, IS_KDA, ALIGN)
        code = code_next
        t = t_next


# ---- launcher ---------------------------------------------------------------------------------------------------------
#: rows a call may carry before the workspace must grow (growing allocates: done outside graph capture only)
MIN_ROW_CAPACITY = 1024
FLUSH_WARPS = 8          #: 8 warps: the 128 x 128 fp32 state is 64 registers per thread
#: alignment hints on the region and window offsets (16-byte vector loads; they also change the register layout
#: Triton picks for the state: see bench/notes/triton.md)
ALIGN_HINTS = True
#: register cap per thread (0: none). 128 at 8 warps would fit two programs per SM at the price of spills (696 B of
#: stack at sm_90): bench/triton_dev.py measures that variant by setting this attribute
MAX_REGISTERS = 0
#: persistent programs under the interpreter (any number is correct; a few keep the CPU tests short)
INTERPRETER_PROGRAMS = 4
#: which kernel a GPU call runs: "mma" (the Gluon kernel of :mod:`leapquant.triton.mma`: tensor-core rank updates,
#: explicit layouts; wherever Triton ships Gluon and the GPU has mma.sync, sm_80+) or "tl" (this module's kernel:
#: the one the interpreter runs, and the fallback). The environment variable forces one (read when a pool's
#: workspace is made); a forced "mma" that cannot run raises with the reasons
KERNEL_ENV = "LEAPQUANT_TRITON_KERNEL"
KERNELS = ("mma", "tl")
#: register cap of the Gluon kernel (0: none, 255 registers, one program per SM). 128 fits two programs per SM at
#: ~100 spilled instructions: measured no faster all due, slower at 1/16 (bench/notes/triton.md, session 11)
MMA_MAX_REGISTERS = 0


#: Triton releases the Gluon kernel is validated on (compiled, judged by the criterion and timed on the H200).
#: Gluon is Triton's experimental dialect and changes between releases, so elsewhere the backend serves with the
#: portable tl kernel and says why (``leapquant info``)
GLUON_VALIDATED_TRITON = ("3.6",)


def mma_reasons(device: torch.device) -> list[str]:
    """Why the Gluon kernel cannot serve ``device`` (empty: it can)."""
    if INTERPRETED or device.type != "cuda":
        return ["the Gluon kernel runs on CUDA GPUs only (not under TRITON_INTERPRET=1)"]
    why = []
    if not triton.__version__.startswith(GLUON_VALIDATED_TRITON):
        why.append(f"the Gluon kernel is validated on triton {', '.join(v + '.x' for v in GLUON_VALIDATED_TRITON)}, "
                   f"this is {triton.__version__} (the tl kernel serves instead)")
    if torch.cuda.get_device_capability(device) < (8, 0):
        why.append(f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0): no mma.sync")
    if not why:
        try:
            from . import mma  # noqa: F401
        except Exception as exc:  # a Triton without a usable Gluon
            why.append(f"triton {triton.__version__} has no usable Gluon: {type(exc).__name__}: {exc}")
    return why


def kernel_for(device: torch.device) -> str:
    """The kernel a call on ``device`` runs (see :data:`KERNEL_ENV`)."""
    forced = os.environ.get(KERNEL_ENV, "").strip().lower()
    if forced and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r}: expected one of {KERNELS}")
    why = mma_reasons(device)
    if forced == "mma" and why:
        raise RuntimeError(f"{KERNEL_ENV}=mma cannot run: " + "; ".join(why))
    if forced:
        return forced
    return "tl" if why else "mma"


#: Triton releases the bound launch (:func:`_bind`) was validated on: it calls the compiled kernel's own launcher
#: (``CompiledKernel[grid](*every kernel parameter)``), skipping the JIT's per-call argument binding and
#: specialisation. Elsewhere every call goes through the JIT's launch (correct; tens of microseconds dearer per call)
BOUND_LAUNCH_TRITON = ("3.6",)


@dataclass
class _Workspace:
    """Per-pool workspace, allocated once outside the call: the due list, typed views of raw, the persistent grid
    size and the launch bound to the pool's buffers."""
    rows: int                      # largest len(idx) served without growing
    due: torch.Tensor              # int32 [rows * H]: the call's due programs by rank
    raw_u8: torch.Tensor
    raw_f16: torch.Tensor
    kernel: str = "tl"             # "mma" or "tl" (kernel_for)
    programs: int = 0              # persistent programs resident at once (0: not bound yet)
    buffers: tuple = ()            # the pool tensors the launch is bound to (re-bound when the caller swaps one)
    launch: object = None          # launch(*kernel parameters): the compiled kernel's launcher, or the JIT's
    constants: tuple = ()          # the compile-time parameters, in the kernel's order, after the run-time ones


_WORKSPACES: "weakref.WeakKeyDictionary[Pool, _Workspace]" = weakref.WeakKeyDictionary()


def _capturing(pool: Pool) -> bool:
    return pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _workspace(pool: Pool, rows: int) -> _Workspace:
    ws = _WORKSPACES.get(pool)
    if ws is not None and ws.rows >= rows and ws.raw_u8.data_ptr() == pool.raw.data_ptr():
        return ws
    if _capturing(pool):
        raise RuntimeError(f"leapquant triton flush: call leapquant.warmup(pool) (or flush once) with at least {rows} "
                           f"rows outside CUDA graph capture first: the workspace and kernels are made there")
    cap = max(rows, MIN_ROW_CAPACITY, ws.rows if ws is not None else 0)
    ws = _Workspace(rows=cap, due=torch.zeros(cap * pool.num_heads, dtype=torch.int32, device=pool.device),
                    raw_u8=pool.raw.view(torch.uint8), raw_f16=pool.raw.view(torch.float16))
    _WORKSPACES[pool] = ws
    return ws


def _pool_buffers(pool: Pool) -> tuple:
    """The pool tensors a launch reads, in the kernel's order (GDN passes p twice: gbuf is a placeholder there)."""
    kda = pool.gate == "kda"
    return (pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.pcum if kda else pool.p, pool.gbuf if kda else pool.p,
            pool.hcnt)


def _flush_args(pool: Pool, ws: _Workspace, q0: torch.Tensor, idx: torch.Tensor) -> tuple:
    """Run-time arguments of the kernel (_flush_due or mma.flush_due, same order) for a call with ``idx``."""
    raw, kbuf, ubuf, w, gate, gbuf, hcnt = ws.buffers
    return (raw, ws.raw_u8, ws.raw_f16, kbuf, ubuf, w, gate, gbuf, q0, idx, hcnt, ws.due,
            idx.numel(), pool.num_slots, slot_stride(pool.num_heads))


def _kernel_fn(kernel: str):
    if kernel == "mma":
        from .mma import flush_due
        return flush_due
    return _flush_due


def _flush_meta(pool: Pool, kernel: str, programs: int) -> dict:
    """Compile-time arguments of the kernel for a grid of ``programs``."""
    hp = triton.next_power_of_2(pool.num_heads)
    if kernel == "mma":
        from .mma import WARPS
        meta = dict(H=pool.num_heads, HP=hp, G=programs, IS_KDA=pool.gate == "kda", CHUNK=CHUNK, TW=min(hp, 32),
                    num_warps=WARPS, num_stages=1)
        if MMA_MAX_REGISTERS:
            meta["maxnreg"] = MMA_MAX_REGISTERS
        return meta
    meta = dict(H=pool.num_heads, HP=hp, G=programs, IS_KDA=pool.gate == "kda",
                CHUNK=CHUNK, ALIGN=ALIGN_HINTS, num_warps=FLUSH_WARPS, num_stages=1)
    if MAX_REGISTERS and not INTERPRETED:
        meta["maxnreg"] = MAX_REGISTERS
    return meta


def _resident_programs(pool: Pool, ws: _Workspace, q0: torch.Tensor, idx: torch.Tensor) -> int:
    """Persistent grid size: the flush programs that fit on the GPU at once (registers, shared memory, threads), from
    the kernel compiled for one program per SM."""
    if INTERPRETED or pool.device.type != "cuda":
        return INTERPRETER_PROGRAMS
    props = torch.cuda.get_device_properties(pool.device)
    sms = props.multi_processor_count
    meta = _flush_meta(pool, ws.kernel, sms)
    kern = _kernel_fn(ws.kernel).warmup(*_flush_args(pool, ws, q0, idx), grid=(sms,), **meta)
    try:
        kern._init_handles()                   # loads the module and fills n_regs (Triton 3.x)
        threads = 32 * meta["num_warps"]
        by_regs = props.regs_per_multiprocessor // (max(kern.n_regs, 1) * threads)
        smem = kern.metadata.shared
        by_smem = props.shared_memory_per_multiprocessor // smem if smem else by_regs
        by_threads = props.max_threads_per_multi_processor // threads
        per_sm = max(1, min(by_regs, by_smem, by_threads))
    except Exception:                          # an API change: one program per SM is always resident
        per_sm = 1
    return per_sm * sms


def _bound_launch_supported() -> bool:
    return not INTERPRETED and triton.__version__.startswith(BOUND_LAUNCH_TRITON)


def _bind(pool: Pool, ws: _Workspace, q0: torch.Tensor, idx: torch.Tensor) -> None:
    """Choose the kernel and grid, compile it for the pool's buffers and bind its launch (outside graph capture).

    The JIT specialises a kernel on its pointers' 16-byte alignment (not q0's and idx's, which change per call) and
    on the values of nothing else it is given at run time (N, num_slots and SS are not specialised), so one compiled
    kernel serves every call on these buffers: it is launched directly through its own launcher."""
    if _capturing(pool):
        raise RuntimeError("leapquant triton flush: call leapquant.warmup(pool) outside CUDA graph capture first "
                           "(the kernel is compiled and bound to the pool's buffers there)")
    ws.buffers = _pool_buffers(pool)
    ws.kernel = kernel_for(pool.device)
    ws.programs = _resident_programs(pool, ws, q0, idx)
    fn = _kernel_fn(ws.kernel)
    meta = _flush_meta(pool, ws.kernel, ws.programs)
    grid = (ws.programs, 1, 1)            # (the compiled kernel's launcher reads all three dimensions)
    if _bound_launch_supported():
        compiled = fn.warmup(*_flush_args(pool, ws, q0, idx), grid=grid, **meta)
        ws.constants = tuple(meta[name] for name in fn.arg_names[len(_flush_args(pool, ws, q0, idx)):])
        ws.launch = compiled[grid]
    else:
        options = {k: v for k, v in meta.items() if k not in fn.arg_names}
        consts = {k: v for k, v in meta.items() if k in fn.arg_names}
        ws.constants = ()

        def launch(*args):
            fn[grid](*args, **consts, **options)
        ws.launch = launch


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def flush(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Triton backend of :func:`leapquant.flush_inplace` (arguments already validated).

    pool: :class:`~leapquant.layout.Pool`; idx int32 [N] slot per row (<= 0 or >= num_slots: skip); q0 fp32 [V, R].
    One launch of a fixed grid; no host synchronisation, no allocation once the pool's workspace exists."""
    if idx.numel() == 0:
        return
    ws = _workspace(pool, idx.numel())
    if ws.launch is None or not _same(ws.buffers, _pool_buffers(pool)):
        _bind(pool, ws, q0, idx)
    ws.launch(*_flush_args(pool, ws, q0, idx), *ws.constants)


def warmup(pool: Pool) -> None:
    """Make the workspace, compile / load the kernel for ``pool`` and bind its launch (outside any graph capture) by
    flushing an all-skip row: nothing in the pool changes."""
    from ..reference import default_q0
    idx = torch.zeros(1, dtype=torch.int32, device=pool.device)
    flush(pool, idx, default_q0(pool.device))
