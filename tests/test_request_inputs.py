"""The flush request's own benchmark inputs, as a caller can produce them, through every backend.

The request's benchmark (Conless/kda, requests/conless-leapquant-kda-flush) feeds one structured checkpoint per batch:
full-rank codes with positive scales, a rank-4 part, one hot row and a full random window, with heads 1..8 as edge
cases. Heads 1, 2, 3 and 6 have zero codes and tokens under positive scales; head 2 also has no live window entry, so
its exact state is 0 and the criterion allows no error at all there. This module rebuilds that structure (our code,
the request's description) and judges every backend by the SPEC criterion, then the checkpoint the reference made
from it plus a new window (the request's "second window").
"""
from __future__ import annotations

import pytest
import torch

from leapquant import criterion, dispatch, reference
from leapquant.api import run
from leapquant.layout import K, L, QMAX, R, V, Pool

HAS_CUDA = torch.cuda.is_available()
HEADS = 32


def _window(b: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A full window: keys and values ~0.3 N(0, 1), weights 1, decay factors in [0.6, 1), pcum = their log-sum minus
    up to 0.5 (the decay the checkpoint saw before the window)."""
    kbuf = (0.3 * torch.randn(b, HEADS, L, K, generator=g)).to(torch.bfloat16)
    ubuf = (0.3 * torch.randn(b, HEADS, L, V, generator=g)).to(torch.bfloat16)
    w = torch.ones(b, HEADS, L)
    gbuf = (0.6 + 0.4 * torch.rand(b, HEADS, L, K, generator=g)).to(torch.float16)
    pcum = gbuf.float().log().sum(-2) - 0.5 * torch.rand(b, HEADS, K, generator=g)
    return kbuf, ubuf, gbuf, w, pcum


def structured(b: int, seed: int) -> list[torch.Tensor]:
    """The request's structured input (CPU): heads 1 rank-1 window only, 2 all zero, 3 rank-2 window, 4 tiny, 5 huge,
    6 rank 1 over a noise floor, 7 decayed by pcum -200, 8 a quarter of the channels never decaying."""
    g = torch.Generator().manual_seed(seed)
    codes = (40 * torch.randn(b, HEADS, V, K, generator=g)).round().clamp(-QMAX, QMAX).to(torch.int8)
    s_k = 0.05 + 0.2 * torch.rand(b, HEADS, K, generator=g)
    s_v = 0.1 + 0.5 * torch.rand(b, HEADS, V, generator=g)
    s_v[..., 5] *= 30                                             # a hot row
    u = (0.5 * torch.randn(b, HEADS, R, K, generator=g)).to(torch.float16)
    q = (0.5 * torch.randn(b, HEADS, R, V, generator=g)).to(torch.float16)
    kbuf, ubuf, gbuf, w, pcum = _window(b, g)
    for h in (1, 2, 3, 6):
        codes[:, h], u[:, h], q[:, h] = 0, 0, 0
    w[:, 1, 1:] = 0
    w[:, 2] = 0
    w[:, 3, 2:] = 0
    w[:, 6, 1:] = 0
    codes[:, 6] = (40 * torch.randn(b, V, K, generator=g)).round().clamp(-QMAX, QMAX).to(torch.int8)
    s_k[:, 6] *= 1e-6                                             # the noise floor under head 6's rank-1 window
    s_k[:, 4] *= 1e-4
    u[:, 4] *= 1e-2
    ubuf[:, 4] *= 1e-4
    s_k[:, 5] *= 3e2
    u[:, 5] *= 17
    ubuf[:, 5] *= 3e2
    pcum[:, 7] -= 200.0
    gbuf[:, 8, :, :32] = 1.0
    pcum[:, 8, :32] = 0.0
    q0 = torch.randn(V, R, generator=torch.Generator().manual_seed(0))
    return [codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0]


def _judge(inp: list[torch.Tensor], out, name: str) -> criterion.Verdict:
    codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0 = [t.cpu() for t in inp]
    S = criterion.exact_state(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum=pcum, gbuf=gbuf)
    ref = reference.compress(reference.rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum=pcum, gbuf=gbuf), q0)
    return criterion.judge(S, [o.cpu() for o in out], list(ref), name=name)


def _backends() -> list:
    out = [pytest.param("reference", 1)]
    for name in ("triton", "tilelang"):
        for b in (16, 64):
            out.append(pytest.param(name, b, marks=[pytest.mark.gpu, pytest.mark.skipif(
                not HAS_CUDA, reason="GPU backend at the request's batch sizes")]))
    return out


@pytest.mark.parametrize("backend, batch", _backends())
def test_request_structured_input(backend, batch):
    device = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    why = dispatch.reasons(backend, Pool(2, HEADS, device=device))
    if why:
        pytest.skip(f"{backend}: {'; '.join(why)}")
    first = [t.to(device) for t in structured(batch, seed=batch)]
    out = run(*first, backend=backend)
    v = _judge(first, out, backend)
    assert v.passed, v.message
    dec = reference.decode_checkpoint(*[o.cpu() for o in out])
    assert float(dec[:, 2].abs().max()) == 0.0, "head 2's state is exactly zero and must decode to zero"
    # the second window: the reference's own checkpoint of the first input, then a new full window
    ref_ck = reference.compress(reference.rebuild(*first[:5], *first[5:7], first[8], pcum=first[9], gbuf=first[7]),
                                first[10])
    kbuf, ubuf, gbuf, w, pcum = _window(batch, torch.Generator().manual_seed(batch + 1))
    second = [*ref_ck, *(t.to(device) for t in (kbuf, ubuf, gbuf, w, pcum)), first[10]]
    v = _judge(second, run(*second, backend=backend), backend)
    assert v.passed, v.message
