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
from leapquant import criterion, dispatch, families, reference, step_families
from leapquant.layout import L, Pool
from helpers import (POISON_CODE, assert_flush_footprint, check_graph_replay, due_programs, judge_programs,
                     noisy_pool, nothing_due_launches, poison_due_checkpoints, program_inputs, snapshot)

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


@pytest.fixture(params=BACKENDS, scope="module")
def serving_backend(request) -> str:
    """A backend that serves some geometry here (8 heads, both gates); skipped with its reasons otherwise (before
    hypothesis draws anything: its examples would all be filtered out)."""
    name = request.param
    if not (served(name, 8, "kda", skip=False) or served(name, 8, "gdn", skip=False)):
        served(name, 8, "kda")
    return name


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


@given(gate=st.sampled_from(["kda", "gdn"]), seed=st.integers(0, 2**16), batch=st.integers(1, 2),
       heads=st.sampled_from([2, 5, 8, 12, 16]))
def test_random_geometries(serving_backend, gate, seed, batch, heads):
    """Random batch, heads, gate and seed (families cycle over the heads), against the reference."""
    backend = serving_backend
    assume(served(backend, heads, gate, skip=False))
    case = families.make_case(batch, heads, gate, seed=seed).to(DEVICE)
    v = _judge_flush(case, case.run(backend=backend), backend)
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
    slots, hs = due_programs(pool, idx)
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
    slots, hs = due_programs(pool, idx)
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
