"""Train golden configs in a fresh process whose environment the caller chose, and print
their final-model hashes as JSON (tests/test_portable_kernels.py).

    python tests/golden/in_env.py [--numpy-first] MODE [NAME ...]

MODE is the ``run.kernels`` the configs run with (``portable`` or ``native``), pinned the
way every edgefl entry point pins it (:func:`edgefl.kernels.pin`, before torch and numpy
load); no NAME: every config that runs over the loopback transport. ``--numpy-first``
imports numpy before the pin (as a notebook that imported it before edgefl: its OpenBLAS
keeps the kernels it picked). Prints one JSON object: ``{"fingerprint": {...}, "models":
{name: model_sha256}, "not_in_effect": the pin's line or null}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--numpy-first"]:
        import numpy  # noqa: F401

        argv = argv[1:]
    mode, names = argv[0], argv[1:]
    from edgefl import kernels

    why = kernels.pin(mode)  # (as edgefl simulate, edgefl run and the in-process backend do)
    from golden.configs import job, load_models, run_loopback

    models = load_models()
    names = names or sorted(n for n, e in models.items() if e.get("backend") != "mpi")
    out = {}
    for name in names:
        with contextlib.redirect_stdout(io.StringIO()):  # (the coordinator's summary table)
            summary, _ = run_loopback(job(models[name]["set"], f"run.kernels={mode}"))
        out[name] = summary["model_sha256"]
    print(json.dumps({"fingerprint": kernels.fingerprint(mode), "models": out,
                      "not_in_effect": why}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
