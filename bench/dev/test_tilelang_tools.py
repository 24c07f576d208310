"""Tests of the TileLang developer tools beside this file (tilelang_dev.py, tilelang_clock.py, ncu_profile.py,
emulate_products.py), on a CPU: their profiling builds and version loading trace to kernels, their parsers read what
they are given. Run with ``python -m pytest -q -p no:cacheprovider bench/dev`` (the shipped suite, tests/, does not
import the dev tools). The GPU parts of the tools (timing, stamps read back) are not covered here.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

tilelang = pytest.importorskip("tilelang")

import emulate_products  # noqa: E402
import ncu_profile  # noqa: E402
import tilelang_clock  # noqa: E402
import tilelang_dev  # noqa: E402

from leapquant.tilelang import config, kernel  # noqa: E402

CFG = config.FlushConfig(32, "kda", "sm_90a", 132)


def test_profile_variants_name_phases():
    """Every unit a variant doubles or empties is a field of the kernel's Phases (a renamed phase fails here)."""
    fields = set(vars(kernel.Phases()))
    for name, (twice, skip) in tilelang_dev.PROFILE_VARIANTS.items():
        assert set(twice) <= fields and set(skip) <= fields, name


@pytest.mark.parametrize("variant", ["x2_rebuild", "no_stage", "ranking_only"])
def test_profiling_build_traces(variant):
    """A variant's kernel traces; a doubled phase appears twice as often as in the shipped kernel."""
    script = kernel.make_flush_func(CFG, tilelang_dev.profiling_phases(tilelang_dev.PROFILE_VARIANTS[variant]))
    script = script.script()
    shipped = kernel.make_flush_func(CFG).script()
    if variant == "x2_rebuild":
        assert script.count("lq_code(") == 2 * shipped.count("lq_code(")
    elif variant == "ranking_only":
        assert "lq_mma" not in script and "lq_nth_set_bit" in script


def test_load_version_from_directory(tmp_path):
    """A copy of the package directory loads as its own package inside leapquant (its __init__ not run: no second
    backend) and generates the same kernel as the installed one; the clock tool finds its clock module."""
    from leapquant import dispatch
    copy = tmp_path / "tilelang"
    shutil.copytree(Path(kernel.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    backends = list(dispatch.BACKENDS)
    mod = tilelang_dev.load_kernel_module(str(copy))
    assert mod is not kernel and mod.__name__.startswith("leapquant._ab_tilelang_")
    assert list(dispatch.BACKENDS) == backends
    cfg = mod.FlushConfig(32, "gdn", "sm_90a", 132)
    assert mod.make_flush_func(cfg).script() == kernel.make_flush_func(config.FlushConfig(32, "gdn", "sm_90a",
                                                                                         132)).script()
    ck = tilelang_clock.clock_module(str(copy))
    assert ck.__name__ == mod.__package__ + ".clock" and ck.CTA_WORD == 2048
    assert tilelang_dev.label(str(copy)) == str(copy)


def test_clock_tool_arguments():
    args = tilelang_clock.parse_args(["phases", "256:all", "4:all", "--gate", "gdn"])
    assert (args.command, args.points, args.gate, args.kernel) == ("phases", ["256:all", "4:all"], "gdn", None)
    assert tilelang_clock.generator(None) is kernel
    from leapquant.tilelang import clock
    assert tilelang_clock.clock_module(None) is clock and clock.MAX_STAMPED_CTAS >= 148
    with pytest.raises(SystemExit):
        tilelang_clock.parse_args(["cycles"])


def test_ncu_segments(tmp_path, capsys):
    """The SASS page of a report cut after every barrier: shares of samples and of executed instructions."""
    assert ncu_profile._opcode("@!P0 FFMA.FTZ R1, R2, R3, R4 ;") == "FFMA"
    rows = ["Address,Source,Warp Stall Sampling (All Samples),Instructions Executed,stall_barrier,stall_wait",
            '0,"FFMA R1, R2, R3, R4 ;",30,100,0,5', '1,"BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;",50,10,40,0',
            '2,"STS [R1], R2 ;",20,10,0,10']
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(rows) + "\n")
    ncu_profile.segments(str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "instructions 3 samples 100 warp-inst executed 120"
    assert out[1].startswith("seg   0 [    0-    1] samples  80.0% exe  91.7%") and "ends BAR.SYNC" in out[1]
    assert out[2].startswith("seg   1 [    2-    2] samples  20.0%")


def test_emulate_products_on_cpu():
    """tf32 truncation keeps the top 11 significant bits; the exact variant of the compression is the reference's."""
    import torch

    from leapquant import families
    from leapquant.reference import compress, rebuild
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, -3.0], dtype=torch.float32)
    assert emulate_products.tf32(x).tolist() == [1.0 + 2.0 ** -10, 1.0, -3.0]
    case = families.make_case(2, 4, "kda", seed=1)
    t = case.tensors
    S = rebuild(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
    exact = emulate_products.compress(S, case.q0, False, False, False)
    for a, b in zip(exact, compress(S, case.q0)):
        assert torch.equal(a, b)
    assert case.judge(exact, "exact").passed


def test_segment_counts_read_a_listing():
    """tilelang_dev.segment_counts splits an nvdisasm listing at its clock reads, counts each segment's instructions
    and its backward branches (a loop), and names predicated opcodes by their opcode."""
    listing = """
        /*0000*/                   CS2R R2, SR_CLOCKLO ;
        /*0010*/                   FADD R3, R3, R4 ;
.L_x_1:
        /*0020*/               @P0 FMUL R5, R5, R6 ;
        /*0030*/                   BRA `(.L_x_1) ;
        /*0040*/                   CS2R R8, SR_CLOCKLO ;
        /*0050*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0060*/                   CS2R R9, SR_CLOCKLO ;
"""
    first, second = tilelang_dev.segment_counts(listing)
    assert (first["instructions"], first["loops"]) == (4, 1)
    assert first["ops"]["FMUL"] == 1 and first["ops"]["CS2R"] == 1
    assert (second["instructions"], second["loops"]) == (2, 0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_counts_cover_every_segment():
    """The clock-stamp build compiles without a GPU and has one segment per name clock_segments gives; the rebuild
    and codes segments carry their tensor-core and packing instructions."""
    pytest.importorskip("triton")
    names = kernel.clock_segments(config.FlushConfig(32, "gdn", "sm_90a", 132, clock="phases"))
    counts = tilelang_dev.segment_counts(tilelang_dev.clock_build_sass("gdn", "sm_90a", 132))
    assert len(counts) == len(names)
    seg = dict(zip(names, counts))
    assert seg["rebuild"]["ops"]["HMMA"] > 0 and seg["codes"]["ops"]["PRMT"] > 0
