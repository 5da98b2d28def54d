"""benchmarks/varlen.py on the CPU: its argument parsing and row grid, the useful-FLOP count, the
packed <-> padded index, and that a measured row (with a fake timer that only traces each call)
carries its fields as JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import varlen


def test_arguments_and_rows():
    args = varlen.parser().parse_args(["--out", "x.json", "--quick", "--mixes", "short-16-1024", "--iterations", "5"])
    assert (args.out, args.quick, args.mixes, args.iterations) == ("x.json", True, ["short-16-1024"], 5)
    assert varlen.parser().parse_args([]).out == "benchmarks/results/varlen_h200.json"
    with pytest.raises(SystemExit):
        varlen.parser().parse_args(["--mixes", "no-such-mix"])
    grid = varlen.rows()
    assert {(r["mix"], r["head_dim"], r["causal"]) for r in grid} == {
        (m, d, c) for m in varlen.MIXES for d in (64, 128) for c in (False, True)}
    assert {r["head_dim"] for r in varlen.rows(quick=True, mixes=["one-long-8192"])} == {128}


def test_lengths_are_a_fixed_draw_and_flops_count_each_sequence():
    for mix, (count, _) in varlen.MIXES.items():
        lengths = varlen.lengths_of(mix)
        assert len(lengths) == count and lengths.min() > 0
        np.testing.assert_array_equal(lengths, varlen.lengths_of(mix))
    assert varlen.lengths_of("one-long-8192").max() == 8192
    assert varlen.useful_flops([3, 5], 2, 64, False) == 4 * 2 * 64 * (9 + 25)
    assert varlen.useful_flops([3, 5], 2, 64, True) == 2 * 2 * 64 * (9 + 25)


def test_padding_index_round_trips_the_packing():
    lengths = np.array([3, 1, 4])
    cu, index = varlen.padding_index(lengths)
    np.testing.assert_array_equal(cu, [0, 3, 4, 8])
    np.testing.assert_array_equal(index, [[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7]])
    tokens = np.arange(8) * 10
    assert sorted(tokens[index[index >= 0]].tolist()) == tokens.tolist()


def test_measured_row_fields(monkeypatch):
    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(varlen, "lengths_of", lambda mix, seed=0: np.array([5, 1, 9]))
    monkeypatch.setattr(varlen.attention, "_median_ms", lambda function, arguments, iterations: (
        jnp.zeros(jax.eval_shape(function, *arguments).shape, jnp.bfloat16), 0.5))
    monkeypatch.setattr(varlen, "kernels_of", lambda function, arguments: ["sm90a_forward"])
    record = varlen.measure(dict(mix="short-16-1024", q_heads=4, kv_heads=2, head_dim=64, causal=True), 3)
    # Which of our kernels each of our calls lowers to is part of the row (cuDNN's are not ours to name).
    assert record["packed_kernels"] == record["padded_kernels"] == ["sm90a_forward"]
    assert "cudnn_padded_kernels" not in record
    assert (record["sequences"], record["tokens"], record["max_len"], record["padded_tokens"]) == (3, 15, 9, 27)
    for name in ("packed", "padded"):
        assert record[f"{name}_ms"] == 0.5, record.get(f"{name}_error")
        assert record[f"{name}_tflops"] == pytest.approx(record["useful_flops"] / 0.5e-3 / 1e12)
    assert record["speedup_vs_padded"] == 1.0 and record["max_abs_diff_vs_padded"] == 0.0
    # cuDNN does not trace on a CPU: its failure is a field of the row, and the others still time.
    assert ("cudnn_padded_ms" in record) != ("cudnn_padded_error" in record)
    json.dumps(record)


def test_backward_row_times_the_gradient(monkeypatch):
    """--backward: each call becomes its forward and backward (dq against a fixed cotangent, q's shape,
    so the packed / padded comparison holds), counted as 3.5x the forward's useful FLOPs."""
    import jax
    import jax.numpy as jnp

    assert varlen.parser().parse_args(["--backward"]).backward and not varlen.parser().parse_args([]).backward
    assert all(row["backward"] for row in varlen.rows(quick=True, backward=True))
    monkeypatch.setattr(varlen, "lengths_of", lambda mix, seed=0: np.array([5, 1, 9]))
    monkeypatch.setattr(varlen.attention, "_median_ms", lambda function, arguments, iterations: (
        jnp.zeros(jax.eval_shape(function, *arguments).shape, jnp.bfloat16), 0.5))
    monkeypatch.setattr(varlen, "kernels_of", lambda function, arguments: [])
    row = dict(mix="short-16-1024", q_heads=4, kv_heads=2, head_dim=64, causal=False)
    record = varlen.measure(dict(row, backward=True), 3)
    assert record["useful_flops"] == 3.5 * varlen.measure(row, 3)["useful_flops"]
    for name in ("packed", "padded"):
        assert record[f"{name}_ms"] == 0.5, record.get(f"{name}_error")
    assert record["max_abs_diff_vs_padded"] == 0.0


def test_kernels_of_names_the_custom_calls_of_a_lowering():
    """kernels_of reads the fa4_jax custom-call targets of the lowered function (none on the CPU, where
    attention lowers to the reference), so a packed gradient that fell back to the reference backward
    shows in the report."""
    import jax
    import jax.numpy as jnp

    import fa4_jax

    q = jnp.ones((6, 2, 64), jnp.bfloat16)
    cu = jnp.array([0, 2, 6], jnp.int32)
    assert varlen.kernels_of(jax.jit(lambda q, cu: fa4_jax.attention_varlen(q, q, q, cu, cu)), (q, cu)) == []
