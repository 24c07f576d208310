"""End-to-end decode accuracy: a simulated decode through :func:`leapquant.decode_inplace` against dense recurrences.

One layer's decode of ``tokens`` tokens for a batch of sequences, served four ways from the same bf16 inputs:

* ``fp64 state``: the dense recurrence in fp64 (the truth);
* ``leapquant``: the compressed pool, one :func:`leapquant.decode_inplace` per token (the step, then the flush of the
  windows it filled), on the backend asked for;
* ``fp32 state``: the dense recurrence in fp32;
* ``bf16 state``: the dense recurrence computed in fp32 with the state rounded to bf16 after every token (how a
  bf16-state decode kernel keeps it).

The dense recurrence is the math of SPEC section 7 on a materialised state, in the order of
:func:`leapquant.reference.step_math` (and with its functions): ``kn``, ``qn`` normalised, the state decayed by this
token's gate, ``u = beta (v - S kn)``, ``o = S qn + (kn . qn) u`` (:func:`leapquant.reference.delta_rule`), then
``S += u kn^T``. Every method emits ``o`` in bf16, as a model's kernel does (the fp64 truth stays fp64), so the
numbers compare the state each one keeps.

The metric is the relative error of the outputs over the last ``last`` tokens: ``||o - o_exact||_F / ||o_exact||_F``
over those tokens, every sequence and head (and per head, its worst). The requirement: LeapQuant's error is no worse
than the bf16 state's.

The inputs imitate a trained layer's (all drawn on the CPU from one seed, so every device sees the same tokens):

* per-head ``A = exp(A_log)`` uniform in [1, 16] and ``dt = softplus(dt_bias)`` log-uniform in [1e-4, 1e-1] per key
  channel (KDA) or head (GDN): per-token decays ``exp(-A dt)`` from 0.2 to 0.9999, time constants from under a token to
  about 10^4 tokens (models initialise ``dt`` in [1e-3, 1e-1]; the wider range adds channels that hardly decay);
* gate pre-activations ``a = 0.5 N(0, 1)``, plus a jump of 3 to 6 on 2 % of the entries (a channel that forgets):
  most per-token decays stay near their head's, a few channels decay fast;
* keys and queries of each key head in a 16-dimensional subspace of their own plus isotropic noise (0.3), values
  likewise in a subspace per value head, with a scale per head log-uniform in [0.1, 2] and per channel
  (log-normal, sigma 0.5); all rounded to bf16 (kn and qn are L2-normalised, so their raw scale only meets the
  norm's 1e-6);
* ``beta = sigmoid(b)`` uniform in (0.05, 0.9) (``b`` rounded to bf16; beta rounded to bf16 as the models carry it);
* the prefill state: the fp64 dense recurrence over ``prefill`` tokens from zero, stored as fp32 (a prefill's
  output); LeapQuant puts it into the pool with :meth:`leapquant.Pool.encode`, the bf16 state rounds it.

The pool holds the sequences in shuffled slots (not 1..B in order), and the batch has one padding row (``idx = -1``)
whose output must come out exactly zero (``out`` is filled with NaN before every call).

Run ``python -m leapquant.e2e --backend triton --out bench/results/E2E.md`` on a GPU for the record
(``--backend reference`` runs on a CPU too).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import bench, dispatch
from . import reference as ref
from .numerics import DEFAULT_HEADS, GATES, K, L, V
from .options import name_word as _word

METHODS = ("leapquant", "fp32 state", "bf16 state")   #: the methods judged against the fp64 state, in table order
SUBSPACE = 16          #: dimension of each head's key / query / value subspace
NOISE = 0.3            #: isotropic part of keys, queries and values (relative to the subspace part)
FORGET_P = 0.02        #: share of gate pre-activations that jump (a channel that forgets)
EXTRA_QKV_COLUMNS = 64  #: the qkv rows are a slice of a wider buffer (an engine's projection output)


# ---- the inputs --------------------------------------------------------------------------------------------------------
@dataclass
class Layer:
    """The per-head constants and the token source of one simulated layer (CPU tensors).

    A_log fp32 [H]; dt_bias fp32 [H, K] (KDA) or [H] (GDN); key_basis fp32 [Hk, K, SUBSPACE]; value_basis fp32
    [H, V, SUBSPACE]; value_scale fp32 [H, V]."""
    gate: str
    heads: int
    k_heads: int
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    key_basis: torch.Tensor
    value_basis: torch.Tensor
    value_scale: torch.Tensor
    gen: torch.Generator = field(repr=False)

    @classmethod
    def draw(cls, gate: str, heads: int, k_heads: int, seed: int) -> "Layer":
        g = torch.Generator().manual_seed(seed)
        A_log = torch.log(1.0 + 15.0 * torch.rand(heads, generator=g))
        shape = (heads, K) if gate == "kda" else (heads,)
        dt = torch.exp(math.log(1e-4) + (math.log(1e-1) - math.log(1e-4)) * torch.rand(shape, generator=g))
        dt_bias = dt + torch.log(-torch.expm1(-dt))                  # softplus(dt_bias) = dt
        key_basis = torch.randn(k_heads, K, SUBSPACE, generator=g) / math.sqrt(SUBSPACE)
        value_basis = torch.randn(heads, V, SUBSPACE, generator=g) / math.sqrt(SUBSPACE)
        head_scale = torch.exp(math.log(0.1) + (math.log(2.0) - math.log(0.1)) * torch.rand(heads, 1, generator=g))
        value_scale = head_scale * torch.exp(0.5 * torch.randn(heads, V, generator=g))
        return cls(gate, heads, k_heads, A_log, dt_bias, key_basis, value_basis, value_scale, g)

    def tokens(self, n: int) -> dict[str, torch.Tensor]:
        """One token for each of ``n`` sequences: qx, kx bf16 [n, Hk, K], vx bf16 [n, H, V], a bf16 [n, H, K] (KDA)
        or [n, H] (GDN), b bf16 [n, H]."""
        g, H, Hk = self.gen, self.heads, self.k_heads

        def in_subspace(basis: torch.Tensor, lead: int) -> torch.Tensor:
            coef = torch.randn(n, lead, SUBSPACE, 1, generator=g)
            return (basis @ coef).squeeze(-1) + NOISE * torch.randn(n, lead, basis.shape[-2], generator=g)

        kx = in_subspace(self.key_basis, Hk)
        qx = in_subspace(self.key_basis, Hk)
        vx = self.value_scale * in_subspace(self.value_basis, H)
        a_shape = (n, H, K) if self.gate == "kda" else (n, H)
        jump = torch.rand(a_shape, generator=g) < FORGET_P
        a = 0.5 * torch.randn(a_shape, generator=g) + jump * (3.0 + 3.0 * torch.rand(a_shape, generator=g))
        p = 0.05 + 0.85 * torch.rand(n, H, generator=g)
        b = torch.log(p / (1.0 - p))
        bf = torch.bfloat16
        return dict(qx=qx.to(bf), kx=kx.to(bf), vx=vx.to(bf), a=a.to(bf), b=b.to(bf))


# ---- the dense recurrence ----------------------------------------------------------------------------------------------
def dense_step(S: torch.Tensor, tok: dict[str, torch.Tensor], A_log: torch.Tensor, dt_bias: torch.Tensor,
               gate: str, beta_bf16: bool = True) -> torch.Tensor:
    """One token of the dense recurrence on S [n, H, V, K] in S's dtype, in place; returns o [n, H, V] (S's dtype).

    tok: the bf16 token of :meth:`Layer.tokens` (qx, kx [n, Hk, K]) on S's device; A_log fp32 [H], dt_bias fp32
    [H, K] / [H]. The order is the reference step's: decay by this token's gate, ``u``, ``o``, then ``S += u kn^T``."""
    dt, H = S.dtype, S.shape[-3]
    kn = ref.l2_normalise(ref.expand_key_heads(tok["kx"], H), dt)
    qn = ref.l2_normalise(ref.expand_key_heads(tok["qx"], H), dt) * K ** -0.5
    decay = torch.exp(ref.log_gate(tok["a"], A_log, dt_bias, dt))
    S.mul_(decay.unsqueeze(-2) if gate == "kda" else decay[..., None, None])
    u, o = ref.delta_rule(S, kn, qn, tok["vx"], ref.step_beta(tok["b"], beta_bf16, dt))
    S.addcmul_(u.unsqueeze(-1), kn.unsqueeze(-2))
    return o


# ---- the result ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    """The errors of one simulated decode: ``errors[method]`` the relative error of o over the last ``last``
    tokens (all sequences and heads), ``worst_head[method]`` the largest of the same per head; ``windows[i][method]``
    the relative error over decode tokens ``i L .. (i + 1) L - 1`` (every window of the run, the last one possibly
    shorter); ``backends``: the backend that served each op (``step``, ``flush``); ``padding_zero``: the padding row's
    output was exactly zero at every token; ``finite``: every output of every method was finite; ``seconds``: wall
    time of the pool's calls (one :func:`leapquant.decode_inplace` per token, each followed by a device
    synchronisation), ``token_seconds`` the median of one call (which the first call's compilation does not move)."""
    gate: str
    backend: str
    device: str
    batch: int
    heads: int
    k_heads: int
    tokens: int
    last: int
    prefill: int
    seed: int
    errors: dict[str, float]
    worst_head: dict[str, float]
    windows: list[dict[str, float]]
    backends: dict[str, str]
    padding_zero: bool
    finite: bool
    seconds: float
    token_seconds: float

    @property
    def passed(self) -> bool:
        """LeapQuant no worse than the bf16 state, the padding row zero, everything finite."""
        return (self.finite and self.padding_zero
                and self.errors["leapquant"] <= self.errors["bf16 state"])

    def summary(self) -> str:
        errs = ", ".join(f"{m} {self.errors[m]:.3e} (worst head {self.worst_head[m]:.3e})" for m in METHODS)
        return (f"{self.gate} / {self.backend}: relative error of o over the last {self.last} tokens: {errs}; "
                f"padding row zero: {self.padding_zero}; finite: {self.finite}")


# ---- the simulation -----------------------------------------------------------------------------------------------
def simulate(gate: str, *, backend: str | None = None, device: torch.device | str = "cpu", batch: int = 8,
             heads: int = DEFAULT_HEADS, k_heads: int | None = None, tokens: int = 512, last: int = 128, prefill: int = 256,
             seed: int = 0) -> Result:
    """Decode ``tokens`` tokens of ``batch`` sequences (``heads`` value heads; ``k_heads`` key heads, default
    ``heads`` for KDA and ``heads // 2`` for GDN: Qwen3-Next's 16 / 32) from a prefill of ``prefill`` tokens, through
    the pool on ``backend`` (None: the dispatch's choice) and the three dense recurrences, on ``device``; returns the
    errors of the last ``last`` tokens (see the module's docstring)."""
    import leapquant as lq

    if gate not in GATES:
        raise ValueError(f"gate: expected 'kda' or 'gdn', got {gate!r}")
    if not 1 <= last <= tokens:
        raise ValueError(f"last: expected 1 <= last <= tokens ({tokens}), got {last}")
    device = torch.device(device)
    hk = k_heads if k_heads is not None else (heads if gate == "kda" else max(1, heads // 2))
    layer = Layer.draw(gate, heads, hk, seed)
    A_log, dt_bias = layer.A_log.to(device), layer.dt_bias.to(device)

    def on_device(tok: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in tok.items()}

    def row_inputs(tok: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A token as the step's rows: qkv bf16 [n, 2 Hk K + H V] (q | k | v), a and b as they are."""
        qkv_rows = torch.cat([tok["qx"].flatten(1), tok["kx"].flatten(1), tok["vx"].flatten(1)], dim=1)
        return dict(qkv=qkv_rows, a=tok["a"], b=tok["b"])

    with torch.inference_mode():
        # the prefill state: the exact recurrence from zero, kept as fp32 as a prefill leaves it
        S64 = torch.zeros(batch, heads, V, K, dtype=torch.float64, device=device)
        for _ in range(prefill):
            dense_step(S64, on_device(layer.tokens(batch)), A_log, dt_bias, gate)
        prefill_state = S64.float()
        S64 = prefill_state.double()
        S32 = prefill_state.clone()
        S16 = prefill_state.bfloat16()

        # the pool: sequences in shuffled slots, rows in another order, one padding row (-1)
        g = torch.Generator().manual_seed(seed + 1)
        num_slots = 2 * batch + 3
        slots = (torch.randperm(num_slots - 1, generator=g)[:batch] + 1).tolist()
        rows = batch + 1
        pad_row = int(torch.randint(0, rows, (1,), generator=g))
        seq_rows = torch.tensor([r for r in range(rows) if r != pad_row], device=device)
        idx = torch.full((rows,), -1, dtype=torch.int32)
        idx[seq_rows.cpu()] = torch.tensor(slots, dtype=torch.int32)
        idx = idx.to(device)
        pool = lq.Pool(num_slots, heads, device=device, gate=gate)
        pool.reset_slots(slots)
        pool.encode(slots, prefill_state)
        q0 = lq.default_q0(device)
        backends = {op: dispatch.select(pool, rows, backend, op=op).name for op in ("step", "flush")}

        width = 2 * hk * K + heads * V
        qkv_buf = torch.zeros(rows, width + EXTRA_QKV_COLUMNS, dtype=torch.bfloat16, device=device)
        qkv = qkv_buf[:, :width]                       # row stride wider than the row, as a projection's slice
        a_rows = torch.zeros((rows, heads, K) if gate == "kda" else (rows, heads), dtype=torch.bfloat16,
                             device=device)
        b_rows = torch.zeros(rows, heads, dtype=torch.bfloat16, device=device)
        out = torch.empty(rows, heads, V, dtype=torch.bfloat16, device=device)

        err_sq = {m: torch.zeros(heads, dtype=torch.float64, device=device) for m in METHODS}
        ref_sq = torch.zeros(heads, dtype=torch.float64, device=device)
        n_windows = -(-tokens // L)
        win_err_sq = torch.zeros(n_windows, len(METHODS), dtype=torch.float64, device=device)
        win_ref_sq = torch.zeros(n_windows, dtype=torch.float64, device=device)
        padding_bad = torch.zeros((), dtype=torch.bool, device=device)
        not_finite = torch.zeros((), dtype=torch.bool, device=device)
        call_seconds = []
        for t in range(tokens):
            tok = on_device(layer.tokens(batch))
            junk = on_device(layer.tokens(1))           # what a padding row may hold: ignored by the step
            seq_in, pad_in = row_inputs(tok), row_inputs(junk)
            for name, dst in (("qkv", qkv), ("a", a_rows), ("b", b_rows)):
                dst[seq_rows] = seq_in[name]
                dst[pad_row] = pad_in[name][0]

            out.fill_(float("nan"))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            lq.decode_inplace(pool, idx, qkv, a_rows, b_rows, A_log, dt_bias, q0, out, num_k_heads=hk,
                              backend=backend)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            call_seconds.append(time.perf_counter() - t0)
            padding_bad |= (out[pad_row] != 0).any()

            o64 = dense_step(S64, tok, A_log, dt_bias, gate)
            o32 = dense_step(S32, tok, A_log, dt_bias, gate).to(torch.bfloat16)
            S16_work = S16.float()
            o16 = dense_step(S16_work, tok, A_log, dt_bias, gate).to(torch.bfloat16)
            S16.copy_(S16_work)
            outs = {"leapquant": out[seq_rows], "fp32 state": o32, "bf16 state": o16}
            ref_head = o64.square().sum(dim=(0, 2))                  # per head, this token
            win_ref_sq[t // L] += ref_head.sum()
            if t >= tokens - last:
                ref_sq += ref_head
            for i, (m, o) in enumerate(outs.items()):
                not_finite |= ~torch.isfinite(o).all()
                err_head = (o.double() - o64).square().sum(dim=(0, 2))
                win_err_sq[t // L, i] += err_head.sum()
                if t >= tokens - last:
                    err_sq[m] += err_head

    errors = {m: math.sqrt(float(err_sq[m].sum()) / float(ref_sq.sum())) for m in METHODS}
    worst = {m: float((err_sq[m] / ref_sq.clamp_min(1e-300)).sqrt().max()) for m in METHODS}
    win_rel = (win_err_sq / win_ref_sq.clamp_min(1e-300).unsqueeze(1)).sqrt().cpu()
    windows = [dict(zip(METHODS, map(float, row))) for row in win_rel]
    chosen = backend if backend is not None else "auto"
    return Result(gate=gate, backend=chosen, device=str(device), batch=batch, heads=heads, k_heads=hk,
                  tokens=tokens, last=last, prefill=prefill, seed=seed, errors=errors, worst_head=worst,
                  windows=windows, backends=backends, padding_zero=not bool(padding_bad),
                  finite=not bool(not_finite), seconds=sum(call_seconds),
                  token_seconds=statistics.median(call_seconds))


# ---- the record ----------------------------------------------------------------------------------------------------
def markdown_table(results: list[Result]) -> str:
    """The table ``gate | method | relative error of o over the last N tokens | worst head | / bf16 state`` of
    ``results`` (one row per gate and method; the last column: the error over the bf16 state's)."""
    last = sorted({r.last for r in results})
    lines = [f"| gate | method | rel. error of o, last {'/'.join(map(str, last))} tokens | worst head | / bf16 state |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        for m in METHODS:
            ratio = r.errors[m] / r.errors["bf16 state"] if r.errors["bf16 state"] > 0 else float("nan")
            lines.append(f"| {r.gate} | {m} | {r.errors[m]:.3e} | {r.worst_head[m]:.3e} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def render(results: list[Result], *, device: str, commit: str, command: str) -> str:
    """The markdown report: what was run, on what, and the table."""
    from .dispatch import versions
    v = versions()
    r0 = results[0]
    gates = ", ".join(f"{r.gate} ({r.heads} value heads, {r.k_heads} key heads)" for r in results)
    verdicts = "; ".join(f"{r.gate}: {'yes' if r.passed else 'NO'}" for r in results)
    lines = [
        "# End-to-end decode accuracy",
        "",
        "A simulated decode of one layer through `leapquant.decode_inplace` (step + flush of the windows it fills, one "
        "call per token) against the dense recurrence with its state in fp64 (the truth), fp32 and bf16 (computed in "
        "fp32, rounded to bf16 after every token); every method sees the same bf16 inputs and emits o in bf16. The "
        "inputs, the prefill state and the metric are described in `leapquant/e2e.py`.",
        "",
        f"- device: {device}",
        f"- backend: {r0.backend} (" + "; ".join(f"{r.gate}: step {r.backends['step']}, flush {r.backends['flush']}"
                                                 for r in results) + ")",
        f"- versions: python {v['python']}, torch {v['torch']}, triton {v['triton']}, tilelang {v['tilelang']}",
        f"- commit: {commit}",
        f"- run: batch {r0.batch} sequences (shuffled slots, one padding row), {gates}, prefill {r0.prefill} tokens, "
        f"{r0.tokens} decode tokens ({r0.tokens // L} flushes per program), seed {r0.seed}",
        f"- metric: ||o - o_exact||_F / ||o_exact||_F over the last {r0.last} tokens, every sequence and head; "
        "worst head: the same per head, the largest",
        f"- padding row output exactly zero: {', '.join(f'{r.gate} {r.padding_zero}' for r in results)}; "
        f"all outputs finite: {', '.join(f'{r.gate} {r.finite}' for r in results)}",
        f"- requirement (leapquant no worse than the bf16 state, padding zero, finite): {verdicts}",
        f"- command: `{command}`",
        "",
        markdown_table(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m leapquant.e2e``: run both gates (or those asked for), print the table, write it to ``--out``.
    Exit status 0 when every gate meets the requirement, 1 otherwise, 2 for options that cannot run."""
    parser = argparse.ArgumentParser(prog="python -m leapquant.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", type=_word, default=None, choices=dispatch.CHOICES,
                        help="leapquant backend (default: the dispatch's choice)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--gates", nargs="+", type=_word, choices=GATES, default=list(GATES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--last", type=int, default=None, help="tokens judged, the last of the decode "
                                                                 "(default 128, or every token of a shorter decode)")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="markdown file to write the report to")
    parser.add_argument("--commit", default=None, help="commit recorded in the report (default: git of the checkout)")
    args = parser.parse_args(argv)
    last = args.last if args.last is not None else min(128, args.tokens)

    from .options import UsageError, parse_device
    try:
        problem = dispatch.env_problem() if args.backend is None else None
        if problem:
            raise UsageError(problem)
        if args.batch < 1 or args.heads < 1 or args.tokens < 1 or args.prefill < 0:
            raise UsageError("--batch, --heads and --tokens must be positive, --prefill at least 0")
        if not 1 <= last <= args.tokens:
            raise UsageError(f"--last must lie in [1, --tokens = {args.tokens}], got {last}")
        device = parse_device(args.device)
    except UsageError as e:
        print(f"python -m leapquant.e2e: error: {e}", file=sys.stderr)
        return 2
    results = []
    for gate in args.gates:
        t0 = time.perf_counter()
        r = simulate(gate, backend=args.backend, device=device, batch=args.batch, heads=args.heads,
                     tokens=args.tokens, last=last, prefill=args.prefill, seed=args.seed)
        print(f"{r.summary()} [{time.perf_counter() - t0:.1f} s, {r.seconds:.1f} s in decode_inplace]", flush=True)
        results.append(r)
    command = "python -m leapquant.e2e " + " ".join(argv if argv is not None else sys.argv[1:])
    report = render(results, device=dispatch.device_description(device), commit=args.commit or bench.git_commit(),
                    command=command)
    print(markdown_table(results), end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        print(f"wrote {out}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
