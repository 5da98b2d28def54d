"""benchmarks/decode.py on the CPU: its rows are issue 16's grid, a row's JSON carries every field the
issue names (the row-measuring code run with a fake timer), and the plot renders from a report."""

from __future__ import annotations

import json

import jax
import pytest

from benchmarks import decode

ISSUE_FIELDS = ("batch", "context", "q_len", "page_size", "fa4_jax_ms", "fa4_jax_tbps", "pallas_best_ms")


def test_rows_are_the_issue_grid():
    expected = {(b, c, q, p) for b in (1, 8, 64) for c in (1024, 8192, 32768, 131072) for q in (1, 4)
                for p in (16, 64)}
    assert {(r["batch"], r["context"], r["q_len"], r["page_size"]) for r in decode.rows()} == expected
    assert (decode.Q_HEADS, decode.KV_HEADS, decode.HEAD_DIM) == (32, 8, 128)


@pytest.mark.parametrize("q_len", [1, 4])
def test_row_fields(monkeypatch, q_len):
    """Every issue field is in a measured row; Pallas runs only Sq = 1 rows (pallas_best_ms null else)."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(decode, "_inputs", lambda row, key: (
        jnp.zeros((1, row["q_len"], 32, 128), jnp.bfloat16), jnp.zeros((64, 16, 8, 128), jnp.bfloat16),
        jnp.zeros((64, 16, 8, 128), jnp.bfloat16), jnp.zeros((1, 64), jnp.int32), jnp.full((1,), 1024, jnp.int32)))
    monkeypatch.setattr(decode.attention, "_median_ms", lambda function, arguments, iterations: (None, 0.25))
    record = decode.measure(dict(batch=1, context=1024, q_len=q_len, page_size=16), jax.random.key(0), 3,
                            sm_count=132, option_variants=tuple(decode.OPTION_VARIANTS))
    for field in ISSUE_FIELDS:
        assert field in record, field
    assert record["num_splits"] == 16
    assert record["fa4_jax_tbps"] == pytest.approx(1 * 1024 * 8 * 128 * 4 / 0.25e-3 / 1e12)
    assert (record["pallas_best_ms"] is None) == (q_len != 1)
    # The DecodeOptions candidates, each beside the default options through the same decode.run.
    assert record["fa4_jax_run_ms"] == 0.25
    assert all(record[f"fa4_jax_{name}_ms"] == 0.25 for name in decode.OPTION_VARIANTS), record
    assert not [name for name in record if name.endswith("_error")], record
    assert "no_page_lookahead" in decode._format(record)
    json.dumps(record)


def test_cold_l2_fields(monkeypatch):
    """--cold-l2 adds each timed kernel's time after an L2 flush, ours and Pallas', with our bandwidth."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(decode, "_inputs", lambda row, key: (
        jnp.zeros((1, 1, 32, 128), jnp.bfloat16), jnp.zeros((64, 16, 8, 128), jnp.bfloat16),
        jnp.zeros((64, 16, 8, 128), jnp.bfloat16), jnp.zeros((1, 64), jnp.int32), jnp.full((1,), 1024, jnp.int32)))
    monkeypatch.setattr(decode.attention, "_median_ms", lambda function, arguments, iterations: (None, 0.25))
    flushes = []
    monkeypatch.setattr(decode, "_cold_median_ms",
                        lambda function, arguments, iterations, flush: flushes.append(flush) or 0.5)
    record = decode.measure(dict(batch=1, context=1024, q_len=1, page_size=16), jax.random.key(0), 3,
                            sm_count=132, cold_flush="flush")
    assert record["fa4_jax_cold_ms"] == 0.5 and record["pallas_best_cold_ms"] == 0.5
    assert record["fa4_jax_cold_tbps"] == pytest.approx(1 * 1024 * 8 * 128 * 4 / 0.5e-3 / 1e12)
    assert set(flushes) == {"flush"} and len(flushes) >= 2   # ours and each Pallas kernel
    assert "cold L2" in decode._format(record)


def test_plot(tmp_path):
    rows = [dict(batch=b, context=c, q_len=q, page_size=p, kv_bytes=decode.kv_bytes(dict(batch=b, context=c)),
                 fa4_jax_ms=1.0, fa4_jax_tbps=3.0, pallas_best_ms=2.0 if q == 1 else None)
            for b in (1, 64) for c in (1024, 8192) for q in (1, 4) for p in (16, 64)]
    report = dict(device="H200", date="2026-12-02T00:00:00", git_revision="0" * 40, copy_tbps=4.3, rows=rows)
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(report))
    decode.plot(str(path), str(tmp_path / "decode.png"))
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_merge(tmp_path):
    paths = []
    for batch, copy in ((1, 4.3), (64, 4.2)):
        path = tmp_path / f"b{batch}.json"
        path.write_text(json.dumps(dict(device="H200", date="d", git_revision="r", copy_tbps=copy,
                                        rows=[dict(batch=batch, copy_tbps=copy)])))
        paths.append(str(path))
    merged = decode.merge(paths, str(tmp_path / "all.json"))
    assert [row["batch"] for row in merged["rows"]] == [1, 64]
    assert merged["copy_tbps"] == 4.3 and len(merged["runs"]) == 2   # the stricter yardstick
    assert json.loads((tmp_path / "all.json").read_text()) == merged


def test_copy_bandwidth_takes_the_fastest_copy_and_records_each(monkeypatch):
    """The yardstick is the fastest copy that could be timed (one slow kernel must not lower the bar), and
    a copy that cannot be timed is recorded with its error."""
    milliseconds = {"bf16 x + 1": 2.0, "uint32 x + 1": 1.0}

    def fake_median_ms(function, arguments, iterations):
        name = arguments[0]
        if name not in milliseconds:
            raise RuntimeError("CUPTI returned no kernel timings")
        return None, milliseconds[name]

    monkeypatch.setattr(decode.attention, "_median_ms", fake_median_ms)
    monkeypatch.setattr(decode, "copy_kernels",
                        lambda: {name: (None, (lambda name: lambda: name)(name))
                                 for name in ("bf16 x + 1", "uint32 x + 1", "copy")})
    monkeypatch.setattr(jax, "jit", lambda function: function)

    def no_driver(iterations):
        raise RuntimeError("CUDA driver: CUDA_ERROR_NO_DEVICE")

    monkeypatch.setattr(decode, "memcpy_ms", no_driver)
    best, each = decode.copy_bandwidth(3)
    expected = 2 * decode.COPY_BYTES / 1e-3 / 1e12
    assert best == pytest.approx(expected)
    assert each["bf16 x + 1"] == pytest.approx(expected / 2) and each["copy"].startswith("RuntimeError")
    assert each["cuMemcpyDtoD"].startswith("RuntimeError: CUDA driver")
    # The driver's memcpy (timed between events) counts like the others, and here it is the fastest.
    monkeypatch.setattr(decode, "memcpy_ms", lambda iterations: 0.5)
    best, each = decode.copy_bandwidth(3)
    assert best == pytest.approx(2 * expected) == pytest.approx(each["cuMemcpyDtoD"])
