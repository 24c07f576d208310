"""The TileLang backend: a persistent flush kernel built with TileLang 0.1.12 for sm_90a (H100/H200) and sm_100a
(B200). Importing this module registers the backend with :mod:`leapquant.dispatch`.

    reasons(pool)   why the backend cannot serve ``pool`` (empty: it can)
    warmup(pool)    build (or load from TileLang's disk cache) the kernel for the pool's geometry, outside any capture
    flush(pool, idx, q0)   the deployment call; arguments already validated

Compiled kernels are cached per (num_heads, gate, arch, SM count); the kernel takes the pool's size and the call's
row count as run-time sizes, so one build serves every pool and batch of that geometry.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
import threading

import torch

from .. import dispatch
from ..layout import GATES, Pool
from .kernel import ALIGN_BYTES, SUPPORTED_HEADS, FlushConfig, compile_flush, shared_bytes

REQUIRED_TILELANG = "0.1.12"
#: compute capability -> the architecture the kernel is built for (the 'a' targets: wgmma / setmaxnreg era chips)
ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a"}

_KERNELS: dict[FlushConfig, object] = {}
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _tilelang_problem() -> str | None:
    try:
        import tilelang
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        return f"tilelang is not importable ({type(e).__name__}: {e})"
    if tilelang.__version__.split("+")[0] != REQUIRED_TILELANG:
        return f"tilelang {tilelang.__version__} is installed, the kernel needs {REQUIRED_TILELANG}"
    return None


@functools.lru_cache(maxsize=None)
def _nvcc_problem() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        try:
            from tilelang.contrib.nvcc import get_nvcc_compiler
            nvcc = get_nvcc_compiler()
        except Exception:  # noqa: BLE001
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
    misaligned = [name for name in ("raw", *pool.WINDOW_FIELDS[pool.gate])
                  if getattr(pool, name).data_ptr() % ALIGN_BYTES]
    if misaligned:
        why.append(f"pool.{', pool.'.join(misaligned)} not {ALIGN_BYTES}-byte aligned (the kernel copies and reads "
                   f"them in {ALIGN_BYTES}-byte pieces)")
    if not why:
        props = torch.cuda.get_device_properties(pool.device)
        cfg = config_for(pool)
        limit = getattr(props, "shared_memory_per_block_optin", None)
        if limit is not None and shared_bytes(cfg) > limit:
            why.append(f"the kernel needs {shared_bytes(cfg)} B of shared memory, the device allows {limit} B")
    return why


def kernel_for(pool: Pool):
    """The compiled kernel for ``pool`` (built on first use; never inside a CUDA graph capture)."""
    cfg = config_for(pool)
    kern = _KERNELS.get(cfg)
    if kern is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("leapquant tilelang: the kernel for this geometry is not built; call "
                               "leapquant.warmup(pool) before capturing a CUDA graph")
        with _LOCK:
            kern = _KERNELS.get(cfg)
            if kern is None:
                kern = _KERNELS[cfg] = compile_flush(cfg)
    return kern


def warmup(pool: Pool) -> None:
    kernel_for(pool)


def _placeholders(pool: Pool) -> dict[str, torch.Tensor]:
    """One-element stand-ins for the other gate's tensors (the kernel's signature has both)."""
    cache = pool.__dict__.setdefault("_tilelang_placeholders", {})
    if not cache:
        dev = pool.device
        cache["pcum"] = torch.zeros(1, 1, 1, dtype=torch.float32, device=dev)
        cache["gbuf"] = torch.ones(1, 1, 1, 1, dtype=torch.float16, device=dev)
        cache["p"] = torch.ones(1, 1, dtype=torch.float32, device=dev)
    return cache


def flush(pool: Pool, idx: torch.Tensor, q0: torch.Tensor) -> None:
    """Backend call: flush every due program of ``idx``'s rows in place (slots outside [1, num_slots) are skipped)."""
    if idx.numel() == 0:
        return
    kern = kernel_for(pool)
    ph = _placeholders(pool)
    raw = pool.raw
    if pool.gate == "kda":
        pcum, gbuf, p = pool.pcum, pool.gbuf, ph["p"]
    else:
        pcum, gbuf, p = ph["pcum"], ph["gbuf"], pool.p
    with torch.cuda.device(pool.device):
        kern(raw.view(torch.int32), raw, raw.view(torch.float16), pool.kbuf, pool.ubuf, pool.w, pcum, gbuf, p,
             pool.hcnt, q0, idx)


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    try:
        import tilelang
        out["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        out["tilelang"] = "not installed"
    return out


dispatch.register(dispatch.Backend(
    name="tilelang",
    flush=flush,
    reasons=reasons,
    description="persistent TileLang kernel (sm_90a / sm_100a): fp32 state blocks in registers, rank updates "
                "on the tensor cores with exact operands, two consumer groups per CTA, each prefetching its next "
                "program into shared memory (cp.async), due programs balanced across CTAs by a rank scan",
    warmup=warmup,
    versions=versions,
))
