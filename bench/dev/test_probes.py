"""Tests of the CPU probe of the flush redesign (probe_factored.py), on a CPU. Run with
``python -m pytest -q -p no:cacheprovider bench/dev`` (the shipped suite, tests/, does not import the dev tools)."""
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
