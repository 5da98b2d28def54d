"""Compile the sm100 forward kernel for sm_100a without a Blackwell GPU, and read what it became: a
tool for the tests and the compile report, not part of the package.

No Blackwell GPU is reachable, so the kernel is proven by inspection: CuTe DSL compiles for any
target on a CPU with fake tensors, `CUTE_DSL_KEEP=ptx` keeps the PTX, and `ptxas` (when installed)
reports registers and spills. Each compile runs in a subprocess because the DSL reads CUTE_DSL_ARCH
and CUTE_DSL_KEEP once, at import. Used by tests/test_kernel_compile_sm100.py and
benchmarks/sm100_report.py.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "sm_100a"

_COMPILE = r"""
import glob, json, os, sys, time, traceback
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm100 import backward as sm100_backward
from fa4_jax.kernels.sm100 import forward as sm100_forward

specs = json.loads(sys.argv[1])
keep_going = sys.argv[2:] == ["--keep-going"]
dump_dir = os.environ["CUTE_DSL_DUMP_DIR"]
named = set()

def compile_one(name, spec):
    config = AttentionConfig(**spec["config"])
    B, Sq, Sk, Hq, Hkv, D = spec["shape"]
    problem = host.Problem((B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), spec["dtype"])
    if spec["direction"] == "backward":
        kernel = sm100_backward.Sm100BackwardKernel(sm100_backward.options(config, problem))
        arguments = sm100_backward.fake_arguments(config, spec["shape"], spec["dtype"])
    else:
        options = sm100_forward.options(config, problem, sm_count=spec["sm_count"])
        kernel = sm100_forward.Sm100ForwardKernel(options)
        arguments = host.forward_fake_arguments(config, spec["shape"], spec["dtype"])
    start = time.perf_counter()
    cute.compile(kernel, make_fake_stream(), *arguments)
    seconds = time.perf_counter() - start
    # The dump name does not tell configs apart: move each PTX next to its spec's name at once.
    (ptx,) = set(glob.glob(os.path.join(dump_dir, "*.ptx"))) - named
    named.add(os.path.join(dump_dir, name + ".ptx"))
    os.replace(ptx, os.path.join(dump_dir, name + ".ptx"))
    if spec["direction"] == "backward":
        layout = {
            "keys_per_cta_pair": sm100_backward.PAIR_KEYS,
            "query_block": sm100_backward.ROWS,
            "tmem_columns_used": kernel.tmem_columns_used,
            "tmem_columns_allocated": kernel.tmem_columns_allocated,
            "shared_memory_bytes": kernel.shared_storage.size_in_bytes(),
            "threads_per_cta": kernel.threads_per_cta,
        }
        print("SM100_KERNEL " + json.dumps({"name": name, "compile_seconds": round(seconds, 2),
                                            "layout": layout}),
              flush=True)
        return
    print("SM100_KERNEL " + json.dumps({"name": name, "compile_seconds": round(seconds, 2), "layout": {
        "query_tiles_per_cta": kernel.q_stage,
        "key_block": kernel.n_block,
        "kv_stages": kernel.kv_stage,
        "tmem_columns_used": kernel.tmem_columns_used,
        "tmem_columns_allocated": kernel.tmem_columns_allocated,
        "shared_memory_bytes": kernel.shared_storage.size_in_bytes(),
        "threads_per_cta": kernel.threads_per_cta,
    }}), flush=True)

for name, spec in specs.items():
    try:
        compile_one(name, spec)
    except Exception:
        if not keep_going:
            raise
        named.update(glob.glob(os.path.join(dump_dir, "*.ptx")))  # what a failed compile left is not the next's
        print("SM100_KERNEL " + json.dumps({"name": name, "error": traceback.format_exc()}), flush=True)
"""


def compile_kernels(specs: dict, directory: str, direction: str = "forward", keep_going: bool = False) -> dict:
    """Compile each named spec {config, shape [B, Sq, Sk, Hq, Hkv, D], dtype} of the sm100 forward (or,
    `direction` "backward" or a spec's own "direction", backward) kernel for sm_100a.

    One subprocess compiles them in turn (the DSL import is paid once), each distinct spec once: names with
    equal specs (a test grid's row that is also a report configuration) share one record. Returns, per name,
    {"ptx_path", "ptx", "compile_seconds", "layout": query tiles, key block, TMEM columns, ...}. A spec
    that fails to compile raises RuntimeError; with `keep_going`, it is returned as {"error": why}
    instead and the others still compile (the tests, where each case is its own test).
    """
    specs = {name: {"dtype": "bfloat16", "sm_count": 148, "direction": direction, **spec}
             for name, spec in specs.items()}
    first_of = {}       # the spec (as canonical JSON) -> the first name that has it
    same_as = {name: first_of.setdefault(json.dumps(spec, sort_keys=True), name) for name, spec in specs.items()}
    distinct = {name: spec for name, spec in specs.items() if same_as[name] == name}
    os.makedirs(directory, exist_ok=True)
    environment = dict(os.environ, CUTE_DSL_ARCH=TARGET, CUTE_DSL_KEEP="ptx",
                       CUTE_DSL_DUMP_DIR=str(directory),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(distinct)] + ["--keep-going"] * keep_going,
                            env=environment, capture_output=True, text=True, timeout=300 + 120 * len(distinct))
    failure = f"sm100 compile failed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if result.returncode != 0 and not keep_going:
        raise RuntimeError(failure)
    compiled = {}
    for line in result.stdout.splitlines():
        if line.startswith("SM100_KERNEL "):
            record = json.loads(line[len("SM100_KERNEL "):])
            if "error" not in record:
                path = os.path.join(str(directory), record["name"] + ".ptx")
                with open(path) as handle:
                    record.update(ptx_path=path, ptx=handle.read())
            compiled[record.pop("name")] = record
    for name in distinct:
        compiled.setdefault(name, {"error": f"the compile process exited ({result.returncode}) before it\n"
                                            + failure})
    return {name: dict(compiled[same_as[name]]) for name in specs}


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
    # floor by a rounded add, then a Horner chain of FMAs, then the integer part added to the exponent field
    "exp2 polynomial": r"add\.rm\.f32[^}]*?(?:fma\.rn\.f32[^}]*?){3}shl\.b32[^}]*?add\.s32",
    "setmaxnreg": r"setmaxnreg\.",                        # per-role register split
}


def instruction_counts(ptx: str) -> dict:
    return {name: len(re.findall(pattern, ptx)) for name, pattern in INSTRUCTIONS.items()}


SINGLE_THREAD_INSTRUCTIONS = ("tcgen05.mma.", "tcgen05.commit.", "cp.async.bulk.tensor.")


def issued_by_one_thread(ptx: str) -> bool:
    """Every tcgen05.mma, tcgen05.commit and TMA copy sits behind an elect.sync predicate: one
    thread issues it (a whole warp issuing would run each MMA or copy 32 times)."""
    lines = ptx.splitlines()
    for index, line in enumerate(lines):
        if any(instruction in line for instruction in SINGLE_THREAD_INSTRUCTIONS):
            window = "\n".join(lines[max(0, index - 40):index])
            if "elect.sync" not in window:
                return False
    return True


def uses_local_memory(ptx: str) -> bool:
    return bool(re.search(r"\.local\b|ld\.local|st\.local", ptx))


def find_ptxas() -> Optional[str]:
    """ptxas from the nvidia-cuda-nvcc wheel (the test extra pins the release the spill checks were set
    against), else the one on PATH, else None."""
    try:
        files = importlib.metadata.distribution("nvidia-cuda-nvcc").files or ()
    except importlib.metadata.PackageNotFoundError:
        files = ()
    for file in files:
        if file.name == "ptxas" and file.parent.name == "bin":
            return str(file.locate())
    return shutil.which("ptxas")


# ptxas -v reports by PTX text: a test session asks about the same kernel more than once (the quick and
# the whole compile report), and an sm_100a kernel takes seconds to assemble.
_RESOURCES = {}


def ptxas_resources(ptx_path: str) -> Optional[dict]:
    """Registers, spills and stack from `ptxas -v`, or None where ptxas is not installed."""
    ptxas = find_ptxas()
    if ptxas is None:
        return None
    with open(ptx_path, "rb") as handle:
        key = (ptxas, hashlib.sha256(handle.read()).hexdigest())
    if key not in _RESOURCES:
        _RESOURCES[key] = _run_ptxas(ptxas, ptx_path)
    return dict(_RESOURCES[key])


def _run_ptxas(ptxas: str, ptx_path: str) -> dict:
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


# --------------------------------------------------------------------------------------------------
# The committed compile report (benchmarks/results/sm100_compile_report.json)

REPORT_PATH = os.path.join(REPO, "benchmarks", "results", "sm100_compile_report.json")

# Every head dim, causal and not, in bf16 with GQA; plus fp16 and the feature paths.
REPORT_SPECS = {
    **{f"d{d}{'-causal' if causal else ''}": dict(
        config=dict(scale=d ** -0.5, causal=causal), shape=[2, 2048, 2048, 16, 4, d])
       for d in (64, 96, 128, 192, 256) for causal in (False, True)},
    "d128-fp16": dict(config=dict(scale=128 ** -0.5), shape=[2, 2048, 2048, 16, 16, 128],
                      dtype="float16"),
    "d128-window-softcap-sinks": dict(
        config=dict(scale=128 ** -0.5, window_left=512, window_right=0, softcap=30.0, has_sinks=True),
        shape=[2, 2048, 2048, 16, 4, 128]),
    "d128-segments-lengths": dict(
        config=dict(scale=128 ** -0.5, has_segment_ids=True, has_q_seq_lengths=True,
                    has_kv_seq_lengths=True),
        shape=[2, 2048, 2048, 16, 4, 128]),
}


BACKWARD_REPORT_PATH = os.path.join(REPO, "benchmarks", "results", "sm100_backward_compile_report.json")

# The backward's head dims, causal and not, in bf16 with GQA; plus fp16 and the feature paths.
BACKWARD_REPORT_SPECS = {
    **{f"d{d}{'-causal' if causal else ''}": dict(
        config=dict(scale=d ** -0.5, causal=causal), shape=[2, 2048, 2048, 16, 4, d])
       for d in (64, 96, 128) for causal in (False, True)},
    "d128-fp16": dict(config=dict(scale=128 ** -0.5), shape=[2, 2048, 2048, 16, 16, 128], dtype="float16"),
    "d128-window-softcap-sinks-segments-lengths": dict(
        config=dict(scale=128 ** -0.5, window_left=512, window_right=0, softcap=30.0, has_sinks=True,
                    has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True),
        shape=[2, 2048, 2048, 16, 4, 128]),
}


def registers_per_role(direction: str) -> dict:
    """The setmaxnreg split of the forward or backward kernel, per role."""
    if direction == "backward":
        from fa4_jax.kernels.sm100.backward import Sm100BackwardKernel as Kernel

        return {"compute": Kernel.registers_compute, "dq": Kernel.registers_dq,
                "mma_load": Kernel.registers_other}
    from fa4_jax.kernels.sm100.forward import Sm100ForwardKernel as Kernel

    return {"softmax": Kernel.registers_softmax, "correction": Kernel.registers_correction,
            "mma_load_epilogue": Kernel.registers_other}


def kernel_record(compiled: dict, direction: str = "forward") -> dict:
    """The reported facts of one compiled kernel (everything but timing, so reruns reproduce it)."""
    ptx = compiled["ptx"]
    record = dict(compiled["layout"])
    record["registers_per_role"] = registers_per_role(direction)
    resources = ptxas_resources(compiled["ptx_path"])
    if resources is not None:
        record.update(resources)
    record["instructions"] = instruction_counts(ptx)
    record["tcgen05_and_tma_issued_by_one_thread"] = issued_by_one_thread(ptx)
    record["local_memory"] = uses_local_memory(ptx)
    return record


def build_report(directory: str, names=None, direction: str = "forward") -> dict:
    """The compile report of the forward (REPORT_SPECS) or backward (BACKWARD_REPORT_SPECS) kernel."""
    all_specs = BACKWARD_REPORT_SPECS if direction == "backward" else REPORT_SPECS
    return report_of(compile_kernels({name: all_specs[name] for name in (names or all_specs)}, directory,
                                     direction), direction)


def report_of(compiled: dict, direction: str = "forward") -> dict:
    """The compile report from `compile_kernels` records of configurations named as in REPORT_SPECS
    (or BACKWARD_REPORT_SPECS)."""
    import importlib.metadata

    specs = {name: (BACKWARD_REPORT_SPECS if direction == "backward" else REPORT_SPECS)[name] for name in compiled}
    return {
        "what": f"sm100 {direction} kernel compiled for sm_100a on a CPU (fake tensors), not run: no "
                "Blackwell GPU was available. Regenerate: python benchmarks/sm100_report.py",
        "target": TARGET,
        "cutlass_dsl": importlib.metadata.version("nvidia-cutlass-dsl"),
        "configs": {name: {"spec": specs[name], **kernel_record(compiled[name], direction)} for name in specs},
    }
