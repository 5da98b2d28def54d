"""The SASS budget of the sm90 backward's loops: what each warp role executes per query block, by class.

Nsight Compute counts what ran; this counts what the compiler emitted, on the CPU, so a change to the
kernel's index or control code can be measured before it reaches a GPU. `build` lowers the jitted
backward for CUDA (the GPU's own compile path: `cutlass_call` with dynamic shapes, not the compile
tests' fake tensors, whose static shapes let the compiler fold divisions that the GPU build keeps)
with `CUTE_DSL_KEEP=ptx,cubin`, checks `ptxas -v` (spills, stack, wgmma serialization) and
disassembles the cubin with nvdisasm; `report` finds the loops (back edges, not counting the
out-of-line mbarrier spin loops), names each by what it issues (HGMMA: the consumer warp groups,
UTMALDG: the producer warp, a bulk reduce: the dQ writer warp) and counts its body by class.

    python tools/sass_budget.py build --out DIR [--tree TREE] [--configs d128 d128-causal d64] [--jobs 2]
                                      [--tuning '{"ds_stmatrix": false}']
    python tools/sass_budget.py report DIR [--json out.json]
    python tools/sass_budget.py compare BEFORE_DIR AFTER_DIR

A loop body is counted once per iteration: the blocks a forward branch inside it can skip (the
per-score mask of a partial key block) are counted apart as "conditional". nvdisasm comes from
--nvdisasm, PATH, or the nvidia-cuda-nvdisasm wheel (`pip download --no-deps nvidia-cuda-nvdisasm`
and unzip it: the binary is nvidia/cu13/bin/nvdisasm).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import json
import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (batch, sequence, heads, head dim, causal[, deterministic]), self-attention in bf16, default tuning:
# the shape of issue 12's Nsight Compute profile (B 4, S 4k, H 16); the large heads (backward_large_heads, whose
# `Tuning` --tuning then sets) at the shapes of their profiles (B 2, S 8k).
CONFIGS = {
    "d128": (4, 4096, 16, 128, False),
    "d128-causal": (4, 4096, 16, 128, True),
    "d64": (4, 4096, 16, 64, False),
    "d192-causal": (2, 8192, 16, 192, True),
    "d256-causal": (2, 8192, 8, 256, True),
    "d256-causal-deterministic": (2, 8192, 8, 256, True, True),
}

_LOWER = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward, backward_large_heads
batch, length, heads, head_dim, causal, *deterministic = json.loads(sys.argv[1])
kernel = backward if head_dim <= 128 else backward_large_heads
query = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.bfloat16)
lse = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
tuning = dataclasses.replace(kernel.DEFAULT_TUNING, **json.loads(sys.argv[2]))
config = AttentionConfig(scale=head_dim ** -0.5, causal=causal, deterministic=bool(deterministic and deterministic[0]))
options = kernel.options(config, host.Problem.of(query, query, query), tuning)
jax.jit(lambda q, k, v, o, l, g: kernel.run(options, q, k, v, o, l, g, None, {})).trace(
    query, query, query, query, lse, query).lower(lowering_platforms=("cuda",))
"""

# Instruction classes, first match wins (opcode prefixes as nvdisasm prints them).
CLASSES = (
    ("HGMMA", r"HGMMA"),
    ("WARPGROUP", r"WARPGROUP"),
    ("FP32", r"F(FMA|MUL|ADD|MNMX|SEL|SETP)\b"),
    ("MUFU", r"MUFU"),
    ("convert", r"(F2FP|F2F|I2F|F2I)\b"),
    ("shared", r"(LDS|STS|LDSM|STSM)\b"),
    ("global/bulk", r"(LDG|STG|RED|ATOM|ATOMS|UTMA\w*|UBLK\w*)\b"),
    ("sync", r"(SYNCS|BAR|MEMBAR|FENCE|DEPBAR|NANOSLEEP|ELECT|WARPSYNC)\b"),
    ("R2UR", r"R2UR\b"),
    ("uniform", r"(U[A-Z0-9]+|S2UR)\b"),
    ("int/address", r"(IMAD|IADD3|VIADD|IADD|LEA|SHF|LOP3|PRMT|MOV|SEL|IABS|CS2R|S2R|POPC|FLO|SGXT|BMSK|"
                    r"IMNMX|VIMNMX|LDC)\b"),
    ("pred/branch", r"(ISETP|PLOP3|BRA|BSSY|BSYNC|EXIT|P2R|R2P|VOTE\w*)\b"),
)
CLASS_NAMES = [name for name, _ in CLASSES] + ["other"]
ROLES = ("consumer", "producer", "dq_writer")

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"\.L_x_\d+")


def instruction_class(opcode: str) -> str:
    for name, pattern in CLASSES:
        if re.match(pattern, opcode):
            return name
    return "other"


def parse(text: str):
    """([(predicate, opcode, operands)], {label: index of the instruction it precedes})."""
    instructions, labels = [], {}
    for line in text.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.search(line)
        if match:
            instructions.append(((match.group(2) or "").strip(), match.group(3), match.group(4)))
    return instructions, labels


def _role(body) -> str:
    opcodes = [opcode for _, opcode, _ in body]
    if any(opcode.startswith("HGMMA") for opcode in opcodes):
        return "consumer"
    if any(opcode.startswith("UTMALDG") for opcode in opcodes):
        return "producer"
    if any(opcode.startswith(("UBLKRED", "UTMAREDG")) for opcode in opcodes):
        return "dq_writer"
    return "other"


def loops(instructions, labels) -> list:
    """(role, first, last) of each loop: a branch back to an earlier label, before the last EXIT (after
    it lie the out-of-line slow paths of the mbarrier waits, which jump back into the loops), whose
    body is not itself a spin loop (NANOSLEEP) or the setmaxnreg retry."""
    last_exit = max(index for index, (_, opcode, _) in enumerate(instructions) if opcode == "EXIT")
    found = []
    for index, (_, opcode, operands) in enumerate(instructions[:last_exit]):
        if opcode != "BRA":
            continue
        first = labels[_TARGET.search(operands).group(0)]
        body = instructions[first:index + 1]
        if first <= index and not any(op.startswith(("NANOSLEEP", "USETMAXREG")) for _, op, _ in body):
            found.append((_role(body), first, index))
    return found


def _conditional(instructions, labels, first, last) -> set:
    """Indices that a predicated forward branch inside [first, last] can skip."""
    skipped = set()
    for index in range(first, last):
        predicate, opcode, operands = instructions[index]
        if opcode == "BRA" and predicate:
            target = labels[_TARGET.search(operands).group(0)]
            if index < target <= last:
                skipped.update(range(index + 1, target))
    return skipped


def budget(text: str) -> dict:
    """{role: {"total", "conditional", "classes": {class: count}, "conditional_classes", "opcodes"}}
    of each warp role's loop (the largest, where a role has several)."""
    instructions, labels = parse(text)
    result = {}
    for role, first, last in loops(instructions, labels):
        if role not in ROLES or (role in result and result[role]["total"] >= last - first + 1):
            continue
        body = instructions[first:last + 1]
        skipped = _conditional(instructions, labels, first, last)
        result[role] = {
            "total": len(body),
            "conditional": len(skipped),
            "classes": dict(collections.Counter(instruction_class(op) for _, op, _ in body)),
            "conditional_classes": dict(collections.Counter(instruction_class(instructions[i][1])
                                                            for i in skipped)),
            "opcodes": dict(collections.Counter(op for _, op, _ in body).most_common()),
        }
    return result


# --------------------------------------------------------------------------------------------------
# build

def find_nvdisasm(explicit=None):
    if explicit:
        return explicit
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import importlib.metadata
        files = importlib.metadata.distribution("nvidia-cuda-nvdisasm").files or ()
    except Exception:
        files = ()
    for file in files:
        if file.name == "nvdisasm":
            return str(file.locate())
    raise SystemExit("nvdisasm not found: pass --nvdisasm (docstring says where to get it)")


def _build_one(tree, name, spec, tuning, out, nvdisasm, ptxas) -> dict:
    directory = os.path.join(out, name)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.join(directory, "dump"))
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("CUTE_DSL_", "FA4_JAX_"))}
    environment.update(PYTHONPATH=tree, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", JAX_PLATFORMS="cpu",
                       CUTE_DSL_DUMP_DIR=os.path.join(directory, "dump"),
                       FA4_JAX_CACHE_DIR=os.path.join(directory, "cache"))
    process = subprocess.run([sys.executable, "-c", _LOWER, json.dumps(spec), json.dumps(tuning)],
                             env=environment, cwd=directory,
                             capture_output=True, text=True, timeout=1800)
    if process.returncode != 0:
        raise RuntimeError(f"{name}: lowering failed\n{process.stderr[-3000:]}")
    (ptx,) = glob.glob(os.path.join(directory, "dump", "*.ptx"))
    (cubin,) = glob.glob(os.path.join(directory, "dump", "*.cubin"))
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(directory, "sass.txt"), "w") as handle:
        handle.write(sass)
    record = {"spec": spec, "tuning": tuning}
    if ptxas:
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report.stderr)
        record.update(spill_bytes=sum(int(a) + int(b) for a, b in spills),
                      stack_bytes=sum(int(s) for s in re.findall(r"(\d+) bytes stack frame", report.stderr)),
                      wgmma_serialized="instructions are serialized" in report.stderr,
                      registers=[int(r) for r in re.findall(r"Used (\d+) registers", report.stderr)])
    with open(os.path.join(directory, "build.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    return record


def build(tree, out, names, tuning, jobs, nvdisasm) -> int:
    sys.path.insert(0, REPO)
    from tools.sm100_inspect import find_ptxas
    nvdisasm, ptxas = find_nvdisasm(nvdisasm), find_ptxas()
    os.makedirs(out, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        built = pool.map(lambda name: _build_one(tree, name, CONFIGS[name], tuning, out, nvdisasm, ptxas), names)
        records = dict(zip(names, built))
    failed = 0
    for name, record in records.items():
        bad = record.get("spill_bytes") or record.get("stack_bytes") or record.get("wgmma_serialized")
        failed += bool(bad)
        resources = {key: value for key, value in record.items() if key not in ("spec", "tuning")}
        print(f"{name}: ptxas {'FAIL ' if bad else ''}{resources}")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------------
# report / compare

def _budgets(directory) -> dict:
    result = {}
    for path in sorted(glob.glob(os.path.join(directory, "*", "sass.txt"))):
        with open(path) as handle:
            result[os.path.basename(os.path.dirname(path))] = budget(handle.read())
    return result


ROWS = ["total", "conditional"] + CLASS_NAMES


def _count(budgets, name, role, row) -> int:
    entry = budgets[name].get(role, {})
    return entry.get(row, entry.get("classes", {}).get(row, 0))


def _print_tables(sides) -> None:
    """One markdown table per role: a row per class, a column per configuration; a cell is the count,
    or "a -> b" where `sides` (one or two budgets) differ."""
    names = [name for name in sides[0] if all(name in side for side in sides)]
    for role in ROLES:
        print(f"| {role} | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for row in ROWS:
            cells = []
            for name in names:
                counts = [_count(side, name, role, row) for side in sides]
                cells.append(" -> ".join(map(str, counts)) if len(set(counts)) > 1 else str(counts[0]))
            if any(cell != "0" for cell in cells):
                print(f"| {row} | " + " | ".join(cells) + " |")
        print()


def report(directory, json_path=None) -> int:
    budgets = _budgets(directory)
    _print_tables([budgets])
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(budgets, handle, indent=1)
    return 0


def compare(before_directory, after_directory) -> int:
    _print_tables([_budgets(before_directory), _budgets(after_directory)])
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build")
    build_parser.add_argument("--out", required=True)
    build_parser.add_argument("--tree", default=REPO, help="the source tree to compile (default: this one)")
    build_parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    build_parser.add_argument("--jobs", type=int, default=2)
    build_parser.add_argument("--tuning", type=json.loads, default={},
                              help="Tuning fields over the default, as JSON (a candidate's budget)")
    build_parser.add_argument("--nvdisasm")
    report_parser = commands.add_parser("report")
    report_parser.add_argument("directory")
    report_parser.add_argument("--json")
    compare_parser = commands.add_parser("compare")
    compare_parser.add_argument("before")
    compare_parser.add_argument("after")
    arguments = parser.parse_args(argv)
    if arguments.command == "build":
        return build(os.path.abspath(arguments.tree), arguments.out, arguments.configs, arguments.tuning,
                     arguments.jobs, arguments.nvdisasm)
    if arguments.command == "report":
        return report(arguments.directory, arguments.json)
    return compare(arguments.before, arguments.after)


if __name__ == "__main__":
    sys.exit(main())
