"""Compile the sm100 forward kernel for sm_100a without a Blackwell GPU, and read what it became.

No Blackwell GPU is reachable, so the kernel is proven by inspection: CuTe DSL compiles for any
target on a CPU with fake tensors, `CUTE_DSL_KEEP=ptx` keeps the PTX, and `ptxas` (when installed)
reports registers and spills. Each compile runs in a subprocess because the DSL reads CUTE_DSL_ARCH
and CUTE_DSL_KEEP once, at import. Used by tests/test_kernel_compile_sm100.py and
benchmarks/sm100_report.py.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = "sm_100a"

_COMPILE = r"""
import json, sys
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import sm100_forward

spec = json.loads(sys.argv[1])
config = AttentionConfig(**spec["config"])
B, Sq, Sk, Hq, Hkv, D = spec["shape"]
element = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[spec["dtype"]]

def fake(dtype, shape):
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape)))[::-1],
                                    assumed_align=16)

class DtypeName:
    name = spec["dtype"]

options = sm100_forward.kernel_options(config, (B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D),
                                       DtypeName, sm_count=spec["sm_count"])
kernel = sm100_forward.Sm100ForwardKernel(options)
i32, f32 = cutlass.Int32, cutlass.Float32
arguments = [
    fake(element, (B, Sq, Hq, D)), fake(element, (B, Sk, Hkv, D)), fake(element, (B, Sk, Hkv, D)),
    fake(f32, (Hq,)) if config.has_sinks else None,
    fake(i32, (B, Sq)) if config.has_segment_ids else None,
    fake(i32, (B, Sk)) if config.has_segment_ids else None,
    fake(i32, (B,)) if config.has_q_seq_lengths else None,
    fake(i32, (B,)) if config.has_kv_seq_lengths else None,
    fake(i32, (1,)) if config.has_q_start else None,
    fake(element, (B, Sq, Hq, D)), fake(f32, (B, Hq, Sq)),
]
cute.compile(kernel, make_fake_stream(), *arguments)
print("SM100_LAYOUT " + json.dumps({
    "query_tiles_per_cta": kernel.q_stage,
    "key_block": kernel.n_block,
    "kv_stages": kernel.kv_stage,
    "tmem_columns_used": kernel.tmem_columns_used,
    "tmem_columns_allocated": kernel.tmem_columns_allocated,
    "shared_memory_bytes": kernel.shared_storage.size_in_bytes(),
    "threads_per_cta": kernel.threads_per_cta,
}))
"""


def compile_kernel(spec: dict, directory: str) -> tuple[str, str, dict]:
    """Compile one spec {config, shape [B, Sq, Sk, Hq, Hkv, D], dtype} for sm_100a.

    Returns (PTX path, PTX text, kernel layout facts: query tiles, TMEM columns, shared memory...).
    """
    spec = {"dtype": "bfloat16", "sm_count": 148, **spec}
    os.makedirs(directory, exist_ok=True)
    environment = dict(os.environ, CUTE_DSL_ARCH=TARGET, CUTE_DSL_KEEP="ptx",
                       CUTE_DSL_DUMP_DIR=str(directory),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(spec)], env=environment,
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"sm100 compile failed for {spec}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    files = glob.glob(os.path.join(str(directory), "*.ptx"))
    if len(files) != 1:
        raise RuntimeError(f"expected one PTX file in {directory}, found {files}")
    layout = json.loads(result.stdout.split("SM100_LAYOUT ", 1)[1].splitlines()[0])
    with open(files[0]) as handle:
        return files[0], handle.read(), layout


# Instructions whose presence makes the FA4 design real, by what they show.
INSTRUCTIONS = {
    "tcgen05.alloc": r"tcgen05\.alloc\.",                 # TMEM allocated explicitly ...
    "tcgen05.dealloc": r"tcgen05\.dealloc\.",             # ... and released
    "tcgen05.mma": r"tcgen05\.mma\.",                     # 5th-generation tensor-core MMAs
    "tcgen05.ld": r"tcgen05\.ld\.",                       # S and O read from TMEM
    "tcgen05.st": r"tcgen05\.st\.",                       # P (and rescaled O) written into TMEM
    "tcgen05.commit.mbarrier": r"tcgen05\.commit\.[^\n]*mbarrier::arrive",  # MMA completion -> mbarrier
    "cp.async.bulk.tensor": r"cp\.async\.bulk\.tensor",   # TMA
    "ex2.approx": r"ex2\.approx",                         # exp2 on MUFU
    # floor, then a Horner chain of FMAs, then the integer part added to the exponent field
    "exp2 polynomial": r"cvt\.rmi\.f32\.f32[^}]*?(?:fma\.rn\.f32[^}]*?){3}shl\.b32[^}]*?add\.s32",
    "setmaxnreg": r"setmaxnreg\.",                        # per-role register split
}


def instruction_counts(ptx: str) -> dict:
    return {name: len(re.findall(pattern, ptx)) for name, pattern in INSTRUCTIONS.items()}


def mma_issue_is_elected(ptx: str) -> bool:
    """Every tcgen05.mma sits behind an elect.sync predicate: one thread of the MMA warp issues it."""
    lines = ptx.splitlines()
    for index, line in enumerate(lines):
        if "tcgen05.mma." in line:
            window = "\n".join(lines[max(0, index - 40):index])
            if "elect.sync" not in window:
                return False
    return True


def uses_local_memory(ptx: str) -> bool:
    return bool(re.search(r"\.local\b|ld\.local|st\.local", ptx))


def ptxas_resources(ptx_path: str) -> Optional[dict]:
    """Registers, spills and stack from `ptxas -v`, or None where ptxas is not installed."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    result = subprocess.run([ptxas, f"-arch={TARGET}", "-v", ptx_path, "-o", os.devnull],
                            capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}\n{result.stderr[-3000:]}")
    text = result.stderr

    def number(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    version = re.search(r"release ([0-9.]+)", subprocess.run(
        [ptxas, "--version"], capture_output=True, text=True).stdout)
    return {
        "ptxas_version": version.group(1) if version else "unknown",
        "registers_at_launch": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "stack_frame_bytes": number(r"(\d+) bytes stack frame"),
    }
