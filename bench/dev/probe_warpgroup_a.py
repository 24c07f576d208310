"""Issue 28, probe P2: warpgroup A of the flush redesign alone (docs/design-tilelang.md, "The redesign's probes"),
written in Gluon. One program of 4 warps per (row, head) computes the new tokens from the factored form it reads,
without the dense state: the three products, each

    S^T x = g (c C^T (s_v x) + u^T (q x)) + Kd^T (Ub x)          S z = s_v C (c g z) + q^T (u (g z)) + Ub^T (Kd z)

(C the int8 codes, c = s_k / 127, g the checkpoint's decay per column: KDA exp(pcum), GDN p; Kd the window's keys
w_j kbuf_j D_j, Ub its values), the codes' parts on the int8 tensor cores with the multiplier split into four signed
base-2^7 digits under a power-of-two scale per column (exact integer sums), the rank-4 and window parts as sums in
fp32; then CholeskyQR: P from S^T q0 (one pass), Q from S P (two passes), U = S^T Q, the tokens u = fp16(U^T),
q = fp16(Q^T) to a side output (warpgroup B would take them).

The gates (issue 28): <= 4.5k warp instructions per program, <= 6k cycles per program with both pipes busy, tokens
equal to the reference's up to fp32 rounding. ``static`` compiles it without a GPU and counts its SASS (no loop: the
static count per thread times 4 warps is what a program executes, up to the branch for rows without a sequence);
``time`` (GPU) checks the tokens against the reference's compression and times it.

Dev tool: python bench/dev/probe_warpgroup_a.py static [--capability 90] | time [--batch 64 256]. CPU check:
bench/dev/test_probes.py compiles it for sm_90."""
from __future__ import annotations

import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from leapquant.numerics import CHOLQR_ABS_FLOOR, CHOLQR_RELATIVE_FLOOR, FP16_MAX, K, R, V

from probe_warpgroup_b import (_CODES_BYTE, _K, _L, _QMAX, _R, _SK_WORD, _SV_WORD,  # noqa: E402
                               _TOK_HALF, _TOK_ROW, _V, _RNI_ASM, CODES, CODES_SMEM, PLAIN2, WARPS, _mul,
                               _program, compile_probe, print_static, probe_args, time_mode)

_REL_FLOOR = gl.constexpr(CHOLQR_RELATIVE_FLOOR)
_ABS_FLOOR = gl.constexpr(CHOLQR_ABS_FLOOR)
_FP16_MAX = gl.constexpr(FP16_MAX)
_DIGIT_EXP = gl.constexpr(127 + 26)

#: a 128-vector (a row or column index of the state per thread)
VEC = gl.constexpr(gl.BlockedLayout([1], [32], [WARPS], [0]))
#: [128, 16]: a thread's row, 16 values of it (the window's 16 entries; a product's 4 columns x 4 digits)
ROW16 = gl.constexpr(gl.BlockedLayout([1, 16], [32, 1], [WARPS, 1], [1, 0]))
#: the codes' products: int32 accumulators [128, 16] and their int8 operands (16 channels per thread, steps of 64)
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=16))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=16))
_KSTEP = gl.constexpr(64)


@gluon.jit
def _balanced(x):
    d = ((x + 64) & 127) - 64
    return d, (x - d) >> 7


@gluon.jit
def _digits4(x0, x1, x2, x3):
    """The four columns x0..x3 [128] (VEC) as int8 digits [128, 16] (ROW16: column 4 c + d is column c's digit d,
    weight 2^(21 - 7 d)) and each column's unit (max |x_c| scaled into [2^26, 2^27), as the step kernel's digits)."""
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, ROW16))[None, :]
    out = gl.zeros([128, 16], gl.int32, layout=ROW16)
    units = gl.zeros([16], gl.float32, layout=gl.SliceLayout(0, ROW16))
    for c in gl.static_range(4):
        x = x0 if c == 0 else (x1 if c == 1 else (x2 if c == 2 else x3))
        top = gl.max(gl.abs(x), 0).to(gl.int32, bitcast=True) >> 23
        shift = gl.minimum(_DIGIT_EXP - top, 149)
        first = gl.minimum(shift, 127)
        xs = x * ((first + 127) << 23).to(gl.float32, bitcast=True) * ((shift - first + 127) << 23).to(
            gl.float32, bitcast=True)
        n = gl.inline_asm_elementwise(_RNI_ASM, "=r,r", [xs], dtype=gl.int32, is_pure=True, pack=1)
        d3, n = _balanced(n)
        d2, n = _balanced(n)
        d1, d0 = _balanced(n)
        unit = gl.where(shift <= 126, (127 - shift) << 23, 1 << (149 - shift)).to(gl.float32, bitcast=True)
        for d in gl.static_range(4):
            dig = d0 if d == 0 else (d1 if d == 1 else (d2 if d == 2 else d3))
            out = gl.where(col == 4 * c + d, gl.convert_layout(dig, gl.SliceLayout(1, ROW16))[:, None], out)
        units = gl.where(gl.arange(0, 16, layout=gl.SliceLayout(0, ROW16)) // 4 == c, unit, units)
    return out.to(gl.int8), units


@gluon.jit
def _codes_product(a_s, xd_s, d, units):
    """[128, 4] as four VEC columns: the int8 matrix in ``a_s`` [128, 128] (rows out) times the digits ``d`` [128, 16]
    (rows: the inner index) through the tensor cores, each column recombined from its digits in fp32."""
    xd_s.store(gl.permute(d, [1, 0]))                    # [16, 128]: a digit column's 128 values contiguous
    gl.thread_barrier()
    acc = gl.zeros([128, 16], gl.int32, layout=ACC)
    for s in gl.static_range(128 // _KSTEP):
        acc = mma_v2(a_s.slice(s * _KSTEP, _KSTEP, 1).load(A_OP),
                     xd_s.slice(s * _KSTEP, _KSTEP, 1).permute([1, 0]).load(B_OP), acc)
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, ACC))
    dw = n % 4
    w = gl.where(dw == 0, 2097152.0, gl.where(dw == 1, 16384.0, gl.where(dw == 2, 128.0, 1.0)))
    part = acc.to(gl.float32) * (w * gl.convert_layout(units, gl.SliceLayout(0, ACC)))[None, :]
    gl.thread_barrier()                                  # xd_s is written again by the next product
    y0 = gl.convert_layout(gl.sum(gl.where((n // 4 == 0)[None, :], part, 0.0), 1), VEC)
    y1 = gl.convert_layout(gl.sum(gl.where((n // 4 == 1)[None, :], part, 0.0), 1), VEC)
    y2 = gl.convert_layout(gl.sum(gl.where((n // 4 == 2)[None, :], part, 0.0), 1), VEC)
    y3 = gl.convert_layout(gl.sum(gl.where((n // 4 == 3)[None, :], part, 0.0), 1), VEC)
    return y0, y1, y2, y3


@gluon.jit
def _small(m_rows, x0, x1, x2, x3):
    """m [128, 16] (ROW16: row t of the thread, 16 values) against four VEC columns: the four [16] sums over the
    128 rows, sum_t m[t, :] x_c[t] (spread to every thread)."""
    s0 = gl.sum(m_rows * gl.convert_layout(x0, gl.SliceLayout(1, ROW16))[:, None], 0)
    s1 = gl.sum(m_rows * gl.convert_layout(x1, gl.SliceLayout(1, ROW16))[:, None], 0)
    s2 = gl.sum(m_rows * gl.convert_layout(x2, gl.SliceLayout(1, ROW16))[:, None], 0)
    s3 = gl.sum(m_rows * gl.convert_layout(x3, gl.SliceLayout(1, ROW16))[:, None], 0)
    return s0, s1, s2, s3


@gluon.jit
def _apply(m_rows, s):
    """VEC: sum_j m[t, j] s[j] for the thread's row t (m [128, 16] ROW16, s [16] spread)."""
    return gl.convert_layout(gl.sum(m_rows * s[None, :], 1), VEC)


@gluon.jit
def _st_x(cT_s, xd_s, c, g, s_v, q_rows, u_rows, ub_rows, kd_rows, x0, x1, x2, x3):
    """S^T x for x [V, 4] (four VEC columns indexed by v): four VEC columns indexed by k. [128, 16] operands, a row
    per thread: q_rows [v, r] and u_rows [k, r] (the tokens, r < 4, the rest 0), ub_rows [v, j] and kd_rows [k, j]
    (the window's values and decayed, weighted keys)."""
    d, units = _digits4(x0 * s_v, x1 * s_v, x2 * s_v, x3 * s_v)
    y0, y1, y2, y3 = _codes_product(cT_s, xd_s, d, units)
    qx0, qx1, qx2, qx3 = _small(q_rows, x0, x1, x2, x3)          # [16]: q x, rows 0..3 of each (rest 0)
    ux0 = _apply(u_rows, qx0)
    ux1 = _apply(u_rows, qx1)
    ux2 = _apply(u_rows, qx2)
    ux3 = _apply(u_rows, qx3)
    b0, b1, b2, b3 = _small(ub_rows, x0, x1, x2, x3)              # [16]: Ub x
    return (g * (c * y0 + ux0) + _apply(kd_rows, b0), g * (c * y1 + ux1) + _apply(kd_rows, b1),
            g * (c * y2 + ux2) + _apply(kd_rows, b2), g * (c * y3 + ux3) + _apply(kd_rows, b3))


@gluon.jit
def _s_z(c_s, xd_s, c, g, s_v, q_rows, u_rows, ub_rows, kd_rows, z0, z1, z2, z3):
    """S z for z [K, 4] (four VEC columns indexed by k): four VEC columns indexed by v. The [128, 16] operands as in
    :func:`_st_x`: q_rows [v, r], u_rows [k, r], ub_rows [v, j], kd_rows [k, j]."""
    cg = c * g
    d, units = _digits4(z0 * cg, z1 * cg, z2 * cg, z3 * cg)
    y0, y1, y2, y3 = _codes_product(c_s, xd_s, d, units)
    u0, u1, u2, u3 = _small(u_rows, z0 * g, z1 * g, z2 * g, z3 * g)    # [16]: u (g z)
    k0, k1, k2, k3 = _small(kd_rows, z0, z1, z2, z3)                   # [16]: Kd z
    return (s_v * y0 + _apply(q_rows, u0) + _apply(ub_rows, k0), s_v * y1 + _apply(q_rows, u1)
            + _apply(ub_rows, k1), s_v * y2 + _apply(q_rows, u2) + _apply(ub_rows, k2),
            s_v * y3 + _apply(q_rows, u3) + _apply(ub_rows, k3))


@gluon.jit
def _pivot(d):
    return gl.sqrt(gl.maximum(d, _ABS_FLOOR))


@gluon.jit
def _cholqr(x0, x1, x2, x3):
    """One CholeskyQR pass on four VEC columns: X <- X L^-T, L L^T = X^T X, pivots floored (leapquant.numerics)."""
    g00 = gl.sum(x0 * x0, 0)
    g10 = gl.sum(x1 * x0, 0)
    g11 = gl.sum(x1 * x1, 0)
    g20 = gl.sum(x2 * x0, 0)
    g21 = gl.sum(x2 * x1, 0)
    g22 = gl.sum(x2 * x2, 0)
    g30 = gl.sum(x3 * x0, 0)
    g31 = gl.sum(x3 * x1, 0)
    g32 = gl.sum(x3 * x2, 0)
    g33 = gl.sum(x3 * x3, 0)
    l00 = _pivot(g00)
    l10 = g10 / l00
    l11 = _pivot(gl.maximum(g11 - l10 * l10, _REL_FLOOR * g11))
    l20 = g20 / l00
    l21 = (g21 - l20 * l10) / l11
    l22 = _pivot(gl.maximum(g22 - l20 * l20 - l21 * l21, _REL_FLOOR * g22))
    l30 = g30 / l00
    l31 = (g31 - l30 * l10) / l11
    l32 = (g32 - l30 * l20 - l31 * l21) / l22
    l33 = _pivot(gl.maximum(g33 - l30 * l30 - l31 * l31 - l32 * l32, _REL_FLOOR * g33))
    y0 = x0 / l00
    y1 = (x1 - l10 * y0) / l11
    y2 = (x2 - l20 * y0 - l21 * y1) / l22
    y3 = (x3 - l30 * y0 - l31 * y1 - l32 * y2) / l33
    return y0, y1, y2, y3


@gluon.jit
def warpgroup_a_kernel(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, tok_out_ptr,
                       idx_ptr, num_slots, SS, H: gl.constexpr, IS_KDA: gl.constexpr):
    """Program row * H + head of the grid (N * H,): the new tokens of that program (every program due) to
    ``tok_out_ptr`` fp16 [N, H, R, K + V] (u | q rows). q0 fp32 [V, R]."""
    pid, head, slot, valid, prog, region = _program(idx_ptr, num_slots, SS, H)
    if valid:
        raw_i8 = raw_u8.to(gl.pointer_type(gl.int8))
        # ---- staging: the codes and their transpose in shared memory, the rest a row or column per thread ----
        c_s = gl.allocate_shared_memory(gl.int8, [_V, _K], CODES_SMEM)
        rv = gl.arange(0, _V, layout=gl.SliceLayout(1, CODES))
        ck = gl.arange(0, _K, layout=gl.SliceLayout(0, CODES))
        codes = gl.load(raw_i8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + ck[None, :])
        c_s.store(codes)
        cT_s = gl.allocate_shared_memory(gl.int8, [_K, _V], CODES_SMEM, gl.permute(codes, [1, 0]))
        xd_s = gl.allocate_shared_memory(gl.int8, [16, 128], PLAIN2)
        t = gl.arange(0, 128, layout=VEC)
        t16 = gl.arange(0, 128, layout=gl.SliceLayout(1, ROW16))[:, None]
        j16 = gl.arange(0, 16, layout=gl.SliceLayout(0, ROW16))[None, :]
        s_v = gl.load(raw_f32 + region + _SV_WORD + t)
        c = gl.load(raw_f32 + region + _SK_WORD + t) / _QMAX
        tok = raw_f16 + region * 2 + _TOK_HALF
        live_r = j16 < _R
        q_rows = gl.load(tok + j16 * _TOK_ROW + _K + t16, mask=live_r, other=0.0).to(gl.float32)   # [v, r]
        u_rows = gl.load(tok + j16 * _TOK_ROW + t16, mask=live_r, other=0.0).to(gl.float32)        # [k, r]
        ub_rows = gl.load(ubuf_ptr + prog * (_L * _V) + j16 * _V + t16).to(gl.float32)            # [v, j]
        w = gl.load(w_ptr + prog * _L + j16)
        kd_rows = gl.load(kbuf_ptr + prog * (_L * _K) + j16 * _K + t16).to(gl.float32) * w       # [k, j]
        if IS_KDA:
            g = gl.exp(gl.load(gate_ptr + prog * _K + t))
            gj = gl.load(gbuf_ptr + prog * (_L * _K) + gl.minimum(j16 + 1, _L - 1) * _K + t16).to(gl.float32)
            # D_j = prod_{i > j} gbuf_i: a reverse product along the thread's own 16 entries
            kd_rows = kd_rows * gl.associative_scan(gl.where(j16 + 1 < _L, gj, 1.0), 1, _mul, reverse=True)
        else:
            g = gl.full([128], 1.0, gl.float32, layout=VEC) * gl.load(gate_ptr + prog)
        gl.thread_barrier()
        # ---- P = CholeskyQR(S^T q0), one pass; Q = CholeskyQR(S P), two; U = S^T Q ----
        x0 = gl.load(q0_ptr + t * _R + 0)
        x1 = gl.load(q0_ptr + t * _R + 1)
        x2 = gl.load(q0_ptr + t * _R + 2)
        x3 = gl.load(q0_ptr + t * _R + 3)
        y0, y1, y2, y3 = _st_x(cT_s, xd_s, c, g, s_v, q_rows, u_rows, ub_rows, kd_rows, x0, x1, x2, x3)
        p0, p1, p2, p3 = _cholqr(y0, y1, y2, y3)
        z0, z1, z2, z3 = _s_z(c_s, xd_s, c, g, s_v, q_rows, u_rows, ub_rows, kd_rows, p0, p1, p2, p3)
        z0, z1, z2, z3 = _cholqr(z0, z1, z2, z3)
        q0n, q1n, q2n, q3n = _cholqr(z0, z1, z2, z3)
        e0, e1, e2, e3 = _st_x(cT_s, xd_s, c, g, s_v, q_rows, u_rows, ub_rows, kd_rows, q0n, q1n, q2n, q3n)
        # ---- the tokens: u = fp16(U^T) (clamped), q = fp16(Q^T) ----
        out = tok_out_ptr + pid * (_R * _TOK_ROW)
        for r in gl.static_range(_R):
            er = e0 if r == 0 else (e1 if r == 1 else (e2 if r == 2 else e3))
            qr = q0n if r == 0 else (q1n if r == 1 else (q2n if r == 2 else q3n))
            gl.store(out + r * _TOK_ROW + t, gl.minimum(gl.maximum(er, -_FP16_MAX), _FP16_MAX).to(gl.float16))
            gl.store(out + r * _TOK_ROW + _K + t, qr.to(gl.float16))


SIGNATURE = {"raw_f32": "*fp32", "raw_u8": "*u8", "raw_f16": "*fp16", "kbuf_ptr": "*bf16", "ubuf_ptr": "*bf16",
             "w_ptr": "*fp32", "gate_ptr": "*fp32", "gbuf_ptr": "*fp16", "q0_ptr": "*fp32", "tok_out_ptr": "*fp16",
             "idx_ptr": "*i32", "num_slots": "i32", "SS": "i32", "H": "constexpr", "IS_KDA": "constexpr"}


def compile_static(capability: int = 90, gate: str = "kda", num_heads: int = 32, maxnreg: int | None = None):
    """P2's kernel compiled for ``capability`` without a GPU (probe_warpgroup_b.compile_probe)."""
    return compile_probe(warpgroup_a_kernel, SIGNATURE, capability, gate, num_heads, maxnreg)


def launch(pool, idx, q0, tok_out, maxnreg: int | None = None) -> None:
    """One call over the programs of ``idx`` (int32 slots, every head): the new tokens to ``tok_out`` fp16
    [N, H, R, K + V]."""
    import torch
    from leapquant.layout import slot_stride
    kda = pool.gate == "kda"
    gate = pool.pcum if kda else pool.p
    warpgroup_a_kernel[(idx.numel() * pool.num_heads,)](
        pool.raw, pool.raw.view(torch.uint8), pool.raw.view(torch.float16), pool.kbuf, pool.ubuf, pool.w, gate,
        pool.gbuf if kda else pool.p, q0, tok_out, idx, pool.num_slots, slot_stride(pool.num_heads),
        H=pool.num_heads, IS_KDA=kda, num_warps=WARPS, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))


def check(gate: str, dev) -> str:
    """The probe's tokens by the SPEC criterion (8 rows x 32 heads of every family): the reference encodes the case's
    rebuilt state with them (residual, scales, codes: what warpgroup B would do) and the checkpoint is judged against
    the exact state as every flush is. (A head of rank below 4 has noise for its last columns of Q, in the reference
    as here: its tokens cannot be compared entry by entry, its checkpoint can.)"""
    import torch
    from leapquant import families
    from leapquant.layout import Pool
    from leapquant.reference import default_q0, rebuild, tokens_and_codes
    case = families.make_case(8, 32, gate, seed=3)
    t = case.tensors
    S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
    pool = Pool(10, 32, device=dev, gate=gate)
    slots = torch.arange(1, 9)
    case.to(dev).load_into(pool, slots)
    out = torch.full((8, 32, R, K + V), float("nan"), dtype=torch.float16, device=dev)
    launch(pool, slots.to(dev, torch.int32), default_q0(dev), out)
    torch.cuda.synchronize()
    out = out.cpu()
    checkpoint = tokens_and_codes(S, out[..., K:].float().transpose(-1, -2), out[..., :K].float().transpose(-1, -2))
    v = case.judge(checkpoint, name=f"P2 {gate}")
    return f"{gate}: {'PASS' if v.passed else 'FAIL'}, worst head {v.worst_score:.4f} of its bound :: {v.message}"


def main() -> int:
    args = probe_args([64, 256])
    if args.cmd == "static":
        print_static(compile_static, args.capability, args.maxnreg)
        return 0
    import torch
    from leapquant.reference import default_q0
    dev = torch.device("cuda")
    q0 = default_q0(dev)

    def call_for(pool, gate, batch, idx):
        out = torch.empty((batch, 32, R, K + V), dtype=torch.float16, device=dev)
        return lambda s, cap: launch(pool, idx[s], q0, out, cap)
    time_mode(args, check, call_for)
    return 0


if __name__ == "__main__":
    sys.exit(main())
