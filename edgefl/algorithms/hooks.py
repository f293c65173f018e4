"""The hook table: every hook of the two plugin halves, how the runtime dispatches it, and
who may decide it.

This table is the one description of the hooks: the runtime dispatches by it, the loader
checks decisions against it (:func:`check_owners`) and the docs print it
(:func:`table_markdown`, in docs/write-your-own-algorithm.md, kept current by a test).

Dispatch modes:

- ``all``: a notification. Every plugin's hook runs, in plugin order (:attr:`Plugin.order`),
  and returns nothing. A plugin that only needs to *know* uses one of these.
- ``chain``: every plugin's hook runs in plugin order, each on what the one before returned
  or edited (``shape_task`` edits the spec, ``transform`` returns the ``Apply`` to use;
  ``encode`` and ``send_model`` are the two sides' wire pipelines: a plugin edits the
  :class:`~edgefl.algorithms.base.Upload` / :class:`~edgefl.algorithms.base.Download`, or
  encodes it, and at most one plugin may encode one).
- ``first``: plugins are asked in plugin order; the first answer that is not None wins and
  the rest are not asked (the core's count when nobody answers).
- ``owner``: a decision with exactly one owner: at most one plugin of a job may override
  it, checked when the plugins are loaded (two claimants: a one-line ConfigError naming
  both); without an owner the core decides.
- ``kind``: the plugin that registered the message kind (``message_kinds``,
  ``update_kinds``; two plugins claiming one kind are refused at load time too).
- ``own``: every plugin, each with its own data (its checkpoint entry, its summary keys).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .base import CoordinatorPlugin, Plugin, WorkerPlugin

Side = Literal["coordinator", "worker"]
Mode = Literal["all", "chain", "first", "owner", "kind", "own"]


@dataclass(frozen=True)
class Hook:
    """One hook: its side, its dispatch mode and when the runtime calls it."""

    name: str
    side: Side
    mode: Mode
    when: str


# side, hook, mode, when the runtime calls it (rank 0's in the order a run calls them)
_TABLE = """
rank0  on_registered     all   every worker rank registered (may exchange messages)
rank0  on_start          all   before the first task is dispatched (fresh run and resume)
rank0  shape_task        chain a task is dispatched: edit its TaskSpec
rank0  send_model        chain the model goes to a rank (Download): precede it, or encode it
rank0  down_bytes        first bytes a model download of a device moves (None: the core's count)
rank0  on_message        kind  a message of one of the plugin's kinds arrived
rank0  decode            kind  an update of one of its kinds: (dense delta or None, reason, message)
rank0  on_iteration      all   a local iteration of a device ended (pushed or not)
rank0  transform         chain a model change is about to be made: the Apply to use
rank0  aggregate         owner the step to apply instead of the aggregator's
rank0  after_apply       all   the step was applied, the version counted (may add to the model)
rank0  on_device_dead    all   a device is dead (crash or its rank failed)
rank0  on_device_moved   all   a dead rank's device has a new host: edit the state it restores
rank0  flush_devices     own   end of training: the devices whose worker half holds mass back
rank0  on_flushed        own   one device's final flush arrived (the plugin that asked)
rank0  on_row            all   a metrics row is about to be written: add keys
rank0  on_end            all   training is over, workers not yet stopped: a last exchange
rank0  summary           own   summary.json is written: the keys to add
rank0  state_dict        own   every checkpoint: saved under the plugin's name
rank0  load_state_dict   own   resume: restore it (after on_registered)
worker on_register       all   before the REGISTER is sent: add JSON fields
worker on_message        kind  a message of one of the plugin's kinds arrived
worker before_train      all   a task starts (LocalJob built; job.new_model: from a global model)
worker train             owner run the task's local training yourself: its loss
worker after_train       all   the task's local training ended (before the gate and the update)
worker gate              owner a gated device's iteration ended: (push?, loss, score)
worker encode            chain an update (Upload; or the end's flush) goes out: edit or encode it
worker device_state      own   every checkpoint and task start: the device's state
worker load_device_state own   resume or re-hosting: restore it
"""

HOOKS: tuple[Hook, ...] = tuple(
    Hook(name, "coordinator" if side == "rank0" else "worker", mode, when)  # type: ignore[arg-type]
    for side, name, mode, when in (line.split(maxsplit=3) for line in _TABLE.strip().splitlines())
)

#: the decisions with one owner, per side
OWNED: dict[Side, tuple[str, ...]] = {
    side: tuple(h.name for h in HOOKS if h.side == side and h.mode == "owner")
    for side in ("coordinator", "worker")
}

_BASES: dict[Side, type] = {"coordinator": CoordinatorPlugin, "worker": WorkerPlugin}


def _half(cls: type[Plugin], side: Side) -> type | None:
    return cls.coordinator if side == "coordinator" else cls.worker


def overrides(half: type | None, name: str, side: Side) -> bool:
    """Does the half class ``half`` define hook ``name`` itself (not the default)?"""
    if half is None:
        return False
    return getattr(half, name, None) is not getattr(_BASES[side], name)


def check_owners(classes: list[type[Plugin]]) -> None:
    """At most one plugin of a job overrides each ``owner`` hook: two claimants are a
    one-line ConfigError naming both (one would silently win)."""
    for side, names in OWNED.items():
        for name in names:
            claim = [c.name for c in classes if overrides(_half(c, side), name, side)]
            if len(claim) > 1:
                raise ConfigError(
                    f"config key 'algorithm.plugins': plugins '{claim[0]}' and '{claim[1]}' "
                    f"both decide the {side} hook '{name}' (a decision has one owner)"
                )


def users(classes: list[type[Plugin]]) -> dict[tuple[Side, str], list[str]]:
    """(side, hook) -> the names of the plugins among ``classes`` that override it."""
    out = {}
    for h in HOOKS:
        out[(h.side, h.name)] = [
            c.name for c in classes if overrides(_half(c, h.side), h.name, h.side)
        ]
    return out


def undeclared() -> list[str]:
    """Public methods of the half base classes that the table does not list (a test keeps
    this empty, so a new hook cannot skip the table)."""
    out = []
    for side, base in _BASES.items():
        listed = {h.name for h in HOOKS if h.side == side}
        for name, _ in inspect.getmembers(base, inspect.isfunction):
            if not name.startswith("_") and name not in listed:
                out.append(f"{side}.{name}")
        out += [f"{side}.{n} (listed, not defined)" for n in listed if not hasattr(base, n)]
    return sorted(out)


def table_markdown(classes: list[type[Plugin]]) -> str:
    """The hook table as docs/write-your-own-algorithm.md prints it: hook, side, mode, when,
    and which of ``classes`` (the built-ins: ``edgefl.algorithms.builtin_classes()``)
    override it."""
    used = users(classes)
    lines = ["| hook | side | mode | when | built-in users |", "|---|---|---|---|---|"]
    for h in HOOKS:
        params = list(inspect.signature(getattr(_BASES[h.side], h.name)).parameters)[1:]
        who = ", ".join(used[(h.side, h.name)]) or "-"
        lines.append(
            f"| `{h.name}({', '.join(params)})` | {h.side} | {h.mode} | {h.when} | {who} |"
        )
    n = {s: sum(h.side == s for h in HOOKS) for s in _BASES}
    lines.append("")
    lines.append(f"{len(HOOKS)} hooks ({n['coordinator']} on rank 0, {n['worker']} on a worker).")
    return "\n".join(lines) + "\n"


__all__ = [
    "HOOKS",
    "OWNED",
    "Hook",
    "check_owners",
    "overrides",
    "table_markdown",
    "undeclared",
    "users",
]
