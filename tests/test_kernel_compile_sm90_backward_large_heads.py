"""CPU-only: compile the Hopper large-head backward kernel (D = 192, 256) for sm_90a with fake tensors.

The PTX must hold what the design is made of: `wgmma.mma_async` (S, dP: D / 16 k-steps each; dV, dK,
dQ: 4 each), TMA loads, the producer / consumer register split, the TMA bulk reduce-add of dQ and the
TMA stores of dK / dV, and no local memory; ptxas (when installed) must report no spills. The
`Tuning` candidates compile the same way; where one does not apply (diagonal_first without
deterministic mode, stagger in deterministic mode) the PTX is the default's, byte for byte.
The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP at import, so the cases compile in one subprocess
(tests/ptx_checks.compile_batch); each test checks its own case.
"""

from __future__ import annotations

import re

import pytest

import ptx_checks
from ptx_checks import assert_no_spills

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from tools.sm100_inspect import find_ptxas  # noqa: E402

pytestmark = [pytest.mark.slow, ptx_checks.one_worker(__name__)]


_COMPILE = r"""
import json, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward_large_heads as large_heads

spec = json.loads(sys.argv[1])
config = AttentionConfig(**spec["config"])
batch, q_len, kv_len, q_heads, kv_heads, head_dim = spec["shape"]
problem = host.Problem((batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
                       (batch, kv_len, kv_heads, head_dim), spec["dtype"])
tuning = large_heads.Tuning(**spec.get("tuning", {}))
kernel = large_heads.Sm90LargeHeadBackwardKernel(large_heads.options(config, problem, tuning))
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
    # Sequence-sharded queries (q_start, a runtime operand): the query-block range, masks and dQ turns
    # at global rows, with key lengths (the combination context parallelism's all-gather passes).
    "d256-causal-gqa-q-start": dict(config=dict(scale=256 ** -0.5, causal=True, has_q_start=True, q_total=1200),
                                    shape=[2, 300, 333, 8, 2, 256]),
    "d192-deterministic-window-q-start-kv-lengths-diagonal-first": dict(
        config=dict(scale=192 ** -0.5, deterministic=True, window_left=70, window_right=20, has_q_start=True,
                    q_total=900, has_kv_seq_lengths=True),
        tuning=dict(diagonal_first=True), shape=[2, 300, 333, 4, 2, 192]),
}


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """The selected CASES by name, and each selected INAPPLICABLE_TUNING parameter's default and tuned
    kernel as "<parameter>/default" and "<parameter>/tuned"."""
    specs = {name: {"dtype": "bfloat16", **CASES[name]} for name in sorted(ptx_checks.selected(request, "name"))}
    for parameter in sorted(ptx_checks.selected(request, "parameter")):
        spec, inapplicable = INAPPLICABLE_TUNING[parameter]
        specs[f"{parameter}/default"] = {"dtype": "bfloat16", **spec}
        specs[f"{parameter}/tuned"] = {"dtype": "bfloat16", **spec, "tuning": inapplicable}
    return ptx_checks.compile_batch(_COMPILE, specs, tmp_path_factory.mktemp("sm90_large_heads_ptx"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_wgmma_tma_without_spills(compiled, name):
    path, ptx = compiled[name]
    head_dim = CASES[name]["shape"][-1]
    assert ".target sm_90a" in ptx
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 2 * head_dim // 16 + 12
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx, "no producer/consumer register split"
    assert re.search(r"cp\.reduce\.async\.bulk[^;]*\.add", ptx), "no bulk reduce-add for dQ"
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx), "no TMA store of dK / dV"
    # The dQ turns (ordered_reduction): an acquire spin and a release add, in deterministic mode only.
    deterministic = CASES[name]["config"].get("deterministic", False)
    assert bool(re.search(r"ld(\.[a-z]+)*\.acquire", ptx)) == deterministic
    assert bool(re.search(r"red(\.[a-z]+)*\.release", ptx)) == deterministic
    # Diagonal first reverses the launch order (key block = grid - 1 - blockIdx.x).
    diagonal_first = CASES[name].get("tuning", {}).get("diagonal_first", False) and deterministic
    assert ("%nctaid.x" in ptx) == diagonal_first
    assert ".local" not in ptx, "local memory in the PTX"
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not installed: the PTX was checked, spills were not")
    assert_no_spills(ptxas, path, name)


# Per parametrisation: the spec, and the tuning setting that does not apply in its mode (also what
# tools/kernel_binaries.py compiles for this test).
INAPPLICABLE_TUNING = {
    parameter: (dict(config=dict(scale=256 ** -0.5, causal=True, deterministic=deterministic),
                     shape=[2, 300, 333, 8, 2, 256]), inapplicable)
    for parameter, deterministic, inapplicable in [("unordered_dq", False, dict(diagonal_first=True)),
                                                   ("deterministic", True, dict(stagger=False))]}


@pytest.mark.parametrize("parameter", sorted(INAPPLICABLE_TUNING))
def test_inapplicable_tuning_leaves_the_ptx_unchanged(compiled, parameter):
    """diagonal_first orders deterministic turns only, the stagger is the non-deterministic walk's
    only: each setting outside its mode must give the default kernel, byte for byte."""
    _, default = compiled[f"{parameter}/default"]
    _, tuned = compiled[f"{parameter}/tuned"]
    assert tuned == default
