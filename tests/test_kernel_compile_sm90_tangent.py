"""Compile the Hopper tangent kernel (forward-mode AD) for sm_90a on the CPU and check what it became
(runs in CI): wgmma on the tensor cores, TMA loads, register reallocation, mbarrier pipelines, no local
memory in the PTX, and, where ptxas is installed, no spills, stack frame or serialized wgmma."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from ptx_checks import assert_no_spills, compile_environment

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from tools.sm100_inspect import find_ptxas  # noqa: E402


# name -> (AttentionConfig fields, [B, Sq, Sk, Hq, Hkv, D], dtype)
ALL_FEATURES = {"causal": True, "softcap": 30.0, "has_sinks": True, "has_segment_ids": True, "window_left": 300,
                "has_q_seq_lengths": True, "has_kv_seq_lengths": True}
CONFIGS = {
    "d128": ({}, [2, 1000, 1000, 4, 4, 128], "bfloat16"),
    "d64-causal-gqa-fp16": ({"causal": True}, [2, 1000, 1100, 8, 2, 64], "float16"),
    "d64-all-features": (ALL_FEATURES, [2, 1600, 1700, 4, 2, 64], "bfloat16"),
    "d128-all-features-fp16": (ALL_FEATURES, [2, 700, 900, 4, 2, 128], "float16"),
    "d128-window-q-start": ({"window_left": 100, "window_right": 20, "has_q_start": True, "q_total": 2000},
                            [1, 500, 2000, 4, 4, 128], "bfloat16"),
}

_COMPILE = r"""
import glob, json, os, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import tangent

configs = json.loads(sys.argv[1])
dump = os.environ["CUTE_DSL_DUMP_DIR"]
result = {}
for name, (fields, shape, dtype) in configs.items():
    B, Sq, Sk, Hq, Hkv, D = shape
    config = AttentionConfig(scale=D ** -0.5, **fields)
    problem = host.Problem((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), dtype)
    reason = tangent.unsupported_reason(config, problem)
    assert reason is None, reason
    options = tangent.options(config, problem, sm_count=132)
    cute.compile(tangent.Sm90TangentKernel(options), make_fake_stream(),
                 *host.tangent_fake_arguments(config, shape, dtype, options.tile_m))
    # The DSL names the file after the kernel's arguments: move each out of the way under its name.
    new = glob.glob(os.path.join(dump, "cutlass_*.ptx"))
    assert len(new) == 1, new
    path = os.path.join(dump, name + ".ptx")
    os.replace(new[0], path)
    result[name] = path
print("SM90_TANGENT_PTX " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{config name: PTX path}, all compiled in one subprocess for sm_90a."""
    directory = tmp_path_factory.mktemp("sm90_tangent_ptx")
    process = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CONFIGS)],
                             env=compile_environment(directory), capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("SM90_TANGENT_PTX "))
    return json.loads(line[len("SM90_TANGENT_PTX "):])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ptx_has_hopper_instructions(compiled, name):
    with open(compiled[name]) as handle:
        ptx = handle.read()
    assert ".target sm_90a" in ptx
    # Per key block: S, t_Q K^T and Q t_K^T (D / 16 wgmma each), then P t_V and (P o t_S) V.
    assert len(re.findall(r"wgmma\.mma_async", ptx)) >= 5, "not the five tensor-core GEMMs per key block"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert re.search(r"setmaxnreg\.dec", ptx) and re.search(r"setmaxnreg\.inc", ptx), "no register reallocation"
    assert "mbarrier.try_wait" in ptx, "no mbarrier pipeline"
    assert not re.search(r"\.local\b|ld\.local|st\.local", ptx), "local memory in the PTX"
    assert "ex2.approx" in ptx, "P not recomputed with exp2"


def test_options_are_the_compile_key():
    """Equal calls give equal (hashable) options; anything the kernel compiles in changes them; head dims
    the kernel does not take are refused with the reason."""
    import dataclasses

    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import tangent

    shape = (1, 300, 2, 128)
    problem = host.Problem(shape, shape, shape, "bfloat16")
    first = tangent.options(AttentionConfig(scale=0.1, causal=True), problem, sm_count=132)
    assert first == tangent.options(AttentionConfig(scale=0.1, causal=True), problem, sm_count=132)
    assert hash(first) == hash(dataclasses.replace(first))
    assert first != tangent.options(AttentionConfig(scale=0.1), problem, sm_count=132)
    assert first != tangent.options(AttentionConfig(scale=0.1, causal=True, softcap=5.0), problem, sm_count=132)
    for head_dim in tangent.SUPPORTED_HEAD_DIMS:
        square = (1, 8, 2, head_dim)
        tangent.options(AttentionConfig(scale=0.1), host.Problem(square, square, square, "bfloat16"),
                        sm_count=132).check()
    with pytest.raises(ValueError, match="takes D = Dv"):
        dataclasses.replace(first, head_dim=96, v_head_dim=96).check()
    wide = host.Problem((1, 8, 2, 96), (1, 8, 2, 96), (1, 8, 2, 96), "bfloat16")
    assert "head dims (64, 128), not 96" in tangent.unsupported_reason(AttentionConfig(scale=0.1), wide)


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_register_spills(compiled, name):
    assert_no_spills(find_ptxas(), compiled[name], name)
