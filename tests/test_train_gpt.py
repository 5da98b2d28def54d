"""examples/train_gpt.py on the 8 fake CPU devices of tests/conftest.py: sharded training runs, fa4_jax
matches XLA attention step for step, and attention adds no collective to what tensor parallelism needs."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--batch", "8",
        "--vocab", "64", "--quiet"]


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes them on the CPU)")


@pytest.mark.parametrize("mesh,kv_heads", [("data=2,model=4", "4"), ("data=4,model=2", "2")],
                         ids=["tp4", "tp2-gqa"])
def test_sharded_step_matches_xla_attention_with_same_collectives(train_gpt, eight_devices, tmp_path,
                                                                   mesh, kv_heads):
    runs = {}
    for attention in ("fa4", "xla"):
        out = tmp_path / f"{attention}.json"
        runs[attention] = train_gpt.main(TINY + ["--steps", "3", "--mesh", mesh, "--kv-heads", kv_heads,
                                                 "--attention", attention, "--json", str(out)])
        assert json.loads(out.read_text())["loss"] == runs[attention]["loss"]
    fa4, xla = runs["fa4"], runs["xla"]
    assert fa4["devices"]["used"] == 8 and fa4["mesh"] == train_gpt.parse_mesh(mesh, 8)
    assert np.all(np.isfinite(fa4["loss"]))
    np.testing.assert_allclose(fa4["loss"], xla["loss"], rtol=1e-4)
    # Same model, only the attention core differs: every collective is the projections' (or the
    # gradient reduction's), none is attention's.
    assert fa4["collectives"] == xla["collectives"]
    assert fa4["collectives"]["all-gather"] == 0 and fa4["collectives"]["all-to-all"] == 0
    for key in ("tokens_per_second", "median_step_seconds", "step_seconds", "versions", "git_revision"):
        assert key in fa4


@pytest.mark.parametrize("kv_heads", [8, 4, 1], ids=["mha", "gqa", "mqa"])
def test_attention_needs_no_collective_but_the_mqa_gradient_sum(train_gpt, eight_devices, inputs, kv_heads):
    """Batch on `data`, heads on `model`: each shard owns whole (batch, head) problems."""
    mesh = train_gpt.make_mesh({"data": 2, "model": 4})
    heads_spec = P("data", None, "model", None)
    kv_spec = heads_spec if kv_heads > 1 else P("data", None, None, None)
    query = jax.device_put(inputs.normal((4, 16, 8, 16)), NamedSharding(mesh, heads_spec))
    key, value = (jax.device_put(inputs.normal((4, 16, kv_heads, 16)), NamedSharding(mesh, kv_spec))
                  for _ in range(2))
    cotangent = jax.device_put(inputs.normal((4, 16, 8, 16)), NamedSharding(mesh, heads_spec))

    def forward_and_backward(query, key, value, cotangent):
        out, pullback = jax.vjp(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True), query, key, value)
        return out, pullback(cotangent)

    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True)).lower(query, key, value)
    assert set(train_gpt.collective_counts(forward.compile().as_text()).values()) == {0}
    compiled = jax.jit(forward_and_backward).lower(query, key, value, cotangent).compile()
    counts = train_gpt.collective_counts(compiled.as_text())
    # With one KV head replicated over the head shards, its gradient is a sum over them: all-reduces of
    # dK and dV (XLA may combine the two) are what that sharding needs, and nothing else.
    reductions = counts.pop("all-reduce")
    assert reductions in ((1, 2) if kv_heads == 1 else (0,))
    assert set(counts.values()) == {0}
    out, (d_query, _, _) = compiled(query, key, value, cotangent)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, heads_spec), 4)
    assert d_query.sharding.is_equivalent_to(NamedSharding(mesh, heads_spec), 4)


def test_cpu_run_learns(train_gpt, tmp_path):
    result = train_gpt.main(TINY + ["--steps", "15", "--learning-rate", "1e-2"])
    assert result["loss"][-1] < result["loss"][0] - 0.3
    assert result["tokens_per_second"] > 0


def test_synthetic_data_is_a_repeated_walk(train_gpt):
    tokens = np.asarray(train_gpt.synthetic_batch(0, 3, batch=2, seq_len=15, vocab=50))
    assert tokens.shape == (2, 16) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[:, :8], tokens[:, 8:])
    np.testing.assert_array_equal(tokens, train_gpt.synthetic_batch(0, 3, batch=2, seq_len=15, vocab=50))


def test_mesh_flag(train_gpt):
    assert train_gpt.parse_mesh("", 8) == {"data": 8, "model": 1}
    assert train_gpt.parse_mesh("model=4", 8) == {"data": 2, "model": 4}
    assert train_gpt.parse_mesh("data=2,model=2", 8) == {"data": 2, "model": 2}
    with pytest.raises(SystemExit):
        train_gpt.parse_mesh("data=4,model=4", 8)


def test_compare_script_summary_and_plot(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_gpt_compare", EXAMPLE.parents[1] / "benchmarks" / "train_gpt_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)

    def run(name, attention, losses, step):
        return {"name": name, "ok": True, "attention": attention, "fa4_implementation": "auto",
                "loss": losses, "median_step_seconds": step, "tokens_per_second": 1000 / step,
                "devices": {"kind": "cpu", "used": 1},
                "config": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "batch": 8,
                           "dtype": "float32"}}

    runs = [run("cudnn", "cudnn", [3.0, 2.0, 1.0], 0.2), run("fa4", "fa4", [3.0, 2.1, 1.0], 0.1),
            {"name": "fa4_reference", "ok": False}]
    numbers = compare.compare(runs)["fa4"]
    assert numbers["step_time_ratio_vs_cudnn"] == pytest.approx(0.5)
    assert numbers["max_abs_loss_difference"] == pytest.approx(0.1)
    pytest.importorskip("matplotlib")
    result = tmp_path / "summary.json"
    result.write_text(json.dumps({"runs": runs}))
    compare.main(["plot", str(result), "--png", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").stat().st_size > 0
