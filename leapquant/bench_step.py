"""``leapquant bench --op step|decode``: time the decode step and the decode token beside fla's stock decode.

* ``--op step``: ``leapquant.step_inplace`` of every row (every program stepping), with the window held at one fill
  count per row of the table (``--fill``, default ``1 15``: one live entry as the request's benchmark has it, and a
  full window); every call finds its fill counts as set, restored outside every call's time (the kernel timer
  after each round over the slot sets, the event timers before each call, the wall timer before each run). Memory
  bound: every program x
  ``step_program_bytes(gate)`` (SPEC section 7) at the copy bandwidth measured in the same run.
* ``--op decode``: ``leapquant.decode_inplace`` (the step, then the flush of the windows it filled) at the steady state
  of serving: the fill counts staggered so that 1/16 of the programs are due in every call, as they are when each
  sequence flushes every 16 tokens. Bound: the step's bytes plus the due programs' ``due_program_bytes(gate)``.
* beside them, in the same run (``--fla``, on by default where fla is installed): fla's ``fused_recurrent_kda``
  decode of one token with the state in fp32 and in bf16 (``fla-fp32``, ``fla-bf16``), in place in a state pool
  addressed by slot indices as vLLM calls it, the gate, beta's sigmoid and the q / k normalisation inside the kernel.
  GDN runs through the same fla kernel with the head's gate broadcast over its key channels (fla's GDN recurrent
  kernel has no slot indices and writes a fresh fp32 state); its state traffic is the same as a GDN decode's.

Every point is L2-cold (``--rotate`` disjoint slot sets in rotation) and timed as the flush is (``--timer``). The
project's backends are judged in the same run by the SPEC section 7 criterion (``criterion.judge_step``) on the step
families (``leapquant.step_families``) tiled to the batch, through the same pool and deployment call; fla's rows are
not judged (a different state format), their ``x fla`` columns compare times.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .numerics import L
from .bench_common import Row, _fmt, _one_line, _percentile, slot_sets, time_calls, time_calls_kernel, time_calls_wall

#: what `leapquant bench --op` times (dispatch.OPS: what a backend serves; decode = step + the flush it makes due)
BENCH_OPS = ("flush", "step", "decode")
DEFAULT_FILLS = (1, L - 1)
FLA_STATES = {"fla-fp32": "float32", "fla-bf16": "bfloat16"}


def fla_available() -> str | None:
    """None when fla's KDA recurrent kernel imports, else why not."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: F401
    except Exception as e:
        return "fla not importable: " + _one_line(e, 160)
    return None


@dataclass
class TokenSets:
    """One decode token per row for each slot set, in the deployment form's layout: ``qkv`` bf16 [N, 2 Hk K + H V],
    ``a`` bf16 [N, H, K] (KDA) / [N, H] (GDN), ``b`` bf16 [N, H], ``out`` bf16 [N, H, V]; per-head ``A_log``,
    ``dt_bias``."""
    qkv: list
    a: list
    b: list
    out: list
    A_log: Any
    dt_bias: Any
    num_k_heads: int


@dataclass
class StepPoint:
    """What one (gate, batch) shares between its targets: the slot sets, their int32 idx, the tiled case and tokens."""
    gate: str
    batch: int
    sets: list
    idx: list
    case: Any                        # StepCase of the batch (tiled from the check rows)
    tokens: TokenSets
    extra: dict = field(default_factory=dict)


def num_k_heads_for(gate: str, heads: int) -> int:
    """Key heads: KDA one per value head; GDN as Qwen3-Next, half the value heads (GQA) where they divide."""
    return heads // 2 if gate == "gdn" and heads % 2 == 0 else heads


def tile_case(case, batch: int):
    """``case`` (a StepCase of r rows) tiled to ``batch`` rows, its labels and fp64 exact values alike."""
    import torch

    from .step_families import StepCase

    def tile(x):
        reps = -(-batch // x.shape[0])
        return (torch.cat([x] * reps) if reps > 1 else x)[:batch]
    per_head = ("A_log", "dt_bias")
    t = {k: (v if k in per_head else tile(v)) for k, v in case.tensors.items()}
    labels = [case.labels[b % case.batch] for b in range(batch)]
    out = StepCase(case.gate, t, labels, case.q0, {k: tile(v) for k, v in case.token_scale.items()})
    for flag, ex in case._exact.items():
        out._exact[flag] = type(ex)(ex.gate, {k: tile(v) for k, v in ex.values.items()},
                                    {k: tile(v) for k, v in ex.magnitude.items()}, tile(ex.g), tile(ex.live))
    return out


def read_step_outputs(pool, slots, h_before, gate: str, out):
    """The functional step's outputs of rows ``slots`` (long [B]) after one step_inplace: ``out`` and the entry each
    program appended at its fill count ``h_before`` (int [B, H], L read as 0), the weights and the gate state."""
    import torch

    from .layout import L
    B, H = h_before.shape
    entry = torch.where(h_before == L, torch.zeros_like(h_before), h_before).long()
    si = slots.long().unsqueeze(1).expand(B, H)
    hi = torch.arange(H, device=slots.device).unsqueeze(0).expand(B, H)
    head = (out, pool.kbuf[si, hi, entry], pool.ubuf[si, hi, entry])
    if gate == "kda":
        return head + (pool.gbuf[si, hi, entry], pool.w[slots], pool.pcum[slots])
    return head + (pool.w[slots], pool.p[slots])


def make_tokens(case, sets: int, device) -> TokenSets:
    """The case's token (tiled rows) for every slot set, in the deployment form's layout."""
    import torch

    from .layout import V
    t = case.tensors
    qkv = case.qkv().to(device)
    a, b = t["a"].to(device), t["b"].to(device)
    return TokenSets(qkv=[qkv.clone() for _ in range(sets)], a=[a.clone() for _ in range(sets)],
                     b=[b.clone() for _ in range(sets)],
                     out=[torch.empty(case.batch, case.heads, V, dtype=torch.bfloat16, device=device)
                          for _ in range(sets)],
                     A_log=t["A_log"].to(device), dt_bias=t["dt_bias"].to(device), num_k_heads=case.num_k_heads)


# ---- targets ----------------------------------------------------------------------------------------------------
@dataclass
class OpTarget:
    """One column of a step / decode benchmark: a project backend (``kind='backend'``) or fla (``kind='fla'``)."""
    name: str
    kind: str
    unavailable: str | None = None


def op_targets(names: Sequence[str], fla: bool) -> list[OpTarget]:
    """The project backends asked for (each with the dispatch's reasons when it has no step kernel on this machine
    is found at its first pool), then fla's two state formats when ``fla``."""
    out = [OpTarget(n, "backend") for n in dict.fromkeys(names) if n.lower() != "none"]
    if fla:
        why = fla_available()
        out += [OpTarget(n, "fla", why) for n in FLA_STATES]
    return out


class FlaState:
    """fla's decode state pool for one gate: [num_slots, H, V, K] in fp32 or bf16 (``state_v_first``), and the
    per-set inputs in fla's layout ([N, 1, heads, dim], contiguous), derived from the same tokens."""

    def __init__(self, dtype_name: str, num_slots: int, point: StepPoint, device) -> None:
        import torch

        from .layout import K, V
        H, hk = point.case.heads, point.tokens.num_k_heads
        self.state = torch.empty(num_slots, H, V, K, dtype=getattr(torch, dtype_name), device=device)
        self.state.normal_(0.0, 0.02)
        tk, N = point.tokens, point.batch
        self.inputs = []
        for s in range(len(point.sets)):
            qkv = tk.qkv[s]
            q = qkv[:, :hk * K].reshape(N, 1, hk, K).contiguous()
            k = qkv[:, hk * K:2 * hk * K].reshape(N, 1, hk, K).contiguous()
            v = qkv[:, 2 * hk * K:].reshape(N, 1, H, V).contiguous()
            a = tk.a[s] if point.gate == "kda" else tk.a[s].unsqueeze(-1).expand(N, H, K)
            g = a.reshape(N, 1, H, K).contiguous()
            beta = tk.b[s].reshape(N, 1, H).contiguous()
            o = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device=device)
            self.inputs.append((q, k, v, g, beta, o))
        dt = tk.dt_bias if point.gate == "kda" else tk.dt_bias.unsqueeze(-1).expand(H, K)
        self.A_log, self.dt_bias = tk.A_log.contiguous(), dt.contiguous().float()
        self.idx = point.idx

    def call(self, s: int) -> None:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        q, k, v, g, beta, o = self.inputs[s]
        fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=self.state,
                                inplace_final_state=True, state_v_first=True, ssm_state_indices=self.idx[s],
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, out=o)


# ---- the run ------------------------------------------------------------------------------------------------------
def _time(run, call: Callable[[int], None], prepare: Callable[[int], None] | None, reference: bool):
    a, plan = run.args, run.plan
    if plan.on_gpu and not reference and a.timer == "kernel":
        return time_calls_kernel(call, a.rotate, plan.repeats, plan.device, prepare=prepare)
    if a.timer == "wall":
        return time_calls_wall(call, a.rotate, plan.repeats, plan.device, a.max_seconds, prepare=prepare)
    return time_calls(call, a.rotate, plan.repeats, plan.device, a.max_seconds,
                      capture=plan.on_gpu and not reference and a.timer == "graph", host_sync=reference,
                      prepare=prepare)


def _fill_row(row: Row, samples: list, method: str, nprog: int, nbytes: float, bw_gbs: float) -> None:
    row.median_us, row.p20_us, row.p80_us = (_percentile(samples, 50), _percentile(samples, 20),
                                             _percentile(samples, 80))
    row.samples, row.timing, row.due_programs = len(samples), method, nprog
    row.bound_us = nbytes / (bw_gbs * 1e9) * 1e6
    row.ratio = row.median_us / row.bound_us if row.bound_us > 0 else float("nan")


def check_step(name: str, pool, point: StepPoint, run) -> tuple[str, float, str]:
    """(verdict, worst score, message): the tiled step families loaded into the first slot set, one step_inplace
    through ``name``, the outputs read back and judged by the SPEC section 7 criterion (fp64)."""
    import torch

    import leapquant
    if not run.args.refcheck:
        return "unchecked (--no-refcheck)", float("nan"), ""
    try:
        case, tk = point.case, point.tokens
        slots = point.sets[0]
        case.load_into(pool, slots)
        h0 = pool.hcnt[slots].clone()
        out = torch.full_like(tk.out[0], float("nan"))
        leapquant.step_inplace(pool, point.idx[0], tk.qkv[0], tk.a[0], tk.b[0], tk.A_log, tk.dt_bias, out,
                               num_k_heads=tk.num_k_heads, backend=name)
        got = [x.cpu() for x in read_step_outputs(pool, slots, h0, point.gate, out)]
        v = case.judge(got, name=name)
        return ("PASS" if v.passed else "FAIL"), float(v.worst_score), v.message
    except Exception as e:
        return "error: " + _one_line(e, 200), float("nan"), "error: " + _one_line(e, 600)


def measure_ops(run, targets: Sequence[OpTarget]) -> None:
    """Every (gate, batch) of ``run``: the project targets checked and timed, then fla's, appending rows."""
    import torch

    from .layout import L, Pool, due_program_bytes, step_program_bytes
    from .step_families import make_step_case
    a, plan, dev = run.args, run.plan, run.plan.device
    op, heads = a.op, a.heads
    num_slots = a.rotate * max(plan.batches) + 9
    bw = run.env["bandwidth_gbs"]
    for gate in a.gate:
        hk = num_k_heads_for(gate, heads)
        base = make_step_case(min(a.check_rows, max(plan.batches)), heads, gate, a.seed, "cpu", num_k_heads=hk)
        base.exact()
        pool = None
        for batch in plan.batches:
            sets = slot_sets(a.rotate, batch, a.seed, dev)
            point = StepPoint(gate, batch, sets, [s.to(torch.int32) for s in sets], None, None)
            point.case = tile_case(base, batch)
            point.tokens = make_tokens(point.case, a.rotate, dev)
            for tgt in targets:
                labels = ([f"h={f}" for f in a.fill] if op == "step" else ["staggered"])
                if tgt.unavailable or (tgt.name == "reference" and a.ref_max_batch and batch > a.ref_max_batch):
                    why = tgt.unavailable or f"skipped: batch > --ref-max-batch {a.ref_max_batch}"
                    for lab in labels:
                        run.rows.append(Row(backend=tgt.name, gate=gate, batch=batch, heads=heads, due=lab,
                                            verdict=why if why.startswith("skipped") else "unavailable: " + why,
                                            op=op))
                    continue
                if tgt.kind == "fla":
                    _measure_fla(run, tgt, point, num_slots, labels, bw)
                    continue
                if pool is None:
                    pool = Pool(num_slots, heads, device=dev, gate=gate)
                verdict, worst, message = check_step(tgt.name, pool, point, run)
                run.prog.log(f"{tgt.name} {gate} b={batch}: check {verdict[:60]}")
                for lab in labels:
                    row = Row(backend=tgt.name, gate=gate, batch=batch, heads=heads, due=lab, verdict=verdict,
                              worst_ratio=worst, message=message, op=op)
                    try:
                        _time_project(run, tgt, pool, point, lab, row, bw, step_program_bytes(gate),
                                      due_program_bytes(gate))
                    except Exception as e:
                        row.verdict = verdict + "; timing error: " + _one_line(e, 200)
                        with contextlib.suppress(Exception):
                            if plan.on_gpu:
                                torch.cuda.synchronize(dev)
                    run.rows.append(row)
                    run.prog.log(f"{tgt.name} {gate} b={batch} {op} {lab}: {_fmt(row.median_us)} us")
        del pool
        if plan.on_gpu:
            torch.cuda.empty_cache()
    _ = L


def _time_project(run, tgt: OpTarget, pool, point: StepPoint, label: str, row: Row, bw: float, step_bytes: int,
                  flush_bytes: int) -> None:
    import torch

    import leapquant
    from .layout import L
    a, dev = run.args, run.plan.device
    tk, heads, batch = point.tokens, point.case.heads, point.batch
    for s, slots in enumerate(point.sets):
        point.case.load_into(pool, slots)
    nprog = batch * heads
    if a.op == "step":
        fill = int(label.split("=")[1])
        fills = [torch.full((batch, heads), fill, dtype=torch.int32, device=dev) for _ in point.sets]

        def prepare(s):
            pool.hcnt[point.sets[s]] = fills[s]

        def call(s):
            leapquant.step_inplace(pool, point.idx[s], tk.qkv[s], tk.a[s], tk.b[s], tk.A_log, tk.dt_bias,
                                   tk.out[s], num_k_heads=tk.num_k_heads, backend=tgt.name)
        nbytes = nprog * step_bytes
        ndue = 0
    else:
        # staggered fill counts: program (r, h) of set s at (r * H + h + s) mod L, L - 1 due after this call's step
        prepare = None
        prog = torch.arange(nprog, device=dev, dtype=torch.int32).reshape(batch, heads)
        for s, slots in enumerate(point.sets):
            pool.hcnt[slots] = (prog + s) % L
        q0 = leapquant.default_q0(dev)

        def call(s):
            leapquant.decode_inplace(pool, point.idx[s], tk.qkv[s], tk.a[s], tk.b[s], tk.A_log, tk.dt_bias, q0,
                                     tk.out[s], num_k_heads=tk.num_k_heads, backend=tgt.name)
        ndue = -(-nprog // L)
        nbytes = nprog * step_bytes + nprog / L * flush_bytes
    if run.plan.on_gpu:
        torch.cuda.synchronize(dev)
    samples, method = _time(run, call, prepare, tgt.name == "reference")
    _fill_row(row, samples, method, nprog, nbytes, bw)
    if a.op == "decode":
        row.message = (row.message + "; " if row.message else "") + f"{ndue} of {nprog} programs due per call"


def _measure_fla(run, tgt: OpTarget, point: StepPoint, num_slots: int, labels: Sequence[str], bw: float) -> None:
    import torch

    from .layout import K, V
    dev = run.plan.device
    nprog = point.batch * point.case.heads
    state_bytes = V * K * (4 if tgt.name == "fla-fp32" else 2)
    try:
        st = FlaState(FLA_STATES[tgt.name], num_slots, point, dev)
        samples, method = _time(run, st.call, None, False)
        verdict = "not judged (fla: the stock recurrence)"
    except Exception as e:
        samples, method, verdict = [], "", "error: " + _one_line(e, 200)
        st = None
    for lab in labels:
        row = Row(backend=tgt.name, gate=point.gate, batch=point.batch, heads=point.case.heads, due=lab,
                  verdict=verdict, op=run.args.op)
        if samples:
            _fill_row(row, samples, method, nprog, nprog * 2 * state_bytes, bw)
            row.message = "bound: the state read and written"
        run.rows.append(row)
        run.prog.log(f"{tgt.name} {point.gate} b={point.batch}: {_fmt(row.median_us)} us")
    del st
    if run.plan.on_gpu:
        torch.cuda.empty_cache()


def op_table(rows: Sequence[Row]) -> str:
    """The markdown table of a step / decode run, with each project row's speed-up over fla's two states at the same
    gate and batch."""
    fla = {(r.backend, r.gate, r.batch): r.median_us for r in rows if r.backend in FLA_STATES}
    head = ("| backend | op | gate | batch | heads | window | median us | p20 us | p80 us | bound us | x bound "
            "| x fla-fp32 | x fla-bf16 | verdict | worst score |")
    lines = [head, "|" + "|".join([" --- "] * (head.count("|") - 1)) + "|"]
    for r in rows:
        sp = []
        for f in FLA_STATES:
            t = fla.get((f, r.gate, r.batch), float("nan"))
            sp.append(_fmt(t / r.median_us, 2) if r.backend not in FLA_STATES and not math.isnan(r.median_us)
                      and not math.isnan(t) else "—")
        verdict = r.verdict if len(r.verdict) <= 60 else r.verdict[:57] + "..."
        lines.append(f"| {r.backend} | {r.op} | {r.gate} | {r.batch} | {r.heads} | {r.due} | {_fmt(r.median_us)} "
                     f"| {_fmt(r.p20_us)} | {_fmt(r.p80_us)} | {_fmt(r.bound_us)} | {_fmt(r.ratio, 2)} "
                     f"| {sp[0]} | {sp[1]} | {verdict} | {_fmt(r.worst_ratio, 4)} |")
    return "\n".join(lines)
