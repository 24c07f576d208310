"""Smoke tests of the benchmark CLI (``leapquant bench``) on the CPU: tiny batches and heads, wall-clock timing.

They check the stdout table, the CSV's columns, the plot file, ``--record`` (the table of record and the history it
appends to), ``--timer wall``, ``--impl`` with tiny modules of the project's interface (a correct one, a wrong one, a
broken one, ones of another geometry), that one failing backend does not stop the run, and the run's steps one by one
where that is cheap.
"""
from __future__ import annotations

import argparse
import csv
import math
import textwrap
import time

import pytest
import torch

import leapquant
from leapquant import bench, bench_common

HEADS = 2
TINY = ["--heads", str(HEADS), "--check-rows", "1", "--repeats", "2", "--max-seconds", "2", "--device", "cpu",
        "--quiet"]

FAKE_IMPL = '''
"""A tiny implementation with the interface of --impl, built on leapquant's reference."""
import leapquant
from leapquant import reference_pool
{extra}

class Pool(leapquant.Pool):
    def __init__(self, num_slots, num_heads=32, device=None, gate="kda"):
        super().__init__(num_slots, {heads}, device=device, gate={gate})

def flush_inplace(pool, idx, q0):
    reference_pool.flush_inplace(pool, idx, q0)
    {damage}
'''


def _fake(tmp_path, name: str, damage: str = "pass", heads: int = HEADS, gate: str = "gate", extra: str = "") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(FAKE_IMPL).format(heads=heads, damage=damage, gate=gate, extra=extra))
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
    closed = tmp_path / "closed"
    good = _fake(tmp_path, "fake_good", extra=f"NAME = 'good'\ndef close():\n    open({str(closed)!r}, 'w').close()")
    wrong = _fake(tmp_path, "fake_wrong", damage="pool.tokens[idx.long()] = 0")      # drops the rank-4 part
    broken = _fake(tmp_path, "fake_broken", damage="raise RuntimeError('kernel exploded')")
    bad_heads = _fake(tmp_path, "fake_heads", heads=3)
    kda_only = _fake(tmp_path, "fake_kda_only", gate="'kda'")
    no_iface = tmp_path / "not_an_impl.py"
    no_iface.write_text("x = 1\n")
    out_csv = tmp_path / "i.csv"
    rc = bench.main(["--backends", "reference", "tilelang", "--batch", "1", "--due", "all", "none", *TINY,
                     "--impl", good, "--impl", wrong, "--impl", broken, "--impl", bad_heads, "--impl", kda_only,
                     "--impl", str(no_iface), "--csv", str(out_csv)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "impl:good" in stdout                                       # the module's NAME names its rows
    rows = {(r["backend"], r["due"]): r for r in _rows(out_csv)}
    assert rows[("impl:good", "all")]["verdict"] == "PASS"
    assert float(rows[("impl:good", "all")]["median_us"]) > 0
    assert int(rows[("impl:good", "none")]["due_programs"]) == 0
    assert closed.exists()                                             # close() once its rows were done
    assert rows[("impl:fake_wrong", "all")]["verdict"] == "FAIL"
    assert float(rows[("impl:fake_wrong", "all")]["worst_ratio"]) > 1
    assert "kernel exploded" in rows[("impl:fake_broken", "all")]["verdict"]
    assert "3 heads" in rows[("impl:fake_heads", "all")]["verdict"]
    assert rows[("impl:fake_kda_only", "all")]["verdict"] == "PASS"    # a KDA run: the pool serves it
    assert rows[("impl:not_an_impl", "all")]["verdict"].startswith("unavailable: import failed")
    # on a CPU the TileLang backend cannot serve: a row that says so, and the run goes on
    assert rows[("tilelang", "all")]["verdict"].startswith("unavailable")
    assert rows[("reference", "all")]["verdict"] == "PASS"
    # the rows come in the order asked for (the reference ran first, the --impl modules before the kernels)
    assert list(dict.fromkeys(r["backend"] for r in _rows(out_csv))) == [
        "reference", "tilelang", "impl:good", "impl:fake_wrong", "impl:fake_broken", "impl:fake_heads",
        "impl:fake_kda_only", "impl:not_an_impl"]


def test_impl_pool_of_another_gate(tmp_path):
    kda_only = _fake(tmp_path, "fake_kda_only", gate="'kda'")
    out_csv = tmp_path / "g.csv"
    rc = bench.main(["--backends", "none", "--gate", "gdn", "--batch", "1", "--due", "all", *TINY,
                     "--impl", kda_only, "--csv", str(out_csv)])
    assert rc == bench.EXIT_NOTHING
    (row,) = _rows(out_csv)
    assert row["verdict"].startswith("error:") and "not a gdn pool" in row["verdict"]


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
    L = leapquant.L                                                   # a full window's fill count
    pats, n = bench.due_pattern(8, 16, 32, "sixteenth", seed=0, device="cpu")
    assert n == 32 and len(pats) == 8
    for p in pats:
        assert int((p == L).sum()) == 32 and int(p.max()) == L and int(p.min()) >= 0
    assert any(not torch.equal(pats[0], p) for p in pats[1:])       # a different placement in every set
    rows_hit = (pats[0] == L).sum(dim=1)
    assert int(rows_hit.max()) > int(rows_hit.min())                  # uneven across rows
    pats, n = bench.due_pattern(8, 4, 2, "none", seed=0, device="cpu")
    assert n == 0 and all(int(p.max()) < L for p in pats)
    pats, n = bench.due_pattern(8, 4, 2, "all", seed=0, device="cpu")
    assert n == 8 and all(bool((p == L).all()) for p in pats)


def test_parser_mounts_as_subcommand():
    top = argparse.ArgumentParser(prog="leapquant")
    sub = top.add_subparsers(dest="cmd")
    bench.add_arguments(sub.add_parser("bench"))
    ns = top.parse_args(["bench", "--backends", "triton", "--batch", "16", "64", "--impl", "a.py", "--impl", "b.py",
                         "--no-refcheck", "--due", "all", "--record", "out", "--timer", "wall"])
    assert ns.backends == ["triton"] and ns.batch == [16, 64] and ns.impl == ["a.py", "b.py"]
    assert ns.refcheck is False and ns.due == ["all"] and ns.record == "out" and ns.timer == "wall"
    assert top.parse_args(["bench"]).record is None


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


# ---- --record: the table of record and its history ----------------------------------------------------------------
def test_record_writes_the_table_and_appends_history(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rec = tmp_path / "results"
    cmd = ["--backends", "reference", "tilelang", "--batch", "1", "2", "--due", "all", "none", *TINY,
           "--commit", "abc1234", "--record", str(rec)]
    assert bench.main(cmd) == 0
    stdout = capsys.readouterr().out
    md = (rec / "RECORD.md").read_text()
    assert md == stdout                                                 # the same report as --md
    for fact in ("commit abc1234", "device: ", "versions: python ", "torch ", "timing: ", "timer floor",
                 f"command: `leapquant bench {' '.join(cmd)}`"):
        assert fact in md, fact
    with open(rec / "RECORD.csv", newline="") as f:
        assert tuple(next(csv.reader(f))) == bench.CSV_COLUMNS
    record_rows = _rows(rec / "RECORD.csv")
    assert len(record_rows) == 2 * 2 * 2                               # 2 backends x 2 batches x 2 due fractions
    assert (rec / "RECORD.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(rec / "history.csv", newline="") as f:
        assert tuple(next(csv.reader(f))) == bench.HISTORY_COLUMNS
    history = _rows(rec / "history.csv")
    timed = [r for r in record_rows if not math.isnan(float(r["median_us"]))]    # tilelang cannot serve here
    assert len(history) == len(timed) == 4
    for h, r in zip(history, timed):
        assert h == {"commit": "abc1234", "date": r["date"], "gpu": r["device"], "backend": "reference", "gate": "kda",
                     "batch": r["batch"], "heads": str(HEADS), "due": r["due"], "median_us": r["median_us"],
                     "bound_us": r["bound_us"], "verdict": "PASS", "op": "flush"}

    assert bench.main(cmd) == 0                                        # a second run appends its rows
    history2 = _rows(rec / "history.csv")
    assert len(history2) == 8 and history2[:4] == history
    assert (rec / "history.csv").read_text().count("commit,date,") == 1


def test_record_not_written_when_nothing_was_timed(tmp_path):
    rec = tmp_path / "results"
    assert bench.main(["--backends", "tilelang", "--batch", "1", "--due", "all", *TINY,
                       "--record", str(rec)]) == bench.EXIT_NOTHING
    assert not rec.exists()


def _row(**kw) -> bench_common.Row:
    base = dict(backend="triton", gate="kda", batch=16, heads=32, due="all", due_programs=512, median_us=33.2049,
                p20_us=33.1, p80_us=33.3, samples=40, timing="t", bound_us=6.9104, ratio=4.8, verdict="PASS",
                worst_ratio=0.99)
    return bench_common.Row(**{**base, **kw})


ENV = dict(device="NVIDIA H200", sm_count=132, bandwidth_gbs=4183.0, timer_floor_us=0.9, torch="2", triton="3",
           tilelang="0", python="3", commit="abc1234", date="2026-12-02 04:28 UTC")


def test_append_history_keeps_the_files_columns_and_line_ends(tmp_path):
    path = tmp_path / "history.csv"
    # an existing history: its own column order, no line end after the last line
    path.write_text("commit,gpu,backend,due,median_us,verdict,date\nold,G,triton,all,1.0,PASS,d")
    rows = [_row(), _row(due="none", due_programs=0, median_us=2.8, bound_us=0.0, verdict="FAIL"),
            _row(due="sixteenth", median_us=float("nan"), verdict="skipped: batch > --ref-max-batch 16")]
    assert bench.append_history(path, rows, ENV) == 2                  # the untimed row is left out
    lines = path.read_text().split("\n")
    assert lines == ["commit,gpu,backend,due,median_us,verdict,date", "old,G,triton,all,1.0,PASS,d",
                     "abc1234,NVIDIA H200,triton,all,33.205,PASS,2026-12-02 04:28 UTC",
                     "abc1234,NVIDIA H200,triton,none,2.8,FAIL,2026-12-02 04:28 UTC", ""]


def test_history_row_shortens_the_verdict():
    assert bench.history_row(_row(verdict="error: RuntimeError: boom"), ENV)["verdict"] == "error"
    assert bench.history_row(_row(verdict="unchecked (--no-refcheck)"), ENV)["verdict"] == "unchecked"
    assert bench.history_row(_row(verdict="FAIL"), ENV)["gpu"] == "NVIDIA H200"


def test_the_repositorys_history_header_is_the_one_appended_to():
    from pathlib import Path
    history = Path(__file__).resolve().parent.parent / "bench" / "results" / "history.csv"
    if not history.exists():
        pytest.skip("no bench/results/history.csv in this checkout")
    with open(history, newline="") as f:
        assert tuple(next(csv.reader(f))) == bench.HISTORY_COLUMNS


# ---- --timer wall ---------------------------------------------------------------------------------------------------
def test_wall_timer_rows_say_so(tmp_path):
    out_csv = tmp_path / "w.csv"
    assert bench.main(["--backends", "reference", "--batch", "1", "--due", "none", "--no-refcheck", "--timer", "wall",
                       *TINY, "--csv", str(out_csv)]) == 0
    (row,) = _rows(out_csv)
    assert row["timing"].startswith("host wall-clock per eager call") and float(row["median_us"]) > 0


@pytest.mark.timing
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("timer", ["events", "wall"])
def test_preparation_runs_before_each_call_and_outside_its_time(timer, device):
    """A call consumes its set (as a flush empties its windows); ``prepare`` restores it. Every call must find its set
    restored, and the preparation's own time must not be in the samples (it sleeps 20 ms on the host; the call does
    nothing, or one tiny kernel on a GPU, whose CUDA events would then hold the GPU's idle wait for the host)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.zeros(1, device=device)
    ready = [False] * 4
    calls = []

    def prepare(s):
        time.sleep(0.02)
        ready[s] = True

    def call(s):
        calls.append(ready[s])
        ready[s] = False
        x.add_(1.0)

    if timer == "wall":
        samples, method = bench_common.time_calls_wall(call, 4, 12, device, 5.0, prepare=prepare)
    else:
        samples, method = bench_common.time_calls(call, 4, 12, device, 5.0, capture=False, prepare=prepare)
    assert calls and all(calls), "a call found its set not restored"
    assert bench_common._percentile(samples, 50) < 10_000, \
        f"the preparation's 20 ms reached the samples: {sorted(samples)}"


@pytest.mark.timing
def test_kernel_timer_prepares_every_round_outside_the_calls(cuda_device):
    """time_calls_kernel with a preparation: every replayed call finds its set restored (the call records what it found
    and consumes it), and no call's span holds the preparation's kernels. One slot set, so a preparation follows every
    call: were it inside the spans, every call would list the preparation's kernels beside its own, and every sample
    would hold its 256 MiB fill (the medians are compared, so a GPU shared with other processes does not decide it).
    The call is captured in a CUDA graph, as the benchmark's calls are: ``ready`` is written by ``fill_``, where a
    Python float assigned by index is a pageable host-to-device copy that no graph captures; the timer then times
    eager calls, whose spans hold the host's launch gaps (22 us on one H100, 39-89 us on a slower host, against a
    fill of 82 us)."""
    nsets, repeats = 1, 9
    ready = torch.zeros(nsets, device=cuda_device)
    seen = torch.zeros(2 * (repeats + 4 * nsets), device=cuda_device)
    count = torch.zeros((), dtype=torch.long, device=cuda_device)
    big = torch.empty(64 << 20, device=cuda_device)

    def prepare(s):
        big.fill_(float(s))
        ready[s].fill_(1.0)

    def call(s):
        seen.index_copy_(0, count.view(1), ready[s].view(1))
        count.add_(1)
        ready[s].fill_(0.0)

    kernels: list[list[str]] = []
    samples, how = bench_common.time_calls_kernel(call, nsets, repeats, cuda_device, prepare=prepare, kernels=kernels)
    torch.cuda.synchronize(cuda_device)
    assert "graph capture failed" not in how, how
    n = int(count)
    assert len(samples) == repeats and n >= repeats and len(kernels) == repeats
    assert bool((seen[:n] == 1.0).all()), f"a call found its set not restored: {seen[:n].tolist()}"
    alone: list[list[str]] = []
    bench_common.time_calls_kernel(call, nsets, 3, cuda_device, kernels=alone)     # the call's own kernels
    assert alone[0] and all(k == alone[0] for k in kernels), \
        f"the calls' spans hold other kernels: {kernels} against the call's own {alone[0]}"
    fill_us = bench_common.time_calls_kernel(lambda s: big.fill_(1.0), 1, 5, cuda_device)[0]
    assert bench_common._percentile(samples, 50) < bench_common._percentile(fill_us, 50) / 2, \
        f"the calls' spans hold the preparation: {samples} against a fill of {fill_us}"


# ---- the run's steps -------------------------------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    return bench.build_parser().parse_args([*argv, "--device", "cpu", "--quiet"])


def test_plan_run_resolves_and_refuses():
    plan = bench.plan_run(_args("--batch", "2", "1", "2"))
    assert plan.device.type == "cpu" and not plan.on_gpu
    assert plan.batches == [2, 1] and plan.repeats == 3              # duplicates dropped, order kept; CPU repeats
    assert bench.plan_run(_args()).batches == list(bench.DEFAULT_CPU_BATCHES)
    assert bench.plan_run(_args("--repeats", "7")).repeats == 7
    for bad in (("--rotate", "7"), ("--batch", "0"), ("--heads", "0"), ("--check-rows", "0")):
        with pytest.raises(bench.UsageError):
            bench.plan_run(_args(*bad))


def test_build_targets_and_execution_order(tmp_path):
    good = _fake(tmp_path, "fake_good")
    args = _args("--backends", "triton", "none", "reference", "--ref-max-batch", "4", "--impl", good)
    targets = bench.build_targets(args, torch.device("cpu"))
    assert [(t.name, t.kind) for t in targets] == [("triton", "backend"), ("reference", "backend"),
                                                   ("impl:fake_good", "impl")]
    assert targets[1].max_batch == 4 and targets[0].max_batch is None
    assert [t.name for t in bench.execution_order(targets)] == ["reference", "impl:fake_good", "triton"]
    assert bench.build_targets(_args("--backends", "none"), torch.device("cpu")) == []


def test_slot_sets_are_disjoint_and_skip_slot_0():
    sets = bench_common.slot_sets(8, 3, seed=0, device="cpu")
    slots = torch.cat(sets)
    assert len(sets) == 8 and all(s.numel() == 3 for s in sets)
    assert sorted(slots.tolist()) == list(range(1, 25))


def test_report_text_has_one_verdict_line_per_batch():
    env = dict(ENV, device_long="NVIDIA H200 (sm_90, 132 SMs)", bandwidth_how="copy", bytes_kda=1, bytes_gdn=1,
               timing_long="kernel time", rotate=8, check_long="criterion", load="idle", command="leapquant bench")
    rows = [_row(message="triton: PASS"), _row(due="none", message="triton: PASS"), _row(message="")]
    text = bench.report_text(rows, env, ["all", "none"])
    assert text.startswith("# LeapQuant flush benchmark (2026-12-02 04:28 UTC)")
    assert text.count("| triton | kda | 16 |") == 3
    assert text.endswith("Verdicts:\n\n- triton kda b=16: triton: PASS\n")


def test_step_and_decode_ops_on_the_cpu(tmp_path):
    """--op step / decode: the reference is checked by the step criterion and timed at each fill (step) or at the
    staggered steady state (decode); the record goes to RECORD-<op>.* and the history rows carry the op."""
    for op, dues in (("step", {"h=1", "h=15"}), ("decode", {"staggered"})):
        rec = tmp_path / op
        cmd = ["--op", op, "--backends", "reference", "--batch", "1", "--heads", "4", "--gate", "kda", "gdn",
               "--repeats", "2", "--max-seconds", "1", "--check-rows", "2", "--record", str(rec), "--quiet",
               "--commit", "abc1234", "--device", "cpu", "--no-fla"]
        assert bench.main(cmd) == 0
        md = (rec / f"RECORD-{op}.md").read_text()
        assert f"LeapQuant {op} benchmark" in md and "step_program_bytes" in md
        rows = _rows(rec / f"RECORD-{op}.csv")
        assert {r["due"] for r in rows} == dues and {r["op"] for r in rows} == {op}
        assert all(r["verdict"] == "PASS" and float(r["worst_ratio"]) <= 1 for r in rows), rows
        assert all(float(r["bound_us"]) > 0 for r in rows)
        assert {h["op"] for h in _rows(rec / "history.csv")} == {op}
    assert bench.main(["--op", "step", "--impl", "x.py"]) == bench.EXIT_USAGE
    assert bench.main(["--op", "step", "--fill", "16"]) == bench.EXIT_USAGE


@pytest.mark.parametrize("argv", [["--op", "step", "--impl", "x.py"], ["--op", "decode", "--fill", "16"],
                                  ["--op", "step", "--fill", "-1"]])
def test_step_usage_errors_come_before_the_device_is_probed(argv):
    """A usage error of --op step / decode is the planner's (:func:`bench.plan_run`), which runs before the GPU load
    probe, so that it exits as a usage error (2) and not as busy (3) on a GPU that other processes load."""
    with pytest.raises(bench.UsageError):
        bench.plan_run(bench.build_parser().parse_args(argv))
