"""examples/generate.py on the CPU: decoding with the Flax layer's KV cache, contiguous or paged (prompt in
one call, then one token per call), gives the tokens a full forward pass over the same sequence predicts."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page_size", [0, 4])
def test_cached_decoding_matches_the_full_forward(page_size):
    sys.path.insert(0, str(EXAMPLES))
    try:
        generate = _load("generate")
        args = generate.parse_args(["--train-steps", "3", "--batch", "2", "--prompt-len", "9", "--new-tokens", "6",
                                    "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
                                    "--page-size", str(page_size)])
        gpt_args, mesh, params = generate.train(args)
        result = generate.generate(args, gpt_args, mesh, params)
        assert result["tokens"].shape == (2, 6) and result["tokens_per_second"] > 0
        # Teacher forcing over prompt + generated tokens: the greedy prediction at each position must be
        # the token decoding produced there.
        model = generate.train_gpt.GPT(gpt_args, mesh, nnx.Rngs(0))
        nnx.update(model, params)
        walks = generate.train_gpt.synthetic_batch(args.seed, 10_000, args.batch, 15, args.vocab)
        sequence = jnp.concatenate([walks[:, :9], jnp.asarray(result["tokens"][:, :-1])], axis=1)
        predicted = np.asarray(jnp.argmax(model(sequence), axis=-1))[:, 8:]
        np.testing.assert_array_equal(predicted, result["tokens"])
    finally:
        sys.path.remove(str(EXAMPLES))
