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
    (4) codes       blocks of 16 rows from shared memory, 16 codes of a row per thread (:data:`CODES`), dequantised
                    exactly (one byte permute per code, as the flush's Gluon kernel) and reduced against xk and xq
                    (16 products in the thread, then 3 shuffles); the row sums go to shared memory
    (5) rows        a state row per thread (:data:`VROW`): the window's ubuf^T (keys kn) and the rank part's
                    q_old^T (u_old kn) inside the thread, the codes' sums read back, then u_new, o and the stores

Every value is fp32 (no TF32); the results equal the portable kernel's up to the order of the sums.
"""
# (no ``from __future__ import annotations``: Gluon reads the annotations of its constexpr parameters)
import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ..layout import CODES_BYTE, OFF, REGION_WORDS, SK_BYTE, SV_BYTE, TOK_BYTE
from ..numerics import K, L, NORM_EPS, QMAX, R, SOFTPLUS_THRESHOLD, V
from .gluon_kernel import _CODE_SHIFT

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
#: xk and xq carry 2^15: the dequantised codes are c 2^-15 (exact), so the products are c xk exactly as rounded
_CODE_UNIT = gl.constexpr(32768.0)
_BLOCK = gl.constexpr(16)                   #: state rows per step of phase (4): 4 per warp
#: the flush kernel's exact dequantisation (gluon_kernel._CODE_BYTES_ASM) four codes per call: one sign flip of the
#: four bytes, then one byte permute per code puts u = c + 128 into bits 8..15 of the float 1.0: x = 1 + u 2^-15, and
#: x - _CODE_SHIFT = c 2^-15 exactly (two codes per call spent a permute more per code to split the word)
_CODE_QUAD_ASM = gl.constexpr(
    "{ .reg .b32 t, one; xor.b32 t, $4, 0x80808080; mov.b32 one, 0x3F800000; "
    "prmt.b32 $0, t, one, 0x7604; prmt.b32 $1, t, one, 0x7614; prmt.b32 $2, t, one, 0x7624; "
    "prmt.b32 $3, t, one, 0x7634; }")

# ---- layouts (4 warps) -------------------------------------------------------------------------------------------
#: [L, K] window tiles: a column (all L entries of one channel) per thread, channel = 32 warp + lane
WCOL = gl.constexpr(gl.BlockedLayout([L, 1], [1, 32], [1, WARPS], [0, 1]))
#: [R, K] rank rows u_old, a column per thread alike
UCOL = gl.constexpr(gl.BlockedLayout([R, 1], [1, 32], [1, WARPS], [0, 1]))
#: a K-vector, one channel per thread (as WCOL and UCOL slice it)
KVEC = gl.constexpr(gl.SliceLayout(0, WCOL))
#: [V, L] ubuf^T: a state row (its L window values) per thread, row = 32 warp + lane; [V, R] q_old^T alike
VROW = gl.constexpr(gl.BlockedLayout([1, L], [32, 1], [WARPS, 1], [1, 0]))
QROW = gl.constexpr(gl.BlockedLayout([1, R], [32, 1], [WARPS, 1], [1, 0]))
#: a V-vector, one state row per thread
VVEC = gl.constexpr(gl.SliceLayout(1, VROW))
#: [16, K] int8 code blocks: 16 codes of a row per thread, 8 threads a row, 4 rows a warp
CODES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
#: xk, xq as every thread of a block needs them: its 16 channels
CODE_COLS = gl.constexpr(gl.SliceLayout(0, CODES))
CODE_ROWS = gl.constexpr(gl.SliceLayout(1, CODES))
PLAIN1_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
PLAIN2_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))


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
def _step_program(codes_s, sums_k, sums_q, raw_f32, raw_i8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr,
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
    jl = gl.arange(0, _L, layout=gl.SliceLayout(1, WCOL))
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
        # D_j = en * prod_{j<i<h} gbuf_i: the reverse scan runs down the thread's own column
        g_next = gl.load(gb + (jl[:, None] + 1) * _K + kk[None, :], mask=(jl[:, None] + 1) < h, other=1.0)
        decay = gl.associative_scan(g_next.to(gl.float32), 0, _mul, reverse=True)
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
    col = gl.load(raw_f32 + region + _SK_WORD + cc) / _QMAX * gate_c
    xk = col * kn_c * _CODE_UNIT
    xq = col * qn_c * _CODE_UNIT
    knq = gl.sum(kn * qn, 0)

    # ---- (4) the codes: 16 rows a step, reduced against xk and xq; the row sums to shared memory ----
    async_copy.wait_group(0)
    gl.thread_barrier()
    for b in gl.static_range(_V // _BLOCK):
        x = gl.inline_asm_elementwise(_CODE_QUAD_ASM, "=r,=r,=r,=r,r",
                                      [codes_s.slice(b * _BLOCK, _BLOCK).load(CODES)], dtype=gl.float32,
                                      is_pure=True, pack=4)
        d = x - _CODE_SHIFT                                           # c 2^-15, exact
        sums_k.slice(b * _BLOCK, _BLOCK).store(gl.sum(d * xk[None, :], 1))
        sums_q.slice(b * _BLOCK, _BLOCK).store(gl.sum(d * xq[None, :], 1))

    # ---- (5) a state row per thread: the window's and the rank part's terms, then the delta rule ----
    vr = gl.arange(0, _V, layout=VVEC)
    jv = gl.arange(0, _L, layout=gl.SliceLayout(0, VROW))
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
    codes_s = gl.allocate_shared_memory(gl.int8, [_V, _K], PLAIN2_SMEM)
    sums_k = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    sums_q = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    if (slot > 0) & (slot < num_slots):
        _step_program(codes_s, sums_k, sums_q, raw_f32, raw_u8.to(gl.pointer_type(gl.int8)), raw_f16, kbuf_ptr, ubuf_ptr,
                      w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, row,
                      head, slot, SS, qkv_stride, a_stride, b_stride, H, HK, IS_KDA, BETA_BF16)
    else:                                   # no sequence on this row: a zero output, nothing else written
        gl.store(out_ptr + (row * H + head) * _V + gl.arange(0, _V, layout=VVEC),
                 gl.zeros([_V], gl.bfloat16, layout=VVEC))
