"""Federated (per-device) evaluation (edgefl/algorithms/fedeval, docs/evaluation.md): metric
loading, the held-out split, aggregation, and whole jobs over the loopback transport."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SMALL_JOB, run_loopback_job
from torch.utils.data import TensorDataset

from edgefl.algorithms.fedeval.metrics import (
    decode,
    encode,
    evaluate_on,
    load_metrics,
    metric_means,
    weighted_means,
)
from edgefl.config import load_config
from edgefl.data.holdout import holdout_size, holdout_split
from edgefl.errors import ConfigError
from edgefl.runtime.policies import check_policies

# ---------------------------------------------------------------------- metric loading


def test_load_metrics_by_module_function():
    import fedeval_helpers

    got = load_metrics(["fedeval_helpers:top2", "fedeval_helpers:margin"])
    assert list(got) == ["top2", "margin"]
    assert got["top2"] is fedeval_helpers.top2


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("fedeval_helpers.top2", "expected 'package.module:name'"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("fedeval_helpers:nope", "has no 'nope'"),
        ("fedeval_helpers:NOT_CALLABLE", "is not callable"),
        ("fedeval_helpers:loss", "has no"),
        (3, "expected 'package.module:name'"),
    ],
)
def test_bad_metric_spec_is_a_one_line_config_error(spec, why):
    with pytest.raises(ConfigError) as e:
        load_metrics(["fedeval_helpers:top2", spec])
    msg = str(e.value)
    assert "\n" not in msg and "config key 'evaluation.metrics[1]'" in msg and why in msg


def test_metric_name_twice_or_reserved_is_refused(monkeypatch):
    import fedeval_helpers

    with pytest.raises(ConfigError, match=r"metric name 'top2' is used twice"):
        load_metrics(["fedeval_helpers:top2", "fedeval_helpers:top2"])
    monkeypatch.setattr(fedeval_helpers, "accuracy", fedeval_helpers.top2, raising=False)
    with pytest.raises(ConfigError, match=r"metric name 'accuracy' is reserved"):
        load_metrics(["fedeval_helpers:accuracy"])


def test_config_check_refuses_a_bad_metric_before_any_rank_starts():
    """The plugin's check_config runs in the pre-launch check (check_policies)."""
    cfg = load_config(overrides=[*SMALL_JOB, "evaluation.every=1",
                                 'evaluation.metrics=["fedeval_helpers:nope"]'])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_policies(cfg)
    assert "\n" not in str(e.value) and "evaluation.metrics[0]" in str(e.value)
    cfg = load_config(overrides=[*SMALL_JOB, "evaluation.every=1", "evaluation.holdout=1.0"])
    with pytest.raises(ConfigError, match=r"'evaluation.holdout' = 1.0: must be in \(0, 1\)"):
        check_policies(cfg)
    with pytest.raises(ConfigError, match="evaluation.holdout"):
        load_config(overrides=["evaluation.holdout=0.0"])


def test_cli_reports_a_bad_metric_in_one_line(edgefl_cli, tmp_path):
    proc = edgefl_cli("simulate", "--set", "evaluation.every=1", "--set",
                      'evaluation.metrics=["no_such_module_xyz:f"]', "--set",
                      f'run.out="{tmp_path / "run"}"', cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert "evaluation.metrics[0]" in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------- split, aggregation


def _data(n: int, dim: int = 3, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, dim, generator=g), torch.randint(classes, (n,), generator=g)
    )


def test_holdout_split_is_seeded_disjoint_and_covers_the_device():
    ds = _data(50)
    tr, ho = holdout_split(ds, 0.2, seed=7, device=3)
    assert len(ho) == holdout_size(50, 0.2) == 10 and len(tr) == 40
    assert sorted(tr.indices + ho.indices) == list(range(50))
    assert tr.indices == sorted(tr.indices)
    tr2, ho2 = holdout_split(ds, 0.2, seed=7, device=3)
    assert ho2.indices == ho.indices  # deterministic
    assert holdout_split(ds, 0.2, seed=7, device=4)[1].indices != ho.indices  # per device
    assert holdout_split(ds, 0.2, seed=8, device=3)[1].indices != ho.indices  # per seed
    assert [holdout_size(n, 0.2) for n in (0, 1, 2, 3, 100)] == [0, 0, 1, 1, 20]
    assert len(holdout_split(_data(1), 0.2, 0, 0)[1]) == 0


def test_the_workers_one_split_is_holdout_split():
    """A worker makes the one held-out split for every half that asked (Hermes' gate with a
    gate, federated evaluation without): holdout_split's, cached, and a single sample both
    trains and measures."""
    from types import SimpleNamespace

    from edgefl.runtime.worker import Worker

    ds, one = _data(40), _data(1)
    w = SimpleNamespace(holdout=None, splits={}, cfg={"seed": 5},
                        data=SimpleNamespace(train=lambda d: one if d == 9 else ds))  # fmt: skip
    assert Worker.split(w, 2) is None  # nobody asked
    Worker.hold_out(w, 0.3)
    Worker.hold_out(w, 0.3)  # the same fraction again is fine
    with pytest.raises(ValueError, match="two hold-out fractions"):
        Worker.hold_out(w, 0.2)
    h_tr, h_ho = Worker.split(w, 2)
    tr, ho = holdout_split(ds, 0.3, seed=5, device=2)
    assert (list(h_tr.indices), list(h_ho.indices)) == (tr.indices, ho.indices)
    assert Worker.split(w, 2)[0] is h_tr  # cached
    a, b = Worker.split(w, 9)
    assert a is b is one


def test_weighted_means_by_hand():
    res = {
        "0": {"samples": 10, "loss": 1.0, "accuracy": 0.5, "top2": 1.0},
        "1": {"samples": 30, "loss": 2.0, "accuracy": 0.1, "top2": 0.0},
        "2": {"samples": 0, "loss": math.nan, "accuracy": math.nan, "top2": math.nan},
    }
    got = weighted_means(res, ["loss", "accuracy", "top2"])
    assert got["loss"] == pytest.approx((10 * 1.0 + 30 * 2.0) / 40)
    assert got["accuracy"] == pytest.approx((10 * 0.5 + 30 * 0.1) / 40)
    assert got["top2"] == pytest.approx(0.25)
    assert weighted_means({"0": res["2"]}, ["loss"]) == {"loss": None}


def test_device_means_aggregate_exactly_to_the_pooled_mean():
    """Sample-weighted means of per-device metric means = the metric over all examples."""
    import fedeval_helpers

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    parts = [_data(n, seed=s) for s, n in ((1, 7), (2, 13), (3, 30))]
    m = {"margin": fedeval_helpers.margin}
    res = {str(i): {"samples": len(p), **metric_means(model, p, m, batch_size=4)}
           for i, p in enumerate(parts)}  # fmt: skip
    pooled = torch.cat([fedeval_helpers.margin(model(p.tensors[0]), p.tensors[1])
                        for p in parts]).mean().detach()  # fmt: skip
    assert weighted_means(res, ["margin"])["margin"] == pytest.approx(float(pooled), rel=1e-6)


def test_evaluate_on_leaves_the_random_streams_and_mode_alone():
    import fedeval_helpers

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
    model.train()
    before = torch.get_rng_state()
    r = evaluate_on(model, _data(20), "classification", {"top2": fedeval_helpers.top2})
    assert torch.equal(torch.get_rng_state(), before) and model.training
    assert r["samples"] == 20 and 0.0 <= r["accuracy"] <= r["top2"] <= 1.0
    assert math.isfinite(r["loss"])
    with pytest.raises(ValueError, match="returned 6 values for a batch of 20"):
        metric_means(model, _data(20), {"w": fedeval_helpers.whole_batch})


def test_payload_round_trip_and_refusals():
    r = {"version": 4, "device": 1, "samples": 9, "loss": 0.5, "accuracy": 0.25, "top2": 1.0}
    assert decode(encode(r), ["top2"]) == r
    with pytest.raises(ValueError, match="needs the keys"):
        decode(encode({"version": 4, "samples": 9}), [])
    with pytest.raises(ValueError, match="not a JSON"):
        decode(encode(r)[:-3], [])


# ---------------------------------------------------------------------- whole jobs


def _job(*sets: str, ranks: int = 3):
    cfg = load_config(overrides=[*SMALL_JOB, "run.rounds=4", *sets])
    check_policies(cfg)
    coord, statuses = run_loopback_job(cfg, ranks=ranks)
    assert statuses == [0] * ranks
    return coord


def test_bsp_job_rows_every_k_versions_have_device_values_and_weighted_means():
    coord = _job("evaluation.every=2", 'evaluation.metrics=["fedeval_helpers:top2"]')
    rows = coord.metrics.rows
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # version v is evaluated by tasks starting from it and lands in row v + 1 under BSP
    assert [r.get("fed_version") for r in rows] == [0, None, 2, None]
    for r in rows:
        if r.get("fed_version") is None:
            assert not any(k.startswith("fed_") for k in r)
            continue
        per = r["fed_eval"]
        assert sorted(per, key=int) == ["0", "1", "2", "3", "4"]
        for d, v in per.items():
            n = coord.devices[int(d)]["samples"]
            assert v["samples"] == holdout_size(n, 0.2) > 0
            assert coord.n_train[int(d)] == n - v["samples"]  # held out of training
        tot = sum(v["samples"] for v in per.values())
        for k in ("loss", "accuracy", "top2"):
            want = sum(v["samples"] * v[k] for v in per.values()) / tot
            assert r[f"fed_{k}"] == pytest.approx(want)
        assert 0.0 <= r["fed_accuracy"] <= r["fed_top2"] <= 1.0
    # the user metric is also computed on the central test set where the test set is used
    tested = [r for r in rows if r.get("test_accuracy") is not None]
    assert tested and all(0.0 <= r["test_top2"] <= 1.0 for r in tested)
    assert all("test_top2" not in r for r in rows if r.get("test_accuracy") is None)
    s = coord.plugins[-1].summary()["fed_eval"]
    assert s["versions_landed"] == 2 and s["last"]["version"] == 2
    assert s["last"]["fed_loss"] == rows[2]["fed_loss"]


def test_evaluation_does_not_change_training():
    """Evaluating more or less often gives the bit-identical model (only the split, the same
    for both, changes what the devices train on); with evaluation off the model differs."""
    a = _job("evaluation.every=1", 'evaluation.metrics=["fedeval_helpers:margin"]')
    b = _job("evaluation.every=3")
    off = _job()
    assert a.global_model.tobytes() == b.global_model.tobytes()
    assert a.global_model.tobytes() != off.global_model.tobytes()
    assert all("fed_eval" in r for r in a.metrics.rows)  # every=1: rows 1..4 (versions 0..3)
    assert [r.get("fed_version") for r in b.metrics.rows] == [0, None, None, 3]


def test_with_the_hermes_gate_its_held_out_split_is_evaluated():
    """gate = hermes: Hermes answers the split hook first; evaluation reuses its held-out
    split (hermes.holdout_fraction, not evaluation.holdout) and only a device's fresh
    global models are evaluated (not its own local model between pushes)."""
    coord = _job("algorithm.gate=hermes", "algorithm.consistency=asp", "sim.clock=virtual",
                 "sim.reference_s_per_sample=0.0001", "hermes.holdout_fraction=0.3",
                 "hermes.max_local_iterations=2", "evaluation.every=1", "evaluation.holdout=0.5",
                 "run.rounds=6")  # fmt: skip
    landed = [r for r in coord.metrics.rows if "fed_eval" in r]
    assert landed
    for r in landed:
        assert r["fed_version"] < r["round"]
        for d, v in r["fed_eval"].items():
            n = coord.devices[int(d)]["samples"]
            assert v["samples"] == holdout_size(n, 0.3)  # Hermes' split
            assert coord.n_train[int(d)] == n - holdout_size(n, 0.3)
    versions = [r["fed_version"] for r in landed]
    assert len(versions) == len(set(versions))  # each version lands once
    assert landed[0]["fed_version"] == 0 and len(landed[0]["fed_eval"]) == 5  # all start at 0


def test_golden_model_unchanged_with_evaluation_off():
    from golden.configs import load_models, run_loopback

    entry = load_models()["fedavg_small"]
    summary, _ = run_loopback([*entry["set"], "evaluation.every=0"])
    assert summary["model_sha256"] == entry["model_sha256"]
    assert summary["fed_eval"] is None


def test_the_final_model_is_evaluated_on_every_device():
    """evaluation.final (default): 4 rounds evaluated every 3 land version 3 only; the
    final version 4 is evaluated at the end on every device, and each device's figures are
    the final model's on its held-out split, computed here independently."""
    coord = _job("evaluation.every=3")
    half = coord.plugins[-1]
    s = half.summary()["fed_eval"]
    assert s["last"]["version"] == 3
    final = s["final"]
    assert final["version"] == 4 == coord.version and final["missing"] == []
    assert sorted(final["devices"], key=int) == ["0", "1", "2", "3", "4"]
    coord.task.flat.from_host(coord.global_model)
    kind = coord.task.data.info.task
    for d, got in final["devices"].items():
        held_out = holdout_split(coord.task.data.train(int(d)), 0.2, coord.cfg["seed"], int(d))[1]
        want = evaluate_on(coord.task.model, held_out, kind, {})
        assert got == pytest.approx(want)
    tot = sum(v["samples"] for v in final["devices"].values())
    want = sum(v["samples"] * v["accuracy"] for v in final["devices"].values()) / tot
    assert final["fed_accuracy"] == pytest.approx(want)
    assert _job("evaluation.every=3", "evaluation.final=false").plugins[-1].final_result is None
