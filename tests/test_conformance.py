"""The conformance suite: every registered backend, for every op, against the fp32 reference by the spec's criterion
(docs/spec.md section 3), on every input family, both gates, several geometries; and the deployment contract on a
caller's pool: poisoned outputs all written, every other byte untouched, padding rows skipped, CUDA-graph replay, a
call with nothing due is one launch, no host synchronisation.

The cases are generated from the backend registry (leapquant.dispatch.BACKENDS) and an op table (:data:`OPS`); a
backend that cannot serve a geometry here (leapquant.dispatch.reasons) is skipped with its reasons, so the same suite
runs on a CPU (the reference, and the Triton kernel through its interpreter) and on a GPU (every backend). What is
specific to one backend (its build for each target, its kernel choice, its emulated inline assembly) stays in that
backend's own test file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import assume, given, strategies as st

import leapquant as lq
from leapquant import criterion, dispatch, families, reference, reference_pool, step_families
from leapquant.layout import L, Pool
from helpers import (POISON_CODE, assert_flush_footprint, check_graph_replay, empty_windows, judge_programs,
                     mixed_windows, noisy_pool, nothing_due_launches, poison_due_checkpoints, program_inputs, snapshot,
                     written_programs)

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
BACKENDS = dispatch.BACKENDS
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def served(backend: str, heads: int, gate: str, skip: bool = True, op: str = "flush") -> bool:
    """Whether ``backend`` serves ``op`` on a pool of this geometry on DEVICE; skips the test with the reasons if
    not."""
    why = dispatch.reasons(backend, Pool(2, heads, device=DEVICE, gate=gate), op=op)
    if why and skip:
        pytest.skip(f"{backend} cannot serve the {op} on {heads} heads ({gate}) on {DEVICE}: {'; '.join(why)}")
    return not why


def serves_some_geometry(backend: str, op: str = "flush") -> None:
    """Skips the test with the reasons unless ``backend`` serves ``op`` for some geometry here (8 heads, either gate):
    before hypothesis draws anything, since its examples would all be filtered out."""
    if not (served(backend, 8, "kda", skip=False, op=op) or served(backend, 8, "gdn", skip=False, op=op)):
        served(backend, 8, "kda", op=op)


@pytest.fixture(params=BACKENDS, scope="module")
def serving_backend(request) -> str:
    """A backend that serves the flush for some geometry here (:func:`serves_some_geometry`)."""
    serves_some_geometry(request.param)
    return request.param


# ---- the ops ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One op of the library as the suite exercises it: a case of functional-form inputs (``make_case(batch, heads,
    gate, seed)``), the backend's output for it, the criterion's verdict, the input families a case cycles through and
    the output dtypes per gate."""
    name: str
    make_case: Callable[..., families.Case | step_families.StepCase]
    run: Callable[[families.Case | step_families.StepCase, str], tuple]
    judge: Callable[[families.Case | step_families.StepCase, tuple, str], criterion.Verdict | criterion.StepVerdict]
    families: tuple[str, ...]
    dtypes: Callable[[str], list[torch.dtype]]


def _judge_flush(case: families.Case, out: tuple, name: str) -> criterion.Verdict:
    if case.device.type == "cpu":
        return case.judge(out, name)
    t = case.tensors
    S = criterion.exact_state(*case.checkpoint(), t["kbuf"], t["ubuf"], t["w"], **case.gate_kwargs())
    return criterion.judge(S, out, case.reference(), labels=case.labels, name=name)


def _make_step_case(batch: int, heads: int, gate: str, seed: int = 0) -> step_families.StepCase:
    """GDN with grouped key heads (two value heads per key head) where the head count allows, as Qwen3-Next."""
    hk = heads // 2 if gate == "gdn" and heads % 2 == 0 else None
    return step_families.make_step_case(batch, heads, gate, seed=seed, num_k_heads=hk)


OPS = {
    "flush": Op("flush", families.make_case, lambda case, backend: case.run(backend=backend), _judge_flush,
                families.FAMILIES,
                lambda gate: [torch.int8, torch.float32, torch.float32, torch.float16, torch.float16]),
    "step": Op("step", _make_step_case, lambda case, backend: case.run(backend=backend),
               lambda case, out, name: case.judge(out, name=name), step_families.STEP_FAMILIES,
               lambda gate: [dt for _, dt in criterion.STEP_OUTPUTS[gate]]),
}


# ---- the functional form: every family, random geometries ------------------------------------------------------
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_every_family(op, backend, gate):
    """Every input family at least once (3 x 8 heads; head h of row b from family (8 b + h + seed) mod count)."""
    served(backend, 8, gate, op=op)
    o = OPS[op]
    case = o.make_case(3, 8, gate, seed=3).to(DEVICE)
    assert set(o.families) <= {lab for row in case.labels for lab in row}
    out = o.run(case, backend)
    v = o.judge(case, out, backend)
    assert v.passed, v.message
    assert [x.dtype for x in out] == o.dtypes(gate)


@pytest.mark.parametrize("family", ["zero", "scaled_zero"])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_state_decodes_to_exactly_zero(backend, gate, family):
    """An exactly zero state (an empty checkpoint, or zero codes and tokens under positive scales with w = 0)
    must decode to exactly zero: the criterion's cap there is 0."""
    served(backend, 8, gate)
    case = families.make_case(1, 8, gate, seed=11, families=[family]).to(DEVICE)
    out = case.run(backend=backend)
    assert float(reference.decode_checkpoint(*[x.cpu() for x in out]).abs().max()) == 0.0


@pytest.fixture(params=[(backend, op) for op in OPS for backend in BACKENDS], ids="-".join, scope="module")
def serving_op(request) -> tuple[str, str]:
    """(backend, op): a backend that serves the op for some geometry here (:func:`serves_some_geometry`)."""
    serves_some_geometry(*request.param)
    return request.param


@given(gate=st.sampled_from(["kda", "gdn"]), seed=st.integers(0, 2**16), batch=st.integers(1, 2),
       heads=st.sampled_from([2, 5, 8, 12, 16]))
def test_random_geometries(serving_op, gate, seed, batch, heads):
    """Random batch, heads, gate and seed (families cycle over the heads), against the reference, for every op."""
    backend, op = serving_op
    assume(served(backend, heads, gate, skip=False, op=op))
    o = OPS[op]
    case = o.make_case(batch, heads, gate, seed=seed).to(DEVICE)
    v = o.judge(case, o.run(case, backend), backend)
    assert v.passed, v.message


# ---- the deployment form on a caller's pool ---------------------------------------------------------------------------
def _heads_for(backend: str) -> int:
    return 8 if backend == "tilelang" else 3


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_poisoned_pool_footprint(backend, gate):
    """Due checkpoints poisoned (0x7f codes, zero scales and tokens: finite, they are the input too) are all
    rewritten and pass the criterion; non-due programs with NaN scales neither change nor leak; slot 0, rows not in
    idx, spare regions, bytes past each checkpoint and hcnt stay bitwise untouched; the due windows are reset."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    pool, idx = noisy_pool(gate, heads, 5, DEVICE)
    slots, hs = written_programs(pool, idx)
    s, h = slots.to(DEVICE), hs.to(DEVICE)
    poison_due_checkpoints(pool, slots, hs)
    pool.s_k[4, 0] = float("nan")                             # due, but its row is not in idx
    pool.s_v[0, 0] = float("nan")                             # slot 0
    inputs = program_inputs(pool, slots, hs)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend=backend)
    assert_flush_footprint(pool, before, slots, hs)
    assert bool((pool.s_k[s, h] >= lq.EPS).all()) and bool((pool.s_v[s, h] >= lq.EPS).all())
    assert not bool((pool.codes[s, h] == POISON_CODE).all(dim=-1).all(dim=-1).any())
    v = judge_programs(pool, slots, hs, inputs, lq.default_q0(DEVICE), backend)
    assert v.passed, v.message


@given(gate=st.sampled_from(["kda", "gdn"]), seed=st.integers(0, 2**16))
def test_footprint_random(serving_backend, gate, seed):
    """Random pools (noise everywhere, family data in some slots, a random mix of due programs)."""
    backend = serving_backend
    heads = _heads_for(backend)
    assume(served(backend, heads, gate, skip=False))
    pool, idx = noisy_pool(gate, heads, seed, DEVICE)
    slots, hs = written_programs(pool, idx)
    inputs = program_inputs(pool, slots, hs)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend=backend)
    assert_flush_footprint(pool, before, slots, hs)
    v = judge_programs(pool, slots, hs, inputs, lq.default_q0(DEVICE), backend)
    assert v.passed, v.message


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_a_sequence_change_nothing(backend, gate):
    """idx of only padding (0, -1, any negative) and, through the backend's own call (as under graph capture,
    where nothing checks values), slots >= num_slots: nothing moves."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    pool, _ = noisy_pool(gate, heads, 9, DEVICE)
    pool.hcnt.fill_(L)
    before = snapshot(pool)
    q0 = lq.default_q0(DEVICE)
    lq.flush_inplace(pool, torch.tensor([0, -1, 0, -7], dtype=torch.int32, device=DEVICE), q0, backend=backend)
    bad = torch.tensor([0, -1, pool.num_slots, pool.num_slots + 100, -(2**31)], dtype=torch.int32, device=DEVICE)
    dispatch.get_backend(backend).flush(pool, bad, q0)
    none = torch.zeros(0, dtype=torch.long)
    assert_flush_footprint(pool, before, none, none)


# ---- the empty window: a flush with nothing to fold leaves its program alone --------------------------------------
# (the definition: leapquant.reference.empty_window; every backend implements it, each kernel on values it loads
# anyway)
def _same_bytes(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> list[str]:
    """The buffers (of :func:`snapshot`) whose bytes differ."""
    return [name for name in before if not torch.equal(after[name], before[name])]


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_second_flush_changes_nothing(backend, gate):
    """A flush empties the windows it folds (hcnt stays L: still due); a second call with no step in between finds
    them empty and leaves the whole pool bitwise as the first call left it."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    pool, idx = noisy_pool(gate, heads, 13, DEVICE)
    q0 = lq.default_q0(DEVICE)
    slots, hs = written_programs(pool, idx)
    assert len(slots) > 0
    lq.flush_inplace(pool, idx, q0, backend=backend)
    assert len(written_programs(pool, idx)[0]) == 0, "the first flush left a window that is not empty"
    first = snapshot(pool)
    lq.flush_inplace(pool, idx, q0, backend=backend)
    assert not _same_bytes(snapshot(pool), first), f"the second flush changed {_same_bytes(snapshot(pool), first)}"


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_flushes_keep_the_error(backend, gate):
    """20 flushes with no step in between: the decoded state's error against the exact fp64 state stays what the
    first flush left (per head, bitwise), on every family."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    case = families.make_case(2, heads, gate, seed=21)
    pool = Pool(3, heads, device=DEVICE, gate=gate)
    case.to(DEVICE).load_into(pool, [1, 2])
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    q0 = lq.default_q0(DEVICE)
    exact = case.exact()

    def error() -> torch.Tensor:
        dec = pool.decode([1, 2], with_window=False).double().cpu()
        return (dec - exact).abs().mean(dim=(-1, -2))

    lq.flush_inplace(pool, idx, q0, backend=backend)
    err1, ck1 = error(), [t.cpu() for t in pool.read_checkpoint([1, 2])]
    for _ in range(19):
        lq.flush_inplace(pool, idx, q0, backend=backend)
    assert torch.equal(error(), err1), f"error after 20 flushes {error().max():.3g} vs {err1.max():.3g} after one"
    assert all(torch.equal(a.cpu(), b) for a, b in zip(pool.read_checkpoint([1, 2]), ck1))


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decay_only_window_is_flushed(backend, gate):
    """A window without weights whose gate still decays the checkpoint (KDA: one pcum channel at -0.25; GDN: p =
    exp(-2); helpers.DECAY_ONLY_*) is not empty: it is flushed to the decayed state (judged by the criterion) and
    reset, as the reference decides; the same window without the decay (-0.0 weights and pcum included) is left
    bitwise alone."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    pool, idx = noisy_pool(gate, heads, 17, DEVICE)
    due_s, due_h = (t.cpu() for t in reference_pool.due_programs(pool, idx))
    decay, empty = torch.arange(len(due_s)) % 2 == 0, torch.arange(len(due_s)) % 2 == 1
    empty_windows(pool, due_s[decay], due_h[decay], decay=True)
    empty_windows(pool, due_s[empty], due_h[empty])
    slots, hs = written_programs(pool, idx)
    assert torch.equal(slots, due_s[decay]) and torch.equal(hs, due_h[decay]), "the reference's criterion"
    inputs = program_inputs(pool, slots, hs)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend=backend)
    assert_flush_footprint(pool, before, slots, hs)
    v = judge_programs(pool, slots, hs, inputs, lq.default_q0(DEVICE), backend)
    assert v.passed, v.message


@given(gate=st.sampled_from(["kda", "gdn"]), seed=st.integers(0, 2**16))
def test_mixed_empty_and_full_windows(serving_backend, gate, seed):
    """One call, due programs of three kinds (helpers.mixed_windows): empty windows (left bitwise alone), windows
    that only decay and windows that hold entries (both rewritten, judged by the criterion, reset); programs not due,
    slot 0 and rows not in idx untouched: the footprint is exact."""
    backend = serving_backend
    heads = _heads_for(backend)
    assume(served(backend, heads, gate, skip=False))
    pool, idx = noisy_pool(gate, heads, seed, DEVICE)
    mixed_windows(pool, idx, seed)
    slots, hs = written_programs(pool, idx)
    inputs = program_inputs(pool, slots, hs)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend=backend)
    assert_flush_footprint(pool, before, slots, hs)
    if len(slots):
        v = judge_programs(pool, slots, hs, inputs, lq.default_q0(DEVICE), backend)
        assert v.passed, v.message


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")     # (the interpreter's reductions)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_weight_is_not_empty(backend, gate):
    """A NaN weight (outside the domain, but a kernel must not read it as zero) makes a window not empty: the program
    is flushed and its window reset, whatever its checkpoint becomes; everything outside it stays untouched."""
    heads = _heads_for(backend)
    served(backend, heads, gate)
    pool, idx = noisy_pool(gate, heads, 19, DEVICE)
    due_s, due_h = (t.cpu() for t in reference_pool.due_programs(pool, idx))
    empty_windows(pool, due_s, due_h)
    pool.w[int(due_s[0]), int(due_h[0]), 5] = float("nan")
    slots, hs = written_programs(pool, idx)
    assert len(slots) == 1
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, lq.default_q0(DEVICE), backend=backend)
    assert_flush_footprint(pool, before, slots, hs, finite=False)


# ---- GPU: deployment sizes, graphs, launches ------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [16, 64, 256, 512])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_gpu_deployment_sizes(backend, gate, batch):
    """Every family at batch x 32 heads (16 distinct rows of families tiled to the batch), judged on the GPU."""
    served(backend, 32, gate)
    data = _check_data(gate)
    t, exact, ref, labels = data.batch(batch)
    args = [t[n] for n in ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf")]
    if gate == "kda":
        out = lq.run(*args, t["gbuf"], t["w"], t["pcum"], data.q0, backend=backend)
    else:
        out = lq.run_gdn(*args, t["w"], t["p"], data.q0, backend=backend)
    v = criterion.judge(exact, list(out), list(ref), labels=labels, name=backend)
    assert v.passed, f"batch {batch} {gate}: {v.message}"


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend,kernel", [("triton", "mma"), ("triton", "tl"), ("tilelang", None)])
def test_gpu_empty_windows(backend, kernel, gate, monkeypatch):
    """Batch 32 x 32 heads of every family in a noisy pool, 2/3 of them due, the due ones of three kinds
    (helpers.mixed_windows: empty, decay only, entries), idx shuffled with padding rows and a due slot left out: one
    call writes exactly the programs the reference decides (footprint exact, the criterion on them), and a second
    call leaves the whole pool bitwise as the first left it. ``kernel``: the Triton backend's Gluon ("mma") or tl
    kernel (LEAPQUANT_TRITON_KERNEL, read when the new pool is first flushed)."""
    from helpers import fill_noise
    if kernel is not None:
        from leapquant.triton import launch
        if kernel == "mma" and launch.mma_reasons(DEVICE):
            pytest.skip("; ".join(launch.mma_reasons(DEVICE)))
        monkeypatch.setenv(launch.KERNEL_ENV, kernel)
    served(backend, 32, gate)
    batch, heads = 32, 32
    pool = Pool(batch + 3, heads, device=DEVICE, gate=gate)
    fill_noise(pool, seed=31)
    slots = torch.arange(2, batch + 2)
    families.make_case(batch, heads, gate, seed=31).to(DEVICE).load_into(pool, slots)
    g = torch.Generator().manual_seed(31)
    pool.hcnt[slots] = torch.where(torch.rand(batch, heads, generator=g) < 2 / 3, L, L - 1).to(DEVICE, torch.int32)
    pool.hcnt[0] = L
    pool.hcnt[batch + 2] = L                                    # due, but its row is not in idx
    rows = slots[torch.randperm(batch, generator=g)]
    idx = torch.cat([torch.tensor([-1]), rows[:batch // 2], torch.tensor([0]), rows[batch // 2:]])
    idx = idx.to(DEVICE, torch.int32)
    mixed_windows(pool, idx, seed=31)
    s, h = written_programs(pool, idx)
    due = len(reference_pool.due_programs(pool, idx)[0])
    assert 0 < len(s) < due, (len(s), due)
    inputs = program_inputs(pool, s, h)
    q0 = lq.default_q0(DEVICE)
    before = snapshot(pool)
    lq.flush_inplace(pool, idx, q0, backend=backend)
    torch.cuda.synchronize()
    assert_flush_footprint(pool, before, s, h)
    v = judge_programs(pool, s, h, inputs, q0, f"{backend} {kernel or ''}")
    assert v.passed, v.message
    first = snapshot(pool)
    lq.flush_inplace(pool, idx, q0, backend=backend)
    torch.cuda.synchronize()
    changed = _same_bytes(snapshot(pool), first)
    assert not changed, f"the second flush changed {changed}"


_CHECK: dict = {}


def _check_data(gate: str):
    from leapquant.bench import CheckData
    if gate not in _CHECK:
        _CHECK[gate] = CheckData(gate, 32, 16, 0, DEVICE)
    return _CHECK[gate]


@gpu
@needs_cuda
@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_gpu_other_head_counts(backend, gate, heads):
    """Tensor parallelism leaves 16 or 8 heads per GPU: 40 rows of every family."""
    served(backend, heads, gate)
    case = families.make_case(40, heads, gate, seed=heads).to(DEVICE)
    v = _judge_flush(case, case.run(backend=backend), backend)
    assert v.passed, v.message


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_gpu_graph_replay(backend, gate):
    """Captured once, replayed with different due sets (tests/helpers.check_graph_replay)."""
    served(backend, 32, gate)
    check_graph_replay(backend, gate, 32, DEVICE)


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_gpu_nothing_due_is_one_launch(backend, gate):
    """A call with nothing due launches one kernel (its programs rank the flags themselves and exit)."""
    served(backend, 32, gate)
    names = nothing_due_launches(backend, gate, 32, DEVICE)
    assert len(names) == 1, f"nothing due launched {len(names)} kernels: {names}"
