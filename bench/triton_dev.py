"""Development timing of the Triton flush on a GPU (L2-cold, CUDA graphs, CUDA events) with a correctness check by
the SPEC criterion in the same run.

    PYTHONPATH=. python bench/triton_dev.py [--batch 16 64 256 512] [--variants w8:a0 w8:a1] [--gate kda] [--out DIR]
    python bench/triton_dev.py --render bench/results/FILE.json       # the markdown table of an earlier run
    python bench/triton_dev.py --static [w8:a1 w8:a1:fma ...]           # CPU: sm_90 registers / SASS counts

Variants ``wN:aX[:rM][:fma]``: warps, alignment hints, register cap; ``fma`` runs the previous kernel (the rebuild as
fp32 FMAs, kept below as ``_flush_due_fma``) through the same launcher, for A/B timing against the shipped one.

Method (SPEC section 5): for each batch B a pool of 8 B + 1 slots holds eight disjoint slot sets; one CUDA graph per
set holds one deployment call; the graphs are replayed in rotation, so no call finds its data in L2. Launches are
queued behind a sleep kernel so the host never starves the GPU; CUDA events around each replay give the call's GPU
time (both kernels and the gap between them). Due fractions: all (hcnt = L everywhere), sixteenth (B/16 whole rows
due, as at steady state where all heads of a sequence fill together), none. The memory bound is due programs x
layout.due_program_bytes() over the device-to-device copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import leapquant as lq
from leapquant import criterion, families
from leapquant.layout import L, Pool, due_program_bytes

import leapquant.triton  # noqa: F401  (registers the backend)
fm = sys.modules["leapquant.triton.flush"]
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


# ---- the previous kernel (fp32 FMA rebuild), for A/B timing against the shipped one ----------------------------------
from leapquant.triton.flush import (_ALIGN, _CODES_BYTE, _EPS, _K, _L, _OFF, _QMAX, _R,  # noqa: E402,F401
                                    _REGION_WORDS, _SK_WORD, _SV_WORD, _TOK_HALF, _TOK_ROW, _V, _due_item,
                                    _orthonormalize, _rint, _store_token, _sum4)


@triton.jit
def _flush_one_fma(raw_f32, raw_i8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, scratch,
                   slot, head, H, SS, IS_KDA: tl.constexpr, ALIGN: tl.constexpr):
    """The previous kernel's item (commit 94fd1f5, measured 1685 us at batch 256 all due): the rebuild as fp32
    broadcast FMAs on the CUDA cores (window keys staged through the first L x K words of scratch), the rest as the
    shipped kernel. Kept here only for A/B timing (variant suffix ``:fma``)."""
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
    codes_p = raw_i8 + region * 4 + _CODES_BYTE + rv[:, None] * _K + rk[None, :]
    sk_p = raw_f32 + region + _SK_WORD + rk
    sv_p = raw_f32 + region + _SV_WORD + rv
    tok = raw_f16 + region * 2 + _TOK_HALF

    # ---- (1) rebuild: S = (q^T u + codes * s_k / 127 * s_v) * gate + sum_j w_j ubuf_j (outer) (kbuf_j * D_j) ----
    # (broadcast FMAs keep S in a blocked layout whose column sums stay inside each thread; a tl.dot here moved S
    #  to the MMA layout and made every later reduction dearer: measured 17 % slower, bench/notes/triton.md.
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
    S = codes.to(tl.float32) * col[None, :] * row[:, None]
    for r in tl.static_range(_R):
        u_old = tl.load(tok + r * _TOK_ROW + rk).to(tl.float32) * gate
        q_old = tl.load(tok + r * _TOK_ROW + _K + rv).to(tl.float32)
        S += q_old[:, None] * u_old[None, :]
    # the window's effective keys kbuf[j] * w[j] * D_j as one [L, K] tile (8 elements per thread, none replicated; D_j
    # an exclusive reverse product scan of gbuf), staged through this program's scratch rows: built in the 1-D key
    # layout of S's columns every thread would compute all 16 x 16 of its keys, 32 copies of the same work.
    # The barrier before the stores keeps the previous item's readers ahead (its later reductions already are); the
    # one after publishes the rows to every warp (bar.sync orders global memory within the block).
    rl = tl.arange(0, _L)
    keys = tl.load(kb + rl[:, None] * _K + rk[None, :]).to(tl.float32) * tl.load(wp + rl)[:, None]
    if IS_KDA:
        g_next = tl.load(gb + (rl[:, None] + 1) * _K + rk[None, :], mask=rl[:, None] + 1 < _L, other=1.0)
        keys = keys * tl.cumprod(g_next.to(tl.float32), 0, reverse=True)      # D_j = prod_{i > j} gbuf[i]
    tl.debug_barrier()
    tl.store(scratch + rl[:, None] * _K + rk[None, :], keys)
    tl.debug_barrier()
    for j in tl.static_range(_L):
        S += tl.load(ub + j * _V + rv).to(tl.float32)[:, None] * tl.load(scratch + j * _K + rk)[None, :]

    # ---- (2) one subspace iteration from q0: P = orth(S^T q0) [K, R], Q = orth(S P) [V, R], U = S^T Q [K, R] ----
    # (q0's columns are re-read per item from L1/L2: held across the item loop they cost 4 row vectors of registers)
    q0c0 = tl.load(q0_ptr + rv * _R + 0)
    q0c1 = tl.load(q0_ptr + rv * _R + 1)
    q0c2 = tl.load(q0_ptr + rv * _R + 2)
    q0c3 = tl.load(q0_ptr + rv * _R + 3)
    p0, p1, p2, p3 = _sum4(S * q0c0[:, None], S * q0c1[:, None], S * q0c2[:, None], S * q0c3[:, None], 0)
    p0, p1, p2, p3 = _orthonormalize(p0, p1, p2, p3)
    c0, c1, c2, c3 = _sum4(S * p0[None, :], S * p1[None, :], S * p2[None, :], S * p3[None, :], 1)
    c0, c1, c2, c3 = _orthonormalize(c0, c1, c2, c3)
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
    y = _rint(x * (_QMAX / s_v)[:, None])
    tl.store(codes_p, y.to(tl.int8))

    # ---- (7) window reset (hcnt stays L: "flushed, empty") ----
    tl.store(wp + tl.arange(0, _L), tl.zeros([_L], tl.float32))
    if IS_KDA:
        tl.store(gp + rk, tl.zeros([_K], tl.float32))
        rl = tl.arange(0, _L)
        tl.store(gb + rl[:, None] * _K + rk[None, :], tl.full([_L, _K], 1.0, tl.float16))
    else:
        tl.store(gate_ptr + prog, 1.0)


@triton.jit(do_not_specialize=["num_chunks", "H", "SS"], do_not_specialize_on_alignment=["q0_ptr"])
def _flush_due_fma(raw_f32, raw_i8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, scratch_ptr,
               due_ptr, count_ptr,
               num_chunks, H, SS, IS_KDA: tl.constexpr, CHUNK: tl.constexpr,
               MAX_CHUNKS: tl.constexpr, ALIGN: tl.constexpr):
    """The previous kernel's persistent loop (same arguments as leapquant.triton.flush._flush_due), calling
    _flush_one_fma; scratch rows per program at the stride the shipped launcher allocates (V x K words)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    scratch = scratch_ptr + pid * (_V * _K)
    ch = tl.arange(0, MAX_CHUNKS)
    n_c = tl.load(count_ptr + ch, mask=ch < num_chunks, other=0)
    ends = tl.cumsum(n_c, 0)                       # items in chunks 0..c
    starts = ends - n_c
    total = tl.sum(n_c, 0)
    t = pid
    code = _due_item(due_ptr, ends, starts, ch, t, total, CHUNK)
    while t < total:                               # (a while loop: the interpreter cannot range over tensors)
        t_next = t + G
        code_next = _due_item(due_ptr, ends, starts, ch, t_next, total, CHUNK)   # in flight during this item
        _flush_one_fma(raw_f32, raw_i8, raw_f16, kbuf_ptr, ubuf_ptr, w_ptr, gate_ptr, gbuf_ptr, q0_ptr, scratch,
                       code // H, code % H, H, SS, IS_KDA, ALIGN)
        code = code_next
        t = t_next

SHIPPED = fm._flush_due

SETS = 8                  #: disjoint slot sets flushed in rotation (L2-cold)
SLEEP_CYCLES = 20_000_000  #: ~10 ms at 2 GHz: the queue fills behind it



def parse_variant(variant: str) -> tuple[int, bool, int, bool]:
    """``wN:aX[:rM][:fma]`` -> (warps, alignment hints, register cap (0: none), previous FMA kernel)."""
    w_, a_, *rest = variant.split(":")
    cap = next((int(t[1:]) for t in rest if t.startswith("r")), 0)
    return int(w_[1:]), a_ == "a1", cap, "fma" in rest


def use_variant(variant: str) -> int:
    """Set the launcher's knobs (and kernel) for ``variant``; returns its warps."""
    warps, align, cap, old = parse_variant(variant)
    fm.FLUSH_WARPS, fm.ALIGN_HINTS, fm.MAX_REGISTERS = warps, align, cap
    fm._flush_due = _flush_due_fma if old else SHIPPED
    return warps


def static_counts(variant: str, gate: str = "kda") -> dict:
    """Compile the variant for sm_90 on this machine (no GPU): registers, stack, shared memory, SASS instruction
    count per thread and a few opcode counts, with Triton's bundled ptxas / cuobjdump (bench/notes/triton.md)."""
    import collections
    import re
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    warps, align, cap, old = parse_variant(variant)
    fn = _flush_due_fma if old else SHIPPED
    kda = gate == "kda"
    ptrs = dict(raw_f32="*fp32", raw_i8="*i8", raw_f16="*fp16", kbuf_ptr="*bf16", ubuf_ptr="*bf16", w_ptr="*fp32",
                gate_ptr="*fp32", gbuf_ptr="*fp16" if kda else "*fp32", q0_ptr="*fp32", scratch_ptr="*fp32",
                due_ptr="*i32", count_ptr="*i32")
    consts = dict(IS_KDA=kda, CHUNK=fm.CHUNK, MAX_CHUNKS=fm.MIN_CHUNKS, ALIGN=align)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):      # as launched: 16-byte pointers, q0 unspecialised, int scalars
        sig[name] = ptrs.get(name) or ("constexpr" if name in consts else "i32")
        if name in ptrs and name != "q0_ptr":
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = dict(num_warps=warps, num_stages=1, **({"maxnreg": cap} if cap else {}))
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{tools}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    count = collections.Counter(o.split(".")[0] for o in ops)
    return dict(variant=variant, gate=gate, instructions=len(ops), regs=int(re.search(r"REG:(\d+)", res).group(1)),
                stack=int(re.search(r"STACK:(\d+)", res).group(1)), smem=k.metadata.shared,
                **{op: count[op] for op in ("BAR", "SHFL", "LDS", "STS", "FFMA", "HGMMA", "LDL", "STL")})


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second: the benchmark CLI's measurement."""
    from leapquant.bench import copy_bandwidth as measure
    return measure(torch.device("cuda"))[0]


def fill(pool: Pool, g: torch.Generator) -> None:
    """Valid random checkpoints and windows (never zeros: they can hide unwritten outputs and run faster)."""
    dev = pool.device
    pool.codes.copy_(torch.randint(-127, 128, pool.codes.shape, dtype=torch.int8, device=dev))
    pool.s_k.uniform_(1e-3, 1.0)
    pool.s_v.uniform_(1e-3, 1.0)
    pool.tokens.copy_(0.1 * torch.randn(pool.tokens.shape, device=dev))
    pool.kbuf.copy_(torch.randn(pool.kbuf.shape, device=dev))
    pool.ubuf.copy_(torch.randn(pool.ubuf.shape, device=dev))
    pool.w.uniform_(0.0, 1.0)
    if pool.gate == "kda":
        pool.pcum.uniform_(-5.0, 0.0)
        pool.gbuf.copy_(torch.rand(pool.gbuf.shape, device=dev).clamp_min(1e-3))
    else:
        pool.p.uniform_(0.1, 1.0)


def set_due(pool: Pool, B: int, mode: str, g: torch.Generator) -> int:
    """hcnt for every slot set; returns due programs per call."""
    H = pool.num_heads
    if mode == "all":
        pool.hcnt.fill_(L)
        return B * H
    pool.hcnt.fill_(L - 1)
    if mode == "none":
        return 0
    rows = max(1, B // 16)
    for s in range(SETS):
        pick = torch.randperm(B, generator=g)[:rows] + 1 + s * B
        pool.hcnt[pick.to(pool.device)] = L
    return rows * H


def time_point(pool: Pool, B: int, q0: torch.Tensor, reps: int) -> list[float]:
    """Median-able list of per-call GPU times (us) over `reps` rotations of the SETS graphs."""
    stream = torch.cuda.Stream()
    graphs = []
    idxs = [torch.arange(1 + s * B, 1 + (s + 1) * B, dtype=torch.int32, device="cuda")[torch.randperm(B).cuda()]
            for s in range(SETS)]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for s in range(SETS):
            lq.flush_inplace(pool, idxs[s], q0, backend="triton")   # warm (compiled already by warmup)
        torch.cuda.synchronize()
        for s in range(SETS):
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr, stream=stream):
                lq.flush_inplace(pool, idxs[s], q0, backend="triton")
            graphs.append(gr)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    out = []
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(SETS)]
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        for s in range(SETS):
            ev[s][0].record()
            graphs[s].replay()
            ev[s][1].record()
        torch.cuda.synchronize()
        out += [a.elapsed_time(b) * 1e3 for a, b in ev]
    return out


def check(batch: int, gate: str, seed: int) -> criterion.Verdict:
    case = families.make_case(batch, 32, gate, seed=seed).to("cuda")
    out = case.run(backend="triton")
    S = criterion.exact_state(*case.checkpoint(), case.tensors["kbuf"], case.tensors["ubuf"], case.tensors["w"],
                              **case.gate_kwargs())
    return criterion.judge(S, out, case.reference(), labels=case.labels, name=f"triton {gate} b{batch}")


def render(path: str) -> str:
    """The markdown table of a triton_dev.json written by an earlier run (results files are generated, not typed)."""
    with open(path) as f:
        d = json.load(f)
    env = d["env"]
    out = [f"{env['gpu']} ({env['sms']} SMs), copy {env['copy_bw_tbs']:.2f} TB/s, torch {env['torch']}, "
           f"triton {env['triton']}, commit {env['commit']}, {env['date']}", "",
           "| gate | variant | batch | due | due programs | median us | p20 | p80 | bound us | x bound | regs | "
           "spills | grid |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        variant = r.get("variant", f"w{r.get('warps')}")
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        out.append(f"| {r['gate']} | {variant} | {r['batch']} | {r['due']} | {r['due_programs']} | "
                   f"{r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} | {r['bound_us']:.1f} | {ratio} | "
                   f"{r['regs']} | {r['spills']} | {r['grid']} |")
    for v in d.get("verdicts", []):
        out.append(f"\n- criterion {v['gate']} batch {v['batch']}: {v['message']}")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(sys.argv[2]))
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "--static":          # CPU only: sm_90 static counts of each variant
        for v in sys.argv[2:] or ["w8:a1", "w8:a1:fma"]:
            for gate in ("kda", "gdn"):
                print(json.dumps(static_counts(v, gate)), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--variants", nargs="+", default=[f"w{fm.FLUSH_WARPS}:a{int(fm.ALIGN_HINTS)}"],
                    help="kernel variants warps:align-hints[:register cap][:fma], e.g. w8:a1 w8:a1:fma w8:a0:r128 "
                         "(fma: the previous kernel, fp32 FMA rebuild); the first at every batch")
    ap.add_argument("--variant-batch", nargs="+", type=int, default=[256], help="batches of the other variants")
    ap.add_argument("--gate", nargs="+", default=["kda"])
    ap.add_argument("--due", nargs="+", default=["all", "sixteenth", "none"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--check", nargs="*", type=int, default=[64, 256], help="batches judged by the criterion")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    # the device machine gets the working tree without .git: pass the hash in LEAPQUANT_COMMIT there
    commit = os.environ.get("LEAPQUANT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    env = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               triton=__import__("triton").__version__, commit=commit or "unknown", copy_bw_tbs=bw / 1e12,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(env), flush=True)
    rows = []
    for gate in a.gate:
        for vi, variant in enumerate(a.variants):
            use_variant(variant)
            fm._WORKSPACES.clear()
            for B in (a.batch if vi == 0 else a.variant_batch):
                pool = Pool(SETS * B + 1, 32, device="cuda", gate=gate)
                g = torch.Generator().manual_seed(B)
                fill(pool, g)
                q0 = lq.default_q0("cuda")
                lq.warmup(pool, backend="triton")
                ws = fm._WORKSPACES[pool]
                kern = fm._flush_due.warmup(*fm._flush_args(pool, ws, q0, 1), grid=(1,), **fm._flush_meta(pool, ws))
                info = dict(regs=kern.n_regs, spills=kern.n_spills, smem=kern.metadata.shared, grid=ws.programs)
                for mode in a.due:
                    due = set_due(pool, B, mode, g)
                    t = time_point(pool, B, q0, a.reps)
                    med = statistics.median(t)
                    q = statistics.quantiles(t, n=5)
                    bound = due * due_program_bytes(gate) / bw * 1e6
                    row = dict(gate=gate, variant=variant, batch=B, due=mode, due_programs=due, median_us=med,
                               p20_us=q[0], p80_us=q[-1], bound_us=bound, ratio=med / bound if bound else None,
                               **info)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del pool
                fm._WORKSPACES.clear()
                torch.cuda.empty_cache()
    use_variant(a.variants[0])                    # the criterion judges the first variant
    fm._WORKSPACES.clear()
    verdicts = []
    for gate in a.gate:
        for B in a.check:
            v = check(B, gate, seed=B)
            verdicts.append(dict(gate=gate, batch=B, passed=v.passed, worst_score=v.worst_score, message=v.message))
            print(v.message, flush=True)
    with open(os.path.join(a.out, "triton_dev.json"), "w") as f:
        json.dump(dict(env=env, rows=rows, verdicts=verdicts), f, indent=1)
    print(f"\n{env['gpu']}  copy {bw / 1e12:.2f} TB/s  torch {env['torch']}  triton {env['triton']}  {commit}")
    print("| gate | variant | batch | due | programs | median us | p20 | p80 | bound us | ratio | regs | spills | grid |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"| {r['gate']} | {r['variant']} | {r['batch']} | {r['due']} | {r['due_programs']} | {r['median_us']:.1f} "
              f"| {r['p20_us']:.1f} | {r['p80_us']:.1f} | {r['bound_us']:.1f} | {ratio} | {r['regs']} | {r['spills']} "
              f"| {r['grid']} |")
    for v in verdicts:
        print(f"criterion {v['gate']} b{v['batch']}: {'PASS' if v['passed'] else 'FAIL'} worst {v['worst_score']:.4f}")


if __name__ == "__main__":
    main()
