"""Model runner: turns a `SchedulerOutput` into one jitted forward + sample over the paged KV pool.

The host builds flat numpy arrays (tokens, positions, KV slots, page tables, image rows) padded to a fixed
(token, slot) bucket, so a small set of shapes compiles once (`warmup`) and serving never recompiles. The
KV pools are donated to the step, so XLA updates them in place. Images are encoded once (ViT + projector) and
kept in an LRU keyed by content hash; each step gathers the rows its image placeholder tokens need.

The runner owns the parameters, the pools and the live requests, and takes each scheduler step through its
call: dispatch, launch, collect. The parts have modules of their own: the traced programs (`step_programs.py`),
the shapes they compile for (`buckets.py`), their host inputs (`step_inputs.py`), the launch and what calls
carry (`launch.py`) and the reading of their outputs (`step_outputs.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.config import ServeConfig
from mmjax.kernels import MeshSharding, kv_head_axes, pool_spec
from mmjax.parallel.sharding import in_sharding_context
from mmjax.quant import quantize_state
from mmjax.quant.kv import kv_cache_dtype
from mmjax.serving.buckets import StepShapes, auto_decode_steps, buckets
from mmjax.serving.images import ImageCache, ImageInput
from mmjax.serving.launch import CallLauncher
from mmjax.serving.request import Request
from mmjax.serving.scheduler import SchedulerOutput
from mmjax.serving.sizing import size_serving
from mmjax.serving.speculative.device_ngram import DeviceHistory, set_rows
from mmjax.serving.step_inputs import StepInputs
from mmjax.serving.step_outputs import multi_step_tokens, rounds_tokens, step_tokens
from mmjax.serving.step_programs import DeviceDraft, StepPrograms, copy_pool_pages
from mmjax.serving.step_types import PendingStep, RequestState, SampledToken
from mmjax.serving.transfer import PackedStep
from mmjax.serving.unroll import serving_layout


class ModelRunner(StepShapes, StepInputs, CallLauncher):
    """Owns the parameters and the KV pools and runs one step per `execute`.

    `model` is an `MLLM` (or a (graphdef, state) pair of one). The step samples with `sampling.sample`. Each
    (token, slot) bucket has two sampler programs, both compiled by `warmup()`: the plain one (no token history,
    no top logprobs) and the full one, for a call in which some request uses penalties, top-k/top-p, top logprobs
    or beam search (a `max_model_len` token history, the sort, and the `num_logprobs` = max(serve.max_logprobs,
    2 * serve.max_beam_width) most likely tokens per sampled token). `num_compiles` counts traces of the step and
    of the image encoder: it stays put after warm-up.

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
        # serve.speculative.rounds: speculative rounds per call when every running request speculates (the proposer
        # on the device only, n-gram or draft model; the config checks); one round is the verifying step itself
        self.spec_rounds = serve.speculative.rounds if on_device else 1
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
        self._copy = jax.jit(copy_pool_pages, donate_argnums=(0,), out_shardings=pool_sharding)
        self._upload = jax.jit(self._upload_fn, donate_argnums=(0,), out_shardings=rep)  # history rows
        # multi-step decode; not with speculation always on (its steps verify drafts) nor in its draft runner
        self.decode_steps = (auto_decode_steps(serve.decode_steps)
                             if serve.speculative.method == "none" or self.spec_dynamic else 1)
        self._programs = StepPrograms(  # the settings the traced programs read
            page_size=self.page_size, max_slots=self.max_slots, decode_steps=self.decode_steps,
            token_buckets=self.token_buckets, spec_k=self.spec_k, ngram_min=serve.speculative.ngram_min,
            ngram_max=serve.speculative.ngram_max, spec_rounds=self.spec_rounds, adaptive=serve.speculative.adaptive)
        self._multi = PackedStep(self._traced(self._programs.multi_step), wrap=wrap, put=self._put,
                                 out_shardings=None if out is None else (*out, rep))
        # a call that prefills also decodes decode_steps tokens for its decoding requests (the ragged step, then
        # decode steps); not with speculation (its steps verify drafts)
        self.mixed_steps = self.decode_steps > 1 and not self.spec_k and serve.mixed_decode_steps
        self._mixed = PackedStep(self._traced(self._programs.mixed_step), wrap=wrap, put=self._put,
                                 out_shardings=None if out is None else (*out, rep))
        self._decode = PackedStep(self._traced(self._programs.decode_step), wrap=wrap, put=self._put,
                                  out_shardings=None if out is None else (*out, rep))
        self._rounds = PackedStep(self._rounds_fn, wrap=wrap, put=self._put,
                                  out_shardings=None if out is None else (rep, carry, rep))
        self._no_last = self._put(jnp.zeros(self.max_slots, jnp.int32))  # an unchained call's "previous tokens"
        # calls fed on the device by the call launched before them, while it ran: chained multi-step calls
        # (Scheduler.schedule_chained) and overlapped steps (Scheduler.advance)
        self.num_chained = 0
        self.num_mixed = 0  # mixed calls: a ragged step that prefills, then decode steps (`StepPrograms.mixed_step`)
        self._encode = jax.jit(in_sharding_context(self._encode_fn, sharding), out_shardings=rep)

    def _memory_devices(self, mesh: jax.sharding.Mesh | None) -> list[Any]:
        """The devices whose free memory sizes the pool: this process's devices of the mesh, else the weights'."""
        if mesh is not None:
            return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        leaves = jax.tree.leaves(self.state)
        return sorted(leaves[0].devices(), key=lambda d: d.id) if leaves and hasattr(leaves[0], "devices") \
            else jax.local_devices()[:1]

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

    # -- traced functions: StepPrograms' programs over the runner's parameters and carry --------------------

    def _traced(self, program: Callable[..., Any]) -> Callable[..., Any]:
        """`program(model, ...)` as a jitted call takes it: over the parameter leaves, its traces counted."""

        def fn(state, *args):
            self.num_compiles += 1  # runs only while tracing
            return program(self._model(state), *args)

        return fn

    def _step_fn(self, state, pools, batch, sampling):
        """`StepPrograms.ragged_step` over what a call of `_step` takes (`_carry`, `_params`): with the proposer on
        the device, `pools` is (pools, token histories); with the draft model on the device, `state` is (target
        leaves, draft leaves) and `pools` (pools, draft pools). Returns the outputs, the same carry, and the
        sampled tokens [max_num_seqs] kept on the device."""
        self.num_compiles += 1  # runs only while tracing
        history = draft = None
        if self.history is not None:
            pools, history = pools
        if self.draft is not None:
            (state, draft_state), (pools, draft_pools) = state, pools
            draft = DeviceDraft(self.draft._model(draft_state), draft_pools, self.draft.page_size)
        outs, pools, history, draft_pools, kept = self._programs.ragged_step(self._model(state), pools, batch,
                                                                            sampling, history, draft)
        if history is not None:
            pools = (pools, history)
        if draft is not None:
            pools = (pools, draft_pools)
        return outs, pools, kept

    def _rounds_fn(self, state, carry, batch, sampling):
        """A call of speculative rounds over what `_rounds` takes: `StepPrograms.spec_rounds_step` (n-gram; `carry`
        is (pools, token histories)) or, with the draft model on the device, `draft_rounds_step` (`state` is
        (target leaves, draft leaves) and `carry` (pools, draft pools)). Returns the outputs, the same carry, and
        each slot's last token [max_num_seqs]."""
        self.num_compiles += 1  # runs only while tracing
        if self.draft is None:
            return self._programs.spec_rounds_step(self._model(state), carry, batch, sampling)
        (state, draft_state), (pools, draft_pools) = state, carry
        draft = DeviceDraft(self.draft._model(draft_state), draft_pools, self.draft.page_size)
        outs, pools, draft_pools, last = self._programs.draft_rounds_step(self._model(state), pools, batch,
                                                                          sampling, draft)
        return outs, (pools, draft_pools), last

    def _upload_fn(self, history, rows, values):
        """Replace token-history rows (`DeviceHistory.flush`); one shape, compiled by `warmup`."""
        self.num_compiles += 1
        return set_rows(history, rows, values)

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

    # -- calls ------------------------------------------------------------------------------------------------

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
            return self._dispatch_rounds(out, draft_probs)
        if not out.scheduled:
            return PendingStep(out, result={})
        if (not self.spec_k or self.spec_dynamic) and all(e.num_tokens == 1 for e in out.scheduled):
            return self._dispatch_decode(out, chain)
        return self._dispatch_one(out, draft_probs, chain)

    def collect(self, pending: PendingStep) -> dict[str, SampledToken]:
        """The sampled tokens of a dispatched step (waits for the device)."""
        if pending.result is not None:
            return pending.result
        scheduled = pending.out.scheduled
        if pending.rounds:
            return rounds_tokens(self._rounds.outputs(pending.handle), scheduled, self._requests, self.history,
                                 self.spec_rounds)
        if pending.multi:
            return multi_step_tokens((pending.packed or self._multi).outputs(pending.handle), scheduled,
                                     self._requests)
        return step_tokens(pending.packed.outputs(pending.handle), scheduled, self._requests, self.history)

    def _dispatch_decode(self, out: SchedulerOutput, chain: PendingStep | None) -> PendingStep:
        """Launch a step in which every entry decodes one token (`StepPrograms.decode_step`)."""
        batch, sampling = self._decode_inputs(out, chain)
        return PendingStep(out, launched=self._launch(self._decode, batch, sampling), packed=self._decode)

    def _dispatch_one(self, out: SchedulerOutput, draft_probs: Any, chain: PendingStep | None) -> PendingStep:
        batch, sampling, drafted = self._ragged_inputs(out, draft_probs, chain)
        launched = self._launch(self._step, batch, sampling)
        for rid, valid in drafted:  # the draft computed its KV through the last draft it fed
            draft_probs.ran(rid, valid)
        return PendingStep(out, launched=launched, packed=self._step)

    def _dispatch_mixed(self, out: SchedulerOutput) -> PendingStep:
        """Launch a mixed call (`StepPrograms.mixed_step`): the ragged step of `out`, then each entry's num_steps - 1
        decode steps; its tokens are read as a multi-step call's."""
        batch, sampling, _ = self._ragged_inputs(out, None, None)
        batch["num_steps"] = np.zeros(len(batch["query_len"]), np.int32)
        batch["num_steps"][:len(out.scheduled)] = [e.num_steps for e in out.scheduled]
        self.num_mixed += 1
        return PendingStep(out, launched=self._launch(self._mixed, batch, sampling), multi=True, packed=self._mixed)

    def _dispatch_multi(self, out: SchedulerOutput, chain: PendingStep | None) -> PendingStep:
        """Launch a multi-step decode (every entry has `num_steps` > 1 or is a 1-step tail of one); chained
        entries start from `chain`'s last samples on device."""
        batch, sampling = self._multi_inputs(out, chain)
        launched = self._launch(self._multi, batch, sampling, self._no_last if chain is None else chain.last)
        self.num_chained += chain is not None
        return PendingStep(out, launched=launched, multi=True)

    def _dispatch_rounds(self, out: SchedulerOutput, proposals: Any) -> PendingStep:
        """Launch a call of speculative rounds: every entry is a decode token with `num_rounds` > 1 and its
        reserved draft slots. `proposals` (the proposer's): the drafts each request's first round may make, a
        mapping (n-gram), or with the draft model on the device `FusedDrafts` (that, and the draft pages)."""
        batch, sampling = self._rounds_inputs(out, proposals)
        launched = self._launch(self._rounds, batch, sampling)
        if self.draft is not None:  # the rounds write the draft's KV up to the call's last position at most
            for e in out.scheduled:
                proposals.ran(e.request_id, e.start + e.emit_limit)
        return PendingStep(out, launched=launched, packed=self._rounds, rounds=True)

    def warmup(self) -> int:
        """Compile every step shape (and the image encoder) with all-padding inputs; returns the number of
        compiles. Padding writes only to the null page, so the pools' real pages are untouched."""
        before = self.num_compiles
        for t, s in self.step_shapes:
            batch = self._empty_batch(t, s)
            if not self.text_only:
                batch["image_rows"] = self._zeros(t)
            for history in (0, self.max_model_len):
                self._run(batch, self._sampler_tensors([], s, history))
        for t, s in self.decode_shapes:
            for history in (0, self.max_model_len):
                _, self.pools = self._decode(self._leaves, self.pools, self._decode_batch(t, s),
                                             self._sampler_tensors([], s, history))
        for t, s in self.multi_step_shapes:
            for history in (0, self.max_model_len):
                _, self.pools = self._multi(self._leaves, self.pools, self._multi_batch(t, s),
                                            self._sampler_tensors([], s, history), self._no_last)
        for t, s in self.mixed_step_shapes:
            batch = self._empty_batch(t, s)
            batch["num_steps"] = np.zeros(s, np.int32)
            if not self.text_only:
                batch["image_rows"] = self._zeros(t)
            for history in (0, self.max_model_len):
                _, self.pools = self._mixed(self._leaves, self.pools, batch,
                                            self._sampler_tensors([], s, history))
        for t, s in self.spec_round_shapes:
            for history in (0, self.max_model_len):
                carry, fused = self._carry(self._rounds)
                _, carry = self._rounds(self._params(fused), carry, self._rounds_batch(t, s),
                                        self._sampler_tensors([], s, history))
                self._set_carry(carry, fused)
        if self.history is not None:  # the token histories' row upload
            self.history.warmup(self._upload)
        if self.serve.max_beam_width > 1:  # the beam forks' page copy
            zeros = np.zeros(self.serve.max_num_seqs, np.int32)
            self.pools = self._copy(self.pools, *self._put((zeros, zeros)))
        if not self.text_only:
            v = self.model_cfg.vision
            self._encode(self._leaves, self._put(np.zeros((v.image_size, v.image_size, v.channels), np.float32)))
        return self.num_compiles - before
