"""The suite's own scheduling under pytest-xdist (tests/conftest.py): a compile-test module is one unit of
work, so the worker that compiles its batch runs all of its tests."""

from conftest import scheduling_unit


def test_compile_modules_are_one_unit_of_xdist_work():
    compile_tests = "tests/test_kernel_compile_sm90.py"
    assert scheduling_unit(f"{compile_tests}::test_ptx_has_hopper_instructions[d128]") == compile_tests
    assert scheduling_unit(f"{compile_tests}::test_no_register_spills[d64-polynomial-exp2]") == compile_tests
    other = "tests/test_attention.py::test_matches_reference[causal]"
    assert scheduling_unit(other) == other
