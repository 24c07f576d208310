"""What an engine holds and passes, beyond the format itself: model parameters that require grad, pools allocated
under ``torch.inference_mode``, device spellings, and buffers the engine creates. The pool never joins an autograd
graph, a pool made under inference mode is served outside it as inside, and what cannot be served is a ValueError
before anything is written."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import leapquant as lq
from leapquant import api, dispatch, families, step_families as sf
from leapquant.layout import K, L, V
from helpers import snapshot

H, N = 4, 2
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
#: the backends that step on this machine (the reference everywhere; Triton's kernels on a GPU, its portable kernel
#: through the interpreter on a CPU)
STEP_BACKENDS = [b for b in ("reference", "triton")
                 if not dispatch.reasons(b, lq.Pool(2, H, device=DEVICE), op="step")]


def _token(gate: str, requires_grad: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    A_log, dt_bias = sf.head_constants(H, gate, g)
    return dict(idx=torch.tensor([1, -1], dtype=torch.int32, device=DEVICE),
                qkv=torch.randn(N, 2 * H * K + H * V, generator=g).bfloat16().to(DEVICE),
                a=torch.randn((N, H, K) if gate == "kda" else (N, H), generator=g).bfloat16().to(DEVICE),
                b=torch.randn(N, H, generator=g).bfloat16().to(DEVICE),
                A_log=torch.nn.Parameter(A_log.to(DEVICE), requires_grad=requires_grad),
                dt_bias=torch.nn.Parameter(dt_bias.to(DEVICE), requires_grad=requires_grad))


def _pool(gate: str) -> lq.Pool:
    pool = lq.Pool(3, H, gate=gate, device=DEVICE)
    pool.encode([1, 2], torch.randn(2, H, V, K, generator=torch.Generator().manual_seed(1)))
    return pool


def _tracked(pool: lq.Pool) -> list[str]:
    """The pool's buffers (and views) that are part of an autograd graph."""
    names = ["raw", "codes", "s_k", "s_v", "tokens", *pool.WINDOW_FIELDS[pool.gate]]
    return [n for n in names if getattr(pool, n).requires_grad or getattr(pool, n).grad_fn is not None]


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_parameters_that_require_grad_leave_the_pool_out_of_autograd(gate, backend):
    """A_log and dt_bias as a model holds them (nn.Parameter, requiring grad): 20 decode tokens give the same bytes
    and outputs as plain tensors, the output does not require grad and no pool buffer joins a graph."""
    outs = {}
    for grad in (False, True):
        pool, t = _pool(gate), _token(gate, requires_grad=grad)
        q0 = lq.default_q0(DEVICE)
        for _ in range(L + 4):
            o = lq.decode_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], q0,
                                  backend=backend)
        assert not o.requires_grad and o.grad_fn is None
        assert not _tracked(pool), f"pool buffers in an autograd graph: {_tracked(pool)}"
        outs[grad] = (o, snapshot(pool))
    assert torch.equal(outs[False][0], outs[True][0])
    for name, before in outs[False][1].items():
        assert torch.equal(before, outs[True][1][name]), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_helpers_given_tensors_that_require_grad_leave_the_pool_out_of_autograd(gate):
    """encode / write_checkpoint / write_window with inputs that require grad (a state from a differentiable
    prefill, say) store values, not a graph."""
    pool = lq.Pool(3, H, gate=gate)
    state = torch.randn(1, H, V, K, requires_grad=True)
    pool.encode([1], state * 1.0)
    case = families.make_case(1, H, gate, seed=2)
    t = {k: (v.float().requires_grad_() if v.is_floating_point() and v.dtype == torch.float32 else v)
         for k, v in case.tensors.items()}
    pool.write_checkpoint([2], t["codes"], t["s_k"], t["s_v"], t["u"], t["q"])
    pool.write_window([2], t["kbuf"], t["ubuf"], t["w"], t["pcum"] if gate == "kda" else t["p"], t.get("gbuf"))
    assert not _tracked(pool), f"pool buffers in an autograd graph: {_tracked(pool)}"


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_a_pool_made_under_inference_mode_is_served_outside_it(gate, backend):
    """An engine allocates its pool under torch.inference_mode and may call outside it (or the other way round):
    every public call works either way and writes the same bytes."""
    results = []
    for made_inside in (False, True):
        with torch.inference_mode(made_inside):
            pool = _pool(gate)
        t = _token(gate)
        pool.reset_slots([2])
        pool.copy_slots([1], [2])
        o = lq.decode_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"],
                              lq.default_q0(DEVICE), backend=backend)
        with torch.inference_mode(made_inside):         # (the test's own write: inference tensors need the mode)
            pool.hcnt[1] = L
        lq.flush_inplace(pool, torch.tensor([1, 2], dtype=torch.int32, device=DEVICE), lq.default_q0(DEVICE),
                         backend=backend)
        results.append((o, snapshot(pool)))
    assert torch.equal(results[0][0], results[1][0])
    for name, before in results[0][1].items():
        assert torch.equal(before, results[1][1][name]), name


@pytest.mark.parametrize("spelling", ["cpu", "cpu:0", torch.device("cpu", 0)])
def test_device_spellings_name_one_device(spelling):
    """``cpu:0`` is the CPU: the pool's buffers and the device it checks its calls against agree."""
    pool = lq.Pool(2, 1, device=spelling)
    assert pool.device == torch.device("cpu") and pool.raw.device == pool.device
    lq.flush_inplace(pool, torch.tensor([1], dtype=torch.int32), lq.default_q0())


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="no-such-device"), "device: "),
    (dict(raw=[0.0]), "raw: expected a torch.Tensor"),
])
def test_pools_that_cannot_exist_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lq.Pool(2, 1, **kwargs)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_functional_forms_take_an_empty_batch(gate):
    """B = 0 (an engine's batch split that left nothing) gives empty outputs of the shapes and dtypes a batch would
    have, as flush_inplace and step_inplace do nothing for no rows."""
    flush = lq.run if gate == "kda" else lq.run_gdn
    *batched, q0 = families.make_case(1, 2, gate, seed=0).args()
    full, empty = flush(*batched, q0), flush(*(t[:0] for t in batched), q0)
    assert [(t.shape[1:], t.dtype) for t in empty] == [(t.shape[1:], t.dtype) for t in full]
    assert all(t.shape[0] == 0 for t in empty)
    step = lq.step if gate == "kda" else lq.step_gdn
    *batched, A_log, dt_bias = sf.make_step_case(1, 2, gate, seed=0, num_k_heads=2 if gate == "kda" else 1).args()
    full, empty = step(*batched, A_log, dt_bias), step(*(t[:0] for t in batched), A_log, dt_bias)
    assert [(t.shape[1:], t.dtype) for t in empty] == [(t.shape[1:], t.dtype) for t in full]
    assert all(t.shape[0] == 0 for t in empty)


def test_a_pool_takes_its_device_from_any_buffer_given():
    """device=None: the device of the first buffer given (raw's where given), a window buffer's where only those are
    given: one on the meta device is named as such, not as a mismatch with the CPU."""
    kbuf = torch.zeros(2, 1, L, K, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="device: .*meta"):
        lq.Pool(2, 1, kbuf=kbuf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_window_buffers_alone_place_the_pool_on_their_gpu(gate):
    hcnt = torch.zeros(3, 2, dtype=torch.int32, device="cuda")
    pool = lq.Pool(3, 2, gate=gate, hcnt=hcnt)
    assert pool.device == hcnt.device and pool.raw.device == hcnt.device and pool.hcnt is hcnt


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_pool_without_cuda_is_refused():
    with pytest.raises(ValueError, match="device: .cuda. cannot hold the pool.s tensors"):
        lq.Pool(2, 1, device="cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:99", "meta", "hpu"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_devices_this_machine_lacks_are_refused_by_the_info_helpers(device):
    """The helpers an engine calls before it has a pool name a device this machine lacks, or one leapquant does not
    run on, with a ValueError (torch's own errors for it are RuntimeError, AssertionError, TypeError or ImportError,
    depending on the device and the build)."""
    with pytest.raises(ValueError, match="device: "):
        lq.device_description(device)
    with pytest.raises(ValueError, match="device: .* (cannot hold|holds no data)"):
        lq.default_q0(device)


def test_slots_on_the_meta_device_are_refused():
    pool = lq.Pool(3, 1)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="meta device"):
        pool.reset_slots(torch.ones(1, dtype=torch.long, device="meta"))
    assert all(torch.equal(v, snapshot(pool)[k]) for k, v in before.items())


def test_the_callers_default_device_does_not_move_the_helpers():
    """Engines build a model's layers under a default device (vLLM's loader: ``with torch.device(target)``; meta
    stands in for another device here): the device a helper is given, or the pool's, is where it works. default_q0
    made its Gaussian on the default device (on a GPU host: torch's error for a CPU generator there), the slot helpers
    their slot tensor (on meta: NotImplementedError)."""
    np = pytest.importorskip("numpy")
    pool = lq.Pool(3, 1)
    with torch.device("meta"):
        q0 = lq.default_q0("cpu")
        pool.reset_slots([1])
        pool.reset_slots(np.array([2]))
        pool.encode([1], torch.ones(1, 1, V, K, device="cpu"))
        pool.copy_slots([1], [2])
        state = pool.decode([2])
    assert torch.equal(q0, lq.default_q0("cpu")) and state.device.type == "cpu"
    assert torch.allclose(state, torch.ones(1, 1, V, K), atol=1e-2)


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_a_nan_gate_reaches_the_output(gate, backend):
    """Values are not checked on the hot path (that would read them on the host), so a NaN in a caller's gate
    pre-activation is the caller's to see: every backend carries it into that head's output and gate state as NaN,
    as the reference's formula does, rather than turning it into a finite gate that silently wipes the state. The
    other heads stay finite."""
    pool, t = _pool(gate), _token(gate)
    if gate == "kda":
        t["a"][0, 0, 5] = float("nan")
    else:
        t["a"][0, 0] = float("nan")
    out = lq.step_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], backend=backend)
    assert bool(out[0, 0].float().isnan().all()), "the head with the NaN gate"
    assert bool(out[0, 1:].float().isfinite().all()) and not bool(out[1].any()), "the other heads, the padding row"
    gate_state = pool.pcum[1, 0, 5] if gate == "kda" else pool.p[1, 0]
    assert bool(gate_state.isnan()), "the gate state of the head with the NaN gate"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "tilelang"])
def test_a_pool_on_another_gpu_is_served_there(backend):
    """Kernels launch on the current device: a pool on cuda:1 called from cuda:0 gets the same bytes as the same
    pool on cuda:0 (decode_inplace for Triton; the flush for TileLang, which has no step)."""
    heads = 8
    why = dispatch.reasons(backend, lq.Pool(3, heads, device="cuda:1"))
    if why:
        pytest.skip(f"{backend} cannot serve here: {'; '.join(why)}")
    case = families.make_case(2, heads, "kda", seed=3)
    results = []
    for dev in ("cuda:0", "cuda:1"):
        pool = lq.Pool(3, heads, device=dev)
        case.load_into(pool, [1, 2])
        idx = torch.tensor([1, 2], dtype=torch.int32, device=dev)
        with torch.cuda.device(0):
            if backend == "triton":
                g = torch.Generator().manual_seed(4)
                A_log, dt_bias = sf.head_constants(heads, "kda", g)
                qkv = torch.randn(2, 2 * heads * K + heads * V, generator=g).bfloat16()
                a, b = torch.randn(2, heads, K, generator=g).bfloat16(), torch.randn(2, heads, generator=g).bfloat16()
                pool.hcnt[1:3] = L - 1                     # the step fills every window: the flush folds them
                lq.decode_inplace(pool, idx, qkv.to(dev), a.to(dev), b.to(dev), A_log.to(dev), dt_bias.to(dev),
                                  lq.default_q0(dev), backend=backend)
            else:
                lq.flush_inplace(pool, idx, lq.default_q0(dev), backend=backend)
            assert torch.cuda.current_device() == 0, "the call left another device current"
            torch.cuda.synchronize(dev)
        results.append(snapshot(pool))
    for name, first in results[0].items():
        assert torch.equal(first.cpu(), results[1][name].cpu()), name


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_functional_forms_inside_and_outside_inference_mode(gate, backend):
    """The functional forms keep a scratch pool per geometry: one first made under inference mode serves later calls
    outside it (and the other way round), with the same results."""
    api._SCRATCH.pools = {}                             # (the scratch pools: made afresh, inside the mode first)
    step_case = sf.make_step_case(2, H, gate, seed=5).to(DEVICE)
    flush_case = families.make_case(2, H, gate, seed=5).to(DEVICE)
    results = []
    for inside in (True, False, True):
        with torch.inference_mode(inside):
            results.append((step_case.run(backend=backend), flush_case.run(backend=backend)))
    for later in results[1:]:
        for a, b in zip(results[0][0] + results[0][1], later[0] + later[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_raw_carved_out_of_a_larger_buffer(gate, backend):
    """An engine may hand the pool a raw that is a view into its own larger allocation (several layers' states in one
    buffer), at any 16-byte-aligned offset: the pool's views, the helpers and the kernels address that view, the
    results equal those of a pool of its own, and nothing outside the view changes."""
    words = lq.layout.raw_words(3, H)
    lead = 20                                            # words before the view: 80 bytes, 16-byte aligned
    arena = torch.full((lead + words + 12,), 7.0, device=DEVICE)
    arena[lead:lead + words] = lq.Pool(3, H, gate=gate, device=DEVICE).raw       # as a new pool's raw
    results = []
    for raw in (None, arena[lead:lead + words]):
        pool = lq.Pool(3, H, gate=gate, device=DEVICE, **({} if raw is None else {"raw": raw}))
        pool.encode([1, 2], torch.randn(2, H, V, K, generator=torch.Generator().manual_seed(1)))
        t = _token(gate)
        for _ in range(L):
            o = lq.decode_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"],
                                  lq.default_q0(DEVICE), backend=backend)
        results.append((o, pool.read_checkpoint([1, 2]), snapshot(pool)))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
    for name, first in results[0][2].items():
        assert torch.equal(first, results[1][2][name]), name
    assert bool((arena[:lead] == 7.0).all()) and bool((arena[lead + words:] == 7.0).all()), "bytes outside the view"


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_pool_buffers_that_share_memory_are_refused(gate):
    """An engine's buffers for one pool must not share bytes (kbuf and ubuf have the same shape and dtype; one
    tensor passed as both would take the step's u_new over its kn): a ValueError naming both, at construction and,
    for a buffer swapped in later, at the next call, before anything is written."""
    NS = 3
    kb = torch.zeros(NS, H, L, K, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"^ubuf: shares memory with kbuf"):
        lq.Pool(NS, H, gate=gate, device=DEVICE, kbuf=kb, ubuf=kb)
    raw = torch.zeros(lq.layout.raw_words(NS, H), device=DEVICE)
    w_in_raw = raw[: NS * H * L].view(NS, H, L)                   # the weights inside the checkpoints' words
    with pytest.raises(ValueError, match=r"^w: shares memory with raw"):
        lq.Pool(NS, H, gate=gate, device=DEVICE, raw=raw, w=w_in_raw)
    pool = _pool(gate)
    before = snapshot(pool)
    pool.ubuf = pool.kbuf                                         # swapped after construction
    t = _token(gate)
    with pytest.raises(ValueError, match=r"pool\.ubuf: shares memory with pool\.kbuf"):
        lq.step_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"])
    pool.ubuf = before["ubuf"].clone()
    assert all(torch.equal(before[n], x) for n, x in snapshot(pool).items())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_pool_buffers_off_a_16_byte_boundary_are_refused(gate):
    """The GPU kernels copy a pool's buffers in 16-byte pieces (the Gluon flush does not build for kbuf, ubuf or gbuf
    pointers without that alignment): an engine's buffer placed one element into its own allocation is a ValueError
    naming it, at construction and, swapped in later, at the next call (before anything is written) on every
    backend."""
    NS = 3
    for name in ("raw", *lq.Pool.WINDOW_FIELDS[gate]):
        if name in lq.layout.LOOSE_ALIGNMENT:
            continue
        f = lq.layout.FIELDS.get(name)
        shape, dtype = ((lq.layout.raw_words(NS, H),), torch.float32) if name == "raw" else ((NS, H) + f.shape, f.dtype)
        arena = torch.zeros(1 + torch.Size(shape).numel(), dtype=dtype, device=DEVICE)
        cut = arena[1:].view(shape)                                # one element past an aligned start
        assert cut.data_ptr() % lq.layout.ALIGN_BYTES
        with pytest.raises(ValueError, match=f"{name}: expected a start on a 16-byte boundary"):
            lq.Pool(NS, H, gate=gate, device=DEVICE, **{name: cut})
    pool = _pool(gate)
    before = snapshot(pool)
    kept = pool.kbuf
    pool.kbuf = torch.zeros(kept.numel() + 1, dtype=kept.dtype, device=DEVICE)[1:].view(kept.shape)
    t = _token(gate)
    for backend in STEP_BACKENDS:
        with pytest.raises(ValueError, match="pool.kbuf: expected a start on a 16-byte boundary"):
            lq.step_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], backend=backend)
    pool.kbuf = kept
    assert all(torch.equal(before[n], x) for n, x in snapshot(pool).items())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_fill_counts_stacked_per_layer(gate):
    """hcnt (and GDN's p) hold 4 bytes per (slot, head): an engine stacking them per layer ([layers, NS, H]) puts
    layer 1's view off a 16-byte boundary when NS * H % 4 != 0. Such a pool is accepted and decodes as a pool of
    fresh buffers does on every step backend; TileLang says it cannot serve it, and the dispatch's remembered choice
    tells the two pools apart."""
    NS, heads = 3, 2                                          # NS * H = 6: layer 1 starts 24 bytes in
    fields = [n for n in lq.layout.LOOSE_ALIGNMENT if n in lq.Pool.WINDOW_FIELDS[gate]]

    def layer1() -> dict[str, torch.Tensor]:
        """Layer 1's views of fresh [2, NS, H] stacks of the 4-byte fields."""
        return {n: torch.full((2, NS, heads), lq.layout.FIELDS[n].empty, dtype=lq.layout.FIELDS[n].dtype,
                              device=DEVICE)[1] for n in fields}
    assert all(t.data_ptr() % lq.layout.ALIGN_BYTES for t in layer1().values())
    g = torch.Generator().manual_seed(3)
    A_log, dt_bias = sf.head_constants(heads, gate, g)
    state = torch.randn(NS - 1, heads, V, K, generator=g)
    idx = torch.tensor([2, -1, 1], dtype=torch.int32, device=DEVICE)
    qkv = [torch.randn(3, 2 * heads * K + heads * V, generator=g).bfloat16().to(DEVICE) for _ in range(L + 2)]
    a = [torch.randn((3, heads, K) if gate == "kda" else (3, heads), generator=g).bfloat16().to(DEVICE)
         for _ in range(L + 2)]
    b = [torch.randn(3, heads, generator=g).bfloat16().to(DEVICE) for _ in range(L + 2)]
    q0 = lq.default_q0(DEVICE)
    for backend in STEP_BACKENDS:
        results = []
        for buffers in ({}, layer1()):
            pool = lq.Pool(NS, heads, gate=gate, device=DEVICE, **buffers)
            pool.encode([1, 2], state)
            outs = [lq.decode_inplace(pool, idx, qkv[t], a[t], b[t], A_log.to(DEVICE), dt_bias.to(DEVICE), q0,
                                      backend=backend).clone() for t in range(L + 2)]
            results.append((outs, snapshot(pool)))
        for o1, o2 in zip(results[0][0], results[1][0]):
            assert torch.equal(o1, o2), backend
        for name, first in results[0][1].items():
            assert torch.equal(first, results[1][1][name]), (backend, name)
    tl = dispatch.get_backend("tilelang")
    if tl is not None:
        shifted = lq.Pool(NS, 8, gate=gate, device=DEVICE,
                          **{n: torch.ones(2 * NS * 8 + 1, dtype=lq.layout.FIELDS[n].dtype,
                                           device=DEVICE)[1:NS * 8 + 1].view(NS, 8) for n in fields})
        assert any("16-byte aligned" in w for w in tl.reasons(shifted)), tl.reasons(shifted)


def test_the_remembered_choice_tells_loose_alignments_apart(monkeypatch):
    """Two pools of one geometry, one with its fill counts off a 16-byte boundary: a backend that refuses the second
    is not chosen for it from the first pool's answer, and forcing it raises."""
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    NS = 3
    aligned = lq.Pool(NS, H, device=DEVICE)
    arena = torch.zeros(NS * H + 1, dtype=torch.int32, device=DEVICE)
    shifted = lq.Pool(NS, H, device=DEVICE, hcnt=arena[1:].view(NS, H))

    def aligned_only(pool):
        return ["fill counts off the 16-byte boundary"] if any(pool.loose_alignment()) else []
    ref = dispatch.get_backend("reference")
    monkeypatch.setitem(dispatch._REGISTRY, "tilelang", dispatch.Backend("tilelang", flush=ref.flush,
                                                                          reasons=aligned_only))
    assert dispatch.select(aligned, 2, "tilelang").name == "tilelang"
    with pytest.raises(lq.BackendUnavailable, match="off the 16-byte boundary"):
        dispatch.select(shifted, 2, "tilelang")
    monkeypatch.setattr(dispatch, "auto_order", lambda pool, rows, op="flush": ["tilelang", "reference"])
    assert dispatch.select(aligned, 2).name == "tilelang"
    assert dispatch.select(shifted, 2).name == "reference"


def test_functional_forms_from_two_threads_at_once():
    """Two threads calling the functional flush with the same shapes and different inputs each get their own
    results (each thread has its own scratch pools), and a thread keeps at most ``api.SCRATCH_POOLS`` of them."""
    import threading
    cases = [families.make_case(2, H, "kda", seed=s) for s in (1, 2)]
    want = [lq.run(*c.args(), backend="reference") for c in cases]
    wrong = []

    def worker(i: int) -> None:
        for _ in range(12):
            got = lq.run(*cases[i].args(), backend="reference")
            if not all(torch.equal(x, y) for x, y in zip(got, want[i])):
                wrong.append(i)
    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} of 24 concurrent calls returned another thread's results"
    for B in (1, 3, 4):
        lq.run(*families.make_case(B, H, "kda", seed=0).args(), backend="reference")
    assert len(api._SCRATCH.pools) == api.SCRATCH_POOLS


@pytest.mark.interpreter
def test_functional_forms_from_two_threads_under_the_interpreter():
    """The Triton backend through its interpreter (the CPU tier) from two threads at once: the interpreter patches
    module state while it runs a kernel, and the launcher runs one interpreted launch at a time."""
    import threading
    from leapquant.triton.tl_kernel import INTERPRETED
    if not INTERPRETED or torch.cuda.is_available():
        pytest.skip("the interpreter serves the Triton backend only on a CPU with TRITON_INTERPRET=1")
    cases = [families.make_case(1, 2, "kda", seed=s) for s in (1, 2)]
    want = [lq.run(*c.args(), backend="triton") for c in cases]
    errors = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                got = lq.run(*cases[i].args(), backend="triton")
                if not all(torch.equal(x, y) for x, y in zip(got, want[i])):
                    errors.append(f"thread {i}: another result")
        except Exception as e:                  # noqa: BLE001 (any failure of a thread is the finding)
            errors.append(f"thread {i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("backend", STEP_BACKENDS)
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_step_inputs_off_a_16_byte_boundary(gate, backend):
    """The per-call tensors may sit anywhere an engine's slicing leaves them: qkv one element into a projection's
    output (row stride not a multiple of 16 bytes), a, b and out one element into buffers of their own. The step
    gives the same bytes as with fresh tensors (the Triton kernels are specialised on their pointers' alignment at
    launch)."""
    t = _token(gate)
    W = t["qkv"].shape[1]
    results = []
    for shifted in (False, True):
        pool = _pool(gate)
        if shifted:
            proj = torch.zeros(N, W + 3, dtype=torch.bfloat16, device=DEVICE)
            proj[:, 1:1 + W] = t["qkv"]
            qkv = proj[:, 1:1 + W]
            a = torch.zeros(t["a"].numel() + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(t["a"].shape)
            a.copy_(t["a"])
            b = torch.zeros(t["b"].numel() + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(t["b"].shape)
            b.copy_(t["b"])
            out = torch.zeros(N * H * V + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(N, H, V)
            assert qkv.data_ptr() % 16 and out.data_ptr() % 16
        else:
            qkv, a, b, out = t["qkv"], t["a"], t["b"], None
        o = lq.step_inplace(pool, t["idx"], qkv, a, b, t["A_log"], t["dt_bias"], out, backend=backend)
        results.append((o.clone(), snapshot(pool)))
    assert torch.equal(results[0][0], results[1][0])
    for name, first in results[0][1].items():
        assert torch.equal(first, results[1][1][name]), name


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_q0_sharing_memory_with_the_pool_or_out_is_refused(gate):
    """The flush reads q0 while it rewrites checkpoints, and decode_inplace's step writes out before its flush reads
    q0: q0 inside the pool's memory, or out over q0, is a ValueError naming both, before anything is written."""
    pool, t = _pool(gate), _token(gate)
    before = snapshot(pool)
    idx = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    in_raw = pool.raw[: V * lq.R].view(V, lq.R)
    with pytest.raises(ValueError, match="q0: shares memory with pool.raw"):
        lq.flush_inplace(pool, idx, in_raw)
    arena = torch.zeros(N * H * V, dtype=torch.float32, device=DEVICE)
    q0 = arena[: V * lq.R].view(V, lq.R)
    q0.copy_(lq.default_q0(DEVICE))
    out = arena.view(torch.bfloat16)[: N * H * V].view(N, H, V)
    with pytest.raises(ValueError, match="out: shares memory with q0"):
        lq.decode_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], q0, out)
    assert torch.equal(q0, lq.default_q0(DEVICE))
    assert all(torch.equal(before[n], x) for n, x in snapshot(pool).items())


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("bad, match", [
    (lambda q: torch.ones_like(q), "q0: its columns must be independent"),
    (lambda q: q.clone().index_fill_(1, torch.tensor([2], device=q.device), 0.0), "q0: its columns' norms"),
    (lambda q: q.clone().fill_(float("nan")), "q0: values must be finite"),
])
def test_q0_values_are_checked_with_the_value_checks(gate, bad, match):
    """With check_idx (the host-synchronising checks) flush_inplace and decode_inplace check q0's values as run()
    and encode() do: a start matrix without R independent unit directions leaves the rank part to rounding noise,
    on which no two backends agree. Unchecked, the call reads no value of q0 on the host (the default path)."""
    pool, t = _pool(gate), _token(gate)
    pool.hcnt.fill_(lq.L)
    before = snapshot(pool)
    q0 = bad(lq.default_q0(DEVICE))
    with pytest.raises(ValueError, match=match):
        lq.flush_inplace(pool, t["idx"], q0, check_idx=True)
    with pytest.raises(ValueError, match=match):
        lq.decode_inplace(pool, t["idx"], t["qkv"], t["a"], t["b"], t["A_log"], t["dt_bias"], q0, check_idx=True)
    assert all(torch.equal(before[n], x) for n, x in snapshot(pool).items())


def test_pool_attributes_changed_after_a_call_are_checked_again():
    """A pool's geometry attributes are part of what a call checks: changed after a checked call (num_slots grown,
    an unknown gate), the next call is a ValueError, not an index error in a backend."""
    pool = lq.Pool(3, H, device=DEVICE)
    q0, idx = lq.default_q0(DEVICE), torch.tensor([1], dtype=torch.int32, device=DEVICE)
    lq.flush_inplace(pool, idx, q0)
    pool.num_slots = 100
    with pytest.raises(ValueError, match="pool.raw: expected shape"):
        lq.flush_inplace(pool, torch.tensor([50], dtype=torch.int32, device=DEVICE), q0)
    pool.num_slots, pool.gate = 3, "xyz"
    with pytest.raises(ValueError, match="pool.gate: expected one of"):
        lq.flush_inplace(pool, idx, q0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=3, num_heads=True), "num_heads: expected an int"),
    (dict(num_slots=True, num_heads=2), "num_slots: expected an int"),
    (dict(num_slots=2 ** 62, num_heads=2), "more than any device holds"),
    (dict(num_slots=3, num_heads=2, device="meta"), "holds no data"),
])
def test_pools_that_cannot_hold_data_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lq.Pool(**kwargs)


def test_a_functional_gdn_step_with_no_key_heads_is_refused():
    """qx / kx with a key-head dimension of 0: a ValueError naming qx (not a division by zero)."""
    case = sf.make_step_case(1, 2, "gdn", seed=0)
    args = dict(case.tensors)
    for n in ("qx", "kx"):
        args[n] = args[n][:, :0]
    names = ("codes", "s_k", "s_v", "u", "q", "kbuf", "ubuf", "w", "p", "h", "qx", "kx", "vx", "a", "b", "A_log",
             "dt_bias")
    with pytest.raises(ValueError, match="qx: .*0 key heads"):
        lq.step_gdn(*(args[n] for n in names), backend="reference")


@given(gate=st.sampled_from(["kda", "gdn"]), num_slots=st.integers(2, 6), heads=st.integers(1, 5),
       gaps=st.lists(st.integers(0, 3), min_size=7, max_size=7), shifted=st.integers(-1, 6),
       seed=st.integers(0, 2 ** 16))
def test_engine_arenas(gate, num_slots, heads, gaps, shifted, seed):
    """An engine's arena: one byte buffer holding the pool's raw and window tensors one after another, each placed
    on a 16-byte boundary a drawn number of boundaries past the previous one's end, except hcnt and GDN's p, which
    sit a drawn number of elements past one, and the buffer number ``shifted`` (if any), moved one element off. The
    pool accepts it exactly when every buffer but hcnt and p starts on a 16-byte boundary (else a ValueError naming
    the one that does not), and then decodes L + 1 tokens on it as on a pool of fresh buffers (reference backend):
    the same outputs and bytes."""
    names = ("raw", *lq.Pool.WINDOW_FIELDS[gate])
    loose = lq.layout.LOOSE_ALIGNMENT
    shapes = {"raw": ((lq.layout.raw_words(num_slots, heads),), torch.float32)}
    shapes.update({n: ((num_slots, heads) + lq.layout.FIELDS[n].shape, lq.layout.FIELDS[n].dtype)
                   for n in names[1:]})
    nbytes = {n: torch.Size(shapes[n][0]).numel() * shapes[n][1].itemsize for n in names}
    starts, end = {}, 0
    for i, (n, gap) in enumerate(zip(names, gaps)):
        size = shapes[n][1].itemsize
        start = -(-end // 16) * 16 + (gap * size if n in loose else gap * 16)
        starts[n] = start + (size if i == shifted else 0)
        end = starts[n] + nbytes[n]
    buf = torch.zeros(end + 16, dtype=torch.uint8)
    arena = buf[(-buf.data_ptr()) % 16:]                              # from the buffer's first 16-byte boundary
    views = {n: arena[starts[n]:starts[n] + nbytes[n]].view(shapes[n][1]).view(shapes[n][0]) for n in names}
    fresh = lq.Pool(num_slots, heads, gate=gate)           # the arena's buffers start as a new pool's
    for n in names:
        views[n].copy_(getattr(fresh, n))
    off = [n for n in names if n not in loose and views[n].data_ptr() % lq.layout.ALIGN_BYTES]
    if off:
        with pytest.raises(ValueError, match=f"^{off[0]}: expected a start on a 16-byte boundary"):
            lq.Pool(num_slots, heads, gate=gate, **views)
        return
    g = torch.Generator().manual_seed(seed)
    A_log, dt_bias = sf.head_constants(heads, gate, g)
    state = 0.1 * torch.randn(num_slots - 1, heads, V, K, generator=g)
    idx = torch.arange(num_slots - 1, 0, -1, dtype=torch.int32)
    n = idx.numel()
    toks = [(torch.randn(n, 2 * heads * K + heads * V, generator=g).bfloat16(),
             torch.randn((n, heads, K) if gate == "kda" else (n, heads), generator=g).bfloat16(),
             torch.randn(n, heads, generator=g).bfloat16()) for _ in range(L + 1)]
    results = []
    for given_bufs in ({}, views):
        pool = lq.Pool(num_slots, heads, gate=gate, **given_bufs)
        pool.encode(list(range(1, num_slots)), state)
        outs = [lq.decode_inplace(pool, idx, qkv, a, b, A_log, dt_bias, lq.default_q0(), backend="reference")
                for qkv, a, b in toks]
        results.append((outs, snapshot(pool)))
    assert all(torch.equal(x, y) for x, y in zip(results[0][0], results[1][0]))
    for name, first in results[0][1].items():
        assert torch.equal(first, results[1][1][name]), name
