"""Server optimizers applied to the aggregated delta on the coordinator (pure numpy, no MPI).

After aggregation the coordinator holds ``delta`` = the (weighted) mean of the devices'
``local model - global model``. Following Reddi et al., "Adaptive Federated Optimization"
(ICLR 2021, Algorithm 2), ``-delta`` is treated as a pseudo-gradient and the global model
``x`` (float32, updated in place) takes one optimizer step per round (``t = 1, 2, ...``):

=============  =====================================================================
``sgd``         ``x += lr * delta``  (``lr = 1`` is plain FedAvg)
``fedavgm``     ``b = beta1 * b + delta``; ``x += lr * b``  (Hsu et al. 2019, server momentum)
``fedadam``     ``m = beta1 m + (1 - beta1) delta``; ``v = beta2 v + (1 - beta2) delta^2``
``fedyogi``     same ``m``; ``v = v - (1 - beta2) delta^2 sign(v - delta^2)``
``fedadagrad``  same ``m``; ``v = v + delta^2``
=============  =====================================================================

and for the three adaptive ones ``x += lr * m / (sqrt(v) + tau)``, with ``m`` starting at 0
and ``v`` at ``tau^2`` (the paper's ``v_{-1} >= tau^2``; no bias correction, as in the paper).

**L1 proximal step** (``server.l1 > 0``): after the step, every penalised coordinate is
soft-thresholded, ``x = sign(x) * max(|x| - lr * l1 * s, 0)``, where ``s = 1`` for sgd,
fedavgm and user functions, and ``s = 1 / (sqrt(v) + tau)`` (the step's own per-coordinate
scale) for the adaptive optimizers, i.e. the proximal operator of ``l1 * ||x||_1`` in the
metric the step uses (as in proximal adaptive methods, e.g. Yun et al., "Adaptive Proximal
Gradient Methods for Structured Neural Networks", NeurIPS 2021). ``server.l1`` is in
pseudo-gradient (delta) units: for devices running ``K`` local gradient steps at learning rate
``eta`` on ``loss + lam * ||w||_1``, ``server.l1 = lam * eta * K`` and ``sgd`` with
``lr = 1`` make one round a proximal gradient (ISTA) step of length ``eta * K``.

**User function** (``server.optimizer = "package.module:function"``)::

    def update(params, delta, state, step, cfg) -> numpy.ndarray | None

``params`` (float32, model size) is the global model to update in place, or return a new
array of the same shape; ``delta`` (float32) the aggregated delta; ``state`` a dict of numpy
arrays the function may add to or modify (saved by :meth:`ServerOptimizer.state_dict`, so it
survives a checkpoint); ``step`` the 1-based step count; ``cfg`` the ``[server]`` table as a
dict. The L1 proximal step is applied afterwards when ``server.l1 > 0``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from edgefl.config import checks
from edgefl.errors import ConfigError
from edgefl.policies.keyrange import KeyRange

BUILTIN = ("sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
DEFAULTS: dict[str, Any] = {
    "optimizer": "sgd",
    "lr": 1.0,
    "beta1": 0.9,
    "beta2": 0.99,
    "tau": 1e-3,
    "l1": 0.0,
}

L1Keys = KeyRange | np.ndarray | None


class ServerOptimizer:
    """``sgd``: ``x += lr * delta``, then the optional L1 proximal step.

    Args:
        lr: server learning rate (> 0; ``server.lr``), default 1.0.
        l1: L1 threshold per unit lr in delta units (>= 0; ``server.l1``), default 0.0.
        l1_keys: the penalised keys: a :class:`KeyRange`, a sorted key array, or None for
            every key (default). Biases are usually left out.
    """

    name = "sgd"

    def __init__(self, lr: float = 1.0, l1: float = 0.0, l1_keys: L1Keys = None) -> None:
        self.lr = checks.positive("server.lr", lr)
        self.l1 = checks.non_negative("server.l1", l1)
        self.l1_keys = l1_keys
        self.t = 0

    # -- the round's step ------------------------------------------------------------------
    def step(self, params: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """Apply one step to ``params`` (float32, 1-D, updated in place) and return it."""
        if params.ndim != 1 or params.dtype != np.float32:
            raise ValueError(f"params must be 1-D float32, got {params.dtype} {params.shape}")
        d = np.asarray(delta, np.float32).reshape(-1)
        if d.size != params.size:
            raise ValueError(f"delta has {d.size} elements, params {params.size}")
        self.t += 1
        self._update(params, d)
        if self.l1 > 0:
            self._prox(params)
        return params

    def _update(self, params: np.ndarray, d: np.ndarray) -> None:
        params += np.float32(self.lr) * d

    def _scale(self) -> np.ndarray | None:
        """Per-coordinate scale of the prox threshold (None = 1 everywhere)."""
        return None

    def _prox(self, params: np.ndarray) -> None:
        sel: Any
        if self.l1_keys is None:
            sel = slice(None)
        elif isinstance(self.l1_keys, KeyRange):
            sel = slice(self.l1_keys.start, self.l1_keys.stop)
        else:
            sel = np.asarray(self.l1_keys)
        thr: Any = np.float32(self.lr * self.l1)
        scale = self._scale()
        if scale is not None:
            thr = thr * scale[sel]
        x = params[sel]
        params[sel] = np.sign(x) * np.maximum(np.abs(x) - thr, np.float32(0))

    # -- checkpoint state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Optimizer state as numpy arrays (``step`` plus the optimizer's buffers)."""
        return {"step": np.array(self.t, np.int64), **self._buffers()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict` output (arrays are copied)."""
        self.t = int(np.asarray(state["step"]))
        self._load_buffers({k: np.array(v) for k, v in state.items() if k != "step"})

    def _buffers(self) -> dict[str, np.ndarray]:
        return {}

    def _load_buffers(self, bufs: dict[str, np.ndarray]) -> None:
        if bufs:
            raise ValueError(f"{self.name}: unexpected state {sorted(bufs)}")


class FedAvgM(ServerOptimizer):
    """Server momentum: ``b = beta1 * b + delta``; ``x += lr * b``.

    Args:
        lr, l1, l1_keys: as :class:`ServerOptimizer`.
        beta1: momentum in [0, 1) (``server.beta1``), default 0.9.
    """

    name = "fedavgm"

    def __init__(self, lr=1.0, beta1=0.9, l1=0.0, l1_keys=None) -> None:
        super().__init__(lr, l1, l1_keys)
        self.beta1 = _unit("server.beta1", beta1)
        self.b: np.ndarray | None = None

    def _update(self, params, d):
        if self.b is None:
            self.b = np.zeros_like(d)
        self.b *= np.float32(self.beta1)
        self.b += d
        params += np.float32(self.lr) * self.b

    def _buffers(self):
        return {} if self.b is None else {"momentum": self.b.copy()}

    def _load_buffers(self, bufs):
        self.b = bufs.pop("momentum", None)
        super()._load_buffers(bufs)


class _Adaptive(ServerOptimizer):
    """Shared part of FedAdam/FedYogi/FedAdagrad (Reddi et al. 2021, Algorithm 2).

    Args:
        lr, l1, l1_keys: as :class:`ServerOptimizer`.
        beta1: first-moment decay in [0, 1) (``server.beta1``), default 0.9.
        beta2: second-moment decay in [0, 1) (``server.beta2``), default 0.99 (unused by
            fedadagrad).
        tau: adaptivity > 0 (``server.tau``), default 1e-3.
    """

    def __init__(self, lr=1.0, beta1=0.9, beta2=0.99, tau=1e-3, l1=0.0, l1_keys=None) -> None:
        super().__init__(lr, l1, l1_keys)
        self.beta1 = _unit("server.beta1", beta1)
        self.beta2 = _unit("server.beta2", beta2)
        self.tau = checks.positive("server.tau", tau)
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> None:
        raise NotImplementedError

    def _update(self, params, d):
        if self.m is None or self.v is None:
            self.m = np.zeros_like(d)
            self.v = np.full_like(d, np.float32(self.tau) ** 2)
        b1 = np.float32(self.beta1)
        self.m *= b1
        self.m += (np.float32(1) - b1) * d
        self._second_moment(self.v, d * d)
        params += np.float32(self.lr) * self.m / (np.sqrt(self.v) + np.float32(self.tau))

    def _scale(self):
        assert self.v is not None
        return np.float32(1) / (np.sqrt(self.v) + np.float32(self.tau))

    def _buffers(self):
        if self.m is None or self.v is None:
            return {}
        return {"m": self.m.copy(), "v": self.v.copy()}

    def _load_buffers(self, bufs):
        self.m = bufs.pop("m", None)
        self.v = bufs.pop("v", None)
        super()._load_buffers(bufs)


class FedAdam(_Adaptive):
    """``v = beta2 * v + (1 - beta2) * delta^2`` (see :class:`_Adaptive` for the arguments)."""

    name = "fedadam"

    def _second_moment(self, v, d2):
        b2 = np.float32(self.beta2)
        v *= b2
        v += (np.float32(1) - b2) * d2


class FedYogi(_Adaptive):
    """``v = v - (1 - beta2) * delta^2 * sign(v - delta^2)`` (arguments: :class:`_Adaptive`)."""

    name = "fedyogi"

    def _second_moment(self, v, d2):
        v -= (np.float32(1) - np.float32(self.beta2)) * d2 * np.sign(v - d2)


class FedAdagrad(_Adaptive):
    """``v = v + delta^2`` (arguments: :class:`_Adaptive`; beta2 unused)."""

    name = "fedadagrad"

    def _second_moment(self, v, d2):
        v += d2


UserUpdate = Callable[..., "np.ndarray | None"]


class UserFunction(ServerOptimizer):
    """A user-supplied ``package.module:function`` update (signature in the module docstring).

    Args:
        spec: ``"package.module:function"`` (``server.optimizer``).
        cfg: the ``[server]`` table passed to the function as ``cfg``; default empty.
        lr, l1, l1_keys: as :class:`ServerOptimizer` (the function reads lr from cfg).
    """

    name = "user"

    def __init__(self, spec: str, cfg=None, lr=1.0, l1=0.0, l1_keys=None) -> None:
        super().__init__(lr, l1, l1_keys)
        self.spec = spec
        self.fn = load_function(spec)
        self.cfg = dict(cfg or {})
        self.state: dict[str, np.ndarray] = {}

    def _update(self, params, d):
        out = self.fn(params, d, self.state, self.t, dict(self.cfg))
        if out is not None:
            arr = np.asarray(out)
            if arr.shape != params.shape:
                raise ConfigError(
                    f"config key 'server.optimizer' = {self.spec!r}: returned shape "
                    f"{arr.shape}, expected {params.shape}"
                )
            if not np.all(np.isfinite(arr)):
                raise ConfigError(
                    f"config key 'server.optimizer' = {self.spec!r}: returned non-finite values"
                )
            params[...] = arr

    def _buffers(self):
        return {f"user.{k}": np.array(v) for k, v in self.state.items()}

    def _load_buffers(self, bufs):
        self.state = {k[5:]: v for k, v in bufs.items() if k.startswith("user.")}
        rest = {k: v for k, v in bufs.items() if not k.startswith("user.")}
        super()._load_buffers(rest)


def load_function(spec: str) -> UserUpdate:
    """Import ``"package.module:function"``; ConfigError (key ``server.optimizer``) if it fails."""
    key = "server.optimizer"
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise ConfigError(f"config key {key!r} = {spec!r}: expected 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config problem
        raise ConfigError(
            f"config key {key!r} = {spec!r}: cannot import module {mod_name!r} "
            f"({type(e).__name__}: {e})"
        ) from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(
            f"config key {key!r} = {spec!r}: {mod_name!r} has no function {fn_name!r}"
        )
    return fn


def make_server_optimizer(server: Mapping[str, Any], l1_keys: L1Keys = None) -> ServerOptimizer:
    """The optimizer named by the ``[server]`` table.

    Keys read (defaults in :data:`DEFAULTS`): ``optimizer`` (sgd | fedavgm | fedadam | fedyogi
    | fedadagrad | 'package.module:function'), ``lr``, ``beta1``, ``beta2``, ``tau``, ``l1``.
    Other keys of the table are ignored here. ``l1_keys``: see :class:`ServerOptimizer`.
    """
    c = {**DEFAULTS, **{k: v for k, v in server.items() if k in DEFAULTS}}
    name = c["optimizer"]
    if not isinstance(name, str) or not (name in BUILTIN or ":" in name):
        raise ConfigError(
            f"config key 'server.optimizer' = {name!r}: must be one of {', '.join(BUILTIN)} "
            "or 'package.module:function'"
        )
    lr, l1 = c["lr"], c["l1"]
    if name == "sgd":
        return ServerOptimizer(lr, l1, l1_keys)
    if name == "fedavgm":
        return FedAvgM(lr, c["beta1"], l1, l1_keys)
    if name in ("fedadam", "fedyogi", "fedadagrad"):
        cls = {"fedadam": FedAdam, "fedyogi": FedYogi, "fedadagrad": FedAdagrad}[name]
        return cls(lr, c["beta1"], c["beta2"], c["tau"], l1, l1_keys)
    return UserFunction(name, dict(server), lr, l1, l1_keys)


def _unit(key: str, x: Any) -> float:
    """A number in [0, 1) (the moment decay rates)."""
    f = checks.number(key, x)
    if not 0 <= f < 1:
        raise ConfigError(f"config key {key!r} = {x!r}: must be in [0, 1)")
    return f
