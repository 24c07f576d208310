"""The Triton backend's launcher: one launch per call, CUDA-graph safe (no host sync, no allocation, a fixed grid).

Two kernels take the same arguments, workspace and grid: on a GPU the Gluon kernel
(:mod:`leapquant.triton.gluon_kernel`: tensor-core rank updates in layouts chosen for the algorithm; 3x faster on the
H200), elsewhere the ``tl`` kernel (:mod:`leapquant.triton.tl_kernel`), which the interpreter runs (the CPU test
tier). :func:`kernel_name_for` chooses one per device; :func:`flush` makes the pool's workspace once, compiles the
chosen kernel for the pool's buffers, binds its launch (:func:`_bind`) and launches it.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton

from .. import dispatch
from ..layout import Pool, buffer_addresses, capturing, on_pool_device, slot_stride
from ..validate import binding_current, checked_record
from . import step_kernel, tl_kernel
from .tl_kernel import INTERPRETED

#: (row, head) flags a program ranks per step of its scan (rows x heads padded to a power of two); a compile-time
#: argument of both kernels. On a GPU one step covers batch 256 x 32 heads, all its loads in flight at once (each step
#: costs two dependent trips to memory: idx, then the fill counters); under the interpreter a short step lets the CPU
#: tests span several steps at small sizes
SCAN_FLAGS = 1024 if INTERPRETED else 8192
#: held around every launch: Triton's interpreter patches module-level state while it runs a kernel, so two threads'
#: interpreted launches collide (an InterpreterError in one of them); compiled launches need no lock
_LAUNCH_LOCK = threading.Lock() if INTERPRETED else contextlib.nullcontext()
#: rows a call may carry before the workspace must grow (growing allocates: done outside graph capture only)
MIN_ROW_CAPACITY = 1024
#: persistent programs under the interpreter (any number is correct; a few keep the CPU tests short)
INTERPRETER_PROGRAMS = 4
#: shared memory the CUDA runtime reserves per resident block (sm_80 and newer): a program's share of an SM is its
#: kernel's own plus this
RESERVED_SHARED_BYTES = 1024

#: which kernel a GPU call runs: "mma" (the Gluon kernel: tensor-core rank updates, explicit layouts; wherever Triton
#: ships a validated Gluon and the GPU has mma.sync, sm_80+) or "tl" (the portable kernel: the one the interpreter
#: runs, and the fallback). The environment variable forces one (read when a pool's launch is bound); a forced "mma"
#: that cannot run raises with the reasons
KERNEL_ENV = "LEAPQUANT_TRITON_KERNEL"
KERNELS = ("mma", "tl")

#: Triton releases the Gluon kernel is validated on (compiled, judged by the criterion and timed on the H200).
#: Gluon is Triton's experimental dialect and changes between releases, so elsewhere the backend serves with the
#: portable tl kernel and says why (``leapquant info``)
GLUON_VALIDATED_TRITON = ("3.6",)

#: Triton releases the bound launch (:func:`_bind`) was validated on: it calls the compiled kernel's own launcher
#: (``CompiledKernel[grid](*every kernel parameter)``), skipping the JIT's per-call argument binding and
#: specialisation. Elsewhere every call goes through the JIT's launch (correct; tens of microseconds dearer per call)
BOUND_LAUNCH_TRITON = ("3.6",)


def _gluon_kernel():
    """The Gluon kernel's module, imported on first use: a Triton without a usable Gluon fails this import, and the
    backend must still serve there with the tl kernel (:func:`mma_reasons` reports the failure)."""
    from . import gluon_kernel
    return gluon_kernel


# ---- kernel choice ---------------------------------------------------------------------------------------------------
def mma_reasons(device: torch.device) -> list[str]:
    """Why the Gluon kernel cannot serve ``device`` (empty: it can)."""
    if INTERPRETED or device.type != "cuda":
        return ["the Gluon kernel runs on CUDA GPUs only (not under TRITON_INTERPRET=1)"]
    why = []
    if not triton.__version__.startswith(GLUON_VALIDATED_TRITON):
        why.append(f"the Gluon kernel is validated on triton {', '.join(v + '.x' for v in GLUON_VALIDATED_TRITON)}, "
                   f"this is {triton.__version__} (the tl kernel serves instead)")
    if torch.cuda.get_device_capability(device) < (8, 0):
        why.append(f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0): no mma.sync")
    if not why:
        try:
            _gluon_kernel()
        except Exception as exc:  # a Triton without a usable Gluon
            why.append(f"triton {triton.__version__} has no usable Gluon: {type(exc).__name__}: {exc}")
    return why


def kernel_name_for(device: torch.device) -> str:
    """The kernel a call on ``device`` runs (see :data:`KERNEL_ENV`)."""
    forced = os.environ.get(KERNEL_ENV, "").strip().lower()
    if forced and forced not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={forced!r}: expected one of {KERNELS}")
    why = mma_reasons(device)
    if forced == "mma" and why:
        raise RuntimeError(f"{KERNEL_ENV}=mma cannot run: " + "; ".join(why))
    if forced:
        return forced
    return "tl" if why else "mma"


def kernel_fn(kernel: str):
    """The jit function of ``kernel`` ("mma" or "tl"); both take :func:`flush_args`, then :func:`flush_meta`'s
    compile-time arguments."""
    if kernel == "mma":
        return _gluon_kernel().flush_due
    return tl_kernel._flush_due


# ---- workspace and arguments -----------------------------------------------------------------------------------------
@dataclass
class _Workspace:
    """Per-pool workspace, allocated once outside the call: the due list, typed views of raw, the persistent grid
    size and the launch bound to the pool's buffers."""
    rows: int                      # largest len(idx) served without growing
    due: torch.Tensor              # int32 [rows * H]: the call's due programs by rank
    raw_u8: torch.Tensor
    raw_f16: torch.Tensor
    kernel: str = "tl"             # "mma" or "tl" (kernel_name_for)
    programs: int = 0              # persistent programs resident at once (0: not bound yet)
    buffers: tuple = ()            # PoolBuffers the launch is bound to (re-bound when the caller swaps one)
    addresses: tuple = ()          # where their data started when bound (re-bound when that moves)
    checked: object = None         # validate.checked_record(pool) when the binding was last found current
    launch: object = None          # launch(*kernel parameters): the compiled kernel's launcher, or the JIT's
    constants: tuple = ()          # the compile-time parameters, in the kernel's order, after the run-time ones


_WORKSPACES: "weakref.WeakKeyDictionary[Pool, _Workspace]" = weakref.WeakKeyDictionary()


def _workspace(pool: Pool, rows: int) -> _Workspace:
    ws = _WORKSPACES.get(pool)
    if ws is not None and ws.rows >= rows and ws.raw_u8.data_ptr() == pool.raw.data_ptr():
        return ws
    if capturing(pool.device):
        held = ws.rows if ws is not None else 0
        raise RuntimeError(f"leapquant triton flush: {rows} rows, more than the pool's workspace holds ({held}): "
                           f"outside CUDA graph capture, call leapquant.warmup(pool) (it makes room for "
                           f"max(num_slots, {MIN_ROW_CAPACITY}) rows) or flush once with at least {rows} rows first")
    cap = max(rows, MIN_ROW_CAPACITY, ws.rows if ws is not None else 0)
    ws = _Workspace(rows=cap, due=torch.zeros(cap * pool.num_heads, dtype=torch.int32, device=pool.device),
                    raw_u8=pool.raw.view(torch.uint8), raw_f16=pool.raw.view(torch.float16))
    _WORKSPACES[pool] = ws
    return ws


class PoolBuffers(NamedTuple):
    """The pool tensors a launch reads, in the kernels' argument order. ``gate_state`` is KDA's pcum or GDN's p; GDN
    has no gbuf, and its p stands in there (the kernels' signature has both; a GDN kernel never reads it)."""
    raw: torch.Tensor
    kbuf: torch.Tensor
    ubuf: torch.Tensor
    w: torch.Tensor
    gate_state: torch.Tensor
    gbuf: torch.Tensor
    hcnt: torch.Tensor


def pool_buffers(pool: Pool) -> PoolBuffers:
    """The pool's :class:`PoolBuffers`."""
    kda = pool.gate == "kda"
    return PoolBuffers(pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.pcum if kda else pool.p,
                       pool.gbuf if kda else pool.p, pool.hcnt)


def flush_args(pool: Pool, buffers: PoolBuffers, raw_u8: torch.Tensor, raw_f16: torch.Tensor, due: torch.Tensor,
               q0: torch.Tensor, idx: torch.Tensor) -> tuple:
    """Run-time arguments of either kernel (same order) for a call with ``idx``: ``buffers`` from
    :func:`pool_buffers`, raw's uint8 and fp16 views, ``due`` the workspace list int32 [>= len(idx) * H]."""
    b = buffers
    return (b.raw, raw_u8, raw_f16, b.kbuf, b.ubuf, b.w, b.gate_state, b.gbuf, q0, idx, b.hcnt, due,
            idx.numel(), pool.num_slots, slot_stride(pool.num_heads))


def _flush_args(pool: Pool, ws: _Workspace, q0: torch.Tensor, idx: torch.Tensor) -> tuple:
    return flush_args(pool, ws.buffers, ws.raw_u8, ws.raw_f16, ws.due, q0, idx)


def flush_meta(pool: Pool, kernel: str, programs: int) -> dict:
    """Compile-time arguments and launch options of ``kernel`` for a grid of ``programs``."""
    hp = triton.next_power_of_2(pool.num_heads)
    meta = dict(H=pool.num_heads, HP=hp, G=programs, IS_KDA=pool.gate == "kda", SCAN_FLAGS=SCAN_FLAGS)
    if kernel == "mma":
        return dict(meta, TW=min(hp, 32), num_warps=_gluon_kernel().WARPS, num_stages=1)
    return dict(meta, num_warps=tl_kernel.WARPS, num_stages=1)


# ---- binding and launching -------------------------------------------------------------------------------------------
def resident_programs(pool: Pool, fn, args: tuple, meta: dict) -> int:
    """Persistent grid size: the flush programs that fit on the GPU at once (registers, shared memory, threads), from
    the kernel ``fn`` compiled with ``args`` and ``meta`` for one program per SM."""
    if INTERPRETED or pool.device.type != "cuda":
        return INTERPRETER_PROGRAMS
    sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
    return programs_per_sm(pool.device, fn, args, dict(meta, G=sms)) * sms


def programs_per_sm(device: torch.device, fn, args: tuple, meta: dict) -> int:
    """How many programs of the kernel ``fn`` (compiled with ``args`` and ``meta``, launch options included) are
    resident on one SM of ``device`` at once: the least of what its registers, shared memory and threads allow."""
    props = torch.cuda.get_device_properties(device)
    kern = fn.warmup(*args, grid=(props.multi_processor_count,), **meta)
    try:
        kern._init_handles()                   # loads the module and fills n_regs (Triton 3.x)
        threads = 32 * meta["num_warps"]
        by_regs = props.regs_per_multiprocessor // (max(kern.n_regs, 1) * threads)
        smem = kern.metadata.shared + RESERVED_SHARED_BYTES
        by_smem = props.shared_memory_per_multiprocessor // smem
        by_threads = props.max_threads_per_multi_processor // threads
        return max(1, min(by_regs, by_smem, by_threads))
    except Exception:                          # an API change: one program per SM is always resident
        return 1


def _bound_launch_supported() -> bool:
    return not INTERPRETED and triton.__version__.startswith(BOUND_LAUNCH_TRITON)


def _bind(pool: Pool, ws: _Workspace, q0: torch.Tensor, idx: torch.Tensor) -> None:
    """Choose the kernel and grid, compile it for the pool's buffers and bind its launch (outside graph capture).

    The JIT specialises a kernel on its pointers' 16-byte alignment (not q0's and idx's, which change per call) and
    on the values of nothing else it is given at run time (N, num_slots and SS are not specialised), so one compiled
    kernel serves every call on these buffers: it is launched directly through its own launcher."""
    if capturing(pool.device):
        raise RuntimeError("leapquant triton flush: call leapquant.warmup(pool) outside CUDA graph capture first "
                           "(the kernel is compiled and bound to the pool's buffers there)")
    ws.buffers = pool_buffers(pool)
    ws.addresses = buffer_addresses(ws.buffers)
    ws.checked = checked_record(pool)
    ws.kernel = kernel_name_for(pool.device)
    fn = kernel_fn(ws.kernel)
    args = _flush_args(pool, ws, q0, idx)
    ws.programs = resident_programs(pool, fn, args, flush_meta(pool, ws.kernel, 1))
    meta = flush_meta(pool, ws.kernel, ws.programs)
    grid = (ws.programs, 1, 1)            # (the compiled kernel's launcher reads all three dimensions)
    if _bound_launch_supported():
        compiled = fn.warmup(*args, grid=grid, **meta)
        ws.constants = tuple(meta[name] for name in fn.arg_names[len(args):])
        ws.launch = compiled[grid]
    else:
        options = {k: v for k, v in meta.items() if k not in fn.arg_names}
        consts = {k: v for k, v in meta.items() if k in fn.arg_names}
        ws.constants = ()

        def launch(*args):
            fn[grid](*args, **consts, **options)
        ws.launch = launch


def _bound(pool: Pool, ws: _Workspace) -> bool:
    """Whether the workspace's launch is bound to the pool's current buffers: at once when the argument check's record
    is the one it was last found current with (the check has just looked at the buffers), else by comparing them."""
    if ws.launch is None:
        return False
    ok, ws.checked = binding_current(pool, ws.checked, ws.buffers, ws.addresses, pool_buffers(pool))
    return ok


def prepare(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> Callable[[], None]:
    """The flush of these arguments readied, returned as its launch: the workspace, the compiled kernel and the
    launch bound to the pool's buffers are made (or found) here, so that a flush that cannot launch raises now (a
    missing binding is made outside graph capture only, else the RuntimeError that says to warm up first).
    :func:`leapquant.decode_inplace` readies its flush before the step writes anything (a step whose flush then
    failed would leave full windows unfolded) and launches it after the step."""
    if idx.numel() == 0:
        return dispatch.no_launch
    with on_pool_device(pool), _LAUNCH_LOCK:
        ws = _workspace(pool, idx.numel())
        if not _bound(pool, ws):
            _bind(pool, ws, q0, idx)
        args = (*_flush_args(pool, ws, q0, idx), *ws.constants)
        launch = ws.launch

    def flush_launch() -> None:
        with on_pool_device(pool), _LAUNCH_LOCK:
            launch(*args)
    return flush_launch


def flush(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Triton backend of :func:`leapquant.flush_inplace` (arguments already validated).

    pool: :class:`~leapquant.layout.Pool`; idx int32 [N] slot per row (<= 0 or >= num_slots: skip); q0 fp32 [V, R].
    One launch of a fixed grid; no host synchronisation, no allocation once the pool's workspace exists."""
    prepare(pool, idx, q0)()


def warmup(pool: Pool) -> None:
    """Make the workspace (room for a call of ``max(num_slots, MIN_ROW_CAPACITY)`` rows: an engine's batch holds each
    slot at most once, plus padding), compile / load the kernel for ``pool`` and bind its launch (outside any graph
    capture) by flushing an all-skip row: nothing in the pool changes."""
    from ..reference import default_q0
    with on_pool_device(pool), _LAUNCH_LOCK:
        _workspace(pool, pool.num_slots)
    idx = torch.zeros(1, dtype=torch.int32, device=pool.device)
    flush(pool, idx, default_q0(pool.device))


# ---- the decode step ---------------------------------------------------------------------------------------------------
def step(pool: Pool, idx: torch.Tensor, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
         dt_bias: torch.Tensor, out: torch.Tensor, num_k_heads: int, beta_bf16: bool) -> None:
    """Triton backend of :func:`leapquant.step_inplace` (arguments already validated, ``out`` given).

    One launch of the step kernel, one program per (row, head): grid (N * H,); on a GPU where the Gluon kernel serves
    (:func:`kernel_name_for`) the Gluon step kernel (:mod:`leapquant.triton.gluon_step_kernel`), else the portable one
    (:mod:`leapquant.triton.step_kernel`). No host synchronisation and no allocation (raw's typed views are views), so the call can be captured in a CUDA
    graph once the kernel is compiled. GDN passes p in place of the KDA-only gbuf (never read there), as the flush."""
    if idx.numel() == 0:
        return
    args = (*_step_pool_args(pool), idx, qkv, a, b, A_log, dt_bias, out, pool.num_slots,
            slot_stride(pool.num_heads), qkv.stride(0), a.stride(0), b.stride(0))
    meta = dict(H=pool.num_heads, HK=num_k_heads, IS_KDA=pool.gate == "kda", BETA_BF16=bool(beta_bf16))
    grid = (idx.numel() * pool.num_heads,)
    with on_pool_device(pool), _LAUNCH_LOCK:
        if _step_kernel_choice(pool.device) == "mma":
            gk = _gluon_step_kernel()
            gk.step_kernel[grid](*args, **meta, num_warps=gk.WARPS, num_stages=1,
                                 maxnreg=gk.MAX_REGISTERS[pool.gate])
        else:
            step_kernel.step_kernel[grid](*args, **meta, BV=step_kernel.BV, num_warps=step_kernel.WARPS,
                                          num_stages=1)


#: per pool: (the argument check's record they were made under, the step's pool arguments)
_STEP_ARGS: "weakref.WeakKeyDictionary[Pool, tuple]" = weakref.WeakKeyDictionary()


def _step_pool_args(pool: Pool) -> tuple:
    """The step kernel's pool arguments (raw, its uint8 and fp16 views, the window tensors, hcnt), made again only
    when the argument check's record changes (a checked call; an unchecked one makes them every time)."""
    record = checked_record(pool)
    cached = _STEP_ARGS.get(pool)
    if cached is not None and record is not None and cached[0] is record:
        return cached[1]
    b = pool_buffers(pool)
    args = (b.raw, b.raw.view(torch.uint8), b.raw.view(torch.float16), b.kbuf, b.ubuf, b.w, b.gate_state, b.gbuf,
            b.hcnt)
    if record is not None:
        _STEP_ARGS[pool] = (record, args)
    return args


_STEP_CHOICE: dict[str, str] = {}


def _step_kernel_choice(device: torch.device) -> str:
    """:func:`kernel_name_for` of ``device``, made once per device (the step calls it on every launch)."""
    key = str(device)
    if key not in _STEP_CHOICE:
        _STEP_CHOICE[key] = kernel_name_for(device)
    return _STEP_CHOICE[key]


def _gluon_step_kernel():
    """The Gluon step kernel's module (imported on first use, as :func:`_gluon_kernel`)."""
    from . import gluon_step_kernel
    return gluon_step_kernel
