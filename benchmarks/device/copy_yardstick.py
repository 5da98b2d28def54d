"""How fast this GPU moves memory, by several kernels, to check decode.py's copy yardstick (`copy_tbps`:
bf16 `x + 1` over 4 GiB, read + write bytes / time) against others: the same in 4-byte words, XLA's plain
copy, a read-only sum (what a decode kernel's K / V loads are) and a write-only fill. CUPTI kernel times,
median of 20. Prints one line per kernel. Usage (device machine, repo root): python3 benchmarks/device/copy_yardstick.py
"""

import jax
import jax.numpy as jnp

from benchmarks import attention

GIB = 1 << 30


def main():
    size = 4 * GIB
    cases = {
        "bf16 x + 1 (decode.py's)": (lambda a: a + jnp.bfloat16(1), jnp.zeros((size // 2,), jnp.bfloat16), 2),
        "uint32 x + 1": (lambda a: a + jnp.uint32(1), jnp.zeros((size // 4,), jnp.uint32), 2),
        "float32 x * 2": (lambda a: a * 2.0, jnp.ones((size // 4,), jnp.float32), 2),
        "copy (jnp.copy)": (lambda a: jnp.copy(a), jnp.ones((size // 4,), jnp.float32), 2),
        "read-only sum": (lambda a: jnp.sum(a, dtype=jnp.float32), jnp.ones((size // 4,), jnp.float32), 1),
        "read-only sum [rows, 128]": (lambda a: jnp.sum(a.reshape(-1, 128), axis=0),
                                      jnp.ones((size // 4,), jnp.float32), 1),
        "write-only fill": (lambda a: jnp.full_like(a, 3.0) + a[:1], jnp.ones((size // 4,), jnp.float32), 1),
    }
    print(jax.devices()[0].device_kind)
    for name, (function, x, passes) in cases.items():
        _, ms = attention._median_ms(jax.jit(function), (x,), 20)
        print(f"{name:28s} {ms:8.3f} ms  {passes * size / (ms * 1e-3) / 1e12:6.2f} TB/s", flush=True)
        del x


if __name__ == "__main__":
    main()
