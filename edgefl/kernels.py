"""CPU numerics: the kernels mode of a run (``run.kernels``) and the fingerprint of the
numerics a process computes with (docs/reproducibility.md).

Why: torch, its BLAS (MKL) and oneDNN pick their CPU kernels when they first run, by the
instruction sets of the CPU. An AVX-512 kernel and an AVX2 kernel of the same operation add
in a different order, so the same config trains a model that differs in its last bits from
one CPU to another, and training amplifies those bits. Measured on this project's machines
(torch 2.13.0): a matrix product and ``exp`` change with MKL's code path, ``log_softmax``
with torch's CPU capability; every golden model changed between an Intel AVX-512 machine
and the one the hashes were first recorded on.

``portable`` (the default) pins, before torch loads, every choice that measurably changes
the arithmetic to what any x86-64 CPU with AVX2 has (Intel since 2013, AMD since 2015):

- ``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorised kernels;
- ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility, the one code path
  it documents as giving the same results on Intel and non-Intel CPUs alike. (``AVX2``, the
  path first chosen here, is an Intel-only branch: on an AMD EPYC, torch 2.13.0's MKL
  2024.2 ignores it and keeps its own ``AUTO`` path, so every golden model differed there.
  ``COMPATIBLE`` costs matrix products 2-3x, measured: 512x512 sgemm 14.7 ms against 5.3
  ms on one core; the small models of a federated job spend little time there.)
- ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN (convolutions) never uses AVX-512 or AMX.

MKL's vector math (torch's ``sqrt``, ``exp``, ``log``, ``tanh``, ``erf`` ... of float
tensors) follows MKL's code path, which CBWR does not make vendor-independent: ``vsSqrt``
rounds differently on an AMD EPYC and an Intel Xeon under ``COMPATIBLE``. edgefl's own
training avoids it where it mattered (Adam/AdamW use torch's fused kernel,
edgefl/training/optim.py); docs/reproducibility.md lists the functions.

Thread counts are part of the arithmetic too (parallel reductions split by thread): every
rank runs ``fleet.threads`` intra-op threads (default 1). numpy's own SIMD and OpenBLAS
dispatch were measured not to change any golden model and are left alone.

``native`` leaves the environment as it is: the fastest kernels of each CPU.

On aarch64 portable mode sets nothing (torch uses other kernels and BLAS there); the same
model holds between machines of one core type, not between core types nor against x86.

Nothing here imports torch at module level: :func:`pin` must run before torch loads.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from typing import Any

MODES = ("portable", "native")
# set in every rank's environment by the launcher: the mode already pinned there
KERNELS_ENV = "EDGEFL_KERNELS"
_X86 = ("x86_64", "amd64", "i686", "i386")
PORTABLE_ENV_X86 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
# MKL's code paths (mkl_cbwr.h): what mkl_cbwr_get / mkl_cbwr_get_auto_branch return
_MKL_BRANCHES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    11: "AVX512_MIC",
    12: "AVX512",
    13: "AVX512_MIC_E1",
    14: "AVX512_E1",
}
# what must agree between two fingerprints for the same arithmetic
COMPARED = ("torch", "cpu_capability", "mkl_path", "onednn_max_isa", "threads", "probe")


def portable_env(machine: str | None = None) -> dict[str, str]:
    """The environment portable mode sets on this (or ``machine``'s) architecture."""
    m = (machine or platform.machine()).lower()
    return dict(PORTABLE_ENV_X86) if m in _X86 else {}


def rank_env(mode: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` (a launched rank's environment) with ``mode``'s settings applied."""
    out = dict(env)
    if mode == "portable":
        out.update(portable_env())
    out[KERNELS_ENV] = mode
    return out


def pin(mode: str) -> str | None:
    """Apply ``mode`` to this process (``os.environ``), before torch runs its first kernel.

    Returns None when the kernels in effect are ``mode``'s, else one line saying why not
    (torch already ran kernels in this process before ``pin``: they stay as chosen then).
    """
    if mode not in MODES:
        raise ValueError(f"kernels mode {mode!r}: expected one of {', '.join(MODES)}")
    os.environ.update(rank_env(mode, {}))
    return not_in_effect(mode)


def not_in_effect(mode: str) -> str | None:
    """None if this process computes with ``mode``'s kernels (or torch is not loaded yet,
    so it will), else one line naming what differs."""
    if mode != "portable" or "torch" not in sys.modules or not portable_env():
        return None
    found = _capability()
    want = portable_env()["ATEN_CPU_CAPABILITY"].upper()
    mkl = _mkl_path()
    if (found not in (want, None) or mkl not in (None, portable_env()["MKL_CBWR"])) and _has_avx2():
        return (
            f"portable kernels asked for, but torch already runs {found} kernels "
            f"(MKL path {mkl}) in this "
            "process (it chose them before edgefl could pin them: import and run edgefl "
            f"before any torch computation, or set ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE "
            "before Python starts); this run's model may differ from other machines'"
        )
    if not _has_avx2():
        return (
            "portable kernels need a CPU with AVX2 and this one has none: torch runs its "
            "generic kernels, whose rounding differs from an AVX2 machine's"
        )
    return None


def _capability() -> str | None:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an old torch: unknown
        return None


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return " avx2" in line
    except OSError:
        pass
    return True  # (no /proc: assume a current CPU)


def _mkl_path() -> str | None:
    """The MKL code path in effect (``AVX2``, ``AVX512_E1``, ...; ``+STRICT`` when strict),
    or None where torch has no MKL or does not export its CNR functions."""
    try:
        import ctypes

        import torch

        if not torch.backends.mkl.is_available():
            return None
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
        get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
        branch = get(1)  # MKL_CBWR_BRANCH
        if branch in (1, 2):  # OFF / AUTO: the path MKL picked for this CPU
            auto = lib.mkl_serv_cbwr_get_auto_branch
            auto.restype = ctypes.c_int
            return "auto:" + _MKL_BRANCHES.get(auto(), str(auto()))
        strict = "+STRICT" if get(-1) & 0x10000 else ""
        return _MKL_BRANCHES.get(branch, str(branch)) + strict
    except (OSError, AttributeError, ImportError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def probe() -> str:
    """First 16 hex digits of the SHA-256 of a few small computations whose rounding
    depends on the kernels (a matrix product and ``exp``: MKL; ``log_softmax``: torch's
    vectorised kernels; a convolution: oneDNN), run with this process's thread count. Two
    processes with the same probe computed these the same way. About a millisecond."""
    import torch

    g = torch.Generator().manual_seed(1234)
    h = hashlib.sha256()
    with torch.no_grad():
        a = torch.randn(64, 300, generator=g)
        b = torch.randn(300, 257, generator=g)
        h.update((a @ b).numpy().tobytes())
        h.update(torch.exp(torch.randn(1000, generator=g)).numpy().tobytes())
        h.update(torch.log_softmax(torch.randn(64, 10, generator=g), 1).numpy().tobytes())
        x = torch.randn(4, 3, 12, 12, generator=g)
        w = torch.randn(8, 3, 3, 3, generator=g)
        h.update(torch.nn.functional.conv2d(x, w).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(mode: str | None = None) -> dict[str, Any]:
    """Where this process's numbers come from: kernels mode, torch version, CPU capability
    in use, MKL code path, oneDNN cap, intra-op threads, platform, CPU, numpy, and the
    :func:`probe`. Loads torch."""
    import numpy
    import torch

    return {
        "kernels": mode or os.environ.get(KERNELS_ENV, "native"),
        "torch": torch.__version__,
        "cpu_capability": _capability(),
        "mkl_path": _mkl_path(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "threads": torch.get_num_threads(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_model(),
        "numpy": numpy.__version__,
        "probe": probe(),
    }


def differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The :data:`COMPARED` fields in which fingerprints ``a`` and ``b`` differ, as
    ``field a -> b`` texts; [] when either is missing (nothing to compare)."""
    if not a or not b:
        return []
    return [f"{k} {a.get(k)} -> {b.get(k)}" for k in COMPARED if a.get(k) != b.get(k)]


def mismatch_line(what: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    """One warning line when ``a`` (``what``: e.g. "the checkpoint was written") and ``b``
    (this process) compute differently, else None."""
    diff = differences(a, b)
    if not diff:
        return None
    return (
        f"{what} with other numerics than this process ({'; '.join(diff)}): the run goes "
        "on, but its model is not promised to be bit-identical to an uninterrupted run's"
    )
