"""The decode-step requests' own benchmark inputs, as a caller can produce them, through every backend that serves
the step.

The KDA step request's benchmark (Conless/kda, requests/conless-leapquant-kda-step) judges three inputs per batch: a
structured state (full-range codes under positive scales, a hot row, a partly filled window with decay histories in
[0.5, 1] and a cumulative log-gate consistent with it; heads 1-6 edge cases: an empty window over zero codes, an
all-zero state, a full window h = L - 1, tiny (1e-4) and huge (3e2) scales, a checkpoint decayed by pcum - 200), the
step after it (the first step's entry appended), and unstructured in-domain tensors (integer codes over the whole
int8 range, log-normal scales, unnormalised fp16 tokens and bf16 window rows, decay factors down to 1e-3, pcum down to
-20). The GDN request (requests/conless-leapquant-step) has the same three inputs with 16 key heads and a scalar gate.
This module rebuilds them (our code, the requests' description) and judges every backend by the SPEC section 7
criterion against the fp64 step.
"""
from __future__ import annotations

import pytest
import torch

from leapquant import dispatch
from leapquant.layout import K, L, QMAX, R, V, Pool
from leapquant.reference import default_q0
from leapquant.step_families import StepCase

HAS_CUDA = torch.cuda.is_available()
HEADS = 32


def _key_heads(gate: str) -> int:
    return HEADS if gate == "kda" else 16


def _token_and_gate(b: int, gate: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """This token: qx, kx per key head, vx per value head (bf16 N(0, 1)), the gate input a (KDA per channel), beta's
    input b ~ 2 N(0, 1), and the per-head constants (A = exp(A_log) in [0.5, 2), dt_bias ~ 0.5 N(0, 1) - 1)."""
    hk = _key_heads(gate)
    shape_a = (b, HEADS, K) if gate == "kda" else (b, HEADS)
    shape_dt = (HEADS, K) if gate == "kda" else (HEADS,)
    return dict(qx=torch.randn(b, hk, K, generator=g).to(torch.bfloat16),
                kx=torch.randn(b, hk, K, generator=g).to(torch.bfloat16),
                vx=torch.randn(b, HEADS, V, generator=g).to(torch.bfloat16),
                a=torch.randn(*shape_a, generator=g).to(torch.bfloat16),
                b=(2 * torch.randn(b, HEADS, generator=g)).to(torch.bfloat16),
                A_log=torch.log(0.5 + 1.5 * torch.rand(HEADS, generator=g)),
                dt_bias=0.5 * torch.randn(*shape_dt, generator=g) - 1.0)


def _gate_state(t: dict[str, torch.Tensor], gate: str, low: float, g: torch.Generator, drift: torch.Tensor) -> None:
    """Decay factors in [low, 1] on the live entries (1 past the fill count), w = 1 on the live entries, and the gate
    the checkpoint has seen: KDA pcum = the live factors' log-sum plus ``drift`` [b, H, K]; GDN p = exp of its mean."""
    b = t["codes"].shape[0]
    live = torch.arange(L) < t["h"].unsqueeze(-1)                                   # [b, H, L]
    t["w"] = live.float()
    factors = low + (1 - low) * torch.rand(b, HEADS, L, K, generator=g)
    gbuf = torch.where(live.unsqueeze(-1), factors, torch.ones_like(factors)).to(torch.float16)
    pcum = gbuf.float().log().sum(-2) + drift
    if gate == "kda":
        t["gbuf"], t["pcum"] = gbuf, pcum
    else:
        t["p"] = torch.exp(pcum.mean(-1))


def _case(gate: str, t: dict[str, torch.Tensor], label: str) -> StepCase:
    labels = [[label] * HEADS for _ in range(t["codes"].shape[0])]
    return StepCase(gate, t, labels, default_q0(torch.device("cpu")), {})


def structured(b: int, gate: str, seed: int) -> StepCase:
    g = torch.Generator().manual_seed(seed)
    t = dict(codes=(40 * torch.randn(b, HEADS, V, K, generator=g)).round().clamp(-QMAX, QMAX).to(torch.int8),
             s_k=0.05 + 0.2 * torch.rand(b, HEADS, K, generator=g),
             s_v=0.1 + 0.5 * torch.rand(b, HEADS, V, generator=g),
             u=(0.5 * torch.randn(b, HEADS, R, K, generator=g)).to(torch.float16),
             q=(0.5 * torch.randn(b, HEADS, R, V, generator=g)).to(torch.float16),
             h=torch.randint(0, L, (b, HEADS), generator=g, dtype=torch.int32),
             kbuf=(0.1 * torch.randn(b, HEADS, L, K, generator=g)).to(torch.bfloat16),
             ubuf=(0.3 * torch.randn(b, HEADS, L, V, generator=g)).to(torch.bfloat16))
    t["s_v"][..., 5] *= 30                                          # a hot row
    t["codes"][:, 1] = 0                                            # head 1: no codes, an empty window
    t["h"][:, 1] = 0
    for n in ("codes", "u", "q"):                                   # head 2: an all-zero state
        t[n][:, 2] = 0
    t["h"][:, 2] = 0
    t["h"][:, 3] = L - 1                                            # head 3: the window's last entry
    t["s_k"][:, 4] *= 1e-4                                          # head 4: tiny
    t["u"][:, 4] *= 1e-2
    t["ubuf"][:, 4] *= 1e-4
    t["s_k"][:, 5] *= 3e2                                           # head 5: huge
    t["u"][:, 5] *= 17
    t["ubuf"][:, 5] *= 3e2
    drift = -torch.rand(b, HEADS, K, generator=g)
    drift[:, 6] -= 200.0                                            # head 6: a checkpoint decayed to nothing
    _gate_state(t, gate, 0.5, g, drift)
    t.update(_token_and_gate(b, gate, g))
    return _case(gate, t, "request structured")


def random_input(b: int, gate: str, seed: int) -> StepCase:
    g = torch.Generator().manual_seed(seed)
    t = dict(codes=torch.randint(-QMAX, QMAX + 1, (b, HEADS, V, K), generator=g, dtype=torch.int8),
             s_k=0.05 * torch.exp(0.7 * torch.randn(b, HEADS, K, generator=g)),
             s_v=0.3 * torch.exp(0.7 * torch.randn(b, HEADS, V, generator=g)),
             u=torch.randn(b, HEADS, R, K, generator=g).to(torch.float16),
             q=torch.randn(b, HEADS, R, V, generator=g).to(torch.float16),
             h=torch.randint(0, L, (b, HEADS), generator=g, dtype=torch.int32),
             kbuf=torch.randn(b, HEADS, L, K, generator=g).to(torch.bfloat16),
             ubuf=torch.randn(b, HEADS, L, V, generator=g).to(torch.bfloat16))
    _gate_state(t, gate, 1e-3, g, torch.zeros(b, HEADS, K))
    if gate == "kda":
        t["pcum"] = -20 * torch.rand(b, HEADS, K, generator=g)
    else:
        t["p"] = torch.rand(b, HEADS, generator=g)
    t.update(_token_and_gate(b, gate, g))
    return _case(gate, t, "request random")


def following(case: StepCase, out, seed: int) -> StepCase:
    """The step after ``case`` as the request's benchmark builds it: the outputs ``out`` written at entry h (keys,
    values, KDA decay factors), the new weights and gate, h + 1 except that a window at L - 1 stays at L - 1 (its last
    entry is overwritten next), the entries past the new fill count emptied (w = 0, decay factor 1), a new token."""
    t = dict(case.tensors)
    h = t["h"].long()
    this = (torch.arange(L) == h.unsqueeze(-1)).unsqueeze(-1)                        # [b, H, L, 1]
    t["kbuf"] = torch.where(this, out[1].unsqueeze(-2), t["kbuf"])
    t["ubuf"] = torch.where(this, out[2].unsqueeze(-2), t["ubuf"])
    h2 = torch.where(h >= L - 1, h, h + 1)
    live = torch.arange(L) < h2.unsqueeze(-1)
    if case.gate == "kda":
        gbuf = torch.where(this, out[3].unsqueeze(-2), t["gbuf"])
        t["gbuf"] = torch.where(live.unsqueeze(-1), gbuf, torch.ones_like(gbuf))
        t["w"], t["pcum"] = out[4] * live, out[5]
    else:
        t["w"], t["p"] = out[3] * live, out[4]
    t["h"] = h2.to(torch.int32)
    t.update(_token_and_gate(h.shape[0], case.gate, torch.Generator().manual_seed(seed)))
    return _case(case.gate, t, "request next step")


def _backends() -> list:
    out = [pytest.param("reference", 2), pytest.param("triton", 1)]   # triton on a CPU: its tl kernel, interpreted
    for b in (16, 64):
        out.append(pytest.param("triton", b, marks=[pytest.mark.gpu, pytest.mark.skipif(
            not HAS_CUDA, reason="GPU backend at the request's batch sizes")]))
    return out


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend, batch", _backends())
def test_request_step_inputs(backend, batch, gate):
    device = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    if device.type == "cuda" and batch == 1 and backend == "triton":
        pytest.skip("the interpreter's case (batch 1) runs on a CPU; the GPU runs the request's batch sizes")
    why = dispatch.reasons(backend, Pool(2, HEADS, device=device, gate=gate), op="step")
    if why:
        pytest.skip(f"{backend}: {'; '.join(why)}")
    first = structured(batch, gate, seed=batch)
    out = first.to(device).run(backend=backend)
    v = first.judge(out, name=f"{backend} structured")
    assert v.passed, v.message
    second = following(first, first.reference(), seed=batch + 1)
    v = second.judge(second.to(device).run(backend=backend), name=f"{backend} next step")
    assert v.passed, v.message
    third = random_input(batch, gate, seed=batch + 2)
    v = third.judge(third.to(device).run(backend=backend), name=f"{backend} random")
    assert v.passed, v.message
