"""A tied embedding table quantized for serving: the token lookup and the logits' matmul read one int8 copy.

Why: with tied embeddings (Llama 3.2, Qwen2) the [vocab, embed] table is also the output projection, the largest
single matmul of a decode step (a 128k x 2048 table is 0.5 GB in bf16, a fifth of the 1.24B's bytes per step).
The values are the logits' `[embed, vocab]` output matmul, int8 with one float32 scale per vocabulary row (the
logits' output channel), so the logits are the per-channel int8 matmul of `weights.QuantizedWeight` (the fused
decode kernel included), and a lookup gathers rows and scales them (`rows`). int8 values are stored output
channels first (`QuantizedWeight.transposed`), which is the table's own [vocab, embed] layout: a token's row is
contiguous.
`serve.quantize_lm_head` turns it on (an untied `lm_head` [embed, vocab] becomes a plain `QuantizedWeight`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mmjax.quant.weights import QuantizedWeight, dequantize, quantize


@flax.struct.dataclass
class QuantizedTable:
    """The quantized [vocab, embed] table; `head` holds it as the int8 [embed, vocab] output matmul."""

    head: QuantizedWeight

    def __getitem__(self, key):
        """`param[...]` yields the container itself (what `nnx.Param.__getitem__` forwards here)."""
        if key is Ellipsis:
            return self
        raise TypeError("a QuantizedTable is only read whole (param[...])")

    @property
    def shape(self) -> tuple[int, int]:
        embed, vocab = self.head.shape
        return vocab, embed

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    def rows(self, tokens: jax.Array, dtype) -> jax.Array:
        """The dequantized embedding rows of `tokens` ([...] -> [..., embed]) in `dtype`."""
        if self.head.transposed:
            q = jnp.take(self.head.q, tokens, axis=0)                  # [..., embed]
        else:
            q = jnp.moveaxis(jnp.take(self.head.q, tokens, axis=1), 0, -1)
        scale = jnp.take(self.head.scale[0], tokens, axis=0)           # [...]
        return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)

    def quantized_einsum(self, spec: str, x: jax.Array, dtype, out_dtype=None) -> jax.Array:
        """einsum(spec, x, table) for a spec whose table operand is '<vocab letter><embed letter>' (the logits)."""
        ins, out = spec.replace(" ", "").split("->")
        xs, ws = ins.split(",")
        if len(ws) != 2:
            raise ValueError(f"a quantized table [vocab, embed] does not match einsum {spec!r}")
        return self.head.quantized_einsum(f"{xs},{ws[::-1]}->{out}", x, dtype, out_dtype)


def quantize_table(table: jax.Array) -> QuantizedTable:
    """[vocab, embed] float table -> int8 per vocabulary row, stored as the [embed, vocab] output matmul."""
    return QuantizedTable(quantize(jnp.asarray(table).T, "int8", n_contract=1))


def dequantize_table(t: QuantizedTable, dtype=jnp.float32) -> jax.Array:
    """The [vocab, embed] float table `t` stands for."""
    return dequantize(t.head).T.astype(dtype)
