"""The split-KV paged decode kernel (fa4_jax/kernels/sm90/decode.py) on the CPU: compiled for sm_90a and
sm_100a with its PTX checked for the design (mma.sync tensor cores, ldmatrix, 16-byte cp.async with a
multistage wait, no local memory; no spills where ptxas is installed), its split-count heuristic, what
it refuses, and the combine pass (plain JAX) against a float64 softmax over all keys. The combine kernel
(`combine="kernel"`, decode_combine.py) compiles in the same processes: its PTX's loads, and its merge run
through the PTX interpreter against the XLA one.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
import ptx_addresses
from ptx_checks import assert_no_spills, compile_environment

pytest.importorskip("cutlass")
from fa4_jax.kernels.sm90 import decode  # noqa: E402
from tools.sm100_inspect import find_ptxas  # noqa: E402


# name -> (AttentionConfig fields, [B, Sq, Hq, Hkv, D, max_blocks], dtype, page size, arch[, DecodeOptions
# overrides]). The cases compile the last-CTA combine (`combine="last_cta"`: its arrival protocol is what the
# PTX checks and the PTX interpreter below are about) unless their overrides say otherwise; the default,
# the XLA combine, is the "d128-xla-combine" case, the cluster combine the "cluster" cases.
LAST_CTA = {"combine": "last_cta"}
CONFIGS = {
    "d128-gqa4-page16": ({}, [2, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_90a"),
    "d128-q4-page64-sinks": ({"has_sinks": True}, [8, 4, 32, 8, 128, 32], "bfloat16", 64, "sm_90a"),
    "d64-softcap-window-fp16-page7": ({"softcap": 30.0, "window_left": 100}, [3, 4, 8, 2, 64, 20], "float16", 7,
                                      "sm_90a"),
    "d256-64-rows": ({}, [2, 8, 16, 2, 256, 10], "bfloat16", 64, "sm_90a"),
    "d128-mqa-page1-window": ({"window_left": 5, "window_right": 0}, [1, 3, 6, 1, 128, 300], "bfloat16", 1,
                              "sm_90a"),
    "d128-contiguous": ({}, [4, 2, 8, 8, 128, 1], "bfloat16", 4096, "sm_90a"),
    # The case the first H200 run was bisected on (every case failed: misaligned shared addresses).
    "d64-fp16-page64-sinks": ({"has_sinks": True}, [2, 1, 8, 2, 64, 8], "float16", 64, "sm_90a"),
    # Tuning alternatives: 32 keys per warp with two stages, and a four-stage ring of 64-key blocks.
    "d128-tile128-stages2": ({}, [2, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_90a", {"tile_n": 128, "num_stages": 2}),
    "d128-stages4": ({}, [2, 4, 32, 8, 128, 64], "bfloat16", 64, "sm_90a", {"num_stages": 4}),
    # One split: the CTA writes the final O (sinks folded in) itself; and the XLA combine's variant.
    "d128-one-split-sinks": ({"has_sinks": True}, [2, 4, 32, 8, 128, 8], "bfloat16", 16, "sm_90a", {"num_splits": 1}),
    "d128-xla-combine": ({}, [1, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_90a", {"combine": "xla"}),
    # The cluster combine: 16 splits of one block (B = 1, 1k, the benchmark's row), 4 query tokens with
    # sinks on 3 splits, and D = 256 (two merge passes' worth of items on 2 splits).
    "d128-cluster-16": ({}, [1, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_90a", {"combine": "cluster"}),
    "d128-q4-cluster-sinks": ({"has_sinks": True}, [2, 4, 32, 8, 128, 3], "bfloat16", 64, "sm_90a",
                              {"combine": "cluster"}),
    "d256-cluster-2": ({}, [8, 2, 16, 2, 256, 2], "bfloat16", 64, "sm_90a", {"combine": "cluster", "num_splits": 2}),
    # The benchmark's 8k row (32 splits of 4 blocks) with its page numbers loaded right before their cp.async
    # (`page_lookahead=False`; every other case loads them a block ahead, the default).
    "d128-no-page-lookahead": ({}, [1, 1, 32, 8, 128, 512], "bfloat16", 16, "sm_90a",
                               {"combine": "xla", "page_lookahead": False}),
    "sm100-d128-cluster": ({}, [1, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_100a", {"combine": "cluster"}),
    "sm100-d128-gqa4-page16": ({}, [2, 1, 32, 8, 128, 64], "bfloat16", 16, "sm_100a"),
    "sm100-d64-softcap": ({"softcap": 20.0}, [2, 2, 8, 2, 64, 16], "float16", 32, "sm_100a"),
}

# The combine kernel (`combine="kernel"`, fa4_jax/kernels/sm90/decode_combine.py), compiled in the same
# processes: name -> (AttentionConfig fields, [B, Sq, Hq, Hkv, D], dtype, arch, splits). The sm_90a case is
# the one the PTX interpreter merges below: Sq 4 x 5 heads a group (20 rows: a full 16-row tile and one of
# 4), sinks, and 37 splits (a group of 32 loads in flight, then one of 5); the sm_100a one is the benchmark's
# B = 1 8k row (32 splits).
COMBINE_CONFIGS = {
    "combine-q4-gqa5-37-splits-sinks": ({"has_sinks": True}, [2, 4, 10, 2, 64], "bfloat16", "sm_90a", 37),
    "sm100-combine-d128-32-splits": ({}, [1, 1, 32, 8, 128], "bfloat16", "sm_100a", 32),
}

_COMPILE = r"""
import glob, json, os, sys
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import decode, decode_combine

# The combine cases come second, where given (tools/kernel_binaries.py passes the decode cases alone).
configs, combine_configs = json.loads(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
dump = os.environ["CUTE_DSL_DUMP_DIR"]
result = {}
for name, (fields, shape, dtype, page, _, *overrides) in configs.items():
    B, Sq, Hq, Hkv, D, max_blocks = shape
    config = AttentionConfig(scale=D ** -0.5, causal=True, has_kv_seq_lengths=True, **fields)
    logical = (B, max_blocks * page, Hkv, D)
    problem = host.Problem((B, Sq, Hq, D), logical, logical, dtype, page_size=page)
    assert decode.unsupported_reason(config, problem) is None
    overrides = {"combine": "last_cta", **(overrides[0] if overrides else {})}   # LAST_CTA, then the case's
    options = decode.options(config, problem, sm_count=132, **overrides)
    cute.compile(decode.Sm90DecodeKernel(options), make_fake_stream(),
                 *decode.fake_arguments(options, B, Hkv, 50, max_blocks, fields.get("has_sinks", False)))
    (new,) = glob.glob(os.path.join(dump, "cutlass_*.ptx"))
    path = os.path.join(dump, name + ".ptx")
    os.replace(new, path)
    result[name] = {"ptx": path, "stages": options.num_stages, "splits": options.num_splits}
for name, (fields, (B, Sq, Hq, Hkv, D), dtype, _, splits) in combine_configs.items():
    config = AttentionConfig(scale=D ** -0.5, causal=True, has_kv_seq_lengths=True, **fields)
    logical = (B, 64 * 16, Hkv, D)
    problem = host.Problem((B, Sq, Hq, D), logical, logical, dtype, page_size=16)
    options = decode.combine_options(decode.options(config, problem, sm_count=132, combine="kernel",
                                                    num_splits=splits), fields.get("has_sinks", False))
    cute.compile(decode_combine.Sm90DecodeCombineKernel(options), make_fake_stream(),
                 *decode_combine.fake_arguments(options, B, Hkv))
    (new,) = glob.glob(os.path.join(dump, "cutlass_*.ptx"))
    path = os.path.join(dump, name + ".ptx")
    os.replace(new, path)
    result[name] = {"ptx": path, "splits": options.num_splits}
print("DECODE_PTX " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{name: {ptx, stages, splits}} (the combine kernel's cases: {ptx, splits}): one compile subprocess per
    architecture."""
    result = {}
    for arch in sorted({config[4] for config in CONFIGS.values()} | {config[3] for config in COMBINE_CONFIGS.values()}):
        directory = tmp_path_factory.mktemp(f"decode_{arch}")
        selected = {name: config for name, config in CONFIGS.items() if config[4] == arch}
        combines = {name: config for name, config in COMBINE_CONFIGS.items() if config[3] == arch}
        environment = dict(compile_environment(directory), CUTE_DSL_ARCH=arch)
        process = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(selected), json.dumps(combines)],
                                 env=environment, capture_output=True, text=True, timeout=900)
        assert process.returncode == 0, process.stderr[-4000:]
        line = next(line for line in process.stdout.splitlines() if line.startswith("DECODE_PTX "))
        result.update(json.loads(line[len("DECODE_PTX "):]))
    return result


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ptx_has_the_design(compiled, name):
    with open(compiled[name]["ptx"]) as handle:
        ptx = handle.read()
    assert f".target {CONFIGS[name][4]}" in ptx
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)", ptx), "no mma.sync tensor cores"
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx, "no ldmatrix"
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx, "V^T not read with transposing ldmatrix"
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, 16;", ptx), "no 16-byte cp.async"
    wait = compiled[name]["stages"] - 2
    assert re.search(rf"cp\.async\.wait_group\s+{wait};", ptx), f"no multistage wait (wait_group {wait})"
    assert not re.search(r"\.local\b|ld\.local|st\.local", ptx), "local memory in the PTX"
    assert "wgmma" not in ptx and "cp.async.bulk" not in ptx  # arch-neutral by design
    options = _compiled_options(name)
    arrivals = re.findall(r"atom\.global(?:\.acq_rel)?(?:\.gpu)?\.add\.[us]32", ptx)
    if options.combine == "last_cta" and options.num_splits > 1:
        # The last-CTA combine: partial stores, a device-scope fence, then one acq_rel arrival per CTA, and
        # a fence again before the last CTA reads the partials.
        assert re.findall(r"atom\.global\.acq_rel(?:\.gpu)?\.add\.[us]32", ptx) == arrivals and len(arrivals) == 1, \
            f"expected one acq_rel device-scope atomic add, found {arrivals}"
        fences = [m.start() for m in re.finditer(r"fence\.acq_rel\.gpu;", ptx)]
        atomic = ptx.index(arrivals[0])
        last_partial_store = ptx.rindex("st.global", 0, atomic)
        assert any(last_partial_store < f < atomic for f in fences), "no fence between the partials and the arrival"
        assert any(f > atomic for f in fences), "no fence between the arrival and the last CTA's reads"
    else:
        assert not arrivals, "an arrival counter where no split waits for another"
    arrives = [m.start() for m in re.finditer(r"barrier\.cluster\.arrive;", ptx)]
    waits = [m.start() for m in re.finditer(r"barrier\.cluster\.wait;", ptx)]
    remote_loads = [m.start() for m in re.finditer(r"ld\.shared::cluster", ptx)]
    if options.combine == "cluster" and options.num_splits > 1:
        # Release / acquire around the partials in shared memory, every remote load between the first
        # wait and the second arrive (no CTA leaves while a peer may read it), no global partial.
        assert len(arrives) == len(waits) == 2 and arrives[0] < waits[0] < arrives[1] < waits[1], (arrives, waits)
        assert remote_loads and all(waits[0] < load < arrives[1] for load in remote_loads)
        assert all(m.start() > waits[0] for m in re.finditer(r"st\.global", ptx)), "a global store before the merge"
    else:
        assert not arrives and not waits and not remote_loads, "cluster barriers or remote loads without a cluster"


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(name for name in CONFIGS if CONFIGS[name][4] == "sm_90a"))
def test_no_register_spills(compiled, name):
    assert_no_spills(find_ptxas(), compiled[name]["ptx"], name)


# Where the address check puts each buffer (256-byte aligned, as XLA's are, and far apart), in the
# kernel's parameter order (sinks only where the config has them).
_BUFFERS = ("q", "k", "v", "tables", "lengths", "sinks", "semaphore", "partial_o", "partial_lse", "out", "lse")
_BASES = {name: (index + 1) << 36 for index, name in enumerate(_BUFFERS)}
_FAKE_BLOCKS = 50   # cache blocks of the compile's fake tensors (decode.fake_arguments)


def _compiled_options(name):
    fields, (B, Sq, Hq, Hkv, D, max_blocks), dtype, page, _, *overrides = CONFIGS[name]
    config = AttentionConfig(scale=D ** -0.5, causal=True, has_kv_seq_lengths=True, **fields)
    logical = (B, max_blocks * page, Hkv, D)
    problem = host.Problem((B, Sq, Hq, D), logical, logical, dtype, page_size=page)
    return decode.options(config, problem, sm_count=132, **{**LAST_CTA, **(overrides[0] if overrides else {})})


def _shapes(options, name):
    _, (B, Sq, Hq, Hkv, D, max_blocks), *_ = CONFIGS[name]
    o_shape, lse_shape = decode.partial_shapes(options, B, Hkv)
    cache = (_FAKE_BLOCKS, options.page_size, Hkv, D)
    return {"q": (B, Sq, Hq, D), "k": cache, "v": cache, "tables": (B, max_blocks), "lengths": (B,),
            "sinks": (Hq,), "semaphore": decode.semaphore_shape(options, B, Hkv), "partial_o": o_shape,
            "partial_lse": lse_shape, "out": (B, Sq, Hq, D), "lse": (B, Hq, Sq)}


def _element_bytes(buffer):
    return 2 if buffer in ("q", "k", "v", "out") else 4


@pytest.mark.parametrize("name", ["d64-fp16-page64-sinks", "d64-softcap-window-fp16-page7", "d256-64-rows",
                                  "d128-tile128-stages2", "d128-one-split-sinks"])
def test_every_access_is_aligned_and_in_bounds(compiled, name, rng):
    """Two CTAs of the compiled PTX, run thread by thread on the CPU (tests/ptx_addresses.py) over a
    paged cache (random block ids, garbage past each sequence's last page): every 16-byte cp.async has
    16-byte aligned source and destination, every ldmatrix row address is 16-byte aligned, every load
    and store is aligned to its width and inside its buffer (shared: the CTA's allocation), no table
    entry past a sequence's last page is read. The first CTA is not the last of its (batch, head tile)
    to arrive (its counter reads 0): it writes its split's partial rows, O and LSE, every element once,
    and nothing else. The second is the last (its counter reads splits - 1): it also reads every split's
    partial rows of its head tile, writes the final O and LSE of the tile's rows, every element once, and
    zeroes its counter. With one split a CTA writes the final O and LSE directly and no partial. The
    first H200 run failed on the ldmatrix / cp.async alignment."""
    options = _compiled_options(name)
    fields, (B, Sq, Hq, Hkv, D, max_blocks), *_ = CONFIGS[name]
    buffers = [b for b in _BUFFERS if b != "sinks" or fields.get("has_sinks")]
    program, params, shapes, sizes, memory, pages = _interpreter_inputs(compiled, name, options, buffers, rng)
    head_tiles = Hkv * options.row_tiles
    splits = options.num_splits
    shared_end = 1024 + options.shared_memory_bytes()
    for block, last in [((0, head_tiles - 1, 0), splits == 1), ((splits - 1, 0, B - 1), True)]:
        split, head_tile, batch = block
        counter = _BASES["semaphore"] + 4 * (batch * head_tiles + head_tile)
        cta_memory = {**memory, counter: splits - 1 if last else 0}
        shared = {}
        touched = {b: collections.defaultdict(list) for b in buffers}
        for thread in range(decode.THREADS):
            for access in ptx_addresses.thread_accesses(program, thread, block, params, cta_memory,
                                                        shared_memory=shared):
                _check_access(access, f"{name} CTA {block} thread {thread}: {access}", buffers, sizes,
                              shared_end, max_blocks, pages, touched)

        def elements(buffer, index):
            return sorted(np.arange(int(np.prod(shapes[buffer]))).reshape(shapes[buffer])[index].ravel().tolist())

        rows = options.rows - head_tile % options.row_tiles * decode.TILE_M
        rows = min(rows, decode.TILE_M)
        expected_writes = {"semaphore": [], "partial_o": [], "partial_lse": [], "out": [], "lse": []}
        if splits > 1:
            expected_writes["partial_o"] = elements("partial_o", (batch, head_tile, split, slice(0, rows)))
            expected_writes["partial_lse"] = elements("partial_lse", (batch, head_tile, split, slice(0, rows)))
        if last:
            head_kv, first = head_tile // options.row_tiles, head_tile % options.row_tiles * decode.TILE_M
            packed = np.arange(first, first + rows)
            positions, heads = packed // options.group, head_kv * options.group + packed % options.group
            expected_writes["out"] = elements("out", (batch, positions, heads))
            expected_writes["lse"] = elements("lse", (batch, heads, positions))
            if splits > 1:
                expected_writes["semaphore"] = [batch * head_tiles + head_tile]
                for buffer in ("partial_o", "partial_lse"):
                    read = elements(buffer, (batch, head_tile, slice(None), slice(0, rows)))
                    assert sorted(set(touched[buffer]["ld.global"])) == read, f"{name} CTA {block}: {buffer} reads"
        for buffer, expected in expected_writes.items():
            assert sorted(touched[buffer]["st.global"]) == expected, f"{name} CTA {block}: {buffer} elements"
        arrivals = touched["semaphore"]["atom.global"]
        assert arrivals == ([batch * head_tiles + head_tile] if splits > 1 else []), f"{name} CTA {block}: counter"


def _interpreter_inputs(compiled, name, options, buffers, rng):
    """What the PTX interpreter runs case `name` on: its parsed program (one 8-byte pointer parameter per
    buffer, checked), the parameters' bytes (each buffer at its `_BASES` address), the buffers' shapes
    and byte sizes, and the paged cache's lengths and tables (`_paged_cache`) with pages per sequence."""
    _, (batch, *_, max_blocks), *_ = CONFIGS[name]
    with open(compiled[name]["ptx"]) as handle:
        program = ptx_addresses.parse(handle.read())
    assert [size for _, size in program.params] == [8] * len(buffers), f"expected {len(buffers)} tensor pointers"
    params = {param: _BASES[buffer].to_bytes(8, "little") for (param, _), buffer in zip(program.params, buffers)}
    shapes = _shapes(options, name)
    sizes = {b: int(np.prod(shapes[b])) * _element_bytes(b) for b in buffers}
    memory, pages = _paged_cache(options, batch, max_blocks, rng)
    return program, params, shapes, sizes, memory, pages


def _paged_cache(options, batch, max_blocks, rng):
    """({address: value} of the lengths (the first sequence fills its table, the others are random) and
    the block tables (random blocks, garbage past each sequence's last page), pages per sequence)."""
    max_len = max_blocks * options.page_size
    lengths = [max_len] + [int(rng.integers(1, max_len + 1)) for _ in range(batch - 1)]
    pages = [-(-length // options.page_size) for length in lengths]
    memory = {_BASES["lengths"] + 4 * b: length for b, length in enumerate(lengths)}
    for b in range(batch):
        for j in range(max_blocks):
            block = int(rng.integers(0, _FAKE_BLOCKS)) if j < pages[b] else int(rng.choice([-7, _FAKE_BLOCKS,
                                                                                             2 ** 31 - 1]))
            memory[_BASES["tables"] + 4 * (b * max_blocks + j)] = block & 0xFFFFFFFF
    return memory, pages


def _check_access(access, where, buffers, sizes, shared_end, max_blocks, pages, touched):
    """Aligned to its width, inside the CTA's shared allocation or its global buffer, no table entry past
    a sequence's last page; global element indices recorded in touched[buffer][instruction]. Reads of
    a peer CTA's shared memory (space "cluster") are left to the caller."""
    assert access.address % min(access.size, 16) == 0, f"misaligned {where}"
    if access.space == "cluster":
        return
    if access.space == "shared":
        assert 1024 <= access.address and access.address + access.size <= shared_end, where
        return
    buffer = max((b for b in buffers if _BASES[b] <= access.address), key=_BASES.get)
    offset = access.address - _BASES[buffer]
    assert offset + access.size <= sizes[buffer], f"past the end of {buffer}: {where}"
    if buffer == "tables":
        assert offset // 4 % max_blocks < pages[offset // 4 // max_blocks], f"table past length: {where}"
    unit = _element_bytes(buffer)
    touched[buffer][access.kind].extend(range(offset // unit, (offset + access.size) // unit))


CLUSTER_CONFIGS = sorted(name for name, config in CONFIGS.items()
                         if config[4] == "sm_90a" and config[5:] and config[5].get("combine") == "cluster")


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_combine_reads_every_split_and_writes_once(compiled, name, rng):
    """Every CTA of one cluster (the splits of the last (batch, head tile)), all threads, through the
    PTX interpreter: accesses aligned and in bounds as above; no partial, counter or atomic in global
    memory; the remote loads read from every split exactly the bytes that split's CTA stored to its own
    shared memory for its tile's rows (its partial O and LSE) -- never an unwritten byte --, each byte
    of O once (16-byte loads) and each row's LSE twice per 8-column item of the row (scalar loads: the
    merge's max, then its weights), and every row's O and LSE of the tile is written exactly once over
    the cluster."""
    options = _compiled_options(name)
    fields, (B, Sq, Hq, Hkv, D, max_blocks), *_ = CONFIGS[name]
    buffers = [b for b in ("q", "k", "v", "tables", "lengths", "sinks", "out", "lse")
               if b != "sinks" or fields.get("has_sinks")]
    program, params, shapes, sizes, memory, pages = _interpreter_inputs(compiled, name, options, buffers, rng)
    splits, head_tiles = options.num_splits, Hkv * options.row_tiles
    assert splits > 1
    batch, head_tile = B - 1, head_tiles - 1
    shared_end = 1024 + options.shared_memory_bytes()
    touched = {b: collections.defaultdict(list) for b in buffers}
    stored = {}   # rank -> shared bytes it stored
    remote = {4: collections.defaultdict(list), 16: collections.defaultdict(list)}   # load size -> peer -> bytes
    for rank in range(splits):
        shared = {}
        stored[rank] = set()
        for thread in range(decode.THREADS):
            for access in ptx_addresses.thread_accesses(program, thread, (rank, head_tile, batch), params, memory,
                                                        shared_memory=shared):
                _check_access(access, f"{name} rank {rank} thread {thread}: {access}", buffers, sizes, shared_end,
                              max_blocks, pages, touched)
                if access.kind == "st.shared":
                    stored[rank].update(range(access.address, access.address + access.size))
                elif access.space == "cluster":
                    peer = access.address >> ptx_addresses.CLUSTER_RANK_SHIFT
                    local = access.address & ((1 << ptx_addresses.CLUSTER_RANK_SHIFT) - 1)
                    assert 0 <= peer < splits and 1024 <= local and local + access.size <= shared_end, access
                    remote[access.size][peer].extend(range(local, local + access.size))
    rows = min(options.rows - head_tile % options.row_tiles * decode.TILE_M, decode.TILE_M)
    assert set(remote) == {4, 16}
    for peer in range(splits):
        for size, elements, reads in ((16, rows * D, 1), (4, rows, 2 * D // decode.CHUNK)):
            read = collections.Counter(remote[size][peer])
            assert set(read) <= stored[peer], f"{name}: rank {peer}'s shared memory read where it stored nothing"
            assert len(read) == elements * 4, f"{name}: rank {peer}: {len(read)} bytes read by {size}-byte loads"
            assert set(read.values()) == {reads}, f"{name}: rank {peer}: bytes read {set(read.values())} times"
    head_kv, first = head_tile // options.row_tiles, head_tile % options.row_tiles * decode.TILE_M
    packed = np.arange(first, first + rows)
    positions, heads = packed // options.group, head_kv * options.group + packed % options.group
    for buffer, index in (("out", (batch, positions, heads)), ("lse", (batch, heads, positions))):
        expected = sorted(np.arange(int(np.prod(shapes[buffer]))).reshape(shapes[buffer])[index].ravel().tolist())
        assert sorted(touched[buffer]["st.global"]) == expected, f"{name}: {buffer} elements"
    assert not any(kind.startswith("atom") for b in buffers for kind in touched[b]), "an atomic in the cluster combine"


def test_options_are_checked():
    problem = _problem()
    config = AttentionConfig(scale=0.1, causal=True, has_kv_seq_lengths=True)
    for overrides, message in [({"tile_n": 96}, "multiple of 64"), ({"num_stages": 1}, "num_stages"),
                               ({"tile_n": 256, "num_stages": 4}, "shared memory"),
                               ({"combine": "fused"}, "combine must be one of"),
                               ({"combine": "cluster", "num_splits": 17}, "at most 16 splits")]:
        with pytest.raises(ValueError, match=message):
            decode.options(config, problem, **overrides).check()
    for head_dim in decode.SUPPORTED_HEAD_DIMS:
        decode.options(config, _problem(head_dim=head_dim)).check()


# The split counts of the decode benchmark's rows (benchmarks/decode.py: Hq / Hkv 32 / 8, D 128, bf16;
# the same for pages of 16 and 64 and for q_len 1 and 4, both one 16-row tile), on 132 SMs with 2 CTAs
# of 64-key blocks per SM (264 slots):
#   batch  context  CTAs without splits  key blocks  splits  blocks per split  CTAs
#   1      1k       8                    16          16      1                 128
#   1      8k       8                    128         32      4                 256
#   1      32k      8                    512         32      16                256
#   1      128k     8                    2048        33      63 (last: 32)     264
#   8      1k       64                   16          4       4                 256
#   8      8k+      64                   >= 128      4       >= 32             256
#   64     any      512 (>= 264)         -           1       all               512
BENCHMARK_SPLITS = {(1, 1024): 16, (1, 8192): 32, (1, 32768): 32, (1, 131072): 33,
                    (8, 1024): 4, (8, 8192): 4, (8, 32768): 4, (8, 131072): 4,
                    (64, 1024): 1, (64, 8192): 1, (64, 32768): 1, (64, 131072): 1}


@pytest.mark.parametrize("q_len, page", [(1, 16), (4, 64)])
def test_split_heuristic_on_the_benchmark_shapes(q_len, page):
    config = AttentionConfig(scale=0.1, causal=True, has_kv_seq_lengths=True)
    for (batch, context), splits in BENCHMARK_SPLITS.items():
        logical = (batch, context, 8, 128)
        problem = host.Problem((batch, q_len, 32, 128), logical, logical, "bfloat16", page_size=page)
        options = decode.options(config, problem, sm_count=132)
        assert (options.num_splits, options.tile_n) == (splits, 64), (batch, context)
        blocks = context // options.tile_n
        per_split = -(-blocks // splits)
        assert (splits - 1) * per_split < blocks, f"an idle split at {(batch, context)}"
        assert splits == 1 or batch * 8 * splits <= 264, f"splits past one wave at {(batch, context)}"


def test_cluster_combine_splits_on_the_benchmark_shapes():
    """With combine="cluster" the splits come from the same rule capped at one cluster (16): B = 1 takes
    16 splits at every context (one CTA per SM, which the page-64 sweep measured faster at 8k and 32k),
    B = 8 and 64 keep theirs (4 and 1)."""
    config = AttentionConfig(scale=0.1, causal=True, has_kv_seq_lengths=True)
    for (batch, context), splits in BENCHMARK_SPLITS.items():
        logical = (batch, context, 8, 128)
        problem = host.Problem((batch, 1, 32, 128), logical, logical, "bfloat16", page_size=16)
        options = decode.options(config, problem, sm_count=132, combine="cluster")
        assert options.num_splits == min(splits, decode.MAX_CLUSTER_SPLITS), (batch, context)
        options.check()


def test_split_heuristic():
    """One split when the CTAs fill the GPU; more for small batches, bounded by the key blocks, and as
    few as give each split the same number of blocks."""
    fill = lambda batch, context: decode.choose_num_splits(batch, 8, 1, context, 64, 132, 2)
    assert fill(64, 8192) == 1                       # 512 CTAs >= 264 slots
    assert fill(33, 8192) == 1                       # 264 CTAs: exactly one wave
    assert fill(8, 8192) == 4                        # 64 CTAs: 264 // 64, one wave of 256
    assert fill(1, 8192) == 32                       # 264 // 8 = 33 splits of 4 blocks leave one idle
    assert fill(1, 1024) == 16                       # one block each
    assert fill(1, 64) == 1
    assert fill(1, 100) == 2                         # a partial second block is a block
    assert decode.choose_num_splits(1, 1, 1, 10 ** 8, 64, 132, 2) == decode.MAX_SPLITS
    assert decode.choose_num_splits(1, 8, 4, 8192, 64, 132, 2) == 8     # 32 CTAs: 264 // 32


def _problem(q_len=1, q_heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", page=16, batch=2):
    logical = (batch, 64 * page, kv_heads, head_dim)
    return host.Problem((batch, q_len, q_heads, head_dim), logical, logical, dtype, page_size=page)


@pytest.mark.parametrize("config, problem, message", [
    (AttentionConfig(scale=0.1, has_segment_ids=True), _problem(), "segment ids"),
    (AttentionConfig(scale=0.1), _problem(q_len=17, q_heads=32, kv_heads=8), "packed rows exceed 64"),
    (AttentionConfig(scale=0.1), _problem(head_dim=96), "head dims"),
    (AttentionConfig(scale=0.1), _problem(dtype="float32"), "bfloat16 or float16"),
    (AttentionConfig(scale=-0.1), _problem(), "positive scale"),
])
def test_unsupported(config, problem, message, monkeypatch):
    assert message in decode.unsupported_reason(config, problem)


@pytest.mark.parametrize("xla_merge", decode.XLA_MERGES)
def test_combine_partials_is_the_softmax_over_all_keys(rng, xla_merge):
    """Partials cut from one row's keys at random, each a normalised (O, LSE) (or empty: -inf), merge
    into the softmax over all keys with the sinks; padded rows of the tile (NaN here) are dropped. Both
    forms of the XLA merge (staged, one variadic reduction)."""
    batch, kv_heads, group, q_len, dim, keys = 2, 3, 2, 3, 64, 40
    problem = host.Problem((batch, q_len, kv_heads * group, dim), (batch, 100, kv_heads, dim),
                           (batch, 100, kv_heads, dim), "bfloat16", page_size=10)
    options = decode.options(AttentionConfig(scale=0.3, causal=True, has_kv_seq_lengths=True), problem,
                             sm_count=132, num_splits=7, xla_merge=xla_merge)
    parts, rows = options.num_splits, options.rows
    logits = rng.standard_normal((batch, kv_heads, rows, keys)) * 3
    values = rng.standard_normal((batch, kv_heads, keys, dim))
    sinks = rng.standard_normal(kv_heads * group).astype(np.float32)
    o_shape, lse_shape = decode.partial_shapes(options, batch, kv_heads)
    partial_o = np.full(o_shape, np.nan, np.float32)
    partial_lse = np.full(lse_shape, np.nan, np.float32)
    cuts = np.sort(rng.choice(np.arange(keys + 1), size=parts - 1))
    bounds = [0, *cuts, keys]
    for p in range(parts):
        chunk = slice(bounds[p], bounds[p + 1])
        s = logits[..., chunk]
        if s.shape[-1] == 0:
            partial_o[:, :, p, :rows] = 0.0
            partial_lse[:, :, p, :rows] = -np.inf
            continue
        lse = np.log(np.exp(s).sum(-1))
        partial_lse[:, :, p, :rows] = lse
        partial_o[:, :, p, :rows] = np.einsum("bhrk,bhkd->bhrd", np.exp(s - lse[..., None]), values[:, :, chunk])
    out, lse = decode.combine_partials(options, jnp.asarray(partial_o), jnp.asarray(partial_lse),
                                       jnp.asarray(sinks), batch, kv_heads)
    # Row r = position * G + g holds query head h * G + g at position r // G.
    sink_rows = np.tile(sinks.reshape(kv_heads, group), (1, q_len))[None]
    expected_lse = np.log(np.exp(logits).sum(-1) + np.exp(sink_rows))
    expected_o = np.einsum("bhrk,bhkd->bhrd", np.exp(logits - expected_lse[..., None]), values)
    expected_o = expected_o.reshape(batch, kv_heads, q_len, group, dim).transpose(0, 2, 1, 3, 4)
    expected_lse = expected_lse.reshape(batch, kv_heads, q_len, group).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(np.asarray(out), expected_o.reshape(batch, q_len, kv_heads * group, dim),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), expected_lse.reshape(batch, kv_heads * group, q_len),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xla_merge", decode.XLA_MERGES)
def test_combine_of_rows_that_see_nothing(xla_merge):
    problem = host.Problem((1, 1, 2, 64), (1, 10, 1, 64), (1, 10, 1, 64), "bfloat16", page_size=10)
    options = decode.options(AttentionConfig(scale=0.3, causal=True, has_kv_seq_lengths=True), problem,
                             sm_count=132, xla_merge=xla_merge)
    o_shape, lse_shape = decode.partial_shapes(options, 1, 1)
    out, lse = decode.combine_partials(options, jnp.zeros(o_shape), jnp.full(lse_shape, -jnp.inf), None, 1, 1)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)
    with_sinks = decode.combine_partials(options, jnp.zeros(o_shape), jnp.full(lse_shape, -jnp.inf),
                                         jnp.asarray([0.5, -jnp.inf]), 1, 1)
    np.testing.assert_array_equal(np.asarray(with_sinks[1]).ravel(), [0.5, -np.inf])
    assert np.all(np.asarray(with_sinks[0]) == 0)


def test_routing(monkeypatch):
    """paged calls and short-query attention calls with key lengths take the decode kernel on sm_90
    (and sm_100, the same arch-neutral code); attention without key lengths keeps the forward kernel."""
    from fa4_jax.lowering import cuda

    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    config = AttentionConfig(scale=0.1, causal=True, has_kv_seq_lengths=True)
    assert cuda.kernel_for_problem("decode", config, _problem()) is decode
    contiguous = host.Problem((2, 4, 32, 128), (2, 5000, 8, 128), (2, 5000, 8, 128), "bfloat16")
    assert cuda.decode_module_for_attention(config, contiguous) is decode
    assert cuda.decode_module_for_attention(config.replace(has_kv_seq_lengths=False), contiguous) is None
    long_query = host.Problem((2, 64, 32, 128), (2, 5000, 8, 128), (2, 5000, 8, 128), "bfloat16")
    assert cuda.decode_module_for_attention(config, long_query) is None
    monkeypatch.setattr(cuda, "compute_capability", lambda: (10, 0))
    assert cuda.kernel_for_problem("decode", config, _problem()) is decode


def test_both_entry_points_lower_to_the_decode_kernel(monkeypatch):
    """Lowered for CUDA (a GPU of compute capability 9.0 pretended), paged_attention and a short-query
    attention with key lengths both become the decode kernel's call (compiled here, on the CPU)."""
    import jax

    import fa4_jax
    from fa4_jax.lowering import cuda

    monkeypatch.setenv("FA4_JAX_CACHE_DIR", "")
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    paged = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="cute")).trace(
        bf16(2, 1, 8, 64), bf16(40, 16, 2, 64), bf16(40, 16, 2, 64), int32(2, 20), int32(2))
    contiguous = jax.jit(lambda q, k, v, n: fa4_jax.attention(q, k, v, causal=True, kv_seq_lengths=n,
                                                              implementation="cute")).trace(
        bf16(2, 2, 8, 64), bf16(2, 300, 2, 64), bf16(2, 300, 2, 64), int32(2))
    for traced in (paged, contiguous):
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "fa4_jax_sm90_decode" in text
        assert "fa4_jax_sm90_forward" not in text


@pytest.mark.parametrize("has_sinks", [False, True])
def test_combine_kernel_lowers_after_the_decode_kernel(monkeypatch, has_sinks):
    """decode.run with combine="kernel", lowered for CUDA (compiled here, on the CPU): the decode kernel
    (its partials) and then the combine kernel, which returns the final O in the query dtype and the LSE;
    no XLA merge left (no reduce)."""
    import jax

    from fa4_jax import paged

    monkeypatch.setenv("FA4_JAX_CACHE_DIR", "")
    spec = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype)
    arguments = (spec(jnp.bfloat16, 2, 1, 8, 64), spec(jnp.bfloat16, 40, 16, 2, 64), spec(jnp.bfloat16, 40, 16, 2, 64),
                 spec(jnp.int32, 2, 20), spec(jnp.int32, 2), spec(jnp.float32, 8) if has_sinks else None)
    config = AttentionConfig(scale=0.125, causal=True, has_kv_seq_lengths=True, has_sinks=has_sinks)
    options = decode.options(config, paged.paged_problem(*arguments[:4]), sm_count=132, combine="kernel")
    traced = jax.jit(lambda *a: decode.run(options, *a)).trace(*arguments)
    out, lse = traced.out_info
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 1, 8, 64), jnp.bfloat16, (2, 8, 1), jnp.float32)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.index("fa4_jax_sm90_decode_combine") > text.index("fa4_jax_sm90_decode_") and "reduce" not in text


@pytest.mark.parametrize("name", ["d64-fp16-page64-sinks", "d128-q4-page64-sinks", "d128-gqa4-page16"])
def test_last_cta_merges_the_splits(compiled, name, rng):
    """The last CTA of a (batch, head tile), run thread by thread on the CPU from its PTX with every
    split's partial (O, LSE) and the sinks in memory, writes the softmax over all splits and the sink:
    lse = log(sum_s exp(lse_s) + exp(sink)), O = sum_s exp(lse_s - lse) O_s, rounded to the output dtype.
    Among the rows: one that no split saw (lse -inf everywhere: O 0, LSE the sink or -inf) and one that
    only some splits saw."""
    options = _compiled_options(name)
    fields, (B, Sq, Hq, Hkv, D, max_blocks), dtype, *_ = CONFIGS[name]
    has_sinks = fields.get("has_sinks", False)
    buffers = [b for b in _BUFFERS if b != "sinks" or has_sinks]
    splits, head_tiles, group = options.num_splits, Hkv * options.row_tiles, options.group
    assert splits > 1
    with open(compiled[name]["ptx"]) as handle:
        program = ptx_addresses.parse(handle.read())
    params = {param: _BASES[buffer].to_bytes(8, "little") for (param, _), buffer in zip(program.params, buffers)}
    shapes = _shapes(options, name)
    batch, head_tile = B - 1, head_tiles - 1
    head_kv, first = head_tile // options.row_tiles, head_tile % options.row_tiles * decode.TILE_M
    rows = min(decode.TILE_M, options.rows - first)
    max_len = max_blocks * options.page_size
    memory = {_BASES["lengths"] + 4 * b: max_len for b in range(B)}
    memory.update({_BASES["tables"] + 4 * i: i % _FAKE_BLOCKS for i in range(B * max_blocks)})
    memory[_BASES["semaphore"] + 4 * (batch * head_tiles + head_tile)] = splits - 1
    partial_lse = rng.standard_normal((splits, rows)).astype(np.float32) * 3
    partial_lse[:, 0] = -np.inf                      # a row no split saw
    partial_lse[: splits // 2, rows - 1] = -np.inf   # a row only the later splits saw
    partial_o = rng.standard_normal((splits, rows, D)).astype(np.float32)
    partial_o[:, 0] = 0.0                            # what an empty split writes
    sinks = rng.standard_normal(Hq).astype(np.float32) if has_sinks else None
    bits = lambda x: int(np.float32(x).view(np.uint32))
    for s in range(splits):
        for r in range(rows):
            index = (((batch * shapes["partial_lse"][1] + head_tile) * splits + s) * decode.TILE_M + r)
            memory[_BASES["partial_lse"] + 4 * index] = bits(partial_lse[s, r])
            for d in range(D):
                memory[_BASES["partial_o"] + 4 * (index * D + d)] = bits(partial_o[s, r, d])
    if has_sinks:
        memory.update({_BASES["sinks"] + 4 * h: bits(sinks[h]) for h in range(Hq)})

    stored = {}
    shared = {}
    for thread in range(decode.THREADS):
        for access in ptx_addresses.thread_accesses(program, thread, (splits - 1, head_tile, batch), params, memory,
                                                    shared_memory=shared):
            if access.kind == "st.global" and _BASES["out"] <= access.address:
                stored[access.address] = access
    kind = "bf16x2" if dtype == "bfloat16" else "f16x2"
    packed = np.arange(first, first + rows)
    heads, positions = head_kv * group + packed % group, packed // group
    top = partial_lse.max(axis=0)
    if has_sinks:
        top = np.maximum(top, sinks[heads])
    shift = np.where(np.isfinite(top), top, 0.0)
    total = np.exp(partial_lse - shift).sum(axis=0) + (np.exp(sinks[heads] - shift) if has_sinks else 0.0)
    expected_lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    weights = np.exp(partial_lse - np.where(np.isfinite(expected_lse), expected_lse, 0.0))
    expected_o = np.einsum("sr,srd->rd", weights, partial_o)
    for r in range(rows):
        lse_address = _BASES["lse"] + 4 * ((batch * Hq + heads[r]) * Sq + positions[r])
        (lse_bits,) = stored[lse_address].values
        np.testing.assert_allclose(ptx_addresses._bits_float(lse_bits), expected_lse[r], rtol=1e-5, atol=1e-5)
        out = []
        for d in range(0, D, 8):
            address = _BASES["out"] + 2 * (((batch * Sq + positions[r]) * Hq + heads[r]) * D + d)
            for word in stored[address].values:
                out += [ptx_addresses.half_float(word, kind), ptx_addresses.half_float(word >> 16, kind)]
        np.testing.assert_allclose(out, expected_o[r], rtol=1e-2, atol=1e-2, err_msg=f"{name} row {r}")
    assert np.isinf(expected_lse[0]) != has_sinks


def _combine_options(name):
    """(decode options, combine options) of COMBINE_CONFIGS[name]."""
    fields, (B, Sq, Hq, Hkv, D), dtype, _, splits = COMBINE_CONFIGS[name]
    config = AttentionConfig(scale=D ** -0.5, causal=True, has_kv_seq_lengths=True, **fields)
    logical = (B, 64 * 16, Hkv, D)
    problem = host.Problem((B, Sq, Hq, D), logical, logical, dtype, page_size=16)
    options = decode.options(config, problem, sm_count=132, combine="kernel", num_splits=splits)
    return options, decode.combine_options(options, fields.get("has_sinks", False))


@pytest.mark.parametrize("name", sorted(COMBINE_CONFIGS))
def test_combine_kernel_ptx_has_the_design(compiled, name):
    """The combine kernel: per split one 16-byte load of a thread's 4 partial columns and one LSE load, the
    output's 4 columns (8 bytes) in one store, plain global loads and stores only (no shared memory, no
    barrier, no local memory), so the same code runs on sm_90 and sm_100."""
    with open(compiled[name]["ptx"]) as handle:
        ptx = handle.read()
    _, options = _combine_options(name)
    assert f".target {COMBINE_CONFIGS[name][3]}" in ptx
    vector_loads = re.findall(r"ld\.global(?:\.nc)?\.(?:v4\.b32|v4\.f32|v2\.b64)", ptx)   # 16 bytes each
    scalar_loads = re.findall(r"ld\.global(?:\.nc)?\.(?:b32|f32)\s", ptx)
    assert len(vector_loads) == options.num_splits, f"{len(vector_loads)} 16-byte loads for {options.num_splits} splits"
    assert len(scalar_loads) == options.num_splits + options.has_sinks, scalar_loads
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 1, "the 4 output columns are not one 8-byte store"
    assert not re.search(r"\.local\b|ld\.local|st\.local|\.shared|bar\.sync|barrier", ptx)
    assert "wgmma" not in ptx and "cp.async" not in ptx and "atom." not in ptx


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not installed")
def test_combine_kernel_has_no_register_spills(compiled):
    """ptxas keeps a group's 32 splits of loads in registers (minctasm 1 lets it use up to 255)."""
    name = next(name for name, config in COMBINE_CONFIGS.items() if config[3] == "sm_90a")
    assert_no_spills(find_ptxas(), compiled[name]["ptx"], name)


def test_combine_kernel_merges_the_partials(compiled, rng):
    """Every thread of the sm_90a combine case, run through the PTX interpreter on random partials (rows a
    split did not see: LSE -inf; the padded rows of the last tile: NaN, never read), writes what the XLA
    merge (`combine_partials`, `_merge_in_stages`) computes: O rounded to bf16, LSE within 1e-5; a row no
    split and no sink saw gets O 0 and LSE -inf, one with only its sink O 0 and LSE the sink. Every
    access aligned and inside its buffer, every output element written once, no partial row past the
    tile's real rows read."""
    name = next(name for name, config in COMBINE_CONFIGS.items() if config[3] == "sm_90a")
    decode_options, options = _combine_options(name)
    fields, (B, Sq, Hq, Hkv, D), dtype, _, splits = COMBINE_CONFIGS[name]
    from fa4_jax.kernels.sm90 import decode_combine

    buffers = ["partial_o", "partial_lse", "sinks", "out", "lse"]
    with open(compiled[name]["ptx"]) as handle:
        program = ptx_addresses.parse(handle.read())
    assert [size for _, size in program.params] == [8] * len(buffers)
    params = {param: _BASES[buffer].to_bytes(8, "little") for (param, _), buffer in zip(program.params, buffers)}
    o_shape, lse_shape = decode_combine.partial_shapes(options, B, Hkv)
    out_shape, out_lse_shape = decode_combine.output_shapes(options, B, Hkv)
    shapes = {"partial_o": o_shape, "partial_lse": lse_shape, "sinks": (Hq,), "out": out_shape, "lse": out_lse_shape}
    sizes = {b: int(np.prod(shapes[b])) * (2 if b == "out" else 4) for b in buffers}

    partial_lse = (rng.standard_normal(lse_shape) * 3).astype(np.float32)
    partial_o = rng.standard_normal(o_shape).astype(np.float32)
    partial_lse[rng.random(lse_shape) < 0.2] = -np.inf     # splits that saw no key of a row
    sinks = rng.standard_normal(Hq).astype(np.float32)
    # Packed row 0 of (batch 0, head 0) (query head 0, position 0): no split and no sink; packed row 1
    # (head 1): only its sink.
    partial_lse[0, 0, :, 0:2] = -np.inf
    partial_o[0, 0, :, 0:2] = 0.0
    sinks[0] = -np.inf
    last_rows = options.rows - (options.row_tiles - 1) * decode.TILE_M
    padded = np.zeros(lse_shape, bool)
    padded.reshape(B, Hkv, options.row_tiles, splits, decode.TILE_M)[:, :, -1, :, last_rows:] = True
    partial_lse[padded] = np.nan
    partial_o[padded] = np.nan
    memory = {}
    for buffer, values in (("partial_o", partial_o), ("partial_lse", partial_lse), ("sinks", sinks)):
        words = values.ravel().view(np.uint32)
        memory.update(zip(range(_BASES[buffer], _BASES[buffer] + 4 * words.size, 4), words.tolist()))

    stored = {}
    read = collections.Counter()
    for batch in range(B):
        for head_kv in range(Hkv):
            for cta in range(options.ctas_per_head):
                for thread in range(decode_combine.THREADS):
                    for access in ptx_addresses.thread_accesses(program, thread, (cta, head_kv, batch), params,
                                                                memory):
                        where = f"CTA {(cta, head_kv, batch)} thread {thread}: {access}"
                        assert access.space == "global" and access.address % access.size == 0, where
                        buffer = max((b for b in buffers if _BASES[b] <= access.address), key=_BASES.get)
                        offset = access.address - _BASES[buffer]
                        assert offset + access.size <= sizes[buffer], f"past the end of {buffer}: {where}"
                        if access.kind == "st.global":
                            assert buffer in ("out", "lse") and access.address not in stored, where
                            stored[access.address] = access
                        else:
                            assert buffer in ("partial_o", "partial_lse", "sinks"), where
                            read.update((buffer, element)
                                        for element in range(offset // 4, (offset + access.size) // 4))
    for buffer, values in (("partial_o", partial_o), ("partial_lse", partial_lse)):
        elements = {element for b, element in read if b == buffer}
        assert not np.isnan(values.ravel()[sorted(elements)]).any(), f"a padded row of {buffer} read"
        assert len(elements) == np.count_nonzero(~padded) * (D if buffer == "partial_o" else 1), buffer

    expected_o, expected_lse = decode.combine_partials(decode_options, jnp.asarray(partial_o),
                                                       jnp.asarray(partial_lse), jnp.asarray(sinks), B, Hkv)
    expected_o, expected_lse = np.asarray(expected_o), np.asarray(expected_lse)
    out = np.full(out_shape, np.nan, np.float32)
    lse = np.full(out_lse_shape, np.nan, np.float32)
    for address, access in stored.items():
        if address >= _BASES["lse"]:
            (bits,) = access.values
            lse.ravel()[(address - _BASES["lse"]) // 4] = ptx_addresses._bits_float(bits)
            continue
        start = (address - _BASES["out"]) // 2
        for index, word in enumerate(access.values):
            out.ravel()[start + 2 * index] = ptx_addresses.half_float(word, "bf16x2")
            out.ravel()[start + 2 * index + 1] = ptx_addresses.half_float(word >> 16, "bf16x2")
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "an output element not written"
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, expected_o, rtol=1e-2, atol=1e-2)
    assert lse[0, 0, 0] == -np.inf and np.isclose(lse[0, 1, 0], sinks[1], rtol=1e-6, atol=1e-6)
    assert not out[0, 0, :2].any()
