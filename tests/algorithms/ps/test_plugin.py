"""The ps Plugin class (edgefl.algorithms.ps.plugin): when it is on, its halves, what it
requires of the other keys and its own config check."""

from __future__ import annotations

import pytest

from edgefl.algorithms.ps.coordinator import PSCoordinator
from edgefl.algorithms.ps.filters import KKTFilter, SignificantlyModified
from edgefl.algorithms.ps.kinds import MODEL_KEYS, RESEND, SPARSE, WORKSET
from edgefl.algorithms.ps.plugin import ParameterServer, check_ps, make_ps_filter_chain
from edgefl.algorithms.ps.worker import PSWorker
from edgefl.errors import ConfigError

from ..fakes import config


def test_the_plugin_wires_the_ps_halves():
    assert ParameterServer.name == "ps"
    assert ParameterServer.coordinator is PSCoordinator
    assert ParameterServer.worker is PSWorker
    assert ParameterServer.summary_keys == {"ps": None, "sparse_resends": 0}


def test_the_halves_handle_the_ps_kinds_which_are_distinct():
    kinds = [SPARSE, RESEND, MODEL_KEYS, WORKSET]
    assert len({int(k) for k in kinds}) == 4
    assert PSCoordinator.update_kinds == (SPARSE,)
    assert set(PSWorker.message_kinds) >= {MODEL_KEYS, RESEND}
    # rank 0 gets WORKSET through poll() during registration, not as a handled kind
    assert WORKSET not in PSCoordinator.message_kinds


@pytest.mark.parametrize(
    "sets,on",
    [
        ((), False),
        (("ps.sparse=true",), True),
        (("ps.pull=working-set",), True),
        (("ps.key_cache=true", "ps.value_dtype=float16"), False),
    ],
)
def test_enabled_by_sparse_pushes_or_a_non_full_pull(sets, on):
    assert ParameterServer.enabled(config(None, *sets)) is on


@pytest.mark.parametrize(
    "sets,keys",
    [
        (('ps.filters=["significant"]',), ("ps.filters", "ps.sparse")),
        (("ps.sparse=true", 'ps.filters=["kkt"]'), ("ps.filters", "server.l1")),
        (("ps.sparse=true", "algorithm.residual=gddr"), ("ps.sparse", "algorithm.residual")),
        (
            ("ps.pull=working-set", "train.weight_decay=0.01"),
            ("ps.pull", "train.weight_decay"),
        ),
        (("ps.debug_bad_working_set=unsorted",), ("ps.debug_bad_working_set", "ps.pull")),
        (
            ("ps.debug_bad_working_set=duplicate", "ps.pull=working-set"),
            ("ps.debug_bad_working_set", "model.name"),
        ),
    ],
)
def test_check_ps_refuses_a_broken_requirement_naming_both_keys(sets, keys):
    cfg = config(None, *sets)
    with pytest.raises(ConfigError) as e:
        ParameterServer.check_config(cfg)
    msg = str(e.value)
    assert f"config key '{keys[0]}'" in msg and f"needs {keys[1]}" in msg and "because" in msg


def test_a_filter_without_sparse_is_refused_even_though_the_plugin_is_off():
    cfg = config(None, 'ps.filters=["significant"]')
    assert not ParameterServer.enabled(cfg)
    with pytest.raises(ConfigError, match="ps.filters"):
        check_ps(cfg)


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("ps.sparse=true", 'ps.filters=["significant", "kkt"]', "server.l1=0.1"),
        ("ps.pull=working-set", "model.name=logreg", "ps.debug_bad_working_set=out-of-range"),
    ],
)
def test_good_configs_pass(sets):
    check_ps(config(None, *sets))


def test_the_requirements_are_declared_as_data():
    whens = [r.when for r in ParameterServer.requires]
    assert whens.count("ps.filters") == 2 and "ps.pull" in whens
    assert all(r.because for r in ParameterServer.requires)


def test_the_filter_chain_takes_server_l1_as_the_kkt_threshold():
    cfg = config(
        None,
        "ps.sparse=true",
        'ps.filters=["significant", "kkt"]',
        "ps.sig_threshold=0.3",
        "ps.kkt_margin=0.01",
        "ps.kkt_carry=true",
        "server.l1=0.2",
    )
    chain = make_ps_filter_chain(cfg)
    sig, kkt = chain.filters
    assert isinstance(sig, SignificantlyModified) and sig.threshold == 0.3
    assert isinstance(kkt, KKTFilter)
    assert (kkt.l1, kkt.margin, kkt.carry) == (0.2, 0.01, True)


def test_check_ps_builds_the_filter_chain_of_sparse_pushes():
    # (a value the schema would refuse, edited in afterwards: only the chain catches it)
    cfg = config(None, "ps.sparse=true")
    cfg["ps"]["filters"] = ["topk"]
    with pytest.raises(ConfigError, match="unknown filter 'topk'"):
        check_ps(cfg)
    cfg["ps"]["sparse"] = False
    cfg["ps"]["filters"] = []
    check_ps(cfg)  # no sparse pushes: no chain is built
