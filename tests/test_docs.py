"""The repository explains itself: what its docs say is there and holds.

- No tracked file points at design documents outside the repository; every rule and
  invariant of docs/contract.md that code, tests or docs cite by number exists there.
- The README's first Python snippet runs as written on a CPU-only machine.
- The gauge identities that docs/usage.md and docs/contract.md state hold for every pool,
  host pools included, while copies are in flight.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import radixcache as rc

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "docs" / "contract.md"
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"

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


def first_python_block(path: Path) -> str:
    match = re.search(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S)
    assert match is not None, f"{path.name} has no python block"
    return match.group(1)


def test_the_readmes_first_snippet_runs_on_a_cpu() -> None:
    code = first_python_block(README)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


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
