"""What rank 0 shows and writes: progress, metrics.jsonl, the final summary."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO


class Progress:
    """Round-by-round progress: a tqdm bar on a terminal, plain lines otherwise.

    The bar shows rounds done, the rate (rounds/s of wall time), the time left, and the
    latest test accuracy and loss. A line per row (``lines``) is meant for logs and may be
    parsed: ``round    3/10  test_acc 0.8125  test_loss 0.5012  train_loss 0.6021 ...``.

    Args:
        mode: ``auto``, ``bar``, ``lines`` or ``quiet`` (config ``output.progress``); ``auto``
            is a bar when ``stream`` is a terminal, or when ``EDGEFL_TTY=1`` (set by
            ``edgefl simulate`` when its own output is one: mpiexec gives rank 0 a pipe).
        rounds: total rounds.
        stream: where to print (stdout).
        start: rounds already done (a resume): where the bar starts.
        min_interval_s: least wall time between two redraws of the bar (seconds).
    """

    def __init__(
        self,
        mode: str,
        rounds: int,
        stream: IO[str] | None = None,
        start: int = 0,
        min_interval_s: float = 0.1,
    ) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            hint = os.environ.get("EDGEFL_TTY")  # set by `edgefl simulate` (mpiexec: a pipe)
            tty = hint == "1" if hint is not None else _isatty(self.stream)
            mode = "bar" if tty else "lines"
        self.mode = mode
        self.rounds = rounds
        self.t0 = time.monotonic()
        self.bar = None
        if mode == "bar":
            self.bar = _make_bar(self.stream, rounds, start, min_interval_s)

    def update(self, row: dict) -> None:
        """Show one metrics row (``round``, ``test_accuracy``, ``test_loss``, ...)."""
        if self.mode == "quiet":
            return
        r = row["round"]
        acc = row.get("test_accuracy")
        loss = row.get("test_loss")
        if self.bar is not None:
            if acc is not None and loss is not None:
                self.bar.set_postfix_str(f"acc={acc:.4f} loss={loss:.4f}", refresh=False)
            self.bar.update(max(r - self.bar.n, 0))
            if r >= self.rounds:
                self.close()
            return
        if self.mode == "bar":  # closed already (a row after the last round)
            return
        acc_s = f"{acc:.4f}" if acc is not None else "  -   "
        loss_s = f"{loss:.4f}" if loss is not None else "  -   "
        elapsed = row.get("wall_time_s", time.monotonic() - self.t0)
        train = row.get("train_loss")
        train_s = f"{train:.4f}" if train is not None else "-"
        vt = row.get("time_s")
        vt_s = f"  clock {vt:10.3f}s" if vt is not None else ""
        self.stream.write(
            f"round {r:4d}/{self.rounds}  test_acc {acc_s}  test_loss {loss_s}  "
            f"train_loss {train_s}{vt_s}  wall {elapsed:7.2f}s\n"
        )
        self.stream.flush()

    def close(self) -> None:
        """End the bar (its last state stays on screen); idempotent."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _screen(stream: IO[str]) -> tuple[int, int]:
    """(columns, lines) of the terminal ``stream`` is: its own size, else ``$COLUMNS`` /
    ``$LINES``, else 100 x 24. (The pseudo-terminal Open MPI gives rank 0 reports 0 x 0,
    and tqdm hides a bar on a screen of 0 lines.)"""
    try:
        cols, lines = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        cols = lines = 0
    fallback = shutil.get_terminal_size((100, 24))
    return (cols or fallback.columns or 100, lines or fallback.lines or 24)


def _make_bar(stream: IO[str], rounds: int, start: int, min_interval_s: float):
    from tqdm import tqdm

    cols, lines = _screen(stream)
    return tqdm(
        total=rounds,
        initial=start,
        unit="round",
        file=stream,
        ncols=cols,
        nrows=lines,
        mininterval=min_interval_s,
        miniters=1,  # redraw per round, at most every min_interval_s
        smoothing=0.1,
        leave=True,
    )


class Rows(Sequence):
    """The metrics rows kept in memory as the very JSON lines ``metrics.jsonl`` holds: a row
    of a large fleet lists every device (about 70 bytes of text per device, where the dicts
    took about 350), so a row is parsed again only when read. ``lines`` is what a checkpoint
    stores (``metrics_jsonl``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [json.loads(line) for line in self.lines[i]]
        return json.loads(self.lines[i])


class MetricsLog:
    """Appends one JSON object per round to ``metrics.jsonl`` (and keeps its lines in
    memory: :class:`Rows`)."""

    def __init__(self, path: Path | None, history: list[dict] | None = None) -> None:
        self.path = path
        self.rows = Rows()
        self.rows.lines.extend(json.dumps(row) for row in history or [])
        if path is not None:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for line in self.rows.lines:
                    f.write(line + "\n")
            os.replace(tmp, path)

    def append(self, row: dict) -> None:
        line = json.dumps(row)
        self.rows.lines.append(line)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def summary_table(rows: list[dict], devices: dict[int, dict], info: dict) -> str:
    """The final summary: run totals, final/best accuracy, and a per-device table.

    ``devices`` maps device id -> {torch, samples, rounds, bytes_up, bytes_down, msgs_up,
    msgs_down, time_s}. More than 16 devices are summarised as min / median / max rows.
    """
    out = []
    evals = [r for r in rows if r.get("test_accuracy") is not None]
    last = evals[-1] if evals else {}
    best = max(evals, key=lambda r: r["test_accuracy"]) if evals else {}
    out.append(
        f"edgefl summary: {info.get('rounds_done', len(rows))} rounds, "
        f"{len(devices)} devices on {info.get('workers', '?')} worker ranks, "
        f"{info.get('wall_time_s', 0.0):.1f} s"
    )
    losses = [r for r in rows if r.get("test_loss") is not None]
    if not last and losses:  # regression: no accuracy
        low = min(losses, key=lambda r: r["test_loss"])
        out.append(
            f"final test loss {losses[-1]['test_loss']:.4f}  (lowest {low['test_loss']:.4f} "
            f"at round {low['round']})"
        )
    if last:
        out.append(
            f"final test accuracy {last['test_accuracy']:.4f}  test loss {last['test_loss']:.4f}"
            f"  (best {best['test_accuracy']:.4f} at round {best['round']})"
        )
    if info.get("stopped"):
        out.append(f"stopped: {info['stopped']}")
    if info.get("rejected"):
        out.append(
            f"rejected messages: {info['rejected']}  duplicates ignored: "
            f"{info.get('duplicates', 0)}"
        )
    cols = ["device", "torch", "samples", "rounds", "up", "down", "msgs up/down", "s/round"]
    table = []

    def fmt(d, v) -> list[str]:
        rounds = max(v.get("rounds", 0), 1)
        return [
            str(d),
            str(v.get("torch", "?")),
            str(v.get("samples", 0)),
            str(v.get("rounds", 0)),
            _human_bytes(v.get("bytes_up", 0)),
            _human_bytes(v.get("bytes_down", 0)),
            f"{v.get('msgs_up', 0)}/{v.get('msgs_down', 0)}",
            f"{v.get('time_s', 0.0) / rounds:.4f}",
        ]

    ids = sorted(devices)
    if len(ids) <= 16:
        table = [fmt(d, devices[d]) for d in ids]
    else:
        by_time = sorted(ids, key=lambda d: devices[d].get("time_s", 0.0))
        for label, d in (
            ("min", by_time[0]),
            ("median", by_time[len(ids) // 2]),
            ("max", by_time[-1]),
        ):
            table.append(fmt(f"{label}:{d}", devices[d]))
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
    out.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in table:
        out.append("  ".join(x.rjust(w) for x, w in zip(r, widths)))
    return "\n".join(out)
