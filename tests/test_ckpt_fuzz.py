"""Damaged checkpoints never crash the reader (issue 15, item 4).

A real run's checkpoint (a 2-round job, in-process) is damaged over 1,300 ways: single-bit
flips spread over the whole file (dense in the HDF5 superblock and metadata at its start,
every bit of the commit trailer), truncations to many lengths and appended bytes. Every case
runs ``edgefl inspect`` (``edgefl.cli.main``) in ONE child process, so a signal death (the
SIGSEGV h5py can give on damaged metadata) kills the child and fails the test; ten cases go
through the real ``edgefl`` console command, each in its own process (and one whose
output pipe is closed, ``| head``: status 141, no traceback). Every damaged file
must end as status 2 with exactly one ``edgefl: error: checkpoint '<file>': ...`` line on
stderr, and h5py must never have been asked to open it (the commit trailer's SHA-256 refuses
it first). A file whose damage is sealed again (a valid trailer over deleted entries) is
caught by the resume schema, one line naming the entry; ``latest_checkpoint`` skips a damaged
newest file, and ``simulate --resume`` refuses a bad file or falls back in a directory.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from subprocess import PIPE

import pytest
from test_ckpt import edit_h5

import edgefl
from edgefl.ckpt import checkpoint_name, latest_checkpoint
from edgefl.cli import main

# a 2-round job of 2 devices on 1 worker rank, an 8-unit MLP (about 43 KiB of checkpoint)
TINY = {
    "fleet.devices": 2,
    "fleet.ranks": 2,
    "fleet.device": "cpu",
    "run.rounds": 2,
    "data.args.dim": 10,
    "data.args.classes": 4,
    "model.args.hidden": [8],
    "sim.reference_s_per_sample": 0.0001,
    "output.progress": "quiet",
}
TRAILER = 64  # bytes of the commit trailer (docs/architecture.md, Checkpoints)

# The child: applies each case to the pristine bytes, runs `edgefl inspect` on the result
# with fd 2 redirected to a file (so C-level output is caught too), counts h5py.File calls,
# and writes one JSON line per case. An exception escaping main() is recorded as a traceback;
# a case still running after 10 s ends the child with SIGALRM (a hang fails like a crash).
# main() runs as is; only the argument parser it builds (20 ms, the same every time) is made
# once, which keeps 1,300 cases at a few seconds.
DRIVER = textwrap.dedent(
    """
    import contextlib, functools, io, json, os, signal, sys, tempfile, traceback
    import h5py
    import edgefl.cli
    from edgefl.cli import main

    edgefl.cli.build_parser = functools.cache(edgefl.cli.build_parser)

    pristine = open(sys.argv[1], "rb").read()
    cases = json.load(open(sys.argv[2]))
    target, out = sys.argv[3], open(sys.argv[4], "w")
    opened = [0]
    real_file = h5py.File

    def counting_file(*a, **k):
        opened[0] += 1
        return real_file(*a, **k)

    h5py.File = counting_file
    err = tempfile.TemporaryFile()
    for i, case in enumerate(cases):
        op, arg = case
        data = bytearray(pristine)
        if op == "flip":
            data[arg // 8] ^= 1 << (arg % 8)
        elif op == "cut":
            del data[arg:]
        elif op == "append":
            data += bytes.fromhex(arg)
        with open(target, "wb") as fh:
            fh.write(data)
        err.seek(0)
        err.truncate()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        opened[0], stdout, exc = 0, io.StringIO(), None
        signal.alarm(10)
        try:
            with contextlib.redirect_stdout(stdout):
                rc = main(["inspect", target])
        except BaseException:
            rc, exc = None, traceback.format_exc()
        signal.alarm(0)
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        err.seek(0)
        row = {"i": i, "rc": rc, "exc": exc, "stderr": err.read().decode("utf-8", "replace"),
               "stdout": stdout.getvalue()[:200], "h5py_opened": opened[0]}
        out.write(json.dumps(row) + "\\n")
        out.flush()
    """
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A real run's checkpoint: a 2-round job run in this process."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    edgefl.simulate(overrides=TINY, out=out, backend="inline")
    path = out / "checkpoints" / checkpoint_name(2)
    assert path.is_file()
    return path


def damage_cases(size: int) -> list[tuple[str, int | str]]:
    """Over 1,300 cases for a file of ``size`` bytes; bit offsets count from the start."""
    rng = random.Random(15)
    payload = size - TRAILER
    bits = set(rng.sample(range(min(2048, payload) * 8), 300))  # superblock, root metadata
    bits |= set(rng.sample(range(payload * 8), 400))  # anywhere in the HDF5 file
    bits |= set(range(payload * 8, size * 8))  # every bit of the trailer (512)
    cuts = {0, 1, 7, 8, 9, 63, 64, 65, 512, payload - 1, payload, payload + 1}
    cuts |= {size - 8, size - 9, size - 1}
    cuts |= set(rng.sample(range(1, size), 150))
    appended = ["00", "00" * TRAILER, "ff" * 4096]
    cases: list[tuple[str, int | str]] = [("flip", b) for b in sorted(bits)]
    cases += [("cut", c) for c in sorted(cuts) if c < size]
    cases += [("append", a) for a in appended]
    return cases


def assert_one_line_error(rc, stdout: str, stderr: str, target: Path, case) -> str:
    assert rc == 2, (case, rc, stderr)
    assert "Traceback" not in stderr + stdout, (case, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, (case, stderr)
    assert lines[0].startswith(f"edgefl: error: checkpoint '{target}': "), (case, lines[0])
    assert stdout == "", (case, stdout)  # nothing described from a bad file
    return lines[0]


def test_damaged_files_give_one_line_and_never_reach_h5py(pristine, tmp_path):
    raw = pristine.read_bytes()
    cases = [("none", 0), *damage_cases(len(raw))]
    assert len(cases) > 1300
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    target, results = tmp_path / checkpoint_name(2), tmp_path / "results.jsonl"
    shutil.copy(pristine, tmp_path / "pristine.h5")
    child = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "pristine.h5"),
         str(tmp_path / "cases.json"), str(target), str(results)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert child.returncode == 0, (
        f"the child died (status {child.returncode}) at case {len(rows)}: "
        f"{cases[len(rows)] if len(rows) < len(cases) else '?'}\n{child.stderr[-2000:]}"
    )
    assert len(rows) == len(cases)
    first = rows[0]  # the undamaged file: described, status 0
    assert first["rc"] == 0 and first["stderr"] == "" and first["h5py_opened"] == 1, first
    assert first["stdout"].startswith(f"checkpoint {target}\n"), first
    reasons: dict[str, int] = {}
    payload_bits = (len(raw) - TRAILER) * 8
    for case, row in zip(cases[1:], rows[1:]):
        assert row["exc"] is None, (case, row["exc"])
        line = assert_one_line_error(row["rc"], row["stdout"], row["stderr"], target, case)
        assert row["h5py_opened"] == 0, (case, line)  # refused before HDF5 parsed a byte
        why = next((name for name, pattern in REASONS if re.search(pattern, line)), None)
        assert why is not None, (case, line)
        if case[0] == "flip" and case[1] < payload_bits:
            assert why == "sha256", (case, line)  # any changed HDF5 byte fails the digest
        reasons[why] = reasons.get(why, 0) + 1
    assert set(reasons) == {name for name, _ in REASONS}, reasons  # each one reached


# what a damaged file is refused for, by the commit trailer (edgefl/ckpt/seal.py)
REASONS = [
    ("sha256", r"': corrupt \(SHA-256 of its \d+ bytes does not match the digest"),
    ("trailer-damaged", r"': corrupt \(its commit trailer is damaged\)$"),
    ("no-trailer", r"': truncated or corrupt, or not written by this edgefl \(no commit trailer"),
    ("length", r"': truncated or corrupt \(the trailer records \d+ bytes before it"),
    ("version", r"': commit trailer version \d+ is not supported"),
    ("empty", r"': empty file \(0 bytes\)$"),
    ("not-hdf5", r"': not an HDF5 file"),
]


# cases through the real console command, one process each: (name, damage)
CLI_CASES = [
    ("intact", ("none", 0)),
    ("superblock-flip", ("flip", 8 * 20 + 3)),  # the superblock's size / version fields
    ("root-metadata-flip", ("flip", 8 * 700 + 5)),
    ("late-flip", ("flip", -8 * 2000)),  # in the data and metadata near the end
    ("digest-flip", ("flip", -8 * 30)),
    ("length-flip", ("flip", -8 * 48 + 2)),
    ("cut-half", ("cut", 0.5)),
    ("cut-trailer", ("cut", -1)),
    ("cut-signature", ("cut", 4)),
    ("trailer-twice", ("append", "trailer")),
]


def _damaged(raw: bytes, damage) -> bytes:
    op, arg = damage
    data = bytearray(raw)
    if op == "flip":
        bit = arg % (len(raw) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
    elif op == "cut":
        data = data[: int(len(raw) * arg) if isinstance(arg, float) else arg]
    elif op == "append":
        data += raw[-TRAILER:]
    return bytes(data)


def test_console_command_on_damaged_files(pristine, tmp_path):
    exe = shutil.which("edgefl", path=str(Path(sys.executable).parent)) or shutil.which("edgefl")
    assert exe, "the edgefl console script is not installed"
    raw = pristine.read_bytes()
    procs = []
    for name, damage in CLI_CASES:  # all started at once, then collected
        p = tmp_path / f"{name}.h5"
        p.write_bytes(_damaged(raw, damage))
        cmd = [exe, "inspect", str(p)]
        procs.append((name, p, subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True)))
    # `edgefl inspect ... | head`: the reader is gone before anything is written
    gone = subprocess.Popen([exe, "inspect", str(pristine)], stdout=PIPE, stderr=PIPE)
    gone.stdout.close()
    for name, p, proc in procs:
        out, err = proc.communicate(timeout=120)
        if name == "intact":
            assert proc.returncode == 0 and err == "", err
            assert "sha256 and crc32 verified" in out
            assert "a run's checkpoint: every entry a resume reads" in out
        else:
            assert_one_line_error(proc.returncode, out, err, p, name)
    err = gone.communicate(timeout=120)[1].decode()
    assert gone.returncode == 141 and err == "", (gone.returncode, err)  # as SIGPIPE, silent


@pytest.mark.parametrize("entry", ["config_toml", "round", "model", "model/flat", "clock"])
def test_deleted_entry_is_one_line_naming_it(pristine, tmp_path, capsys, entry):
    p = tmp_path / checkpoint_name(2)
    shutil.copy(pristine, p)
    edit_h5(p, lambda f: f.__delitem__(entry))  # a valid trailer over the deletion
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr()
    assert err.out == ""
    assert (
        err.err
        == f"edgefl: error: checkpoint '{p}': entry '/{entry}' is missing (a resume reads it)\n"
    )
    # --resume stops at once with the same line (nothing launched, no run directory)
    assert main(["simulate", "--resume", str(p), "--out", str(tmp_path / "cont")]) == 2
    assert capsys.readouterr().err == err.err
    assert not (tmp_path / "cont").exists()


def test_latest_checkpoint_skips_a_damaged_newest_file(pristine, tmp_path, caplog, capsys):
    ck = tmp_path / "run" / "checkpoints"
    ck.mkdir(parents=True)
    raw = pristine.read_bytes()
    good, flipped, cut, schema = (ck / checkpoint_name(r) for r in (2, 3, 4, 5))
    good.write_bytes(raw)
    flipped.write_bytes(_damaged(raw, ("flip", 8 * 300)))
    cut.write_bytes(raw[: len(raw) // 3])
    shutil.copy(pristine, schema)
    edit_h5(schema, lambda f: f.__delitem__("metrics_jsonl"))
    with caplog.at_level(logging.WARNING, logger="edgefl.ckpt"):
        assert latest_checkpoint(ck) == good
    text = caplog.text
    assert f"'{flipped}': corrupt (SHA-256" in text
    assert f"'{cut}': truncated or corrupt" in text
    assert f"'{schema}': entry '/metrics_jsonl' is missing" in text
    # a resume given the run directory falls back to the newest good file
    caplog.clear()
    argv = ["simulate", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "cont")]
    assert main([*argv, "--dry-run"]) == 0
    assert f"--resume {good}" in capsys.readouterr().out
    assert not (tmp_path / "cont").exists()
    # naming the damaged file itself: one line, status 2
    assert main(["simulate", "--resume", str(flipped), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"edgefl: error: checkpoint '{flipped}': corrupt (SHA-256")
    assert err.count("\n") == 1
