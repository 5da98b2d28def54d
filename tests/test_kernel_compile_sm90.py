"""Compile the Hopper forward kernel for sm_90a on the CPU and check what it became (runs in CI).

The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP once, at import, so the compiles run in one subprocess
with those set; each configuration's PTX is then checked for the instructions that make the design
real: wgmma (tensor cores), cp.async.bulk.tensor (TMA), setmaxnreg (register reallocation between
producer and consumers) and mbarrier waits, and for the absence of local memory. Where `ptxas` is
installed, its report must show no spills.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (AttentionConfig fields, [B, Sq, Sk, Hq, Hkv, D], dtype, KernelOptions overrides)
CONFIGS = {
    "d128": ({}, [2, 1000, 1000, 4, 4, 128], "bfloat16", {}),
    "d64-causal": ({"causal": True}, [2, 1000, 1000, 4, 4, 64], "bfloat16", {}),
    "d256-gqa-fp16": ({}, [1, 300, 700, 8, 2, 256], "float16", {}),
    "d96-window": ({"window_left": 100, "window_right": 0}, [1, 500, 500, 2, 2, 96], "bfloat16", {}),
    "d192-all-features": (
        {"causal": True, "softcap": 30.0, "has_sinks": True, "has_segment_ids": True,
         "has_q_seq_lengths": True, "has_kv_seq_lengths": True},
        [2, 300, 400, 4, 2, 192], "bfloat16", {}),
    "d128-polynomial-exp2": ({"causal": True}, [1, 512, 512, 2, 2, 128], "bfloat16", {"poly_exp2_every": 2}),
}

_COMPILE = r"""
import dataclasses, glob, json, os, sys
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import sm90_forward

configs = json.loads(sys.argv[1])
dump = os.environ["CUTE_DSL_DUMP_DIR"]

def fake(dtype, shape):
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape)))[::-1], assumed_align=16)

class DtypeName:
    def __init__(self, name):
        self.name = name

result = {}
for name, (fields, shape, dtype, overrides) in configs.items():
    B, Sq, Sk, Hq, Hkv, D = shape
    config = AttentionConfig(scale=D ** -0.5, **fields)
    element = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]
    reason = sm90_forward.unsupported_reason(config, (B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), DtypeName(dtype))
    assert reason is None, reason
    options = sm90_forward.kernel_options(config, (B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D),
                                          DtypeName(dtype), sm_count=132)
    kernel = sm90_forward.Sm90ForwardKernel(dataclasses.replace(options, **overrides))
    i32, f32 = cutlass.Int32, cutlass.Float32
    before = set(glob.glob(os.path.join(dump, "*.ptx")))
    cute.compile(kernel, make_fake_stream(),
                 fake(element, (B, Sq, Hq, D)), fake(element, (B, Sk, Hkv, D)), fake(element, (B, Sk, Hkv, D)),
                 fake(f32, (Hq,)) if config.has_sinks else None,
                 fake(i32, (B, Sq)) if config.has_segment_ids else None,
                 fake(i32, (B, Sk)) if config.has_segment_ids else None,
                 fake(i32, (B,)) if config.has_q_seq_lengths else None,
                 fake(i32, (B,)) if config.has_kv_seq_lengths else None,
                 None,
                 fake(element, (B, Sq, Hq, D)), fake(f32, (B, Hq, Sq)))
    new = sorted(set(glob.glob(os.path.join(dump, "*.ptx"))) - before)
    assert len(new) == 1, new
    result[name] = new[0]
print("SM90_PTX " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{config name: PTX path}, all compiled in one subprocess for sm_90a."""
    directory = tmp_path_factory.mktemp("sm90_ptx")
    environment = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(directory),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CONFIGS)], env=environment,
                             capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("SM90_PTX "))
    return json.loads(line[len("SM90_PTX "):])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ptx_has_hopper_instructions(compiled, name):
    with open(compiled[name]) as handle:
        ptx = handle.read()
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx, "no tensor-core wgmma"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert re.search(r"setmaxnreg\.dec", ptx) and re.search(r"setmaxnreg\.inc", ptx), "no register reallocation"
    assert "mbarrier.try_wait" in ptx, "no mbarrier pipeline"
    assert not re.search(r"\.local\b|ld\.local|st\.local", ptx), "local memory in the PTX"
    if CONFIGS[name][3].get("poly_exp2_every"):
        assert "cvt.rmi.f32.f32" in ptx, "polynomial exp2 missing"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_register_spills(compiled, name):
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", compiled[name], "-o", os.devnull],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report.stderr)
    assert spills and all(stores == "0" and loads == "0" for stores, loads in spills), report.stderr
    stack = re.findall(r"(\d+) bytes stack frame", report.stderr)
    assert all(size == "0" for size in stack), report.stderr
