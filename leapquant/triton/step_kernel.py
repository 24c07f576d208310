"""The Triton backend's portable decode step (docs/spec.md section 7), in plain ``triton.language``: the kernel the
interpreter runs (the CPU test tier) and the one that serves where the Gluon step kernel cannot
(:mod:`leapquant.triton.gluon_step_kernel`, 2x faster on the H200: same algorithm, layouts chosen for it).

One program per (row, head) of the call: grid (N * H,). A program whose row has no valid slot (idx <= 0 or >=
num_slots) writes a zero output and nothing else. Otherwise it

1. reads the token of its row (q and k of its key head, v of its head) and normalises q and k in fp32;
2. evaluates the gate: KDA a log-decay per key channel (``en = exp(g)``, ``pcum_new = pcum + g``), GDN one per head
   (``at = exp(g)``, ``p_new = p * at``, the live weights decayed by at);
3. applies the state S = checkpoint (decayed by the gate since it was written) + the live window entries j < h to
   kn and qn without forming it: S kn = diag(s_v) codes (s_k / 127 * kn) + q_old^T (u_old kn) + ubuf^T (keys kn),
   each factor gated, all in fp32 (no TF32, which the SPEC lists as a known failure), BV rows of the state per step
   of a loop;
4. applies the gated delta rule to those rows: ``u_new = beta (v - S kn)``, ``o = S qn + (kn . qn) u_new``;
5. appends entry h of its window (kn, u_new, KDA en; w[h] = 1) and advances the gate state and the fill count.

The form and its sizes were chosen by measurement on the H200 (docs/design-triton.md, the step's table of variants):
4 warps and BV = 32 took 256 us at batch 256 (KDA), the state formed in registers 409 us, a loop over key-channel
chunks 590-1400 us.

The state is never written to global memory and the checkpoint is only read. No host synchronisation and no
allocation: the launch is graph-capturable. Like the flush's tl kernel it runs unchanged under the interpreter
(``TRITON_INTERPRET=1``): bf16 / fp16 values are widened to fp32 right after their loads and only exp / log / sqrt
are used (no libdevice).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..numerics import K, NORM_EPS, SOFTPLUS_THRESHOLD
# the pool's offsets and the program's sizes as the flush's tl kernel names them (one definition)
from .tl_kernel import (_ALIGN, _CODES_BYTE, _K, _L, _OFF, _QMAX, _R, _REGION_WORDS, _SK_WORD, _SV_WORD, _TOK_HALF,
                        _TOK_ROW, _V, _code_to_f32, _const)

#: warps of one step program and the state rows per step of its loop (a [BV, K] code tile): 125 registers (KDA) at
#: 4 warps, no spills; 8 warps or BV = 64 need more registers than an SM holds for enough programs
WARPS = 4
BV = 32

_NORM_EPS = _const(NORM_EPS)
_SP_THRESHOLD = _const(SOFTPLUS_THRESHOLD)
_INV_SQRT_K = _const(K ** -0.5)


@triton.jit
def _softplus(x):
    """log(1 + exp(x)), and x itself above the threshold (where exp could overflow). log1p written with exp / log
    only: with u = 1 + e rounded, log(u) * e / (u - 1) corrects the rounding of u (accurate for tiny e, where
    log(1 + e) alone would return 0), and u == 1 means e is below half an ulp of 1: log1p(e) = e then. A NaN x gives
    NaN, as the reference's softplus: the minimum drops a NaN operand, so the last select keeps x unless x <= the
    threshold (false for NaN)."""
    e = tl.exp(tl.minimum(x, _SP_THRESHOLD))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x <= _SP_THRESHOLD, lp, x)


@triton.jit
def _round_bf16(x):
    """x (fp32) rounded to the nearest bf16, ties to even, returned as the fp32 holding that value. Integer ops on
    the bits: the interpreter's fp32 -> bf16 cast truncates, so the rounding is done here, alike on every target
    (finite inputs; a value past bf16's largest rounds to inf as the hardware cast does)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x):
    """x (fp32) as bf16, rounded to nearest even (the cast of an already rounded value is exact everywhere)."""
    return _round_bf16(x).to(tl.bfloat16)


@triton.jit
def _l2_normalise(x):
    """x / sqrt(sum x^2 + NORM_EPS) in fp32 (correctly rounded square root and division, as torch's)."""
    return tl.div_rn(x, tl.sqrt_rn(tl.sum(x * x, 0) + _NORM_EPS))


@triton.jit
def _step_program(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, qkv_ptr, a_ptr,
                  b_ptr, A_log_ptr, dt_ptr, out_ptr, row, head, slot, SS, qkv_stride, a_stride, b_stride,
                  H: tl.constexpr, HK: tl.constexpr, IS_KDA: tl.constexpr, BETA_BF16: tl.constexpr,
                  BV: tl.constexpr):
    """Step program (slot, head) for token row ``row`` (int64 scalars), in place; the key channels in chunks of
    ``BV`` rows of the state."""
    rl = tl.arange(0, _L)
    prog = slot * H + head
    # fill count: L ("just flushed, empty") reads as 0; a count outside [0, L] is outside the domain and is clamped
    # (as the reference does) so that no store ever leaves the window
    hc = tl.load(hcnt_ptr + prog)
    h = tl.where(hc == _L, 0, hc)
    h = tl.minimum(tl.maximum(h, 0), _L - 1)
    live = rl < h                                                     # [L] the window entries before the fill count

    # ---- (1) the token: q, k of key head hk (GQA), normalised in fp32 ----
    rk = tl.arange(0, _K)
    tok_row = qkv_ptr + row * qkv_stride
    hk = head // (H // HK)
    kn = _l2_normalise(tl.load(tok_row + HK * _K + hk * _K + rk).to(tl.float32))
    qn = _l2_normalise(tl.load(tok_row + hk * _K + rk).to(tl.float32)) * _INV_SQRT_K
    v_row = tok_row + 2 * HK * _K + head * _V

    # ---- (2) the gate and the window's effective keys [L, K] ----
    A = tl.exp(tl.load(A_log_ptr + head))
    kb = kbuf_ptr + prog * (_L * _K)
    ub = ubuf_ptr + prog * (_L * _V)
    wp = w_ptr + prog * _L
    # non-live entries are masked at the load (0): whatever a flush left there (or noise) contributes nothing
    w_old = tl.load(wp + rl, mask=live, other=0.0)
    kwin = tl.load(kb + rl[:, None] * _K + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if IS_KDA:
        g = -A * _softplus(tl.load(a_ptr + row * a_stride + head * _K + rk).to(tl.float32)
                           + tl.load(dt_ptr + head * _K + rk))        # [K]
        en = tl.exp(g)
        gp = gate_ptr + prog * _K                                     # pcum row
        pcum_new = tl.load(gp + rk) + g
        col_gate = tl.exp(pcum_new)                                   # the checkpoint's decay, per column
        row_gate = 1.0
        # D_j = en * prod_{j<i<h} gbuf_i: an exclusive reverse product over the later live entries (1 in place of
        # the non-live ones, so entries at and past h add no factor)
        gb = gbuf_ptr + prog * (_L * _K)
        g_next = tl.load(gb + (rl[:, None] + 1) * _K + rk[None, :], mask=(rl[:, None] + 1) < h, other=1.0)
        keys = kwin * w_old[:, None] * (tl.cumprod(g_next.to(tl.float32), 0, reverse=True) * en[None, :])
    else:
        g = -A * _softplus(tl.load(a_ptr + row * a_stride + head).to(tl.float32) + tl.load(dt_ptr + head))
        at = tl.exp(g)
        p_new = tl.load(gate_ptr + prog) * at
        col_gate = 1.0
        row_gate = p_new                                              # the checkpoint's decay, one scalar
        w_live = w_old * at                                           # the live weights decayed by this token's gate
        keys = kwin * w_live[:, None]

    # ---- (3) S kn and S qn, S never formed, BV rows of the state at a time ----
    # S = diag(s_v row_gate) codes diag(s_k / 127 col_gate) + q_old^T diag(row_gate) u_old diag(col_gate)
    #     + ubuf^T keys. Every term but the rows' own factors reduces to small vectors first: xk = s_k / 127 col_gate
    # kn ([K]), u_old (col_gate kn) ([R]) and keys kn ([L]) (alike for qn); then each block of BV rows is one
    # [BV, K] code tile against xk and xq, and the rows' factors. A program holds vectors and one code tile, never a
    # [V, K] fp32 state: few registers, many programs in flight to cover the memory latency. Each row's output and
    # window value follow from its own S kn and S qn, so a block is finished (and stored) in its own iteration.
    region = tl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN)
    col = tl.load(raw_f32 + region + _SK_WORD + rk) / _QMAX * col_gate
    xk = col * kn
    xq = col * qn
    rr = tl.arange(0, _R)
    tok = raw_f16 + region * 2 + _TOK_HALF
    u_old = tl.load(tok + rr[:, None] * _TOK_ROW + rk[None, :]).to(tl.float32) * col_gate          # [R, K]
    uk = tl.sum(u_old * kn[None, :], 1) * row_gate                    # [R]
    uq = tl.sum(u_old * qn[None, :], 1) * row_gate
    tk = tl.sum(keys * kn[None, :], 1)                                # [L]
    tq = tl.sum(keys * qn[None, :], 1)
    knq = tl.sum(kn * qn, 0)
    bx = tl.load(b_ptr + row * b_stride + head).to(tl.float32)
    # sigmoid in fp64, then rounded once to fp32: a few bf16 values of b put sigmoid(b) within 1 fp32 ulp of a bf16
    # rounding midpoint (b = -2^-8: 0.04 ulp), where fp32's approximate exp and division could flip the rounding of
    # beta against the reference's; one scalar per program, so fp64 costs nothing measurable
    beta = (1.0 / (1.0 + tl.exp(-bx.to(tl.float64)))).to(tl.float32)
    if BETA_BF16:                                                     # the models carry beta in bf16
        beta = _round_bf16(beta)
    rb = tl.arange(0, BV)
    for v0 in tl.range(0, _V, BV):
        rv = v0 + rb
        codes = _code_to_f32(tl.load(raw_u8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + rk[None, :]))
        row_f = tl.load(raw_f32 + region + _SV_WORD + rv) * row_gate                               # [BV]
        q_oldT = tl.load(tok + rr[None, :] * _TOK_ROW + _K + rv[:, None]).to(tl.float32)          # [BV, R]
        ubT = tl.load(ub + rl[None, :] * _V + rv[:, None], mask=live[None, :], other=0.0).to(tl.float32)  # [BV, L]
        Sk = tl.sum(codes * xk[None, :], 1) * row_f + tl.sum(q_oldT * uk[None, :], 1) + tl.sum(ubT * tk[None, :], 1)
        Sq = tl.sum(codes * xq[None, :], 1) * row_f + tl.sum(q_oldT * uq[None, :], 1) + tl.sum(ubT * tq[None, :], 1)
        # ---- (4) the gated delta rule, for these rows ----
        u_new = beta * (tl.load(v_row + rv).to(tl.float32) - Sk)
        tl.store(out_ptr + (row * H + head) * _V + rv, _to_bf16(Sq + knq * u_new))
        tl.store(ub + h * _V + rv, _to_bf16(u_new))

    # ---- (5) the rest of the appended entry, its weight, the gate state, the fill count ----
    tl.store(kb + h * _K + rk, _to_bf16(kn))
    if IS_KDA:
        tl.store(gb + h * _K + rk, en.to(tl.float16))
        tl.store(gp + rk, pcum_new)
        tl.store(wp + h, 1.0)
    else:
        tl.store(gate_ptr + prog, p_new)
        # the live weights decayed, w[h] = 1, the entries past h untouched
        tl.store(wp + rl, tl.where(rl == h, 1.0, w_live), mask=rl <= h)
    tl.store(hcnt_ptr + prog, h + 1)


@triton.jit(do_not_specialize=["num_slots", "SS", "qkv_stride", "a_stride", "b_stride"])
def step_kernel(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, idx_ptr, qkv_ptr,
                a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, num_slots, SS, qkv_stride, a_stride, b_stride,
                H: tl.constexpr, HK: tl.constexpr, IS_KDA: tl.constexpr, BETA_BF16: tl.constexpr,
                BV: tl.constexpr):
    """Program ``pid`` = row * H + head of the grid (N * H,).

    raw as fp32 / uint8 / fp16 pointers (one buffer); the pool's window tensors (gate_ptr: pcum fp32 [NS, H, K] for
    KDA, p fp32 [NS, H] for GDN; gbuf fp16 [NS, H, L, K], a placeholder for GDN); hcnt int32 [NS, H]; idx int32 [N];
    qkv bf16 rows (q | k | v) at qkv_stride; a bf16 [N, H, K] (KDA) or [N, H] (GDN) rows at a_stride; b bf16 [N, H]
    rows at b_stride; A_log fp32 [H]; dt_bias fp32 [H, K] or [H]; out bf16 [N, H, V] contiguous. HK key heads."""
    pid = tl.program_id(0)
    row = (pid // H).to(tl.int64)
    head = (pid % H).to(tl.int64)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if (slot > 0) & (slot < num_slots):
        _step_program(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, qkv_ptr,
                      a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, row, head, slot, SS, qkv_stride, a_stride, b_stride,
                      H, HK, IS_KDA, BETA_BF16, BV)
    else:                                   # no sequence on this row: a zero output, nothing else written
        tl.store(out_ptr + (row * H + head) * _V + tl.arange(0, _V), tl.zeros([_V], tl.bfloat16))
