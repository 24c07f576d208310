"""Test of bench/dev/decay_only_luck.py on a CPU (a small case: the tool's table takes minutes)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decay_only_luck as dl  # noqa: E402


def test_counts_every_head_of_both_implementations():
    """Both implementations are judged on every head; with per-channel KDA decays neither is over its bound."""
    gate, decay = dl.DECAYS["KDA pcum from -0.125 to -0.375"]
    r = dl.over_bound(gate, decay, seeds=1, batch=2, heads=8)
    assert set(r) == {"Gram-Schmidt, fp64", "CholeskyQR, fp32"}
    for n_over, n, worst in r.values():
        assert n == 16 and n_over == 0 and 0.0 < worst <= 1.0


def test_gdn_decay_only_state_is_a_multiple_of_the_checkpoint():
    """The tool's premise: with every weight 0 the rebuilt GDN state is p times the decoded checkpoint."""
    from leapquant import families
    from leapquant.reference import decode_checkpoint, rebuild
    case = families.make_case(1, 4, "gdn", seed=0)
    t = dict(case.tensors)
    t["w"] = torch.zeros_like(t["w"])
    t["p"] = torch.full_like(t["p"], 0.5)
    S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], p=t["p"])
    assert torch.equal(S, 0.5 * decode_checkpoint(*case.checkpoint()))
