"""The command line: ``leapquant info`` and ``leapquant demo`` (the README's main job), as a user runs them."""
from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapquant", *args], capture_output=True, text=True, timeout=300)


def test_info_lists_every_backend_with_reasons():
    res = _run("info", "--heads", "4")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for name in ("reference", "triton", "tilelang"):
        assert f"  {name}" in out
    assert "<- auto" in out and "versions:" in out and "device:" in out
    if "cuda" not in out:
        assert "needs a CUDA device" in out or "CUDA" in out      # a CPU machine says why the GPU kernels cannot serve


def test_demo_runs_and_judges_every_window():
    res = _run("demo", "--batch", "2", "--heads", "4", "--windows", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "pass" in line]
    assert len(rows) == 2, res.stdout
    assert "bytes per head: checkpoint 19456" in res.stdout


def test_demo_gdn():
    res = _run("demo", "--batch", "1", "--heads", "2", "--windows", "1", "--gate", "gdn")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gate gdn" in res.stdout
