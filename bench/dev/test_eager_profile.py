"""eager_profile.py on a CPU: its timing helper with a stand-in for the device's synchronisation (the tool itself
needs a GPU)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import eager_profile  # noqa: E402


def test_per_call_counts_every_call():
    calls = []
    us = eager_profile.per_call_us(lambda: calls.append(1), runs=3, n=4, sync=lambda: None)
    assert len(calls) == 1 + 3 * 4 and us >= 0.0
