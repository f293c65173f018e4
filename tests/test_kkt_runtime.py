"""The KKT filter in the runtime (one process, ``--backend inline``): devices test their
update against the gradient of their local loss at the global model (``server.l1``, the prox
threshold), hold back what the prox would zero, and flush it at the end: uplink bytes fall,
accuracy stays, no mass is lost."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_edgefl

from edgefl.algorithms.ps.filters import mass_checksum
from edgefl.algorithms.ps.workset import device_working_set, loss_gradient
from edgefl.config import load_config
from edgefl.errors import ConfigError
from edgefl.runtime.policies import check_policies

# a sparse L1 workload where accuracy moves (base_logit 0: about half positives)
CLICKS = [
    "--set", "data.source=clicks", "--set", "model.name=logreg", "--rounds", "10",
    "--set", "data.args={features=2000, samples_per_device=400, nnz_per_example=10, "
    "base_logit=0.0}",
    "--set", "train.lr=0.5", "--set", "server.l1=0.01", "--set", "output.progress=quiet",
    "--set", "ps.sparse=true", "--set", "ps.key_cache=true",
]  # fmt: skip


def _run(out, *extra):
    proc = run_edgefl("simulate", "--out", str(out), "--backend", "inline", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _up(s: dict) -> int:
    return sum(d["bytes_up"] for d in s["devices"].values())


def test_kkt_filter_cuts_uplink_keeps_accuracy_loses_nothing(tmp_path):
    plain = _run(tmp_path / "plain", *CLICKS)
    kkt = _run(tmp_path / "kkt", *CLICKS, "--set", 'ps.filters=["kkt"]')
    ps = kkt["ps"]
    # the filter skipped a good share of the entries it saw, so fewer bytes went up
    assert ps["kkt_seen"] > 0 and ps["kkt_skipped"] > 0.2 * ps["kkt_seen"]
    assert _up(kkt) < 0.8 * _up(plain)
    assert abs(kkt["final_accuracy"] - plain["final_accuracy"]) <= 0.01
    # everything each device produced reached rank 0 (its weighted checksum), the held-back
    # part in the final flush; dropping the flush would miss by its size
    assert ps["flushed_abs"] > 1.0
    assert set(ps["mass"]) == {str(d) for d in range(8)}
    for m in ps["mass"].values():
        assert abs(m["produced"] - m["received"]) <= 1e-6 * m["received_abs"]
    assert plain["ps"]["kkt_seen"] == 0 and plain["ps"]["flushed_abs"] == 0.0
    assert kkt["rejected"] == 0 and kkt["sparse_resends"] == 0


def _cfg(*sets: str) -> dict:
    return load_config(overrides=["data.source='clicks'", "model.name='logreg'", *sets])


@pytest.mark.parametrize(
    "sets, keys",
    [
        (["ps.sparse=true", 'ps.filters=["kkt"]'], ("'ps.filters'", "server.l1")),
        (['ps.filters=["significant"]'], ("'ps.filters'", "ps.sparse")),
        (["ps.pull='working-set'", "train.weight_decay=0.01"], ("'ps.pull'", "weight_decay")),
        (["ps.debug_bad_working_set='unsorted'"], ("'ps.debug_bad_working_set'", "ps.pull")),
        (
            ["ps.sparse=true", "algorithm.residual='gddr'"],
            ("'ps.sparse'", "algorithm.residual"),
        ),
    ],
)
def test_bad_combinations_are_one_line_config_errors(sets, keys):
    with pytest.raises(ConfigError) as e:
        check_policies(_cfg(*sets))
    msg = str(e.value)
    assert "\n" not in msg
    assert all(k in msg for k in keys), msg


def test_good_combinations_pass():
    check_policies(_cfg("ps.sparse=true", 'ps.filters=["kkt", "significant"]', "server.l1=0.01"))
    check_policies(_cfg("ps.pull='working-set'", "ps.debug_bad_working_set='duplicate'"))
    check_policies(_cfg("ps.sparse=true", "algorithm.gate='hermes'"))  # (allowed since)
    # another model: its working set is every key, so working-set pulls are full pulls
    check_policies(load_config(overrides=["ps.pull='working-set'"]))


def test_loss_gradient_is_the_hand_computed_logistic_gradient():
    cfg = _cfg("data.args={features=50, samples_per_device=30, nnz_per_example=4}")
    from edgefl.runtime.state import build_task

    task = build_task(cfg)
    ds = task.data.train(0)
    model = task.model
    before = task.flat.snapshot()
    g = loss_gradient(model, ds, "classification", batch_size=7)  # 5 uneven batches
    # softmax regression by hand: d/dW mean CE = (P - Y)^T X / n, d/db = mean(P - Y)
    x = ds.csr.toarray().astype(np.float64)
    y = np.eye(2)[ds.labels]
    w = model.linear.weight.detach().numpy().astype(np.float64)
    b = model.linear.bias.detach().numpy().astype(np.float64)
    z = x @ w.T + b
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = np.concatenate([((p - y).T @ x / len(y)).reshape(-1), (p - y).mean(axis=0)])
    assert g.dtype == np.float32 and g.shape == (task.flat.numel,)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    # it moved nothing: same parameters, no gradients left, train mode kept
    assert np.array_equal(task.flat.snapshot(), before)
    assert all(p.grad is None for p in model.parameters()) and model.training
    # zero outside the device's working set: those features never occur in its data
    ws = device_working_set(_layout(task), ds)
    outside = np.setdiff1d(np.arange(g.size), ws)
    assert outside.size > 0 and not g[outside].any() and g[ws[:-2]].any()


def _layout(task):
    from edgefl.policies.keyrange import ParamLayout

    return ParamLayout.from_flat(task.flat)


def test_working_set_of_dense_examples():
    """Generic (x, y) data: the weight columns of features nonzero in some example + bias."""
    from edgefl.policies.keyrange import ParamLayout

    layout = ParamLayout.from_shapes(["linear.weight", "linear.bias"], [(3, 4), (3,)])
    x = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]])
    ds = torch.utils.data.TensorDataset(x, torch.tensor([0, 1]))
    # features 1 and 3: keys o*4 + j for outputs o = 0..2, then the bias keys 12..14
    assert device_working_set(layout, ds).tolist() == [1, 3, 5, 7, 9, 11, 12, 13, 14]


def test_mass_checksum_is_additive_and_does_not_cancel():
    keys = np.array([0, 1, 5])
    a, b = np.array([1.0, -1.0, 0.5]), np.array([-0.25, 1.0, 0.0])
    whole = mass_checksum(keys, a + b)
    assert whole == pytest.approx(mass_checksum(keys, a) + mass_checksum(keys, b), abs=1e-15)
    # r_0 = 1, r_1 = 1 + 0.618..., r_5 = 1 + frac(5 * 0.618...) = 1.0901699...
    assert mass_checksum(keys, a) == pytest.approx(1.0 - 1.6180339887 + 0.5 * 1.0901699437)
    # a 2-class softmax update sums to 0 but its checksum does not
    assert mass_checksum([3, 4], [0.2, -0.2]) != 0.0


def test_kkt_that_skips_nothing_changes_nothing():
    """In-process job (loopback transport): with ps.kkt_margin > server.l1 the filter can
    skip nothing, so the extra gradient pass must leave training bit-identical."""
    import hashlib

    from conftest import run_loopback_job

    sets = [
        "fleet.devices=4", "run.rounds=3", "ps.sparse=true", "ps.key_cache=true",
        "server.l1=0.01", "output.progress='quiet'",
        "data.args={features=300, samples_per_device=60, nnz_per_example=5}",
    ]  # fmt: skip
    plain, _ = run_loopback_job(_cfg(*sets), ranks=3)
    kkt, status = run_loopback_job(_cfg(*sets, 'ps.filters=["kkt"]', "ps.kkt_margin=0.02"), ranks=3)
    assert status == [0, 0, 0]
    h = [hashlib.sha256(c.global_model.tobytes()).hexdigest() for c in (plain, kkt)]
    assert h[0] == h[1]
    ps = kkt.plugin("ps").summary()["ps"]
    assert ps["kkt_seen"] > 0 and ps["kkt_skipped"] == 0


def test_sparse_pushes_under_the_hermes_gate():
    """ps.sparse with algorithm.gate = "hermes" (no longer refused): a gated device's push
    goes through its filter chain like any other. Lossless (float32, no filter) it ends with
    the model of dense gated pushes, bit for bit; with the significance filter every device's
    mass arrives (produced = received, to float rounding)."""
    import hashlib

    from conftest import SMALL_JOB, run_loopback_job

    from edgefl.runtime.policies import check_policies

    sets = [*SMALL_JOB, "fleet.devices=4", 'sim.clock="virtual"',
            "sim.reference_s_per_sample=0.0001", 'algorithm.gate="hermes"']  # fmt: skip
    check_policies(load_config(overrides=[*sets, "ps.sparse=true"]))
    runs = [
        run_loopback_job(load_config(overrides=s), ranks=3)
        for s in (sets, [*sets, "ps.sparse=true"])
    ]
    assert [st for _, st in runs] == [[0, 0, 0]] * 2
    h = [hashlib.sha256(c.global_model.tobytes()).hexdigest() for c, _ in runs]
    assert h[0] == h[1]
    filt = [*sets, "ps.sparse=true", 'ps.filters=["significant"]', "ps.sig_threshold=0.01"]
    coord, st = run_loopback_job(load_config(overrides=filt), ranks=3)
    assert st == [0, 0, 0]
    mass = coord.plugin("ps").summary()["ps"]["mass"]
    assert len(mass) == 4
    for m in mass.values():
        assert m["received"] == pytest.approx(m["produced"], rel=1e-8, abs=1e-9)
