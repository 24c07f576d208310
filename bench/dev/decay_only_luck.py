"""CPU measurement: how often does a correct implementation fail the flush criterion on a window that only decays?

    python bench/dev/decay_only_luck.py [SEEDS]

A window with every weight 0 but a decay (GDN p < 1, KDA pcum < 0) is flushed to the decayed checkpoint: a multiple
of a state that is already in the compressed form, so the re-compression gives most of the stored tokens and codes
back and its error is small, set by the few tokens that round the other way. The criterion compares that error with
the fp32 reference's at a 1 % slack. This tool counts the heads over their bound for two other implementations of the
same algorithm: the reference's Gram-Schmidt computed in fp64 (more accurate than the fp32 reference), and the
kernels' CholeskyQR (numerics' passes and floors) in fp32. Every family, ``families.make_case(16, 32, gate, seed)`` for
``SEEDS`` seeds (default 12: 6,144 heads per row), weights set to 0 and the decay of each row applied.
"""
from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from leapquant import criterion, families  # noqa: E402
from leapquant.numerics import K, P_CHOLQR_PASSES, Q_CHOLQR_PASSES  # noqa: E402
from leapquant.reference import compress, rebuild, tokens_and_codes  # noqa: E402
from probe_factored import cholqr  # noqa: E402

#: row name: (gate, decay) with decay GDN's p or KDA's pcum [K]
DECAYS = {
    "GDN p = 0.5": ("gdn", 0.5),
    "GDN p = 0.25": ("gdn", 0.25),
    "GDN p = exp(-2)": ("gdn", math.exp(-2.0)),
    "GDN p = 0.6": ("gdn", 0.6),
    "GDN p = 0.7": ("gdn", 0.7),
    "GDN p = 0.8": ("gdn", 0.8),
    "GDN p = 0.9": ("gdn", 0.9),
    "KDA pcum = -0.25 on one channel": ("kda", torch.zeros(K).index_fill_(0, torch.tensor([7]), -0.25)),
    "KDA pcum = -0.25 on every channel": ("kda", torch.full((K,), -0.25)),
    "KDA pcum from -0.125 to -0.375": ("kda", -0.25 * torch.linspace(0.5, 1.5, K)),
}


def cholqr_compress(S: torch.Tensor, q0: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' algorithm in fp32: P by CholeskyQR, Q by CholeskyQR, U = S^T Q, then the reference's encoding."""
    P, _ = cholqr(S.transpose(-1, -2) @ q0, P_CHOLQR_PASSES)
    Q, _ = cholqr(S @ P, Q_CHOLQR_PASSES)
    return tokens_and_codes(S, Q, S.transpose(-1, -2) @ Q)


def over_bound(gate: str, decay, seeds: int, batch: int = 16, heads: int = 32) -> dict[str, tuple[int, int, float]]:
    """{implementation: (heads over their bound, heads, worst score)} for windows that only decay by ``decay``."""
    out: dict[str, tuple[int, int, float]] = {}
    for seed in range(seeds):
        case = families.make_case(batch, heads, gate, seed=seed)
        t = dict(case.tensors)
        t["w"] = torch.zeros_like(t["w"])
        if gate == "gdn":
            t["p"] = torch.full_like(t["p"], decay)
            gk = dict(p=t["p"])
        else:
            t["pcum"] = decay.expand_as(t["pcum"]).clone()
            gk = dict(pcum=t["pcum"], gbuf=t["gbuf"])
        ck = case.checkpoint()
        S32 = rebuild(*ck, t["kbuf"], t["ubuf"], t["w"], **gk)
        S = criterion.exact_state(*ck, t["kbuf"], t["ubuf"], t["w"], **gk)
        ref = compress(S32, case.q0)
        impls = {"Gram-Schmidt, fp64": tuple(x.float() if x.dtype == torch.float64 else x
                                              for x in compress(S32.double(), case.q0)),
                 "CholeskyQR, fp32": cholqr_compress(S32, case.q0)}
        for name, ck_out in impls.items():
            v = criterion.judge(S, ck_out, ref, name=name)
            n_over, n, worst = out.get(name, (0, 0, 0.0))
            out[name] = (n_over + int((v.score > 1).sum()), n + v.score.numel(), max(worst, v.worst_score))
    return out


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    print("| decay-only window | Gram-Schmidt in fp64: over 1 (worst) | CholeskyQR in fp32: over 1 (worst) |\n"
          "| --- | --- | --- |")
    for row, (gate, decay) in DECAYS.items():
        r = over_bound(gate, decay, seeds)
        cells = [f"{n_over} of {n:,} ({worst:.4f})" for n_over, n, worst in r.values()]
        print(f"| {row} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
