"""The GPU timing tools on a CPU: eager_profile's timing helper with a stand-in for the device's synchronisation, and
decode_variants' ways (the tools themselves need a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_variants  # noqa: E402
import eager_profile  # noqa: E402


def test_per_call_counts_every_call():
    calls = []
    us = eager_profile.per_call_us(lambda: calls.append(1), runs=3, n=4, sync=lambda: None)
    assert len(calls) == 1 + 3 * 4 and us >= 0.0


def test_decode_variants_name_the_flush_backends():
    """Each two-call way names a flush backend as its third word (the tool passes it to flush_inplace)."""
    from leapquant.dispatch import BACKENDS
    assert [w.split()[2] for w in decode_variants.WAYS[1:]] == ["tilelang", "triton"]
    assert set(w.split()[2] for w in decode_variants.WAYS[1:]) <= set(BACKENDS)
