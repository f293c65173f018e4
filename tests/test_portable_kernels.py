"""Portable kernels (``run.kernels``, edgefl/kernels.py): the same config trains the same
model whatever CPU kernels the machine would pick by itself.

An AVX2-only machine is stood in for by ``ATEN_CPU_CAPABILITY=avx2``; on a machine with
AVX-512 the unpinned environment is the AVX-512 one. In portable mode both give the hashes
recorded in tests/golden/models.json. On an AVX-512 machine native mode is shown to give
another model (so the golden set would notice kernel drift at all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_edgefl, run_launch
from golden.configs import load_models, simulate_argv

from edgefl import kernels

HERE = Path(__file__).resolve().parent
MODELS = load_models()
# every variable edgefl.kernels pins, and the mode it leaves for the ranks
PINNED = (*kernels.PORTABLE_ENV_X86, kernels.KERNELS_ENV)


def _has(flag: str) -> bool:
    try:
        return any(
            line.startswith("flags") and f" {flag}" in line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


AVX512 = _has("avx512f")
X86 = bool(kernels.portable_env())


def machine_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell would have it: none of the portable
    settings (this test session pinned them in os.environ), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED}
    env.update(extra)
    return env


def edgefl_in(env: dict[str, str], *args: str, cwd) -> subprocess.CompletedProcess:
    """``python -m edgefl ARGS`` in exactly ``env`` (run_edgefl adds this test process's
    environment, pinned portable, to what it is given)."""
    return run_launch([sys.executable, "-m", "edgefl", *args], timeout=300, cwd=cwd, env=env)


def in_env(mode: str, env: dict[str, str], *names: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "golden" / "in_env.py"), *mode.split(), *names],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mismatches(got: dict) -> dict:
    return {
        n: (sha[:12], MODELS[n]["model_sha256"][:12])
        for n, sha in got["models"].items()
        if sha != MODELS[n]["model_sha256"]
    }


# the configs native kernels change (the sequential path's and the stacked path's)
BIG = ("default_job", "cnn_digits", "mlp_digits", "default_job_vectorized",
       "mlp_digits_vectorized")  # fmt: skip
STACKED = ("default_job_vectorized", "mlp_digits_vectorized")
# numpy's OpenBLAS is pinned too (the stacked path's products) where the CPU has AVX2 + FMA
OPENBLAS = "OPENBLAS_CORETYPE" in kernels.portable_env()


@pytest.mark.skipif(not X86, reason="portable mode pins x86-64 kernels only")
@pytest.mark.parametrize(
    "capability, names",
    [("avx512", BIG), ("avx2", ())],
    ids=["machine-default-avx512", "avx2-machine"],
)
def test_the_golden_set_is_the_same_under_either_capability(capability, names):
    """The loopback golden configs, in a fresh process whose environment asks torch for
    ``capability`` (on an AVX2-only CPU a request for AVX-512 falls back to AVX2) and MKL
    for its own path: portable mode overrides both, and the recorded models come out. The
    AVX2 machine (a newcomer's) runs every config; the AVX-512 request runs the configs
    whose models native kernels change (the test below), since the whole set also runs in
    this pytest process, pinned the same way (tests/test_golden_models.py)."""
    env = machine_env(ATEN_CPU_CAPABILITY=capability, MKL_CBWR="AUTO")
    if capability == "avx512":  # (and OpenBLAS's AVX-512 kernels, where there are any)
        env["OPENBLAS_CORETYPE"] = "SkylakeX" if AVX512 else "Haswell"
    got = in_env("portable", env, *names)
    fp = got["fingerprint"]
    assert (fp["cpu_capability"], fp["mkl_path"]) == ("AVX2", "COMPATIBLE"), fp
    assert fp["blas"].endswith(" Haswell") or not OPENBLAS, fp
    assert sorted(got["models"]) == sorted(names) if names else len(got["models"]) >= 40
    assert mismatches(got) == {}


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 to differ from AVX2")
def test_native_kernels_of_an_avx512_machine_train_another_model():
    """The check above can fail: with native kernels this AVX-512 machine trains other
    models for the configs big enough to use vectorised kernels."""
    got = in_env("native", machine_env(), *BIG)
    assert got["fingerprint"]["cpu_capability"].startswith("AVX512"), got["fingerprint"]
    assert set(mismatches(got)) == set(BIG)


@pytest.mark.skipif(not (AVX512 and OPENBLAS), reason="needs OpenBLAS kernels other than AVX2")
def test_the_stacked_path_needs_numpys_openblas_pinned_too():
    """The stacked configs' products run in numpy's OpenBLAS: a process that loaded numpy
    before pinning (its OpenBLAS on this machine's AVX-512 kernels, torch and MKL pinned)
    trains other stacked models, and the pin says so in one line; the sequential path's
    model is the recorded one there."""
    env = machine_env(OPENBLAS_CORETYPE="SkylakeX")
    got = in_env("--numpy-first portable", env, *STACKED, "mlp_digits")
    assert got["fingerprint"]["blas"].endswith(" SkylakeX"), got["fingerprint"]
    assert "numpy's OpenBLAS already runs its SkylakeX kernels" in got["not_in_effect"]
    assert set(mismatches(got)) == set(STACKED)


@pytest.mark.mpi
@pytest.mark.skipif(not X86, reason="portable mode pins x86-64 kernels only")
@pytest.mark.parametrize("name", ["default_job", "cnn_digits"])
def test_edgefl_simulate_pins_every_rank(name, launcher, tmp_path):
    """The real CLI over mpiexec, from a shell that asks for AVX-512 kernels: the launcher
    pins portable kernels for every rank, and summary.json says so."""
    entry = MODELS[name]
    out = tmp_path / "run"
    env = machine_env(ATEN_CPU_CAPABILITY="avx512")
    proc = run_edgefl(*simulate_argv(entry["set"], out), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_sha256"] == entry["model_sha256"]
    assert summary["numerics"]["cpu_capability"] == "AVX2"
    assert summary["numerics"]["kernels"] == "portable"
    assert summary["numerics_differ"] == {}


@pytest.mark.skipif(not OPENBLAS, reason="numpy's OpenBLAS is pinned on AVX2 + FMA CPUs only")
def test_edgefl_simulate_in_process_pins_numpys_openblas_before_the_config_loads(tmp_path):
    """The real CLI with the in-process backend: loading the config imports numpy, so the
    CLI pins the configured kernels first; the stacked job trains the recorded model (on
    an AVX-512 machine OpenBLAS would otherwise pick its AVX-512 kernels: the test above),
    with no warning."""
    entry = MODELS["default_job_vectorized"]
    out = tmp_path / "run"
    env = machine_env(OPENBLAS_CORETYPE="SkylakeX" if AVX512 else "Haswell")
    argv = [*simulate_argv(entry["set"], out), "--backend", "inline"]
    proc = edgefl_in(env, *argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["numerics"]["blas"].endswith(" Haswell"), summary["numerics"]
    assert summary["model_sha256"] == entry["model_sha256"]


def test_the_configured_mode_is_read_before_the_config_loads(tmp_path):
    """kernels.configured_mode: --set wins over the given table, which wins over the file
    (or recipe); anything it cannot read is portable (loading the config reports it)."""
    native = tmp_path / "native.toml"
    native.write_text('[run]\nkernels = "native"\n')
    assert kernels.configured_mode() == "portable"
    assert kernels.configured_mode(str(native)) == "native"
    assert kernels.configured_mode(str(native), None) == "native"  # (edgefl run, no --set)
    assert kernels.configured_mode(str(native), ['run.kernels="portable"']) == "portable"
    assert kernels.configured_mode(None, ["run.kernels = 'native'"]) == "native"
    assert kernels.configured_mode(None, [], {"run": {"kernels": "native"}}) == "native"
    assert kernels.configured_mode("recipe:digits-cnn-iid") == "portable"
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    for path, sets in ((bad, []), (tmp_path / "missing.toml", []), (None, ["run.kernels=x"])):
        assert kernels.configured_mode(str(path) if path else None, sets) == "portable"


@pytest.mark.skipif(not X86, reason="portable mode pins x86-64 kernels only")
def test_pin_takes_back_what_the_early_pin_set_for_another_mode(monkeypatch):
    """The configured mode is guessed before the config loads (a resume's comes from its
    checkpoint later): pinning the mode it turns out to be leaves no variable of the guess
    behind, and keeps what the user had set."""
    for name in PINNED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_CBWR", "AUTO")  # (the user's own)
    monkeypatch.setattr(kernels, "_EARLY", {})
    kernels.pin_configured()  # (no config, no --set: portable)
    assert os.environ["MKL_CBWR"] == "COMPATIBLE" and os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    kernels.pin("native")
    assert os.environ["MKL_CBWR"] == "AUTO" and "ATEN_CPU_CAPABILITY" not in os.environ
    assert os.environ[kernels.KERNELS_ENV] == "native" and kernels._EARLY == {}


def test_an_old_fingerprint_without_a_field_is_compared_on_the_others():
    """Checkpoints written before the fingerprint recorded numpy's BLAS resume without a
    warning about it, and still name a field both have that differs."""
    new = {k: "x" for k in kernels.COMPARED}
    old = {k: v for k, v in new.items() if k != "blas"}
    assert kernels.differences(old, new) == []
    assert kernels.differences(old, dict(new, probe="y")) == ["probe x -> y"]


@pytest.mark.mpi
@pytest.mark.skipif(not AVX512, reason="needs a CPU whose native kernels differ from AVX2")
def test_native_kernels_over_mpiexec_are_the_machines_own(launcher, tmp_path):
    """``run.kernels = "native"`` through the real CLI and mpiexec: every rank computes
    with this machine's own kernels (its ranks pin the configured mode before the config
    loads: a mode read wrongly there would leave them on portable kernels)."""
    out = tmp_path / "run"
    entry = MODELS["default_job"]
    argv = simulate_argv([*entry["set"], "run.kernels=native"], out)
    proc = edgefl_in(machine_env(), *argv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    fp = summary["numerics"]
    assert fp["kernels"] == "native" and fp["cpu_capability"].startswith("AVX512"), fp
    assert fp["mkl_path"].startswith("auto:") and summary["numerics_differ"] == {}
    assert summary["model_sha256"] != entry["model_sha256"]


def test_pin_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="expected one of portable, native"):
        kernels.pin("fast")


def test_the_fingerprint_names_what_differs():
    a = {k: "x" for k in kernels.COMPARED}
    b = dict(a, cpu_capability="AVX512", probe="y")
    assert kernels.differences(a, b) == ["cpu_capability x -> AVX512", "probe x -> y"]
    assert kernels.differences(a, dict(a)) == []
    assert kernels.differences(None, b) == []
    line = kernels.mismatch_line("the checkpoint was written", a, b)
    assert "cpu_capability x -> AVX512" in line and "not promised" in line


def test_a_process_that_ran_torch_first_is_told(tmp_path):
    """In-process runs cannot re-pin kernels torch already chose: a one-line warning."""
    code = (
        "import torch; torch.log_softmax(torch.randn(4, 10), 1); "
        "from edgefl import kernels; print(kernels.pin('portable'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=machine_env(), timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    if AVX512:
        assert "torch already runs AVX512 kernels" in proc.stdout
    else:
        assert proc.stdout.strip() == "None"


def test_registration_names_a_rank_with_other_numerics(caplog):
    """Rank 0 compares every REGISTER's fingerprint with its own: a differing rank is one
    warning line and a ``numerics_differ`` entry of summary.json; a re-host onto it too."""
    from types import SimpleNamespace

    from edgefl.runtime.registration import check_numerics, rehost_numerics

    mine = {k: "same" for k in kernels.COMPARED}
    other = dict(mine, cpu_capability="AVX512")
    core = SimpleNamespace(
        numerics=mine,
        numerics_differ={},
        rank_info={1: {"host": "a", "numerics": mine}, 2: {"host": "b", "numerics": other}},
    )
    with caplog.at_level("WARNING", logger="edgefl.coordinator"):
        check_numerics(core)
        rehost_numerics(core, 7, 1, 2)
        rehost_numerics(core, 8, 2, 2)
    assert core.numerics_differ == {"2": ["cpu_capability same -> AVX512"]}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("rank 2 (b) computes with other numerics than rank 0")
    assert lines[1].startswith("device 7 moved from rank 1 to rank 2, which computes")


def test_a_checkpoint_records_its_numerics_and_inspect_shows_them(tmp_path):
    """The checkpoint and summary.json of a run carry rank 0's fingerprint; ``edgefl
    inspect`` prints it and, on the machine that wrote it, warns of nothing."""
    from golden.configs import run_loopback_dir

    from edgefl.ckpt import load_checkpoint

    sets = [*MODELS["fedavg_small"]["set"], "run.checkpoint_every=2"]
    summary = run_loopback_dir(sets, tmp_path / "run")
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.h5"))[-1]
    saved = json.loads(load_checkpoint(ckpt)["numerics"])
    assert saved == summary["numerics"]
    assert saved["kernels"] == "portable" and saved["threads"] == 1
    proc = run_edgefl("inspect", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "  numerics: kernels portable, torch " in proc.stdout
    assert "warning" not in proc.stderr, proc.stderr


def test_a_resume_under_other_numerics_warns_and_goes_on(tmp_path, caplog):
    """A checkpoint written by a machine that computes differently (its fingerprint edited
    here to another CPU capability) resumes, with one warning line naming the difference."""
    from golden.configs import run_loopback_dir

    from edgefl.ckpt import load_checkpoint, save_checkpoint

    sets = [*MODELS["fedavg_small"]["set"], "run.checkpoint_every=2"]
    run_loopback_dir(sets, tmp_path / "run")
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "ckpt-000002.h5")
    other = dict(json.loads(state["numerics"]), cpu_capability="AVX512", probe="0" * 16)
    state["numerics"] = json.dumps(other)
    elsewhere = tmp_path / "elsewhere.h5"
    save_checkpoint(elsewhere, state)
    with caplog.at_level("WARNING", logger="edgefl.coordinator"):
        summary = run_loopback_dir(sets, tmp_path / "resumed", resume=elsewhere)
    lines = [r.getMessage() for r in caplog.records if "other numerics" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "cpu_capability AVX512 -> AVX2" in lines[0] and "the run goes on" in lines[0]
    assert summary["model_sha256"] == MODELS["fedavg_small"]["model_sha256"]


@pytest.mark.mpi
@pytest.mark.skipif(not X86, reason="portable mode pins x86-64 kernels only")
def test_a_hand_started_mpirun_edgefl_run_pins_every_rank(launcher, tmp_path):
    """``mpiexec -n 3 edgefl run job.toml`` as on a cluster, without edgefl simulate (so no
    launcher sets the environment), from a shell that asks for AVX-512: each rank pins the
    portable kernels itself after reading the config, and the golden model comes out."""
    from conftest import run_launch
    from golden.configs import effective_config

    from edgefl.config import dump_config

    entry = MODELS["default_job"]
    cfg, _ = effective_config(entry["set"])
    conf = tmp_path / "job.toml"
    conf.write_text(dump_config(cfg))
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "edgefl", "run", str(conf), "--out", str(out)]
    proc = run_launch(launcher.command(3, argv), cwd=tmp_path, timeout=300,
                      env=machine_env(ATEN_CPU_CAPABILITY="avx512"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["numerics"]["cpu_capability"] == "AVX2"
    assert summary["numerics_differ"] == {}
    assert summary["model_sha256"] == entry["model_sha256"]


def test_the_kernels_bench_jobs_are_valid_configs():
    """``edgefl bench kernels`` runs three jobs: each is a valid config, the 10k one with
    the requested fleet, all in both modes."""
    import argparse

    from edgefl.bench import kernels as bench
    from edgefl.config import load_config

    args = argparse.Namespace(seed=3, devices=123)
    for job in bench.JOBS:
        for mode in kernels.MODES:
            cfg = load_config(
                None, [*bench.FIXED, *bench.job_sets(job, args), f"run.kernels={mode}"]
            )
            assert cfg["seed"] == 3 and cfg["run"]["kernels"] == mode
    big = load_config(None, [*bench.FIXED, *bench.job_sets("10k", args)])
    assert big["fleet"]["devices"] == 123 and big["model"]["name"] == "logreg"
    cnn = load_config(None, [*bench.FIXED, *bench.job_sets("cnn", args)])
    assert cnn["model"]["name"] == "cnn" and cnn["data"]["source"] == "partition"
    with pytest.raises(SystemExit, match="unknown job 'gpu'"):
        bench.job_sets("gpu", args)


# one local Adam/AdamW run as edgefl's trainer builds it, its parameters' SHA-256 printed
_ADAM = """
import hashlib, sys, torch
from edgefl.training.optim import optimizer_factory
h = hashlib.sha256()
for name in ("adam", "adamw"):
    make = optimizer_factory({"optimizer": name, "weight_decay": 0.01, "beta1": 0.9,
                              "beta2": 0.999, "momentum": 0.0})
    g = torch.Generator().manual_seed(0)
    for n in (4, 80, 1000, 10007):  # sizes with and without a vector tail
        p = torch.randn(n, generator=g).requires_grad_()
        opt = make([p], 0.01)
        for _ in range(5):
            p.grad = torch.randn(n, generator=g)
            opt.step()
        h.update(p.detach().numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.skipif(not X86, reason="MKL's code paths are x86-64 ones")
def test_the_adam_step_does_not_depend_on_mkls_code_path():
    """torch's default Adam step takes ``sqrt`` from MKL's vector math, whose rounding
    follows MKL's code path (chosen by CPU vendor and model: the adam_cosine golden model
    recorded on an AMD EPYC under MKL_CBWR=COMPATIBLE was not the one an Intel Xeon trains
    under the same setting). edgefl's Adam/AdamW (edgefl/training/optim.py) use torch's
    fused kernel instead: every MKL path and torch capability gives the same parameters.
    The control shows the check can fail: torch's default step differs between paths."""
    paths = ("COMPATIBLE", "AUTO")
    caps = ("avx2", "avx512") if AVX512 else ("avx2",)

    def run(code: str, path: str, cap: str) -> str:
        env = machine_env(MKL_CBWR=path, ATEN_CPU_CAPABILITY=cap)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.split()[-1]

    got = {(p, c): run(_ADAM, p, c) for p in paths for c in caps}
    assert len(set(got.values())) == 1, got
    default = _ADAM.replace("opt = make([p], 0.01)", "opt = torch.optim.Adam([p], lr=0.01)")
    assert len({run(default, p, "avx2") for p in paths}) > 1
