"""CPU probe P0 of the flush redesign (docs/design-tilelang.md, "The redesign's probes"): the re-compression with its
three products computed from the factored form a flush reads instead of the dense state.

    python bench/dev/probe_factored.py [SEEDS]

With S = diag(s_v) C diag(c) + q^T u diag(g) + Ub^T Kd (C the int8 codes, c = g s_k / 127, g the checkpoint's decay
per channel, Kd the decayed, weighted window keys [L, K], Ub the window values [L, V]):

    S^T x = c * C^T (s_v * x) + g * u^T (q x) + Kd^T (Ub x)          (P = S^T q0, U = S^T Q)
    S z   = s_v * C (c * z)   + q^T (u (g * z)) + Ub^T (Kd z)        (S P)

The codes' products run as an int8 tensor core would: each column of the multiplier (s_v * x or c * z, fp32) is split
into LIMBS signed base-2^7 digits under a power-of-two scale (the largest magnitude in [32, 64) units: every digit in
[-64, 64]), the integer sums are exact, and the digits' sums are combined in fp32, lowest first. The rank-4 and window
terms are fp32 products. The basis is the kernels' CholeskyQR (leapquant.numerics: P one pass, Q two, the pivot
floors); "U after Q's second factor" computes U = S^T Q1 from the first pass's Q1 and applies the second factor to U
as to Q (so U's product can start before Q's second pass ends). The residual, scales and codes come from the dense
fp32 state (reference.tokens_and_codes), as the redesign's dense warpgroup would make them.

Every variant is judged by the flush criterion (leapquant.criterion) on ``families.make_case(8, 32, gate, seed)`` for
both gates and SEEDS seeds; printed: the worst score over every head and over the heads of the non-tiny families (the
tiny families' error is set by the fp16 rounding of the tokens: bench/results/TESTS.md), and the heads over 1.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from leapquant import families  # noqa: E402
from leapquant.numerics import (CHOLQR_ABS_FLOOR, CHOLQR_RELATIVE_FLOOR, P_CHOLQR_PASSES, Q_CHOLQR_PASSES,  # noqa: E402
                                QMAX)
from leapquant.reference import rebuild, tokens_and_codes, window_decays  # noqa: E402

DIGIT_BITS = 7                 #: base 2^7 digits, each in [-64, 64] (fits int8 beside the codes' [-127, 127])
LEAD_UNITS = 64                #: the largest magnitude of a column is scaled into [LEAD_UNITS / 2, LEAD_UNITS)


def digits(y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y [..., rows, cols] fp32 -> (d [n, ..., rows, cols] integer-valued fp64, e [..., 1, cols] int): y ~ sum_i d_i
    2^(e - 7 i), per column e such that max |y| / 2^e is in [32, 64)."""
    m = y.abs().amax(dim=-2, keepdim=True)
    _, ex = torch.frexp(m)                                   # m = f 2^ex, f in [0.5, 1)
    e = ex - (LEAD_UNITS.bit_length() - 1)                   # m / 2^e in [32, 64)
    t = y.double() * torch.pow(2.0, -e.double())
    out = []
    for _ in range(n):
        d = torch.round(t)
        out.append(d)
        t = (t - d) * 2.0 ** DIGIT_BITS
    return torch.stack(out), e


def int8_product(C: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """C [..., a, b] int8 codes times y [..., b, cols] fp32, as n-digit int8 tensor-core products combined in fp32
    (lowest digit first): [..., a, cols] fp32."""
    d, e = digits(y, n)
    Cd = C.double()
    acc = torch.zeros(*C.shape[:-1], y.shape[-1], dtype=torch.float32)
    for i in reversed(range(n)):
        s = (Cd @ d[i]).float()                              # exact: |sum| <= 127 * 64 * 128 < 2^24
        acc = acc + s * torch.pow(2.0, (e - DIGIT_BITS * i).double()).float()
    return acc


class Factored:
    """The factored form of the states a flush compresses (leading dims [B, H]), fp32 terms."""

    def __init__(self, t: dict[str, torch.Tensor], gate: str):
        self.C = t["codes"]
        self.s_v = t["s_v"].float()
        self.u, self.q = t["u"].float(), t["q"].float()
        keys = t["kbuf"].float() * t["w"].float().unsqueeze(-1)
        if gate == "kda":
            self.g = torch.exp(t["pcum"].float())                                  # [B, H, K]
            keys = keys * window_decays(t["gbuf"])
        else:
            self.g = t["p"].float().unsqueeze(-1).expand_as(t["s_k"])
        self.c = self.g * t["s_k"].float() / QMAX
        self.Kd, self.Ub = keys, t["ubuf"].float()

    def st_x(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """S^T x: x [B, H, V, R] -> [B, H, K, R]."""
        codes = int8_product(self.C.transpose(-1, -2), self.s_v.unsqueeze(-1) * x, n)
        rank = self.u.transpose(-1, -2) @ (self.q @ x)
        return self.c.unsqueeze(-1) * codes + self.g.unsqueeze(-1) * rank + self.Kd.transpose(-1, -2) @ (self.Ub @ x)

    def s_z(self, z: torch.Tensor, n: int) -> torch.Tensor:
        """S z: z [B, H, K, R] -> [B, H, V, R]."""
        codes = int8_product(self.C, self.c.unsqueeze(-1) * z, n)
        rank = self.q.transpose(-1, -2) @ (self.u @ (self.g.unsqueeze(-1) * z))
        return self.s_v.unsqueeze(-1) * codes + rank + self.Ub.transpose(-1, -2) @ (self.Kd @ z)


def cholqr_factor(X: torch.Tensor) -> torch.Tensor:
    """L^-T [..., R, R] of one CholeskyQR pass (X <- X L^-T, L L^T = X^T X) with the kernels' pivot floors."""
    G = X.transpose(-1, -2) @ X
    R = G.shape[-1]
    Lm = torch.zeros_like(G)
    for j in range(R):
        d = G[..., j, j] - (Lm[..., j, :j] ** 2).sum(-1)
        d = torch.maximum(torch.maximum(d, CHOLQR_RELATIVE_FLOOR * G[..., j, j]),
                          torch.full_like(d, CHOLQR_ABS_FLOOR))
        Lm[..., j, j] = torch.sqrt(d)
        for k in range(j + 1, R):
            Lm[..., k, j] = (G[..., k, j] - (Lm[..., k, :j] * Lm[..., j, :j]).sum(-1)) / Lm[..., j, j]
    eye = torch.eye(R).expand_as(G)
    return torch.linalg.solve_triangular(Lm, eye, upper=False).transpose(-1, -2)


def cholqr(X: torch.Tensor, passes: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    factors = []
    for _ in range(passes):
        f = cholqr_factor(X)
        X = X @ f
        factors.append(f)
    return X, factors


def compress_factored(S: torch.Tensor, F: Factored | None, q0: torch.Tensor, n: int, u_after: bool):
    """The re-compression with the products from the factored form (F; None: from the dense S) and CholeskyQR."""
    st_x = (lambda x: S.transpose(-1, -2) @ x) if F is None else (lambda x: F.st_x(x, n))  # noqa: E731
    s_z = (lambda z: S @ z) if F is None else (lambda z: F.s_z(z, n))                     # noqa: E731
    P, _ = cholqr(st_x(q0.expand(*S.shape[:-2], *q0.shape)), P_CHOLQR_PASSES)
    Q1, f1 = cholqr(s_z(P), 1)
    Q, f2 = cholqr(Q1, Q_CHOLQR_PASSES - 1)
    if u_after:
        U = st_x(Q1)
        for f in f2:
            U = U @ f
    else:
        U = st_x(Q)
    return tokens_and_codes(S, Q, U)


VARIANTS = {   # name: (products from the factored form, digits, U after Q's second factor)
    "CholeskyQR, dense products (the shipped kernels)": (False, 0, False),
    "factored, 4 digits": (True, 4, False),
    "factored, 4 digits, U after Q's second factor": (True, 4, True),
    "factored, 3 digits, U after Q's second factor": (True, 3, True),
}


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    print("| variant | gate | worst score (family) | worst, non-tiny families | heads over 1 |\n"
          "| --- | --- | --- | --- | --- |")
    for name, (factored, n, u_after) in VARIANTS.items():
        for gate in ("kda", "gdn"):
            worst, worst_fam, worst_rest, over, heads = 0.0, "", 0.0, 0, 0
            for seed in range(seeds):
                case = families.make_case(8, 32, gate, seed=seed)
                t = case.tensors
                S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
                out = compress_factored(S, Factored(t, gate) if factored else None, case.q0, n, u_after)
                v = case.judge(out, name)
                score = v.score
                for b in range(score.shape[0]):
                    for h in range(score.shape[1]):
                        sc, fam = float(score[b, h]), case.labels[b][h]
                        if sc > worst:
                            worst, worst_fam = sc, fam
                        if not fam.startswith("tiny"):
                            worst_rest = max(worst_rest, sc)
                over += int((score > 1).sum())
                heads += score.numel()
            print(f"| {name} | {gate} | {worst:.4f} ({worst_fam}) | {worst_rest:.4f} | {over} of {heads} |",
                  flush=True)


if __name__ == "__main__":
    main()
