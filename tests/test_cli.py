"""The command line: ``leapquant info`` and ``leapquant demo`` (the README's main job), as a user runs them: what they
print, how they fail on bad input (exit status 2, one line on stderr, no traceback) and what they import."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import leapquant
from leapquant import cli

HAS_CUDA = torch.cuda.is_available()


def _run(*args: str, env: dict | None = None, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "leapquant", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def _imported_modules(importtime_log: str) -> set[str]:
    """Module names from ``python -X importtime``'s log (one 'import time: self | cumulative | name' line each)."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _assert_usage_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2, one line on stderr naming the problem, no traceback."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- info ------------------------------------------------------------------------------------------------------------
def test_info_lists_every_backend_with_reasons():
    res = _run("info", "--heads", "4")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for name in ("reference", "triton", "tilelang"):
        assert f"  {name}" in out
    assert "<- auto" in out and "versions:" in out and "device:" in out
    flush, step = out.split("\nflush backends for ")[1].split("\nstep backends ")          # each op's own list
    for name in ("reference", "triton", "tilelang"):
        assert f"  {name}" in step
    assert "available  <- auto" in step                  # (the reference on a CPU, the Triton kernel on a GPU)
    if "cuda" not in out:
        assert "needs a CUDA device" in out or "CUDA" in out      # a CPU machine says why the GPU kernels cannot serve


def test_info_flags_an_invalid_backend_variable():
    """LEAPQUANT_BACKEND=bogus makes every flush raise: info says so on its variable's line, names the valid values,
    still lists the backends, and exits 2 with the reason on stderr."""
    res = _run("info", "--heads", "4", env=dict(os.environ, LEAPQUANT_BACKEND="bogus"))
    _assert_usage_error(res, "LEAPQUANT_BACKEND='bogus'", "auto, reference, triton, tilelang")
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("LEAPQUANT_BACKEND="))
    assert "INVALID" in line and "auto, reference, triton, tilelang" in line, line
    assert "<- auto" not in res.stdout                       # no flush would reach the auto choice
    for name in ("reference", "triton", "tilelang"):
        assert f"  {name}" in res.stdout


def test_info_marks_a_backend_forced_by_the_variable():
    res = _run("info", "--heads", "4", env=dict(os.environ, LEAPQUANT_BACKEND="reference"))
    assert res.returncode == 0, res.stderr
    assert "reference available  <- forced by LEAPQUANT_BACKEND" in res.stdout, res.stdout


def test_info_imports_no_backend_package_beyond_need():
    """info learns tilelang's availability from its metadata (importing it takes seconds) and never loads
    leapquant.api (its torch.compiler decorator loads torch's compiler stack)."""
    res = _run("info", "--heads", "4", python_flags=("-X", "importtime"))
    assert res.returncode == 0, res.stderr
    mods = _imported_modules(res.stderr)
    assert "torch" in mods                                 # the log is read right
    assert "leapquant.api" not in mods and "torch._dynamo" not in mods
    if not (HAS_CUDA and shutil.which("nvcc") is None):    # only there is TileLang's own nvcc search asked
        assert "tilelang" not in mods


# ---- what --help costs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [("--help",), ("info", "--help"), ("demo", "--help"), ("bench", "--help")])
def test_help_imports_neither_torch_nor_a_backend(args):
    res = _run(*args, python_flags=("-X", "importtime"))
    assert res.returncode == 0, res.stderr
    assert "usage: leapquant" in res.stdout
    mods = _imported_modules(res.stderr)
    assert "leapquant.cli" in mods                         # the log is read right
    heavy = {m for m in mods if m.split(".")[0] in ("torch", "triton", "tilelang", "numpy")}
    assert not heavy, sorted(heavy)


def test_import_leapquant_is_lazy_and_every_public_name_is_there():
    code = ("import sys, leapquant as lq; assert 'torch' not in sys.modules, 'import leapquant loaded torch'; "
            "from leapquant import *; "
            "from leapquant import api, layout, reference, dispatch; "
            "names = {n: getattr(lq, n) for n in lq.__all__}; "
            "src = {'Pool': layout.Pool, 'flush_inplace': api.flush_inplace, 'run': api.run, 'run_gdn': api.run_gdn, "
            "'warmup': api.warmup, 'backend_info': api.backend_info, 'versions': api.versions, "
            "'device_description': api.device_description, 'default_q0': reference.default_q0, "
            "'use_backend': dispatch.use_backend, 'BackendUnavailable': dispatch.BackendUnavailable, "
            "'BACKENDS': dispatch.BACKENDS, 'V': layout.V, 'K': layout.K, 'L': layout.L, 'R': layout.R, "
            "'QMAX': layout.QMAX, 'EPS': layout.EPS, 'OFF': layout.OFF, 'step_inplace': api.step_inplace, "
            "'step': api.step, 'step_gdn': api.step_gdn, 'decode_inplace': api.decode_inplace}; "
            "assert set(src) == set(lq.__all__), set(src) ^ set(lq.__all__); "
            "bad = [n for n in src if names[n] is not src[n]]; assert not bad, bad; "
            "assert set(lq.__all__) <= set(dir(lq)); "
            "assert lq.validate.check_pool; "
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    res = subprocess.run([sys.executable, "-c", "import leapquant; leapquant.no_such_name"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0 and "AttributeError" in res.stderr and "no_such_name" in res.stderr


def test_every_option_has_help_text():
    parser = cli.build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    missing = []
    for name, sub in subs[0].choices.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing
    assert set(subs[0].choices) == {"info", "demo", "bench"}


# ---- demo ------------------------------------------------------------------------------------------------------------
def _decode_rows(stdout: str) -> list[list[str]]:
    """The demo's decode table: one row per window, cells window | leapquant | fp32 state | bf16 state | ratio."""
    part = stdout.split("\nflush:")[0]
    rows = [line.strip("| ").split(" | ") for line in part.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows[1:]]          # (the header's separator does not start with "| ")


def test_demo_decodes_then_judges_every_flush():
    """The main job: a decode through decode_inplace (every window's output error beside the fp32- and bf16-state
    recurrences, finite outputs, the padding row zero), then every simulated window's flush judged."""
    res = _run("demo", "--batch", "2", "--heads", "4", "--windows", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    ops = re.search(r"one decode_inplace per token \(step: (\w+), flush: (\w+)\)", res.stdout)
    assert ops, res.stdout
    if not HAS_CUDA:                                      # (a GPU: the dispatch's own choice for each op)
        assert ops.groups() == ("reference", "reference"), ops.groups()
    decode = _decode_rows(res.stdout)
    assert [r[0] for r in decode] == ["1", "2"], res.stdout
    for r in decode:
        errors = [float(c) for c in r[1:4]]
        assert all(0 < e < 0.05 for e in errors), r
        assert float(r[4]) == pytest.approx(errors[0] / errors[2], rel=2e-3), r
    assert "outputs finite: yes; padding row's output exactly zero: yes" in res.stdout
    flush = [line for line in res.stdout.split("\nflush:")[1].splitlines() if line.startswith("| ") and "pass" in line]
    assert len(flush) == 2, res.stdout
    assert "bytes per head: checkpoint 19456" in res.stdout     # SPEC section 4's 19 KB, an independent check


def test_demo_gdn():
    res = _run("demo", "--batch", "1", "--heads", "2", "--windows", "1", "--gate", "gdn")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gate gdn" in res.stdout and "; 1 key heads" in res.stdout
    assert len(_decode_rows(res.stdout)) == 1, res.stdout


def test_demo_on_the_reference_says_its_verdict_cannot_fail():
    """The reference is the criterion's yardstick: judged against itself it passes by construction. The demo says so,
    and names the way to judge a kernel on a CPU."""
    res = _run("demo", "--device", "cpu", "--backend", "reference", "--batch", "1", "--heads", "2", "--windows", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "criterion's own yardstick" in res.stdout and "checks the format, not a kernel" in res.stdout
    assert "--backend triton" in res.stdout


@pytest.mark.interpreter
@pytest.mark.parametrize("how", ["option", "variable"])
def test_demo_judges_the_triton_kernel_on_a_cpu(how):
    """``--backend triton`` or ``LEAPQUANT_BACKEND=triton`` on a CPU runs the kernel through Triton's interpreter (the
    demo turns it on): a verdict that can fail."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LEAPQUANT_BACKEND")}
    forced = ("--backend", "triton") if how == "option" else ()
    if how == "variable":
        env["LEAPQUANT_BACKEND"] = "triton"
    res = _run("demo", "--device", "cpu", *forced, "--batch", "1", "--heads", "2", "--windows", "1", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 1 ")]
    assert len(rows) == 2 and "triton" in rows[1] and "pass" in rows[1], res.stdout
    assert "(step: triton, flush: triton)" in res.stdout
    assert "yardstick" not in res.stdout


@pytest.mark.parametrize("option", ["--windows", "--batch", "--heads"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_rejects_counts_below_one(option, value):
    """A count below one is a usage error naming the option (not a TypeError deep inside, nor a silent default)."""
    res = _run("demo", option, value)
    _assert_usage_error(res, f"argument {option}", ">= 1", value)
    assert res.stdout == ""


def test_demo_rejects_a_non_integer_and_an_unknown_backend():
    _assert_usage_error(_run("demo", "--batch", "two"), "argument --batch", "'two'")
    _assert_usage_error(_run("demo", "--backend", "fast"), "argument --backend", "'fast'", "tilelang")
    _assert_usage_error(_run("info", "--heads", "0"), "argument --heads", ">= 1")


def test_names_are_read_in_any_case():
    """--backend and --gate take a name in any case, as the API's backend= and LEAPQUANT_BACKEND do (and Pool's
    gate=)."""
    res = _run("demo", "--backend", " Reference", "--gate", "GDN", "--batch", "1", "--heads", "2", "--windows", "1")
    assert res.returncode == 0, res.stderr
    assert "gdn" in res.stdout.lower()
    import leapquant as lq
    assert lq.Pool(2, 1, gate=" KDA ").gate == "kda"
    _assert_usage_error(_run("info", "--gate", "mamba"), "argument --gate", "'mamba'")


def test_demo_library_errors_are_one_line():
    """A ValueError from the library (here: a forced backend that cannot serve, whose message lists its reasons on
    several lines) is printed on one line, exit status 2."""
    res = _run("demo", "--device", "cpu", "--backend", "tilelang", "--batch", "1", "--heads", "8", "--windows", "1")
    _assert_usage_error(res, "leapquant demo: error:", "'tilelang' was forced", "needs a CUDA device")
    if "decode:" in res.stdout:         # (tilelang importable: its missing step kernel is said before the flush fails)
        assert "decode: not run: the tilelang backend has no step kernel" in res.stdout, res.stdout


@pytest.mark.parametrize("command", [("demo",), ("info",), ("bench", "--op", "flush"), ("bench", "--op", "step")])
def test_every_command_rejects_devices_this_machine_lacks_on_one_line(command):
    """``--device`` is one option for every command: a device that is no torch device, or is not here, is exit
    status 2 and one line naming the option (not a traceback from deep inside)."""
    _assert_usage_error(_run(*command, "--device", "bogus"), "--device 'bogus'")
    _assert_usage_error(_run(*command, "--device", "meta"), "--device 'meta'", "cpu or cuda")
    if not HAS_CUDA:
        _assert_usage_error(_run(*command, "--device", "cuda"), "--device 'cuda'", "CUDA is not available")


def test_demo_rejects_devices_this_machine_lacks():
    _assert_usage_error(_run("demo", "--device", "gpu0"), "--device 'gpu0'")
    if not HAS_CUDA:
        _assert_usage_error(_run("demo", "--device", "cuda"), "CUDA is not available")


def test_version():
    res = _run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"leapquant {leapquant.__version__}", res


@pytest.mark.parametrize("option", [("--backends", "nosuch"), ("--repeats", "0"), ("--repeats", "-3"),
                                    ("--max-seconds", "-1"), ("--ref-max-batch", "-5")])
def test_bench_rejects_options_that_cannot_run_before_measuring(option):
    """A bad name or count is one line naming the option, exit status 2, before anything is measured (not a row of
    the report, nor a default in its place)."""
    res = _run("bench", "--device", "cpu", *option)
    _assert_usage_error(res, "leapquant bench: error:", option[0])
    assert res.stdout == ""


def test_bench_rejects_an_invalid_backend_variable_it_would_read():
    """The variable chooses the backends only where --backends names none; named ones run, spelled in any case."""
    env = dict(os.environ, LEAPQUANT_BACKEND="nosuch")
    _assert_usage_error(_run("bench", "--device", "cpu", env=env), "leapquant bench: error:", "LEAPQUANT_BACKEND")
    res = _run("bench", "--device", "cpu", "--backends", "Reference", "--batch", "1", "--heads", "2", "--repeats",
               "1", "--check-rows", "1", "--due", "none", "--gate", "kda", env=env)
    assert res.returncode == 0 and "| reference | kda | 1 | 2 | none |" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("args", [("--batch", "0"), ("--heads", "-1"), ("--tokens", "0"),
                                  ("--last", "600")])
def test_e2e_rejects_options_that_cannot_run(args):
    """``python -m leapquant.e2e``: exit status 2 and one line for options that cannot run (1 means the accuracy
    requirement failed)."""
    res = subprocess.run([sys.executable, "-m", "leapquant.e2e", "--device", "cpu", *args], capture_output=True,
                         text=True, timeout=300)
    _assert_usage_error(res, "python -m leapquant.e2e: error:", args[0])
