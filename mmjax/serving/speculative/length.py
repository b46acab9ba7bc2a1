"""The adaptive draft length rule (`serve.speculative.adaptive`), shared by the host's `DraftLength` and the
device's speculative rounds (`StepPrograms.spec_rounds_step`), which adapt k after every round inside one call."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def next_draft_length(k: Any, drafted: Any, accepted: Any, max_k: int) -> Any:
    """`DraftLength`'s rule: k + 1 (at most max_k) after a step that accepted all of its drafted tokens, k - 1 (at
    least 1) after one that accepted under half, else k; a step that drafted nothing keeps k. Python ints or
    (with the proposer on the device, per round inside the call) jax arrays."""
    if isinstance(k, int):
        if drafted and accepted == drafted:
            return min(max_k, k + 1)
        return max(1, k - 1) if drafted and 2 * accepted < drafted else k
    some = drafted > 0
    return jnp.where(some & (accepted == drafted), jnp.minimum(max_k, k + 1),
                     jnp.where(some & (2 * accepted < drafted), jnp.maximum(1, k - 1), k))
