"""compute-sanitizer memcheck and racecheck over the CuTe kernels on small shapes (GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sanitizer_cases.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not on PATH"),
]


# "all": every forward and backward case in one process, as issue 12 asks; each kind alone too, so a
# report says which side it came from.
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("kind", ["forward", "backward", "all"])
def test_kernels_are_sanitizer_clean(tool, kind):
    environment = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "99", sys.executable, CASES, kind]
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
    output = completed.stdout + completed.stderr
    from sanitizer_cases import cases_of
    assert output.count(": ran") == len(cases_of(kind)), output[-4000:]
    # --error-exitcode makes any reported error (memcheck) or hazard (racecheck) a non-zero exit.
    assert completed.returncode == 0, output[-4000:]
    assert "ERROR SUMMARY: 0 errors" in output or "0 hazards" in output, output[-4000:]
