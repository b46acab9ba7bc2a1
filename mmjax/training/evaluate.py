"""Held-out evaluation: greedy answers from the serving engine (what is scored is what is served), scored by
exact match per question type."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mmjax.config import Config, ServeConfig
from mmjax.kernels import MeshSharding
from mmjax.serving.engine import Engine
from mmjax.serving.request import SamplingParams

log = logging.getLogger(__name__)


def eval_serve_config(cfg: Config, max_prompt_len: int) -> ServeConfig:
    """`cfg.serve` with the keys the user left at their defaults sized for evaluation: requests of
    `max_prompt_len + eval.max_new_tokens` tokens (at most `model.max_seq_len`), `eval.batch_size` of them at
    once, the pool holding all of them (no preemption) and one step prefilling them all; no logprobs and no
    beam-search candidates. Every step pads to at least `eval.batch_size` slots and tokens, so as requests stop
    at EOS no smaller shapes compile: a few shapes in all, compiled on the first evaluation (the old fixed-batch
    loop did the same padded work). The layers keep the run's scan: unrolled layers would need a copy of every
    weight beside the training state."""
    default, serve = ServeConfig(), cfg.serve
    want = max_prompt_len + cfg.eval.max_new_tokens
    max_len = min(want, cfg.model.max_seq_len)
    if max_len < want and serve.max_model_len == default.max_model_len:
        log.warning("evaluation: prompt (%d) + eval.max_new_tokens (%d) exceeds model.max_seq_len=%d; answers "
                    "stop there", max_prompt_len, cfg.eval.max_new_tokens, cfg.model.max_seq_len)
    sized = {"max_model_len": max_len, "max_num_seqs": cfg.eval.batch_size}
    model_len = serve.max_model_len or max_len
    seqs = serve.max_num_seqs if serve.max_num_seqs != default.max_num_seqs else cfg.eval.batch_size
    sized["num_pages"] = 1 + seqs * -(-model_len // serve.page_size)  # page 0 is the null page
    sized["max_num_batched_tokens"] = max(seqs * max_prompt_len, seqs)
    sized["max_logprobs"] = sized["max_beam_width"] = 0  # greedy answers: no top-k candidates per step
    sized["min_slot_bucket"] = sized["min_token_bucket"] = seqs
    sized["unroll_layers"] = False  # the engine shares the trainer's stacked arrays: unrolling would copy them
    return dataclasses.replace(serve, **{k: v for k, v in sized.items()
                                         if getattr(serve, k) == getattr(default, k)})


def make_eval_engine(cfg: Config, graphdef: nnx.GraphDef, params: Any, tokenizer: Any, eval_set: Any,
                     mesh: Mesh | None = None, sharding: MeshSharding | None = None) -> Engine:
    """The run's evaluation engine, built once: its steps compile on the first evaluation and are reused
    with each evaluation's parameters (`Engine.update_weights`), traced inside the run's `sharding` context."""
    serve = eval_serve_config(cfg, int(np.max(eval_set.prompt_lens, initial=1)))
    return Engine(dataclasses.replace(cfg, serve=serve), (graphdef, params), tokenizer, mesh=mesh,
                  sharding=sharding)


def normalize_answer(text: str) -> str:
    """Exact match ignores case and runs of whitespace."""
    return " ".join(text.lower().split())


def exact_match_scores(predictions: list[str], answers: list[str], qtypes: list[str]) -> dict[str, float]:
    """`eval/exact_match` overall and `eval/exact_match/<qtype>` (whitespace- and case-insensitive).

    Plain Python, not a `clu.metrics` collection: the hits come from comparing strings on the host, once per
    evaluation, so a device-side accumulator would only add transfers."""
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
    """Generates every eval prompt greedily through `engine` (`eval.max_new_tokens` tokens, stopping at EOS),
    `batch_size` requests at a time, and scores the answers.

    Every process of a multi-process run submits the same requests: the scheduler is deterministic, so all
    run the same jitted steps in lockstep, and the sampled tokens come back replicated to every host.
    """

    def __init__(self, eval_set: Any, tokenizer: Any, engine: Engine, batch_size: int, max_new_tokens: int):
        self.eval_set = eval_set
        self.tokenizer = tokenizer
        self.engine = engine
        self.batch_size = batch_size
        self.sampling = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)

    def requests(self, i: int) -> tuple[list[int], list[np.ndarray]]:
        """Example i's prompt token ids and its (normalised) images."""
        es = self.eval_set
        prompt = es.tokens[i, :es.prompt_lens[i]].tolist()
        images = [] if self.engine.model_cfg.text_only else list(es.images[i][es.image_valid[i].astype(bool)])
        return prompt, images

    def generate(self, params: Any) -> list[list[int]]:
        """Greedy output token ids of every eval example with `params` (EOS included when it stopped there)."""
        engine = self.engine
        engine.update_weights(params)
        out: list[list[int]] = []
        n = len(self.eval_set)
        for start in range(0, n, self.batch_size):
            ids = []
            for i in range(start, min(start + self.batch_size, n)):
                prompt, images = self.requests(i)
                ids.append(engine.add_request(prompt, images, self.sampling, request_id=f"eval-{i}"))
            done: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = o.token_ids
            out.extend(done[rid] for rid in ids)
        return out

    def run(self, params: Any) -> tuple[dict[str, float], list[str]]:
        predictions = [self.tokenizer.decode(ids) for ids in self.generate(params)]
        scores = exact_match_scores(predictions, self.eval_set.answers, self.eval_set.qtypes)
        scores["eval/baseline_majority"] = float(self.eval_set.baseline_majority)
        scores["eval/baseline_type_majority"] = float(self.eval_set.baseline_type_majority)
        return scores, predictions
