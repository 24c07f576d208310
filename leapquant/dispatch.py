"""Backend registry and choice.

Every backend implements the same call, ``flush(pool, idx, q0) -> None`` (the pool updated in place; arguments
already validated), and says why it cannot serve a pool through ``reasons(pool) -> list[str]`` (empty: it can).

Choice, in this order of precedence:
  * ``backend=`` on the call, or an enclosing ``with leapquant.use_backend(name):``;
  * ``LEAPQUANT_BACKEND`` read once at import (``auto`` when unset);
  * ``auto``: the first backend of :func:`auto_order` that can serve, logged once per (device, backend).
A forced backend that cannot serve raises :class:`BackendUnavailable` with its reasons; ``auto`` degrades quietly to
the next one and, when only the reference is left on a GPU, warns once.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .layout import Pool

log = logging.getLogger("leapquant")

BACKENDS = ("reference", "triton", "tilelang")
CHOICES = ("auto",) + BACKENDS
ENV_VAR = "LEAPQUANT_BACKEND"

#: read once at import: later changes of the environment do not move the choice (use ``backend=`` or use_backend)
ENV_BACKEND: str = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"

#: modules that register the optional backends when imported
_MODULES = {"triton": "leapquant.triton", "tilelang": "leapquant.tilelang"}


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


_REGISTRY: dict[str, Backend] = {}
_IMPORT_ERRORS: dict[str, str] = {}
_LOGGED: set[tuple] = set()
#: resolved choices per (device, gate, heads, requested name, rows): the capability checks run once per geometry
_CHOSEN: dict[tuple, Backend] = {}
_local = threading.local()


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend; the backend modules call this when imported."""
    if backend.name not in BACKENDS:
        raise ValueError(f"backend name {backend.name!r} is not one of {BACKENDS}")
    _REGISTRY[backend.name] = backend
    _CHOSEN.clear()
    return backend


def _load(name: str) -> Backend | None:
    if name not in _REGISTRY and name in _MODULES and name not in _IMPORT_ERRORS:
        try:
            importlib.import_module(_MODULES[name])
        except Exception as e:  # an optional backend that cannot import is a reason, not a crash
            _IMPORT_ERRORS[name] = f"import of {_MODULES[name]} failed: {type(e).__name__}: {e}"
    return _REGISTRY.get(name)


def get_backend(name: str) -> Backend | None:
    _check_name(name, allow_auto=False)
    return _load(name)


def reasons(name: str, pool: Pool) -> list[str]:
    """Why backend ``name`` cannot serve ``pool`` (empty list: it can)."""
    b = get_backend(name)
    if b is None:
        return [_IMPORT_ERRORS.get(name, f"backend {name!r} is not registered")]
    try:
        return list(b.reasons(pool))
    except Exception as e:
        return [f"capability check failed: {type(e).__name__}: {e}"]


def _check_name(name: object, allow_auto: bool = True) -> str:
    valid = CHOICES if allow_auto else BACKENDS
    if not isinstance(name, str) or name.strip().lower() not in valid:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(valid)}")
    return name.strip().lower()


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
    try:
        return _check_name(ENV_BACKEND)
    except ValueError as e:
        raise ValueError(f"{ENV_VAR}={ENV_BACKEND!r}: {e}") from None


def auto_order(pool: Pool, num_rows: int) -> list[str]:
    """Backends in order of preference for this pool and call size (``num_rows`` = len(idx)).

    The reference is always last. The Triton interpreter is never chosen automatically: on a CPU only the reference
    serves."""
    if pool.device.type != "cuda":
        return ["reference"]
    from . import perf_table
    return perf_table.preferred(pool, num_rows) + ["reference"]


def select(pool: Pool, num_rows: int, backend: str | None = None) -> Backend:
    """The backend that will run a flush of ``num_rows`` rows on ``pool``."""
    name = requested(backend)
    key = (str(pool.device), pool.gate, pool.num_heads, name, num_rows)
    chosen = _CHOSEN.get(key)
    if chosen is not None and _REGISTRY.get(chosen.name) is chosen:
        return chosen
    chosen = _resolve(pool, num_rows, name)
    _CHOSEN[key] = chosen
    return chosen


def _resolve(pool: Pool, num_rows: int, name: str) -> Backend:
    if name != "auto":
        why = reasons(name, pool)
        if why:
            raise BackendUnavailable(f"backend {name!r} was forced but cannot serve {pool}:\n  - "
                                     + "\n  - ".join(why))
        return _REGISTRY[name]
    rejected: dict[str, list[str]] = {}
    for cand in auto_order(pool, num_rows):
        why = reasons(cand, pool)
        if not why:
            _log_choice(pool, cand, rejected)
            return _REGISTRY[cand]
        rejected[cand] = why
    lines = [f"{n}: {'; '.join(r)}" for n, r in rejected.items()]
    raise BackendUnavailable("no backend can serve " + repr(pool) + ":\n  - " + "\n  - ".join(lines))


def _log_choice(pool: Pool, name: str, rejected: dict[str, list[str]]) -> None:
    key = (str(pool.device), pool.gate, pool.num_heads, name)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    for other, why in rejected.items():
        log.info("[leapquant] flush: %s skipped on %s: %s", other, pool.device, "; ".join(why))
    log.info("[leapquant] flush -> %s (%s, gate=%s, heads=%d)", name, pool.device, pool.gate, pool.num_heads)
    if name == "reference" and pool.device.type == "cuda":
        warnings.warn(f"leapquant: no GPU kernel can serve {pool} ("
                      + "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items())
                      + "); using the slow fp32 reference", RuntimeWarning, stacklevel=4)


def all_backends() -> list[Backend | None]:
    return [_load(n) for n in BACKENDS]


def import_error(name: str) -> str | None:
    _load(name)
    return _IMPORT_ERRORS.get(name)
