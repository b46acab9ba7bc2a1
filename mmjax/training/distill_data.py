"""Self-distillation data for a draft model: the target's own continuations of prompts, generated through the
serving engine, one sequence per row.

A draft earns its keep when the target accepts its guesses, that is when it predicts what the target itself
writes; so the draft learns on the target's outputs (greedy ones, which greedy speculation verifies, and
sampled ones, which cover more of the target's behaviour), not on other text.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmjax.config import Config, SpeculativeConfig
from mmjax.errors import ConfigError
from mmjax.serving.engine import LLM
from mmjax.serving.request import SamplingParams

log = logging.getLogger(__name__)

PAGE_SIZE = 16
MIN_NEW_TOKENS = 8  # a prompt that leaves the sequence fewer tokens to generate is dropped


@dataclasses.dataclass
class Sequences:
    """Prompt + continuation token rows padded to one length, with where each row's prompt ends and which
    prompt it continues (rows of one prompt stay on one side of a train / held-out split)."""

    tokens: np.ndarray  # int32 [N, S], zero-padded
    lengths: np.ndarray  # int32 [N]: prompt + generated tokens
    prompt_lengths: np.ndarray  # int32 [N]
    prompt_ids: np.ndarray  # int32 [N]: the index of the prompt each row continues

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, rows: np.ndarray) -> Sequences:
        return Sequences(self.tokens[rows], self.lengths[rows], self.prompt_lengths[rows], self.prompt_ids[rows])

    def generated(self) -> np.ndarray:
        """bool [N, S]: positions whose next token is a generated one (the predictions a draft makes when it
        speculates after the prompt)."""
        t = np.arange(self.tokens.shape[1])[None]
        return (t >= self.prompt_lengths[:, None] - 1) & (t < self.lengths[:, None] - 1)


def pad_rows(rows: Sequence[Sequence[int]], prompt_lengths: Sequence[int], prompt_ids: Sequence[int],
             seq_len: int) -> Sequences:
    """`rows` (each cut to `seq_len` tokens) as a `Sequences` of width `seq_len`."""
    tokens = np.zeros((len(rows), seq_len), np.int32)
    lengths = np.zeros(len(rows), np.int32)
    for i, row in enumerate(rows):
        row = list(row)[:seq_len]
        tokens[i, :len(row)] = row
        lengths[i] = len(row)
    return Sequences(tokens, lengths, np.minimum(np.asarray(prompt_lengths, np.int32), lengths),
                     np.asarray(prompt_ids, np.int32))


def generation_config(cfg: Config, seq_len: int, max_num_seqs: int) -> Config:
    """`cfg` with a serving section sized for generating rows of `seq_len` tokens, `max_num_seqs` at a time: a
    pool of exactly that many sequences (not sized from the device's memory, which the distillation needs), no
    speculation, beams or top logprobs, the prefix cache on (a prompt's samples share its KV). Few step shapes
    (every step padded to at least `max_num_seqs` tokens and slots) and scanned layers: a one-off batch job
    pays its compiles, which the unrolled layers and small buckets of a server would multiply."""
    if seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"sequence length {seq_len} exceeds the target's model.max_seq_len="
                          f"{cfg.model.max_seq_len}; pass a shorter one")
    pages = -(-seq_len // PAGE_SIZE)
    budget = max(cfg.serve.max_num_batched_tokens, max_num_seqs, 1024)
    serve = dataclasses.replace(cfg.serve, page_size=PAGE_SIZE, max_model_len=seq_len, max_num_seqs=max_num_seqs,
                                num_pages=1 + max_num_seqs * pages, max_num_batched_tokens=budget,
                                min_token_bucket=max_num_seqs, min_slot_bucket=max_num_seqs, unroll_layers=False,
                                max_beam_width=0, max_logprobs=0, enable_prefix_caching=True,
                                speculative=SpeculativeConfig())
    return dataclasses.replace(cfg, serve=serve)


def generate_sequences(cfg: Config, model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], *, seq_len: int,
                       samples: int = 4, greedy_samples: int = 1, temperature: float = 0.8, seed: int = 0,
                       max_num_seqs: int = 64) -> Sequences:
    """The target's continuations of `prompts` (token ids), up to `seq_len` tokens per row (prompt included) or
    the tokenizer's end of sequence: per prompt `greedy_samples` greedy rows (at most one: greedy rows are all
    the same) and `samples - greedy_samples` drawn at `temperature`, each with its own seed. A prompt that
    leaves fewer than `MIN_NEW_TOKENS` tokens to generate is dropped."""
    if samples < 1 or not 0 <= greedy_samples <= min(samples, 1):
        raise ConfigError(f"samples={samples}, greedy_samples={greedy_samples}: need samples >= 1 and greedy "
                          "samples 0 or 1 (greedy continuations of a prompt are all the same)")
    if temperature <= 0 and samples > greedy_samples:
        raise ConfigError(f"temperature={temperature}: sampled continuations need a temperature > 0")
    kept = [i for i, p in enumerate(prompts) if seq_len - len(p) >= MIN_NEW_TOKENS]
    if len(kept) < len(prompts):
        log.warning("dropped %d of %d prompts that leave under %d of the %d tokens of a row to generate",
                    len(prompts) - len(kept), len(prompts), MIN_NEW_TOKENS, seq_len)
    if not kept:
        raise ConfigError(f"no prompt is shorter than the sequence length {seq_len} by {MIN_NEW_TOKENS} tokens; "
                          "pass a longer sequence length")
    requests, params, owners = [], [], []
    for i in kept:
        room = seq_len - len(prompts[i])
        for s in range(samples):
            greedy = s < greedy_samples
            requests.append(list(prompts[i]))
            params.append(SamplingParams(max_tokens=room, temperature=0.0 if greedy else temperature,
                                         seed=None if greedy else seed * 1_000_003 + i * samples + s))
            owners.append(i)
    llm = LLM(generation_config(cfg, seq_len, max_num_seqs), model, tokenizer)
    outputs = llm.generate(requests, params)
    del llm  # its KV pool: the distillation needs the memory
    return pad_rows([list(p) + list(o.token_ids) for p, o in zip(requests, outputs)],
                    [len(p) for p in requests], owners, seq_len)


def split_by_prompt(seqs: Sequences, held_out: set[int]) -> tuple[Sequences, Sequences]:
    """(train, held-out) rows: the rows of prompts in `held_out` and the others."""
    mask = np.isin(seqs.prompt_ids, sorted(held_out))
    return seqs.take(np.flatnonzero(~mask)), seqs.take(np.flatnonzero(mask))
