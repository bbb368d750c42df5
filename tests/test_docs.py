"""The repository explains itself: what its docs say is there and holds.

- No tracked file points at design documents outside the repository; every rule and
  invariant of docs/contract.md that code, tests or docs cite by number exists there.
- Every fenced code block of README.md and docs/*.md runs here, or says why it does not
  (below); the README stays short; every relative link in them leads somewhere.
- The gauge identities that docs/usage.md and docs/contract.md state hold for every pool,
  host pools included, while copies are in flight.

Code blocks. A block runs unless the line just before its opening fence is a marker,
``<!-- docs-test: KIND -->`` or ``<!-- docs-test: KIND: why -->`` (docs/usage.md, "Code
blocks in these docs", says the same for a reader):

- unmarked ``python`` blocks run on a CPU (CUDA hidden, ``-X dev -W error``, nothing on
  stderr); the blocks of one page run in order in one fresh interpreter, in one namespace,
  so a block may use what an earlier block of the same page defined;
- unmarked ``bash`` (``sh``, ``shell``) blocks run with ``bash -euo pipefail`` in an empty
  temporary directory, the interpreter's scripts (``radixcache``, ``python``) first on PATH
  (a test marked slow: they are small replays);
- ``redis``: runs as well, against a redis-server started on loopback (tests/conftest.py),
  the block's ``redis://HOST:PORT`` replaced by its address (without redis-server its page
  is skipped, or fails under RADIXCACHE_REQUIRE_REDIS=1 as in CI);
- ``output`` (what a command prints, a listing, a wire format), ``signature`` (calls or
  flags with placeholders), ``slow`` (minutes long), ``needs gpu``: not run;
- ``ci``: not run here because .ci/run runs it: each of its commands must be in .ci/run;
- ``needs server: which`` and ``skip: why``: not run, for the reason given (required).

Any other block (``text``, no info string) needs a marker. The commands of a block that
does not run (all but ``output``) are still checked: every repository script they name
exists, and every ``--flag`` given to ``radixcache`` or to a repository Python script is
one its ``--help`` lists.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import radixcache as rc

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "docs" / "contract.md"
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
CI_RUN = ROOT / ".ci" / "run"
#: The pages whose code blocks are checked.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: Names of the design documents that live outside the repository, and the path to them.
#: Written so that this file does not match its own patterns.
OUTSIDE = re.compile(
    r"\b(?:API|ARCHITECTURE|SEMANTICS|STYLE)" + r"\.md\b|\.\./shared\b|\bAPI rule\b"
)
#: "docs/contract.md rule 9", "docs/contract.md rules 9", "docs/contract.md, invariant 5",
#: across a line break in a comment too.
COMMENT = r"(?:\s*(?://[/!]?|#))?"
CITED = re.compile(r"docs/contract\.md(?:'s)?,?\s+" + COMMENT + r"\s*(rule|invariant)s?\s+(\d+)")
SKIP_DIRS = {"target", "__pycache__", "node_modules"}
#: Inputs, not prose: the fuzz target's corpus.
SKIP_UNDER = ("fuzz/corpus/",)
TEXT_SUFFIXES = {".rs", ".py", ".pyi", ".md", ".toml", ".sh", ".cu", ".txt", ".yml", ".yaml", ""}


def tracked_files() -> list[Path]:
    """The repository's files: git's list in a checkout, else a walk of the source tree."""
    if (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
        files += [Path(dirpath) / f for f in filenames]
    return files


@functools.lru_cache(maxsize=1)
def texts() -> tuple[tuple[str, str], ...]:
    """``(path, text)`` of every tracked text file."""
    out = []
    for path in tracked_files():
        name = path.relative_to(ROOT).as_posix()
        if path.suffix not in TEXT_SUFFIXES or name.startswith(SKIP_UNDER) or not path.is_file():
            continue
        try:
            out.append((name, path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return tuple(out)


def numbered(section: str) -> list[int]:
    """The item numbers of a numbered list under a ``## `` heading of docs/contract.md."""
    text = CONTRACT.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(section)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match is not None, f"docs/contract.md has no section {section!r}"
    return [int(n) for n in re.findall(r"^(\d+)\. \*\*", match.group(1), re.M)]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    found = [
        f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for name, text in texts()
        for m in OUTSIDE.finditer(text)
    ]
    assert found == [], "cite docs/contract.md instead:\n" + "\n".join(found)


def test_the_contract_numbers_its_rules_1_to_20_and_its_invariants_1_to_8() -> None:
    assert numbered("Precise rules") == list(range(1, 21))
    assert numbered("Invariants") == list(range(1, 9))


def test_every_cited_rule_and_invariant_exists_in_the_contract() -> None:
    have = {"rule": set(numbered("Precise rules")), "invariant": set(numbered("Invariants"))}
    cited: list[tuple[str, str, int]] = [
        (name, kind, int(n)) for name, text in texts() for kind, n in CITED.findall(text)
    ]
    assert any(kind == "rule" for _, kind, _ in cited), "the citations were not found"
    missing = [c for c in cited if c[2] not in have[c[1]]]
    assert missing == []


def test_the_citation_pattern_reads_wrapped_comments() -> None:
    wrapped = "// (docs/contract.md\n        // rule 11) and # docs/contract.md, invariant 5"
    assert CITED.findall(wrapped) == [("rule", "11"), ("invariant", "5")]
    assert OUTSIDE.findall("see API" + ".md and " + "../" + "shared/x") != []


# ------------------------------------------------------------------ code blocks

#: kind -> (the block runs, a reason is required).
KINDS: dict[str, tuple[bool, bool]] = {
    "redis": (True, False),
    "output": (False, False),
    "signature": (False, False),
    "slow": (False, False),
    "needs gpu": (False, False),
    "ci": (False, False),
    "needs server": (False, True),
    "skip": (False, True),
}
#: Info strings of blocks that can run, and how.
LANGUAGES = {"python": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
MARKER = re.compile(r"<!-- docs-test: (?P<kind>[a-z]+(?: [a-z]+)?)(?:: (?P<why>.*?))? -->")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
REDIS_URL = re.compile(r"redis://[\w.-]+:\d+")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  #: the page, relative to the repository root
    line: int  #: the line of its opening fence, from 1
    info: str  #: the info string's first word
    body: str
    kind: str | None  #: the marker's kind, None without one
    why: str | None  #: the marker's reason

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def language(self) -> str | None:
        """``python`` or ``shell`` for a block that can run, else None."""
        return LANGUAGES.get(self.info)

    @property
    def runs(self) -> bool:
        """Whether the tests run it."""
        known = self.kind is None or (self.kind in KINDS and KINDS[self.kind][0])
        return known and self.language is not None


def read_blocks(page: str, text: str) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of a markdown `text`, and what is wrong with their markers."""
    lines = text.split("\n")
    blocks: list[Block] = []
    problems: list[str] = []
    marker: re.Match[str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if line.strip().startswith("<!-- docs-test"):
            marker = MARKER.fullmatch(line.strip())
            if marker is None:
                problems.append(f"{page}:{i + 1}: not a marker: {line.strip()!r}")
            elif i + 1 == len(lines) or not FENCE.match(lines[i + 1]):
                problems.append(f"{page}:{i + 1}: a marker must be the line just before a fence")
            i += 1
            continue
        if fence is None:
            marker = None
            i += 1
            continue
        indent, mark = len(fence["indent"]), fence["fence"]
        # A closing fence: the same character, at least as many, indented less than a code block.
        close = re.compile(rf"^ {{0,{indent + 3}}}{re.escape(mark[0])}{{{len(mark)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{page}:{i + 1}: a fence that is never closed")
            break
        body = "".join(
            (s[indent:] if s[:indent].strip() == "" else s) + "\n" for s in lines[i + 1 : end]
        )
        info = fence["info"].strip().split(" ")[0]
        kind, why = (marker["kind"], marker["why"]) if marker is not None else (None, None)
        block = Block(page, i + 1, info, body, kind, why)
        problems += block_problems(block)
        blocks.append(block)
        marker = None
        i = end + 1
    return blocks, problems


def block_problems(block: Block) -> list[str]:
    """What keeps `block` from being run here or marked as not run (docstring at the top)."""
    where = block.where
    if block.kind is None:
        if block.language is None:
            return [f"{where}: a {block.info or 'plain'} block needs a marker: it cannot run"]
        return []
    if block.kind not in KINDS:
        return [f"{where}: unknown kind {block.kind!r}: one of {sorted(KINDS)}"]
    if KINDS[block.kind][1] and not block.why:
        return [f"{where}: {block.kind!r} needs a reason: <!-- docs-test: {block.kind}: why -->"]
    if block.kind == "redis" and (block.language is None or not REDIS_URL.search(block.body)):
        return [f"{where}: a 'redis' block is Python or shell with a redis://HOST:PORT in it"]
    return []


@functools.cache
def page_blocks(page: str) -> tuple[Block, ...]:
    """The code blocks of `page` (a path relative to the root)."""
    blocks, _ = read_blocks(page, (ROOT / page).read_text(encoding="utf-8"))
    return tuple(blocks)


def page_names() -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in PAGES]


def test_every_code_block_runs_here_or_says_why_not() -> None:
    problems = []
    for page in page_names():
        _, found = read_blocks(page, (ROOT / page).read_text(encoding="utf-8"))
        problems += found
    assert problems == [], "\n".join(problems)
    assert sum(len(page_blocks(p)) for p in page_names()) > 40, "the blocks were not found"


def test_a_block_that_cannot_run_must_say_why() -> None:
    text = "\n".join(
        [
            "```text",  # no marker
            "x",
            "```",
            "<!-- docs-test: maybe -->",  # unknown kind
            "```",
            "```",
            "<!-- docs-test: skip -->",  # no reason
            "```bash",
            "```",
            "<!-- docs-test: redis -->",  # no URL
            "```python",
            "```",
            "<!-- docs-test: output -->",  # not before a fence
            "",
            "<!-- docs-test: needs server: a Redis at 10.0.0.5 -->",  # fine
            "```python",
            "```",
            "```python",  # fine: it runs
            "    ```",
            "```",
        ]
    )
    blocks, problems = read_blocks("x.md", text)
    assert [p.split(":")[1] for p in problems] == ["1", "5", "8", "11", "13"], problems
    assert [(b.line, b.runs) for b in blocks] == [
        (1, False),
        (5, False),
        (8, False),
        (11, True),
        (16, False),
        (18, True),
    ]
    assert blocks[-1].body == "    ```\n", "a fence indented as code does not close the block"


#: Runs the Python blocks of one page, in order, in one namespace; each block is compiled
#: under its page's name, at its own lines, so a traceback points at the page.
DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for page, line, code in json.load(sys.stdin):
    exec(compile("\\n" * line + code, page, "exec"), namespace)
"""


def child_env(tmp_path: Path) -> dict[str, str]:
    """The environment blocks run in: no GPU, this interpreter's scripts first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PATH": path}


def runs(language: str) -> list[str]:
    """The pages with blocks in `language` that run."""
    return [
        p for p in page_names() if any(b.runs and b.language == language for b in page_blocks(p))
    ]


def with_redis(block: Block, request: pytest.FixtureRequest) -> str:
    """The block's code, its Redis URL pointed at a server on loopback for a 'redis' block."""
    if block.kind != "redis":
        return block.body
    server = request.getfixturevalue("redis_server")
    return REDIS_URL.sub(server.url, block.body)


@pytest.mark.parametrize("page", runs("python"))
def test_the_python_blocks_of_each_page_run(
    page: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    blocks = [b for b in page_blocks(page) if b.runs and b.language == "python"]
    code = [(page, b.line, with_redis(b, request)) for b in blocks]
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", DRIVER],
        input=json.dumps(code),
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(tmp_path),
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


@pytest.mark.slow  # replays and fleets of a few seconds: the CLI's own tests run the same calls
@pytest.mark.parametrize(
    "where",
    [b.where for p in runs("shell") for b in page_blocks(p) if b.runs and b.language == "shell"],
)
def test_the_shell_blocks_run(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    page, line = where.rsplit(":", 1)
    (block,) = [b for b in page_blocks(page) if b.line == int(line)]
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", with_redis(block, request)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(tmp_path),
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"


# ------------------------------------------------------------------ commands not run

#: A program a command line runs: a `radixcache` subcommand, a Python script, a shell script.
PROGRAM = re.compile(
    r"(?:^|(?<=[\s;&|(]))(?:"
    r"(?P<cli>radixcache\s+(?:replay|bench|workload))\b"
    r"|(?:\S*/)?python3?\s+(?P<script>[\w./-]+\.py)"
    r"|(?:bash\s+)?(?P<shell>[\w./-]+\.sh)"
    r")(?P<args>.*?)(?=\s&&\s|\s\|\|?\s|;\s|;$|$)"
)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def command_lines(body: str) -> list[str]:
    """The logical lines of a shell text: comments dropped, continued lines joined."""
    out: list[str] = []
    joining = False
    for raw in body.split("\n"):
        line = re.sub(r"(?:^|\s)#.*$", "", raw).rstrip()
        continued = line.endswith("\\")
        line = line.removesuffix("\\").rstrip()
        if out and (joining or (raw[:1].isspace() and line.strip())):
            out[-1] += " " + line.strip()
        elif line.strip():
            out.append(line.strip())
        joining = continued
    return out


def invocations(body: str) -> list[tuple[str, list[str]]]:
    """``(program, flags)`` for each program `body` runs: ``radixcache replay``, a path."""
    found = []
    for line in command_lines(body):
        for m in PROGRAM.finditer(line):
            program = m["cli"] or m["script"] or m["shell"]
            found.append((re.sub(r"\s+", " ", program), FLAG.findall(m["args"])))
    return found


@functools.cache
def help_text(program: str) -> str:
    """What ``PROGRAM --help`` prints (a ``radixcache`` subcommand, a script's path)."""
    if program.startswith("radixcache "):
        cmd = [
            sys.executable,
            "-c",
            "import sys; from radixcache.cli import main; sys.exit(main())",
        ]
        cmd += [*program.split()[1:], "--help"]
    else:
        cmd = [sys.executable, str(ROOT / program), "--help"]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "1000"},
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, f"{program} --help: {done.stderr}"
    return done.stdout


def command_problems(where: str, body: str) -> list[str]:
    """A script that is not there, a flag its program's --help does not list."""
    problems = []
    for program, flags in invocations(body):
        if not program.startswith("radixcache ") and not (ROOT / program).is_file():
            problems.append(f"{where}: {program}: no such file")
        elif program.endswith(".sh"):
            continue
        else:
            text = help_text(program)
            problems += [
                f"{where}: {program}: no {flag} in its --help"
                for flag in flags
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
            ]
    return problems


def test_the_commands_of_blocks_not_run_name_real_scripts_and_flags() -> None:
    blocks = [b for p in page_names() for b in page_blocks(p) if not b.runs and b.kind != "output"]
    programs = {program for b in blocks for program, _ in invocations(b.body)}
    runnable = sorted(p for p in programs if p.startswith("radixcache ") or p.endswith(".py"))
    with ThreadPoolExecutor(max_workers=4) as pool:  # the --help runs, at once
        list(
            pool.map(
                help_text,
                [p for p in runnable if p.startswith("radixcache") or (ROOT / p).is_file()],
            )
        )
    problems = [p for b in blocks for p in command_problems(b.where, b.body)]
    assert problems == [], "\n".join(problems)
    assert {"radixcache replay", "scripts/policy_sweep.py"} <= programs


def test_the_command_check_finds_a_missing_script_and_an_unknown_flag() -> None:
    body = "\n".join(
        [
            "radixcache replay --workload gsp \\",
            "    --no-such-flag 1   # --in-a-comment",
            "radixcache workload gsp --out w.jsonl && python scripts/nope.py --x",
            "for m in 16 64; do",
            "  .venv/bin/python benches/l3_throughput.py --json; done",
        ]
    )
    assert invocations(body) == [
        ("radixcache replay", ["--workload", "--no-such-flag"]),
        ("radixcache workload", ["--out"]),
        ("scripts/nope.py", ["--x"]),
        ("benches/l3_throughput.py", ["--json"]),
    ]
    assert command_problems("x.md:1", body) == [
        "x.md:1: radixcache replay: no --no-such-flag in its --help",
        "x.md:1: scripts/nope.py: no such file",
    ]


def ci_commands(body: str) -> list[str]:
    """The commands of a shell text, each ``a && b`` as two."""
    return [c.strip() for line in command_lines(body) for c in line.split("&&")]


def ci_runs(command: str, ci: str) -> bool:
    """Whether .ci/run's text `ci` runs `command` (``pip install .`` is in ``".[test]"``)."""
    lines = [re.sub(r"(?:^|\s)#.*$", "", line) for line in ci.split("\n")]
    words = shlex.split(command)
    if words[:2] == ["pip", "install"] and len(words) == 3 and words[2] == ".":
        return any(re.search(r"pip install \"?\.(\[\w+\])?\"?(\s|$)", line) for line in lines)
    return any(command in line for line in lines)


def test_the_blocks_marked_ci_are_what_ci_runs() -> None:
    ci = CI_RUN.read_text(encoding="utf-8")
    blocks = [b for p in page_names() for b in page_blocks(p) if b.kind == "ci"]
    assert blocks != []
    missing = [(b.where, c) for b in blocks for c in ci_commands(b.body) if not ci_runs(c, ci)]
    assert missing == [], "not in .ci/run"


def test_the_ci_check_finds_a_command_ci_does_not_run() -> None:
    ci = 'pip install ".[test]" && cargo test\n# radixcache bench\nradixcache replay\n'
    assert ci_commands("# 1. a\npip install . && radixcache replay") == [
        "pip install .",
        "radixcache replay",
    ]
    assert ci_runs("pip install .", ci)
    assert ci_runs("radixcache replay", ci)
    assert not ci_runs("radixcache bench", ci), "a comment runs nothing"
    assert not ci_runs("pip install .[sglang]", ci)


# ------------------------------------------------------------------ the pages themselves


def test_the_readme_stays_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 220, f"README.md has {lines} lines: move the details to docs/usage.md"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks), repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_relative_link_of_the_pages_leads_somewhere() -> None:
    broken = []
    seen = 0
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            seen += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
    assert seen > 20, "the links were not found"
    assert slug("A fleet with a shared store (L3)") == "a-fleet-with-a-shared-store-l3"
    assert slug("The sweep, per policy (`scripts/policy_sweep.py`)") == (
        "the-sweep-per-policy-scriptspolicy_sweeppy"
    )


# ------------------------------------------------------------------ the gauge formulas

#: A formula in a code span: "*_free_slots + *_cached_tokens (or _states) + ... ==
#: *_capacity_slots", after the pools it is stated for, in backticks inside parentheses.
FORMULA = re.compile(r"\(((?:`\w+`,?\s*)+)\)[^`(]*?`(\*_[^`]*==\s*\*_capacity_slots)`")


def formulas(path: Path) -> dict[str, str]:
    """Each pool named in `path`, with the gauge formula stated for it."""
    text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for pools, formula in FORMULA.findall(text):
        for pool in re.findall(r"`(\w+)`", pools):
            out[pool] = formula
    return out


def holds(formula: str, pool: str, stats: dict[str, int]) -> bool:
    """Evaluate `formula` for `pool` on `stats` (a missing key is a KeyError)."""
    unit = "states" if pool.endswith("mamba") else "tokens"
    formula = formula.replace("_tokens (or _states)", f"_{unit}").replace("*", pool)
    left, right = formula.split("==")
    return sum(stats[k.strip()] for k in left.split("+")) == stats[right.strip()]


def moments() -> Iterator[tuple[str, dict[str, int]]]:
    """A hybrid cache with a host tier, through copies in flight of every kind."""
    ps = 16
    cache = rc.HybridCache(
        kv_slots=16 * ps, page_size=ps, mamba_slots=6, host_kv_slots=32 * ps, host_mamba_slots=4
    )
    prompt = list(range(1, 4 * ps + 1))
    req = cache.admit(prompt)
    assert req is not None
    assert cache.extend(req, prompt) is not None
    caller = cache.alloc_kv(2 * ps)
    state = cache.alloc_mamba()
    yield "a live request and caller slots", cache.stats()
    cache.finish(req)
    backups = cache.take_batches()
    assert [b.kind for b in backups] == ["backup"]
    for b in backups:
        b.start()
    yield "a backup started", cache.stats()
    cache.evict(kv_tokens=16 * ps, mamba_states=6)
    cache.evict_host(kv_tokens=32 * ps, mamba_states=4)
    yield "evictions while the backup runs", cache.stats()
    for b in backups:
        b.complete()
    cache.evict(kv_tokens=16 * ps, mamba_states=6)
    yield "demoted to the host", cache.stats()
    again = cache.admit([*prompt, 7])
    assert again is not None
    assert again.host_len == len(prompt)
    lb = cache.load_back(again)
    assert lb is not None
    lb.batch.start()
    lb.commit()
    cache.evict_host(kv_tokens=32 * ps, mamba_states=4)
    yield "a load-back in flight", cache.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        batch_id = lb.batch.id
        del lb
    cache.abort(again)
    yield "its request aborted while the copies run", cache.stats()
    cache.complete(batch_id)
    assert caller is not None
    assert state is not None
    cache.free_kv(caller)
    cache.free_mamba(state)
    cache.evict(kv_tokens=16 * ps, mamba_states=6)
    cache.evict_host(kv_tokens=32 * ps, mamba_states=4)
    cache.audit()
    yield "cleared", cache.stats()


@pytest.mark.parametrize("path", [USAGE, CONTRACT], ids=["usage", "contract"])
def test_the_stated_gauge_formulas_hold_for_every_pool_host_pools_included(path: Path) -> None:
    stated = formulas(path)
    assert sorted(stated) == ["host_kv", "host_mamba", "kv", "mamba"], stated
    seen = 0
    for moment, stats in moments():
        for pool, formula in stated.items():
            assert holds(formula, pool, stats), (moment, pool, formula)
        seen += 1
    assert seen == 7


def test_the_formula_check_catches_a_formula_that_does_not_hold() -> None:
    stats = {"host_kv_free_slots": 3, "host_kv_cached_tokens": 1, "host_kv_capacity_slots": 4}
    stated = "*_free_slots + *_cached_tokens (or _states) == *_capacity_slots"
    assert holds(stated, "host_kv", stats)
    with pytest.raises(KeyError):
        holds("*_free_slots + *_caller_slots == *_capacity_slots", "host_kv", stats)
    stats["host_kv_free_slots"] = 2
    assert not holds("*_free_slots + *_cached_tokens == *_capacity_slots", "host_kv", stats)
