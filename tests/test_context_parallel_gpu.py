"""Context parallelism's per-shard kernel calls, proven on one device before several are lent.

`jax.vmap(..., axis_name="sp")` stands in for the sequence mesh axis: the sequence is cut into shards
along a new leading axis and `fa4_jax.attention(..., context_parallel_axis="sp")` runs the same ring
(or all-gather) code as on a mesh, its collective-permutes and gathers becoming moves between the vmapped
shards. The per-shard calls carry each shard's own q_start, which the batching rule cannot fold into the
batch, so every shard's (and ring step's) kernel call runs on its own, one after another, on one GPU.
The results must equal the unsharded call's: forward, LSE and every gradient.

The CPU test checks the emulation itself (on the reference path); the GPU test runs it on the kernels
(implementation="cute", so a kernel that refused a call fails the test instead of falling back).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle


def _to_shards(x, shards, axis=1):
    """[..., S, ...] -> [shards, ..., S / shards, ...]: shard i holds the i-th slice of the sequence."""
    moved = jnp.moveaxis(x, axis, 0)
    split = moved.reshape((shards, moved.shape[0] // shards) + moved.shape[1:])
    return jnp.moveaxis(split, 1, axis + 1)


def _from_shards(x, axis=1):
    moved = jnp.moveaxis(x, axis + 1, 1)
    merged = moved.reshape((moved.shape[0] * moved.shape[1],) + moved.shape[2:])
    return jnp.moveaxis(merged, 0, axis)


def _problem(inputs, dtype, q_len, q_heads, kv_heads, head_dim, with_sinks, with_kv_lengths):
    batch = 2
    operands = {
        "query": inputs.normal((batch, q_len, q_heads, head_dim), dtype),
        "key": inputs.normal((batch, q_len, kv_heads, head_dim), dtype),
        "value": inputs.normal((batch, q_len, kv_heads, head_dim), dtype),
        "d_out": inputs.normal((batch, q_len, q_heads, head_dim), dtype),
        "d_lse": inputs.normal((batch, q_heads, q_len)),
    }
    if with_sinks:
        operands["sinks"] = inputs.normal((q_heads,))
    if with_kv_lengths:
        operands["kv_seq_lengths"] = inputs.lengths(batch, q_len, minimum=q_len // 2)
    return operands


def _results(operands, options, shards=None):
    """(out, lse, dq, dk, dv[, dsinks]); with `shards`, the sequence over that many vmapped shards."""
    sinks = operands.get("sinks")
    kv_lengths = operands.get("kv_seq_lengths")

    def attention(query, key, value, sinks, **extra):
        return fa4_jax.attention(query, key, value, sinks=sinks, kv_seq_lengths=kv_lengths, return_lse=True,
                                 **options, **extra)

    def run(query, key, value, d_out, d_lse, sinks, **extra):
        (out, lse), pullback = jax.vjp(lambda q, k, v, s: attention(q, k, v, s, **extra), query, key, value, sinks)
        return (out, lse) + tuple(pullback((d_out, d_lse)))

    args = [operands[n] for n in ("query", "key", "value", "d_out", "d_lse")]
    if shards is None:
        return jax.jit(run)(*args, sinks)
    sharded = [_to_shards(x, shards, axis=2 if n == "d_lse" else 1)
               for x, n in zip(args, ("query", "key", "value", "d_out", "d_lse"))]
    per_shard = jax.vmap(lambda q, k, v, do, dl, s: run(q, k, v, do, dl, s, context_parallel_axis="sp"),
                         in_axes=(0, 0, 0, 0, 0, None), out_axes=0, axis_name="sp")
    out, lse, d_q, d_k, d_v, *d_sinks = jax.jit(per_shard)(*sharded, sinks)
    # A replicated sink's gradient comes back per shard; the shards' parts sum to the whole.
    d_sinks = [d.sum(axis=0) if d is not None else None for d in d_sinks]
    return (_from_shards(out), _from_shards(lse, axis=2), _from_shards(d_q), _from_shards(d_k),
            _from_shards(d_v), *d_sinks)


def _check(actual, expected, tolerance):
    """Every output checked before failing, so a report names all that differ (and where along the
    sequence: max |error| per 128 positions, relative to the output's largest entry)."""
    names = ("out", "lse", "d_query", "d_key", "d_value", "d_sinks")
    failures = []
    for name, got, want in zip(names, actual, expected):
        if want is None:
            assert got is None, name
            continue
        got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
        try:
            oracle.assert_close(got, want, tolerance, name, floor=1.0)
        except AssertionError as error:
            axis = 2 if name == "lse" else 1
            if got.ndim > axis:
                difference = np.moveaxis(np.abs(got - want), axis, 0)
                scale = max(float(np.max(np.abs(want))), 1.0)
                blocks = [round(float(np.max(difference[b:b + 128])) / scale, 4)
                          for b in range(0, difference.shape[0], 128)]
                error = f"{error}; per 128 positions {blocks}"
            failures.append(str(error))
    assert not failures, "\n".join(failures)


# (features, strategy, shards, zigzag shards, kv_seq_lengths, sinks)
CASES = {
    "ring-causal-zigzag": (dict(causal=True), "ring", 4, 4, False, False),
    "ring-causal-window-softcap": (dict(causal=True, window=(300, 0), softcap=20.0), "ring", 4, None, False, False),
    "ring-window-sinks": (dict(window=(200, 200)), "ring", 2, None, False, True),
    "allgather-causal-zigzag-kv-lengths-sinks": (dict(causal=True), "all_gather", 4, 4, True, True),
}


def _zigzagged(operands, zigzag_shards):
    if zigzag_shards is None:
        return operands
    axes = {"query": 1, "key": 1, "value": 1, "d_out": 1, "d_lse": 2}
    return {n: fa4_jax.zigzag(x, zigzag_shards, axis=axes[n]) if n in axes else x for n, x in operands.items()}


def _expected_in_order(results, zigzag_shards):
    if zigzag_shards is None:
        return results
    axes = (1, 2, 1, 1, 1)
    return tuple(fa4_jax.zigzag(r, zigzag_shards, axis=a) for r, a in zip(results, axes)) + tuple(results[5:])


def _run_case(inputs, case, dtype, implementation, q_len, head_dim, tolerance, outputs=6):
    """The first `outputs` of (out, lse, dq, dk, dv, dsinks) of the sharded call against the unsharded."""
    features, strategy, shards, zigzag_shards, kv_lengths, sinks = case
    operands = _problem(inputs, dtype, q_len, q_heads=4, kv_heads=2, head_dim=head_dim, with_sinks=sinks,
                        with_kv_lengths=kv_lengths)
    expected = _expected_in_order(_results(operands, dict(features, implementation=implementation)), zigzag_shards)
    options = dict(features, implementation=implementation, context_parallel=strategy, zigzag_shards=zigzag_shards)
    actual = _results(_zigzagged(operands, zigzag_shards), options, shards=shards)
    _check(actual[:outputs], expected[:outputs], tolerance)


@pytest.mark.parametrize("case", [CASES["ring-causal-zigzag"], CASES["allgather-causal-zigzag-kv-lengths-sinks"]],
                         ids=["ring-causal-zigzag", "allgather-causal-zigzag-kv-lengths-sinks"])
def test_vmapped_shards_equal_the_unsharded_reference(inputs, case):
    """The emulation itself, on the reference path (float32, any platform)."""
    _run_case(inputs, case, jnp.float32, "reference", q_len=32, head_dim=16, tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_per_shard_kernel_calls_equal_the_unsharded_kernel(inputs, case):
    """bf16 on the sm90 kernels: each shard's (and ring step's) call with its q_start, in sequence
    on one GPU, against the one unsharded kernel call (out and LSE; implementation="cute", so a refused
    call fails). The ring merges bf16 partial outputs, so the tolerance is a few bf16 roundings.
    The gradients on the sm90 backward kernel the same way."""
    _run_case(inputs, case, jnp.bfloat16, "cute", q_len=1024, head_dim=128, tolerance=2e-2)


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs (a ring of two)")
def test_ring_permute_brackets_the_kernel_on_two_gpus():
    """On GPUs XLA runs collective-permutes asynchronously: some K/V permute must start before an
    attention kernel of the step and be awaited only after it, i.e. the transfer overlaps the kernel."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices("gpu")[:2]), ("seq",))
    split = NamedSharding(mesh, PartitionSpec(None, "seq"))
    q, k, v = (jax.device_put(jnp.ones((1, 4096, 8, 128), jnp.bfloat16), split) for _ in range(3))
    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, context_parallel="ring",
                                                        implementation="cute"))
    text = forward.lower(q, k, v).compile().as_text()
    lines = text[text.index("ENTRY"):].splitlines()
    # A step's kernel sits in the entry computation or inside the conditional that skips, unmasks or
    # masks the step.
    kernels = [i for i, line in enumerate(lines)
               if ("custom-call(" in line and "CuteDSL" in line) or " conditional(" in line]
    assert kernels, "no CuTe kernel in the compiled ring"
    assert "CuteDSL" in text, "the ring did not run the CuTe kernels"
    starts = {line.split("=")[0].strip(): i for i, line in enumerate(lines) if "collective-permute-start(" in line}
    assert starts, "no asynchronous collective-permute"
    bracketed = []
    for i, line in enumerate(lines):
        if "collective-permute-done(" in line:
            start = next((s for name, s in starts.items() if name in line.split("(", 1)[1]), None)
            if start is not None and any(start < kernel < i for kernel in kernels):
                bracketed.append((start, i))
    assert bracketed, "\n".join(lines)
