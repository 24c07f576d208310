"""The correctness criterion of SPEC section 3, shared by the tests and the benchmark.

The decoded state is judged, never the codes (two correct implementations flip codes whenever they differ in the
last bits). For every head, with ``S`` the exactly rebuilt fp64 state and ``err = mean |decode(checkpoint) - S|``:

* relatively judged heads (``err_ref >= 1e-4 * mean|S|``): ``err <= 1.01 * err_ref``, where ``err_ref`` is the same
  error of the fp32 reference's checkpoint;
* absolutely judged heads (the format captures them almost exactly, all-zero heads included):
  ``err <= 1e-3 * mean|S|``;
* every output finite, codes in [-127, 127].

A head's *score* is its error over its bound (pass <= 1): ``err / (1.01 err_ref)`` or ``err / (1e-3 mean|S|)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .layout import QMAX
from .reference import decode_checkpoint, rebuild

REL_SLACK = 1.01         #: a backend may be 1 % worse than the fp32 reference on a relatively judged head
REL_FLOOR = 1e-4         #: err_ref below this fraction of mean|S|: the head is judged absolutely
ABS_BOUND = 1e-3         #: ... against this fraction of mean|S|


def exact_state(codes, s_k, s_v, u, q, kbuf, ubuf, w, *, pcum=None, gbuf=None, p=None) -> torch.Tensor:
    """The fp64 rebuild of the state a flush compresses (inputs in their storage dtypes, leading dims [B, H])."""
    return rebuild(codes, s_k, s_v, u, q, kbuf, ubuf, w, pcum=pcum, gbuf=gbuf, p=p, dtype=torch.float64)


def head_errors(S: torch.Tensor, checkpoint: Sequence[torch.Tensor]) -> torch.Tensor:
    """mean |decode(checkpoint) - S| per head, fp64 [...]."""
    dec = decode_checkpoint(*checkpoint, dtype=torch.float64)
    return (dec - S.to(dec.device)).abs().mean(dim=(-1, -2))


@dataclass
class Verdict:
    passed: bool
    worst_score: float                      #: the largest err / bound over the heads (pass <= 1)
    worst_head: tuple[int, ...] | None      #: (b, h) of that head
    message: str                            #: one line, or the reasons of the failure
    score: torch.Tensor = field(repr=False)  #: per head
    err: torch.Tensor = field(repr=False)
    err_ref: torch.Tensor = field(repr=False)
    mean_abs: torch.Tensor = field(repr=False)
    relative: torch.Tensor = field(repr=False)  #: bool per head: judged against the reference

    def __bool__(self) -> bool:
        return self.passed


def _fmt(h: tuple[int, ...], labels: Sequence[Sequence[str]] | None) -> str:
    if len(h) != 2:
        return str(h)
    lab = f" [{labels[h[0]][h[1]]}]" if labels is not None else ""
    return f"(b={h[0]}, h={h[1]}){lab}"


def judge(S: torch.Tensor, out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor],
          labels: Sequence[Sequence[str]] | None = None, name: str = "backend") -> Verdict:
    """Judge checkpoint ``out`` = (codes, s_k, s_v, u, q) against the fp64 state ``S`` [B, H, V, K], with ``ref`` the
    fp32 reference's checkpoint of the same inputs. ``labels[b][h]`` names head (b, h)'s input family in messages."""
    problems: list[str] = []
    codes = out[0]
    if codes.dtype != torch.int8:
        problems.append(f"codes dtype {codes.dtype}, expected int8")
    elif codes.numel() and int(codes.to(torch.int16).abs().max()) > QMAX:
        bad = (codes.to(torch.int16).abs() > QMAX).nonzero()[0].tolist()
        problems.append(f"codes outside [-{QMAX}, {QMAX}] (first at {bad})")
    for nm, t in zip(("s_k", "s_v", "u", "q"), out[1:]):
        finite = torch.isfinite(t.float())
        if not bool(finite.all()):
            problems.append(f"{nm} has {int((~finite).sum())} non-finite values (first at "
                            f"{(~finite).nonzero()[0].tolist()})")
    S = S.to(torch.float64)
    err = head_errors(S, out).cpu()
    err_ref = head_errors(S, ref).cpu()
    mean_abs = S.abs().mean(dim=(-1, -2)).cpu()
    relative = (err_ref >= REL_FLOOR * mean_abs) & (err_ref > 0)
    bound = torch.where(relative, REL_SLACK * err_ref, ABS_BOUND * mean_abs)
    score = torch.where(bound > 0, err / bound.clamp_min(1e-300),
                        torch.where(err > 0, torch.full_like(err, float("inf")), torch.zeros_like(err)))
    score = torch.where(torch.isnan(score), torch.full_like(score, float("inf")), score)
    flat = int(score.reshape(-1).argmax())
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), score.shape))
    ws = float(score.reshape(-1)[flat])
    kind = "relative" if bool(relative[worst]) else "absolute"
    detail = (f"worst head {_fmt(worst, labels)} ({kind}): err {float(err[worst]):.4g}, reference err "
              f"{float(err_ref[worst]):.4g}, mean|S| {float(mean_abs[worst]):.4g}, score {ws:.4f} "
              f"(err / {'1.01 err_ref' if kind == 'relative' else '1e-3 mean|S|'})")
    nfail = int((score > 1).sum())
    if nfail:
        problems.append(f"{nfail} of {score.numel()} heads over their bound ({100.0 * nfail / score.numel():.1f} %)")
    passed = not problems
    msg = f"{name}: {'PASS' if passed else 'FAIL'}: " + "; ".join(problems + [detail])
    return Verdict(passed, ws, worst, msg, score, err, err_ref, mean_abs, relative)
