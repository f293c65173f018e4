"""Objects of a notebook or a script, shipped by value to the MPI ranks of their run.

:func:`edgefl.simulate` takes classes, functions and other callables as config values
(``{"model.name": Net}``). One the ranks can import by name stays its
``'module:qualname'`` spec (``"mymodels:Net"``). One they cannot - defined in ``__main__``
(a notebook, a script), inside a function, a lambda, a ``functools.partial`` - is passed
by value:

- the process calling :func:`edgefl.simulate` (the launcher) names it in the reserved
  namespace :data:`MODULE` (``"edgefl.shipped.by_value:Net"``), so that the config, the run
  directory's ``config.toml``, checkpoints and the trust checks keep holding strings
  (:class:`ObjectTable`);
- with ``backend="mpi"`` it pickles them with cloudpickle into one payload, which it writes
  into the run directory for the job's life only (:meth:`Shipment.staged`), and gives the
  ranks the file's path and SHA-256 in their environment (:data:`SHIPPED_ENV`);
- each rank (:func:`load_on_rank`, in ``edgefl run``) checks the file's SHA-256 against
  that digest before it unpickles it, then registers the objects under :data:`MODULE`
  before any spec is resolved. With ``backend="inline"`` the objects are registered in the
  calling process and never pickled.

The trust boundary: the only pickle edgefl loads is this payload, in a rank whose launcher
put its digest in the rank's environment, and only when the bytes read have that digest.
Nothing read from a checkpoint, a config file or an MPI message is ever unpickled: a value
naming :data:`MODULE` is only a string, and where no launcher shipped the objects (``edgefl
simulate CONFIG``, ``--resume``, ``mpiexec ... edgefl run``) it is refused in one line
(:func:`refuse_unshipped`, :func:`load_on_rank`). The wire format carries raw numeric
buffers only (:mod:`edgefl.comm.wire`). docs/python-api.md, section 6, is the user's view.

Light: the standard library only until something is pickled (then cloudpickle).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.abc
import inspect
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config.code import named_code
from .errors import ConfigError, EdgeflError

#: the reserved namespace: a module that exists only where the objects were registered
MODULE = f"{__name__}.by_value"
PREFIX = f"{MODULE}:"
#: set by the launcher in every rank's environment: ``"<SHA-256 hex>:<payload path>"``
SHIPPED_ENV = "EDGEFL_SHIPPED"
#: the payload file in the run directory, there while the job runs
PAYLOAD_FILE = ".edgefl-shipped.pkl"
FORMAT = "edgefl-shipped/1"

# :data:`MODULE` is a submodule of this one that is never on disk: an empty search path,
# and a finder that explains its absence (this module is imported before any submodule
# is looked up, so the finder is in place whenever one is)
__path__: list[str] = []

_HEX64 = re.compile(r"[0-9a-f]{64}")
# name in MODULE -> (what the object is, SHA-256 of the payload that brought it or None)
_manifest: dict[str, tuple[str, str | None]] = {}


class _Absent(importlib.abc.MetaPathFinder):
    """Says why ``import edgefl.shipped.by_value`` fails where nothing registered it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == MODULE or fullname.startswith(f"{MODULE}."):
            raise ImportError(
                f"{MODULE} holds the objects edgefl.simulate() passed by value; they exist "
                "only in the Python session that launched the run and in its ranks",
                name=fullname,
            )
        return None


if not any(isinstance(f, _Absent) for f in sys.meta_path):
    sys.meta_path.append(_Absent())


# -- the namespace --------------------------------------------------------------------------
def is_shipped(value: Any) -> bool:
    """Whether ``value`` is a spec naming an object of :data:`MODULE`."""
    return isinstance(value, str) and value.startswith(PREFIX)


def shipped_specs(cfg: Any) -> list[tuple[str, str]]:
    """(dotted config key, value) of every value of ``cfg`` naming :data:`MODULE`."""
    return [(k, v) for k, v in named_code(cfg) if is_shipped(v)]


def _namespace() -> types.ModuleType:
    mod = sys.modules.get(MODULE)
    if mod is None:
        mod = types.ModuleType(MODULE, "Objects edgefl.simulate() passed by value.")
        sys.modules[MODULE] = mod
        globals()["by_value"] = mod  # (as an imported submodule would be)
    return mod


def install(objects: Mapping[str, Any], origins: Mapping[str, str], digest: str | None) -> None:
    """Register ``objects`` (name -> object) under :data:`MODULE` in this process;
    ``origins``: what each one is (for ``config.toml``), ``digest``: the SHA-256 of the
    payload that brought them (None: registered in the process that defined them)."""
    mod = _namespace()
    for name, obj in objects.items():
        setattr(mod, name, obj)
        _manifest[name] = (origins.get(name, "an object"), digest)


def registered(name: str) -> Any:
    """The object registered as ``name`` in :data:`MODULE` in this process, or None."""
    mod = sys.modules.get(MODULE)
    return getattr(mod, name, None) if mod is not None else None


def config_note(cfg: dict) -> str:
    """Comment lines for the top of a run directory's ``config.toml``: which values name
    objects passed by value and how (empty when none does)."""
    found = shipped_specs(cfg)
    if not found:
        return ""
    lines = [
        "# Objects edgefl.simulate() passed by value (docs/python-api.md, section 6): they",
        "# exist only in the Python session that launched this run and in its ranks; edgefl",
        "# never unpickles them from a file, so this config runs only from that session.",
    ]
    digests: list[str] = []
    for key, spec in found:
        origin, digest = _manifest.get(spec[len(PREFIX) :], ("an object", None))
        lines.append(f"#   {key} = {spec!r}: {origin}")
        if digest and digest not in digests:
            digests.append(digest)
    for digest in digests:
        lines.append(f"# shipped to the ranks by value (cloudpickle), payload SHA-256 {digest}")
    if not digests:
        lines.append("# (registered in the launching process: backend inline, nothing pickled)")
    return "\n".join(lines) + "\n"


# -- the launcher's side ----------------------------------------------------------------------
def _by_name(obj: Any) -> str | None:
    """``'module:qualname'`` when that names ``obj`` itself in this process, else None."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    found: Any = sys.modules.get(mod)
    for part in qual.split("."):
        found = getattr(found, part, None)
    return f"{mod}:{qual}" if found is obj else None


def describe(obj: Any) -> str:
    """What ``obj`` is, in a few words (``class Net of __main__``)."""
    qual = getattr(obj, "__qualname__", None)
    mod = getattr(obj, "__module__", None)
    if isinstance(obj, type):
        kind = "class"
    elif inspect.isfunction(obj):
        kind = "function"
    else:
        return f"a {type(obj).__module__}.{type(obj).__qualname__} object"
    return f"{kind} {qual} of {mod}"


def _base_name(obj: Any) -> str:
    """A Python identifier for ``obj`` in :data:`MODULE` (``make.<locals>.Net`` ->
    ``make_locals_Net``)."""
    if isinstance(obj, functools.partial):
        return f"{_base_name(obj.func)}_partial"
    text = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(text, str):
        text = type(obj).__name__
    name = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")
    return name if name and not name[0].isdigit() else f"obj_{name}"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class ObjectTable:
    """The objects of one :func:`edgefl.simulate` call that the ranks cannot import by
    name: :meth:`take` names them in :data:`MODULE` while the call's config is read;
    :meth:`ship` (``backend="mpi"``) or :meth:`register` (``backend="inline"``) once the
    backend is known."""

    def __init__(self) -> None:
        self._named: dict[str, Any] = {}  # name in MODULE -> object
        self._ids: dict[int, str] = {}  # id(object) -> its name
        self._main: dict[str, Any] = {}  # "__main__:qualname" -> the object given

    def _name_for(self, obj: Any, wanted: str | None = None) -> str:
        if id(obj) in self._ids:
            return self._ids[id(obj)]
        base = wanted or _base_name(obj)
        name, n = base, 1
        while name in self._named and self._named[name] is not obj:
            n += 1
            name = f"{base}_{n}"
        self._named[name] = obj
        self._ids[id(obj)] = name
        return name

    def take(self, value: Any) -> Any:
        """``value`` (a config dict or overrides, a list, a value) with every callable in
        it replaced by a spec string: its ``'module:qualname'`` when this process can
        import it by that name (``__main__`` included), else a name in :data:`MODULE`.
        Other values are left as they are (the config's checks judge them)."""
        if isinstance(value, Mapping):
            return {k: self.take(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.take(v) for v in value]
        if isinstance(value, (str, bytes, int, float, bool)) or value is None:
            return value
        if not callable(value):
            return value
        spec = _by_name(value)
        if spec is not None:
            if spec.startswith("__main__:"):
                self._main[spec] = value
            return spec
        return PREFIX + self._name_for(value)

    def _object(self, key: str, spec: str) -> Any:
        """The object ``spec`` (``__main__:X`` or a name in :data:`MODULE`) stands for."""
        mod, _, qual = spec.partition(":")
        if mod == "__main__":
            if spec in self._main:
                return self._main[spec]
            found: Any = sys.modules.get("__main__")
            for part in qual.split("."):
                found = getattr(found, part, None)
            if found is None:
                raise ConfigError(f"config key '{key}' = {spec!r}: __main__ has no {qual!r}")
            return found
        name = spec[len(PREFIX) :]
        if name in self._named:
            return self._named[name]
        found = registered(name)
        if found is None:
            raise ConfigError(unshipped_line(key, spec))
        return found

    def register(self, cfg: dict) -> None:
        """``backend="inline"``: register the objects ``cfg`` names in :data:`MODULE` in
        this process (nothing is pickled); ``__main__`` values stay as they are."""
        objects: dict[str, Any] = {}
        for key, spec in shipped_specs(cfg):
            objects[spec[len(PREFIX) :]] = self._object(key, spec)
        install(objects, {n: describe(o) for n, o in objects.items()}, None)

    def ship(self, cfg: dict) -> tuple[dict, Shipment]:
        """``backend="mpi"``: pickle, with cloudpickle, every object ``cfg`` names that the
        ranks cannot import (``__main__:X`` values and names in :data:`MODULE`) into one
        payload; register them in this process (for the pre-launch check and
        ``Result.model()``). Returns the config with those values renamed into
        :data:`MODULE`, and the :class:`Shipment` to stage for the launch. A ConfigError
        names the key of an object cloudpickle cannot serialize."""
        found = [(k, v) for k, v in named_code(cfg) if v.startswith("__main__:") or is_shipped(v)]
        if not found:
            return cfg, Shipment(b"", "", ())
        rename: dict[str, str] = {}
        objects: dict[str, Any] = {}
        keys: dict[str, str] = {}  # name -> the first config key naming it
        for key, spec in found:
            if spec in rename:
                continue
            obj = self._object(key, spec)
            wanted = _base_name(obj) if spec.startswith("__main__:") else spec[len(PREFIX) :]
            name = self._name_for(obj, wanted)
            rename[spec] = PREFIX + name
            objects[name] = obj
            keys.setdefault(name, key)
        origins = {n: describe(o) for n, o in objects.items()}
        payload = _pickle(objects, origins, keys)
        digest = hashlib.sha256(payload).hexdigest()
        install(objects, origins, digest)
        return _renamed(cfg, rename), Shipment(payload, digest, tuple(rename.values()))


def _pickle(objects: dict[str, Any], origins: dict[str, str], keys: dict[str, str]) -> bytes:
    """The payload: ``objects`` and ``origins`` by value (cloudpickle); a ConfigError naming
    the config key of an object it cannot serialize."""
    first = next(iter(keys.values()))
    try:
        import cloudpickle
    except ImportError:
        raise ConfigError(
            f"config key '{first}': passing an object by value to the MPI ranks needs "
            "cloudpickle: pip install cloudpickle"
        ) from None
    try:
        return cloudpickle.dumps({"format": FORMAT, "objects": objects, "origins": origins})
    except Exception as whole:  # noqa: BLE001 - find which object, say it in one line
        culprit, error = first, whole
        for name, obj in objects.items():
            try:
                cloudpickle.dumps(obj)
            except Exception as e:  # noqa: BLE001
                culprit, error = keys[name], e
                break
        raise ConfigError(
            f"config key '{culprit}': cloudpickle cannot serialize "
            f"{origins.get(_name_in(keys, culprit), 'it')} for the MPI ranks "
            f"({_one_line(error)}); define it in a module file and name it 'module:Name', "
            'or run in this process with backend="inline"'
        ) from None


def _name_in(keys: dict[str, str], key: str) -> str:
    return next((n for n, k in keys.items() if k == key), "")


def _renamed(doc: Any, rename: Mapping[str, str]) -> Any:
    """A copy of ``doc`` with every string in ``rename`` replaced by its new value."""
    if isinstance(doc, dict):
        return {k: _renamed(v, rename) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_renamed(v, rename) for v in doc]
    if isinstance(doc, str):
        return rename.get(doc, doc)
    return doc


@dataclass(frozen=True)
class Shipment:
    """The payload of one launch: its bytes (empty: nothing to ship), SHA-256 (hex) and
    the specs it serves."""

    payload: bytes
    digest: str
    specs: tuple[str, ...]

    @contextmanager
    def staged(self, run_dir: Path) -> Iterator[dict[str, str]]:
        """While in effect, the payload is ``run_dir/.edgefl-shipped.pkl`` (owner-only,
        written here, removed afterwards); yields the environment the ranks need
        (``{SHIPPED_ENV: "<sha256>:<path>"}``; empty when there is nothing to ship)."""
        if not self.payload:
            yield {}
            return
        path = Path(run_dir).resolve() / PAYLOAD_FILE
        path.unlink(missing_ok=True)  # (one a killed launcher left: never read)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.payload)
        except OSError as e:
            raise EdgeflError(f"cannot write '{path}': {e.strerror}") from None
        try:
            yield {SHIPPED_ENV: f"{self.digest}:{path}"}
        finally:
            path.unlink(missing_ok=True)


# -- the ranks' side --------------------------------------------------------------------------
def unshipped_line(key: str, spec: str) -> str:
    """The refusal of a value naming :data:`MODULE` where no launcher shipped it."""
    return (
        f"config key '{key}' = {spec!r} names an object edgefl.simulate() passed by value "
        "from the Python session that launched its run; it exists only there and edgefl "
        "never unpickles one from a file: run the job with edgefl.simulate() from a "
        "notebook or script that defines it, or name an importable 'module:Name' instead"
    )


def _covered(key: str, overrides: Sequence[str]) -> bool:
    """Whether a ``--set`` text sets ``key`` or a table above it."""
    for text in overrides:
        k = text.split("=", 1)[0].strip()
        if k and (key == k or key.startswith((f"{k}.", f"{k}["))):
            return True
    return False


def refuse_unshipped(
    cfg: dict, checkpoint: str | None = None, overrides: Sequence[str] = ()
) -> None:
    """``edgefl simulate`` (which ships nothing): refuse, in one line, a config whose
    values (less the keys ``overrides``, ``--set`` texts, set) name :data:`MODULE`;
    ``checkpoint``: the config is that checkpoint's own (a resume)."""
    found = [(k, v) for k, v in shipped_specs(cfg) if not _covered(k, overrides)]
    if not found:
        return
    key, spec = found[0]
    if checkpoint is None:
        raise ConfigError(unshipped_line(key, spec))
    raise EdgeflError(
        f"checkpoint '{checkpoint}': its config key '{key}' = {spec!r} names an object "
        "edgefl.simulate() passed by value from the Python session that launched the run; "
        "it exists only there and edgefl never unpickles one from a file, so this run "
        "cannot be resumed from the command line: start it again with edgefl.simulate() "
        "from a notebook or script that defines the object (docs/python-api.md)"
    )


_loaded: set[str] = set()  # digests of the payloads loaded in this process


def load_on_rank(cfg: dict, environ: Mapping[str, str] | None = None) -> None:
    """A rank (``edgefl run``), before any spec of ``cfg`` is resolved: when ``cfg`` names
    :data:`MODULE`, load the payload its launcher named in ``environ`` (default
    ``os.environ``, :data:`SHIPPED_ENV`) and register its objects. The file is unpickled
    only if its bytes have the SHA-256 given there; anything else is one line: no
    launcher's payload (a hand-started job, a resume), a payload changed since the
    launcher wrote it, one that cannot be loaded here, a name it lacks."""
    found = shipped_specs(cfg)
    if not found:
        return
    env = os.environ if environ is None else environ
    value = env.get(SHIPPED_ENV, "")
    if not value:
        raise ConfigError(unshipped_line(*found[0]))
    digest, _, path = value.partition(":")
    if not _HEX64.fullmatch(digest) or not path:
        raise EdgeflError(f"{SHIPPED_ENV}={value!r}: expected '<SHA-256 hex>:<payload path>'")
    if digest not in _loaded:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise EdgeflError(
                f"cannot read the objects edgefl.simulate() shipped by value ('{path}': "
                f"{e.strerror})"
            ) from None
        got = hashlib.sha256(data).hexdigest()
        if not hmac.compare_digest(got, digest):
            raise EdgeflError(
                f"refusing to unpickle '{path}': its SHA-256 is {got}, but the launcher "
                f"gave {digest} ({SHIPPED_ENV}): the objects edgefl.simulate() shipped by "
                "value were changed after it wrote them"
            )
        objects, origins = _unpickle(data, path)
        install(objects, origins, digest)
        _loaded.add(digest)
    for key, spec in found:
        if registered(spec[len(PREFIX) :]) is None:
            raise ConfigError(
                f"config key '{key}' = {spec!r}: not among the objects edgefl.simulate() "
                "shipped by value for this run"
            )


def _unpickle(data: bytes, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(objects, origins) of a payload whose digest was checked."""
    try:
        import pickle

        import cloudpickle  # noqa: F401 - what the payload's functions are rebuilt with
    except ImportError:
        raise EdgeflError(
            "loading the objects edgefl.simulate() shipped by value needs cloudpickle on "
            "every rank: pip install cloudpickle"
        ) from None
    try:
        content = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - e.g. a module the notebook had and ranks lack
        raise EdgeflError(
            f"cannot load the objects edgefl.simulate() shipped by value ('{path}'): {_one_line(e)}"
        ) from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise EdgeflError(f"'{path}' is not a payload of objects shipped by value ({FORMAT})")
    objects, origins = content.get("objects"), content.get("origins")
    if not isinstance(objects, dict) or not all(isinstance(n, str) for n in objects):
        raise EdgeflError(f"'{path}' is not a payload of objects shipped by value ({FORMAT})")
    return objects, origins if isinstance(origins, dict) else {}
