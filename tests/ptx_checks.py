"""Compiling CuTe kernels for sm_90a on the CPU and reading what ptxas says, for the compile tests.

The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP at import, so a compile runs in a subprocess with them set.
"""

from __future__ import annotations

import glob
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


def compile_ptx(name: str, script: str, spec: dict, directory):
    """(path, text) of the one PTX file `python -c script json(spec)` leaves in `directory`."""
    result = subprocess.run([sys.executable, "-c", script, json.dumps(spec)], env=compile_environment(directory),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name}: compile failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    files = glob.glob(os.path.join(str(directory), "*.ptx"))
    assert len(files) == 1, f"{name}: expected one PTX file, found {files}"
    with open(files[0]) as handle:
        return files[0], handle.read()


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
