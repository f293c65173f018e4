"""Regenerate the command outputs that docs/*.md print, or check that they still match.

    python docs/regen.py [PAGE ...] [--check] [--slow]

How to add a block: put a marker line naming the command right before the fenced block
(or the Markdown table) that shows its output,

    <!-- regen: edgefl simulate --out /tmp/doc-run --rounds 5 -->
    ```
    ```

and run ``python docs/regen.py docs/PAGE.md``: the command's output (stdout and stderr)
becomes the block's content. Options go between ``regen`` and ``: ``:

    $            the block shows ``$ COMMAND`` before the output; consecutive markers
                 (each with its own options) fill one block
    keep=S,S...  only these lines of the output, as Python slices (``keep=:2,-8:``);
                 ``...`` stands for each run of lines left out
    slow         takes minutes (benchmarks): run only with --slow, else left as it is;
                 a Markdown table after a marker is never rewritten: --slow prints the
                 command's output to make it from
    setup        no block: just run the command first (e.g. write a small plug-in)

A marker may span several lines, up to its ``-->`` (a here-document, a short script).

A page's commands run in order, under bash, in one scratch directory (so a later block sees
the run directories of earlier ones) holding links to this checkout's docs/, tests/,
datasets/ and launch/. ``/tmp/X`` in a command is a path in the scratch directory and
prints as ``/tmp/X`` again; the virtualenv's directory prints as ``/work/venv``.

--check runs the commands without writing and compares only the stable figures of each
block: the numbers and hex digests left once what varies from run to run is masked
(wall-clock times, the s/round column, dates, available memory, which worker reports an
error first; see VOLATILE). It lists the blocks whose figures differ and exits with 1.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
LINKED = ("docs", "tests", "datasets", "launch")
VENV_SHOWN = "/work/venv"
# Open MPI's start-up failure on a stale session directory (tests/conftest.py): run again
LAUNCH_FLAKE = "The PMIx server's listener thread failed to start"

MARKER = re.compile(r"<!-- regen(?P<opts>[^\n]*?): (?P<cmd>.*?)-->", re.S)
FENCE = re.compile(r"^\s*(`{3,})")
# what changes from run to run: the named group v of each match is masked before comparing
VOLATILE = [
    re.compile(p, re.M)
    for p in (
        r"\bwall +(?P<v>\d+\.\d+)s",  # round lines
        r"^edgefl summary: .*, (?P<v>\d+(?:\.\d+)?) s$",  # its duration
        r"^ *\S+ +(?:cpu|cuda:\d+|mps) .* (?P<v>\d+\.\d+)$",  # the s/round column
        r"(?P<v>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)",  # dates
        r"(?P<v>\d{8}-\d{6})",  # runs/<YYYYmmdd-HHMMSS>-name
        r"wall_time_s\W+(?:float )?(?P<v>[\d.e+-]+)",
        r"(?P<v>\d+(?:\.\d+)?) [KMGT]i?B (?:is )?available",
        r"\bin (?P<v>\d+\.\d+) s\b",  # the pre-launch check's duration
        r"\babout (?P<v>\d+(?:\.\d+)?) s\b",  # and its projection
        r"error: rank (?P<v>\d+):",  # the first worker to report
    )
]
FIGURE = re.compile(r"\b[0-9a-f]{16,}\b|\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


@dataclass
class Step:
    """A marker, or several in a row, and the block or table after them (none: setup)."""

    markers: list[tuple[list[str], str]]  # (options, command)
    line: int  # 1-based line of the first marker
    body: tuple[int, int] | None  # lines [start, end) of the block's content
    table: bool = False  # a Markdown table: written by hand from the output

    def options(self) -> set[str]:
        return {o for opts, _ in self.markers for o in opts}


def parse(text: str) -> list[Step]:
    """The page's steps, in order."""
    lines = text.split("\n")
    steps, i = [], 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("<!-- regen"):
            i += 1
            continue
        first, markers = None, []
        while i < len(lines) and lines[i].lstrip().startswith("<!-- regen"):
            j = i
            while "-->" not in lines[j]:
                j += 1
            m = MARKER.search("\n".join(lines[i : j + 1]))
            if m is None:
                raise SystemExit(f"line {i + 1}: not a regen marker")
            opts, command = m["opts"].split(), m["cmd"].strip()
            if "setup" in opts:
                steps.append(Step([(opts, command)], i + 1, None))
            else:
                first = i if first is None else first
                markers.append((opts, command))
            i = j + 1
        if not markers:
            continue
        fence = FENCE.match(lines[i]) if i < len(lines) else None
        if fence is not None:
            end = i + 1
            while not lines[end].strip().startswith(fence[1]):
                end += 1
            steps.append(Step(markers, first + 1, (i + 1, end)))
            i = end + 1
        elif i < len(lines) and lines[i].startswith("|"):  # a table (of a benchmark)
            end = i
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            steps.append(Step(markers, first + 1, (i, end), table=True))
            i = end
        else:
            raise SystemExit(f"line {first + 1}: a regen marker must precede a block or table")
    return steps


def body(text: str, step: Step) -> str:
    start, end = step.body
    return "\n".join(text.split("\n")[start:end])


def _masked(m: re.Match) -> str:
    return m.string[m.start() : m.start("v")] + "~" + m.string[m.end("v") : m.end()]


def mask(text: str) -> str:
    """``text`` with the volatile fields replaced by ``~``."""
    for pattern in VOLATILE:
        text = pattern.sub(_masked, text)
    return text


def stable(text: str) -> list[tuple[str, str]]:
    """(figures, masked line) of each line of ``text`` that holds stable figures."""
    out = []
    for line in mask(text).split("\n"):
        figures = FIGURE.findall(line)
        if figures:
            out.append((" ".join(figures), line))
    return out


def differences(page: str, fresh: str) -> list[str]:
    """The lines whose stable figures differ ('-' on the page, '+' fresh); [] if none."""
    a, b = stable(page), stable(fresh)
    matcher = difflib.SequenceMatcher(a=[f for f, _ in a], b=[f for f, _ in b], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            out += [f"- {line}" for _, line in a[i1:i2]] + [f"+ {line}" for _, line in b[j1:j2]]
    return out


def keep(output: str, spec: str) -> str:
    """The lines of ``output`` that the slices of ``spec`` select, ``...`` for each gap."""
    lines = output.split("\n")
    chosen: set[int] = set()
    for item in spec.split(","):
        a, b = (int(x) if x else None for x in item.split(":"))
        chosen.update(range(len(lines))[a:b])
    out, last = [], -1
    for n in sorted(chosen):
        if n > last + 1:
            out.append("...")
        out.append(lines[n])
        last = n
    if last < len(lines) - 1:
        out.append("...")
    return "\n".join(out)


class Scratch:
    """The scratch directory a page's commands run in."""

    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="edgefl-docs-")
        self.dir = Path(self.tmp.name)
        for name in LINKED:
            (self.dir / name).symlink_to(REPO / name)
        (self.dir / "tmp").mkdir()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEFL_")}
        bin_dir = str(Path(sys.executable).parent)
        self.env.update(PATH=bin_dir + os.pathsep + self.env.get("PATH", ""), PYTHONUNBUFFERED="1")

    def execute(self, command: str, timeout: float = 3600, bash: tuple = ()) -> tuple[int, str]:
        """Run ``command`` under ``bash BASH... -c``: its exit status and its output (stdout
        and stderr), paths shown as on the page. A launch that Open MPI itself failed to
        start (LAUNCH_FLAKE) is run again, at most twice."""
        command = command.replace("/tmp/", f"{self.dir}/tmp/")
        for _ in range(3):
            proc = subprocess.run(
                ["bash", *bash, "-c", command],
                cwd=self.dir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
            if LAUNCH_FLAKE not in proc.stdout:
                break
        out = proc.stdout.replace(f"{self.dir}/tmp/", "/tmp/").replace(f"{self.dir}/", "")
        out = out.replace(sys.prefix, VENV_SHOWN).replace(f"{REPO}/", "")
        return proc.returncode, "\n".join(line.rstrip() for line in out.strip("\n").split("\n"))

    def run(self, command: str) -> str:
        """The output of ``command`` (stdout and stderr), paths shown as on the page."""
        return self.execute(command)[1]


def render(step: Step, scratch: Scratch) -> str:
    """The fresh content of the step's block (runs its commands)."""
    parts = []
    for opts, command in step.markers:
        out = scratch.run(command)
        for opt in opts:
            if opt.startswith("keep="):
                out = keep(out, opt[len("keep=") :])
        parts.append(f"$ {command}\n{out}" if "$" in opts else out)
    return "\n".join(parts)


def regen_page(page: Path, check: bool, slow: bool) -> list[str]:
    """Regenerate (or check) one page; returns the problems found by --check."""
    name = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    text = page.read_text()
    fresh: dict[int, tuple[list, str]] = {}  # step index -> (its markers, new content)
    problems = []
    scratch = Scratch()
    try:
        for n, step in enumerate(parse(text)):
            if "slow" in step.options() and not slow:
                print(f"{name}:{step.line}: slow, left as it is", file=sys.stderr)
                continue
            t0 = time.monotonic()
            new = render(step, scratch)
            print(f"{name}:{step.line}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
            if step.body is None:
                continue
            if step.table:  # a person turns the output into the table
                print(f"{name}:{step.line}: the table's output:\n{new}")
                continue
            if check:
                diff = differences(body(text, step), new)
                if diff:
                    problems.append(
                        f"{name}:{step.line}: {step.markers[0][1]}\n  " + "\n  ".join(diff)
                    )
            else:
                fresh[n] = (step.markers, new)
    finally:
        scratch.tmp.cleanup()
    if fresh:
        # read the page again: someone may have edited its prose meanwhile
        text = page.read_text()
        lines = text.split("\n")
        for n, step in reversed(list(enumerate(parse(text)))):
            if n in fresh and fresh[n][0] == step.markers:
                start, end = step.body
                lines[start:end] = fresh[n][1].split("\n")
        new_text = "\n".join(lines)
        if new_text != text:
            tmp = page.with_name(page.name + ".regen")
            tmp.write_text(new_text)
            os.replace(tmp, page)
            print(f"{name}: rewritten", file=sys.stderr)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="default: every page with a marker")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--slow", action="store_true", help="also the blocks marked slow")
    args = parser.parse_args(argv)
    pages = args.pages or sorted(p for p in DOCS.glob("*.md") if "<!-- regen" in p.read_text())
    problems = []
    for page in pages:
        problems += regen_page(page.resolve(), args.check, args.slow)
    for problem in problems:
        print(problem)
    if args.check:
        print(f"regen --check: {len(problems)} block(s) differ", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
