"""leapquant: the LeapQuant flush for hybrid linear-attention serving (KDA and GDN recurrent states).

    pool = leapquant.Pool(num_slots, num_heads=32, device="cuda", gate="kda")
    leapquant.flush_inplace(pool, idx, q0)                 # deployment form, in place, CUDA-graph safe
    codes, s_k, s_v, u, q = leapquant.run(...)              # functional form (every program due)
    leapquant.step_inplace(pool, idx, qkv, a, b, A_log, dt_bias, out)   # the decode step (SPEC section 7)

See README.md for shapes, backends and environment variables.

The public names are loaded on first use (PEP 562 ``__getattr__``): ``import leapquant`` alone imports neither torch
nor a backend, so the command line answers ``--help`` at once. ``from leapquant import Pool, flush_inplace`` and
``leapquant.flush_inplace`` work as with eager imports. The dispatch (torch-free) is imported here, so
``LEAPQUANT_BACKEND`` is read when leapquant is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .dispatch import BACKENDS, BackendUnavailable, use_backend

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_LAZY = {
    "backend_info": "api", "device_description": "api", "flush_inplace": "api", "run": "api", "run_gdn": "api",
    "step": "api", "step_gdn": "api", "step_inplace": "api", "decode_inplace": "api", "versions": "api",
    "warmup": "api",
    "EPS": "layout", "K": "layout", "L": "layout", "OFF": "layout", "QMAX": "layout", "R": "layout", "V": "layout",
    "Pool": "layout",
    "default_q0": "reference",
}
#: submodules reachable as attributes (``leapquant.layout``) without importing them first: the package's core (the
#: backends' packages stay behind an explicit import)
_SUBMODULES = ("api", "layout", "reference", "reference_pool", "validate")

__all__ = [
    "Pool", "flush_inplace", "run", "run_gdn", "warmup", "use_backend", "backend_info", "versions",
    "device_description", "default_q0", "BackendUnavailable", "BACKENDS", "V", "K", "L", "R", "QMAX", "EPS", "OFF",
    "step_inplace", "step", "step_gdn", "decode_inplace",
]

if TYPE_CHECKING:  # static analysers and IDEs see the eager form
    from .api import (backend_info, decode_inplace, device_description, flush_inplace, run, run_gdn, step, step_gdn,
                      step_inplace, versions, warmup)
    from .layout import EPS, K, L, OFF, QMAX, R, V, Pool
    from .reference import default_q0


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value          # later look-ups skip this function
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
