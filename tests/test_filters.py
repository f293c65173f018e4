"""Worker-side filters: nothing is ever lost (sent + residual == produced), hand cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.algorithms.ps.compress import round_values
from edgefl.algorithms.ps.filters import (
    ErrorFeedback,
    FilterChain,
    FilterContext,
    KKTFilter,
    SignificantlyModified,
    make_filter_chain,
)
from edgefl.errors import ConfigError

SPACE = 40


def _fp16(v: np.ndarray) -> np.ndarray:
    return round_values(v, "float16")


def _make(kind: str):
    if kind == "significant":
        return SignificantlyModified(0.75), None
    if kind == "kkt":
        return KKTFilter(0.3, margin=0.05, exempt=[0]), None
    if kind == "kkt-carry":
        return KKTFilter(0.3, carry=True), None
    if kind == "error-feedback-fp16":
        return ErrorFeedback(), _fp16
    if kind == "chain":
        return FilterChain([KKTFilter(0.3), SignificantlyModified(0.5)]), None
    if kind == "chain-fp16":
        return FilterChain([KKTFilter(0.2), SignificantlyModified(0.25)], _fp16), None
    raise AssertionError(kind)


def _dense(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(SPACE, np.float64)
    out[keys] = values
    return out


# Values are multiples of 2**-6 below 2**7 in magnitude: every sum here is exact in float64,
# so "sent + residual == produced" must hold bit for bit.
_value = st.integers(-(2**13), 2**13).map(lambda i: i / 64.0)
_update = st.dictionaries(st.integers(0, SPACE - 1), _value, max_size=SPACE)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(
        ["significant", "kkt", "kkt-carry", "error-feedback-fp16", "chain", "chain-fp16"]
    ),
    st.lists(_update, min_size=1, max_size=12),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_filters_never_lose_mass(kind: str, updates, seed: int, flush: bool) -> None:
    f, quantize = _make(kind)
    rng = np.random.default_rng(seed)
    produced = np.zeros(SPACE)
    sent = np.zeros(SPACE)
    for upd in updates:
        keys = np.array(sorted(upd), np.int64)
        vals = np.array([upd[k] for k in keys], np.float32)
        # context: about half the weights are zero, gradients straddle l1 = 0.3
        ctx = FilterContext(
            np.arange(SPACE),
            weights=np.where(rng.random(SPACE) < 0.5, 0.0, 1.0),
            grads=rng.choice([-0.5, -0.2, 0.0, 0.1, 0.28, 0.4], SPACE),
        )
        produced += _dense(keys, vals)
        sk, sv = f.apply(keys, vals, ctx, quantize)
        assert sv.dtype == np.float32 and np.all(np.diff(sk) > 0) and np.all(sv != 0)
        if quantize is not None:
            assert np.array_equal(_fp16(sv), sv)  # sent values are what the receiver decodes
        sent += _dense(sk, sv)
        hk, hv = f.held()
        assert np.array_equal(sent + _dense(hk, hv), produced)
    if flush:
        sk, sv = f.flush(quantize)
        sent += _dense(sk, sv)
        hk, hv = f.held()
        assert np.array_equal(sent + _dense(hk, hv), produced)
        if not kind.endswith("fp16"):
            assert hk.size == 0  # everything went out (float16 rounding errors may stay)


def test_significantly_modified_hand_case() -> None:
    f = SignificantlyModified(1.0)
    k, v = f.apply([2, 5], np.array([0.6, 1.5], np.float32))
    assert k.tolist() == [5] and v.tolist() == [1.5]  # 0.6 is held back
    k, v = f.apply([2], np.array([0.6], np.float32))
    assert k.tolist() == [2] and v.tolist() == [np.float32(1.2)]  # accumulated 1.2 > 1
    assert len(f.residual) == 0  # 2 * float32(0.6) is exact in float32
    k, v = f.apply([3], np.array([-1.0], np.float32))
    assert k.size == 0  # |-1.0| is not > 1.0
    k, v = f.flush()
    assert k.tolist() == [3] and v.tolist() == [-1.0] and len(f.residual) == 0
    assert f.seen == 4 and f.sent == 3


def test_kkt_filter_hand_case() -> None:
    ctx = FilterContext(
        np.array([0, 1, 2, 3, 9]),
        weights=np.array([0.0, 0.0, 0.5, 0.0, 0.0]),
        grads=np.array([0.05, 0.2, 0.01, -0.079, 0.0]),
    )
    f = KKTFilter(0.1, margin=0.02, exempt=[9])
    keys = np.array([0, 1, 2, 3, 7, 9])
    vals = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], np.float32)
    k, v = f.apply(keys, vals, ctx)
    # 0: w = 0, |g| = 0.05 <= 0.08 -> skip; 1: |g| = 0.2 -> send; 2: w != 0 -> send;
    # 3: |g| = 0.079 <= 0.08 -> skip; 7: not in ctx -> send; 9: exempt -> send
    assert k.tolist() == [1, 2, 7, 9] and v.tolist() == [2.0, 3.0, 5.0, 6.0]
    assert f.skipped == 2
    hk, hv = f.held()
    assert hk.tolist() == [0, 3] and hv.tolist() == [1.0, 4.0]
    # without carry, the tally is not resent when the condition no longer holds
    ctx2 = FilterContext(np.array([0, 3]), np.array([0.0, 0.0]), np.array([0.5, 0.5]))
    k, v = f.apply([0, 3], np.array([1.0, 1.0], np.float32), ctx2)
    assert v.tolist() == [1.0, 1.0]
    assert f.held()[1].tolist() == [1.0, 4.0]
    # with carry, it is
    g = KKTFilter(0.1, margin=0.02, carry=True)
    g.apply(keys[:1], vals[:1], ctx)
    k, v = g.apply([0], np.array([1.0], np.float32), ctx2)
    assert k.tolist() == [0] and v.tolist() == [2.0] and len(g.residual) == 0
    # a margin larger than l1 skips nothing
    assert KKTFilter(0.1, margin=0.2).apply(keys, vals, ctx)[0].size == keys.size
    with pytest.raises(ValueError, match="FilterContext"):
        KKTFilter(0.1).apply(keys, vals)


def test_error_feedback_fp16_carries_rounding_error() -> None:
    f = ErrorFeedback()
    x = np.float32(1.0 + 2**-12)  # not representable in float16: rounds to 1.0
    k, v = f.apply([4], np.array([x]), quantize=_fp16)
    assert v.tolist() == [1.0] and f.held()[1].tolist() == [2**-12]
    # a different key does not pick up key 4's residual, and creates no extra entry
    k, v = f.apply([5], np.array([1.0], np.float32), quantize=_fp16)
    assert k.tolist() == [5]
    # key 4 again: 2**-12 + 2**-12 + 1 = 1 + 2**-11 -> rounds to 1.0 again (ties to even)
    k, v = f.apply([4], np.array([x]), quantize=_fp16)
    assert v.tolist() == [1.0] and f.held()[1].tolist() == [2**-11]


def test_chain_state_dict_round_trip() -> None:
    rng = np.random.default_rng(1)

    def make():
        return FilterChain([KKTFilter(0.1), SignificantlyModified(0.4)], _fp16)

    a, b = make(), make()
    ctx = FilterContext(np.arange(30), np.zeros(30), rng.uniform(-0.3, 0.3, 30))
    ups = [(np.sort(rng.choice(30, 10, replace=False)), rng.normal(0, 0.5, 10)) for _ in range(6)]
    for k, v in ups[:3]:
        a.apply(k, v, ctx)
    b.load_state_dict({k: v.copy() for k, v in a.state_dict().items()})
    for k, v in ups[3:]:
        ka, va = a.apply(k, v, ctx)
        kb, vb = b.apply(k, v, ctx)
        assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    assert np.array_equal(a.held()[1], b.held()[1])
    assert a.filters[0].skipped == b.filters[0].skipped > 0


def test_make_filter_chain_and_config_errors() -> None:
    c = make_filter_chain({"filters": ["kkt", "significant"], "l1": 0.1, "sig_threshold": 0.2})
    assert [f.name for f in c.filters] == ["kkt", "significant"]
    assert c.filters[1].threshold == 0.2 and c.filters[0].l1 == 0.1
    assert make_filter_chain({}).filters == []
    with pytest.raises(ConfigError, match="'ps.sig_threshold' = -1"):
        SignificantlyModified(-1)
    with pytest.raises(ConfigError, match="'ps.l1'"):
        KKTFilter(float("nan"))
    with pytest.raises(ConfigError, match="'ps.kkt_margin'"):
        make_filter_chain({"filters": ["kkt"], "kkt_margin": -0.5})
    with pytest.raises(ConfigError, match="'ps.filters'.*unknown filter 'topk'"):
        make_filter_chain({"filters": ["topk"]})
    with pytest.raises(ConfigError, match="'ps.filters'"):
        make_filter_chain({"filters": "kkt"})
    with pytest.raises(ConfigError, match="'ps.kkt_carry'"):
        make_filter_chain({"filters": ["kkt"], "kkt_carry": 1})
