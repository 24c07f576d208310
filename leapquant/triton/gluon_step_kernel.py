"""The Triton backend's decode step on a GPU, written in Gluon (explicit layouts), for sm_80 and newer.

Same contract, grid and arguments as the portable step kernel (:mod:`leapquant.triton.step_kernel`, which the
interpreter runs and which serves where Gluon cannot): one program of 4 warps per (row, head), S applied to kn and qn
without being formed. What differs is that every tensor has a layout chosen so that the sums stay inside a thread:

    (0) codes       the program's 16 KB of codes start copying into shared memory first (cp.async), so that their
                    trip to memory overlaps everything up to (4)
    (1) token       q, k and every per-channel quantity (the gate, pcum, s_k, xk = s_k / 127 col_gate kn, xq) one
                    channel per thread (:data:`KVEC`): the norms are the only reductions over the channels
    (2) window      the keys [L, K] a column per thread (:data:`WCOL`): the decay products D_j are a scan inside the
                    thread; keys kn and keys qn reduce over the channels once
    (3) rank part   u_old [R, K] a column per thread alike: u_old (col_gate kn), u_old (col_gate qn)
    (4) codes       on the tensor cores: codes [V, K] (exact as fp16, two byte permutes and two half-precision
                    subtractions per four codes) times X [K, 8] = (xk, xq) each split into fp16 hi + lo parts under a
                    power-of-two scale (:func:`_fp16_split`), fp32 accumulators [V, 8] (:data:`ACC`), 32 channels
                    per step; the row sums go to shared memory
    (5) rows        a state row per thread (:data:`VROW`): the window's ubuf^T (keys kn) and the rank part's
                    q_old^T (u_old kn) inside the thread, the codes' sums read back, then u_new, o and the stores

Every value is fp32 but phase (4)'s operands: fp16 x fp16 products are exact, the tensor cores add them in fp32 (with
truncation, a few ulp per mma), and the hi + lo split keeps 22 bits of each xk and xq, so the results equal the
portable kernel's to about fp32 rounding (a CPU emulation of the phase with round-to-nearest sums: 1.8 ulp of
sum |c x| at worst, against 3.9 for fp32 FMA chains over dequantised codes).
"""
# (no ``from __future__ import annotations``: Gluon reads the annotations of its constexpr parameters)
import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..layout import CODES_BYTE, OFF, REGION_WORDS, SK_BYTE, SV_BYTE, TOK_BYTE
from ..numerics import K, L, NORM_EPS, QMAX, R, SOFTPLUS_THRESHOLD, V

assert V == 128 and K == 128 and L == 16 and R == 4, "the layouts below are written for a 128 x 128 state"

#: warps of one program: one channel (and one state row) per thread
WARPS = 4

_V = gl.constexpr(V)
_K = gl.constexpr(K)
_L = gl.constexpr(L)
_R = gl.constexpr(R)
_TOK_ROW = gl.constexpr(K + V)
_QMAX = gl.constexpr(float(QMAX))
_OFF = gl.constexpr(OFF)
_REGION_WORDS = gl.constexpr(REGION_WORDS)
_CODES_BYTE = gl.constexpr(CODES_BYTE)
_SK_WORD = gl.constexpr(SK_BYTE // 4)
_SV_WORD = gl.constexpr(SV_BYTE // 4)
_TOK_HALF = gl.constexpr(TOK_BYTE // 2)
_ALIGN = gl.constexpr(math.gcd(OFF, REGION_WORDS))
_NORM_EPS = gl.constexpr(NORM_EPS)
_SP_THRESHOLD = gl.constexpr(SOFTPLUS_THRESHOLD)
_INV_SQRT_K = gl.constexpr(K ** -0.5)
_KSTEP = gl.constexpr(32)                   #: channels per step of phase (4): two k = 16 mma steps
#: four codes to four exact fp16 values per call: one sign flip of the four bytes makes u = c + 128, a byte permute
#: per pair puts u under the exponent byte 0x64 (the half 1024 + u), and one f16x2 subtraction of 1152 leaves c
_CODE_HALF_ASM = gl.constexpr(
    "{ .reg .b32 t, m, k; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 k, 0x64806480; "
    "prmt.b32 $0, t, m, 0x7170; prmt.b32 $1, t, m, 0x7372; sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; }")
#: _fp16_split scales the largest magnitude into [2^14, 2^15): hi + lo stay finite in fp16 and the parts that matter
#: stay normal; the scale is 2^(_SPLIT_EXP - that magnitude's biased exponent)
_SPLIT_EXP = gl.constexpr(127 + 14)

# ---- layouts (4 warps) -------------------------------------------------------------------------------------------
#: [L, K] window tiles: a column (all L entries of one channel) per thread, channel = 32 warp + lane
WCOL = gl.constexpr(gl.BlockedLayout([L, 1], [1, 32], [1, WARPS], [0, 1]))
#: a K-vector, one channel per thread (as WCOL slices it)
KVEC = gl.constexpr(gl.SliceLayout(0, WCOL))
#: [V, L] ubuf^T: a state row (its L window values) per thread, row = 32 warp + lane; [V, R] q_old^T alike
VROW = gl.constexpr(gl.BlockedLayout([1, L], [32, 1], [WARPS, 1], [1, 0]))
QROW = gl.constexpr(gl.BlockedLayout([1, R], [32, 1], [WARPS, 1], [1, 0]))
#: a V-vector, one state row per thread
VVEC = gl.constexpr(gl.SliceLayout(1, VROW))
#: [16, K] tiles, 16 channels of a row per thread, 8 threads a row, 4 rows a warp: the codes' copy to shared memory
#: (16-byte chunks), the window keys and u_old for their sums over the channels (16 products in the thread, 3 shuffles)
CODES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
#: a K-vector as every thread of a CODES tile needs it: its 16 channels
CODE_COLS = gl.constexpr(gl.SliceLayout(0, CODES))
#: phase (4): [V, 8] fp32 mma accumulators, warp w holding rows 16 w .. 16 w + 15 and 64 + 16 w ..; the codes and X
#: as its operands, each thread holding 8 consecutive channels (k_width 8: one 8-byte load of codes per row and step,
#: the same channel order in both operands, so the sum over the channels is unchanged)
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]))
A_CODES = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=8))
B_X = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=8))
#: X^T [8, K] as it is built: a channel per thread (the KVEC distribution), its 8 columns in the thread
XT = gl.constexpr(gl.BlockedLayout([8, 1], [1, 32], [1, WARPS], [0, 1]))
PLAIN1_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
PLAIN2_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
#: the codes: 16-byte chunks XOR-swizzled by row, so that the 8 rows of an operand load fall in distinct banks
CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))


@gluon.jit
def _mul(a, b):
    return a * b


@gluon.jit
def _softplus(x):
    """log(1 + exp(x)), x itself above the threshold: the portable kernel's formula (step_kernel._softplus)."""
    e = gl.exp(gl.minimum(x, _SP_THRESHOLD))
    u = 1.0 + e
    lp = gl.where(u == 1.0, e, gl.log(u) * (e / gl.where(u == 1.0, 1.0, u - 1.0)))
    return gl.where(x > _SP_THRESHOLD, x, lp)


@gluon.jit
def _fp16_split(x):
    """(hi, lo, unit): x [K] fp32 = (hi + lo) unit to about 2^-22 of max |x|, hi and lo fp16, unit a power of two with
    max |x| / unit in [2^14, 2^15) where max |x| is normal (a subnormal maximum is scaled by 2^141: below 2^15, with
    the few bits it has; an all-zero x gives zeros). The scale 1 / unit = 2^shift, shift in [-113, 141], is applied as
    two exact factors (fp32 holds neither 2^141 nor, as a normal, its inverse: unit may be subnormal)."""
    top = gl.max(gl.abs(x), 0).to(gl.int32, bitcast=True) >> 23                # max |x|'s biased exponent
    shift = _SPLIT_EXP - top
    first = gl.minimum(shift, 127)
    xs = x * ((first + 127) << 23).to(gl.float32, bitcast=True) * ((shift - first + 127) << 23).to(gl.float32,
                                                                                                   bitcast=True)
    hi = xs.to(gl.float16)
    lo = (xs - hi.to(gl.float32)).to(gl.float16)
    unit = gl.where(shift <= 126, (127 - shift) << 23, 1 << (149 - shift)).to(gl.float32, bitcast=True)
    return hi, lo, unit


@gluon.jit
def _step_program(codes_s, x_s, sums_k, sums_q, raw_f32, raw_i8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr,
                  qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, row, head, slot, SS, qkv_stride, a_stride,
                  b_stride, H: gl.constexpr, HK: gl.constexpr, IS_KDA: gl.constexpr, BETA_BF16: gl.constexpr):
    prog = slot * H + head
    region = gl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, _ALIGN)

    # ---- (0) the codes into shared memory, first ----
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, CODES))
    cc = gl.arange(0, _K, layout=gl.SliceLayout(0, CODES))
    async_copy.async_copy_global_to_shared(codes_s, raw_i8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + cc[None, :])
    async_copy.commit_group()

    # fill count: L ("just flushed, empty") reads as 0; outside [0, L] clamped (as the reference)
    hc = gl.load(hcnt_ptr + prog)
    h = gl.where(hc == _L, 0, hc)
    h = gl.minimum(gl.maximum(h, 0), _L - 1)

    # ---- (1) the token and the per-channel quantities, a channel per thread ----
    kk = gl.arange(0, _K, layout=KVEC)
    tok_row = qkv_ptr + row * qkv_stride
    hk = head // (H // HK)
    kx = gl.load(tok_row + HK * _K + hk * _K + kk).to(gl.float32)
    qx = gl.load(tok_row + hk * _K + kk).to(gl.float32)
    kn = gl.div_rn(kx, gl.sqrt_rn(gl.sum(kx * kx, 0) + _NORM_EPS))
    qn = gl.div_rn(qx, gl.sqrt_rn(gl.sum(qx * qx, 0) + _NORM_EPS)) * _INV_SQRT_K
    A = gl.exp(gl.load(A_log_ptr + head))
    kb = kbuf_ptr + prog * (_L * _K)
    ub = ubuf_ptr + prog * (_L * _V)
    wp = w_ptr + prog * _L
    gb = gbuf_ptr + prog * (_L * _K)
    gp = gate_ptr + prog * _K

    # ---- (2) the window's effective keys [L, K], a column per thread; non-live entries loaded as 0 ----
    # tile row r holds entry j = L - 1 - r, so that D_j's product over the later entries is a forward scan (Triton
    # lowers a reverse scan by reversing the lanes: 5 shuffles per value, 140 shuffles in all)
    jl = (_L - 1) - gl.arange(0, _L, layout=gl.SliceLayout(1, WCOL))
    live = jl < h
    w_old = gl.load(wp + jl, mask=live, other=0.0)
    kwin = gl.load(kb + jl[:, None] * _K + kk[None, :], mask=live[:, None], other=0.0).to(gl.float32)
    if IS_KDA:
        g = -A * _softplus(gl.load(a_ptr + row * a_stride + head * _K + kk).to(gl.float32)
                           + gl.load(dt_ptr + head * _K + kk))
        en = gl.exp(g)
        pcum_new = gl.load(gp + kk) + g
        col_gate = gl.exp(pcum_new)
        row_gate = 1.0
        # D_j = en * prod_{j<i<h} gbuf_i: a scan down the thread's own column, over the rows of the later entries
        g_next = gl.load(gb + (jl[:, None] + 1) * _K + kk[None, :], mask=(jl[:, None] + 1) < h, other=1.0)
        decay = gl.associative_scan(g_next.to(gl.float32), 0, _mul)
        keys = kwin * w_old[:, None] * (decay * en[None, :])
        w_eff = w_old
    else:
        g = -A * _softplus(gl.load(a_ptr + row * a_stride + head).to(gl.float32) + gl.load(dt_ptr + head))
        at = gl.exp(g)
        p_new = gl.load(gate_ptr + prog) * at
        col_gate = gl.full([_K], 1.0, gl.float32, layout=KVEC)
        row_gate = p_new
        w_eff = w_old * at
        keys = kwin * w_eff[:, None]
    # keys kn, keys qn: the keys move to 16 channels of a row per thread (one exchange), so that the sums over the
    # channels run inside the thread but for 3 shuffles (a column per thread took 5 shuffles per entry and vector)
    kn_c = gl.convert_layout(kn, CODE_COLS)
    qn_c = gl.convert_layout(qn, CODE_COLS)
    keys_r = gl.convert_layout(keys, CODES)
    tk = gl.sum(keys_r * kn_c[None, :], 1)                            # [L] keys kn
    tq = gl.sum(keys_r * qn_c[None, :], 1)

    # ---- (3) the rank part: u_old (col_gate kn), u_old (col_gate qn), 16 channels of a row per thread ----
    rr = gl.arange(0, _R, layout=gl.SliceLayout(1, CODES))
    tok = raw_f16 + region * 2 + _TOK_HALF
    u_old = gl.load(tok + rr[:, None] * _TOK_ROW + cc[None, :]).to(gl.float32)
    gate_c = gl.convert_layout(col_gate, CODE_COLS)
    uk = gl.sum(u_old * (gate_c * kn_c)[None, :], 1) * row_gate       # [R]
    uq = gl.sum(u_old * (gate_c * qn_c)[None, :], 1) * row_gate
    col = gl.load(raw_f32 + region + _SK_WORD + kk) / _QMAX * col_gate
    xk_hi, xk_lo, unit_k = _fp16_split(col * kn)
    xq_hi, xq_lo, unit_q = _fp16_split(col * qn)
    knq = gl.sum(kn * qn, 0)

    # ---- (4) the codes on the tensor cores: [V, K] codes x X [K, 8], X's columns (xk hi, lo, xq hi, lo, 0 ...) ----
    n8 = gl.arange(0, 8, layout=gl.SliceLayout(1, XT))[:, None]
    xT = gl.where(n8 == 0, gl.convert_layout(xk_hi, gl.SliceLayout(0, XT))[None, :],
                  gl.where(n8 == 1, gl.convert_layout(xk_lo, gl.SliceLayout(0, XT))[None, :],
                           gl.where(n8 == 2, gl.convert_layout(xq_hi, gl.SliceLayout(0, XT))[None, :],
                                    gl.where(n8 == 3, gl.convert_layout(xq_lo, gl.SliceLayout(0, XT))[None, :],
                                             0.0))))
    x_s.store(xT.to(gl.float16))
    async_copy.wait_group(0)
    gl.thread_barrier()
    acc = gl.zeros([_V, 8], gl.float32, layout=ACC)
    for c in gl.static_range(_K // _KSTEP):
        a = gl.inline_asm_elementwise(_CODE_HALF_ASM, "=r,=r,r", [codes_s.slice(c * _KSTEP, _KSTEP, 1).load(A_CODES)],
                                      dtype=gl.float16, is_pure=True, pack=4)
        acc = mma_v2(a, x_s.slice(c * _KSTEP, _KSTEP, 1).permute([1, 0]).load(B_X), acc)
    n_acc = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))[None, :]
    sums_k.store(gl.sum(gl.where(n_acc < 2, acc, 0.0), 1) * unit_k)
    sums_q.store(gl.sum(gl.where((n_acc >= 2) & (n_acc < 4), acc, 0.0), 1) * unit_q)

    # ---- (5) a state row per thread: the window's and the rank part's terms, then the delta rule ----
    vr = gl.arange(0, _V, layout=VVEC)
    jv = (_L - 1) - gl.arange(0, _L, layout=gl.SliceLayout(0, VROW))   # the entries in the window tiles' row order
    ubT = gl.load(ub + jv[None, :] * _V + vr[:, None], mask=(jv < h)[None, :], other=0.0).to(gl.float32)
    tk_r = gl.convert_layout(tk, gl.SliceLayout(0, VROW))
    tq_r = gl.convert_layout(tq, gl.SliceLayout(0, VROW))
    rq = gl.arange(0, _R, layout=gl.SliceLayout(0, QROW))
    vq = gl.arange(0, _V, layout=gl.SliceLayout(1, QROW))
    q_oldT = gl.load(tok + rq[None, :] * _TOK_ROW + _K + vq[:, None]).to(gl.float32)
    rank_k = gl.convert_layout(gl.sum(q_oldT * gl.convert_layout(uk, gl.SliceLayout(0, QROW))[None, :], 1), VVEC)
    rank_q = gl.convert_layout(gl.sum(q_oldT * gl.convert_layout(uq, gl.SliceLayout(0, QROW))[None, :], 1), VVEC)
    row_f = gl.load(raw_f32 + region + _SV_WORD + vr) * row_gate
    gl.thread_barrier()                                               # the codes' row sums are in shared memory
    Sk = sums_k.load(VVEC) * row_f + rank_k + gl.sum(ubT * tk_r[None, :], 1)
    Sq = sums_q.load(VVEC) * row_f + rank_q + gl.sum(ubT * tq_r[None, :], 1)
    bx = gl.load(b_ptr + row * b_stride + head).to(gl.float32)
    # sigmoid in fp64, rounded once to fp32 (as the portable kernel: b near bf16 rounding midpoints)
    beta = (1.0 / (1.0 + gl.exp(-bx.to(gl.float64)))).to(gl.float32)
    if BETA_BF16:
        beta = beta.to(gl.bfloat16).to(gl.float32)
    u_new = beta * (gl.load(tok_row + 2 * HK * _K + head * _V + vr).to(gl.float32) - Sk)
    o = Sq + knq * u_new

    # ---- the writes: the output, entry h (kn, u_new, KDA en), the weights, the gate state, the fill count ----
    gl.store(out_ptr + (row * H + head) * _V + vr, o.to(gl.bfloat16))
    gl.store(ub + h * _V + vr, u_new.to(gl.bfloat16))
    gl.store(kb + h * _K + kk, kn.to(gl.bfloat16))
    if IS_KDA:
        gl.store(gb + h * _K + kk, en.to(gl.float16))
        gl.store(gp + kk, pcum_new)
        gl.store(wp + jl, gl.full([_L], 1.0, gl.float32, layout=gl.SliceLayout(1, WCOL)), mask=jl == h)
    else:
        gl.store(gate_ptr + prog, p_new)
        gl.store(wp + jl, gl.where(jl == h, 1.0, w_eff), mask=jl <= h)
    gl.store(hcnt_ptr + prog, h + 1)


@gluon.jit(do_not_specialize=["num_slots", "SS", "qkv_stride", "a_stride", "b_stride"])
def step_kernel(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, idx_ptr, qkv_ptr,
                a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, num_slots, SS, qkv_stride, a_stride, b_stride,
                H: gl.constexpr, HK: gl.constexpr, IS_KDA: gl.constexpr, BETA_BF16: gl.constexpr):
    """Program ``pid`` = row * H + head of the grid (N * H,), 4 warps: the portable kernel's arguments
    (step_kernel.step_kernel) without BV."""
    pid = gl.program_id(0)
    row = (pid // H).to(gl.int64)
    head = (pid % H).to(gl.int64)
    slot = gl.load(idx_ptr + row).to(gl.int64)
    codes_s = gl.allocate_shared_memory(gl.int8, [_V, _K], CODES_SMEM)
    x_s = gl.allocate_shared_memory(gl.float16, [8, _K], PLAIN2_SMEM)
    sums_k = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    sums_q = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    if (slot > 0) & (slot < num_slots):
        _step_program(codes_s, x_s, sums_k, sums_q, raw_f32, raw_u8.to(gl.pointer_type(gl.int8)), raw_f16, kbuf_ptr, ubuf_ptr,
                      w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, row,
                      head, slot, SS, qkv_stride, a_stride, b_stride, H, HK, IS_KDA, BETA_BF16)
    else:                                   # no sequence on this row: a zero output, nothing else written
        gl.store(out_ptr + (row * H + head) * _V + gl.arange(0, _V, layout=VVEC),
                 gl.zeros([_V], gl.bfloat16, layout=VVEC))
