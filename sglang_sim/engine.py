"""The scheduler: admits requests against the KV pool, emits their tokens over time, and ends every request once.

Why one task per request instead of a batched step loop: the sim has no GPU batch to fill, and a task per request
keeps each lifecycle readable as straight-line code (wait for KV -> decode -> release) with a single `finally`
that returns the KV. Every way a request can end (finish, abort by rid, abort_all, client disconnect, pause-abort,
replace in a session, session close) goes through `_end`, so the books cannot depend on which path was taken.
KV is reserved at admission for the whole planned reply, like a real engine reserving decode space, so a running
request never stalls on memory; when the pool is short the request waits (unlocked radix leaves are evicted LRU
first), and one that could never fit is refused up front.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_sim import sampling_masks
from sglang_sim.family import EngineFamily
from sglang_sim.generation import ReplyPlan, SamplingParams, derive_seed, plan_reply
from sglang_sim.images import Expanded, expand, load_image
from sglang_sim.kv_pool import KVPool
from sglang_sim.lora import LoraAdapters, LoraRefusal
from sglang_sim.radix_cache import Node, RadixCache
from sglang_sim.requests import BadRequest, GenerateInput, SimRequest
from sglang_sim.sessions import EngineSession, KVHold, SessionRefusal

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_MESSAGE = "Aborted"
# A request aborted before it was scheduled comes back through TokenizerManager._handle_abort_req, whose default
# message this is, with a reduced meta_info (no prompt_tokens / cached_tokens): see wire.queued_abort_body.
WAITING_ABORT_MESSAGE = "Abort in waiting queue"
_MIN_SLEEP_S = 0.01  # emit at least this much latency per wake-up, so per-token latency stays cheap to emulate
_EMPTY = np.zeros(0, dtype=np.int32)
_MAX_ROUTING_KEYS = 4096
_MAX_CUT_REPLIES = 1024
# What a token sampled by new weights on KV the old weights computed has off its exact logprob (the real engine's
# measured 0.2: docs/design.md 5.4), so a fast-tier test sees stale KV as a real one does.
STALE_KV_SHIFT = -0.25
_MIXED = -1  # a slot version: KV partly computed by other weights (an update while its request ran)


def weight_shift(version: str, first: str = "default") -> float:
    """What weights `version` add to a planned logprob, on KV of their own: 0 under the engine's `first` weights (its
    --weight-version), else a small amount in [-0.2, 0) fixed by the version's name. The sim's outputs stay those of
    the plan, their logprobs move with the weights, so a test can tell which weights (and KV) sampled a token."""
    if version == first:
        return 0.0
    digest = hashlib.blake2b(version.encode(), digest_size=4).digest()
    return float(np.float32(-(int.from_bytes(digest, "little") % 1000 + 1) / 5000))



def _lora_mark(lora_seed: int | None) -> bytes:
    """What tells one adapter's cut replies from another's (and the base model's) with the same tokens."""
    return b"" if lora_seed is None else b"|lora" + lora_seed.to_bytes(8, "little")

@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_tokens: int = 65536
    context_length: int = 32768
    token_latency_ms: float = 0.0
    prefill_latency_ms: float = 0.0  # per 1000 prompt tokens that are not cached
    seed: int = 0
    enable_streaming_session: bool = False
    weight_version: str = "default"
    incremental_streaming_output: bool = False  # SGLang's --incremental-streaming-output
    stream_interval: int | None = None  # SGLang's --stream-interval; None: one event per decode wake-up
    reasoning_parser: str | None = None  # SGLang's --reasoning-parser: `require_reasoning` holds a grammar back
    sampling_mask_max_tokens: int = sampling_masks.DEFAULT_MAX_TOKENS  # SGLang's --sampling-mask-max-tokens
    # SGLang's --enable-lora, --lora-paths NAME=DIR and --max-loaded-loras (sglang_sim/lora.py)
    enable_lora: bool = False
    lora_paths: tuple[tuple[str, str], ...] = ()
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8  # reported only: the sim runs every request on its own
    # SGLang's --max-running-requests: the request rows (req_to_token_pool). A request is admitted only into a free
    # row; a streaming session keeps its first turn's row until it is closed (session/streaming_session.py).
    max_running_requests: int = 4096


class Engine:
    """All mutable engine state; touched only from the event loop."""

    def __init__(self, config: EngineConfig, family: EngineFamily) -> None:
        self.config = config
        self.family = family
        self.pool = KVPool(config.kv_capacity_tokens)
        self.cache = RadixCache(self.pool)
        self.requests: dict[str, SimRequest] = {}
        self.sessions: dict[str, EngineSession] = {}
        self._row_requests: set[str] = set()  # rids of running requests in a row of their own
        self._row_sessions: set[str] = set()  # streaming sessions that keep a row (their first turn's) until closed
        self.paused = False
        self.pause_mode: str | None = None
        self.forward_sleep_s = 0.0  # SGLang's /slow_down: added to every decode step
        self.weight_version = config.weight_version
        self.last_routing_key: str | None = None
        self.routing_keys: dict[str, int] = {}  # X-SMG-Routing-Key -> requests seen (bounded, oldest dropped)
        self.finished_total = 0
        # scheduler.py `_accumulate_decode_moment` sums per decode step: steps, batch size, step time (us), batch
        # size squared, batch size x step time, tokens generated. Each sim request decodes on its own (batch 1).
        self._decode_moments = [0.0] * 6
        self.aborted_total = 0
        self.generated_tokens_total = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Replies an abort cut, by prompt + the tokens emitted before the cut (bounded, oldest dropped): see `_plan`.
        self._cut: dict[bytes, tuple[ReplyPlan, int]] = {}
        # Weight-dependent logprobs (logprob_shift): which weights computed each KV slot, by version number, and the
        # partitions of the radix cache by `extra_key`.
        self._versions: dict[str, int] = {config.weight_version: 0}
        self._slot_versions = np.zeros(self.pool.capacity, dtype=np.int32)
        self._namespaces: dict[str, int] = {}
        self.lora = LoraAdapters(enabled=config.enable_lora, max_loaded=config.max_loaded_loras)
        for name, path in config.lora_paths:
            self.lora.load(name, path)

    # -- submission -----------------------------------------------------------------------------------------------

    def submit(self, inp: GenerateInput, mask_overflow: bool = False) -> SimRequest:
        """Validate, plan and start a request; raises BadRequest for anything SGLang answers with a 400."""
        if inp.rid in self.requests:
            raise BadRequest(f"Duplicate request ID detected: {inp.rid}")
        if inp.input_ids is not None:
            ids = inp.input_ids
        else:
            ids = np.asarray(self.family.tokenizer.encode(inp.text or ""), dtype=np.int32)
        expanded = self._expand_images(inp, ids)
        session = None
        prompt = expanded.prompt
        if inp.session_params is not None:
            session = self.sessions.get(inp.session_params.id)
            if session is None:
                raise BadRequest(f"Invalid request: session id {inp.session_params.id} does not exist")
            try:
                prompt = session.build_prompt(inp.session_params, ids, self.family.bos_token_id)
            except SessionRefusal as exc:
                raise BadRequest(str(exc)) from exc
        if len(prompt) == 0:
            raise BadRequest("The input is empty.")
        lora_seed, lora_id = None, 0
        if inp.lora_path is not None:
            try:
                path, lora_id = self.lora.resolve(inp.lora_path)
            except LoraRefusal as exc:
                raise BadRequest(str(exc)) from exc
            lora_seed = self.lora.seed(self.config.seed, path)
        start_len = inp.routed_experts_start_len
        if inp.return_routed_experts and not 0 <= start_len <= len(prompt):  # scheduler.py handle_generate_request
            raise BadRequest(f"routed_experts_start_len={start_len} is outside [0, {len(prompt)}] (the number of "
                             "input tokens).")
        if inp.sampling.max_new_tokens is None:
            # scheduler.py init_req_max_new_tokens: null means "until the context (or the KV pool) is full": at most
            # max_req_len - input_len - 1 with max_req_len = context_len - 1, and at most the pool's capacity - input
            # - page_size - 1 (allocator max_new_tokens_for_memory, page_size 1).
            room = min(self.config.context_length, self.pool.capacity) - len(prompt) - 2
            inp = dataclasses.replace(inp, sampling=dataclasses.replace(inp.sampling, max_new_tokens=max(0, room)))
        self._check_context(len(prompt), inp.sampling.max_new_tokens)
        if inp.return_sampling_mask and (why := sampling_masks.refusal(inp.sampling,
                                                                       self.config.sampling_mask_max_tokens)):
            raise BadRequest(why)
        key = expanded.key if expanded.images else prompt
        try:
            plan = self._plan(prompt, key, inp.sampling,
                              inp.require_reasoning and self.config.reasoning_parser is not None, lora_seed)
        except ValueError as exc:  # a constraint the sim cannot satisfy (ConstraintError) or a bias banning every word
            raise BadRequest(str(exc)) from exc
        if inp.return_sampling_mask and sampling_masks.effective_top_k(inp.sampling) > 1:
            # The mask's distribution has no sampled token less likely than this (sampling_masks.py).
            plan.logprobs = np.maximum(plan.logprobs, np.float32(sampling_masks.floor(self.family.vocab_size)))
        req = SimRequest(inp=inp, prompt=prompt, plan=plan, session=session,
                         key=key if expanded.images else None, images=expanded.images,
                         namespace=self._namespace(inp.extra_key, lora_id), lora_seed=lora_seed)
        if mask_overflow and inp.return_sampling_mask and sampling_masks.effective_top_k(inp.sampling) > 1:
            req.overflow_at = len(plan.output_ids) // 2  # a greedy mask is the argmax alone: it cannot overflow
        if len(req.kv_tokens) > self.pool.capacity:
            raise BadRequest(f"Input length ({len(prompt)} tokens) plus the reply exceeds the maximum number of "
                             f"KV tokens ({self.pool.capacity}).")
        if inp.routing_key is not None:
            self.last_routing_key = inp.routing_key
            self.routing_keys[inp.routing_key] = self.routing_keys.pop(inp.routing_key, 0) + 1
            if len(self.routing_keys) > _MAX_ROUTING_KEYS:
                del self.routing_keys[next(iter(self.routing_keys))]
        self.requests[req.rid] = req
        if session is not None and inp.session_params is not None:
            for orphan in session.attach(req, inp.session_params):
                self._abort(orphan, ABORT_MESSAGE)
        task = asyncio.get_running_loop().create_task(self._run(req), name=f"sim-request-{req.rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return req

    def _expand_images(self, inp: GenerateInput, ids: np.ndarray) -> Expanded:
        """The prompt with its images expanded (sglang_sim/images.py has SGLang's rules). Raises ImageRefusal (a 400)
        for an image SGLang cannot load, EngineCrash (a 500) for more pads than images."""
        if not inp.image_data:
            return Expanded(prompt=ids, key=ids, images=())
        vision = self.family.vision
        if vision is None:
            raise BadRequest("sglang-sim: this model's vocabulary has no <|image_pad|> token; it takes no images")
        images = [load_image(source, self.family.geometry) for source in inp.image_data]
        expanded = expand(ids, images, vision.pad, self.family.vocab_size)
        if expanded.images and inp.session_params is not None:
            raise BadRequest("sglang-sim does not emulate image_data on engine sessions")
        return expanded

    def _plan(self, prompt: np.ndarray, key: np.ndarray, params: SamplingParams, reasoning_gate: bool,
              lora_seed: int | None = None) -> ReplyPlan:
        """The reply to `prompt` (its images are in `key`: another image, another reply). A prompt that is an aborted
        request's prompt + the tokens it had emitted gets the rest of that request's reply (within this request's
        max_new_tokens), as a model continues its own text: a reply continued after an abort (a weight update) is
        then the reply an uninterrupted run gives. `reasoning_gate`: a grammar waits for the end of the reasoning
        (generation.py `grammar_first`). `lora_seed`: the request's adapter (sglang_sim/lora.py): another reply."""
        cut = self._cut.get(key.astype(np.int32, copy=False).tobytes() + _lora_mark(lora_seed))
        if cut is None:
            base = self.config.seed if lora_seed is None else lora_seed
            seed = base if key is prompt else derive_seed(base, key, None) % 2**63
            return plan_reply(self.family, prompt, params, seed, reasoning_gate)
        whole, emitted = cut
        ids, logprobs, finish = whole.output_ids[emitted:], whole.logprobs[emitted:], whole.finish_reason
        limit = params.max_new_tokens
        if finish.get("type") == "length" or len(ids) > limit:
            ids, logprobs, finish = ids[:limit], logprobs[:limit], {"type": "length", "length": limit}
        return ReplyPlan(output_ids=ids, logprobs=logprobs, finish_reason=finish)

    def _namespace(self, extra_key: str | None, lora_id: int = 0) -> int:
        """The radix-cache partition of an `extra_key` and an adapter's load (0: neither), numbered in order of first
        use: SGLang appends the adapter's `lora_id` to the request's extra key."""
        if lora_id:
            extra_key = f"{extra_key or ''}\x00lora:{lora_id}"
        if not extra_key:
            return 0
        return self._namespaces.setdefault(extra_key, len(self._namespaces) + 1)

    def logprob_shift(self, version: str, stale: bool) -> float:
        """What weights `version` add to a planned logprob (`weight_shift`), and on `stale` KV (computed by other
        weights) STALE_KV_SHIFT more."""
        return weight_shift(version, self.config.weight_version) + (STALE_KV_SHIFT if stale else 0.0)

    def _version_number(self) -> int:
        return self._versions.setdefault(self.weight_version, len(self._versions))

    def _computed(self, req: SimRequest, prefix: np.ndarray, new: np.ndarray) -> None:
        """At admission: the request's new slots are computed by the weights now; its tokens from here on are
        sampled by them, on KV of them unless the reused `prefix` slots were computed by other weights."""
        current = self._version_number()
        stale = bool(len(prefix)) and bool(np.any(self._slot_versions[prefix] != current))
        self._slot_versions[new] = _MIXED if stale else current
        if len(req.shift) != len(req.plan.output_ids):
            req.shift = np.zeros(len(req.plan.output_ids), dtype=np.float32)
        req.shift[req.generated:] = self.logprob_shift(self.weight_version, stale)

    def _remember_cut(self, req: SimRequest) -> None:
        if not 0 < req.generated < len(req.plan.output_ids):
            return
        key = (np.concatenate([req.content_key, req.output_ids]).astype(np.int32, copy=False).tobytes()
               + _lora_mark(req.lora_seed))
        self._cut.pop(key, None)
        self._cut[key] = (req.plan, req.generated)
        if len(self._cut) > _MAX_CUT_REPLIES:
            del self._cut[next(iter(self._cut))]

    def _check_context(self, n_prompt: int, max_new_tokens: int) -> None:
        ctx = self.config.context_length
        if n_prompt >= ctx:
            raise BadRequest(f"The input ({n_prompt} tokens) is longer than the model's context length ({ctx} tokens).")
        if n_prompt + max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n_prompt + max_new_tokens} tokens: {n_prompt} tokens from the input "
                f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit.")

    # -- lifecycle ------------------------------------------------------------------------------------------------

    async def _run(self, req: SimRequest) -> None:
        completed = False
        try:
            while True:
                if not await self._admit(req):
                    break
                outcome = await self._decode(req)
                if outcome == "retract":
                    self._release(req, keep=False)
                    req.retractions += 1
                    continue
                completed = outcome == "done"
                break
        finally:
            self._end(req, completed)

    async def _admit(self, req: SimRequest) -> bool:
        """Wait (while paused or short of KV) until the request holds its KV; False if aborted meanwhile."""
        req.state = "waiting"
        while True:
            if req.abort_message is not None:
                return False
            if not self.paused and self._row_for(req) and self._reserve(req):
                self._take_row(req)
                req.state = "running"
                return True
            req.wakeup.clear()
            await req.wakeup.wait()

    def rows_used(self) -> int:
        return len(self._row_requests) + len(self._row_sessions)

    def _row_for(self, req: SimRequest) -> bool:
        """A row to run in: its streaming session's, or a free one (scheduler.py `get_num_allocatable_reqs`)."""
        session = req.session
        if session is not None and session.streaming and session.session_id in self._row_sessions:
            return True
        return self.rows_used() < self.config.max_running_requests

    def _take_row(self, req: SimRequest) -> None:
        session = req.session
        if session is not None and session.streaming:
            self._row_sessions.add(session.session_id)  # kept until the session closes
        else:
            self._row_requests.add(req.rid)

    def _reserve(self, req: SimRequest) -> bool:
        kv = req.kv_tokens
        session = req.session
        hold = session.hold if session is not None and session.streaming else None
        if hold is not None:
            slots = self._alloc(len(kv) - hold.length)
            if slots is None:
                return False
            assert session is not None
            session.hold = None
            req.node, req.prefix_len = hold.node, hold.prefix_len
            req.private = np.concatenate([hold.private, slots])
            self._reused(req, hold.length)
            self._computed(req, hold.private, slots)
            return True
        # schedule_batch.py `_compute_max_prefix_len`: the prompt's last token is always computed, and input logprobs
        # asked from `logprob_start_len` on are computed, not read from the cache.
        limit = len(req.prompt) - 1
        streaming_session = req.session is not None and req.session.streaming  # which ignore logprob_start_len
        if req.inp.return_logprob and req.inp.logprob_start_len >= 0 and not streaming_session:
            limit = min(limit, req.inp.logprob_start_len)
        match = self.cache.match_prefix(req.cache_key[:limit])
        self.cache.lock(match.node)  # pin the prefix before eviction can run
        slots = self._alloc(len(kv) - match.length)
        if slots is None:
            self.cache.unlock(match.node)
            return False
        req.node, req.prefix_len, req.private = match.node, match.length, slots
        self._reused(req, match.length)
        self._computed(req, match.slots, slots)
        return True

    @staticmethod
    def _reused(req: SimRequest, cached: int) -> None:
        """The admitted request skips prefilling `cached` tokens; the reply's cached_tokens reports its first
        admission (a retracted request re-admitted later keeps that count)."""
        req.admitted_cached = cached
        if req.retractions == 0:
            req.cached_tokens = cached

    def _alloc(self, n: int) -> np.ndarray | None:
        slots = self.pool.alloc(n)
        if slots is None:
            self.cache.evict(n - self.pool.free)
            slots = self.pool.alloc(n)
        return slots

    def slow_down(self, seconds: float | None) -> None:
        """SGLang's `/slow_down` (scheduler.py): sleep `seconds` before every step from the next one on; None or
        <= 0 lifts it."""
        self.forward_sleep_s = seconds if seconds is not None and seconds > 0 else 0.0

    def _step_latency(self) -> float:
        """Seconds per decoded token: the configured latency plus the /slow_down pace, read at every step."""
        return self.config.token_latency_ms / 1000.0 + self.forward_sleep_s

    async def _decode(self, req: SimRequest) -> str:
        """Prefill what is not cached, then emit the planned tokens; returns done | abort | retract."""
        n = len(req.plan.output_ids)
        latency = self._step_latency()
        uncached = len(req.prompt) + req.generated - req.admitted_cached  # after a retraction, recompute output too
        prefill = self.config.prefill_latency_ms / 1000.0 * max(0, uncached) / 1000.0
        if latency == 0 and prefill == 0:
            await asyncio.sleep(0)
        clock = asyncio.get_running_loop().time  # the clock the sleeps are timed on
        while True:
            if req.abort_message is not None:
                return "abort"
            if self.paused:
                if self.pause_mode == "retract":
                    return "retract"
                req.wakeup.clear()
                await req.wakeup.wait()  # in_place: keep the KV, resume on continue
                continue
            if prefill > 0:
                started = clock()
                await self._sleep(req, prefill)
                prefill = max(0.0, prefill - (clock() - started))
                continue
            if req.overflow_at is not None and req.generated >= req.overflow_at:
                req.overflow = sampling_masks.overflow_abort(self.config.sampling_mask_max_tokens)
                return "abort"
            if req.generated >= n:
                return "done"
            end = n if req.overflow_at is None else req.overflow_at
            latency = self._step_latency()
            chunk = max(1, math.ceil(_MIN_SLEEP_S / latency)) if latency > 0 else max(n, 1)
            step = min(chunk, end - req.generated)
            if latency > 0:
                started = clock()
                await self._sleep(req, step * latency)
                step = min(step, int((clock() - started) / latency + 1e-9))
            req.generated += step
            if step:
                step_us = latency * 1e6
                for i, value in enumerate((1.0, 1.0, step_us, 1.0, step_us, 1.0)):
                    self._decode_moments[i] += step * value
                req.progress.set()

    @staticmethod
    async def _sleep(req: SimRequest, seconds: float) -> None:
        """Sleep that an abort or pause cuts short (the request's wakeup event)."""
        req.wakeup.clear()
        handle = asyncio.get_running_loop().call_later(seconds, req.wakeup.set)
        try:
            await req.wakeup.wait()
        finally:
            handle.cancel()

    def _end(self, req: SimRequest, completed: bool) -> None:
        """The single exit: KV back (kept in the tree or the session slot on success), session books, wake-ups."""
        req.state = "finished"
        if completed:
            req.finish_reason = req.plan.finish_reason
        elif req.overflow is not None:
            req.finish_reason = req.overflow
        else:
            req.finish_reason = {"type": "abort", "message": req.abort_message or ABORT_MESSAGE,
                                 "status_code": None, "err_type": None}
            self._remember_cut(req)
        session = req.session
        keep_in_session = completed and session is not None and session.streaming
        self._release(req, keep=completed, into_session=keep_in_session)
        if session is not None:
            session.on_request_end(req, req.output_ids, succeeded=completed)
            if session.close_on_finish and not session.busy():
                self._close_now(session)
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
        self.finished_total += 1
        self.aborted_total += 0 if completed else 1
        self.generated_tokens_total += req.generated
        req.finished_at = time.perf_counter()
        req.progress.set()
        req.done.set()
        self._kv_changed()

    def _release(self, req: SimRequest, keep: bool, into_session: bool = False) -> None:
        """Return a request's KV: into the radix tree or its session's slot when kept, to the pool otherwise; and
        its row, unless a streaming session keeps it."""
        self._row_requests.discard(req.rid)
        node = req.node
        if node is None:
            return
        if keep and into_session:
            assert req.session is not None
            req.session.hold = KVHold(node=node, prefix_len=req.prefix_len, private=req.private)
        elif keep:
            kv = req.kv_tokens
            slots = np.concatenate([self.cache.match_prefix(kv[: req.prefix_len]).slots, req.private])
            already = self.cache.insert(kv, slots)
            # Slots past our prefix that someone else cached meanwhile are duplicates: give them back.
            self.pool.release(req.private[: max(0, already - req.prefix_len)])
            self.cache.unlock(node)
        else:
            self.pool.release(req.private)
            self.cache.unlock(node)
        req.node, req.prefix_len, req.private = None, 0, _EMPTY

    def _kv_changed(self) -> None:
        for other in self.requests.values():
            if other.state == "waiting":
                other.interrupt()

    # -- aborts and pauses ----------------------------------------------------------------------------------------

    def _abort(self, req: SimRequest, message: str) -> None:
        if req.state == "finished" or req.abort_message is not None:
            return
        req.abort_message = WAITING_ABORT_MESSAGE if req.state == "waiting" else message
        req.aborted_waiting = req.state == "waiting" and req.generated == 0
        req.interrupt()

    def abort(self, rid: str | None, abort_all: bool = False) -> int:
        """Abort exactly one rid, or everything; unknown rids are a no-op.

        Exact, as SGLang's TokenizerManager.abort_request does with one tokenizer worker (it looks the rid up in
        rid_to_state; prefix matching happens only inside the scheduler, for requests the tokenizer never saw)."""
        if abort_all:
            hits = list(self.requests.values())
        else:
            req = self.requests.get(rid) if rid else None
            hits = [req] if req is not None else []
        for req in hits:
            self._abort(req, ABORT_MESSAGE)
        return len(hits)

    def abort_request(self, req: SimRequest) -> None:
        """Abort one specific request (client disconnect)."""
        self._abort(req, ABORT_MESSAGE)

    async def pause(self, mode: str) -> None:
        """Stop generation; returns once running requests have reacted (aborted, retracted or parked)."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"Invalid pause mode {mode!r}; expected one of {list(PAUSE_MODES)}")
        self.paused, self.pause_mode = True, mode
        targets = list(self.requests.values())
        for req in targets:
            if mode == "abort":
                self._abort(req, ABORT_MESSAGE)
            else:
                req.interrupt()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if mode == "abort" and all(r.state == "finished" for r in targets):
                break
            if mode == "retract" and all(r.node is None for r in targets):
                break
            if mode == "in_place":
                break
            await asyncio.sleep(0.001)

    def set_weight_version(self, version: str) -> None:
        """Scheduler.record_weight_version_change: every live request that has output records (old version, tokens
        so far), so its final meta_info says which version produced which tokens."""
        if version == self.weight_version:
            return
        for req in self.requests.values():
            if req.generated > 0:
                req.weight_events.append((self.weight_version, req.generated))
        self.weight_version = version
        for req in self.requests.values():
            if req.node is not None:  # admitted: the rest is sampled by the new weights on KV of the old
                self._slot_versions[req.private] = _MIXED
                req.shift[req.generated:] = self.logprob_shift(version, stale=True)

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None
        for req in list(self.requests.values()):
            req.interrupt()

    # -- sessions -------------------------------------------------------------------------------------------------

    def open_session(self, session_id: str | None, capacity_of_str_len: int, streaming: bool,
                     timeout: float | None) -> str:
        if streaming and not self.config.enable_streaming_session:
            raise BadRequest("Streaming sessions are disabled; start the engine with --enable-streaming-session.")
        if session_id is not None and session_id in self.sessions:
            raise BadRequest("Failed to open the session. Check if a session with the same id is still open.")
        session = EngineSession.open(session_id, capacity_of_str_len, streaming, timeout)
        self.sessions[session.session_id] = session
        return session.session_id

    def close_session(self, session_id: str) -> None:
        """Close now, or once the in-flight request ends (SGLang defers; freeing under a running request is wrong)."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        if session.streaming and session.inflight is not None:
            session.close_on_finish = True
            return
        self._close_now(session)

    def _close_now(self, session: EngineSession) -> None:
        hold, session.hold = session.hold, None
        if hold is not None:
            self.pool.release(hold.private)
            self.cache.unlock(hold.node)
        self.sessions.pop(session.session_id, None)
        self._row_sessions.discard(session.session_id)
        self._kv_changed()

    def reap_sessions(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if session.timed_out(now):
                self.close_session(session.session_id)

    # -- cache ----------------------------------------------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop every unlocked radix node; refused (False) while any request runs or waits, as in SGLang."""
        if self.requests:
            return False
        self.cache.evict_all()
        return True

    # -- observability --------------------------------------------------------------------------------------------

    def decode_moments(self) -> list[float] | None:
        """The decode step moment sums of `/v1/loads` (load_inquirer.py: None until a token was decoded)."""
        return list(self._decode_moments) if self._decode_moments[0] > 0 else None

    def counts(self) -> dict[str, int]:
        running = sum(1 for r in self.requests.values() if r.state == "running")
        held = sum(s.hold.length for s in self.sessions.values() if s.hold is not None)
        return {
            "kv_capacity_tokens": self.pool.capacity,
            "kv_used_tokens": self.pool.used,
            "kv_cached_tokens": self.cache.evictable_size,
            "kv_locked_tokens": self.cache.protected_size,
            "kv_session_tokens": held,
            "open_sessions": len(self.sessions),
            "running_requests": running,
            "request_rows_used": self.rows_used(),
            "waiting_requests": len(self.requests) - running,
            # tokens the live requests emitted so far: what a test waits for before it cuts a reply (an abort)
            "output_tokens_in_flight": sum(r.generated for r in self.requests.values()),
        }

    def check_books(self) -> dict[str, Any]:
        """Recount everything from first principles; `ok` is False with reasons when any invariant is broken."""
        errors = self.cache.check()
        owners: list[tuple[Node, np.ndarray]] = [(r.node, r.private) for r in self.requests.values() if r.node]
        owners += [(s.hold.node, s.hold.private) for s in self.sessions.values() if s.hold is not None]
        private_total = sum(len(p) for _, p in owners)
        tree_total = self.cache.total_size
        if self.pool.used != tree_total + private_total:
            errors.append(f"used slots {self.pool.used} != tree {tree_total} + private {private_total}")
        expected: dict[int, int] = {}
        nodes: dict[int, Node] = {}
        for node, _ in owners:
            cur: Node | None = node
            while cur is not None and cur is not self.cache.root:
                expected[id(cur)] = expected.get(id(cur), 0) + 1
                nodes[id(cur)] = cur
                cur = cur.parent
        stack = list(self.cache.root.children.values())
        while stack:
            cur = stack.pop()
            if cur.lock_ref != expected.get(id(cur), 0):
                errors.append(f"node lock_ref {cur.lock_ref} != owners {expected.get(id(cur), 0)}")
            nodes.pop(id(cur), None)
            stack.extend(cur.children.values())
        if nodes:
            errors.append("an owner locks a node that is no longer in the tree")
        every = np.concatenate([self.cache.all_slots(), *[p for _, p in owners]]) if owners else self.cache.all_slots()
        mask = np.zeros(self.pool.capacity, dtype=bool)
        mask[every] = True
        if len(np.unique(every)) != len(every) or not np.array_equal(mask, self.pool.in_use_mask()):
            errors.append("slots in use differ from the slots the tree and owners hold")
        plain = {r.rid for r in self.requests.values()
                 if r.state == "running" and not (r.session is not None and r.session.streaming)}
        if self._row_requests != plain:
            errors.append(f"rows of requests {sorted(self._row_requests)} != running requests {sorted(plain)}")
        if not self._row_sessions <= set(self.sessions):
            errors.append("a closed session still holds a row")
        if self.rows_used() > self.config.max_running_requests:
            errors.append(f"{self.rows_used()} rows used of {self.config.max_running_requests}")
        for session in self.sessions.values():
            if session.inflight is not None and session.inflight.state == "finished":
                errors.append(f"session {session.session_id} points at a finished request")
        return {"ok": not errors, "errors": errors, "used": self.pool.used, "tree": tree_total,
                "private": private_total, **self.counts()}

    async def shutdown(self) -> None:
        self.abort(None, abort_all=True)
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
