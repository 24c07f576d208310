"""What is specific to the Triton backend (the criterion on every family, the footprint on a caller's pool and the
deployment contract for its default kernel are in tests/test_conformance.py).

Without a GPU the tl kernel runs through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1): the
ranking across steps of the due scan, repeated calls, the kernel's layout constants, the kernel choice; the Gluon
kernel (the backend's GPU kernel) is built for sm_80 / sm_90 / sm_100 by Triton's own ptxas and its inline assembly
emulated. With a GPU the ``gpu`` tests judge both kernels (Gluon and tl) at the deployment sizes, and the tl kernel
(the conformance suite runs the Gluon kernel, the default) replays the call from a CUDA graph with different due sets
and launches once with nothing due.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest
import torch

import leapquant as lq
from leapquant import criterion, families
from leapquant.layout import CHECKPOINT_BYTES, L, OFF, REGION_WORDS, Pool
from helpers import (assert_flush_footprint, check_graph_replay, fill_noise, noisy_pool, nothing_due_launches,
                     snapshot, written_programs)

pytest.importorskip("triton")
from leapquant import triton as lq_triton  # noqa: E402  (registers the backend)
from leapquant.triton import launch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
pytestmark = [] if HAS_CUDA else [pytest.mark.interpreter]


def _judge(case: families.Case, out) -> criterion.Verdict:
    """The criterion on ``case``'s device (the fp64 rebuild on a GPU is cheap; on the CPU it is the case's own)."""
    if case.device.type == "cpu":
        return case.judge(out, "triton")
    S = criterion.exact_state(*case.checkpoint(), case.tensors["kbuf"], case.tensors["ubuf"], case.tensors["w"],
                              **case.gate_kwargs())
    return criterion.judge(S, out, case.reference(), labels=case.labels, name="triton")


# ---- what is specific to this backend: the ranking's scan steps, repeated calls, the kernels' constants -------------
# (every family, random geometries, the poisoned pool's footprint and padding rows: tests/test_conformance.py)
@pytest.mark.parametrize("heads", [1, 64])
def test_due_list_spans_scan_steps(heads):
    """Rows x heads beyond one step of the due scan (and 1 head): a few due programs scattered over every step
    are each flushed once; everything else stays untouched."""
    rows = launch.SCAN_FLAGS // heads + 3                            # two scan steps (or more with one head)
    pool = Pool(rows + 2, heads, device=DEVICE, gate="gdn")
    fill_noise(pool, seed=heads)
    pool.hcnt.fill_(L - 1)
    g = torch.Generator().manual_seed(heads)
    idx = (torch.randperm(rows + 1, generator=g)[:rows] + 1).to(torch.int32)
    idx[:3] = 0                                               # skipped rows
    picks = [(int(idx[3]), 0), (int(idx[rows // 2]), heads - 1), (int(idx[-1]), heads // 2)]
    for s_, h_ in picks:
        pool.hcnt[s_, h_] = L
    idx = idx.to(DEVICE)
    slots, hs = written_programs(pool, idx)
    assert len(slots) == 3
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend="triton")
    assert_flush_footprint(pool, before, slots, hs)


def test_second_call_keeps_state():
    """hcnt stays L after a flush, so a second call finds the same programs due with empty windows: it leaves them,
    and the whole pool, bitwise as the first call did (no second re-compression)."""
    pool, idx = noisy_pool("kda", 2, 4, DEVICE)
    slots, hs = written_programs(pool, idx)
    assert len(slots) > 0
    q0 = lq.default_q0(DEVICE)
    lq.flush_inplace(pool, idx, q0, backend="triton")
    assert len(written_programs(pool, idx)[0]) == 0
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, q0, backend="triton")
    none = torch.zeros(0, dtype=torch.long)
    assert_flush_footprint(pool, before, none, none)
    after = snapshot(pool)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_warmup_makes_room_for_every_slot(monkeypatch):
    """warmup sizes the flush's workspace for a call of every slot (max(num_slots, MIN_ROW_CAPACITY) rows), so that an
    engine that warms up and then captures never meets a batch larger than the workspace inside the capture."""
    monkeypatch.setattr(launch, "MIN_ROW_CAPACITY", 2)
    pool = Pool(6, 1, device=DEVICE)
    before = snapshot(pool)
    lq.warmup(pool, backend="triton")
    assert launch._WORKSPACES[pool].rows >= pool.num_slots
    after = snapshot(pool)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_layout_constants_match_the_kernel():
    """The tl kernel's offsets are the layout's (a changed layout must fail here before it corrupts a pool)."""
    from leapquant.triton import tl_kernel as tk
    val = lambda c: getattr(c, "value", c)  # noqa: E731
    assert val(tk._CODES_BYTE) == 0
    assert val(tk._SK_WORD) * 4 == lq.layout.SK_BYTE and val(tk._SV_WORD) * 4 == lq.layout.SV_BYTE
    assert val(tk._TOK_HALF) * 2 + 2 * lq.R * (lq.K + lq.V) == CHECKPOINT_BYTES
    assert val(tk._OFF) == OFF and val(tk._REGION_WORDS) == REGION_WORDS


# ---- the Gluon kernel: builds for every target on the CPU; the kernel choice ---------------------------------------
_COMPILE = """
import sys
from gluon_probes import compile_static
k = compile_static(int(sys.argv[1]), gate=sys.argv[2], num_heads=int(sys.argv[3]))
sass = k.asm["sass"]
print(len(k.asm["cubin"]), sass.count("HMMA"), sass.count("LDGSTS"), sass.count("LDL") + sass.count("STL"))
"""


def _gluon_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a child Python without TRITON_INTERPRET (under the interpreter Triton's own library functions
    are interpreted ones, which Gluon cannot compile), the repository and tests/ (for tests/gluon_probes.py) on its
    path; skips without Gluon, fails with the child's stderr."""
    pytest.importorskip("triton.experimental.gluon")
    import triton
    from leapquant.triton.launch import GLUON_VALIDATED_TRITON
    if not triton.__version__.startswith(GLUON_VALIDATED_TRITON):
        # Gluon is Triton's experimental dialect and changes between releases; on others the backend serves with the
        # tl kernel (the Gluon kernel is declined with this reason), and CI runs these tests again with triton 3.6
        pytest.skip(f"the Gluon kernel is validated on triton {', '.join(GLUON_VALIDATED_TRITON)}.x; this is "
                    f"{triton.__version__} (the tl kernel serves here)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.parametrize("capability,gate,heads", [(80, "kda", 32), (90, "kda", 32), (90, "gdn", 12), (100, "kda", 8)])
def test_gluon_kernel_compiles(capability, gate, heads):
    """The Gluon kernel lowered and assembled by Triton's ptxas for sm_80 / sm_90 / sm_100 without a GPU (in a child
    process: under TRITON_INTERPRET=1 Triton's own library functions are interpreted ones, which Gluon cannot
    compile). Its rank updates and residual run on the tensor cores (HMMA), its inputs arrive by cp.async (LDGSTS),
    and nothing spills."""
    run = _gluon_child(_COMPILE, str(capability), gate, str(heads))
    cubin, hmma, ldgsts, spills = map(int, run.stdout.split())
    assert cubin > 0 and hmma >= 3 * 16, f"sm_{capability}: {hmma} HMMA (old tokens, window hi + lo, residual)"
    assert ldgsts > 0, f"sm_{capability}: no cp.async copies"
    assert spills == 0, f"sm_{capability}: {spills} local-memory accesses"


def test_gluon_exchanges_conflict_free():
    """The Gluon kernel's one-round exchange layouts (the sums' partials, the vectors' redistributions, the window
    keys) have no shared-memory bank conflicts on their writes and reads, by Triton's own model (a compiled probe, in a
    child process for the reason above)."""
    run = _gluon_child("from gluon_probes import exchange_bank_conflicts as f; print(f())")
    found = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert len(found) == 20 and "col4-read" in found and "keys-write" in found, found
    assert all(v == 0 for v in found.values()), f"bank conflicts (excess wavefronts per access): {found}"


def test_gluon_code_dequantisation():
    """The Gluon kernel's dequantisation (gluon_kernel._CODE_BYTES_ASM: a sign flip and a byte permute into the float
    1.0, then an exact subtraction of _CODE_SHIFT and one multiplication by s_k _CODE_SCALE) emulated bit for bit, from
    the asm text, for every code and s_k over 60 binades: code 0 gives exactly 0 (an all-zero state must decode to
    zero), and every other code is c s_k / 127 to three roundings (2^15 / 127, the scale, the product)."""
    run = _gluon_child("from leapquant.triton import gluon_kernel as m; "
                       "print(repr((m._CODE_BYTES_ASM.value, m._CODE_SCALE.value, m._CODE_SHIFT.value)))")
    asm, scale, shift = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    flip = int(re.search(r"xor\.b32 t, \$2, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    one = int(re.search(r"mov\.b32 one, (0x[0-9A-Fa-f]+);", asm).group(1), 16)
    sels = [int(v, 16) for v in re.findall(r"prmt\.b32 \$[01], t, one, (0x[0-9A-Fa-f]+);", asm)]
    assert len(sels) == 2, asm

    def prmt(a: int, b: int, sel: int) -> int:       # PTX prmt.b32 (default mode): byte i of {b, a} per selector nibble
        src = a | (b << 32)
        return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))

    codes = list(range(-lq.QMAX, lq.QMAX + 1))
    pairs = [(c & 0xFF) | ((codes[(i + 7) % len(codes)] & 0xFF) << 8) for i, c in enumerate(codes)]
    x = torch.tensor([[prmt(w ^ flip, one, sel) for sel in sels] for w in pairs], dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)                          # [255, 2]: the pair's two codes
    c = torch.tensor([[c, codes[(i + 7) % len(codes)]] for i, c in enumerate(codes)], dtype=torch.float64)
    s_k = torch.logspace(-30, 30, 61, dtype=torch.float64).float()
    a = s_k * torch.tensor(scale, dtype=torch.float32)                 # fp32, as in the kernel
    t = x - torch.tensor(shift, dtype=torch.float32)                   # fp32 subtraction, as in the kernel
    assert torch.equal(t.double(), c * 2.0 ** -15), "x - shift is not exactly c 2^-15"
    got = (t[:, :, None] * a).double()                                 # fp32 product, one rounding
    assert torch.all(got[c == 0] == 0), "code 0 does not dequantise to exactly 0"
    step = s_k.double() / lq.QMAX
    err = ((got - c[:, :, None] * step) / step).abs()
    assert torch.all(err <= 2.0 ** -22 * c.abs()[:, :, None]), f"worst {(err / c.abs().clamp_min(1)[:, :, None]).max():.3g}"


def _run_warp_asm(asm: str, inputs: list[list[float]], n_out: int) -> list[list[float]]:
    """Runs the PTX of an inline-asm block over a warp's 32 lanes (``inputs[lane]`` are $n_out, $n_out + 1, ...),
    for the few instructions the kernel's asm uses; returns each lane's outputs $0 .. $n_out - 1."""
    regs = [{f"${n_out + i}": v for i, v in enumerate(row)} for row in inputs]

    def val(lane: int, x: str):
        return lane if x == "%laneid" else regs[lane][x] if x in regs[lane] else int(x, 0)

    for stmt in (t.strip() for t in asm.strip()[1:-1].split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        a = [x.strip() for x in rest.split(",")]
        step = {
            "mov.u32": lambda lane: val(lane, a[1]),
            "and.b32": lambda lane: val(lane, a[1]) & val(lane, a[2]),
            "setp.ne.u32": lambda lane: val(lane, a[1]) != val(lane, a[2]),
            "selp.f32": lambda lane: val(lane, a[1]) if val(lane, a[3]) else val(lane, a[2]),
            "add.f32": lambda lane: val(lane, a[1]) + val(lane, a[2]),
            "shfl.sync.bfly.b32": lambda lane: val(lane ^ int(a[2], 0), a[1]),
            "shfl.sync.idx.b32": lambda lane: val(int(a[2], 0), a[1]),
        }[op]                                           # (an instruction not listed here fails the test: KeyError)
        new = [step(lane) for lane in range(32)]        # every lane reads before any lane writes, as in a warp
        for lane in range(32):
            regs[lane][a[0]] = new[lane]
    return [[regs[lane][f"${j}"] for j in range(n_out)] for lane in range(32)]


def test_gluon_gram_reduction():
    """The Gluon kernel's Gram-matrix reduction (gluon_kernel._GRAM_ASM: a reduce-scatter over the lanes, then each sum
    read from a lane holding it) run instruction by instruction over a warp: every lane ends with all ten sums
    (integers, so exactly)."""
    run = _gluon_child("from leapquant.triton import gluon_kernel as m; print(repr(m._GRAM_ASM.value))")
    asm = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        parts = torch.randint(-1000, 1000, (32, 10), generator=gen).tolist()
        sums = [sum(row[j] for row in parts) for j in range(10)]
        got = _run_warp_asm(asm, parts, 10)
        assert all(row == sums for row in got), f"lane 0 got {got[0]}, want {sums}"


def test_kernel_choice(monkeypatch):
    """LEAPQUANT_TRITON_KERNEL picks the kernel: a bad value is a ValueError naming the choices, also among the
    backend's reasons (so a forced backend raises with it, auto skips it); "mma" where the Gluon kernel cannot run
    (the CPU) raises with the reasons; "tl" always works; unset, the CPU gets "tl"."""
    cpu = torch.device("cpu")
    pool = Pool(3, 2, device=DEVICE)              # a pool the backend serves here (GPU, or the interpreter)
    monkeypatch.setenv(launch.KERNEL_ENV, "cuda-graphs")
    with pytest.raises(ValueError, match="expected one of"):
        launch.kernel_name_for(cpu)
    assert any("expected one of" in why for why in lq_triton.reasons(pool))
    monkeypatch.setenv(launch.KERNEL_ENV, "mma")
    with pytest.raises(RuntimeError, match="CUDA GPUs only"):
        launch.kernel_name_for(cpu)
    if not HAS_CUDA:
        assert any("CUDA GPUs only" in why for why in lq_triton.reasons(pool))
    monkeypatch.setenv(launch.KERNEL_ENV, "tl")
    assert launch.kernel_name_for(cpu) == "tl" and not lq_triton.reasons(pool)
    monkeypatch.delenv(launch.KERNEL_ENV)
    assert launch.kernel_name_for(cpu) == "tl"


# ---- GPU only: the deployment sizes and CUDA graphs, for both kernels -------------------------------------------
@pytest.fixture(params=["mma", "tl"])
def kernel(request, monkeypatch):
    """The Triton backend's two GPU kernels (the Gluon kernel is the default; the tl kernel is the fallback)."""
    if request.param == "mma" and HAS_CUDA and launch.mma_reasons(DEVICE):
        pytest.skip("; ".join(launch.mma_reasons(DEVICE)))
    monkeypatch.setenv(launch.KERNEL_ENV, request.param)
    return request.param


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [16, 64, 256, 512])
def test_gpu_deployment_sizes(batch, kernel):
    """All families at batch x 32 heads (KDA; GDN at batch 64) through the deployment call, judged on the GPU."""
    for gate in (("kda", "gdn") if batch == 64 else ("kda",)):
        case = families.make_case(batch, 32, gate, seed=batch).to(DEVICE)
        v = _judge(case, case.run(backend="triton"))
        assert v.passed, f"{kernel} batch {batch} {gate}: {v.message}"


@pytest.fixture
def tl_kernel(monkeypatch):
    """The backend's fallback kernel on the GPU (the conformance suite runs graph replay and the one-launch test on
    the backend's default, the Gluon kernel)."""
    monkeypatch.setenv(launch.KERNEL_ENV, "tl")
    return "tl"


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_gpu_graph_replay(gate, tl_kernel):
    """Captured once, replayed with different due sets (tests/helpers.check_graph_replay)."""
    check_graph_replay("triton", gate, 32, DEVICE)


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_gpu_nothing_due_is_one_launch(gate, tl_kernel):
    """A call with nothing due launches one kernel (its programs rank the flags themselves and exit)."""
    names = nothing_due_launches("triton", gate, 32, DEVICE)
    assert len(names) == 1, f"{tl_kernel}: nothing due launched {len(names)} kernels: {names}"


@gpu
@needs_cuda
def test_gpu_capture_after_warmup_takes_a_batch_of_every_slot():
    """After warmup alone, a flush of more rows than the workspace's minimum (every slot of a large pool, padding
    among them) is captured and replayed: warmup made room for num_slots rows."""
    pool = Pool(launch.MIN_ROW_CAPACITY + 8, 1, device=DEVICE)
    lq.warmup(pool, backend="triton")
    idx = torch.arange(pool.num_slots, dtype=torch.int32, device=DEVICE)
    idx[::7] = -1
    q0 = lq.default_q0(DEVICE)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lq.flush_inplace(pool, idx, q0, backend="triton")
    g.replay()
    torch.cuda.synchronize()


@gpu
@needs_cuda
def test_gpu_default_kernel_is_gluon():
    """On an sm_80+ GPU with Gluon, a call runs the Gluon kernel (its name in the profile), not the tl kernel."""
    if launch.mma_reasons(DEVICE) or os.environ.get(launch.KERNEL_ENV):
        pytest.skip("the Gluon kernel is not the default here")
    names = nothing_due_launches("triton", "kda", 8, DEVICE)
    assert names == ["flush_due"], names
