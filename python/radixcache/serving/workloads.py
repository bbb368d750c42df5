"""Workloads: request sequences shaped like the ones serving engineers judge caches on.

A workload is a list of `Job` (prompt token ids, output token ids, namespace), served in
order. The built-in ones are seeded and repeatable:

* ``gsp`` — generated shared prefix, shaped like SGLang ``bench_serving``'s dataset of
  that name with its defaults: 64 groups of 16 prompts, a 2,048-token system prompt per
  group, a 128-token question, 256 output tokens, shuffled.
* ``multiturn`` — shaped like SGLang's HiCache multi-turn benchmark defaults: 256 clients,
  5 rounds, 512 new tokens per round, 64 output tokens; each round's prompt is the
  previous prompt, its output and new text; within a round the clients are interleaved.
* ``mixed`` (the default) — shared system prompts followed by unique suffixes of very
  different lengths (some of several thousand tokens), multi-turn chats, and unrelated
  prompts; sized so that a default replay sees prefix hits, state copy-on-write,
  eviction, demotion to the host tier and load-backs.

Each request carries a priority hint (`Job.priority`, passed to ``admit``; it matters
under the ``"priority"`` eviction policy), set without drawing from the seeded streams,
so the tokens are the same as without it: in ``gsp`` and ``multiturn`` a tenant tier,
every other group or client 1 and the others 0 (`TIERS`); in ``mixed`` the kind of
request: 2 for a chat turn (it comes back), 1 for a shared system prompt and its
suffix, 0 for an unrelated prompt.

Outputs are recorded token ids, as in a trace: the scheduler feeds them as the decoded
tokens. JSONL files hold one job per line: ``{"prompt": [ids], "output_len": n,
"output": [ids] (optional), "namespace": "..." (optional), "priority": n (optional)}``;
a job without ``output`` gets the checksum model's own samples (what the model would
generate). `parse_line` checks every field: a prompt and an output of at least one
token id each (integers in ``[0, 2**32)``), at most `MAX_OUTPUT_LEN` output tokens, a
namespace that is a string of valid Unicode, a priority that is a 64-bit integer, no
other field, no key given twice; a file with no job is refused.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import secrets
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .model import VOCAB, Reference

__all__ = [
    "FIELDS",
    "MAX_OUTPUT_LEN",
    "PRIORITY_RANGE",
    "TIERS",
    "TOKEN_LIMIT",
    "WORKLOADS",
    "Job",
    "gsp",
    "load",
    "load_jsonl",
    "mixed",
    "multiturn",
    "parse_line",
    "save_jsonl",
]


@dataclass(frozen=True)
class Job:
    """One request: its prompt, the tokens it decodes, its namespace and priority.

    Attributes:
        prompt: Prompt token ids (uint32 array).
        output: Output token ids (fed as decoded tokens; ``len(output)`` samples).
        namespace: The cache namespace (a LoRA id, a tenant), or None.
        priority: The request's priority hint (higher: its prefix is kept longer under
            the ``"priority"`` eviction policy), passed to ``admit``; a 64-bit integer.
        line: The line of the JSONL file it was read from (None for a built-in one).
    """

    prompt: np.ndarray
    output: np.ndarray
    namespace: str | None = None
    priority: int = 0
    line: int | None = field(default=None, compare=False)

    def to_json(self) -> str:
        """One JSONL line."""
        d: dict[str, object] = {
            "prompt": self.prompt.tolist(),
            "output_len": len(self.output),
            "output": self.output.tolist(),
        }
        if self.namespace is not None:
            d["namespace"] = self.namespace
        if self.priority:
            d["priority"] = self.priority
        return json.dumps(d, separators=(",", ":"))


#: Tenant tiers of the built-in ``gsp`` and ``multiturn``: group or client ``i`` has
#: priority ``i % TIERS``.
TIERS = 2


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.uint32)


def _job(
    prompt: np.ndarray, output: np.ndarray, namespace: str | None = None, priority: int = 0
) -> Job:
    return Job(
        np.ascontiguousarray(prompt, dtype=np.uint32),
        output.astype(np.uint32),
        namespace,
        priority,
    )


def gsp(
    requests: int | None = None,
    seed: int = 0,
    *,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
) -> list[Job]:
    """Make the generated-shared-prefix workload (SGLang ``bench_serving``'s ``gsp``).

    Args:
        requests: Total requests (default ``groups * prompts_per_group``); the number of
            groups follows it (``ceil(requests / prompts_per_group)``).
        seed: Seed.
        groups: System prompts.
        prompts_per_group: Questions per system prompt.
        system_len: Tokens of each system prompt.
        question_len: Tokens of each question.
        output_len: Output tokens per request.
    """
    rng = np.random.default_rng(seed)
    if requests is not None:
        groups = max(1, math.ceil(requests / prompts_per_group))
    jobs = []
    for g in range(groups):
        system = _tokens(rng, system_len)
        for _ in range(prompts_per_group):
            prompt = np.concatenate([system, _tokens(rng, question_len)])
            jobs.append(_job(prompt, _tokens(rng, output_len), priority=g % TIERS))
    order = rng.permutation(len(jobs))
    jobs = [jobs[i] for i in order]
    return jobs[:requests] if requests is not None else jobs


def multiturn(
    requests: int | None = None,
    seed: int = 0,
    *,
    clients: int = 256,
    rounds: int = 5,
    request_len: int = 512,
    output_len: int = 64,
) -> list[Job]:
    """Make multi-turn chats (SGLang ``benchmark/hicache/bench_multiturn.py`` defaults).

    Args:
        requests: Total requests (default ``clients * rounds``); fewer clients are made
            when it is smaller.
        seed: Seed.
        clients: Conversations.
        rounds: Turns per conversation.
        request_len: New tokens per turn.
        output_len: Output tokens per turn.
    """
    rng = np.random.default_rng(seed)
    if requests is not None:
        clients = max(1, min(clients, math.ceil(requests / rounds)))
    history = [np.zeros(0, dtype=np.uint32) for _ in range(clients)]
    jobs = []
    for _ in range(rounds):
        for c in rng.permutation(clients):
            prompt = np.concatenate([history[c], _tokens(rng, request_len)])
            output = _tokens(rng, output_len)
            jobs.append(_job(prompt, output, priority=int(c) % TIERS))
            history[c] = np.concatenate([prompt, output])
    return jobs[:requests] if requests is not None else jobs


def mixed(requests: int | None = None, seed: int = 0) -> list[Job]:
    """Make the default workload: shared system prompts, chats and unrelated prompts.

    Per request (by default 1,200), drawn at random:

    * 50%: one of 12 system prompts (512-2,048 tokens) and a unique suffix: usually 32-512
      tokens, one in six 2,000-6,000 tokens (a long document after a shared
      instruction: the branch point is far from the end);
    * 35%: the next turn of one of up to 48 open chats (each starts from a system
      prompt; a turn adds the previous output and 64-384 new tokens; a chat closes after
      8 turns or 6,000 tokens);
    * 15%: an unrelated prompt of 128-2,048 tokens.

    Outputs are 16-128 tokens. One request in ten runs in a second namespace (a LoRA
    adapter), which shares nothing with the default one.
    """
    n = 1200 if requests is None else requests
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    systems = [_tokens(rng, int(rng.integers(512, 2049))) for _ in range(12)]
    chats: list[tuple[np.ndarray, str | None, int]] = []
    jobs = []
    for _ in range(n):
        ns = "lora-1" if pick.random() < 0.1 else None
        r = pick.random()
        out = _tokens(rng, pick.randint(16, 128))
        if r < 0.5:
            suffix = pick.randint(2000, 6000) if pick.random() < 1 / 6 else pick.randint(32, 512)
            prompt = np.concatenate([pick.choice(systems), _tokens(rng, suffix)])
            jobs.append(_job(prompt, out, ns, priority=1))
        elif r < 0.85:
            if len(chats) < 48 and (not chats or pick.random() < 0.3):
                chats.append((pick.choice(systems), ns, 0))
            i = pick.randrange(len(chats))
            history, cns, turns = chats[i]
            prompt = np.concatenate([history, _tokens(rng, pick.randint(64, 384))])
            jobs.append(_job(prompt, out, cns, priority=2))
            grown = np.concatenate([prompt, out])
            if turns + 1 >= 8 or len(grown) > 6000:
                chats.pop(i)
            else:
                chats[i] = (grown, cns, turns + 1)
        else:
            jobs.append(_job(_tokens(rng, pick.randint(128, 2048)), out, ns))
    return jobs


WORKLOADS = {"mixed": mixed, "gsp": gsp, "multiturn": multiturn}


def _write(jobs: Iterable[Job], f: IO[str]) -> int:
    n = 0
    for job in jobs:
        f.write(job.to_json() + "\n")
        n += 1
    return n


def save_jsonl(jobs: Iterable[Job], path: str | Path) -> int:
    """Write `jobs` as JSONL; returns how many.

    The file is written whole under a temporary name in its directory (flushed to the
    disk), then renamed over `path`: a write that fails or is interrupted leaves `path`
    as it was (absent, or the old file, never a part) and no temporary file. A symbolic
    link is followed (its target is replaced, keeping its permissions); a `path` that is
    not a regular file (a device such as ``/dev/stdout``, a pipe) is written in place.
    """
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        with open(target, "w") as f:
            return _write(jobs, f)
    directory, name = os.path.split(target)
    fd, tmp = _create_beside(directory, name)
    try:
        with os.fdopen(fd, "w") as f:
            if os.path.exists(target):
                os.chmod(f.fileno(), stat.S_IMODE(os.stat(target).st_mode))
            n = _write(jobs, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:  # Ctrl-C too: the temporary file goes, then the error
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def _create_beside(directory: str, name: str) -> tuple[int, str]:
    """Create a new file ``.NAME.XXXXXXXX.tmp`` in `directory` (the umask's permissions)."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", directory)


#: The most output tokens one job may ask for (``output_len`` or ``len(output)``): a job
#: without ``output`` has its samples computed when the file is read (about 2 s for this
#: many), so the limit bounds that time and memory.
MAX_OUTPUT_LEN = 1 << 16
#: Token ids are unsigned 32-bit integers: ``0 <= id < TOKEN_LIMIT``.
TOKEN_LIMIT = 1 << 32
#: The fields of a JSONL line; any other is refused (a misspelt one would be ignored).
FIELDS = ("prompt", "output_len", "output", "namespace", "priority")
#: A priority is a 64-bit signed integer (the cache's ``priority``): ``lo <= p < hi``.
PRIORITY_RANGE = (-(1 << 63), 1 << 63)


def _short(value: object) -> str:
    """`value`'s repr, cut to a length that fits in one line of an error message."""
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def _ids(value: object, what: str, line: int) -> np.ndarray:
    if not isinstance(value, list):
        raise ValueError(f"line {line}: {what}: must be a list of token ids, got {_short(value)}")
    if not value:
        raise ValueError(f"line {line}: {what}: must hold at least one token id")
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < TOKEN_LIMIT:
            raise ValueError(
                f"line {line}: {what}[{i}]: {_short(t)} is not a token id "
                f"(an integer in [0, 2**32))"
            )
    return np.array(value, dtype=np.uint32)


def _count(value: object, line: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_OUTPUT_LEN:
        raise ValueError(
            f"line {line}: output_len: must be an integer in [1, {MAX_OUTPUT_LEN}], "
            f"got {_short(value)}"
        )
    return value


class _DuplicateKey(Exception):
    """A JSON object gives one key twice (`json.loads` would keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for key, value in pairs:
        if key in d:
            raise _DuplicateKey(key)
        d[key] = value
    return d


def parse_line(text: str, line: int, ref: Reference | None = None) -> Job:
    """Check one JSONL line (every field) and make its job.

    Args:
        text: The line.
        line: Its number (1-based), for the messages.
        ref: The reference model that samples a job without ``output`` (default: a new
            `Reference`; pass one to share its tables across lines).

    Raises:
        ValueError: The line is not a valid job; the message starts with ``line N:`` and
            names the field.
    """
    try:
        d = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ValueError(
            f"line {line}: key {_short(e.key)} appears twice (a line gives each once)"
        ) from None
    except RecursionError:
        raise ValueError(f"line {line}: not JSON (nested too deeply)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line}: not JSON ({e.msg})") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ValueError(f"line {line}: not JSON ({e})") from None
    if not isinstance(d, dict) or "prompt" not in d:
        raise ValueError(f"line {line}: a job is an object with a 'prompt'")
    unknown = [k for k in d if k not in FIELDS]
    if unknown:
        raise ValueError(
            f"line {line}: unknown field {_short(unknown[0])} (a job has {', '.join(FIELDS)})"
        )
    prompt = _ids(d["prompt"], "prompt", line)
    ns = d.get("namespace")
    if ns is not None:
        if not isinstance(ns, str):
            raise ValueError(f"line {line}: namespace: must be a string, got {_short(ns)}")
        try:
            ns.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"line {line}: namespace: {_short(ns)} is not valid Unicode (a lone surrogate)"
            ) from None
    priority = d.get("priority", 0)
    lo, hi = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool) or not lo <= priority < hi:
        raise ValueError(
            f"line {line}: priority: must be an integer in [-2**63, 2**63), got {_short(priority)}"
        )
    if "output" in d:
        output = _ids(d["output"], "output", line)
        if len(output) > MAX_OUTPUT_LEN:
            raise ValueError(
                f"line {line}: output: {len(output)} tokens, more than {MAX_OUTPUT_LEN}"
            )
        if "output_len" in d and _count(d["output_len"], line) != len(output):
            raise ValueError(
                f"line {line}: output_len: {d['output_len']} differs from len(output) {len(output)}"
            )
    else:
        if "output_len" not in d:
            raise ValueError(f"line {line}: a job has an 'output_len' or an 'output'")
        n = _count(d["output_len"], line)
        output = np.array((ref or Reference()).samples(prompt, n), dtype=np.uint32)
    return Job(prompt, output, ns, priority, line=line)


def load_jsonl(path: str | Path, requests: int | None = None) -> list[Job]:
    """Read a JSONL workload (see the module docstring); the first `requests` jobs.

    Blank lines are skipped; every other line is checked as `parse_line` does.

    Raises:
        ValueError: A line is not a valid job (naming the line and the field), or the
            file holds no job.
        OSError: The file cannot be read.
    """
    jobs: list[Job] = []
    ref = Reference()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if requests is not None and len(jobs) >= requests:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"line {line_no}: not UTF-8 (byte {e.start + 1})") from None
            if line.strip():
                jobs.append(parse_line(line, line_no, ref))
    if not jobs:
        raise ValueError("no jobs: the file is empty or blank")
    return jobs


def load(name_or_path: str, requests: int | None = None, seed: int = 0) -> list[Job]:
    """Load a built-in workload by name (`WORKLOADS`), or a JSONL file by path.

    Raises:
        ValueError: Neither a built-in name nor an existing file (naming `name_or_path`).
    """
    if name_or_path in WORKLOADS:
        return WORKLOADS[name_or_path](requests, seed)
    if Path(name_or_path).is_file():
        return load_jsonl(name_or_path, requests)
    raise ValueError(
        f"workload: {name_or_path!r} is neither a built-in workload "
        f"({', '.join(WORKLOADS)}) nor a file"
    )


def stats(jobs: Sequence[Job]) -> dict[str, int]:
    """Count the requests, prompt tokens and output tokens of a workload."""
    return {
        "requests": len(jobs),
        "prompt_tokens": sum(len(j.prompt) for j in jobs),
        "output_tokens": sum(len(j.output) for j in jobs),
    }
