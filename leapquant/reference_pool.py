"""The reference backend: the reference's math (:mod:`leapquant.reference`) applied to a pool, in place. The
semantic definition of what a flush and a step write (and of what they leave alone); slow, and it synchronises with
the host (it reads which rows are valid and which programs are due)."""
from __future__ import annotations

import torch

from .layout import Pool
from .numerics import K, L, V
from .reference import PROGRAMS_AT_ONCE, compress, empty_window, pool_writes, rebuild, step_math


def due_programs(pool: Pool, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, heads) long [n] of the due programs of ``idx`` (``hcnt == L``), each once, in (row, head) order."""
    slots = idx.to(pool.device, torch.long)
    slots = torch.where((slots > 0) & (slots < pool.num_slots), slots, torch.zeros_like(slots))
    slots = torch.unique(slots[slots > 0])
    due = pool.hcnt[slots] == L                                        # [n, H]
    row, head = due.nonzero(as_tuple=True)
    return slots[row], head


def written_programs(pool: Pool, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, heads) long [n] of the programs a flush of ``idx`` rewrites: the due programs whose window is not
    empty (:func:`empty_window`), each once, in (row, head) order. A flush writes nothing anywhere else."""
    slots, heads = due_programs(pool, idx)
    gate = dict(pcum=pool.pcum[slots, heads]) if pool.gate == "kda" else dict(p=pool.p[slots, heads])
    keep = ~empty_window(pool.w[slots, heads], **gate)
    return slots[keep], heads[keep]


@pool_writes()
def flush_inplace(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Reference backend of :func:`leapquant.flush_inplace` (arguments already validated): the programs of
    :func:`written_programs` are rebuilt, re-compressed and their windows reset; a due program with an empty window
    is left as it is."""
    slots, heads = written_programs(pool, idx)
    for lo in range(0, slots.numel(), PROGRAMS_AT_ONCE):
        s, h = slots[lo:lo + PROGRAMS_AT_ONCE], heads[lo:lo + PROGRAMS_AT_ONCE]
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


@pool_writes()
def step_inplace(pool: Pool, idx: torch.Tensor, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, out: torch.Tensor, num_k_heads: int,
                 beta_bf16: bool) -> None:
    """Reference backend of :func:`leapquant.step_inplace` (arguments already validated; ``out`` given).

    Rows whose slot is outside [1, num_slots) get a zero output and write nothing. Each stepped program appends its
    entry h (the fill count, L read as 0): kbuf / ubuf (and KDA gbuf) entry h, ``w[h] = 1`` (GDN: the live weights
    decayed too), pcum (KDA) or p (GDN), ``hcnt = h + 1``. Loop-free over the rows in groups of :data:`PROGRAMS_AT_ONCE`
    programs (it reads the valid rows on the host: a synchronisation, as every reference call)."""
    H, Hk = pool.num_heads, num_k_heads
    slots = idx.to(torch.long)
    valid = (slots > 0) & (slots < pool.num_slots)
    out.masked_fill_(~valid[:, None, None], 0.0)
    rows_all = valid.nonzero().flatten()
    heads = torch.arange(H, device=pool.device)
    step_rows = max(1, PROGRAMS_AT_ONCE // H)
    for lo in range(0, rows_all.numel(), step_rows):
        rows = rows_all[lo:lo + step_rows]
        s = slots[rows]
        tok = qkv[rows]
        n = rows.numel()
        qx = tok[:, :Hk * K].reshape(n, Hk, K)
        kx = tok[:, Hk * K:2 * Hk * K].reshape(n, Hk, K)
        vx = tok[:, 2 * Hk * K:].reshape(n, H, V)
        hc = pool.hcnt[s]
        # a fill count of L is "just flushed, empty"; a count outside [0, L] is outside the domain (clamped so that
        # the reference never writes outside the window)
        h = torch.where(hc == L, torch.zeros_like(hc), hc).clamp(0, L - 1).long()
        gate = dict(gbuf=pool.gbuf[s], pcum=pool.pcum[s]) if pool.gate == "kda" else dict(p=pool.p[s])
        tokens = pool.tokens[s]
        r = step_math(pool.codes[s], pool.s_k[s], pool.s_v[s], tokens[..., :K], tokens[..., K:], pool.kbuf[s],
                      pool.ubuf[s], pool.w[s], h, qx, kx, vx, a[rows], b[rows], A_log, dt_bias, **gate,
                      beta_bf16=beta_bf16)
        si, hi = s.unsqueeze(1).expand(n, H), heads.unsqueeze(0).expand(n, H)
        pool.kbuf[si, hi, h] = r["kn"].to(torch.bfloat16)
        pool.ubuf[si, hi, h] = r["u_new"].to(torch.bfloat16)
        if pool.gate == "kda":
            pool.gbuf[si, hi, h] = r["en"].to(torch.float16)
            pool.w[si, hi, h] = 1.0
            pool.pcum[s] = r["pcum_new"]
        else:
            pool.w[s] = r["w_new"]            # the live weights decayed, w[h] = 1, the rest as they were (bitwise)
            pool.p[s] = r["p_new"]
        pool.hcnt[s] = (h + 1).to(torch.int32)
        out[rows] = r["o"].to(torch.bfloat16)
