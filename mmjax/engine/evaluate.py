"""Held-out evaluation: greedy answers from the KV-cache decode path, scored by exact match per question type."""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from mmjax.engine.steps import MODEL_INPUTS
from mmjax.kernels import MeshSharding
from mmjax.parallel.rules import batch_sharding
from mmjax.parallel.sharding import in_sharding_context
from mmjax.serving.generate import greedy_generate


def make_generate_fn(graphdef: nnx.GraphDef, *, max_new_tokens: int, eos_id: int, pad_id: int,
                     sharding: MeshSharding | None = None) -> Callable:
    """Jitted greedy generation, traced inside the run's `sharding` context (the train step's), so on a
    mesh the activations follow the rules and the custom kernels run per shard instead of replicated."""

    def generate(params: Any, prompt: dict[str, jax.Array]) -> jax.Array:
        return greedy_generate(nnx.merge(graphdef, params), prompt, max_new_tokens=max_new_tokens,
                               eos_id=eos_id, pad_id=pad_id)

    return jax.jit(in_sharding_context(generate, sharding))


def normalize_answer(text: str) -> str:
    """Exact match ignores case and runs of whitespace."""
    return " ".join(text.lower().split())


def exact_match_scores(predictions: list[str], answers: list[str], qtypes: list[str]) -> dict[str, float]:
    """`eval/exact_match` overall and `eval/exact_match/<qtype>` (whitespace- and case-insensitive)."""
    hits = [normalize_answer(p) == normalize_answer(a) for p, a in zip(predictions, answers, strict=True)]
    out = {"eval/exact_match": float(np.mean(hits)) if hits else 0.0}
    by_type: dict[str, list[bool]] = collections.defaultdict(list)
    for hit, qtype in zip(hits, qtypes):
        by_type[qtype].append(hit)
    for qtype in sorted(by_type.keys() - {""}):  # user datasets have no question types
        out[f"eval/exact_match/{qtype}"] = float(np.mean(by_type[qtype]))
    return out


def write_predictions(path: str | Path, eval_set: Any, predictions: list[str]) -> None:
    """One JSON line per held-out example (id, qtype, answer, prediction, hit): what a score hides."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, (pred, answer) in enumerate(zip(predictions, eval_set.answers, strict=True)):
            row = {"id": eval_set.ids[i], "qtype": eval_set.qtypes[i], "answer": answer, "prediction": pred,
                   "hit": normalize_answer(pred) == normalize_answer(answer)}
            f.write(json.dumps(row) + "\n")


class Evaluator:
    """Runs `generate` over the eval set in fixed-size batches (padded so every batch compiles once)."""

    def __init__(self, eval_set: Any, tokenizer: Any, generate: Callable, mesh: Mesh, batch_size: int,
                 data_parallel: int):
        self.eval_set = eval_set
        self.tokenizer = tokenizer
        self.generate = generate
        self.mesh = mesh
        self.batch_size = -(-batch_size // data_parallel) * data_parallel

    def run(self, params: Any) -> tuple[dict[str, float], list[str]]:
        predictions: list[str] = []
        for batch, rows in self.eval_set.batches(self.batch_size):
            prompt = {k: jax.device_put(batch[k], batch_sharding(self.mesh, batch[k].ndim))
                      for k in MODEL_INPUTS if k in batch}  # text-only batches have no images
            out = self.generate(params, prompt)
            # multi-process: the answers span every process's devices; gather them to each host
            out = multihost_utils.process_allgather(out, tiled=True) if not out.is_fully_addressable else out
            out = np.asarray(jax.device_get(out))[:rows]
            predictions.extend(self.tokenizer.decode(row.tolist()) for row in out)
        scores = exact_match_scores(predictions, self.eval_set.answers, self.eval_set.qtypes)
        scores["eval/baseline_majority"] = float(self.eval_set.baseline_majority)
        return scores, predictions
