"""Public entry points: the deployment form :func:`flush_inplace` and the functional forms :func:`run` (KDA) and
:func:`run_gdn` (GDN), both of which go through the dispatch."""
from __future__ import annotations

import torch

from . import dispatch
from .layout import L, Pool
from .validate import check_flush_args, check_pool, check_run_args


@torch.compiler.disable
def flush_inplace(pool: Pool, idx: torch.Tensor, q0: torch.Tensor, *, backend: str | None = None,
                  check_idx: bool | None = None) -> None:
    """Flush every due program of the rows in ``idx``, in place.

    pool: :class:`Pool`. idx: int32 [N] on the pool's device, slot per row (``<= 0``: no sequence, the row is
    skipped, as engines pad with -1 or 0). q0: fp32 [V, R], the start of the subspace iteration, shared by all
    programs. A program (slot, head) is due when ``hcnt == L``; its checkpoint is rewritten and its window reset
    (``w = 0``, ``pcum = 0``, ``gbuf = 1``; GDN ``p = 1``); ``hcnt`` stays ``L``. Everything else in the pool stays
    bitwise untouched.

    backend: ``None`` (LEAPQUANT_BACKEND / use_backend / auto), or one of ``auto, reference, triton, tilelang``.
    check_idx: also check idx's values (every slot < num_slots, no slot twice): a host synchronisation, so off by
    default (``None``: the ``LEAPQUANT_CHECK_IDX`` environment switch); unchecked, slots >= num_slots are skipped.
    The call never synchronises with the host otherwise (the reference backend does: it is the slow fallback).
    Raises ValueError on bad arguments (before any launch) and BackendUnavailable (a ValueError) when a forced
    backend cannot serve."""
    check_flush_args(pool, idx, q0, check_idx)
    dispatch.select(pool, idx.numel(), backend).flush(pool, idx, q0)


def warmup(pool: Pool, *, backend: str | None = None) -> str:
    """Compile / load the chosen backend's kernel for ``pool`` outside any graph capture; returns its name."""
    check_pool(pool)
    b = dispatch.select(pool, pool.num_slots, backend)
    if b.warmup is not None:
        b.warmup(pool)
    return b.name


_POOLS: dict[tuple, Pool] = {}


def _scratch_pool(B: int, H: int, device: torch.device, gate: str) -> Pool:
    key = (B, H, str(device), gate)
    pool = _POOLS.get(key)
    if pool is None:
        if len(_POOLS) > 8:
            _POOLS.clear()
        pool = _POOLS[key] = Pool(B + 1, H, device=device, gate=gate)
    return pool


def _run(gate: str, args: dict[str, torch.Tensor], backend: str | None) -> tuple[torch.Tensor, ...]:
    B, H, dev = check_run_args(gate, args)
    pool = _scratch_pool(B, H, dev, gate)
    rows = torch.arange(1, B + 1, device=dev)
    pool.write_checkpoint(rows, args["codes"], args["s_k"], args["s_v"], args["u"], args["q"])
    gate_arg = args["pcum"] if gate == "kda" else args["p"]
    pool.write_window(rows, args["kbuf"], args["ubuf"], args["w"], gate_arg, args.get("gbuf"), fill=L)
    flush_inplace(pool, rows.to(torch.int32), args["q0"].contiguous(), backend=backend)
    return pool.read_checkpoint(rows)


def run(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
        kbuf: torch.Tensor, ubuf: torch.Tensor, gbuf: torch.Tensor, w: torch.Tensor, pcum: torch.Tensor,
        q0: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional KDA flush, every program due. Leading dims [B, H]:
    codes int8 [B, H, V, K], s_k fp32 [B, H, K], s_v fp32 [B, H, V], u fp16 [B, H, R, K], q fp16 [B, H, R, V],
    kbuf bf16 [B, H, L, K], ubuf bf16 [B, H, L, V], gbuf fp16 [B, H, L, K], w fp32 [B, H, L], pcum fp32 [B, H, K],
    q0 fp32 [V, R]. Returns fresh ``(codes, s_k, s_v, u, q)`` of the same shapes and dtypes."""
    return _run("kda", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, gbuf=gbuf, w=w,
                            pcum=pcum, q0=q0), backend)


def run_gdn(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
            kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, p: torch.Tensor, q0: torch.Tensor, *,
            backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional GDN flush, every program due: as :func:`run` with the scalar gate product p fp32 [B, H] in place
    of gbuf and pcum."""
    return _run("gdn", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, w=w, p=p, q0=q0),
                backend)


def versions() -> dict[str, str]:
    """Python, torch, triton and tilelang versions ("not installed" where absent), read without importing them."""
    return dispatch.versions()


def device_description(device: torch.device | str | None = None) -> str:
    """The device in words: a GPU's name, compute capability and SM count, or the CPU's."""
    return dispatch.device_description(device)


def backend_info(device: torch.device | str | None = None, num_heads: int = 32, gate: str = "kda",
                 num_rows: int = 256) -> list[dict]:
    """Every backend, available or not, with the reasons it cannot serve a pool of this geometry on ``device``:
    dicts with ``name``, ``available``, ``reasons``, ``auto_rank`` (1 = auto's first choice, None = never auto),
    ``description`` and ``versions``."""
    return dispatch.backend_info(device, num_heads=num_heads, gate=gate, num_rows=num_rows)


__all__ = ["flush_inplace", "run", "run_gdn", "warmup", "backend_info", "versions", "device_description"]
