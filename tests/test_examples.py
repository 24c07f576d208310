"""The examples run as a user runs them: a fresh interpreter, small sizes, on the CPU (the reference backend)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kda_decode_loop_runs_on_the_cpu():
    """examples/kda_decode_loop.py: a pool, prefill states encoded into shuffled slots, a padded batch, one
    decode_inplace per token; it exits 0 only when its outputs match the dense fp32 recurrence and the padding row's
    output is zero."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "examples" / "kda_decode_loop.py"), "--device", "cpu", "--batch", "2",
           "--heads", "4", "--tokens", "20"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    for head in ("device:", "backend: reference", "tokens/s:", "output norm:", "check vs dense fp32 recurrence:"):
        assert any(line.startswith(head) for line in lines), (head, proc.stdout)
    assert lines[-1].endswith(": ok"), proc.stdout


def test_kda_decode_loop_takes_the_librarys_spellings():
    """``--device cpu:0`` and ``--backend auto`` mean what they mean to the library."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(ROOT / "examples" / "kda_decode_loop.py"), "--device", "cpu:0", "--backend", "auto",
           "--batch", "1", "--heads", "2", "--tokens", "17"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].endswith(": ok"), proc.stdout + proc.stderr


def test_kda_decode_loop_rejects_options_that_cannot_run():
    """Exit status 2 and argparse's one-line error for options that cannot run here (exit 1 means the check failed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    cases = [("--batch", "0"), ("--tokens", "-1"), ("--backend", "nosuch"), ("--device", "nosuch")]
    if not __import__("torch").cuda.is_available():
        cases += [("--device", "cuda"), ("--backend", "triton"), ("--backend", "tilelang")]
    for args in cases:
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "kda_decode_loop.py"), *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr and "error:" in proc.stderr.strip().splitlines()[-1], (args, proc.stderr)
