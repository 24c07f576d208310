"""Tests of the seed adapter (bench/dev/seed_adapter.py) with a stand-in for the seed file: the seed's interface
(``Pool(num_slots, device)``, 2 heads, KDA only, tokens named ``uq``) over leapquant's reference. Run on a CPU with
``python -m pytest -q -p no:cacheprovider bench/dev/test_seed_adapter.py`` (the shipped suite, tests/, does not
import the dev tools)."""
from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ADAPTER = Path(__file__).resolve().parent / "seed_adapter.py"
TINY = ["--heads", "2", "--check-rows", "1", "--repeats", "2", "--max-seconds", "2", "--device", "cpu", "--quiet",
        "--batch", "1", "--due", "all", "none"]

FAKE_SEED = '''
"""A stand-in for the seed kernel's file: its interface, leapquant's reference inside."""
import leapquant
from leapquant import reference_pool

class Pool:
    def __init__(self, num_slots, device="cpu"):
        self._pool = leapquant.Pool(num_slots, 2, device=device, gate="kda")
        for name in ("raw", "codes", "s_k", "s_v", "kbuf", "ubuf", "w", "pcum", "gbuf", "hcnt"):
            setattr(self, name, getattr(self._pool, name))
        self.uq = self._pool.tokens           # the seed's name for the Compensator Tokens; no `tokens`

def flush_inplace(pool, idx, q0):
    reference_pool.flush_inplace(pool._pool, idx, q0)
'''


@pytest.fixture
def seed_file(tmp_path, monkeypatch):
    path = tmp_path / "fake_seed.py"
    path.write_text(FAKE_SEED)
    monkeypatch.setenv("LEAPQUANT_SEED_KERNEL", str(path))
    return path


def _adapter(name: str = "seed_adapter_under_test"):
    spec = importlib.util.spec_from_file_location(name, ADAPTER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path) -> dict:
    with open(path, newline="") as f:
        return {(r["backend"], r["gate"], r["due"]): r for r in csv.DictReader(f)}


def test_the_seeds_pool_through_the_projects_attributes(seed_file):
    mod = _adapter()
    assert mod.NAME == "fake_seed"
    pool = mod.Pool(10, num_heads=2, device="cpu", gate="kda")
    assert pool.tokens is pool.inner.uq and pool.codes is pool.inner.codes
    assert mod.Pool(10, num_heads=2, device="cpu", gate="kda").inner is pool.inner     # kept: one build per size
    with pytest.raises(ValueError, match="3"):
        mod.Pool(10, num_heads=3, device="cpu", gate="kda")
    with pytest.raises(ValueError, match="gdn"):
        mod.Pool(10, num_heads=2, device="cpu", gate="gdn")
    mod.close()
    assert mod.Pool(10, num_heads=2, device="cpu", gate="kda").inner is not pool.inner


def test_import_without_the_seed_says_how(monkeypatch):
    monkeypatch.delenv("LEAPQUANT_SEED_KERNEL", raising=False)
    with pytest.raises(ImportError, match="LEAPQUANT_SEED_KERNEL"):
        _adapter()


def test_the_bench_checks_and_times_the_seed(seed_file, tmp_path, monkeypatch):
    out = tmp_path / "s.csv"
    mod = _adapter()
    monkeypatch.setattr(sys, "argv", ["seed_adapter.py"])
    rc = mod.main([str(seed_file), "--backends", "reference", "--gate", "kda", "gdn", *TINY, "--csv", str(out)])
    assert rc == 0
    rows = _rows(out)
    assert rows[("impl:fake_seed", "kda", "all")]["verdict"] == "PASS"
    assert float(rows[("impl:fake_seed", "kda", "all")]["median_us"]) > 0
    assert "the run asks for gate gdn" in rows[("impl:fake_seed", "gdn", "all")]["verdict"]
    assert rows[("reference", "gdn", "all")]["verdict"] == "PASS"


def test_main_without_a_seed_file_prints_the_usage():
    r = subprocess.run([sys.executable, str(ADAPTER)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "seed_adapter.py SEED.py" in r.stderr
