"""benchmarks/tangent.py on the CPU: its row grid, the FLOP count, and that a report row is JSON."""

from __future__ import annotations

from benchmarks import tangent


def test_rows_and_flops():
    grid = tangent.rows()
    assert {(r["head_dim"], r["seq_len"], r["causal"]) for r in grid} == {
        (d, s, c) for d in (64, 128) for s in (1024, 4096) for c in (False, True)}
    assert all(r["batch"] * r["seq_len"] == tangent.TOKENS for r in grid)
    assert {r["head_dim"] for r in tangent.rows(quick=True, head_dims=(80,))} == {80}
    row = dict(batch=1, seq_len=100, q_heads=2, kv_heads=1, head_dim=64, causal=False)
    assert tangent.tangent_flops(row) == 5 * 2 * 2 * 100 * 100 * 64
    assert tangent.tangent_flops(dict(row, causal=True)) == tangent.tangent_flops(row) / 2
