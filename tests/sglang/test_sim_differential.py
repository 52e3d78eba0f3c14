"""The differential test that keeps `sglang-sim` honest: the same scripted requests go to real SGLang 0.5.23 and to
the sim, and what comes back must have the same shape.

"Shape" is what the session server (and anyone writing against SGLang's native API) relies on: status codes, the
keys of every object and the JSON types of their values (recursively), the forms of `finish_reason`, error bodies
(their keys, and their messages where SGLang's are fixed text), stream framing (`data: ` events, cumulative chunks,
the final `[DONE]`) and the session errors. Token ids, texts and timings differ (a random model versus a scripted
one) and are not compared. Each probe is one scenario; the test reports every difference at once, and a difference
is fixed in the sim (sglang_sim/), never by loosening a probe.

The sim is started to match the engine: the checkpoint's tokenizer, the same context length (2048), KV pool (8192),
streaming sessions and reasoning parser.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from harness.launchers import RunningProcess, start_sim
from session_server.engine import reader
from support.images import IMG, RED, TALL, collapse_pads, data_url, pad_runs, pipelined_statuses, png, user_turn
from support.sglang_engine import Engines, assert_engine_clean, loads, paced
from trajectory import engine_output
from trajectory.errors import UpstreamError
from trajectory.image_grid import IMAGE_PAD_ID

Probe = Callable[["Target"], dict[str, Any]]
PROBES: dict[str, Probe] = {}


def probe(fn: Probe) -> Probe:
    PROBES[fn.__name__] = fn
    return fn


class Target:
    """One engine under test: its URL and a prompt in its tokenizer."""

    def __init__(self, url: str, checkpoint: Path) -> None:
        from transformers import AutoTokenizer

        self.url = url
        self.checkpoint = checkpoint
        tok = self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        # The directive makes the sim generate up to the request's limit, as the random model does (which never
        # stops on its own); the real engine reads it as any text.
        text = tok.apply_chat_template([{"role": "user", "content": "Say something. [[sim: tokens 5000]]"}],
                                       tokenize=False, add_generation_prompt=True)
        self.prompt: list[int] = list(tok.encode(text, add_special_tokens=False))
        self.http = httpx.Client(base_url=url, timeout=120)
        self.rids = iter(range(10**6))

    def rid(self) -> str:
        return f"diff-{next(self.rids)}-{time.monotonic_ns()}"

    def generate(self, **body: Any) -> httpx.Response:
        sp = {"temperature": 0, "max_new_tokens": 4, **body.pop("sampling_params", {})}
        payload = {"input_ids": self.prompt, "sampling_params": sp, "return_logprob": True,
                   "logprob_start_len": -1, "rid": body.pop("rid", None) or self.rid(), **body}
        return self.http.post("/generate", json=payload)


def shape(value: Any) -> Any:
    """The JSON shape of a value: objects keep their keys (recursively), arrays the union of their items' shapes,
    scalars their JSON type (int and float are both 'number': SGLang's floats may be whole)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items: list[Any] = []
        for item in value:
            s = shape(item)
            if s not in items:
                items.append(s)
        return items
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null" if value is None else type(value).__name__


def body_of(resp: httpx.Response) -> Any:
    try:
        return msgspec.json.decode(resp.content)
    except msgspec.DecodeError:
        return {"<text>": resp.text}


def reply(resp: httpx.Response) -> dict[str, Any]:
    return {"status": resp.status_code, "content_type": resp.headers.get("content-type", "").split(";")[0],
            "shape": shape(body_of(resp))}


def error(resp: httpx.Response, *values: str) -> dict[str, Any]:
    """An error reply: status, shape, and the message (SGLang's messages are fixed text up to the `values` the
    request chose, e.g. a session id, which are replaced by `<value>`)."""
    text = resp.text
    for value in values:
        text = text.replace(value, "<value>")
    return {**reply(resp), "body": text}


# -- the probes -----------------------------------------------------------------------------------------------------

@probe
def generate_plain(t: Target) -> dict[str, Any]:
    r = t.generate()
    meta, n = r.json()["meta_info"], len(r.json()["output_ids"])
    return {**reply(r), "finish_reason": meta["finish_reason"]["type"],
            "lengths_agree": len(meta["output_token_logprobs"]) == meta["completion_tokens"] == n}


@probe
def generate_stream(t: Target) -> dict[str, Any]:
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": True,
        "logprob_start_len": -1, "rid": t.rid(), "stream": True,
    }) as r:
        raw = r.read()
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b"", raw[-80:]
    events = blocks[:-1]
    chunks = [msgspec.json.decode(e[len(b"data: "):]) for e in events[:-1]]
    ids = [c["output_ids"] for c in chunks]
    return {
        "status": r.status_code, "content_type": r.headers.get("content-type", "").split(";")[0],
        "framing": sorted({e[:6].decode() for e in events}), "last": events[-1].decode(),
        "chunk_shapes": shape(chunks), "cumulative": all(a == b[: len(a)] for a, b in itertools.pairwise(ids)),
        "final_finish": chunks[-1]["meta_info"]["finish_reason"]["type"],
        "earlier_finish": shape([c["meta_info"]["finish_reason"] for c in chunks[:-1]]),
        "final_length": len(ids[-1]),
    }


def decode_path(body: bytes) -> str:
    """Which path of the server's strict decode (trajectory/engine_output.py) a reply takes."""
    vocab = 2**31  # the ids' range is not what this asks
    try:
        return "fast" if engine_output._accept(engine_output._fast_decoder(vocab).decode(body), vocab) else "strict"
    except (msgspec.DecodeError, UpstreamError):
        return "strict"


@probe
def decode_paths(t: Target) -> dict[str, Any]:
    """A reply, plain or the final event of a stream, in the shape the server's fast decode path takes; the stream's
    intermediate events in the layout its bulk cut finds."""
    plain = t.generate(sampling_params={"max_new_tokens": 24}).content
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": True,
        "logprob_start_len": -1, "rid": t.rid(), "stream": True,
    }) as r:
        events = r.read().split(b"\n\n")
    payloads = [e.removeprefix(b"data: ") for e in events[:-2]]  # the events before `[DONE]` and the empty tail
    return {"plain": decode_path(plain), "stream_final": decode_path(payloads[-1]),
            "intermediate_events": sorted({_bulk_cut(p) for p in payloads[:-1]})}


def _bulk_cut(payload: bytes) -> str:
    """Whether the streamed turn's intermediate-event shortcut (session_server/engine/reader.py) finds SGLang's layout
    in an event, cuts its `output_ids` and `output_token_logprobs` out, and leaves the fields the stream reads as
    the whole event has them; "whole" where it falls back to decoding the event as it came."""
    cut = reader.lean_event(payload, ids=True, logprobs=True)
    if cut == payload:
        return "whole"
    whole, short = msgspec.json.decode(payload), msgspec.json.decode(cut)
    assert short["meta_info"].pop("output_token_logprobs") == []
    whole["meta_info"].pop("output_token_logprobs")
    whole.pop("output_ids")
    assert short == whole
    return "cut"


@probe
def generate_max_new_tokens_null(t: Target) -> dict[str, Any]:
    """Without a limit SGLang runs to `context_len - 2` tokens in all (scheduler.py: max_req_len - input_len - 1)."""
    filler = t.prompt * (1990 // len(t.prompt))
    r = t.http.post("/generate", json={"input_ids": filler, "sampling_params": {"temperature": 0,
                                       "max_new_tokens": None}, "rid": t.rid()})
    meta = r.json()["meta_info"]
    return {**reply(r), "finish_reason": meta["finish_reason"],
            "total": meta["prompt_tokens"] + meta["completion_tokens"]}


@probe
def unknown_sampling_key(t: Target) -> dict[str, Any]:
    return error(t.generate(sampling_params={"bogus_key": 1}))


@probe
def sampling_key_of_the_wrong_type(t: Target) -> dict[str, Any]:
    return error(t.generate(sampling_params={"max_new_tokens": "4"}))


@probe
def require_reasoning_of_the_wrong_type(t: Target) -> dict[str, Any]:
    """FastAPI's lax parse first (its 400 names the source line, here without the install path), then the contract
    gate, which takes only a JSON boolean."""
    out = {}
    for value in ("yes", "Off", 1, 0.0, 2, 0.5, "maybe", None, [True], {"x": 1}):
        answer = error(t.generate(require_reasoning=value))
        answer["body"] = re.sub(r'File \\"[^"]*?sglang/srt/', r'File \\"sglang/srt/', answer["body"])
        out[repr(value)] = answer
    return out


@probe
def require_reasoning_with_a_grammar(t: Target) -> dict[str, Any]:
    """What the session server sends for a constrained turn in thinking mode: both engines run a reasoning parser,
    so the grammar waits for the reasoning's end (the random model's 4 tokens never reach it; the sim's JSON answer is
    longer than 4 tokens): a reply of the same shape, cut by length."""
    schema = '{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}'
    r = t.generate(require_reasoning=True, sampling_params={"json_schema": schema})
    return {**reply(r), "finish_reason": r.json()["meta_info"]["finish_reason"]}


@probe
def sampling_value_out_of_range(t: Target) -> dict[str, Any]:
    return error(t.generate(sampling_params={"temperature": -1}))


@probe
def sampling_value_out_of_range_streamed(t: Target) -> dict[str, Any]:
    """A value SamplingParams.verify refuses is a ValueError in the tokenizer manager: a streamed request gets HTTP
    200, one error event and `[DONE]` (http_server.py `stream_results`), not the plain request's 400."""
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "sampling_params": {"temperature": -1, "max_new_tokens": 4}, "rid": t.rid(),
        "stream": True,
    }) as r:
        raw = r.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return {"status": r.status_code, "content_type": r.headers.get("content-type", "").split(";")[0],
            "events": [e.decode() if e == b"[DONE]" else msgspec.json.decode(e) for e in events]}


MASKED = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_new_tokens": 8}


def _mask_facts(meta: dict[str, Any], mode: str, top_k: int) -> dict[str, Any]:
    """What holds of the rows whatever the model: one per output token, the sampled id in each, within top_k, and
    the sampling logprobs those of a distribution over the row (support: each row's exp sums to 1; selected: at
    least the full-vocabulary logprob)."""
    rows, values = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    tokens = [entry[1] for entry in meta["output_token_logprobs"]]
    full = [entry[0] for entry in meta["output_token_logprobs"]]
    if mode == "support":
        normalised = all(abs(sum(math.exp(v) for v in row) - 1) < 1e-3 for row in values)
    else:
        normalised = all(v >= f - 1e-4 for v, f in zip(values, full, strict=True))
    return {"rows_per_token": len(rows) == len(tokens) == meta["output_token_sampling_mask_length"],
            "sampled_in_row": all(t in row for t, row in zip(tokens, rows, strict=True)),
            "within_top_k": all(1 <= len(row) <= top_k for row in rows), "normalised": normalised}


@probe
def sampling_mask_plain(t: Target) -> dict[str, Any]:
    """`return_sampling_mask` with both `sampling_logprobs_mode`s, sampled and greedy; the reply keeps the shape the
    server's fast decode path takes."""
    out: dict[str, Any] = {}
    for mode in ("selected", "support"):
        r = t.generate(sampling_params=MASKED, return_sampling_mask=True, sampling_logprobs_mode=mode)
        out[mode] = {**reply(r), **_mask_facts(r.json()["meta_info"], mode, 20), "decode_path": decode_path(r.content)}
    greedy = t.generate(sampling_params={"temperature": 0, "max_new_tokens": 4}, return_sampling_mask=True,
                        sampling_logprobs_mode="support").json()["meta_info"]
    out["greedy"] = {"rows": [len(row) for row in greedy["output_token_sampling_mask"]],
                     "logprobs": greedy["output_token_sampling_logprobs"]}
    return out


@probe
def sampling_mask_refusals(t: Target) -> dict[str, Any]:
    """A top_k the mask cannot hold (none, or past --sampling-mask-max-tokens) and a logprobs mode without masks."""
    out = {}
    for name, sp in (("no_top_k", {"temperature": 1.0, "top_p": 0.9}), ("all", {"temperature": 1.0, "top_k": -1}),
                     ("past_cap", {"temperature": 1.0, "top_k": 4097})):
        out[name] = error(t.generate(sampling_params={**sp, "max_new_tokens": 2}, return_sampling_mask=True))
    at_cap = t.generate(sampling_params={"temperature": 1.0, "top_k": 4096, "max_new_tokens": 2},
                        return_sampling_mask=True)
    out["at_cap"] = {**reply(at_cap), **_mask_facts(at_cap.json()["meta_info"], "selected", 4096)}
    out["mode_without_masks"] = error(t.generate(sampling_params=MASKED, sampling_logprobs_mode="support"))
    return out


@probe
def sampling_mask_stream(t: Target) -> dict[str, Any]:
    """Streamed: each event carries the rows so far (cumulative, as the logprobs)."""
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "sampling_params": MASKED, "return_logprob": True, "logprob_start_len": -1,
        "rid": t.rid(), "stream": True, "return_sampling_mask": True,
    }) as r:
        events = [e.removeprefix(b"data: ") for e in r.read().split(b"\n\n") if e]
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    return {"status": r.status_code, "last": events[-1].decode(), "chunk_shapes": shape(chunks),
            "cumulative": all(len(c["meta_info"]["output_token_sampling_mask"]) == len(c["output_ids"])
                              for c in chunks),
            "final": _mask_facts(chunks[-1]["meta_info"], "selected", 20),
            "final_decode_path": decode_path(events[-2])}


def _cut_stream(t: Target, cut: Callable[[], httpx.Response]) -> dict[str, Any]:
    """A long streamed request, cut by `cut()` once its first tokens have arrived: what the cut answered and how
    the stream ended."""
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 1500}, "return_logprob": True,
        "logprob_start_len": -1, "rid": t.rid(), "stream": True,
    }) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines)  # tokens were sampled
        answer = cut()
        events = [line.removeprefix("data: ") for line in lines]
    final = msgspec.json.decode(events[-2])
    meta = final["meta_info"]
    return {"cut": error(answer), "status": r.status_code, "last": events[-1], "final_shape": shape(final),
            "finish_reason": meta["finish_reason"], "partial": 0 < meta["completion_tokens"] < 1500}


@probe
def weight_update_aborts_running_requests(t: Target) -> dict[str, Any]:
    """`/update_weight_version` aborts every in-flight request (abort_all_requests defaults to true): the stream
    ends with SGLang's bare abort finish reason and the tokens sampled so far (what turns/resume.py continues)."""
    try:
        return _cut_stream(t, lambda: t.http.post("/update_weight_version", json={"new_version": "diff-v2"}))
    finally:
        t.http.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": False})


@probe
def weights_from_disk_abort_running_requests(t: Target) -> dict[str, Any]:
    """`/update_weights_from_disk` with `abort_all_requests` (the same weights again: only the shapes count)."""
    try:
        return _cut_stream(t, lambda: t.http.post("/update_weights_from_disk", json={
            "model_path": str(t.checkpoint), "weight_version": "diff-v3", "flush_cache": False,
            "abort_all_requests": True}))
    finally:
        t.http.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": False})


@probe
def pause_abort_aborts_running_requests(t: Target) -> dict[str, Any]:
    try:
        return _cut_stream(t, lambda: t.http.post("/pause_generation", json={"mode": "abort"}))
    finally:
        t.http.post("/continue_generation", json={})


@probe
def prompt_too_long(t: Target) -> dict[str, Any]:
    r = t.http.post("/generate", json={"input_ids": [t.prompt[0]] * 2100, "sampling_params": {"max_new_tokens": 4},
                                       "rid": t.rid()})
    return error(r)


@probe
def abort_running_request(t: Target) -> dict[str, Any]:
    rid = t.rid()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(t.http.post, "/generate", json={
            "input_ids": t.prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 1500},
            "return_logprob": True, "logprob_start_len": -1, "rid": rid})
        deadline = time.monotonic() + 60
        while loads(t.url)["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # a few tokens in
        aborted = t.http.post("/abort_request", json={"rid": rid, "abort_all": False})
        r = running.result(60)
    meta = r.json()["meta_info"]
    return {"abort": {"status": aborted.status_code, "body": aborted.text}, **reply(r),
            "finish_reason": meta["finish_reason"], "partial": 0 < meta["completion_tokens"] < 1500}


@probe
def abort_unknown_rid(t: Target) -> dict[str, Any]:
    r = t.http.post("/abort_request", json={"rid": "no-such-rid", "abort_all": False})
    return {"status": r.status_code, "body": r.text}


@probe
def session_lifecycle(t: Target) -> dict[str, Any]:
    opened = t.http.post("/open_session", json={"capacity_of_str_len": 10000, "streaming": True, "timeout": 60})
    sid = opened.json()
    first = t.generate(session_params={"id": sid})
    second_prompt = first.json()["output_ids"] + t.prompt[-3:]
    second = t.http.post("/generate", json={"input_ids": second_prompt, "sampling_params": {"max_new_tokens": 4,
                         "temperature": 0}, "session_params": {"id": sid}, "rid": t.rid(), "return_logprob": True,
                         "logprob_start_len": -1})
    replace = t.generate(session_params={"id": sid, "replace": True})
    closed = t.http.post("/close_session", json={"session_id": sid})
    deadline = time.monotonic() + 30  # close is asynchronous in SGLang: the session goes a moment after the answer
    while (after_close := t.generate(session_params={"id": sid})).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    unknown = t.generate(session_params={"id": "no-such-session"})
    return {
        "open": {"status": opened.status_code, "type": shape(sid)},
        "first": reply(first), "second": reply(second),
        "second_cached_covers_first": second.json()["meta_info"]["cached_tokens"] >= len(t.prompt),
        "replace": error(replace), "close": {"status": closed.status_code, "body": closed.text},
        "after_close": error(after_close, sid), "unknown": error(unknown),
    }


@probe
def session_concurrent_request(t: Target) -> dict[str, Any]:
    """A second request on a streaming session while its first runs is refused; the first is then aborted. (The
    session's timeout is long: SGLang 0.5.23's scheduler dies on an assertion in release_kv_cache when a streaming
    session times out while its request runs.)"""
    sid = t.http.post("/open_session", json={"capacity_of_str_len": 10000, "streaming": True, "timeout": 600}).json()
    rid = t.rid()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(t.generate, rid=rid, session_params={"id": sid},
                              sampling_params={"max_new_tokens": 1500})
        deadline = time.monotonic() + 60
        while loads(t.url)["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # a few tokens in
        second = t.generate(session_params={"id": sid})
        t.http.post("/abort_request", json={"rid": rid, "abort_all": False})
        first = running.result(120)
    closed = t.http.post("/close_session", json={"session_id": sid})
    return {"first": reply(first), "first_finish": first.json()["meta_info"]["finish_reason"],
            "second": error(second), "close": closed.status_code}


@probe
def admin_and_info_routes(t: Target) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in ("/ready", "/health", "/health_generate"):
        r = t.http.get(path)
        out[path] = {"status": r.status_code, "body": r.text}
    for path in ("/model_info", "/get_model_info", "/v1/models"):
        out[path] = reply(t.http.get(path))
    # /server_info is SGLang's whole configuration (hundreds of server args); what is compared is what the session
    # server reads (turns/limits.py: max_req_input_len, context_length, and their values here) and the figures
    # tests read from both engines.
    info = t.http.get("/server_info").json()
    out["/server_info"] = {k: info.get(k) for k in ("max_req_input_len", "context_length", "max_total_num_tokens",
                                                    "enable_streaming_session", "page_size", "reasoning_parser")}
    out["/model_info"]["reasoning_parser"] = t.http.get("/model_info").json().get("reasoning_parser")
    out["/server_info"]["internal_states"] = shape([{"memory_usage": {"token_capacity": s["memory_usage"][
        "token_capacity"]}, "last_gen_throughput": s["last_gen_throughput"]} for s in info["internal_states"]])
    out["/server_info"]["weight_version"] = shape(info.get("weight_version"))
    out["/v1/loads?include=core"] = reply(t.http.get("/v1/loads?include=core"))
    flushed = t.http.post("/flush_cache")
    out["/flush_cache"] = {"status": flushed.status_code, "body": flushed.text}
    for mode in ("abort", "in_place"):
        paused = t.http.post("/pause_generation", json={"mode": mode})
        resumed = t.http.post("/continue_generation", json={})
        out[f"pause[{mode}]"] = {"pause": error(paused), "continue": error(resumed)}
    return out


@probe
def slow_down(t: Target) -> dict[str, Any]:
    """SGLang's test hook that the tier paces engines with (support/sglang_engine.py `paced`): a pace, its lift,
    and what a malformed body gets. The last probe: it lifts the pace the real engine's observation runs at."""
    out = {}
    for name, body in (("pace", {"forward_sleep_time": 0.001}), ("null", {"forward_sleep_time": None}),
                       ("missing", {}), ("string", {"forward_sleep_time": "x"})):
        out[name] = reply(t.http.post("/slow_down", json=body))
    out["lift"] = reply(t.http.post("/slow_down", json={"forward_sleep_time": 0}))
    return out


# -- image probes (the tiny Qwen3-VL, issue 34) ----------------------------------------------------------------------

IMAGE_PROBES: dict[str, Probe] = {}


def image_probe(fn: Probe) -> Probe:
    IMAGE_PROBES[fn.__name__] = fn
    return fn


class ImageTarget(Target):
    """An engine serving the tiny Qwen3-VL; its prompt has one image pad (the directive: see Target)."""

    def __init__(self, url: str, checkpoint: Path) -> None:
        super().__init__(url, checkpoint)
        self.prompt = self.encode(user_turn(f"{IMG}Describe it. [[sim: tokens 5000]]"))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def generate_alone(self, **body: Any) -> httpx.Response:
        """`generate` on a connection of its own, for a request SGLang answers 500 and then closes the connection
        (support/images.py `alone`)."""
        pooled = self.http
        with httpx.Client(base_url=self.url, timeout=120) as self.http:
            try:
                return self.generate(**body)
            finally:
                self.http = pooled


def _without_addresses(answer: dict[str, Any]) -> dict[str, Any]:
    """PIL names the BytesIO it could not read by its address."""
    answer["body"] = re.sub(r"object at 0x[0-9a-f]+", "object at <address>", answer["body"])
    return answer


@image_probe
def image_plain(t: Target) -> dict[str, Any]:
    r = t.generate(image_data=data_url(RED), return_prompt_token_ids=True)
    body = r.json()
    meta = body["meta_info"]
    keys = list(meta)
    at = keys.index("image_tokens")
    return {**reply(r), "finish_reason": meta["finish_reason"]["type"], "prompt_tokens": meta["prompt_tokens"],
            "image_tokens": meta["image_tokens"], "pad_runs": pad_runs(body["prompt_token_ids"]),
            "collapses_to_the_input": collapse_pads(body["prompt_token_ids"]) == t.prompt,
            "image_tokens_between": keys[at - 1: at + 2]}


@image_probe
def image_stream(t: Target) -> dict[str, Any]:
    with t.http.stream("POST", "/generate", json={
        "input_ids": t.prompt, "image_data": [data_url(RED)], "return_prompt_token_ids": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": True, "logprob_start_len": -1,
        "rid": t.rid(), "stream": True,
    }) as r:
        raw = r.read()
    events = raw.split(b"\n\n")[:-1]
    chunks = [msgspec.json.decode(e[len(b"data: "):]) for e in events[:-1]]
    ids = [c["output_ids"] for c in chunks]
    return {
        "status": r.status_code, "content_type": r.headers.get("content-type", "").split(";")[0],
        "framing": sorted({e[:6].decode() for e in events}), "last": events[-1].decode(),
        "chunk_shapes": shape(chunks), "cumulative": all(a == b[: len(a)] for a, b in itertools.pairwise(ids)),
        "final_finish": chunks[-1]["meta_info"]["finish_reason"]["type"], "several_events": len(chunks) > 1,
        "prompt_ids_per_event": sorted({len(c["prompt_token_ids"]) for c in chunks}),
        "image_tokens_per_event": sorted({c["meta_info"]["image_tokens"] for c in chunks}),
    }


@image_probe
def image_cache(t: Target) -> dict[str, Any]:
    """The radix cache keys images by content: values, not only shapes, must agree."""
    assert t.http.post("/flush_cache").status_code == 200
    first = t.generate(image_data=data_url(RED), return_prompt_token_ids=True).json()
    again = t.generate(image_data=data_url(RED), return_prompt_token_ids=True).json()
    stored = first["prompt_token_ids"] + first["output_ids"]
    turn2 = collapse_pads(stored) + t.encode(f"<|im_end|>\n{user_turn(f'{IMG}And this?')}")  # type: ignore[attr-defined]
    second = t.http.post("/generate", json={"input_ids": turn2, "image_data": [data_url(RED), data_url(TALL)],
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                                            "return_prompt_token_ids": True, "rid": t.rid()}).json()
    swapped = t.http.post("/generate", json={"input_ids": turn2, "image_data": [data_url(TALL), data_url(RED)],
                                             "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                                             "rid": t.rid()}).json()
    return {"first": first["meta_info"]["cached_tokens"],
            "again_uncached": len(again["prompt_token_ids"]) - again["meta_info"]["cached_tokens"],
            "second_starts_with_stored": second["prompt_token_ids"][: len(stored)] == stored,
            "second_uncached_of_stored": len(stored) - second["meta_info"]["cached_tokens"],
            "second_image_tokens": second["meta_info"]["image_tokens"],
            "swapped_cached_before_first_pad": swapped["meta_info"]["cached_tokens"] == turn2.index(IMAGE_PAD_ID)}


@image_probe
def image_refusals(t: Target) -> dict[str, Any]:
    expanded = t.generate(image_data=data_url(RED), return_prompt_token_ids=True).json()["prompt_token_ids"]
    out: dict[str, Any] = {
        "pre_expanded": error(t.generate_alone(input_ids=expanded, image_data=data_url(RED))),  # type: ignore[attr-defined]
        "two_pads_one_image": error(t.generate_alone(  # type: ignore[attr-defined]
            input_ids=t.encode(user_turn(f"{IMG}a{IMG}b")), image_data=[data_url(RED)])),  # type: ignore[attr-defined]
        "bad_base64": error(t.generate(image_data="data:image/png;base64,!!!!")),
        "not_an_image": _without_addresses(error(t.generate(image_data="aGVsbG8gd29ybGQh"))),
        "wrong_type": error(t.generate(image_data=5)),
        "wrong_item_type": error(t.generate(image_data=["x", 5])),
        "remote": error(t.generate_alone(image_data="http://127.0.0.1:9/x.png")),  # type: ignore[attr-defined]
        "fewer_pads": reply(t.generate(image_data=[data_url(RED), data_url(png(64, 64, (1, 2, 3)))])),
    }
    with t.http.stream("POST", "/generate", json={"input_ids": expanded, "image_data": data_url(RED), "stream": True,
                                                  "sampling_params": {"max_new_tokens": 4}}) as r:
        try:
            r.read()
            dropped = False
        except httpx.RemoteProtocolError:
            dropped = True
    out["pre_expanded_streamed"] = {"status": r.status_code, "dropped": dropped}
    crash = {"input_ids": expanded, "image_data": data_url(RED), "sampling_params": {"max_new_tokens": 4}}
    out["pipelined_after_500"] = pipelined_statuses(t.http, crash)
    with t.http.stream("POST", "/generate", json={"input_ids": t.prompt, "image_data": "!!!!", "stream": True}) as r:
        out["bad_base64_streamed"] = {"status": r.status_code, "body": r.read().decode()}
    return out


@image_probe
def image_input_logprobs(t: Target) -> dict[str, Any]:
    body = t.generate(image_data=data_url(RED), return_prompt_token_ids=True, logprob_start_len=0).json()
    reported = [entry[1] for entry in body["meta_info"]["input_token_logprobs"]]
    at_pads = {r for r, p in zip(reported, body["prompt_token_ids"], strict=True) if p == IMAGE_PAD_ID}
    return {"entries": len(reported) == len(body["prompt_token_ids"]), "ids_at_pads": sorted(at_pads),
            # the same prompt ran before, but input logprobs from 0 on are computed, not read from the cache
            "cached_tokens": body["meta_info"]["cached_tokens"],
            "elsewhere_the_prompt": all(r == p for r, p in zip(reported, body["prompt_token_ids"], strict=True)
                                        if p != IMAGE_PAD_ID)}


# -- the test -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProcess]:
    with start_sim(engines.checkpoint("qwen3-dense"), "qwen3", "--context-length", "2048", "--kv-capacity-tokens",
                   "8192", "--enable-streaming-session", "--token-latency-ms", "20", "--reasoning-parser", "qwen3",
                   log_dir=tmp_path_factory.mktemp("sim")) as proc:
        yield proc


def observe(target: Target) -> dict[str, Any]:
    return {name: fn(target) for name, fn in PROBES.items()}


def differences(real: Any, sim: Any, path: str = "") -> list[str]:
    if isinstance(real, dict) and isinstance(sim, dict):
        out = []
        for key in sorted(set(real) | set(sim)):
            if key not in sim:
                out.append(f"{path}.{key}: missing in the sim (real: {real[key]!r})")
            elif key not in real:
                out.append(f"{path}.{key}: only in the sim ({sim[key]!r})")
            else:
                out += differences(real[key], sim[key], f"{path}.{key}")
        return out
    return [] if real == sim else [f"{path}: real {real!r} != sim {sim!r}"]


def test_the_sim_answers_like_real_sglang(engines: Engines, sim: RunningProcess) -> None:
    engine = engines.get("dense")
    checkpoint = engines.checkpoint("qwen3-dense")
    # Paced as the sim is (--token-latency-ms 20): the probes that cut a 1500-token reply cut it within a second of
    # its first tokens, and at this pace it runs at least 30 s on any machine.
    with paced(engine.url, 0.02):
        real = observe(Target(engine.url, checkpoint))
    emulated = observe(Target(sim.url, checkpoint))
    diff = differences(real, emulated)
    assert not diff, "\n".join(diff)
    assert real["decode_paths"] == {"plain": "fast", "stream_final": "fast", "intermediate_events": ["cut"]}
    assert_engine_clean(engine.url)


@pytest.fixture(scope="module")
def vl_sim(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProcess]:
    with start_sim(engines.checkpoint("qwen3-vl"), "qwen3", "--context-length", "2048", "--kv-capacity-tokens",
                   "8192", "--token-latency-ms", "20", log_dir=tmp_path_factory.mktemp("vl-sim")) as proc:
        yield proc


def test_the_sim_answers_image_requests_like_real_sglang(engines: Engines, vl_sim: RunningProcess) -> None:
    """The same image requests (one pad per image plus `image_data`) to real SGLang serving the tiny Qwen3-VL and to
    the sim started on its checkpoint: the same shapes, plain and streamed, and the same counts (expanded pads,
    cached tokens, refusals)."""
    engine = engines.get("vl")
    checkpoint = engines.checkpoint("qwen3-vl")
    try:
        with paced(engine.url, 0.02):
            real = {name: fn(ImageTarget(engine.url, checkpoint)) for name, fn in IMAGE_PROBES.items()}
        emulated = {name: fn(ImageTarget(vl_sim.url, checkpoint)) for name, fn in IMAGE_PROBES.items()}
        diff = differences(real, emulated)
        assert not diff, "\n".join(diff)
        assert real["image_plain"]["image_tokens"] == 80 and real["image_cache"]["second_uncached_of_stored"] == 1
        assert_engine_clean(engine.url)
    finally:
        engines.stop("vl")


# -- LoRA (issue 40) ------------------------------------------------------------------------------------------------
LORA_PROBES: dict[str, Probe] = {}


def lora_probe(fn: Probe) -> Probe:
    LORA_PROBES[fn.__name__] = fn
    return fn


class LoraTarget(Target):
    """An engine serving adapters a1 and a2 (--lora-paths, --max-loaded-loras 3); `adapters`: their directory."""

    def __init__(self, url: str, checkpoint: Path, adapters: Path) -> None:
        super().__init__(url, checkpoint)
        self.adapters = adapters

    def listed(self) -> list[str]:
        return sorted(m["id"] for m in self.http.get("/v1/models").json()["data"] if m.get("parent"))

    def load(self, name: str, directory: str) -> httpx.Response:
        body = {"lora_name": name, "lora_path": str(self.adapters / directory)}
        return self.http.post("/load_lora_adapter", json=body)

    def unload(self, name: str) -> httpx.Response:
        return self.http.post("/unload_lora_adapter", json={"lora_name": name})


def _paths(t: Target, answer: dict[str, Any]) -> dict[str, Any]:
    """The adapters' directory in an answer's text, as `<adapters>` (the two engines are given the same ones)."""
    answer["body"] = answer["body"].replace(str(t.adapters), "<adapters>")  # type: ignore[attr-defined]
    return answer


@lora_probe
def lora_generate(t: Target) -> dict[str, Any]:
    """`lora_path` on /generate: the same reply shape, another reply than the base model's and each other's."""
    base, a1, a2 = (t.generate(**kw) for kw in ({}, {"lora_path": "a1"}, {"lora_path": "a2"}))
    ids = [r.json()["output_ids"] for r in (base, a1, a2)]
    return {"a1": reply(a1), "stream": reply(t.generate(lora_path="a2", stream=True)),
            "distinct_replies": len({tuple(i) for i in ids}), "repeatable": t.generate(lora_path="a1").json()[
                "output_ids"] == ids[1]}


@lora_probe
def lora_cache(t: Target) -> dict[str, Any]:
    """The radix cache keeps adapters apart (and from the base model), `extra_key` composing with them."""
    assert t.http.post("/flush_cache").status_code == 200
    prompt = list(range(2000, 2200))
    seen = {}
    a1, a1_v0 = {"lora_path": "a1"}, {"lora_path": "a1", "extra_key": "v0"}
    for label, kw in (("base", {}), ("base again", {}), ("a1", a1), ("a1 again", a1), ("a2", {"lora_path": "a2"}),
                      ("base third", {}), ("a1 v0", a1_v0), ("a1 v0 again", a1_v0)):
        r = t.http.post("/generate", json={"input_ids": prompt, "rid": t.rid(),
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 1}, **kw})
        seen[label] = r.json()["meta_info"]["cached_tokens"]
    return seen


@lora_probe
def lora_load_and_unload(t: Target) -> dict[str, Any]:
    """Load at run time, a duplicate name, unload, unload again, a name never loaded, the reload-on-reference of an
    unloaded name, and the model list along the way; the engine ends as it began (a1, a2)."""
    lt: LoraTarget = t  # type: ignore[assignment]
    info = t.http.get("/server_info").json()
    out: dict[str, Any] = {"start": lt.listed(), "server_info": {
        k: info.get(k) for k in ("enable_lora", "max_loaded_loras", "max_loras_per_batch")}}
    out["load"] = _paths(t, error(lt.load("a3", "a1@1")))
    out["listed_after_load"] = lt.listed()
    out["load_again"] = _paths(t, error(lt.load("a3", "a1@1")))
    out["unload"] = _paths(t, error(lt.unload("a3")))
    out["unload_again"] = error(lt.unload("a3"))
    out["listed_after_unload"] = lt.listed()
    out["never_loaded"] = error(t.generate(lora_path="nope"))
    out["reloaded"] = reply(t.generate(lora_path="a3"))
    out["listed_after_reload"] = lt.listed()
    assert lt.unload("a3").status_code == 200
    return out


@lora_probe
def lora_eviction_at_the_limit(t: Target) -> dict[str, Any]:
    """At --max-loaded-loras a load is not refused: the least recently used adapter goes (and comes back when named)."""
    lt: LoraTarget = t  # type: ignore[assignment]
    t.generate(lora_path="a2")  # a1 is now the least recently used
    out = {"a3": lt.load("a3", "a1@1").status_code, "a4": lt.load("a4", "a1@1").status_code,
           "listed_at_the_limit": lt.listed()}
    out["a1_named_again"] = t.generate(lora_path="a1").status_code
    out["listed_after"] = lt.listed()
    for name in ("a3", "a4"):
        lt.unload(name)
    if "a1" not in lt.listed():
        t.generate(lora_path="a1")
    if "a2" not in lt.listed():
        t.generate(lora_path="a2")
    out["end"] = lt.listed()
    return out


@pytest.fixture(scope="module")
def lora_sim(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningProcess]:
    adapters = engines.adapters()
    with start_sim(engines.checkpoint("qwen3-dense"), "qwen3", "--context-length", "2048", "--kv-capacity-tokens",
                   "8192", "--token-latency-ms", "20", "--enable-lora", "--lora-paths", f"a1={adapters}/a1",
                   f"a2={adapters}/a2", "--max-loaded-loras", "3", "--max-loras-per-batch", "3",
                   log_dir=tmp_path_factory.mktemp("lora-sim")) as proc:
        yield proc


def test_the_sim_serves_lora_like_real_sglang(engines: Engines, lora_sim: RunningProcess) -> None:
    """The same LoRA requests to real SGLang (--enable-lora, the test plugin's pin-memory patch) and to the sim: the
    same shapes, the same cache counts, the same load / unload / reload-on-reference / eviction behaviour."""
    engine = engines.get("lora")
    checkpoint, adapters = engines.checkpoint("qwen3-dense"), engines.adapters()
    try:
        real = {name: fn(LoraTarget(engine.url, checkpoint, adapters)) for name, fn in LORA_PROBES.items()}
        emulated = {name: fn(LoraTarget(lora_sim.url, checkpoint, adapters)) for name, fn in LORA_PROBES.items()}
        diff = differences(real, emulated)
        assert not diff, "\n".join(diff)
        assert real["lora_cache"] == {"base": 0, "base again": 199, "a1": 0, "a1 again": 199, "a2": 0,
                                      "base third": 199, "a1 v0": 0, "a1 v0 again": 199}
        assert real["lora_eviction_at_the_limit"]["end"] == ["a1", "a2"]
        assert_engine_clean(engine.url)
    finally:
        engines.stop("lora")
