"""The fp32 reference: the semantic definition of the flush, in plain torch (any device, CPU included).

Every function works in the floating dtype it is given (fp32 is the reference; the tests also run it in fp64 to
measure the reference's own rounding). Shapes carry any leading dims ``[...]`` (usually [B, H]).

The flush of one program (one sequence and head):

1. rebuild the state ``S`` [V, K] from the old checkpoint and the window (:func:`rebuild`);
2. one round of subspace iteration from ``q0``: ``P = orth(S^T q0)``, ``Q = orth(S P)``, ``U = S^T Q``;
3. tokens ``u = U^T``, ``q = Q^T`` rounded to fp16;
4. residual ``E = S - q^T u`` with the rounded tokens;
5. smoothing scales ``s_k`` (per column) and ``s_v`` (per row), then ``codes = round_half_even(127 E / (s_k s_v))``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .numerics import EPS, FP16_MAX, GS_ABS_FLOOR, K, L, QMAX, R, V

if TYPE_CHECKING:                     # the pool is only read here: no import of the layout module (which imports this)
    from .layout import Pool

#: Programs rebuilt at once by the reference flush: bounds its temporaries to ~64 MB per fp32 intermediate.
CHUNK = 1024


def default_q0(device: torch.device | str = "cpu") -> torch.Tensor:
    """A deterministic start matrix fp32 [V, R] (Gaussian from a fixed seed, columns of unit norm): almost surely not
    orthogonal to any head's dominant subspace."""
    g = torch.Generator().manual_seed(0x1EA9)
    q0 = torch.randn(V, R, generator=g, dtype=torch.float64)
    return (q0 / q0.norm(dim=0, keepdim=True)).to(torch.float32).to(device)


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


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
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
    P = orthonormalize(St @ q0.to(dt))                   # [..., K, R]
    Q = orthonormalize(S @ P)                            # [..., V, R]
    return encode(S, Q, St @ Q)                          # U = S^T Q [..., K, R]


def encode(S: torch.Tensor, Q: torch.Tensor, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor]:
    """Steps 2-5 of the re-compression: fp16 tokens from the basis Q [..., V, R] and U = S^T Q [..., K, R], the
    residual with the rounded tokens, the smoothing scales and the codes. Same return as :func:`compress`."""
    dt = S.dtype
    u = U.transpose(-1, -2).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    q = Q.transpose(-1, -2).to(torch.float16)
    E = S - q.to(dt).transpose(-1, -2) @ u.to(dt)
    s_k = torch.sqrt(E.abs().mean(dim=-2)).clamp_min(EPS)              # [..., K]
    x = E / s_k.unsqueeze(-2)
    s_v = x.abs().amax(dim=-1).clamp_min(EPS)                          # [..., V]
    codes = torch.round(x * (QMAX / s_v).unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return codes, s_k.to(torch.float32), s_v.to(torch.float32), u, q


def due_programs(pool: Pool, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, heads) long [n] of the due programs of ``idx``, each once, in (row, head) order."""
    slots = idx.to(pool.device, torch.long)
    slots = torch.where((slots > 0) & (slots < pool.num_slots), slots, torch.zeros_like(slots))
    slots = torch.unique(slots[slots > 0])
    due = pool.hcnt[slots] == L                                        # [n, H]
    row, head = due.nonzero(as_tuple=True)
    return slots[row], head


def flush_inplace(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Reference backend of :func:`leapquant.flush_inplace` (arguments already validated)."""
    slots, heads = due_programs(pool, idx)
    for lo in range(0, slots.numel(), CHUNK):
        s, h = slots[lo:lo + CHUNK], heads[lo:lo + CHUNK]
        gate = dict(pcum=pool.pcum[s, h], gbuf=pool.gbuf[s, h]) if pool.gate == "kda" else dict(p=pool.p[s, h])
        tok = pool.tokens[s, h]
        S = rebuild(pool.codes[s, h], pool.s_k[s, h], pool.s_v[s, h], tok[..., :K], tok[..., K:],
                    pool.kbuf[s, h], pool.ubuf[s, h], pool.w[s, h], **gate)
        codes, s_k, s_v, u, q = compress(S, q0)
        pool.codes[s, h] = codes
        pool.s_k[s, h] = s_k
        pool.s_v[s, h] = s_v
        pool.tokens[s, h] = torch.cat([u, q], dim=-1)
        pool.w[s, h] = 0.0
        if pool.gate == "kda":
            pool.pcum[s, h] = 0.0
            pool.gbuf[s, h] = 1.0
        else:
            pool.p[s, h] = 1.0
