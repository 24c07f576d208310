"""Argument checks run before any launch: every failure is a ``ValueError`` naming the argument, and the pool is
left untouched.

The deployment call's checks read only tensor metadata (no host synchronisation): the pool's buffers once per pool
until one of them is replaced, idx and q0 on every call. The *values* of idx (range, repeats) and of q0 need a
device-to-host copy, so they are checked only when asked: ``flush_inplace(..., check_idx=True)`` or
``LEAPQUANT_CHECK_IDX=1`` (a debugging switch; it cannot be used while a CUDA graph is being captured). Without it
the kernels skip every row whose slot is outside ``[1, num_slots)`` (``idx <= 0`` is how engines pad: vLLM with -1,
SGLang with 0); a slot that appears twice in one call is a caller error the unchecked path does not detect, and so
are a fill count outside [0, L] (a pool built on the engine's uninitialised buffers and never reset) and a step of a
program whose full window no flush has folded (the switch checks both: the fill counts for every op, the window for
the step).
"""
from __future__ import annotations

import os
import weakref

import torch

from .layout import (FIELDS, GATES, K, L, R, V, Pool, as_int, buffer_addresses, byte_span, capturing, check_dense,
                     check_tensor, checked_start_matrix, first_overlap, same_objects)
from .options import name_word
from .reference import empty_window

#: the environment switch of the idx value checks, read once at import: "1", "true", "yes", "on" (any case): checked;
#: unset, "", "0", "false", "no", "off": not; any other value is kept as it is and named by the first call that reads
#: the switch (a debugging switch that a typo turned off would leave the caller believing its calls checked)
CHECK_IDX_ENV = "LEAPQUANT_CHECK_IDX"
_SWITCH_ON, _SWITCH_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def switch_value(text: str) -> bool | str:
    """An environment switch's text as True / False, or the text itself where it is neither."""
    word = name_word(text)
    return True if word in _SWITCH_ON else False if word in _SWITCH_OFF else text


CHECK_IDX: bool | str = switch_value(os.environ.get(CHECK_IDX_ENV, ""))

#: per pool, the buffer objects last found valid (held, so that no new tensor can take a checked one's identity),
#: their byte spans by name, their data addresses and the pool's geometry: a pool is re-checked only when one of its
#: buffers, or the memory behind one, is replaced, or its geometry attributes are changed
_CHECKED: "weakref.WeakKeyDictionary[Pool, tuple[tuple, dict[str, tuple[int, int]], tuple, tuple]]" = \
    weakref.WeakKeyDictionary()


def _buffers(pool: Pool) -> tuple:
    """The objects a check validates: the pool's buffers (raw, its codes view, the window tensors)."""
    return tuple([getattr(pool, n, None) for n in ("raw", "codes", *pool.WINDOW_FIELDS.get(pool.gate, ()))])


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
    geometry = (pool.gate, pool.num_slots, pool.num_heads, pool.slot_stride, pool.device)
    seen = _CHECKED.get(pool)
    if (seen is not None and seen[3] == geometry and same_objects(seen[0], key)
            and seen[2] == buffer_addresses(key)):
        return pool
    pool.check_buffers()
    names = ("raw", "codes", *pool.WINDOW_FIELDS[pool.gate])
    _CHECKED[pool] = (key, {f"pool.{n}": byte_span(t) for n, t in zip(names, key)}, buffer_addresses(key), geometry)
    return pool


def checked_record(pool: Pool) -> object | None:
    """The record :func:`check_pool` keeps of the buffers it last found valid for ``pool`` (None: never checked).
    It is replaced exactly when the full check runs again (a buffer, the memory behind one or the geometry changed),
    so a backend that bound its launch while this record was current may launch again without looking at the
    buffers itself, as long as the call was checked first: one look at the buffers per call, not one per layer of
    the call (the eager call's host time: the design note of the Triton backend)."""
    return _CHECKED.get(pool)


def binding_current(pool: Pool, seen: object | None, buffers: tuple, addresses: tuple,
                    current: tuple) -> tuple[bool, object | None]:
    """Whether what a backend bound from ``buffers`` (whose data started at ``addresses``) still fits the pool's
    ``current`` buffers, and the record to keep beside the binding: at once when :func:`checked_record` is ``seen``,
    the record the binding was last found current with (the check has just looked at the buffers), else by comparing
    the buffers themselves."""
    record = checked_record(pool)
    if record is not None and seen is record:
        return True, record
    ok = same_objects(buffers, current) and addresses == buffer_addresses(buffers)
    return ok, (record if ok else None)


def _pool_spans(pool: Pool) -> dict[str, tuple[int, int]]:
    """The byte spans of a checked pool's buffers, by name."""
    return _CHECKED[pool][1]


def want_values(check_idx: object) -> bool:
    """Whether to run the host-synchronising value checks (idx's values, the fill counts of its programs, q0's
    values): ``check_idx`` (a bool) where given, else the environment switch."""
    if check_idx is not None:
        return check_flag("check_idx", check_idx)
    if not isinstance(CHECK_IDX, bool):
        raise ValueError(f"{CHECK_IDX_ENV}: expected one of {', '.join(_SWITCH_ON)} (check idx's values) or "
                         f"{', '.join(repr(v) for v in _SWITCH_OFF)} (do not), got {CHECK_IDX!r}")
    return CHECK_IDX


def check_idx_values(pool: Pool, idx: torch.Tensor) -> None:
    """The values of idx (host-synchronising): every slot < num_slots (``<= 0`` skips the row) and no slot > 0 twice;
    and the fill counts of those slots' programs in [0, L]: the kernels read any other count as the nearest end of
    that range, so a count that was never initialised would drop or fold the window without an error."""
    if capturing(pool.device):
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
    hc = pool.hcnt[live.long()]
    bad = FIELDS["hcnt"].bad_mask(hc)
    if bool(bad.any()):
        row, head = bad.nonzero()[0].tolist()
        raise ValueError(f"hcnt: slot {int(live[row])}, head {head} has fill count {int(hc[row, head])}, outside "
                         f"[0, {L}] (a new sequence's slot starts from reset_slots; an engine's own hcnt buffer is "
                         f"not initialised by Pool)")


def check_windows_folded(pool: Pool, idx: torch.Tensor) -> None:
    """(Host-synchronising, with the idx value checks.) No program a step is about to serve is due with a window the
    flush has not folded: its fill count L reads as "just flushed, empty", so the step would drop the window's
    updates. The flush (or decode_inplace, which runs it) must come between the step that fills a window and the
    next."""
    slots = idx[(idx > 0) & (idx < pool.num_slots)].long()
    if not slots.numel():
        return
    gate = dict(pcum=pool.pcum[slots]) if pool.gate == "kda" else dict(p=pool.p[slots])
    unfolded = (pool.hcnt[slots] == L) & ~empty_window(pool.w[slots], **gate)
    if bool(unfolded.any()):
        row, head = unfolded.nonzero()[0].tolist()
        raise ValueError(f"idx: slot {int(slots[row])}, head {head} is due (fill count {L}) with a window the flush "
                         f"has not folded; run flush_inplace before its next step (decode_inplace does both)")


def _is_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_idx(pool: Pool, idx: object) -> torch.Tensor:
    """idx int32 [N], contiguous, on the pool's device (metadata only): the flush's and the step's idx."""
    idx = _is_tensor("idx", idx)
    if idx.dtype != torch.int32:
        raise ValueError(f"idx: expected dtype torch.int32, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"idx: expected a 1-D tensor [N], got shape {tuple(idx.shape)}")
    if idx.device != pool.device:
        raise ValueError(f"idx: expected device {pool.device} (the pool's), got {idx.device}")
    if not idx.is_contiguous():
        raise ValueError(f"idx: expected a contiguous tensor, got strides {tuple(idx.stride())}")
    return idx


def check_flush_args(pool: object, idx: object, q0: object, check_idx: bool | None = None) -> Pool:
    """Validate a deployment call. idx int32 [N] (slot per row; ``<= 0``: no sequence), q0 fp32 [V, R].

    Metadata only, unless ``check_idx`` (default: :data:`CHECK_IDX`, from ``LEAPQUANT_CHECK_IDX``) asks for the
    host-synchronising checks of idx's values (:func:`check_idx_values`)."""
    pool = check_pool(pool)
    idx = _check_idx(pool, idx)
    check_q0(pool, q0)
    if want_values(check_idx):
        check_idx_values(pool, idx)
        check_q0_values(q0)
    return pool


def check_q0(pool: Pool, q0: object, out: torch.Tensor | None = None) -> None:
    """q0 fp32 [V, R], dense, on the pool's device, sharing no memory with the pool (the flush reads it while it
    rewrites checkpoints) nor with ``out`` (:func:`leapquant.decode_inplace`'s step writes out before its flush reads
    q0)."""
    check_dense("q0", q0, (V, R), torch.float32, pool.device)
    shared = first_overlap(q0, _pool_spans(pool))
    if shared is not None:
        raise ValueError(f"q0: shares memory with {shared} (the flush reads q0 while it writes the pool)")
    if out is not None and first_overlap(out, {"q0": byte_span(q0)}) is not None:
        raise ValueError("out: shares memory with q0 (the step writes out before the flush reads q0)")


def check_q0_values(q0: torch.Tensor) -> None:
    """q0's values (host-synchronising: with idx's, when the value checks are asked for), as the functional form and
    ``encode`` check them: finite, independent columns near unit norm (``layout.checked_start_matrix``). A start
    matrix without R independent directions leaves the rank part to rounding noise, on which no two backends agree."""
    checked_start_matrix(q0, q0.device)


def _expect(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> None:
    check_tensor(name, t, shape, dtype, device, whose="that of codes")


def _leading_dims(codes: object) -> tuple[int, int, torch.device]:
    """(B, H, device) of a functional form's call, read off ``codes`` [B, H, V, K]."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
        raise ValueError(f"codes: expected an int8 tensor [B, H, {V}, {K}], got "
                         f"{tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__}")
    if codes.is_meta:
        raise ValueError("codes: expected a tensor with data, got one on the meta device")
    B, H = codes.shape[:2]
    if H < 1:
        raise ValueError(f"codes: expected H >= 1, got shape {tuple(codes.shape)}")
    return B, H, codes.device


def check_run_args(gate: str, args: dict[str, object]) -> tuple[int, int, torch.device]:
    """Validate the functional form's inputs (leading dims [B, H]); returns (B, H, device)."""
    assert gate in GATES
    B, H, dev = _leading_dims(args["codes"])
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


# ---- the decode step (SPEC section 7) ------------------------------------------------------------------------------
def _meta(name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...], dims: str, device: torch.device,
          whose: str) -> torch.Tensor:
    """Type, dtype, shape (``dims`` names it) and device of one argument (metadata only)."""
    return check_tensor(name, t, shape, dtype, device, dims=dims, whose=whose)


def _rows_dense(name: str, t: torch.Tensor, row_numel: int) -> None:
    """Each row (dim 0) dense and row-major, rows at any stride that keeps them apart (>= a row's size): how an
    engine's projections hand over slices of a wider row."""
    inner = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != inner:
            raise ValueError(f"{name}: each row must be dense and row-major (inner strides "
                             f"{tuple(t.stride()[1:])}, expected {tuple(_dense_strides(t.shape[1:]))})")
        inner *= size
    if t.shape[0] > 1 and t.stride(0) < row_numel:
        raise ValueError(f"{name}: row stride {t.stride(0)} is smaller than a row ({row_numel} elements)")


def _dense_strides(shape: tuple[int, ...]) -> list[int]:
    out, inner = [], 1
    for size in reversed(shape):
        out.append(inner)
        inner *= size
    return out[::-1]


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    return value


def _key_heads(gate: str, num_heads: int, num_k_heads: object, derived: int | None, arg: str, source: str) -> int:
    """The key-head count Hk: ``num_k_heads`` where given (it must then equal ``derived``, what ``source``, a property
    of argument ``arg``, implies, when that is known), else ``derived``; KDA has one key head per head, GDN any Hk
    dividing H (GQA)."""
    if num_k_heads is not None:
        given = as_int(num_k_heads)
        if given is None or given < 1:
            raise ValueError(f"num_k_heads: expected a positive int or None, got {num_k_heads!r}")
        if derived is not None and derived != given:
            raise ValueError(f"num_k_heads: {given} disagrees with {arg}: {source} gives {derived} key heads")
        hk = given
    elif derived is not None:
        if derived < 1:
            raise ValueError(f"{arg}: {source} gives {derived} key heads; expected at least one")
        hk = derived
    else:
        raise ValueError(f"{arg}: {source} does not tell the number of key heads; pass num_k_heads")
    if gate == "kda" and hk != num_heads:
        if num_k_heads is None:             # the count came from the input's shape: the input is what is wrong
            raise ValueError(f"{arg}: {source} gives {hk} key heads, but KDA has one key head per head "
                             f"({num_heads})")
        raise ValueError(f"num_k_heads: KDA has one key head per head ({num_heads}), got {hk}")
    if num_heads % hk:
        what = f"num_k_heads: got {hk}" if num_k_heads is not None else f"{arg}: {source} gives {hk} key heads"
        raise ValueError(f"{what}, but the {num_heads} heads must split evenly over the key heads")
    return hk


def check_step_args(pool: object, idx: object, qkv: object, a: object, b: object, A_log: object, dt_bias: object,
                    out: object, num_k_heads: object, beta_bf16: object, check_idx: bool | None = None) -> int:
    """Validate a deployment step call (see :func:`step_inplace`); returns the key-head count Hk.

    Metadata only (dtypes, shapes, strides, devices), unless ``check_idx`` (default ``LEAPQUANT_CHECK_IDX``) asks
    for the host-synchronising checks of idx's values. ``out`` may be None (the caller then gets a fresh tensor)."""
    pool = check_pool(pool)
    idx = _check_idx(pool, idx)
    N, H, dev, gate = idx.numel(), pool.num_heads, pool.device, pool.gate
    qkv = _is_tensor("qkv", qkv)
    if qkv.dtype != torch.bfloat16:
        raise ValueError(f"qkv: expected dtype torch.bfloat16, got {qkv.dtype}")
    if qkv.dim() != 2 or qkv.shape[0] != N:
        raise ValueError(f"qkv: expected shape (N, 2 Hk K + H V) with N = {N} (len(idx)), got {tuple(qkv.shape)}")
    width = qkv.shape[1]
    rest = width - H * V                          # q and k of the key heads: 2 Hk K
    derived = rest // (2 * K) if rest > 0 and rest % (2 * K) == 0 else None
    if num_k_heads is None and derived is None:
        raise ValueError(f"qkv: width {width} is not 2 Hk K + H V = 2 Hk * {K} + {H * V} for any key-head count Hk")
    hk = _key_heads(gate, H, num_k_heads, derived, "qkv", f"its width {width}")
    if width != 2 * hk * K + H * V:
        raise ValueError(f"qkv: expected width 2 Hk K + H V = {2 * hk * K + H * V} (Hk = {hk}), got {width}")
    if qkv.device != dev:
        raise ValueError(f"qkv: expected device {dev} (the pool's), got {qkv.device}")
    _rows_dense("qkv", qkv, width)
    if gate == "kda":
        _meta("a", a, torch.bfloat16, (N, H, K), "N, H, K", dev, "the pool's")
        _rows_dense("a", a, H * K)
    else:
        _meta("a", a, torch.bfloat16, (N, H), "N, H", dev, "the pool's")
        _rows_dense("a", a, H)
    _meta("b", b, torch.bfloat16, (N, H), "N, H", dev, "the pool's")
    _rows_dense("b", b, H)
    A_log = _meta("A_log", A_log, torch.float32, (H,), "H", dev, "the pool's")
    dt_shape, dt_dims = ((H, K), "H, K") if gate == "kda" else ((H,), "H")
    dt_bias = _meta("dt_bias", dt_bias, torch.float32, dt_shape, dt_dims, dev, "the pool's")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if out is not None:
        out = _meta("out", out, torch.bfloat16, (N, H, V), "N, H, V", dev, "the pool's")
        if not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous tensor, got strides {tuple(out.stride())}")
        # the step reads every input while it writes out (the kernels' programs in any order): out may not overlap any
        shared = first_overlap(out, {"idx": byte_span(idx), "qkv": byte_span(qkv), "a": byte_span(a),
                                      "b": byte_span(b), "A_log": byte_span(A_log),
                                      "dt_bias": byte_span(dt_bias), **_pool_spans(pool)})
        if shared is not None:
            raise ValueError(f"out: shares memory with {shared} (the step reads it while it writes out)")
    check_flag("beta_bf16", beta_bf16)
    if want_values(check_idx):
        check_idx_values(pool, idx)
        check_windows_folded(pool, idx)
    return hk


def check_step_run_args(gate: str, args: dict[str, object], num_k_heads: object) -> tuple[int, int, int,
                                                                                          torch.device]:
    """Validate the functional step's inputs (leading dims [B, H]); returns (B, H, Hk, device). Reads h's values on
    the host (every entry in [0, L])."""
    B, H, dev = _leading_dims(args["codes"])
    qx = _is_tensor("qx", args["qx"])
    if qx.dim() != 3:
        raise ValueError(f"qx: expected a bf16 tensor [B, Hk, {K}], got shape {tuple(qx.shape)}")
    hk = _key_heads(gate, H, num_k_heads, qx.shape[1], "qx", "its shape")
    spec = {
        "codes": ((B, H, V, K), torch.int8, "B, H, V, K"), "s_k": ((B, H, K), torch.float32, "B, H, K"),
        "s_v": ((B, H, V), torch.float32, "B, H, V"), "u": ((B, H, R, K), torch.float16, "B, H, R, K"),
        "q": ((B, H, R, V), torch.float16, "B, H, R, V"), "kbuf": ((B, H, L, K), torch.bfloat16, "B, H, L, K"),
        "ubuf": ((B, H, L, V), torch.bfloat16, "B, H, L, V"), "w": ((B, H, L), torch.float32, "B, H, L"),
        "h": ((B, H), torch.int32, "B, H"), "qx": ((B, hk, K), torch.bfloat16, "B, Hk, K"),
        "kx": ((B, hk, K), torch.bfloat16, "B, Hk, K"), "vx": ((B, H, V), torch.bfloat16, "B, H, V"),
        "b": ((B, H), torch.bfloat16, "B, H"), "A_log": ((H,), torch.float32, "H"),
    }
    if gate == "kda":
        spec.update(gbuf=((B, H, L, K), torch.float16, "B, H, L, K"), pcum=((B, H, K), torch.float32, "B, H, K"),
                    a=((B, H, K), torch.bfloat16, "B, H, K"), dt_bias=((H, K), torch.float32, "H, K"))
    else:
        spec.update(p=((B, H), torch.float32, "B, H"), a=((B, H), torch.bfloat16, "B, H"),
                    dt_bias=((H,), torch.float32, "H"))
    for name, (shape, dtype, dims) in spec.items():
        _meta(name, args[name], dtype, shape, dims, dev, "that of codes")
    h = args["h"]
    bad = FIELDS["hcnt"].bad_mask(h)
    if bool(bad.any()):
        raise ValueError(f"h: expected fill counts in [0, {L}] ({L}: just flushed, read as 0), got "
                         f"{int(h[bad][0])} at {tuple(bad.nonzero()[0].tolist())}")
    return B, H, hk, dev
