"""`fa4_jax.attention` under JAX transformations: jit, grad, vmap (any in_axes), jacobian, vmap(grad),
remat (with the residual names), scan, shard_map and jax.export; each checked against the oracle or
against the same computation without the transformation."""

import functools

import jax
import jax.extend
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import fa4_jax
import numpy_reference as oracle
from fa4_jax.primitive import attention_fwd_p

TOLERANCE = 1e-5  # float32 against the float64 oracle (see test_attention.py)

# Static options of every call here: masking and the softcap chain rule are in every check.
OPTIONS = dict(causal=True, window=(9, None), softcap=3.0)


def _small(inputs, batch=2, q_len=21, kv_len=26, q_heads=4, kv_heads=2, head_dim=16, value_dim=8):
    query = inputs.normal((batch, q_len, q_heads, head_dim), scale=1.5)
    key = inputs.normal((batch, kv_len, kv_heads, head_dim))
    value = inputs.normal((batch, kv_len, kv_heads, value_dim))
    sinks = inputs.normal((q_heads,))
    return query, key, value, sinks


def _oracle(query, key, value, sinks=None, **options):
    return oracle.attention_forward(query, key, value, sinks=sinks, **options)


def _loss(query, key, value, sinks, d_out, d_lse, **options):
    """A scalar that reads both outputs, so gradients cover the out and the lse paths (with sinks
    every lse is finite)."""
    out, lse = fa4_jax.attention(query, key, value, sinks=sinks, return_lse=True, **options)
    return jnp.sum(out * d_out) + jnp.sum(lse * d_lse)


def _check_gradients(grads, query, key, value, sinks, d_out, d_lse, **options):
    expected = oracle.attention_backward(query, key, value, d_out, d_lse, sinks=sinks, **options)
    for name, grad in zip(("dq", "dk", "dv", "dsinks"), grads):
        oracle.assert_close(grad, expected[name], TOLERANCE, name,
                            floor=expected["dsinks_scale"] if name == "dsinks" else 1e-6)


def test_jit_equals_eager(inputs):
    query, key, value, sinks = _small(inputs)
    eager = fa4_jax.attention(query, key, value, sinks=sinks, return_lse=True, **OPTIONS)
    jitted = jax.jit(lambda *a: fa4_jax.attention(*a[:3], sinks=a[3], return_lse=True, **OPTIONS))(
        query, key, value, sinks)
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    expected = _oracle(query, key, value, sinks, **OPTIONS)
    oracle.assert_close(eager[0], expected[0], TOLERANCE, "out")
    oracle.assert_close(eager[1], expected[1], TOLERANCE, "lse", floor=1.0)


def test_eager_calls_reuse_the_compiled_computation(inputs):
    """A second eager call with the same shapes and options must not compile again. The first call,
    after the caches are cleared, must be seen compiling: else a renamed event would pass vacuously."""
    query, key, value, sinks = _small(inputs)
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fa4_jax.attention(query, key, value, sinks=sinks, **OPTIONS))
        assert compiled, "no compile event seen for the first call"
        compiled.clear()
        jax.block_until_ready(fa4_jax.attention(query, key, value, sinks=sinks, **OPTIONS))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiled, f"the second eager call compiled {len(compiled)} time(s)"


def test_under_disable_jit(inputs):
    """jax.disable_jit() (for debugging the surrounding code) still runs attention, compiled: forward and
    gradient equal the jitted ones."""
    query, key, value, sinks = _small(inputs)
    d_out = inputs.normal((2, 21, 4, 8))
    d_lse = inputs.normal((2, 4, 21))
    gradient = jax.grad(functools.partial(_loss, **OPTIONS), argnums=(0, 1, 2, 3))

    def forward(*operands):
        return fa4_jax.attention(*operands[:3], sinks=operands[3], return_lse=True, **OPTIONS)
    with jax.disable_jit():
        eager = forward(query, key, value, sinks), gradient(query, key, value, sinks, d_out, d_lse)
    jitted = jax.jit(forward)(query, key, value, sinks), jax.jit(gradient)(query, key, value, sinks, d_out, d_lse)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_grad(inputs):
    query, key, value, sinks = _small(inputs)
    d_out = inputs.normal((2, 21, 4, 8))
    d_lse = inputs.normal((2, 4, 21))
    grads = jax.jit(jax.grad(functools.partial(_loss, **OPTIONS), argnums=(0, 1, 2, 3)))(
        query, key, value, sinks, d_out, d_lse)
    _check_gradients(grads, query, key, value, sinks, d_out, d_lse, **OPTIONS)


def _vmapped_case(inputs, name):
    """Operands with a leading vmapped axis of size 3 on the operands named in `name`."""
    size = 3
    query, key, value, sinks = _small(inputs)
    q_lengths = jnp.asarray([21, 15], jnp.int32)
    kv_ids = inputs.segment_ids(2, 26)
    q_ids = inputs.segment_ids(2, 21)
    operands = dict(query=query, key=key, value=value, sinks=sinks, q_seq_lengths=q_lengths,
                    q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    batched = {
        "query": lambda: inputs.normal((size,) + query.shape, scale=1.5),
        "key": lambda: inputs.normal((size,) + key.shape),
        "value": lambda: inputs.normal((size,) + value.shape),
        "sinks": lambda: inputs.normal((size,) + sinks.shape),
        "q_seq_lengths": lambda: jnp.asarray([[21, 3], [0, 20], [10, 21]], jnp.int32),
        "q_segment_ids": lambda: jnp.stack([inputs.segment_ids(2, 21) for _ in range(size)]),
        "kv_segment_ids": lambda: jnp.stack([inputs.segment_ids(2, 26) for _ in range(size)]),
    }
    in_axes = {}
    for operand in name.split("+"):
        operands[operand] = batched[operand]()
        in_axes[operand] = 0
    return operands, in_axes, size


def _attention_of(operands):
    return fa4_jax.attention(
        operands["query"], operands["key"], operands["value"], sinks=operands["sinks"],
        segment_ids=(operands["q_segment_ids"], operands["kv_segment_ids"]),
        q_seq_lengths=operands["q_seq_lengths"], return_lse=True, **OPTIONS)


def _oracle_of(operands):
    numpy_operands = {name: np.asarray(array) for name, array in operands.items()}
    return _oracle(numpy_operands["query"], numpy_operands["key"], numpy_operands["value"],
                   numpy_operands["sinks"],
                   segment_ids=(numpy_operands["q_segment_ids"], numpy_operands["kv_segment_ids"]),
                   q_seq_lengths=numpy_operands["q_seq_lengths"], **OPTIONS)


# Which operands carry the vmapped axis: batch-like operands, per-head sinks, and mixtures (the
# batching rule folds into batch, into heads, or maps element by element).
VMAPPED = ["query", "key+value", "value", "sinks", "query+sinks", "q_seq_lengths", "kv_segment_ids",
           "q_segment_ids+kv_segment_ids+q_seq_lengths", "query+key+value+sinks+q_seq_lengths"]


@pytest.mark.parametrize("vmapped", VMAPPED)
def test_vmap_partial_in_axes(inputs, vmapped):
    operands, mapped, size = _vmapped_case(inputs, vmapped)
    names = list(operands)
    in_axes = [mapped.get(name) for name in names]
    function = jax.jit(jax.vmap(lambda *arrays: _attention_of(dict(zip(names, arrays))), in_axes=in_axes))
    out, lse = function(*operands.values())
    for index in range(size):
        sliced = {name: array[index] if name in mapped else array for name, array in operands.items()}
        expected_out, expected_lse = _oracle_of(sliced)
        oracle.assert_close(out[index], expected_out, TOLERANCE, f"out[{index}]")
        oracle.assert_close(lse[index], expected_lse, TOLERANCE, f"lse[{index}]", floor=1.0)


@pytest.mark.parametrize("vmapped", ["query", "key+value", "sinks", "query+sinks", "q_seq_lengths",
                                     "query+key+value+sinks+q_seq_lengths"])
def test_vmap_of_vjp_partial_in_axes(inputs, vmapped):
    """The backward's batching rule: cotangents always vmapped, the primal operands only where named."""
    operands, mapped, size = _vmapped_case(inputs, vmapped)
    d_out = inputs.normal((size, 2, 21, 4, 8))
    d_lse = inputs.normal((size, 2, 4, 21))
    names = list(operands)

    def pullback(*arrays):
        given = dict(zip(names, arrays[:-2]))

        def function(query, key, value, sinks):
            return _attention_of(dict(given, query=query, key=key, value=value, sinks=sinks))
        _, vjp = jax.vjp(function, given["query"], given["key"], given["value"], given["sinks"])
        return vjp(arrays[-2:])

    in_axes = [mapped.get(name) for name in names] + [0, 0]
    grads = jax.jit(jax.vmap(pullback, in_axes=in_axes))(*operands.values(), d_out, d_lse)
    for index in range(size):
        sliced = {name: np.asarray(array[index] if name in mapped else array) for name, array in operands.items()}
        _check_gradients([grad[index] for grad in grads], sliced["query"], sliced["key"], sliced["value"],
                         sliced["sinks"], np.asarray(d_out[index]), np.asarray(d_lse[index]),
                         segment_ids=(sliced["q_segment_ids"], sliced["kv_segment_ids"]),
                         q_seq_lengths=sliced["q_seq_lengths"], **OPTIONS)


def test_vmap_of_the_forward_with_shared_sinks_is_one_batched_call(inputs):
    """Lengths and segment ids vmapped, the sinks not: the forward folds the vmapped axis into the batch
    (every batch element shares the sinks anyway) instead of running the elements one by one."""
    operands, mapped, _ = _vmapped_case(inputs, "q_segment_ids+kv_segment_ids+q_seq_lengths")
    names = list(operands)
    function = jax.vmap(lambda *arrays: _attention_of(dict(zip(names, arrays))),
                        in_axes=[mapped.get(name) for name in names])
    jaxpr = jax.make_jaxpr(function)(*operands.values()).jaxpr
    assert "scan" not in _primitive_names(jaxpr) and _count_forward_calls(jaxpr) == 1, _primitive_names(jaxpr)
    out, lse = jax.jit(function)(*operands.values())
    for index in range(3):
        sliced = {name: array[index] if name in mapped else array for name, array in operands.items()}
        expected_out, expected_lse = _oracle_of(sliced)
        oracle.assert_close(out[index], expected_out, TOLERANCE, f"out[{index}]")
        oracle.assert_close(lse[index], expected_lse, TOLERANCE, f"lse[{index}]", floor=1.0)


def test_vmap_over_a_non_leading_axis_and_out_axes(inputs):
    """Key and value vmapped on their axis 1 (sequence comes after it); results stacked on axis 2."""
    query, key, value, sinks = _small(inputs)
    keys = inputs.normal((2, 3, 26, 2, 16))
    values = inputs.normal((2, 3, 26, 2, 8))
    function = jax.vmap(lambda k, v: fa4_jax.attention(query, k, v, sinks=sinks, **OPTIONS),
                        in_axes=(1, 1), out_axes=2)
    out = jax.jit(function)(keys, values)
    assert out.shape == (2, 21, 3, 4, 8)
    for index in range(3):
        expected, _ = _oracle(query, keys[:, index], values[:, index], sinks, **OPTIONS)
        oracle.assert_close(out[:, :, index], expected, TOLERANCE, f"out[{index}]")


def test_nested_vmap(inputs):
    query = inputs.normal((2, 3, 1, 21, 4, 16))
    key = inputs.normal((3, 1, 26, 2, 16))
    value = inputs.normal((3, 1, 26, 2, 8))
    inner = jax.vmap(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True), in_axes=(0, 0, 0))
    out = jax.jit(jax.vmap(inner, in_axes=(0, None, None)))(query, key, value)
    for outer in range(2):
        for index in range(3):
            expected, _ = _oracle(query[outer, index], key[index], value[index], causal=True)
            oracle.assert_close(out[outer, index], expected, TOLERANCE, f"out[{outer}, {index}]")


def test_jacobian(inputs):
    """jax.jacobian (reverse mode) on a tiny problem, every entry (forward mode: test_forward_mode.py)."""
    query, key, value, sinks = _small(inputs, batch=1, q_len=3, kv_len=4, q_heads=2, kv_heads=1, head_dim=4,
                                      value_dim=3)
    options = dict(causal=True, softcap=2.0)

    def function(q, k, v, s):
        return fa4_jax.attention(q, k, v, sinks=s, return_lse=True, **options)

    jacobians = jax.jit(jax.jacobian(function, argnums=(0, 1, 2, 3)))(query, key, value, sinks)
    out, lse = function(query, key, value, sinks)
    operands = {"dq": query, "dk": key, "dv": value, "dsinks": sinks}
    for output_index, output in enumerate((out, lse)):
        # Row `position` of the Jacobian is the VJP with a one-hot cotangent at `position`.
        expected = {name: np.zeros(output.shape + operand.shape) for name, operand in operands.items()}
        for position in np.ndindex(output.shape):
            cotangents = [np.zeros(out.shape), np.zeros(lse.shape)]
            cotangents[output_index][position] = 1.0
            row = oracle.attention_backward(query, key, value, *cotangents, sinks=sinks, **options)
            for name in operands:
                expected[name][position] = row[name]
        for name, jacobian in zip(operands, jacobians[output_index]):
            oracle.assert_close(jacobian, expected[name], TOLERANCE, f"d {['out', 'lse'][output_index]} / {name}")


def test_vmap_of_grad(inputs):
    """Per-example gradients: every example's gradient equals the oracle's for that example alone."""
    examples = 3
    query = inputs.normal((examples, 1, 21, 4, 16), scale=1.5)
    key = inputs.normal((examples, 1, 26, 2, 16))
    value = inputs.normal((examples, 1, 26, 2, 8))
    sinks = inputs.normal((4,))
    d_out = inputs.normal((examples, 1, 21, 4, 8))
    d_lse = inputs.normal((examples, 1, 4, 21))
    per_example = jax.vmap(jax.grad(functools.partial(_loss, **OPTIONS), argnums=(0, 1, 2, 3)),
                           in_axes=(0, 0, 0, None, 0, 0))
    grads = jax.jit(per_example)(query, key, value, sinks, d_out, d_lse)
    for index in range(examples):
        _check_gradients([g[index] for g in grads], query[index], key[index], value[index], sinks,
                         d_out[index], d_lse[index], **OPTIONS)


def _primitive_names(jaxpr) -> set:
    """The names of every primitive in `jaxpr`, sub-jaxprs included."""
    names = set()
    for equation in jaxpr.eqns:
        names.add(equation.primitive.name)
        for sub_jaxpr in jax.extend.core.jaxprs_in_params(equation.params):
            names |= _primitive_names(sub_jaxpr)
    return names


def _count_forward_calls(jaxpr) -> int:
    """How many times the attention forward primitive runs, looking inside every sub-jaxpr."""
    count = 0
    for equation in jaxpr.eqns:
        if equation.primitive is attention_fwd_p:
            count += 1
        for sub_jaxpr in jax.extend.core.jaxprs_in_params(equation.params):
            count += _count_forward_calls(sub_jaxpr)
    return count


@pytest.mark.parametrize("policy,forward_calls", [
    (None, 2),  # plain jax.checkpoint saves nothing: the backward recomputes the forward
    (jax.checkpoint_policies.nothing_saveable, 2),
    (jax.checkpoint_policies.save_only_these_names(*fa4_jax.RESIDUAL_NAMES), 1),
], ids=["default", "nothing-saveable", "save-residual-names"])
def test_remat(inputs, policy, forward_calls):
    query, key, value, sinks = _small(inputs)
    d_out = inputs.normal((2, 21, 4, 8))
    d_lse = inputs.normal((2, 4, 21))
    loss = functools.partial(_loss, **OPTIONS)
    remat_loss = jax.checkpoint(loss, policy=policy)
    gradient = jax.grad(remat_loss, argnums=(0, 1, 2, 3))
    grads = jax.jit(gradient)(query, key, value, sinks, d_out, d_lse)
    _check_gradients(grads, query, key, value, sinks, d_out, d_lse, **OPTIONS)
    jaxpr = jax.make_jaxpr(gradient)(query, key, value, sinks, d_out, d_lse).jaxpr
    assert _count_forward_calls(jaxpr) == forward_calls


def test_residual_names_are_public():
    assert fa4_jax.RESIDUAL_NAMES == ("fa4_query", "fa4_key", "fa4_value", "fa4_out", "fa4_lse")


def _layer(x, weights):
    """A small pre-projection attention block on x [B, S, 4 * 8]: GQA with 4 query and 2 KV heads."""
    batch, length, _ = x.shape
    query = (x @ weights["query"]).reshape(batch, length, 4, 8)
    key = (x @ weights["key"]).reshape(batch, length, 2, 8)
    value = (x @ weights["value"]).reshape(batch, length, 2, 8)
    out = fa4_jax.attention(query, key, value, causal=True, sinks=weights["sinks"])
    return x + out.reshape(batch, length, 32) @ weights["out"]


def test_scan_over_layers_equals_unrolled(inputs):
    layers = 3
    weights = {"query": inputs.normal((layers, 32, 32), scale=0.2), "key": inputs.normal((layers, 32, 16), scale=0.2),
               "value": inputs.normal((layers, 32, 16), scale=0.2), "out": inputs.normal((layers, 32, 32), scale=0.2),
               "sinks": inputs.normal((layers, 4))}
    x = inputs.normal((2, 19, 32))

    def scanned(weights, x):
        y, _ = jax.lax.scan(lambda h, w: (_layer(h, w), None), x, weights)
        return jnp.sum(y ** 2)

    def unrolled(weights, x):
        for index in range(layers):
            x = _layer(x, jax.tree.map(lambda w: w[index], weights))
        return jnp.sum(x ** 2)

    scan_value, scan_grads = jax.jit(jax.value_and_grad(scanned))(weights, x)
    loop_value, loop_grads = jax.jit(jax.value_and_grad(unrolled))(weights, x)
    np.testing.assert_allclose(scan_value, loop_value, rtol=1e-5)
    for name in weights:
        oracle.assert_close(scan_grads[name], np.asarray(loop_grads[name]), TOLERANCE, name)


def test_shard_map_with_grad(inputs):
    """Each device runs attention and its backward on its batch shard inside shard_map; the sinks are
    replicated, so their gradient comes back summed over the shards (as for any JAX operation)."""
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = Mesh(devices, ("data",))
    query, key, value, sinks = _small(inputs, batch=4)
    d_out = inputs.normal((4, 21, 4, 8))
    d_lse = inputs.normal((4, 4, 21))
    loss = functools.partial(_loss, **OPTIONS)

    def per_shard(q, k, v, s, d_o, d_l):
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, s, d_o, d_l)

    data = PartitionSpec("data")
    function = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(data, data, data, PartitionSpec(), data, data),
                                     out_specs=(data, data, data, PartitionSpec())))
    grads = function(query, key, value, sinks, d_out, d_lse)
    _check_gradients(grads, query, key, value, sinks, d_out, d_lse, **OPTIONS)


# Inside shard_map a replicated operand that meets sharded ones must be treated as the same value on
# every device (as JAX's own operations do): the output varies over the union of the operands' mesh
# axes, and the gradient of a replicated operand is the sum over those axes, replicated again.
SHARD_MAP_LAYOUTS = {
    # MQA with the query heads split: the one KV head is shared by every shard's heads.
    "heads-split-kv-replicated": dict(query=PartitionSpec(None, None, "x"), key=PartitionSpec(),
                                      value=PartitionSpec(), sinks=PartitionSpec("x"), lse=PartitionSpec(None, "x")),
    # Rows split (no option needs row positions): keys, values and sinks are shared by every shard.
    "rows-split-kv-sinks-replicated": dict(query=PartitionSpec(None, "x"), key=PartitionSpec(),
                                           value=PartitionSpec(), sinks=PartitionSpec(),
                                           lse=PartitionSpec(None, None, "x")),
}


@pytest.mark.parametrize("layout", SHARD_MAP_LAYOUTS.values(), ids=SHARD_MAP_LAYOUTS.keys())
def test_shard_map_gradient_of_a_replicated_operand_is_summed(inputs, layout):
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = Mesh(devices, ("x",))
    query, key, value, sinks = _small(inputs, q_len=24, kv_len=20, q_heads=4, kv_heads=1)
    d_out = inputs.normal((2, 24, 4, 8))
    d_lse = inputs.normal((2, 4, 24))
    options = dict(softcap=3.0)
    loss = functools.partial(_loss, **options)

    def per_shard(q, k, v, s, d_o, d_l):
        out = fa4_jax.attention(q, k, v, sinks=s, **options)
        assert jax.typeof(out).manual_axis_type.varying == {"x"}, jax.typeof(out)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, s, d_o, d_l)

    specs = (layout["query"], layout["key"], layout["value"], layout["sinks"])
    function = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=specs + (layout["query"], layout["lse"]),
                                     out_specs=specs))
    grads = function(query, key, value, sinks, d_out, d_lse)
    _check_gradients(grads, query, key, value, sinks, d_out, d_lse, **options)


def test_shard_map_output_varies_with_a_sharded_key(inputs):
    """The query replicated and one KV head per device: each device's output differs, so it must not
    be typed as replicated (out_specs=PartitionSpec() would then silently return one device's)."""
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = Mesh(devices, ("x",))
    query, key, value, _ = _small(inputs, q_heads=2, kv_heads=4)
    heads = PartitionSpec(None, None, "x")
    function = jax.shard_map(lambda q, k, v: fa4_jax.attention(q, k, v, **OPTIONS), mesh=mesh,
                             in_specs=(PartitionSpec(), heads, heads), out_specs=PartitionSpec())
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(function)(query, key, value)


def test_export_round_trip(inputs):
    """Serialize, deserialize and call (also its VJP) with the same results as the function itself."""
    query, key, value, sinks = _small(inputs)
    d_out = inputs.normal((2, 21, 4, 8))

    def function(q, k, v, s):
        return fa4_jax.attention(q, k, v, sinks=s, **OPTIONS)

    exported = jax.export.export(jax.jit(function))(query, key, value, sinks)
    restored = jax.export.deserialize(exported.serialize(vjp_order=1))
    np.testing.assert_array_equal(np.asarray(restored.call(query, key, value, sinks)),
                                  np.asarray(jax.jit(function)(query, key, value, sinks)))

    grads = jax.jit(jax.grad(lambda *a: jnp.sum(restored.call(*a) * d_out), argnums=(0, 1, 2, 3)))(
        query, key, value, sinks)
    _check_gradients(grads, query, key, value, sinks, d_out, None, **OPTIONS)


def test_export_with_a_symbolic_batch(inputs):
    """One exported artifact serves any batch size (shape polymorphism on the batch axis)."""
    (batch_size,) = jax.export.symbolic_shape("b")
    query_spec = jax.ShapeDtypeStruct((batch_size, 21, 4, 16), jnp.float32)
    kv_spec = jax.ShapeDtypeStruct((batch_size, 26, 2, 16), jnp.float32)
    value_spec = jax.ShapeDtypeStruct((batch_size, 26, 2, 8), jnp.float32)

    def function(q, k, v):
        return fa4_jax.attention(q, k, v, **OPTIONS)

    exported = jax.export.export(jax.jit(function))(query_spec, kv_spec, value_spec)
    restored = jax.export.deserialize(exported.serialize())
    for batch in (1, 3):
        query, key, value, _ = _small(inputs, batch=batch)
        expected, _ = _oracle(query, key, value, **OPTIONS)
        oracle.assert_close(restored.call(query, key, value), expected, TOLERANCE, f"out (batch {batch})")
