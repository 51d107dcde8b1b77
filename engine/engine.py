"""The step loop: schedule -> flattened mixed batch -> forward -> sample -> postprocess, with every step measured."""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from engine._C import BlockManager
from engine.config import EngineConfig
from engine.executor import Executor, StepBatch
from engine.kv_transfer import MAX_CHUNK_BYTES, Handoff, KvBegin, KvChunk, KvEnd, KvImportRefused, KvLayout, \
    KvReceiver, KvTransferError, stream_blocks
from engine.model_config import ModelConfig
from engine.request import Request, RequestStatus
from engine.sampler import PromptSpan, TopLogprobs, skip_samples
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarMask, Grammars, StructuredOutput
from engine.tokenizer import Detokenizer, Tokenizer
from scheduler.attainability import AttainabilityChecker
from scheduler.headroom import Headroom, handed_off
from scheduler.latency_model import LearningLatencyModel
from scheduler.output_length import OutputLengthTracker
from scheduler.slo import SLO, next_token_deadline
from scheduler.types import BatchPolicy, KvState, StepStats, is_decode, is_decoding

StepHook = Callable[[StepStats], None]

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot be served as asked; nothing else is affected."""


def _check_tpot_reserve(request_id: str, tpot_reserve: float) -> None:
    if not 0 <= tpot_reserve < 1:
        raise InvalidRequestError(f"request {request_id!r}: tpot_reserve must lie in [0, 1), got {tpot_reserve}")


@dataclass(slots=True)
class RequestOutput:
    """A request's result so far. `new_token_ids`/`new_text` are what this step added (for streaming)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    arrival: float
    first_token_time: float | None
    token_times: list[float]
    logprobs: list[float] | None
    num_cached_tokens: int
    first_scheduled_time: float | None = None
    error: str | None = None
    top_logprobs: list[TopLogprobs] | None = None  # per output token, when `top_logprobs` and `logprobs` ask
    # per prompt token (None for the first), complete from the first output on, when `prompt_logprobs` asks
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    handoff: Handoff | None = None  # finish_reason "prefilled": what the decode side needs to continue it


class Engine:
    """Owns the requests, the block manager, the batch policy and an executor. Single-threaded: one caller steps it."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, executor: Executor, policy: BatchPolicy,
                 tokenizer: Tokenizer | None, latency_model: LearningLatencyModel, *, headroom: Headroom | None = None,
                 clock=time.monotonic, stats_history: int = 4096):
        """`headroom`: the margin the batch policy plans with (`build_engine` hands the same one to both); the
        engine feeds it the outcome of every request."""
        self.config, self.executor, self.policy, self.tokenizer = config, executor, policy, tokenizer
        self.tiers = config.tier_set
        self.block_size = config.block_size
        self.max_model_len = model_config.context_length(config.max_model_len)
        eos = model_config.eos_token_ids
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset(eos)
        # The engine alone feeds the latency model, once per step; the policy and the admission test predict by it.
        self.latency_model = latency_model
        self.headroom = headroom or Headroom(config.headroom_target)
        self.output_lengths = OutputLengthTracker(default_mean=min(256, self.max_model_len))
        self.attainability = AttainabilityChecker(latency_model, self.output_lengths, config.prefill_chunk)
        self.iteration_end = 0.0  # predicted end of the step in flight
        self.clock = clock
        self.blocks = BlockManager(executor.num_kv_blocks, self.block_size, config.enable_prefix_caching)
        self.waiting: list[Request] = []  # kept in arrival order
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.detok: dict[str, Detokenizer] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=stats_history)  # recent history; `num_steps` counts all
        self.num_steps = 0
        # called on the stepping thread after every step, once the latency model has it: the engine's lists are a
        # consistent picture there (the cluster worker takes its resident report from them)
        self.step_hooks: list[StepHook] = []
        self._seq_ids = itertools.count()
        self.role = config.role
        self.kv_layout = KvLayout.of_cache(executor.kv_cache, self.block_size)
        self.handoffs: dict[str, Request] = {}  # prefilled, holding their blocks until the decode side has them
        self.imports: dict[str, KvReceiver] = {}  # reserved here, their KV still on the way
        self.grammars = Grammars(tokenizer.hf, executor.vocab_size, sorted(self.eos_token_ids)) \
            if tokenizer is not None else None

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    slo: SLO | str | None = None, arrival: float | None = None, tier: str | None = None,
                    resumed_tokens: int = 0, tpot_reserve: float = 0.0) -> Request:
        """Validates and queues a request; raises InvalidRequestError (the engine is untouched) when it can't run.

        Its SLO is made concrete here unless a front end did so at its own admission (then `tier` names the tier
        it resolved and `slo` is that request's SLO): `slo` is an SLO, a tier name or None (the default tier).

        `resumed_tokens`: the prompt's last tokens are output that the request already streamed from another
        instance (a stream migrated off a failed one; `max_tokens` counts what remains). They are prefilled again
        with the prompt, and the request goes on as if it had produced them here: its text continues theirs
        (stop strings across the seam, the same text held back) and a seeded generator is past their draws.

        `tpot_reserve`: the share of its TPOT the batch policy keeps in reserve before each of its tokens' deadlines
        (`scheduler.types.SchedulableRequest`), as the router that placed it asks."""
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.imports:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if tier is None:
            try:
                resolved, slo = self.tiers.resolve(slo)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            tier = resolved.name
        elif not isinstance(slo, SLO):
            raise InvalidRequestError(f"a request admitted under tier {tier!r} needs its SLO, got {slo!r}")
        ids = self._tokenize(prompt)
        if len(ids) + 1 > self.max_model_len:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens leaves no room for output in the context "
                                      f"length of {self.max_model_len}")
        if len(ids) > self.executor.num_kv_blocks * self.block_size:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens exceeds the KV pool "
                                      f"({self.executor.num_kv_blocks * self.block_size} tokens)")
        _check_tpot_reserve(request_id, tpot_reserve)
        if not 0 <= resumed_tokens < len(ids):
            raise InvalidRequestError(f"resumed_tokens must be in [0, {len(ids)}) for a prompt of {len(ids)} tokens, "
                                      f"got {resumed_tokens}")
        detok, generator, grammar = self._continuation(params, ids[len(ids) - resumed_tokens:])
        req = Request(request_id, next(self._seq_ids), ids, params, self.clock() if arrival is None else arrival,
                      slo=slo, tier=tier, generator=generator, grammar=grammar, tpot_reserve=tpot_reserve)
        self.blocks.add_sequence(req.seq_id, ids)
        self.requests[request_id] = req
        self.detok[request_id] = detok
        self._enqueue(req)
        return req

    def _continuation(self, params: SamplingParams, produced: list[int]):
        """(detokenizer, seeded generator, grammar matcher) of a request whose output so far, `produced`, was made
        elsewhere, as if made here: the text continues it (what it streamed counted as sent), the generator is past
        its draws and the matcher has accepted it."""
        detok = Detokenizer(self.tokenizer, params.stop)
        for token in produced:
            if detok.add(token):
                raise InvalidRequestError("the output produced so far already contains a stop string")
        detok.take_delta(False)  # the client has that text already
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.executor.device).manual_seed(params.seed)
            skip_samples(generator, self.executor.vocab_size, len(produced))
        grammar = None
        if params.structured_output is not None:
            grammar = self._with_grammars(Grammars.matcher, params.structured_output)
            if not all(grammar.accept_token(t) for t in produced):
                raise InvalidRequestError("the output produced so far does not follow the request's structured "
                                          "output")
        return detok, generator, grammar

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles the grammar of `params`' structured output unless it is compiled already. Thread-safe, and it
        touches no request: a front end calls it off the step loop so that `add_request` finds the grammar compiled.
        Raises InvalidRequestError for a structured output that cannot be served."""
        if params.structured_output is not None:
            self._with_grammars(Grammars.compile, params.structured_output)

    def _with_grammars(self, method, spec: StructuredOutput):
        """method(self.grammars, spec), its refusals as InvalidRequestError."""
        if self.grammars is None:
            raise InvalidRequestError("structured output needs the model's tokenizer, and this model has none")
        try:
            return method(self.grammars, spec)
        except ValueError as e:
            raise InvalidRequestError(f"structured output: {e}") from None

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.executor.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def _enqueue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            if request_id in self.imports:
                self.cancel_import(self.imports[request_id])
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        return self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- prefill/decode hand-off (engine/kv_transfer.py) ----------------------------------------------------
    def handoff(self, request_id: str) -> Handoff:
        """The state of a request this engine holds for a hand-off (its output ended "prefilled": a prefill engine's
        at its first token, or one let go of mid-stream by `hand_over`)."""
        req = self._held(request_id)
        p = req.params
        logprobs, top = req.output_logprobs, req.output_top_logprobs
        return Handoff(
            req.request_id, req.prompt_token_ids, req.output_token_ids[0], p, req.slo, req.tier, req.arrival,
            req.token_times[0], req.first_scheduled_time, req.num_cached_tokens, req.standing, self.kv_layout,
            self._blocks_for(req.num_computed_tokens),
            first_logprob=logprobs[0] if logprobs else None,
            first_top_logprobs=top[0] if top else None,
            prompt_logprobs=req.prompt_logprobs if p.prompt_logprobs else None,
            prompt_top_logprobs=req.prompt_top_logprobs if p.prompt_logprobs else None,
            later_tokens=req.output_token_ids[1:], later_times=req.token_times[1:],
            later_logprobs=logprobs[1:] if logprobs else None, later_top_logprobs=top[1:] if top else None,
            tpot_reserve=req.tpot_reserve)

    def hand_over(self, request_id: str) -> RequestOutput | None:
        """A decoding request of this engine (role decode or both) leaves the batch between steps to go on another
        instance: held with its blocks for the pull, as a prefill engine holds a prompt at its first token, its
        last output ending "prefilled" with its hand-off. Text held back for a stop string stays held: the other
        side streams it. None when it is not decoding here (finished, or still in its prompt)."""
        req = self.requests.get(request_id)
        if self.role == "prefill" or req is None or req not in self.running or not is_decoding(req):
            return None
        self.running.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, "prefilled"
        self.handoffs[request_id] = req
        out = self._output(req, [], "")
        out.handoff = self.handoff(request_id)
        return out

    def export_kv(self, request_id: str, first_block: int = 0,
                  max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[KvBegin | KvChunk | KvEnd]:
        """The frames of a held request's computed blocks from `first_block` on (what the receiving side asks),
        read as they are consumed: the blocks stay held until `release_handoff`."""
        req = self._held(request_id)
        blocks = list(self.blocks.block_table(req.seq_id))[:self._blocks_for(req.num_computed_tokens)]
        return stream_blocks(request_id, self.executor.kv_cache, self.kv_layout, blocks, first_block,
                             max_chunk_bytes)

    def release_handoff(self, request_id: str) -> None:
        """Lets go of a held request once the decode side has its KV, or once no decode side will take it: its
        blocks are freed, the full ones staying in the prefix cache as any finished request's do."""
        self._finish(self._held(request_id), "prefilled")

    def _held(self, request_id: str) -> Request:
        req = self.handoffs.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not held here for a hand-off")
        return req

    def _hold_for_handoff(self, req: Request, token: int) -> RequestOutput:
        """A prefill engine's request with its first token: it leaves the batch with its blocks and ends here as
        "prefilled". Text held back for a stop string stays held: the decode side streams it."""
        self.running.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, "prefilled"
        self.handoffs[req.request_id] = req
        out = self._output(req, [token], self.detok[req.request_id].take_delta(False))
        out.handoff = self.handoff(req.request_id)
        return out

    def _blocks_for(self, num_tokens: int) -> int:
        """How many KV blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def reserve_import(self, handoff: Handoff) -> KvReceiver:
        """Reserves the blocks of an exported request, its prompt and output so far, and returns the receiver its
        KV frames go to (from its `first_block`: the leading blocks this engine's prefix cache holds are taken
        from there). KvImportRefused when the blocks are not free, KvTransferError when this engine cannot take
        it (role, KV layout), InvalidRequestError for a bad request; none of them reserves anything."""
        if self.role == "prefill":
            raise KvTransferError("a 'prefill' engine imports no KV: roles decode and both do")
        rid, prompt = handoff.request_id, handoff.prompt_token_ids
        if rid in self.requests or rid in self.imports:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if handoff.layout != self.kv_layout:
            raise KvTransferError(f"request {rid!r}: KV layout {handoff.layout} does not match this engine's "
                                  f"{self.kv_layout}")
        _check_tpot_reserve(rid, handoff.tpot_reserve)
        later = len(handoff.later_tokens)
        if len(handoff.later_times) != later or any(
                x is not None and len(x) != later for x in (handoff.later_logprobs, handoff.later_top_logprobs)):
            raise InvalidRequestError(f"request {rid!r}: {later} later tokens with other counts of times or "
                                      f"logprobs")
        ids = self._tokenize([*prompt, *handoff.output_token_ids])
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"request {rid!r} of {len(ids)} tokens has no room to continue in the "
                                      f"context length of {self.max_model_len}")
        computed = len(ids) - 1  # its newest token is computed here
        if handoff.num_blocks != self._blocks_for(computed):
            raise KvTransferError(f"request {rid!r}: {handoff.num_blocks} blocks cannot hold {computed} computed "
                                  f"tokens in blocks of {self.block_size}")
        seq_id = next(self._seq_ids)
        self.blocks.add_sequence(seq_id, ids)
        cached = self.blocks.allocate_cached_prefix(seq_id)
        if not self.blocks.ensure_capacity(seq_id, len(ids)):
            self.blocks.remove_sequence(seq_id)
            raise KvImportRefused(f"request {rid!r} needs {self._blocks_for(len(ids))} KV blocks, "
                                  f"{self.blocks.num_free_blocks()} are free")
        receiver = KvReceiver(handoff, seq_id, list(self.blocks.block_table(seq_id)), cached // self.block_size,
                              self.executor.kv_cache)
        self.imports[rid] = receiver
        return receiver

    def finish_import(self, receiver: KvReceiver) -> Request:
        """Applies a complete, verified transfer: the KV goes into the reserved blocks and the request joins the
        running batch, decoding on from its newest token with the sampling state it had (text, seeded generator,
        grammar). KvTransferError, nothing applied, for a transfer that is not complete or no longer reserved."""
        rid, h = receiver.request_id, receiver.handoff
        if self.imports.get(rid) is not receiver:
            raise KvTransferError(f"request {rid!r} has no reservation here (cancelled or applied already)")
        receiver.apply()  # KvTransferError, nothing marked, when the transfer is not complete
        outputs = h.output_token_ids
        detok, generator, grammar = self._continuation(h.params, outputs)
        computed = len(h.prompt_token_ids) + len(outputs) - 1
        del self.imports[rid]
        self.blocks.mark_computed(receiver.seq_id, computed)
        req = Request(rid, receiver.seq_id, list(h.prompt_token_ids), h.params, h.arrival, slo=h.slo, tier=h.tier,
                      generator=generator, grammar=grammar, tpot_reserve=h.tpot_reserve)
        for token, t in zip(outputs, [h.first_token_time, *h.later_times]):
            req.append_output(token, t)
        if h.first_logprob is not None:
            req.output_logprobs += [h.first_logprob, *(h.later_logprobs or ())]
        if h.first_top_logprobs is not None:
            req.output_top_logprobs += [h.first_top_logprobs, *(h.later_top_logprobs or ())]
        if h.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_top_logprobs = list(h.prompt_logprobs), list(h.prompt_top_logprobs)
        req.num_computed_tokens, req.num_cached_tokens = computed, h.num_cached_tokens
        req.num_blocks = self.blocks.num_blocks_of(receiver.seq_id)
        req.first_scheduled_time, req.standing = h.first_scheduled_time, handed_off(h.standing)
        req.status = RequestStatus.RUNNING
        self.requests[rid], self.detok[rid] = req, detok
        self.running.append(req)
        return req

    def cancel_import(self, receiver: KvReceiver) -> None:
        """Gives back a reservation whose transfer failed or was given up; nothing of it was applied (its blocks,
        which may hold part of the transfer, were never marked computed)."""
        receiver.cancel()  # no chunk is written into the blocks once they are given back
        if self.imports.get(receiver.request_id) is receiver:
            del self.imports[receiver.request_id]
            self.blocks.remove_sequence(receiver.seq_id)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.clock()
        kv = KvState(self.block_size, self.blocks.num_free_blocks(), self.blocks.num_total_blocks)
        plan = self.policy.schedule(start, self.running, self.waiting, kv)
        for req in plan.preempted:
            self._preempt(req)
        items = self._admit(plan.scheduled)
        if not items:
            return []
        reqs = [r for r, _ in items]
        computed = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, len(reqs))
        new = np.fromiter((n for _, n in items), np.int64, len(reqs))
        meta = self.blocks.build_batch(np.fromiter((r.seq_id for r in reqs), np.int64, len(reqs)), computed, new)
        sampled = [reqs[i] for i in meta.sample_rows.tolist()]
        num_decode = sum(1 for r, n in items if is_decode(r, n))
        num_prefill = int(new.sum()) - num_decode
        num_kv = int(meta.seq_lens.sum())
        spans = [(r, span) for b, (r, n) in enumerate(items) if r.params.prompt_logprobs
                 and (span := self._prompt_span(r, n, int(meta.query_start_loc[b]))) is not None]
        batch = StepBatch(meta, [r.params for r in sampled], [r.generator for r in sampled],
                          num_prefill, num_decode, num_kv, len(items),
                          grammar=GrammarMask.of([r.grammar for r in sampled], self.executor.vocab_size),
                          prompt_spans=[span for _, span in spans])
        self.iteration_end = start + self.latency_model.predict(num_prefill, num_decode, num_kv)
        try:
            result = self.executor.execute(batch)
        except Exception as e:  # a failed forward ends this batch's requests with an error, not the engine
            log.exception("step failed; ending its %d requests with an error", len(reqs))
            for r in reqs:
                self.running.remove(r)
            return [self._finish(r, "error", error=f"{type(e).__name__}: {e}") for r in reqs]
        now = self.clock()
        for r, n in items:
            r.num_computed_tokens += n
            self.blocks.mark_computed(r.seq_id, r.num_computed_tokens)
        for (r, _), got in zip(spans, result.prompt_logprobs or ()):
            r.prompt_logprobs.extend(got.logprobs)
            r.prompt_top_logprobs.extend(got.top_logprobs or [None] * len(got.logprobs))
        logprobs, top = result.logprobs, result.top_logprobs
        outputs = [self._append_token(r, t, None if logprobs is None else logprobs[i],
                                      None if top is None else top[i], now)
                   for i, (r, t) in enumerate(zip(sampled, result.token_ids))]
        stats = StepStats(start, self.clock() - start, num_prefill, num_decode, num_kv,
                          self.blocks.num_total_blocks - self.blocks.num_free_blocks(), len(self.running),
                          len(self.waiting), len(items))
        self.step_stats.append(stats)
        self.num_steps += 1
        self.latency_model.observe(stats)
        for hook in self.step_hooks:
            hook(stats)
        return outputs

    # ---- internals ------------------------------------------------------------------------------------------
    def _admit(self, scheduled) -> list[tuple[Request, int]]:
        """Gives every planned request its KV blocks (prefix-cache hits first for newcomers); drops what can't fit."""
        items = []
        for req, n in scheduled:
            if n <= 0:
                continue
            newcomer = req.status is RequestStatus.WAITING
            if newcomer and req.num_blocks == 0:
                # prompt logprobs still to compute need the logits of every prompt position: no cache hits
                wants_prompt = req.params.prompt_logprobs and len(req.prompt_logprobs) < req.num_prompt_tokens
                cached = 0 if wants_prompt else self.blocks.allocate_cached_prefix(req.seq_id)
                req.num_computed_tokens = cached
                if req.num_output_tokens == 0:
                    req.num_cached_tokens = cached
                n = min(n, req.num_tokens - cached)
            if not self.blocks.ensure_capacity(req.seq_id, req.num_computed_tokens + n):
                if newcomer:
                    self.blocks.free_blocks(req.seq_id)
                    req.num_computed_tokens = 0
                req.num_blocks = self.blocks.num_blocks_of(req.seq_id)
                continue
            req.num_blocks = self.blocks.num_blocks_of(req.seq_id)
            if newcomer:
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = self.clock()
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
            items.append((req, n))
        # single-token rows (decodes) lead the flattened batch whatever the policy's order: the attention kernel then
        # runs them on decode-shaped tiles apart from the prefill chunks
        items.sort(key=lambda item: item[1] != 1)
        return items

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the request's KV, keep its tokens, send it back to the queue."""
        self.blocks.free_blocks(req.seq_id)
        req.num_computed_tokens = req.num_blocks = 0
        if req in self.running:
            self.running.remove(req)
            self._enqueue(req)

    @staticmethod
    def _prompt_span(req: Request, num_new: int, first_row: int) -> PromptSpan | None:
        """The positions of this step's chunk whose next prompt token has no log-probability yet (a chunk computed
        again after a preemption has them already)."""
        start = req.num_computed_tokens  # position p scores prompt token p + 1
        first = max(start + 1, len(req.prompt_logprobs))  # prompt index of the first token to score
        end = min(start + num_new + 1, req.num_prompt_tokens)
        if end <= first:
            return None
        return PromptSpan(first_row + first - 1 - start, req.prompt_token_ids[first:end], req.params.top_logprobs)

    def _append_token(self, req: Request, token: int, logprob: float | None, top: TopLogprobs | None,
                      now: float) -> RequestOutput:
        req.standing = self.headroom.note_token(req.standing, req.num_output_tokens == 0,
                                                now > next_token_deadline(req))
        req.append_output(token, now)
        if logprob is not None and req.params.logprobs:
            req.output_logprobs.append(logprob)
            if top is not None:
                req.output_top_logprobs.append(top)
        self.blocks.append_token(req.seq_id, token)
        detok = self.detok[req.request_id]
        p = req.params
        reason = error = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            reason, error = "error", f"token {token} does not follow the request's structured output"
        elif (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif detok.add(token):
            reason = "stop"
        elif req.grammar is not None and req.grammar.is_terminated():  # its document is complete
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        elif self.role == "prefill":
            return self._hold_for_handoff(req, token)
        if reason is not None:
            self.running.remove(req)
            return self._finish(req, reason, new_token_ids=[token], error=error)
        return self._output(req, [token], detok.take_delta(False))

    def _finish(self, req: Request, reason: str, new_token_ids: list[int] | None = None,
                error: str | None = None) -> RequestOutput:
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        if reason in ("stop", "length"):
            self.output_lengths.observe(req.tier, req.num_output_tokens)
            self.headroom.note_finished(req.standing)
        self.blocks.remove_sequence(req.seq_id)
        req.num_blocks = req.num_computed_tokens = 0
        self.handoffs.pop(req.request_id, None)
        del self.requests[req.request_id]
        detok = self.detok.pop(req.request_id)
        return self._output(req, new_token_ids or [], detok.take_delta(True), text=detok.text)

    def _output(self, req: Request, new_ids: list[int], new_text: str, text: str | None = None) -> RequestOutput:
        if text is None:
            text = self.detok[req.request_id].text
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=req.output_token_ids,
            text=text, new_token_ids=new_ids, new_text=new_text, finished=req.finished,
            finish_reason=req.finish_reason, arrival=req.arrival,
            first_token_time=req.token_times[0] if req.token_times else None, token_times=req.token_times,
            logprobs=req.output_logprobs if req.params.logprobs else None, num_cached_tokens=req.num_cached_tokens,
            first_scheduled_time=req.first_scheduled_time, error=req.error,
            top_logprobs=req.output_top_logprobs if req.params.logprobs and req.params.top_logprobs else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs else None,
            prompt_top_logprobs=req.prompt_top_logprobs if req.params.prompt_logprobs else None)
