"""Bad input fails early with the right error type and a message that says what to change.

Shape and dtype errors are checked under `jax.eval_shape`: they must come from argument checking or
abstract evaluation, before anything is lowered or compiled.
"""

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from conftest import has_gpu

BATCH, Q_LEN, KV_LEN, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 8, 12, 4, 2, 16


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _arrays(**changes):
    """Abstract operands of a valid call, with some replaced."""
    arrays = {
        "query": _spec((BATCH, Q_LEN, Q_HEADS, HEAD_DIM)),
        "key": _spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM)),
        "value": _spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM)),
    }
    arrays.update(changes)
    return arrays


def _abstract_call(arrays, **options):
    return jax.eval_shape(lambda arrays: fa4_jax.attention(**arrays, **options), arrays)


# (id, arrays, static options, error type, pattern: what was wrong and what to do about it)
BAD_INPUTS = [
    ("query-rank-3", _arrays(query=_spec((Q_LEN, Q_HEADS, HEAD_DIM))), {}, ValueError,
     r"rank 4.*x\[None\]"),
    ("value-rank-5", _arrays(value=_spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM, 1))), {}, ValueError,
     r"rank 4"),
    ("batch-mismatch", _arrays(key=_spec((BATCH + 1, KV_LEN, KV_HEADS, HEAD_DIM))), {}, ValueError,
     r"same batch size"),
    ("head-dim-mismatch", _arrays(key=_spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM * 2))), {}, ValueError,
     r"same head_dim"),
    ("key-value-length-mismatch", _arrays(value=_spec((BATCH, KV_LEN + 1, KV_HEADS, HEAD_DIM))), {}, ValueError,
     r"must agree on kv_len"),
    ("heads-not-divisible", _arrays(key=_spec((BATCH, KV_LEN, 3, HEAD_DIM)), value=_spec((BATCH, KV_LEN, 3, HEAD_DIM))),
     {}, ValueError, r"multiple of kv_heads.*repeat the key/value heads"),
    ("head-dim-above-256", _arrays(query=_spec((BATCH, Q_LEN, Q_HEADS, 320)), key=_spec((BATCH, KV_LEN, KV_HEADS, 320))),
     {}, ValueError, r"head_dim 320.*maximum 256.*split the heads"),
    ("value-head-dim-above-256", _arrays(value=_spec((BATCH, KV_LEN, KV_HEADS, 288))), {}, ValueError,
     r"v_head_dim 288.*maximum 256"),
    ("empty-sequence", _arrays(query=_spec((BATCH, 0, Q_HEADS, HEAD_DIM))), {}, ValueError,
     r"q_len, kv_len, q_heads, kv_heads, head_dim and v_head_dim must be >= 1 \(batch may be 0\)"),
    ("int-inputs", _arrays(query=_spec((BATCH, Q_LEN, Q_HEADS, HEAD_DIM), jnp.int32),
                           key=_spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM), jnp.int32),
                           value=_spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM), jnp.int32)),
     {}, TypeError, r"bfloat16, float16 or float32"),
    ("mixed-dtypes", _arrays(key=_spec((BATCH, KV_LEN, KV_HEADS, HEAD_DIM), jnp.float16)), {}, TypeError,
     r"share one dtype.*Cast them"),
    ("sinks-wrong-shape", _arrays(sinks=_spec((KV_HEADS,), jnp.float32)), {}, ValueError,
     r"sinks must have shape \(4,\)"),
    ("sinks-int", _arrays(sinks=_spec((Q_HEADS,), jnp.int32)), {}, TypeError, r"sinks must be a float array"),
    ("segment-ids-wrong-shape", _arrays(segment_ids=(_spec((BATCH, Q_LEN + 1), jnp.int32),
                                                     _spec((BATCH, KV_LEN), jnp.int32))),
     {}, ValueError, r"q_segment_ids must have shape \(2, 8\)"),
    ("segment-ids-float", _arrays(segment_ids=(_spec((BATCH, Q_LEN), jnp.float32), _spec((BATCH, KV_LEN), jnp.int32))),
     {}, TypeError, r"integer array.*astype\(jnp\.int32\)"),
    ("single-segment-ids-cross-attention", _arrays(segment_ids=_spec((BATCH, Q_LEN), jnp.int32)), {}, ValueError,
     r"pass a pair"),
    ("segment-ids-three-arrays", _arrays(segment_ids=(_spec((BATCH, Q_LEN), jnp.int32),) * 3), {}, ValueError,
     r"or a pair"),
    ("q-lengths-wrong-shape", _arrays(q_seq_lengths=_spec((BATCH, 1), jnp.int32)), {}, ValueError,
     r"q_seq_lengths must have shape \(2,\)"),
    ("kv-lengths-float", _arrays(kv_seq_lengths=_spec((BATCH,), jnp.float32)), {}, TypeError,
     r"kv_seq_lengths must be an integer array"),
    ("window-negative", _arrays(), dict(window=(-1, 4)), ValueError, r"non-negative"),
    ("window-not-a-pair", _arrays(), dict(window=8), ValueError, r"pair \(left, right\)"),
    ("softcap-zero", _arrays(), dict(softcap=0.0), ValueError, r"softcap must be a positive.*or None"),
    ("softcap-negative", _arrays(), dict(softcap=-5.0), ValueError, r"softcap must be a positive"),
    ("scale-not-finite", _arrays(), dict(scale=float("nan")), ValueError, r"scale must be a finite"),
    # Finite Python floats that float32, in which the logits are computed, rounds to inf or 0.
    ("scale-beyond-float32", _arrays(), dict(scale=-1e39), ValueError, r"scale must be a finite.*float32"),
    ("softcap-beyond-float32", _arrays(), dict(softcap=1e39), ValueError, r"softcap must be a positive.*float32"),
    ("softcap-below-float32", _arrays(), dict(softcap=1e-39), ValueError, r"softcap must be a positive.*float32"),
    ("unknown-implementation", _arrays(), dict(implementation="triton"), ValueError,
     r"implementation must be one of.*'cute', 'reference'"),
]


@pytest.mark.parametrize("arrays,options,error,pattern", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_rejected(arrays, options, error, pattern):
    with pytest.raises(error, match=pattern):
        _abstract_call(arrays, **options)


SYMBOLIC_SHAPES = {
    "sequence": ("b, s", lambda b, s: ((b, s, Q_HEADS, HEAD_DIM), (b, s, KV_HEADS, HEAD_DIM))),
    "kv-sequence-and-window": ("b, t", lambda b, t: ((b, Q_LEN, Q_HEADS, HEAD_DIM), (b, t, KV_HEADS, HEAD_DIM))),
    "heads": ("b, h", lambda b, h: ((b, Q_LEN, 2 * h, HEAD_DIM), (b, KV_LEN, h, HEAD_DIM))),
}


@pytest.mark.parametrize("names,shapes", SYMBOLIC_SHAPES.values(), ids=SYMBOLIC_SHAPES.keys())
def test_symbolic_dims_other_than_batch_are_rejected(names, shapes):
    """jax.export shape polymorphism: only the batch may be symbolic; anything else is named, instead
    of an inconclusive symbolic comparison from deep inside the checks."""
    query_shape, key_shape = shapes(*jax.export.symbolic_shape(names))
    specs = [_spec(query_shape), _spec(key_shape), _spec(key_shape)]
    function = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, window=(3, 0)))
    with pytest.raises(ValueError, match=r"only the batch size may be symbolic.*query \(b, "):
        jax.export.export(function)(*specs)


def test_float64_inputs_are_rejected(enable_x64):
    arrays = {name: _spec(spec.shape, jnp.float64) for name, spec in _arrays().items()}
    with pytest.raises(TypeError, match=r"bfloat16, float16 or float32"):
        _abstract_call(arrays)


@pytest.mark.skipif(has_gpu(), reason="on a GPU implementation='cute' may run")
def test_cute_without_a_gpu_names_the_alternatives(inputs):
    query = inputs.normal((1, 8, 2, 16), jnp.bfloat16)
    key = inputs.normal((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"needs an NVIDIA GPU.*implementation=None.*'reference'"):
        jax.block_until_ready(fa4_jax.attention(query, key, key, implementation="cute"))


def test_zero_batch_is_valid_and_empty(inputs):
    """Batch is the one axis that may be 0: out, lse and the gradients are empty, the sink gradient 0."""
    query, key = inputs.normal((0, Q_LEN, Q_HEADS, HEAD_DIM)), inputs.normal((0, KV_LEN, KV_HEADS, HEAD_DIM))
    sinks = inputs.normal((Q_HEADS,))

    def loss(query, key, value, sinks):
        out, lse = fa4_jax.attention(query, key, value, sinks=sinks, causal=True, return_lse=True)
        assert out.shape == (0, Q_LEN, Q_HEADS, HEAD_DIM) and lse.shape == (0, Q_HEADS, Q_LEN)
        return out.sum() + lse.sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(query, key, key, sinks)
    assert [g.shape for g in grads[:3]] == [query.shape, key.shape, key.shape]
    assert not grads[3].any()


def test_valid_call_passes_the_checks():
    """The base operands of the table above are valid: each failure comes from its one change."""
    arrays = _arrays(sinks=_spec((Q_HEADS,), jnp.float32),
                     segment_ids=(_spec((BATCH, Q_LEN), jnp.int32), _spec((BATCH, KV_LEN), jnp.int32)),
                     q_seq_lengths=_spec((BATCH,), jnp.int32), kv_seq_lengths=_spec((BATCH,), jnp.int32))
    out = _abstract_call(arrays, window=(3, 0), softcap=20.0, causal=True)
    assert out.shape == (BATCH, Q_LEN, Q_HEADS, HEAD_DIM) and out.dtype == jnp.bfloat16
