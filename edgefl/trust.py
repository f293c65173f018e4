"""The trust boundary of a resume: code a checkpoint names runs only on the user's say-so.

A checkpoint's SHA-256 trailer proves the file intact, not who wrote it: anyone can edit a
checkpoint and seal it again (``edgefl.ckpt.save_checkpoint``). ``edgefl simulate --resume
CKPT`` without a config file continues the run with the checkpoint's own ``config_toml``,
whose ``'package.module:attr'`` values (``data.source``, ``model.name``, ``train.*``,
``algorithm.plugins``, ``evaluation.metrics``, a plug-in's ``args`` ...) would be imported
and called with arguments from the same file. :func:`check_resumed_config` refuses such a
config before anything is imported, called or written, in one line naming every such key
and value, unless the user vouches for it:

- by passing the run's config file (``edgefl simulate CONFIG --resume CKPT``): the code it
  names is then the file's, which the user chose (the run directory keeps one,
  ``<run>/config.toml``);
- by ``--set KEY=VALUE`` for that key (the value is the user's);
- by ``--trust-checkpoint`` (the user trusts the file, e.g. one they wrote themselves).

Built-in names (no ``:``) need nothing. The same holds for ``run.out`` (where the resume
writes the run directory: config.toml, metrics, checkpoints): a value that is not the
directory the checkpoint lies in needs the same say-so (or ``--out``).

Pure: reads nothing, imports nothing of the user's (docs/fault-tolerance.md, threat model).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config.code import named_code
from .errors import EdgeflError

MAX_LISTED = 6  # keys named in the refusal before "and N more"


def _covered(key: str, overrides: Sequence[str]) -> bool:
    """Whether a ``--set`` text sets ``key`` or a table above it (``data.args`` covers
    ``data.args.base``; ``algorithm.plugins`` covers ``algorithm.plugins[0]``)."""
    for text in overrides:
        k = text.split("=", 1)[0].strip()
        if k and (key == k or key.startswith((f"{k}.", f"{k}["))):
            return True
    return False


def _checkpoint_run_dir(checkpoint: str | None) -> Path | None:
    """The run directory a resume infers from the checkpoint's path (``<run>/checkpoints/``),
    as :func:`edgefl.runtime.rundir.resolve_run_dir` does; None if it infers none."""
    if not checkpoint:
        return None
    p = Path(checkpoint).resolve()
    return p.parent.parent if p.parent.name == "checkpoints" else None


def untrusted_values(
    doc: dict[str, Any],
    checkpoint: str | None = None,
    overrides: Sequence[str] = (),
    out: str | None = None,
) -> list[tuple[str, str]]:
    """(key, value) of what the checkpoint's config ``doc`` would make a resume import and
    call (every ``'package.module:attr'`` value) or write to (a ``run.out`` that is not
    the checkpoint's own run directory, unless ``out`` is given), less the keys the user
    set (``overrides``: ``--set`` texts)."""
    found = [(k, v) for k, v in named_code(doc) if not _covered(k, overrides)]
    run = doc.get("run")
    run_out = run.get("out") if isinstance(run, dict) else None
    if isinstance(run_out, str) and run_out and not out and not _covered("run.out", overrides):
        if Path(run_out).resolve() != _checkpoint_run_dir(checkpoint):
            found.append(("run.out", run_out))
    return found


def check_resumed_config(
    doc: dict[str, Any],
    checkpoint: str,
    overrides: Sequence[str] = (),
    out: str | None = None,
    trusted: bool = False,
) -> None:
    """Refuse (EdgeflError, one line) to resume from ``checkpoint`` with its own config
    ``doc`` when that names code (or a foreign ``run.out``) the user did not vouch for:
    see the module docstring. Call it before anything of the config is used."""
    if trusted:
        return
    found = untrusted_values(doc, checkpoint, overrides, out)
    if not found:
        return
    listed = ", ".join(f"{k} = {v!r}" for k, v in found[:MAX_LISTED])
    if len(found) > MAX_LISTED:
        listed += f" and {len(found) - MAX_LISTED} more"
    code = any(k != "run.out" for k, _ in found)
    writes = any(k == "run.out" for k, _ in found)
    what = " and ".join(
        w
        for w, on in (
            ("names code the resume would import and call", code),
            ("says where it would write", writes),
        )
        if on
    )
    raise EdgeflError(
        f"checkpoint '{checkpoint}': its config {what} ({listed}); its SHA-256 proves the "
        "file intact, not who wrote it, so edgefl runs it only on your say-so: pass the "
        f"run's config file (edgefl simulate CONFIG --resume {checkpoint}, e.g. the run "
        "directory's config.toml), or --trust-checkpoint if you trust this file"
    )


def check_resume_args(doc: dict[str, Any], args: Any) -> None:
    """:func:`check_resumed_config` for ``edgefl simulate``'s parsed arguments (``resume``,
    ``overrides``, ``out``, ``trust_checkpoint``)."""
    check_resumed_config(
        doc,
        str(args.resume),
        list(getattr(args, "overrides", None) or []),
        getattr(args, "out", None),
        bool(getattr(args, "trust_checkpoint", False)),
    )
