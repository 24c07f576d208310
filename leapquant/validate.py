"""Argument checks run before any launch: every failure is a ``ValueError`` naming the argument, and the pool is
left untouched.

The deployment call's checks read only tensor metadata (no host synchronisation): the pool's buffers once per pool
until one of them is replaced, idx and q0 on every call. The *values* of idx (range, repeats) need a device-to-host
copy, so they are checked only when asked: ``flush_inplace(..., check_idx=True)`` or ``LEAPQUANT_CHECK_IDX=1``
(a debugging switch; it cannot be used while a CUDA graph is being captured). Without it the kernels skip every row
whose slot is outside ``[1, num_slots)`` (``idx <= 0`` is how engines pad: vLLM with -1, SGLang with 0); a slot that
appears twice in one call is a caller error the unchecked path does not detect.
"""
from __future__ import annotations

import os
import weakref

import torch

from .layout import (GATES, K, L, R, V, Pool, check_dense, raw_words)

#: the environment switch of the idx value checks, read once at import ("1", "true", "yes", "on": checked)
CHECK_IDX_ENV = "LEAPQUANT_CHECK_IDX"
CHECK_IDX: bool = os.environ.get(CHECK_IDX_ENV, "").strip().lower() in ("1", "true", "yes", "on")

#: per pool, the buffer objects last found valid (held, so that no new tensor can take a checked one's identity):
#: a pool is re-checked only when one of its buffers is replaced
_CHECKED: "weakref.WeakKeyDictionary[Pool, tuple]" = weakref.WeakKeyDictionary()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _buffers(pool: Pool) -> tuple:
    """The objects a check validates: the pool's buffers (raw, its codes view, the window tensors)."""
    return tuple([getattr(pool, n, None) for n in ("raw", "codes", *pool.WINDOW_FIELDS[pool.gate])])


def _same(a: tuple | None, b: tuple) -> bool:
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def check_pool(pool: object, gate: str | None = None, num_heads: int | None = None) -> Pool:
    """The pool's buffers still match its geometry (an engine may have swapped one), and its gate / heads match
    what the caller expects. The full check runs once per set of buffers (the last valid set is remembered)."""
    if not isinstance(pool, Pool):
        raise ValueError(f"pool: expected a leapquant.Pool, got {type(pool).__name__}")
    if gate is not None and pool.gate != gate:
        raise ValueError(f"pool: gate mismatch: the pool is {pool.gate!r}, the call expects {gate!r}")
    if num_heads is not None and pool.num_heads != num_heads:
        raise ValueError(f"pool: num_heads mismatch: the pool has {pool.num_heads}, the call expects {num_heads}")
    key = _buffers(pool)
    if _same(_CHECKED.get(pool), key):
        return pool
    NS, H, dev = pool.num_slots, pool.num_heads, pool.device
    check_dense("pool.raw", pool.raw, (raw_words(NS, H),), torch.float32, dev)
    check_dense("pool.kbuf", pool.kbuf, (NS, H, L, K), torch.bfloat16, dev)
    check_dense("pool.ubuf", pool.ubuf, (NS, H, L, V), torch.bfloat16, dev)
    check_dense("pool.w", pool.w, (NS, H, L), torch.float32, dev)
    check_dense("pool.hcnt", pool.hcnt, (NS, H), torch.int32, dev)
    if pool.gate == "kda":
        check_dense("pool.pcum", pool.pcum, (NS, H, K), torch.float32, dev)
        check_dense("pool.gbuf", pool.gbuf, (NS, H, L, K), torch.float16, dev)
    else:
        check_dense("pool.p", pool.p, (NS, H), torch.float32, dev)
    if pool.codes.untyped_storage().data_ptr() != pool.raw.untyped_storage().data_ptr():
        raise ValueError("pool.raw: was replaced after the views were made; build a new Pool around it")
    _CHECKED[pool] = key
    return pool


def check_idx_values(pool: Pool, idx: torch.Tensor) -> None:
    """The values of idx (host-synchronising): every slot < num_slots (``<= 0`` skips the row) and no slot > 0 twice."""
    if _capturing(pool.device):
        raise ValueError(f"check_idx: the idx value checks read idx on the host, which a CUDA graph capture forbids "
                         f"(unset {CHECK_IDX_ENV} or pass check_idx=False while capturing)")
    if not idx.numel():
        return
    hi = int(idx.max())
    if hi >= pool.num_slots:
        raise ValueError(f"idx: slots must be < num_slots = {pool.num_slots} (values <= 0 skip the row), got {hi}")
    live = idx[idx > 0]
    if torch.unique(live).numel() != live.numel():
        raise ValueError("idx: a slot appears more than once (each sequence owns one slot)")


def check_flush_args(pool: object, idx: object, q0: object, check_idx: bool | None = None) -> Pool:
    """Validate a deployment call. idx int32 [N] (slot per row; ``<= 0``: no sequence), q0 fp32 [V, R].

    Metadata only, unless ``check_idx`` (default: :data:`CHECK_IDX`, from ``LEAPQUANT_CHECK_IDX``) asks for the
    host-synchronising checks of idx's values (:func:`check_idx_values`)."""
    pool = check_pool(pool)
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"idx: expected a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int32:
        raise ValueError(f"idx: expected dtype torch.int32, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"idx: expected a 1-D tensor [N], got shape {tuple(idx.shape)}")
    if idx.device != pool.device:
        raise ValueError(f"idx: expected device {pool.device} (the pool's), got {idx.device}")
    if not idx.is_contiguous():
        raise ValueError(f"idx: expected a contiguous tensor, got strides {tuple(idx.stride())}")
    check_dense("q0", q0, (V, R), torch.float32, pool.device)
    if CHECK_IDX if check_idx is None else check_idx:
        check_idx_values(pool, idx)
    return pool


def _expect(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device} (that of codes), got {t.device}")


def check_run_args(gate: str, args: dict[str, object]) -> tuple[int, int, torch.device]:
    """Validate the functional form's inputs (leading dims [B, H]); returns (B, H, device)."""
    assert gate in GATES
    codes = args["codes"]
    if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
        raise ValueError(f"codes: expected an int8 tensor [B, H, {V}, {K}], got "
                         f"{tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__}")
    B, H = codes.shape[:2]
    if B < 1 or H < 1:
        raise ValueError(f"codes: expected B >= 1 and H >= 1, got shape {tuple(codes.shape)}")
    dev = codes.device
    spec = {
        "codes": ((B, H, V, K), torch.int8), "s_k": ((B, H, K), torch.float32), "s_v": ((B, H, V), torch.float32),
        "u": ((B, H, R, K), torch.float16), "q": ((B, H, R, V), torch.float16),
        "kbuf": ((B, H, L, K), torch.bfloat16), "ubuf": ((B, H, L, V), torch.bfloat16),
        "w": ((B, H, L), torch.float32), "q0": ((V, R), torch.float32),
    }
    if gate == "kda":
        spec.update(gbuf=((B, H, L, K), torch.float16), pcum=((B, H, K), torch.float32))
    else:
        spec.update(p=((B, H), torch.float32))
    for name, (shape, dtype) in spec.items():
        _expect(name, args[name], shape, dtype, dev)
    return B, H, dev
