"""The Triton backend: a portable flush kernel for any CUDA GPU Triton supports, and the CPU through
``TRITON_INTERPRET=1`` (tests). Importing this module registers it with :mod:`leapquant.dispatch`.

Modules: :mod:`.launch` (workspace, kernel choice, the bound launch), :mod:`.tl_kernel` (the portable ``tl`` kernel,
which the interpreter runs) and :mod:`.gluon_kernel` (the GPU kernel, in Gluon; imported only where it is chosen)."""
from __future__ import annotations

import torch
import triton

from .. import dispatch
from ..layout import Pool
from .launch import INTERPRETED, KERNEL_ENV, kernel_name_for, flush, prepare, step, warmup

#: Triton's bf16 loads need sm_80 (Ampere) or newer
MIN_CAPABILITY = (8, 0)
#: item codes slot * H + head are int32
MAX_CODES = 2 ** 31


def reasons(pool: Pool) -> list[str]:
    """Why this backend cannot serve ``pool`` (empty: it can)."""
    why = []
    if pool.device.type == "cuda":
        if INTERPRETED:
            why.append("TRITON_INTERPRET=1 is set: the Triton interpreter runs on the CPU only")
        elif torch.cuda.get_device_capability(pool.device) < MIN_CAPABILITY:
            cap = torch.cuda.get_device_capability(pool.device)
            why.append(f"compute capability {cap} < {MIN_CAPABILITY}")
    elif not INTERPRETED:
        why.append(f"device {pool.device}: the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")
    if not why:
        try:                       # a forced GPU kernel that cannot run (LEAPQUANT_TRITON_KERNEL) is a reason too
            kernel_name_for(pool.device)
        except (ValueError, RuntimeError) as exc:
            why.append(str(exc))
    if pool.num_slots * pool.num_heads >= MAX_CODES:
        why.append(f"num_slots * num_heads = {pool.num_slots * pool.num_heads} does not fit the int32 due list")
    return why


dispatch.register(dispatch.Backend(
    name="triton",
    flush=flush,
    reasons=reasons,
    step=step,
    prepare=prepare,
    description="Triton: one launch of persistent flush programs that rank the due programs on the GPU; on sm_80+ "
                "a Gluon kernel (tensor-core rank updates), else / on the CPU (TRITON_INTERPRET=1) the tl kernel",
    warmup=warmup,
    versions=lambda: {"triton": triton.__version__, "torch": torch.__version__},
))

__all__ = ["flush", "step", "warmup", "reasons", "KERNEL_ENV"]
