"""benchmarks/hopper_vs_peers.py on the CPU: its rows are exactly issue 12's, a row's JSON carries every
field the issue names (the row-writing code run with stand-in libraries and fake timings), the plot
renders from a result file, and the peer library stays out of the package and the tests."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "hopper_vs_peers.py"
PEER = "fa4" + "peer"   # spelled apart, so that this file does not match its own search below

ISSUE_FIELDS = ("pass", "batch", "seq_len", "q_heads", "kv_heads", "head_dim", "causal",
                "fa4_jax_tflops", "cudnn_tflops", "fa4peer_tflops")


@pytest.fixture(scope="module")
def benchmark():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "path", list(sys.path))   # the script puts benchmarks/ and the root on it
        spec = importlib.util.spec_from_file_location("hopper_vs_peers", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, module)   # @dataclass looks its module up there
        spec.loader.exec_module(module)
    return module


def _issue_rows():
    """Issue 12's rows, written out from its text: (pass, batch, seq_len, q_heads, kv_heads, head_dim, causal)."""
    shapes = [(16384 // s, s, 2048 // d, 2048 // d, d, causal)
              for d in (64, 128, 256) for causal in (False, True) for s in (1024, 2048, 4096, 8192, 16384)]
    shapes += [(16384 // s, s, 16, kv, 128, True) for kv in (4, 2, 1) for s in (2048, 8192)]
    shapes += [(16384 // s, s, 16, 16, 192, causal) for causal in (False, True) for s in (2048, 8192)]
    return {(pass_name, *shape) for shape in shapes for pass_name in ("forward", "backward")}


def _key(row):
    shape = row.shape
    return (row.pass_name, shape.batch, shape.seq_len, shape.q_heads, shape.kv_heads, shape.head_dim, shape.causal)


def test_row_grid_is_the_issues(benchmark):
    rows = benchmark.row_grid()
    assert len(rows) == 80
    assert {_key(row) for row in rows} == _issue_rows()
    assert len({row.name for row in rows}) == 80
    assert all(row.shape.batch * row.shape.seq_len == 16384 for row in rows)


def test_row_filters(benchmark):
    rows = benchmark.row_grid()
    backward_128 = benchmark.select_rows(rows, r"^backward D128 ")
    assert len(backward_128) == 16   # 10 of the issue-3 grid and 6 GQA / MQA
    assert all(row.pass_name == "backward" and row.shape.head_dim == 128 for row in backward_128)
    grouped = benchmark.select_rows(rows, r"H16/(4|2|1) ")
    assert {row.shape.kv_heads for row in grouped} == {4, 2, 1} and len(grouped) == 12
    quick = benchmark.select_rows(rows, quick=True)
    assert quick and all(row.shape.seq_len <= 2048 for row in quick) and len(quick) == 34
    assert benchmark.select_rows(rows, "forward D192", quick=True) == [
        row for row in rows if row.pass_name == "forward" and row.shape.head_dim == 192 and row.shape.seq_len == 2048]


def test_flops(benchmark):
    shape = benchmark.Shape(batch=2, seq_len=1024, q_heads=16, kv_heads=4, head_dim=128, causal=True)
    forward = 4 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert benchmark.Row("forward", shape).flops == forward
    assert benchmark.Row("backward", shape).flops == 2.5 * forward


def _stand_in_libraries(benchmark):
    """XLA attention stands in for every library (the peer as not importable), so the rows are real
    forward and backward passes on the CPU."""
    def xla(shape):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=shape.causal, implementation="xla")

    def broken(shape):
        raise ValueError("no kernel for this shape")

    peer, version = benchmark.fa4peer_factory(enabled=False)
    assert version is None
    return dict(fa4_jax=xla, cudnn=broken, fa4peer=peer), dict(fa4_jax=xla, cudnn=xla, fa4peer=xla)


def _fake_timer(milliseconds=2.0, seen=None, out=None):
    def timer(function, arguments):
        if seen is not None:
            seen.append(len(json.loads(out.read_text())["rows"]))
        return function(*arguments), milliseconds
    return timer


SMALL = dict(batch=1, seq_len=64, q_heads=4, kv_heads=2, head_dim=32, causal=True)


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_row_has_the_issues_fields(benchmark, pass_name):
    shape = benchmark.Shape(**SMALL)
    row = benchmark.Row(pass_name, shape)
    inputs = benchmark.make_inputs(shape)
    failing, working = _stand_in_libraries(benchmark)

    record = benchmark.measure_row(row, inputs, working, _fake_timer(2.0))
    assert all(field in record for field in ISSUE_FIELDS)
    assert record["pass"] == pass_name and record["kv_heads"] == 2 and record["causal"] is True
    expected = row.flops / 2e-3 / 1e12
    assert all(record[f"{name}_tflops"] == pytest.approx(expected) for name in ("fa4_jax", "cudnn", "fa4peer"))
    assert record["ratio_vs_best_peer"] == pytest.approx(1.0)
    assert record["max_abs_diff_reference"] == "cudnn"
    labels = ["out"] if pass_name == "forward" else ["dq", "dk", "dv"]
    assert all(record[f"fa4_jax_max_abs_diff_{label}"] == 0.0 for label in labels)
    assert not any(key.endswith("_error") for key in record)
    json.dumps(record, allow_nan=False)

    record = benchmark.measure_row(row, inputs, failing, _fake_timer(2.0))
    assert all(field in record for field in ISSUE_FIELDS)
    assert record["fa4_jax_tflops"] == pytest.approx(expected)
    assert record["cudnn_tflops"] is None and record["cudnn_error"] == "ValueError: no kernel for this shape"
    assert record["fa4peer_tflops"] is None and record["fa4peer_error"].startswith("fa4peer not importable")
    assert record["ratio_vs_best_peer"] is None and record["best_peer"] is None
    assert record["max_abs_diff_reference"] is None


def test_sweep_rewrites_the_json_after_every_row(benchmark, tmp_path):
    out = tmp_path / "result.json"
    rows = [benchmark.Row(pass_name, benchmark.Shape(**dict(SMALL, causal=causal)))
            for causal in (False, True) for pass_name in ("forward", "backward")]
    report = benchmark.new_report("fake GPU", {"jax": jax.__version__})
    benchmark.write_report(report, out)
    seen = []
    _, working = _stand_in_libraries(benchmark)
    benchmark.sweep(rows, working, _fake_timer(1.0, seen, out), report, str(out))
    # Three libraries a row: each row's timings saw every earlier row on disk already.
    assert seen == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    written = json.loads(out.read_text())
    assert {"device", "date", "versions", "git_revision", "rows"} <= set(written)
    assert [record["name"] for record in written["rows"]] == [row.name for row in rows]
    table = benchmark.summary_table(written["rows"])
    assert "4 of 4 rows" in table and rows[0].name in table


def test_max_seconds_skips_whole_shapes(benchmark, tmp_path):
    out = tmp_path / "result.json"
    rows = [benchmark.Row(pass_name, benchmark.Shape(**SMALL)) for pass_name in ("forward", "backward")]
    report = benchmark.new_report("fake GPU", {})
    _, working = _stand_in_libraries(benchmark)
    benchmark.sweep(rows, working, _fake_timer(), report, str(out), max_seconds=-1)
    assert report["rows"] == [] and report["skipped_rows"] == [row.name for row in rows]


def _fake_result(benchmark, path):
    records = []
    for index, row in enumerate(benchmark.row_grid()):
        record = row.record()
        record.update(fa4_jax_tflops=400.0 + index, cudnn_tflops=450.0, fa4peer_tflops=None,
                      fa4peer_error="fa4peer not importable: --no-peer")
        if index % 7 == 0:
            record.update(fa4_jax_tflops=None, fa4_jax_error="NotImplementedError: no")
        record["best_peer"] = "cudnn"
        record["ratio_vs_best_peer"] = None if record["fa4_jax_tflops"] is None else record["fa4_jax_tflops"] / 450.0
        records.append(record)
    report = dict(device="NVIDIA H200", date="2026-12-01T00:00:00+00:00", versions={}, git_revision="0123456789abc",
                  rows=records)
    path.write_text(json.dumps(report))


def test_plot_renders_from_a_result_file(benchmark, tmp_path):
    pytest.importorskip("matplotlib")
    result, png = tmp_path / "result.json", tmp_path / "result.png"
    _fake_result(benchmark, result)
    benchmark.main(["--plot", str(result), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000


def test_arguments(benchmark, monkeypatch):
    seen = []
    monkeypatch.setattr(benchmark, "run", seen.append)
    benchmark.main(["--rows", "backward D(64|128) ", "--quick", "--no-peer", "--precompile-workers", "12",
                    "--grid", "head-dims",
                    "--iterations", "5", "--max-seconds", "400", "--out", "x.json"])
    (args,) = seen
    assert (args.rows, args.quick, args.no_peer, args.precompile_workers, args.iterations, args.max_seconds,
            args.out, args.grid) == ("backward D(64|128) ", True, True, 12, 5, 400.0, "x.json", "head-dims")
    with pytest.raises(SystemExit):
        benchmark.main(["--rows", "(unclosed"])


def test_peer_is_imported_by_the_benchmark_only(benchmark):
    """The package and the tests never import the peer; the benchmark imports it inside a function
    only (loading the script, as above, must not)."""
    statement = re.compile(rf"^\s*(import|from)\s+{PEER}\b|import_module\(\s*['\"]{PEER}|__import__\(\s*['\"]{PEER}",
                           re.MULTILINE)
    sources = sorted((ROOT / "fa4_jax").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    assert len(sources) > 20
    assert [str(path) for path in sources if statement.search(path.read_text())] == []
    assert PEER not in sys.modules
    assert statement.search(SCRIPT.read_text())


def test_head_dim_grid_is_the_padded_head_dims_and_their_kernels(benchmark):
    """--grid head-dims: D 80 and MLA's 192/128 (which fa4_jax zero-pads), each beside the head dims it
    pads to (96, 192), 16 heads, S 2k and 8k, causal or not; FLOPs count the call's own head dims."""
    rows = benchmark.row_grid("head-dims")
    assert len(rows) == 32 and len({row.name for row in rows}) == 32
    assert {(row.shape.head_dim, row.shape.value_dim) for row in rows} == {(80, 80), (96, 96), (192, 128), (192, 192)}
    assert all(row.shape.batch * row.shape.seq_len == 16384 and row.shape.q_heads == 16 for row in rows)
    mla = benchmark.select_rows(rows, r"^forward D192/128 S2048 ")
    assert [row.name for row in mla] == ["forward D192/128 S2048 B8 H16/16 full",
                                         "forward D192/128 S2048 B8 H16/16 causal"]
    assert mla[0].flops == 2 * 8 * 16 * 2048 * 2048 * (192 + 128)
    assert benchmark.select_rows(rows, r"D192 ") and all(row.shape.v_head_dim is None
                                                         for row in benchmark.select_rows(rows, r"D192 "))


@pytest.mark.parametrize("pass_name", ["forward", "backward"])
def test_row_of_a_value_head_dim_of_its_own(benchmark, pass_name):
    """Inputs and outputs at Dv: value and d_out [.., Dv], out and dv compared at Dv."""
    import fa4_jax

    shape = benchmark.Shape(**SMALL, v_head_dim=48)
    inputs = benchmark.make_inputs(shape)
    assert [x.shape[-1] for x in inputs] == [32, 32, 48, 48]

    def reference(shape):   # jax.nn's XLA attention refuses Dv != D
        return lambda q, k, v: fa4_jax.attention(q, k, v, causal=shape.causal, implementation="reference")
    working = dict(fa4_jax=reference, cudnn=reference, fa4peer=reference)
    record = benchmark.measure_row(benchmark.Row(pass_name, shape), inputs, working, _fake_timer(2.0))
    assert not any(key.endswith("_error") for key in record), record
    assert record["v_head_dim"] == 48 and record["name"].startswith(f"{pass_name} D32/48 ")


def test_rounds_take_turns_and_report_each_librarys_median_round(benchmark, monkeypatch):
    """With rounds > 1 the libraries alternate (a clock dip under the power cap then falls on all of them),
    `<lib>_ms` is the median of a library's rounds, and a library failing in a later round is reported
    as failed, not timed on its earlier rounds."""
    shape = benchmark.Shape(**SMALL)
    row = benchmark.Row("forward", shape)
    # Each library's timed function is its name; the fake timer looks its next time up.
    monkeypatch.setattr(benchmark, "timed_function", lambda pass_name, function, inputs: (function, ()))
    libraries = {name: (lambda name: lambda shape: name)(name) for name in benchmark.TIMING_ORDER}
    order, times = [], {"cudnn": [3.0, 1.0, 2.0], "fa4peer": [4.0, 4.0, 9.0], "fa4_jax": [5.0, 1.0, 1.0]}

    def timer(name, arguments):
        order.append(name)
        return jnp.zeros((1,)), times[name][order.count(name) - 1]

    record = benchmark.measure_row(row, None, libraries, timer, rounds=3)
    assert order == list(benchmark.TIMING_ORDER) * 3
    assert (record["cudnn_ms"], record["fa4peer_ms"], record["fa4_jax_ms"]) == (2.0, 4.0, 1.0)
    assert record["fa4_jax_ms_rounds"] == [5.0, 1.0, 1.0]
    assert record["ratio_vs_best_peer"] == pytest.approx(2.0)

    def failing_later(name, arguments):
        order.append(name)
        if name == "fa4peer" and order.count(name) > 1:
            raise RuntimeError("lost the device")
        return jnp.zeros((1,)), 1.0

    order.clear()
    record = benchmark.measure_row(row, None, libraries, failing_later, rounds=3)
    assert record["fa4peer_ms"] is None and record["fa4peer_error"].startswith("RuntimeError")
    assert "fa4peer_ms_rounds" not in record and record["fa4peer_max_abs_diff_out"] is None
    assert order.count("fa4peer") == 2 and order.count("cudnn") == 3
