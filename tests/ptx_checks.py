"""Compiling CuTe kernels for sm_90a on the CPU and reading what ptxas says, for the compile tests.

The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP at import, so a compile runs in a subprocess with them set.
Starting that subprocess and importing the DSL costs more than most compiles, so a test module compiles
all its cases in one subprocess per architecture (`compile_batch`, from a module-scoped fixture), and
each test still checks its own case: a case that fails to compile fails its test alone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_environment(directory) -> dict:
    """The environment of a subprocess that compiles for sm_90a and keeps its PTX in `directory`."""
    return dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(directory),
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


# Runs a compile script (written to run as `python -c script <arguments>`, the way
# tools/kernel_binaries.py runs it for one case) for each case in turn, in one process: each case gets its
# own globals and sys.argv, its new PTX file is moved aside at once (the DSL names the file after the
# kernel's arguments, so cases can collide), and its outcome is printed as it finishes, so a process that
# dies still reports the cases before it.
_BATCH = r"""
import glob, json, os, sys, traceback
script, cases = sys.argv[1], json.loads(sys.argv[2])
dump = os.environ["CUTE_DSL_DUMP_DIR"]
code = compile(script, "<compile script>", "exec")
kept = set()
for name, arguments in cases.items():
    sys.argv = ["-c", *arguments]
    try:
        exec(code, {"__name__": "__main__"})
        new = sorted(set(glob.glob(os.path.join(dump, "*.ptx"))) - kept)
        assert len(new) == 1, f"expected one new PTX file, found {new}"
        path = os.path.join(dump, f"case{len(kept)}.ptx")
        os.replace(new[0], path)
        kept.add(path)
        record = {"ptx_path": path}
    except BaseException:
        kept.update(glob.glob(os.path.join(dump, "*.ptx")))  # what a failed compile left is not the next's
        record = {"error": traceback.format_exc()}
    print("PTX_BATCH " + json.dumps([name, record]), flush=True)
"""


class CompiledBatch:
    """The cases a batch compiled (`compile_batch`, or tools/sm100_inspect.compile_kernels with
    keep_going), each {"ptx_path", ...} or {"error"}: `batch[name]` is (PTX path, text) and
    `batch.record(name)` the whole record, or either fails the test with that case's compile error."""

    def __init__(self, records: dict):
        self.records = records

    def record(self, name: str) -> dict:
        record = self.records[name]
        assert "error" not in record, f"{name}: compile failed\n{record['error']}"
        return record

    def __getitem__(self, name: str):
        path = self.record(name)["ptx_path"]
        with open(path) as handle:
            return path, handle.read()


def compile_batch(script: str, specs: dict, directory, arch: str = "sm_90a") -> CompiledBatch:
    """Each {name: spec} compiled by `script` (which reads json(spec) from argv), all in one subprocess
    for `arch` that keeps its PTX in `directory`."""
    cases = {name: [json.dumps(spec)] for name, spec in specs.items()}
    environment = dict(compile_environment(directory), CUTE_DSL_ARCH=arch)
    process = subprocess.run([sys.executable, "-c", _BATCH, script, json.dumps(cases)], env=environment,
                             capture_output=True, text=True, timeout=300 + 120 * len(cases))
    records = dict(json.loads(line[len("PTX_BATCH "):]) for line in process.stdout.splitlines()
                   if line.startswith("PTX_BATCH "))
    for name in cases:
        records.setdefault(name, {"error": f"the compile process exited ({process.returncode}) before this "
                                           f"case\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}"})
    return CompiledBatch(records)


def selected(request, parameter: str) -> set:
    """The values of `parameter` that this session's tests in the requesting module take (every case
    in CI, one under `-k`), so a module fixture compiles only what the selected tests check."""
    taken = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None and parameter in callspec.params:
            taken.add(callspec.params[parameter])
    return taken


def selected_tests(request) -> set:
    """The names of this session's test functions in the requesting module."""
    return {item.originalname for item in request.session.items if item.module is request.module}


def assert_no_spills(ptxas: str, path: str, name: str):
    """`ptxas -v` for sm_90a compiles `path` and reports no spill stores or loads and no stack frame."""
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report.stderr)
    assert spills and all(stores == "0" and loads == "0" for stores, loads in spills), \
        f"{name}: spills\n{report.stderr[-1500:]}"
    # Short of registers, ptxas may instead wait for every wgmma before the next (warning C7512).
    assert "instructions are serialized" not in report.stderr, f"{name}: wgmma serialized\n{report.stderr[-1500:]}"
    stack = re.findall(r"(\d+) bytes stack frame", report.stderr)
    assert all(size == "0" for size in stack), f"{name}: stack frame\n{report.stderr[-1500:]}"
