"""CPU emulation: which of the flush's three products tolerate the state truncated to tf32 (one tensor-core pass)?

    python bench/dev/emulate_products.py [SEEDS]

Runs the fp32 reference's compress with S replaced by its tf32 truncation (the top 11 significant bits: what an
m16n8k8 tf32 mma reads of an fp32 operand) in P = S^T q0, in S P, in U = S^T Q, or in several, on
``families.make_case(8, 32, gate, seed)`` for both gates and ``SEEDS`` seeds, and judges each variant by the SPEC
criterion against the fp64 state and the plain reference (worst score: pass <= 1). The other operand is kept exact (a
kernel splits it into hi | lo halves of the n columns at no extra mma).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from leapquant import families  # noqa: E402
from leapquant.reference import orthonormalise, rebuild, tokens_and_codes  # noqa: E402

TF32_DROPPED_BITS = 0x1FFF          # the 13 low mantissa bits a tf32 operand ignores
VARIANTS = {"P": (True, False, False), "SP": (False, True, False), "U": (False, False, True),
            "P+SP": (True, True, False), "all": (True, True, True)}


def tf32(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32) & ~TF32_DROPPED_BITS).view(torch.float32)


def compress(S: torch.Tensor, q0: torch.Tensor, in_p: bool, in_sp: bool, in_u: bool) -> tuple[torch.Tensor, ...]:
    """The reference's compress with tf32(S) in the chosen products."""
    St, Sa = S.transpose(-1, -2), tf32(S)
    Sat = Sa.transpose(-1, -2)
    P = orthonormalise((Sat if in_p else St) @ q0)
    Q = orthonormalise((Sa if in_sp else S) @ P)
    return tokens_and_codes(S, Q, (Sat if in_u else St) @ Q)


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    worst = dict.fromkeys(VARIANTS, 0.0)
    failed = dict.fromkeys(VARIANTS, 0)
    for gate in ("kda", "gdn"):
        for seed in range(seeds):
            case = families.make_case(8, 32, gate, seed=seed)
            t = case.tensors
            S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
            for name, flags in VARIANTS.items():
                v = case.judge(compress(S, case.q0, *flags), name)
                worst[name] = max(worst[name], v.worst_score)
                failed[name] += not v.passed
    print("| S truncated to tf32 in | worst score | failing cases |\n| --- | --- | --- |")
    for name in VARIANTS:
        print(f"| {name} | {worst[name]:.4f} | {failed[name]} of {2 * seeds} |")


if __name__ == "__main__":
    main()
