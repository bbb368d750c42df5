"""The prefill compute a cache hit saves: a per-layer FLOP model of a hybrid model's shape.

A prompt token at position ``p`` (0-based) costs, in a forward pass:

* each attention layer: the Q, K, V and output projections, constant per token, plus
  the scores and the weighted sum of values over the ``p + 1`` positions it attends
  to, which grow with ``p``;
* each Mamba-2 layer: the input and output projections, the short convolution and the
  state update and readout, all constant per token (the state has a fixed size);
* each MLP layer: constant per token.

So ``cost(p) = a + b * (p + 1)``, and a prompt's first ``n`` tokens cost
``a * n + b * n * (n + 1) / 2`` (`ModelShape.prefill_flops`). A hit on the first ``h``
tokens saves exactly the cost of those positions: ``compute_saved_ratio`` is the sum of
that over the requests, divided by the cost of every prompt computed from scratch.

The default shape is about that of an 8-billion-parameter hybrid such as NVIDIA's
Nemotron-H-8B: 4 attention, 24 Mamba-2 and 24 MLP layers at width 4,096. Few attention
layers make the per-token constant dominate (about 14 GFLOP a token against 65,536
FLOP per position attended), so at the built-in workloads' lengths compute saved is close
to the token hit rate, a little above it (deep tokens cost more).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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

    def token_flops(self) -> tuple[int, int]:
        """Return ``(a, b)``: a token at position ``p`` costs ``a + b * (p + 1)`` FLOPs."""
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
        a = self.attention_layers * attention + self.mamba_layers * mamba + self.mlp_layers * mlp
        b = self.attention_layers * 4 * q  # scores and values, per position attended
        return a, b

    def prefill_flops(self, n: int) -> int:
        """FLOPs of computing the first `n` tokens of a sequence (positions ``0..n-1``)."""
        a, b = self.token_flops()
        return a * n + b * n * (n + 1) // 2


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
