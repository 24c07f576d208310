"""The TileLang backend: its build for both targets (CPU, no GPU needed), its capability checks, and on a GPU its
output against the fp32 reference by the SPEC criterion and its deployment contract.

CPU part (CI): the kernel is lowered and compiled with nvcc for sm_90a and sm_100a (a break in the TileLang code fails
here), its clock-stamp builds trace, and ``reasons`` is checked on CPU pools and declined geometries. Skipped only
where nvcc or tilelang is absent.
GPU part (``gpu`` marker, skipped without CUDA): what is specific to this kernel beside the conformance suite
(tests/test_conformance.py runs every backend, TileLang included, through the families, the deployment sizes, other
head counts, the footprint at 8 heads, graph replay and the one-launch test): the hard families and the footprint
at its main geometry of 32 heads, slots out of range through its own launcher, and its ranking over several scan steps
and rounds.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import leapquant as lq
from leapquant import criterion, dispatch, families, reference
from leapquant.layout import L, Pool
from helpers import (assert_flush_footprint, judge_programs, noisy_pool, poison_due_checkpoints, program_inputs,
                     snapshot, written_programs)

tilelang = pytest.importorskip("tilelang")
from leapquant import tilelang as lq_tl  # noqa: E402  (registers the backend)
from leapquant.tilelang import clock as tl_clock  # noqa: E402
from leapquant.tilelang import config as tl_config  # noqa: E402
from leapquant.tilelang import kernel as tl_kernel  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_NVCC = shutil.which("nvcc") is not None
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc (the CUDA toolkit)")
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")


# ---- CPU: the kernel builds for both targets ---------------------------------------------------------------------
@needs_nvcc
@pytest.mark.parametrize("arch,sms,gate,heads,clock", [("sm_90a", 132, "kda", 32, None),
                                                       ("sm_100a", 148, "kda", 32, None),
                                                       ("sm_100a", 148, "gdn", 8, None),
                                                       ("sm_90a", 132, "kda", 32, "phases")])
def test_kernel_compiles_for_target(monkeypatch, arch, sms, gate, heads, clock):
    """Lower the kernel and compile it with nvcc for the target (TileLang's disk cache off, so nvcc really runs); one
    clock-stamp build too (the profiling builds are a generator option, kept building)."""
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")
    cfg = tl_config.FlushConfig(num_heads=heads, gate=gate, arch=arch, num_sms=sms, clock=clock)
    kern = tl_kernel.compile_flush(cfg)
    src = kern.get_kernel_source()
    assert "leapquant_flush" in src
    assert "__launch_bounds__(512" in src, "one CTA of 512 threads per SM is what the register budget assumes"
    assert tl_config.shared_bytes(cfg) <= 227 * 1024
    assert ("lq_mark(" in src) == (clock == "phases")


#: stamps each clock mode places (leapquant/tilelang/clock.py): "ctas" at the CTA's start, each group's loop end and
#: the CTA's end; "prologue" at the CTA's start, before the ranking, after three of its barriers, when it ends, and
#: per group at the first fetch, its staging, the barrier after it, a program's start and the loop's end
CLOCK_STAMPS = {"ctas": ("lq_cta_stamp", 3), "prologue": ("lq_pro_stamp", 1 + 1 + 3 + 1 + 5)}


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_clock_builds_trace(gate):
    """Every clock mode traces to a kernel with its stamps where clock.py says; the "phases" build stamps after every
    step of the program loop, one counter per named step; the shipped build has no stamp at all."""
    script = tl_kernel.make_flush_func(tl_config.FlushConfig(32, gate, "sm_90a", 132)).script()
    assert not any(name in script for name in ("lq_mark", "lq_cta_stamp", "lq_pro_stamp", "clock64"))
    cfg = tl_config.FlushConfig(32, gate, "sm_90a", 132, clock="phases")
    names = tl_kernel.clock_segments(cfg)
    assert names[:4] == ["load_codes", "barrier: codes loaded", "prefetch (next program, staging warps)", "rebuild"]
    assert names[-4:] == ["residual", "scales_k", "scales_v", "codes"] and len(set(names)) == len(names)
    assert tl_kernel.make_flush_func(cfg).script().count("lq_mark") == len(names)
    assert 2 * (len(names) + 1) <= tl_clock.CTA_WORD, "the counters and the CTA stamps share the pool's header"
    for mode, (helper, count) in CLOCK_STAMPS.items():
        script = tl_kernel.make_flush_func(tl_config.FlushConfig(32, gate, "sm_90a", 132, clock=mode)).script()
        assert script.count(helper) == count, (mode, script.count(helper))


def test_config_rejects_other_geometries():
    with pytest.raises(ValueError):
        tl_config.FlushConfig(num_heads=12, gate="kda", arch="sm_90a", num_sms=132)
    with pytest.raises(ValueError):
        tl_config.FlushConfig(num_heads=32, gate="mamba", arch="sm_90a", num_sms=132)
    with pytest.raises(ValueError):
        tl_config.FlushConfig(num_heads=32, gate="kda", arch="sm_90a", num_sms=132, clock="cycles")


# ---- the verifier -------------------------------------------------------------------------------------------------
def test_reasons_on_cpu_pool():
    why = lq_tl.reasons(Pool(2, 32, device="cpu", gate="kda"))
    assert any("CUDA" in w for w in why), why


def test_use_kernel_serves_a_variant_in_a_block_only():
    """The explicit hook for a kernel variant (bench/dev/tilelang_dev.py checks one through the public API with it):
    inside the block the geometry's flushes get the given kernel, afterwards the one served before (here: none)."""
    cfg = lq_tl.FlushConfig(32, "kda", "sm_90a", 132)
    variant = object()
    assert cfg not in lq_tl._KERNELS
    with lq_tl.use_kernel(cfg, variant):
        assert lq_tl._KERNELS[cfg] is variant
    assert cfg not in lq_tl._KERNELS


def test_reasons_decline_other_head_counts():
    for heads in (1, 4, 12, 24, 64):
        why = lq_tl.reasons(Pool(2, heads, device="cpu", gate="gdn"))
        assert any("num_heads" in w for w in why), (heads, why)


def test_reasons_report_tilelang_version(monkeypatch):
    lq_tl._tilelang_problem.cache_clear()
    monkeypatch.setattr(tilelang, "__version__", "0.1.99")
    try:
        why = lq_tl.reasons(Pool(2, 32, device="cpu"))
        assert any("0.1.12" in w for w in why), why
    finally:
        lq_tl._tilelang_problem.cache_clear()


def test_reasons_report_missing_nvcc(monkeypatch):
    lq_tl._nvcc_problem.cache_clear()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    import tilelang.contrib.nvcc as tl_nvcc
    monkeypatch.setattr(tl_nvcc, "get_nvcc_compiler", lambda: None, raising=False)
    try:
        why = lq_tl.reasons(Pool(2, 32, device="cpu"))
        assert any("nvcc" in w for w in why), why
    finally:
        lq_tl._nvcc_problem.cache_clear()


def test_registered_and_forced_backend_raises_on_cpu():
    assert dispatch.get_backend("tilelang") is not None
    pool = Pool(3, 32, device="cpu")
    with pytest.raises(lq.BackendUnavailable):
        lq.flush_inplace(pool, torch.tensor([1], dtype=torch.int32), lq.default_q0(), backend="tilelang")


# ---- GPU: the criterion ---------------------------------------------------------------------------------------------
def _skip_unless_served(heads: int = 32, gate: str = "kda") -> None:
    why = lq_tl.reasons(Pool(2, heads, device=DEVICE, gate=gate))
    if why:
        pytest.skip("tilelang cannot serve here: " + "; ".join(why))


_CHECK_DATA: dict = {}


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("family", ["tiny", "pcum_below_1000", "zero", "scaled_zero", "scaled_zero_window", "huge",
                                    "window_rank1", "window_rank2", "rank1_noise", "decayed"])
def test_gpu_hard_families(gate, family):
    """The tiny head (~1e-4: an fp16 residual fails there by 1.4-2 %), pcum < -1000, rank-deficient heads."""
    _skip_unless_served(32, gate)
    case = families.make_case(4, 32, gate, seed=7, families=[family]).to(DEVICE)
    out = case.run(backend="tilelang")
    v = case.judge(out, "tilelang")
    assert v.passed, v.message
    if family in ("zero", "scaled_zero"):
        assert float(reference.decode_checkpoint(*out).abs().max()) == 0.0


# ---- GPU: the deployment contract -----------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("heads", [32])
def test_gpu_footprint_and_poison(gate, heads):
    """At the kernel's main geometry, 32 heads (the conformance suite runs the same test at 8): due checkpoints
    poisoned (0x7f codes, zero scales and tokens) are all rewritten and pass the criterion; every other byte (non-due
    programs, slot 0, rows not in idx, spare regions, bytes past each checkpoint, hcnt) is untouched; the due windows
    are reset."""
    _skip_unless_served(heads, gate)
    pool, idx = noisy_pool(gate, heads, 5 + heads, DEVICE)
    slots, hs = written_programs(pool, idx)
    s, h = slots.to(DEVICE), hs.to(DEVICE)
    poison_due_checkpoints(pool, slots, hs)
    pool.s_k[4, 0] = float("nan")
    pool.s_v[0, 0] = float("nan")
    inputs = program_inputs(pool, slots, hs)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend="tilelang")
    torch.cuda.synchronize()
    assert_flush_footprint(pool, before, slots, hs)
    assert bool((pool.s_k[s, h] >= lq.EPS).all()) and bool((pool.s_v[s, h] >= lq.EPS).all())
    v = judge_programs(pool, slots, hs, inputs, lq.default_q0(DEVICE), "tilelang")
    assert v.passed, v.message


@gpu
@needs_cuda
def test_gpu_out_of_range_slots_are_skipped():
    """Slots outside [1, num_slots) (reachable under graph capture, where values are not checked) change nothing."""
    _skip_unless_served(8, "kda")
    pool, _ = noisy_pool("kda", 8, 9, DEVICE)
    pool.hcnt.fill_(L)
    before = snapshot(pool)
    bad = torch.tensor([0, -1, pool.num_slots, pool.num_slots + 100, -(2**31)], dtype=torch.int32, device=DEVICE)
    lq_tl.flush(pool, bad, lq.default_q0(DEVICE))
    torch.cuda.synchronize()
    assert_flush_footprint(pool, before, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


@gpu
@needs_cuda
@pytest.mark.parametrize("due", ["all", "some"])
def test_gpu_several_scan_steps_and_rounds(due):
    """600 rows x 32 heads: the ranking spans two scan steps of 512 rows, and with every program due (19200 > 132 CTAs
    x 128 list entries) two ranking rounds; every due program is flushed once and passes the criterion."""
    _skip_unless_served(32, "kda")
    from leapquant.bench import CheckData
    rows = 600
    data = _CHECK_DATA.get("kda")
    if data is None:
        data = _CHECK_DATA["kda"] = CheckData("kda", 32, 16, 0, DEVICE)
    t, exact, ref, labels = data.batch(rows)
    pool = Pool(rows + 3, 32, device=DEVICE, gate="kda")
    slots = torch.arange(2, rows + 2)
    pool.write_checkpoint(slots, t["codes"], t["s_k"], t["s_v"], t["u"], t["q"])
    pool.write_window(slots, t["kbuf"], t["ubuf"], t["w"], t["pcum"], t["gbuf"])
    g = torch.Generator().manual_seed(3)
    if due == "some":
        pool.hcnt[slots] = torch.where(torch.rand(rows, 32, generator=g) < 0.3, L, L - 1).to(DEVICE, torch.int32)
    idx = slots[torch.randperm(rows, generator=g)].to(DEVICE, torch.int32)
    due_mask = (pool.hcnt[slots] == L).cpu()
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend="tilelang")
    torch.cuda.synchronize()
    r, h = due_mask.nonzero(as_tuple=True)
    assert_flush_footprint(pool, before, slots[r], h)
    s_dev, h_dev = slots[r].to(DEVICE), h.to(DEVICE)
    tok = pool.tokens[s_dev, h_dev]
    out = tuple(x.unsqueeze(0) for x in (pool.codes[s_dev, h_dev], pool.s_k[s_dev, h_dev], pool.s_v[s_dev, h_dev],
                                         tok[..., :lq.K], tok[..., lq.K:]))
    r_dev, hh = r.to(DEVICE), h.to(DEVICE)
    v = criterion.judge(exact[r_dev, hh].unsqueeze(0), out, tuple(x[r_dev, hh].unsqueeze(0) for x in ref),
                        name="tilelang")
    assert v.passed, v.message
