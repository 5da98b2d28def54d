"""Hopper (sm_90a) kernels: the forward, the backward for head dims 64-128 and the one for 192/256,\nwith the wgmma helpers they share."""

# SMs of an H100 / H200 SXM: the persistent forward grid and the backward's head-split choice assume it
# where JAX sees no GPU (compiling on a CPU host); on a GPU both read the real count (host.sm_count).
DEFAULT_SM_COUNT = 132
