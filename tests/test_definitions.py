"""definition.json files (the flush and the decode step of each gate): up to date, well-formed, and their embedded
references agree with the package's and pass the op's criterion."""
from __future__ import annotations

import json

import pytest
import torch

from leapquant import families
from leapquant import step_families as sf
from leapquant.definitions import make
from leapquant.layout import L

NAMES = {"kda": "leapquant_kda_flush_h32", "gdn": "leapquant_gdn_flush_h32"}
ALL_NAMES = sorted([*NAMES.values(), *make.STEP_NAMES.values()])


def _embedded_run(name: str):
    d = json.loads((make.HERE / name / "definition.json").read_text())
    ns: dict = {}
    exec(compile(d["reference"], f"<{d['name']} reference>", "exec"), ns)
    return d, ns["run"]


def test_committed_files_are_up_to_date():
    for path, text in make.render().items():
        assert path.read_text() == text, f"{path} is stale: run python -m leapquant.definitions.make"


def test_every_definition_is_committed():
    assert sorted(p.name for p in make.HERE.iterdir() if (p / "definition.json").exists()) == ALL_NAMES


@pytest.mark.parametrize("name", ALL_NAMES)
def test_schema_fields_and_workloads(name):
    folder = make.HERE / name
    d = json.loads((folder / "definition.json").read_text())
    assert {"name", "op_type", "description", "axes", "inputs", "outputs", "constraints", "reference"} <= set(d)
    for spec in list(d["inputs"].values()) + list(d["outputs"].values()):
        assert all(ax in d["axes"] for ax in spec["shape"])
    rows = [json.loads(line) for line in (folder / "workloads.jsonl").read_text().splitlines()]
    assert [r["workload"]["axes"]["batch_size"] for r in rows] == [16, 32, 64, 128, 256, 512]
    assert all(set(r["workload"]["inputs"]) == set(d["inputs"]) for r in rows)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_embedded_reference_agrees_with_the_package(gate):
    d = json.loads((make.HERE / NAMES[gate] / "definition.json").read_text())
    ns: dict = {}
    exec(compile(d["reference"], f"<{d['name']} reference>", "exec"), ns)
    case = families.make_case(2, 7, gate, seed=3)
    out = ns["run"](*case.args())
    assert list(d["outputs"]) == ["codes", "s_k", "s_v", "u", "q"]
    for got, spec in zip(out, d["outputs"].values()):
        assert str(got.dtype) == f"torch.{spec['dtype']}"
    v = case.judge(out, f"{d['name']} embedded reference")
    assert v.passed, v.message
    # same algorithm, same fp32 operations: the decoded states agree to rounding
    from leapquant.reference import decode_checkpoint
    a, b = decode_checkpoint(*out), decode_checkpoint(*case.reference())
    scale = case.exact().abs().mean(dim=(-1, -2), keepdim=True).float()
    assert float(((a - b).abs() / scale.clamp_min(1e-30)).mean()) < 1e-3


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_embedded_reference_keeps_empty_windows(gate):
    """Heads whose window is empty (leapquant.reference.empty_window) come back unchanged from the embedded reference,
    as from the package; the others are re-compressed."""
    from leapquant import reference
    d = json.loads((make.HERE / NAMES[gate] / "definition.json").read_text())
    ns: dict = {}
    exec(compile(d["reference"], f"<{d['name']} reference>", "exec"), ns)
    case = families.make_case(2, 5, gate, seed=4)
    t = case.tensors
    t["w"][0, 1] = 0.0
    t["w"][1, 3] = 0.0
    if gate == "kda":
        t["pcum"][0, 1] = 0.0
        t["pcum"][1, 3] = 0.0
        t["pcum"][1, 3, 0] = -0.5                  # w = 0 but a decay: not empty
    else:
        t["p"][0, 1] = 1.0
        t["p"][1, 3] = 0.5
    empty = reference.empty_window(t["w"], **({"pcum": t["pcum"]} if gate == "kda" else {"p": t["p"]}))
    assert empty.sum() == 1 and bool(empty[0, 1])
    out = ns["run"](*case.args())
    for got, given in zip(out, case.checkpoint()):
        assert torch.equal(got[0, 1], given[0, 1])
    assert not torch.equal(out[0][1, 3], case.checkpoint()[0][1, 3])


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_embedded_step_reference_agrees_with_the_package(gate):
    """The step definition's self-contained run: the outputs, names, dtypes and shapes it declares, bitwise the
    package's fp32 reference (the same operations in the same order), and the SPEC section 7 criterion against fp64; the
    input families, grouped key heads for GDN as the definition's axes say."""
    d, run = _embedded_run(make.STEP_NAMES[gate])
    hk = d["axes"]["num_k_heads"]["value"] * 4 // d["axes"]["num_heads"]["value"]     # 4 heads, the same grouping
    case = sf.make_step_case(3, 4, gate, seed=5, num_k_heads=hk)
    out = run(*case.args())
    assert len(out) == len(d["outputs"])
    for got, (name, spec) in zip(out, d["outputs"].items()):
        assert str(got.dtype) == f"torch.{spec['dtype']}", name
        assert got.dim() == len(spec["shape"]), name
    for got, want in zip(out, case.reference()):
        assert torch.equal(got, want)
    v = case.judge(out, name=d["name"])
    assert v.passed, v.message


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_embedded_step_reference_reads_only_the_live_entries(gate):
    """A fill count of L reads as an empty window, and entries at and past the fill count are ignored whatever they
    hold (NaN included), as in the package."""
    _, run = _embedded_run(make.STEP_NAMES[gate])
    case = sf.make_step_case(2, 2, gate, seed=6, num_k_heads=1 if gate == "gdn" else None)
    t = case.tensors
    t["h"][0, 0] = L
    t["h"][1, 1] = 3
    t["kbuf"][1, 1, 3:] = float("nan")
    t["ubuf"][1, 1, 3:] = float("nan")
    out = run(*case.args())
    assert all(bool(torch.isfinite(x.float()).all()) for x in out)
    for got, want in zip(out, case.reference()):
        assert torch.equal(got, want)
