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


@pytest.mark.parametrize("strategy", ["ring", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_context_parallel_training_matches_the_unsplit_sequence(train_gpt, eight_devices, strategy):
    """--context-parallel 4 --zigzag (the sequence over 4 devices in zigzag order) trains the same model
    on the same data: the losses equal those of a batch-only mesh, and K/V move as the strategy says."""
    plain = train_gpt.main(TINY + ["--steps", "2", "--mesh", "data=2"])
    split = train_gpt.main(TINY + ["--steps", "2", "--mesh", "data=2", "--context-parallel", "4", "--zigzag",
                                   "--context-parallel-strategy", strategy])
    assert split["mesh"] == {"data": 2, "model": 1, "seq": 4} and split["devices"]["used"] == 8
    np.testing.assert_allclose(split["loss"], plain["loss"], rtol=1e-4)
    if strategy == "ring":
        assert split["collectives"]["collective-permute"] > 0
    else:
        assert split["collectives"]["reduce-scatter"] > 0


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


def test_help_shows_defaults_and_steps_below_timing_skip_is_an_error(train_gpt, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "training steps (default: 30)" in help_text and "(default: 0)" in help_text
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--steps", "1", "--timing-skip", "2"])
    assert "smaller than --timing-skip" in capsys.readouterr().err
    assert train_gpt.parse_args(["--steps", "2", "--timing-skip", "2"]).steps == 2


def test_compare_script_summary_and_plot(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "train_gpt_compare", EXAMPLE.parents[1] / "benchmarks" / "train_gpt_compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)

    def run(name, attention, losses, step, mesh=None, all_reduces=0):
        return {"name": name, "mesh_flag": mesh, "ok": True, "attention": attention,
                "fa4_implementation": "auto", "loss": losses, "median_step_seconds": step,
                "tokens_per_second": 1000 / step, "warnings": [], "custom_calls": {},
                "collectives": {"all-reduce": all_reduces, "all-gather": 0},
                "devices": {"kind": "cpu", "used": 1 if mesh is None else 2},
                "config": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 32, "batch": 8,
                           "dtype": "float32"}}

    runs = [run("cudnn", "cudnn", [3.0, 2.0, 1.0], 0.2), run("fa4", "fa4", [3.0, 2.1, 1.0], 0.1),
            {"name": "fa4_reference", "mesh_flag": None, "ok": False, "exit": 1, "log_tail": "boom"}]
    numbers = compare.compare(runs)["fa4"]
    assert numbers["step_time_ratio_vs_cudnn"] == pytest.approx(0.5)
    # No CuTe custom call in the compiled step: the comparison must not pass the reference off as the kernels.
    assert numbers["attention"] == "fa4_jax (reference path)"
    on_kernels = dict(runs[1], custom_calls={"CuteDSLRT_NvJaxCutlassCall_v2": 12})
    assert compare.compare([runs[0], on_kernels])["fa4"]["attention"] == "fa4_jax (CuTe kernels)"
    assert numbers["max_abs_loss_difference"] == pytest.approx(0.1)
    assert numbers["same_collectives_as_cudnn"]

    meshes = ["data=2", "data=1,model=2"]
    mesh_runs = [run("cudnn", "cudnn", [3.0, 2.0], 0.2, meshes[0], 1),
                 run("fa4", "fa4", [3.0, 2.0], 0.2, meshes[0], 1),
                 run("cudnn", "cudnn", [3.0, 2.5], 0.4, meshes[1], 8),
                 run("fa4", "fa4", [3.0, 2.0], 0.2, meshes[1], 9),
                 {"name": "fa4_reference", "mesh_flag": meshes[1], "ok": False, "exit": "timeout",
                  "log_tail": ""}]
    summary = compare.summarize([], meshes, mesh_runs)
    assert summary["comparison"][meshes[0]]["fa4"]["step_time_ratio_vs_cudnn"] == pytest.approx(1.0)
    assert summary["comparison"][meshes[0]]["fa4"]["same_collectives_as_cudnn"]
    assert summary["comparison"][meshes[1]]["fa4"]["max_abs_loss_difference"] == pytest.approx(0.5)
    assert not summary["comparison"][meshes[1]]["fa4"]["same_collectives_as_cudnn"]
    assert summary["devices"]["used"] == 2 and summary["comparison"][meshes[1]]["fa4"]["devices_used"] == 2

    pytest.importorskip("matplotlib")
    for name, written in (("one_mesh", compare.summarize([], None, runs)), ("two_meshes", summary)):
        result = tmp_path / f"{name}.json"
        result.write_text(json.dumps(written))
        compare.main(["plot", str(result), "--png", str(tmp_path / f"{name}.png")])
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        compare.main(["table", str(result)])


@pytest.fixture(scope="module")
def two_gpus():
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs two GPUs")


def cute_kernel_calls(targets: dict) -> int:
    return sum(count for target, count in targets.items() if target.startswith("CuteDSLRT"))


@pytest.mark.gpu
def test_two_gpus_heads_sharded_attention_runs_the_cute_kernels_without_collectives(train_gpt, two_gpus,
                                                                                      inputs):
    mesh = train_gpt.make_mesh({"data": 1, "model": 2})
    heads = NamedSharding(mesh, P("data", None, "model", None))
    query, key, value, cotangent = (jax.device_put(inputs.normal((2, 512, 8, 128), jnp.bfloat16), heads)
                                    for _ in range(4))

    def forward_and_backward(query, key, value, cotangent, implementation):
        out, pullback = jax.vjp(
            lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation=implementation),
            query, key, value)
        return out, pullback(cotangent)

    compiled = jax.jit(forward_and_backward, static_argnums=4).lower(
        query, key, value, cotangent, "cute").compile()
    hlo = compiled.as_text()
    counts = train_gpt.collective_counts(hlo)
    assert set(counts.values()) == {0}, counts
    targets = train_gpt.custom_call_targets(hlo)
    assert cute_kernel_calls(targets) == 2, targets   # the forward kernel and the backward kernel

    out, gradients = compiled(query, key, value, cotangent)
    assert out.sharding.is_equivalent_to(heads, 4)
    assert all(gradient.sharding.is_equivalent_to(heads, 4) for gradient in gradients)
    on_one_device = [jax.device_put(array, jax.devices()[0]) for array in (query, key, value, cotangent)]
    expected_out, expected_gradients = jax.jit(forward_and_backward, static_argnums=4)(
        *on_one_device, "reference")
    for got, expected in zip((out, *gradients), (expected_out, *expected_gradients)):
        got, expected = (np.asarray(array, np.float32) for array in (got, expected))
        assert np.linalg.norm(got - expected) <= 2e-2 * np.linalg.norm(expected)


@pytest.mark.gpu
def test_two_gpus_model_parallel_step_attention_adds_no_collective(train_gpt, two_gpus):
    """The tensor-parallel GPT step (heads and MLP on `model`) with fa4_jax attention has the same
    collectives as with cuDNN's or XLA's attention: only what the projections need."""
    mesh = train_gpt.make_mesh({"data": 1, "model": 2})
    layers = 2
    counts, targets = {}, {}
    for attention in ("fa4", "cudnn", "xla"):
        args = train_gpt.parse_args(
            ["--attention", attention, "--fa4-implementation", "cute", "--dtype", "bfloat16", "--layers",
             str(layers), "--d-model", "512", "--heads", "4", "--seq-len", "512", "--batch", "4",
             "--vocab", "256", "--steps", "2"])
        hlo = train_gpt.build_training(args, mesh)[-1]
        counts[attention] = train_gpt.collective_counts(hlo)
        targets[attention] = train_gpt.custom_call_targets(hlo)
    assert counts["fa4"] == counts["cudnn"] == counts["xla"], counts
    assert counts["fa4"]["all-gather"] == counts["fa4"]["all-to-all"] == 0, counts
    assert counts["fa4"]["all-reduce"] + counts["fa4"]["reduce-scatter"] > 0, counts  # it is sharded
    assert cute_kernel_calls(targets["fa4"]) == 2 * layers, targets["fa4"]
    assert not any("fmha" in target for target in targets["fa4"]), targets["fa4"]
    assert any("fmha" in target for target in targets["cudnn"]), targets["cudnn"]
