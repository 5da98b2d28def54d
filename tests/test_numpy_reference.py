"""The float64 oracle checked against itself: literal formulas, a brute-force mask and finite differences.

Everything else is tested against tests/numpy_reference.py, so it must be right on its own terms.
"""

import numpy as np
import pytest

import numpy_reference as oracle

# Two float64 evaluations of one formula in different orders; atol because an output that cancels to
# ~1e-5 is only accurate to ~1e-16 absolute, which is no relative bound.
_FLOAT64 = dict(rtol=1e-12, atol=1e-13)


def _inputs(generator, batch=2, q_len=5, kv_len=7, q_heads=4, kv_heads=2, head_dim=6, value_dim=3):
    query = generator.standard_normal((batch, q_len, q_heads, head_dim))
    key = generator.standard_normal((batch, kv_len, kv_heads, head_dim))
    value = generator.standard_normal((batch, kv_len, kv_heads, value_dim))
    return query, key, value


def _literal_visible(batch, q_len, kv_len, causal, window, q_ids, kv_ids, q_lengths, kv_lengths):
    """The contract's visibility rule, one (b, i, j) at a time; lengths are clipped to [0, axis]."""
    visible = np.zeros((batch, q_len, kv_len), dtype=bool)
    for b in range(batch):
        q_valid = q_len if q_lengths is None else min(max(q_lengths[b], 0), q_len)
        kv_valid = kv_len if kv_lengths is None else min(max(kv_lengths[b], 0), kv_len)
        offset = kv_valid - q_valid
        for i in range(q_len):
            for j in range(kv_len):
                ok = i < q_valid and j < kv_valid
                if causal:
                    ok = ok and j <= i + offset
                if window is not None:
                    left, right = window
                    ok = ok and (left is None or i + offset - left <= j)
                    ok = ok and (right is None or j <= i + offset + right)
                if q_ids is not None:
                    ok = ok and q_ids[b, i] == kv_ids[b, j]
                visible[b, i, j] = ok
    return visible


def test_unmasked_equals_direct_softmax(rng):
    query, key, value = _inputs(rng, q_heads=2, kv_heads=2)
    out, lse = oracle.attention_forward(query, key, value, scale=0.3)
    for b in range(query.shape[0]):
        for h in range(query.shape[2]):
            logits = 0.3 * query[b, :, h] @ key[b, :, h].T
            weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            np.testing.assert_allclose(out[b, :, h], weights @ value[b, :, h], **_FLOAT64)
            np.testing.assert_allclose(lse[b, h], np.log(np.exp(logits).sum(axis=1)), **_FLOAT64)


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    query, key, value = _inputs(rng, head_dim=9)
    np.testing.assert_allclose(oracle.attention_forward(query, key, value)[0],
                               oracle.attention_forward(query, key, value, scale=1 / 3)[0], **_FLOAT64)


def test_grouped_query_heads_read_kv_head_h_div_group(rng):
    query, key, value = _inputs(rng, q_heads=6, kv_heads=2)
    grouped = oracle.attention_forward(query, key, value, causal=True)
    repeated = oracle.attention_forward(query, np.repeat(key, 3, axis=2), np.repeat(value, 3, axis=2),
                                        causal=True)
    np.testing.assert_allclose(grouped[0], repeated[0], **_FLOAT64)
    # Head 4 belongs to group 1: changing kv head 0 must not move it.
    key_changed = key.copy()
    key_changed[:, :, 0] += rng.standard_normal(key_changed[:, :, 0].shape)
    moved = oracle.attention_forward(query, key_changed, value, causal=True)[0]
    np.testing.assert_array_equal(moved[:, :, 3:], grouped[0][:, :, 3:])
    assert not np.allclose(moved[:, :, :3], grouped[0][:, :, :3])


def test_sinks_act_as_an_extra_key_with_zero_value(rng):
    query, key, value = _inputs(rng, q_heads=2, kv_heads=2)
    sinks = rng.standard_normal(2)
    out, lse = oracle.attention_forward(query, key, value, sinks=sinks, scale=1.0)
    # Append, at the logits level, one key whose logit is the sink and whose value is zero.
    for b in range(query.shape[0]):
        for h in range(2):
            logits = query[b, :, h] @ key[b, :, h].T
            logits = np.concatenate([logits, np.full((logits.shape[0], 1), sinks[h])], axis=1)
            values = np.concatenate([value[b, :, h], np.zeros((1, value.shape[-1]))], axis=0)
            weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
            np.testing.assert_allclose(out[b, :, h], weights @ values, **_FLOAT64)
            np.testing.assert_allclose(lse[b, h], np.log(np.exp(logits).sum(axis=1)), **_FLOAT64)


def test_softcap_caps_logits(rng):
    query, key, value = _inputs(rng, q_heads=1, kv_heads=1)
    query = query * 10
    capped = oracle.attention_forward(query, key, value, softcap=2.0, scale=1.0)
    logits = 2.0 * np.tanh(np.einsum("bqd,bkd->bqk", query[:, :, 0], key[:, :, 0]) / 2.0)
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(capped[0][:, :, 0], np.einsum("bqk,bkd->bqd", weights, value[:, :, 0]),
                               **_FLOAT64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (2, 1), (0, None), (None, 0), (3, 3)])
@pytest.mark.parametrize("segments", [None, "pair"])
@pytest.mark.parametrize("lengths", [None, "q", "kv", "both"])
@pytest.mark.parametrize("q_len,kv_len", [(5, 5), (4, 9), (9, 4)])
def test_mask_matches_literal_rule(rng, causal, window, segments, lengths, q_len, kv_len):
    batch = 3
    q_ids = kv_ids = None
    if segments:
        q_ids = rng.integers(0, 3, size=(batch, q_len))
        kv_ids = rng.integers(0, 3, size=(batch, kv_len))
    # Lengths from below 0 to past the axis, which the contract clips.
    q_lengths = rng.integers(-2, q_len + 3, size=batch) if lengths in ("q", "both") else None
    kv_lengths = rng.integers(-2, kv_len + 3, size=batch) if lengths in ("kv", "both") else None
    masking = oracle.Masking(causal, window, None if q_ids is None else (q_ids, kv_ids),
                             q_lengths, kv_lengths)
    expected = _literal_visible(batch, q_len, kv_len, causal, window, q_ids, kv_ids, q_lengths, kv_lengths)
    np.testing.assert_array_equal(oracle.visible_keys(batch, q_len, kv_len, masking), expected)


def test_bottom_right_alignment_example():
    # Sq=2, Sk=5, causal: row 0 sits at key 3 and row 1 at key 4.
    mask = oracle.visible_keys(1, 2, 5, oracle.Masking(causal=True))[0]
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # Sq=4, Sk=2, causal: rows 0 and 1 sit before key 0 and see nothing.
    mask = oracle.visible_keys(1, 4, 2, oracle.Masking(causal=True))[0]
    np.testing.assert_array_equal(mask, [[0, 0], [0, 0], [1, 0], [1, 1]])


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(rng, with_sinks):
    query, key, value = _inputs(rng, q_len=6, kv_len=3)
    sinks = rng.standard_normal(4) if with_sinks else None
    out, lse = oracle.attention_forward(query, key, value, causal=True, sinks=sinks)
    # off = -3: rows 0..2 see no key.
    np.testing.assert_array_equal(out[:, :3], 0.0)
    expected_lse = np.broadcast_to(sinks[None, :, None], (2, 4, 3)) if with_sinks else -np.inf
    np.testing.assert_array_equal(lse[:, :, :3], expected_lse)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 3:]))
    grads = oracle.attention_backward(query, key, value, rng.standard_normal(out.shape),
                                      rng.standard_normal(lse.shape), causal=True, sinks=sinks)
    np.testing.assert_array_equal(grads["dq"][:, :3], 0.0)
    for name, grad in grads.items():
        assert grad is None or np.all(np.isfinite(grad)), name


def _loss(query, key, value, sinks, d_out, d_lse, options):
    out, lse = oracle.attention_forward(query, key, value, sinks=sinks, **options)
    return np.sum(out * d_out) + np.sum(np.where(np.isfinite(lse), lse * d_lse, 0.0))


def _finite_difference(function, array, step=1e-6):
    gradient = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        plus, minus = array.copy(), array.copy()
        plus[index] += step
        minus[index] -= step
        gradient[index] = (function(plus) - function(minus)) / (2 * step)
    return gradient


@pytest.mark.parametrize("options", [
    dict(),
    dict(causal=True, softcap=1.5),
    dict(window=(1, 2), sinks=True),
    dict(causal=True, window=(2, None), softcap=0.7, sinks=True, segments=True, lengths=True),
    dict(window=(None, 0), sinks=True, lengths=True),
], ids=["plain", "causal-softcap", "window-sinks", "everything", "right-window-lengths"])
def test_gradients_match_finite_differences(rng, options):
    options = dict(options)
    query, key, value = _inputs(rng, batch=2, q_len=4, kv_len=5, q_heads=4, kv_heads=2, head_dim=3,
                                value_dim=2)
    sinks = rng.standard_normal(4) if options.pop("sinks", False) else None
    if options.pop("segments", False):
        options["segment_ids"] = (np.array([[0, 0, 1, 1], [0, 1, 1, 1]]),
                                  np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]))
    if options.pop("lengths", False):
        # Batch 1: one padding query row (its lse is the sink) and one padding key.
        options["q_seq_lengths"] = np.array([4, 3])
        options["kv_seq_lengths"] = np.array([5, 4])
    out, lse = oracle.attention_forward(query, key, value, sinks=sinks, **options)
    d_out = rng.standard_normal(out.shape)
    d_lse = rng.standard_normal(lse.shape)
    grads = oracle.attention_backward(query, key, value, d_out, d_lse, sinks=sinks, **options)

    def loss_of(position):
        def loss(array):
            arguments = [query, key, value, sinks]
            arguments[position] = array
            return _loss(*arguments, d_out, d_lse, options)
        return loss

    for position, name in enumerate(["dq", "dk", "dv"]):
        numeric = _finite_difference(loss_of(position), [query, key, value][position])
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-7, err_msg=name)
    if sinks is not None:
        numeric = _finite_difference(loss_of(3), sinks)
        np.testing.assert_allclose(grads["dsinks"], numeric, rtol=1e-6, atol=1e-7, err_msg="dsinks")
    else:
        assert grads["dsinks"] is None


@pytest.mark.parametrize("options", [
    dict(),
    dict(causal=True, softcap=1.5, sinks=True),
    dict(causal=True, window=(2, None), softcap=0.7, sinks=True, segments=True, lengths=True),
], ids=["plain", "causal-softcap-sinks", "everything"])
def test_tangent_matches_a_directional_finite_difference(rng, options):
    """attention_tangent is the derivative of attention_forward along (t_q, t_k, t_v, t_sinks)."""
    options = dict(options)
    query, key, value = _inputs(rng, batch=2, q_len=4, kv_len=5, q_heads=4, kv_heads=2, head_dim=3,
                                value_dim=2)
    sinks = rng.standard_normal(4) if options.pop("sinks", False) else None
    if options.pop("segments", False):
        options["segment_ids"] = (np.array([[0, 0, 1, 1], [0, 1, 1, 1]]),
                                  np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]))
    if options.pop("lengths", False):
        options["q_seq_lengths"] = np.array([4, 3])
        options["kv_seq_lengths"] = np.array([5, 4])
    primals = [query, key, value] + ([sinks] if sinks is not None else [])
    tangents = [rng.standard_normal(x.shape) for x in primals]

    def forward(step):
        moved = [x + step * t for x, t in zip(primals, tangents)]
        return oracle.attention_forward(*moved[:3], sinks=moved[3] if sinks is not None else None, **options)

    step = 1e-6
    (out_plus, lse_plus), (out_minus, lse_minus) = forward(step), forward(-step)
    t_out, t_lse = oracle.attention_tangent(*primals[:3], *tangents[:3], tangents[3] if sinks is not None else None,
                                            sinks=sinks, **options)
    np.testing.assert_allclose(t_out, (out_plus - out_minus) / (2 * step), rtol=1e-6, atol=1e-7)
    finite = np.isfinite(lse_plus)
    np.testing.assert_allclose(t_lse[finite], ((lse_plus - lse_minus) / (2 * step))[finite], rtol=1e-6, atol=1e-7)
    assert np.all(t_lse[~finite] == 0)
