"""Hash the PTX and cubin of every kernel configuration the compile tests build, and compare two trees.

Issue 11 moves the kernel code into a new layout and must not change what any kernel compiles to: the
PTX and the cubin of every configuration the compile tests build (the whole sm_90a and sm_100a grids,
slow tests included) are to be byte-identical before and after. This script is that check. `manifest`
compiles each configuration against one source tree and records the SHA-256 of its PTX and cubin;
`compare` sets two manifests side by side and fails on any difference.

    python tools/kernel_binaries.py list --tree /path/to/tree
    python tools/kernel_binaries.py manifest --tree /path/to/tree --out before.json [--jobs 2] [--only REGEX]
    python tools/kernel_binaries.py compare before.json after.json --out result.json [--normalized]

Strict comparison (the default) asks for equal PTX and cubin bytes. `--normalized` compares the PTX
with every `kernel_cutlass_...` identifier replaced by one placeholder: before the kernels named
themselves (b34ac9c) the DSL mangled the kernel object's default repr (module path and address) into
those names, so only a normalised comparison can span that commit.

The PTX is reproducible; the cubin nearly so. The DSL's built-in PTX assembler (CUDA 13.4 in
nvidia-cutlass-dsl 4.8.1) gives some PTX more than one cubin from run to run, chosen by memory
addresses: the same process with address randomisation off (`setarch -R`) repeats itself, but then the
choice follows the length of the tree's path; the standalone ptxas 13.0 gives one cubin for the same
PTX every time. Of the 121 configurations at b34ac9c, one (the large-head backward at D = 192, causal,
GQA, fp16) has two cubins, about 30 / 70. So where a strict comparison finds the PTX identical and the
cubin not, it compiles that configuration `--recompile` more times in both trees (which must still be
there, unchanged) and passes it when the two trees produce a common cubin; the result file lists the
variants each tree produced.

Configurations are read from the tree's own test modules (imported with the tree and its tests/ first
on sys.path), through the names those tests expose: `CONFIGS` and `_COMPILE` (tests/test_kernel_compile_sm90.py
and tests/test_kernel_compile_sm90_tangent.py, one JSON dict of configurations on argv, the forward's
`PACKED_SEQUENCES` after it), `CASES` and
`_COMPILE` (the two sm90 backward tests, one JSON spec on argv, as tests/ptx_checks.compile_batch passes
it to each case), `CASES`, `GRID` and the module's `sm100_inspect` (`compile_kernels`, `REPORT_SPECS`)
for sm100, and the `_LOWER*` scripts that lower a jitted call for CUDA (tests/test_compile_cache.py,
tests/test_kernel_compile_sm100.py; tests/test_head_padding.py's `LOWERED_CASES` and `_LOWER_JVP`, and
tests/test_warning_filters.py's `CASES`, whose lowerings compile several kernels each). Each
configuration compiles in its own subprocess with its own empty dump directory; one that fails, or
that leaves other than one PTX and one cubin, fails the manifest. A test module that compiles kernels
but is not known here fails it too, so a new compile test cannot be left out unnoticed; the few that
compile nothing worth hashing on a CPU are named, with the reason, in NOT_HASHED.

A lowering that compiles several kernels (a forward and its backward or tangent; the decode kernel and
its combine) is one job too. The DSL names a kernel's dump files after its arguments' types, cut to
about 190 characters, so such kernels overwrite each other's files: the job runs its script under
_SEPARATE_KERNELS, which moves each compile's PTX and cubin aside as it returns (and fails unless it
left one of each). Its record's hashes are each the SHA-256 of its kernels' hashes, sorted (so neither
the order they compiled in nor the file names count), and "kernels" lists the kernels' own records; a
job of one kernel records that kernel's hashes themselves, as before.

Keys are "<test module>::<collection>/<config name>", or "<test module>::<script>" for the lowering
scripts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import hashlib
import importlib
import importlib.metadata
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

KERNEL_NAME = re.compile(r"kernel_cutlass_\w+")
ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
LISTING = "KERNEL_BINARIES_JOBS "   # marks the line of `list --json` output among whatever imports print

# What marks a test module as one that compiles kernels; each such module needs an entry in `_jobs_of`,
# or in NOT_HASHED.
COMPILE_MARKERS = re.compile(r"_COMPILE\b|cute\.compile|compile_kernels|lowering_platforms|build_report")

# Test modules that match COMPILE_MARKERS but build no configuration worth hashing here, knowingly left
# out: module -> why. (tests/test_kernel_binaries_tool.py checks that each still exists and still matches.)
NOT_HASHED = {
    "test_kernel_binaries_tool": "this tool's own tests: their cute.compile is a stand-in DSL's, which writes "
                                 "made-up dump files (the test of _SEPARATE_KERNELS); no kernel",
    "test_sm100_protocol": "its compiles stop while tracing, on planted schedule mismatches: no binary",
    "test_sm90_forward": "GPU-only: its kernels compile at run time on an H100 / H200 (every test that "
                         "compiles or lowers is @gpu; `_kernel_calls` lowers inside those tests only); the "
                         "CPU compile test of the same kernel and head dims (80, MLA's 192/128) is "
                         "tests/test_kernel_compile_sm90.py",
}

# Runs a lowering script (argv[1], its arguments after it) that compiles several kernels in one process:
# each compile's new PTX and cubin are moved aside as kernel<n>.ptx / .cubin the moment it returns, since
# the next kernel's files may take the same name (see the docstring). Every kernel cutlass_call compiles
# goes through cutlass.cute.compile, looked up at each call.
_SEPARATE_KERNELS = r"""
import glob, os, sys
import cutlass.cute
script, sys.argv = sys.argv[1], ["-c", *sys.argv[2:]]
dump = os.environ["CUTE_DSL_DUMP_DIR"]
original, kept = cutlass.cute.compile, set()

def compile_apart(*arguments, **keywords):
    result = original(*arguments, **keywords)
    number = len(kept) // 2
    for extension in ("ptx", "cubin"):
        new = sorted(set(glob.glob(os.path.join(dump, "*." + extension))) - kept)
        assert len(new) == 1, f"compile {number}: expected one new .{extension} file, found {new}"
        path = os.path.join(dump, f"kernel{number}.{extension}")
        os.replace(new[0], path)
        kept.add(path)
    return result

cutlass.cute.compile = compile_apart
exec(compile(script, "<lowering script>", "exec"), {"__name__": "__main__"})
"""

# Runs in the job's subprocess: the tree's own sm100 compile path, for one named spec.
_SM100_COMPILE = r"""
import importlib, json, sys
tests, module_name, named_spec, dump = sys.argv[1:]
sys.path.insert(0, tests)
name, spec = json.loads(named_spec)
importlib.import_module(module_name).sm100_inspect.compile_kernels({name: spec}, dump)
"""


def normalized_ptx(ptx: str) -> str:
    """The PTX with every kernel symbol name replaced by one placeholder."""
    return KERNEL_NAME.sub("kernel_cutlass_NAME", ptx)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------------
# Listing: the jobs a tree's compile tests make (runs with the tree on sys.path)

def _script_job(key, arch, script, *arguments, several_kernels=False):
    """`python -c script arguments...`; with several_kernels, under _SEPARATE_KERNELS."""
    return {"key": key, "arch": arch, "kind": "script", "script": script, "arguments": list(arguments),
            "several_kernels": several_kernels}


def _jobs_of(module_name: str, module) -> list:
    """One job per configuration the test module compiles: how to run it and for which arch."""
    if module_name in NOT_HASHED:
        return []
    if module_name in ("test_kernel_compile_sm90", "test_kernel_compile_sm90_tangent"):
        # The sm90 forward's script takes the packed configurations' sequence counts as a second argument
        # (PACKED_SEQUENCES, since 36cddad); the tangent's, and the forward's before then, take none.
        packed = [json.dumps(module.PACKED_SEQUENCES)] if hasattr(module, "PACKED_SEQUENCES") else []
        return [_script_job(f"{module_name}::CONFIGS/{name}", "sm_90a", module._COMPILE,
                            json.dumps({name: config}), *packed)
                for name, config in module.CONFIGS.items()]
    if module_name in ("test_kernel_compile_sm90_backward", "test_kernel_compile_sm90_backward_large_heads"):
        jobs = [_script_job(f"{module_name}::CASES/{name}", "sm_90a", module._COMPILE,
                            json.dumps({"dtype": "bfloat16", **spec}))
                for name, spec in module.CASES.items()]
        if module_name.endswith("large_heads"):
            for parameter, (test_spec, inapplicable) in module.INAPPLICABLE_TUNING.items():
                spec = {"dtype": "bfloat16", **test_spec}
                collection = f"test_inapplicable_tuning_leaves_the_ptx_unchanged[{parameter}]"
                jobs.append(_script_job(f"{module_name}::{collection}/default", "sm_90a", module._COMPILE,
                                        json.dumps(spec)))
                jobs.append(_script_job(f"{module_name}::{collection}/tuned", "sm_90a", module._COMPILE,
                                        json.dumps({**spec, "tuning": inapplicable})))
        return jobs
    if module_name == "test_kernel_compile_sm100":
        collections = {"CASES": module.CASES,
                       "GRID": {name: spec for specs in module.GRID.values() for name, spec in specs.items()},
                       "REPORT_SPECS": module.sm100_inspect.REPORT_SPECS}
        jobs = [{"key": f"{module_name}::{collection}/{name}", "arch": module.sm100_inspect.TARGET,
                 "kind": "sm100", "module": module_name, "name": name, "spec": spec}
                for collection, specs in collections.items() for name, spec in specs.items()]
        return jobs + [_script_job(f"{module_name}::_LOWER", module.sm100_inspect.TARGET, module._LOWER)]
    if module_name == "test_kernel_compile_sm100_backward":
        collections = {"CASES": module.CASES, "GRID": module.GRID,
                       "REPORT_SPECS": module.sm100_inspect.BACKWARD_REPORT_SPECS}
        jobs = [{"key": f"{module_name}::{collection}/{name}", "arch": module.sm100_inspect.TARGET,
                 "kind": "sm100", "module": module_name, "name": name, "spec": {**spec, "direction": "backward"}}
                for collection, specs in collections.items() for name, spec in specs.items()]
        return jobs + [_script_job(f"{module_name}::_LOWER", module.sm100_inspect.TARGET, module._LOWER)]
    if module_name == "test_kernel_compile_decode":
        return [_script_job(f"{module_name}::CONFIGS/{name}", config[4], module._COMPILE, json.dumps({name: config}))
                for name, config in module.CONFIGS.items()]
    if module_name == "test_compile_cache":
        return [_script_job(f"{module_name}::{script}", "sm_90a", getattr(module, script))
                for script in sorted(vars(module)) if script.startswith("_LOWER")]
    if module_name == "test_head_padding":
        return _head_padding_jobs(module_name, module)
    if module_name == "test_warning_filters":
        return _warning_filter_jobs(module_name, module)
    raise SystemExit(f"tests/{module_name}.py compiles kernels, but tools/kernel_binaries.py does not know "
                     "how to build its configurations: add it to _jobs_of (or, with the reason, to NOT_HASHED)")


def _head_padding_jobs(module_name: str, module) -> list:
    """The real kernels at padded head dims: each LOWERED_CASES lowering compiles a forward and a
    backward, `_LOWER_JVP` the forward at 80 and the tangent at 128. The module's other kernel tests run
    stand-ins on the CPU and compile nothing."""
    jobs = [_script_job(f"{module_name}::LOWERED_CASES/{name}", arch, module._LOWER,
                        json.dumps([head_dim, v_head_dim, capability]), several_kernels=True)
            for name, (head_dim, v_head_dim, _, _, capability, arch) in module.LOWERED_CASES.items()]
    return jobs + [_script_job(f"{module_name}::_LOWER_JVP", "sm_90a", module._LOWER_JVP, several_kernels=True)]


def _warning_filter_jobs(module_name: str, module) -> list:
    """Each case's lowering of its passes under warnings-as-errors, through the disk cache (the test's one
    run without it compiles the same kernels in cutlass_call's own lowering): every kernel those passes
    call (the decode case's combine kernel too)."""
    return [_script_job(f"{module_name}::CASES/{name}", arch, module._LOWER,
                        json.dumps({"capability": capability, "shape": shape, "options": options, "passes": passes}),
                        several_kernels=True)
            for name, (capability, arch, shape, options, passes) in module.CASES.items()]


def list_jobs(tree: str) -> dict:
    """{"fa4_jax": where it was imported from, "jobs": [...]} for the tree, imported from the tree."""
    tree = os.path.abspath(tree)
    sys.path[:0] = [tree, os.path.join(tree, "tests")]
    import fa4_jax

    if not os.path.abspath(fa4_jax.__file__).startswith(tree + os.sep):
        raise SystemExit(f"fa4_jax imported from {fa4_jax.__file__}, not from the tree {tree}")
    jobs = []
    for path in sorted(glob.glob(os.path.join(tree, "tests", "test_*.py"))):
        with open(path) as handle:
            if not COMPILE_MARKERS.search(handle.read()):
                continue
        module_name = os.path.basename(path)[:-len(".py")]
        jobs += _jobs_of(module_name, importlib.import_module(module_name))
    keys = [job["key"] for job in jobs]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise SystemExit(f"configurations named twice: {duplicates}")
    return {"fa4_jax": os.path.abspath(fa4_jax.__file__), "jobs": jobs}


# --------------------------------------------------------------------------------------------------
# Manifest: compile each job in its own subprocess and hash what it left

def _tree_environment(tree: str) -> dict:
    """The caller's environment with the tree as the only PYTHONPATH and no DSL or kernel-cache settings."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("CUTE_DSL_", "FA4_JAX_")) and name != "PYTHONPATH"}
    environment["PYTHONPATH"] = tree
    return environment


def _job_environment(tree: str, arch: str, directory: str) -> dict:
    environment = _tree_environment(tree)
    environment.update(
        CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx,cubin",
        CUTE_DSL_DUMP_DIR=os.path.join(directory, "dump"),
        # The lowering scripts compile through the on-disk kernel cache: an empty one, so they compile.
        FA4_JAX_CACHE_DIR=os.path.join(directory, "cache"))
    return environment


def _command(tree: str, job: dict, directory: str) -> list:
    if job["kind"] == "script" and job.get("several_kernels"):
        return [sys.executable, "-c", _SEPARATE_KERNELS, job["script"], *job["arguments"]]
    if job["kind"] == "script":
        return [sys.executable, "-c", job["script"], *job["arguments"]]
    return [sys.executable, "-c", _SM100_COMPILE, os.path.join(tree, "tests"), job["module"],
            json.dumps([job["name"], job["spec"]]), os.path.join(directory, "dump")]


def run_job(tree: str, job: dict, directory: str) -> dict:
    """Compile one job into `directory`/dump and return its hashes; raises RuntimeError naming the job."""
    os.makedirs(os.path.join(directory, "dump"))
    os.makedirs(os.path.join(directory, "cache"))
    environment = _job_environment(tree, job["arch"], directory)
    if job["kind"] == "sm100":
        # compile_kernels sets CUTE_DSL_KEEP=ptx for its own subprocess; the older switch still adds the
        # cubin, and it passes through.
        environment["CUTE_DSL_KEEP_CUBIN"] = "1"
    start = time.perf_counter()
    process = subprocess.run(_command(tree, job, directory), env=environment, cwd=directory,
                             capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{job['key']}: compile failed (exit {process.returncode})\n"
                           f"{process.stdout[-2000:]}\n{process.stderr[-3000:]}")
    record = hash_dump(os.path.join(directory, "dump"), job.get("several_kernels", False), job["key"])
    return {"arch": job["arch"], **record, "compile_seconds": round(seconds, 2)}


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _kernel_record(ptx: bytes, cubin: bytes) -> dict:
    text = ptx.decode()
    return {
        "ptx_sha256": sha256(ptx),
        "cubin_sha256": sha256(cubin),
        "ptx_normalized_sha256": sha256(normalized_ptx(text).encode()),
        "ptx_bytes": len(ptx),
        "cubin_bytes": len(cubin),
        "entries": ENTRY.findall(text),
    }


def _combined_record(kernels: list) -> dict:
    """One record for several kernels: each hash over the kernels' hashes sorted, so it depends on what
    they compiled to and on nothing else (not the order, not the file names)."""
    fields = ("ptx_sha256", "cubin_sha256", "ptx_normalized_sha256")
    return {
        **{field: sha256("\n".join(sorted(kernel[field] for kernel in kernels)).encode()) for field in fields},
        "ptx_bytes": sum(kernel["ptx_bytes"] for kernel in kernels),
        "cubin_bytes": sum(kernel["cubin_bytes"] for kernel in kernels),
        "entries": sorted(entry for kernel in kernels for entry in kernel["entries"]),
        "kernels": sorted(kernels, key=lambda kernel: (kernel["entries"], kernel["ptx_sha256"])),
    }


def hash_dump(dump: str, several_kernels: bool, key: str) -> dict:
    """The record of what a job left in `dump`, or RuntimeError: one PTX and one cubin (a compile script
    may have renamed the PTX), or, for a job of several kernels, PTX and cubin files in pairs of one name
    (_SEPARATE_KERNELS's kernel<n>), at least one."""
    ptx_files = sorted(glob.glob(os.path.join(dump, "*.ptx")))
    cubin_files = sorted(glob.glob(os.path.join(dump, "*.cubin")))
    found = [os.path.basename(path) for path in ptx_files + cubin_files]
    if not several_kernels:
        if len(ptx_files) != 1 or len(cubin_files) != 1:
            raise RuntimeError(f"{key}: expected one PTX and one cubin in {dump}, found {found}")
        return _kernel_record(_read(ptx_files[0]), _read(cubin_files[0]))
    stems = [os.path.splitext(path)[0] for path in ptx_files]
    if not stems or stems != [os.path.splitext(path)[0] for path in cubin_files]:
        raise RuntimeError(f"{key}: expected PTX and cubin files in pairs of one name in {dump}, found {found}")
    return _combined_record([_kernel_record(_read(stem + ".ptx"), _read(stem + ".cubin")) for stem in stems])


def _tree_revision(tree: str) -> dict:
    def git(*arguments):
        return subprocess.run(["git", "-C", tree, *arguments], capture_output=True, text=True).stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted_changes": bool(status)}


def _listing(tree: str) -> dict:
    """`list --json` for the tree, run in a subprocess that imports the tree's own modules."""
    listed = subprocess.run([sys.executable, os.path.abspath(__file__), "list", "--tree", tree, "--json"],
                            env=_tree_environment(tree), capture_output=True, text=True,
                            cwd=tempfile.gettempdir())
    lines = [line for line in listed.stdout.splitlines() if line.startswith(LISTING)]
    if listed.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"listing the configurations of {tree} failed\n{listed.stderr[-4000:]}")
    return json.loads(lines[0][len(LISTING):])


def manifest(tree: str, out: str, jobs: int, only: str | None, artifacts: str | None) -> int:
    tree = os.path.abspath(tree)
    listing = _listing(tree)
    selected = [job for job in listing["jobs"] if only is None or re.search(only, job["key"])]
    if not selected:
        print(f"no configuration matches {only!r}", file=sys.stderr)
        return 1
    root = artifacts or tempfile.mkdtemp(prefix="kernel_binaries_")
    os.makedirs(root, exist_ok=True)
    print(f"{len(selected)} configurations from {tree}, {jobs} at a time; artifacts in {root}", flush=True)
    start = time.perf_counter()
    records, failures = {}, []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_job, tree, job, os.path.join(root, f"{index:04d}")): job
                   for index, job in enumerate(selected)}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            key = futures[future]["key"]
            try:
                records[key] = future.result()
                print(f"[{done}/{len(selected)}] {key}: {records[key]['compile_seconds']} s", flush=True)
            except Exception as error:  # every failure is reported, none stops the others
                failures.append(key)
                print(f"[{done}/{len(selected)}] FAILED {error}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    if artifacts is None:
        shutil.rmtree(root, ignore_errors=True)
    if failures:
        print(f"{len(failures)} configurations failed: {', '.join(sorted(failures))}", file=sys.stderr)
        return 1
    result = {
        "what": "SHA-256 of the PTX and cubin of each configuration the compile tests build "
                "(tools/kernel_binaries.py manifest)",
        "tree": tree,
        **_tree_revision(tree),
        "fa4_jax": listing["fa4_jax"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cutlass_dsl": importlib.metadata.version("nvidia-cutlass-dsl"),
        "python": sys.version.split()[0],
        "only": only,
        "jobs": jobs,
        "wall_seconds": round(wall, 1),
        "counts": _counts(records),
        "configs": dict(sorted(records.items())),
    }
    _write_json(out, result)
    print(f"{len(records)} configurations in {wall:.0f} s -> {out}")
    return 0


def _counts(records: dict) -> dict:
    """Configurations per test module and per target."""
    counts = {"total": len(records)}
    for key, record in records.items():
        module = key.split("::")[0]
        counts[module] = counts.get(module, 0) + 1
        counts[record["arch"]] = counts.get(record["arch"], 0) + 1
    return counts


# --------------------------------------------------------------------------------------------------
# Compare

def compare_manifests(before: dict, after: dict, normalized: bool, cubin_variants=None) -> dict:
    """Per-configuration verdicts and whether the two manifests are identical in the chosen sense.

    The DSL's built-in PTX assembler does not always give the same cubin for the same PTX: its choice
    depends on where things land in memory (with address randomisation off it repeats, but moves with
    the length of the tree's path). So where the PTX is identical and only the cubin differs,
    `cubin_variants(manifest, key)`, when given, recompiles that configuration in a manifest's tree and
    returns the cubin hashes it saw; the cubin counts as identical when both trees produce a common one.
    """
    fields = ("ptx_normalized_sha256",) if normalized else ("ptx_sha256", "cubin_sha256")
    verdicts, variants = {}, {}
    for key in sorted(set(before["configs"]) | set(after["configs"])):
        if key not in after["configs"]:
            verdicts[key] = "missing after"
        elif key not in before["configs"]:
            verdicts[key] = "missing before"
        else:
            differing = [field for field in fields
                         if before["configs"][key][field] != after["configs"][key][field]]
            verdicts[key] = "identical" if not differing else "differs: " + ", ".join(differing)
            if differing == ["cubin_sha256"] and cubin_variants is not None:
                seen = {which: sorted({manifest_["configs"][key]["cubin_sha256"], *cubin_variants(manifest_, key)})
                        for which, manifest_ in (("before", before), ("after", after))}
                seen["common"] = sorted(set(seen["before"]) & set(seen["after"]))
                variants[key] = seen
                if seen["common"]:
                    verdicts[key] = "identical after recompiling: both trees produce a common cubin"
    tally = {"configs": len(verdicts)}
    for verdict in verdicts.values():
        kind = verdict.split(":")[0]
        tally[kind] = tally.get(kind, 0) + 1

    def side(manifest_):
        return {name: manifest_.get(name) for name in ("tree", "commit", "uncommitted_changes", "date",
                                                        "cutlass_dsl", "only")}

    return {
        "what": "tools/kernel_binaries.py compare: " + (
            "PTX with kernel_cutlass_* names normalised" if normalized else "PTX and cubin bytes"),
        "mode": "normalized" if normalized else "strict",
        "compared_fields": list(fields),
        "before": side(before),
        "after": side(after),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cutlass_dsl": importlib.metadata.version("nvidia-cutlass-dsl"),
        "counts": tally,
        "identical": all(verdict.startswith("identical") for verdict in verdicts.values()),
        "verdicts": verdicts,
        "cubin_variants": variants,
    }


def recompiler(attempts: int):
    """cubin_variants for compare_manifests: compile a configuration `attempts` times in the manifest's
    tree. The PTX must come out as the manifest has it, or the tree has changed since and nothing it
    compiles now says anything about the manifest."""
    listings = {}

    def cubin_variants(manifest_: dict, key: str) -> list:
        tree = manifest_["tree"]
        if tree not in listings:
            listings[tree] = {job["key"]: job for job in _listing(tree)["jobs"]}
        hashes = []
        for attempt in range(attempts):
            with tempfile.TemporaryDirectory(prefix="kernel_binaries_") as directory:
                record = run_job(tree, listings[tree][key], os.path.join(directory, "job"))
            if record["ptx_sha256"] != manifest_["configs"][key]["ptx_sha256"]:
                raise SystemExit(f"{key}: {tree} now compiles to other PTX than its manifest records")
            hashes.append(record["cubin_sha256"])
        print(f"{key}: {tree}: {len(set(hashes))} cubin variants in {attempts} compiles", flush=True)
        return hashes

    return cubin_variants


def read_manifest(path: str) -> dict:
    """A manifest, plain or xz-compressed (the committed ones are kept as .json.xz: the repository travels
    with every device call next to the CuTe DSL bundle, under 64 MiB)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def compare(before_path: str, after_path: str, out: str, normalized: bool, recompile: int) -> int:
    before, after = read_manifest(before_path), read_manifest(after_path)
    result = compare_manifests(before, after, normalized, recompiler(recompile) if recompile else None)
    _write_json(out, result)
    for key, verdict in result["verdicts"].items():
        if verdict != "identical":
            print(f"{key}: {verdict}")
    print(f"{result['mode']}: {result['counts']} -> {'identical' if result['identical'] else 'DIFFERENT'}"
          f" ({out})")
    return 0 if result["identical"] else 1


def _write_json(path: str, data: dict):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="the configurations a tree's compile tests build")
    listing.add_argument("--tree", required=True)
    listing.add_argument("--json", action="store_true", help="the jobs as JSON (what manifest runs)")
    build = commands.add_parser("manifest", help="compile every configuration and hash its PTX and cubin")
    build.add_argument("--tree", required=True, help="the source tree (its fa4_jax and tests/)")
    build.add_argument("--out", required=True)
    build.add_argument("--jobs", type=int, default=2, help="compiles run at once")
    build.add_argument("--only", help="only configurations whose key matches this regular expression")
    build.add_argument("--artifacts", help="keep each compile's PTX and cubin under this directory")
    check = commands.add_parser("compare", help="compare two manifests; exit 1 on any difference")
    check.add_argument("before")
    check.add_argument("after")
    check.add_argument("--out", required=True)
    check.add_argument("--normalized", action="store_true",
                       help="compare the PTX with kernel_cutlass_* names normalised, not PTX and cubin bytes")
    check.add_argument("--recompile", type=int, default=8, metavar="N",
                       help="where only the cubin differs, compile it N more times in each tree (0: never)")
    arguments = parser.parse_args(argv)
    if arguments.command == "list":
        listing = list_jobs(arguments.tree)
        if arguments.json:
            print(LISTING + json.dumps(listing))
        else:
            for job in listing["jobs"]:
                print(f"{job['arch']}  {job['key']}")
            print(f"{len(listing['jobs'])} configurations; fa4_jax from {listing['fa4_jax']}")
        return 0
    if arguments.command == "manifest":
        return manifest(arguments.tree, arguments.out, arguments.jobs, arguments.only, arguments.artifacts)
    return compare(arguments.before, arguments.after, arguments.out, arguments.normalized,
                   arguments.recompile)


if __name__ == "__main__":
    sys.exit(main())
