"""Every shell block of README.md and docs/*.md runs as pasted, unless it is marked.

The blocks are the fenced ```bash, ```sh, ```shell and ```console blocks (a ```console block
runs its ``$ `` lines, with their ``\\`` continuation lines; the rest is output). Each is one
test, named ``PAGE:LINE`` (the line of its opening fence): it runs under ``bash -e -c`` in the
page's scratch directory, set up as docs/regen.py sets it up for the page's regen markers
(links to docs/, tests/, datasets/ and launch/, ``/tmp/X`` meaning a folder of the scratch
directory, the virtualenv's bin/ first on PATH, no EDGEFL_* variables; as root, Open MPI's
OMPI_ALLOW_RUN_AS_ROOT pair, as docs/cluster.md says a root user needs), and must exit with
status 0. A page's blocks share its scratch directory and run in page order (a block that
resumes a run finds the run of the block before it; a test selected alone runs the page's
earlier blocks first).

How a block is marked: HTML comment lines (invisible once rendered) right before its fence,
or before the ``<!-- regen ... -->`` markers that precede its fence:

``<!-- excerpt: REASON -->``
    not run; REASON says why (``needs a Slurm cluster``, ``pip install: downloads``, ``a
    fresh virtualenv and install, minutes``, ``a fragment: ...``). The page should say so
    to the reader too where it is not obvious (a fragment of code: a caption line above
    it, such as "Excerpt of docs/examples/rings_model.py").
``<!-- excerpt of PATH -->``
    the block (any language) shows lines of the repository file PATH, verbatim and in the
    file's order (some may be left out, e.g. docstrings): not run, and checked against the
    file, so the excerpt cannot drift from it. Give it a caption the reader sees, naming
    PATH and what was left out.
``<!-- docs-test: exit N -->``
    the block shows a failure on purpose: it must end with status N.
``<!-- docs-test: slow: REASON -->``
    takes minutes (a benchmark): run only when ``EDGEFL_DOCS_SLOW=1``, skipped otherwise
    with REASON (``pytest -rs`` lists the skipped blocks and why).

Which kind a block is: runs here in seconds and leaves nothing outside its scratch
directory: unmarked. Needs what a CI box has not (a cluster, a GPU, a network, another
install) or only shows the shape of a command: ``excerpt``. Runs here but for minutes:
``slow``. ``python docs/regen.py``'s own markers say how a block's *output* is made; these
say whether the *commands* a reader pastes work.

Cost: the unmarked blocks take about 2 minutes on 2 cores (mostly MPI start-ups).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import load_docs_regen

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
SLOW_ENV = "EDGEFL_DOCS_SLOW"
TIMEOUT_S = 900


regen = load_docs_regen()

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<lang>[\w+-]*)")
MARK = re.compile(
    r"<!--\s*(?:excerpt:\s*(?P<why>.+?)|excerpt of (?P<path>\S+)|docs-test:\s*(?P<opt>.+?))\s*-->"
)


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str  # the content, the fence's indentation removed
    excerpt: str | None = None  # why it is not run
    source: str | None = None  # the file it is an excerpt of
    exit: int = 0
    slow: str | None = None  # why it is slow
    problems: list[str] = field(default_factory=list)  # malformed markers

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def script(self) -> str:
        """What runs: the block, or a console block's ``$`` commands."""
        if self.lang != "console":
            return self.text
        out, going = [], False
        for line in self.text.split("\n"):
            if line.startswith("$ ") or going:
                out.append(line[2:] if line.startswith("$ ") and not going else line)
                going = line.endswith("\\")
        return "\n".join(out)


def comments_before(lines: list[str], i: int) -> list[str]:
    """The HTML comments (each joined into one string) on the lines right before line i."""
    out, j = [], i - 1
    while j >= 0 and lines[j].rstrip().endswith("-->"):
        k = j
        while "<!--" not in lines[k]:
            k -= 1
        out.append(" ".join(x.strip() for x in lines[k : j + 1]))
        j = k - 1
    return out


def parse_page(page: Path) -> list[Block]:
    """The page's fenced blocks (every language), with their markers."""
    name = str(page.relative_to(ROOT))
    lines = page.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        end = i + 1
        while not lines[end].strip().startswith(m["fence"]):
            end += 1
        indent = len(m["indent"])
        text = "\n".join(x[indent:] if not x[:indent].strip() else x for x in lines[i + 1 : end])
        block = Block(name, i + 1, m["lang"], text)
        marks = [c for c in comments_before(lines, i) if re.match(r"<!--\s*(excerpt|docs-test)", c)]
        for c in marks:
            mm = MARK.fullmatch(c)
            if mm is None:
                block.problems.append(f"not a docs-test marker: {c}")
            elif mm["why"]:
                block.excerpt = mm["why"]
            elif mm["path"]:
                block.excerpt, block.source = f"an excerpt of {mm['path']}", mm["path"]
            elif (e := re.fullmatch(r"exit (\d+)", mm["opt"])) is not None:
                block.exit = int(e[1])
            elif (s := re.fullmatch(r"slow:\s*(.+)", mm["opt"])) is not None:
                block.slow = s[1]
            else:
                block.problems.append(f"unknown docs-test option: {c}")
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in parse_page(page)]
SHELL_BLOCKS = [b for b in BLOCKS if b.lang in SHELL]
RUN = [b for b in SHELL_BLOCKS if b.excerpt is None]
SLOW_ON = os.environ.get(SLOW_ENV) == "1"


def _param(b: Block):
    marks = []
    if b.slow is not None and not SLOW_ON:
        marks.append(pytest.mark.skip(reason=f"slow ({b.slow}): set {SLOW_ENV}=1 to run it"))
    return pytest.param(b, id=b.id, marks=marks)


class Pages:
    """Each page's scratch directory, and which of its blocks ran there."""

    def __init__(self) -> None:
        self.scratch: dict[str, object] = {}
        self.done: dict[str, set[int]] = {}

    def run(self, block: Block) -> tuple[int, str]:
        if block.page not in self.scratch:
            scratch = self.scratch[block.page] = regen.Scratch()
            if os.geteuid() == 0:  # as root, Open MPI's mpirun wants this (docs/cluster.md)
                scratch.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
                scratch.env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            self.done[block.page] = set()
        scratch, done = self.scratch[block.page], self.done[block.page]
        for b in RUN:  # the page's earlier blocks first (when this one runs alone)
            if b.page == block.page and b.line < block.line and b.line not in done:
                if b.slow is None or SLOW_ON:
                    done.add(b.line)
                    scratch.execute(b.script(), timeout=TIMEOUT_S, bash=("-e",))
        done.add(block.line)
        return scratch.execute(block.script(), timeout=TIMEOUT_S, bash=("-e",))

    def close(self) -> None:
        for scratch in self.scratch.values():
            scratch.tmp.cleanup()


@pytest.fixture(scope="module")
def pages():
    p = Pages()
    yield p
    p.close()


@pytest.mark.parametrize("block", [_param(b) for b in RUN])
def test_block_runs_as_pasted(block: Block, pages: Pages):
    status, out = pages.run(block)
    tail = "\n".join(out.split("\n")[-40:])
    assert status == block.exit, (
        f"{block.id}: exit status {status}, the page expects {block.exit}\n"
        f"--- the block:\n{block.script()}\n--- its output (last 40 lines):\n{tail}"
    )


def test_markers_are_well_formed():
    problems = [f"{b.id}: {p}" for b in BLOCKS for p in b.problems]
    for b in BLOCKS:
        if b.lang not in SHELL and (b.slow is not None or b.exit):
            problems.append(f"{b.id}: a ```{b.lang} block never runs: slow/exit mean nothing")
        if b.excerpt is not None and (b.slow is not None or b.exit):
            problems.append(f"{b.id}: an excerpt does not run: slow/exit mean nothing")
    assert problems == []


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.source], ids=lambda b: b.id)
def test_excerpt_matches_its_file(block: Block):
    path = ROOT / block.source
    assert path.is_file(), f"{block.id}: excerpt of {block.source}: no such file"
    have = iter(line.rstrip() for line in path.read_text().split("\n"))
    missing = [line for line in block.text.split("\n") if line.rstrip() not in have]
    assert missing == [], f"{block.id}: lines not in {block.source} (in this order): {missing[:3]}"


def test_inventory():
    """How many shell blocks run, are excerpts and are slow (printed with ``-s``)."""
    slow = [b for b in RUN if b.slow is not None]
    excerpts = [b for b in SHELL_BLOCKS if b.excerpt is not None]
    print(
        f"\ndocs shell blocks: {len(SHELL_BLOCKS)}; run: {len(RUN) - len(slow)}; "
        f"slow ({'run' if SLOW_ON else f'skipped, {SLOW_ENV}=1 runs them'}): {len(slow)}; "
        f"excerpts: {len(excerpts)}"
    )
    for b in excerpts:
        print(f"  excerpt {b.id}: {b.excerpt}")
    for b in slow:
        print(f"  slow    {b.id}: {b.slow}")
    assert RUN, "no shell blocks found"
