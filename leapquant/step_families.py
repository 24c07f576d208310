"""Input families of the decode step (SPEC section 7), shared by the tests and (later) the benchmark.

A :class:`StepCase` holds the functional-form inputs of one step (leading dims [B, H]; the token's query and key per
key head, [B, Hk, K]); each program (b, h) draws from one family. Values come from torch under a seed, so a
(batch, heads, gate, seed, families, key heads) tuple is one reproducible case.

Families (every one for both gates):
    empty            fill count 0, the window zeroed (a reset slot after a prefill's encode)
    just_flushed     fill count L ("just flushed, empty", read as 0): w = 0, gates reset, stale keys and values left
                     behind by the flush (they must be ignored)
    full             fill count L - 1: fifteen live entries, the step fills the last one
    zero             an all-zero state (zero codes and tokens under positive scales, w = 0) and a zero value (and
                     key): every term of o and u_new is zero, so they must come out exactly zero
    zero_state       the same state with a real token: o = (kn . qn) beta v
    tiny, huge       checkpoint, window and value ~1e-4 (the key too: the norm's 1e-6 matters) / ~3e2 (window 1.5e3)
    decayed          a checkpoint decayed to nothing (KDA pcum ~ -1e4, GDN p subnormal)
    pcum_below_1000  KDA: half the channels with pcum in [-3000, -1000]; GDN: p the smallest subnormal
    gate_extremes    gate pre-activations past softplus's threshold (+30: the entry decays to nothing) and far below
                     it (-30: no decay), beta saturated (b = +-12)
    random           unstructured in-domain tensors (checkpoint, window, fill count)
    sim              a prefilled state compressed, then h steps of the reference itself (the window a decode builds)

:meth:`StepCase.next_step` gives the step after a case's: the reference's entry appended (a window it fills is
flushed by the reference, leaving the fill count L), then a fresh token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .families import (FP16_TINIEST, FP32_TINIEST, CaseTensors, _empty_window, _kda_gates, _low_rank_noise,
                       _random_checkpoint, check_draw)
from .layout import CHECKPOINT_FIELDS, K, L, R, V, Pool
from .reference import compress, default_q0, rebuild, step_reference

STEP_EDGE_FAMILIES = ("empty", "just_flushed", "full", "zero", "zero_state", "tiny", "huge", "decayed",
                      "pcum_below_1000", "gate_extremes")
STEP_FAMILIES = STEP_EDGE_FAMILIES + ("random", "sim")
TOKEN_NAMES = ("qx", "kx", "vx", "a", "b")


# ---- per-head constants and tokens ---------------------------------------------------------------------------------
def head_constants(heads: int, gate: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log fp32 [H] and dt_bias fp32 [H, K] (KDA) or [H] (GDN) as the models initialise them: A = exp(A_log) in
    [1, 16], dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (so softplus(a + dt_bias) ~ 0.01-0.3 and
    a step decays by exp(-0.01) .. exp(-5))."""
    A_log = torch.log(1.0 + 15.0 * torch.rand(heads, generator=g))
    shape = (heads, K) if gate == "kda" else (heads,)
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=g))
    return A_log, dt + torch.log(-torch.expm1(-dt))


def _token(n: int, gate: str, g: torch.Generator, vscale: torch.Tensor, kscale: torch.Tensor
           ) -> dict[str, torch.Tensor]:
    """One token per program (per value head; grouped later): qx, kx bf16 [n, K] (kx scaled by ``kscale`` [n]), vx
    bf16 [n, V] scaled by ``vscale`` [n], a bf16 [n, K] (KDA) or [n] (GDN), b bf16 [n]."""
    qx = torch.randn(n, K, generator=g)
    kx = torch.randn(n, K, generator=g) * kscale[:, None]
    vx = torch.randn(n, V, generator=g) * vscale[:, None]
    a = torch.randn((n, K) if gate == "kda" else (n,), generator=g)
    b = 2.0 * torch.randn(n, generator=g)
    bf = torch.bfloat16
    return dict(qx=qx.to(bf), kx=kx.to(bf), vx=vx.to(bf), a=a.to(bf), b=b.to(bf))


def _live_window(n: int, gate: str, g: torch.Generator, h: torch.Tensor, scale: float = 1.0
                 ) -> dict[str, torch.Tensor]:
    """A window with ``h`` [n] live entries as decode steps leave it: L2-normalised keys, values of ``scale``, KDA
    w = 1 with per-channel decays (gbuf) and their summed log (pcum), GDN weights decayed by the later gates and the
    gate product p; entries at and past h are empty (w = 0, gbuf = 1)."""
    live = torch.arange(L) < h[:, None]
    k = torch.randn(n, L, K, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    win = dict(kbuf=k.to(torch.bfloat16), ubuf=(scale * torch.randn(n, L, V, generator=g)).to(torch.bfloat16))
    if gate == "kda":
        logg, gbuf = _kda_gates(n, g)
        gbuf = torch.where(live[..., None], gbuf, torch.ones_like(gbuf))
        # pcum sums the stored (fp16) decays' logs: the checkpoint decays as the window's entries do
        logs = torch.log(gbuf.float().clamp_min(FP16_TINIEST))
        win.update(w=live.float(), gbuf=gbuf, pcum=logs.sum(dim=1))
    else:
        logg = torch.where(live, -torch.nn.functional.softplus(torch.randn(n, L, generator=g) - 2.0),
                           torch.zeros(n, L))
        after = torch.flip(torch.cumsum(torch.flip(logg, [1]), 1), [1]) - logg        # sum of the later gates
        win.update(w=live.float() * torch.exp(after), p=torch.exp(logg.sum(dim=1)).clamp_min(FP32_TINIEST))
    return win


def _zero_checkpoint(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Zero codes and tokens under positive scales: decodes to exactly 0."""
    return (torch.zeros(n, V, K, dtype=torch.int8), 0.05 + 0.2 * torch.rand(n, K, generator=g),
            0.1 + 0.5 * torch.rand(n, V, generator=g), torch.zeros(n, R, K, dtype=torch.float16),
            torch.zeros(n, R, V, dtype=torch.float16))


# ---- advancing a program by one step ------------------------------------------------------------------------------
def append_entry(t: dict[str, torch.Tensor], out: Sequence[torch.Tensor], gate: str, q0: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """The checkpoint and window after a step whose outputs are ``out`` (the functional form's tuple), leading dims
    [...]: entry h written (h = the fill count, L read as 0), the gate state replaced, h + 1; a window that is then
    full is flushed (the reference's re-compression), leaving the fill count L, as the pool after a flush."""
    t = dict(t)
    h = t["h"].long()
    h = torch.where(h == L, torch.zeros_like(h), h)
    this = (torch.arange(L) == h[..., None])
    if gate == "kda":
        _, k_row, u_row, g_row, t["w"], t["pcum"] = out
        t["gbuf"] = torch.where(this[..., None], g_row[..., None, :], t["gbuf"])
    else:
        _, k_row, u_row, t["w"], t["p"] = out
    t["kbuf"] = torch.where(this[..., None], k_row[..., None, :], t["kbuf"])
    t["ubuf"] = torch.where(this[..., None], u_row[..., None, :], t["ubuf"])
    t["h"] = (h + 1).to(torch.int32)
    full = t["h"] == L
    if bool(full.any()):
        ck = [t[n][full] for n in CHECKPOINT_FIELDS]
        gate_arg = dict(pcum=t["pcum"][full], gbuf=t["gbuf"][full]) if gate == "kda" else dict(p=t["p"][full])
        new = compress(rebuild(*ck, t["kbuf"][full], t["ubuf"][full], t["w"][full], **gate_arg), q0)
        for name, val in zip(CHECKPOINT_FIELDS, new):
            t[name] = t[name].clone()
            t[name][full] = val
        for name, val in _empty_window(int(full.sum()), gate).items():
            if name in ("kbuf", "ubuf"):
                continue                                      # the flush leaves keys and values behind
            t[name] = t[name].clone()
            t[name][full] = val
    return t


def _simulate(ck: tuple[torch.Tensor, ...], gate: str, g: torch.Generator, steps: torch.Tensor,
              A_log: torch.Tensor, dt_bias: torch.Tensor, q0: torch.Tensor, scale: float = 1.0
              ) -> dict[str, torch.Tensor]:
    """The window ``steps`` [n] (< L) reference decode steps build from checkpoint ``ck`` and an empty window
    (A_log, dt_bias: the constants of each program's head, [n] and [n, K] / [n])."""
    n = ck[0].shape[0]
    t = dict(zip(CHECKPOINT_FIELDS, ck), **_empty_window(n, gate), h=torch.zeros(n, dtype=torch.int32))
    ones = torch.ones(n)
    for i in range(int(steps.max()) if n else 0):
        tok = _token(n, gate, g, scale * ones, ones)
        args = [t[k].unsqueeze(0) for k in ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "w", "h")]
        args += [tok[k].unsqueeze(0) for k in TOKEN_NAMES] + [A_log, dt_bias]
        gate_kw = dict(gbuf=t["gbuf"][None], pcum=t["pcum"][None]) if gate == "kda" else dict(p=t["p"][None])
        out = [o[0] for o in step_reference(*args, **gate_kw)]
        new = append_entry(t, out, gate, q0)
        go = i < steps
        t = {k: torch.where(go.view(n, *([1] * (v.dim() - 1))), new[k], v) for k, v in t.items()}
    return t


# ---- the families (n programs at a time) --------------------------------------------------------------------------
def _step_family(name: str, n: int, gate: str, g: torch.Generator, q0: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every input of ``n`` programs of family ``name`` (CPU, leading dim [n]; the token per value head), plus the
    token scales ``vscale`` and ``kscale`` [n] (kept for the next step's token)."""
    h = torch.randint(1, L, (n,), generator=g, dtype=torch.int32)
    vscale, kscale = torch.ones(n), torch.ones(n)
    ck = compress(_low_rank_noise(n, g), q0)
    win = None
    if name == "empty":
        h = torch.zeros(n, dtype=torch.int32)
        win = _empty_window(n, gate)
    elif name == "just_flushed":
        win = _live_window(n, gate, g, torch.full((n,), L - 1))      # stale entries: only w and the gates reset
        win.update({k: v for k, v in _empty_window(n, gate).items() if k not in ("kbuf", "ubuf")})
        h = torch.full((n,), L, dtype=torch.int32)
    elif name == "full":
        h = torch.full((n,), L - 1, dtype=torch.int32)
    elif name in ("zero", "zero_state"):
        ck = _zero_checkpoint(n, g)
        win = _live_window(n, gate, g, h)
        win["w"] = torch.zeros(n, L)                                  # keys and values, but no weight: zero state
        if name == "zero":
            vscale, kscale = torch.zeros(n), torch.zeros(n)
    elif name == "tiny":
        ck = compress(_low_rank_noise(n, g, scale=1e-4), q0)
        win = _live_window(n, gate, g, h, scale=1e-4)
        vscale, kscale = torch.full((n,), 1e-4), torch.full((n,), 1e-4)
    elif name == "huge":
        ck = compress(_low_rank_noise(n, g, scale=3e2), q0)
        win = _live_window(n, gate, g, h, scale=1.5e3)
        vscale = torch.full((n,), 3e2)
    elif name == "decayed":
        win = _live_window(n, gate, g, h)
        if gate == "kda":
            win["pcum"] = -1e4 * (1.0 + torch.rand(n, K, generator=g))
        else:
            win["p"] = torch.full((n,), 2e-41)
    elif name == "pcum_below_1000":
        win = _live_window(n, gate, g, h)
        if gate == "kda":
            deep = torch.rand(n, K, generator=g) < 0.5
            win["pcum"] = torch.where(deep, -1000.0 - 2000.0 * torch.rand(n, K, generator=g), win["pcum"])
        else:
            win["p"] = torch.full((n,), FP32_TINIEST)
    elif name == "random":
        ck = _random_checkpoint(n, g)
        h = torch.randint(0, L, (n,), generator=g, dtype=torch.int32)
        live = torch.arange(L) < h[:, None]
        win = dict(kbuf=torch.randn(n, L, K, generator=g).to(torch.bfloat16),
                   ubuf=torch.randn(n, L, V, generator=g).to(torch.bfloat16),
                   w=torch.rand(n, L, generator=g) * live)
        if gate == "kda":
            gb = torch.rand(n, L, K, generator=g).clamp_min(1e-3)
            win.update(gbuf=torch.where(live[..., None], gb, torch.ones_like(gb)).to(torch.float16),
                       pcum=-20.0 * torch.rand(n, K, generator=g))
        else:
            win.update(p=torch.rand(n, generator=g).clamp_min(FP32_TINIEST))
    elif name == "sim":
        t = _simulate(compress(_low_rank_noise(n, g, scale=0.1), q0), gate, g, h, A_log, dt_bias, q0)
        t.update(_token(n, gate, g, vscale, kscale), vscale=vscale, kscale=kscale)
        return t
    elif name != "gate_extremes":
        raise ValueError(f"unknown step family {name!r}: expected one of {STEP_FAMILIES}")
    if win is None:
        win = _live_window(n, gate, g, h)
    tok = _token(n, gate, g, vscale, kscale)
    if name == "gate_extremes":
        pick = torch.randint(0, 3, tok["a"].shape, generator=g)
        a = torch.where(pick == 0, 30.0, torch.where(pick == 1, -30.0, tok["a"].float()))
        tok.update(a=a.to(torch.bfloat16), b=(12.0 * torch.sign(torch.randn(n, generator=g))).to(torch.bfloat16))
    return dict(zip(CHECKPOINT_FIELDS, ck), **win, h=h, **tok, vscale=vscale, kscale=kscale)


# ---- the case -------------------------------------------------------------------------------------------------------
@dataclass
class StepCase(CaseTensors):
    """Functional-form inputs of one step, leading dims [B, H] (qx, kx [B, Hk, K]); ``labels[b][h]`` is the family of
    program (b, h). ``token_scale`` holds each program's value and key scales (for :meth:`next_step`)."""
    gate: str
    tensors: dict[str, torch.Tensor]
    labels: list[list[str]]
    q0: torch.Tensor
    token_scale: dict[str, torch.Tensor] = field(repr=False)
    _exact: dict = field(default_factory=dict, repr=False)

    @property
    def num_k_heads(self) -> int:
        return self.tensors["qx"].shape[1]

    def math_args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of leapquant.reference.step_math / step_reference and criterion.exact_step (the gate
        tensors go by keyword: :meth:`gate_kwargs`)."""
        t = self.tensors
        return tuple(t[n] for n in ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "w", "h", "qx", "kx", "vx",
                                    "a", "b", "A_log", "dt_bias"))

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of leapquant.step (KDA) or leapquant.step_gdn (GDN), in their order."""
        t = self.tensors
        names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf") + (
            ("gbuf", "w", "pcum") if self.gate == "kda" else ("w", "p")) + (
            "h", "qx", "kx", "vx", "a", "b", "A_log", "dt_bias")
        return tuple(t[n] for n in names)

    def run(self, backend: str | None = None, beta_bf16: bool = True) -> tuple[torch.Tensor, ...]:
        """The step's outputs from the dispatched (or named) backend through the functional form."""
        from .api import step, step_gdn
        if self.gate == "kda":
            return step(*self.args(), beta_bf16=beta_bf16, backend=backend)
        return step_gdn(*self.args(), beta_bf16=beta_bf16, backend=backend)

    def reference(self, beta_bf16: bool = True) -> tuple[torch.Tensor, ...]:
        """The fp32 reference's outputs, computed directly (no pool)."""
        return step_reference(*self.math_args(), **self.gate_kwargs(), beta_bf16=beta_bf16)

    def exact(self, beta_bf16: bool = True):
        """The fp64 values and magnitudes the outputs are judged against (criterion.exact_step), cached."""
        if beta_bf16 not in self._exact:
            from .criterion import exact_step
            self._exact[beta_bf16] = exact_step(*self.math_args(), **self.gate_kwargs(), beta_bf16=beta_bf16)
        return self._exact[beta_bf16]

    def judge(self, out: Sequence[torch.Tensor], beta_bf16: bool = True, name: str = "backend"):
        """The SPEC section 7 criterion's verdict on ``out`` (criterion.judge_step)."""
        from .criterion import judge_step
        return judge_step(self.exact(beta_bf16), [o.cpu() for o in out], labels=self.labels, name=name)

    def to(self, device: torch.device | str) -> "StepCase":
        return StepCase(self.gate, {k: v.to(device) for k, v in self.tensors.items()}, self.labels, self.q0,
                        self.token_scale)

    def qkv(self) -> torch.Tensor:
        """bf16 [B, 2 Hk K + H V]: the token as one row per sequence, (q | k | v)."""
        t, B = self.tensors, self.batch
        return torch.cat([t["qx"].reshape(B, -1), t["kx"].reshape(B, -1), t["vx"].reshape(B, -1)], dim=1)

    def load_into(self, pool: Pool, slots: Sequence[int] | torch.Tensor) -> None:
        """Write checkpoint, window and fill count into ``slots`` (B slots) of ``pool``."""
        t = self.tensors
        pool.write_checkpoint(slots, *(t[n] for n in CHECKPOINT_FIELDS))
        pool.write_window(slots, t["kbuf"], t["ubuf"], t["w"], t["pcum"] if self.gate == "kda" else t["p"],
                          t.get("gbuf"), fill=0)
        s = torch.as_tensor(list(slots) if not isinstance(slots, torch.Tensor) else slots, device=pool.device)
        pool.hcnt[s.long()] = t["h"].to(pool.device)

    def next_step(self, seed: int = 1) -> "StepCase":
        """The following step: the fp32 reference's entry of this step appended to every program (a window it fills
        flushed by the reference), a fresh token of each program's scales, the same head constants."""
        t = {k: v.cpu() for k, v in self.tensors.items()}
        out = [o.cpu() for o in self.reference()]
        t = append_entry(t, out, self.gate, self.q0)
        g = torch.Generator().manual_seed(seed)
        B, H, hk = self.batch, self.heads, self.num_k_heads
        tok = _token(B * H, self.gate, g, self.token_scale["vscale"].reshape(-1),
                     self.token_scale["kscale"].reshape(-1))
        for k, v in tok.items():
            t[k] = v.reshape(B, H, *v.shape[1:])
        for k in ("qx", "kx"):
            t[k] = t[k][:, ::H // hk].contiguous()
        labels = [[f"next:{lab}" for lab in row] for row in self.labels]
        case = StepCase(self.gate, t, labels, self.q0, self.token_scale)
        return case.to(self.device) if self.device.type != "cpu" else case


def make_step_case(batch: int, heads: int, gate: str = "kda", seed: int = 0, device: torch.device | str = "cpu",
                   families: Sequence[str] | None = None, num_k_heads: int | None = None,
                   q0: torch.Tensor | None = None) -> StepCase:
    """A step case of ``batch`` x ``heads`` programs. Program h of row b draws from ``families[(b * heads + h + seed)
    % len(families)]`` (default: all of :data:`STEP_FAMILIES`). ``num_k_heads`` (GDN only; default ``heads``): the
    token's key heads; value head j reads key head j // (heads // num_k_heads) (its group's first value head's draw)."""
    fams = check_draw(families, STEP_FAMILIES, gate, "step family")
    hk = heads if num_k_heads is None else num_k_heads
    if hk < 1 or heads % hk or (gate == "kda" and hk != heads):
        raise ValueError(f"num_k_heads: expected a divisor of {heads} (KDA: {heads}), got {num_k_heads!r}")
    g = torch.Generator().manual_seed(seed)
    q0 = default_q0() if q0 is None else q0.detach().cpu().float()
    A_log, dt_bias = head_constants(heads, gate, g)
    n = batch * heads
    labels_flat = [fams[(i + seed) % len(fams)] for i in range(n)]
    parts: dict[str, list] = {}
    for fam in dict.fromkeys(labels_flat):
        where = [i for i, lab in enumerate(labels_flat) if lab == fam]
        hd = torch.tensor([i % heads for i in where])
        vals = _step_family(fam, len(where), gate, g, q0, A_log[hd], dt_bias[hd])
        for k, v in vals.items():
            parts.setdefault(k, [None] * n)
            for j, i in enumerate(where):
                parts[k][i] = v[j]
    t = {k: torch.stack(v).reshape(batch, heads, *v[0].shape).contiguous() for k, v in parts.items()}
    scale = dict(vscale=t.pop("vscale"), kscale=t.pop("kscale"))
    for k in ("qx", "kx"):
        t[k] = t[k][:, ::heads // hk].contiguous()                  # one key head per group of value heads
    t.update(A_log=A_log, dt_bias=dt_bias)
    labels = [labels_flat[b * heads:(b + 1) * heads] for b in range(batch)]
    case = StepCase(gate, t, labels, q0, scale)
    return case.to(device) if torch.device(device).type != "cpu" else case
