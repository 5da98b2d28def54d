"""Compile the Hopper forward kernel for sm_90a on the CPU and check what it became (runs in CI).

The DSL reads CUTE_DSL_ARCH / CUTE_DSL_KEEP once, at import, so the compiles run in one subprocess
with those set; each configuration's PTX is then checked for the instructions that make the design
real: wgmma (tensor cores), cp.async.bulk.tensor (TMA), setmaxnreg (register reallocation between
producer and consumers) and mbarrier waits, and for the absence of local memory. Where `ptxas` is
installed, its report must show no spills.

The configurations are what `sm90.forward.options` picks (the tuned defaults: three consumer
warpgroups with every pipeline option at D = 64, Q double buffer + TMA-store epilogue at D = 80 / 96 /
128 with the split key loop and zigzag tile order when causal, `LARGE_HEAD_CAUSAL` at D = 256 causal:
ping-pong, TMA store in two chunks, early Q release, zigzag; `LARGE_HEAD_FULL`, the same less zigzag, at
D = 256 full), plus overrides where an option is only
reachable that way; each is checked for the instructions its effective options add.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from ptx_checks import assert_no_spills, compile_environment

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from tools.sm100_inspect import find_ptxas  # noqa: E402


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (AttentionConfig fields, [B, Sq, Sk, Hq, Hkv, D] or [B, Sq, Sk, Hq, Hkv, D, Dv] (Dv: the value
# head dim, D when not given), dtype, KernelOptions overrides)
CONFIGS = {
    # D = 128 non-causal: Q double buffer + TMA store.
    "d128": ({}, [2, 1000, 1000, 4, 4, 128], "bfloat16", {}),
    # D = 64 causal, Sq below the three-warpgroup cut: Q double buffer + TMA store.
    "d64-causal-short": ({"causal": True}, [2, 1000, 1000, 4, 4, 64], "bfloat16", {}),
    # D = 64 causal above the cut: three consumer warpgroups (160 registers) with every pipeline option,
    # here with the features that fit them (sinks, lengths, GQA).
    "d64-causal-three-warpgroups-sinks-lengths-fp16": (
        {"causal": True, "has_sinks": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True},
        [2, 3000, 3100, 4, 2, 64], "float16", {}),
    # D = 64 with a softcap, window and segments (which spill at 160 registers): two warpgroups.
    "d64-all-features-long": (
        {"causal": True, "softcap": 30.0, "has_sinks": True, "has_segment_ids": True, "window_left": 300,
         "has_q_seq_lengths": True, "has_kv_seq_lengths": True},
        [2, 1600, 1700, 4, 2, 64], "bfloat16", {}),
    "d256-gqa-fp16": ({}, [1, 300, 700, 8, 2, 256], "float16", {}),
    # D = 256 causal: ping-pong barriers.
    "d256-causal": ({"causal": True}, [2, 1000, 1000, 4, 4, 256], "bfloat16", {}),
    # The promoted D = 256 causal set spelled out (the TMA store in two column chunks, early Q release,
    # zigzag tile order), and zigzag at D = 128.
    "d256-causal-store-chunks-early-q-zigzag": (
        {"causal": True}, [2, 1000, 1000, 4, 4, 256], "bfloat16",
        {"tma_store": True, "store_chunks": 2, "early_q_release": True, "zigzag_tiles": True,
         "mirrored_tiles": False}),
    "d128-causal-zigzag": ({"causal": True}, [2, 1000, 1000, 4, 4, 128], "bfloat16",
                           {"zigzag_tiles": True, "mirrored_tiles": False}),
    # The D = 256 causal defaults with every feature that adds registers or shared memory.
    "d256-causal-all-features": (
        {"causal": True, "softcap": 30.0, "has_sinks": True, "has_segment_ids": True, "window_left": 300,
         "has_q_seq_lengths": True, "has_kv_seq_lengths": True},
        [2, 700, 900, 4, 2, 256], "float16", {}),
    "d96-window": ({"window_left": 100, "window_right": 0}, [1, 500, 500, 2, 2, 96], "bfloat16", {}),
    "d192-all-features": (
        {"causal": True, "softcap": 30.0, "has_sinks": True, "has_segment_ids": True,
         "has_q_seq_lengths": True, "has_kv_seq_lengths": True},
        [2, 300, 400, 4, 2, 192], "bfloat16", {}),
    # D = 192 (D192 / D192_CAUSAL: ping-pong, the TMA store in three chunks, early Q release; zigzag and
    # the split key loop when causal), here with lengths (the store's clipping) in fp16, and the
    # candidate's 112-key blocks.
    "d192": ({}, [2, 1000, 1000, 4, 4, 192], "bfloat16", {}),
    "d192-causal-lengths-fp16": (
        {"causal": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True}, [2, 1000, 900, 4, 2, 192],
        "float16", {}),
    "d192-n112-pingpong": ({}, [2, 1000, 1000, 4, 4, 192], "bfloat16",
                           {"key_block": 112, "tma_store": False, "store_chunks": 1}),
    # DeepSeek MLA, D = 192 with Dv = 128 (EXTRA_HEAD_DIM_PAIRS): the D = 192 sets with 128-key blocks and
    # the TMA store in two chunks (forward.MLA); causal with lengths (the store's clipping), GQA and
    # Sq != Sk, in bf16 and fp16; packed (per-row stores).
    "d192-v128": ({}, [2, 1000, 1000, 4, 4, 192, 128], "bfloat16", {}),
    "d192-v128-causal-lengths-gqa": (
        {"causal": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True}, [2, 1000, 900, 8, 2, 192, 128],
        "bfloat16", {}),
    "d192-v128-causal-lengths-fp16": (
        {"causal": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True}, [2, 1000, 900, 8, 2, 192, 128],
        "float16", {}),
    "d192-v128-packed-causal-gqa-fp16": ({"causal": True, "has_cu_seqlens": True}, [1, 1000, 1100, 8, 2, 192, 128],
                                         "float16", {}),
    "d128-polynomial-exp2": ({"causal": True}, [1, 512, 512, 2, 2, 128], "bfloat16", {"poly_exp2_every": 2}),
    # The D = 64 candidates (TUNING_CANDIDATES d64-poly4 / d64-poly8): full, and causal with lengths.
    "d64-polynomial-exp2": ({}, [2, 1000, 1000, 4, 4, 64], "bfloat16", {"poly_exp2_every": 4}),
    "d64-causal-lengths-polynomial-exp2": (
        {"causal": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True}, [2, 1000, 900, 4, 2, 64],
        "bfloat16", {"poly_exp2_every": 8}),
    # D = 80 (its own kernel, 32-byte swizzled tiles: m64n128k16 Q K^T, m64n80k16 P V) causal GQA with
    # lengths in fp16: Q double buffer + TMA store (5 boxes a warpgroup) + split key loop + mirrored tiles.
    "d80-causal-lengths-gqa-fp16": (
        {"causal": True, "has_q_seq_lengths": True, "has_kv_seq_lengths": True}, [2, 1000, 900, 4, 2, 80],
        "float16", {}),
    # Packed variable-length sequences (attention_varlen): B = 1, the offsets' length in PACKED_SEQUENCES.
    # D = 128 causal GQA (split key loop, zigzag), D = 64 with every other mask feature, D = 256 causal
    # (LARGE_HEAD_CAUSAL less the TMA store).
    "d128-packed-causal-gqa": ({"causal": True, "has_cu_seqlens": True}, [1, 1000, 1100, 4, 2, 128], "bfloat16", {}),
    "d64-packed-window-softcap-sinks-fp16": (
        {"window_left": 100, "window_right": 20, "softcap": 30.0, "has_sinks": True, "has_cu_seqlens": True},
        [1, 3000, 2500, 4, 1, 64], "float16", {}),
    "d256-packed-causal-one-sequence": ({"causal": True, "has_cu_seqlens": True}, [1, 700, 900, 4, 4, 256],
                                        "bfloat16", {}),
}
# Sequences N of the packed configurations (cu_seqlens of N + 1 entries).
PACKED_SEQUENCES = {"d128-packed-causal-gqa": 7, "d64-packed-window-softcap-sinks-fp16": 30,
                    "d256-packed-causal-one-sequence": 1, "d192-v128-packed-causal-gqa-fp16": 5}

_COMPILE = r"""
import dataclasses, glob, json, os, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import forward as sm90_forward

configs = json.loads(sys.argv[1])
packed_sequences = json.loads(sys.argv[2])
dump = os.environ["CUTE_DSL_DUMP_DIR"]

result = {}
for name, (fields, shape, dtype, overrides) in configs.items():
    B, Sq, Sk, Hq, Hkv, D, *rest = shape
    Dv = rest[0] if rest else D
    config = AttentionConfig(scale=D ** -0.5, **fields)
    problem = host.Problem((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv), dtype,
                           sequences=packed_sequences.get(name))
    reason = sm90_forward.unsupported_reason(config, problem)
    assert reason is None, reason
    options = sm90_forward.options(config, problem, sm_count=132, **overrides)
    kernel = sm90_forward.Sm90ForwardKernel(options)
    cute.compile(kernel, make_fake_stream(),
                 *host.forward_fake_arguments(config, shape, dtype, packed_sequences.get(name)))
    # The DSL names the file after the kernel's arguments, so configurations that differ only in
    # options write the same file: move each one out of the way under its configuration's name.
    new = glob.glob(os.path.join(dump, "cutlass_*.ptx"))
    assert len(new) == 1, new
    path = os.path.join(dump, name + ".ptx")
    os.replace(new[0], path)
    effective = {field: getattr(options, field) for field in ("consumer_warpgroups", "q_stages", "tma_store",
                 "split_masked_loop", "poly_exp2_every", "pingpong_max_head_dim", "head_dim", "v_head_dim",
                 "tile_n", "packed")}
    result[name] = {"ptx": path, "options": effective}
print("SM90_PTX " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{config name: PTX path}, all compiled in one subprocess for sm_90a."""
    directory = tmp_path_factory.mktemp("sm90_ptx")
    process = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CONFIGS), json.dumps(PACKED_SEQUENCES)],
                             env=compile_environment(directory),
                             capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("SM90_PTX "))
    return json.loads(line[len("SM90_PTX "):])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ptx_has_hopper_instructions(compiled, name):
    with open(compiled[name]["ptx"]) as handle:
        ptx = handle.read()
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx, "no tensor-core wgmma"
    assert "cp.async.bulk.tensor" in ptx, "no TMA loads"
    assert re.search(r"setmaxnreg\.dec", ptx) and re.search(r"setmaxnreg\.inc", ptx), "no register reallocation"
    assert "mbarrier.try_wait" in ptx, "no mbarrier pipeline"
    assert not re.search(r"\.local\b|ld\.local|st\.local", ptx), "local memory in the PTX"
    options = compiled[name]["options"]
    if options["poly_exp2_every"]:
        assert "add.rm.f32" in ptx, "polynomial exp2 missing"
    if options["consumer_warpgroups"] == 3:
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;", ptx), "consumers not raised to 160 registers"
    if options["tma_store"]:
        assert "stmatrix.sync.aligned" in ptx, "O not written to shared memory with stmatrix"
        assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx), "no TMA store of O"
        assert "cp.async.bulk.wait_group.read" in ptx, "shared O buffer reused without waiting for the TMA store"
        assert "fence.proxy.async.shared::cta" in ptx, "no proxy fence between stmatrix and the TMA store"
    if options["head_dim"] <= options["pingpong_max_head_dim"]:
        assert re.search(r"bar\.sync\s+%r\d+, 256;", ptx), "no ping-pong scheduler barrier"
    # Q K^T's wgmma is as wide as the key block, P V's as Dv (MLA's V is not padded inside the kernel).
    for width in (options["tile_n"], options["v_head_dim"]):
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{width}k16\.", ptx), f"no m64n{width}k16 wgmma"
    if options["packed"]:
        assert not options["tma_store"] and not re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx), \
            "a TMA store of O, which would clip at the array's end, not at the sequence's"


@pytest.mark.parametrize("name", sorted(PACKED_SEQUENCES))
def test_packed_offsets_are_read_at_run_time_by_binary_search(compiled, name):
    """The packed scheduler's design in the PTX: the offsets are int32 loads at run time (one compile
    serves every packing), and each of the two roles (producer warp, consumers) reads, per work item,
    ceil(log2(N + 2)) offsets for the search of its slot's sequence plus at most 4 for that sequence's
    query and key extents (the compiler may fold some when N is small): no per-sequence table, no scan
    over the N sequences (which would take >= N loads per role: 30 in the D = 64 configuration).
    Besides them, b32 global loads are only the sink logit's (one, by the consumers)."""
    with open(compiled[name]["ptx"]) as handle:
        ptx = handle.read()
    search_steps = (PACKED_SEQUENCES[name] + 1).bit_length()
    sink_loads = int(CONFIGS[name][0].get("has_sinks", False))
    offset_loads = len(re.findall(r"ld\.global(?:\.nc)?\.(?:b32|u32|s32)\s", ptx)) - sink_loads
    assert 2 * search_steps < offset_loads <= 2 * (search_steps + 4), (offset_loads, search_steps)


def test_tuning_options_are_checked():
    """Options that cannot make a kernel are refused before compiling, with the reason; the tuned
    defaults of every supported head dim (and MLA's 192/128) fit."""
    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    def options_for(head_dim, causal=False, q_len=256, v_head_dim=None):
        shape = (1, q_len, 2, head_dim)
        value = shape[:3] + (v_head_dim or head_dim,)
        return sm90_forward.options(AttentionConfig(scale=0.1, causal=causal),
                                    host.Problem(shape, shape, value, "bfloat16"), sm_count=132)

    options = options_for(128)
    for overrides, reason in [({"consumer_warpgroups": 3}, "registers"), ({"consumer_warpgroups": 4}, "consumer_warpgroups"),
                              ({"q_stages": 3}, "q_stages")]:
        with pytest.raises(ValueError, match=reason):
            dataclasses.replace(options, **overrides).check()
    with pytest.raises(ValueError, match="shared memory"):
        dataclasses.replace(options_for(256), q_stages=2).check()
    for head_dim in sm90_forward.SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for q_len in (1024, 4096):
                options_for(head_dim, causal, q_len).check()
    assert options_for(64, True, 1024).consumer_warpgroups == 2
    assert options_for(64, True, 2048).consumer_warpgroups == 2
    assert options_for(64, True, 2944).consumer_warpgroups == 3
    assert options_for(64, False, 1024).consumer_warpgroups == 3
    long_shape = (1, 4096, 2, 64)
    softcapped = sm90_forward.options(AttentionConfig(scale=0.1, softcap=5.0),
                                      host.Problem(long_shape, long_shape, long_shape, "bfloat16"), sm_count=132)
    assert softcapped.consumer_warpgroups == 2 and softcapped.q_stages == 2
    assert options_for(96).q_stages == 2 and options_for(128, True).split_masked_loop
    # The split key loop (docs/sm90_forward_tuning.md, seventh round): D <= 128 full and causal, D = 64
    # causal below the three-group cut; not a window without the causal mask, nor D = 64's softcap.
    assert options_for(128).split_masked_loop and options_for(96).split_masked_loop
    assert options_for(64, True, 1024).split_masked_loop and not softcapped.split_masked_loop
    windowed = sm90_forward.options(AttentionConfig(scale=0.1, window_left=256),
                                    host.Problem(long_shape[:3] + (128,), long_shape[:3] + (128,),
                                                 long_shape[:3] + (128,), "bfloat16"), sm_count=132)
    assert not windowed.split_masked_loop
    d80, d80_causal = options_for(80), options_for(80, True)
    assert (d80.tile_n, d80.num_stages, d80.q_stages, d80.tma_store, d80.consumer_warpgroups) == (128, 2, 2, True, 2)
    assert d80_causal.split_masked_loop and d80_causal.mirrored_tiles
    assert options_for(256, True).pingpong_max_head_dim == 256 and options_for(256).pingpong_max_head_dim == 256
    # D = 256 full: causal's epilogue (two TMA-store chunks, early Q release) without the zigzag order.
    d256 = options_for(256)
    assert (d256.tma_store, d256.store_chunks, d256.early_q_release, d256.zigzag_tiles) == (True, 2, True, False)
    for causal in (False, True):
        mla = options_for(192, causal, 4096, v_head_dim=128)
        mla.check()
        # The D = 192 set with MLA's 128-key blocks and the O store in two 64-column chunks
        # (forward.MLA); three chunks do not divide Dv = 128.
        assert (mla.tile_n, mla.store_chunks, mla.tma_store, mla.split_masked_loop) == (128, 2, True, causal)
        with pytest.raises(ValueError, match="store_chunks 3"):
            dataclasses.replace(mla, store_chunks=3).check()


_EPILOGUE_LAYOUT = r"""
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from fa4_jax.kernels.sm90.wgmma import accumulator_mn

mismatches, checked = [], []
THREADS = (0, 1, 2, 3, 4, 5, 8, 13, 31, 32, 47, 64, 90, 127)  # every lane role of the wgmma C layout

@cute.jit
def compare():
    dtype = cutlass.BFloat16
    for warpgroups, n in ((2, 64), (3, 64), (2, 80)):   # Dv = 80: two warpgroups only (KernelOptions.check)
        def pv_mma(atoms):
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, cutlass.Float32,
                atom_layout_mnk=(atoms, 1, 1), tiler_mn=(64, n), a_source=warpgroup.OperandSource.RMEM)
        tile, one = pv_mma(warpgroups), pv_mma(1)
        for thread in THREADS:
            in_one = one.get_slice(thread).partition_C(cute.make_identity_tensor((64, n)))
            for w in cutlass.range_constexpr(warpgroups):
                in_tile = tile.get_slice(thread + 128 * w).partition_C(cute.make_identity_tensor((64 * warpgroups, n)))
                for i in cutlass.range_constexpr(cute.size(in_one)):
                    checked.append(1)
                    if cutlass.const_expr((in_tile[i][0] - 64 * w, in_tile[i][1]) != (in_one[i][0], in_one[i][1])):
                        mismatches.append((warpgroups, n, thread, w, i))

chunk_mismatches, chunk_checked = [], []

@cute.jit
def compare_chunks():
    # store_chunks: chunk k of a thread's (rows, columns) view of its Dv = 256 accumulator must be the
    # (rows, columns) view of a one-warpgroup N = 256 / chunks MMA, shifted by k * 256 / chunks columns.
    dtype = cutlass.BFloat16
    for chunks in cutlass.range_constexpr(2, 5, 2):
        width = 256 // chunks
        def pv_mma(atoms, n):
            return sm90_utils.make_trivial_tiled_mma(
                dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, cutlass.Float32,
                atom_layout_mnk=(atoms, 1, 1), tiler_mn=(64, n), a_source=warpgroup.OperandSource.RMEM)
        tile, one = pv_mma(2, 256), pv_mma(1, width)
        for thread in THREADS:
            in_one = accumulator_mn(one.get_slice(thread).partition_C(cute.make_identity_tensor((64, width))))
            for w in cutlass.range_constexpr(2):
                in_tile = accumulator_mn(tile.get_slice(thread + 128 * w).partition_C(
                    cute.make_identity_tensor((128, 256))))
                chunk_width = cute.size(in_one, mode=[1])
                for k in cutlass.range_constexpr(chunks):
                    for r in cutlass.range_constexpr(cute.size(in_one, mode=[0])):
                        for c in cutlass.range_constexpr(chunk_width):
                            chunk_checked.append(1)
                            full = in_tile[r, k * chunk_width + c]
                            if cutlass.const_expr((full[0] - 64 * w, full[1] - k * width) != (in_one[r, c][0], in_one[r, c][1])):
                                chunk_mismatches.append((chunks, thread, w, k, r, c))

compare()
print("EPILOGUE_LAYOUT", len(checked), len(mismatches), mismatches[:5])
compare_chunks()
print("EPILOGUE_CHUNKS", len(chunk_checked), len(chunk_mismatches), chunk_mismatches[:5])
"""


def test_tma_store_epilogue_layout(tmp_path):
    """The TMA-store epilogue partitions each warpgroup's O buffer with a one-warpgroup MMA: thread t of
    warpgroup w must hold, in the same register order, rows 64 w + (the rows thread t holds there), at
    Dv = 64 and at D = 80's 80 columns;
    with store_chunks, chunk k of its columns must be that MMA's columns + k Dv / chunks."""
    script = tmp_path / "epilogue_layout.py"  # the DSL compiles functions from their source file
    script.write_text(_EPILOGUE_LAYOUT)
    environment = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, str(script)], env=environment, capture_output=True,
                             text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("EPILOGUE_LAYOUT"))
    _, checked, mismatched, examples = line.split(" ", 3)
    assert int(checked) == 14 * ((2 + 3) * 32 + 2 * 40) and int(mismatched) == 0, examples
    line = next(line for line in process.stdout.splitlines() if line.startswith("EPILOGUE_CHUNKS"))
    _, checked, mismatched, examples = line.split(" ", 3)
    assert int(checked) == 2 * 14 * 2 * 128 and int(mismatched) == 0, examples


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_register_spills(compiled, name):
    assert_no_spills(find_ptxas(), compiled[name]["ptx"], name)


_LOWER_VARLEN = r"""
import json, warnings
import jax, jax.numpy as jnp
import fa4_jax
from fa4_jax.lowering import cuda
cuda.compute_capability = lambda: (9, 0)   # lower for an H100/H200 on this CPU
query = jax.ShapeDtypeStruct((700, 4, 128), jnp.bfloat16)
key = jax.ShapeDtypeStruct((900, 2, 128), jnp.bfloat16)
sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
offsets = jax.ShapeDtypeStruct((6,), jnp.int32)

def calls(function, *arguments):
    text = jax.jit(function).trace(*arguments).lower(lowering_platforms=("cuda",)).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    return ([line.split(" : ")[-1] for line in lines if "sm90_forward" in line],
            [line.split(" : ")[-1] for line in lines if "sm90_backward" in line], len(lines))

forward = lambda q, k, v, s, a, b: fa4_jax.attention_varlen(q, k, v, a, b, causal=True, sinks=s, return_lse=True,
                                                            implementation="cute")
loss = lambda q, k, v, s, a, b: fa4_jax.attention_varlen(q, k, v, a, b, causal=True, sinks=s).astype(jnp.float32).sum()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gradient = calls(jax.grad(loss), query, key, key, sinks, offsets, offsets)
print("LOWERED " + json.dumps({"forward": calls(forward, query, key, key, sinks, offsets, offsets),
                               "gradient": gradient, "warnings": [str(w.message) for w in caught]}))
"""


def test_attention_varlen_lowers_for_cuda_to_the_packed_kernel(tmp_path):
    """attention_varlen on an sm_90 GPU (faked: the DSL compiles for sm_90a on this CPU) lowers its
    forward to the sm90 kernel, with the packing as batch 1 and both offset arrays as int32 [N + 1]
    operands; its gradient runs that forward kernel and the sm90 backward kernel, which takes the
    offsets too and adds dQ into the tiled fp32 accumulator [1, Tq padded to 64-row blocks, Hq, D]
    (no other custom call, no fallback warning)."""
    environment = dict(compile_environment(tmp_path), FA4_JAX_CACHE_DIR=str(tmp_path))
    process = subprocess.run([sys.executable, "-c", _LOWER_VARLEN], env=environment, capture_output=True,
                             text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    lowered = json.loads(line[len("LOWERED "):])
    kernel_call = ("(tensor<1x700x4x128xbf16>, tensor<1x900x2x128xbf16>, tensor<1x900x2x128xbf16>, tensor<4xf32>, "
                   "tensor<6xi32>, tensor<6xi32>) -> (tensor<1x700x4x128xbf16>, tensor<1x4x700xf32>)")
    backward_call = ("(tensor<1x700x4x128xbf16>, tensor<1x900x2x128xbf16>, tensor<1x900x2x128xbf16>, "
                     "tensor<1x700x4x128xbf16>, tensor<1x4x704xf32>, tensor<1x4x704xf32>, tensor<6xi32>, tensor<6xi32>, "
                     "tensor<1x704x4x128xf32>) -> (tensor<1x704x4x128xf32>, tensor<1x900x2x128xbf16>, "
                     "tensor<1x900x2x128xbf16>)")
    assert lowered["forward"] == [[kernel_call], [], 1], lowered
    assert lowered["gradient"] == [[kernel_call], [backward_call], 2], lowered
    assert not any("reference path" in w for w in lowered["warnings"]), lowered["warnings"]
