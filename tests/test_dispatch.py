"""Backend registry and choice: env var, per-call override, context manager, forced-unavailable errors, auto."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import leapquant as lq
from leapquant import dispatch


def _pool(gate="kda"):
    pool = lq.Pool(3, 2, gate=gate)
    return pool, torch.tensor([1, 2], dtype=torch.int32), lq.default_q0()


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Each test resolves its choices anew (the dispatch caches them per geometry)."""
    monkeypatch.setattr(dispatch, "_CHOSEN", {})


@pytest.fixture
def fake_tilelang(monkeypatch):
    """A tilelang backend that always declines, with two reasons."""
    fake = dispatch.Backend("tilelang", flush=lambda *a: pytest.fail("a declining backend ran"),
                            reasons=lambda pool: ["fake: no sm_90a here", "fake: nvcc missing"])
    monkeypatch.setitem(dispatch._REGISTRY, "tilelang", fake)
    return fake


def test_env_var_is_read_once_at_import():
    code = ("import os, leapquant.dispatch as d; print(d.ENV_BACKEND); os.environ['LEAPQUANT_BACKEND'] = 'triton'; "
            "print(d.requested())")
    env = dict(os.environ, LEAPQUANT_BACKEND="Reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["reference", "reference"]


def test_bad_env_value_raises_listing_valid_names():
    code = ("import torch, leapquant as lq; p = lq.Pool(2, 1); "
            "lq.flush_inplace(p, torch.tensor([1], dtype=torch.int32), lq.default_q0())")
    env = dict(os.environ, LEAPQUANT_BACKEND="cutlass")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "LEAPQUANT_BACKEND='cutlass'" in res.stderr and "auto, reference, triton, tilelang" in res.stderr


def test_unknown_backend_name_raises_before_launch():
    pool, idx, q0 = _pool()
    with pytest.raises(ValueError, match="unknown backend 'fast'.*auto, reference, triton, tilelang"):
        lq.flush_inplace(pool, idx, q0, backend="fast")
    with pytest.raises(ValueError, match="unknown backend"):
        with lq.use_backend("fast"):
            pass


def test_forced_unavailable_backend_raises_with_its_reasons(fake_tilelang):
    pool, idx, q0 = _pool()
    pool.hcnt.fill_(lq.L)
    before = pool.raw.clone()
    with pytest.raises(lq.BackendUnavailable, match="(?s)'tilelang' was forced.*no sm_90a here.*nvcc missing"):
        lq.flush_inplace(pool, idx, q0, backend="tilelang")
    with pytest.raises(lq.BackendUnavailable):
        with lq.use_backend("tilelang"):
            lq.flush_inplace(pool, idx, q0)
    assert torch.equal(pool.raw, before)


def test_real_tilelang_declines_cpu_pools():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    pool, _, _ = _pool()
    why = dispatch.reasons("tilelang", pool)
    assert why and all(isinstance(r, str) and r for r in why)


def test_per_call_override_beats_context_and_env(fake_tilelang):
    pool, idx, q0 = _pool()
    with lq.use_backend("tilelang"):
        assert dispatch.select(pool, 2, backend="reference").name == "reference"
        with pytest.raises(lq.BackendUnavailable):
            dispatch.select(pool, 2)
    assert dispatch.requested() == dispatch.requested(None)


def test_auto_degrades_quietly_and_logs_once(fake_tilelang, monkeypatch, caplog):
    pool, idx, q0 = _pool()
    monkeypatch.setattr(dispatch, "auto_order", lambda pool, n, op="flush": ["tilelang", "reference"])
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="leapquant"):
        assert dispatch.select(pool, 2, backend="auto").name == "reference"
        assert dispatch.select(pool, 2, backend="auto").name == "reference"
    chosen = [r for r in caplog.records if "flush -> reference" in r.getMessage()]
    skipped = [r for r in caplog.records if "tilelang skipped" in r.getMessage()]
    assert len(chosen) == 1 and len(skipped) == 1
    assert "no sm_90a here" in skipped[0].getMessage()


def test_no_backend_left_lists_every_reason(fake_tilelang, monkeypatch):
    pool, _, _ = _pool()
    monkeypatch.setattr(dispatch, "auto_order", lambda pool, n, op="flush": ["tilelang"])
    with pytest.raises(lq.BackendUnavailable, match="(?s)no backend can serve.*tilelang: fake: no sm_90a here"):
        dispatch.select(pool, 2, backend="auto")


def test_cpu_auto_choice_is_the_reference():
    pool, _, _ = _pool()
    assert dispatch.auto_order(pool, 2) == ["reference"]
    assert dispatch.select(pool, 2, backend="auto").name == "reference"


def test_backend_info_lists_every_backend_with_reasons():
    rows = lq.backend_info("cpu", num_heads=4)
    assert [r["name"] for r in rows] == list(lq.BACKENDS)
    ref = rows[0]
    assert ref["available"] and ref["reasons"] == [] and ref["auto_rank"] == 1
    for r in rows[1:]:
        assert r["available"] or r["reasons"], r


@pytest.mark.parametrize("kwargs, match", [(dict(num_rows=-1), "num_rows: expected an int >= 0"),
                                           (dict(num_rows="256"), "num_rows: expected an int >= 0"),
                                           (dict(num_heads=0), "num_heads: expected an int >= 1"),
                                           (dict(op="both"), "unknown op"), (dict(gate="x"), "gate: expected")])
def test_backend_info_names_a_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lq.backend_info("cpu", **kwargs)


@pytest.mark.parametrize("device", ["gpu", "nope", "meta"])
def test_backend_info_names_a_device_it_cannot_probe(device):
    """A device torch cannot name, or one that holds no data, is a ValueError naming the device (as for
    device_description), not torch's own error."""
    with pytest.raises(ValueError, match=f"device: '{device}'"):
        lq.backend_info(device)


def test_choice_is_cached_per_geometry(monkeypatch):
    pool, _, _ = _pool()
    calls = []
    real = dispatch.reasons
    monkeypatch.setattr(dispatch, "reasons", lambda name, p, op="flush": calls.append(name) or real(name, p, op))
    for _ in range(3):
        assert dispatch.select(pool, 2, backend="reference").name == "reference"
    assert calls == ["reference"]


def test_register_rejects_unknown_names():
    with pytest.raises(ValueError, match="not one of"):
        dispatch.register(dispatch.Backend("cuda_graph", flush=lambda *a: None, reasons=lambda p: []))


# ---- LEAPQUANT_BACKEND validity, reported before any flush ---------------------------------------------------------
def test_env_problem_names_the_value_and_the_valid_ones(monkeypatch):
    monkeypatch.setattr(dispatch, "ENV_BACKEND", "bogus")
    problem = dispatch.env_problem()
    assert problem and "LEAPQUANT_BACKEND='bogus'" in problem and "auto, reference, triton, tilelang" in problem
    with pytest.raises(ValueError, match="LEAPQUANT_BACKEND='bogus'"):
        dispatch.requested()
    pool, idx, q0 = _pool()
    with pytest.raises(ValueError, match="LEAPQUANT_BACKEND='bogus'.*auto, reference, triton, tilelang"):
        lq.flush_inplace(pool, idx, q0)
    assert dispatch.select(pool, 2, backend="reference").name == "reference"   # an explicit choice still serves
    monkeypatch.setattr(dispatch, "ENV_BACKEND", "tilelang")
    assert dispatch.env_problem() is None


# ---- the environment report reads versions without importing the backends' packages -------------------------------
def test_dispatch_imports_neither_torch_nor_a_backend():
    code = ("import sys, leapquant.dispatch as d; v = d.versions(); "
            "print(sorted(m for m in ('torch', 'triton', 'tilelang', 'leapquant.api') if m in sys.modules)); "
            "print(v['torch'] != 'not installed')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True", out


def test_reference_registers_without_the_api_module():
    """Asking the dispatch for the reference imports torch and leapquant.reference only (not leapquant.api, whose
    torch.compiler decorator costs about 1.5 s), so ``leapquant info`` stays fast."""
    code = ("import sys, leapquant.dispatch as d; b = d.get_backend('reference'); "
            "print(b.name, 'leapquant.api' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["reference", "False", "False"], out


def test_package_version_without_import(monkeypatch):
    assert dispatch.package_version("leapquant_no_such_package") is None
    assert dispatch.package_version("torch") == torch.__version__
    assert dispatch.versions()["torch"] == torch.__version__


def test_backend_info_reports_a_missing_package_without_importing(monkeypatch):
    real = dispatch.package_version
    monkeypatch.setattr(dispatch, "package_version", lambda name: None if name == "tilelang" else real(name))
    monkeypatch.delitem(dispatch._REGISTRY, "tilelang", raising=False)
    real_load = dispatch._load
    monkeypatch.setattr(dispatch, "_load", lambda name: pytest.fail(f"{name} was imported") if name == "tilelang"
                        else real_load(name))
    rows = {r["name"]: r for r in dispatch.backend_info("cpu", num_heads=4)}
    assert not rows["tilelang"]["available"]
    assert rows["tilelang"]["reasons"] == ["tilelang is not installed (pip install 'leapquant[tilelang]')"]
    assert rows["reference"]["available"]
