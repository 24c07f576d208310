"""Public entry points: the deployment form :func:`flush_inplace` and the functional forms :func:`run` (KDA) and
:func:`run_gdn` (GDN), both of which go through the dispatch; the decode step's deployment form
:func:`step_inplace` and its functional forms :func:`step` (KDA) and :func:`step_gdn` (GDN), through the dispatch's
``op="step"``."""
from __future__ import annotations

import functools
import threading

import torch

from . import dispatch
from .layout import DEFAULT_HEADS, FIELDS, L, V, Pool, checked_start_matrix
from .reference import pool_writes
from .validate import (check_flush_args, check_flag, check_pool, check_q0, check_q0_values, check_run_args,
                       check_step_args, check_step_run_args, want_values)


@torch.compiler.disable
def flush_inplace(pool: Pool, idx: torch.Tensor, q0: torch.Tensor, *, backend: str | None = None,
                  check_idx: bool | None = None) -> None:
    """Flush every due program of the rows in ``idx``, in place.

    pool: :class:`Pool`. idx: int32 [N] on the pool's device, slot per row (``<= 0``: no sequence, the row is
    skipped, as engines pad with -1 or 0). q0: fp32 [V, R], the start of the subspace iteration, shared by all
    programs: finite, independent columns near unit norm as :func:`leapquant.default_q0`'s (the kernels form S^T q0's
    Gram matrix in fp32; its values are read on the host only with ``check_idx``). A program (slot, head) is due
    when ``hcnt == L``; its checkpoint is rewritten and its window reset (``w = 0``, ``pcum = 0``, ``gbuf = 1``; GDN
    ``p = 1``); ``hcnt`` stays ``L``. A due program whose window is already empty (every ``w`` 0 and no decay: KDA
    every ``pcum`` 0, GDN ``p`` 1; ``reference.empty_window``) is left as it is, so a second call without a decode
    step in between changes nothing. Everything else in the pool stays bitwise untouched.

    backend: ``None`` (LEAPQUANT_BACKEND / use_backend / auto), or one of ``auto, reference, triton, tilelang``.
    check_idx: also check idx's values (every slot < num_slots, no slot twice), the fill counts of their programs
    (in [0, L]) and q0's values (finite, independent columns near unit norm): a host synchronisation, so off by
    default (``None``: the ``LEAPQUANT_CHECK_IDX`` environment switch); unchecked, slots >= num_slots are skipped, and
    a slot given twice is the caller's error (its programs' flushes would race).
    The call never synchronises with the host otherwise (the reference backend does: it is the slow fallback).
    Raises ValueError on bad arguments (before any launch) and BackendUnavailable (a ValueError) when a forced
    backend cannot serve."""
    check_flush_args(pool, idx, q0, check_idx)
    dispatch.select(pool, idx.numel(), backend).flush(pool, idx, q0)


def warmup(pool: Pool, *, backend: str | None = None) -> str:
    """Compile / load the chosen backend's flush kernel for ``pool`` outside any graph capture; returns its name.
    The step kernel is specialised on the call's own arguments (key heads, beta's mode, the inputs' alignment): one
    eager step_inplace / decode_inplace call with the engine's buffers before capturing compiles it (as
    examples/kda_decode_loop.py does, with every row padding)."""
    check_pool(pool)
    b = dispatch.select(pool, pool.num_slots, backend)
    if b.warmup is not None:
        b.warmup(pool)
    return b.name


#: scratch pools the functional forms keep per thread (for its most recent shapes: B, H, device, gate); a pool of
#: B + 1 slots holds about B x H x 81 KB (KDA; 0.66 GB at B = 256, H = 32) until its thread ends or it is replaced
SCRATCH_POOLS = 1
_SCRATCH = threading.local()


def _scratch_pool(B: int, H: int, device: torch.device, gate: str) -> Pool:
    """A pool of ``B + 1`` slots for one functional call: the calling thread's own (threads never share one), reused
    for the thread's last :data:`SCRATCH_POOLS` shapes and released beyond them."""
    pools = getattr(_SCRATCH, "pools", None)
    if pools is None:
        pools = _SCRATCH.pools = {}
    key = (B, H, str(device), gate)
    pool = pools.pop(key, None)
    if pool is None:
        pool = Pool(B + 1, H, device=device, gate=gate)
    pools[key] = pool                                   # (insertion order: the most recent last)
    while len(pools) > SCRATCH_POOLS:
        del pools[next(iter(pools))]
    return pool


def _run(gate: str, args: dict[str, torch.Tensor], backend: str | None) -> tuple[torch.Tensor, ...]:
    B, H, dev = check_run_args(gate, args)
    # q0's values too (the functional form reads values on the host anyway): a non-finite start matrix
    q0 = checked_start_matrix(args["q0"], dev)
    if B == 0:                          # no program: empty outputs, as flush_inplace does nothing for no rows
        return tuple(torch.empty((0, H) + FIELDS[n].shape, dtype=FIELDS[n].dtype, device=dev)
                     for n in ("codes", "s_k", "s_v", "u", "q"))
    pool = _scratch_pool(B, H, dev, gate)
    rows = torch.arange(1, B + 1, device=dev)
    pool.write_checkpoint(rows, args["codes"], args["s_k"], args["s_v"], args["u"], args["q"])
    gate_arg = args["pcum"] if gate == "kda" else args["p"]
    pool.write_window(rows, args["kbuf"], args["ubuf"], args["w"], gate_arg, args.get("gbuf"), fill=L)
    flush_inplace(pool, rows.to(torch.int32), q0.contiguous(), backend=backend)
    return pool.read_checkpoint(rows)


def run(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
        kbuf: torch.Tensor, ubuf: torch.Tensor, gbuf: torch.Tensor, w: torch.Tensor, pcum: torch.Tensor,
        q0: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional KDA flush, every program due. Leading dims [B, H]:
    codes int8 [B, H, V, K], s_k fp32 [B, H, K], s_v fp32 [B, H, V], u fp16 [B, H, R, K], q fp16 [B, H, R, V],
    kbuf bf16 [B, H, L, K], ubuf bf16 [B, H, L, V], gbuf fp16 [B, H, L, K], w fp32 [B, H, L], pcum fp32 [B, H, K],
    q0 fp32 [V, R] (finite; the start matrix: independent columns of norm in ``numerics.Q0_NORM_RANGE``, near 1 as
    :func:`leapquant.default_q0`'s, else a ``ValueError``: the kernels form S^T q0's Gram matrix in fp32). Returns
    fresh ``(codes, s_k, s_v, u, q)`` of the same shapes and dtypes (a program whose window is empty,
    ``reference.empty_window``, gets its own checkpoint back unchanged; B = 0: empty outputs).

    The functional forms (:func:`run`, :func:`run_gdn`, :func:`step`, :func:`step_gdn`) go through a scratch pool of
    ``B + 1`` slots that each thread keeps for its last :data:`SCRATCH_POOLS` shapes: threads may call them at once;
    an engine serves from its own pool with the ``*_inplace`` calls instead."""
    return _run("kda", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, gbuf=gbuf, w=w,
                            pcum=pcum, q0=q0), backend)


def run_gdn(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
            kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, p: torch.Tensor, q0: torch.Tensor, *,
            backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional GDN flush, every program due: as :func:`run` with the scalar gate product p fp32 [B, H] in place
    of gbuf and pcum."""
    return _run("gdn", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, w=w, p=p, q0=q0),
                backend)


# ---- the decode step (SPEC section 7) ------------------------------------------------------------------------------
@torch.compiler.disable
def step_inplace(pool: Pool, idx: torch.Tensor, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, out: torch.Tensor | None = None, *,
                 num_k_heads: int | None = None, beta_bf16: bool = True, backend: str | None = None,
                 check_idx: bool | None = None) -> torch.Tensor:
    """One decode step of every head of the rows in ``idx``, on the pool, in place (SPEC section 7). Returns ``out``.

    pool: :class:`Pool` (KDA or GDN; H heads). idx: int32 [N] on the pool's device, the slot of each row (``<= 0``: no
    sequence: zero output, nothing written; slots >= num_slots are skipped the same way). qkv: bf16 [N, W], one row
    per sequence laid out ``(q | k | v)`` = Hk*K query, Hk*K key and H*V value elements, W = 2 Hk K + H V (rows at any
    stride >= W, each row dense). a: bf16 [N, H, K] (KDA, a gate per key channel) or [N, H] (GDN), the gate
    pre-activation; b: bf16 [N, H], beta's pre-activation (rows at any stride, each row dense). A_log: fp32 [H];
    dt_bias: fp32 [H, K] (KDA) or [H] (GDN). out: bf16 [N, H, V] contiguous, written for every row (allocated when
    None; a captured graph passes its own). num_k_heads: Hk (None: H for KDA; GDN: from qkv's width), H % Hk == 0,
    value head j reads key head j // (H // Hk) (GDN's GQA; KDA has Hk = H). beta_bf16: round beta = sigmoid(b) to
    bf16 as the models carry it (False: keep fp32, as vLLM).

    Each stepped program (slot, head) with fill count h (``hcnt``; L, "just flushed, empty", counts as 0) appends
    entry h of its window: ``kbuf[h] = kn`` (bf16), ``ubuf[h] = u_new`` (bf16), KDA ``gbuf[h] = exp(g)`` (fp16) and
    ``pcum += g``, GDN ``p *= at`` and the live weights ``w[j < h] *= at``; ``w[h] = 1``; ``hcnt = h + 1``. Nothing
    else changes (the checkpoint is only read). The step that makes ``hcnt == L`` leaves the program due: the flush
    must run before its next step.

    The checks read metadata only (no host synchronisation; idx's values only with ``check_idx`` or
    ``LEAPQUANT_CHECK_IDX``, as :func:`flush_inplace`, which then also checks that no stepped program is due with a
    window no flush has folded); bad arguments raise ``ValueError`` naming the argument before anything is written.
    ``out`` may not share memory with anything the step reads (the inputs, the pool). Each slot may appear at most once
    in ``idx``: two rows stepping one slot are undefined (the backends differ; on a GPU their programs race), and only
    ``check_idx`` names it. GDN: pass ``num_k_heads`` (a qkv row with columns beyond q | k | v, such as an unsliced
    output gate z, reads as more key heads when the count is derived from its width). backend: as
    :func:`flush_inplace`; a backend without a step kernel (TileLang) cannot serve the step."""
    hk = check_step_args(pool, idx, qkv, a, b, A_log, dt_bias, out, num_k_heads, beta_bf16, check_idx)
    chosen = dispatch.select(pool, idx.numel(), backend, op="step")
    return _launch_step(chosen, pool, idx, qkv, a, b, A_log, dt_bias, out, hk, beta_bf16)


def _launch_step(chosen: dispatch.Backend, pool: Pool, idx: torch.Tensor, qkv: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, out: torch.Tensor | None, hk: int,
                 beta_bf16: bool) -> torch.Tensor:
    """The step on arguments already checked, through the backend already chosen."""
    if out is None:
        out = torch.empty(idx.numel(), pool.num_heads, V, dtype=torch.bfloat16, device=pool.device)
    chosen.step(pool, idx, qkv, a, b, A_log, dt_bias, out, hk, beta_bf16)
    return out


@torch.compiler.disable
def decode_inplace(pool: Pool, idx: torch.Tensor, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, q0: torch.Tensor, out: torch.Tensor | None = None, *,
                   num_k_heads: int | None = None, beta_bf16: bool = True, backend: str | None = None,
                   check_idx: bool | None = None) -> torch.Tensor:
    """One decode token of every head of the rows in ``idx``: :func:`step_inplace`, then :func:`flush_inplace` of the
    same rows, which folds exactly the windows this step filled (their fill count is now L; every other program of
    those rows has a fill count below L: the flush skips it). Arguments as the two calls'; returns ``out``.

    Both calls are checked (and their backends chosen) once, and the flush's kernel and workspace readied, before
    either writes anything, so a flush that cannot launch raises with the pool as it was. The pair is one call per
    layer per token for an engine; on the GPU backends both are graph-capturable launches (a separate step kernel and
    flush kernel: not fused). ``backend`` forces both ops' backend, so a backend without a step kernel (TileLang)
    cannot be forced here; auto pairs the Triton step with TileLang's flush where that serves (``leapquant info``
    lists each op's choice)."""
    hk = check_step_args(pool, idx, qkv, a, b, A_log, dt_bias, out, num_k_heads, beta_bf16, check_idx)
    check_q0(pool, q0, out)                   # (the pool and idx, and idx's values if asked for: checked just above)
    if want_values(check_idx):
        check_q0_values(q0)
    step_backend = dispatch.select(pool, idx.numel(), backend, op="step")
    flush_backend = dispatch.select(pool, idx.numel(), backend)
    # the flush readied before the step writes: one that cannot launch must not leave the step's full windows unfolded
    launch_flush = (flush_backend.prepare(pool, idx, q0) if flush_backend.prepare is not None
                    else functools.partial(flush_backend.flush, pool, idx, q0))
    out = _launch_step(step_backend, pool, idx, qkv, a, b, A_log, dt_bias, out, hk, beta_bf16)
    launch_flush()
    return out


def _step_run(gate: str, args: dict[str, torch.Tensor], num_k_heads: int | None, beta_bf16: bool,
              backend: str | None) -> tuple[torch.Tensor, ...]:
    """The functional step through the deployment form: the inputs loaded into a scratch pool, one step_inplace,
    the appended entries and the gate state read back."""
    B, H, hk, dev = check_step_run_args(gate, args, num_k_heads)
    check_flag("beta_bf16", beta_bf16)
    if B == 0:                          # no program: empty outputs (o, an entry of kbuf, ubuf (gbuf), then w, pcum / p)
        def empty(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty((0, H, *dims), dtype=dtype, device=dev)
        rows = ("kbuf", "ubuf", "gbuf") if gate == "kda" else ("kbuf", "ubuf")
        entries = [empty(FIELDS[n].shape[1:], FIELDS[n].dtype) for n in rows]
        return (empty((V,), torch.bfloat16), *entries,
                *(empty(FIELDS[n].shape, FIELDS[n].dtype) for n in ("w", "pcum" if gate == "kda" else "p")))
    pool = _scratch_pool(B, H, dev, gate)
    rows = torch.arange(1, B + 1, device=dev)
    pool.write_checkpoint(rows, args["codes"], args["s_k"], args["s_v"], args["u"], args["q"])
    gate_arg = args["pcum"] if gate == "kda" else args["p"]
    pool.write_window(rows, args["kbuf"], args["ubuf"], args["w"], gate_arg, args.get("gbuf"), fill=0)
    h = args["h"]
    with pool_writes():
        pool.hcnt[rows] = h
    qkv = torch.cat([args["qx"].reshape(B, -1), args["kx"].reshape(B, -1), args["vx"].reshape(B, -1)], dim=1)
    out = torch.empty(B, H, V, dtype=torch.bfloat16, device=dev)
    # (the rows are the form's own, one slot each; a fill count of L is an input here, not a flush left out)
    # a, b and the constants as the deployment form takes them (dense rows, contiguous): the functional form takes any
    # layout, as it does for the other inputs
    a, b, A_log, dt_bias = (args[n].contiguous() for n in ("a", "b", "A_log", "dt_bias"))
    step_inplace(pool, rows.to(torch.int32), qkv, a, b, A_log, dt_bias, out,
                 num_k_heads=hk, beta_bf16=beta_bf16, backend=backend, check_idx=False)
    entry = torch.where(h == L, torch.zeros_like(h), h).long()          # the entry the step appended
    si = rows.unsqueeze(1).expand(B, H)
    hi = torch.arange(H, device=dev).unsqueeze(0).expand(B, H)
    head = (out, pool.kbuf[si, hi, entry], pool.ubuf[si, hi, entry])
    if gate == "kda":
        return head + (pool.gbuf[si, hi, entry], pool.w[rows], pool.pcum[rows])
    return head + (pool.w[rows], pool.p[rows])


def step(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
         kbuf: torch.Tensor, ubuf: torch.Tensor, gbuf: torch.Tensor, w: torch.Tensor, pcum: torch.Tensor,
         h: torch.Tensor, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         A_log: torch.Tensor, dt_bias: torch.Tensor, *, beta_bf16: bool = True,
         backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional KDA decode step (SPEC section 7), leading dims [B, H], through the dispatch.

    The checkpoint: codes int8 [B, H, V, K], s_k fp32 [B, H, K], s_v fp32 [B, H, V], u fp16 [B, H, R, K], q fp16
    [B, H, R, V]. The window: kbuf bf16 [B, H, L, K], ubuf bf16 [B, H, L, V], gbuf fp16 [B, H, L, K], w fp32
    [B, H, L], pcum fp32 [B, H, K], the fill count h int32 [B, H] in [0, L] (L: just flushed, read as 0; entries at
    and past h do not enter the result, but every value must lie in the window's domain: the form stores them
    through :meth:`Pool.write_window`, which checks them). The token: qx, kx bf16 [B, H, K], vx bf16 [B, H, V],
    a bf16 [B, H, K], b bf16 [B, H]; A_log fp32 [H], dt_bias fp32 [H, K]. beta_bf16: as :func:`step_inplace`.
    B = 0 gives empty outputs.

    Returns fresh ``(o bf16 [B, H, V], k_row bf16 [B, H, K], u_row bf16 [B, H, V], g_row fp16 [B, H, K], w_new fp32
    [B, H, L], pcum_new fp32 [B, H, K])``: the output, the window entry the step appends (kn, u_new, exp(g)), the
    weights with ``w[h] = 1`` and ``pcum + g``."""
    return _step_run("kda", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, gbuf=gbuf, w=w,
                                 pcum=pcum, h=h, qx=qx, kx=kx, vx=vx, a=a, b=b, A_log=A_log, dt_bias=dt_bias),
                     None, beta_bf16, backend)


def step_gdn(codes: torch.Tensor, s_k: torch.Tensor, s_v: torch.Tensor, u: torch.Tensor, q: torch.Tensor,
             kbuf: torch.Tensor, ubuf: torch.Tensor, w: torch.Tensor, p: torch.Tensor, h: torch.Tensor,
             qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, *, beta_bf16: bool = True, num_k_heads: int | None = None,
             backend: str | None = None) -> tuple[torch.Tensor, ...]:
    """Functional GDN decode step (SPEC section 7), leading dims [B, H], through the dispatch.

    As :func:`step` with one gate per head: no gbuf / pcum but the gate product p fp32 [B, H]; qx, kx bf16
    [B, Hk, K] with Hk key heads dividing H (GQA: value head j reads key head j // (H // Hk); ``num_k_heads``, when
    given, must equal Hk); a bf16 [B, H]; dt_bias fp32 [H].

    Returns fresh ``(o bf16 [B, H, V], k_row bf16 [B, H, K], u_row bf16 [B, H, V], w_new fp32 [B, H, L], p_new fp32
    [B, H])``: w_new has the live weights (j < h) decayed by ``at = exp(g)`` and ``w[h] = 1``; ``p_new = p * at``."""
    return _step_run("gdn", dict(codes=codes, s_k=s_k, s_v=s_v, u=u, q=q, kbuf=kbuf, ubuf=ubuf, w=w, p=p, h=h,
                                 qx=qx, kx=kx, vx=vx, a=a, b=b, A_log=A_log, dt_bias=dt_bias),
                     num_k_heads, beta_bf16, backend)


def versions() -> dict[str, str]:
    """Python, torch, triton and tilelang versions ("not installed" where absent), read without importing them."""
    return dispatch.versions()


def device_description(device: torch.device | str | None = None) -> str:
    """The device in words: a GPU's name, compute capability and SM count, or the CPU's."""
    return dispatch.device_description(device)


def backend_info(device: torch.device | str | None = None, num_heads: int = DEFAULT_HEADS, gate: str = "kda",
                 num_rows: int = 256, op: str = "flush") -> list[dict]:
    """Every backend, available or not, with the reasons it cannot serve ``op`` (``"flush"`` or ``"step"``) on a pool
    of this geometry on ``device``: dicts with ``name``, ``available``, ``reasons``, ``auto_rank`` (1 = auto's first
    choice, None = never auto), ``description`` and ``versions``."""
    return dispatch.backend_info(device, num_heads=num_heads, gate=gate, num_rows=num_rows, op=op)


__all__ = ["flush_inplace", "run", "run_gdn", "step_inplace", "step", "step_gdn", "decode_inplace", "warmup",
           "backend_info", "versions", "device_description"]
