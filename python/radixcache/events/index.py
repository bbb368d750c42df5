"""A router's index of one worker's cache, rebuilt from its decoded event batches alone."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .chain import HASH_LEN, Format, _check_format, _wire
from .codec import DecodedBatch, DecodedEvent


class SequenceGap(RuntimeError):
    """Batches were lost: the index can no longer equal the publisher's cache.

    ``expected`` is the sequence number the index needed next, ``received`` the one that
    came. A subscriber with a replay socket fills gaps itself; this is raised when the
    replay buffer no longer holds the missing batches (or there is no replay socket). A
    router then drops the worker's index and rebuilds it (a new subscriber).
    """

    def __init__(self, expected: int, received: int) -> None:
        self.expected = expected
        self.received = received
        super().__init__(
            f"sequence gap: expected batch {expected}, received {received} "
            f"({received - expected} lost)"
        )


class RouterIndex:
    """A router's view of one worker's cache, rebuilt from its events alone.

    Per tier (``medium``), the set of page hashes present and the set of pages at whose
    end a recurrent state is available, as wire integers (`wire_hash`). Batches must be
    applied in sequence order starting at 0 (`apply`): a repeated batch is ignored, a
    missing one raises `SequenceGap`. One index per publisher (one worker or DP rank).

    A batch that `decode_batch` refuses is lost, and with it what it removed: do as the
    subscriber does, ``reset(seq + 1)`` (forget everything and go on after it), so that
    the index under-claims until the worker stores its pages again and never claims a
    page the lost batch removed (docs/events.md, "Batches that cannot be decoded").

    A publisher that restarts numbers its batches from 0 again: `apply` would take them all
    for repeats. Whoever feeds the index tells a restart from a repeat (as
    `KvEventSubscriber` does: docs/events.md, "A publisher that restarts") and calls
    `reset` first.
    """

    def __init__(self, format: Format = "sglang") -> None:
        """Start empty, expecting batch 0 of a publisher of `format`."""
        _check_format(format)
        self.format: Format = format
        self.next_seq = 0
        self._pages: dict[str, set[int]] = {}
        self._states: dict[str, set[int]] = {}

    def apply(self, seq: int, batch: DecodedBatch) -> bool:
        """Apply batch `seq`; False (and no change) if it was applied already.

        Raises `SequenceGap` when `seq` skips batches (nothing is applied).
        """
        if seq < self.next_seq:
            return False
        if seq > self.next_seq:
            raise SequenceGap(self.next_seq, seq)
        self.apply_events(batch.events)
        self.next_seq = seq + 1
        return True

    def apply_events(self, events: Iterable[DecodedEvent]) -> None:
        """Apply `events` in order, without sequence checks."""
        for event in events:
            if event.kind == "cleared":
                self._pages.clear()
                self._states.clear()
            elif event.kind == "stored":
                self._pages.setdefault(event.medium, set()).update(event.hashes)
            elif event.kind == "removed":
                self._pages.get(event.medium, set()).difference_update(event.hashes)
            elif event.kind == "state_stored":
                self._states.setdefault(event.medium, set()).update(event.hashes)
            elif event.kind == "state_removed":
                self._states.get(event.medium, set()).difference_update(event.hashes)
            else:
                raise ValueError(f"events: unknown kind {event.kind!r}")

    def reset(self, next_seq: int = 0) -> None:
        """Forget everything and expect batch `next_seq` next (a router starting over)."""
        if isinstance(next_seq, bool) or not isinstance(next_seq, int) or next_seq < 0:
            raise ValueError(f"next_seq must be an integer >= 0, got {next_seq!r}")
        self._pages.clear()
        self._states.clear()
        self.next_seq = next_seq

    def pages(self, medium: str) -> frozenset[int]:
        """Return the page hashes present on `medium`."""
        return frozenset(self._pages.get(medium, ()))

    def states(self, medium: str) -> frozenset[int]:
        """Return the page hashes at whose end a state is available on `medium`."""
        return frozenset(self._states.get(medium, ()))

    def snapshot(self) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
        """``{medium: (pages, states)}`` for every tier that holds either."""
        media = {m for m, s in self._pages.items() if s} | {m for m, s in self._states.items() if s}
        return {m: (self.pages(m), self.states(m)) for m in sorted(media)}

    def usable_prefix(
        self, hashes: Sequence[bytes | int], medium: str | None = None
    ) -> tuple[int, int]:
        """Return ``(pages_matched, pages_usable)`` for a prompt's leading page hashes.

        `hashes`: the prompt's page hashes (32-byte, from `page_hashes`, or wire integers).
        ``pages_matched``: how many leading pages are present on `medium` (None: on any
        tier). ``pages_usable``: the longest matched run that ends at a page with a state
        on that medium (any tier for None): what a hybrid model can reuse. A model without
        recurrent layers emits no state events; its reuse is ``pages_matched``.
        """
        if medium is None:
            present: set[int] = set().union(*self._pages.values())
            stateful: set[int] = set().union(*self._states.values())
        else:
            present = self._pages.get(medium, set())
            stateful = self._states.get(medium, set())
        matched = usable = 0
        for i, value in enumerate(hashes):
            key = value if isinstance(value, int) else self._key(value, i)
            if key not in present:
                break
            matched = i + 1
            if key in stateful:
                usable = matched
        return matched, usable

    def _key(self, value: object, i: int) -> int:
        if not isinstance(value, bytes) or len(value) != HASH_LEN:
            raise ValueError(f"hashes[{i}] must be a {HASH_LEN}-byte page hash or an integer")
        return _wire(value, self.format)
