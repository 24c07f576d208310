"""Tests of the flush redesign's probes on a CPU: P0 (probe_factored.py), P3's copy kernel (probe_copy_floor.py,
under the interpreter) and the Gluon probes P1 / P2 (probe_warpgroup_b.py, probe_warpgroup_a.py: compiled for sm_90
under the triton release the Gluon kernels are validated on). Run with ``python -m pytest -q -p no:cacheprovider
bench/dev`` (the shipped suite, tests/, does not import the dev tools)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_factored as pf  # noqa: E402

from leapquant import families  # noqa: E402
from leapquant.reference import rebuild  # noqa: E402


def test_digits_are_int8_and_exact_to_their_precision():
    """Every digit is an integer in [-64, 64]; n digits rebuild each column to 2^(1 - 7 n) of its largest magnitude
    (an all-zero column gives zeros)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 128, 4, generator=g) * torch.tensor([1e-30, 1.0, 3e4, 0.0])
    for n in (3, 4):
        d, e = pf.digits(y, n)
        assert bool((d == torch.round(d)).all()) and int(d.abs().max()) <= 64
        back = sum(d[i] * torch.pow(2.0, (e - pf.DIGIT_BITS * i).double()) for i in range(n))
        m = y.double().abs().amax(dim=-2, keepdim=True)
        assert bool(((back - y.double()).abs() <= m * 2.0 ** (1 - 7 * n)).all())
        assert bool((back[..., 3] == 0).all())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_factored_products_equal_the_dense_ones(gate):
    """S^T x and S z from the factored form agree with the dense state's products to fp32 accuracy (4 digits)."""
    case = families.make_case(2, 8, gate, seed=2)
    t = case.tensors
    S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs(), dtype=torch.float64)
    F = pf.Factored(t, gate)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 128, 4, generator=g)
    for got, want, scale in ((F.st_x(x, 4), S.transpose(-1, -2) @ x.double(), S.abs().sum(-2)),
                             (F.s_z(x, 4), S @ x.double(), S.abs().sum(-1))):
        bound = 1e-5 * (scale.unsqueeze(-1) * x.double().abs().amax(dim=-2, keepdim=True)) + 1e-30
        assert bool(((got.double() - want).abs() <= bound).all())


def test_the_probe_passes_the_criterion_on_a_small_case():
    """The dense-product variant and the 3-digit variant with U after Q's second factor both pass the criterion."""
    case = families.make_case(2, 8, "kda", seed=3)
    t = case.tensors
    S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
    assert case.judge(pf.compress_factored(S, None, case.q0, 0, False), "dense").passed
    assert case.judge(pf.compress_factored(S, pf.Factored(t, "kda"), case.q0, 3, True), "factored").passed


def test_copy_floor_moves_the_due_programs_bytes():
    """probe_copy_floor (issue 28, P3) in a child Python under the Triton interpreter (a CPU): each program of idx
    writes its checkpoint back unchanged, its reset fields from what it read (KDA gbuf = kbuf ^ ubuf ^ gbuf, pcum and w
    xor the fill count; GDN w xor the fill count, p xor the window's xor), and nothing else changes."""
    import subprocess
    code = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import probe_copy_floor as cf
from leapquant.layout import Pool
for gate in ("kda", "gdn"):
    pool = Pool(4, 2, gate=gate)
    g = torch.Generator().manual_seed(1)
    pool.raw.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, (pool.raw.numel(),), generator=g).to(torch.int32))
    for name in ("kbuf", "ubuf", "w", "pcum" if gate == "kda" else "p", "hcnt") + (("gbuf",) if gate == "kda" else ()):
        t = getattr(pool, name)
        it = torch.int32 if t.element_size() == 4 else torch.int16
        t.view(it).copy_(torch.randint(-2**15, 2**15 - 1, t.shape, generator=g).to(it))
    names = ("raw", "kbuf", "ubuf", "w", "hcnt", "pcum" if gate == "kda" else "p") + (("gbuf",) if gate == "kda" else ())
    before = {n: getattr(pool, n).clone() for n in names}
    idx = torch.tensor([3, 1], dtype=torch.int32)
    cf.launch(pool, idx)
    i32 = lambda t: t.view(torch.int32)
    bits = lambda t: t.view(torch.int32 if t.element_size() == 4 else torch.int16)
    for n in ("raw", "kbuf", "ubuf", "hcnt"):          # (as bits: random words include NaNs)
        assert torch.equal(bits(getattr(pool, n)), bits(before[n])), n
    s = idx.long()
    hc = before["hcnt"][s]
    w_want = before["w"].clone()
    w_want[s] = (i32(before["w"][s]) ^ hc.unsqueeze(-1)).view(torch.float32)
    assert torch.equal(i32(pool.w), i32(w_want))
    mix = i32(before["kbuf"][s]).flatten(-2) ^ i32(before["ubuf"][s]).flatten(-2)
    if gate == "kda":
        g_want = before["gbuf"].clone()
        g_want[s] = (mix ^ i32(before["gbuf"][s]).flatten(-2)).view(torch.float16).view(g_want[s].shape)
        assert torch.equal(pool.gbuf.view(torch.int16), g_want.view(torch.int16))
        p_want = before["pcum"].clone()
        p_want[s] = (i32(before["pcum"][s]) ^ hc.unsqueeze(-1)).view(torch.float32)
        assert torch.equal(i32(pool.pcum), i32(p_want))
    else:
        x = mix[..., 0]
        for k in range(1, mix.shape[-1]):
            x = x ^ mix[..., k]
        p_want = before["p"].clone()
        p_want[s] = (i32(before["p"][s]) ^ x).view(torch.float32)
        assert torch.equal(i32(pool.p), i32(p_want))
print("ok")
"""
    env = dict(__import__("os").environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]


def test_gluon_warpgroup_probes_compile():
    """probe_warpgroup_b (issue 28, P1) and probe_warpgroup_a (P2) lowered and assembled for sm_90 in a child Python
    without the interpreter (Gluon cannot compile under it), on the triton release the Gluon kernels are validated on:
    P1's rank updates and residual on the tensor cores (4 calls of 32 mma per thread), P2's codes products on the int8
    tensor cores (3 products of 16 mma per thread), no local memory uncapped."""
    import os
    import subprocess
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    from leapquant.triton.launch import GLUON_VALIDATED_TRITON
    if not triton.__version__.startswith(GLUON_VALIDATED_TRITON):
        pytest.skip(f"Gluon is validated on triton {', '.join(GLUON_VALIDATED_TRITON)}.x; this is {triton.__version__}")
    here = Path(__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import probe_warpgroup_a as a, probe_warpgroup_b as b\n"
            "for gate in ('kda', 'gdn'):\n"
            "    for name, p, mma in (('b', b, 128), ('a', a, 48)):\n"
            "        c = b.static_counts(p.compile_static(90, gate))\n"
            "        print(name + gate, c['instructions'], c['mma'], mma, c['local'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent.parent), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code, str(here)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line.split() for line in run.stdout.split("\n") if line]
    assert len(lines) == 4, run.stdout
    for name, n, mma, want, local in lines:
        assert int(n) > 0 and int(mma) == int(want) and int(local) == 0, name
