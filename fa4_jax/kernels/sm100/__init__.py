"""Blackwell (sm_100a) kernels: the forward (tcgen05 MMA, TMEM accumulators)."""
