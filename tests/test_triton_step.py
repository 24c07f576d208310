"""The Triton backend's decode step (leapquant.triton.step_kernel): on the CPU through the interpreter, on a GPU
with the compiled kernel (the same tests).

* Functional form: every step family, both gates, both beta modes, GDN with grouped key heads, and the step after
  each, judged by the SPEC section 7 criterion against the fp64 exact form (as tests/test_step_reference.py judges
  the reference).
* Deployment form on a noisy pool: only the stepped programs' entry h, w, pcum / p, hcnt and out change; padding
  rows (0, negative, >= num_slots) get zeros and write nothing; hcnt and the untouched weights match the reference
  backend byte for byte, the computed fields pass the criterion.
* The kernel compiles for an sm_90 GPU without one (a child process without the interpreter).
* On a GPU: the step and decode_inplace captured in a CUDA graph and replayed with new tokens match eager calls;
  neither synchronises with the host.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import leapquant as lq
from leapquant import dispatch, step_families as sf
from leapquant.layout import K, L, V
from helpers import fill_noise, snapshot

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

NS, H = 7, 4


# ---- the functional form, judged by the criterion -------------------------------------------------------------------
@pytest.mark.parametrize("beta_bf16", [True, False])
@pytest.mark.parametrize("gate,num_k_heads", [("kda", None), ("gdn", 4), ("gdn", 2)])
def test_functional_step_passes_on_every_family(gate, num_k_heads, beta_bf16):
    """3 x 8 programs covering every family, then the next step after each (a window one entry fuller)."""
    case = sf.make_step_case(3, 8, gate, seed=1, num_k_heads=num_k_heads).to(DEVICE)
    assert set(sf.STEP_FAMILIES) <= {lab for row in case.labels for lab in row}
    for c in (case, case.next_step(seed=2)):
        out = c.run(backend="triton", beta_bf16=beta_bf16)
        v = c.judge(out, beta_bf16=beta_bf16, name="triton")
        assert v.passed, v.message


def test_functional_step_matches_reference_on_exact_fields():
    """The fields no rounding touches agree with the reference bit for bit: KDA's w_new (w[h] = 1, the rest copied)."""
    case = sf.make_step_case(2, 8, "kda", seed=7).to(DEVICE)
    tri, ref = case.run(backend="triton"), case.run(backend="reference")
    assert torch.equal(tri[4], ref[4])


# ---- the deployment form on a noisy pool ------------------------------------------------------------------------------
def _clone(pool: lq.Pool) -> lq.Pool:
    bufs = {name: t.clone() for name, t in dict(raw=pool.raw, **pool.window_tensors()).items()}
    return lq.Pool(pool.num_slots, pool.num_heads, device=pool.device, gate=pool.gate, **bufs)


def _case_from_pool(pool: lq.Pool, slots: list[int], qkv, a, b, A_log, dt_bias, hk: int) -> sf.StepCase:
    """The functional-form inputs of the stepped rows, read from the pool before the step (for the criterion)."""
    n = len(slots)
    s = torch.tensor(slots, device=pool.device)
    codes, s_k, s_v, u, q = pool.read_checkpoint(slots)
    t = dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=pool.kbuf[s].clone(), ubuf=pool.ubuf[s].clone(),
             w=pool.w[s].clone(), h=pool.hcnt[s].clone(), qx=qkv[:, :hk * K].reshape(n, hk, K),
             kx=qkv[:, hk * K:2 * hk * K].reshape(n, hk, K), vx=qkv[:, 2 * hk * K:].reshape(n, H, V),
             a=a.clone(), b=b.clone(), A_log=A_log, dt_bias=dt_bias)
    if pool.gate == "kda":
        t.update(gbuf=pool.gbuf[s].clone(), pcum=pool.pcum[s].clone())
    else:
        t.update(p=pool.p[s].clone())
    labels = [[f"slot{x}"] * H for x in slots]
    return sf.StepCase(pool.gate, t, labels, None, {})


def _read_entries(pool: lq.Pool, out_rows: torch.Tensor, slots: list[int], h: torch.Tensor) -> tuple:
    """The stepped programs' outputs as the functional form returns them (o, k_row, u_row, [g_row], w, pcum / p)."""
    s = torch.tensor(slots, device=pool.device).unsqueeze(1).expand(len(slots), H)
    hd = torch.arange(H, device=pool.device).unsqueeze(0).expand(len(slots), H)
    head = (out_rows, pool.kbuf[s, hd, h], pool.ubuf[s, hd, h])
    if pool.gate == "kda":
        return head + (pool.gbuf[s, hd, h], pool.w[slots], pool.pcum[slots])
    return head + (pool.w[slots], pool.p[slots])


@pytest.mark.parametrize("beta_bf16", [True, False])
@pytest.mark.parametrize("gate,hk", [("kda", H), ("gdn", H), ("gdn", 2), ("gdn", 1)])
def test_deployment_footprint(gate, hk, beta_bf16):
    seed = 11 + hk
    pool = lq.Pool(NS, H, gate=gate, device=DEVICE)
    fill_noise(pool, seed=seed)                       # noise everywhere: a stray write shows in a byte comparison
    sf.make_step_case(3, H, gate, seed=seed, num_k_heads=hk).load_into(pool, [2, 3, 5])
    ref_pool = _clone(pool)
    before = snapshot(pool)
    g = torch.Generator().manual_seed(seed)
    # rows: slots 3, pad 0, 2, 5, pad -1, 6 (noise), NS and NS + 100 (out of range: skipped, as under capture)
    idx = torch.tensor([3, 0, 2, 5, -1, 6, NS, NS + 100], dtype=torch.int32, device=DEVICE)
    N = idx.numel()
    width = 2 * hk * K + H * V
    # qkv, a, b as slices of wider rows (an engine's projection output)
    qkv = torch.randn(N, width + 24, generator=g).bfloat16()[:, 8:8 + width]
    a = (torch.randn(N, H + 1, K, generator=g).bfloat16()[:, :H] if gate == "kda"
         else torch.randn(N, H + 3, generator=g).bfloat16()[:, 2:2 + H])
    b = (2 * torch.randn(N, 2 * H, generator=g)).bfloat16()[:, H:]
    qkv, a, b = qkv.to(DEVICE), a.to(DEVICE), b.to(DEVICE)
    A_log, dt_bias = (x.to(DEVICE) for x in sf.head_constants(H, gate, g))
    stepped_rows, slots = [0, 2, 3, 5], [3, 2, 5, 6]
    case = _case_from_pool(pool, slots, qkv[stepped_rows], a[stepped_rows], b[stepped_rows], A_log, dt_bias, hk)
    hc = pool.hcnt[slots].clone()
    h = torch.where(hc == L, 0, hc).long()

    out = torch.full((N, H, V), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    ref_out = out.clone()
    dispatch.get_backend("triton").step(pool, idx, qkv, a, b, A_log, dt_bias, out, hk, beta_bf16)
    dispatch.get_backend("reference").step(ref_pool, idx, qkv, a, b, A_log, dt_bias, ref_out, hk, beta_bf16)

    # the checkpoints are only read; padding rows are zero
    assert torch.equal(pool.raw.cpu().view(torch.int32), before["raw"].view(torch.int32)), "the step wrote into raw"
    assert not bool(out[[1, 4, 6, 7]].any())
    # the computed fields by the criterion
    v = case.judge(_read_entries(pool, out[stepped_rows], slots, h), beta_bf16=beta_bf16, name="triton")
    assert v.passed, v.message
    # the fill counts (and KDA's weights, GDN's weights at and past h) byte for byte as the reference backend's
    assert torch.equal(pool.hcnt, ref_pool.hcnt)
    if gate == "kda":
        assert torch.equal(pool.w.view(torch.int32), ref_pool.w.view(torch.int32))
    else:
        past = torch.arange(L, device=DEVICE) >= h.unsqueeze(-1)
        assert torch.equal(pool.w[slots][past].view(torch.int32), ref_pool.w[slots][past].view(torch.int32))
    # nothing else moved: with the stepped entries put back to their old bytes, every window tensor is as before
    s = torch.tensor(slots).unsqueeze(1).expand(len(slots), H)
    hd = torch.arange(H).unsqueeze(0).expand(len(slots), H)
    h = h.cpu()
    for name, t in pool.window_tensors().items():
        old = before[name].view(t.dtype).view(t.shape)
        now = t.cpu().clone()
        if name in ("kbuf", "ubuf", "gbuf"):
            now[s, hd, h] = old[s, hd, h]
        elif name in ("w", "pcum", "p", "hcnt"):
            now[slots] = old[slots]
        assert torch.equal(now.contiguous().view(torch.uint8), before[name]), name


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_stale_window_entries_never_reach_the_outputs(gate, backend):
    """Window entries past the fill count (j >= h: stale, left by earlier windows) never reach a sum: the kernels do
    not read their keys, decay factors or ubuf rows, and the Gluon kernel reads their weights (the 16 weights whole)
    and selects them away. With them NaN / inf (kbuf, ubuf, w, KDA gbuf) the step writes exactly the bytes it writes
    with them finite, and leaves the stale entries past h as they were."""
    hk = H if gate == "kda" else 2
    runs = []
    for poison in (False, True):
        pool = lq.Pool(NS, H, gate=gate, device=DEVICE)
        fill_noise(pool, seed=5)
        sf.make_step_case(3, H, gate, seed=5, num_k_heads=hk).load_into(pool, [2, 3, 5])
        slots = torch.tensor([2, 3, 5])
        hc = pool.hcnt[slots].cpu()
        h = torch.where(hc == L, 0, hc).long()
        stale = torch.arange(L).view(1, 1, L) >= h.unsqueeze(-1)          # [3, H, L]
        if poison:
            bad = torch.tensor([float("nan"), float("inf"), -float("inf")])
            for name in ("kbuf", "ubuf", "w") + (("gbuf",) if gate == "kda" else ()):
                t = getattr(pool, name)
                vals = t[slots.to(DEVICE)].cpu()
                fill = bad[torch.arange(vals.numel()) % 3].view(vals.shape).to(vals.dtype)
                mask = stale.view(stale.shape + (1,) * (vals.dim() - 3)).expand_as(vals)
                t[slots.to(DEVICE)] = torch.where(mask, fill, vals).to(DEVICE)
        g = torch.Generator().manual_seed(9)
        N = 3
        qkv = torch.randn(N, 2 * hk * K + H * V, generator=g).bfloat16().to(DEVICE)
        a = (torch.randn(N, H, K, generator=g) if gate == "kda" else torch.randn(N, H, generator=g)).bfloat16()
        b = torch.randn(N, H, generator=g).bfloat16().to(DEVICE)
        A_log, dt_bias = (x.to(DEVICE) for x in sf.head_constants(H, gate, g))
        out = torch.full((N, H, V), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        idx = slots.to(DEVICE, torch.int32)
        dispatch.get_backend(backend).step(pool, idx, qkv, a.to(DEVICE), b, A_log, dt_bias, out, hk, True)
        runs.append((pool, out, stale, h))
    (clean, out0, stale, h), (dirty, out1, _, _) = runs
    assert torch.equal(out0.view(torch.int16), out1.view(torch.int16)), "stale entries changed the output"
    s = torch.tensor([2, 3, 5])
    past = stale.clone()
    past[torch.arange(3).unsqueeze(1), torch.arange(H).unsqueeze(0), h] = False        # entry h is written
    for name, t in clean.window_tensors().items():
        a0, a1 = t[s.to(DEVICE)].cpu(), getattr(dirty, name)[s.to(DEVICE)].cpu()
        if t.dim() >= 3 and t.shape[2] == L:                                # entries: compare all but the stale ones
            keep = ~past.view(past.shape + (1,) * (a0.dim() - 3)).expand_as(a0)
            a0, a1 = a0[keep], a1[keep]
        bits = torch.int32 if a0.element_size() == 4 else torch.int16
        assert torch.equal(a0.contiguous().view(bits), a1.contiguous().view(bits)), name
    for name in ("kbuf", "ubuf", "w") + (("gbuf",) if gate == "kda" else ()):   # the stale entries past h untouched
        t = getattr(dirty, name)[s.to(DEVICE)].cpu()
        mask = past.view(past.shape + (1,) * (t.dim() - 3)).expand_as(t)
        assert not bool(torch.isfinite(t[mask].float()).any()), f"{name}: a stale entry past h was written"


def test_empty_idx_launches_nothing():
    pool = lq.Pool(3, H, gate="kda")
    fill_noise(pool, seed=1)
    before = snapshot(pool)
    idx = torch.zeros(0, dtype=torch.int32)
    qkv = torch.zeros(0, 2 * H * K + H * V, dtype=torch.bfloat16)
    a, b = torch.zeros(0, H, K, dtype=torch.bfloat16), torch.zeros(0, H, dtype=torch.bfloat16)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H, K)
    out = torch.zeros(0, H, V, dtype=torch.bfloat16)
    dispatch.get_backend("triton").step(pool, idx, qkv, a, b, A_log, dt_bias, out, H, True)
    after = snapshot(pool)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_decode_inplace_raises_before_the_step_when_the_flush_cannot_launch(monkeypatch):
    """decode_inplace readies the flush (workspace, compiled kernel, bound launch) before its step writes: a flush that
    cannot launch (here its binding fails, as a compile error or a capture without warmup would) raises with the
    pool byte for byte as it was, instead of after a step that filled windows nobody then folds."""
    from leapquant.triton import launch
    pool = lq.Pool(NS, H, gate="kda", device=DEVICE)
    fill_noise(pool, seed=3)
    with torch.no_grad():
        pool.hcnt[2] = L - 1                       # this token fills slot 2's windows: the flush is due
    before = snapshot(pool)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, 2 * H * K + H * V, generator=g).bfloat16().to(DEVICE)
    a = torch.randn(1, H, K, generator=g).bfloat16().to(DEVICE)
    b = torch.randn(1, H, generator=g).bfloat16().to(DEVICE)
    A_log, dt_bias = (t.to(DEVICE) for t in sf.head_constants(H, "kda", g))

    def no_binding(*args, **kwargs):
        raise RuntimeError("no kernel for this pool")
    monkeypatch.setattr(launch, "_bind", no_binding)
    with pytest.raises(RuntimeError, match="no kernel for this pool"):
        lq.decode_inplace(pool, torch.tensor([2], dtype=torch.int32, device=DEVICE), qkv, a, b, A_log, dt_bias,
                          lq.default_q0(DEVICE), backend="triton")
    after = snapshot(pool)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"the step wrote {changed} before the flush failed"


# the step kernels' signature for an ahead-of-time compile (both kernels; the portable one adds BV)
_SIGNATURE = r"""
sig = {"raw_f32": "*fp32", "raw_u8": "*u8", "raw_f16": "*fp16", "kbuf_ptr": "*bf16", "ubuf_ptr": "*bf16",
       "w_ptr": "*fp32", "gate_ptr": "*fp32", "gbuf_ptr": "*fp16" if kda else "*fp32", "hcnt_ptr": "*i32",
       "idx_ptr": "*i32", "qkv_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "A_log_ptr": "*fp32",
       "dt_ptr": "*fp32", "out_ptr": "*bf16", "num_slots": "i32", "SS": "i32", "qkv_stride": "i32",
       "a_stride": "i32", "b_stride": "i32", "H": "constexpr", "HK": "constexpr", "IS_KDA": "constexpr",
       "BETA_BF16": "constexpr"}
"""


# ---- ahead-of-time compile for a GPU ---------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from leapquant.triton import step_kernel
gate = sys.argv[1]
kda = gate == "kda"
""" + _SIGNATURE + r"""
sig["BV"] = "constexpr"
names = list(sig)
assert names == list(step_kernel.step_kernel.arg_names), step_kernel.step_kernel.arg_names
const = {"H": 32, "HK": 32 if kda else 16, "IS_KDA": kda, "BETA_BF16": True, "BV": step_kernel.BV}
aligned = [i for i, n in enumerate(names) if sig[n].startswith("*")]
src = ASTSource(fn=step_kernel.step_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=step_kernel.WARPS, num_stages=1))
ptx = k.asm["ptx"]
# register use and spills from the ptxas Triton ships (its verbose report); absent ptxas: not reported
import os, re, subprocess, tempfile
import triton.backends.nvidia as nv
ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
regs = spills = None
if os.path.exists(ptxas):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        rep = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    m = re.search(r"Used (\d+) registers", rep)
    regs = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", rep)
    spills = int(m.group(1)) + int(m.group(2)) if m else None
print(json.dumps({"ok": "cubin" in k.asm, "shared": k.metadata.shared, "regs": regs, "spill_bytes": spills}))
"""


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_compiles_for_sm90(gate):
    """The kernel builds for sm_90 ahead of time (no GPU here): Triton's compiler down to PTX, without the
    interpreter; where Triton ships ptxas, its register report shows no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, gate], capture_output=True, text=True, timeout=600, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("no ptxas: " + res.stderr[-300:])
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["ok"], info
    # measured with triton 3.6's ptxas (sm_90a, 4 warps, BV 32): KDA 125 registers, GDN 123, no spills
    assert info["spill_bytes"] in (None, 0), info
    print(f"step kernel {gate} sm_90: {info}")


# ---- on a GPU: CUDA-graph replay, no host synchronisation -------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", None])
@pytest.mark.parametrize("op", ["step", "decode"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_gpu_graph_replay_matches_eager_without_sync(gate, op, backend):
    """step_inplace / decode_inplace captured once in a CUDA graph and replayed for four tokens (fresh tokens copied
    into the captured buffers; windows filling and, for decode, flushing on the way) leave the pool and the outputs
    byte for byte as the same calls made eagerly on a copy of the pool, and the eager calls (after the first) never
    synchronise with the host."""
    hk = H if gate == "kda" else 2
    pool = lq.Pool(NS, H, gate=gate, device=DEVICE)
    fill_noise(pool, seed=3)
    sf.make_step_case(3, H, gate, seed=3, num_k_heads=hk).load_into(pool, [2, 3, 5])
    pool.hcnt[[2, 3, 5]] = torch.tensor([L - 2, L - 1, L], dtype=torch.int32, device=DEVICE).unsqueeze(1)
    eager_pool, warm_pool = _clone(pool), _clone(pool)
    idx = torch.tensor([3, -1, 2, 5, 0], dtype=torch.int32, device=DEVICE)
    N, width = idx.numel(), 2 * hk * K + H * V
    g = torch.Generator().manual_seed(5)
    A_log, dt_bias = (x.to(DEVICE) for x in sf.head_constants(H, gate, g))
    q0 = lq.default_q0(DEVICE)

    def token():
        a_shape = (N, H, K) if gate == "kda" else (N, H)
        return (torch.randn(N, width, generator=g).bfloat16().to(DEVICE),
                torch.randn(*a_shape, generator=g).bfloat16().to(DEVICE),
                (2 * torch.randn(N, H, generator=g)).bfloat16().to(DEVICE))

    def call(p, qkv, a, b, out):
        if op == "step":
            lq.step_inplace(p, idx, qkv, a, b, A_log, dt_bias, out, num_k_heads=hk, backend=backend)
        else:
            lq.decode_inplace(p, idx, qkv, a, b, A_log, dt_bias, q0, out, num_k_heads=hk, backend=backend)

    static = token() + (torch.empty(N, H, V, dtype=torch.bfloat16, device=DEVICE),)
    eager_out = torch.empty_like(static[3])
    for p in (warm_pool, pool, eager_pool):                 # binds each pool's buffers to the flush, outside capture
        lq.warmup(p, backend=backend)
    call(warm_pool, *static)                               # compiles and binds every kernel, eagerly
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call(pool, *static)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for t in range(4):
        tok = token()
        for dst, src in zip(static, tok):
            dst.copy_(src)
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(eager_pool, *tok, eager_out)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert torch.equal(static[3].view(torch.int16), eager_out.view(torch.int16)), f"token {t}: out differs"
        assert not bool(static[3][[1, 4]].any()), "padding rows must be zero"
    replayed, eager = snapshot(pool), snapshot(eager_pool)
    for name in replayed:
        assert torch.equal(replayed[name], eager[name]), f"{name} differs between the replayed graph and eager calls"
    # slot 2 started at L - 2: L - 1, L (full), then read as empty: 1, 2
    assert bool((pool.hcnt[2] == 2).all())


@needs_cuda
@pytest.mark.parametrize("beta_bf16", [True, False])
def test_gluon_beta_on_every_bf16_value(beta_bf16):
    """The Gluon step kernel's beta (fp32 where that is exact enough, fp64 near bf16 rounding midpoints and for
    |b| > 8) over all 65,280 finite bf16 values of b against sigmoid in fp64: rounded to bf16 it is the exact value's
    rounding for every b; unrounded (vLLM's fp32 beta) it is within 2^-19 of it (of 2^-149 below fp32's
    normal range)."""
    from leapquant.triton import launch
    if launch.mma_reasons(DEVICE):
        pytest.skip("; ".join(launch.mma_reasons(DEVICE)))
    from gluon_probes import beta_probe
    b = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    b = b[torch.isfinite(b.float())]
    out = torch.full(b.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    beta_probe[(b.numel(),)](b.to(DEVICE), out, BETA_BF16=beta_bf16, num_warps=1)
    got = out.cpu().double()
    exact = torch.sigmoid(b.double())
    if beta_bf16:
        want = exact.to(torch.bfloat16).double()
        bad = got != want
        assert not bool(bad.any()), (f"{int(bad.sum())} of {b.numel()} values round differently, e.g. b = "
                                     f"{b[bad][:4].tolist()}: {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}")
    else:
        # within 2^-19 of the exact value, or of fp32's subnormal spacing where the value is below fp32's normals
        excess = (got - exact).abs() / torch.maximum(exact * 2.0 ** -19, torch.full_like(exact, 2.0 ** -149))
        worst = int(excess.argmax())
        assert float(excess[worst]) <= 1, f"b = {float(b[worst])}: {float(got[worst])!r} vs {float(exact[worst])!r}"


@needs_cuda
def test_gluon_digits_rebuild_every_value():
    """Phase (4)'s split of xk and xq into int8 digits (gluon_step_kernel._digits) on K-vectors of every magnitude
    (normal, tiny, subnormal, all zero, one nonzero channel, signs mixed, values on the unit's grid): every digit in
    [-64, 64], the unit a power of two with max |x| / unit in [2^26, 2^27) where max |x| >= 2^-123, and
    (d0 2^21 + d1 2^14 + d2 2^7 + d3) unit within half a unit of every x, exactly x where x is a multiple of the unit;
    a NaN or an infinity makes the unit NaN."""
    from leapquant.triton import launch
    if launch.mma_reasons(DEVICE):
        pytest.skip("; ".join(launch.mma_reasons(DEVICE)))
    from gluon_probes import digits_probe
    from leapquant.triton.gluon_step_kernel import WARPS
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, K, generator=g, dtype=torch.float64)
    scales = [2.0 ** e for e in (-140, -130, -126, -123, -100, -30, -1, 0, 1, 30, 100, 120)]
    rows = [base[i] * scales[i % len(scales)] for i in range(base.shape[0])]
    grid = torch.randint(-2 ** 23, 2 ** 23, (K,), generator=g, dtype=torch.int64) * 8   # exact in fp32
    grid[0] = 2 ** 26                                                # the maximum, 64, sets the unit: 2^-20
    rows += [torch.zeros(K, dtype=torch.float64), torch.eye(K, dtype=torch.float64)[5] * -3.0,
             torch.linspace(-1, 1, K, dtype=torch.float64) * 2.0 ** -149, grid.double() * 2.0 ** -20]
    on_grid = len(rows) - 1
    x = torch.stack(rows).float()
    assert bool(torch.isfinite(x).all()) and float(x[on_grid].double().sub(rows[-1]).abs().max()) == 0
    bad = torch.stack([x[7].clone(), x[7].clone()])
    bad[0, 3], bad[1, 9] = float("nan"), float("-inf")
    x = torch.cat([x, bad])
    digits = torch.full((x.shape[0], 4, K), 99, dtype=torch.int8, device=DEVICE)
    unit = torch.full((x.shape[0],), 1.0, dtype=torch.float32, device=DEVICE)
    digits_probe[(x.shape[0],)](x.to(DEVICE), digits, unit, num_warps=WARPS)
    d, u, xd = digits.cpu().long()[:-2], unit.cpu().double(), x.double()[:-2]
    assert bool(torch.isnan(u[-2:]).all()), u[-2:]
    u = u[:-2]
    assert int(d.abs().max()) <= 64, int(d.abs().max())
    assert bool((u > 0).all()) and bool((torch.frexp(u)[0] == 0.5).all()), u
    top = xd.abs().amax(1)
    normal = top >= 2.0 ** -123
    ratio = top[normal] / u[normal]
    assert bool(((ratio >= 2.0 ** 26) & (ratio < 2.0 ** 27)).all()), ratio
    n = d[:, 0] * 2 ** 21 + d[:, 1] * 2 ** 14 + d[:, 2] * 2 ** 7 + d[:, 3]
    err = (n.double() * u[:, None] - xd).abs() / u[:, None]
    worst = divmod(int(err.argmax()), K)
    assert float(err.max()) <= 0.5, f"row {worst[0]} channel {worst[1]}: {float(err.max())} units"
    assert float(u[on_grid]) == 2.0 ** -20 and bool((err[on_grid] == 0).all()), "values on the unit's grid"


# ---- the Gluon step kernel: builds for every target on the CPU (triton 3.6; CI runs these with it) ----------------
_GLUON_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from leapquant.triton import gluon_step_kernel as m
cap, gate = int(sys.argv[1]), sys.argv[2]
kda = gate == "kda"
""" + _SIGNATURE + r"""
names = list(sig)
assert names == list(m.step_kernel.arg_names), m.step_kernel.arg_names
const = {"H": 32, "HK": 32 if kda else 16, "IS_KDA": kda, "BETA_BF16": True}
aligned = [i for i, n in enumerate(names) if (sig[n].startswith("*") and n != "idx_ptr") or n == "qkv_stride"]
src = GluonASTSource(fn=m.step_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                     attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
k = triton.compile(src, target=GPUTarget("cuda", cap, 32),
                   options=dict(num_warps=m.WARPS, num_stages=1, maxnreg=m.MAX_REGISTERS[gate]))
sass = k.asm["sass"]
print(len(k.asm["cubin"]), sass.count("LDGSTS"), sass.count("LDL") + sass.count("STL"))
"""


#: local-memory instructions the kernel holds as the launch builds it (2 warps, both gates under
#: gluon_step_kernel.MAX_REGISTERS' cap of 112; triton 3.6's ptxas), per gate and target: KDA 24 / 8 / 22 on sm_80 /
#: sm_90 / sm_100 (142 registers on sm_90 uncapped, 7 programs per SM; the cap gives the 9 the H200's timings were
#: taken with), GDN none
STEP_SPILL_BUDGET = {"kda": {80: 24, 90: 8, 100: 22}, "gdn": {80: 0, 90: 0, 100: 0}}


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("capability", [80, 90, 100])
def test_gluon_step_kernel_compiles(capability, gate):
    """The Gluon step kernel lowered and assembled for sm_80 / sm_90 / sm_100 without a GPU (a child process, as the
    flush's Gluon kernel in tests/test_triton.py), as the launch builds it (its register cap, a qkv row stride of a
    multiple of 16): its codes arrive by cp.async (LDGSTS), and its local-memory traffic stays within
    :data:`STEP_SPILL_BUDGET`."""
    from test_triton import _gluon_child
    run = _gluon_child(_GLUON_COMPILE, str(capability), gate)
    cubin, ldgsts, spills = map(int, run.stdout.split())
    assert cubin > 0 and ldgsts > 0, f"sm_{capability}: no cp.async copies"
    assert spills <= STEP_SPILL_BUDGET[gate][capability], f"sm_{capability}: {spills} local-memory accesses"


