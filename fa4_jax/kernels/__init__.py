"""The CuTe-DSL kernels: a wing per architecture (`sm90/`, `sm100/`) over the building blocks they share
(`common/`), the host side every kernel uses (`host.py`) and the on-disk compile cache.

Each kernel module shows the same face to `fa4_jax.lowering.cuda`: `unsupported_reason(config, problem)`,
`options(config, problem)` (a frozen dataclass that is also its compile key) and `run(options, ...)`.
Importing this package imports nothing else, so cutlass is needed only where a kernel module is
imported (the CUDA lowering)."""
