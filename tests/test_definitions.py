"""definition.json files: up to date, well-formed, and their embedded references agree with the package's."""
from __future__ import annotations

import json

import pytest
import torch

from leapquant import families
from leapquant.definitions import make

NAMES = {"kda": "leapquant_kda_flush_h32", "gdn": "leapquant_gdn_flush_h32"}


def test_committed_files_are_up_to_date():
    for path, text in make.render().items():
        assert path.read_text() == text, f"{path} is stale: run python -m leapquant.definitions.make"


@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_schema_fields_and_workloads(gate):
    folder = make.HERE / NAMES[gate]
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
