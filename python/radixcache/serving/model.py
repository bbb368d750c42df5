"""The checksum model: a deterministic stand-in for a hybrid LLM that makes cache bugs visible.

Its layers are those of the cache's pools: full attention always, Mamba layers when the
cache has state slots (``mamba_slots > 0``), sliding-window attention (SWA) layers when
it has SWA slots (``swa_slots > 0``, window ``swa_window``). So four models (`MODELS`):
``"attention"`` (full attention only), ``"hybrid"`` (full + Mamba), ``"swa"`` (SWA +
full) and ``"swa-hybrid"`` (SWA + full + Mamba); `model_name` names a cache's.

It reads and writes a real `Storage` the way a model's layers do:

* **KV.** Feeding token ``t`` at position ``p`` writes ``h(t, p)`` (a 64-bit hash) into the
  token's KV slot, salted differently in every layer's K and V.
* **SWA KV.** The same hash, salted differently in every SWA layer's K and V, goes into
  the token's SWA slot (``Request.swa_indices``, aligned with ``tokens[swa_start:]``).
* **State.** Every Mamba layer keeps two chains, one in its conv buffer and one in its SSM
  buffer: ``c' = c * A + t + 1`` (mod 2**64, ``A`` odd, a different start per layer and
  buffer). The multiplication by an odd number is a bijection, so a wrong starting state
  always gives a wrong state after any number of tokens.
* **Sampling.** After each forward that ends a prompt or a decode step, the sampled token
  is a hash of every KV entry the request reads back through its ``kv_indices`` (all layers,
  K and V, weighted by position), of every layer's conv and SSM state, and, for the SWA
  layers, of the SWA KV of the window only: the sample at position ``p`` reads positions
  ``max(0, p - W + 1) .. p`` through ``swa_indices`` (every SWA layer, K and V, weighted
  by position), and nothing before them.

So a stale, uninitialised, misrouted or half-copied slot (one layer, or K without V)
changes the sampled token; an SWA slot does when it is in the window (a freed or reused
in-window slot is caught, an out-of-window one cannot matter, as in a real SWA layer).
`Reference` computes the same samples from the tokens alone, without any cache: serving
through the cache must give exactly those.

Compute is deferred, as on a GPU: `ChecksumModel.forward` enqueues the work on a
`ComputeStream` and returns at once; the work runs when something waits for it (the
transfer engine before a copy, given the stream's event through ``after_compute``; or the
scheduler, one step later). A copy that does not wait for the compute touching its slots
therefore corrupts the data exactly as it would on a GPU, and the samples show it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .._core import HybridCache
from ..storage import Storage

__all__ = ["MODELS", "ChecksumModel", "ComputeEvent", "ComputeStream", "Reference", "model_name"]

#: The model kinds, by their layers: full attention, + Mamba, + SWA, + both.
MODELS = ("hybrid", "attention", "swa", "swa-hybrid")


def model_name(cache: HybridCache) -> str:
    """Return the model kind (`MODELS`) that `cache`'s pools serve."""
    mamba, swa = cache.mamba_slots > 0, cache.swa_slots > 0
    if swa:
        return "swa-hybrid" if mamba else "swa"
    return "hybrid" if mamba else "attention"


M64 = (1 << 64) - 1
VOCAB = 32_000

_GOLDEN = 0x9E3779B97F4A7C15
_POS = 0xD6E8FEB86659FD93
_A = 0x5851F42D4C957F2D  # conv chain multiplier (odd)
_B = 0x2545F4914F6CDD1D  # SSM chain multiplier (odd)
_U = np.uint64


def _mix_py(x: int) -> int:
    """Apply the splitmix64 finaliser to a Python int (mod 2**64)."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """Apply the splitmix64 finaliser elementwise to a uint64 array (wrapping)."""
    x = x ^ (x >> _U(30))
    x = x * _U(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U(27))
    x = x * _U(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> _U(31))
    return out


def _constants(seed: int, n: int, odd: bool = False) -> list[int]:
    out = [_mix_py(seed * 1_000_003 + i + 1) for i in range(n)]
    return [v | 1 for v in out] if odd else out


class _Powers:
    """``m**k`` mod 2**64 for k = 0, 1, ..., grown on demand."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.table = np.ones(1, dtype=np.uint64)

    def upto(self, n: int) -> np.ndarray:
        if len(self.table) <= n:
            size = max(n + 1, 2 * len(self.table))
            grow = np.full(size - len(self.table), self.m, dtype=np.uint64)
            tail = np.cumprod(grow) * self.table[-1:]
            self.table = np.concatenate([self.table, tail])
        return self.table[: n + 1]


class ComputeEvent:
    """A point on a `ComputeStream`: `synchronize()` runs everything enqueued before it."""

    def __init__(self, stream: ComputeStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq

    def synchronize(self) -> None:
        """Wait until the compute enqueued before this event has run."""
        self.stream.run_until(self.seq)

    @property
    def done(self) -> bool:
        """Whether the compute before this event has run."""
        return self.stream.done_seq >= self.seq


@dataclass
class ComputeStream:
    """A CPU stand-in for a GPU compute stream: work is queued, and runs when waited for.

    `radixcache.TransferEngine` on CPU calls ``synchronize()`` on the event given to
    ``after_compute`` before a batch's copies, the host-side equivalent of a GPU copy
    stream waiting on the compute stream's event.
    """

    queue: list[tuple[int, Callable[[], None]]] = field(default_factory=list)
    next_seq: int = 0
    done_seq: int = -1
    launches: int = 0

    def launch(self, work: Callable[[], None]) -> None:
        """Enqueue `work` (it runs at the next wait that covers it)."""
        self.queue.append((self.next_seq, work))
        self.next_seq += 1
        self.launches += 1

    def record(self) -> ComputeEvent:
        """Record an event after everything enqueued so far."""
        return ComputeEvent(self, self.next_seq - 1)

    def run_until(self, seq: int) -> None:
        """Run the queued work up to and including `seq`."""
        while self.queue and self.queue[0][0] <= seq:
            s, work = self.queue.pop(0)
            work()
            self.done_seq = s
        self.done_seq = max(self.done_seq, seq)

    def synchronize(self) -> None:
        """Run everything queued."""
        self.run_until(self.next_seq - 1)


class ChecksumModel:
    """The stand-in model, over a `Storage` whose arrays hold one int64 per row.

    Args:
        cache: The cache; `storage` must fit it (`storage_for`). Its ``mamba_slots == 0``
            makes a model without Mamba layers (no state), its ``swa_slots > 0`` one with
            SWA layers of window ``swa_window``.
        storage: The KV and state arrays (NumPy; int64 rows of one element).
        seed: Seeds the hash constants (the reference must use the same seed).

    Attributes:
        stream: The `ComputeStream` its work is queued on.
        mismatches: Samples that differed from what the request expected (0 when the
            cache and the engine are right).
        samples: Samples computed.
    """

    def __init__(self, cache: HybridCache, storage: Storage, *, seed: int = 0) -> None:
        self.cache = cache
        self.storage = storage
        self.hybrid = cache.mamba_slots > 0
        self.window = cache.swa_window
        self.stream = ComputeStream()
        self.mismatches = 0
        self.samples = 0
        arrays = list(storage.kv["device"]) + (list(storage.mamba["device"]) if self.hybrid else [])
        if self.window:
            arrays += list(storage.swa["device"])
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.itemsize != 8 or a[0, 0].size != 1:
                raise ValueError(
                    "storage: the checksum model needs NumPy arrays with one 8-byte value "
                    "per row (ChecksumModel.storage_for makes them)"
                )
        k, v = storage.kv["device"]
        self.k = k.reshape(k.shape[0], k.shape[1]).view(np.uint64)
        self.v = v.reshape(v.shape[0], v.shape[1]).view(np.uint64)
        if self.hybrid:
            conv, ssm = storage.mamba["device"]
            self.conv = conv.reshape(conv.shape[0], conv.shape[1]).view(np.uint64)
            self.ssm = ssm.reshape(ssm.shape[0], ssm.shape[1]).view(np.uint64)
        if self.window:
            sk, sv = storage.swa["device"]
            self.swa_k = sk.reshape(sk.shape[0], sk.shape[1]).view(np.uint64)
            self.swa_v = sv.reshape(sv.shape[0], sv.shape[1]).view(np.uint64)
        self.ref = Reference(
            layers=self.k.shape[0],
            mamba_layers=self.conv.shape[0] if self.hybrid else 0,
            swa_layers=self.swa_k.shape[0] if self.window else 0,
            window=self.window,
            seed=seed,
        )

    @staticmethod
    def storage_for(
        cache: HybridCache, *, layers: int = 2, mamba_layers: int = 2, swa_layers: int = 2
    ) -> Storage:
        """Allocate the (NumPy) storage the model needs for `cache`'s pools."""
        return Storage.for_cache(
            cache,
            layers=layers,
            mamba_layers=mamba_layers,
            swa_layers=swa_layers,
            kv_heads=1,
            head_dim=1,
            conv_shape=(1,),
            ssm_shape=(1,),
            dtype="int64",
            ssm_dtype="int64",
            device="cpu",
        )

    def forward(
        self,
        start: int,
        tokens: Sequence[int] | np.ndarray,
        slots: np.ndarray,
        state_slot: int | None,
        read: np.ndarray | None = None,
        expect: int | None = None,
        on_sample: Callable[[int], None] | None = None,
        swa: tuple[Sequence[int] | np.ndarray, int] | None = None,
    ) -> None:
        """Enqueue one forward: feed `tokens` at positions ``start...``, then maybe sample.

        Args:
            start: Position of the first token (tokens before it are in the cache).
            tokens: The tokens fed.
            slots: Their KV slots (from ``cache.extend``).
            state_slot: The request's state slot (read when ``start > 0``, then written).
            read: When given, sample: the KV slots of the whole sequence so far, in order
                (the request's ``kv_indices`` after this forward's tokens).
            expect: The sample the reference gives; a different one counts a mismatch.
            on_sample: Called with the sample.
            swa: With SWA layers (required then): the request's ``(swa_indices,
                swa_start)`` after this forward's tokens, from which it writes their SWA
                slots and reads the sample's window.

        Raises:
            ValueError: `swa` is missing with SWA layers, given without them, or does not
                cover the tokens fed and the window read.
        """
        toks = np.asarray(tokens, dtype=np.uint64)
        slots = np.array(slots, dtype=np.int64)
        read = None if read is None else np.array(read, dtype=np.int64)
        window = self._window(start, len(toks), read is not None, swa)
        self.stream.launch(
            lambda: self._run(start, toks, slots, state_slot, read, expect, on_sample, window)
        )

    def _window(
        self, start: int, n: int, sample: bool, swa: tuple[Sequence[int] | np.ndarray, int] | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Return the SWA slots a forward writes (its tokens') and reads (its window)."""
        if (swa is not None) != bool(self.window):
            raise ValueError("swa: (swa_indices, swa_start) is given exactly with SWA layers")
        if swa is None:
            return None
        indices, swa_start = np.array(swa[0], dtype=np.int64), int(swa[1])
        end = start + n
        lo = max(0, end - self.window) if sample else start
        if swa_start > min(lo, start) or swa_start + len(indices) < end:
            raise ValueError(
                f"swa: slots of tokens {swa_start}..{swa_start + len(indices)} do not cover"
                f" the tokens fed and read, {min(lo, start)}..{end}"
            )
        return indices[start - swa_start : end - swa_start], indices[
            lo - swa_start : end - swa_start
        ]

    def _run(
        self,
        start: int,
        toks: np.ndarray,
        slots: np.ndarray,
        state_slot: int | None,
        read: np.ndarray | None,
        expect: int | None,
        on_sample: Callable[[int], None] | None,
        window: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        ref = self.ref
        h = ref.kv_hash(toks, start)
        self.k[:, slots] = h[None, :] ^ ref.salt_k[:, None]
        self.v[:, slots] = h[None, :] ^ ref.salt_v[:, None]
        if window is not None:
            self.swa_k[:, window[0]] = h[None, :] ^ ref.swa_salt_k[:, None]
            self.swa_v[:, window[0]] = h[None, :] ^ ref.swa_salt_v[:, None]
        if self.hybrid:
            if state_slot is None:
                raise RuntimeError("a hybrid forward without a state slot")
            if start == 0:
                conv, ssm = ref.conv0, ref.ssm0
            else:
                conv, ssm = self.conv[:, state_slot], self.ssm[:, state_slot]
            conv, ssm = ref.advance(conv, ssm, toks)
            self.conv[:, state_slot] = conv
            self.ssm[:, state_slot] = ssm
        if read is None:
            return
        # Attention: every layer reads K and V of every position, weighted by position.
        w = ref.position_weights(len(read))
        digest = (
            int((np.take(self.k, read, axis=1) @ w * ref.weight_k).sum(dtype=np.uint64))
            + int((np.take(self.v, read, axis=1) @ w * ref.weight_v).sum(dtype=np.uint64))
        ) & M64
        if window is not None:
            # SWA layers: only the window's positions, each with its own weight.
            seen = window[1]
            ws = ref.position_weights(len(read))[len(read) - len(seen) :]
            digest = (
                digest
                + int(
                    (np.take(self.swa_k, seen, axis=1) @ ws * ref.swa_weight_k).sum(dtype=np.uint64)
                )
                + int(
                    (np.take(self.swa_v, seen, axis=1) @ ws * ref.swa_weight_v).sum(dtype=np.uint64)
                )
            ) & M64
        fold = 0
        if self.hybrid and state_slot is not None:
            fold = ref.fold(self.conv[:, state_slot], self.ssm[:, state_slot])
        sample = ref.sample(digest, fold)
        self.samples += 1
        if expect is not None and sample != expect:
            self.mismatches += 1
        if on_sample is not None:
            on_sample(sample)


class Reference:
    """The model computed from tokens alone (no cache, no storage): the oracle's answer.

    Args:
        layers: KV layers.
        mamba_layers: Mamba layers (0: none).
        swa_layers: SWA layers (0: none; at least 1 with a `window`).
        window: The SWA layers' window in tokens (0: no SWA layers).
        seed: Seeds the hash constants (those of the full attention and Mamba layers
            do not depend on the SWA layers).

    Raises:
        ValueError: SWA layers without a window, or a window without SWA layers.
    """

    def __init__(
        self,
        *,
        layers: int = 2,
        mamba_layers: int = 2,
        swa_layers: int = 0,
        window: int = 0,
        seed: int = 0,
    ) -> None:
        if (swa_layers > 0) != (window > 0):
            raise ValueError(f"window: {window} with {swa_layers} swa_layers (both or neither)")
        self.layers = layers
        self.mamba_layers = mamba_layers
        self.window = window
        c = _constants(seed, 4 * layers + 4 * mamba_layers + 4 * swa_layers, odd=True)
        arr = np.array(c, dtype=np.uint64)
        self.salt_k, self.salt_v = arr[:layers], arr[layers : 2 * layers]
        self.weight_k, self.weight_v = arr[2 * layers : 3 * layers], arr[3 * layers : 4 * layers]
        m = arr[4 * layers : 4 * layers + 4 * mamba_layers]
        n = mamba_layers
        self.conv0, self.ssm0 = m[:n], m[n : 2 * n]
        self.fold_c, self.fold_s = m[2 * n : 3 * n], m[3 * n : 4 * n]
        s = arr[4 * layers + 4 * mamba_layers :]
        n = swa_layers
        self.swa_salt_k, self.swa_salt_v = s[:n], s[n : 2 * n]
        self.swa_weight_k, self.swa_weight_v = s[2 * n : 3 * n], s[3 * n : 4 * n]
        self._pa = _Powers(_A)
        self._pb = _Powers(_B)
        self._pos = np.ones(0, dtype=np.uint64)
        self._py = (
            [int(x) for x in self.salt_k],
            [int(x) for x in self.salt_v],
            [int(x) for x in self.weight_k],
            [int(x) for x in self.weight_v],
            [int(x) for x in self.fold_c],
            [int(x) for x in self.fold_s],
        )
        self._swa_py = [
            [int(x) for x in a]
            for a in (self.swa_salt_k, self.swa_salt_v, self.swa_weight_k, self.swa_weight_v)
        ]

    def kv_hash(self, toks: np.ndarray, start: int) -> np.ndarray:
        """``h(t, p)`` for tokens `toks` at positions ``start, start + 1, ...``."""
        pos = np.arange(start, start + len(toks), dtype=np.uint64)
        return _mix(toks * _U(_GOLDEN) + pos * _U(_POS) + _U(1))

    def _swa_terms(self, h: np.ndarray, start: int) -> np.ndarray:
        """Each position's term of the SWA digest: hashes `h` from position `start`."""
        w = self.position_weights(start + len(h))[start:]
        e = ((h[None, :] ^ self.swa_salt_k[:, None]) * self.swa_weight_k[:, None]).sum(
            axis=0, dtype=np.uint64
        ) + ((h[None, :] ^ self.swa_salt_v[:, None]) * self.swa_weight_v[:, None]).sum(
            axis=0, dtype=np.uint64
        )
        out: np.ndarray = e * w
        return out

    def position_weights(self, n: int) -> np.ndarray:
        """Return the digest's weights of positions ``0..n-1`` (``2p + 1``)."""
        if len(self._pos) < n:
            self._pos = np.arange(max(n, 2 * len(self._pos)), dtype=np.uint64) * _U(2) + _U(1)
        return self._pos[:n]

    def advance(
        self, conv: np.ndarray, ssm: np.ndarray, toks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every layer's conv and SSM chains after feeding `toks` (closed form)."""
        n = len(toks)
        if n == 0:
            return conv.copy(), ssm.copy()
        inp = toks + _U(1)
        pa = self._pa.upto(n)
        pb = self._pb.upto(n)
        sa = (inp * pa[n - 1 :: -1]).sum(dtype=np.uint64)
        sb = (inp * pb[n - 1 :: -1]).sum(dtype=np.uint64)
        return conv * pa[n] + sa, ssm * pb[n] + sb

    def fold(self, conv: np.ndarray, ssm: np.ndarray) -> int:
        """Every layer's state folded into one number."""
        return int((conv * self.fold_c + ssm * self.fold_s).sum(dtype=np.uint64))

    @staticmethod
    def sample(digest: int, fold: int) -> int:
        """Sample a token from a KV digest and a state fold."""
        return (_mix_py(digest ^ fold) >> 1) % VOCAB

    def samples(
        self,
        prompt: Sequence[int] | np.ndarray,
        output_len: int,
        output: Sequence[int] | np.ndarray | None = None,
    ) -> list[int]:
        """Compute the samples the model gives for `prompt`, then `output` (or its own).

        Sample ``i`` is taken after the prompt and the first ``i`` output tokens; decoding
        feeds ``output[i]`` (when given) or sample ``i`` (when not) as the next token.
        """
        if output_len == 0:
            return []
        toks = np.asarray(prompt, dtype=np.uint64)
        n = len(toks)
        h = self.kv_hash(toks, 0)
        sk, sv, wk, wv, fc, fs = self._py
        w = self.position_weights(n)
        digest = (
            int(((h[None, :] ^ self.salt_k[:, None]) @ w * self.weight_k).sum(dtype=np.uint64))
            + int(((h[None, :] ^ self.salt_v[:, None]) @ w * self.weight_v).sum(dtype=np.uint64))
        ) & M64
        # SWA layers: each position's term, summed over the window (0 without SWA layers).
        lo = max(0, n - self.window)
        terms = [int(x) for x in self._swa_terms(h[lo:], lo)] if self.window else []
        swa = sum(terms) & M64
        conv_a, ssm_a = self.advance(self.conv0, self.ssm0, toks)
        conv = [int(x) for x in conv_a]
        ssm = [int(x) for x in ssm_a]

        def fold() -> int:
            return sum(c * f + s * g for c, f, s, g in zip(conv, fc, ssm, fs)) & M64

        out = [self.sample((digest + swa) & M64, fold())]
        pos = n
        layers = range(self.layers)
        ssk, ssv, swk, swv = self._swa_py
        swa_layers = range(len(ssk))
        for i in range(1, output_len):
            t = int(output[i - 1]) if output is not None else out[-1]
            hv = _mix_py(t * _GOLDEN + pos * _POS + 1)
            e = sum(((hv ^ sk[j]) * wk[j] + (hv ^ sv[j]) * wv[j]) for j in layers)
            digest = (digest + e * (2 * pos + 1)) & M64
            if self.window:  # the window slides: position pos comes in, pos - W leaves
                e = sum(((hv ^ ssk[j]) * swk[j] + (hv ^ ssv[j]) * swv[j]) for j in swa_layers)
                terms.append(e * (2 * pos + 1) & M64)
                swa = swa + terms[-1] - (terms[-1 - self.window] if pos >= self.window else 0)
                swa &= M64
            conv = [(c * _A + t + 1) & M64 for c in conv]
            ssm = [(s * _B + t + 1) & M64 for s in ssm]
            pos += 1
            out.append(self.sample((digest + swa) & M64, fold()))
        return out
