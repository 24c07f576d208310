"""The Triton backend's portable kernel, in plain ``triton.language`` (the ``tl`` kernel).

It runs wherever Triton does: under the interpreter (``TRITON_INTERPRET=1``, the CPU test tier) and on any CUDA GPU
where the Gluon kernel (:mod:`leapquant.triton.gluon_kernel`, 3x faster on the H200) cannot serve. The launcher
(:mod:`leapquant.triton.launch`) chooses between the two and gives both the same arguments, workspace and grid.

A fixed grid of ``G`` persistent programs. Each first ranks the call's due programs itself (:func:`_rank_due`: every
(row, head) flag of ``idx`` in flag order, ``SCAN_FLAGS`` flags per step, a prefix count) and writes the ones whose rank is
``pid (mod G)`` into its own entries of a workspace list indexed by rank; then it flushes them. Every program ranks
alike, so the split is balanced (+-1 item) however unevenly the due programs are spread over the rows, and no program
waits for another; a call with nothing due is this one launch.

One item = one due (slot, head) program (:func:`_flush_item`), in fp32 registers. An item whose window is empty
(every weight 0 and no decay: :func:`_window_live`, leapquant.reference.empty_window's test on the weights and gate
that the rebuild loads anyway) is skipped whole, so a second flush without a decode step in between writes nothing.
Any other item runs phase by phase as docs/spec.md section 2 names them (:func:`_flush_program`): (1) rebuild the
state S [V, K] (the window as one fp32 FMA matrix product); (2) project and (3) orthonormalise: one subspace iteration
from q0, P = orth(S^T q0), Q = orth(S P), U = S^T Q, each product one batched reduction, orth = CholeskyQR with
floored pivots (passes and floors: leapquant.numerics, shared by every kernel); (4) tokens in fp16; (5) residual
E = S - q^T u with the rounded tokens; (6) smoothing scales; (7) codes; (8) window reset.

The kernel runs unchanged under the interpreter: bf16/fp16 values are converted to fp32 right after each load, and
the codes are converted with fp32 and integer arithmetic only (no libdevice, which the interpreter lacks).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from ..layout import CODES_BYTE, OFF, REGION_ALIGN_WORDS, REGION_WORDS, SK_WORD, SV_WORD, TOK_HALF, TOK_ROW
from ..numerics import (CODE_BIAS, CODE_BIAS_BITS, CODE_SIGN, EPS, FP16_MAX, P_CHOLQR_PASSES, Q_CHOLQR_PASSES, QMAX,
                        RINT_MAGIC, K, L, R, V)
from .cholesky import cholesky4

assert R == 4, "the kernel unrolls the rank-4 subspace iteration by hand"

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"   #: triton.jit read the same variable at decoration

#: warps of one program: the 128 x 128 fp32 state is 64 registers per thread (16 warps measured 18 % slower: spills
#: and 16-warp reductions; docs/design-triton.md)
WARPS = 8


def _const(value):
    """A global the kernel reads: compiled kernels need tl.constexpr globals; the interpreter needs plain values
    (there, constexpr arithmetic with a tensor would wrap the tensor in a constexpr)."""
    return value if INTERPRETED else tl.constexpr(value)


# ---- compile-time constants (named once; the kernel reads these globals) ---------------------------------------------
_V = _const(V)
_K = _const(K)
_L = _const(L)
_R = _const(R)
_TOK_ROW = _const(TOK_ROW)
_QMAX = _const(float(QMAX))
_EPS = _const(EPS)
_FP16_MAX = _const(FP16_MAX)
#: CholeskyQR pivot floors and passes: leapquant.numerics (shared with the Gluon and TileLang kernels)
_P_PASSES = _const(P_CHOLQR_PASSES)
_Q_PASSES = _const(Q_CHOLQR_PASSES)
_OFF = _const(OFF)
_REGION_WORDS = _const(REGION_WORDS)
_CODES_BYTE = _const(CODES_BYTE)
_SK_WORD = _const(SK_WORD)
_SV_WORD = _const(SV_WORD)
_TOK_HALF = _const(TOK_HALF)
#: rounding to the nearest code without a rounding or conversion instruction: leapquant.numerics.RINT_MAGIC
_RINT_MAGIC = _const(RINT_MAGIC)
#: a code byte b (unsigned view) as a float, exactly: (b ^ 0x80) is code + 128 in 0..255 (leapquant.numerics.CODE_BIAS)
_CODE_BIAS_BITS = _const(CODE_BIAS_BITS)
_CODE_SIGN = _const(CODE_SIGN)
_CODE_OFFSET = _const(CODE_BIAS)
_BYTE = _const(0xFF)
_ALIGN = _const(REGION_ALIGN_WORDS)


# ---- ranking: each persistent program finds its own due programs -------------------------------------------------
@triton.jit
def _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
              SCAN_FLAGS: tl.constexpr):
    """Rank the call's due programs in flag order (row, head) and write the code ``slot * H + head`` of each one whose
    rank r is ``pid (mod G)`` to ``due[r]``; return their total (int32).

    idx int32 [N] (slot per row; 0, negative or >= num_slots: skip), hcnt int32 [NS, H], due int32 [>= N * H]; HP =
    H rounded up to a power of two. Each rank has one writer and one reader, the same program: no program waits for
    another."""
    SCAN_ROWS: tl.constexpr = SCAN_FLAGS // HP
    heads = tl.arange(0, HP)
    total = 0
    r0 = 0
    while r0 < N:
        rows = r0 + tl.arange(0, SCAN_ROWS)
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
        r0 += SCAN_ROWS
    return total


# ---- batched sums: four (or ten) reductions as one -------------------------------------------------------------------
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


# ---- (1) rebuild ---------------------------------------------------------------------------------------------------
@triton.jit
def _code_to_f32(b):
    """int8 codes read as unsigned bytes (uint8) -> their value as fp32, by integer ops and one exact FADD."""
    biased = (b.to(tl.int32) ^ _CODE_SIGN) | _CODE_BIAS_BITS
    return biased.to(tl.float32, bitcast=True) - _CODE_OFFSET


@triton.jit
def _rebuild(codes, s_k, s_v, tok, kb, ub, w, gb, gate_in, rv, rk, IS_KDA: tl.constexpr):
    """S [V, K] fp32 = (q^T u + codes * s_k / 127 * s_v) * gate + sum_j w_j ubuf_j (outer) (kbuf_j * D_j), from the
    item's codes (uint8 [V, K]) and scales (loaded), its token rows ``tok``, window rows (kb, ub, gb), its weights
    ``w`` fp32 [L] and ``gate_in`` (loaded: the pcum row fp32 [K] for KDA, the scalar p for GDN).

    S stays in a blocked layout whose column sums stay inside each thread: a tensor-core tl.dot moved S to the MMA
    layout and made every later reduction dearer (measured 17 % slower on the H200: docs/design-triton.md). The gate
    is folded into the column factors (KDA) or the row factors (GDN): one multiply per element less."""
    if IS_KDA:
        gate = tl.exp(gate_in)                                  # [K]
        col = s_k / _QMAX * gate
        row = s_v
    else:
        gate = gate_in                                          # scalar p
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
    # thread (the rank-1 loop's vectors were loaded per entry: measured 14 % slower, docs/design-triton.md)
    rl = tl.arange(0, _L)
    keys = tl.load(kb + rl[:, None] * _K + rk[None, :]).to(tl.float32) * w[:, None]
    if IS_KDA:
        g_next = tl.load(gb + (rl[:, None] + 1) * _K + rk[None, :], mask=rl[:, None] + 1 < _L, other=1.0)
        keys = keys * tl.cumprod(g_next.to(tl.float32), 0, reverse=True)      # D_j = prod_{i > j} gbuf[i]
    ubT = tl.load(ub + rl[None, :] * _V + rv[:, None]).to(tl.float32)          # [V, L]
    return tl.dot(ubT, keys, S, input_precision="ieee")


# ---- (2) project ---------------------------------------------------------------------------------------------------
@triton.jit
def _project_t(S, x0, x1, x2, x3):
    """S^T x [K] for four V-vectors x, as one 4-operand reduction over the rows."""
    return _sum4(S * x0[:, None], S * x1[:, None], S * x2[:, None], S * x3[:, None], 0)


@triton.jit
def _project(S, y0, y1, y2, y3):
    """S y [V] for four K-vectors y, as one 4-operand reduction over the columns."""
    return _sum4(S * y0[None, :], S * y1[None, :], S * y2[None, :], S * y3[None, :], 1)


# ---- (3) orthonormalise --------------------------------------------------------------------------------------------
@triton.jit
def _cholqr(x0, x1, x2, x3):
    """One CholeskyQR pass over four columns x_j (1-D vectors of one layout): the 10 entries of G = X^T X in ONE
    multi-operand reduction, the Cholesky factor G = L L^T on scalars (cholesky.cholesky4, pivots floored), then X L^-T by
    forward substitution, elementwise on the columns. A zero column comes out zero."""
    i00, l10, l20, l30, i11, l21, l31, i22, l32, i33 = cholesky4(*_sum10(
        x0 * x0, x1 * x0, x1 * x1, x2 * x0, x2 * x1, x2 * x2, x3 * x0, x3 * x1, x3 * x2, x3 * x3))
    y0 = x0 * i00
    y1 = (x1 - l10 * y0) * i11
    y2 = (x2 - l20 * y0 - l21 * y1) * i22
    y3 = (x3 - l30 * y0 - l31 * y1 - l32 * y2) * i33
    return y0, y1, y2, y3


@triton.jit
def _orthonormalise(c0, c1, c2, c3, PASSES: tl.constexpr):
    """CholeskyQR with PASSES passes (leapquant.numerics: one for P, two for Q). A pass on a nearly orthonormal input
    brings the columns to working precision; the floors bound what a rank-deficient column can blow up to."""
    for _ in tl.static_range(PASSES):
        c0, c1, c2, c3 = _cholqr(c0, c1, c2, c3)
    return c0, c1, c2, c3


# ---- (4) tokens ----------------------------------------------------------------------------------------------------
@triton.jit
def _store_token(tok, r, U_r, Q_r, rk, rv):
    """Round column r of U (clamped to fp16's range) and of Q to fp16, store them as token row r, and return the
    rounded values in fp32 (the residual uses exactly what is stored)."""
    u16 = tl.minimum(tl.maximum(U_r, -_FP16_MAX), _FP16_MAX).to(tl.float16)
    q16 = Q_r.to(tl.float16)
    tl.store(tok + r * _TOK_ROW + rk, u16)
    tl.store(tok + r * _TOK_ROW + _K + rv, q16)
    return u16.to(tl.float32), q16.to(tl.float32)


# ---- (7) codes -----------------------------------------------------------------------------------------------------
@triton.jit
def _f32_to_code(y):
    """round_half_even(y) for |y| < 2^22 as an int8 code byte (uint8 bits), by one FADD and integer ops."""
    return ((y + _RINT_MAGIC).to(tl.int32, bitcast=True) & _BYTE).to(tl.uint8)


# ---- (8) window reset ----------------------------------------------------------------------------------------------
@triton.jit
def _reset_window(wp, gp, gb, gate_ptr, prog, rk, IS_KDA: tl.constexpr):
    """w = 0, and pcum = 0, gbuf = 1 (KDA) or p = 1 (GDN); hcnt stays L: "flushed, empty"."""
    tl.store(wp + tl.arange(0, _L), tl.zeros([_L], tl.float32))
    if IS_KDA:
        tl.store(gp + rk, tl.zeros([_K], tl.float32))
        rl = tl.arange(0, _L)
        tl.store(gb + rl[:, None] * _K + rk[None, :], tl.full([_L, _K], 1.0, tl.float16))
    else:
        tl.store(gate_ptr + prog, 1.0)


# ---- the empty window: nothing to fold -------------------------------------------------------------------------------
@triton.jit
def _window_live(w, gate_in, IS_KDA: tl.constexpr):
    """Whether the window holds anything to fold (int32 scalar, 0 or 1): some weight of ``w`` fp32 [L] is not 0, or
    the gate decays the checkpoint (KDA: some pcum of ``gate_in`` fp32 [K] is not 0; GDN: the scalar p is not 1).
    A NaN counts as something; -0.0 as zero. The complement of leapquant.reference.empty_window, on the values the
    rebuild reads."""
    live = tl.max((w != 0.0).to(tl.int32), 0)
    if IS_KDA:
        live = live | tl.max((gate_in != 0.0).to(tl.int32), 0)
    else:
        live = live | (gate_in != 1.0).to(tl.int32)
    return live


# ---- one item, phase by phase ----------------------------------------------------------------------------------------
@triton.jit
def _flush_item(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
                slot, head, H, SS, IS_KDA: tl.constexpr):
    """Flush program (slot, head) in place: slot, head int64 scalars; q0 fp32 [V, R]. A program whose window is empty
    (:func:`_window_live`) is left untouched: nothing past its weights and gate is read, nothing is written."""
    rv = tl.arange(0, _V)
    rk = tl.arange(0, _K)
    # first fp32 word of the (slot, head) region, and the row of the dense window tensors. The alignment hints
    # (OFF, SS and the region size are multiples of _ALIGN words) let loads and stores use 16-byte vectors; they also
    # change the register layout Triton picks for the state
    region = tl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN)
    prog = slot * H + head
    kb = kbuf_ptr + tl.multiple_of(prog * (_L * _K), _L * _K)
    ub = ubuf_ptr + tl.multiple_of(prog * (_L * _V), _L * _V)
    wp = w_ptr + tl.multiple_of(prog * _L, _L)
    gb = gbuf_ptr + tl.multiple_of(prog * (_L * _K), _L * _K)
    gp = gate_ptr + tl.multiple_of(prog * _K, _K)          # pcum row (KDA)
    codes_p = raw_u8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + rk[None, :]
    sk_p = raw_f32 + region + _SK_WORD + rk
    sv_p = raw_f32 + region + _SV_WORD + rv
    tok = raw_f16 + region * 2 + _TOK_HALF
    # the weights and the gate, read once: the emptiness test and the rebuild use them
    w = tl.load(wp + tl.arange(0, _L))
    if IS_KDA:
        gate_in = tl.load(gp + rk)                              # pcum [K]
    else:
        gate_in = tl.load(gate_ptr + prog)                      # p
    if _window_live(w, gate_in, IS_KDA) != 0:
        _flush_program(codes_p, sk_p, sv_p, tok, kb, ub, wp, gb, gp, gate_ptr, prog, w, gate_in, q0_ptr, rv, rk,
                       IS_KDA)


@triton.jit
def _flush_program(codes_p, sk_p, sv_p, tok, kb, ub, wp, gb, gp, gate_ptr, prog, w, gate_in, q0_ptr, rv, rk,
                   IS_KDA: tl.constexpr):
    """The flush of one program whose window is not empty, phase by phase: codes_p uint8 pointers [V, K], sk_p /
    sv_p fp32 pointers [K] / [V], tok the fp16 token rows, kb / ub / wp / gb / gp its window rows, w fp32 [L] and
    gate_in (pcum fp32 [K] or p) already loaded."""
    # ---- (1) rebuild: S = (q^T u + codes * s_k / 127 * s_v) * gate + sum_j w_j ubuf_j (outer) (kbuf_j * D_j) ----
    S = _rebuild(tl.load(codes_p), tl.load(sk_p), tl.load(sv_p), tok, kb, ub, w, gb, gate_in, rv, rk, IS_KDA)

    # ---- (2) project, (3) orthonormalise: one subspace iteration from q0 ----
    # P = orth(S^T q0) [K, R], Q = orth(S P) [V, R], U = S^T Q [K, R]
    # (q0's columns are re-read per item from L1/L2: held across the item loop they cost 4 row vectors of registers)
    q0c0 = tl.load(q0_ptr + rv * _R + 0)
    q0c1 = tl.load(q0_ptr + rv * _R + 1)
    q0c2 = tl.load(q0_ptr + rv * _R + 2)
    q0c3 = tl.load(q0_ptr + rv * _R + 3)
    p0, p1, p2, p3 = _project_t(S, q0c0, q0c1, q0c2, q0c3)
    p0, p1, p2, p3 = _orthonormalise(p0, p1, p2, p3, _P_PASSES)
    c0, c1, c2, c3 = _project(S, p0, p1, p2, p3)
    c0, c1, c2, c3 = _orthonormalise(c0, c1, c2, c3, _Q_PASSES)
    # (every U column before the residual: S then dies into E in place instead of both living at once)
    U0, U1, U2, U3 = _project_t(S, c0, c1, c2, c3)

    # ---- (4) tokens u = fp16(U^T), q = fp16(Q^T); (5) residual E = S - q^T u with the rounded tokens ----
    u0, q0_ = _store_token(tok, 0, U0, c0, rk, rv)
    u1, q1_ = _store_token(tok, 1, U1, c1, rk, rv)
    u2, q2_ = _store_token(tok, 2, U2, c2, rk, rv)
    u3, q3_ = _store_token(tok, 3, U3, c3, rk, rv)
    E = S - q0_[:, None] * u0[None, :]
    E = E - q1_[:, None] * u1[None, :]
    E = E - q2_[:, None] * u2[None, :]
    E = E - q3_[:, None] * u3[None, :]

    # ---- (6) scales: s_k = max(sqrt(mean_v |E|), eps); x = E / s_k; s_v = max(max_k |x|, eps) ----
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

    # ---- (7) codes = round_half_even(127 x / s_v) ----
    # |x| <= s_v by construction, so |y| <= 127 (1 + a few ulp) rounds into [-127, 127]: no clamp needed
    tl.store(codes_p, _f32_to_code(x * (_QMAX / s_v)[:, None]))

    # ---- (8) window reset ----
    _reset_window(wp, gp, gb, gate_ptr, prog, rk, IS_KDA)


# ---- the kernel -----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N", "num_slots", "SS"], do_not_specialize_on_alignment=["q0_ptr", "idx_ptr"])
def _flush_due(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, idx_ptr, hcnt_ptr,
               due_ptr, N, num_slots, SS, H: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
               IS_KDA: tl.constexpr, SCAN_FLAGS: tl.constexpr):
    """Persistent program ``pid`` of ``G`` (the grid): ranks the due programs (:func:`_rank_due`), then flushes its
    items pid, pid + G, ... of them. H (heads) and G are compile-time: the ranking's tile is rows x HP and its
    remainder by G a multiplication and shifts (a run-time divisor costs ~20 instructions per flag).

    raw as fp32 / int8 / fp16 pointers (one buffer), the window tensors of the pool (gate_ptr: pcum fp32 [NS, H, K]
    for KDA, p fp32 [NS, H] for GDN; gbuf fp16 [NS, H, L, K], unused for GDN), q0 fp32 [V, R], idx int32 [N],
    hcnt int32 [NS, H], the workspace list due int32 [>= N * H]; SCAN_FLAGS: flags ranked per step of the scan."""
    pid = tl.program_id(0)
    total = _rank_due(idx_ptr, hcnt_ptr, due_ptr, N, num_slots, pid, H, HP, G, SCAN_FLAGS)
    tl.debug_barrier()                             # the list entries written by this program's threads, visible to all
    t = pid
    code = tl.load(due_ptr + t, mask=t < total, other=0).to(tl.int64)
    while t < total:                               # (a while loop: the interpreter cannot range over tensors)
        t_next = t + G
        code_next = tl.load(due_ptr + t_next, mask=t_next < total, other=0).to(tl.int64)   # in flight meanwhile
        _flush_item(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr,
                    code // H, code % H, H, SS, IS_KDA)
        code = code_next
        t = t_next
