"""CPU-only: compile the Hopper large-head backward kernel (D = 192, 256) for sm_90a with fake tensors.

The PTX must hold what the design is made of: `wgmma.mma_async` (S, dP: D / 16 k-steps each; dV, dK,
dQ: 4 each), TMA loads, the producer / consumer register split, the TMA bulk reduce-add of dQ and the
TMA stores of dK / dV, and no local memory; ptxas (when installed) must report no spills. The
`Tuning` candidates compile the same way; where one does not apply (diagonal_first without
deterministic mode, stagger in deterministic mode) the PTX is the default's, byte for byte.
Each compile runs in a subprocess because the DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP at import.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMPILE = r"""
import json, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import sm90_backward_large_heads as large_heads

spec = json.loads(sys.argv[1])
config = AttentionConfig(**spec["config"])
batch, q_len, kv_len, q_heads, kv_heads, head_dim = spec["shape"]
tuning = large_heads.Tuning(**spec.get("tuning", {}))
kernel = large_heads.make_kernel(config, spec["dtype"], head_dim, q_heads // kv_heads, tuning)
cute.compile(kernel.__call__, make_fake_stream(),
             *large_heads.fake_arguments(config, spec["shape"], spec["dtype"]))
"""

CASES = {
    "d256": dict(config=dict(scale=256 ** -0.5), shape=[2, 300, 300, 4, 4, 256]),
    "d256-causal-gqa-fp16": dict(config=dict(scale=256 ** -0.5, causal=True),
                                 shape=[2, 300, 333, 8, 2, 256], dtype="float16"),
    "d256-deterministic-causal": dict(config=dict(scale=256 ** -0.5, causal=True, deterministic=True),
                                      shape=[2, 256, 512, 8, 2, 256]),
    "d256-softcap-window": dict(config=dict(scale=1.0, softcap=5.0, window_left=64, window_right=32),
                                shape=[1, 200, 333, 4, 4, 256]),
    "d256-segments-lengths": dict(config=dict(scale=256 ** -0.5, has_segment_ids=True,
                                              has_q_seq_lengths=True, has_kv_seq_lengths=True),
                                  shape=[2, 197, 333, 4, 4, 256]),
    "d192": dict(config=dict(scale=192 ** -0.5), shape=[2, 300, 300, 4, 4, 192]),
    "d192-causal-gqa-fp16": dict(config=dict(scale=192 ** -0.5, causal=True),
                                 shape=[2, 300, 333, 8, 2, 192], dtype="float16"),
    "d192-deterministic-segments": dict(config=dict(scale=192 ** -0.5, deterministic=True,
                                                    has_segment_ids=True, has_kv_seq_lengths=True),
                                        shape=[1, 200, 333, 4, 2, 192]),
    "d256-deterministic-causal-diagonal-first": dict(
        config=dict(scale=256 ** -0.5, causal=True, deterministic=True),
        tuning=dict(diagonal_first=True), shape=[2, 256, 512, 8, 2, 256]),
    "d192-deterministic-window-lengths-diagonal-first": dict(
        config=dict(scale=192 ** -0.5, deterministic=True, window_left=70, window_right=20,
                    has_q_seq_lengths=True, has_kv_seq_lengths=True),
        tuning=dict(diagonal_first=True), shape=[2, 300, 333, 4, 2, 192]),
    "d256-causal-no-stagger": dict(config=dict(scale=256 ** -0.5, causal=True),
                                   tuning=dict(stagger=False), shape=[2, 300, 333, 8, 2, 256]),
    "d192-segments-no-stagger": dict(config=dict(scale=192 ** -0.5, has_segment_ids=True),
                                     tuning=dict(stagger=False), shape=[1, 200, 333, 4, 4, 192]),
}


def _compile_ptx(name, spec, directory):
    spec = {"dtype": "bfloat16", **spec}
    environment = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
                       CUTE_DSL_DUMP_DIR=str(directory),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name}: compile failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    files = glob.glob(os.path.join(str(directory), "*.ptx"))
    assert len(files) == 1, f"{name}: expected one PTX file, found {files}"
    with open(files[0]) as handle:
        return files[0], handle.read()


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_wgmma_tma_without_spills(name, tmp_path):
    path, ptx = _compile_ptx(name, CASES[name], tmp_path)
    head_dim = CASES[name]["shape"][-1]
    assert ".target sm_90a" in ptx
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * head_dim // 16 + 12
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx, "no producer/consumer register split"
    assert re.search(r"cp\.reduce\.async\.bulk[^;]*\.add", ptx), "no bulk reduce-add for dQ"
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx), "no TMA store of dK / dV"
    if CASES[name]["config"].get("deterministic"):
        assert re.search(r"ld(\.[a-z]+)*\.acquire", ptx), "no acquire load for the dQ ordering"
        assert re.search(r"red(\.[a-z]+)*\.release", ptx), "no release for the dQ ordering"
    # Diagonal first reverses the launch order (key block = grid - 1 - blockIdx.x).
    diagonal_first = (CASES[name].get("tuning", {}).get("diagonal_first", False)
                      and CASES[name]["config"].get("deterministic", False))
    assert ("%nctaid.x" in ptx) == diagonal_first
    assert ".local" not in ptx, "local memory in the PTX"
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr[-2000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report.stderr)]
    assert spills and max(spills) == 0, f"{name}: spills\n{report.stderr[-1500:]}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["unordered_dq", "deterministic"])
def test_inapplicable_tuning_leaves_the_ptx_unchanged(deterministic, tmp_path):
    """diagonal_first orders deterministic turns only, the stagger is the non-deterministic walk's
    only: each setting outside its mode must give the default kernel, byte for byte."""
    config = dict(scale=256 ** -0.5, causal=True, deterministic=deterministic)
    spec = dict(config=config, shape=[2, 300, 333, 8, 2, 256])
    inapplicable = dict(stagger=False) if deterministic else dict(diagonal_first=True)
    (tmp_path / "default").mkdir()
    (tmp_path / "tuned").mkdir()
    _, default = _compile_ptx("default", spec, tmp_path / "default")
    _, tuned = _compile_ptx("inapplicable", dict(spec, tuning=inapplicable), tmp_path / "tuned")
    assert tuned == default
