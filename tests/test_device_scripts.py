"""benchmarks/device/ on the CPU: what a device call runs must at least parse, since a typo there costs a call
of device time. Every shell script passes `bash -n`, every Python script compiles, and the scripts and
Python files a script names exist in the repository."""

from __future__ import annotations

import pathlib
import py_compile
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE = ROOT / "benchmarks" / "device"
SHELL = sorted(DEVICE.glob("*.sh"))
PYTHON = sorted(DEVICE.glob("*.py"))


@pytest.mark.parametrize("script", SHELL, ids=lambda path: path.name)
def test_shell_script_parses_and_names_what_exists(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    # Lines that are code, not comments: the repository paths they run.
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    named = set(re.findall(r"\b((?:benchmarks|tests|tools|examples)/[\w/.-]+\.(?:py|sh))\b", code))
    named |= {f"benchmarks/device/{name}" for name in re.findall(r'\$\(dirname "\$0"\)/([\w.-]+\.sh)', code)}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{script.name} runs files that do not exist: {missing}"


@pytest.mark.parametrize("script", PYTHON, ids=lambda path: path.name)
def test_python_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)
