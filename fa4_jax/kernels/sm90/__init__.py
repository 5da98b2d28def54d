"""Hopper (sm_90a) kernels: the forward, the backward for head dims 64-128 and the one for 192/256,\nwith the wgmma helpers they share."""
