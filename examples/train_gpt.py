"""Train a small GPT (Flax NNX) with fa4_jax attention on a device mesh.

The mesh has two axes: `data` splits the batch, `model` splits attention heads and the MLP's hidden
units (tensor parallelism: the query/key/value and MLP-up kernels by columns, the attention-out and
MLP-down kernels by rows, so each block needs one all-reduce per projection pair and attention itself
none). Any device count works; `--mesh data=2,model=4` picks the split. `--context-parallel N` adds a
third axis, `seq`, that splits every sequence N ways (context parallelism: fa4_jax.attention's
all-gather or ring strategy, `--context-parallel-strategy`); `--zigzag` feeds the sequences in
`fa4_jax.zigzag` order so that each of the N shards gets the same causal work.

`--attention` swaps only the attention core, everything else (parameters, initial values, data) is
identical: `fa4` is `fa4_jax.flax_layer.MultiHeadAttention`, `cudnn` and `xla` are
`flax.nnx.MultiHeadAttention` calling `jax.nn.dot_product_attention(implementation=...)`.

The data are synthetic and need no download: each sequence is a random walk on a fixed sparse token
graph (every token has a few possible successors), and its second half repeats the first, so the loss
falls as the model learns the graph and then learns to copy from the first half (which needs attention).

    python examples/train_gpt.py --steps 30                                     # CPU, about a minute
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python examples/train_gpt.py --context-parallel 4 --zigzag --steps 5       # 8 fake CPU devices
    python examples/train_gpt.py --attention cudnn --dtype bfloat16 --layers 8 --d-model 1024 \\
        --heads 8 --seq-len 2048 --batch 16 --steps 200 --json out.json          # one GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import flax_layer

DATA, MODEL, SEQ = "data", "model", "seq"
SUCCESSORS_PER_TOKEN = 4

# Tensor-parallel layout, by the trailing names of a parameter's path. Parameters not listed (embeddings,
# layer norms, output biases) are replicated.
PARAMETER_LAYOUT = {
    ("attention", "query", "kernel"): P(None, MODEL, None),   # [d_model, heads, head_dim]
    ("attention", "query", "bias"): P(MODEL, None),
    ("attention", "key", "kernel"): P(None, MODEL, None),
    ("attention", "key", "bias"): P(MODEL, None),
    ("attention", "value", "kernel"): P(None, MODEL, None),
    ("attention", "value", "bias"): P(MODEL, None),
    ("attention", "out", "kernel"): P(MODEL, None, None),     # [heads, head_dim, d_model]
    ("mlp_up", "kernel"): P(None, MODEL),                     # [d_model, 4 d_model]
    ("mlp_up", "bias"): P(MODEL),
    ("mlp_down", "kernel"): P(MODEL, None),                   # [4 d_model, d_model]
}
ACTIVATION = P(DATA, None, None)   # [batch, seq, features]: split by batch (and by SEQ when the mesh has it)


def activation_spec(mesh: Mesh) -> P:
    return P(DATA, SEQ, None) if SEQ in mesh.axis_names else ACTIVATION


def xla_attention_fn(implementation: str):
    """attention_fn for flax.nnx.MultiHeadAttention running jax.nn.dot_product_attention."""

    def attention_fn(query, key, value, *, mask=None, is_causal=False, **_ignored):
        return jax.nn.dot_product_attention(query, key, value, mask=mask, is_causal=is_causal,
                                            implementation=implementation)

    return attention_fn


def fa4_context_parallel_attention_fn(args):
    """attention_fn for flax.nnx.MultiHeadAttention with the sequence split over the `seq` mesh axis."""
    def attention_fn(query, key, value, *, mask=None, is_causal=False, dtype=None, **_ignored):
        if mask is not None:
            raise NotImplementedError("this example's context-parallel attention takes no mask")
        dtype = dtype or query.dtype
        return fa4_jax.attention(query.astype(dtype), key.astype(dtype), value.astype(dtype), causal=is_causal,
                                 implementation=args.fa4_implementation,
                                 context_parallel=args.context_parallel_strategy,
                                 zigzag_shards=args.context_parallel if args.zigzag else None)
    return attention_fn


class Block(nnx.Module):
    def __init__(self, args, activation_sharding: NamedSharding, rngs: nnx.Rngs):
        dtype = jnp.dtype(args.dtype)
        self.activation_sharding = activation_sharding
        attention_settings = dict(
            num_heads=args.heads, in_features=args.d_model, num_kv_heads=args.kv_heads, decode=False,
            dtype=dtype, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(args.d_model, dtype=dtype, rngs=rngs)
        if args.attention == "fa4" and args.context_parallel > 1:
            self.attention = nnx.MultiHeadAttention(
                **attention_settings, attention_fn=fa4_context_parallel_attention_fn(args))
        elif args.attention == "fa4":
            self.attention = flax_layer.MultiHeadAttention(
                **attention_settings, implementation=args.fa4_implementation)
        else:
            self.attention = nnx.MultiHeadAttention(
                **attention_settings, attention_fn=xla_attention_fn(args.attention))
        self.mlp_norm = nnx.LayerNorm(args.d_model, dtype=dtype, rngs=rngs)
        self.mlp_up = nnx.Linear(args.d_model, 4 * args.d_model, dtype=dtype, rngs=rngs)
        self.mlp_down = nnx.Linear(4 * args.d_model, args.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x), is_causal=True)
        x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        x = x + self.mlp_down(jax.nn.gelu(self.mlp_up(self.mlp_norm(x))))
        return jax.lax.with_sharding_constraint(x, self.activation_sharding)


class GPT(nnx.Module):
    def __init__(self, args, mesh: Mesh, rngs: nnx.Rngs):
        dtype = jnp.dtype(args.dtype)
        self.activation_sharding = NamedSharding(mesh, activation_spec(mesh))
        self.zigzag_shards = args.context_parallel if args.zigzag else None
        self.token_embedding = nnx.Embed(args.vocab, args.d_model, dtype=dtype, rngs=rngs)
        self.position_embedding = nnx.Embed(args.seq_len, args.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(args, self.activation_sharding, rngs) for _ in range(args.layers)])
        self.final_norm = nnx.LayerNorm(args.d_model, dtype=dtype, rngs=rngs)
        self.lm_head = nnx.Linear(args.d_model, args.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, positions=None):
        """Logits [batch, seq, vocab]; `positions` [seq] default 0.. (decoding passes where the tokens sit)."""
        if positions is None:
            positions = jnp.arange(tokens.shape[1])
            if self.zigzag_shards:  # the tokens come in zigzag order; so must their positions
                positions = fa4_jax.zigzag(positions[None], self.zigzag_shards)[0]
        x = self.token_embedding(tokens) + self.position_embedding(positions)[None]
        x = jax.lax.with_sharding_constraint(x, self.activation_sharding)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def parameter_spec(path, ndim: int) -> P:
    """PartitionSpec of a parameter (or of an optimizer slot, whose path ends like its parameter's)."""
    names = tuple(key.key for key in path if isinstance(key, jax.tree_util.DictKey))
    for suffix, spec in PARAMETER_LAYOUT.items():
        if names[-len(suffix):] == suffix and len(spec) == ndim:
            return spec
    return P()


def shardings_for(tree, mesh: Mesh):
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, parameter_spec(path, np.ndim(leaf))), tree)


def synthetic_batch(seed: int, step, batch: int, seq_len: int, vocab: int) -> jax.Array:
    """int32 [batch, seq_len + 1]: a walk on a fixed sparse token graph, then the same walk again."""
    graph = jax.random.randint(jax.random.key(seed), (vocab, SUCCESSORS_PER_TOKEN), 0, vocab)
    walk_key = jax.random.fold_in(jax.random.key(seed + 1), step)
    start_key, choice_key = jax.random.split(walk_key)
    half = (seq_len + 2) // 2
    start = jax.random.randint(start_key, (batch,), 0, vocab)
    choices = jax.random.randint(choice_key, (half - 1, batch), 0, SUCCESSORS_PER_TOKEN)

    def advance(token, choice):
        following = graph[token, choice]
        return following, following

    _, rest = jax.lax.scan(advance, start, choices)
    walk = jnp.concatenate([start[:, None], rest.T], axis=1)
    return jnp.concatenate([walk, walk], axis=1)[:, :seq_len + 1].astype(jnp.int32)


def parse_mesh(text: str, device_count: int) -> dict:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; one axis may be left out or -1 to take the rest."""
    sizes = {DATA: -1, MODEL: 1} if not text else {DATA: -1, MODEL: -1}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes:
            raise SystemExit(f"--mesh axes are {DATA} and {MODEL}; got {name!r}")
        sizes[name] = int(value)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) == 2:
        sizes[MODEL] = 1
        free = [DATA]
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        sizes[free[0]] = device_count // known
    if sizes[DATA] * sizes[MODEL] > device_count or min(sizes.values()) < 1:
        raise SystemExit(f"--mesh {sizes} needs more devices than the {device_count} present")
    return sizes


def make_mesh(sizes: dict, context_parallel: int = 1) -> Mesh:
    count = sizes[DATA] * sizes[MODEL] * context_parallel
    if context_parallel == 1:
        return Mesh(np.array(jax.devices()[:count]).reshape(sizes[DATA], sizes[MODEL]), (DATA, MODEL))
    devices = np.array(jax.devices()[:count]).reshape(sizes[DATA], context_parallel, sizes[MODEL])
    return Mesh(devices, (DATA, SEQ, MODEL))


def collective_counts(hlo_text: str) -> dict:
    """How many of each collective the compiled HLO runs (async pairs counted once, by their start)."""
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {}
    for kind in kinds:
        total = 0
        for line in hlo_text.splitlines():
            if "=" not in line:
                continue
            instruction = line.split("=", 1)[1]
            if f" {kind}(" in instruction or f" {kind}-start(" in instruction:
                total += 1
        counts[kind] = total
    return counts


def custom_call_targets(hlo_text: str) -> dict:
    """{target: count} of the compiled HLO's custom calls: which kernels the step really runs (fa4_jax's
    CuTe kernels appear as CuteDSLRT_NvJaxCutlassCall*, cuDNN attention as __cudnn$fmha*)."""
    counts = {}
    for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
        counts[target] = counts.get(target, 0) + 1
    return counts


def build_training(args, mesh: Mesh, donate: bool = True):
    """(compiled train step, params, optimizer state, data function, parameter count, HLO text).
    donate=False keeps the step's inputs alive, so one state can be stepped repeatedly (profiling)."""
    model = GPT(args, mesh, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    parameter_count = sum(leaf.size for leaf in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, max(1, args.steps // 10),
                                                  max(2, args.steps))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))

    param_shardings = shardings_for(params, mesh)
    params = jax.device_put(params, param_shardings)
    opt_state_shape = jax.eval_shape(optimizer.init, params)
    opt_shardings = shardings_for(opt_state_shape, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    batch_sharding = NamedSharding(mesh, P(DATA, None))

    def loss_fn(params, tokens):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if args.zigzag:  # the mean over tokens does not depend on their order
            inputs, labels = (fa4_jax.zigzag(x, args.context_parallel) for x in (inputs, labels))
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = NamedSharding(mesh, P())
    step_fn = jax.jit(train_step, in_shardings=(param_shardings, opt_shardings, batch_sharding),
                      out_shardings=(param_shardings, opt_shardings, replicated),
                      donate_argnums=(0, 1) if donate else ())
    data_fn = jax.jit(
        lambda step: synthetic_batch(args.seed, step, args.batch, args.seq_len, args.vocab),
        out_shardings=batch_sharding)
    compiled = step_fn.lower(params, opt_state, data_fn(0)).compile()
    return compiled, params, opt_state, data_fn, parameter_count, compiled.as_text()


def progress(step: int, total: int, loss: float, tokens_per_second: float, done: bool = False):
    width = 30
    filled = int(width * step / total)
    line = (f"\r{step:>5}/{total} [{'#' * filled}{'.' * (width - filled)}] loss {loss:7.4f}  "
            f"{tokens_per_second:,.0f} tokens/s")
    sys.stderr.write(line + ("\n" if done else ""))
    sys.stderr.flush()


def versions() -> dict:
    import flax
    import jaxlib
    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "numpy": np.__version__,
            "fa4_jax": fa4_jax.__version__}


def git_revision() -> Optional[str]:
    """The checkout's commit; on a machine that got the files without .git, $FA4_GIT_REVISION."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FA4_GIT_REVISION")


class _DefaultsInHelp(argparse.HelpFormatter):
    """--help shows each option's default, except where there is none (None, "", False) to show."""

    def _get_help_string(self, action):
        if any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)) or action.default == "":
            return action.help
        return f"{action.help} (default: {action.default})"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsInHelp)
    parser.add_argument("--attention", choices=("fa4", "cudnn", "xla"), default="fa4",
                        help="the attention core: ours, or jax.nn.dot_product_attention's cudnn / xla")
    parser.add_argument("--fa4-implementation", choices=("auto", "cute", "reference"), default="auto",
                        help="fa4_jax.attention(implementation=...); auto picks the kernels when they "
                             "can take the call and the reference otherwise (with a warning)")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--d-model", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="fewer than --heads for GQA (default: --heads)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak of the warmup-cosine schedule")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="compute dtype (parameters stay float32)")
    parser.add_argument("--mesh", default="", help="e.g. data=2,model=4 (default: all devices on data)")
    parser.add_argument("--context-parallel", type=int, default=1,
                        help="split every sequence over this many devices (a `seq` mesh axis)")
    parser.add_argument("--context-parallel-strategy", choices=("auto", "all_gather", "ring"), default="auto",
                        help="fa4_jax.attention(context_parallel=...); auto: the cost model")
    parser.add_argument("--zigzag", action="store_true",
                        help="with --context-parallel: sequences in fa4_jax.zigzag order (balanced causal work)")
    parser.add_argument("--seed", type=int, default=0, help="parameters and data")
    parser.add_argument("--timing-skip", type=int, default=2,
                        help="first steps left out of the step-time median")
    parser.add_argument("--json", default=None, help="write losses, step times, versions, devices here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < args.timing_skip:
        parser.error(f"--steps {args.steps} is smaller than --timing-skip {args.timing_skip}: no step would be "
                     "timed; run more steps or skip fewer")
    if args.fa4_implementation == "auto":
        args.fa4_implementation = None
    if args.context_parallel_strategy == "auto":
        args.context_parallel_strategy = None
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.context_parallel < 1 or jax.device_count() % args.context_parallel:
        raise SystemExit(f"--context-parallel {args.context_parallel} must divide the {jax.device_count()} devices")
    if args.context_parallel > 1 and args.attention != "fa4":
        raise SystemExit("--context-parallel needs --attention fa4 (cuDNN attention refuses a split sequence)")
    if args.seq_len % (args.context_parallel * (2 if args.zigzag else 1)):
        raise SystemExit(f"--seq-len {args.seq_len} must divide by {'2 * ' if args.zigzag else ''}"
                         f"--context-parallel {args.context_parallel}")
    sizes = parse_mesh(args.mesh, jax.device_count() // args.context_parallel)
    kv_heads = args.kv_heads or args.heads
    if args.heads % sizes[MODEL] or kv_heads % sizes[MODEL]:
        raise SystemExit(f"--heads {args.heads} and kv heads {kv_heads} must divide by model={sizes[MODEL]}")
    if args.batch % sizes[DATA]:
        raise SystemExit(f"--batch {args.batch} must divide by data={sizes[DATA]}")
    mesh = make_mesh(sizes, args.context_parallel)

    compile_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, params, opt_state, data_fn, parameter_count, hlo_text = build_training(args, mesh)
    compile_seconds = time.perf_counter() - compile_start
    for warning in caught:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)

    tokens_per_step = args.batch * args.seq_len
    losses, step_seconds = [], []
    for step in range(args.steps):
        tokens = data_fn(step)
        tokens.block_until_ready()
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens)
        loss = float(loss)
        step_seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if not args.quiet:
            progress(step + 1, args.steps, loss, tokens_per_step / step_seconds[-1], step + 1 == args.steps)

    timed = step_seconds[min(args.timing_skip, len(step_seconds) - 1):]
    median_step = float(np.median(timed))
    result = {
        "attention": args.attention,
        "fa4_implementation": (args.fa4_implementation or "auto") if args.attention == "fa4" else None,
        "warnings": [str(warning.message) for warning in caught],
        "config": {key: value for key, value in vars(args).items() if key not in ("json", "quiet")},
        "mesh": dict(sizes, **({SEQ: args.context_parallel} if args.context_parallel > 1 else {})),
        "parameters": int(parameter_count),
        "tokens_per_step": tokens_per_step,
        "compile_seconds": compile_seconds,
        "loss": losses,
        "step_seconds": step_seconds,
        "median_step_seconds": median_step,
        "tokens_per_second": tokens_per_step / median_step,
        "collectives": collective_counts(hlo_text),
        "custom_calls": custom_call_targets(hlo_text),
        "devices": {"platform": jax.devices()[0].platform, "kind": jax.devices()[0].device_kind,
                    "count": jax.device_count(), "used": sizes[DATA] * sizes[MODEL] * args.context_parallel},
        "versions": versions(),
        "git_revision": git_revision(),
    }
    print(f"{args.attention}: final loss {losses[-1]:.4f}, median step {median_step * 1e3:.2f} ms, "
          f"{result['tokens_per_second']:,.0f} tokens/s, {parameter_count:,} parameters, mesh {sizes}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
