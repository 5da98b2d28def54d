"""The package's layers, read from its source (every import, including those inside functions): no
import cycle, and no module imports one of a higher layer.

From the bottom: the static configuration; the checks, the pure-JAX reference and the context-parallel
algorithm (given the primitives it binds); the kernels' building blocks (`kernels/common`); the
kernels' host side (`kernels/host`, the compile cache); the kernels themselves, a wing per
architecture that may use its own wing but not another; the primitives; their lowerings and sharding
rules; the public function, jax.nn's signature over it (`fa4_jax.nn`) and the package; the Flax layer.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fa4_jax"

# (layer, module-name prefix), most specific prefix first; a lower layer number is lower in the stack.
LAYERS = [
    (0, "fa4_jax.config"),
    (1, "fa4_jax.validation"), (1, "fa4_jax.reference"),
    (1, "fa4_jax.context_parallel"),  # per-shard algorithm; binds the primitives it is handed
    (2, "fa4_jax.kernels.common"),
    (3, "fa4_jax.kernels.host"), (3, "fa4_jax.kernels.compile_cache"),
    (4, "fa4_jax.kernels.sm90"), (4, "fa4_jax.kernels.sm100"),
    (2, "fa4_jax.kernels"),          # the package's __init__: documentation only
    (5, "fa4_jax.primitive"),
    (6, "fa4_jax.lowering"), (6, "fa4_jax.sharding"),
    (7, "fa4_jax.api"), (7, "fa4_jax.paged"),
    (7.2, "fa4_jax.nn"),             # jax.nn's signature over the public function; the Flax layer uses it
    (8, "fa4_jax.flax_layer"),
    (7.5, "fa4_jax"),                # the package: the public names
]
# Wings of one layer that must not import each other.
WINGS = ("fa4_jax.kernels.sm90", "fa4_jax.kernels.sm100")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(name: str):
    for layer, prefix in LAYERS:
        if name == prefix or name.startswith(prefix + "."):
            return layer, prefix
    raise AssertionError(f"{name} has no layer: add it to LAYERS")


def _imports(path: pathlib.Path, modules: set) -> set:
    """The fa4_jax modules `path` imports (`from a import b` counts a.b when that is a module, else a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("fa4_jax"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fa4_jax"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    found.discard(_module_name(path))
    return found


def _graph():
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) & modules for name, path in paths.items()}


def _upward(graph):
    problems = []
    for name, imported in graph.items():
        layer, _ = _layer(name)
        for other in imported:
            other_layer, _ = _layer(other)
            wing = next((w for w in WINGS if name == w or name.startswith(w + ".")), None)
            other_wing = next((w for w in WINGS if other == w or other.startswith(w + ".")), None)
            if other_layer > layer or (other_layer == layer and wing != other_wing):
                problems.append(f"{name} (layer {layer}) imports {other} (layer {other_layer})")
    return problems


def _cycles(graph):
    state, stack, cycles = {}, [], []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycles.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_no_import_from_a_higher_layer():
    assert _upward(_graph()) == []


def test_every_module_has_a_layer():
    for name in _graph():
        _layer(name)


@pytest.mark.parametrize("planted, found_by", [
    ({"fa4_jax.kernels.common.masking": {"fa4_jax.kernels.sm90.forward"},
      "fa4_jax.kernels.sm90.forward": {"fa4_jax.kernels.common.masking"}}, "both"),
    ({"fa4_jax.kernels.sm100.forward": {"fa4_jax.kernels.sm90.wgmma"}, "fa4_jax.kernels.sm90.wgmma": set()},
     "upward"),
])
def test_the_checks_catch_a_planted_import(planted, found_by):
    """A cycle and a cross-wing import, planted into a graph, are found (the checks can fail)."""
    assert _upward(planted)
    if found_by == "both":
        assert _cycles(planted)
