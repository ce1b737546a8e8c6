"""A character-level GPT: a small decoder-only transformer (the README's language-model example).

The architecture of GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", section 2.3): token and learned position embeddings, ``layers`` pre-LayerNorm
blocks of causal multi-head self-attention (Vaswani et al. 2017, "Attention Is All You Need",
section 3.2) and a 4x-wide GELU MLP, each added to the residual stream, a final LayerNorm and a
linear head to the vocabulary. Weights start as GPT-2's: N(0, 0.02), the residual projections
scaled by 1/sqrt(2 x layers). No dropout: a step's gradient is then a function of the
parameters and the batch alone, so data-parallel training equals one process on the global
batch.

Shapes: B sequences, T positions (T <= ``block``), C = ``dim`` channels, H heads, V tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """Attend over the preceding positions: [B, T, C] float32 -> [B, T, C]."""
        b, t, c = x_BTC.shape
        q, k, v = self.qkv(x_BTC).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C / H]
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        """[B, T, C] float32 -> [B, T, C]."""
        x_BTC = x_BTC + self.attn(self.ln1(x_BTC))
        out: torch.Tensor = x_BTC + self.mlp(self.ln2(x_BTC))
        return out


class CharGPT(nn.Module):
    """Tokens [B, T] int64 -> next-token logits [B, T, V] float32.

    ``blocks`` is the list of transformer blocks (what activation checkpointing recomputes).
    """

    def __init__(self, vocab: int, block: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.apply(_init_weights)
        for blk in self.blocks:
            assert isinstance(blk, Block)
            for proj in (blk.attn.proj, blk.mlp[2]):
                assert isinstance(proj, nn.Linear)
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position.

        Args:
            tokens_BT: [B, T] int64 token ids in [0, V), T <= ``block``.

        Returns:
            [B, T, V] float32 logits; position t depends on tokens 0..t only.

        Raises:
            ValueError: T is longer than the model's ``block``.
        """
        t = tokens_BT.shape[1]
        if t > self.block:
            raise ValueError(f"sequence of {t} tokens is longer than block {self.block}")
        positions = torch.arange(t, device=tokens_BT.device)
        x_BTC = self.tok(tokens_BT) + self.pos(positions)
        for blk in self.blocks:
            x_BTC = blk(x_BTC)
        logits_BTV: torch.Tensor = self.head(self.ln(x_BTC))
        return logits_BTV


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases, LayerNorm as torch's."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def char_gpt(
    vocab: int = 97, block: int = 64, dim: int = 64, heads: int = 4, layers: int = 2
) -> nn.Module:
    """A character-level GPT (the entry point ``examples.char_gpt:char_gpt``).

    Args:
        vocab: V, the token ids' range (``examples.prepare``'s characters: 97).
        block: the longest sequence it reads, positions.
        dim: C, the width of the residual stream.
        heads: attention heads, dividing ``dim``.
        layers: transformer blocks.

    Returns:
        A ``CharGPT`` mapping [B, T] int64 tokens to [B, T, V] float32 logits.

    Raises:
        ValueError: ``dim`` is not a multiple of ``heads``.
    """
    return CharGPT(vocab, block, dim, heads, layers)
