"""CPU-only: compile the Hopper backward kernel for sm_90a with fake tensors and inspect its PTX.

The PTX must hold the instructions that make the design real: `wgmma.mma_async` (tensor cores),
`cp.async.bulk.tensor` (TMA loads), `setmaxnreg` (producer/consumer register split) and the TMA bulk
reductions that add dQ into global memory (with head splits, dK and dV too, and no dK / dV store;
with packed sequences no TMA dK / dV store either);
the query ring's empty mbarriers must expect an arrival from every consumer thread; and ptxas (when
installed) must report no spills.
The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP at import, so the cases compile in one subprocess
(tests/ptx_checks.compile_batch); each test checks its own case.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

import ptx_checks
from ptx_checks import assert_no_spills

from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm90 import backward as sm90_backward  # noqa: E402
from fa4_jax.kernels.sm90 import backward_common  # noqa: E402
from fa4_jax.kernels.sm90.wgmma import swizzle_columns  # noqa: E402
from tools.sm100_inspect import find_ptxas  # noqa: E402

pytestmark = pytest.mark.slow


_COMPILE = r"""
import json, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward as sm90_backward

spec = json.loads(sys.argv[1])
config = AttentionConfig(**spec["config"])
batch, q_len, kv_len, q_heads, kv_heads, head_dim = spec["shape"]
problem = host.Problem((batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
                       (batch, kv_len, kv_heads, head_dim), spec["dtype"], sequences=spec.get("sequences"))
tuning = sm90_backward.Tuning(**spec.get("tuning", {}), head_splits=spec.get("head_splits", 1))
kernel = sm90_backward.Sm90BackwardKernel(sm90_backward.options(config, problem, tuning))
cute.compile(kernel.__call__, make_fake_stream(),
             *sm90_backward.fake_arguments(config, spec["shape"], spec["dtype"], kernel.head_splits, kernel.tile_m,
                                           kernel.tuning.flat_dq, problem.sequences))
"""

# The default tuning everywhere: D 64 / 96 / 128, causal, GQA, deterministic, and the configurations
# short of registers (softcap, segment ids), where `Sm90BackwardKernel` drops early dV, staged row
# statistics and the TMA dK / dV store. Unsplit unless a case says `head_splits` (the compile does not
# ask `head_splits_for`, so these configurations stay the ones they were before head splits).
CASES = {
    "d128": dict(config=dict(scale=128 ** -0.5), shape=[2, 256, 256, 4, 4, 128]),
    "d128-causal-gqa": dict(config=dict(scale=128 ** -0.5, causal=True), shape=[2, 256, 512, 8, 2, 128]),
    "d128-gqa-deterministic": dict(config=dict(scale=128 ** -0.5, causal=True, deterministic=True),
                                   shape=[2, 256, 512, 8, 2, 128]),
    "d64-causal-fp16": dict(config=dict(scale=0.125, causal=True), shape=[2, 300, 300, 4, 4, 64],
                            dtype="float16"),
    "d64-causal-gqa-deterministic": dict(config=dict(scale=0.125, causal=True, deterministic=True),
                                         shape=[2, 300, 300, 8, 2, 64]),
    "d64-softcap": dict(config=dict(scale=1.0, softcap=5.0), shape=[1, 200, 333, 4, 4, 64]),
    "d96-causal-gqa": dict(config=dict(scale=96 ** -0.5, causal=True), shape=[2, 300, 300, 8, 2, 96]),
    "d96-deterministic": dict(config=dict(scale=96 ** -0.5, deterministic=True),
                              shape=[1, 300, 300, 4, 4, 96]),
    "d96-segments": dict(config=dict(scale=96 ** -0.5, has_segment_ids=True), shape=[1, 300, 300, 4, 4, 96]),
    "d128-softcap-window": dict(config=dict(scale=1.0, softcap=5.0, window_left=64, window_right=32),
                                shape=[1, 200, 333, 4, 4, 128]),
    "d128-segments-lengths": dict(config=dict(scale=128 ** -0.5, has_segment_ids=True,
                                              has_q_seq_lengths=True, has_kv_seq_lengths=True),
                                  shape=[2, 197, 333, 4, 4, 128]),
    "d64-deterministic": dict(config=dict(scale=0.125, deterministic=True), shape=[1, 200, 200, 2, 2, 64]),
    # A sequence-sharded query (q_start): context parallelism's per-shard and ring-step calls.
    "sharded-query": dict(config=dict(scale=128 ** -0.5, causal=True, has_q_start=True, q_total=1024),
                          shape=[1, 256, 1024, 4, 4, 128]),
    # Head splits: fp32 partial dK / dV reduce-added, on GQA; deterministic with two; and the
    # configurations short of registers, which take head splits too.
    "d128-causal-gqa-head-splits-2": dict(config=dict(scale=128 ** -0.5, causal=True),
                                          shape=[2, 300, 333, 8, 2, 128], head_splits=2),
    "d128-gqa-head-splits-4": dict(config=dict(scale=128 ** -0.5), shape=[2, 197, 333, 8, 2, 128],
                                   head_splits=4),
    "d96-causal-mqa-head-splits-4-fp16": dict(config=dict(scale=96 ** -0.5, causal=True),
                                              shape=[1, 300, 300, 8, 1, 96], head_splits=4, dtype="float16"),
    "d64-causal-gqa-head-splits-4": dict(config=dict(scale=0.125, causal=True), shape=[2, 300, 300, 8, 2, 64],
                                         head_splits=4),
    "d128-gqa-deterministic-head-splits-2": dict(
        config=dict(scale=128 ** -0.5, causal=True, deterministic=True), shape=[2, 256, 512, 8, 2, 128],
        head_splits=2),
    "d128-softcap-window-head-splits-2": dict(
        config=dict(scale=1.0, softcap=5.0, window_left=64, window_right=32), shape=[1, 200, 333, 8, 2, 128],
        head_splits=2),
    # The other launch order (key block slowest), alone, and deterministic with head splits (where it
    # is ignored: the key block stays on grid x).
    "d128-causal-gqa-key-blocks-outer": dict(config=dict(scale=128 ** -0.5, causal=True),
                                             shape=[2, 256, 512, 8, 2, 128], tuning=dict(key_blocks_outer=True)),
    "d64-deterministic-key-blocks-outer-head-splits-2": dict(
        config=dict(scale=0.125, causal=True, deterministic=True), shape=[2, 300, 300, 8, 2, 64],
        tuning=dict(key_blocks_outer=True), head_splits=2),
    # The dQ staging as a swizzled tile with two TMA tensor reduces (`Tuning(flat_dq=False)`; the
    # default stages it in register order with one 1-D bulk reduce, except at D = 128's 80 rows): D 128 at
    # 64 rows, D 64 at 128 rows, deterministic GQA D 96, head splits.
    "d128-tiled-dq": dict(config=dict(scale=128 ** -0.5), shape=[2, 256, 256, 4, 4, 128],
                          tuning=dict(flat_dq=False, query_rows=64)),
    "d64-causal-tiled-dq": dict(config=dict(scale=0.125, causal=True), shape=[2, 300, 333, 4, 4, 64],
                                tuning=dict(flat_dq=False)),
    "d96-causal-gqa-deterministic-tiled-dq": dict(
        config=dict(scale=96 ** -0.5, causal=True, deterministic=True), shape=[2, 300, 300, 8, 2, 96],
        tuning=dict(flat_dq=False)),
    "d128-causal-gqa-head-splits-2-tiled-dq": dict(config=dict(scale=128 ** -0.5, causal=True),
                                                   shape=[2, 300, 333, 8, 2, 128], head_splits=2,
                                                   tuning=dict(flat_dq=False)),
    # Deterministic full-mask rows walk in rotated turns by default (`Tuning.rotated_turns`): GQA D 128 with
    # head splits and key lengths (D 64 at 128 rows: d64-deterministic above). The plain turns compile in
    # the causal deterministic cases, where rotated turns resolve off.
    "d128-gqa-lengths-deterministic-rotated-turns": dict(
        config=dict(scale=128 ** -0.5, deterministic=True, has_kv_seq_lengths=True),
        shape=[2, 256, 700, 8, 2, 128], head_splits=2),
    # One dQ writer warp (`Tuning(dq_writers=1)`; deterministic mode's default has one per staging buffer):
    # the rotated full-mask walk at D 128 with head splits and key lengths, the causal turns at D 64 (128
    # rows), and the tiled dQ staging at D 96.
    "d128-gqa-lengths-deterministic-one-dq-writer": dict(
        config=dict(scale=128 ** -0.5, deterministic=True, has_kv_seq_lengths=True),
        shape=[2, 256, 700, 8, 2, 128], head_splits=2, tuning=dict(dq_writers=1)),
    "d64-causal-deterministic-one-dq-writer": dict(
        config=dict(scale=0.125, causal=True, deterministic=True), shape=[2, 300, 333, 4, 4, 64],
        tuning=dict(dq_writers=1)),
    "d96-causal-gqa-deterministic-tiled-dq-one-dq-writer": dict(
        config=dict(scale=96 ** -0.5, causal=True, deterministic=True), shape=[2, 300, 300, 8, 2, 96],
        tuning=dict(flat_dq=False, dq_writers=1)),
    # 80 query rows at D = 128 (`Tuning.query_rows=80`: dQ^T, one dQ staging buffer; the default without a
    # mask, which `d128` compiles): lengths that are no multiple of 80 with Sq != Sk in causal GQA (unsplit),
    # key lengths with a window, fp16.
    "d128-causal-gqa-query-rows-80": dict(config=dict(scale=128 ** -0.5, causal=True), shape=[2, 300, 500, 8, 2, 128],
                                          tuning=dict(query_rows=80)),
    "d128-lengths-window-query-rows-80-fp16": dict(
        config=dict(scale=128 ** -0.5, window_left=100, window_right=20, has_q_seq_lengths=True,
                    has_kv_seq_lengths=True),
        shape=[2, 300, 333, 4, 4, 128], dtype="float16", tuning=dict(query_rows=80)),
    # 64 query rows forced at D = 64 (the default takes 128 there).
    "d64-query-rows-64": dict(config=dict(scale=0.125, causal=True), shape=[2, 300, 333, 4, 4, 64],
                              tuning=dict(query_rows=64)),
    "d128-segments-lengths-head-splits-4": dict(
        config=dict(scale=128 ** -0.5, has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True),
        shape=[2, 197, 333, 8, 2, 128], head_splits=4),
    # dS^T staged with plain 32-bit stores (`Tuning(ds_stmatrix=False)`; the default uses stmatrix,
    # docs/sm90_backward_tuning.md, "SASS budget"): D 128, D 64 at 128 rows, and a configuration short
    # of registers, fp16.
    "d128-ds-plain-store": dict(config=dict(scale=128 ** -0.5), shape=[2, 256, 256, 4, 4, 128],
                                tuning=dict(ds_stmatrix=False)),
    "d64-causal-gqa-deterministic-ds-plain-store": dict(
        config=dict(scale=0.125, causal=True, deterministic=True), shape=[2, 300, 300, 8, 2, 64],
        tuning=dict(ds_stmatrix=False)),
    "d96-segments-ds-plain-store-fp16": dict(config=dict(scale=96 ** -0.5, has_segment_ids=True),
                                             shape=[1, 300, 300, 4, 4, 96], dtype="float16",
                                             tuning=dict(ds_stmatrix=False)),
    # dS^T stored before dV is issued (`Tuning.ds_store_first`, a candidate): D 128 full GQA (80 rows), D 64
    # at 128 rows with plain stores.
    "d128-gqa-ds-store-first": dict(config=dict(scale=128 ** -0.5), shape=[2, 300, 333, 8, 2, 128],
                                    tuning=dict(ds_store_first=True)),
    "d64-ds-store-first-plain-store": dict(config=dict(scale=0.125), shape=[2, 256, 300, 4, 4, 64],
                                           tuning=dict(ds_store_first=True, ds_stmatrix=False)),
    # The staged LSE / dPsum loaded before the waits (`Tuning.row_stats_early`, a candidate, 64 query rows): D 128
    # causal GQA, D 96 deterministic with key lengths.
    "d128-causal-gqa-row-stats-early": dict(config=dict(scale=128 ** -0.5, causal=True), shape=[2, 300, 333, 8, 2, 128],
                                            tuning=dict(row_stats_early=True)),
    "d96-deterministic-kv-lengths-row-stats-early": dict(
        config=dict(scale=96 ** -0.5, deterministic=True, has_kv_seq_lengths=True), shape=[2, 300, 333, 4, 4, 96],
        tuning=dict(row_stats_early=True)),
    # The staged dQ published after the dK wait (`Tuning.dq_publish_after_dk`, a candidate): D 128 causal GQA
    # (64 rows), D 64 deterministic (128 rows, two dQ writers), D 128 full (80 rows, dQ^T).
    **{f"{name}-dq-publish-after-dk": dict(config=dict(scale=0.1, **config), shape=shape,
                                           tuning=dict(dq_publish_after_dk=True))
       for name, config, shape in [("d128-causal-gqa", dict(causal=True), [2, 300, 333, 8, 2, 128]),
                                   ("d64-deterministic", dict(deterministic=True), [2, 300, 300, 4, 4, 64]),
                                   ("d128", dict(), [2, 256, 300, 4, 4, 128])]},
    # P with every 4th (6th at D = 64, whose 128 rows spill 16 bytes with every 4th) of a thread's exp2
    # on the FMA pipe (`Tuning.poly_exp2_every`, a candidate): D 128 causal GQA at 64 rows, D 64
    # deterministic at 128 rows, and softcap (whose slope reads P back).
    "d128-causal-gqa-poly-exp2": dict(config=dict(scale=128 ** -0.5, causal=True), shape=[2, 300, 333, 8, 2, 128],
                                      tuning=dict(poly_exp2_every=4)),
    "d64-deterministic-poly-exp2": dict(config=dict(scale=0.125, deterministic=True), shape=[2, 300, 300, 4, 4, 64],
                                        tuning=dict(poly_exp2_every=6)),
    "d96-softcap-poly-exp2-fp16": dict(config=dict(scale=1.0, softcap=5.0), shape=[1, 300, 300, 4, 4, 96],
                                       dtype="float16", tuning=dict(poly_exp2_every=4)),
    # dQ split by head-dim columns between the warp groups at D = 64's 128 rows (`Tuning.dq_row_split=False`;
    # the default splits by rows there): odd lengths, and causal GQA deterministic.
    "d64-dq-column-split": dict(config=dict(scale=0.125), shape=[2, 300, 333, 4, 4, 64],
                                tuning=dict(dq_row_split=False)),
    "d64-causal-gqa-deterministic-dq-column-split": dict(config=dict(scale=0.125, causal=True, deterministic=True),
                                                         shape=[2, 300, 300, 8, 2, 64],
                                                         tuning=dict(query_rows=128, dq_row_split=False)),
    # Packed variable-length sequences (attention_varlen: batch 1, N sequences, cu_seqlens at run time):
    # one CTA per (sequence, key block), the tiled dQ staging, dK / dV by per-element stores. GQA without
    # a mask; causal deterministic (turn counters per query slot); a window, fp16; softcap with sinks (the
    # configuration short of registers).
    "varlen-d128-gqa": dict(config=dict(scale=128 ** -0.5, has_cu_seqlens=True), shape=[1, 700, 900, 8, 2, 128],
                            sequences=7),
    "varlen-d64-causal-deterministic": dict(config=dict(scale=0.125, causal=True, deterministic=True,
                                                        has_cu_seqlens=True),
                                            shape=[1, 700, 900, 4, 4, 64], sequences=7),
    "varlen-d96-window-gqa-fp16": dict(config=dict(scale=96 ** -0.5, window_left=100, window_right=20,
                                                   has_cu_seqlens=True),
                                       shape=[1, 500, 400, 6, 2, 96], sequences=3, dtype="float16"),
    "varlen-d128-softcap-sinks": dict(config=dict(scale=1.0, softcap=20.0, has_sinks=True, has_cu_seqlens=True),
                                      shape=[1, 300, 300, 4, 4, 128], sequences=5),
}


def _problem(shape, dtype="bfloat16", sequences=None):
    batch, q_len, kv_len, q_heads, kv_heads, head_dim = shape
    return host.Problem((batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
                        (batch, kv_len, kv_heads, head_dim), dtype, sequences=sequences)


def _kernel(spec):
    tuning = sm90_backward.Tuning(**spec.get("tuning", {}), head_splits=spec.get("head_splits", 1))
    problem = _problem(spec["shape"], spec.get("dtype", "bfloat16"), spec.get("sequences"))
    return sm90_backward.Sm90BackwardKernel(sm90_backward.options(AttentionConfig(**spec["config"]), problem, tuning))


def _bulk_reduce_count(head_dim, head_splits, dq_writers=1):
    """TMA reduce-adds in the PTX: one per 128-byte-swizzle-wide column block (fewer columns where the
    width does not divide by them) of the dQ halves in each dQ writer's loop, and with head splits of dK
    and dV too."""
    dq_half = head_dim // 2
    count = 2 * dq_half // swizzle_columns(dq_half, 32) * dq_writers
    if head_splits > 1:
        count += 2 * head_dim // swizzle_columns(head_dim, 32)
    return count


def _query_release_counts(ptx):
    """The arrival counts the query ring's two empty mbarriers are initialised with: they sit at bytes
    16 and 24 of the barrier block (after the two full barriers); the count is an immediate or the
    register a `mov` sets."""
    counts = []
    for offset in (16, 24):
        init = re.search(rf"mbarrier\.init\.shared(::cta)?\.b64\s+\[%r\d+\+{offset}\],\s*(%r\d+|\d+);", ptx)
        assert init, f"no mbarrier.init at +{offset}"
        count = init.group(2)
        if count.startswith("%"):
            count = re.search(rf"mov\.[bu]32\s+{re.escape(count)},\s*(\d+);", ptx).group(1)
        counts.append(int(count))
    return counts


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    names = ptx_checks.selected(request, "name")
    return ptx_checks.compile_batch(_COMPILE, {name: {"dtype": "bfloat16", **CASES[name]} for name in sorted(names)},
                                    tmp_path_factory.mktemp("sm90_backward_ptx"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_wgmma_tma_and_reductions(compiled, name):
    path, ptx = compiled[name]
    kernel = _kernel(CASES[name])
    # Every consumer thread releases a query stage (each reads its staged LSE / dPsum).
    assert _query_release_counts(ptx) == [kernel.consumer_threads] * 2
    assert ".target sm_90a" in ptx
    # 5 GEMMs per query block: S^T, dP^T (K = D), dV, dK (K = the query rows), dQ (K = 128 keys).
    assert len(re.findall(r"wgmma\.mma_async", ptx)) >= 5, "no tensor-core wgmma"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx, "no producer/consumer register split"
    # 4d, or 3d where a batch of one drops its mode.
    dkv_store = re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)
    if kernel.head_splits > 1:
        assert not dkv_store, "head splits add dK / dV, they do not store them"
    elif kernel.tma_dkv_store:   # the tuning as the kernel applies it to this config
        assert dkv_store, "no TMA store of dK / dV"
    # Packed sequences start anywhere in the packed rows: dK / dV by per-element stores clipped at the
    # sequence's end (a tile store would overwrite the next sequence's keys), the row statistics by
    # per-thread loads (bulk copies need aligned rows).
    if kernel.packed:
        assert not dkv_store and "cp.async.bulk.shared::cluster.global" not in ptx
    reduces = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.add\.", ptx)
    if kernel.tuning.flat_dq:
        # dQ: one 1-D bulk reduce-add per block; tensor reduces only for head-split dK / dV.
        assert re.search(r"cp\.reduce\.async\.bulk\.global\.shared::cta[^;]*\.add\.f32", ptx), "no dQ bulk add"
        assert len(reduces) == _bulk_reduce_count(kernel.head_dim, kernel.head_splits) - _bulk_reduce_count(
            kernel.head_dim, 1), len(reduces)
    else:
        assert "cp.reduce.async.bulk.tensor" in ptx and ".add." in ptx, "no TMA reduce-add for dQ"
        assert len(reduces) == _bulk_reduce_count(kernel.head_dim, kernel.head_splits, kernel.dq_writers), \
            len(reduces)
    assert not re.search(r"red(\.[a-z]+)*\.global(\.[a-z0-9]+)*\.add\.f32", ptx), "per-element dQ red.add"
    if kernel.tuning.flat_dq:
        # One dQ writer warp, or one per staging buffer (`Tuning.dq_writers`), each with its own writer loop.
        dq_adds = re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta[^;]*\.add\.f32", ptx)
        assert len(dq_adds) == kernel.dq_writers, (len(dq_adds), kernel.dq_writers)
    # The dQ turns (ordered_reduction), in deterministic mode only: an acquire spin, and the pass as a fence
    # then a relaxed add (a release pattern without a release red's second fence).
    deterministic = CASES[name]["config"].get("deterministic", False)
    assert bool(re.search(r"ld(\.[a-z]+)*\.acquire", ptx)) == deterministic
    assert bool(re.search(r"red\.relaxed\.gpu\.global\.add\.s32", ptx)) == deterministic
    assert not re.search(r"red(\.[a-z]+)*\.release", ptx), "the turn's pass fenced twice"
    assert ("fence.acq_rel.gpu" in ptx) == deterministic
    if deterministic and not kernel.rotated_turns:
        # The dQ turn order is highest key block first, launched in that order (rotated turns: the
        # arrival order of walks that start at the key block's own index, launched lowest first).
        axis = "z" if kernel.key_blocks_outer else "x"
        assert f"%nctaid.{axis}" in ptx, "key block not taken from the end of the grid"
    # dS^T goes to shared memory through stmatrix with the candidate only (the forward's O epilogue
    # has its own; this kernel has none else).
    stmatrix = re.findall(r"stmatrix\.sync\.aligned[.\w]*", ptx)
    assert set(stmatrix) == ({"stmatrix.sync.aligned.m8n8.x4.shared.b16"} if kernel.tuning.ds_stmatrix else set())
    # dQ's wgmmas: N = D / 2 (warp groups split the head dim), or N = D with the row split; dQ^T at 80
    # rows: N = the query rows, as S^T and dP^T, so no N = D / 2 at all.
    dq_columns = kernel.head_dim if kernel.tuning.dq_row_split else kernel.head_dim // 2
    if kernel.dq_transposed:
        dq_columns = kernel.tile_m
        assert not re.search(rf"m64n{kernel.head_dim // 2}k16", ptx), "dQ not transposed"
        assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{kernel.tile_m}k16", ptx)) == \
            3 * kernel.tile_n // 16, "S^T, dP^T (K = D = 128) and dQ^T (K = 128 keys): 8 k-steps each"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{dq_columns}k16", ptx), "no dQ wgmma"
    if kernel.tuning.dq_row_split:
        assert not re.search(rf"m64n{kernel.head_dim // 2}k16", ptx), "dQ still split by columns"
    # The FMA-pipe exp2 (a floor by rounded add, no conversion-pipe instruction) with the candidate only.
    assert ("add.rm.f32" in ptx) == bool(kernel.tuning.poly_exp2_every)
    assert ".local" not in ptx, "local memory in the PTX"
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not installed: the PTX was checked, spills were not")
    assert_no_spills(ptxas, path, name)


@pytest.mark.parametrize("head_splits,deterministic", [(3, False), (8, True), (4, True), (0, False)])
def test_head_splits_the_kernel_cannot_do_are_refused(head_splits, deterministic):
    """A split must divide the group (here 8); deterministic mode takes at most 2, whose two partial
    sums add onto zero in either order to the same bits. `options` refuses them, and so does the
    kernel's constructor given such options directly."""
    config = AttentionConfig(scale=0.125, causal=True, deterministic=deterministic)
    problem = _problem([1, 256, 256, 8, 1, 64])
    with pytest.raises(ValueError, match="head_splits"):
        sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=head_splits))
    options = dataclasses.replace(sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=1)),
                                  head_splits=head_splits)
    with pytest.raises(ValueError, match="head_splits"):
        sm90_backward.Sm90BackwardKernel(options)


def test_a_split_past_the_grid_limit_is_refused_by_options():
    """kv_heads * head_splits is gridDim.y: a forced split past CUDA's limit fails in `options`, before
    any compile, and `head_splits_for` never chooses one."""
    problem = _problem([1, 128, 128, 4 * 40000, 40000, 64])
    config = AttentionConfig(scale=0.125)
    assert sm90_backward.unsupported_reason(config, problem) is None
    with pytest.raises(ValueError, match="gridDim.y"):
        sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=2))
    assert 40000 * sm90_backward.options(config, problem).head_splits <= host.MAX_GRID_Y_Z


def test_the_resolved_split_is_the_compile_key():
    """`options` resolves head_splits=None into the options (the compile key) and leaves the tuning's
    None there, so a forced split and the same split chosen compile once."""
    config = AttentionConfig(scale=128 ** -0.5, causal=True)
    problem = _problem([8, 2048, 2048, 16, 1, 128])
    chosen = sm90_backward.options(config, problem)
    assert chosen.head_splits > 1 and chosen.tuning.head_splits is None
    assert sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=chosen.head_splits)) == chosen
    assert sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=1)).head_splits == 1


@pytest.mark.parametrize("head_dim,extra,tuning,match", [
    (64, dict(), dict(), "head dims"), (96, dict(), dict(), "head dims"),
    (128, dict(deterministic=True), dict(), "deterministic mode runs 64 rows"),
    (128, dict(causal=True, deterministic=True), dict(), "deterministic mode runs 64 rows"),
    (128, dict(softcap=5.0), dict(), "softcap or segment ids"),
    (128, dict(), dict(head_splits=2), "head_splits"),
    (128, dict(), dict(dq_row_split=True), "needs 128 query rows"), (128, dict(), dict(ds_stmatrix=False), "stmatrix")])
def test_80_query_rows_are_refused_where_dq_transposed_cannot_run(head_dim, extra, tuning, match):
    """80 query rows compute dQ^T with the head dim split into two warp groups' 64 rows (D = 128 only), with
    the stmatrix dS store, and leave room for one dQ staging buffer, not the two of deterministic mode's
    two dQ writers (where 80 rows with one writer measured slower); the 64-row rules about softcap and
    head splits hold too. Taken where none of these apply, with the tiled dQ staging (flat_dq resolved
    off) and one dQ staging buffer; the kernel refuses the register order and determinism given directly."""
    config = AttentionConfig(scale=head_dim ** -0.5, **extra)
    with pytest.raises(ValueError, match=match):
        sm90_backward.options(config, _problem([1, 256, 256, 8, 2, head_dim]),
                              sm90_backward.Tuning(query_rows=80, **tuning))
    taken = sm90_backward.options(AttentionConfig(scale=128 ** -0.5, causal=True), _problem([1, 256, 256, 8, 2, 128]),
                                  sm90_backward.Tuning(query_rows=80))
    assert taken.tuning.query_rows == 80 and taken.head_splits == 1 and not taken.tuning.flat_dq
    kernel = sm90_backward.Sm90BackwardKernel(taken)
    assert kernel.dq_transposed and kernel.dq_buffers == 1
    assert kernel.shared_memory_bytes() <= backward_common.SHARED_MEMORY_BYTES
    flat = dataclasses.replace(taken, tuning=dataclasses.replace(taken.tuning, flat_dq=True))
    with pytest.raises(ValueError, match="swizzled"):
        sm90_backward.Sm90BackwardKernel(flat)
    with pytest.raises(ValueError, match="deterministic mode runs 64 rows"):
        sm90_backward.Sm90BackwardKernel(dataclasses.replace(taken, deterministic=True))


@pytest.mark.parametrize("head_dim,extra,match", [
    (128, dict(), "head dims"), (64, dict(softcap=5.0), "softcap or segment ids"),
    (64, dict(has_segment_ids=True), "softcap or segment ids"), (64, dict(), "must be one of")])
def test_query_rows_the_kernel_cannot_take_are_refused(head_dim, extra, match):
    """128 query rows fit registers and shared memory at D = 64 only, and not beside softcap or segment
    ids (those spill); other counts are not tile shapes. `options` refuses them by name; at D = 64
    without either, and with an explicit head split of 1, 128 rows are taken."""
    config = AttentionConfig(scale=head_dim ** -0.5, **extra)
    problem = _problem([1, 256, 256, 4, 4, head_dim])
    rows = 96 if match == "must be one of" else 128
    with pytest.raises(ValueError, match=match):
        sm90_backward.options(config, problem, sm90_backward.Tuning(query_rows=rows))
    wide = sm90_backward.options(AttentionConfig(scale=0.125), _problem([1, 256, 256, 8, 2, 64]),
                                 sm90_backward.Tuning(query_rows=128))
    assert wide.tuning.query_rows == 128 and wide.head_splits == 1
    with pytest.raises(ValueError, match="head_splits"):
        sm90_backward.options(AttentionConfig(scale=0.125), _problem([1, 256, 256, 8, 2, 64]),
                              sm90_backward.Tuning(query_rows=128, head_splits=2))


@pytest.mark.parametrize("head_dim,tuning,match", [
    (128, dict(dq_row_split=True), "needs 128 query rows"), (64, dict(dq_row_split=True, query_rows=64), "needs 128"),
    (64, dict(dq_row_split=True, flat_dq=False), "flat_dq=True")])
def test_dq_row_split_is_refused_where_no_warp_group_has_64_rows_of_its_own(head_dim, tuning, match):
    """The row split gives each warp group 64 of 128 query rows, staged in the register order: other row
    counts and the tiled dQ staging are refused by `options`, before anything compiles."""
    with pytest.raises(ValueError, match=match):
        sm90_backward.options(AttentionConfig(scale=head_dim ** -0.5), _problem([1, 256, 256, 4, 4, head_dim]),
                              sm90_backward.Tuning(**tuning))
    split = sm90_backward.options(AttentionConfig(scale=0.125), _problem([1, 256, 256, 4, 4, 64]),
                                  sm90_backward.Tuning(dq_row_split=True))
    assert split.tuning.query_rows == 128 and split.tuning.dq_row_split


@pytest.mark.parametrize("shape,tuning,expected", [
    ([1, 256, 256, 4, 4, 64], dict(), True),                       # D = 64 takes 128 rows: split by rows
    ([1, 256, 256, 4, 4, 64], dict(dq_row_split=False), False),    # kept by columns when asked
    ([1, 256, 256, 4, 4, 64], dict(flat_dq=False), False),         # the tiled staging: by columns
    ([1, 256, 256, 4, 4, 64], dict(query_rows=64), False),         # 64 rows: one atom a warp group already
    ([1, 256, 256, 4, 4, 128], dict(), False),                     # D = 128 runs 64 rows
])
def test_dq_row_split_resolves_where_128_rows_are_chosen(shape, tuning, expected):
    """`Tuning.dq_row_split=None` (the default) resolves to the row split exactly where the options
    take 128 query rows with the register-order dQ staging, so the compile key holds the choice."""
    options = sm90_backward.options(AttentionConfig(scale=shape[-1] ** -0.5), _problem(shape),
                                    sm90_backward.Tuning(**tuning))
    assert options.tuning.dq_row_split is expected


@pytest.mark.parametrize("shape,extra,rows", [
    ([2, 1024, 1024, 8, 8, 64], dict(), 128), ([2, 1024, 1024, 8, 8, 64], dict(deterministic=True), 128),
    ([2, 1024, 1024, 8, 8, 64], dict(softcap=5.0), 64), ([2, 1024, 1024, 8, 8, 64], dict(has_segment_ids=True), 64),
    ([2, 1024, 1024, 8, 8, 128], dict(), 80), ([2, 4096, 4096, 64, 8, 128], dict(), 80),
    ([2, 1024, 1024, 8, 8, 128], dict(causal=True), 64), ([2, 1024, 1024, 8, 8, 128], dict(window_left=100), 64),
    ([2, 1024, 1024, 8, 8, 128], dict(deterministic=True), 64), ([2, 1024, 1024, 8, 8, 128], dict(softcap=5.0), 64),
    ([2, 1024, 1024, 8, 8, 96], dict(), 64), ([1, 2048, 2048, 16, 1, 64], dict(causal=True), None)])
def test_query_rows_default(shape, extra, rows):
    """`options` takes 128 query rows wherever the kernel can (D = 64 without softcap, segment ids or a
    head split), 80 at D = 128 without a mask, determinism, softcap or segment ids (where it measured
    faster), else 64; a head split chosen by head_splits_for (MQA here) keeps 64."""
    config = AttentionConfig(scale=shape[-1] ** -0.5, **extra)
    options = sm90_backward.options(config, _problem(shape))
    if rows is None:
        assert options.head_splits > 1
        rows = 64
    assert options.tuning.query_rows == rows
    assert sm90_backward.Sm90BackwardKernel(options).tile_m == rows


# Prepended to the trace scripts below: a coordinate tensor's coordinates read from its iterator and layout
# (the definition of such a tensor), ~3x faster to trace than indexing it, which builds an op per index;
# one index per tensor is still compared with the indexing.
COORDINATES = r"""
import cutlass.cute as cute

def coordinates(tensor):
    origin, size = tuple(tensor.iterator), cute.size(tensor)
    found = [tuple(o + d for o, d in zip(origin, tensor.layout(v))) for v in range(size)]
    assert found[size // 2] == tuple(tensor[size // 2]), "not a coordinate tensor"
    return found
"""


# Traces (on the CPU, no kernel launched) where the plain stores and stmatrix put each consumer
# thread's dS^T values, as (key, query) coordinates. Plain: register value v at partition_C's
# coordinate v. stmatrix (non-transposed .x4, the PTX ISA's semantics): copy call c moves value u of
# lane l of a warp, which is matrix u // 2's row l // 4, column 2 (l % 4) + u % 2, to the row address
# that lane 8 (u // 2) + l // 4 of the same warp supplies, i.e. to that lane's destination
# coordinate (2 (l % 4) + u % 2) of call c; `retile` must keep the register order (value u + 8 c of
# the call order is register value u + 8 c), and each supplied row must be 8 consecutive queries of
# one key (16 contiguous bytes of the query-contiguous sdS).
_DS_STORE_CHECK = r"""
import json, sys
import cutlass, cutlass.cute as cute
from cutlass import Float32
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward as sm90_backward
spec = json.loads(sys.argv[1])
head_dim = spec["head_dim"]
query = (1, 256, 4, head_dim)
problem = host.Problem(query, query, query, spec["dtype"])
kernel = sm90_backward.Sm90BackwardKernel(sm90_backward.options(
    AttentionConfig(scale=head_dim ** -0.5), problem,
    sm90_backward.Tuning(ds_stmatrix=True, query_rows=spec["query_rows"])))
found = {"rows": kernel.tile_m, "mismatches": 0, "not_in_order": 0, "rows_not_contiguous": 0, "coordinates": set()}

@cute.jit
def trace():
    mma_sdp, _, _ = kernel._tiled_mmas()
    store = kernel._ds_store_copy(mma_sdp)
    identity = cute.make_identity_tensor((kernel.tile_n, kernel.tile_m))
    threads = kernel.consumer_threads
    # Every coordinate is read out once (evaluating them is the bulk of the time).
    plain = [coordinates(mma_sdp.get_slice(t).partition_C(identity)) for t in range(threads)]
    rows = [coordinates(store.get_slice(t).partition_D(identity)) for t in range(threads)]
    for t in cutlass.range_constexpr(threads):
        fragment = cute.make_rmem_tensor(mma_sdp.get_slice(t).partition_shape_C(
            (kernel.tile_n, kernel.tile_m)), Float32)
        retiled = store.get_slice(t).retile(fragment).layout
        values = len(plain[t])
        assert cute.size(retiled) == len(rows[t]) == values and values % 8 == 0
        lane, warp = t % 32, t - t % 32
        for v in cutlass.range_constexpr(values):
            call, u = v // 8, v % 8
            found["not_in_order"] += int(retiled(v) != v)
            supplier = warp + 8 * (u // 2) + lane // 4
            written = rows[supplier][8 * call + 2 * (lane % 4) + u % 2]
            found["mismatches"] += int(written != plain[t][v])
            found["coordinates"].add(written)
            key, first = rows[t][8 * call]
            found["rows_not_contiguous"] += int(first % 8 != 0 or rows[t][v] != (key, first + u))

trace()
found["coordinates"] = len(found["coordinates"])
print("DS_STORE " + json.dumps(found))
"""


@pytest.mark.parametrize("head_dim,query_rows,rows", [(128, 64, 64), (64, None, 128), (128, None, 80)])
def test_ds_stmatrix_stores_what_the_plain_stores_store(head_dim, query_rows, rows, tmp_path):
    """`Tuning.ds_stmatrix` changes how dS^T reaches shared memory, not where each value goes: for every
    consumer thread and register value, stmatrix (as the PTX ISA defines it) writes it at the plain
    store's coordinate, and the values cover the [keys, queries] tile once (64, 80 and 128 query rows).
    The compile test checks that the copy is the non-transposed x4 form this models."""
    found = _trace(_DS_STORE_CHECK, {"head_dim": head_dim, "dtype": "bfloat16", "query_rows": query_rows},
                   tmp_path, "DS_STORE")
    assert found == {"rows": rows, "mismatches": 0, "not_in_order": 0, "rows_not_contiguous": 0,
                     "coordinates": sm90_backward.TILE_N * rows}


def _trace(script_text, spec, tmp_path, tag):
    """Run a DSL trace script (a file: the DSL compiles a function from its source; COORDINATES' helper
    before it) on `spec` and return the JSON it prints after `tag`."""
    import json
    import subprocess
    import sys

    from ptx_checks import compile_environment

    script = tmp_path / "trace.py"
    script.write_text(COORDINATES + script_text)
    result = subprocess.run([sys.executable, str(script), json.dumps(spec)],
                            env=compile_environment(tmp_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith(tag + " "))
    return json.loads(line[len(tag) + 1:])


# Where `_stage_dq` (flat_dq) puts each consumer thread's dQ values: register value v of consumer thread
# t (warp group t // 128) at ((g K + v // 4) 128 + t % 128) 4 + v % 4 of the block, K = values / 4,
# the value being dQ at the (query, head-dim) coordinate the kernel's own dQ tiled MMA gives it
# (partition_C of an identity tensor over (rows, D)).
_DQ_STAGING_TRACE = r"""
import json, sys
import cutlass, cutlass.cute as cute
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward as sm90_backward
spec = json.loads(sys.argv[1])
head_dim = spec["head_dim"]
query = (1, 256, 4, head_dim)
problem = host.Problem(query, query, query, "bfloat16")
tuning = sm90_backward.Tuning(query_rows=spec["query_rows"], dq_row_split=spec["row_split"])
kernel = sm90_backward.Sm90BackwardKernel(sm90_backward.options(AttentionConfig(scale=head_dim ** -0.5), problem, tuning))
placed = {}

@cute.jit
def trace():
    _, _, mma_dq = kernel._tiled_mmas()
    identity = cute.make_identity_tensor((kernel.tile_m, head_dim))
    for t in cutlass.range_constexpr(kernel.consumer_threads):
        values = coordinates(mma_dq.get_slice(t).partition_C(identity))
        chunks = len(values) // 4
        for v in cutlass.range_constexpr(len(values)):
            position = (((t // 128) * chunks + v // 4) * 128 + t % 128) * 4 + v % 4
            placed.setdefault(position, []).append(values[v])

trace()
print("DQ_STAGING " + json.dumps({"rows": kernel.tile_m,
                                  "placed": sorted((p, c) for p, cs in placed.items() for c in cs)}))
"""


@pytest.mark.parametrize("head_dim,query_rows,row_split", [(128, 64, False), (64, 128, False), (64, 128, True)])
def test_flat_dq_reader_inverts_the_kernels_staging(head_dim, query_rows, row_split, tmp_path):
    """The dQ staging order and its reader agree through the kernel's own dQ tiled MMA: every position
    of a block holds one dQ element, and `backward_common.dq_from_fragments` (with one column group
    where `dq_row_split` gives each warp group whole rows) puts each at its (query, head-dim) place (64
    and 128 query rows).
    tests/test_kernel_building_blocks.py checks the reader against the PTX ISA's fragment layout instead."""
    import numpy as np

    from fa4_jax.kernels.sm90 import backward_common

    found = _trace(_DQ_STAGING_TRACE, {"head_dim": head_dim, "query_rows": query_rows, "row_split": row_split},
                   tmp_path, "DQ_STAGING")
    assert found["rows"] == query_rows
    positions = [position for position, _ in found["placed"]]
    assert sorted(positions) == list(range(query_rows * head_dim)), "a position staged twice or never"
    flat = np.zeros(query_rows * head_dim, np.float32)
    for position, (row, column) in found["placed"]:
        flat[position] = row * head_dim + column
    rows = np.asarray(backward_common.dq_from_fragments(query_rows, column_groups=1 if row_split else 2)(
        flat.reshape(1, 1, 1, -1), query_rows))
    np.testing.assert_array_equal(rows[0, :, 0], np.arange(query_rows * head_dim).reshape(query_rows, head_dim))


# (kernel module, D, Dv, keys a CTA): backward.py, and the large-head kernel's layouts (64 keys at D = 256, 96
# with D = 192's three warp groups, at Dv = 192 and MLA's 128), each with `Tuning.rotated_turns` as its deterministic
# default.
ROTATED_TURN_KERNELS = {"d128": ("backward", 128, 128, 128),
                        "large-heads-d256": ("backward_large_heads", 256, 256, 64),
                        "large-heads-d192": ("backward_large_heads", 192, 192, 96),
                        "large-heads-d192-v128": ("backward_large_heads", 192, 128, 96)}


@pytest.mark.parametrize("kernel", sorted(ROTATED_TURN_KERNELS))
@pytest.mark.parametrize("extra, key_blocks, expected", [
    ({}, 32, True),
    ({}, 66, True),                                 # at most half of the 132 SMs
    ({}, 67, False),                                # a head's key blocks cannot all be resident with room to spare
    ({"causal": True}, 32, False),                  # the turns of a full mask only
    ({"window_left": 100}, 32, False),
    ({"has_segment_ids": True}, 32, False),
    ({"has_q_start": True, "q_total": 8192}, 32, False),
    ({"has_kv_seq_lengths": True}, 32, True),       # lengths shorten both walks and turns alike
])
def test_rotated_turns_resolve_where_they_are_safe(extra, key_blocks, expected, kernel):
    """`Tuning.rotated_turns` survives `options` only for deterministic full-mask calls whose key blocks (of the
    kernel's layout) fit on half the SMs (132 here, the CPU's stand-in), and never without determinism; the
    large-head kernel then walks staggered and launches lowest key block first."""
    import importlib

    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT

    assert DEFAULT_SM_COUNT == 132
    module_name, head_dim, v_head_dim, keys = ROTATED_TURN_KERNELS[kernel]
    module = importlib.import_module(f"fa4_jax.kernels.sm90.{module_name}")
    kv_len = key_blocks * keys
    problem = host.Problem((2, kv_len, 8, head_dim), (2, kv_len, 8, head_dim), (2, kv_len, 8, v_head_dim), "bfloat16")
    tuning = dataclasses.replace(module.DEFAULT_TUNING, rotated_turns=True)
    for deterministic in (True, False):
        config = AttentionConfig(scale=0.1, deterministic=deterministic, **extra)
        options = module.options(config, problem, tuning)
        assert options.tuning.rotated_turns == (expected and deterministic), (extra, kv_len, deterministic)
        assert (module.rotated_turns_reason(config, problem, tuning) is None) == (expected and deterministic)
        if module_name == "backward_large_heads":
            built = module.Sm90LargeHeadBackwardKernel(options)
            assert built.rotated_turns == options.tuning.rotated_turns
            assert built.stagger == (built.rotated_turns or not deterministic)
            assert built.diagonal_first == (deterministic and not built.rotated_turns)


def test_dq_writers_resolve_to_one_without_determinism():
    """`Tuning.dq_writers` (a writer warp per dQ staging buffer) shortens the deterministic turns only:
    `options` resolves it to 1 elsewhere, and the kernel refuses a count other than 1 or DQ_BUFFERS."""
    from fa4_jax.kernels.sm90 import backward

    problem = host.Problem((2, 1024, 8, 128), (2, 1024, 8, 128), (2, 1024, 8, 128), "bfloat16")
    tuning = dataclasses.replace(backward.DEFAULT_TUNING, dq_writers=backward.DQ_BUFFERS)
    for deterministic, causal in itertools.product((True, False), (True, False)):
        config = AttentionConfig(scale=0.1, deterministic=deterministic, causal=causal)
        resolved = backward.options(config, problem, tuning)
        assert resolved.tuning.dq_writers == (backward.DQ_BUFFERS if deterministic else 1)
        backward.Sm90BackwardKernel(resolved)
    config = AttentionConfig(scale=0.1, deterministic=True)
    with pytest.raises(ValueError, match="dq_writers=3"):
        backward.Sm90BackwardKernel(backward.options(config, problem, dataclasses.replace(tuning, dq_writers=3)))
