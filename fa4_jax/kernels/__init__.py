"""The CuTe-DSL kernels (sm_90 / sm_100), their shared building blocks and the pure-JAX reference.

Importing this package imports nothing else: the CPU path imports only `reference`, so cutlass is
needed only where a kernel module is imported (the CUDA lowering)."""
