"""CPU: `sm90.backward.head_splits_for`, the choice of how many CTAs share a (key block, KV head,
batch) of the Hopper backward: a split the kernel takes, more than one only where the grid leaves SMs
idle or a causal mask leaves its CTAs unequal, and never more than two in deterministic mode."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.config import AttentionConfig  # noqa: E402
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.common import masking  # noqa: E402
from fa4_jax.kernels.sm90 import backward as sm90_backward  # noqa: E402

CAUSAL = masking.MaskShape(causal=True)
FULL = masking.MaskShape()
H200_SMS = 132

# (batch, kv_heads, group, sequence length): issue 12's GQA 4, GQA 8 and MQA rows, and smaller ones.
SHAPES = [(1, 8, 4, 8192), (2, 8, 8, 4096), (8, 1, 16, 2048), (2, 2, 4, 300), (1, 1, 8, 100), (4, 4, 2, 1000)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", [FULL, CAUSAL, masking.MaskShape(window_left=256, window_right=0)], ids=repr)
@pytest.mark.parametrize("batch,kv_heads,group,length", SHAPES)
def test_the_kernel_takes_every_choice(batch, kv_heads, group, length, mask, deterministic):
    splits = sm90_backward.head_splits_for(batch, kv_heads, group, length, length, H200_SMS, deterministic, mask)
    assert group % splits == 0
    assert splits <= (sm90_backward.DETERMINISTIC_HEAD_SPLITS if deterministic else group)
    config = AttentionConfig(scale=0.125, causal=mask.causal, window_left=mask.window_left,
                             window_right=mask.window_right, deterministic=deterministic)
    dims = (batch, length, kv_heads * group, 128), (batch, length, kv_heads, 128)
    problem = host.Problem(dims[0], dims[1], dims[1], "bfloat16")
    options = sm90_backward.options(config, problem, sm90_backward.Tuning(head_splits=splits))
    assert options.head_splits == splits
    sm90_backward.Sm90BackwardKernel(options)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", [FULL, CAUSAL], ids=repr)
def test_mha_is_never_split(mask, deterministic):
    assert sm90_backward.head_splits_for(1, 2, 1, 2048, 2048, H200_SMS, deterministic, mask) == 1


def test_causal_mqa_is_split():
    """Issue 12's MQA row (B 8, S 2k, 16 query heads on 1): 16 key blocks x 8 = 128 CTAs, one wave in
    which key block 0 walks 32 query blocks per head and key block 15 walks 2."""
    assert sm90_backward.head_splits_for(8, 1, 16, 2048, 2048, H200_SMS, False, CAUSAL) > 1
    assert sm90_backward.head_splits_for(8, 1, 16, 2048, 2048, H200_SMS, True, CAUSAL) == 2


def test_a_full_wave_of_equal_ctas_is_not_split():
    """The same row without a mask: 128 equal CTAs on 132 SMs, a split only adds its partial sums."""
    assert sm90_backward.head_splits_for(8, 1, 16, 2048, 2048, H200_SMS, False, FULL) == 1


def test_an_underfilled_grid_is_split():
    """2 KV heads x 3 key blocks x 2 batch elements = 12 CTAs on 132 SMs: every split up to the group
    pays, equal CTAs or not."""
    assert sm90_backward.head_splits_for(2, 2, 4, 300, 333, H200_SMS, False, FULL) == 4


def test_a_deep_grid_is_not_split():
    """Many waves of CTAs already even out a causal mask's unequal CTAs."""
    assert sm90_backward.head_splits_for(64, 8, 8, 4096, 4096, H200_SMS, False, CAUSAL) == 1


def test_grid_y_stays_within_cuda_limit():
    """kv_heads * head_splits is gridDim.y: a split past 65535 is not chosen."""
    splits = sm90_backward.head_splits_for(1, 40000, 4, 128, 128, 100000, False, FULL)
    assert 40000 * splits <= host.MAX_GRID_Y_Z


def test_longest_first_launch_needs_fewer_splits():
    """`Tuning.key_blocks_outer` launches every head's key block 0 (the longest causal walk) first: the
    model then finds GQA 8's causal grid even without a split, and MQA's with fewer."""
    assert sm90_backward.head_splits_for(2, 8, 8, 4096, 4096, H200_SMS, False, CAUSAL, False) > 1
    assert sm90_backward.head_splits_for(2, 8, 8, 4096, 4096, H200_SMS, False, CAUSAL, True) == 1
    assert (sm90_backward.head_splits_for(8, 1, 16, 2048, 2048, H200_SMS, False, CAUSAL, True)
            < sm90_backward.head_splits_for(8, 1, 16, 2048, 2048, H200_SMS, False, CAUSAL, False))
