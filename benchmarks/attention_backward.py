"""Backward benchmark: the sm90 backward kernels vs cuDNN's backward, one process, same inputs.

A section for benchmarks/attention.py (registered there as "backward" when this module is imported),
runnable on its own. Per shape it times, with CUPTI (all kernels of the call, median of iterations):
- fa4_jax: preprocess + dq/dk/dv kernel + postprocess (`sm90_backward.attention_backward`), given the
  forward's out and LSE;
- fa4_jax_deterministic: the same with deterministic=True (ordered dQ additions);
- fa4_jax_<other>_dq: the other dQ reduction (red.add per element vs TMA bulk reduce-add), to pick
  the default from measurements;
- cudnn: the VJP of jax.nn.dot_product_attention(implementation="cudnn"), residuals precomputed, so
  only its backward kernels are timed.
TFLOP/s counts backward FLOPs = 2.5x forward (forward = 4*B*H*Sq*Sk*D, halved when causal).

Usage: python benchmarks/attention_backward.py --out results.json [--quick] [--iterations N]
       [--head-dims 64 128] [--seq-lens 1024 4096]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attention  # noqa: E402  (the shared benchmark driver)


def backward_flops(shape) -> float:
    return 2.5 * attention.forward_flops(shape)


def _forward_residuals(query, key, value, config):
    """(out, lse, source): from the fa4_jax forward kernel (seconds to compile), else the reference
    (its scan compiles for several seconds per shape on the H200)."""
    import jax
    import fa4_jax
    from fa4_jax.kernels import reference

    try:
        out, lse = jax.jit(lambda q, k, v: fa4_jax.attention(
            q, k, v, causal=config.causal, return_lse=True, implementation="cute"))(query, key, value)
        return out, lse, "fa4_jax forward"
    except Exception:  # no forward kernel for this shape: the reference gives the same residuals
        out, lse = jax.jit(lambda q, k, v: reference.reference_forward(q, k, v, {}, config))(
            query, key, value)
        return out.astype(query.dtype), lse, "reference forward"


def backward_section(shape, arguments, args):
    import jax
    import jax.numpy as jnp
    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import sm90_backward

    query, key, value = arguments
    causal = shape["causal"]
    config = AttentionConfig(scale=shape["head_dim"] ** -0.5, causal=causal)
    d_out = jax.random.normal(jax.random.key(1), query.shape, jnp.float32).astype(query.dtype)
    out, lse, residuals = _forward_residuals(query, key, value, config)

    def ours(deterministic, dq_reduction=sm90_backward.DQ_REDUCTION):
        configured = config.replace(deterministic=deterministic)
        return jax.jit(lambda q, k, v, o, l, g: sm90_backward.backward_with_options(
            q, k, v, o, l, g, None, {}, configured, dq_reduction=dq_reduction)[:3])

    cudnn_forward = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                 implementation="cudnn")
    row = dict(section="backward", residuals=residuals, **shape)
    outputs = {}
    reason = sm90_backward.unsupported_reason(config, query.shape, key.shape, value.shape, query.dtype)
    candidates = {}
    if reason is None:
        candidates["fa4_jax"] = (ours(False), (query, key, value, out, lse, d_out))
        candidates["fa4_jax_deterministic"] = (ours(True), (query, key, value, out, lse, d_out))
        for other in sm90_backward.DQ_REDUCTIONS:
            if other != sm90_backward.DQ_REDUCTION:
                candidates[f"fa4_jax_{other}_dq"] = (ours(False, other), (query, key, value, out, lse, d_out))
    else:
        row["fa4_jax_error"] = f"unsupported: {reason}"
    try:
        _, cudnn_vjp = jax.vjp(cudnn_forward, query, key, value)
        candidates["cudnn"] = (jax.jit(lambda vjp, g: vjp(g)), (cudnn_vjp, d_out))
    except Exception as error:
        row["cudnn_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    for name, (function, function_arguments) in candidates.items():
        try:
            grads, milliseconds = attention._median_ms(function, function_arguments, args.iterations)
        except Exception as error:  # one failing backend must not hide the others
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            continue
        outputs[name] = grads
        row[f"{name}_ms"] = milliseconds
        row[f"{name}_tflops"] = backward_flops(shape) / (milliseconds * 1e-3) / 1e12
    if "fa4_jax" in outputs and "cudnn" in outputs:
        for label, ours_grad, theirs in zip(("dq", "dk", "dv"), outputs["fa4_jax"], outputs["cudnn"]):
            difference = jnp.abs(ours_grad.astype(jnp.float32) - theirs.astype(jnp.float32))
            row[f"max_abs_diff_{label}_vs_cudnn"] = float(jnp.max(difference))
    for name in candidates:
        if name != "cudnn" and f"{name}_ms" in row and "cudnn_ms" in row:
            suffix = name[len("fa4_jax"):]
            row[f"ratio{suffix}_vs_cudnn"] = row["cudnn_ms"] / row[f"{name}_ms"]
    return [row]


attention.SECTIONS["backward"] = backward_section


def main(argv=None):
    """attention.py's command line, plus --head-dims / --seq-lens to measure part of the grid."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, name in (("--head-dims", "HEAD_DIMS"), ("--seq-lens", "SEQUENCE_LENGTHS")):
        if flag in argv:
            start = argv.index(flag)
            end = start + 1
            while end < len(argv) and not argv[end].startswith("--"):
                end += 1
            setattr(attention, name, tuple(int(value) for value in argv[start + 1:end]))
            del argv[start:end]
    if "--sections" not in argv and "--plot" not in argv:
        argv += ["--sections", "backward"]
    attention.main(argv)


if __name__ == "__main__":
    main()
