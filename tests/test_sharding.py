"""Sharding on 8 fake CPU devices: batch and head splits must need no communication (the compiled HLO
has no collective), and sequence splits of the keys or the queries must give the unsharded result."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import fa4_jax
import numpy_reference as oracle

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (tests/conftest.py fakes them on the CPU)")

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
TOLERANCE = 1e-5  # float32; a sharded run differs from the unsharded one only in summation order


def _mesh(shape, names) -> Mesh:
    return Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


def _collectives(compiled_text: str) -> list[str]:
    return [line.strip() for line in compiled_text.splitlines()
            if any(f" {name}" in line or f"{name}-start" in line for name in COLLECTIVES)]


def _problem(inputs, batch, q_len, kv_len, q_heads, kv_heads, features):
    """Operands (a dict, so each can get its own sharding) and the static options."""
    head_dim, value_dim = 16, 8
    operands = {
        "query": inputs.normal((batch, q_len, q_heads, head_dim), scale=1.5),
        "key": inputs.normal((batch, kv_len, kv_heads, head_dim)),
        "value": inputs.normal((batch, kv_len, kv_heads, value_dim)),
        "d_out": inputs.normal((batch, q_len, q_heads, value_dim)),
        "d_lse": inputs.normal((batch, q_heads, q_len)),
    }
    options = {name: features[name] for name in ("causal", "window", "softcap") if name in features}
    if features.get("sinks"):
        operands["sinks"] = inputs.normal((q_heads,))
    if features.get("segments"):
        operands["q_segment_ids"] = inputs.segment_ids(batch, q_len, segments=4)
        operands["kv_segment_ids"] = inputs.segment_ids(batch, kv_len, segments=4)
    if features.get("lengths"):
        operands["q_seq_lengths"] = inputs.lengths(batch, q_len, minimum=q_len // 2)
        operands["kv_seq_lengths"] = inputs.lengths(batch, kv_len, minimum=kv_len // 2)
    return operands, options


def _attention(operands, options):
    segment_ids = None
    if "q_segment_ids" in operands:
        segment_ids = (operands["q_segment_ids"], operands["kv_segment_ids"])
    def function(query, key, value, sinks):
        return fa4_jax.attention(query, key, value, sinks=sinks, segment_ids=segment_ids,
                                 q_seq_lengths=operands.get("q_seq_lengths"),
                                 kv_seq_lengths=operands.get("kv_seq_lengths"), return_lse=True, **options)
    return function


def _forward(operands, options):
    return _attention(operands, options)(operands["query"], operands["key"], operands["value"],
                                         operands.get("sinks"))


def _gradients(operands, options):
    """VJP with explicit cotangents (no loss reduction, which would itself need an all-reduce)."""
    _, pullback = jax.vjp(_attention(operands, options), operands["query"], operands["key"], operands["value"],
                          operands.get("sinks"))
    return pullback((operands["d_out"], operands["d_lse"]))


PASSES = {"forward": _forward, "gradient": _gradients}


def _place(operands, mesh, specs):
    """Each operand on the mesh with its PartitionSpec (replicated when not named)."""
    return {name: jax.device_put(array, NamedSharding(mesh, specs.get(name, PartitionSpec())))
            for name, array in operands.items()}


def _run(pass_name, operands, options):
    function = jax.jit(lambda operands: PASSES[pass_name](operands, options))
    return function, function(operands)


def _check_equal_to_unsharded(pass_name, sharded_results, operands, options):
    single = jax.devices()[0]
    unsharded = {name: jax.device_put(np.asarray(array), single) for name, array in operands.items()}
    _, expected = _run(pass_name, unsharded, options)
    for index, (actual, reference) in enumerate(zip(sharded_results, expected)):
        if reference is None:
            assert actual is None
            continue
        oracle.assert_close(actual, np.asarray(reference), TOLERANCE, f"{pass_name} result {index}", floor=1.0)


def _check_against_oracle(operands, options, out, lse):
    numpy = {name: np.asarray(array) for name, array in operands.items()}
    expected_out, expected_lse = oracle.attention_forward(
        numpy["query"], numpy["key"], numpy["value"], sinks=numpy.get("sinks"),
        segment_ids=(numpy["q_segment_ids"], numpy["kv_segment_ids"]) if "q_segment_ids" in numpy else None,
        q_seq_lengths=numpy.get("q_seq_lengths"), kv_seq_lengths=numpy.get("kv_seq_lengths"), **options)
    oracle.assert_close(out, expected_out, TOLERANCE, "out")
    oracle.assert_close(lse, expected_lse, TOLERANCE, "lse", floor=1.0)


BATCH_HEAD_FEATURES = {
    "plain": dict(),
    "causal-window-softcap": dict(causal=True, window=(11, 3), softcap=3.0),
    "segments-lengths": dict(causal=True, segments=True, lengths=True),
}


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("features", BATCH_HEAD_FEATURES.values(), ids=BATCH_HEAD_FEATURES.keys())
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["gqa", "mqa"])
def test_batch_and_head_sharding_needs_no_collectives(inputs, pass_name, features, kv_heads):
    mesh = _mesh((2, 4), ("batch", "heads"))
    operands, options = _problem(inputs, batch=2, q_len=40, kv_len=56, q_heads=8, kv_heads=kv_heads,
                                 features=features)
    heads = "heads" if kv_heads % 4 == 0 else None  # a single KV head is replicated
    specs = {"query": PartitionSpec("batch", None, "heads"), "d_out": PartitionSpec("batch", None, "heads"),
             "key": PartitionSpec("batch", None, heads), "value": PartitionSpec("batch", None, heads),
             "d_lse": PartitionSpec("batch", "heads"), "q_segment_ids": PartitionSpec("batch"),
             "kv_segment_ids": PartitionSpec("batch"), "q_seq_lengths": PartitionSpec("batch"),
             "kv_seq_lengths": PartitionSpec("batch")}
    placed = _place(operands, mesh, specs)
    function, results = _run(pass_name, placed, options)
    collectives = _collectives(function.lower(placed).compile().as_text())
    if pass_name == "gradient" and kv_heads == 1:
        # The one KV head is shared by query heads on every head shard: its dK / dV are partial sums
        # that must be all-reduced over the head axis; nothing else may communicate.
        collectives = [line for line in collectives if "all-reduce" not in line]
    assert not collectives, "batch/head sharded attention communicates:\n" + "\n".join(collectives[:10])
    if pass_name == "forward":
        out, lse = results
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("batch", None, "heads")), 4)
        _check_against_oracle(operands, options, out, lse)
    else:
        assert results[0].sharding.is_equivalent_to(placed["query"].sharding, 4)
    _check_equal_to_unsharded(pass_name, results, operands, options)


@pytest.mark.parametrize("pass_name", PASSES)
def test_sinks_with_batch_and_head_sharding(inputs, pass_name):
    """The forward needs no communication; the backward only sums the [Hq] sink gradient over batch."""
    mesh = _mesh((2, 4), ("batch", "heads"))
    operands, options = _problem(inputs, batch=2, q_len=40, kv_len=40, q_heads=8, kv_heads=4,
                                 features=dict(causal=True, sinks=True))
    specs = {"query": PartitionSpec("batch", None, "heads"), "d_out": PartitionSpec("batch", None, "heads"),
             "key": PartitionSpec("batch", None, "heads"), "value": PartitionSpec("batch", None, "heads"),
             "d_lse": PartitionSpec("batch", "heads"), "sinks": PartitionSpec("heads")}
    placed = _place(operands, mesh, specs)
    function, results = _run(pass_name, placed, options)
    collectives = _collectives(function.lower(placed).compile().as_text())
    if pass_name == "forward":
        assert not collectives, "\n".join(collectives[:10])
    else:
        # At most all-reduces of the sink gradient (8 heads over 4 shards: f32[2]).
        unexpected = [line for line in collectives if "all-reduce" not in line or "f32[2]" not in line]
        assert not unexpected, "\n".join(unexpected[:10])
    _check_equal_to_unsharded(pass_name, results, operands, options)


@pytest.mark.parametrize("pass_name", PASSES)
def test_head_sharding_finer_than_kv_heads_is_correct(inputs, pass_name):
    """8 query heads split 4 ways but only 2 KV heads, which cannot split the same way: whatever the
    partitioner does instead, the result must not change."""
    mesh = _mesh((4,), ("heads",))
    operands, options = _problem(inputs, batch=2, q_len=40, kv_len=40, q_heads=8, kv_heads=2,
                                 features=dict(causal=True, sinks=True))
    specs = {"query": PartitionSpec(None, None, "heads"), "d_out": PartitionSpec(None, None, "heads"),
             "d_lse": PartitionSpec(None, "heads"), "sinks": PartitionSpec("heads")}
    placed = _place(operands, mesh, specs)
    _, results = _run(pass_name, placed, options)
    _check_equal_to_unsharded(pass_name, results, operands, options)


SEQUENCE_FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(13, 5)),
    "causal-window-sinks": dict(causal=True, window=(20, None), sinks=True, softcap=3.0),
    "segments": dict(segments=True),
    "causal-segments-lengths": dict(causal=True, segments=True, lengths=True, sinks=True),
}
SHAPES = {"square": (64, 64), "q-shorter": (32, 96), "q-longer": (96, 32)}
# Every feature on the square shape; the position-dependent ones also with Sq != Sk (offsets != 0).
QUERY_SEQUENCE_CASES = {f"square-{name}": (SHAPES["square"], features) for name, features in SEQUENCE_FEATURES.items()}
QUERY_SEQUENCE_CASES.update({
    f"{shape_name}-{name}": (SHAPES[shape_name], SEQUENCE_FEATURES[name])
    for shape_name in ("q-shorter", "q-longer")
    for name in ("causal", "causal-window-sinks", "causal-segments-lengths")
})


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("shape,features", QUERY_SEQUENCE_CASES.values(), ids=QUERY_SEQUENCE_CASES.keys())
def test_query_sequence_sharding_equals_unsharded(inputs, pass_name, shape, features):
    """Query rows split over 4 devices: each shard must mask with global row positions."""
    q_len, kv_len = shape
    mesh = _mesh((4,), ("seq",))
    operands, options = _problem(inputs, batch=2, q_len=q_len, kv_len=kv_len, q_heads=4, kv_heads=2,
                                 features=features)
    specs = {"query": PartitionSpec(None, "seq"), "d_out": PartitionSpec(None, "seq"),
             "d_lse": PartitionSpec(None, None, "seq"), "q_segment_ids": PartitionSpec(None, "seq")}
    placed = _place(operands, mesh, specs)
    _, results = _run(pass_name, placed, options)
    if pass_name == "forward":
        _check_against_oracle(operands, options, *results)
    _check_equal_to_unsharded(pass_name, results, operands, options)


# (q_len, kv_len, row shards): Sq not divisible by the shards, so XLA would pad the last shards.
UNEVEN_SHAPES = {"q10-k10-over-4": (10, 10, 4), "q7-k12-over-2": (7, 12, 2), "q10-k6-over-4": (10, 6, 4)}
UNEVEN_QUERY_SEQUENCE_CASES = {
    f"{shape_name}-{name}": (UNEVEN_SHAPES[shape_name], SEQUENCE_FEATURES[name])
    for shape_name, names in [
        ("q10-k10-over-4", ("plain", "causal", "window", "causal-window-sinks", "causal-segments-lengths")),
        ("q7-k12-over-2", ("causal", "causal-segments-lengths")),
        ("q10-k6-over-4", ("causal-window-sinks",)),
    ]
    for name in names
}


def _check_constrained_equals_unsharded(pass_name, mesh, specs, operands, options):
    """Arrays cannot be placed unevenly, so an uneven split is a sharding constraint inside jit; the
    cotangents are computed there from it too (cos of the drawn ones), so the padding of an uneven
    shard would hold non-zero values (cos 0 = 1) and show in any sum over shards."""
    def run(sharded):
        def function(operands):
            if sharded:
                operands = {name: jax.lax.with_sharding_constraint(array, NamedSharding(mesh, specs[name]))
                            if name in specs else array for name, array in operands.items()}
            operands = dict(operands, d_out=jnp.cos(operands["d_out"]), d_lse=jnp.cos(operands["d_lse"]))
            return PASSES[pass_name](operands, options)
        return jax.jit(function)(operands)

    results, expected = run(sharded=True), run(sharded=False)
    if pass_name == "forward":
        _check_against_oracle(operands, options, *results)
    for index, (actual, reference) in enumerate(zip(results, expected)):
        if reference is None:
            assert actual is None
            continue
        oracle.assert_close(actual, np.asarray(reference), TOLERANCE, f"{pass_name} result {index}", floor=1.0)


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("shape,features", UNEVEN_QUERY_SEQUENCE_CASES.values(),
                         ids=UNEVEN_QUERY_SEQUENCE_CASES.keys())
def test_uneven_query_sequence_sharding_equals_unsharded(inputs, pass_name, shape, features):
    """Query rows split over shards that do not divide Sq (the backward sums dK/dV over row shards)."""
    q_len, kv_len, ways = shape
    mesh = _mesh((ways,), ("seq",))
    operands, options = _problem(inputs, batch=2, q_len=q_len, kv_len=kv_len, q_heads=4, kv_heads=2,
                                 features=features)
    specs = {"query": PartitionSpec(None, "seq"), "d_out": PartitionSpec(None, "seq"),
             "d_lse": PartitionSpec(None, None, "seq"), "q_segment_ids": PartitionSpec(None, "seq")}
    _check_constrained_equals_unsharded(pass_name, mesh, specs, operands, options)


# Uneven batch or head splits, where the backward sums over those shards: the sink gradient over batch
# shards, dK / dV over head shards that share one KV head. (Sq = 10, Sk = 12 throughout.)
UNEVEN_BATCH_HEAD_CASES = {
    "batch3-over-2-sinks": (dict(batch=3, q_heads=4, kv_heads=2), 2, PartitionSpec("x"),
                            dict(causal=True, sinks=True)),
    "batch3-over-4-sinks-lengths": (dict(batch=3, q_heads=4, kv_heads=2), 4, PartitionSpec("x"),
                                    dict(causal=True, sinks=True, lengths=True)),
    "batch3-over-2-segments": (dict(batch=3, q_heads=4, kv_heads=2), 2, PartitionSpec("x"),
                               dict(causal=True, segments=True)),
    "heads6-over-4-mqa": (dict(batch=2, q_heads=6, kv_heads=1), 4, PartitionSpec(None, None, "x"),
                          dict(causal=True)),
    "heads6-over-4-mqa-sinks": (dict(batch=2, q_heads=6, kv_heads=1), 4, PartitionSpec(None, None, "x"),
                                dict(window=(3, 2), sinks=True, softcap=3.0)),
}


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("sizes,ways,query_spec,features", UNEVEN_BATCH_HEAD_CASES.values(),
                         ids=UNEVEN_BATCH_HEAD_CASES.keys())
def test_uneven_batch_or_head_sharding_equals_unsharded(inputs, pass_name, sizes, ways, query_spec, features):
    """The batch (or the query heads) split over shards that do not divide it: XLA pads the last
    shards, whose padding must not enter the sums the backward takes over the shards."""
    mesh = _mesh((ways,), ("x",))
    operands, options = _problem(inputs, q_len=10, kv_len=12, features=features, **sizes)
    lse_spec = PartitionSpec(*query_spec[:1], *query_spec[2:3])
    specs = {"query": query_spec, "d_out": query_spec, "d_lse": lse_spec}
    if query_spec[0] is not None:  # the batch: every batched operand follows the query
        specs.update({name: PartitionSpec("x") for name in ("key", "value", "q_seq_lengths", "kv_seq_lengths",
                                                             "q_segment_ids", "kv_segment_ids")})
    else:
        specs["sinks"] = PartitionSpec("x")
    _check_constrained_equals_unsharded(pass_name, mesh, specs, operands, options)


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("features", [SEQUENCE_FEATURES["plain"], SEQUENCE_FEATURES["causal-segments-lengths"],
                                      SEQUENCE_FEATURES["causal-window-sinks"]],
                         ids=["plain", "causal-segments-lengths", "causal-window-sinks"])
def test_key_value_sequence_sharding_equals_unsharded(inputs, pass_name, features):
    """Keys and values split over 8 devices: the result must not depend on it (XLA may gather)."""
    mesh = _mesh((8,), ("seq",))
    operands, options = _problem(inputs, batch=2, q_len=48, kv_len=64, q_heads=4, kv_heads=2,
                                 features=features)
    specs = {"key": PartitionSpec(None, "seq"), "value": PartitionSpec(None, "seq"),
             "kv_segment_ids": PartitionSpec(None, "seq")}
    placed = _place(operands, mesh, specs)
    function, results = _run(pass_name, placed, options)
    # Every query needs every key, so something must move: this also shows `_collectives` sees it.
    assert _collectives(function.lower(placed).compile().as_text())
    if pass_name == "forward":
        _check_against_oracle(operands, options, *results)
    _check_equal_to_unsharded(pass_name, results, operands, options)


@pytest.mark.parametrize("pass_name", PASSES)
def test_query_sequence_over_two_mesh_axes(inputs, pass_name):
    """Rows split over ("b", "a") of a 2 x 4 mesh: a shard's first global row comes from both axis
    indices, minor axis last."""
    mesh = _mesh((2, 4), ("a", "b"))
    operands, options = _problem(inputs, batch=2, q_len=64, kv_len=48, q_heads=4, kv_heads=2,
                                 features=dict(causal=True, window=(10, 3), lengths=True))
    rows = ("b", "a")
    specs = {"query": PartitionSpec(None, rows), "d_out": PartitionSpec(None, rows),
             "d_lse": PartitionSpec(None, None, rows)}
    placed = _place(operands, mesh, specs)
    _, results = _run(pass_name, placed, options)
    if pass_name == "forward":
        _check_against_oracle(operands, options, *results)
    _check_equal_to_unsharded(pass_name, results, operands, options)


@pytest.mark.parametrize("pass_name", PASSES)
def test_batch_and_both_sequences_sharded(inputs, pass_name):
    """Batch on one mesh axis, query and key sequences on the other, causal with sinks and segments."""
    mesh = _mesh((2, 4), ("batch", "seq"))
    operands, options = _problem(inputs, batch=2, q_len=64, kv_len=80, q_heads=4, kv_heads=2,
                                 features=dict(causal=True, sinks=True, segments=True, window=(30, 2)))
    on_sequence = PartitionSpec("batch", "seq")
    specs = {"query": on_sequence, "key": on_sequence, "value": on_sequence, "d_out": on_sequence,
             "d_lse": PartitionSpec("batch", None, "seq"), "q_segment_ids": on_sequence,
             "kv_segment_ids": on_sequence}
    placed = _place(operands, mesh, specs)
    _, results = _run(pass_name, placed, options)
    if pass_name == "forward":
        _check_against_oracle(operands, options, *results)
    _check_equal_to_unsharded(pass_name, results, operands, options)


@pytest.mark.parametrize("layout", ["batch-heads", "query-sequence"])
def test_explicit_sharding_types_follow_the_query(inputs, layout):
    """With Explicit mesh axes the sharding is part of the type: out and lse (and dq) take the query's."""
    mesh = jax.make_mesh((2, 4), ("batch", "other"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    operands, options = _problem(inputs, batch=2, q_len=32, kv_len=32, q_heads=8, kv_heads=4,
                                 features=dict(causal=True, sinks=True))
    if layout == "batch-heads":
        specs = {"query": PartitionSpec("batch", None, "other"), "key": PartitionSpec("batch", None, "other"),
                 "value": PartitionSpec("batch", None, "other"), "sinks": PartitionSpec("other")}
        out_spec, lse_spec = PartitionSpec("batch", None, "other", None), PartitionSpec("batch", "other", None)
    else:
        specs = {"query": PartitionSpec("batch", "other")}
        out_spec, lse_spec = PartitionSpec("batch", "other", None, None), PartitionSpec("batch", None, "other")
    with jax.set_mesh(mesh):
        placed = {name: jax.device_put(array, specs.get(name, PartitionSpec())) for name, array in operands.items()}
        function = _attention(placed, options)
        out_type, lse_type = jax.eval_shape(function, placed["query"], placed["key"], placed["value"], placed["sinks"])
        assert (out_type.sharding.spec, lse_type.sharding.spec) == (out_spec, lse_spec)
        out, lse = jax.jit(function)(placed["query"], placed["key"], placed["value"], placed["sinks"])
        grads = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(function(q, k, v, s)[0]), argnums=(0, 1, 2, 3)))(
            placed["query"], placed["key"], placed["value"], placed["sinks"])
    assert out.sharding.spec == out_spec and grads[0].sharding.is_equivalent_to(placed["query"].sharding, 4)
    _check_against_oracle(operands, options, out, lse)
    expected = oracle.attention_backward(*(np.asarray(operands[name]) for name in ("query", "key", "value")),
                                         np.ones(out.shape), sinks=np.asarray(operands["sinks"]), **options)
    for name, grad in zip(("dq", "dk", "dv", "dsinks"), grads):
        oracle.assert_close(grad, expected[name], TOLERANCE, name,
                            floor=expected["dsinks_scale"] if name == "dsinks" else 1e-6)


# vmap under Explicit sharding: the batching rule folds the vmapped axis into the batch axis (no sinks)
# or the head axis (sinks), and Explicit axes allow only reshapes that keep each device's block whole.
# (in_axes of query, key, value, sinks; whether there are sinks)
EXPLICIT_VMAPS = {
    "query": ((0, None, None, None), False),
    "key-value": ((None, 0, 0, None), False),
    "query-with-sinks": ((0, None, None, None), True),
    "query-sinks": ((0, None, None, 0), True),
    "key-value-with-sinks": ((None, 0, 0, None), True),
    "sinks": ((None, None, None, 0), True),
}


@pytest.mark.parametrize("pass_name", PASSES)
@pytest.mark.parametrize("in_axes,with_sinks", EXPLICIT_VMAPS.values(), ids=EXPLICIT_VMAPS.keys())
def test_vmap_with_explicit_sharding(inputs, pass_name, in_axes, with_sinks):
    """Batch and heads Explicit-sharded (GQA 8/4 over 4 head shards), a vmapped axis of 3 (unsharded)
    on some operands: each element equals the unbatched call, and out keeps the query's sharding."""
    mesh = jax.make_mesh((2, 4), ("batch", "other"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    vmapped = lambda axis: (3,) if axis == 0 else ()
    arrays = {
        "query": inputs.normal(vmapped(in_axes[0]) + (2, 16, 8, 16)),
        "key": inputs.normal(vmapped(in_axes[1]) + (2, 12, 4, 16)),
        "value": inputs.normal(vmapped(in_axes[2]) + (2, 12, 4, 8)),
        "sinks": inputs.normal(vmapped(in_axes[3]) + (8,)),
    }
    sharded = {"query": ("batch", None, "other"), "key": ("batch", None, "other"),
               "value": ("batch", None, "other"), "sinks": ("other",)}
    specs = {name: PartitionSpec(*((None,) if axis == 0 else ()), *sharded[name])
             for name, axis in zip(arrays, in_axes)}
    d_out = inputs.normal((3, 2, 16, 8, 8))
    d_lse = inputs.normal((3, 2, 8, 16))

    def one(query, key, value, sinks, d_out, d_lse):
        def function(query, key, value, sinks):
            return fa4_jax.attention(query, key, value, sinks=sinks if with_sinks else None, causal=True,
                                     return_lse=True)
        if pass_name == "forward":
            return function(query, key, value, sinks)
        _, pullback = jax.vjp(function, query, key, value, sinks)
        return pullback((d_out, d_lse))[:3 + with_sinks]

    with jax.set_mesh(mesh):
        placed = {name: jax.device_put(array, specs[name]) for name, array in arrays.items()}
        results = jax.jit(jax.vmap(one, in_axes=in_axes + (0, 0)))(*placed.values(), d_out, d_lse)
    if pass_name == "forward":
        assert tuple(results[0].sharding.spec)[1:4] == ("batch", None, "other"), results[0].sharding.spec
    for index in range(3):
        element = [array[index] if axis == 0 else array for array, axis in zip(arrays.values(), in_axes)]
        expected = one(*element, d_out[index], d_lse[index])
        for result, reference in zip(results, expected):
            oracle.assert_close(result[index], np.asarray(reference), TOLERANCE, f"{pass_name} [{index}]", floor=1.0)
