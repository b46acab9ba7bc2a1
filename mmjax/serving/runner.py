"""Model runner: turns a `SchedulerOutput` into one jitted forward + sample over the paged KV pool.

The host builds flat numpy arrays (tokens, positions, KV slots, page tables, image rows) padded to a fixed
(token, slot) bucket, so a small set of shapes compiles once (`warmup`) and serving never recompiles. The
KV pools are donated to the step, so XLA updates them in place. Images are encoded once (ViT + projector) and
kept in an LRU keyed by content hash; each step gathers the rows its image placeholder tokens need.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.config import ServeConfig
from mmjax.kernels import MeshSharding, kv_head_axes, pool_spec
from mmjax.model.decoder import PagedMeta
from mmjax.parallel.sharding import in_sharding_context
from mmjax.quant import quantize_state
from mmjax.quant.kv import kv_cache_dtype
from mmjax.serving.buckets import auto_decode_steps, buckets, pick_bucket
from mmjax.serving.images import ImageCache, ImageInput
from mmjax.serving.kv_manager import NULL_PAGE
from mmjax.serving.request import PLACEHOLDER_TOKEN, Request
from mmjax.serving.sampling import SamplingTensors, full_sampler_history, sample
from mmjax.serving.scheduler import SchedulerOutput
from mmjax.serving.sizing import size_serving
from mmjax.serving.speculative.device_ngram import DeviceHistory, append_tokens, place_drafts, propose_drafts, set_rows
from mmjax.serving.speculative.draft_device import CATCH_UP, run_draft
from mmjax.serving.speculative.length import next_draft_length
from mmjax.serving.speculative.verify import verify
from mmjax.serving.step_types import PendingStep, RequestState, SampledToken
from mmjax.serving.transfer import PackedStep, pack
from mmjax.serving.unroll import serving_layout


class ModelRunner:
    """Owns the parameters and the KV pools and runs one step per `execute`.

    `model` is an `MLLM` (or a (graphdef, state) pair of one). The step samples with `sampling.sample`,
    returning `serve.max_logprobs` top logprobs per token. The sampler's token history (for penalties) is
    either empty or `max_model_len` long, so each (token, slot) bucket has two shapes, both compiled by
    `warmup()`. `num_compiles` counts traces of the step and of the image encoder: it stays put after warm-up.

    On a `mesh` the host inputs and the sampled outputs are replicated over it (every process of a multi-process
    run feeds the same inputs and reads every token) and the pools are split over the context's head axes on
    their kv-head dim; the step and encoder are traced inside `sharding` (the run's sharding context, the train
    step's), so the model's layouts follow its rules.
    `update_weights` swaps in new parameters of the same shapes without recompiling. A scanned model's layers are
    served unrolled over per-layer weights unless `serve.unroll_layers` is off (`serving/unroll.py`).
    """

    def __init__(self, model: Any, serve: ServeConfig, *, max_model_len: int,
                 mesh: jax.sharding.Mesh | None = None, sharding: MeshSharding | None = None) -> None:
        graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
        self._given_graphdef = graphdef  # update_weights converts new weights of this form the same way
        self.graphdef, self.state = serving_layout(graphdef, state, serve.unroll_layers)
        # none: unchanged; pre-quantized: kept
        self.state = quantize_state(self.state, serve.quantization, lm_head=serve.quantize_lm_head,
                                    group=serve.quant_group)
        abstract = nnx.merge(self.graphdef, self.state)
        self.model_cfg = abstract.cfg
        self.image_token_id = abstract.image_token_id
        self.text_only = abstract.text_only
        self.use_blocks = not self.text_only and self.model_cfg.image_attention == "bidirectional"
        kv_dtype = kv_cache_dtype(serve.kv_cache_dtype, abstract.compute_dtype)
        if mesh is None and sharding is not None:
            mesh = sharding.mesh
        # next to parameters placed on a mesh: inputs and outputs replicated over it; the pools split over the
        # context's head axes on their kv-head dim (each device holds its heads' KV), else replicated too
        self._replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        pool_sharding = None
        if mesh is not None:
            heads = kv_head_axes(sharding, self.model_cfg.text.n_kv_heads, self.model_cfg.text.n_heads)
            pool_sharding = jax.sharding.NamedSharding(mesh, pool_spec(heads))
        # serve.num_pages / max_num_seqs left at 0: sized from the device memory left beside the weights
        serve = size_serving(serve, self.model_cfg, max_model_len=max_model_len, sharding=pool_sharding,
                             pools_of_one_page=jax.eval_shape(lambda: abstract.decoder.init_pools(
                                 1, serve.page_size, kv_dtype)), devices=self._memory_devices(mesh))
        self.serve = serve
        self.page_size = serve.page_size
        self.max_pages = -(-max_model_len // serve.page_size)
        self.token_buckets = buckets(serve.min_token_bucket, serve.max_num_batched_tokens)
        self.max_slots = serve.max_num_seqs
        self.max_model_len = max_model_len
        self.num_logprobs = max(serve.max_logprobs, 2 * serve.max_beam_width)  # beam search's candidates
        self.spec_k = serve.speculative.num_tokens if serve.speculative.method != "none" else 0
        on_device = bool(self.spec_k) and serve.speculative.proposer_on_device
        # a draft model's drafts come with probabilities (else they are one-hot guesses): from the draft
        # proposer's device bank, or, with the proposer on the device, drawn in the step itself
        self.spec_draft_probs = serve.speculative.method == "draft" and not on_device
        # serve.speculative.proposer_on_device with ngram: the verifying step proposes itself, from token histories
        # kept on the device (one row per speculating request), and appends the tokens it emits to them
        self.history = (DeviceHistory(serve.max_num_seqs, max_model_len, put=self._put)
                        if on_device and serve.speculative.method == "ngram" else None)
        # ... with draft: the verifying step runs the draft model's k steps first (`attach_draft` gives the draft)
        self.fused_draft = on_device and serve.speculative.method == "draft"
        self.draft: ModelRunner | None = None
        self._ngram = dict(k=self.spec_k, n_min=serve.speculative.ngram_min, n_max=serve.speculative.ngram_max)
        # serve.speculative.rounds: speculative rounds per call when every running request speculates (n-gram on
        # the device only, the config checks); one round is the verifying step itself
        self.spec_rounds = serve.speculative.rounds if self.history is not None else 1
        # dynamic speculation: steps without proposals take the plain fast paths (decode and multi-step calls)
        self.spec_dynamic = bool(self.spec_k) and serve.speculative.dynamic
        self._seed_rng = np.random.default_rng(serve.seed)
        self.seeds: dict[str, int] = {}  # drawn once per unseeded random-sampling request
        self.embed_dim = self.model_cfg.text.dim
        self.embed_dtype = abstract.compute_dtype
        # made where they live (on a mesh each device makes its own heads' pages: never the whole pool on one)
        self._pools_from: Future | None = None  # the launcher thread's call that returns the current pools
        self._from_fused = False  # ... and the token histories with them (a call of the n-gram proposing step)
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="mmjax-launch") if serve.launch_thread else None
        self.pools = jax.jit(lambda: abstract.decoder.init_pools(serve.num_pages, serve.page_size, kv_dtype),
                             out_shardings=pool_sharding)()
        self.image_cache = ImageCache(serve.image_cache_size)
        self.num_compiles = 0
        self.num_steps = 0
        self._requests: dict[str, RequestState] = {}
        self._zero_rows: dict[int, jax.Array] = {}
        self._zero_bank: jax.Array | None = None
        rep = self._replicated
        out = None if mesh is None else (rep, pool_sharding)  # (sampled outputs, pools)
        wrap = lambda fn: in_sharding_context(fn, sharding)  # noqa: E731
        # small host inputs in two buffers and the outputs in one (see transfer.py); `_step_fn`'s third output
        # stays on the device (the sampled tokens, for the next step's inputs; DraftRunner's probabilities)
        # (with the proposer on the device the step's pools come with the token histories, replicated)
        carry = pool_sharding if self.history is None else (pool_sharding, rep)
        self._step = PackedStep(self._step_fn, wrap=wrap, put=self._put,
                                out_shardings=None if out is None else (rep, carry, rep))
        self._copy = jax.jit(self._copy_fn, donate_argnums=(0,), out_shardings=pool_sharding)
        self._upload = jax.jit(self._upload_fn, donate_argnums=(0,), out_shardings=rep)  # history rows
        # multi-step decode; not with speculation always on (its steps verify drafts) nor in its draft runner
        self.decode_steps = (auto_decode_steps(serve.decode_steps)
                             if serve.speculative.method == "none" or self.spec_dynamic else 1)
        self._multi = PackedStep(self._multi_step_fn, wrap=wrap, put=self._put,
                                 out_shardings=None if out is None else (*out, rep))
        # a call that prefills also decodes decode_steps tokens for its decoding requests (the ragged step, then
        # decode steps); not with speculation (its steps verify drafts)
        self.mixed_steps = self.decode_steps > 1 and not self.spec_k and serve.mixed_decode_steps
        self._mixed = PackedStep(self._mixed_step_fn, wrap=wrap, put=self._put,
                                 out_shardings=None if out is None else (*out, rep))
        self._decode = PackedStep(self._decode_step_fn, wrap=wrap, put=self._put,
                                  out_shardings=None if out is None else (*out, rep))
        self._rounds = PackedStep(self._spec_rounds_fn, wrap=wrap, put=self._put,
                                  out_shardings=None if out is None else (rep, carry, rep))
        self._no_last = self._put(jnp.zeros(self.max_slots, jnp.int32))  # an unchained call's "previous tokens"
        # calls fed on the device by the call launched before them, while it ran: chained multi-step calls
        # (Scheduler.schedule_chained) and overlapped steps (Scheduler.advance)
        self.num_chained = 0
        self.num_mixed = 0  # mixed calls: a ragged step that prefills, then decode steps (`_mixed_step_fn`)
        self._encode = jax.jit(in_sharding_context(self._encode_fn, sharding), out_shardings=rep)

    def _memory_devices(self, mesh: jax.sharding.Mesh | None) -> list[Any]:
        """The devices whose free memory sizes the pool: this process's devices of the mesh, else the weights'."""
        if mesh is not None:
            return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        leaves = jax.tree.leaves(self.state)
        return sorted(leaves[0].devices(), key=lambda d: d.id) if leaves and hasattr(leaves[0], "devices") \
            else jax.local_devices()[:1]

    def slots_for(self, tokens: int) -> int:
        """Sequence slots of the step shape whose token bucket is `tokens`: as many as tokens (a step has at
        least one token per sequence), at least `min_slot_bucket`, at most `max_num_seqs`. One slot count per
        token bucket keeps the compiled shapes few (a server's warm-up compiles each); padding slots cost little,
        since a step's logits and sampling are a small part of reading the weights."""
        return min(max(tokens, self.serve.min_slot_bucket), self.max_slots)

    @property
    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, slots) shape a step can take; `warmup` compiles each."""
        return [(t, self.slots_for(t)) for t in self.token_buckets]

    def step_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (tokens, slots) shape a step of `num_tokens` tokens over `num_seqs` sequences pads to."""
        t = pick_bucket(self.token_buckets, max(num_tokens, num_seqs))
        if num_seqs > self.slots_for(t):
            raise ValueError(f"{num_seqs} sequences exceed the step's {self.slots_for(t)} slots (max_num_seqs)")
        return t, self.slots_for(t)

    def update_weights(self, state: Any) -> None:
        """Serve `state` from now on (e.g. the trainer's current parameters): same tree, shapes and dtypes, so
        nothing recompiles. Encoded images of the old weights are dropped; the caller resets the prefix cache.
        Float weights are quantized as at construction (`serve.quantization`)."""
        state = quantize_state(serving_layout(self._given_graphdef, state, self.serve.unroll_layers)[1],
                               self.serve.quantization, lm_head=self.serve.quantize_lm_head,
                               group=self.serve.quant_group)
        old = jax.tree.map(lambda x: (x.shape, x.dtype), self.state)
        new = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        if jax.tree.structure(old) != jax.tree.structure(new) or jax.tree.leaves(old) != jax.tree.leaves(new):
            raise ValueError("update_weights needs the parameters' tree, shapes and dtypes unchanged")
        self.state = state
        self.image_cache = ImageCache(self.serve.image_cache_size)

    @property
    def state(self) -> Any:
        """The served parameters (an nnx State)."""
        return self._state

    @state.setter
    def state(self, state: Any) -> None:
        # the jitted functions take the flat list of leaves: a State is a Python pytree, and flattening it in
        # every call costs more host time than the rest of a step's dispatch
        self._state = state
        self._leaves, self._treedef = jax.tree.flatten(state)

    def _model(self, leaves: Any) -> Any:
        """The model over the parameter leaves a jitted function was given (while tracing)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, leaves))

    def _put(self, tree: Any) -> Any:
        """Host inputs replicated over the mesh (the same value on every process), else as they are."""
        return tree if self._replicated is None else jax.device_put(tree, self._replicated)

    # -- traced functions ---------------------------------------------------------------------------------

    def _step_fn(self, state, pools, batch, sampling):
        """One step; returns (tokens, logprobs, top-k[, speculative results]), the pools, and the sampled tokens
        [max_num_seqs] kept on the device. Input token j with chain_src[j] >= 0 is `prev_tokens[chain_src[j]]`,
        the previous step's sample of that slot, still on the device (overlapped scheduling).

        With the proposer on the device, `pools` is (pools, token histories): each speculating slot first looks
        up its drafts in its history row and writes them into its reserved draft positions, the step verifies
        them, and the tokens it emits are appended to the row; a slot that found none emits the plain sample.
        With the draft model on the device, `state` is (target leaves, draft leaves) and `pools` (pools, draft
        pools): each slot with reserved draft positions first runs the draft's k steps (`run_draft`), which fill
        them, and the step verifies them against the draws' probabilities."""
        self.num_compiles += 1  # runs only while tracing
        history = draft_pools = None
        if self.history is not None:
            pools, history = pools
        if self.draft is not None:
            (state, draft_state), (pools, draft_pools) = state, pools
        model = self._model(state)
        tokens, sampling = self._chained_inputs(batch, sampling, batch["query_start"])
        if history is not None:  # the drafts, from the histories already on the device
            reserved = batch["num_draft"]
            drafts, num_draft = propose_drafts(history, batch["hist_row"], batch["hist_len"], reserved,
                                               **self._ngram)
            tokens = place_drafts(tokens, batch["query_start"] + batch["query_len"] - reserved, reserved, drafts,
                                  num_draft)
        elif draft_pools is not None:  # the draft model's k steps, over its own pools
            num_draft = batch["num_draft"]
            drafts, draft_q, draft_pools = run_draft(
                self.draft._model(draft_state), draft_pools, sampling, batch["draft_tokens"], batch["draft_start"],
                batch["draft_table"], num_draft, k=self.spec_k, page_size=self.draft.page_size)
            tokens = place_drafts(tokens, batch["query_start"] + batch["query_len"] - num_draft, num_draft, drafts,
                                  num_draft)
        elif self.spec_k:
            drafts, num_draft = batch["drafts"], batch["num_draft"]
        logits, pools = self._ragged_forward(model, pools, batch, tokens)
        spec = ()
        if self.spec_k:  # logits of every row's last known token and its drafts: [S * (k + 1), V]
            s = batch["num_draft"].shape[0]
            logits = logits.reshape(s, self.spec_k + 1, -1)
            q = batch["draft_bank"][batch["draft_rows"]] if "draft_bank" in batch else None  # [S, k, V]
            if draft_pools is not None:
                q = draft_q
            spec = verify(logits, sampling, drafts, num_draft, q)
            logits = logits[jnp.arange(s), num_draft]
        r = sample(logits, sampling, self.num_logprobs)
        if history is not None:
            emitted, count, lps = spec
            none = num_draft == 0  # nothing proposed: the plain sampler's token, as a step without drafts
            emitted = emitted.at[:, 0].set(jnp.where(none, r.tokens, emitted[:, 0]))
            lps = lps.at[:, 0].set(jnp.where(none, r.logprobs, lps[:, 0]))
            spec = (emitted, count, lps, num_draft)
            pools = (pools, append_tokens(history, batch["hist_row"], batch["hist_len"], emitted, count))
        if draft_pools is not None:
            pools = (pools, draft_pools)
        kept = jnp.zeros(self.max_slots, jnp.int32).at[:r.tokens.shape[0]].set(r.tokens)
        return (r.tokens, r.logprobs, r.top_ids, r.top_logprobs, *spec), pools, kept

    @staticmethod
    def _ragged_forward(model, pools, batch, tokens):
        """The model over a ragged step's flat tokens (prefill chunks, decode tokens, image rows): the logits at
        `logits_indices` and the pools with the step's KV written."""
        meta = PagedMeta(batch["slot_mapping"], batch["page_table"], batch["query_start"], batch["query_len"],
                         batch["context_len"], batch["logits_indices"], kv_block_ids=batch.get("kv_block_ids"))
        rows, mask, blocks = batch.get("image_rows"), batch.get("image_mask"), batch.get("q_block_ids")
        return model.forward_paged(tokens[None], batch["positions"][None], pools, meta,
                                   None if rows is None else rows[None], None if mask is None else mask[None],
                                   None if blocks is None else blocks[None])

    def _chained_inputs(self, batch, sampling, query_start):
        """The step's tokens with each chained one (chain_src >= 0) taken from the previous step's samples on the
        device; a chained slot's input is its last output, so the penalties' history gets it there too."""
        src, prev = batch["chain_src"], batch["prev_tokens"]
        tokens = jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], batch["tokens"])
        history = sampling.output_ids.shape[1]
        if history:
            slots = jnp.arange(batch["query_len"].shape[0])
            last = jnp.clip(query_start + batch["query_len"] - 1, 0, tokens.shape[0] - 1)
            at = jnp.clip(sampling.step - 1, 0, history - 1)
            chained = (batch["query_len"] > 0) & (src[last] >= 0)
            ids = sampling.output_ids
            sampling = sampling.replace(output_ids=ids.at[slots, at].set(jnp.where(chained, tokens[last],
                                                                                   ids[slots, at])))
        return tokens, sampling

    def _decode_step_fn(self, state, pools, batch, sampling):
        """A step in which every sequence decodes one token, laid out by slot (slot i's token is token i): the
        layout of a multi-step call's steps, so the attention kernel writes the step's k, v itself and builds
        no index arrays (`PagedMeta.slot_tokens`). Images play no part in a decode token. Returns as `_step_fn`."""
        self.num_compiles += 1
        model = self._model(state)
        s, t = batch["query_len"].shape[0], batch["tokens"].shape[0]
        slots = jnp.arange(s, dtype=jnp.int32)
        meta = PagedMeta(batch["slot_mapping"], batch["page_table"], slots, batch["query_len"], batch["context_len"],
                         slots, max_query_len=1, slot_tokens=t >= s)
        tokens, sampling = self._chained_inputs(batch, sampling, slots)
        logits, pools = model.forward_paged(tokens[None], batch["positions"][None], pools, meta)
        r = sample(logits, sampling, self.num_logprobs)
        kept = jnp.zeros(self.max_slots, jnp.int32).at[:s].set(r.tokens)
        return (r.tokens, r.logprobs, r.top_ids, r.top_logprobs), pools, kept

    def _decode_batch(self, t: int, s: int) -> dict[str, Any]:
        i32 = np.int32
        return dict(tokens=np.zeros(t, i32), positions=np.zeros(t, i32),
                    slot_mapping=NULL_PAGE * self.page_size + np.arange(t, dtype=i32) % self.page_size,
                    page_table=np.full((s, self.max_pages), NULL_PAGE, i32), query_len=np.zeros(s, i32),
                    context_len=np.zeros(s, i32), chain_src=np.full(t, -1, i32), prev_tokens=self._no_last)

    @property
    def decode_shapes(self) -> list[tuple[int, int]]:
        """The step shapes of a step in which every sequence decodes one token (`_decode_step_fn`); none with
        speculation always on (its decode steps verify drafts)."""
        if self.spec_k and not self.spec_dynamic:
            return []
        most = pick_bucket(self.token_buckets, min(self.max_slots, self.token_buckets[-1]))
        return [(t, s) for t, s in self.step_shapes if t <= most]

    def _multi_step_fn(self, state, pools, batch, sampling, prev_last):
        """`decode_steps` decode steps in one call (`_decode_scan`) from slot i's token at position start[i]. A
        chained slot (chain_src[i] >= 0) starts from `prev_last[chain_src[i]]`, the previous call's last sample of
        that slot, still on device. Returns per-step [K, S] tokens, logprobs and top-k, the pools, and each slot's
        last sample [max_num_seqs] (kept on device for the next call)."""
        self.num_compiles += 1
        model = self._model(state)
        s, t = batch["num_steps"].shape[0], batch["tokens"].shape[0]
        src = batch["chain_src"]
        first = jnp.where(src >= 0, prev_last[jnp.clip(src, 0, prev_last.shape[0] - 1)], batch["tokens"][:s])
        outs, pools = self._decode_scan(model, pools, sampling, sampling.output_ids, batch["page_table"],
                                        batch["start"], batch["num_steps"], first, t, self.decode_steps)
        last = jnp.take_along_axis(outs[0], jnp.maximum(batch["num_steps"] - 1, 0)[None], axis=0)[0]
        return outs, pools, jnp.zeros_like(prev_last).at[:s].set(last)

    def _decode_scan(self, model, pools, sampling, out_ids, table, start, num_steps, first, t, length):
        """`length` decode steps over S slots laid out by slot (token i is slot i's; `t` >= S tokens): slot i's
        token at position start[i] + j goes through the model, its KV into the page table's slot, and the token
        sampled from it (with the keys of output sampling.step[i] + j) is slot i's input of step j + 1. Slots stop
        after num_steps[i] steps (their later tokens write to the null page, their outputs are ignored).
        `out_ids`: the penalties' output history, which gets each step's draws. Returns per-step [length, S]
        tokens, logprobs and top-k, and the pools."""
        i32, ps = jnp.int32, self.page_size
        s = start.shape[0]
        slots = jnp.arange(s, dtype=i32)
        pad_slots = NULL_PAGE * ps + jnp.arange(t, dtype=i32) % ps  # padding writes the null page
        history = sampling.output_ids.shape[1]

        def one(carry, j):
            tok, pools, out_ids = carry
            active = j < num_steps
            pos = start + j
            page = jnp.take_along_axis(table, jnp.minimum(pos // ps, table.shape[1] - 1)[:, None], axis=1)[:, 0]
            slot = jnp.where(active, page * ps + pos % ps, pad_slots[:s])
            meta = PagedMeta(pad_slots.at[:s].set(slot), table, slots, active.astype(i32),
                             jnp.where(active, pos + 1, 0), slots, max_query_len=1,  # one query per sequence,
                             slot_tokens=t >= s)                                     # token i is slot i's
            tokens = jnp.zeros(t, i32).at[:s].set(tok)
            positions = jnp.zeros(t, i32).at[:s].set(jnp.where(active, pos, 0))
            logits, pools = model.forward_paged(tokens[None], positions[None], pools, meta)
            r = sample(logits, sampling.replace(step=sampling.step + j, output_ids=out_ids), self.num_logprobs)
            if history:  # penalties see the tokens drawn so far in this call
                at = jnp.minimum(sampling.step + j, history - 1)
                out_ids = out_ids.at[slots, at].set(jnp.where(active, r.tokens, out_ids[slots, at]))
            return (r.tokens, pools, out_ids), (r.tokens, r.logprobs, r.top_ids, r.top_logprobs)

        (_, pools, _), outs = jax.lax.scan(one, (first, pools, out_ids), jnp.arange(length, dtype=i32))
        return outs, pools

    def _mixed_step_fn(self, state, pools, batch, sampling):
        """A ragged step (prefill chunks, images, one decode token per decoding request) and then up to
        `decode_steps` - 1 decode steps in the same call for the slots with num_steps[i] > 1: those whose step
        ends at their last known token (a decoder, or a prompt completed by its chunk), each fed its sample from
        the step before on the device, from position context_len[i]. The decode steps run over the step's S slots
        in the slot layout of `_decode_scan`. Returns per-step [K, S] results as `_multi_step_fn` (row 0: the
        ragged step's samples), the pools and each slot's last sample [max_num_seqs]."""
        self.num_compiles += 1
        model = self._model(state)
        s = batch["num_steps"].shape[0]
        logits, pools = self._ragged_forward(model, pools, batch, batch["tokens"])
        r = sample(logits, sampling, self.num_logprobs)
        out_ids, history = sampling.output_ids, sampling.output_ids.shape[1]
        if history:  # the penalties of the decode steps see the ragged step's draw
            slots, at = jnp.arange(s), jnp.minimum(sampling.step, history - 1)
            out_ids = out_ids.at[slots, at].set(jnp.where(batch["num_steps"] > 1, r.tokens, out_ids[slots, at]))
        more, pools = self._decode_scan(model, pools, sampling.replace(step=sampling.step + 1), out_ids,
                                        batch["page_table"], batch["context_len"], batch["num_steps"] - 1, r.tokens,
                                        pick_bucket(self.token_buckets, s), self.decode_steps - 1)
        outs = tuple(jnp.concatenate([a[None], b]) for a, b in zip((r.tokens, r.logprobs, r.top_ids, r.top_logprobs),
                                                                   more))
        last = jnp.take_along_axis(outs[0], jnp.maximum(batch["num_steps"] - 1, 0)[None], axis=0)[0]
        return outs, pools, jnp.zeros(self.max_slots, jnp.int32).at[:s].set(last)

    @property
    def mixed_step_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a mixed call (a ragged step, then decode steps) can take: every step shape; none when
        off (`serve.mixed_decode_steps`, one decode step per call, or speculation)."""
        return self.step_shapes if self.mixed_steps else []

    def _multi_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        i32 = np.int32
        return dict(tokens=np.zeros(t, i32), start=np.zeros(s, i32), num_steps=np.zeros(s, i32),
                    page_table=np.full((s, self.max_pages), NULL_PAGE, i32), chain_src=np.full(s, -1, i32))

    @property
    def multi_step_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a multi-step call can take (one token per running sequence); none when off."""
        if self.decode_steps <= 1:
            return []
        most = pick_bucket(self.token_buckets, min(self.max_slots, self.token_buckets[-1]))
        return [(t, s) for t, s in self.step_shapes if t <= most]

    def _dispatch_multi(self, out: SchedulerOutput, chain: PendingStep | None) -> PendingStep:
        """Launch a multi-step decode (every entry has `num_steps` > 1 or is a 1-step tail of one); chained
        entries start from `chain`'s last samples on device."""
        t, s = self.step_shape(len(out.scheduled), len(out.scheduled))
        batch = self._multi_batch(t, s)
        requests = [self._requests[e.request_id].request for e in out.scheduled]
        sampling = self._sampling(requests, s)
        prev = {} if chain is None else {e.request_id: (i, e.num_steps) for i, e in enumerate(chain.out.scheduled)}
        for i, entry in enumerate(out.scheduled):
            pages = np.asarray(entry.page_ids, np.int32)
            batch["tokens"][i], batch["start"][i], batch["num_steps"][i] = entry.token_ids[-1], entry.start, \
                entry.num_steps
            batch["page_table"][i, :len(pages)] = pages
            if entry.chained:  # the previous call's tokens are not in the request yet: its draws come first
                batch["chain_src"][i], produced = prev[entry.request_id]
                sampling.step[i] += produced
        launched = self._launch(self._multi, batch, sampling, self._no_last if chain is None else chain.last)
        self.num_chained += chain is not None
        return PendingStep(out, launched=launched, multi=True)

    def _collect_multi(self, pending: PendingStep) -> dict[str, SampledToken]:
        # one host conversion per output (Python lists, [K, S] and [K, S, top]); top lists only for rows that use them
        tokens, logprobs, top_ids, top_lp = (x.tolist() for x in (pending.packed or self._multi).outputs(
            pending.handle))
        result = {}
        for i, entry in enumerate(pending.out.scheduled):
            if not entry.samples:  # a mixed call's prefill chunk that does not end its prompt
                continue
            k = entry.num_steps
            toks, lps = tuple(tokens[j][i] for j in range(k)), tuple(logprobs[j][i] for j in range(k))
            ids = tops = ((),) * k
            if self._wants_top(entry):
                ids = tuple(tuple(top_ids[j][i]) for j in range(k))
                tops = tuple(tuple(top_lp[j][i]) for j in range(k))
            result[entry.request_id] = SampledToken(toks[0], lps[0], ids[0], tops[0], tokens=toks, token_logprobs=lps,
                                                    token_top_ids=ids, token_top_logprobs=tops)
        return result

    # -- speculative rounds (serve.speculative.rounds) ---------------------------------------------------------

    def _spec_rounds_fn(self, state, carry, batch, sampling):
        """`spec_rounds` speculative rounds in one call (n-gram lookup on the device). Slot i owns the flat tokens
        [query_start[i], query_start[i] + 1 + reserved[i]) in every round; at its position p (start[i] in the
        first round) a round looks up at most min(reserved, its adaptive k, tokens left - 1) drafts in its history
        row's first p + 1 tokens, runs the target over its last token and the drafts found (positions p .., KV
        slots from its page table; the other tokens of its range write the null page and are no query), verifies
        them with the keys of a speculative step at its outputs so far, appends what it emits to the row and
        advances p by that count. A slot stops once it has emitted `limit` tokens (the KV room the scheduler
        reserved). Attention reads each slot's positions below p + 1 + drafts only, so the KV a rejected draft
        left past that is never read and a later round overwrites it. Returns per-round [R, S] results
        (tokens [R, S, k + 1], counts, logprobs, drafts found), (pools, histories) and each slot's last token."""
        self.num_compiles += 1
        pools, history = carry
        model = self._model(state)
        i32, ps, k = jnp.int32, self.page_size, self.spec_k
        s, t = batch["start"].shape[0], batch["tokens"].shape[0]
        table, qs, rows, limit = batch["page_table"], batch["query_start"], batch["hist_row"], batch["limit"]
        j = jnp.arange(k + 1, dtype=i32)[None, :]
        slots = jnp.arange(s, dtype=i32)
        pad_slots = NULL_PAGE * ps + jnp.arange(t, dtype=i32) % ps  # unused tokens write the null page
        adaptive = self.serve.speculative.adaptive

        def one(carry, _):
            pools, history, pos, done, k_now, last = carry
            left = limit - done
            active = left > 0
            cap = jnp.where(active, jnp.minimum(jnp.minimum(batch["reserved"], k_now), left - 1), 0)
            live = jnp.where(active, rows, -1)
            drafts, found = propose_drafts(history, live, pos + 1, cap, **self._ngram)
            used = active[:, None] & (j <= found[:, None])  # [S, k + 1]: the last token, then the drafts found
            idx = jnp.where(used, qs[:, None] + j, t)  # unused: past the end, dropped
            at = pos[:, None] + j
            page = jnp.take_along_axis(table, jnp.clip(at // ps, 0, table.shape[1] - 1), axis=1)
            tokens = jnp.zeros(t, i32).at[idx].set(jnp.concatenate([last[:, None], drafts], axis=1), mode="drop")
            positions = jnp.zeros(t, i32).at[idx].set(at, mode="drop")
            slot_mapping = pad_slots.at[idx].set(page * ps + at % ps, mode="drop")
            logits_at = (qs[:, None] + jnp.minimum(j, found[:, None])).ravel()  # the last token, each draft
            meta = PagedMeta(slot_mapping, table, qs, jnp.where(active, found + 1, 0),
                             jnp.where(active, pos + 1 + found, 0), logits_at)
            logits, pools = model.forward_paged(tokens[None], positions[None], pools, meta)
            logits = logits.reshape(s, k + 1, -1)
            now = sampling.replace(step=sampling.step + done)  # the keys of a speculative step at this output
            emitted, count, lps = verify(logits, now, drafts, found, None)
            r = sample(logits[slots, found], now, 0)
            none = found == 0  # nothing proposed: the plain sampler's token, as a step without drafts
            emitted = emitted.at[:, 0].set(jnp.where(none, r.tokens, emitted[:, 0]))
            lps = lps.at[:, 0].set(jnp.where(none, r.logprobs, lps[:, 0]))
            count = jnp.where(active, count, 0)
            history = append_tokens(history, live, pos + 1, emitted, count)
            last = jnp.where(active, emitted[slots, jnp.maximum(count - 1, 0)], last)
            if adaptive:
                k_now = jnp.where(active, next_draft_length(k_now, found, count - 1, k), k_now)
            return (pools, history, pos + count, done + count, k_now, last), (emitted, count, lps, found)

        init = (pools, history, batch["start"], jnp.zeros(s, i32), batch["first_k"], batch["tokens"][qs])
        (pools, history, *_, last), outs = jax.lax.scan(one, init, None, length=self.spec_rounds)
        return outs, (pools, history), jnp.zeros(self.max_slots, i32).at[:s].set(last)

    def _rounds_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        i32 = np.int32
        return dict(tokens=np.zeros(t, i32), start=np.zeros(s, i32), query_start=np.zeros(s, i32),
                    reserved=np.zeros(s, i32), limit=np.zeros(s, i32), first_k=np.zeros(s, i32),
                    page_table=np.full((s, self.max_pages), NULL_PAGE, i32), hist_row=np.full(s, -1, i32))

    @property
    def spec_round_shapes(self) -> list[tuple[int, int]]:
        """The step shapes a call of speculative rounds can take (every step shape); none when off."""
        return self.step_shapes if self.spec_rounds > 1 else []

    def _dispatch_rounds(self, out: SchedulerOutput, first_k: Mapping[str, int]) -> PendingStep:
        """Launch a call of speculative rounds: every entry is a decode token with `num_rounds` > 1 and its
        reserved draft slots; `first_k` (the proposer's) is the drafts each request's first round may make."""
        t, s = self.step_shape(out.num_scheduled_tokens, len(out.scheduled))
        batch = self._rounds_batch(t, s)
        history = self.history
        history.discard_pending()
        step = {e.request_id for e in out.scheduled}
        off = 0
        for i, entry in enumerate(out.scheduled):
            rid, request = entry.request_id, self._requests[entry.request_id].request
            token, known = entry.token_ids[0], entry.start + 1
            if token == PLACEHOLDER_TOKEN:
                raise ValueError(f"request {rid!r}: speculative rounds need its last token on the host")
            batch["tokens"][off], batch["start"][i], batch["query_start"][i] = token, entry.start, off
            batch["reserved"][i], batch["limit"][i] = entry.num_draft, entry.emit_limit
            batch["first_k"][i] = first_k.get(rid, self.spec_k)  # (the reserved slots cap each round's drafts)
            batch["page_table"][i, :len(entry.page_ids)] = entry.page_ids
            batch["hist_row"][i] = history.row(rid, known, functools.partial(request.token_ids, 0, known), step)
            off += entry.num_tokens
        sampling = self._sampling([self._requests[e.request_id].request for e in out.scheduled], s)
        return PendingStep(out, launched=self._launch(self._rounds, batch, sampling), packed=self._rounds,
                           rounds=True)

    def _collect_rounds(self, pending: PendingStep) -> dict[str, SampledToken]:
        emitted, count, lps, found = (x.tolist() for x in self._rounds.outputs(pending.handle))
        result = {}
        for i, entry in enumerate(pending.out.scheduled):
            rid = entry.request_id
            if rid not in self._requests:
                continue  # finished since the call was launched
            tokens: list[int] = []
            logprobs: list[float] = []
            sizes = []
            for r in range(self.spec_rounds):
                c = count[r][i]
                if not c:  # the slot reached its limit: no later round ran for it
                    break
                tokens += emitted[r][i][:c]
                logprobs += lps[r][i][:c]
                sizes.append((found[r][i], c))
            self.history.wrote(rid, entry.start + 1 + len(tokens))
            result[rid] = SampledToken(tokens[0], logprobs[0], tokens=tuple(tokens), token_logprobs=tuple(logprobs),
                                       num_draft=sum(d for d, _ in sizes), rounds=tuple(sizes))
        return result

    def _wants_top(self, entry) -> bool:
        """Whether a scheduled entry's caller reads its top-k candidates: a request asking for logprobs, or a
        beam search's row (its candidates)."""
        request = self._requests[entry.owner or entry.request_id].request
        return bool(entry.owner) or bool(request.sampling_params.logprobs) or request.sampling_params.num_beams > 1

    def _upload_fn(self, history, rows, values):
        """Replace token-history rows (`DeviceHistory.flush`); one shape, compiled by `warmup`."""
        self.num_compiles += 1
        return set_rows(history, rows, values)

    def _copy_fn(self, pools, src, dst):
        """Copy pages src -> dst in every layer's pools (a beam fork's shared last page; pads are 0 -> 0).
        One small fixed shape, compiled by `warmup`; not counted in `num_compiles` (the step's and encoder's)."""
        return jax.tree.map(lambda p: p.at[:, :, dst].set(p[:, :, src]), pools)

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Run the page copies of a step, in one fixed-shape call of `max_num_seqs` pairs at a time."""
        n = self.serve.max_num_seqs
        for i in range(0, len(copies), n):
            pairs = np.zeros((n, 2), np.int32)
            pairs[:len(copies[i:i + n])] = copies[i:i + n]
            self.pools = self._copy(self.pools, *self._put((pairs[:, 0], pairs[:, 1])))

    def _encode_fn(self, state, image):
        self.num_compiles += 1
        return self._model(state).encode_images(image[None])[0]

    # -- requests -----------------------------------------------------------------------------------------

    def _register(self, request: Request) -> None:
        images = request.mm_data if isinstance(request.mm_data, ImageInput) else None
        block_ids = np.zeros(request.num_prompt_tokens, np.int32)
        if images is not None and self.use_blocks:
            for rank, (start, end) in enumerate(images.ranges):
                block_ids[start:end] = rank + 1
        self._requests[request.request_id] = RequestState(request, images, block_ids)
        sp = request.sampling_params
        if sp.seed is None and not sp.greedy and request.request_id not in self.seeds:
            self.seeds[request.request_id] = int(self._seed_rng.integers(0, 2**32))

    def _sampling(self, requests: Sequence[Request | None], num_slots: int) -> SamplingTensors:
        """Per-slot sampler inputs: plain, or with the token history and the sort when a request uses a penalty
        or top-k/top-p (two programs per step shape, `full_sampler_history`)."""
        return SamplingTensors.from_requests(requests, num_slots, full_sampler_history(requests, self.max_model_len),
                                             seeds=self.seeds)

    def _image_rows(self, state: RequestState, index: int) -> np.ndarray:
        rows = state.embeds.get(index)
        if rows is None:
            image = state.images.images[index]
            rows = state.embeds[index] = self.image_cache.get(
                state.images.hashes[index], lambda: np.asarray(self._encode(self._leaves, self._put(image))))
        return rows

    # -- one step -----------------------------------------------------------------------------------------

    def _empty_batch(self, t: int, s: int) -> dict[str, np.ndarray]:
        if self.fused_draft and self.draft is None:
            raise ValueError("serve.speculative.proposer_on_device with method=draft: the verifying step needs the "
                             "draft model (ModelRunner.attach_draft, which the Engine's proposer calls)")
        i32 = np.int32
        batch = dict(tokens=np.zeros(t, i32), positions=np.zeros(t, i32),
                     slot_mapping=(NULL_PAGE * self.page_size + np.arange(t, dtype=i32) % self.page_size),
                     page_table=np.full((s, self.max_pages), NULL_PAGE, i32), query_start=np.zeros(s, i32),
                     query_len=np.zeros(s, i32), context_len=np.zeros(s, i32), logits_indices=np.zeros(s, i32),
                     chain_src=np.full(t, -1, i32), prev_tokens=self._no_last)
        if self.spec_k:
            batch.update(logits_indices=np.zeros(s * (self.spec_k + 1), i32), num_draft=np.zeros(s, i32))
            if self.fused_draft:  # each drafting slot's last known tokens, their first position, its draft pages
                batch.update(draft_tokens=np.zeros((s, CATCH_UP), i32), draft_start=np.zeros(s, i32),
                             draft_table=np.full((s, self.max_pages), NULL_PAGE, i32))
            elif self.history is None:
                batch["drafts"] = np.zeros((s, self.spec_k), i32)
            else:  # each slot's history row (-1: none) and its length (= the first draft's position)
                batch.update(hist_row=np.full(s, -1, i32), hist_len=np.zeros(s, i32))
            if self.spec_draft_probs:  # rows of the draft proposer's device bank (DraftProbs); unused rows: 0
                batch["draft_rows"] = np.zeros((s, self.spec_k), i32)
                batch["draft_bank"] = self._empty_bank()
        if self.use_blocks:
            batch["q_block_ids"] = np.zeros(t, i32)
            batch["kv_block_ids"] = np.zeros((s, self.max_pages * self.page_size), i32)
        if not self.text_only:
            batch["image_mask"] = np.zeros(t, bool)
        return batch

    def _empty_bank(self) -> jax.Array:
        """A zero draft-probability bank of the proposer's shape, for steps without drafts and warm-up."""
        if self._zero_bank is None:
            rows = self.serve.max_num_seqs * self.spec_k
            self._zero_bank = self._put(jnp.zeros((rows, self.model_cfg.vocab_size), jnp.float32))
        return self._zero_bank

    def _zeros(self, t: int) -> jax.Array:
        """Device-resident zero image rows for steps without image tokens (no host transfer)."""
        if t not in self._zero_rows:
            self._zero_rows[t] = self._put(jnp.zeros((t, self.embed_dim), self.embed_dtype))
        return self._zero_rows[t]

    @property
    def pools(self) -> Any:
        """The KV pools: the last launched call's (waits for that call to return from the launcher thread)."""
        if self._pools_from is not None:
            carry, self._pools_from = self._pools_from.result()[1], None
            self._set_carry(carry, self._from_fused)
        return self._pools

    @pools.setter
    def pools(self, value: Any) -> None:
        self._pools, self._pools_from = value, None

    def attach_draft(self, draft: ModelRunner) -> None:
        """Serve `draft` (a runner of the draft model, its pool included) inside the verifying step
        (`serve.speculative.method=draft` with `proposer_on_device`): each call takes its parameters and donates
        and returns its pools beside the target's. Call before `warmup`."""
        if not self.fused_draft:
            raise ValueError("attach_draft needs serve.speculative.method=draft with proposer_on_device=true")
        if self._replicated is not None:
            raise ValueError("the draft model in the verifying step (serve.speculative.proposer_on_device with "
                             "method=draft) is not supported on a mesh")
        if draft.model_cfg.vocab_size != self.model_cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.model_cfg.vocab_size}) differs from the "
                             f"target's ({self.model_cfg.vocab_size}): it must use the same tokenizer")
        if (draft.page_size, draft.max_pages) != (self.page_size, self.max_pages):
            raise ValueError("the draft runner's page size and page-table width must equal the target's")
        self.draft = draft

    def _carry(self, step: PackedStep) -> tuple[Any, bool]:
        """What a call of `step` donates and returns: the pools, with the token histories (n-gram) or the draft
        model's pools (draft) beside them for the step that proposes on the device; and whether it is that
        step."""
        pools = self.pools  # (waits for a launcher-thread call, which may also hold the histories)
        if step not in (self._step, self._rounds) or (self.history is None and self.draft is None):
            return pools, False
        if self.draft is not None:
            return (pools, self.draft.pools), True
        self.history.flush(self._upload)  # rows that are not current go up first (queued by `_dispatch_one`)
        return (pools, self.history.tokens), True

    def _set_carry(self, carry: Any, fused: bool) -> None:
        if fused and self.draft is not None:
            carry, self.draft.pools = carry
        elif fused:
            carry, self.history.tokens = carry
        self._pools, self._pools_from = carry, None

    def _params(self, fused: bool) -> Any:
        """The parameters a call takes: the target's leaves, with the draft model's for the fused draft step."""
        return (self._leaves, self.draft._leaves) if fused and self.draft is not None else self._leaves

    def _launch(self, step: PackedStep, *inputs: Any) -> Any:
        """Launch one call of `step` (asynchronously); returns (handle, last) for `PendingStep.launched`.

        With `serve.launch_thread` the inputs are packed here and the jitted call (argument handling, the device
        work's enqueueing) runs on the launcher thread, so this thread goes on to read and report the step
        before while it runs; then a Future of them is returned, and `pools` waits for it when next needed."""
        self.num_steps += 1
        carry, fused = self._carry(step)
        if self._launcher is None:
            handle, carry = step.dispatch(self._params(fused), carry, *inputs)
            self._set_carry(carry, fused)
            return handle[:2], handle[2]
        state, packed = self._params(fused), pack(inputs)

        def call() -> tuple[tuple[Any, Any], Any]:
            handle, new_carry = step.launch(state, carry, packed)
            return (handle[:2], handle[2]), new_carry

        called = self._launcher.submit(call)
        self._pools_from, self._from_fused = called, fused
        return called

    def _run(self, batch: dict[str, Any], sampling: Any) -> tuple[np.ndarray, ...]:
        carry, fused = self._carry(self._step)
        outs, carry = self._step(self._params(fused), carry, batch, sampling)
        self._set_carry(carry, fused)
        self.num_steps += 1
        return outs

    def execute(self, out: SchedulerOutput, draft_probs: Any = None) -> dict[str, SampledToken]:
        """Run one scheduler step; returns the sampled token of every entry with `samples=True` (several for
        an entry with speculative tokens). `draft_probs` is the draft-model proposer's `DraftProbs` (its
        drafts' probabilities, on the device), or, with the draft model in the step, `FusedDrafts` (the drafting
        requests' draft pages); without a draft model drafts are one-hot guesses."""
        return self.collect(self.dispatch(out, draft_probs))

    def dispatch(self, out: SchedulerOutput, draft_probs: Any = None, chain: PendingStep | None = None) -> PendingStep:
        """Launch one scheduler step (the device runs it while the host goes on; `collect` reads its tokens).
        `chain`: the step launched before it, whose samples (still on the device) feed `out`'s chained
        multi-step entries (`Scheduler.schedule_chained`) or its placeholder tokens (`Scheduler.advance`)."""
        for rid in out.finished_request_ids:
            self._requests.pop(rid, None)
            self.seeds.pop(rid, None)
            if self.history is not None:
                self.history.release(rid)
        for request in out.new_requests:
            self._register(request)
        if out.page_copies:
            self.copy_pages(out.page_copies)
        if out.scheduled and any(e.num_steps > 1 or e.chained for e in out.scheduled):
            if any(e.num_tokens > 1 for e in out.scheduled):  # prefill chunks: a ragged step, then decode steps
                return self._dispatch_mixed(out)
            return self._dispatch_multi(out, chain)
        if out.scheduled and any(e.num_rounds > 1 for e in out.scheduled):
            return self._dispatch_rounds(out, draft_probs or {})
        if not out.scheduled:
            return PendingStep(out, result={})
        if (not self.spec_k or self.spec_dynamic) and all(e.num_tokens == 1 for e in out.scheduled):
            return self._dispatch_decode(out, chain)
        return self._dispatch_one(out, draft_probs, chain)

    def collect(self, pending: PendingStep) -> dict[str, SampledToken]:
        """The sampled tokens of a dispatched step (waits for the device)."""
        if pending.result is not None:
            return pending.result
        if pending.rounds:
            return self._collect_rounds(pending)
        return self._collect_multi(pending) if pending.multi else self._collect_one(pending)

    @staticmethod
    def _chain_slot(chain: PendingStep | None, request_id: str, index: dict[str, int] | None) -> tuple[int, dict]:
        """A placeholder token's source: the request's slot in `chain` (and the request -> slot index, built once
        per step)."""
        if index is None:
            if chain is None or chain.last is None:
                raise ValueError(f"request {request_id!r}: a placeholder token but no step launched before this one "
                                 "to take it from")
            index = {e.request_id: j for j, e in enumerate(chain.out.scheduled)}
        return index[request_id], index

    def _dispatch_decode(self, out: SchedulerOutput, chain: PendingStep | None) -> PendingStep:
        """Launch a step in which every entry decodes one token (`_decode_step_fn`)."""
        t, s = self.step_shape(len(out.scheduled), len(out.scheduled))
        batch = self._decode_batch(t, s)
        tokens, positions, slot_mapping = batch["tokens"], batch["positions"], batch["slot_mapping"]
        table, query_len, context_len, chain_src = (batch["page_table"], batch["query_len"], batch["context_len"],
                                                    batch["chain_src"])
        ps, index = self.page_size, None
        for i, entry in enumerate(out.scheduled):  # plain Python per sequence: host time per step
            start, pages, token = entry.start, entry.page_ids, entry.token_ids[0]
            if token == PLACEHOLDER_TOKEN:  # sampled by `chain`, still on the device: fed from there
                chain_src[i], index = self._chain_slot(chain, entry.request_id, index)
            else:
                tokens[i] = token
            positions[i], slot_mapping[i] = start, pages[start // ps] * ps + start % ps
            table[i, :len(pages)] = pages
            query_len[i], context_len[i] = 1, start + 1
        if index is not None:
            batch["prev_tokens"] = chain.last
            self.num_chained += 1
        sampling = self._sampling([self._requests[e.owner or e.request_id].request for e in out.scheduled], s)
        return PendingStep(out, launched=self._launch(self._decode, batch, sampling), packed=self._decode)

    def _dispatch_one(self, out: SchedulerOutput, draft_probs: Any, chain: PendingStep | None) -> PendingStep:
        batch, sampling, drafted = self._ragged_inputs(out, draft_probs, chain)
        launched = self._launch(self._step, batch, sampling)
        for rid, valid in drafted:  # the draft computed its KV through the last draft it fed
            draft_probs.ran(rid, valid)
        return PendingStep(out, launched=launched, packed=self._step)

    def _dispatch_mixed(self, out: SchedulerOutput) -> PendingStep:
        """Launch a mixed call (`_mixed_step_fn`): the ragged step of `out`, then each entry's num_steps - 1
        decode steps; its tokens are read as a multi-step call's."""
        batch, sampling, _ = self._ragged_inputs(out, None, None)
        batch["num_steps"] = np.zeros(len(batch["query_len"]), np.int32)
        batch["num_steps"][:len(out.scheduled)] = [e.num_steps for e in out.scheduled]
        self.num_mixed += 1
        return PendingStep(out, launched=self._launch(self._mixed, batch, sampling), multi=True, packed=self._mixed)

    def _ragged_inputs(self, out: SchedulerOutput, draft_probs: Any,
                       chain: PendingStep | None) -> tuple[dict[str, Any], SamplingTensors, list[tuple[str, int]]]:
        """A ragged step's host inputs: the batch, the sampler's, and the (request, valid KV) of each slot whose
        drafts the step's draft model computes."""
        t, s = self.step_shape(out.num_scheduled_tokens, len(out.scheduled))
        batch = self._empty_batch(t, s)
        index: dict[str, int] | None = None  # request -> its slot in `chain` (a placeholder's token)
        history, drafting = self.history, set()
        if history is not None:  # the step's speculating requests: their rows of token history
            history.discard_pending()
            drafting = {e.request_id for e in out.scheduled if e.num_draft}
        if self.spec_draft_probs and draft_probs is not None:
            batch["draft_bank"] = draft_probs.bank
        rows = None
        ps = self.page_size
        off = 0
        drafted: list[tuple[str, int]] = []  # (request, tokens whose draft KV the step leaves valid)
        for i, entry in enumerate(out.scheduled):
            st = self._requests[entry.owner or entry.request_id]
            n, start = entry.num_tokens, entry.start
            end = start + n
            pages = entry.page_ids
            if n == 1:  # a decode token: plain Python, no small numpy arrays (host time per step and sequence)
                token = entry.token_ids[0]
                if token == PLACEHOLDER_TOKEN:  # sampled by `chain`, still on the device: fed from there
                    batch["chain_src"][off], index = self._chain_slot(chain, entry.request_id, index)
                else:
                    batch["tokens"][off] = token
                batch["positions"][off] = start
                batch["slot_mapping"][off] = pages[start // ps] * ps + start % ps
            else:
                pos = np.arange(start, end, dtype=np.int32)
                batch["tokens"][off:off + n] = entry.token_ids
                batch["positions"][off:off + n] = pos
                batch["slot_mapping"][off:off + n] = np.asarray(pages, np.int32)[pos // ps] * ps + pos % ps
            batch["page_table"][i, :len(pages)] = pages
            batch["query_start"][i], batch["query_len"][i], batch["context_len"][i] = off, n, end
            if self.spec_k:  # the last known token and each draft; unused entries repeat the last one
                k1, d = self.spec_k + 1, entry.num_draft
                batch["logits_indices"][i * k1:(i + 1) * k1] = off + n - 1 - d + np.minimum(np.arange(k1), d)
                batch["num_draft"][i] = d
                if self.fused_draft:
                    if d:  # reserved draft slots: the step's draft model fills them
                        self._draft_inputs(batch, i, st.request, end - d, draft_probs.tables[entry.request_id])
                        drafted.append((entry.request_id, end - 1))
                elif history is None:
                    batch["drafts"][i, :d] = entry.token_ids[n - d:]
                elif d:  # reserved draft slots (placeholders): the step proposes from the request's history row
                    known = end - d
                    batch["hist_row"][i] = history.row(entry.request_id, known,
                                                       functools.partial(st.request.token_ids, 0, known), drafting)
                    batch["hist_len"][i] = known
                if d and self.spec_draft_probs:  # the drafts' probabilities stay on the device
                    batch["draft_rows"][i] = draft_probs.first_row[entry.request_id] + np.arange(self.spec_k)
            else:
                batch["logits_indices"][i] = off + n - 1
            if self.use_blocks:
                prompt = len(st.block_ids)
                batch["kv_block_ids"][i, :min(end, prompt)] = st.block_ids[:end]
                if start < prompt:
                    batch["q_block_ids"][off:off + min(end, prompt) - start] = st.block_ids[start:end]
            if st.images is not None:
                for k, (a, b) in enumerate(st.images.ranges):
                    lo, hi = max(a, start), min(b, end)
                    if lo >= hi:
                        continue
                    if rows is None:
                        rows = np.zeros((t, self.embed_dim), np.float32)
                    rows[off + lo - start:off + hi - start] = self._image_rows(st, k)[lo - a:hi - a]
                    batch["image_mask"][off + lo - start:off + hi - start] = True
            off += n
        if not self.text_only:
            # a device array either way, so the step's input layout does not depend on whether images are in it
            batch["image_rows"] = self._zeros(t) if rows is None else jnp.asarray(rows, self.embed_dtype)
        if index is not None:
            batch["prev_tokens"] = chain.last
            self.num_chained += 1
        slot_requests = [self._requests[e.owner or e.request_id].request for e in out.scheduled]
        return batch, self._sampling(slot_requests, s), drafted

    def _draft_inputs(self, batch: dict[str, Any], i: int, request: Request, known: int, table: Sequence[int]) -> None:
        """Slot i's inputs of the draft model's steps: its last `CATCH_UP` known tokens (`known` of them) and its
        draft pages (`FusedDraftProposer.propose` made the draft's KV valid before them)."""
        batch["draft_tokens"][i] = request.token_ids(known - CATCH_UP, known)
        batch["draft_start"][i] = known - CATCH_UP
        batch["draft_table"][i, :len(table)] = table

    def _collect_one(self, pending: PendingStep) -> dict[str, SampledToken]:
        tokens, logprobs, top_ids, top_lp, *spec = pending.packed.outputs(pending.handle)
        tokens, logprobs, spec = tokens.tolist(), logprobs.tolist(), [x.tolist() for x in spec]
        result = {}
        for i, entry in enumerate(pending.out.scheduled):
            if not entry.samples or (entry.owner or entry.request_id) not in self._requests:
                continue  # nothing sampled, or finished since the step was launched
            if entry.num_draft:
                emitted, count, lps = spec[0][i], spec[1][i], spec[2][i]
                drafted = entry.num_draft
                if self.history is not None:  # proposed on the device: at most the reserved slots
                    drafted = spec[3][i]
                    self.history.wrote(entry.request_id, entry.start + entry.num_tokens - entry.num_draft + count)
                result[entry.request_id] = SampledToken(emitted[0], lps[0], tokens=tuple(emitted[:count]),
                                                        token_logprobs=tuple(lps[:count]), num_draft=drafted)
                continue
            if self._wants_top(entry):  # only these rows' top-k become Python lists
                result[entry.request_id] = SampledToken(tokens[i], logprobs[i], tuple(top_ids[i].tolist()),
                                                        tuple(top_lp[i].tolist()))
            else:
                result[entry.request_id] = SampledToken(tokens[i], logprobs[i])
        return result

    def warmup(self) -> int:
        """Compile every step shape (and the image encoder) with all-padding inputs; returns the number of
        compiles. Padding writes only to the null page, so the pools' real pages are untouched."""
        before = self.num_compiles
        for t, s in self.step_shapes:
            batch = self._empty_batch(t, s)
            if not self.text_only:
                batch["image_rows"] = self._zeros(t)
            for history in (0, self.max_model_len):
                self._run(batch, SamplingTensors.from_requests([], s, history))
        for t, s in self.decode_shapes:
            for history in (0, self.max_model_len):
                _, self.pools = self._decode(self._leaves, self.pools, self._decode_batch(t, s),
                                             SamplingTensors.from_requests([], s, history))
        for t, s in self.multi_step_shapes:
            for history in (0, self.max_model_len):
                _, self.pools = self._multi(self._leaves, self.pools, self._multi_batch(t, s),
                                            SamplingTensors.from_requests([], s, history), self._no_last)
        for t, s in self.mixed_step_shapes:
            batch = self._empty_batch(t, s)
            batch["num_steps"] = np.zeros(s, np.int32)
            if not self.text_only:
                batch["image_rows"] = self._zeros(t)
            for history in (0, self.max_model_len):
                _, self.pools = self._mixed(self._leaves, self.pools, batch,
                                            SamplingTensors.from_requests([], s, history))
        for t, s in self.spec_round_shapes:
            for history in (0, self.max_model_len):
                _, carry = self._rounds(self._leaves, (self.pools, self.history.tokens), self._rounds_batch(t, s),
                                        SamplingTensors.from_requests([], s, history))
                self._set_carry(carry, True)
        if self.history is not None:  # the token histories' row upload
            self.history.warmup(self._upload)
        if self.serve.max_beam_width > 1:  # the beam forks' page copy
            zeros = np.zeros(self.serve.max_num_seqs, np.int32)
            self.pools = self._copy(self.pools, *self._put((zeros, zeros)))
        if not self.text_only:
            v = self.model_cfg.vision
            self._encode(self._leaves, self._put(np.zeros((v.image_size, v.image_size, v.channels), np.float32)))
        return self.num_compiles - before
