"""Context parallelism on 8 fake CPU devices: the sequence split over devices (all-gather and ring
strategies, with and without the zigzag order) gives the unsharded forward, LSE and every gradient, and
the unsharded forward-mode tangents (jvp, vmap of jvp, a Hessian-vector product); the compiled HLO moves
K/V (and their tangents) the way each strategy says; zigzag balances causal work.

The grid is a covering set, not the product: every feature meets both strategies and the zigzag order
somewhere, and each case compiles the forward and backward together (one vjp) to keep the file quick.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import fa4_jax
import numpy_reference as oracle
from fa4_jax import context_parallel

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (tests/conftest.py fakes them on the CPU)")

TOLERANCE = 1e-5  # float32: the sharded run differs from the unsharded one only in summation order
SEQ_LEN = 32
# The operands whose axis 1 (or 2, for the LSE) is the sequence, and so are in zigzag order.
SEQUENCE_AXIS = {"query": 1, "key": 1, "value": 1, "d_out": 1, "d_lse": 2, "q_segment_ids": 1,
                 "kv_segment_ids": 1, "t_query": 1, "t_key": 1, "t_value": 1}


def _mesh(shape, names) -> Mesh:
    return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


def _problem(inputs, features, batch=2, q_heads=4, kv_heads=2):
    operands = {
        "query": inputs.normal((batch, SEQ_LEN, q_heads, 16), scale=1.5),
        "key": inputs.normal((batch, SEQ_LEN, kv_heads, 16)),
        "value": inputs.normal((batch, SEQ_LEN, kv_heads, 8)),
        "d_out": inputs.normal((batch, SEQ_LEN, q_heads, 8)),
        "d_lse": inputs.normal((batch, q_heads, SEQ_LEN)),
    }
    if features.get("sinks"):
        operands["sinks"] = inputs.normal((q_heads,))
    if features.get("segments"):
        operands["q_segment_ids"] = operands["kv_segment_ids"] = inputs.segment_ids(batch, SEQ_LEN, segments=4)
    if features.get("lengths"):
        operands["q_seq_lengths"] = inputs.lengths(batch, SEQ_LEN, minimum=SEQ_LEN // 2)
        operands["kv_seq_lengths"] = inputs.lengths(batch, SEQ_LEN, minimum=SEQ_LEN // 2)
    options = {name: features[name] for name in ("causal", "window", "softcap", "deterministic") if name in features}
    return operands, options


def _attention(operands, options):
    """(query, key, value, sinks) -> (out, lse), the other operands (segments, lengths) closed over."""
    segment_ids = None
    if "q_segment_ids" in operands:
        segment_ids = (operands["q_segment_ids"], operands["kv_segment_ids"])

    def function(query, key, value, sinks):
        return fa4_jax.attention(query, key, value, sinks=sinks, segment_ids=segment_ids,
                                 q_seq_lengths=operands.get("q_seq_lengths"),
                                 kv_seq_lengths=operands.get("kv_seq_lengths"), return_lse=True, **options)
    return function


def _results(operands, options):
    """(out, lse, dq, dk, dv, dsinks) with the operands' cotangents d_out, d_lse."""
    (out, lse), pullback = jax.vjp(_attention(operands, options), operands["query"], operands["key"],
                                   operands["value"], operands.get("sinks"))
    return (out, lse) + tuple(pullback((operands["d_out"], operands["d_lse"])))


def _in_zigzag_order(operands, shards):
    if shards is None:
        return dict(operands)
    return {name: fa4_jax.zigzag(x, shards, axis=SEQUENCE_AXIS[name]) if name in SEQUENCE_AXIS else x
            for name, x in operands.items()}


def _expected(operands, options, shards):
    """The unsharded results, in zigzag order when the sharded run is (dsinks has no sequence axis)."""
    single = jax.devices()[0]
    local = {name: jax.device_put(np.asarray(x), single) for name, x in operands.items()}
    results = jax.jit(lambda ops: _results(ops, options))(local)
    if shards is None:
        return results
    axes = (1, 2, 1, 1, 1)
    return tuple(fa4_jax.zigzag(r, shards, axis=a) for r, a in zip(results, axes)) + results[5:]


def _check(actual, expected):
    names = ("out", "lse", "d_query", "d_key", "d_value", "d_sinks")
    for name, got, want in zip(names, actual, expected):
        if want is None:
            assert got is None, name
            continue
        oracle.assert_close(got, np.asarray(want), TOLERANCE, name, floor=1.0)


def _specs(mesh_axes, batch_axis=None, head_axis=None):
    seq = mesh_axes
    return {"query": PartitionSpec(batch_axis, seq, head_axis), "key": PartitionSpec(batch_axis, seq, head_axis),
            "value": PartitionSpec(batch_axis, seq, head_axis), "d_out": PartitionSpec(batch_axis, seq, head_axis),
            "d_lse": PartitionSpec(batch_axis, head_axis, seq), "q_segment_ids": PartitionSpec(batch_axis, seq),
            "kv_segment_ids": PartitionSpec(batch_axis, seq), "sinks": PartitionSpec(head_axis),
            "q_seq_lengths": PartitionSpec(batch_axis), "kv_seq_lengths": PartitionSpec(batch_axis),
            "t_query": PartitionSpec(batch_axis, seq, head_axis), "t_key": PartitionSpec(batch_axis, seq, head_axis),
            "t_value": PartitionSpec(batch_axis, seq, head_axis), "t_sinks": PartitionSpec(head_axis)}


# (features, strategy, zigzag shards, mesh layout, kv_heads): each feature with both strategies, with
# and without zigzag, over the covering set below. "seq4" splits the sequence 4 ways, "seq" 2 ways
# (cheaper to compile: a ring of two steps), "data" / "heads" add a second mesh axis of 2.
JIT_CASES = {
    "causal-allgather-zigzag-seq4": (dict(causal=True), "all_gather", 4, "seq4", 2),
    "causal-ring-zigzag-seq4": (dict(causal=True), "ring", 4, "seq4", 2),
    "causal-window-softcap-ring": (dict(causal=True, window=(9, 2), softcap=3.0), "ring", None, "seq", 2),
    "causal-window-softcap-allgather-zigzag": (dict(causal=True, window=(9, 2), softcap=3.0), "all_gather", 2,
                                               "seq", 2),
    "window-sinks-ring-zigzag": (dict(window=(5, 5), sinks=True), "ring", 2, "seq", 2),
    "causal-sinks-segments-lengths-allgather": (dict(causal=True, sinks=True, segments=True, lengths=True),
                                                "all_gather", None, "seq", 2),
    "causal-segments-lengths-ring-zigzag": (dict(causal=True, segments=True, lengths=True), "ring", 2, "seq", 2),
    "mqa-causal-sinks-ring-heads-x-seq": (dict(causal=True, sinks=True), "ring", None, "heads", 1),
    "deterministic-causal-allgather-data-x-seq-zigzag": (dict(causal=True, deterministic=True), "all_gather", 2,
                                                         "data", 2),
}


@pytest.mark.parametrize("features,strategy,shards,layout,kv_heads", JIT_CASES.values(), ids=JIT_CASES.keys())
def test_sequence_sharded_jit_equals_unsharded(inputs, features, strategy, shards, layout, kv_heads):
    """Under jit the sharding says the sequence is split (4 ways; a 2-D mesh adds data or heads)."""
    operands, options = _problem(inputs, features, kv_heads=kv_heads)
    if layout in ("seq", "seq4"):
        mesh, specs = _mesh((4 if layout == "seq4" else 2,), ("seq",)), _specs("seq")
    elif layout == "data":
        mesh, specs = _mesh((2, 2), ("data", "seq")), _specs("seq", batch_axis="data")
    else:
        mesh, specs = _mesh((2, 2), ("heads", "seq")), _specs("seq", head_axis="heads")
        specs["key"] = specs["value"] = PartitionSpec(None, "seq")  # one KV head: replicated over heads
    ordered = _in_zigzag_order(operands, shards)
    placed = {name: jax.device_put(x, NamedSharding(mesh, specs[name])) for name, x in ordered.items()}
    options = dict(options, context_parallel=strategy, zigzag_shards=shards)
    actual = jax.jit(lambda ops: _results(ops, options))(placed)
    _check(actual, _expected(operands, {k: v for k, v in options.items()
                                        if k not in ("context_parallel", "zigzag_shards")}, shards))


SHARD_MAP_CASES = {
    "ring-causal-sinks-zigzag": (dict(causal=True, sinks=True), "ring", 2),
    # Lengths and window sides are global although each shard holds a slice of the sequence.
    "allgather-window-segments-lengths": (dict(window=(6, 0), segments=True, lengths=True), "all_gather", None),
}


@pytest.mark.parametrize("features,strategy,shards", SHARD_MAP_CASES.values(), ids=SHARD_MAP_CASES.keys())
def test_shard_map_with_context_parallel_axis_equals_unsharded(inputs, features, strategy, shards):
    """Inside shard_map the local q/k/v are sequence slices; context_parallel_axis names the axis."""
    operands, options = _problem(inputs, features)
    mesh = _mesh((2,), ("sp",))
    specs = _specs("sp")
    names = sorted(operands)
    ordered = _in_zigzag_order(operands, shards)
    cp_options = dict(options, context_parallel=strategy, zigzag_shards=shards, context_parallel_axis="sp")

    def body(*arrays):
        return _results(dict(zip(names, arrays)), cp_options)

    out_specs = (specs["query"], specs["d_lse"], specs["query"], specs["key"], specs["value"],
                 PartitionSpec() if "sinks" in operands else None)
    function = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[n] for n in names), out_specs=out_specs)
    actual = jax.jit(function)(*(ordered[n] for n in names))
    _check(actual, _expected(operands, options, shards))


@pytest.mark.parametrize("shards", [1, 4])
def test_zigzag_on_one_device_is_the_permuted_attention(inputs, shards):
    """zigzag_shards needs no mesh: positions are those of the original order on one device too."""
    operands, options = _problem(inputs, dict(causal=True, window=(7, 3), sinks=True, segments=True, lengths=True))
    single = jax.devices()[0]
    ordered = {name: jax.device_put(np.asarray(x), single) for name, x in _in_zigzag_order(operands, shards).items()}
    actual = jax.jit(lambda ops: _results(ops, dict(options, zigzag_shards=shards)))(ordered)
    _check(actual, _expected(operands, options, shards))


def test_zigzag_round_trip_and_order():
    x = jnp.arange(16).reshape(1, 16)
    np.testing.assert_array_equal(fa4_jax.zigzag(x, 4)[0], [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
    np.testing.assert_array_equal(fa4_jax.unzigzag(fa4_jax.zigzag(x, 4), 4), x)
    y = jnp.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(fa4_jax.unzigzag(fa4_jax.zigzag(y, 1, axis=2), 1, axis=2), y)


def _compiled_collectives(function, *args):
    text = function.lower(*args).compile().as_text()
    return [line.strip() for line in text.splitlines()
            if re.search(r"= \S+ (all-gather|collective-permute|reduce-scatter|all-reduce)(-start)?\(", line)]


def _sharded_qkv(mesh, batch=2, q_heads=4, kv_heads=2):
    seq = NamedSharding(mesh, PartitionSpec(None, "seq"))
    shapes = ((batch, SEQ_LEN, q_heads, 16), (batch, SEQ_LEN, kv_heads, 16), (batch, SEQ_LEN, kv_heads, 8))
    return [jax.device_put(jnp.ones(s, jnp.float32), seq) for s in shapes]


def test_all_gather_hlo_gathers_keys_once_and_never_the_query():
    mesh = _mesh((4,), ("seq",))
    query, key, value = _sharded_qkv(mesh)
    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, context_parallel="all_gather",
                                                        zigzag_shards=4))
    collectives = _compiled_collectives(forward, query, key, value)
    gathers = [line for line in collectives if "all-gather" in line]
    assert len(gathers) == 2 and len(collectives) == 2, collectives  # one for K, one for V, nothing else
    assert any("f32[2,32,2,16]" in line for line in gathers) and any("f32[2,32,2,8]" in line for line in gathers)
    assert not any("f32[2,32,4,16]" in line for line in collectives), "the query was gathered"

    gradient = jax.jit(jax.grad(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True,
                                                                  context_parallel="all_gather").sum(), (0, 1, 2)))
    collectives = _compiled_collectives(gradient, query, key, value)
    assert sum("reduce-scatter" in line for line in collectives) == 2, collectives  # dK, dV
    assert not any("all-reduce" in line for line in collectives), collectives
    assert not any("f32[2,32,4,16]" in line for line in collectives), "the query was gathered"


def test_ring_hlo_permutes_keys_and_never_gathers_them():
    mesh = _mesh((4,), ("seq",))
    query, key, value = _sharded_qkv(mesh)
    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, context_parallel="ring",
                                                        zigzag_shards=4))
    collectives = _compiled_collectives(forward, query, key, value)
    # 3 steps of a 4-shard ring move K and V: 6 collective-permutes and nothing else.
    assert len(collectives) == 6 and all("collective-permute" in line for line in collectives), collectives

    gradient = jax.jit(jax.grad(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True,
                                                                  context_parallel="ring").sum(), (0, 1, 2)))
    collectives = _compiled_collectives(gradient, query, key, value)
    # forward (6) + backward K/V (6) + dK/dV returning home along the ring (8)
    assert len(collectives) == 20 and all("collective-permute" in line for line in collectives), collectives


def test_ring_issues_each_transfer_before_the_step_that_does_not_need_it():
    """The compiled schedule (CPU: collective-permute is synchronous there, no start/done pair) puts
    each step's K/V permute ahead of that step's attention (the conditional that skips, unmasks or
    masks it), so on a GPU the asynchronous permute's start/done can bracket the kernel."""
    mesh = _mesh((4,), ("seq",))
    query, key, value = _sharded_qkv(mesh)
    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, context_parallel="ring"))
    text = forward.lower(query, key, value).compile().as_text()
    entry = text[text.index("ENTRY"):]
    lines = entry.splitlines()
    first_permute = next(i for i, line in enumerate(lines) if "collective-permute(" in line)
    first_attention = next(i for i, line in enumerate(lines) if " conditional(" in line)
    assert first_permute < first_attention, entry


def _visible_blocks_per_shard(total, num_shards, zigzag_shards):
    """Causal (rows, keys) blocks each shard computes over a ring, from the library's own pieces and
    visibility rule: 1 for a fully visible block, 1/2 for a diagonal one (about half its scores)."""
    qp = context_parallel.pieces(total, num_shards, zigzag_shards, "query")
    config = fa4_jax.AttentionConfig(scale=1.0, causal=True)
    problem = type("P", (), {"config": config, "diagonal_offsets": lambda self: jnp.int32(0)})()
    work = []
    for shard in range(num_shards):
        count = 0.0
        for source in range(num_shards):
            for row_start in qp.starts(jnp.int32(shard)):
                for key_start in qp.starts(jnp.int32(source)):
                    case = int(context_parallel._visibility(problem, row_start, qp.length, key_start, qp.length))
                    count += {0: 0.0, 1: 1.0, 2: 0.5}[case]
        work.append(count)
    return work


def test_zigzag_balances_causal_work():
    balanced = _visible_blocks_per_shard(64, 4, 4)
    assert len(set(balanced)) == 1, balanced
    unbalanced = _visible_blocks_per_shard(64, 4, None)
    assert unbalanced[0] < unbalanced[-1], unbalanced


def test_cost_model():
    config = fa4_jax.AttentionConfig(scale=1.0)
    assert context_parallel.choose_strategy(config, 4096, 8, 8) == "ring"
    assert context_parallel.choose_strategy(config, 512, 8, 8) == "all_gather"
    assert context_parallel.choose_strategy(config, 512, 32, 8) == "ring"   # GQA: more work per byte
    assert context_parallel.choose_strategy(config.replace(context_parallel="all_gather"), 8192, 8, 8) == "all_gather"


def test_bad_zigzag_input_names_the_fix():
    query = jnp.ones((1, 12, 2, 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        fa4_jax.attention(query, query, query, causal=True, zigzag_shards=4)
    with pytest.raises(ValueError, match="positive int"):
        fa4_jax.attention(query, query, query, zigzag_shards=0)
    with pytest.raises(ValueError, match="context_parallel must be one of"):
        fa4_jax.attention(query, query, query, context_parallel="rings")
    with pytest.raises(ValueError, match="multiple of"):
        fa4_jax.zigzag(jnp.ones((1, 10)), 2)


def test_shards_that_do_not_split_the_zigzag_chunks_raise():
    """An array in hand raises a ValueError at the call; under jit the split is known only when XLA
    partitions, and the same ValueError's message comes back inside XLA's error."""
    mesh = _mesh((4,), ("seq",))
    x = jax.device_put(jnp.ones((1, 24, 2, 16)), NamedSharding(mesh, PartitionSpec(None, "seq")))
    fix = "zigzag_shards equal to the number of sequence shards"  # 6 chunks of 4 over 4 shards of 6
    with pytest.raises(ValueError, match=fix):
        fa4_jax.attention(x, x, x, causal=True, zigzag_shards=3)
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=fix):
        jax.jit(lambda x: fa4_jax.attention(x, x, x, causal=True, zigzag_shards=3))(x)


def test_forced_strategy_with_uneven_sequence_raises():
    mesh = _mesh((4,), ("seq",))
    x = jnp.ones((1, 10, 2, 16))
    constrained = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(None, "seq")))
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match="not a multiple of the 4 shards"):
        jax.jit(lambda x: fa4_jax.attention(constrained(x), constrained(x), constrained(x), causal=True,
                                            context_parallel="ring"))(x)


# ---------------------------------------------------------------------------------------- forward mode
# The tangent takes the forward's route (its key tangents travel or are gathered with the keys); the
# unsharded jvp it is compared with is checked against the float64 oracle in tests/test_forward_mode.py.

def _with_tangents(inputs, operands):
    tangents = {"t_" + name: inputs.normal(operands[name].shape) for name in ("query", "key", "value", "sinks")
                if name in operands}
    return dict(operands, **tangents)


def _jvp_results(operands, options):
    """(out, lse, t_out, t_lse) with the operands' tangents t_query, t_key, t_value (, t_sinks)."""
    names = ("query", "key", "value", "sinks")
    (out, lse), (t_out, t_lse) = jax.jvp(_attention(operands, options), tuple(operands.get(n) for n in names),
                                         tuple(operands.get("t_" + n) for n in names))
    return out, lse, t_out, t_lse


def _expected_jvp(operands, options, shards):
    single = jax.devices()[0]
    local = {name: jax.device_put(np.asarray(x), single) for name, x in operands.items()}
    results = jax.jit(lambda ops: _jvp_results(ops, options))(local)
    if shards is None:
        return results
    return tuple(fa4_jax.zigzag(r, shards, axis=a) for r, a in zip(results, (1, 2, 1, 2)))


def _check_jvp(actual, expected):
    for name, got, want in zip(("out", "lse", "t_out", "t_lse"), actual, expected, strict=True):
        oracle.assert_close(got, np.asarray(want), TOLERANCE, name, floor=1.0)


JVP_JIT_CASES = {
    "causal-ring-zigzag-seq4": (dict(causal=True), "ring", 4, "seq4", 2),
    "causal-window-softcap-sinks-allgather-zigzag": (dict(causal=True, window=(9, 2), softcap=3.0, sinks=True),
                                                     "all_gather", 2, "seq", 2),
    "window-sinks-segments-lengths-ring": (dict(window=(5, 5), sinks=True, segments=True, lengths=True), "ring",
                                           None, "seq", 2),
    "mqa-causal-sinks-ring-heads-x-seq": (dict(causal=True, sinks=True), "ring", None, "heads", 1),
}


@pytest.mark.parametrize("features,strategy,shards,layout,kv_heads", JVP_JIT_CASES.values(),
                         ids=JVP_JIT_CASES.keys())
def test_jvp_of_sequence_sharded_jit_equals_unsharded(inputs, features, strategy, shards, layout, kv_heads):
    operands, options = _problem(inputs, features, kv_heads=kv_heads)
    operands = _with_tangents(inputs, operands)
    if layout in ("seq", "seq4"):
        mesh, specs = _mesh((4 if layout == "seq4" else 2,), ("seq",)), _specs("seq")
    else:
        mesh, specs = _mesh((2, 2), ("heads", "seq")), _specs("seq", head_axis="heads")
        specs["key"] = specs["value"] = specs["t_key"] = specs["t_value"] = PartitionSpec(None, "seq")
    placed = {name: jax.device_put(x, NamedSharding(mesh, specs[name]))
              for name, x in _in_zigzag_order(operands, shards).items()}
    actual = jax.jit(lambda ops: _jvp_results(ops, dict(options, context_parallel=strategy, zigzag_shards=shards)))(
        placed)
    _check_jvp(actual, _expected_jvp(operands, options, shards))


@pytest.mark.parametrize("features,strategy,shards", SHARD_MAP_CASES.values(), ids=SHARD_MAP_CASES.keys())
def test_jvp_in_shard_map_with_context_parallel_axis_equals_unsharded(inputs, features, strategy, shards):
    operands, options = _problem(inputs, features)
    operands = _with_tangents(inputs, operands)
    operands.pop("d_out"), operands.pop("d_lse")
    mesh, specs, names = _mesh((2,), ("sp",)), _specs("sp"), sorted(operands)
    cp_options = dict(options, context_parallel=strategy, zigzag_shards=shards, context_parallel_axis="sp")
    function = jax.shard_map(lambda *arrays: _jvp_results(dict(zip(names, arrays)), cp_options), mesh=mesh,
                             in_specs=tuple(specs[n] for n in names),
                             out_specs=(specs["query"], specs["d_lse"]) * 2)
    ordered = _in_zigzag_order(operands, shards)
    _check_jvp(jax.jit(function)(*(ordered[n] for n in names)), _expected_jvp(operands, options, shards))


def test_zigzag_jvp_on_one_device_is_the_permuted_jvp(inputs):
    operands, options = _problem(inputs, dict(causal=True, window=(7, 3), sinks=True, segments=True, lengths=True))
    operands = _with_tangents(inputs, operands)
    single = jax.devices()[0]
    ordered = {name: jax.device_put(np.asarray(x), single) for name, x in _in_zigzag_order(operands, 4).items()}
    actual = jax.jit(lambda ops: _jvp_results(ops, dict(options, zigzag_shards=4)))(ordered)
    _check_jvp(actual, _expected_jvp(operands, options, 4))


def test_vmap_of_jvp_and_of_grad_in_shard_map_ring(inputs):
    """The outer primitives batch inside shard_map too: the sequence split runs in their lowering."""
    query, key, value = (inputs.normal(s) for s in ((2, SEQ_LEN, 4, 16), (2, SEQ_LEN, 2, 16), (2, SEQ_LEN, 2, 8)))
    tangents = [inputs.normal((3,) + x.shape) for x in (query, key, value)]
    options = dict(causal=True, zigzag_shards=2)

    def both(q, k, v, t_q, t_k, t_v, **cp):
        function = lambda q, k, v: fa4_jax.attention(q, k, v, **options, **cp)
        t_out = jax.vmap(lambda *t: jax.jvp(function, (q, k, v), t)[1])(t_q, t_k, t_v)
        grads = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(function(q, k, v) ** 2), (0, 1, 2)))(t_q, t_k, t_v)
        return t_out, grads

    seq, vmapped = PartitionSpec(None, "sp"), PartitionSpec(None, None, "sp")
    in_zigzag = [fa4_jax.zigzag(x, 2) for x in (query, key, value)] + [fa4_jax.zigzag(t, 2, axis=2) for t in tangents]
    sharded = jax.jit(jax.shard_map(functools.partial(both, context_parallel="ring", context_parallel_axis="sp"),
                                    mesh=_mesh((2,), ("sp",)), in_specs=(seq,) * 3 + (vmapped,) * 3,
                                    out_specs=(vmapped, (vmapped,) * 3)))(*in_zigzag)
    expected = jax.jit(both)(*in_zigzag)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected), strict=True):
        oracle.assert_close(got, np.asarray(want), TOLERANCE, "vmapped", floor=1.0)


def test_hessian_vector_product_in_shard_map_ring(inputs):
    """Second order inside shard_map: JAX differentiates the reference through the same ring."""
    query, key, value = (inputs.normal(s) for s in ((2, SEQ_LEN, 4, 16), (2, SEQ_LEN, 2, 16), (2, SEQ_LEN, 2, 8)))
    sinks = inputs.normal((4,))
    primals = (query, key, value, sinks)
    tangents = tuple(inputs.normal(x.shape) for x in primals)

    def loss(q, k, v, s, **cp):
        out, lse = fa4_jax.attention(q, k, v, sinks=s, causal=True, return_lse=True, **cp)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse ** 2)

    def hvp(loss, *primals_and_tangents):
        return jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), primals_and_tangents[:4], primals_and_tangents[4:])[1]

    def local_loss(*arrays):
        return jax.lax.psum(loss(*arrays, context_parallel="ring", context_parallel_axis="sp"), "sp")

    seq = PartitionSpec(None, "sp")
    sharded = jax.jit(jax.shard_map(functools.partial(hvp, local_loss), mesh=_mesh((2,), ("sp",)),
                                    in_specs=(seq, seq, seq, PartitionSpec()) * 2,
                                    out_specs=(seq, seq, seq, PartitionSpec())))(*primals, *tangents)
    expected = jax.jit(functools.partial(hvp, loss))(*primals, *tangents)
    for name, got, want in zip(("query", "key", "value", "sinks"), sharded, expected, strict=True):
        oracle.assert_close(got, np.asarray(want), 1e-4, name, floor=1.0)


def test_tangent_hlo_moves_key_tangents_with_the_keys():
    """ring: forward 6 permutes (K, V over 3 steps) + tangent 12 (K, V, t_K, t_V); all_gather: 2 + 4
    gathers. Neither moves the query or its tangent."""
    mesh = _mesh((4,), ("seq",))
    operands = _sharded_qkv(mesh) + _sharded_qkv(mesh)  # primals, tangents (distinct arrays)
    for strategy, kind, count in (("ring", "collective-permute", 18), ("all_gather", "all-gather", 6)):
        jvp = jax.jit(lambda q, k, v, *t: jax.jvp(
            lambda *a: fa4_jax.attention(*a, causal=True, context_parallel=strategy, zigzag_shards=4),
            (q, k, v), t))
        collectives = _compiled_collectives(jvp, *operands)
        assert len(collectives) == count and all(kind in line for line in collectives), (strategy, collectives)
        assert not any("f32[2,32,4,16]" in line for line in collectives), "the query was moved"


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_jvp_under_a_vmap_named_as_the_sequence_axis(inputs, strategy):
    """vmap(..., axis_name="sp") stands in for the mesh (tests/test_context_parallel_gpu.py): the
    batching rule runs the split under that named vmap, for the tangent as for the forward."""
    shards = 2
    to_shards = lambda x: jnp.moveaxis(x.reshape(x.shape[0], shards, -1, *x.shape[2:]), 1, 0)
    from_shards = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])
    shapes = ((2, SEQ_LEN, 4, 16), (2, SEQ_LEN, 2, 16), (2, SEQ_LEN, 2, 8))
    primals, tangents = [inputs.normal(s) for s in shapes], [inputs.normal(s) for s in shapes]
    sinks, t_sinks = inputs.normal((4,)), inputs.normal((4,))

    def jvp(q, k, v, t_q, t_k, t_v, **cp):
        function = lambda q, k, v, s: fa4_jax.attention(q, k, v, sinks=s, causal=True, window=(9, 2), **cp)
        return jax.jvp(function, (q, k, v, sinks), (t_q, t_k, t_v, t_sinks))

    per_shard = jax.vmap(functools.partial(jvp, context_parallel=strategy, context_parallel_axis="sp"),
                         axis_name="sp")
    out, t_out = jax.jit(per_shard)(*(to_shards(x) for x in primals + tangents))
    expected_out, expected_t_out = jax.jit(jvp)(*primals, *tangents)
    oracle.assert_close(from_shards(out), np.asarray(expected_out), TOLERANCE, "out", floor=1.0)
    oracle.assert_close(from_shards(t_out), np.asarray(expected_t_out), TOLERANCE, "t_out", floor=1.0)
