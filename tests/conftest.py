"""Test set-up shared by every test file: fake CPU devices, the `gpu` marker, fresh random inputs.

Random inputs are new on every run (the seed comes from os.urandom) so the suite keeps exploring; a
failing test prints its seed, and FA4_TEST_SEED=<seed> replays it.
"""

import os
import sys

# Test the working tree, whether or not the package is installed in the environment.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The sharding tests need 8 devices; on the CPU they are faked. XLA reads the flag when the backend
# starts, so it must be in the environment before jax is first imported.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if "jax" in sys.modules:
    print("tests/conftest.py: jax was imported before conftest; the fake CPU device count may not apply",
          file=sys.stderr)
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_DEVICE_COUNT_FLAG}=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

SEED_VARIABLE = "FA4_TEST_SEED"


# Under `-n`, each compile-test module (tests/test_kernel_compile_*.py: its module fixture compiles every
# case of the file in one batch, minutes on two cores) runs on one worker, so its batch compiles once; every
# other test is a unit of its own. (pytest-xdist's loadgroup did this through a suffix on each test's
# nodeid, which pytest 9 no longer lets a plugin set: the compile modules were split across the workers
# and each worker compiled the whole batch, ~8 minutes of CI.) An explicit --dist keeps xdist's own.
COMPILE_MODULE_PREFIX = "test_kernel_compile_"


def scheduling_unit(nodeid: str) -> str:
    """The unit of work a test is sent to a worker in: its module for a compile-test module, else itself."""
    module = nodeid.split("::", 1)[0]
    return module if os.path.basename(module).startswith(COMPILE_MODULE_PREFIX) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class CompileModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return CompileModulesTogether(config, log)


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax has no gpu backend here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _new_seed() -> int:
    if os.environ.get(SEED_VARIABLE):
        return int(os.environ[SEED_VARIABLE])
    return int.from_bytes(os.urandom(4), "little")


@pytest.fixture
def seed(request) -> int:
    """This test's random seed; shown in the report when the test fails."""
    value = _new_seed()
    request.node.fa4_seed = value
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed_value = getattr(item, "fa4_seed", None)
    if seed_value is not None and report.failed:
        report.sections.append(
            ("random seed", f"replay with: {SEED_VARIABLE}={seed_value} pytest '{item.nodeid}'"))
    return report


@pytest.fixture
def enable_x64():
    """64-bit JAX types for the one test that asks for it; the rest of the suite runs in 32-bit."""
    with jax.enable_x64(True):
        yield


class InputFactory:
    """Random test inputs from one seeded generator: normal floats (never all zeros), packed segment
    ids and prefix lengths."""

    def __init__(self, generator: np.random.Generator):
        self.generator = generator

    def normal(self, shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
        """Normal random values, rounded to `dtype` on the host."""
        values = self.generator.standard_normal(shape).astype(np.float32) * np.float32(scale)
        return jnp.asarray(values).astype(dtype)

    def segment_ids(self, batch, length, segments=3) -> jax.Array:
        """int32 [B, S], packed-sequence style: ids 0, 1, ... in runs of random length."""
        ids = np.zeros((batch, length), dtype=np.int32)
        for row in ids:
            cuts = self.generator.choice(np.arange(1, length), size=min(segments - 1, length - 1),
                                         replace=False)
            for cut in cuts:
                row[cut:] += 1
        return jnp.asarray(ids)

    def lengths(self, batch, maximum, minimum=1) -> jax.Array:
        """int32 [B] valid-prefix lengths in [minimum, maximum]; batch 0 gets the full length and, when
        there are two or more, the last is shorter, so every draw has both a full and a padded row."""
        lengths = self.generator.integers(minimum, maximum + 1, size=(batch,)).astype(np.int32)
        lengths[0] = maximum
        if batch > 1 and maximum > minimum:
            lengths[-1] = self.generator.integers(minimum, maximum)
        return jnp.asarray(lengths)


@pytest.fixture
def inputs(rng) -> InputFactory:
    return InputFactory(rng)
