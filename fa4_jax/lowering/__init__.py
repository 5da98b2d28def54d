"""Per-platform lowering of the inner primitives: the reference everywhere, CuTe kernels on CUDA."""

from fa4_jax.lowering import cuda, reference  # noqa: F401  (importing registers the rules)
