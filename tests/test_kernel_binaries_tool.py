"""tools/kernel_binaries.py compare, on made-up manifests (no compiling): a differing hash or a missing
configuration fails the comparison, and the normalised PTX ignores kernel names and nothing else. The
hashing of a job's dump directory, on made-up files; and the listing of this tree's compile tests
(imports only): every test module that compiles kernels is hashed or knowingly left out."""

from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
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


# --------------------------------------------------------------------------------------------------
# What a job left: hash_dump

def _dump(directory, files: dict) -> str:
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return str(directory)


def _kernel(name: str) -> bytes:
    return PTX.format(name=name).encode()


def test_one_kernel_is_recorded_as_itself_whatever_its_files_are_called(tmp_path):
    """A compile script may rename its PTX (not its cubin): one kernel needs no pairing, and its record
    holds its own hashes, as the committed manifests do."""
    record = kernel_binaries.hash_dump(_dump(tmp_path / "dump", {"d64.ptx": _kernel(NEW_NAME),
                                                                 "cutlass_x.cubin": b"c"}), False, "test_a::CASES/d64")
    expected = {key: value for key, value in _record(PTX.format(name=NEW_NAME), b"c").items() if key != "arch"}
    assert record == {**expected, "ptx_bytes": len(_kernel(NEW_NAME)), "cubin_bytes": 1,
                      "entries": [f"kernel_cutlass_kernel_{NEW_NAME}_0"]}


def test_several_kernels_hash_as_one_set(tmp_path):
    """A lowering of a forward and its gradient: one record whose hashes depend on what the kernels
    compiled to, not on the order they compiled in; any kernel's change shows."""
    forward, backward = _kernel("forward"), _kernel("backward")
    first = kernel_binaries.hash_dump(_dump(tmp_path / "first", {
        "kernel0.ptx": forward, "kernel0.cubin": b"F", "kernel1.ptx": backward, "kernel1.cubin": b"B"}),
        True, "test_a::_LOWER")
    swapped = kernel_binaries.hash_dump(_dump(tmp_path / "swapped", {
        "kernel1.ptx": forward, "kernel1.cubin": b"F", "kernel0.ptx": backward, "kernel0.cubin": b"B"}),
        True, "test_a::_LOWER")
    assert first == swapped
    assert [kernel["entries"] for kernel in first["kernels"]] == [["kernel_cutlass_kernel_backward_0"],
                                                                 ["kernel_cutlass_kernel_forward_0"]]
    assert first["ptx_bytes"] == len(forward) + len(backward) and first["cubin_bytes"] == 2
    changed = kernel_binaries.hash_dump(_dump(tmp_path / "changed", {
        "kernel0.ptx": forward, "kernel0.cubin": b"other", "kernel1.ptx": backward, "kernel1.cubin": b"B"}),
        True, "test_a::_LOWER")
    assert changed["cubin_sha256"] != first["cubin_sha256"] and changed["ptx_sha256"] == first["ptx_sha256"]
    assert changed["ptx_normalized_sha256"] == first["ptx_normalized_sha256"]


@pytest.mark.parametrize("files, several_kernels, message", [
    ({"a.ptx": b"", "a.cubin": b"", "b.ptx": b"", "b.cubin": b""}, False, "expected one PTX and one cubin"),
    ({"a.ptx": b""}, False, "expected one PTX and one cubin"),
    ({}, True, "in pairs of one name"),
    ({"kernel0.ptx": b"", "kernel0.cubin": b"", "kernel1.ptx": b""}, True, "in pairs of one name"),
    ({"kernel0.ptx": b"", "kernel1.cubin": b""}, True, "in pairs of one name"),
])
def test_a_dump_other_than_the_job_expects_fails(tmp_path, files, several_kernels, message):
    with pytest.raises(RuntimeError, match=message):
        kernel_binaries.hash_dump(_dump(tmp_path / "dump", files), several_kernels, "test_a::_LOWER")


# A stand-in DSL whose every compile writes its dump files under one name, as the real one does for a
# forward and a backward whose leading argument types agree (it cuts the name at about 190 characters).
_STUB_CUTE = """
import os
def compile(text, files=("ptx", "cubin")):
    for extension in files:
        with open(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "cutlass_same_name." + extension), "w") as handle:
            handle.write(text + " " + extension)
"""
_LOWERING = """
import sys
import cutlass.cute as cute
for text in sys.argv[1:]:
    cute.compile(text, files=("ptx",) if text == "ptx-only" else ("ptx", "cubin"))
"""


def _run_separated(tmp_path, *texts):
    (tmp_path / "stub" / "cutlass").mkdir(parents=True)
    (tmp_path / "stub" / "cutlass" / "__init__.py").write_text("")
    (tmp_path / "stub" / "cutlass" / "cute.py").write_text(_STUB_CUTE)
    (tmp_path / "dump").mkdir()
    environment = dict(os.environ, PYTHONPATH=str(tmp_path / "stub"), CUTE_DSL_DUMP_DIR=str(tmp_path / "dump"))
    # -S: no site-packages, whose .pth puts the real DSL ahead of PYTHONPATH.
    return subprocess.run([sys.executable, "-S", "-c", kernel_binaries._SEPARATE_KERNELS, _LOWERING, *texts],
                          env=environment, capture_output=True, text=True, timeout=60)


def test_each_compile_of_a_lowering_keeps_its_own_files(tmp_path):
    process = _run_separated(tmp_path, "forward", "backward", "tangent")
    assert process.returncode == 0, process.stderr
    files = {path.name: path.read_text() for path in (tmp_path / "dump").iterdir()}
    assert files == {f"kernel{number}.{extension}": f"{text} {extension}" for number, text in
                     enumerate(("forward", "backward", "tangent")) for extension in ("ptx", "cubin")}


def test_a_compile_that_leaves_no_cubin_fails_the_lowering(tmp_path):
    process = _run_separated(tmp_path, "forward", "ptx-only")
    assert process.returncode != 0 and "compile 1: expected one new .cubin file" in process.stderr


# --------------------------------------------------------------------------------------------------
# This tree's compile tests: listed, or knowingly left out

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def listing():
    """`list --json` for this tree (imports its test modules, compiles nothing)."""
    pytest.importorskip("cutlass")
    return kernel_binaries._listing(REPO)


def _compiling_modules() -> set:
    modules = set()
    for path in glob.glob(os.path.join(REPO, "tests", "test_*.py")):
        with open(path) as handle:
            if kernel_binaries.COMPILE_MARKERS.search(handle.read()):
                modules.add(os.path.basename(path)[:-len(".py")])
    return modules


def test_every_compiling_module_is_hashed_or_knowingly_left_out(listing):
    listed = {job["key"].split("::")[0] for job in listing["jobs"]}
    compiling = _compiling_modules()
    assert listing["fa4_jax"].startswith(REPO + os.sep)
    assert listed <= compiling
    assert compiling - listed == set(kernel_binaries.NOT_HASHED), "a compiling module lists nothing, unexplained"
    # An entry for a module that is gone or no longer compiles would excuse nothing: drop it.
    assert set(kernel_binaries.NOT_HASHED) <= compiling


def test_the_lowerings_of_several_kernels_keep_them_apart(listing):
    """The head-padding lowerings (a forward and a backward or a tangent each) and the warning-filter
    cases (up to three kernels) run under _SEPARATE_KERNELS, one job per case; every other job leaves
    one kernel."""
    several = sorted(job["key"] for job in listing["jobs"] if job.get("several_kernels"))
    assert several == sorted([
        "test_head_padding::LOWERED_CASES/sm90-d192-v128", "test_head_padding::LOWERED_CASES/sm100-d80",
        "test_head_padding::_LOWER_JVP", "test_warning_filters::CASES/sm90-d128-softcap",
        "test_warning_filters::CASES/sm90-d256-causal", "test_warning_filters::CASES/sm90-d256-decode",
        "test_warning_filters::CASES/sm100-d128-softcap"])


@pytest.mark.parametrize("module_name", ["test_kernel_compile_sm90", "test_kernel_compile_sm90_tangent"])
def test_the_sm90_compile_scripts_get_what_their_tests_pass(listing, module_name):
    """One job per configuration, with the arguments the test's own fixture passes its script, cut to that
    configuration: the configuration, and for the forward the packed sequence counts (its script reads
    sys.argv[2]; without it every forward configuration failed to compile)."""
    import importlib

    module = importlib.import_module(module_name)
    jobs = {job["key"]: job for job in listing["jobs"] if job["key"].startswith(module_name + "::")}
    assert sorted(jobs) == sorted(f"{module_name}::CONFIGS/{name}" for name in module.CONFIGS)
    for key, job in jobs.items():
        name = key.split("/", 1)[1]
        assert job["arch"] == "sm_90a" and not job["several_kernels"]
        expected = [{name: module.CONFIGS[name]}] + (
            [module.PACKED_SEQUENCES] if module_name == "test_kernel_compile_sm90" else [])
        assert [json.loads(argument) for argument in job["arguments"]] == json.loads(json.dumps(expected))
