"""tools/kernel_binaries.py compare, on made-up manifests (no compiling): a differing hash or a missing
configuration fails the comparison, and the normalised PTX ignores kernel names and nothing else."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools import kernel_binaries  # noqa: E402

PTX = """.version 8.8
.target sm_90a
.visible .entry kernel_cutlass_kernel_{name}_0(
\t.param .align 64 .b8 kernel_cutlass_kernel_{name}_0_param_0[128]
)
{{
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{%f1}}, %rd1, %rd2, p, 1, 1, 0, 1;
}}
"""
OLD_NAME = "fa4_jaxkernelssm90_forwardSm90ForwardKernel_object_at__TiledMMA"
NEW_NAME = "fa4_jax_sm90_forward_TiledMMA"


def _record(ptx: str, cubin: bytes = b"cubin") -> dict:
    return {"arch": "sm_90a", "ptx_sha256": kernel_binaries.sha256(ptx.encode()),
            "cubin_sha256": kernel_binaries.sha256(cubin),
            "ptx_normalized_sha256": kernel_binaries.sha256(kernel_binaries.normalized_ptx(ptx).encode())}


def _manifest(**records) -> dict:
    return {"tree": "/tree", "commit": "0" * 40, "configs": records}


BEFORE = _manifest(**{"test_a::CASES/d64": _record(PTX.format(name=NEW_NAME)),
                      "test_a::CASES/d128": _record(PTX.format(name=NEW_NAME), b"other cubin")})


def test_identical_manifests_compare_identical():
    result = kernel_binaries.compare_manifests(BEFORE, copy.deepcopy(BEFORE), normalized=False)
    assert result["identical"] and result["counts"] == {"configs": 2, "identical": 2}


@pytest.mark.parametrize("field", ["ptx_sha256", "cubin_sha256"])
def test_a_differing_hash_is_caught(field):
    after = copy.deepcopy(BEFORE)
    after["configs"]["test_a::CASES/d128"][field] = "f" * 64
    result = kernel_binaries.compare_manifests(BEFORE, after, normalized=False)
    assert not result["identical"]
    assert result["verdicts"]["test_a::CASES/d128"] == f"differs: {field}"
    assert result["verdicts"]["test_a::CASES/d64"] == "identical"


def test_a_missing_configuration_is_caught_either_way():
    after = copy.deepcopy(BEFORE)
    del after["configs"]["test_a::CASES/d64"]
    for before, after_, verdict in ((BEFORE, after, "missing after"), (after, BEFORE, "missing before")):
        for normalized in (False, True):
            result = kernel_binaries.compare_manifests(before, after_, normalized)
            assert not result["identical"] and result["verdicts"]["test_a::CASES/d64"] == verdict


def test_normalisation_ignores_kernel_names_only():
    old = PTX.format(name=OLD_NAME)
    new = PTX.format(name=NEW_NAME)
    assert old != new and kernel_binaries.normalized_ptx(old) == kernel_binaries.normalized_ptx(new)
    renamed = _manifest(**{"test_a::CASES/d64": _record(old)})
    current = _manifest(**{"test_a::CASES/d64": _record(new)})
    assert kernel_binaries.compare_manifests(renamed, current, normalized=True)["identical"]
    assert not kernel_binaries.compare_manifests(renamed, current, normalized=False)["identical"]
    # Any change outside the kernel_cutlass_ names still shows: an instruction shape, a parameter size, the target.
    for edited in (new.replace("m64n128k16", "m64n64k16"), new.replace("[128]", "[64]"),
                   new.replace(".target sm_90a", ".target sm_100a")):
        assert kernel_binaries.normalized_ptx(edited) != kernel_binaries.normalized_ptx(new)
        changed = _manifest(**{"test_a::CASES/d64": _record(edited)})
        assert not kernel_binaries.compare_manifests(current, changed, normalized=True)["identical"]


def test_compare_writes_the_result_and_exits_nonzero_on_a_difference(tmp_path, capsys):
    after = copy.deepcopy(BEFORE)
    after["configs"]["test_a::CASES/d64"]["cubin_sha256"] = "f" * 64
    paths = []
    for name, manifest in (("before", BEFORE), ("after", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(manifest))
    out = tmp_path / "result.json"
    assert kernel_binaries.main(["compare", str(paths[0]), str(paths[0]), "--out", str(out), "--recompile", "0"]) == 0
    assert json.loads(out.read_text())["identical"] is True
    assert kernel_binaries.main(["compare", str(paths[0]), str(paths[1]), "--out", str(out),
                                "--recompile", "0"]) == 1
    assert "test_a::CASES/d64: differs: cubin_sha256" in capsys.readouterr().out
    assert json.loads(out.read_text())["identical"] is False


def _cubin_differs():
    after = copy.deepcopy(BEFORE)
    after["configs"]["test_a::CASES/d64"]["cubin_sha256"] = "b" * 64
    return after


def test_a_cubin_that_varies_between_compiles_passes_when_both_trees_produce_a_common_one():
    before, after = BEFORE, _cubin_differs()
    original = before["configs"]["test_a::CASES/d64"]["cubin_sha256"]
    asked = []

    def both_variants(manifest, key):
        asked.append(key)
        return [original, "b" * 64]

    result = kernel_binaries.compare_manifests(before, after, normalized=False, cubin_variants=both_variants)
    assert result["identical"] and asked == ["test_a::CASES/d64"] * 2
    assert result["verdicts"]["test_a::CASES/d64"].startswith("identical after recompiling")
    assert result["cubin_variants"]["test_a::CASES/d64"]["common"] == sorted([original, "b" * 64])


def test_a_cubin_each_tree_always_compiles_its_own_way_still_differs():
    result = kernel_binaries.compare_manifests(BEFORE, _cubin_differs(), normalized=False,
                                               cubin_variants=lambda manifest, key: [])
    assert not result["identical"]
    assert result["verdicts"]["test_a::CASES/d64"] == "differs: cubin_sha256"
    assert result["cubin_variants"]["test_a::CASES/d64"]["common"] == []


def test_no_recompiling_where_the_ptx_differs():
    after = _cubin_differs()
    after["configs"]["test_a::CASES/d64"]["ptx_sha256"] = "c" * 64

    def never(manifest, key):
        raise AssertionError("recompiled although the PTX differs")

    result = kernel_binaries.compare_manifests(BEFORE, after, normalized=False, cubin_variants=never)
    assert result["verdicts"]["test_a::CASES/d64"] == "differs: ptx_sha256, cubin_sha256"
