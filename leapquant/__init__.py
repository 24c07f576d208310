"""leapquant: the LeapQuant flush for hybrid linear-attention serving (KDA and GDN recurrent states).

    pool = leapquant.Pool(num_slots, num_heads=32, device="cuda", gate="kda")
    leapquant.flush_inplace(pool, idx, q0)                 # deployment form, in place, CUDA-graph safe
    codes, s_k, s_v, u, q = leapquant.run(...)              # functional form (every program due)

See README.md for shapes, backends and environment variables.
"""
from .api import backend_info, device_description, flush_inplace, run, run_gdn, versions, warmup
from .dispatch import BACKENDS, BackendUnavailable, use_backend
from .layout import EPS, K, L, OFF, QMAX, R, V, Pool
from .reference import default_q0

__version__ = "0.1.0"

__all__ = [
    "Pool", "flush_inplace", "run", "run_gdn", "warmup", "use_backend", "backend_info", "versions",
    "device_description", "default_q0", "BackendUnavailable", "BACKENDS", "V", "K", "L", "R", "QMAX", "EPS", "OFF",
]
