"""The Triton backend's decode step on a GPU, written in Gluon (explicit layouts), for sm_80 and newer.

Same contract, grid and arguments as the portable step kernel (:mod:`leapquant.triton.step_kernel`, which the
interpreter runs and which serves where Gluon cannot): one program of 2 warps per (row, head), S applied to kn and qn
without being formed. What differs is that every tensor has a layout chosen so that the sums stay inside a thread,
and that the window is read only as far as its fill count:

    token           q, k, v, a and b (written before the slot test, as they depend on the row only; ptxas places
                    them after the branch, beside the loads of (1))
    (0) codes       the program's 16 KB of codes start copying into shared memory (cp.async)
    (1) loads       everything else of the program but ubuf: the window's keys and (KDA) decay factors only where the
                    fill count needs them (an empty entry's rows are never read; its weight is, the 16 weights being
                    64 bytes), the rank part, the scales; ubuf^T loads in (6), its live entries likewise (fewer
                    registers held by loads in flight)
    (2) token       kn, qn: the norms summed on copies holding 16 channels per thread (:data:`CODE_COLS`: 3 shuffles,
                    no exchange between warps); every per-channel quantity (the gate, pcum, s_k, xk, xq) one channel
                    per thread (:data:`KVEC`); KDA's decay products D_j a scan down a column per thread (:data:`WCOL`)
    (3) window      keys kn and keys qn summed with 16 channels of an entry per thread (:data:`CODES`)
    (4) rank part   u_old (col_gate kn), u_old (col_gate qn) alike; X = (xk, xq) as digits for the tensor cores
    (5) codes       on the int8 tensor cores: codes [V, K] times X [K, 8] = (xk, xq) each scaled by a power of two
                    and split into four signed base-2^7 digits (:func:`_digits`), int32 accumulators [V, 8]
                    (:data:`ACC`), 32 channels per step; the row sums, each digit's weighted in fp32, go to shared
                    memory
    (6) rows        a state row per thread (:data:`VROW`): the window's ubuf^T (keys kn) and the rank part's
                    q_old^T (u_old kn) inside the thread, the codes' sums read back, then u_new, o and the stores

Every value is fp32 but phase (5)'s operands: the int8 products and their int32 sums are exact, and the digits keep
each xk and xq to half a unit, at most 2^-27 of the largest (fp32 itself keeps 2^-24 of each value), so the codes' sums
equal the portable kernel's to about fp32 rounding (an fp16 hi + lo split of X on the tensor cores keeps 22 bits, and
costs two byte permutes and two half-precision subtractions per four codes: docs/design-triton.md, the step's
variants).
"""
# (no ``from __future__ import annotations``: Gluon reads the annotations of its constexpr parameters)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..layout import CODES_BYTE, OFF, REGION_ALIGN_WORDS, REGION_WORDS, SK_WORD, SV_WORD, TOK_HALF, TOK_ROW
from ..numerics import K, L, NORM_EPS, QMAX, R, SOFTPLUS_THRESHOLD, V
from .gluon_pool import PoolRefs, aggregate

assert V == 128 and K == 128 and L == 16 and R == 4, "the layouts below are written for a 128 x 128 state"

#: warps of one program. The layouts below are written per warp and wrap over the program's 64 threads, so where a
#: comment says "a channel per thread" (or a state row, an entry) a thread holds two, c and c + 64: every vector phase
#: has two independent chains per instruction, and the program issues 26 % (KDA) / 34 % (GDN) fewer warp instructions
#: than at 4 warps. Measured side by side on the H200 (fill 15; docs/design-triton.md, the step's variants), 4 / 2 / 1
#: warps: KDA batch 64 / 256 / 512 26.9 / 26.1 / 26.9, 87.0 / 82.3 / 95.0, 166.9 / 156.1 / 184.4 us; GDN 22.5 / 21.0 /
#: 22.0, 67.7 / 65.2 / 66.8, 127.6 / 120.8 / 122.3 us
WARPS = 2
#: the launch's register cap per gate (ptxas maxnreg; None: none): 112 for both, 9 programs per SM on sm_90. KDA needs
#: 142 registers uncapped there (7 programs), spills 8 local-memory instructions under 112 and 10 under 128 (8
#: programs; under 112: 24 on sm_80, 22 on sm_100, not timed there); on the H200 (batch 256, fill 1 / 8 / 15) 112 took
#: 66.0 / 71.1 / 77.6 us, 128 68.0 / 72.8 / 79.8. GDN needs 104 registers uncapped (9 programs either way) and was
#: timed under 112
MAX_REGISTERS = {"kda": 112, "gdn": 112}

_V = gl.constexpr(V)
_K = gl.constexpr(K)
_L = gl.constexpr(L)
_R = gl.constexpr(R)
_TOK_ROW = gl.constexpr(TOK_ROW)
_QMAX = gl.constexpr(float(QMAX))
_OFF = gl.constexpr(OFF)
_REGION_WORDS = gl.constexpr(REGION_WORDS)
_CODES_BYTE = gl.constexpr(CODES_BYTE)
_SK_WORD = gl.constexpr(SK_WORD)
_SV_WORD = gl.constexpr(SV_WORD)
_TOK_HALF = gl.constexpr(TOK_HALF)
_ALIGN = gl.constexpr(REGION_ALIGN_WORDS)
_NORM_EPS = gl.constexpr(NORM_EPS)
_SP_THRESHOLD = gl.constexpr(SOFTPLUS_THRESHOLD)
_INV_SQRT_K = gl.constexpr(K ** -0.5)
_KSTEP = gl.constexpr(64)                   #: channels per step of phase (5): two k = 32 int8 mma steps
#: _digits scales the largest magnitude into [2^26, 2^27): four signed base-2^7 digits hold it, and every value keeps
#: its bits down to half a unit (at most 2^-27 of that magnitude); the scale is 2^(_DIGIT_EXP - that magnitude's
#: biased exponent)
_DIGIT_EXP = gl.constexpr(127 + 26)

# ---- layouts (per warp; at 2 warps each wraps once over the rows or channels) ---------------------------------------
#: [L, K] window tiles: a column (all L entries of one channel) per thread, channel = 32 warp + lane (+ 64)
WCOL = gl.constexpr(gl.BlockedLayout([L, 1], [1, 32], [1, WARPS], [0, 1]))
#: a K-vector, one channel per thread (as WCOL slices it)
KVEC = gl.constexpr(gl.SliceLayout(0, WCOL))
#: [V, L] ubuf^T: a state row (its L window values) per thread, row = 32 warp + lane (+ 64); [V, R] q_old^T alike
VROW = gl.constexpr(gl.BlockedLayout([1, L], [32, 1], [WARPS, 1], [1, 0]))
#: [L, 2] / [R, 2] pairs of per-entry values (keys kn, keys qn) with every entry in every thread, as VROW's columns
PAIRS = gl.constexpr(gl.BlockedLayout([L, 2], [32, 1], [WARPS, 1], [1, 0]))
PAIRS_R = gl.constexpr(gl.BlockedLayout([R, 2], [32, 1], [WARPS, 1], [1, 0]))
#: a V-vector, one state row per thread
VVEC = gl.constexpr(gl.SliceLayout(1, VROW))
#: [16, K] tiles, 16 channels of a row per thread, 8 threads a row, 4 rows a warp: the codes' copy to shared memory
#: (16-byte chunks), the window keys and u_old for their sums over the channels (16 products in the thread, 3 shuffles)
CODES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
#: a K-vector as every thread of a CODES tile needs it: its 16 channels
CODE_COLS = gl.constexpr(gl.SliceLayout(0, CODES))
#: phase (5): [V, 8] int32 mma accumulators, warp w holding rows 16 w .. 16 w + 15 and every 32nd row on; the codes and
#: X's digits as its int8 operands, each thread holding 16 consecutive channels of a row (k_width 16) in a step of 64
#: channels (two k = 32 mma steps: the four threads of a quad cover the 64): one 16-byte load of codes per row and
#: step, the same channel order in both operands, so the sum over the channels is unchanged
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]))
A_CODES = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=16))
B_X = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=16))
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
    """log(1 + exp(x)), x itself above the threshold, NaN for a NaN x: the portable kernel's formula
    (step_kernel._softplus)."""
    e = gl.exp(gl.minimum(x, _SP_THRESHOLD))
    u = 1.0 + e
    lp = gl.where(u == 1.0, e, gl.log(u) * (e / gl.where(u == 1.0, 1.0, u - 1.0)))
    return gl.where(x <= _SP_THRESHOLD, lp, x)


@gluon.jit
def _beta(bx, BETA_BF16: gl.constexpr):
    """sigmoid(b) for the bf16 scalar b, as fp32 (rounded to bf16 when BETA_BF16). In fp32 where that is exact enough:
    for |b| <= 8 the fp32 form is within ~16 ulp of sigmoid(b) (the exponent's argument rounded: ln 2 * 11.5 * 2^-24
    relative, ~8 ulp; log2 e, ex2, 1 + e and the division: a few more), so its bf16 rounding is the exact value's unless
    it lies within 64 ulp of a bf16 rounding midpoint (low 16 bits near 0x8000); there, and for |b| > 8, sigmoid in
    fp64 rounded to fp32 (the portable kernel's form; rounded again to bf16, a double rounding whose agreement with
    the exact value's rounding tests/test_triton_step.py checks on every bf16 b). b is one value per program, so the
    branch never diverges."""
    b = bx.to(gl.float32)
    beta = gl.fdiv(1.0, 1.0 + gl.exp(-b), ieee_rounding=False)
    slow = gl.abs(b) > 8.0
    if BETA_BF16:
        slow = slow | (gl.abs((beta.to(gl.int32, bitcast=True) & 0xFFFF) - 0x8000) <= 64)
    if slow:
        beta = (1.0 / (1.0 + gl.exp(-b.to(gl.float64)))).to(gl.float32)
    if BETA_BF16:
        beta = beta.to(gl.bfloat16).to(gl.float32)
    return beta


@gluon.jit
def _balanced(x):
    """(digit, rest): x = rest 2^7 + digit, digit in [-64, 63] (x int32; rest exact: x - digit is a multiple of 2^7)."""
    d = ((x + 64) & 127) - 64
    return d, (x - d) >> 7


@gluon.jit
def _digits(x):
    """(d0, d1, d2, d3, unit): x [K] fp32 = (d0 2^21 + d1 2^14 + d2 2^7 + d3) unit to half a unit (rounded to nearest,
    ties to even), each d an int8 in [-64, 64], unit a power of two with max |x| / unit in [2^26, 2^27) where
    max |x| >= 2^-123 (a smaller maximum is scaled by 2^149: below 2^27, with the bits it has; an all-zero x gives
    zeros). The scale 1 / unit = 2^shift, shift in [-101, 149], is applied as two exact factors (fp32 holds neither
    2^149 nor, as a normal, its inverse). A NaN or infinite x makes the unit NaN, so that it reaches the sums as it
    would reach fp32 products (the digits of such an x mean nothing)."""
    top_abs = gl.max(gl.where(x == x, gl.abs(x), float("inf")), 0)              # NaN counts as infinite
    top = top_abs.to(gl.int32, bitcast=True) >> 23                             # max |x|'s biased exponent
    shift = gl.minimum(_DIGIT_EXP - top, 149)
    first = gl.minimum(shift, 127)
    xs = x * ((first + 127) << 23).to(gl.float32, bitcast=True) * ((shift - first + 127) << 23).to(gl.float32,
                                                                                                   bitcast=True)
    n = gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [xs], dtype=gl.int32, is_pure=True,
                                  pack=1)                                      # |n| <= 2^27
    d3, n = _balanced(n)
    d2, n = _balanced(n)
    d1, d0 = _balanced(n)                                                      # |d0| <= 64
    unit = gl.where(shift <= 126, (127 - shift) << 23, 1 << (149 - shift)).to(gl.float32, bitcast=True)
    unit = gl.where(top_abs <= 3.4028234663852886e38, unit, float("nan"))
    return d0.to(gl.int8), d1.to(gl.int8), d2.to(gl.int8), d3.to(gl.int8), unit


@aggregate
class StepScratch:
    """A program's shared memory: the codes [V, K] int8 (CODES_SMEM), X's digits [8, K] int8, and the codes' row
    sums with kn and with qn [V] fp32."""
    codes: gl.shared_memory_descriptor
    x: gl.shared_memory_descriptor
    sums_k: gl.shared_memory_descriptor
    sums_q: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, codes, x, sums_k, sums_q):
        self.codes = codes
        self.x = x
        self.sums_k = sums_k
        self.sums_q = sums_q


@aggregate
class StepToken:
    """This row's token as a program holds it: kx, qx a channel per thread (KVEC) and as 16-channel copies
    (CODE_COLS), vx a state row per thread (VVEC), the gate's a (KDA: KVEC; GDN: a scalar) and beta's b (bf16)."""
    kx: gl.tensor
    qx: gl.tensor
    kx_c: gl.tensor
    qx_c: gl.tensor
    vx: gl.tensor
    ax: gl.tensor
    bx: gl.tensor

    @gluon.constexpr_function
    def __init__(self, kx, qx, kx_c, qx_c, vx, ax, bx):
        self.kx = kx
        self.qx = qx
        self.kx_c = kx_c
        self.qx_c = qx_c
        self.vx = vx
        self.ax = ax
        self.bx = bx


@gluon.jit
def _step_program(scratch, pool, token, A_log_ptr, dt_ptr, out_ptr, row, head, slot, H: gl.constexpr,
                  IS_KDA: gl.constexpr, BETA_BF16: gl.constexpr):
    kx, qx, kx_c, qx_c, vx, ax, bx = token.kx, token.qx, token.kx_c, token.qx_c, token.vx, token.ax, token.bx
    prog = slot * H + head
    region = gl.multiple_of(_OFF + slot * pool.slot_stride + head * _REGION_WORDS, _ALIGN)

    # ---- (0) the codes into shared memory ----
    cv = gl.arange(0, _V, layout=gl.SliceLayout(1, CODES))
    cc = gl.arange(0, _K, layout=gl.SliceLayout(0, CODES))
    async_copy.async_copy_global_to_shared(scratch.codes,
                                           pool.raw_i8 + region * 4 + _CODES_BYTE + cv[:, None] * _K + cc[None, :])
    async_copy.commit_group()

    # ---- (1) every other load of the program. The window's rows from the fill count on are never read (masked
    # loads): its bytes fall with the fill count, and its loads wait for the fill count, a trip the codes' copy (0)
    # and the token's phase (2) overlap in part (H200, batch 256, against the whole window read: the design note's
    # variants) ----
    hc = gl.load(pool.hcnt + prog)
    kk = gl.arange(0, _K, layout=KVEC)
    vr = gl.arange(0, _V, layout=VVEC)
    kb = pool.kbuf + prog * (_L * _K)
    ub = pool.ubuf + prog * (_L * _V)
    wp = pool.w + prog * _L
    # window tiles hold entry j = L - 1 - r in row r, so that D_j's product over the later entries is a forward scan
    # (Triton lowers a reverse scan by reversing the lanes: 5 shuffles per value, 140 shuffles in all)
    jc = (_L - 1) - gl.arange(0, _L, layout=gl.SliceLayout(1, CODES))   # the entry of each CODES row
    jv = (_L - 1) - gl.arange(0, _L, layout=gl.SliceLayout(0, VROW))    # ... of each VROW column
    # fill count: L ("just flushed, empty") reads as 0; outside [0, L] clamped (as the reference)
    h = gl.where(hc == _L, 0, hc)
    h = gl.minimum(gl.maximum(h, 0), _L - 1)
    kwin = gl.load(kb + jc[:, None] * _K + cc[None, :], mask=(jc < h)[:, None], other=0.0)
    w_old = gl.load(wp + jc)                                            # [L], a thread's own entry
    tok = pool.raw_f16 + region * 2 + _TOK_HALF
    rr = gl.arange(0, _R, layout=gl.SliceLayout(1, CODES))
    u_old = gl.load(tok + rr[:, None] * _TOK_ROW + cc[None, :])         # fp16 [R, K]
    rv = gl.arange(0, _R, layout=gl.SliceLayout(0, VROW))
    q_oldT = gl.load(tok + rv[None, :] * _TOK_ROW + _K + vr[:, None])   # fp16 [V, R], a state row per thread
    s_k = gl.load(pool.raw_f32 + region + _SK_WORD + kk)
    s_v = gl.load(pool.raw_f32 + region + _SV_WORD + vr)
    gb = pool.gbuf + prog * (_L * _K)
    if IS_KDA:
        gp = pool.gate + prog * _K
        jl = (_L - 1) - gl.arange(0, _L, layout=gl.SliceLayout(1, WCOL))
        # entry j + 1's decay factor in row j's place, a column per thread, where j + 1 < h (entry L - 1's row never
        # is: its address is clamped into the window and its load masked off)
        g_next = gl.load(gb + gl.minimum(jl + 1, _L - 1)[:, None] * _K + kk[None, :], mask=((jl + 1) < h)[:, None],
                         other=1.0)
        pcum = gl.load(gp + kk)
        dt = gl.load(dt_ptr + head * _K + kk)
    else:
        p_old = gl.load(pool.gate + prog)
        dt = gl.load(dt_ptr + head)
    A = gl.exp(gl.load(A_log_ptr + head))

    # ---- (2) the token and the per-channel quantities, a channel per thread ----
    # the sums over the channels run on the CODE_COLS copies (16 channels per thread, 3 shuffles, no exchange between
    # warps); the norms by rsqrt: 2^-22 relative at worst (qn, scaled by K^-1/2 too: 2^-21.6), against the
    # criterion's 1e-5 of kn's and o's magnitude
    kx_c = kx_c.to(gl.float32)
    qx_c = qx_c.to(gl.float32)
    k_scale = gl.rsqrt(gl.sum(kx_c * kx_c, 0) + _NORM_EPS)
    q_scale = gl.rsqrt(gl.sum(qx_c * qx_c, 0) + _NORM_EPS) * _INV_SQRT_K
    kn = kx.to(gl.float32) * k_scale
    qn = qx.to(gl.float32) * q_scale
    kn_c = kx_c * k_scale
    qn_c = qx_c * q_scale
    g = -A * _softplus(ax.to(gl.float32) + dt)
    if IS_KDA:
        en = gl.exp(g)
        pcum_new = pcum + g
        col_gate = gl.exp(pcum_new)
        row_gate = 1.0
        # D_j = en * prod_{j<i<h} gbuf_i: a scan down the thread's own column, entries from h on counting as 1
        decay = gl.associative_scan(gl.where((jl[:, None] + 1) < h, g_next.to(gl.float32), 1.0), 0, _mul)
        keys = kwin.to(gl.float32) * gl.convert_layout(decay * en[None, :], CODES)
        w_eff = w_old
    else:
        at = gl.exp(g)
        p_new = p_old * at
        col_gate = gl.full([_K], 1.0, gl.float32, layout=KVEC)
        row_gate = p_new
        w_eff = w_old * at
        keys = kwin.to(gl.float32)
    # ---- (3) the window's sums over the channels, 16 channels of an entry per thread (16 products, 3 shuffles),
    # each entry's weight after its sum; the entries past the fill count become 0 here ----
    live = jc < h
    tk = gl.where(live, gl.sum(keys * kn_c[None, :], 1) * w_eff, 0.0)        # [L] keys kn
    tq = gl.where(live, gl.sum(keys * qn_c[None, :], 1) * w_eff, 0.0)

    # ---- (4) the rank part: u_old (col_gate kn), u_old (col_gate qn), 16 channels of a row per thread ----
    gate_c = gl.convert_layout(col_gate, CODE_COLS)
    uk = gl.sum(u_old.to(gl.float32) * (gate_c * kn_c)[None, :], 1) * row_gate       # [R]
    uq = gl.sum(u_old.to(gl.float32) * (gate_c * qn_c)[None, :], 1) * row_gate
    # X = (xk, xq) = s_k / 127 col_gate (kn, qn) and their maxima, a channel per thread (maxima taken on CODE_COLS
    # copies hold 16 more fp32 per thread: 119 registers for GDN against 80)
    col = s_k / _QMAX * col_gate
    xk0, xk1, xk2, xk3, unit_k = _digits(col * kn)
    xq0, xq1, xq2, xq3, unit_q = _digits(col * qn)
    knq = gl.sum(kn_c * qn_c, 0)

    # ---- (5) the codes on the int8 tensor cores: [V, K] codes x X [K, 8], X's columns the digits (xk d0 .. d3,
    # xq d0 .. d3): exact int32 sums (|sum| <= 128 * 127 * 64 < 2^21), each weighted exactly in fp32 ----
    n8 = gl.arange(0, 8, layout=gl.SliceLayout(1, XT))[:, None]
    xd: gl.constexpr = gl.SliceLayout(0, XT)
    xT = gl.where(n8 == 0, gl.convert_layout(xk0, xd)[None, :],
                  gl.where(n8 == 1, gl.convert_layout(xk1, xd)[None, :],
                           gl.where(n8 == 2, gl.convert_layout(xk2, xd)[None, :],
                                    gl.where(n8 == 3, gl.convert_layout(xk3, xd)[None, :],
                                             gl.where(n8 == 4, gl.convert_layout(xq0, xd)[None, :],
                                                      gl.where(n8 == 5, gl.convert_layout(xq1, xd)[None, :],
                                                               gl.where(n8 == 6, gl.convert_layout(xq2, xd)[None, :],
                                                                        gl.convert_layout(xq3, xd)[None, :])))))))
    scratch.x.store(xT)
    async_copy.wait_group(0)
    gl.thread_barrier()
    acc = gl.zeros([_V, 8], gl.int32, layout=ACC)
    for c in gl.static_range(_K // _KSTEP):
        acc = mma_v2(scratch.codes.slice(c * _KSTEP, _KSTEP, 1).load(A_CODES),
                     scratch.x.slice(c * _KSTEP, _KSTEP, 1).permute([1, 0]).load(B_X), acc)
    n_acc = gl.arange(0, 8, layout=gl.SliceLayout(0, ACC))[None, :]
    weight = gl.where(n_acc % 4 == 0, 2097152.0, gl.where(n_acc % 4 == 1, 16384.0, gl.where(n_acc % 4 == 2, 128.0,
                                                                                            1.0)))
    part = acc.to(gl.float32) * weight
    scratch.sums_k.store(gl.sum(gl.where(n_acc < 4, part, 0.0), 1) * unit_k)
    scratch.sums_q.store(gl.sum(gl.where(n_acc >= 4, part, 0.0), 1) * unit_q)

    # ---- (6) a state row per thread: the window's and the rank part's terms, then the delta rule ----
    # loaded here rather than in (1), to hold fewer registers while the loads are in flight (the design note's
    # variants: GDN 90 registers against 128 with it in (1))
    ubT = gl.load(ub + jv[None, :] * _V + vr[:, None], mask=(jv < h)[None, :], other=0.0).to(gl.float32)
    # the per-entry and per-rank-row sums to every thread, each pair in one exchange
    tk_r, tq_r = gl.split(gl.convert_layout(gl.join(tk, tq), PAIRS))
    uk_r, uq_r = gl.split(gl.convert_layout(gl.join(uk, uq), PAIRS_R))
    tk_r = gl.convert_layout(tk_r, gl.SliceLayout(0, VROW))
    tq_r = gl.convert_layout(tq_r, gl.SliceLayout(0, VROW))
    uk_r = gl.convert_layout(uk_r, gl.SliceLayout(0, VROW))
    uq_r = gl.convert_layout(uq_r, gl.SliceLayout(0, VROW))
    q_oldT = q_oldT.to(gl.float32)
    rank_k = gl.sum(q_oldT * uk_r[None, :], 1)
    rank_q = gl.sum(q_oldT * uq_r[None, :], 1)
    row_f = s_v * row_gate
    gl.thread_barrier()                                               # the codes' row sums are in shared memory
    Sk = scratch.sums_k.load(VVEC) * row_f + rank_k + gl.sum(ubT * tk_r[None, :], 1)
    Sq = scratch.sums_q.load(VVEC) * row_f + rank_q + gl.sum(ubT * tq_r[None, :], 1)
    beta = _beta(bx, BETA_BF16)
    u_new = beta * (vx.to(gl.float32) - Sk)
    o = Sq + knq * u_new

    # ---- the writes: the output, entry h (kn, u_new, KDA en), the weights, the gate state, the fill count ----
    gl.store(out_ptr + (row * H + head) * _V + vr, o.to(gl.bfloat16))
    gl.store(ub + h * _V + vr, u_new.to(gl.bfloat16))
    gl.store(kb + h * _K + kk, kn.to(gl.bfloat16))
    if IS_KDA:
        gl.store(gb + h * _K + kk, en.to(gl.float16))
        gl.store(gp + kk, pcum_new)
        gl.store(wp + jc, gl.full([_L], 1.0, gl.float32, layout=gl.SliceLayout(1, CODES)), mask=jc == h)
    else:
        gl.store(pool.gate + prog, p_new)
        gl.store(wp + jc, gl.where(jc == h, 1.0, w_eff), mask=jc <= h)
    gl.store(pool.hcnt + prog, h + 1)


@gluon.jit(do_not_specialize=["num_slots", "SS", "a_stride", "b_stride"])
def step_kernel(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, hcnt_ptr, idx_ptr, qkv_ptr,
                a_ptr, b_ptr, A_log_ptr, dt_ptr, out_ptr, num_slots, SS, qkv_stride, a_stride, b_stride,
                H: gl.constexpr, HK: gl.constexpr, IS_KDA: gl.constexpr, BETA_BF16: gl.constexpr):
    """Program ``pid`` = row * H + head of the grid (N * H,), :data:`WARPS` warps: the portable kernel's arguments
    (step_kernel.step_kernel) without BV."""
    pid = gl.program_id(0)
    row = (pid // H).to(gl.int64)
    head = (pid % H).to(gl.int64)
    slot = gl.load(idx_ptr + row).to(gl.int64)
    # the token's loads depend on the row only, so they are written before the slot test. ptxas still places them
    # after the branch, but its register allocation is better this way than with them inside the program (static,
    # sm_90: KDA 48 against 56 bytes spilled under its cap, GDN 80 against 92 registers)
    hk = head // (H // HK)
    tok_row = qkv_ptr + row * qkv_stride
    kx = gl.load(tok_row + HK * _K + hk * _K + gl.arange(0, _K, layout=KVEC))
    qx = gl.load(tok_row + hk * _K + gl.arange(0, _K, layout=KVEC))
    kx_c = gl.load(tok_row + HK * _K + hk * _K + gl.arange(0, _K, layout=CODE_COLS))
    qx_c = gl.load(tok_row + hk * _K + gl.arange(0, _K, layout=CODE_COLS))
    vx = gl.load(tok_row + 2 * HK * _K + head * _V + gl.arange(0, _V, layout=VVEC))
    bx = gl.load(b_ptr + row * b_stride + head)
    if IS_KDA:
        ax = gl.load(a_ptr + row * a_stride + head * _K + gl.arange(0, _K, layout=KVEC))
    else:
        ax = gl.load(a_ptr + row * a_stride + head)
    codes_s = gl.allocate_shared_memory(gl.int8, [_V, _K], CODES_SMEM)
    x_s = gl.allocate_shared_memory(gl.int8, [8, _K], PLAIN2_SMEM)
    sums_k = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    sums_q = gl.allocate_shared_memory(gl.float32, [_V], PLAIN1_SMEM)
    if (slot > 0) & (slot < num_slots):
        scratch = StepScratch(codes_s, x_s, sums_k, sums_q)
        pool = PoolRefs(raw_f32, raw_u8, raw_u8.to(gl.pointer_type(gl.int8)), raw_f16, kbuf_ptr, ubuf_ptr, w_ptr,
                        gate_ptr, gbuf_ptr, hcnt_ptr, SS)
        token = StepToken(kx, qx, kx_c, qx_c, vx, ax, bx)
        _step_program(scratch, pool, token, A_log_ptr, dt_ptr, out_ptr, row, head, slot, H, IS_KDA, BETA_BF16)
    else:                                   # no sequence on this row: a zero output, nothing else written
        gl.store(out_ptr + (row * H + head) * _V + gl.arange(0, _V, layout=VVEC),
                 gl.zeros([_V], gl.bfloat16, layout=VVEC))
