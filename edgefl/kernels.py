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
- ``OPENBLAS_CORETYPE=Haswell``: numpy's OpenBLAS (the stacked step's matrix products,
  edgefl/training/blas.py) runs its AVX2 + FMA kernels, the set it also picks on AMD Zen,
  instead of its AVX-512 ones. It is read once, when numpy loads; set only where the CPU
  has AVX2 and FMA (OpenBLAS does not check a forced set against the CPU).

MKL's vector math (torch's ``sqrt``, ``exp``, ``log``, ``tanh``, ``erf`` ... of float
tensors) follows MKL's code path, which CBWR does not make vendor-independent: ``vsSqrt``
rounds differently on an AMD EPYC and an Intel Xeon under ``COMPATIBLE``. edgefl's own
training avoids it where it mattered (Adam/AdamW use torch's fused kernel,
edgefl/training/optim.py); docs/reproducibility.md lists the functions.

Thread counts are part of the arithmetic too (parallel reductions split by thread): every
rank runs ``fleet.threads`` intra-op threads (default 1). numpy's own SIMD was measured not
to change any golden model and is left alone; the sequential path runs no BLAS call of
numpy's, so ``OPENBLAS_CORETYPE`` changes no golden model either (checked), only the
stacked path's products.

``native`` leaves the environment as it is: the fastest kernels of each CPU.

On aarch64 portable mode sets nothing (torch uses other kernels and BLAS there); the same
model holds between machines of one core type, not between core types nor against x86.

Nothing here imports torch at module level: :func:`pin` must run before torch loads.
"""

from __future__ import annotations

import functools
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
    "OPENBLAS_CORETYPE": "Haswell",  # (only on a CPU with AVX2 and FMA: portable_env)
}
OPENBLAS_CORE = PORTABLE_ENV_X86["OPENBLAS_CORETYPE"]
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
COMPARED = ("torch", "cpu_capability", "mkl_path", "onednn_max_isa", "blas", "threads", "probe")


def portable_env(machine: str | None = None) -> dict[str, str]:
    """The environment portable mode sets on this (or ``machine``'s) architecture.

    ``OPENBLAS_CORETYPE`` only where this CPU has AVX2 and FMA: OpenBLAS would run its
    Haswell kernels on a CPU without them (illegal instructions), where it now picks its
    own (and :func:`not_in_effect` says that portable kernels need AVX2)."""
    m = (machine or platform.machine()).lower()
    if m not in _X86:
        return {}
    env = dict(PORTABLE_ENV_X86)
    if machine is None and not (_has_avx2() and _cpu_has("fma")):
        del env["OPENBLAS_CORETYPE"]
    return env


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
    env = rank_env(mode, {})
    for name, before in _EARLY.items():  # (what pin_configured set that mode does not)
        if name not in env:
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
    _EARLY.clear()
    os.environ.update(env)
    return not_in_effect(mode)


# variables pin_configured set -> their value before (None: unset); pin takes back those
# its mode does not set (a resume whose checkpoint turns out native, say)
_EARLY: dict[str, str | None] = {}


def configured_mode(
    path: str | None = None, overrides: list[str] | tuple | None = (), doc: dict | None = None
) -> str:
    """``run.kernels`` as the config will say, read before the config is loaded (loading it
    imports numpy, and numpy's OpenBLAS picks its kernels once, as it loads): the last
    ``--set run.kernels=...`` of ``overrides``, else ``doc``'s, else the file's (or
    recipe's) ``[run] kernels``, else ``portable``. A file or value it cannot read gives
    ``portable``: loading the config names the problem afterwards."""
    mode: Any = "portable"
    try:
        if path is not None:
            from . import recipes

            p = recipes.path(path) if recipes.is_recipe(path) else path
            with open(p, "rb") as f:
                mode = _toml().load(f).get("run", {}).get("kernels", mode)
        if doc is not None:
            mode = doc.get("run", {}).get("kernels", mode)
        for text in overrides or ():  # (None: no --set given)
            key, _, raw = text.partition("=")
            if key.strip() == "run.kernels":
                mode = raw.strip().strip("'\"")
    except Exception:  # noqa: BLE001 - (load_config reports it)
        return "portable"
    return mode if mode in MODES else "portable"


def pin_configured(
    path: str | None = None, overrides: list[str] | tuple | None = (), doc: dict | None = None
) -> None:
    """:func:`pin` the :func:`configured_mode`, first thing in a command that loads a
    config and trains in this process, so that numpy's OpenBLAS loads pinned too. (The
    command pins the loaded config's mode again, which takes back what this set and that
    mode does not; nothing here reads torch.)"""
    env = rank_env(configured_mode(path, overrides, doc), {})
    for name in env:
        _EARLY.setdefault(name, os.environ.get(name))
    os.environ.update(env)


def pin_blas(mode: str) -> None:
    """Only numpy's OpenBLAS of :func:`pin` (``OPENBLAS_CORETYPE``, portable mode): for a
    command that must pin it before numpy loads but leaves torch's kernels to a later
    :func:`pin` or to the processes it starts (``edgefl bench``: a plain loop measured in
    this process keeps the kernels it is told to use)."""
    core = portable_env().get("OPENBLAS_CORETYPE")
    if mode == "portable" and core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core


def _toml() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def not_in_effect(mode: str, stacked: bool = True) -> str | None:
    """None if this process computes with ``mode``'s kernels (or torch and numpy are not
    loaded yet, so they will), else one line naming what differs. ``stacked``: the job
    may train stacked (``train.vectorize`` not ``off``), the one part that numpy's
    OpenBLAS computes; False leaves it out."""
    if mode != "portable" or not portable_env():
        return None
    if "torch" in sys.modules:
        found = _capability()
        want = portable_env()["ATEN_CPU_CAPABILITY"].upper()
        mkl = _mkl_path()
        if (
            found not in (want, None) or mkl not in (None, portable_env()["MKL_CBWR"])
        ) and _has_avx2():
            return (
                f"portable kernels asked for, but torch already runs {found} kernels "
                f"(MKL path {mkl}) in this process (it chose them before edgefl could pin "
                "them: import and run edgefl before any torch computation, or set "
                "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE before Python starts); this "
                "run's model may differ from other machines'"
            )
        if not _has_avx2():
            return (
                "portable kernels need a CPU with AVX2 and this one has none: torch runs its "
                "generic kernels, whose rounding differs from an AVX2 machine's"
            )
    core = _openblas_core() if stacked and "OPENBLAS_CORETYPE" in portable_env() else None
    if core is not None and core.lower() != OPENBLAS_CORE.lower():
        return (
            f"portable kernels asked for, but numpy's OpenBLAS already runs its {core} "
            "kernels in this process (numpy was imported before edgefl could pin them: "
            "import edgefl before numpy, or set OPENBLAS_CORETYPE=Haswell before Python "
            "starts); this run's stacked training (train.vectorize) may differ from other "
            "machines'"
        )
    return None


def _capability() -> str | None:
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an old torch: unknown
        return None


def _has_avx2() -> bool:
    return _cpu_has("avx2")


@functools.cache
def _cpu_has(flag: str) -> bool:
    """Does /proc/cpuinfo list ``flag`` (True where there is no /proc: a current CPU)?"""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.partition(":")[2].split()
    except OSError:
        pass
    return True


def _numpy_blas() -> dict | None:
    """threadpoolctl's record of the BLAS numpy loaded (None before numpy is imported)."""
    if "numpy" not in sys.modules:
        return None
    from threadpoolctl import threadpool_info

    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    # (numpy's wheels vendor their OpenBLAS in numpy.libs/; scipy's has its own copy)
    mine = [i for i in libs if f"{os.sep}numpy" in i.get("filepath", "")]
    return (mine or libs or [None])[0]


def _openblas_core() -> str | None:
    """The kernel set of numpy's OpenBLAS in this process (``Haswell``, ``SkylakeX``, ...),
    None when numpy is not loaded yet or its BLAS is not OpenBLAS."""
    info = _numpy_blas()
    if info is None or info.get("internal_api") != "openblas":
        return None
    return info.get("architecture")


def _blas() -> str:
    """numpy's BLAS, its version and kernel set: ``openblas 0.3.31 Haswell``."""
    import numpy  # noqa: F401 - (loads the BLAS)

    info = _numpy_blas()
    if info is None:
        return "unknown"
    parts = (info.get("internal_api"), info.get("version"), info.get("architecture"))
    return " ".join(str(p) for p in parts if p)


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
    in use, MKL code path, oneDNN cap, numpy's BLAS (its kernel set: the stacked step's
    products), intra-op threads, platform, CPU, numpy, and the :func:`probe`. Loads torch
    and numpy."""
    import numpy
    import torch

    return {
        "kernels": mode or os.environ.get(KERNELS_ENV, "native"),
        "torch": torch.__version__,
        "cpu_capability": _capability(),
        "mkl_path": _mkl_path(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "blas": _blas(),
        "threads": torch.get_num_threads(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_model(),
        "numpy": numpy.__version__,
        "probe": probe(),
    }


def as_launched(fp: dict[str, Any]) -> dict[str, Any]:
    """Fingerprint ``fp`` of this process as a process started from here in ``fp``'s
    kernels mode reports it: there numpy's OpenBLAS loads pinned, here it may have loaded
    before the pin (``edgefl inspect`` reads the checkpoint, and so numpy, before it knows
    the mode)."""
    core = portable_env().get("OPENBLAS_CORETYPE")
    blas = str(fp.get("blas", ""))
    if fp.get("kernels") == "portable" and core and blas.startswith("openblas "):
        return {**fp, "blas": f"{blas.rsplit(' ', 1)[0]} {core}"}
    return fp


def differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """The :data:`COMPARED` fields in which fingerprints ``a`` and ``b`` differ, as
    ``field a -> b`` texts; [] when either is missing (nothing to compare). A field only
    one of them has (a fingerprint written before edgefl recorded it) is not compared."""
    if not a or not b:
        return []
    return [f"{k} {a.get(k)} -> {b.get(k)}" for k in COMPARED
            if k in a and k in b and a[k] != b[k]]  # fmt: skip


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
