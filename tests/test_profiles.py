"""Device profiles: built-in sets, custom TOML/CSV sets, availability, failures, jitter."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefl.errors import ConfigError
from edgefl.sim.profiles import (
    BUILTIN_SETS,
    Availability,
    Failure,
    Profile,
    apportion,
    calibrate_reference,
    jitter_factor,
    load_fleet,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "datasets" / "profiles"
INF = math.inf


# -- built-in sets ------------------------------------------------------------------------
def test_apportion_hand_computed():
    # quotas 1.875 3.125 1.875 1.25 1.25 0.625 -> floors 1 3 1 1 1 0 (7); the 3 left go to
    # the largest remainders 14/16, 14/16 (tie: earlier first) and 10/16
    assert apportion([3, 5, 3, 2, 2, 1], 10) == [2, 3, 2, 1, 1, 1]
    assert apportion([3, 5, 3, 2, 2, 1], 16) == [3, 5, 3, 2, 2, 1]
    assert apportion([1, 1, 1], 2) == [1, 1, 0]
    assert apportion([1], 5) == [5]


@pytest.mark.parametrize("name", list(BUILTIN_SETS))
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 12, 16, 17, 31, 100, 1000])
def test_builtins_load_with_proportions(name, n):
    fleet = load_fleet(name, n, seed=3)
    assert len(fleet) == n and all(isinstance(p, Profile) for p in fleet)
    entries = BUILTIN_SETS[name]
    total = sum(w for _, w in entries)
    got = Counter(p.name for p in fleet)
    assert sum(got.values()) == n
    for p, w in entries:
        assert abs(got[p.name] - n * w / total) < 1  # largest remainder: within one of quota


def test_edge_mix_types_and_spread():
    fleet = load_fleet("edge-mix", 16, seed=0)
    counts = Counter(p.name for p in fleet)
    assert counts == {
        "microcontroller": 3,
        "phone": 5,
        "sbc": 3,
        "embedded-gpu": 2,
        "laptop": 2,
        "edge-server": 1,
    }
    speeds = [p.speed for p in fleet]
    assert max(speeds) / min(speeds) >= 10
    assert {p.kind for p in fleet} == {"cpu", "gpu"}


def test_hermes_12_and_uniform():
    fleet = load_fleet("hermes-12", 12, seed=0)
    assert sorted(Counter(p.name for p in fleet).values()) == [3, 3, 3, 3]
    assert all(p.name == "reference" and p.speed == 1.0 for p in load_fleet("uniform", 9, 0))


def test_builtin_assignment_is_seeded():
    a = [p.name for p in load_fleet("edge-mix", 16, seed=7)]
    assert a == [p.name for p in load_fleet("edge-mix", 16, seed=7)]
    others = [[p.name for p in load_fleet("edge-mix", 16, seed=s)] for s in range(8, 12)]
    assert any(o != a for o in others)  # the seed shuffles which device gets which type
    assert all(Counter(o) == Counter(a) for o in others)  # but never the mix


# -- profile arithmetic -------------------------------------------------------------------
def test_profile_times_hand_computed():
    p = Profile("x", speed=4.0, up_bps=1000.0, down_bps=4000.0, latency_s=0.5)
    assert p.compute_s(100, reference_s_per_sample=0.02) == pytest.approx(0.5)
    assert p.compute_s(100, 0.02, factor=1.5) == pytest.approx(0.75)
    assert p.up_s(2000) == pytest.approx(2.5)
    assert p.down_s(2000) == pytest.approx(1.0)
    q = Profile("y", speed=4.0, s_per_sample=0.003)  # absolute cost wins over speed
    assert q.compute_s(10, 0.02) == pytest.approx(0.03)
    assert Profile("z", mem_cap=64).batch_cap(100) == 64
    assert Profile("z").batch_cap(100) == 100
    with pytest.raises(ValueError, match="calibrate"):
        p.compute_s(10, 0.0)
    json.dumps(p.as_dict())


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"up_bps": 0.0}, "up_bps"),
        ({"down_bps": -1.0}, "down_bps"),
        ({"speed": 0.0}, "speed"),
        ({"latency_s": -0.1}, "latency_s"),
        ({"jitter": -1.0}, "jitter"),
        ({"mem_cap": 1.5}, "mem_cap"),
        ({"kind": "tpu"}, "kind"),
    ],
)
def test_profile_rejects_bad_fields(kw, field):
    with pytest.raises(ConfigError, match=f"sim.profiles.*'{field}'"):
        Profile("x", **kw)


# -- availability -------------------------------------------------------------------------
def test_trace_queries_hand_written():
    a = Availability("trace", ((0, 10), (20, 30), (30, 40)))  # the last two touch: merged
    assert a.intervals == ((0.0, 10.0), (20.0, 40.0))
    assert a.is_online(0, 0, 0) and a.is_online(9.99, 0, 0) and not a.is_online(10, 0, 0)
    assert a.online_until(5, 0, 0) == 10
    assert a.online_until(25, 0, 0) == 40  # across the merged boundary at 30
    assert a.online_until(15, 0, 0) == 15  # offline: no online time left
    assert a.next_online(15, 0, 0) == 20
    assert a.next_online(5, 0, 0) == 5
    assert a.next_online(40, 0, 0) == INF and not a.is_online(1e9, 0, 0)  # offline forever

    p = Availability("trace", ((0, 2), (8, 10)), period_s=10)
    assert p.is_online(10, 0, 0) and p.is_online(29, 0, 0) and not p.is_online(25, 0, 0)
    assert p.online_until(9, 0, 0) == 12  # [8, 10) runs into the next period's [0, 2)
    assert p.online_until(1, 0, 0) == 2
    assert p.online_until(21, 0, 0) == 22
    assert p.next_online(5, 0, 0) == 8
    assert p.next_online(15, 0, 0) == 18
    q = Availability("trace", ((3, 7),), period_s=10)
    assert q.next_online(8, 0, 0) == 13 and q.online_until(24, 0, 0) == 27
    full = Availability("trace", ((0, 5),), period_s=5)
    assert full.online_until(12.5, 0, 0) == INF and full.online_fraction() == 1.0
    always = Availability()
    assert always.is_online(1e9, 0, 0) and always.online_until(3, 0, 0) == INF
    assert always.next_online(3, 0, 0) == 3


def _naive(intervals, period, t):
    """(online, online_until, next_online) by scanning the trace unrolled over 4 periods."""
    reps = range(int(t // period) - 1, int(t // period) + 3) if period else [0]
    spans = sorted(
        (k * (period or 0) + s, k * (period or 0) + e) for k in reps for s, e in intervals
    )
    merged = []
    for s, e in spans:
        if merged and merged[-1][1] >= s:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    for s, e in merged:
        if s <= t < e:
            return True, e, t
    nxt = [s for s, _ in merged if s > t]
    return False, t, (min(nxt) if nxt else INF)


@st.composite
def _traces(draw):
    cuts = sorted(set(draw(st.lists(st.integers(0, 40), min_size=2, max_size=10))))
    if len(cuts) % 2:
        cuts = cuts[:-1]
    if len(cuts) < 2:
        cuts = [0, 1]
    ivs = [(float(cuts[i]), float(cuts[i + 1])) for i in range(0, len(cuts), 2)]
    period = draw(st.sampled_from([0.0, ivs[-1][1], ivs[-1][1] + 3.0]))
    t = draw(st.floats(0, 120, allow_nan=False)) if period else draw(st.floats(0, 60))
    return ivs, period, t


@settings(max_examples=150, deadline=None)
@given(_traces())
def test_trace_matches_naive_scan(case):
    ivs, period, t = case
    a = Availability("trace", tuple(ivs), period_s=period)
    online, until, nxt = _naive(ivs, period, t)
    assert a.is_online(t, 0, 0) == online
    assert a.next_online(t, 0, 0) == pytest.approx(nxt)
    if not (period and len(a.intervals) == 1 and a.intervals[0] == (0.0, period)):
        assert a.online_until(t, 0, 0) == pytest.approx(until)


def _random_answers(a, times, seed, device):
    return [
        (
            a.is_online(t, seed, device),
            a.online_until(t, seed, device),
            a.next_online(t, seed, device),
        )
        for t in times
    ]


def test_random_availability_independent_of_query_order():
    times = list(np.linspace(0, 20000, 401))
    spec = dict(mode="random", mean_on_s=120.0, mean_off_s=60.0)
    fwd = _random_answers(Availability(**spec), times, 5, 3)
    b = Availability(**spec)
    b.is_online(19000.0, 5, 9)  # other devices and a far query first
    b.next_online(25000.0, 5, 3)
    back = _random_answers(b, times[::-1], 5, 3)[::-1]
    assert fwd == back
    assert fwd != _random_answers(Availability(**spec), times, 5, 4)  # per device
    assert fwd != _random_answers(Availability(**spec), times, 6, 3)  # per seed


def test_random_availability_invariants_and_fraction():
    a = Availability("random", mean_on_s=100.0, mean_off_s=50.0)
    rng = np.random.default_rng(0)
    for t in rng.uniform(0, 1e4, 300):
        on, until, nxt = a.is_online(t, 1, 2), a.online_until(t, 1, 2), a.next_online(t, 1, 2)
        if on:
            assert nxt == t and until > t and a.is_online(until - 1e-6, 1, 2)
            assert not a.is_online(until, 1, 2)
        else:
            assert until == t and nxt > t and a.is_online(nxt, 1, 2)
            assert not a.is_online((t + nxt) / 2, 1, 2)
    frac = np.mean([a.is_online(t, 1, d) for d in range(20) for t in np.arange(0, 2e4, 10.0)])
    assert frac == pytest.approx(a.online_fraction(), abs=0.05)  # 2/3


# -- failures and jitter ------------------------------------------------------------------
def test_failures():
    assert Failure().crash_time(0, 0) == INF
    assert Failure("crash", at_s=7.5).crash_time(3, 9) == 7.5
    f = Failure("mtbf", mtbf_s=1000.0)
    fwd = [f.crash_time(4, d) for d in range(2000)]
    g = Failure("mtbf", mtbf_s=1000.0)
    back = [g.crash_time(4, d) for d in reversed(range(2000))][::-1]
    assert fwd == back and len(set(fwd)) == 2000
    assert np.mean(fwd) == pytest.approx(1000.0, rel=0.1)
    assert fwd != [f.crash_time(5, d) for d in range(2000)]


def test_jitter():
    p = Profile("x", jitter=0.3)
    assert jitter_factor(Profile("y"), 1, 2, 3) == 1.0
    fwd = [jitter_factor(p, 1, 2, k) for k in range(20000)]
    back = [jitter_factor(p, 1, 2, k) for k in reversed(range(20000))][::-1]
    assert fwd == back
    x = np.array(fwd)
    assert x.min() > 0 and x.mean() == pytest.approx(1.0, abs=0.02)  # mean-one lognormal
    assert np.log(x).std() == pytest.approx(0.3, abs=0.01)
    assert fwd[:100] != [jitter_factor(p, 1, 3, k) for k in range(100)]
    assert fwd[:100] != [jitter_factor(p, 2, 2, k) for k in range(100)]


# -- custom sets --------------------------------------------------------------------------
def test_example_toml():
    fleet = load_fleet("datasets/profiles/example-fleet.toml", 7, seed=0, base_dir=ROOT)
    assert [p.name for p in fleet] == ["phone"] * 4 + ["raspberry-pi-4"] * 2 + ["edge-server"]
    phone, pi, server = fleet[0], fleet[4], fleet[6]
    assert phone.up_bps == 1.25e6 and phone.down_bps == 6.25e6 and phone.mem_cap == 256
    assert phone.availability.mode == "random" and phone.failure.mode == "mtbf"
    assert pi.s_per_sample == pytest.approx(0.004)
    assert pi.availability.online_until(3600 * 30, 0, 4) == 86400 + 28800
    assert not pi.availability.is_online(30000, 0, 4)
    assert server.kind == "gpu" and server.failure.crash_time(0, 6) == 7200
    big = load_fleet(str(EXAMPLES / "example-fleet.toml"), 14, seed=0)
    assert Counter(p.name for p in big) == {"phone": 8, "raspberry-pi-4": 4, "edge-server": 2}


def test_example_csv():
    fleet = load_fleet(str(EXAMPLES / "example-trace.csv"), 14, seed=0)
    names = ["phone-low", "phone-mid", "phone-high", "sbc", "laptop", "jetson"]
    assert [p.name for p in fleet] == (names * 3)[:14]  # rows cycled
    low, laptop = fleet[0], fleet[4]
    assert low.s_per_sample == pytest.approx(0.025)
    assert low.up_bps == 2000 * 125 and low.down_bps == 8000 * 125 and low.mem_cap == 64
    assert laptop.mem_cap == 0 and fleet[5].kind == "gpu"


def test_fedscale_columns(tmp_path):
    f = tmp_path / "fs.csv"
    f.write_text("client_id,computation,communication\n7,10,1000\n")
    (p,) = load_fleet(str(f), 1, 0)
    assert p.s_per_sample == pytest.approx(0.03)  # 3 x inference ms per sample
    assert p.up_bps == p.down_bps == 128000.0  # FedScale kbit = 1024 bits
    assert p.latency_s == 0.0 and p.name == "trace-1"


def test_csv_row_availability_and_failure(tmp_path):
    f = tmp_path / "av.csv"
    f.write_text("speed,up_bps,down_bps,mean_on_s,mean_off_s,mtbf_s\n1,5,5,10,5,100\n2,5,5,,,\n")
    a, b = load_fleet(str(f), 2, 0)
    assert a.availability.mode == "random" and a.failure.mode == "mtbf"
    assert b.availability.mode == "always" and b.failure.mode == "none"


CSV_BAD = [
    ("speed,up_bps\n1,5\n", ["header (line 1)", "missing column", "'down_kbps'"]),
    ("speed,up_kbps,down_kbps\n1,5,5\n1,-5,5\n", ["row 2 (line 3)", "'up_kbps' = -5", "> 0"]),
    ("speed,up_bps,down_bps\n1,5,0\n", ["row 1 (line 2)", "'down_bps' = 0", "> 0"]),
    ("speed,up_bps,down_bps\nfast,5,5\n", ["row 1 (line 2)", "'speed' = 'fast'", "a number"]),
    ("speed,up_bps,down_bps\n1,5\n", ["row 1 (line 2)", "2 values", "3 columns"]),
    ("speed,up_bps,down_bps\n1,,5\n", ["row 1 (line 2)", "'up_bps' is empty"]),
    ("speed,up_kpbs,down_bps\n1,5,5\n", ["header", "unknown column 'up_kpbs'", "'up_kbps'"]),
    ('speed,up_bps,down_bps\n1,"5,5\n', ["line 2", "does not parse"]),
    ("speed,up_bps,down_bps\n1,5,5,\n", ["row 1 (line 2)", "4 values"]),
    ("speed,up_bps,down_bps\n", ["no device rows"]),
    ("", ["empty file"]),
    ("speed,up_bps,down_bps,mem_cap\n1,5,5,2.5\n", ["row 1", "'mem_cap' = '2.5'", "integer"]),
    ("speed,up_bps,down_bps,kind\n1,5,5,tpu\n", ["row 1", "'kind' = 'tpu'", "cpu or gpu"]),
    ("speed,up_bps,down_bps\n1,5,nan\n", ["row 1", "'down_bps' = 'nan'", "finite"]),
    ("speed,s_per_sample,up_bps,down_bps\n1,0.1,5,5\n", ["row 1", "one of speed, s_per_"]),
    ("speed,speed,up_bps,down_bps\n1,1,5,5\n", ["header", "'speed' appears twice"]),
]


@pytest.mark.parametrize("text,parts", CSV_BAD)
def test_csv_errors_name_file_row_field(tmp_path, text, parts):
    f = tmp_path / "trace.csv"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_fleet(str(f), 3, 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config key 'sim.profiles'")
    assert str(f) in msg or "trace.csv" in msg
    for part in parts:
        assert part in msg, msg


def test_csv_not_utf8(tmp_path):
    f = tmp_path / "bin.csv"
    f.write_bytes(b"\xff\xfe\x00speed\x80\n")
    with pytest.raises(ConfigError, match=r"bin\.csv.*not UTF-8"):
        load_fleet(str(f), 1, 0)


_OK = 'name = "a"\nup_bps = 5.0\n'
TOML_BAD = [
    ("[[device]\nname = 1", ["invalid TOML"]),
    ("[[device]]\nsped = 1.0\n", ["entry 1", "unknown key 'sped'", "did you mean 'speed'"]),
    ('[[device]]\nspeed = "fast"\n', ["entry 1", "'speed' = 'fast'", "a number"]),
    (f"[[device]]\n{_OK}[[device]]\ndown_bps = -3.0\n", ["entry 2", "'down_bps' = -3.0", "> 0"]),
    ("[[device]]\nmem_cap = 2.5\n", ["entry 1", "'mem_cap'", "integer"]),
    ("[[device]]\ncount = 0\n", ["entry 1", "'count' = 0", ">= 1"]),
    ("[[device]]\nname = 3\n", ["entry 1", "'name' = 3", "a string"]),
    ("[[device]]\nspeed = 1.0\ns_per_sample = 0.1\n", ["entry 1", "one of speed, s_per_sample"]),
    ("devices = 3\n", ["unknown top-level key 'devices'", "did you mean 'device'"]),
    ("shuffle = true\n", ["at least one [[device]]"]),
    ("shuffle = 1\n[[device]]\n", ["'shuffle' = 1", "true or false"]),
    (
        '[[device]]\n[device.availability]\nmode = "sometimes"\n',
        ["entry 1", "'availability.mode' = 'sometimes'", "always, trace, random"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "trace"\nintervals = [[0, 5], [3, 8]]\n',
        ["entry 1", "'availability.intervals' item 2", "overlap"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "trace"\nintervals = [[5, 1]]\n',
        ["entry 1", "'availability.intervals' item 1", "start < end"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "trace"\nintervals = [[0, 8]]\nperiod_s = 5\n',
        ["entry 1", "'availability.period_s' = 5", "after the period"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "random"\nmean_on_s = 10\n',
        ["entry 1", "'availability.mean_off_s' is missing"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "random"\nmean_on_s = 10\nmean_off_s = -1\n',
        ["entry 1", "'availability.mean_off_s' = -1", "> 0"],
    ),
    (
        '[[device]]\n[device.availability]\nmode = "trace"\nintervals = [[0, 1]]\nmean_on_s = 3\n',
        ["entry 1", "'availability.mean_on_s' is not used by mode 'trace'"],
    ),
    (
        '[[device]]\n[device.failure]\nmode = "mtbf"\nmtbf_s = -4\n',
        ["entry 1", "'failure.mtbf_s' = -4", "> 0"],
    ),
    (
        '[[device]]\n[device.failure]\nmode = "crash"\n',
        ["entry 1", "'failure.at_s' is missing"],
    ),
    ("[[device]]\nfailure = 3\n", ["entry 1", "'failure' = 3", "a table"]),
]


@pytest.mark.parametrize("text,parts", TOML_BAD)
def test_toml_errors_name_file_entry_field(tmp_path, text, parts):
    f = tmp_path / "fleet.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_fleet(str(f), 4, 0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config key 'sim.profiles'")
    assert "fleet.toml" in msg
    for part in parts:
        assert part in msg, msg


def test_spec_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown device set; did you mean 'edge-mix'"):
        load_fleet("edge_mix", 4, 0)
    with pytest.raises(ConfigError, match=r"'hermes12'.*did you mean 'hermes-12'"):
        load_fleet("hermes12", 4, 0)
    with pytest.raises(ConfigError, match=r"'zzz': unknown device set \(built-in: uniform"):
        load_fleet("zzz", 4, 0)
    with pytest.raises(ConfigError, match=r"'nope\.csv': file '.*nope\.csv' not found"):
        load_fleet("nope.csv", 4, 0, base_dir=tmp_path)
    with pytest.raises(ConfigError, match="fleet.devices"):
        load_fleet("uniform", 0, 0)
    with pytest.raises(ConfigError, match="sim.profiles"):
        load_fleet("", 3, 0)


# -- calibration --------------------------------------------------------------------------
def test_calibrate_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    before = [p.detach().clone() for p in model.parameters()]
    X, Y = torch.randn(100, 20), torch.randint(0, 4, (100,))
    s = calibrate_reference(model, (X, Y), batch_size=32, steps=5)
    assert 0 < s < 0.1 and math.isfinite(s)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # untouched
    with pytest.raises(ValueError):
        calibrate_reference(model, (X, Y), batch_size=0, steps=5)
