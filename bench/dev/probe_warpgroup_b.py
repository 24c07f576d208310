"""Issue 28, probe P1: warpgroup B of the flush redesign alone (docs/design-tilelang.md, "The redesign's probes"),
written in Gluon. One program of 4 warps per (row, head) holds the state [V, K] in the tensor cores' accumulator
layout (128 fp32 per thread) and does B's share of a flush: the rebuild, the residual with the new tokens (a side
input here: warpgroup A would hand them over), the scales and the codes, written to the program's checkpoint.

    rebuild     S = (codes s_k / 127 s_v + q_old^T u_old) g + ubuf^T (w kbuf D), g = exp(pcum) per column (KDA) or
                p (GDN): the codes dequantised on the CUDA cores, both rank updates on the tensor cores (the fp16
                tokens and bf16 window values exact, the keys as bf16 hi + lo parts: 2^-17 relative)
    residual    E = S - q^T u with the new fp16 tokens (tensor cores, exact products)
    scales      s_k = max(sqrt(mean_v |E|), EPS), then s_v = max(max_k |E / s_k|, EPS) (the reference's encode)
    codes       round(127 E / (s_k s_v)) to nearest even, and the tokens, s_k, s_v to the pool

The gates (issue 28): no spills under its register cap, <= 5.5k warp instructions per program, <= 70 us at batch
256 (stop above 90). ``static`` compiles it for a target without a GPU and counts its SASS (the kernel has no loop:
its static count per thread times 4 warps is what a program executes, up to the branch for rows without a
sequence); ``time`` (GPU) times it as the tables of record are timed and checks it against the reference's encode.

Dev tool: python bench/dev/probe_warpgroup_b.py static [--capability 90] | time [--batch 64 256]. CPU check:
bench/dev/test_probes.py compiles it for sm_90."""
from __future__ import annotations

import argparse
import re
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from leapquant.numerics import EPS, K, L, R, V
# the pool's geometry as the step kernel names it for Gluon (one definition: leapquant.layout, leapquant.numerics)
from leapquant.triton.gluon_step_kernel import (_CODES_BYTE, _K, _L, _OFF, _QMAX, _R, _REGION_WORDS, _SK_WORD,  # noqa
                                                _SV_WORD, _TOK_HALF, _TOK_ROW, _V, _mul)

WARPS = 4
_EPS = gl.constexpr(float(EPS))

#: the state [V, K]: mma accumulators, warp w holding rows 16 w .. 16 w + 15 and 64 + 16 w .., all columns
ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=8))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=8))
#: a K-vector, one channel per thread: per-column values computed once, then spread to the state's columns
COL1 = gl.constexpr(gl.BlockedLayout([1], [32], [WARPS], [0]))
#: [16, 128] tiles as they are copied and built: 8 halves (16 bytes) per thread
ROWS16 = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0]))
#: [L, K] window columns, one channel per thread (the decay's product over the later entries runs down it)
WCOL = gl.constexpr(gl.BlockedLayout([L, 1], [1, 32], [1, WARPS], [0, 1]))
#: [V, K] int8 rows, 16 bytes per thread: the codes' copies in and out
CODES = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0]))
CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
_RNI_ASM = gl.constexpr("cvt.rni.s32.f32 $0, $1;")


@gluon.jit
def _program(idx_ptr, num_slots, SS, H: gl.constexpr):
    """(pid, head, slot, valid, prog, region) of program ``pid`` = row * H + head of the grid (N * H,): valid where
    its row holds a sequence (0 < slot < num_slots); prog = slot * H + head; region its region's first word."""
    pid = gl.program_id(0)
    head = (pid % H).to(gl.int64)
    slot = gl.load(idx_ptr + (pid // H).to(gl.int64)).to(gl.int64)
    region = gl.multiple_of(_OFF + slot * SS + head * _REGION_WORDS, 16)
    return pid, head, slot, (slot > 0) & (slot < num_slots), slot * H + head, region


@gluon.jit
def _rank16(tok_ptr, row0: gl.constexpr, n: gl.constexpr, sign: gl.constexpr):
    """[16, n] fp16: rows 0 .. R - 1 the token rows ``tok_ptr + r * (K + V) + row0 + j`` times ``sign`` (exact),
    rows R .. 15 zero (the rank-4 update as a k = 16 mma)."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, ROWS16))[:, None]
    j = gl.arange(0, n, layout=gl.SliceLayout(0, ROWS16))[None, :]
    t = gl.load(tok_ptr + r * _TOK_ROW + row0 + j, mask=(r < _R) & (j >= 0), other=0.0)
    return t * sign


@gluon.jit
def warpgroup_b_kernel(raw_f32, raw_u8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, tok_new_ptr, idx_ptr,
                       num_slots, SS, H: gl.constexpr, IS_KDA: gl.constexpr):
    """Program row * H + head of the grid (N * H,): B's share of the flush of that program (every program due).
    ``tok_new_ptr`` fp16 [N, H, R, K + V]: the new tokens (u | q rows), as warpgroup A would hand them over."""
    pid, head, slot, valid, prog, region = _program(idx_ptr, num_slots, SS, H)
    if valid:
        raw_i8 = raw_u8.to(gl.pointer_type(gl.int8))
        codes_s = gl.allocate_shared_memory(gl.int8, [_V, _K], CODES_SMEM)
        rv = gl.arange(0, _V, layout=gl.SliceLayout(1, CODES))
        ck = gl.arange(0, _K, layout=gl.SliceLayout(0, CODES))
        async_copy.async_copy_global_to_shared(codes_s, raw_i8 + region * 4 + _CODES_BYTE + rv[:, None] * _K
                                               + ck[None, :])
        async_copy.commit_group()

        # ---- the operands beside the codes: scales, gate, tokens (old and new), window ----
        vs = gl.arange(0, _V, layout=gl.SliceLayout(1, ACC))
        ks = gl.arange(0, _K, layout=gl.SliceLayout(0, ACC))
        s_k = gl.load(raw_f32 + region + _SK_WORD + ks)
        s_v = gl.load(raw_f32 + region + _SV_WORD + vs)
        tok = raw_f16 + region * 2 + _TOK_HALF
        tok_new = tok_new_ptr + pid * (_R * _TOK_ROW)
        qT_s = gl.allocate_shared_memory(gl.float16, [16, _V], PLAIN2, _rank16(tok, _K, _V, 1.0))
        u_s = gl.allocate_shared_memory(gl.float16, [16, _K], PLAIN2, _rank16(tok, 0, _K, 1.0))
        qnT_s = gl.allocate_shared_memory(gl.float16, [16, _V], PLAIN2, _rank16(tok_new, _K, _V, -1.0))
        un_s = gl.allocate_shared_memory(gl.float16, [16, _K], PLAIN2, _rank16(tok_new, 0, _K, 1.0))
        # the window's keys w_j kbuf_j D_j (KDA: D_j = prod_{i > j} gbuf_i per channel), split into bf16 hi + lo
        jw = gl.arange(0, _L, layout=gl.SliceLayout(1, WCOL))
        kw = gl.arange(0, _K, layout=gl.SliceLayout(0, WCOL))
        # KDA's rows in reverse entry order (the product over the later entries is a forward scan), GDN's in order
        jr = (_L - 1) - jw if IS_KDA else jw
        keys = (gl.load(kbuf_ptr + prog * (_L * _K) + jr[:, None] * _K + kw[None, :]).to(gl.float32)
                * gl.load(w_ptr + prog * _L + jr)[:, None])
        if IS_KDA:
            g_later = gl.load(gbuf_ptr + prog * (_L * _K) + gl.minimum(jr + 1, _L - 1)[:, None] * _K + kw[None, :])
            keys = keys * gl.associative_scan(gl.where((jr[:, None] + 1) < _L, g_later.to(gl.float32), 1.0), 0, _mul)
            g = gl.convert_layout(gl.exp(gl.load(gate_ptr + prog * _K + gl.arange(0, _K, layout=COL1))),
                                  gl.SliceLayout(0, ACC))
        else:
            g = gl.full([_K], 1.0, gl.float32, layout=gl.SliceLayout(0, ACC)) * gl.load(gate_ptr + prog)
        hi = keys.to(gl.bfloat16)
        lo = (keys - hi.to(gl.float32)).to(gl.bfloat16)
        khi_s = gl.allocate_shared_memory(gl.bfloat16, [_L, _K], PLAIN2, hi)
        klo_s = gl.allocate_shared_memory(gl.bfloat16, [_L, _K], PLAIN2, lo)
        vw = gl.arange(0, _V, layout=gl.SliceLayout(0, WCOL))
        ub = gl.load(ubuf_ptr + prog * (_L * _V) + jr[:, None] * _V + vw[None, :])    # [L, V] in the keys' row order
        ub_s = gl.allocate_shared_memory(gl.bfloat16, [_L, _V], PLAIN2, ub)

        # ---- rebuild: S = (codes s_k / 127 s_v + q_old^T u_old) g + ubuf^T keys ----
        async_copy.wait_group(0)
        gl.thread_barrier()
        codes = codes_s.load(ACC).to(gl.float32)
        S = codes * (s_k / _QMAX)[None, :] * s_v[:, None]
        S = mma_v2(qT_s.permute([1, 0]).load(A_OP), u_s.load(B_OP), S)
        S = S * g[None, :]
        ubT = ub_s.permute([1, 0]).load(A_OP)
        S = mma_v2(ubT, khi_s.load(B_OP), S)
        S = mma_v2(ubT, klo_s.load(B_OP), S)
        # ---- residual: E = S - q^T u with the new tokens (q negated exactly) ----
        E = mma_v2(qnT_s.permute([1, 0]).load(A_OP), un_s.load(B_OP), S)
        # ---- scales: s_k from the column means of |E|, then s_v from the row maxima of |E / s_k| ----
        sk_new = gl.convert_layout(gl.maximum(gl.sqrt(gl.convert_layout(gl.sum(gl.abs(E), 0), COL1) / _V), _EPS),
                                   gl.SliceLayout(0, ACC))
        x = E * gl.convert_layout(1.0 / gl.convert_layout(sk_new, COL1), gl.SliceLayout(0, ACC))[None, :]
        sv_new = gl.maximum(gl.max(gl.abs(x), 1), _EPS)
        # ---- codes: round(x 127 / s_v) to nearest even (|x 127 / s_v| <= 127 (1 + 2^-22): no clamp needed) ----
        n = gl.inline_asm_elementwise(_RNI_ASM, "=r,r", [x * (_QMAX / sv_new)[:, None]], dtype=gl.int32,
                                      is_pure=True, pack=1)
        gl.store(raw_i8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + ck[None, :],
                 gl.convert_layout(n.to(gl.int8), CODES))
        gl.store(raw_f32 + region + _SK_WORD + ks, sk_new)
        gl.store(raw_f32 + region + _SV_WORD + vs, sv_new)
        tr = gl.arange(0, _R, layout=gl.SliceLayout(1, ROWS16))[:, None]
        tc = gl.arange(0, _TOK_ROW, layout=gl.SliceLayout(0, ROWS16))[None, :]
        gl.store(tok + tr * _TOK_ROW + tc, gl.load(tok_new + tr * _TOK_ROW + tc))


SIGNATURE = {"raw_f32": "*fp32", "raw_u8": "*u8", "raw_f16": "*fp16", "kbuf_ptr": "*bf16", "ubuf_ptr": "*bf16",
             "w_ptr": "*fp32", "gate_ptr": "*fp32", "gbuf_ptr": "*fp16", "tok_new_ptr": "*fp16", "idx_ptr": "*i32",
             "num_slots": "i32", "SS": "i32", "H": "constexpr", "IS_KDA": "constexpr"}


def compile_probe(fn, signature: dict, capability: int, gate: str, num_heads: int, maxnreg: int | None):
    """The Gluon probe kernel ``fn`` (arguments ``signature``, then the constexprs H and IS_KDA) compiled for compute
    capability ``capability`` without a GPU (Triton's compiler and ptxas), with 16-byte aligned pool and window
    pointers (idx not). Returns Triton's compiled-kernel object."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(signature, gbuf_ptr="*fp16" if gate == "kda" else "*fp32")
    names = list(sig)
    assert names == list(fn.arg_names), fn.arg_names
    const = {"H": num_heads, "IS_KDA": gate == "kda"}
    aligned = [i for i, n in enumerate(names) if sig[n].startswith("*") and n != "idx_ptr"]
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    opts = dict(num_warps=WARPS, num_stages=1)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=opts)


def compile_static(capability: int = 90, gate: str = "kda", num_heads: int = 32, maxnreg: int | None = None):
    """P1's kernel compiled for ``capability`` without a GPU (:func:`compile_probe`)."""
    return compile_probe(warpgroup_b_kernel, SIGNATURE, capability, gate, num_heads, maxnreg)


def static_counts(kern, capability: int = 90) -> dict:
    """SASS instructions of the compiled kernel (nvdisasm's listing of its cubin: all, its mma and local-memory ones),
    its registers and spilled bytes (ptxas's verbose report of the kernel's PTX), its shared memory."""
    import os
    import subprocess
    import tempfile
    import triton.backends.nvidia as nv
    arch = f"sm_{capability}" + ("a" if capability >= 90 else "")
    bin_dir = os.path.join(os.path.dirname(nv.__file__), "bin")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.cubin"), "wb").write(kern.asm["cubin"])
        listing = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True).stdout
        ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0].split(".")[0]
               for m in re.finditer(r"^\s+/\*[0-9a-f]{4,5}\*/\s+(.*?)\s*;", listing, re.M)]
        open(os.path.join(d, "k.ptx"), "w").write(kern.asm["ptx"])
        rep = subprocess.run([os.path.join(bin_dir, "ptxas"), f"-arch={arch}", "-v",
                              os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return {"instructions": len(ops), "local": sum(o in ("LDL", "STL") for o in ops),
            "mma": ops.count("HMMA") + ops.count("IMMA"),
            "shared": kern.metadata.shared, "registers": int(regs.group(1)) if regs else None,
            "spilled": int(spill.group(1)) if spill else None}


def print_static(compile_fn, capability: int, caps) -> None:
    """The ``static`` table of a probe: ``compile_fn(capability, gate, maxnreg=...)`` for both gates and each cap."""
    print("| gate | maxnreg | instructions per thread | x 4 warps | mma | registers | spilled B | local | shared |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gate in ("kda", "gdn"):
        for cap in caps:
            c = static_counts(compile_fn(capability, gate, maxnreg=cap or None), capability)
            print(f"| {gate} | {cap or 'none'} | {c['instructions']} | {4 * c['instructions']} | {c['mma']} | "
                  f"{c['registers']} | {c['spilled']} | {c['local']} | {c['shared']} |")


def launch(pool, idx, tok_new, maxnreg: int | None = None) -> None:
    """One call over the programs of ``idx`` (int32 slots, every head), ``tok_new`` fp16 [N, H, R, K + V]."""
    import torch
    from leapquant.layout import slot_stride
    kda = pool.gate == "kda"
    gate = pool.pcum if kda else pool.p
    warpgroup_b_kernel[(idx.numel() * pool.num_heads,)](
        pool.raw, pool.raw.view(torch.uint8), pool.raw.view(torch.float16), pool.kbuf, pool.ubuf, pool.w, gate,
        pool.gbuf if kda else pool.p, tok_new, idx, pool.num_slots, slot_stride(pool.num_heads), H=pool.num_heads,
        IS_KDA=kda, num_warps=WARPS, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))


def check(gate: str, dev) -> str:
    """The probe's checkpoint by the SPEC criterion (8 rows x 32 heads of every family): the state it encodes is
    rebuilt from the case's window, the new tokens are the reference's (its compression from the case's q0), and the
    decoded checkpoint is judged against the exact state as every flush is (leapquant.criterion)."""
    import torch
    from leapquant import families
    from leapquant.layout import Pool
    case = families.make_case(8, 32, gate, seed=3)
    _, _, _, u, q = case.reference()
    pool = Pool(10, 32, device=dev, gate=gate)
    slots = torch.arange(1, 9)
    case.to(dev).load_into(pool, slots)
    launch(pool, slots.to(dev, torch.int32), torch.cat([u, q], dim=-1).to(dev).contiguous())
    torch.cuda.synchronize()
    v = case.judge(pool.read_checkpoint(slots.to(dev)), name=f"P1 {gate}")
    return f"{gate}: {'PASS' if v.passed else 'FAIL'}, worst head {v.worst_score:.4f} of its bound :: {v.message}"


def probe_args(batches: list[int]) -> argparse.Namespace:
    """A probe's command line: ``static [--capability C] [--maxnreg N ...]`` or ``time [--batch B ...] [--repeats R]
    [--maxnreg N ...]`` (register caps, 0: none)."""
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("static")
    st.add_argument("--capability", type=int, default=90)
    tm = sub.add_parser("time")
    tm.add_argument("--batch", nargs="+", type=int, default=batches)
    tm.add_argument("--repeats", type=int, default=30)
    for p in (st, tm):
        p.add_argument("--maxnreg", type=int, nargs="*", default=[0])
    return ap.parse_args()


def time_mode(args, check, call_for, bound_us=None) -> None:
    """A probe's ``time`` mode on the GPU: ``check(gate, dev)`` first (a line each), then one table row per gate,
    register cap and batch, L2-cold (eight rotated slot sets), median of ``args.repeats``. ``call_for(pool, gate,
    batch, idx)`` gives the call of slot set s; ``bound_us(gate, batch)``, if given, a column of the bound."""
    import torch
    from leapquant.bench_common import _percentile, slot_sets, time_calls_kernel
    from leapquant.layout import Pool
    dev = torch.device("cuda")
    for gate in ("kda", "gdn"):
        print(check(gate, dev), flush=True)
    extra = (" a whole flush's bound us |", " --- |") if bound_us else ("", "")
    print(f"| gate | maxnreg | batch | us |{extra[0]}\n| --- | --- | --- | --- |{extra[1]}")
    for gate in ("kda", "gdn"):
        pool = Pool(8 * max(args.batch) + 1, 32, device=dev, gate=gate)
        for batch in args.batch:
            idx = [s.to(torch.int32) for s in slot_sets(8, batch, 0, dev)]
            call = call_for(pool, gate, batch, idx)
            for cap in args.maxnreg:
                samples, _ = time_calls_kernel(lambda s: call(s, cap or None), 8, args.repeats, dev)
                bound = f" {bound_us(gate, batch):.1f} |" if bound_us else ""
                print(f"| {gate} | {cap or 'none'} | {batch} | {_percentile(samples, 50):.1f} |{bound}", flush=True)
        pool = None  # noqa: F841
        torch.cuda.empty_cache()


def main() -> int:
    args = probe_args([64, 256, 512])
    if args.cmd == "static":
        print_static(compile_static, args.capability, args.maxnreg)
        return 0
    import torch
    from leapquant.bench_common import copy_bandwidth
    from leapquant.layout import due_program_bytes
    dev = torch.device("cuda")
    bw, _ = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    def call_for(pool, gate, batch, idx):
        g = torch.Generator(device=dev).manual_seed(0)
        tok = [(torch.randn(batch, 32, R, K + V, generator=g, device=dev) * 0.1).half() for _ in range(8)]
        return lambda s, cap: launch(pool, idx[s], tok[s], cap)
    time_mode(args, check, call_for, lambda gate, batch: batch * 32 * due_program_bytes(gate) / bw * 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
