"""The fp32 reference: the semantic definition of the flush, in plain torch (any device, CPU included).

Every function works in the floating dtype it is given (fp32 is the reference; the tests also run it in fp64 to
measure the reference's own rounding). Shapes carry any leading dims ``[...]`` (usually [B, H]).

The flush of one program (one sequence and head), in the phases every kernel names the same way:

* **rebuild**: the state ``S`` [V, K] from the old checkpoint and the window (:func:`rebuild`);
* **project** and **orthonormalise** (:func:`compress`): one round of subspace iteration from ``q0``,
  ``P = orth(S^T q0)``, ``Q = orth(S P)``, ``U = S^T Q``;
* **tokens** (:func:`tokens_and_codes`, as the next three): ``u = U^T``, ``q = Q^T`` rounded to fp16;
* **residual**: ``E = S - q^T u`` with the rounded tokens;
* **scales**: the smoothing scales ``s_k`` (per column) and ``s_v`` (per row);
* **codes**: ``round_half_even(127 E / (s_k s_v))``;
* **reset**: the window emptied (:func:`leapquant.reference_pool.flush_inplace`, the reference backend on a pool).

A due program whose window is empty (:func:`empty_window`: every weight 0, no decay) is not flushed: its checkpoint
and window stay bitwise as they are (:func:`leapquant.reference_pool.written_programs` lists the programs a flush
rewrites).

The decode step (SPEC section 7, the ``step`` section at the end of this module) of one program and token: the state
``S`` before this token's update is the checkpoint decayed by the gates since it was written plus the live window
entries, and the gated delta rule gives the output ``o = S qn + (kn . qn) u_new`` and the new window entry ``u_new =
beta (v - S kn)``; the state itself is never stored (the window holds the update, the flush folds it later).
"""
from __future__ import annotations

import torch

from .devices import device_here
from .numerics import EPS, FP16_MAX, GS_ABS_FLOOR, K, L, NORM_EPS, QMAX, R, SOFTPLUS_THRESHOLD, V

#: Programs rebuilt at once by the reference flush (and rows stepped at once, this over H): bounds its temporaries
#: to ~64 MB per fp32 intermediate.
PROGRAMS_AT_ONCE = 1024

#: The autograd mode of every write into a pool (the reference's flush and step, the pool's helpers): inference mode.
#: A pool is state, never part of an autograd graph: an input that requires grad (a model's ``nn.Parameter`` A_log,
#: say) would otherwise attach the pool's buffers to a graph that grows every token; and a pool an engine allocated
#: under ``torch.inference_mode`` can only be written inside that mode (ordinary tensors may be written there too).
pool_writes = torch.inference_mode


def default_q0(device: torch.device | str = "cpu") -> torch.Tensor:
    """A deterministic start matrix fp32 [V, R] (Gaussian from a fixed seed, columns of unit norm): almost surely not
    orthogonal to any head's dominant subspace."""
    g = torch.Generator().manual_seed(0x1EA9)
    # on the CPU (the generator's device) whatever default device the caller has set (`with torch.device(...)`)
    q0 = torch.randn(V, R, generator=g, dtype=torch.float64, device="cpu")
    return (q0 / q0.norm(dim=0, keepdim=True)).to(torch.float32).to(device_here(device, "q0"))


def decode_checkpoint(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense state [..., V, K] of a checkpoint: ``q^T u + codes * s_k / 127 * s_v``.

    codes int8 [..., V, K]; s_k fp32 [..., K]; s_v fp32 [..., V]; u fp16 [..., R, K]; q fp16 [..., R, V]."""
    low_rank = q.to(dtype).transpose(-1, -2) @ u.to(dtype)
    quant = codes.to(dtype) * (s_k.to(dtype) / QMAX).unsqueeze(-2) * s_v.to(dtype).unsqueeze(-1)
    return low_rank + quant


def window_decays(gbuf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``D_j = prod_{i > j} gbuf[i]`` [..., L, K] from the per-entry decay factors gbuf fp16 [..., L, K]."""
    g = gbuf.to(dtype)
    from_j = torch.flip(torch.cumprod(torch.flip(g, [-2]), dim=-2), [-2])       # prod_{i >= j}
    ones = torch.ones_like(g[..., :1, :])
    return torch.cat([from_j[..., 1:, :], ones], dim=-2)


def rebuild(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
            kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, *, pcum: torch.Tensor | None = None,
            gbuf: torch.Tensor | None = None, p: torch.Tensor | None = None,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The state [..., V, K] a flush compresses.

    KDA (``pcum`` fp32 [..., K] and ``gbuf`` fp16 [..., L, K]):
        ``S = S_old * exp(pcum) + sum_j w[j] ubuf[j] (outer) (kbuf[j] * D_j)``
    GDN (``p`` fp32 [...]): ``S = p * S_old + sum_j w[j] ubuf[j] (outer) kbuf[j]``.
    kbuf bf16 [..., L, K]; ubuf bf16 [..., L, V]; w fp32 [..., L]."""
    old = decode_checkpoint(codes, s_k, s_v, u, q, dtype)
    keys = kbuf.to(dtype) * w.to(dtype).unsqueeze(-1)
    if p is None:
        if pcum is None or gbuf is None:
            raise ValueError("rebuild: pass pcum and gbuf (KDA) or p (GDN)")
        keys = keys * window_decays(gbuf, dtype)
        old = old * torch.exp(pcum.to(dtype)).unsqueeze(-2)
    else:
        old = old * p.to(dtype)[..., None, None]
    return old + ubuf.to(dtype).transpose(-1, -2) @ keys


def orthonormalise(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` [..., n, R]: Gram-Schmidt with every projection applied twice, so the
    columns stay orthogonal to working precision even when ``x`` is nearly rank-deficient. A column with nothing left
    after projection (norm <= GS_ABS_FLOOR) becomes zero."""
    cols: list[torch.Tensor] = []
    for j in range(x.shape[-1]):
        c = x[..., j]
        for _ in range(2):
            for prev in cols:
                c = c - prev * (prev * c).sum(-1, keepdim=True)
        n = c.norm(dim=-1, keepdim=True)
        cols.append(torch.where(n > GS_ABS_FLOOR, c / n.clamp_min(GS_ABS_FLOOR), torch.zeros_like(c)))
    return torch.stack(cols, dim=-1)


def compress(S: torch.Tensor, q0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """Re-compress dense states S [..., V, K] (fp32, or fp64 for a higher-precision evaluation) from the start
    matrix q0 [V, R]. Returns ``(codes int8 [..., V, K], s_k fp32 [..., K], s_v fp32 [..., V], u fp16 [..., R, K],
    q fp16 [..., R, V])``."""
    dt = S.dtype
    St = S.transpose(-1, -2)
    P = orthonormalise(St @ q0.to(dt))                   # [..., K, R]
    Q = orthonormalise(S @ P)                            # [..., V, R]
    return tokens_and_codes(S, Q, St @ Q)                # U = S^T Q [..., K, R]


def tokens_and_codes(S: torch.Tensor, Q: torch.Tensor, U: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The phases after the basis (tokens, residual, scales, codes): fp16 tokens from Q [..., V, R] and
    U = S^T Q [..., K, R], the residual with the rounded tokens, the smoothing scales and the codes. Same return as
    :func:`compress`."""
    dt = S.dtype
    u = U.transpose(-1, -2).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    q = Q.transpose(-1, -2).to(torch.float16)
    E = S - q.to(dt).transpose(-1, -2) @ u.to(dt)
    s_k = torch.sqrt(E.abs().mean(dim=-2)).clamp_min(EPS)              # [..., K]
    x = E / s_k.unsqueeze(-2)
    s_v = x.abs().amax(dim=-1).clamp_min(EPS)                          # [..., V]
    codes = torch.round(x * (QMAX / s_v).unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, s_k.to(torch.float32), s_v.to(torch.float32), u, q


def empty_window(w: torch.Tensor, *, pcum: torch.Tensor | None = None, p: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """bool [...]: the window holds nothing for a flush to fold, so the flush leaves its program untouched.

    Empty means every weight is zero (``w`` fp32 [..., L]: ``w[j] == 0`` for every j) and nothing decays the
    checkpoint (KDA: every ``pcum`` fp32 [..., K] is 0; GDN: ``p`` fp32 [...] is 1). With every weight zero the keys,
    values and decay factors contribute nothing, and the state is the checkpoint itself: re-compressing it would only
    add the format's error again (a flush's window reset leaves exactly this, so a second flush without a step in
    between must be a no-op). ``-0.0`` counts as zero; a NaN weight or gate is not empty. This is the one definition
    every backend implements (the kernels test the same values)."""
    empty = (w == 0).all(dim=-1)
    if p is None:
        if pcum is None:
            raise ValueError("empty_window: pass pcum (KDA) or p (GDN)")
        return empty & (pcum == 0).all(dim=-1)
    return empty & (p == 1)


# ---- the decode step (SPEC section 7) ------------------------------------------------------------------------------
# The functions below work in the floating dtype they are given: fp32 is the reference, fp64 the exact form the
# criterion judges against (leapquant.criterion.exact_step). With ``absolute=True`` they evaluate the same expression
# on the absolute value of every term (the checkpoint's entries, each window term, the key, the value), which gives
# the magnitude M of SPEC section 7: the scale of the terms an output sums, against which its arithmetic error is
# measured (o and u_new can be much smaller than their terms when those cancel).



def l2_normalise(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x / sqrt(sum x^2 + 1e-6)`` over the last dim, in ``dtype``."""
    x = x.to(dtype)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + NORM_EPS)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))``, and ``x`` itself above :data:`SOFTPLUS_THRESHOLD` (exp would overflow fp32 past 88)."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x.clamp_max(SOFTPLUS_THRESHOLD))))


def log_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This token's log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (<= 0), in ``dtype``.

    KDA (a gate per key channel): a bf16 [..., H, K], A_log fp32 [H], dt_bias fp32 [H, K] -> g [..., H, K].
    GDN (one gate per head): a bf16 [..., H], A_log fp32 [H], dt_bias fp32 [H] -> g [..., H]."""
    A = A_log.to(dtype).reshape(A_log.shape + (1,) * (dt_bias.dim() - 1))
    return -torch.exp(A) * softplus(a.to(dtype) + dt_bias.to(dtype))


def step_beta(b: torch.Tensor, beta_bf16: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``beta = sigmoid(b)`` [...] from the bf16 pre-activation, rounded to bf16 when ``beta_bf16`` (the models carry
    it so; vLLM keeps it fp32), returned in ``dtype``."""
    beta = torch.sigmoid(b.to(dtype))
    return beta.to(torch.bfloat16).to(dtype) if beta_bf16 else beta


def expand_key_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Key-head tensors [..., Hk, D] for the ``num_heads`` value heads [..., H, D]: grouped query heads (GDN's GQA,
    Qwen3-Next: 16 key heads for 32 value heads), value head j reading key head ``j // (H // Hk)``."""
    hk = x.shape[-2]
    return x if hk == num_heads else x.repeat_interleave(num_heads // hk, dim=-2)


def live_entries(h: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., L] mask of the window entries before the fill count ``h`` [...] (j < h), as bool or ``dtype``."""
    live = torch.arange(L, device=h.device) < h.unsqueeze(-1)
    return live if dtype is None else live.to(dtype)


def step_state(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
               kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, h: torch.Tensor, g: torch.Tensor, *,
               gbuf: torch.Tensor | None = None, pcum: torch.Tensor | None = None, p: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32, absolute: bool = False
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The state ``S`` [..., V, K] a step reads (before this token's own update), and the step's gate outputs.

    Only the live entries ``j < h`` (h int [...] in [0, L)) count; entries at and past ``h`` are ignored, whatever
    they hold (a flush leaves its keys and values behind).

    KDA (``gbuf`` fp16 [..., L, K], ``pcum`` fp32 [..., K], ``g`` [..., K]):
        ``en = exp(g)``, ``pcum_new = pcum + g``,
        ``S = S_old * diag(exp(pcum_new)) + sum_{j<h} w_j ubuf_j (outer) (kbuf_j * D_j)``,
        ``D_j = en * prod_{j<i<h} gbuf_i``; returns ``{"en", "pcum_new"}``.
    GDN (``p`` fp32 [...], ``g`` [...]): ``at = exp(g)``, ``p_new = p * at``, live weights ``w_j * at``,
        ``S = p_new * S_old + sum_{j<h} w_j at ubuf_j (outer) kbuf_j``; returns ``{"at", "p_new", "w_live"}`` (the
        decayed weights of the live entries, the others unchanged).

    ``absolute``: every term by its absolute value (the magnitude of the sum, see the section's header)."""
    ab = torch.abs if absolute else (lambda t: t)
    if absolute:
        low_rank = q.to(dtype).abs().transpose(-1, -2) @ u.to(dtype).abs()
        old = low_rank + (codes.to(dtype) * (s_k.to(dtype) / QMAX).unsqueeze(-2) * s_v.to(dtype).unsqueeze(-1)).abs()
    else:
        old = decode_checkpoint(codes, s_k, s_v, u, q, dtype)
    live = live_entries(h)
    # the entries past h are selected away, never multiplied by 0: whatever they hold (NaN included) stays out
    zero = torch.zeros((), dtype=dtype, device=kbuf.device)
    kbuf = torch.where(live.unsqueeze(-1), kbuf.to(dtype), zero)
    ubuf = torch.where(live.unsqueeze(-1), ubuf.to(dtype), zero)
    g = g.to(dtype)
    if p is None:
        if gbuf is None or pcum is None:
            raise ValueError("step_state: pass gbuf and pcum (KDA) or p (GDN)")
        en = torch.exp(g)
        pcum_new = pcum.to(dtype) + g
        # D_j = en * prod_{j<i<h} gbuf_i: the decays of the later live entries (1 in place of the others), this step's
        gl = torch.where(live.unsqueeze(-1), gbuf.to(dtype), torch.ones((), dtype=dtype, device=gbuf.device))
        decay = window_decays(gl, dtype) * en.unsqueeze(-2) * live.unsqueeze(-1).to(dtype)
        keys = ab(torch.where(live, w.to(dtype), zero)).unsqueeze(-1) * ab(kbuf) * decay
        S = old * torch.exp(pcum_new).unsqueeze(-2) + ab(ubuf).transpose(-1, -2) @ keys
        return S, {"en": en, "pcum_new": pcum_new}
    at = torch.exp(g)
    p_new = p.to(dtype) * at
    w_live = torch.where(live, w.to(dtype) * at.unsqueeze(-1), w.to(dtype))
    keys = ab(torch.where(live, w_live, zero)).unsqueeze(-1) * ab(kbuf)
    S = old * p_new[..., None, None] + ab(ubuf).transpose(-1, -2) @ keys
    return S, {"at": at, "p_new": p_new, "w_live": w_live}


def delta_rule(S: torch.Tensor, kn: torch.Tensor, qn: torch.Tensor, vx: torch.Tensor, beta: torch.Tensor, *,
               absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule's update and output from the state S [..., V, K] (dtype of S): ``u_new = beta (v - S kn)``
    [..., V] and ``o = S qn + (kn . qn) u_new`` [..., V] (= the updated state ``S + u_new kn^T`` applied to qn).
    kn, qn [..., K], vx [..., V], beta [...]. ``absolute``: ``beta (|v| + S |kn|)`` and ``S |qn| + (|kn| . |qn|) u``
    (S then already holds absolute terms)."""
    dt = S.dtype
    kn, qn, vx, beta = kn.to(dt), qn.to(dt), vx.to(dt), beta.to(dt)
    if absolute:
        kn, qn, vx = kn.abs(), qn.abs(), vx.abs()
    Sk = (S @ kn.unsqueeze(-1)).squeeze(-1)
    u_new = beta.unsqueeze(-1) * ((vx + Sk) if absolute else (vx - Sk))
    o = (S @ qn.unsqueeze(-1)).squeeze(-1) + (kn * qn).sum(-1, keepdim=True) * u_new
    return u_new, o


def step_math(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
              kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, h: torch.Tensor, qx: torch.Tensor,
              kx: torch.Tensor, vx: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor, *, gbuf: torch.Tensor | None = None, pcum: torch.Tensor | None = None,
              p: torch.Tensor | None = None, beta_bf16: bool = True, dtype: torch.dtype = torch.float32,
              absolute: bool = False) -> dict[str, torch.Tensor]:
    """One decode step of every program [B, H], unrounded, in ``dtype`` (SPEC section 7).

    Inputs (leading dims [B, H] unless said): the checkpoint (codes, s_k, s_v, u, q as in :func:`decode_checkpoint`);
    the window kbuf bf16 [.., L, K], ubuf bf16 [.., L, V], w fp32 [.., L], the fill count h int [B, H] in [0, L] (L:
    "just flushed, empty", read as 0); KDA gbuf fp16 [.., L, K] and pcum fp32 [.., K], GDN p fp32 [B, H]; the token
    qx, kx bf16 [B, Hk, K] (Hk key heads; value head j reads key head j // (H // Hk)), vx bf16 [B, H, V], a bf16
    [B, H, K] (KDA) or [B, H] (GDN), b bf16 [B, H]; per-head constants A_log fp32 [H], dt_bias fp32 [H, K] (KDA) or
    [H] (GDN).

    Returns a dict: ``o``, ``kn``, ``u_new`` [B, H, V / K], ``g`` (the log-gate), ``w_new`` [B, H, L] (``w[h] = 1``,
    GDN's live weights decayed by ``at``), and KDA ``en`` [B, H, K], ``pcum_new`` [B, H, K], or GDN ``at``,
    ``p_new`` [B, H]. With ``absolute`` the o, kn and u_new entries are the magnitudes M instead."""
    H = vx.shape[-2]
    h = torch.where(h == L, torch.zeros_like(h), h).long()
    kn = l2_normalise(expand_key_heads(kx, H), dtype)
    qn = l2_normalise(expand_key_heads(qx, H), dtype) * K ** -0.5
    g = log_gate(a, A_log, dt_bias, dtype)
    beta = step_beta(b, beta_bf16, dtype)
    S, gate_out = step_state(codes, s_k, s_v, u, q, kbuf, ubuf, w, h, g, gbuf=gbuf, pcum=pcum, p=p, dtype=dtype,
                             absolute=absolute)
    u_new, o = delta_rule(S, kn, qn, vx, beta, absolute=absolute)
    this = torch.arange(L, device=h.device) == h.unsqueeze(-1)
    w_old = gate_out.pop("w_live") if p is not None else w.to(dtype)
    w_new = torch.where(this, torch.ones((), dtype=dtype, device=w.device), w_old)
    return dict(o=o, kn=kn.abs() if absolute else kn, u_new=u_new, g=g, w_new=w_new, **gate_out)


def step_reference(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
                   kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, h: torch.Tensor, qx: torch.Tensor,
                   kx: torch.Tensor, vx: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, *, gbuf: torch.Tensor | None = None, pcum: torch.Tensor | None = None,
                   p: torch.Tensor | None = None, beta_bf16: bool = True) -> tuple[torch.Tensor, ...]:
    """The fp32 reference step in the storage dtypes (arguments as :func:`step_math`).

    KDA: ``(o bf16 [B, H, V], k_row bf16 [B, H, K], u_row bf16 [B, H, V], g_row fp16 [B, H, K], w_new fp32 [B, H, L],
    pcum_new fp32 [B, H, K])``; GDN: ``(o, k_row, u_row, w_new, p_new fp32 [B, H])``."""
    r = step_math(codes, s_k, s_v, u, q, kbuf, ubuf, w, h, qx, kx, vx, a, b, A_log, dt_bias, gbuf=gbuf, pcum=pcum,
                  p=p, beta_bf16=beta_bf16)
    bf = torch.bfloat16
    head = (r["o"].to(bf), r["kn"].to(bf), r["u_new"].to(bf))
    if p is None:
        return head + (r["en"].to(torch.float16), r["w_new"], r["pcum_new"])
    return head + (r["w_new"], r["p_new"])
