"""On-disk cache of compiled CuTe kernels for `cutlass.jax.cutlass_call`, so a new process's first call
does not trace and compile the kernel again.

`cutlass_call` keeps compiled kernels in a per-process dictionary keyed by (compile key, argument
spec, environment). `prepare` fills that dictionary before JAX lowers the call: from a file when one
exists, else by compiling now and writing the object code to a file. The file name hashes the
compile key, the argument spec, the source of every module in fa4_jax/kernels/ (a kernel or one of
the building blocks it is generated from), the GPU architecture compiled for, the cutlass-dsl version
and the CUTE_DSL_* variables (the ones that change code generation), so a stale kernel is never
served and no version number has to be bumped by hand.

Directory: $FA4_JAX_CACHE_DIR, else $XDG_CACHE_HOME/fa4_jax/kernels, else ~/.cache/fa4_jax/kernels.
FA4_JAX_CACHE_DIR="" turns the disk cache off. Anything unexpected (an unwritable directory, a
changed cutlass-dsl internal) only skips the cache, with a warning: compilation then happens as usual.
A kernel that fails to compile raises its own error.

Input-output aliases (the backward's fp32 dQ accumulator and deterministic counters are updated in
place) are part of the spec and of the file name: pass the same mapping `cutlass_call` gets.

This leans on cutlass internals (`build_function_spec`, `_normalize_input_output_aliases`,
`_CUTLASS_COMPILE_CACHE`, the DSL's `envar.arch`), pinned by the project's nvidia-cutlass-dsl version.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import tempfile
import warnings
from typing import Hashable, Optional

import jax

logger = logging.getLogger(__name__)
_reported: set = set()  # (step, exception type) already warned about

# The .py files under it key the disk cache: the kernels and the building blocks they are generated from
# (a change to one that generates nothing, such as reference.py, costs one recompile).
KERNEL_SOURCES = os.path.dirname(os.path.abspath(__file__))


def cache_directory() -> Optional[str]:
    configured = os.environ.get("FA4_JAX_CACHE_DIR")
    if configured is not None:
        return configured or None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fa4_jax", "kernels")


def _cutlass_version() -> str:
    try:
        from importlib.metadata import version
        return version("nvidia-cutlass-dsl")
    except Exception:
        import cutlass
        return str(getattr(cutlass, "__version__", "unknown"))


@functools.cache
def _source_digest(directory: str) -> str:
    """sha256 over the names and contents of the .py files under `directory` (read once per process)."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(directory).rglob("*.py")):
        source = path.read_bytes()
        digest.update(f"{path.relative_to(directory).as_posix()}\0{len(source)}\0".encode())
        digest.update(source)
    return digest.hexdigest()


def _target_arch() -> str:
    """The architecture the DSL compiles for: CUTE_DSL_ARCH as read at its import, else the local GPU's
    compute capability (its sm_100a default when it sees no GPU)."""
    from cutlass.cutlass_dsl import CuTeDSL
    return CuTeDSL._get_dsl().envar.arch


def _function_spec(arguments, outputs, input_output_aliases):
    """The spec cutlass_call builds for these inputs, outputs and aliases (no options or kwargs)."""
    from cutlass.jax import compile as cutlass_compile
    from cutlass.jax import primitive as cutlass_primitive

    arguments_flat, arguments_tree = jax.tree.flatten(arguments)
    outputs_flat, outputs_tree = jax.tree.flatten(outputs)
    input_specs = cutlass_primitive._resolve_input_spec_flat(None, arguments, arguments_flat)
    output_specs = cutlass_primitive._resolve_spec_flat(None, outputs_flat)
    # cutlass_call normalises its aliases, then hands build_function_spec a dict of them.
    aliases = dict(cutlass_compile._normalize_input_output_aliases(input_output_aliases))
    return cutlass_compile.build_function_spec(
        arguments_flat, arguments_tree, outputs_flat, outputs_tree, input_specs, output_specs, aliases,
        None, False, {})


def _file_name(compile_key: Hashable, spec) -> str:
    code_generation_environment = sorted(
        (name, value) for name, value in os.environ.items() if name.startswith("CUTE_DSL_"))
    description = repr((compile_key, spec.in_args, spec.out_args, str(spec.input_tree), str(spec.output_tree),
                        spec.input_output_aliases, _source_digest(KERNEL_SOURCES), _target_arch(),
                        _cutlass_version(), code_generation_environment))
    return hashlib.sha256(description.encode()).hexdigest() + ".o"


def prepare(function, arguments, outputs, compile_key: Hashable, input_output_aliases=None) -> None:
    """Make sure `cutlass_call(function, compile_key=compile_key,
    input_output_aliases=input_output_aliases)` on `arguments` finds its kernel compiled: in this
    process's cache, else loaded from disk, else compiled now and saved.

    A failure of the cache itself only warns (the call then compiles as usual); a failure to compile
    the kernel is raised as it is, since `cutlass_call` would only spend the same time failing again."""
    directory = cache_directory()
    if directory is None:
        return
    try:
        from cutlass.jax import compile as cutlass_compile

        spec = _function_spec(arguments, outputs, input_output_aliases)
        key = cutlass_compile.CompileCacheKey(
            compile_key=compile_key, spec=spec, environment=str(sorted(os.environ.items())))
        if key in cutlass_compile._CUTLASS_COMPILE_CACHE:
            return
        path = os.path.join(directory, _file_name(compile_key, spec))
        if os.path.exists(path):
            with open(path, "rb") as handle:
                module = handle.read()
            cutlass_compile._CUTLASS_COMPILE_CACHE[key] = cutlass_compile.CompileResult(
                module=module, fingerprint=hashlib.sha256(module).digest(), spec=spec)
            logger.debug("fa4_jax kernel loaded from %s", path)
            return
    except Exception as error:  # the cache is an optimisation: never let it break a call
        _warn_skipped("looking the kernel up", error)
        return
    result = cutlass_compile.get_or_compile_kernel(function, spec, compile_key=compile_key)
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False) as handle:
            handle.write(result.module)
        os.replace(handle.name, path)  # atomic: concurrent processes never read a partial file
    except Exception as error:
        _warn_skipped("saving the kernel", error)


def _warn_skipped(step: str, error: Exception) -> None:
    """Warn once per kind of failure: the first of each is shown, repeats (every later kernel in an
    unwritable directory) are not."""
    if (step, type(error)) in _reported:
        return
    _reported.add((step, type(error)))
    warnings.warn(f"fa4_jax: on-disk kernel cache skipped while {step} ({type(error).__name__}: {error}); "
                  'FA4_JAX_CACHE_DIR="" turns the cache off', stacklevel=3)
