"""The correctness criteria: the flush's (SPEC section 3) and the decode step's (SPEC section 7, :func:`judge_step`),
shared by the tests and the benchmark.

The flush:

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

from .layout import L, QMAX
from .reference import decode_checkpoint, live_entries, rebuild, step_math

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


def _head_name(h: tuple[int, ...], labels: Sequence[Sequence[str]] | None) -> str:
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
    detail = (f"worst head {_head_name(worst, labels)} ({kind}): err {float(err[worst]):.4g}, reference err "
              f"{float(err_ref[worst]):.4g}, mean|S| {float(mean_abs[worst]):.4g}, score {ws:.4f} "
              f"(err / {f'{REL_SLACK:g} err_ref' if kind == 'relative' else f'{ABS_BOUND:g} mean|S|'})")
    nfail = int((score > 1).sum())
    if nfail:
        problems.append(f"{nfail} of {score.numel()} heads over their bound ({100.0 * nfail / score.numel():.1f} %)")
    passed = not problems
    msg = f"{name}: {'PASS' if passed else 'FAIL'}: " + "; ".join(problems + [detail])
    return Verdict(passed, ws, worst, msg, score, err, err_ref, mean_abs, relative)


# ---- the decode step (SPEC section 7) ------------------------------------------------------------------------------
# Every output element against the same formula in fp64 (exact_step), with M the formula on the absolute values of
# every term (the scale of what the element sums: o and u_new can cancel to far below their terms):
#   o, k_row, u_row   |x - exact| <= half a bf16 step of exact + 1e-5 M   (M = 0: the element must be exactly 0)
#   g_row (KDA)       |x - exact| <= half an fp16 step of exact + 1e-5 |exact|
#   w_new             exact where no gate touches it (KDA everywhere; GDN at and past h), GDN's live weights as p_new
#   pcum_new (KDA)    |x - exact| <= 1e-5 (|exact| + 1)
#   p_new (GDN)       |x - exact| <= half an fp32 step of exact + 1e-5 (1 + |g|) |exact|   (g: this step's log-gate)
#   everything finite.
# Half a step is the rounding of the stored output itself: an fp32 computation whose error is d rounds to within
# half a step + 2 d of the exact value, and fp32 arithmetic in any order leaves d ~ 1e-7 M, so 1e-5 M is ~100x what
# it needs, while any intermediate rounded to bf16 / fp16 / TF32 (~1e-3 M) fails.
#
# GDN's gate product and decayed weights have no entry in the SPEC's list: they are judged relative to their size
# (they can be subnormal: half an fp32 step is then the output's own rounding, 2^-150), with the slack of pcum's bound
# carried into the product: at = exp(g) computed in fp32 has a relative error of about |g| 6e-8, so the bound grows
# with this step's |g| as pcum's grows with |pcum|. Where at itself is below the normal fp32 range (g < -87.3), the
# factor the formula multiplies by is an fp32 value whose own rounding is half a subnormal step: 2^-150 / at relative,
# 0.6 % at at = 1.2e-43 (the nightly profile found the fp32 reference 1.16x over a bound without this term, a GDN
# gate_extremes head with w 0.84 decayed to 1.0e-43); for a normal at the term is 2^-24 relative at most, inside the
# 1e-5 allowance.

STEP_REL = 1e-5                     #: the arithmetic allowance, relative to M (o, k_row, u_row) or |exact|
#: the functional step's outputs, in order, with their storage dtypes
STEP_OUTPUTS = {
    "kda": (("o", torch.bfloat16), ("k_row", torch.bfloat16), ("u_row", torch.bfloat16), ("g_row", torch.float16),
            ("w_new", torch.float32), ("pcum_new", torch.float32)),
    "gdn": (("o", torch.bfloat16), ("k_row", torch.bfloat16), ("u_row", torch.bfloat16), ("w_new", torch.float32),
            ("p_new", torch.float32)),
}
#: explicit mantissa bits and the smallest normal exponent of each storage format
_FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


def half_step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` (bf16, fp16, fp32) around each value of ``x`` (fp64): the largest error of rounding
    ``x`` to ``dtype`` to nearest (the spacing of the binade that holds |x|; the subnormal spacing below the normal
    range and at 0)."""
    mant, emin = _FORMAT[dtype]
    _, e = torch.frexp(x)                                  # |x| in [2^(e-1), 2^e)
    ex = torch.where(x == 0, torch.full_like(e, emin), (e - 1).clamp_min(emin))
    return torch.ldexp(torch.ones_like(x), ex - mant - 1)


@dataclass
class StepExact:
    """The fp64 values a step's outputs are judged against: ``values`` by output name (see :data:`STEP_OUTPUTS`),
    ``magnitude`` M of o, k_row and u_row, this step's log-gate ``g`` and the live-entry mask ``live`` [B, H, L]."""
    gate: str
    values: dict[str, torch.Tensor]
    magnitude: dict[str, torch.Tensor]
    g: torch.Tensor
    live: torch.Tensor


def exact_step(codes, s_k, s_v, u, q, kbuf, ubuf, w, h, qx, kx, vx, a, b, A_log, dt_bias, *, gbuf=None, pcum=None,
               p=None, beta_bf16: bool = True) -> StepExact:
    """The step's formula in fp64 on the CPU, and its magnitudes (inputs as :func:`leapquant.reference.step_math`, in
    their storage dtypes, any device). beta is rounded to bf16 from the fp64 sigmoid when ``beta_bf16`` (fp32's
    sigmoid rounds to the same bf16 for every finite bf16 b but eight, all below -88, where beta is subnormal)."""
    args = [t.detach().cpu() for t in (codes, s_k, s_v, u, q, kbuf, ubuf, w, h, qx, kx, vx, a, b, A_log, dt_bias)]
    gate = {k: v.detach().cpu() for k, v in dict(gbuf=gbuf, pcum=pcum, p=p).items() if v is not None}
    ex = step_math(*args, **gate, beta_bf16=beta_bf16, dtype=torch.float64)
    mag = step_math(*args, **gate, beta_bf16=beta_bf16, dtype=torch.float64, absolute=True)
    values = dict(o=ex["o"], k_row=ex["kn"], u_row=ex["u_new"], w_new=ex["w_new"])
    if p is None:
        values.update(g_row=ex["en"], pcum_new=ex["pcum_new"])
        kind = "kda"
    else:
        values.update(p_new=ex["p_new"])
        kind = "gdn"
    h = h.detach().cpu()
    entry = torch.where(h == L, torch.zeros_like(h), h)              # a fill count of L is an empty window
    return StepExact(kind, values, dict(o=mag["o"], k_row=mag["kn"], u_row=mag["u_new"]), ex["g"],
                     live_entries(entry))


def step_tolerances(exact: StepExact) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per output, the tolerance of every element (fp64) and the part of it that is the output's own rounding (half
    a step; 0 for the fp32 outputs)."""
    tol, rounding = {}, {}
    v, M = exact.values, exact.magnitude
    for name in ("o", "k_row", "u_row"):
        hs = half_step(v[name], torch.bfloat16)
        rounding[name] = torch.where(M[name] > 0, hs, torch.zeros_like(hs))     # all terms zero: exactly zero
        tol[name] = rounding[name] + STEP_REL * M[name]
    if exact.gate == "kda":
        rounding["g_row"] = half_step(v["g_row"], torch.float16)
        tol["g_row"] = rounding["g_row"] + STEP_REL * v["g_row"].abs()
        rounding["pcum_new"] = torch.zeros_like(v["pcum_new"])
        tol["pcum_new"] = STEP_REL * (v["pcum_new"].abs() + 1.0)
        rounding["w_new"] = torch.zeros_like(v["w_new"])
        tol["w_new"] = torch.zeros_like(v["w_new"])
    else:
        at = torch.exp(exact.g)                                  # [B, H]
        at_rounding = torch.where(at > 0, half_step(at, torch.float32) / at.clamp_min(1e-300), torch.zeros_like(at))
        rounding["p_new"] = half_step(v["p_new"], torch.float32)
        tol["p_new"] = rounding["p_new"] + (STEP_REL * (1.0 + exact.g.abs()) + at_rounding) * v["p_new"].abs()
        # the live weights are decayed as p is; the others are copied (w[h] = 1, the rest as they were): exact
        zero = torch.zeros_like(v["w_new"])
        rounding["w_new"] = torch.where(exact.live, half_step(v["w_new"], torch.float32), zero)
        tol["w_new"] = torch.where(exact.live, rounding["w_new"] + (STEP_REL * (1.0 + exact.g.abs())
                                                                    + at_rounding).unsqueeze(-1) * v["w_new"].abs(),
                                   zero)
    return tol, rounding


@dataclass
class StepVerdict:
    """The step criterion's verdict. ``worst`` = (output, b, h, index within the program's output) of the element
    with the largest error / tolerance ``worst_score`` (pass <= 1). ``arith_score`` is the largest error beyond the
    output's own rounding over the arithmetic allowance (1e-5 M etc.): how much of the allowance the computation
    uses (the fp32 reference: a few per cent; an intermediate rounded to bf16: hundreds)."""
    passed: bool
    worst_score: float
    worst: tuple | None
    message: str
    arith_score: float
    scores: dict[str, torch.Tensor] = field(repr=False)   #: per output, the worst score of each program [B, H]
    arith: dict[str, torch.Tensor] = field(repr=False)    #: per output, the worst arithmetic score per program

    def __bool__(self) -> bool:
        return self.passed


def _ratio(err: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """err / tol, with 0 / 0 = 0, x / 0 = inf and NaN = inf."""
    r = torch.where(tol > 0, err / tol.clamp_min(1e-300),
                    torch.where(err > 0, torch.full_like(err, float("inf")), torch.zeros_like(err)))
    return torch.where(torch.isnan(r), torch.full_like(r, float("inf")), r)


def judge_step(exact: StepExact, out: Sequence[torch.Tensor], labels: Sequence[Sequence[str]] | None = None,
               name: str = "backend") -> StepVerdict:
    """Judge a step's outputs ``out`` (the functional form's tuple, leading dims [B, H]) against ``exact``."""
    spec = STEP_OUTPUTS[exact.gate]
    problems: list[str] = []
    if len(out) != len(spec):
        raise ValueError(f"out: expected {len(spec)} outputs {[n for n, _ in spec]}, got {len(out)}")
    tol, rounding = step_tolerances(exact)
    scores, arith, where = {}, {}, {}
    for (nm, dtype), x in zip(spec, out):
        ref = exact.values[nm]
        if x.dtype != dtype:
            problems.append(f"{nm} dtype {x.dtype}, expected {dtype}")
        if tuple(x.shape) != tuple(ref.shape):
            problems.append(f"{nm} shape {tuple(x.shape)}, expected {tuple(ref.shape)}")
            continue
        xd = x.detach().cpu().to(torch.float64)
        finite = torch.isfinite(xd)
        if not bool(finite.all()):
            problems.append(f"{nm} has {int((~finite).sum())} non-finite values (first at "
                            f"{tuple((~finite).nonzero()[0].tolist())})")
        err = (xd - ref).abs()
        err = torch.where(finite, err, torch.full_like(err, float("inf")))
        score = _ratio(err, tol[nm])
        allowance = tol[nm] - rounding[nm]
        beyond = _ratio((err - rounding[nm]).clamp_min(0.0), allowance)
        flat = score.reshape(*score.shape[:2], -1)
        scores[nm] = flat.amax(-1)
        arith[nm] = beyond.reshape(*score.shape[:2], -1).amax(-1)
        where[nm] = (score, err, tol[nm], xd, ref)
    if not scores:
        return StepVerdict(False, float("inf"), None, f"{name}: FAIL: " + "; ".join(problems), float("inf"), {}, {})
    worst_name = max(scores, key=lambda n: float(scores[n].max()))
    score, err, tl, xd, ref = where[worst_name]
    flat = int(score.reshape(-1).argmax())
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), score.shape))
    b_, h_, index = pos[0], pos[1], pos[2:]
    ws = float(score[pos])
    arith_score = max(float(a.max()) for a in arith.values())
    lab = f" [{labels[b_][h_]}]" if labels is not None else ""
    over = sum(int((where[n][0] > 1).sum()) for n in where)
    if over:
        problems.append(f"{over} elements over their tolerance")
    detail = (f"worst {worst_name} at program (b={b_}, h={h_}){lab} index {index}: |x - exact| = "
              f"{float(err[pos]):.4g} (x {float(xd[pos]):.6g}, exact {float(ref[pos]):.6g}), tolerance "
              f"{float(tl[pos]):.4g}, score {ws:.4f}; arithmetic score {arith_score:.4f}")
    passed = not problems
    msg = f"{name}: {'PASS' if passed else 'FAIL'}: " + "; ".join(problems + [detail])
    return StepVerdict(passed, ws, (worst_name, b_, h_, index), msg, arith_score, scores, arith)
