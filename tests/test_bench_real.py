"""The ``--data digits|mnist1d`` parts of the benchmarks, without MPI: the config overrides
they pass, the verdict lines against the papers' figures, the MNIST-1D ordering task and the
centralized baseline of ``edgefl bench fedavg``."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from edgefl.bench import cdgrab, consistency, fedavg, gddr, hermes
from edgefl.bench.common import real_data_sets
from edgefl.config import dump_config, load_config
from edgefl.data import load_federated


@pytest.mark.parametrize("dataset,train", [("digits", 1438), ("mnist1d", 4000), ("mnist", 4000)])
def test_real_data_sets_select_the_partition_source(dataset: str, train: int):
    sets = real_data_sets(dataset)
    cfg = load_config(overrides=[*sets, "fleet.devices=6"])
    assert cfg["data"]["source"] == "partition"
    assert cfg["data"]["args"] == {"dataset": dataset, "scheme": "iid"}
    fd = load_federated("partition", cfg["data"]["args"], 6, 0)
    assert sum(len(fd.train(k)) for k in range(6)) == train


def test_real_data_sets_with_a_sample_count_generate_that_many_mnist1d_examples():
    sets = real_data_sets("mnist1d", samples=1000)
    cfg = load_config(overrides=[*sets, "fleet.devices=4"])
    assert cfg["data"]["args"]["dataset_args"] == {"num_samples": 1000}
    fd = load_federated("partition", cfg["data"]["args"], 4, 0)
    assert sum(len(fd.train(k)) for k in range(4)) == 800
    assert real_data_sets("digits", samples=1000) == real_data_sets("digits")  # (mnist1d only)


def test_the_hermes_bench_takes_every_real_dataset_and_a_sample_count():
    p = argparse.ArgumentParser()
    hermes.add_args(p)
    for data in ("digits", "mnist1d", "mnist"):
        assert p.parse_args(["--data", data]).data == data
        assert data in hermes.REAL
    assert p.parse_args(["--data", "mnist1d", "--samples", "60000"]).samples == 60000


def test_real_data_sets_missing_extra_is_one_line(monkeypatch):
    from edgefl.data import real

    monkeypatch.setattr(real, "_CACHE", {})
    monkeypatch.setitem(__import__("sys").modules, "sklearn.datasets", None)
    with pytest.raises(SystemExit, match=r"edgefl\[real\]") as e:
        real_data_sets("digits")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mod", [hermes, gddr, fedavg, cdgrab, consistency])
def test_each_bench_takes_data(mod):
    p = argparse.ArgumentParser()
    mod.add_args(p)
    real = "mnist1d" if mod is cdgrab else "digits"
    assert p.parse_args(["--data", real]).data == real
    with pytest.raises(SystemExit):
        p.parse_args(["--data", "cifar"])


def _row(system: str, speedup: float | None, bytes_vs_bsp: float | None) -> dict:
    return {
        "system": system,
        "speedup_vs_bsp": speedup,
        "bytes_vs_bsp": bytes_vs_bsp,
        "messages": 10,
        "cv_first": 0.5,
        "cv_last": 0.1,
        "cv_settled": 0.05,
    }


def test_hermes_verdict_against_the_paper(capsys):
    rows = [
        _row("bsp", 1.0, 1.0),
        _row("asp", 4.0, 1.0),
        _row("hermes-a-0.9", 14.0, 0.35),  # 65% fewer bytes, 14x: met
        _row("hermes-a-1.3", 14.0, 0.45),  # 55% fewer: not met
        _row("hermes-a-1.6", None, None),  # never reached the target
        _row("hermes-a-2", 14.0, 1.5),  # 50% more bytes than BSP
    ]
    hermes._verdict(rows, real=True)
    lines = [x for x in capsys.readouterr().out.splitlines() if "vs paper" in x]
    assert len(lines) == 4
    assert lines[3].endswith("NOT MET") and "50.0% more than BSP's" in lines[3]
    assert lines[0].endswith(": MET") and "65.0% fewer than BSP's" in lines[0]
    assert lines[1].endswith("NOT MET") and "55.0% fewer" in lines[1]
    assert lines[2].endswith("NOT MET") and "speedup -x" in lines[2] and "never" in lines[2]


def test_hermes_verdict_synthetic_has_no_paper_line(capsys):
    hermes._verdict([_row("asp", 4.0, 1.0), _row("hermes-a-1", 14.0, 0.35)], real=False)
    assert "vs paper" not in capsys.readouterr().out


def test_mnist1d_ordering_task_is_an_iid_split_fixed_by_the_seed():
    spec = cdgrab.TASKS["mnist1d"]
    x, y, info, n = cdgrab._task_data(spec, 16, 0, 4000)
    assert tuple(x.shape) == (4000, 40) and n == 250 and info.num_classes == 10
    assert sorted(np.unique(y.numpy()).tolist()) == list(range(10))
    x2, y2, _, _ = cdgrab._task_data(spec, 16, 0, 4000)
    assert np.array_equal(x.numpy(), x2.numpy()) and np.array_equal(y.numpy(), y2.numpy())
    x3, _, _, _ = cdgrab._task_data(spec, 16, 1, 4000)
    assert not np.array_equal(x.numpy(), x3.numpy())  # another seed, another shuffle
    # every worker's shard holds most classes (IID), not one class
    shard = y.numpy()[:n]
    assert len(np.unique(shard)) == 10


def test_fedavg_centralized_baseline_learns_digits(tmp_path):
    cfg = load_config(
        overrides=[
            *real_data_sets("digits"),
            *fedavg.RECIPES["digits"],
            "model.name=logreg",  # (the CNN of the recipe takes seconds per epoch)
            "fleet.devices=4",
            "seed=3",
        ]
    )
    (tmp_path / "config.toml").write_text(dump_config(cfg))
    acc = fedavg.centralized_accuracy(tmp_path, rounds=1, local_epochs=2)
    assert 0.8 < acc <= 1.0  # 2 epochs over the 1,438 training digits; chance is 0.1


def _ord(m: int, ordering: str, seed: int, losses: list[float]) -> dict:
    return {"task": "mnist1d", "workers": m, "ordering": ordering, "seed": seed,
            "train_loss_by_epoch": losses}  # fmt: skip


def test_cdgrab_paper_check_pairs_seeds_and_counts_epochs():
    rows = [
        _ord(4, "rr", 0, [1.0, 0.8, 0.6]),
        _ord(4, "cd-grab", 0, [1.0, 0.7, 0.59]),  # below at 2 of 3, final gap 0.01
        _ord(32, "rr", 0, [1.0, 0.9, 0.8]),
        _ord(32, "cd-grab", 0, [1.0, 0.8, 0.7]),  # final gap 0.1: grows
    ]
    (line,) = cdgrab.paper_check(rows)
    assert "m=4: below at 2/3 epochs, final gap +0.0100" in line
    assert "m=32: below at 2/3 epochs, final gap +0.1000" in line
    assert line.endswith("gap grows from m=4 to m=32")
    rows[3]["train_loss_by_epoch"] = [1.0, 0.95, 0.85]  # worse than D-RR at m=32
    (line,) = cdgrab.paper_check(rows)
    assert "below at 0/3" in line and "does NOT grow" in line


def _finished_run(out, sets, status="0"):
    from edgefl.config.sources import simulation_config

    out.mkdir()
    (out / "config.toml").write_text(dump_config(simulation_config(None, sets)[0]))
    (out / "exit_status").write_text(status + "\n")
    (out / "summary.json").write_text("{}")


def test_reuse_keeps_only_a_finished_run_of_the_same_config(tmp_path, monkeypatch, capsys):
    """``edgefl bench hermes --reuse``: a run directory is kept only when it finished (exit
    status 0, summary.json) with exactly the effective config the bench would run now;
    another config's run is refused in one line, never overwritten."""
    import subprocess

    from edgefl.bench import common

    sets = ["seed=3", "fleet.devices=4", "algorithm.consistency=asp"]
    _finished_run(tmp_path / "same", sets)
    _finished_run(tmp_path / "failed", sets, status="1")
    assert common.finished_with(tmp_path / "same", sets)
    assert not common.finished_with(tmp_path / "same", [*sets, "train.lr=0.2"])
    assert not common.finished_with(tmp_path / "failed", sets)
    assert not common.finished_with(tmp_path / "missing", sets)

    def no_run(*a, **k):
        raise AssertionError("a reused run must not be started again")

    monkeypatch.setattr(subprocess, "run", no_run)
    common.run_simulate(tmp_path / "same", sets, reuse=True)
    assert "# reused" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--reuse: .* holds another config's run"):
        common.run_simulate(tmp_path / "same", [*sets, "train.lr=0.2"], reuse=True)


def test_hermes_rows_count_api_calls_as_the_paper_does():
    """API calls = model requests (MODEL + TRAIN: two messages down) + pushes (one up), up
    to the first evaluation at the target, or over the whole run when it never gets
    there."""
    rows = [
        {"msgs_up": 3, "msgs_down": 6, "bytes_up": 30, "bytes_down": 60, "iterations": 3,
         "time_s": 1.0, "test_accuracy": 0.5},
        {"msgs_up": 2, "msgs_down": 4, "bytes_up": 20, "bytes_down": 40, "iterations": 2,
         "time_s": 2.0, "test_accuracy": 0.9},
        {"msgs_up": 9, "msgs_down": 9, "bytes_up": 1, "bytes_down": 1, "iterations": 9,
         "time_s": 3.0, "test_accuracy": 0.95},
    ]  # fmt: skip
    at = hermes.at_target({"rows": rows}, 0.9)
    assert (at["api_calls"], at["messages"], at["time_s"], at["bytes"]) == (10, 15, 2.0, 150)
    never = hermes.at_target({"rows": rows}, 0.99)
    assert never["time_s"] is None and never["api_calls"] == 14 + 19 // 2


def test_sync_vs_async_line_against_bsp(capsys):
    """``edgefl bench consistency --data mnist``: each asynchronous policy's virtual time
    to the target against BSP's, FedScale's comparison."""
    rows = [
        {"policy": "bsp", "time_to_target_s": 30.0, "final_accuracy": 0.91},
        {"policy": "fedbuff-k4", "time_to_target_s": 20.0, "final_accuracy": 0.92},
        {"policy": "fedasync", "time_to_target_s": None, "final_accuracy": 0.85},
    ]
    consistency._sync_vs_async(rows, 0.9)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert "fedbuff-k4 vs bsp" in out[0] and "1.50x BSP's speed" in out[0]
    assert "0.9200 vs 0.9100" in out[0]
    assert "fedasync vs bsp" in out[1] and "None vs 30.0" in out[1] and "(-)" in out[1]


def test_consistency_defaults_follow_the_data():
    p = argparse.ArgumentParser()
    consistency.add_args(p)
    args = p.parse_args(["--data", "mnist"])
    assert args.policies is None and args.target is None  # filled in by main from --data
    assert consistency.REAL_TARGET["mnist"] == 0.93
    assert consistency.REAL_POLICIES.split(",") == ["bsp", "fedbuff:4", "fedasync"]


def test_hermes_sweep_parses_its_axes_and_draws_the_speedups(tmp_path):
    """``edgefl bench hermes-sweep``: samples per device must be integers >= 2 (one line
    otherwise); the plot has one line per system and profile set and leaves out a run that
    never reached the target."""
    from edgefl.bench import hermes_sweep

    assert hermes_sweep._ints("150, 400") == [150, 400]
    for bad in ("", "1", "a,b"):
        with pytest.raises(SystemExit, match="--samples"):
            hermes_sweep._ints(bad)
    rows = [
        {"profiles": p, "samples": n, "system": s, "speedup": sp}
        for p in ("uniform", "hermes-12")
        for n, sp in ((150, 1.2), (3000, None))
        for s in ("bsp", "asp", "hermes")
    ]
    path = hermes_sweep.plot(rows, tmp_path / "plots")
    assert path.name == "speedup_vs_samples.png" and path.stat().st_size > 1000
