"""Smoke tests of the benchmark CLI (``leapquant bench``) on the CPU: tiny batches and heads, wall-clock timing.

They check the stdout table, the CSV's columns, the plot file, ``--impl`` with tiny fake modules (a correct one, a wrong
one, a broken one) and that one failing backend does not stop the run.
"""
from __future__ import annotations

import csv
import textwrap

import pytest
import torch

from leapquant import bench

HEADS = 2
TINY = ["--heads", str(HEADS), "--check-rows", "1", "--repeats", "2", "--max-seconds", "2", "--device", "cpu",
        "--quiet"]

FAKE_IMPL = '''
"""A tiny external implementation with the seed's interface (2 heads), built on leapquant's reference."""
import torch
import leapquant
from leapquant import reference

class Pool(leapquant.Pool):
    def __init__(self, num_slots, device="cpu"):
        super().__init__(num_slots, {heads}, device=device, gate="kda")
        self.uq = self.tokens          # the seed's name for the Compensator Tokens

def flush_inplace(pool, idx, q0):
    reference.flush_inplace(pool, idx, q0)
    {damage}

def run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0):
    return leapquant.run(codes, s_k, s_v, u, q, kbuf, ubuf, gbuf, w, pcum, q0, backend="reference")
'''


def _fake(tmp_path, name: str, damage: str = "pass", heads: int = HEADS) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(FAKE_IMPL).format(heads=heads, damage=damage))
    return str(path)


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_table_csv_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_csv, out_md, out_png = tmp_path / "r.csv", tmp_path / "r.md", tmp_path / "r.png"
    rc = bench.main(["--backends", "reference", "--batch", "1", "2", *TINY,
                     "--csv", str(out_csv), "--md", str(out_md), "--plot", str(out_png)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| backend | gate | batch | heads | due |" in stdout
    assert "wall-clock" in stdout and "copy bandwidth" in stdout and "commit" in stdout
    assert out_md.read_text() == stdout
    with open(out_csv, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == bench.CSV_COLUMNS
    rows = _rows(out_csv)
    assert [(r["batch"], r["due"]) for r in rows] == [(b, d) for b in ("1", "2") for d in ("all", "sixteenth", "none")]
    for r in rows:
        assert r["backend"] == "reference" and r["gate"] == "kda" and r["heads"] == str(HEADS)
        assert r["verdict"] == "PASS", r["message"]
        assert float(r["median_us"]) > 0 and float(r["p20_us"]) <= float(r["median_us"]) <= float(r["p80_us"])
        assert r["timing"].startswith("wall-clock")
        assert float(r["worst_ratio"]) <= 1.0
    due = {r["due"]: int(r["due_programs"]) for r in rows if r["batch"] == "2"}
    assert due == {"all": 2 * HEADS, "sixteenth": 1, "none": 0}
    b2 = next(r for r in rows if r["batch"] == "2" and r["due"] == "all")
    assert float(b2["bound_us"]) > 0 and float(b2["ratio"]) == pytest.approx(
        float(b2["median_us"]) / float(b2["bound_us"]), rel=1e-3)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_impl_modules_and_failures_are_rows(tmp_path, capsys):
    good = _fake(tmp_path, "fake_good")
    wrong = _fake(tmp_path, "fake_wrong", damage="pool.tokens[idx.long()] = 0")      # drops the rank-4 part
    broken = _fake(tmp_path, "fake_broken", damage="raise RuntimeError('kernel exploded')")
    bad_heads = _fake(tmp_path, "fake_heads", heads=3)
    no_iface = tmp_path / "not_an_impl.py"
    no_iface.write_text("x = 1\n")
    out_csv = tmp_path / "i.csv"
    rc = bench.main(["--backends", "reference", "tilelang", "--batch", "1", "--due", "all", "none", *TINY,
                     "--impl", good, "--impl", wrong, "--impl", broken, "--impl", bad_heads, "--impl", str(no_iface),
                     "--csv", str(out_csv)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "impl:fake_good" in stdout
    rows = {(r["backend"], r["due"]): r for r in _rows(out_csv)}
    assert rows[("impl:fake_good", "all")]["verdict"] == "PASS"
    assert float(rows[("impl:fake_good", "all")]["median_us"]) > 0
    assert int(rows[("impl:fake_good", "none")]["due_programs"]) == 0
    assert rows[("impl:fake_wrong", "all")]["verdict"] == "FAIL"
    assert float(rows[("impl:fake_wrong", "all")]["worst_ratio"]) > 1
    assert "kernel exploded" in rows[("impl:fake_broken", "all")]["verdict"]
    assert "3 heads" in rows[("impl:fake_heads", "all")]["verdict"]
    assert rows[("impl:not_an_impl", "all")]["verdict"].startswith("unavailable: import failed")
    # on a CPU the TileLang backend cannot serve: a row that says so, and the run goes on
    assert rows[("tilelang", "all")]["verdict"].startswith("unavailable")
    assert rows[("reference", "all")]["verdict"] == "PASS"


def test_no_refcheck_and_nothing_timed(tmp_path, capsys):
    out_csv = tmp_path / "n.csv"
    rc = bench.main(["--backends", "reference", "--batch", "1", "--due", "none", "--no-refcheck", *TINY,
                     "--csv", str(out_csv)])
    assert rc == 0
    (row,) = _rows(out_csv)
    assert row["verdict"].startswith("unchecked")
    rc = bench.main(["--backends", "tilelang", "--batch", "1", "--due", "all", *TINY])
    assert rc == bench.EXIT_NOTHING
    assert bench.main(["--backends", "reference", "--rotate", "4", *TINY]) == bench.EXIT_USAGE


def test_due_pattern_counts_and_spread():
    pats, n = bench.due_pattern(8, 16, 32, "sixteenth", seed=0, device="cpu")
    assert n == 32 and len(pats) == 8
    for p in pats:
        assert int((p == 16).sum()) == 32 and int(p.max()) == 16 and int(p.min()) >= 0
    assert any(not torch.equal(pats[0], p) for p in pats[1:])       # a different placement in every set
    rows_hit = (pats[0] == 16).sum(dim=1)
    assert int(rows_hit.max()) > int(rows_hit.min())                  # uneven across rows
    pats, n = bench.due_pattern(8, 4, 2, "none", seed=0, device="cpu")
    assert n == 0 and all(int(p.max()) < 16 for p in pats)
    pats, n = bench.due_pattern(8, 4, 2, "all", seed=0, device="cpu")
    assert n == 8 and all(bool((p == 16).all()) for p in pats)


def test_parser_mounts_as_subcommand():
    import argparse
    top = argparse.ArgumentParser(prog="leapquant")
    sub = top.add_subparsers(dest="cmd")
    bench.add_arguments(sub.add_parser("bench"))
    ns = top.parse_args(["bench", "--backends", "triton", "--batch", "16", "64", "--impl", "a.py", "--impl", "b.py",
                         "--no-refcheck", "--due", "all"])
    assert ns.backends == ["triton"] and ns.batch == [16, 64] and ns.impl == ["a.py", "b.py"]
    assert ns.refcheck is False and ns.due == ["all"]


def test_gdn_gate(tmp_path):
    out_csv = tmp_path / "g.csv"
    assert bench.main(["--backends", "reference", "--gate", "gdn", "--batch", "1", "--due", "all", *TINY,
                       "--csv", str(out_csv)]) == 0
    (row,) = _rows(out_csv)
    assert row["gate"] == "gdn" and row["verdict"] == "PASS", row["message"]
    assert float(row["bound_us"]) > 0 and float(row["timer_floor_us"]) >= 0


@pytest.mark.interpreter
def test_triton_through_the_interpreter(tmp_path):
    """The Triton backend on the CPU (TRITON_INTERPRET=1, set by conftest): nothing due keeps it quick; the row is
    timed or says why not, and the run goes on either way."""
    import os
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tier runs on a CPU machine with TRITON_INTERPRET=1")
    out_csv = tmp_path / "t.csv"
    rc = bench.main(["--backends", "triton", "reference", "--batch", "1", "--due", "none", "--no-refcheck",
                     "--interpret", *TINY, "--csv", str(out_csv)])
    assert rc == 0
    rows = {r["backend"]: r for r in _rows(out_csv)}
    assert set(rows) == {"triton", "reference"}
    assert rows["triton"]["median_us"] or rows["triton"]["verdict"].startswith(("error", "unavailable"))
