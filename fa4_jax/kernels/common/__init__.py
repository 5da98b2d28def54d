"""Building blocks shared by the sm90 and sm100 kernels (plain functions and small classes, each with\na CPU test in tests/test_kernel_building_blocks.py or tests/test_backward_block_ranges.py)."""
