"""The default deployment path never synchronises with the host (GPU backends), and engines' padding (-1, 0) is
"no sequence" on every backend.

``torch.cuda.set_sync_debug_mode("error")`` makes every host-synchronising CUDA call raise (a device-to-host copy,
``.item()``, ``nonzero``, ``unique``...): a flush that reads idx's values on the host, sorts them, or waits on the
stream fails here. The same call with ``check_idx=True`` must synchronise (the switch is real).
"""
from __future__ import annotations

import pytest
import torch

import leapquant as lq
from leapquant import dispatch
from helpers import assert_flush_footprint, noisy_pool, snapshot, written_programs

HAS_CUDA = torch.cuda.is_available()
GPU_BACKENDS = ("triton", "tilelang")


def _served(backend: str, pool: lq.Pool) -> None:
    why = dispatch.reasons(backend, pool)
    if why:
        pytest.skip(f"{backend} cannot serve this pool: {'; '.join(why)}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_flush_does_not_synchronise(backend, gate):
    pool, idx = noisy_pool(gate, 32, 3, torch.device("cuda"), num_slots=9)
    _served(backend, pool)
    q0 = lq.default_q0(pool.device)
    lq.warmup(pool, backend=backend)
    padded = torch.cat([idx, torch.tensor([-1, 0, -7], dtype=torch.int32, device=pool.device)])
    lq.flush_inplace(pool, padded, q0, backend=backend)          # binds / caches everything once, eagerly
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            lq.flush_inplace(pool, padded, q0, backend=backend)
        with pytest.raises(RuntimeError, match="synchroniz"):
            lq.flush_inplace(pool, padded, q0, backend=backend, check_idx=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", ("reference",) + GPU_BACKENDS)
def test_padding_rows_are_skipped(backend, gate):
    """Rows with slot -1 (vLLM), 0 (SGLang) or any negative value change nothing; the other rows' due programs are
    flushed as without the padding."""
    device = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
    if backend != "reference" and not HAS_CUDA:
        pytest.skip("GPU backend (the interpreter tier covers the Triton kernel's ranking in test_triton.py)")
    pool, idx = noisy_pool(gate, 4, 5, device)
    _served(backend, pool)
    padded = torch.cat([torch.tensor([-1], dtype=torch.int32, device=device), idx,
                        torch.tensor([0, -2**31, -1], dtype=torch.int32, device=device)])
    slots, hs = written_programs(pool, idx)
    before = snapshot(pool)
    lq.flush_inplace(pool, padded, lq.default_q0(device), backend=backend)
    assert_flush_footprint(pool, before, slots, hs)
