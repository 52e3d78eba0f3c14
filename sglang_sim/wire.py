"""SGLang's response shapes: `/generate` bodies, error bodies, model and server info.

Why one module: the wire format is the contract the session server is tested against; keeping every shape here
makes it reviewable against SGLang's `http_server.py`/`io_struct.py` in one read.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import numpy as np

from sglang_sim import sampling_masks
from sglang_sim.engine import Engine
from sglang_sim.generation import output_text
from sglang_sim.requests import SimRequest

SIM_VERSION = "0.5.0-sim"
_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def native_error(message: str) -> dict[str, Any]:
    """SGLang's native-endpoint error body (status 400)."""
    return {"error": {"message": message}}


def validation_error(message: str) -> dict[str, Any]:
    """The body of a request FastAPI's parse refused (http_server.py `validation_exception_handler`, status 400)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def stream_error(message: str, code: int = 400) -> dict[str, Any]:
    """The error event of a streamed /generate (http_server.py `stream_results`)."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}}


def _input_logprobs(req: SimRequest, start: int) -> list[list[Any]]:
    """Input-token logprobs from `logprob_start_len` on (the first prompt token has none, as in SGLang)."""
    if start < 0:
        return []
    ids = req.prompt[start:]
    if req.images:  # SGLang reports an image's pads by the id 0 (their key in its cache is no vocabulary id)
        ids = np.where(req.content_key[start:] != ids, 0, ids)
    ids = ids.tolist()
    rng = np.random.default_rng(len(req.prompt))
    values = np.log(rng.uniform(0.05, 0.95, size=len(ids))).tolist()
    out: list[list[Any]] = [[v, t, None] for v, t in zip(values, ids, strict=True)]
    if start == 0 and out:
        out[0][0] = None
    return out


def weight_version_spans(events: list[tuple[str, int]], current: str, n_out: int) -> list[dict[str, Any]]:
    """Per-token weight versions of a finished request: sglang/srt/utils/weight_versions.py
    `compute_weight_version_spans` (scheduler) followed by `add_weight_versions_to_meta_info` (tokenizer manager)."""
    spans: list[list[Any]] = []
    for version, end in [*events, (current, n_out)]:
        end = min(end, n_out)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    visible = [s for s in spans if s[1] < n_out or s[1] == 0]
    return [{"version": v, "start": a, "end": min(b, n_out)} for v, a, b in visible]


def queued_abort_body(engine: Engine, req: SimRequest) -> dict[str, Any]:
    """A request aborted before it was scheduled (pause_generation mode abort, abort_all, a weight update):
    sglang/srt/managers/tokenizer_manager.py `_handle_abort_req` answers HTTP 200 with this reduced meta_info --
    no prompt_tokens, cached_tokens or retractions -- and the finish reason from scheduler.py `_make_abort_req`."""
    spans = weight_version_spans(req.weight_events, engine.weight_version, 0)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": {"type": "abort", "message": req.abort_message or "Abort in waiting queue"},
        "weight_version": spans[-1]["version"],
        "e2e_latency": (req.finished_at or req.created) - req.created,
        "weight_versions": spans,
    }
    if req.inp.return_logprob:  # add_logprob_to_meta_info(..., finished=True)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = []
        meta["output_token_logprobs_length"] = 0
    meta["completion_tokens"] = 0
    return _with_prompt_ids({"text": "", "output_ids": [], "meta_info": meta}, req)


def _with_prompt_ids(body: dict[str, Any], req: SimRequest) -> dict[str, Any]:
    """`return_prompt_token_ids`: the prompt as the engine ran it (images expanded), beside the reply's other keys."""
    if req.inp.return_prompt_token_ids:
        body["prompt_token_ids"] = req.prompt.tolist()
    return body


def _output_logprobs(engine: Engine, req: SimRequest, start: int, end: int) -> dict[str, list[Any]]:
    """The per-output-token meta lists of tokens [start, end): each entry depends on its token alone, so a stream
    can build them a slice at a time."""
    inp = req.inp
    out_ids = req.plan.output_ids[start:end]
    texts: list[str | None] = (engine.family.token_texts(out_ids) if inp.return_text_in_logprobs
                               else [None] * len(out_ids))
    lps = req.logprobs[start:end].tolist()
    ids = out_ids.tolist()
    lists: dict[str, list[Any]] = {"output_token_logprobs": [[lp, t, s] for lp, t, s in zip(lps, ids, texts,
                                                                                            strict=True)]}
    if inp.top_logprobs_num > 0:
        k = inp.top_logprobs_num
        vocab = engine.family.vocab_size
        lists["output_top_logprobs"] = [
            [[lp, t, s]] + [[lp - 1.0 - j, (t + 1 + j) % vocab, None] for j in range(k - 1)]
            for lp, t, s in zip(lps, ids, texts, strict=True)]
    return lists


def _mask_lists(engine: Engine, req: SimRequest, start: int, end: int) -> dict[str, Any]:
    """With `return_sampling_mask`, the kept ids and sampling logprobs of tokens [start, end) (sampling_masks.py);
    tokenizer_manager.py puts them after the logprob lists, before the counts."""
    inp = req.inp
    if not inp.return_sampling_mask:
        return {}
    return sampling_masks.masks(req.plan.output_ids[start:end], req.plan.logprobs[start:end], inp.sampling,
                                engine.family.vocab_size, inp.sampling_logprobs_mode == "support")


def _counts(req: SimRequest, completion: int) -> dict[str, Any]:
    return {"reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": req.cached_tokens}


def _cache_and_rank(req: SimRequest) -> dict[str, Any]:
    """output_streamer.py `get_cached_tokens_details`: None without a cache hit, else where the hit came from (all
    from the device here: the sim has no host or storage tier); then `image_tokens` (tokenizer_manager.py, when the
    prompt has images); the DP rank is None without data parallelism."""
    details = {"device": req.cached_tokens, "host": 0} if req.cached_tokens > 0 else None
    if req.images:  # the prompt tokens that are image pads, only when the prompt has images
        return {"cached_tokens_details": details, "image_tokens": req.image_tokens, "dp_rank": None}
    return {"cached_tokens_details": details, "dp_rank": None}


def generate_body(engine: Engine, req: SimRequest, final: bool, routed: str | None,
                  streamed: bool = False) -> dict[str, Any]:
    """The `/generate` response (or the last event of a stream, `streamed`) for a request's current progress."""
    if final and req.aborted_waiting:
        return queued_abort_body(engine, req)
    inp = req.inp
    out_ids = req.output_ids
    finish = req.finish_reason if final else None
    # tokenizer_manager.py `_handle_batch_output`, in its order: the head, the logprob lists, the counts, the spans
    # of a finished request, the cache breakdown, the DP rank; e2e_latency when finished; the time the response was
    # sent with the first reply of a request (the only one unstreamed, the first event of a stream).
    meta: dict[str, Any] = {"id": req.rid, "finish_reason": finish, "prompt_tokens": len(req.prompt),
                            "weight_version": engine.weight_version, "num_retractions": req.retractions}
    if inp.return_logprob:
        meta["input_token_logprobs"] = _input_logprobs(req, inp.logprob_start_len)
        if inp.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None for _ in meta["input_token_logprobs"]]
        meta.update(_output_logprobs(engine, req, 0, len(out_ids)))
        meta["output_token_logprobs_length"] = len(out_ids)
    if masks := _mask_lists(engine, req, 0, len(out_ids)):
        meta.update(masks)
        meta["output_token_sampling_mask_length"] = len(out_ids)
    meta.update(_counts(req, len(out_ids)))
    if final:  # the scheduler attaches spans to every finished request (output_streamer.py)
        meta["weight_versions"] = weight_version_spans(req.weight_events, engine.weight_version, len(out_ids))
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
    meta.update(_cache_and_rank(req))
    if final:
        meta["e2e_latency"] = (req.finished_at or 0.0) - req.created
        if not streamed:
            meta["response_sent_to_client_ts"] = time.time()
    if final and routed is not None:
        meta["routed_experts"] = routed  # base64 of int32 [rows, layers, top_k] (routed_experts.py)
    text = output_text(engine.family, out_ids, finish, inp.sampling)
    return _with_prompt_ids({"text": text, "output_ids": out_ids.tolist(), "meta_info": meta}, req)


# tokenizer_manager's incremental keys we emit
_SLICED_META = ("output_token_logprobs", "output_top_logprobs", "output_token_sampling_mask",
                "output_token_sampling_logprobs")


class StreamEvents:
    """The intermediate events of one streamed /generate, each built from what the previous ones already encoded.

    Why: with SGLang's default `stream_interval` 1 a reply of n tokens is n events; rebuilding a cumulative event
    from scratch (decode all text, list and encode every id and logprob) makes the emulated engine quadratic in
    Python, and a 32k-token reply would take minutes. Here the ids, the per-token meta lists and the text are kept
    as encoded JSON and only the new tokens are encoded, so a cumulative event costs a copy of its bytes (what it
    must be on the wire) and a delta event (`--incremental-streaming-output`) what its new tokens cost. The bodies
    say what `generate_body` (cumulative) and `incremental` (deltas) say for the same progress; the last event of a
    stream is still built by them.
    """

    def __init__(self, engine: Engine, req: SimRequest, deltas: bool) -> None:
        self.engine = engine
        self.req = req
        self.deltas = deltas
        self.count = 0  # tokens encoded so far
        self.ids = bytearray()  # "1,2,3": the encoded ids of those tokens
        self.lists: dict[str, bytearray] = {}  # the encoded per-token meta lists, same form
        self.text_at = 0  # tokens whose text ends on a whole character ...
        self.text = bytearray()  # ... and that text, JSON-escaped without its quotes
        self.text_chars = 0  # its length in characters
        self.text_sent = 0  # characters already sent (deltas)
        self.sent = False  # whether an event went out (only the first carries response_sent_to_client_ts)
        inp = req.inp
        # Every event of a stream that asked for them carries the prompt ids (encoded once).
        self.prompt_ids = b""
        if inp.return_prompt_token_ids:
            self.prompt_ids = b',"prompt_token_ids":' + encode(req.prompt.tolist())
        self.head: dict[str, Any] = {}
        if inp.return_logprob:
            self.head["input_token_logprobs"] = _input_logprobs(req, inp.logprob_start_len)
            if inp.top_logprobs_num > 0:
                self.head["input_top_logprobs"] = [None for _ in self.head["input_token_logprobs"]]

    def event(self, count: int) -> bytes:
        """The event for the first `count` output tokens (count > every earlier call's)."""
        req, engine = self.req, self.engine
        start = self.count
        ids_added = _items(encode(req.plan.output_ids[start:count].tolist()))
        lists_added = ({k: _items(encode(v)) for k, v in _output_logprobs(engine, req, start, count).items()}
                       if req.inp.return_logprob else {})
        masks_added = {k: _items(encode(v)) for k, v in _mask_lists(engine, req, start, count).items()}
        self.count = count
        tail = engine.family.decode_text(req.plan.output_ids[self.text_at:count], req.inp.sampling.skip_special_tokens)
        whole = not tail.endswith("\ufffd")
        if self.deltas:
            tail = tail.rstrip("\ufffd")  # SGLang holds back an incomplete character
            skip = self.text_sent - self.text_chars  # characters of the tail an earlier event already sent
            text = encode(tail[skip:])
            self.text_sent = self.text_chars + len(tail)
            ids, lists = ids_added, lists_added
        else:
            text = b'"' + bytes(self.text) + encode(tail)[1:]
        for key, added in (("", ids_added), *lists_added.items(), *masks_added.items()):
            into = self.lists.setdefault(key, bytearray()) if key else self.ids
            if added:
                into += (b"," if into else b"") + added
        masks = masks_added
        if not self.deltas:
            ids = bytes(self.ids)
            lists = {k: bytes(self.lists[k]) for k in lists_added}
            masks = {k: bytes(self.lists[k]) for k in masks_added}
        if whole:
            self.text += encode(tail)[1:-1] if not self.deltas else b""
            self.text_chars += len(tail)
            self.text_at = count
        head = encode({"id": req.rid, "finish_reason": None, "prompt_tokens": len(req.prompt),
                       "weight_version": engine.weight_version, "num_retractions": req.retractions, **self.head})
        parts = [b'{"text":', text, b',"output_ids":[', ids, b'],"meta_info":', head[:-1]]
        for key, items in lists.items():
            parts += [b',"', key.encode(), b'":[', items, b"]"]
        tail: dict[str, Any] = {}
        if req.inp.return_logprob:
            parts += [b',"output_token_logprobs_length":', str(count).encode()]
        for key, items in masks.items():
            parts += [b',"', key.encode(), b'":[', items, b"]"]
        if masks:
            tail["output_token_sampling_mask_length"] = count
        tail.update(_counts(req, count))
        tail.update(_cache_and_rank(req))
        if not self.sent:  # the first event carries the time the response started (tokenizer_manager.py)
            tail["response_sent_to_client_ts"] = time.time()
            self.sent = True
        parts += [b",", encode(tail)[1:], self.prompt_ids, b"}"]
        return b"".join(parts)


def _items(encoded_list: bytes) -> bytes:
    """`[a,b]` -> `a,b`."""
    return encoded_list[1:-1]


def incremental(body: dict[str, Any], tokens_sent: int, text_sent: int) -> dict[str, Any]:
    """A cumulative body cut to what is new since the previous event (SGLang with --incremental-streaming-output:
    text, output_ids and the per-output-token meta lists are deltas; counts such as completion_tokens are not)."""
    meta = dict(body["meta_info"])
    for key in _SLICED_META:
        if isinstance(meta.get(key), list):
            meta[key] = meta[key][tokens_sent:]
    out = {"text": body["text"][text_sent:], "output_ids": body["output_ids"][tokens_sent:], "meta_info": meta}
    if "prompt_token_ids" in body:
        out["prompt_token_ids"] = body["prompt_token_ids"]
    return out


# The prefill batch sizes SGLang 0.5.23 lists for a 2048-token capture budget (its default chunked prefill here).
_BCG_BATCH_SIZES = [4, 8, 12, 16, 20, 24, 28, 32, *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                    1280, 1536, 1792, 2048]


def model_info(engine: Engine, model_path: str, tokenizer_path: str) -> dict[str, Any]:
    """http_server.py `/model_info` of a generation model (its embedding plan says: not an embedding model)."""
    return {"model_path": model_path, "served_model_name": model_path, "tokenizer_path": tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": engine.weight_version,
            "load_format": "auto", "reasoning_parser": engine.config.reasoning_parser, "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": engine.family.name,
            "architectures": ["SglangSimForCausalLM"], "embedding": {
                "family": "none", "task": "none", "execution": "none", "attention": "none",
                "pooling": "model_defined", "normalize": False, "postprocessor": "none",
                "tokenizer_special_tokens": "model_default", "supports_dimensions": False,
                "supports_token_embeddings": False, "supports_multimodal": False, "requires_embedding_flag": False,
                "auto_enable_embedding": False, "bcg_eligibility": "disabled", "safe_disable_kv_cache": False,
                "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False, "enabled": False,
                "matryoshka_dimensions": [], "bcg": {"prefill_backend": "disabled", "enabled": False,
                                                     "capture_token_budget": 2048,
                                                     "capture_batch_sizes": _BCG_BATCH_SIZES},
                "cache": {"kv_cache_disabled": False, "radix_cache_disabled": False,
                          "chunked_prefill_disabled": False}}}


def server_info(engine: Engine, model_path: str, tokenizer_path: str, host: str, port: int) -> dict[str, Any]:
    """Server args and scheduler info like SGLang's `/server_info`, plus live KV and request figures."""
    cfg = engine.config
    counts = engine.counts()
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "served_model_name": model_path,
        "host": host,
        "port": port,
        "context_length": None,  # the --context-length server arg, unset: the model's own is the sim's context
        "page_size": 1,
        "random_seed": cfg.seed,
        "enable_streaming_session": cfg.enable_streaming_session,
        "incremental_streaming_output": cfg.incremental_streaming_output,
        "reasoning_parser": cfg.reasoning_parser,
        "skip_tokenizer_init": False,
        "weight_version": engine.weight_version,
        "enable_lora": cfg.enable_lora,
        "max_loaded_loras": cfg.max_loaded_loras,
        "max_loras_per_batch": cfg.max_loras_per_batch,
        "max_total_num_tokens": engine.pool.capacity,
        "max_running_requests": cfg.max_running_requests,
        # tp_worker.py: max_req_len = min(context_len - 1, kv_capacity - 1), max_req_input_len = max_req_len - 5
        "max_req_input_len": min(cfg.context_length - 1, engine.pool.capacity - 1) - 5,
        "internal_states": [{
            "last_gen_throughput": 0.0,
            "memory_usage": {"token_capacity": engine.pool.capacity, "kv_used_tokens": counts["kv_used_tokens"]},
            "paused": engine.paused,
            "effective_max_running_requests_per_dp": cfg.max_running_requests,
        }],
        "version": SIM_VERSION,
        "sim_model_family": engine.family.name,
        "token_latency_ms": cfg.token_latency_ms,
        "prefill_latency_ms": cfg.prefill_latency_ms,
        "paused": engine.paused,
        "pause_mode": engine.pause_mode,
        "finished_requests": engine.finished_total,
        "aborted_requests": engine.aborted_total,
        "routing_keys": len(engine.routing_keys),
        "last_routing_key": engine.last_routing_key,
        **counts,
    }


def load_snapshot(engine: Engine) -> dict[str, Any]:
    """One DP rank's core load, the flat fields of SGLang 0.5.23's `LoadSnapshot` (managers/load_snapshot.py,
    `to_dict(include={"core"})`): what `/v1/loads` lists per rank."""
    counts = engine.counts()
    capacity = engine.pool.capacity
    used = counts["kv_used_tokens"]
    return {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": counts["running_requests"],
        "num_waiting_reqs": counts["waiting_requests"],
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": engine.config.max_running_requests,
        "token_usage": used / capacity if capacity else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": used / capacity if capacity else 0.0,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": engine.decode_moments(),
    }


def v1_loads(engine: Engine) -> dict[str, Any]:
    """SGLang 0.5.23's `GET /v1/loads` (entrypoints/v1_loads.py `get_loads`): the envelope and one rank."""
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SIM_VERSION,
        "accelerator": None,  # v1_loads.py _accelerator_name(): None on a CPU, as the real-engine tier sees
        "num_accelerators": 1,
        "loads": [load_snapshot(engine)],
    }


def get_load(engine: Engine) -> list[dict[str, Any]]:
    """`GET /get_load`, the per-rank list older SGLang served (`GetLoadReqOutput`: dp_rank, num_reqs,
    num_waiting_reqs, num_tokens) and that sglang-router 0.3.2 still polls on its workers. SGLang 0.5.23 itself
    serves only `/v1/loads`; the sim answers both so it can stand behind the real router."""
    counts = engine.counts()
    return [{
        "dp_rank": 0,
        "num_reqs": counts["running_requests"] + counts["waiting_requests"],
        "num_waiting_reqs": counts["waiting_requests"],
        "num_tokens": counts["kv_used_tokens"],
    }]


def models_list(engine: Engine, model_path: str) -> dict[str, Any]:
    """The served model, then each loaded LoRA adapter as a model whose `parent` is it (as SGLang 0.5.23 lists them)."""
    base = {"id": model_path, "object": "model", "created": 0, "owned_by": "sglang", "root": model_path,
            "parent": None, "max_model_len": engine.config.context_length}
    adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": path,
                 "parent": model_path, "max_model_len": engine.config.context_length}
                for name, path in engine.lora.loaded.items()]
    return {"object": "list", "data": [base, *adapters]}
