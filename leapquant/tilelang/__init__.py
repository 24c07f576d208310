"""The TileLang backend: a persistent flush kernel built with TileLang (0.1.12-0.1.15, see REQUIRED_TILELANG) for
sm_90a (H100/H200) and sm_100a (B200). Importing this module registers the backend with :mod:`leapquant.dispatch`.

    reasons(pool)   why the backend cannot serve ``pool`` (empty: it can)
    warmup(pool)    build (or load from TileLang's disk cache) the kernel for the pool's geometry, outside any capture
    flush(pool, idx, q0)   the deployment call; arguments already validated
    use_kernel(cfg, kernel)   serve one geometry with another compiled kernel in a block (a variant under test)

Compiled kernels are cached per (num_heads, gate, arch, SM count); the kernel takes the pool's size and the call's
row count as run-time sizes, so one build serves every pool and batch of that geometry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import threading
import weakref
from typing import Callable, Iterator

import torch

from .. import dispatch
from ..layout import GATES, LOOSE_ALIGNMENT, Pool, buffer_addresses, on_pool_device
from ..validate import binding_current, checked_record
from .config import ALIGN_BYTES, SUPPORTED_HEADS, FlushConfig, shared_bytes

#: the tilelang releases the kernel is validated on, and how. "gpu": the GPU suite (every input family, both gates,
#: heads 8 / 16 / 32, graph replay) and the benchmark ran with it on the H200. "build": the CPU tier
#: (tests/test_tilelang.py) lowers the kernel and compiles it with nvcc for sm_90a and sm_100a (0.1.15's CUDA source
#: differs from 0.1.12's in 13 lines: a subexpression moved into a local, unused locals dropped), but it has not run on
#: a GPU yet. Other releases are declined with this list as the reason.
REQUIRED_TILELANG = {"0.1.12": "gpu", "0.1.13": "build", "0.1.14": "build", "0.1.15": "build"}
#: compute capability -> the architecture the kernel is built for (the 'a' targets: wgmma / setmaxnreg era chips)
ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a"}

_KERNELS: dict[FlushConfig, object] = {}


@dataclasses.dataclass
class _PoolArgs:
    """A pool's part of the kernel's arguments (see :func:`_call_args`) and what they were made from."""
    record: object          # the argument check's record they were last found current with (None: not checked)
    buffers: tuple          # the pool's buffers the arguments were made from
    addresses: tuple        # where their data started then
    cfg: FlushConfig        # the kernel configuration
    args: tuple             # the kernel's pool arguments


_ARGS: "weakref.WeakKeyDictionary[Pool, _PoolArgs]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _tilelang_problem() -> str | None:
    """Why the installed tilelang cannot build the kernel (None: it can), read from the package's metadata (or the
    imported module's ``__version__``): importing tilelang takes seconds, so the check does not."""
    version = dispatch.package_version("tilelang")
    if version is None:
        return "tilelang is not installed (pip install 'leapquant[tilelang]')"
    if version.split("+")[0] not in REQUIRED_TILELANG:
        gpu = [v for v, how in REQUIRED_TILELANG.items() if how == "gpu"]
        build = [v for v, how in REQUIRED_TILELANG.items() if how == "build"]
        validated = f"{', '.join(gpu)} (run on a GPU)" + (
            f" and {', '.join(build)} (built with nvcc for sm_90a and sm_100a, not run on a GPU)" if build else "")
        releases = sorted(REQUIRED_TILELANG, key=lambda v: tuple(int(part) for part in v.split(".")))
        return (f"tilelang {version} is installed; the kernel is validated on tilelang {validated} "
                f"(pip install 'tilelang>={releases[0]},<={releases[-1]}')")
    return None


@functools.lru_cache(maxsize=None)
def _nvcc_problem() -> str | None:
    """Why no nvcc can build the kernel (None: one can). The nvcc is looked up as TileLang does: on PATH; else, where
    tilelang is already imported, by TileLang's own search; else in $CUDA_HOME, $CUDA_PATH and /usr/local/cuda without
    importing tilelang (it takes seconds), and only on a machine with a CUDA device by TileLang's search itself (which
    also finds pip's nvidia-cuda-nvcc)."""
    nvcc = shutil.which("nvcc")
    ask_tilelang = not nvcc
    if not nvcc and "tilelang" not in sys.modules:
        for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
                nvcc = os.path.join(home, "bin", "nvcc")
                break
        ask_tilelang = (not nvcc and torch.cuda.is_available()
                        and dispatch.package_version("tilelang") is not None)
    if ask_tilelang:
        try:
            from tilelang.contrib.nvcc import get_nvcc_compiler
            nvcc = get_nvcc_compiler() or None
        except Exception:  # noqa: BLE001 - no toolkit found is an answer, not a crash
            nvcc = None
    if not nvcc:
        return "nvcc (the CUDA toolkit) is not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except Exception as e:  # noqa: BLE001
        return f"nvcc at {nvcc} cannot run ({type(e).__name__}: {e})"
    if out.returncode != 0:
        return f"nvcc at {nvcc} failed: {out.stderr.strip()[:200]}"
    return None


def config_for(pool: Pool) -> FlushConfig:
    """The kernel configuration serving ``pool`` on its device."""
    props = torch.cuda.get_device_properties(pool.device)
    return FlushConfig(num_heads=pool.num_heads, gate=pool.gate, arch=ARCHS[(props.major, props.minor)],
                       num_sms=props.multi_processor_count)


def reasons(pool: Pool) -> list[str]:
    why: list[str] = []
    if pool.device.type != "cuda":
        why.append(f"needs a CUDA device (the pool is on {pool.device})")
    elif not torch.cuda.is_available():
        why.append("CUDA is not available")
    else:
        cc = torch.cuda.get_device_capability(pool.device)
        if cc not in ARCHS:
            why.append(f"compute capability sm_{cc[0]}{cc[1]} is not supported (sm_90 or sm_100)")
    if pool.gate not in GATES:
        why.append(f"gate {pool.gate!r} is not supported")
    if pool.num_heads not in SUPPORTED_HEADS:
        why.append(f"num_heads={pool.num_heads} is not supported (built for {', '.join(map(str, SUPPORTED_HEADS))})")
    problem = _tilelang_problem()
    if problem:
        why.append(problem)
    problem = _nvcc_problem()
    if problem:
        why.append(problem)
    loose = [n for n, rest in zip(LOOSE_ALIGNMENT, pool.loose_alignment()) if rest]
    if loose:
        why.append(f"pool.{', pool.'.join(loose)} not {ALIGN_BYTES}-byte aligned (the kernel reads them in "
                   f"{ALIGN_BYTES}-byte pieces; the Triton backend serves such pools)")
    if not why:
        props = torch.cuda.get_device_properties(pool.device)
        cfg = config_for(pool)
        limit = getattr(props, "shared_memory_per_block_optin", None)
        if limit is not None and shared_bytes(cfg) > limit:
            why.append(f"the kernel needs {shared_bytes(cfg)} B of shared memory, the device allows {limit} B")
    return why


def kernel_for(pool: Pool):
    """The compiled kernel for ``pool`` (built on first use; never inside a CUDA graph capture)."""
    return _kernel(config_for(pool))


def _kernel(cfg: FlushConfig):
    """The compiled kernel for ``cfg`` (built on first use; never inside a CUDA graph capture)."""
    kern = _KERNELS.get(cfg)
    if kern is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("leapquant tilelang: the kernel for this geometry is not built; call "
                               "leapquant.warmup(pool) before capturing a CUDA graph")
        with _LOCK:
            kern = _KERNELS.get(cfg)
            if kern is None:
                from .kernel import compile_flush      # imports tilelang (seconds): only when a kernel is built
                kern = _KERNELS[cfg] = compile_flush(cfg)
    return kern


@contextlib.contextmanager
def use_kernel(cfg: FlushConfig, kernel: object) -> Iterator[None]:
    """Serve the pools of ``cfg`` with ``kernel`` (a compiled flush with the shipped kernel's arguments, e.g. a
    variant built from another generator) inside the block, and with the kernel served before it afterwards. For
    checking a variant through the public API (``bench/dev/tilelang_dev.py``); not thread-safe against flushes of the
    same geometry in other threads."""
    with _LOCK:
        saved = _KERNELS.get(cfg)
        _KERNELS[cfg] = kernel
    try:
        yield
    finally:
        with _LOCK:
            if saved is None:
                _KERNELS.pop(cfg, None)
            else:
                _KERNELS[cfg] = saved


def warmup(pool: Pool) -> None:
    """Build (or load) the kernel and make the pool's arguments, outside any graph capture."""
    kernel_for(pool)
    _call_args(pool)


def _call_args(pool: Pool) -> tuple[FlushConfig, tuple]:
    """The pool's kernel configuration and its part of the kernel's arguments, made once per set of buffers (and again
    when memory is swapped behind one or the geometry changes): raw as int32 / fp32 / fp16 views, the window tensors,
    and one-element stand-ins for the other gate's tensors (the kernel's signature has both). A checked call finds
    them by the argument check's record (:func:`leapquant.validate.checked_record`) without looking at the buffers
    again."""
    cached = _ARGS.get(pool)
    if cached is not None and cached.record is not None and cached.record is checked_record(pool):
        return cached.cfg, cached.args
    buffers = (pool.raw, pool.kbuf, pool.ubuf, pool.w, pool.hcnt,
               *((pool.pcum, pool.gbuf) if pool.gate == "kda" else (pool.p,)))
    cfg = config_for(pool)
    record = checked_record(pool)
    if cached is not None and cached.cfg == cfg:
        ok, cached.record = binding_current(pool, cached.record, cached.buffers, cached.addresses, buffers)
        if ok:
            return cached.cfg, cached.args
    dev, raw = pool.device, pool.raw
    if pool.gate == "kda":
        pcum, gbuf, p = pool.pcum, pool.gbuf, torch.ones(1, 1, dtype=torch.float32, device=dev)
    else:
        pcum = torch.zeros(1, 1, 1, dtype=torch.float32, device=dev)
        gbuf = torch.ones(1, 1, 1, 1, dtype=torch.float16, device=dev)
        p = pool.p
    args = (raw.view(torch.int32), raw, raw.view(torch.float16), pool.kbuf, pool.ubuf, pool.w, pcum, gbuf, p,
            pool.hcnt)
    _ARGS[pool] = _PoolArgs(record, buffers, buffer_addresses(buffers), cfg, args)
    return cfg, args


def prepare(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> Callable[[], None]:
    """The flush of these arguments readied, returned as its launch: the pool's arguments and the compiled kernel are
    made (or found) here, so that a flush that cannot launch raises now (:func:`leapquant.decode_inplace` readies its
    flush before the step writes anything and launches it after the step)."""
    if idx.numel() == 0:
        return dispatch.no_launch
    cfg, args = _call_args(pool)
    kern = _kernel(cfg)

    def flush_launch() -> None:
        with on_pool_device(pool):
            kern(*args, q0, idx)
    return flush_launch


def flush(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Backend call: flush every due program of ``idx``'s rows in place (slots outside [1, num_slots) are skipped).
    No host synchronisation; the per-pool arguments are made once (a few microseconds of each eager call)."""
    prepare(pool, idx, q0)()


def versions() -> dict[str, str]:
    """torch's and tilelang's versions (tilelang's from its metadata, not imported), the latter with how it is
    validated when it is not a release the GPU suite ran with."""
    version = dispatch.package_version("tilelang")
    if version is None:
        return {"torch": torch.__version__, "tilelang": "not installed"}
    how = REQUIRED_TILELANG.get(version.split("+")[0])
    if how == "build":
        gpu = ", ".join(v for v, h in REQUIRED_TILELANG.items() if h == "gpu")
        version += f" (builds for sm_90a and sm_100a, not run on a GPU: the GPU suite ran with {gpu})"
    elif how is None:
        version += " (not a validated release)"
    return {"torch": torch.__version__, "tilelang": version}


dispatch.register(dispatch.Backend(
    name="tilelang",
    flush=flush,
    prepare=prepare,
    reasons=reasons,
    description="persistent TileLang kernel (sm_90a / sm_100a): fp32 state blocks in registers, rank updates "
                "on the tensor cores with exact operands, two consumer groups per CTA, each prefetching its next "
                "program into shared memory (cp.async), due programs balanced across CTAs by a rank scan",
    warmup=warmup,
    versions=versions,
))
