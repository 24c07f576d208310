"""What the install promises: the extras accept the triton that current torch releases pin (they never pin one of
their own), tilelang's extra and the backend's validated releases agree, README.md's set-up command is the one CI
checks against the public index, and the tilelang backend says which releases it is validated on without importing
tilelang. (The resolution itself needs the network: ``.ci/run`` does it.)"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from leapquant import dispatch

tomllib = pytest.importorskip("tomllib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_CPU_COMMAND = 'pip install torch==2.13.0 -e ".[triton,tilelang,test]"'


def _extra(name: str) -> list[Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_triton_extra_takes_the_triton_torch_brings():
    """torch pins its triton exactly (2.10 and 2.11: 3.6.0, 2.13: 3.7.1, ...): an extra that pins another one makes
    the set-up command unresolvable, and an upper bound would do the same with the next torch."""
    (req,) = _extra("triton")
    assert req.name == "triton"
    assert not any(s.operator in ("==", "===", "<", "<=", "~=") for s in req.specifier), str(req)
    for release in ("3.6.0", "3.7.1", "3.8.0", "3.9.0"):
        assert req.specifier.contains(release), (str(req), release)
    assert not req.specifier.contains("3.5.1")


def test_tilelang_extra_matches_the_validated_releases():
    lq_tl = pytest.importorskip("leapquant.tilelang")
    (req,) = _extra("tilelang")
    assert req.name == "tilelang"
    validated = sorted(lq_tl.REQUIRED_TILELANG, key=Version)
    for release in validated:
        assert req.specifier.contains(release), (str(req), release)
    below = Version(validated[0])
    above = Version(validated[-1])
    assert not req.specifier.contains(f"{below.major}.{below.minor}.{below.micro - 1}")
    assert not req.specifier.contains(f"{above.major}.{above.minor}.{above.micro + 1}")
    assert set(lq_tl.REQUIRED_TILELANG.values()) <= {"gpu", "build"}
    assert "gpu" in lq_tl.REQUIRED_TILELANG.values()


@pytest.mark.parametrize("installed,ok", [("0.1.12", True), ("0.1.15", True), ("0.1.14+cu128", True),
                                          ("0.1.11", False), ("0.1.16", False), (None, False)])
def test_tilelang_release_check_reads_metadata(monkeypatch, installed, ok):
    lq_tl = pytest.importorskip("leapquant.tilelang")
    monkeypatch.setattr(dispatch, "package_version", lambda name: installed if name == "tilelang" else None)
    lq_tl._tilelang_problem.cache_clear()
    try:
        problem = lq_tl._tilelang_problem()
    finally:
        lq_tl._tilelang_problem.cache_clear()
    if ok:
        assert problem is None
    elif installed is None:
        assert "not installed" in problem
    else:
        assert installed in problem and "0.1.12 (run on a GPU)" in problem and "0.1.15" in problem, problem
        assert "pip install 'tilelang>=0.1.12,<=0.1.15'" in problem


def test_tilelang_versions_say_how_the_installed_release_is_validated(monkeypatch):
    lq_tl = pytest.importorskip("leapquant.tilelang")
    monkeypatch.setattr(dispatch, "package_version", lambda name: "0.1.15")
    assert "not run on a GPU" in lq_tl.versions()["tilelang"]
    monkeypatch.setattr(dispatch, "package_version", lambda name: "0.1.12")
    assert lq_tl.versions()["tilelang"] == "0.1.12"


def test_registering_the_tilelang_backend_does_not_import_tilelang():
    """``import tilelang`` takes seconds (17 s on the GPU host): the backend learns what it needs from the package's
    metadata and imports tilelang only to build a kernel."""
    code = ("import sys, leapquant.tilelang as t, leapquant.layout as l; "
            "t.reasons(l.Pool(2, 32, device='cpu')); t.versions(); print('tilelang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    if torch.cuda.is_available() and shutil.which("nvcc") is None:
        pytest.skip("here TileLang's own nvcc search is asked (it imports tilelang)")
    assert out.stdout.split() == ["False"]


def test_readme_shows_the_command_ci_resolves():
    readme, ci = _read("README.md"), _read(".ci", "run")
    assert README_CPU_COMMAND in readme
    assert README_CPU_COMMAND in ci                       # .ci/run greps README.md for it ...
    assert "INSTALL_ARGS=(torch==2.13.0 -e \".[triton,tilelang,test]\")" in ci    # ... and resolves these arguments
    assert re.search(r"pip install -e \"\.\[triton,tilelang,test\]\"", readme)   # the GPU-host form
    for flag in ("--isolated", "--dry-run", "--report", "--use-feature=fast-deps"):
        assert flag in ci, flag
    assert "HYPOTHESIS_PROFILE=ci python -m pytest -q -p no:cacheprovider" in readme
