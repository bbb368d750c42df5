"""The prefill compute a cache hit saves: a per-layer FLOP model of a hybrid model's shape.

A prompt token at position ``p`` (0-based) costs, in a forward pass:

* each attention layer: the Q, K, V and output projections, constant per token, plus
  the scores and the weighted sum of values over the ``p + 1`` positions it attends
  to, which grow with ``p``;
* each sliding-window attention (SWA) layer: the same projections, and the scores and
  values over the last ``min(p + 1, W)`` positions only (its window ``W``), so past the
  window a token costs the same at any depth;
* each Mamba-2 layer: the input and output projections, the short convolution and the
  state update and readout, all constant per token (the state has a fixed size);
* each MLP layer: constant per token.

So ``cost(p) = a + b * (p + 1) + s * min(p + 1, W)``, and a prompt's first ``n`` tokens
cost ``a * n + b * n * (n + 1) / 2`` plus ``s`` times the sum of ``min(k, W)`` over
``k = 1..n`` (`ModelShape.prefill_flops`). A hit on the first ``h`` tokens saves exactly
the cost of those positions: ``compute_saved_ratio`` is the sum of that over the
requests, divided by the cost of every prompt computed from scratch.

The default shape is about that of an 8-billion-parameter hybrid such as NVIDIA's
Nemotron-H-8B: 4 attention, 24 Mamba-2 and 24 MLP layers at width 4,096. Few attention
layers make the per-token constant dominate (about 14 GFLOP a token against 65,536
FLOP per position attended), so at the built-in workloads' lengths compute saved is close
to the token hit rate, a little above it (deep tokens cost more). It has no SWA layers;
the replay of a model with them (``--model swa|swa-hybrid``) counts with the same shape,
some of its attention layers made SWA layers (`ModelShape.with_swa`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

__all__ = ["ModelShape", "compute_saved_ratio"]


@dataclass(frozen=True)
class ModelShape:
    """A hybrid model's layer counts and widths (the cost model's only inputs).

    Attributes:
        attention_layers: Full-attention layers.
        mamba_layers: Mamba-2 layers.
        mlp_layers: MLP layers (not counted in the other two).
        hidden: The model width.
        heads, kv_heads, head_dim: Attention query heads, key/value heads (grouped
            query attention) and the width of a head.
        mlp_hidden: The MLP's inner width (two matrices: up and down).
        mamba_inner: The Mamba layers' inner width (expand times hidden).
        mamba_state: The SSM state size per channel (``d_state``).
        mamba_groups: B and C groups.
        mamba_heads: Mamba-2 heads (one ``dt`` each).
        conv_kernel: The short convolution's width.
        swa_layers: Sliding-window attention layers (not counted in
            ``attention_layers``), with the attention layers' heads and widths.
        swa_window: The positions each SWA layer attends to (at least 1 with
            ``swa_layers``).

    Raises:
        ValueError: naming ``swa_layers`` or ``swa_window`` when either is negative, or
            ``swa_window`` when ``swa_layers`` is given without a window.
    """

    attention_layers: int = 4
    mamba_layers: int = 24
    mlp_layers: int = 24
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp_hidden: int = 21504
    mamba_inner: int = 8192
    mamba_state: int = 128
    mamba_groups: int = 8
    mamba_heads: int = 128
    conv_kernel: int = 4
    swa_layers: int = 0
    swa_window: int = 0

    def __post_init__(self) -> None:
        for name in ("swa_layers", "swa_window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be at least 0, got {getattr(self, name)}")
        if self.swa_layers and not self.swa_window:
            raise ValueError(
                f"swa_window: must be at least 1 with swa_layers={self.swa_layers} (the "
                "positions each SWA layer attends to)"
            )

    def with_swa(self, window: int, share: float) -> ModelShape:
        """Return this shape with a `share` of its attention layers as SWA layers.

        ``round(share * attention_layers)`` layers become SWA layers of `window`
        positions (added to any it has).

        Raises:
            ValueError: naming ``share`` outside [0, 1], or ``swa_window`` (see the
                class) when `window` is not at least 1 and a layer is made SWA.
        """
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share: must be in [0, 1], got {share}")
        moved = round(share * self.attention_layers)
        return replace(
            self,
            attention_layers=self.attention_layers - moved,
            swa_layers=self.swa_layers + moved,
            swa_window=window if moved or self.swa_layers else self.swa_window,
        )

    def token_flops(self) -> tuple[int, int]:
        """Return ``(a, b)``: a token at position ``p`` costs ``a + b * (p + 1)`` FLOPs.

        With SWA layers, plus ``swa_flops() * min(p + 1, swa_window)``.
        """
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 2 * d * (q + 2 * kv) + 2 * q * d  # Q, K, V; output
        bc = 2 * self.mamba_groups * self.mamba_state
        mamba = (
            2 * d * (2 * self.mamba_inner + bc + self.mamba_heads)  # input projection
            + 2 * self.conv_kernel * (self.mamba_inner + bc)  # convolution
            + 6 * self.mamba_inner * self.mamba_state  # state update and readout
            + 2 * self.mamba_inner * d  # output projection
        )
        mlp = 4 * d * self.mlp_hidden
        layers = self.attention_layers + self.swa_layers
        a = layers * attention + self.mamba_layers * mamba + self.mlp_layers * mlp
        b = self.attention_layers * 4 * q  # scores and values, per position attended
        return a, b

    def swa_flops(self) -> int:
        """Return the SWA layers' FLOPs per position attended (at most ``swa_window``)."""
        return self.swa_layers * 4 * self.heads * self.head_dim

    def prefill_flops(self, n: int) -> int:
        """FLOPs of computing the first `n` tokens of a sequence (positions ``0..n-1``)."""
        a, b = self.token_flops()
        # Sum over k = 1..n of min(k, W): a triangle up to the window, then W a token.
        w = min(n, self.swa_window)
        windowed = w * (w + 1) // 2 + (n - w) * self.swa_window
        return a * n + b * n * (n + 1) // 2 + self.swa_flops() * windowed


def compute_saved_ratio(served: Iterable[tuple[int, int]], shape: ModelShape) -> float:
    """Return the share of the no-cache prefill compute that hits saved.

    Args:
        served: ``(prompt_len, hit_len)`` per request: its prompt, and the tokens it did
            not compute (the prefix reused from the device, or loaded from the host).
        shape: The model.

    Returns:
        Sum of ``prefill_flops(hit_len)`` over sum of ``prefill_flops(prompt_len)``; 0.0
        when there is no prompt.
    """
    total = saved = 0
    for prompt_len, hit in served:
        total += shape.prefill_flops(prompt_len)
        saved += shape.prefill_flops(hit)
    return saved / total if total else 0.0
