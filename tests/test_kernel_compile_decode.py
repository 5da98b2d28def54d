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
# overrides]). The split count is the heuristic's on 132 SMs unless the overrides set it; with one split the
# kernel writes the final O and LSE, with more its partials (the combine kernel's or XLA's to merge).
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
    # One split: the CTA writes the final O (sinks folded in) itself; the same by the heuristic (B = 40: 320
    # CTAs fill the 264 slots), without sinks.
    "d128-one-split-sinks": ({"has_sinks": True}, [2, 4, 32, 8, 128, 8], "bfloat16", 16, "sm_90a", {"num_splits": 1}),
    "d128-b40-one-split": ({}, [40, 1, 32, 8, 128, 12], "bfloat16", 16, "sm_90a"),
    # The benchmark's 8k row (32 splits of 4 blocks) with its page numbers loaded right before their cp.async
    # (`page_lookahead=False`; every other case loads them a block ahead, the default).
    "d128-no-page-lookahead": ({}, [1, 1, 32, 8, 128, 512], "bfloat16", 16, "sm_90a",
                               {"page_lookahead": False}),
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
    options = decode.options(config, problem, sm_count=132, **(overrides[0] if overrides else {}))
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
    # Every split works alone: no arrival counter, atomic, cluster barrier or remote shared load.
    assert not re.search(r"\batom\.|\bred\.|barrier\.cluster|ld\.shared::cluster", ptx), "cross-CTA traffic"
    assert _compiled_options(name).num_splits == compiled[name]["splits"]


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not installed")
@pytest.mark.parametrize("name", sorted(name for name in CONFIGS if CONFIGS[name][4] == "sm_90a"))
def test_no_register_spills(compiled, name):
    assert_no_spills(find_ptxas(), compiled[name]["ptx"], name)


# Where the address check puts each buffer (256-byte aligned, as XLA's are, and far apart).
_BUFFERS = ("q", "k", "v", "tables", "lengths", "sinks", "partial_o", "partial_lse", "out", "lse")
_BASES = {name: (index + 1) << 36 for index, name in enumerate(_BUFFERS)}
_FAKE_BLOCKS = 50   # cache blocks of the compile's fake tensors (decode.fake_arguments)


def _kernel_buffers(options, has_sinks):
    """The kernel's tensor parameters in order: with one split the sinks (where given) and the final O
    and LSE, else the split's partials (the sinks go to the merge)."""
    if options.writes_output:
        return ["q", "k", "v", "tables", "lengths"] + (["sinks"] if has_sinks else []) + ["out", "lse"]
    return ["q", "k", "v", "tables", "lengths", "partial_o", "partial_lse"]


def _compiled_options(name):
    fields, (B, Sq, Hq, Hkv, D, max_blocks), dtype, page, _, *overrides = CONFIGS[name]
    config = AttentionConfig(scale=D ** -0.5, causal=True, has_kv_seq_lengths=True, **fields)
    logical = (B, max_blocks * page, Hkv, D)
    problem = host.Problem((B, Sq, Hq, D), logical, logical, dtype, page_size=page)
    return decode.options(config, problem, sm_count=132, **(overrides[0] if overrides else {}))


def _shapes(options, name):
    _, (B, Sq, Hq, Hkv, D, max_blocks), *_ = CONFIGS[name]
    o_shape, lse_shape = decode.partial_shapes(options, B, Hkv)
    cache = (_FAKE_BLOCKS, options.page_size, Hkv, D)
    return {"q": (B, Sq, Hq, D), "k": cache, "v": cache, "tables": (B, max_blocks), "lengths": (B,),
            "sinks": (Hq,), "partial_o": o_shape, "partial_lse": lse_shape, "out": (B, Sq, Hq, D),
            "lse": (B, Hq, Sq)}


def _element_bytes(buffer):
    return 2 if buffer in ("q", "k", "v", "out") else 4


@pytest.mark.parametrize("name", ["d64-fp16-page64-sinks", "d64-softcap-window-fp16-page7", "d256-64-rows",
                                  "d128-tile128-stages2", "d128-one-split-sinks", "d128-b40-one-split"])
def test_every_access_is_aligned_and_in_bounds(compiled, name, rng):
    """Two CTAs of the compiled PTX (the first split of the first batch's last head tile, the last split
    of the last batch's first), run thread by thread on the CPU (tests/ptx_addresses.py) over a paged
    cache (random block ids, garbage past each sequence's last page): every 16-byte cp.async has 16-byte
    aligned source and destination, every ldmatrix row address is 16-byte aligned, every load and store
    is aligned to its width and inside its buffer (shared: the CTA's allocation), no table entry past a
    sequence's last page is read. Each CTA writes its split's partial rows, O and LSE, every element
    once, and nothing else; with one split, the final O and LSE of its tile's rows instead. The first
    H200 run failed on the ldmatrix / cp.async alignment."""
    options = _compiled_options(name)
    fields, (B, Sq, Hq, Hkv, D, max_blocks), *_ = CONFIGS[name]
    buffers = _kernel_buffers(options, fields.get("has_sinks", False))
    program, params, shapes, sizes, memory, pages = _interpreter_inputs(compiled, name, options, buffers, rng)
    head_tiles = Hkv * options.row_tiles
    splits = options.num_splits
    shared_end = 1024 + options.shared_memory_bytes()
    for block in [(0, head_tiles - 1, 0), (splits - 1, 0, B - 1)]:
        split, head_tile, batch = block
        shared = {}
        touched = {b: collections.defaultdict(list) for b in buffers}
        for thread in range(decode.THREADS):
            for access in ptx_addresses.thread_accesses(program, thread, block, params, memory,
                                                        shared_memory=shared):
                _check_access(access, f"{name} CTA {block} thread {thread}: {access}", buffers, sizes,
                              shared_end, max_blocks, pages, touched)

        def elements(buffer, index):
            return sorted(np.arange(int(np.prod(shapes[buffer]))).reshape(shapes[buffer])[index].ravel().tolist())

        rows = options.rows - head_tile % options.row_tiles * decode.TILE_M
        rows = min(rows, decode.TILE_M)
        if splits > 1:
            expected_writes = {"partial_o": elements("partial_o", (batch, head_tile, split, slice(0, rows))),
                               "partial_lse": elements("partial_lse", (batch, head_tile, split, slice(0, rows)))}
        else:
            head_kv, first = head_tile // options.row_tiles, head_tile % options.row_tiles * decode.TILE_M
            packed = np.arange(first, first + rows)
            positions, heads = packed // options.group, head_kv * options.group + packed % options.group
            expected_writes = {"out": elements("out", (batch, positions, heads)),
                               "lse": elements("lse", (batch, heads, positions))}
        for buffer in buffers:
            assert sorted(touched[buffer]["st.global"]) == expected_writes.get(buffer, []), \
                f"{name} CTA {block}: {buffer} elements"
        assert not any(kind.startswith("atom") for b in buffers for kind in touched[b]), f"{name}: an atomic"


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


def test_options_are_checked():
    problem = _problem()
    config = AttentionConfig(scale=0.1, causal=True, has_kv_seq_lengths=True)
    for overrides, message in [({"tile_n": 96}, "multiple of 64"), ({"num_stages": 1}, "num_stages"),
                               ({"tile_n": 256, "num_stages": 4}, "shared memory"),
                               ({"combine": "cluster"}, "combine must be one of")]:
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


def test_combine_partials_is_the_softmax_over_all_keys(rng):
    """Partials cut from one row's keys at random, each a normalised (O, LSE) (or empty: -inf), merge
    into the softmax over all keys with the sinks; padded rows of the tile (NaN here) are dropped."""
    batch, kv_heads, group, q_len, dim, keys = 2, 3, 2, 3, 64, 40
    problem = host.Problem((batch, q_len, kv_heads * group, dim), (batch, 100, kv_heads, dim),
                           (batch, 100, kv_heads, dim), "bfloat16", page_size=10)
    options = decode.options(AttentionConfig(scale=0.3, causal=True, has_kv_seq_lengths=True), problem,
                             sm_count=132, num_splits=7, combine="xla")
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


def test_combine_of_rows_that_see_nothing():
    problem = host.Problem((1, 1, 2, 64), (1, 10, 1, 64), (1, 10, 1, 64), "bfloat16", page_size=10)
    options = decode.options(AttentionConfig(scale=0.3, causal=True, has_kv_seq_lengths=True), problem,
                             sm_count=132, combine="xla")
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
