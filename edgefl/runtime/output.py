"""What rank 0 shows and writes: progress, metrics.jsonl, the final summary."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO


class Progress:
    """Round-by-round progress: a one-line bar on a terminal, plain lines otherwise.

    Args:
        mode: ``auto``, ``bar``, ``lines`` or ``quiet`` (config ``output.progress``).
        rounds: total rounds (for the bar's width).
        stream: where to print (stdout).
    """

    def __init__(self, mode: str, rounds: int, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            hint = os.environ.get("EDGEFL_TTY")  # set by `edgefl simulate` (mpiexec uses a pty)
            tty = hint == "1" if hint is not None else self.stream.isatty()
            mode = "bar" if tty else "lines"
        self.mode = mode
        self.rounds = rounds
        self.t0 = time.monotonic()

    def update(self, row: dict) -> None:
        if self.mode == "quiet":
            return
        r = row["round"]
        acc = row.get("test_accuracy")
        loss = row.get("test_loss")
        acc_s = f"{acc:.4f}" if acc is not None else "  -   "
        loss_s = f"{loss:.4f}" if loss is not None else "  -   "
        elapsed = row.get("wall_time_s", time.monotonic() - self.t0)
        if self.mode == "bar":
            width = 24
            filled = int(width * r / max(self.rounds, 1))
            bar = "#" * filled + "." * (width - filled)
            line = f"\r[{bar}] round {r}/{self.rounds}  acc {acc_s}  loss {loss_s}  {elapsed:7.1f}s"
            self.stream.write(line)
            if r >= self.rounds:
                self.stream.write("\n")
        else:
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
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()


class MetricsLog:
    """Appends one JSON object per round to ``metrics.jsonl`` (and keeps them in memory)."""

    def __init__(self, path: Path | None, history: list[dict] | None = None) -> None:
        self.path = path
        self.rows: list[dict] = list(history or [])
        if path is not None:
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for row in self.rows:
                    f.write(json.dumps(row) + "\n")
            os.replace(tmp, path)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


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
