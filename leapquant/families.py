"""Input families shared by the tests, the demo and the benchmark (SPEC section 3).

A :class:`Case` holds the functional-form inputs of one flush (leading dims [B, H]); each head draws from one family.
Values come from torch under a seed, so a (batch, heads, gate, seed, families) tuple is one reproducible case.

Families:
    window_rank1, window_rank2   empty checkpoint, one / two window entries
    zero                         all-zero state and window
    scaled_zero                  codes and tokens zero under positive scales (a caller's checkpoint can be so), a window
                                 with keys and values but w = 0: the state is exactly zero and must decode to zero
    scaled_zero_window           the same checkpoint and one live window entry (the state is that rank-1 update)
    tiny, tiny_decayed, huge     states of ~1e-4 (low rank, mild gates), ~3e-5 (decayed, window-dominated), ~1e2
    rank1_noise                  a strong rank-1 part over a 1e-3 noise floor
    decayed                      checkpoint decayed to nothing (KDA pcum ~ -1e4, GDN p subnormal)
    never_decay                  channels that never decay (pcum = 0, gbuf = 1; GDN p = 1)
    hot_row, column_outliers     one row / a few columns 100x the rest
    pcum_below_1000              half the channels with pcum in [-3000, -1000] (GDN: p = the smallest subnormal)
    random                       unstructured in-domain random tensors (checkpoint and window)
    kda_sim                      a window produced by simulating KDA / GDN decode steps from a prefilled state
    second_window                the reference's own output checkpoint plus a new window
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from .layout import CHECKPOINT_FIELDS, FIELDS, GATES, WINDOW_FIELDS, K, L, QMAX, R, V, Pool
from .reference import compress, decode_checkpoint, default_q0, rebuild

EDGE_FAMILIES = ("window_rank1", "window_rank2", "zero", "scaled_zero", "scaled_zero_window", "tiny", "tiny_decayed", "huge", "rank1_noise", "decayed", "never_decay",
                 "hot_row", "column_outliers", "pcum_below_1000")
FAMILIES = EDGE_FAMILIES + ("random", "kda_sim", "second_window")

FP16_TINIEST = 2.0 ** -24          #: smallest positive fp16 (subnormal): gbuf stays in (0, 1]
FP32_TINIEST = 1.401298464324817e-45  #: smallest positive fp32 (subnormal): p stays in (0, 1]


# ---- building blocks (n heads at a time, fp32) --------------------------------------------------------------------
def _low_rank_noise(n: int, g: torch.Generator, scale: float = 1.0, rank: int = 6, noise: float = 0.05) -> torch.Tensor:
    """States [n, V, K] with a decaying spectrum over a noise floor, mean |entry| = ``scale``."""
    a = torch.randn(n, V, rank, generator=g)
    b = torch.randn(n, rank, K, generator=g)
    sv = 0.5 ** torch.arange(rank, dtype=torch.float32)
    S = (a * sv) @ b + noise * torch.randn(n, V, K, generator=g)
    return S * (scale / S.abs().mean(dim=(-1, -2), keepdim=True))


def _kda_gates(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel log-gates [n, L, K] of KDA: g = -exp(A_log) * softplus(x + dt_bias), fp32."""
    a_log = torch.randn(n, 1, K, generator=g) - 1.0
    dt_bias = 0.5 * torch.randn(n, 1, K, generator=g)
    x = torch.randn(n, L, K, generator=g)
    logg = -torch.exp(a_log) * F.softplus(x + dt_bias)
    return logg, torch.exp(logg).clamp_min(FP16_TINIEST).to(torch.float16)


def _window(n: int, gate: str, g: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A realistic window: L2-normalised keys, unit-scale values, beta = sigmoid weights, KDA / GDN gates."""
    k = torch.randn(n, L, K, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    win = dict(kbuf=k.to(torch.bfloat16), ubuf=(scale * torch.randn(n, L, V, generator=g)).to(torch.bfloat16),
               w=torch.sigmoid(torch.randn(n, L, generator=g)))
    if gate == "kda":
        logg, gbuf = _kda_gates(n, g)
        win.update(gbuf=gbuf, pcum=logg.sum(dim=1))
    else:
        logg = -F.softplus(torch.randn(n, L, generator=g) - 2.0)          # scalar gate per step
        # GDN folds each entry's decay into its weight: w_j *= prod_{i > j} exp(g_i)
        after = torch.flip(torch.cumsum(torch.flip(logg, [1]), 1), [1]) - logg
        win["w"] = win["w"] * torch.exp(after)
        win.update(p=torch.exp(logg.sum(dim=1)).clamp_min(FP32_TINIEST))
    return win


def check_draw(families: Sequence[str] | None, known: Sequence[str], gate: str, what: str) -> tuple[str, ...]:
    """The families asked for (None: all of ``known``) and the gate, checked; raises ``ValueError`` naming the
    unknown one (``what``: the kind of family, for the message)."""
    fams = tuple(families or known)
    for f in fams:
        if f not in known:
            raise ValueError(f"unknown {what} {f!r}: expected one of {tuple(known)}")
    if gate not in GATES:
        raise ValueError(f"gate: expected one of {GATES}, got {gate!r}")
    return fams


def _empty_window(n: int, gate: str) -> dict[str, torch.Tensor]:
    """``n`` empty windows of ``gate``: every field but the fill count at its empty value (layout.FIELDS)."""
    return {name: torch.full((n,) + FIELDS[name].shape, FIELDS[name].empty, dtype=FIELDS[name].dtype)
            for name in WINDOW_FIELDS[gate] if name != "hcnt"}


def _random_checkpoint(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(-QMAX, QMAX + 1, (n, V, K), generator=g, dtype=torch.int16).to(torch.int8)
    s_k = torch.exp(torch.empty(n, K).uniform_(math.log(1e-3), math.log(3.0), generator=g))
    s_v = torch.exp(torch.empty(n, V).uniform_(math.log(1e-3), math.log(3.0), generator=g))
    u = (2.0 * torch.randn(n, R, K, generator=g)).to(torch.float16)
    q = (torch.randn(n, R, V, generator=g) / math.sqrt(V)).to(torch.float16)
    return codes, s_k, s_v, u, q


def _family(name: str, n: int, gate: str, g: torch.Generator, q0: torch.Tensor):
    """(checkpoint tuple, window dict) of ``n`` heads of family ``name`` (CPU tensors)."""
    dense = None
    win = _window(n, gate, g)
    if name in ("window_rank1", "window_rank2"):
        dense = torch.zeros(n, V, K)
        win["w"] = torch.zeros(n, L)
        win["w"][:, L - 1] = 1.0
        if name == "window_rank2":
            win["w"][:, 3] = 0.7
    elif name == "zero":
        dense, win = torch.zeros(n, V, K), _empty_window(n, gate)
        win["w"] = torch.rand(n, L, generator=g)            # weights without keys or values: still zero
    elif name in ("scaled_zero", "scaled_zero_window"):
        # the codes and tokens are zero but the scales are not (as in the request's own benchmark input): a kernel's
        # dequantisation must give exactly 0 for code 0, or the zero state decodes to noise
        codes = torch.zeros(n, V, K, dtype=torch.int8)
        s_k = 0.05 + 0.2 * torch.rand(n, K, generator=g)
        s_v = 0.1 + 0.5 * torch.rand(n, V, generator=g)
        u, q = torch.zeros(n, R, K, dtype=torch.float16), torch.zeros(n, R, V, dtype=torch.float16)
        win["w"] = torch.zeros(n, L)
        if name == "scaled_zero_window":
            win["w"][:, 0] = 1.0            # the oldest entry: decayed by every later gate
        return (codes, s_k, s_v, u, q), win
    elif name == "tiny":                 # mean |S| ~ 1e-4, low rank over a noise floor: fp16's subnormals start at 6e-5
        dense = _low_rank_noise(n, g, scale=1e-4)
        win = _window(n, gate, g, scale=1e-4)
        if gate == "kda":                # mild gates, so the checkpoint (not the window) keeps the head at ~1e-4
            logg = -0.01 * torch.rand(n, L, K, generator=g)
            win.update(gbuf=torch.exp(logg).to(torch.float16), pcum=logg.sum(dim=1))
        else:
            win["p"] = torch.full((n,), 0.9)
    elif name == "tiny_decayed":         # mean |S| ~ 3e-5: a 1e-4 checkpoint decayed by realistic gates, plus the window
        dense = _low_rank_noise(n, g, scale=1e-4)
        win = _window(n, gate, g, scale=5e-4)
    elif name == "huge":
        dense = _low_rank_noise(n, g, scale=3e2)
        win = _window(n, gate, g, scale=1.5e3)
    elif name == "rank1_noise":
        a, b = torch.randn(n, V, 1, generator=g), torch.randn(n, 1, K, generator=g)
        dense = 3.0 * a @ b + 1e-3 * torch.randn(n, V, K, generator=g)
        win = _window(n, gate, g, scale=1e-3)
    elif name == "decayed":
        dense = _low_rank_noise(n, g)
        if gate == "kda":
            win["pcum"] = -1e4 * (1.0 + torch.rand(n, K, generator=g))
            win["gbuf"] = torch.full_like(win["gbuf"], FP16_TINIEST)
        else:
            win["p"] = torch.full((n,), 2e-41)
    elif name == "never_decay":
        dense = _low_rank_noise(n, g)
        if gate == "kda":
            keep = torch.rand(n, K, generator=g) < 0.5
            win["pcum"] = torch.where(keep, torch.zeros_like(win["pcum"]), win["pcum"])
            win["gbuf"] = torch.where(keep.unsqueeze(1), torch.ones_like(win["gbuf"]), win["gbuf"])
        else:
            win["p"] = torch.ones(n)
    elif name == "hot_row":
        dense = _low_rank_noise(n, g)
        dense[torch.arange(n), torch.randint(0, V, (n,), generator=g)] *= 100.0
    elif name == "column_outliers":
        dense = _low_rank_noise(n, g)
        cols = torch.randint(0, K, (n, 3), generator=g)
        dense.scatter_(2, cols.unsqueeze(1).expand(n, V, 3), 100.0 * dense.gather(2, cols.unsqueeze(1).expand(n, V, 3)))
    elif name == "pcum_below_1000":
        dense = _low_rank_noise(n, g)
        if gate == "kda":
            deep = torch.rand(n, K, generator=g) < 0.5
            win["pcum"] = torch.where(deep, -1000.0 - 2000.0 * torch.rand(n, K, generator=g), win["pcum"])
            win["gbuf"] = torch.where(deep.unsqueeze(1) & (torch.arange(L) == 7).view(1, L, 1),
                                      torch.full_like(win["gbuf"], FP16_TINIEST), win["gbuf"])
        else:
            win["p"] = torch.full((n,), FP32_TINIEST)
    elif name == "random":
        ck = _random_checkpoint(n, g)
        win = dict(kbuf=torch.randn(n, L, K, generator=g).to(torch.bfloat16),
                   ubuf=torch.randn(n, L, V, generator=g).to(torch.bfloat16), w=torch.rand(n, L, generator=g))
        if gate == "kda":
            win.update(gbuf=torch.rand(n, L, K, generator=g).clamp_min(FP16_TINIEST).to(torch.float16),
                       pcum=-20.0 * torch.rand(n, K, generator=g))
        else:
            win.update(p=torch.rand(n, generator=g).clamp_min(FP32_TINIEST))
        return ck, win
    elif name == "kda_sim":
        return _simulate(n, gate, g, q0)
    elif name == "second_window":
        ck, win1 = _family("kda_sim", n, gate, g, q0)
        gate_arg = dict(pcum=win1["pcum"], gbuf=win1["gbuf"]) if gate == "kda" else dict(p=win1["p"])
        S = rebuild(*ck, win1["kbuf"], win1["ubuf"], win1["w"], **gate_arg)
        return compress(S, q0), _window(n, gate, g)
    else:
        raise ValueError(f"unknown family {name!r}: expected one of {FAMILIES}")
    return compress(dense, q0), win


def _simulate(n: int, gate: str, g: torch.Generator, q0: torch.Tensor, steps: int = L):
    """A prefilled, compressed state and the window of ``steps`` decode tokens from it (see simulate_window)."""
    ck = compress(_low_rank_noise(n, g, scale=0.1), q0)
    return ck, simulate_window(ck, gate, g, steps)


def simulate_window(checkpoint: Sequence[torch.Tensor], gate: str, g: torch.Generator, steps: int = L
                    ) -> dict[str, torch.Tensor]:
    """The window of ``steps`` decode tokens of the delta rule from a checkpoint (leading dim [n], CPU).

    Per step t: decay S by the gate (KDA per channel: g = -exp(A_log) softplus(x + dt_bias); GDN scalar), predict
    ``S k_t`` with an L2-normalised key, buffer the correction ``u_t = v_t - S k_t`` with weight ``beta_t =
    sigmoid(.)``, and apply ``S += beta_t u_t k_t^T`` with the rounded entries (the stored window is what the flush
    sees). Returns kbuf, ubuf, w and pcum + gbuf (KDA) or p (GDN; each entry's later decay folded into w)."""
    S = decode_checkpoint(*checkpoint)
    n = S.shape[0]
    k = torch.randn(n, L, K, generator=g)
    k = (k / k.norm(dim=-1, keepdim=True)).to(torch.bfloat16)
    v = torch.randn(n, L, V, generator=g)
    beta = torch.sigmoid(torch.randn(n, L, generator=g))
    ubuf = torch.zeros(n, L, V, dtype=torch.bfloat16)
    if gate == "kda":
        logg, gbuf = _kda_gates(n, g)
        decay = gbuf.float()
    else:
        logg = -F.softplus(torch.randn(n, L, generator=g) - 2.0)
        decay = torch.exp(logg)[..., None].expand(n, L, K)
    w = beta.clone()
    w[:, steps:] = 0.0
    for t in range(steps):
        S = S * decay[:, t].unsqueeze(1)
        kt = k[:, t].float()
        ut = (v[:, t] - (S @ kt.unsqueeze(-1)).squeeze(-1)).to(torch.bfloat16)
        ubuf[:, t] = ut
        S = S + beta[:, t, None, None] * ut.float().unsqueeze(-1) * kt.unsqueeze(-2)
    win = dict(kbuf=k, ubuf=ubuf)
    if gate == "kda":
        win.update(w=w, gbuf=gbuf, pcum=logg.sum(dim=1))
    else:
        after = torch.flip(torch.cumsum(torch.flip(logg, [1]), 1), [1]) - logg
        win.update(w=w * torch.exp(after), p=torch.exp(logg.sum(dim=1)).clamp_min(FP32_TINIEST))
    return win


# ---- the case ----------------------------------------------------------------------------------------------------


class CaseTensors:
    """What every op's case shares: ``gate`` and the functional form's ``tensors`` with leading dims [B, H]."""
    gate: str
    tensors: dict[str, torch.Tensor]

    @property
    def batch(self) -> int:
        return self.tensors["codes"].shape[0]

    @property
    def heads(self) -> int:
        return self.tensors["codes"].shape[1]

    @property
    def device(self) -> torch.device:
        return self.tensors["codes"].device

    def gate_kwargs(self) -> dict[str, torch.Tensor]:
        t = self.tensors
        return dict(pcum=t["pcum"], gbuf=t["gbuf"]) if self.gate == "kda" else dict(p=t["p"])


@dataclass
class Case(CaseTensors):
    """Functional-form inputs with leading dims [B, H]; ``labels[b][h]`` is the family of head (b, h)."""
    gate: str
    tensors: dict[str, torch.Tensor]
    q0: torch.Tensor
    labels: list[list[str]]
    _exact: torch.Tensor | None = field(default=None, repr=False)
    _ref: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)

    def checkpoint(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.tensors[n] for n in CHECKPOINT_FIELDS)

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of leapquant.run (KDA) or leapquant.run_gdn (GDN), in their order."""
        t = self.tensors
        if self.gate == "kda":
            return (*self.checkpoint(), t["kbuf"], t["ubuf"], t["gbuf"], t["w"], t["pcum"], self.q0)
        return (*self.checkpoint(), t["kbuf"], t["ubuf"], t["w"], t["p"], self.q0)

    def run(self, backend: str | None = None) -> tuple[torch.Tensor, ...]:
        """The new checkpoint (codes, s_k, s_v, u, q) from the dispatched (or named) backend."""
        from .api import run, run_gdn
        return (run if self.gate == "kda" else run_gdn)(*self.args(), backend=backend)

    def to(self, device: torch.device | str) -> "Case":
        return Case(self.gate, {k: v.to(device) for k, v in self.tensors.items()}, self.q0.to(device), self.labels)

    def exact(self) -> torch.Tensor:
        """The fp64 state [B, H, V, K] the flush compresses (on the CPU: it is the judge)."""
        if self._exact is None:
            t = {k: v.cpu() for k, v in self.tensors.items()}
            gate = dict(pcum=t["pcum"], gbuf=t["gbuf"]) if self.gate == "kda" else dict(p=t["p"])
            self._exact = rebuild(*(t[n] for n in CHECKPOINT_FIELDS), t["kbuf"], t["ubuf"], t["w"], **gate,
                                  dtype=torch.float64)
        return self._exact

    def reference(self) -> tuple[torch.Tensor, ...]:
        """The fp32 reference's checkpoint (computed directly, on the case's device)."""
        if self._ref is None:
            t = self.tensors
            S = rebuild(*self.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **self.gate_kwargs())
            self._ref = compress(S, self.q0)
        return self._ref

    def judge(self, out: Sequence[torch.Tensor], name: str = "backend"):
        """The SPEC criterion's verdict on ``out`` (see leapquant.criterion.judge)."""
        from .criterion import judge
        return judge(self.exact(), [o.cpu() for o in out], [r.cpu() for r in self.reference()],
                     labels=self.labels, name=name)

    def load_into(self, pool: Pool, rows: Sequence[int] | torch.Tensor) -> None:
        """Write checkpoint and window into ``rows`` of ``pool`` (hcnt = L: all due)."""
        t = self.tensors
        pool.write_checkpoint(rows, *self.checkpoint())
        pool.write_window(rows, t["kbuf"], t["ubuf"], t["w"], t["pcum"] if self.gate == "kda" else t["p"],
                          t.get("gbuf"))


def make_case(batch: int, heads: int, gate: str = "kda", seed: int = 0, device: torch.device | str = "cpu",
              families: Sequence[str] | None = None, q0: torch.Tensor | None = None) -> Case:
    """A case of ``batch`` x ``heads`` programs. Head h of row b draws from ``families[(b * heads + h + seed) %
    len(families)]`` (default: all of :data:`FAMILIES`), so even small cases cover many families."""
    fams = check_draw(families, FAMILIES, gate, "family")
    g = torch.Generator().manual_seed(seed)
    q0 = default_q0() if q0 is None else q0.detach().cpu().float()
    n = batch * heads
    labels_flat = [fams[(i + seed) % len(fams)] for i in range(n)]
    names = CHECKPOINT_FIELDS + tuple(f for f in WINDOW_FIELDS[gate] if f != "hcnt")   # the functional forms' tensors
    parts: dict[str, list] = {k: [None] * n for k in names}
    for fam in dict.fromkeys(labels_flat):
        where = [i for i, lab in enumerate(labels_flat) if lab == fam]
        ck, win = _family(fam, len(where), gate, g, q0)
        vals = dict(zip(CHECKPOINT_FIELDS, ck), **win)
        for j, i in enumerate(where):
            for k in names:
                parts[k][i] = vals[k][j]
    tensors = {k: torch.stack(v).reshape(batch, heads, *v[0].shape).contiguous() for k, v in parts.items()}
    labels = [labels_flat[b * heads:(b + 1) * heads] for b in range(batch)]
    case = Case(gate, tensors, q0, labels)
    return case.to(device) if torch.device(device).type != "cpu" else case
