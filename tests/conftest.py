"""Shared test set-up.

* Without a CUDA GPU, Triton kernels run through its interpreter: TRITON_INTERPRET must be set before triton is first
  imported, so it is set here, before any test module imports leapquant's Triton backend.
* hypothesis profiles: ``dev`` (default, few examples), ``ci`` (derandomised, what .ci/run uses), ``nightly``; all
  with ``deadline=None`` because the first example of a kernel pays its compilation.
"""
from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=6, **_common)
settings.register_profile("ci", max_examples=10, derandomize=True, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

import pytest  # noqa: E402


@pytest.fixture
def cuda_device() -> torch.device:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", torch.cuda.current_device())
