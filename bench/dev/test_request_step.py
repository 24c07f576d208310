"""Tests of bench/dev/request_step.py on a CPU (the reference backend): the module answers the calls the step
request's benchmark makes of an ``--impl`` module, with the attributes its timing fills and the outputs its
correctness check reads (the shipped suite, tests/, does not import the dev tools)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import leapquant
from leapquant.layout import K, L, R, V

MODULE = Path(__file__).resolve().parent / "request_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("request_step_impl", MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmarks_timing_calls():
    """As the benchmark's timing: a pool of NSETS * bs + 8 slots, its raw, uq and window filled with noise, the
    fill counts set to 1, then step_inplace of one slot set: the output is written and entry 1 appended."""
    mod = _load()
    bs, H = 2, mod.HEADS
    pool = mod.Pool(8 * bs + 8, "cpu")
    pool.raw.normal_(0, 0.1)
    pool.uq.normal_(0, 0.1)
    pool.kbuf.copy_(torch.randn(pool.kbuf.shape))
    pool.ubuf.copy_(torch.randn(pool.ubuf.shape))
    pool.w.uniform_(0, 1)
    assert pool.uq.data_ptr() == pool.tokens.data_ptr() and pool.uq.shape[-2:] == (R, K + V)
    g = torch.Generator().manual_seed(0)
    idx = torch.arange(1, 1 + bs, dtype=torch.int32)
    mixed = torch.randn(bs, 2 * H * K + H * V, generator=g).to(torch.bfloat16)
    a = torch.randn(bs, H, K, generator=g).to(torch.bfloat16)
    b = (2 * torch.randn(bs, H, generator=g)).to(torch.bfloat16)
    A_log = torch.log(torch.rand(H, generator=g) * 1.5 + 0.5)
    dt_bias = torch.randn(H, K, generator=g) * 0.5 - 1.0
    o = torch.full((bs, H, V), float("nan"), dtype=torch.bfloat16)
    pool.hcnt.fill_(1)
    mod.step_inplace(pool, idx, mixed, a, b, A_log, dt_bias, o)
    assert bool(torch.isfinite(o.float()).all())
    assert bool((pool.hcnt[1:1 + bs] == 2).all()) and bool((pool.w[1:1 + bs, :, 1] == 1).all())


def test_the_benchmarks_correctness_call():
    """run(...) in the request's input order returns its six outputs: o, k_row, u_row, g_row, w_new, pcum_new."""
    mod = _load()
    B, H = 1, mod.HEADS
    g = torch.Generator().manual_seed(1)
    h = torch.randint(0, L, (B, H), generator=g, dtype=torch.int32)
    live = torch.arange(L) < h[..., None]
    inputs = (torch.randint(-127, 128, (B, H, V, K), generator=g, dtype=torch.int8),
              torch.rand(B, H, K, generator=g) * 0.2 + 0.05, torch.rand(B, H, V, generator=g) * 0.5 + 0.1,
              (0.5 * torch.randn(B, H, R, K, generator=g)).half(), (0.5 * torch.randn(B, H, R, V, generator=g)).half(),
              (0.1 * torch.randn(B, H, L, K, generator=g)).bfloat16(),
              (0.3 * torch.randn(B, H, L, V, generator=g)).bfloat16(),
              torch.where(live[..., None], torch.rand(B, H, L, K, generator=g) * 0.5 + 0.5,
                          torch.ones(B, H, L, K)).half(),
              live.float(), -torch.rand(B, H, K, generator=g) * 5, h,
              torch.randn(B, H, K, generator=g).bfloat16(), torch.randn(B, H, K, generator=g).bfloat16(),
              torch.randn(B, H, V, generator=g).bfloat16(), torch.randn(B, H, K, generator=g).bfloat16(),
              (2 * torch.randn(B, H, generator=g)).bfloat16(), torch.log(torch.rand(H, generator=g) * 1.5 + 0.5),
              torch.randn(H, K, generator=g) * 0.5 - 1.0)
    out = mod.run(*inputs)
    assert [tuple(t.shape) for t in out] == [(B, H, V), (B, H, K), (B, H, V), (B, H, K), (B, H, L), (B, H, K)]
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32,
                                      torch.float32]
    ours = leapquant.step(*inputs, backend="reference")
    assert all(torch.equal(x, y) for x, y in zip(out, ours))
