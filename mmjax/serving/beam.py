"""Beam search inside the continuous-batching loop, step for step the algorithm of Hugging Face `generate(
num_beams=k, length_penalty=, early_stopping=)` (its vectorised beam search), for one request.

The request's prompt is prefilled once as an ordinary row. From its logits the search starts: each running
beam is then a row of the batch (a child `Request` whose outputs are the beam's tokens), and all of a
request's rows are scheduled in the same step. After each step every new beam is a `fork` of its parent's
page table (all pages shared by reference count) and the parents are freed, so a beam that survives alone
keeps its pages outright; the first write into a page still shared (the partly filled last page of a beam
with several children) copies it (`KVCacheManager.copy_on_write`, a device page copy in the runner). Pruned
and finished beams give their pages back at once.

Scores are float32, as in Hugging Face, so the same candidates win. A preempted beam search restarts from its
prompt (the prefix cache keeps the prompt's pages): the search is deterministic, so its result is the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mmjax.serving.kv_manager import KVCacheManager
from mmjax.serving.request import Request, RequestStatus

NEG = np.float32(-1.0e9)  # Hugging Face's "never pick this" score


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, largest first; ties keep the lower index first."""
    return np.argsort(-scores, kind="stable")[:k]


class BeamGroup:
    """The beam search state of one request: running beams (rows), the best finished hypotheses, and the
    early-stopping test. `rows` is empty while the prompt is prefilled (the request itself is the row)."""

    def __init__(self, request: Request, max_model_len: int) -> None:
        sp = request.sampling_params
        self.request = request
        self.width = sp.num_beams
        self.n = sp.n
        self.length_penalty = float(sp.length_penalty)
        self.early_stopping = sp.early_stopping
        self.eos = None if sp.ignore_eos else request.eos_token_id
        self.keep = max(2, 1 + (self.eos is not None)) * self.width  # candidates per step, as Hugging Face
        self.prompt_len = request.num_prompt_tokens
        self.max_length = min(self.prompt_len + sp.max_tokens, max_model_len)
        self._ids = 0
        self.results: list[tuple[list[int], float]] = []  # the n best (tokens, score) once done
        self.result_logprobs: list[list[float]] = []  # each result token's log-softmax, when it was chosen
        self.pending_copies: list[tuple[int, int]] = []
        self._reset()

    def _reset(self) -> None:
        self.rows: list[Request] = []
        self.scores = np.zeros(0, np.float32)  # running beam scores (sum of logprobs), best first
        self.row_logprobs: list[list[float]] = []  # per running row: its tokens' logprobs
        self.fin_tokens: list[list[int]] = [[] for _ in range(self.width)]
        self.fin_logprobs: list[list[float]] = [[] for _ in range(self.width)]
        self.fin_scores = np.full(self.width, NEG, np.float32)
        self.fin_done = np.zeros(self.width, bool)
        self.improvable = True  # Hugging Face's is_early_stop_heuristic_unsatisfied
        self.pending_copies = []

    @property
    def seq_cost(self) -> int:
        """Sequence slots the request may take at once."""
        return self.width

    def row_ids(self) -> list[str]:
        return [r.request_id for r in self.rows]

    # -- scheduling -------------------------------------------------------------------------------------------

    def allocate(self, kv: KVCacheManager) -> bool:
        """Room for one more token in every row, copying each row's write page it still shares; False when
        pages ran out (what was done stays done and is finished by the next call)."""
        for row in self.rows:
            if kv.allocate_slots(row, 1) is None:
                return False
            copy = kv.copy_on_write(row.request_id, row.num_computed_tokens)
            if copy is None:
                return False
            if copy is not True:
                self.pending_copies.append(copy)
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # -- one search step ----------------------------------------------------------------------------------

    def step(self, kv: KVCacheManager, candidates: Mapping[str, tuple[Sequence[int], Sequence[float]]]) -> bool:
        """Advance the search by one token from each row's top log-softmax candidates; returns True when the
        search is done (then `results` holds the n best and every row's pages are freed)."""
        rows = self.rows or [self.request]
        scores = self.scores if self.rows else np.zeros(1, np.float32)
        row_lps = self.row_logprobs if self.rows else [[]]
        cand_score, cand_row, cand_tok, cand_lp = [], [], [], []
        for j, row in enumerate(rows):
            ids, lps = candidates[row.request_id]
            if len(ids) < self.keep:
                raise ValueError(f"beam search needs {self.keep} candidates per row, got {len(ids)}")
            cand_lp.append(np.asarray(lps[:self.keep], np.float32))
            cand_score.append(cand_lp[-1] + scores[j])
            cand_row.append(np.full(self.keep, j))
            cand_tok.append(np.asarray(ids[:self.keep], np.int64))
        acc = np.concatenate(cand_score)
        flat = np.concatenate(cand_row) * (1 << 32) + np.concatenate(cand_tok)  # Hugging Face's flat index order
        order = np.lexsort((flat, -acc))[:self.keep]
        top, top_row, top_tok = acc[order], np.concatenate(cand_row)[order], np.concatenate(cand_tok)[order]
        top_lp = np.concatenate(cand_lp)[order]
        cur_len = self.prompt_len + (len(rows[0].output_token_ids) if self.rows else 0)
        hits = (top_tok == self.eos) | (cur_len + 1 >= self.max_length)

        # running beams of the next step: the best candidates that did not stop
        running = top + hits.astype(np.float32) * NEG
        nxt = _topk(running, self.width)
        # finished hypotheses: the stopping candidates among the top `width`, length-penalised
        just = hits & (np.arange(self.keep) < self.width)
        fin = top / np.float32((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        fin = fin + np.float32(bool(self.fin_done.all() and self.early_stopping is True)) * NEG
        fin = fin + np.float32(not self.improvable) * NEG
        fin = fin + (~just).astype(np.float32) * NEG
        merged = np.concatenate([self.fin_scores, fin])
        best = _topk(merged, self.width)
        tokens = [*self.fin_tokens, *([*rows[r].output_token_ids, int(t)] for r, t in zip(top_row, top_tok))]
        lps = [*self.fin_logprobs, *([*row_lps[r], float(lp)] for r, lp in zip(top_row, top_lp))]
        done_flags = np.concatenate([self.fin_done, just])
        self.fin_tokens = [list(tokens[i]) for i in best]
        self.fin_logprobs = [list(lps[i]) for i in best]
        self.fin_scores, self.fin_done = merged[best], done_flags[best]

        new_scores = running[nxt]
        cur_len += 1
        hyp_len = self.max_length - self.prompt_len if (self.early_stopping == "never" and self.length_penalty > 0) \
            else cur_len - self.prompt_len
        best_possible = new_scores[0] / np.float32(hyp_len ** self.length_penalty)
        worst = self.fin_scores.min() if self.fin_done.all() else NEG
        self.improvable = bool(self.improvable and (not self.fin_done.all() or best_possible > worst))
        go_on = self.improvable and not (self.fin_done.all() and self.early_stopping is True) and not hits.all()
        if not go_on:
            self.results = [(self.fin_tokens[i], float(self.fin_scores[i])) for i in range(self.n)]
            self.result_logprobs = [self.fin_logprobs[i] for i in range(self.n)]
            self.release(kv)
            return True
        # every new beam forks its parent's pages; then the old rows let theirs go
        new_rows, new_lps = [], []
        for i in nxt:
            new_lps.append([*row_lps[int(top_row[i])], float(top_lp[i])])
            parent = rows[int(top_row[i])]
            self._ids += 1
            child = Request(f"{self.request.request_id}#beam{self._ids}", self.request.prompt_token_ids,
                            self.request.sampling_params, eos_token_id=self.request.eos_token_id,
                            arrival_time=self.request.arrival_time)
            child.output_token_ids = [*parent.output_token_ids, int(top_tok[i])]
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            kv.fork(parent.request_id, child.request_id)
            new_rows.append(child)
        for row in rows:
            kv.free(row.request_id)
        self.rows, self.scores, self.row_logprobs = new_rows, new_scores, new_lps
        return False

    def finish(self) -> RequestStatus:
        """Put the best sequence in the request's outputs; its status (stopped at EOS, or the length)."""
        tokens = self.results[0][0]
        self.request.output_token_ids = list(tokens)
        if self.eos is not None and tokens and tokens[-1] == self.eos:
            self.request.stop_reason = self.eos
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH

    def release(self, kv: KVCacheManager) -> None:
        """Free every row's pages and start over (preemption) or end (finish, abort)."""
        for row in self.rows:
            kv.free(row.request_id)
        self._reset()
