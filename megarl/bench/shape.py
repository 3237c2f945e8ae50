"""The model shape of the benches that build a Llama-style model from arguments (trainer, packing, prox,
lora): the same six arguments and the same ModelDims, each bench with its own defaults."""

from __future__ import annotations

import argparse


def add_shape_args(p: argparse.ArgumentParser, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                   vocab: int, layers_help: str = "transformer layers", ffn_help: str | None = None,
                   vocab_help: str | None = None) -> None:
    """``--layers --hidden --ffn --heads --kv-heads --vocab`` with this bench's defaults (head_dim is
    hidden / heads)."""
    p.add_argument("--layers", type=int, default=layers, help=layers_help)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--ffn", type=int, default=ffn, help=ffn_help)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--vocab", type=int, default=vocab, help=vocab_help)


def llama_dims(a: argparse.Namespace, *, layers: int | None = None, max_positions: int = 2048, tied: bool = True):
    """The ModelDims of :func:`add_shape_args`' arguments (``layers`` overrides ``--layers``; ``--ffn 0``:
    4 x hidden)."""
    from megarl.models.layouts import ModelDims

    return ModelDims(family="llama", num_layers=layers or a.layers, hidden_size=a.hidden, num_heads=a.heads,
                     num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads, ffn_hidden_size=a.ffn or 4 * a.hidden,
                     vocab_size=a.vocab, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=max_positions, tie_word_embeddings=tied, qkv_bias=False)
