"""Backend registry and choice.

Every backend implements the same call, ``flush(pool, idx, q0) -> None`` (the pool updated in place; arguments
already validated), and says why it cannot serve a pool through ``reasons(pool) -> list[str]`` (empty: it can).
The decode step is a second op with the same rules: a backend's optional ``step(pool, idx, qkv, a, b, A_log, dt_bias,
out, num_k_heads, beta_bf16) -> None`` (None: it has no step kernel, which is then its reason), and optionally its
own ``step_reasons(pool)`` (default: the flush's ``reasons``). :func:`select` and :func:`reasons` take ``op="flush"``
or ``op="step"`` (default ``"flush"``).

Choice, in this order of precedence:
  * ``backend=`` on the call, or an enclosing ``with leapquant.use_backend(name):``;
  * ``LEAPQUANT_BACKEND`` read once at import (``auto`` when unset);
  * ``auto``: the first backend of :func:`auto_order` that can serve, logged once per (device, backend).
A forced backend that cannot serve raises :class:`BackendUnavailable` with its reasons; ``auto`` degrades quietly to
the next one and, when only the reference is left on a GPU, warns once.

This module imports neither torch nor a backend at import time (``leapquant --help`` loads it): the backends are
imported when first asked for, and :func:`versions`, :func:`env_problem`, :func:`device_description` and
:func:`backend_info` (what ``leapquant info`` prints) read package versions from their installed metadata instead of
importing the packages. ``backend_info`` does not import :mod:`leapquant.api` either (its ``torch.compiler``
decorator imports torch's compiler stack, about 1.5 s).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import platform
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from .numerics import DEFAULT_HEADS
from .options import name_word

if TYPE_CHECKING:
    import torch

    from .layout import Pool

log = logging.getLogger("leapquant")

BACKENDS = ("reference", "triton", "tilelang")
CHOICES = ("auto",) + BACKENDS
#: the ops a backend can serve: the flush (every backend) and the decode step (where ``Backend.step`` is set)
OPS = ("flush", "step")
#: GPU backends ``auto`` tries for the step, in order, before the reference: the Triton step kernel (the only step
#: kernel; bench/results/RECORD-step.md has its measurements on the H200)
STEP_AUTO_ORDER: tuple[str, ...] = ("triton",)
ENV_VAR = "LEAPQUANT_BACKEND"

#: read once at import: later changes of the environment do not move the choice (use ``backend=`` or use_backend)
ENV_BACKEND: str = name_word(os.environ.get(ENV_VAR, "auto")) or "auto"

#: modules that register the optional backends when imported (the reference is registered by this module)
_MODULES = {"triton": "leapquant.triton", "tilelang": "leapquant.tilelang"}
#: the Python package each optional backend needs (checked through its installed metadata, without importing it)
_PACKAGES = {"triton": "triton", "tilelang": "tilelang"}


class BackendUnavailable(ValueError):
    """A forced backend cannot serve the call (the message lists its reasons), or no backend can."""


@dataclass
class Backend:
    name: str
    flush: Callable[[Pool, torch.Tensor, torch.Tensor], None]
    reasons: Callable[[Pool], list[str]]
    description: str = ""
    warmup: Callable[[Pool], None] | None = None
    versions: Callable[[], dict[str, str]] = field(default=lambda: {})
    #: the decode step on a pool (arguments validated, ``out`` given): ``step(pool, idx, qkv, a, b, A_log, dt_bias,
    #: out, num_k_heads, beta_bf16) -> None``; None: no step kernel
    step: Callable[..., None] | None = None
    #: why the step cannot serve a pool, where it differs from ``reasons`` (None: the flush's reasons apply)
    step_reasons: Callable[[Pool], list[str]] | None = None
    #: the flush readied (workspace, compiled kernel, bound launch) and returned as its launch: ``prepare(pool, idx,
    #: q0) -> launch()``, raising where the flush would; None: nothing to ready (the reference: ``flush`` is called)
    prepare: Callable[[Pool, torch.Tensor, torch.Tensor], Callable[[], None]] | None = None


def no_launch() -> None:
    """A backend's ``prepare`` for a call with nothing to launch (no rows)."""


_REGISTRY: dict[str, Backend] = {}
_IMPORT_ERRORS: dict[str, str] = {}
_LOGGED: set[tuple] = set()
#: resolved choices per (device, gate, heads, requested name, rows, op, where the pool's fill counts (and GDN's gate
#: products) start: ``Pool.loose_alignment``): the capability checks run once per such key (a backend's reasons read
#: the pool's device and geometry and that alignment, nothing else of it; every other buffer of a pool is aligned)
_CHOSEN: dict[tuple, Backend] = {}
_local = threading.local()


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; the backend modules call this when imported."""
    if backend.name not in BACKENDS:
        raise ValueError(f"backend name {backend.name!r} is not one of {BACKENDS}")
    _REGISTRY[backend.name] = backend
    _CHOSEN.clear()
    return backend


def _register_reference() -> None:
    """The reference serves every pool; it is registered here, on first demand, so that asking for it imports only
    torch, :mod:`leapquant.reference` and :mod:`leapquant.reference_pool`."""
    import torch

    from . import reference_pool
    register(Backend(
        name="reference",
        flush=reference_pool.flush_inplace,
        reasons=lambda pool: [],
        description="fp32 torch, any device (the semantic definition; slow, host-synchronising)",
        versions=lambda: {"torch": torch.__version__},
        step=reference_pool.step_inplace,
    ))


def _load(name: str) -> Backend | None:
    if name == "reference" and name not in _REGISTRY:
        _register_reference()
    if name not in _REGISTRY and name in _MODULES and name not in _IMPORT_ERRORS:
        try:
            importlib.import_module(_MODULES[name])
        except Exception as e:  # an optional backend that cannot import is a reason, not a crash
            _IMPORT_ERRORS[name] = f"import of {_MODULES[name]} failed: {type(e).__name__}: {e}"
    return _REGISTRY.get(name)


def get_backend(name: str) -> Backend | None:
    _check_name(name, allow_auto=False)
    return _load(name)


def _check_op(op: object) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}: expected one of {', '.join(OPS)}")
    return op


def reasons(name: str, pool: Pool, op: str = "flush") -> list[str]:
    """Why backend ``name`` cannot serve ``op`` (``"flush"`` or ``"step"``) on ``pool`` (empty list: it can)."""
    _check_op(op)
    b = get_backend(name)
    if b is None:
        return [_IMPORT_ERRORS.get(name, f"backend {name!r} is not registered")]
    if op == "step" and b.step is None:
        return [f"{name} has no step kernel (a call that forces it cannot step; with no backend forced each op "
                "picks its own)"]
    check = b.step_reasons if op == "step" and b.step_reasons is not None else b.reasons
    try:
        return list(check(pool))
    except Exception as e:
        return [f"capability check failed: {type(e).__name__}: {e}"]


def _check_name(name: object, allow_auto: bool = True) -> str:
    valid = CHOICES if allow_auto else BACKENDS
    if not isinstance(name, str) or name_word(name) not in valid:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(valid)}")
    return name_word(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``name`` (or ``"auto"``) for flushes in this block and thread, over LEAPQUANT_BACKEND."""
    name = _check_name(name)
    prev = getattr(_local, "forced", None)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = prev


def requested(backend: str | None = None) -> str:
    """The name a call asks for: its ``backend=``, else the enclosing use_backend, else LEAPQUANT_BACKEND."""
    if backend is not None:
        return _check_name(backend)
    forced = getattr(_local, "forced", None)
    if forced is not None:
        return forced
    problem = env_problem()
    if problem:
        raise ValueError(problem)
    return ENV_BACKEND


def env_problem() -> str | None:
    """Why the LEAPQUANT_BACKEND read at import is invalid (None: it is valid). Every flush without ``backend=``
    outside a use_backend block raises a ValueError with this message; ``leapquant info`` prints it."""
    try:
        _check_name(ENV_BACKEND)
    except ValueError as e:
        return f"{ENV_VAR}={ENV_BACKEND!r}: {e}"
    return None


def auto_order(pool: Pool, num_rows: int, op: str = "flush") -> list[str]:
    """Backends in order of preference for this pool, call size (``num_rows`` = len(idx)) and op.

    The reference is always last. The Triton interpreter is never chosen automatically: on a CPU only the reference
    serves. The flush's GPU order comes from committed measurements (:mod:`leapquant.perf_table`); the step's is
    :data:`STEP_AUTO_ORDER`."""
    if pool.device.type != "cuda":
        return ["reference"]
    if _check_op(op) == "step":
        return list(STEP_AUTO_ORDER) + ["reference"]
    from . import perf_table
    return perf_table.preferred(pool, num_rows) + ["reference"]


def select(pool: Pool, num_rows: int, backend: str | None = None, op: str = "flush") -> Backend:
    """The backend that will run ``op`` (``"flush"``, the default, or ``"step"``) on ``num_rows`` rows of ``pool``."""
    _check_op(op)
    name = requested(backend)
    key = (str(pool.device), pool.gate, pool.num_heads, name, num_rows, op, pool.loose_alignment())
    chosen = _CHOSEN.get(key)
    if chosen is not None and _REGISTRY.get(chosen.name) is chosen:
        return chosen
    chosen = _resolve(pool, num_rows, name, op)
    _CHOSEN[key] = chosen
    return chosen


def _resolve(pool: Pool, num_rows: int, name: str, op: str = "flush") -> Backend:
    what = "" if op == "flush" else f" the {op} op on"
    if name != "auto":
        why = reasons(name, pool, op)
        if why:
            raise BackendUnavailable(f"backend {name!r} was forced but cannot serve{what} {pool}:\n  - "
                                     + "\n  - ".join(why))
        return _REGISTRY[name]
    rejected: dict[str, list[str]] = {}
    for cand in auto_order(pool, num_rows, op):
        why = reasons(cand, pool, op)
        if not why:
            _log_choice(pool, cand, rejected, op)
            return _REGISTRY[cand]
        rejected[cand] = why
    lines = [f"{n}: {'; '.join(r)}" for n, r in rejected.items()]
    raise BackendUnavailable(f"no backend can serve{what} " + repr(pool) + ":\n  - " + "\n  - ".join(lines))


def _log_choice(pool: Pool, name: str, rejected: dict[str, list[str]], op: str = "flush") -> None:
    key = (str(pool.device), pool.gate, pool.num_heads, name) + (() if op == "flush" else (op,))
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    for other, why in rejected.items():
        log.info("[leapquant] %s: %s skipped on %s: %s", op, other, pool.device, "; ".join(why))
    log.info("[leapquant] %s -> %s (%s, gate=%s, heads=%d)", op, name, pool.device, pool.gate, pool.num_heads)
    if name == "reference" and pool.device.type == "cuda":
        what = "" if op == "flush" else f" the {op} op on"
        warnings.warn(f"leapquant: no GPU kernel can serve{what} {pool} ("
                      + "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
                      + "); using the slow fp32 reference", RuntimeWarning, stacklevel=4)


# ---- the environment report (``leapquant info``): versions and availability without importing the backends ------
def package_version(package: str) -> str | None:
    """The version of ``package`` without importing it: the imported module's own ``__version__`` where it is already
    imported (that is the code that runs), else its installed metadata; None where it is not installed."""
    mod = sys.modules.get(package)
    version = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(version, str):
        return version
    try:
        if importlib.util.find_spec(package) is None:
            return None
        return importlib.metadata.version(package)
    except (ImportError, ValueError):   # PackageNotFoundError is an ImportError
        return None


def versions() -> dict[str, str]:
    """Python, torch, triton and tilelang versions ("not installed" where absent), none of them imported."""
    out = {"python": platform.python_version()}
    for package in ("torch", "triton", "tilelang"):
        out[package] = package_version(package) or "not installed"
    return out


def default_device() -> torch.device:
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_description(device: torch.device | str | None = None) -> str:
    """One line naming ``device`` (default: :func:`default_device`): a GPU's name, compute capability and SM count, or
    the CPU's processor. A device this machine lacks raises a ``ValueError``."""
    import torch

    from .devices import device_here
    dev = device_here(device, "tensors") if device is not None else default_device()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        return f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs)"
    if dev.type != "cpu":
        raise ValueError(f"device: {device!r}: leapquant runs on cpu or cuda devices")
    return f"CPU ({platform.processor() or platform.machine()})"


def backend_info(device: torch.device | str | None = None, num_heads: int = DEFAULT_HEADS, gate: str = "kda",
                 num_rows: int = 256, op: str = "flush") -> list[dict]:
    """Every backend, available or not, with the reasons it cannot serve ``op`` (``"flush"`` or ``"step"``) on a
    pool of this geometry on ``device``.

    A backend whose package is not installed is reported from its metadata without importing its module."""
    from .layout import Pool, as_int
    _check_op(op)
    rows_n = as_int(num_rows)
    if rows_n is None or rows_n < 0:
        raise ValueError(f"num_rows: expected an int >= 0 (the rows of the call asked about), got {num_rows!r}")
    from .devices import device_here
    device = device_here(device, "a pool") if device is not None else default_device()
    probe = Pool(2, num_heads, device=device, gate=gate)
    order = auto_order(probe, rows_n, op)
    rows = []
    for name in BACKENDS:
        package = _PACKAGES.get(name)
        if package is not None and name not in _REGISTRY and package_version(package) is None:
            why = [f"{package} is not installed (pip install 'leapquant[{name}]')"]
            b = None
        else:
            why = reasons(name, probe, op)
            b = _REGISTRY.get(name)
        rows.append(dict(name=name, available=not why, reasons=why,
                         auto_rank=order.index(name) + 1 if name in order else None,
                         description=b.description if b else "", versions=b.versions() if b else {}))
    return rows
