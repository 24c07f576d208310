"""Tests of the compute-sanitizer driver (sanitize.py: its arguments, its reading of the tools' output, and its child's
flush on the CPU through the reference backend). Run on a CPU with
``python -m pytest -q -p no:cacheprovider bench/dev`` (the shipped suite, tests/, does not import the bench tools).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
#: the driver, beside this file or in bench/ above it
SANITIZE = next(p for p in (HERE / "sanitize.py", HERE.parent / "sanitize.py") if p.exists())


@pytest.fixture(scope="module")
def sanitize():
    spec = importlib.util.spec_from_file_location("sanitize", SANITIZE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sanitize"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_lists_every_run(sanitize, capsys):
    assert sanitize.main(["--dry-run", "--sanitizer", sys.executable]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(lines) == len(sanitize.TOOLS) * len(sanitize.GPU_BACKENDS) * len(sanitize.GATES)
    for tool in sanitize.TOOLS:
        mine = [ln for ln in lines if f"--tool {tool} " in ln]
        assert len(mine) == 4
        assert all("--error-exitcode 86" in ln and "--child" in ln and "--rows 32 --heads 32" in ln for ln in mine)
        assert all(("--racecheck-report analysis" in ln) == (tool == "racecheck") for ln in mine)


def test_dry_run_subset(sanitize, capsys):
    assert sanitize.main(["--dry-run", "--sanitizer", sys.executable, "--tools", "racecheck", "--backends", "tilelang",
                          "--gates", "gdn", "--racecheck-report", "all", "--no-warmup"]) == 0
    out = capsys.readouterr().out.splitlines()
    runs = [ln for ln in out if not ln.startswith("#")]
    assert len(runs) == 1 and "--racecheck-report all" in runs[0] and "--backend tilelang --gate gdn" in runs[0]
    assert not any("warm-up" in ln for ln in out)


def test_bad_arguments(sanitize):
    for argv in (["--tools", "nope", "--dry-run"], ["--rows", "1", "--dry-run"], ["--due", "0", "--dry-run"], []):
        with pytest.raises(SystemExit) as exc:
            sanitize.parse_args(argv)
        assert exc.value.code == 2


ANALYSIS_LOG = """========= COMPUTE-SANITIZER
[child] footprint ok
========= Error: Race reported between Write access at leapquant_flush_kernel+0xabc0 in tvm_kernels.cu:752
=========     and Read access at leapquant_flush_kernel+0xb750 in tvm_kernels.cu:762 [20224 hazards]
========= Error: Race reported between Write access at leapquant_flush_kernel+0xabd0 in tvm_kernels.cu:752
=========     and Read access at leapquant_flush_kernel+0xb760 in tvm_kernels.cu:762 [20224 hazards]
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
HAZARD_LOG = """========= Error: Potential RAW hazard detected at __shared__ 0x6800 in block (5,0,0) :
=========     Write Thread (224,0,0) at leapquant_flush_kernel+0xabc0 in tvm_kernels.cu:752
=========     Read Thread (64,0,0) at leapquant_flush_kernel+0xb750 in tvm_kernels.cu:762
=========     Current Value : 15
[child] footprint ok
========= RACECHECK SUMMARY: 100 hazards displayed (1376288 errors, 0 warnings)
"""


def test_reads_racecheck_reports(sanitize):
    r = sanitize.Result("racecheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output(ANALYSIS_LOG, r)
    assert (r.errors, r.warnings, r.hazards) == (2, 0, 40448)
    assert r.pairs == {"Write tvm_kernels.cu:752 / Read tvm_kernels.cu:762": 40448}
    assert sanitize.verdict(r) == "ERRORS"
    r = sanitize.Result("racecheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output(HAZARD_LOG, r)
    assert (r.errors, r.displayed) == (1376288, 100)
    assert r.pairs == {"RAW: Write tvm_kernels.cu:752 / Read tvm_kernels.cu:762": 1}
    clean = "[child] footprint ok\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    r = sanitize.Result("racecheck", "triton", "gdn", [], returncode=0)
    sanitize.parse_output(clean, r)
    assert (r.errors, r.hazards, sanitize.verdict(r)) == (0, 0, "clean")


def test_reads_other_tools_and_failures(sanitize):
    ok = "[child] footprint ok\n========= ERROR SUMMARY: 0 errors\n"
    r = sanitize.Result("memcheck", "triton", "kda", [], returncode=0)
    sanitize.parse_output(ok, r)
    assert (r.errors, r.hazards, sanitize.verdict(r)) == (0, None, "clean")
    r = sanitize.Result("initcheck", "tilelang", "kda", [], returncode=86)
    sanitize.parse_output("========= ERROR SUMMARY: 3 errors\n", r)
    assert sanitize.verdict(r) == "ERRORS"
    r = sanitize.Result("synccheck", "tilelang", "gdn", [], returncode=1)      # the child raised
    sanitize.parse_output("Traceback ...\n========= ERROR SUMMARY: 0 errors\n", r)
    assert sanitize.verdict(r) == "FAILED (exit 1)"
    r = sanitize.Result("synccheck", "tilelang", "gdn", [], returncode=0)      # no flush footprint seen
    sanitize.parse_output("========= ERROR SUMMARY: 0 errors\n", r)
    assert sanitize.verdict(r) == "NO FLUSH"
    r = sanitize.Result("memcheck", "tilelang", "gdn", [], timed_out=True)
    assert sanitize.verdict(r) == "TIMEOUT"


def test_outputs_merge(sanitize, tmp_path):
    args = sanitize.parse_args(["--out", str(tmp_path)])
    a = sanitize.Result("memcheck", "triton", "kda", ["cs", "a"], returncode=0, errors=0, verdict="clean", log="A")
    sanitize.write_outputs(str(tmp_path), args, [a], [], [{"commit": "x"}], "")
    runs, warm, headers = sanitize.load_previous(str(tmp_path))
    assert [sanitize.key(r) for r in runs] == [("memcheck", "triton", "kda")] and headers == [{"commit": "x"}]
    b = sanitize.Result("racecheck", "tilelang", "gdn", ["cs", "b"], returncode=86, errors=5, verdict="ERRORS",
                        pairs={"Write f:1 / Read f:2": 7}, log="B")
    old_log = (tmp_path / "sanitize.log").read_text()
    sanitize.write_outputs(str(tmp_path), args, runs + [b], warm, headers + [{"commit": "y"}], old_log)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["tool"], r["verdict"]) for r in data["runs"]] == [("memcheck", "clean"), ("racecheck", "ERRORS")]
    md = (tmp_path / "summary.md").read_text()
    assert "| racecheck | tilelang | gdn | 5 |" in md and "Write f:1 / Read f:2: 7 racing accesses" in md
    log = (tmp_path / "sanitize.log").read_text()
    assert log.count("===== memcheck triton kda") == 1 and "===== racecheck tilelang gdn" in log


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_child_flush_on_cpu(sanitize, gate, capsys):
    """The child's pool, call and footprint check, through the reference backend on the CPU."""
    args = sanitize.parse_args(["--child", "--backend", "reference", "--gate", gate, "--device", "cpu",
                                "--rows", "3", "--heads", "4", "--seed", "1"])
    assert sanitize.child(args) == 0
    assert sanitize.CHILD_OK in capsys.readouterr().out


def test_child_pool_and_footprint_check(sanitize):
    from leapquant.layout import L
    pool, idx, due = sanitize.build_pool(5, 4, "kda", 0.5, seed=3)
    assert sorted(idx.tolist()) == [0, 1, 2, 3, 4] and not due[0].any() and due.any() and (~due[1:]).any()
    assert (pool.hcnt[due] == L).all() and (pool.hcnt[~due] < L).all()
    after = sanitize.pool_to(pool, "cpu")
    assert after.raw.data_ptr() != pool.raw.data_ptr()
    assert "no due checkpoint changed (did the kernel run?)" in sanitize.check_footprint(pool, after, due)
    after.w[~due] += 1.0
    assert "window tensor w of a program not due changed" in sanitize.check_footprint(pool, after, due)
    assert torch.equal(pool.hcnt, after.hcnt)
