"""The OpenAI-compatible HTTP API over an ``Engine``: /v1/models, /v1/completions,
/v1/chat/completions (both with server-sent-event streaming), /health and /metrics. A request's
``model`` is the served model's name or, with LoRA adapters over it, an adapter's.

Requests are checked here (types, ranges, context length) and refused with OpenAI's error body
and HTTP 400 (404 for an unknown model, 413 for a body over the size limit, 503 with Retry-After
when the queue is full); a request that fails never reaches the engine, so it cannot disturb the
others. OpenAI fields this server does not implement (``logit_bias``, ``tools``, ...) are refused
by name unless they hold the value that means "off", and unknown fields are refused as OpenAI
does: nothing a client asks for is silently ignored. Every error the app answers (unknown
routes and methods, failures) has OpenAI's body, ``{"error": {message, type, param, code}}``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property

from llm_foundry.data.sft import check_messages
from llm_foundry.data.sources import DataError
from llm_foundry.messages import one_line, shown
from llm_foundry.serve.engine import Engine, Params, QueueFull, Sequence
from llm_foundry.serve.offsets import StreamedOffsets, text_offsets
from llm_foundry.serve.page import add_page
from llm_foundry.serve.prompt_size import chars_per_token, min_tokens

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
except ImportError as e:  # the optional [serve] extra
    from llm_foundry.package import absent, missing_extra

    if not absent(e, "fastapi", "starlette"):
        raise  # installed but broken: its own error
    raise missing_extra("serve needs FastAPI and uvicorn", "serve", str(e)) from None

MAX_LOGPROBS = 5  # OpenAI's bound for completions
COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions
MAX_REQUEST_BYTES = 4 * 2**20  # default bound on a request body (--max-request-bytes)
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request asks whether its client is there
READ = ["GET", "HEAD"]  # HEAD as GET without the body: what health checkers send
# the routes that generate, by their name in /metrics
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

# the request fields each endpoint implements (besides those in OFF)
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
          "seed", "logprobs", "user"}  # fmt: skip
FIELDS = {
    False: COMMON | {"prompt"},
    True: COMMON | {"messages", "max_completion_tokens", "top_logprobs",
                    # about OpenAI's own service (storage, billing, caching): no effect here
                    "metadata", "store", "service_tier", "safety_identifier",
                    "prompt_cache_key", "parallel_tool_calls"},
}  # fmt: skip


def _is_zero(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == 0


# OpenAI fields not implemented here: accepted only at the value that means "off" (or null)
OFF: dict[str, tuple[str, object]] = {
    "logit_bias": ("{}", lambda v: v == {}),
    "presence_penalty": ("0", _is_zero),
    "frequency_penalty": ("0", _is_zero),
    "best_of": ("1", lambda v: type(v) is int and v == 1),
    "echo": ("false", lambda v: v is False),
    "suffix": ('""', lambda v: v == ""),
    "response_format": ('{"type": "text"}', lambda v: v == {"type": "text"}),
    "tools": ("[]", lambda v: v == []),
    "functions": ("[]", lambda v: v == []),
    "tool_choice": ('"none"', lambda v: v == "none"),
    "function_call": ('"none"', lambda v: v == "none"),
    "modalities": ('["text"]', lambda v: v == ["text"]),
    "audio": ("", lambda v: False),
    "prediction": ("", lambda v: False),
    "reasoning_effort": ("", lambda v: False),
    "web_search_options": ("", lambda v: False),
    "verbosity": ("", lambda v: False),
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, param=None, code=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Served:
    """What the app serves: the engine, its tokenizer, the chat template and the counters;
    ``adapters`` names the LoRA adapters over the model (a request's ``model`` may name one):
    ``adapters[k - 1]`` is the engine's adapter k."""

    engine: Engine
    tokenizer: object
    name: str
    template: str | None = None
    specials: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)  # (endpoint, status) -> count
    chat_stop: tuple[str, ...] = ()  # a chat template's plain-text end of turn
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: list[str] = field(default_factory=list)

    @cached_property
    def chars_per_token(self) -> float | None:
        """The most characters one token stands for (None: not bounded; ``prompt_size``)."""
        return chars_per_token(self.tokenizer)

    def adapter_of(self, model) -> int:
        """The engine's adapter for a request's ``model``: 0 for the served model's name, k
        for ``adapters[k - 1]``; BadRequest (404) naming the valid ones otherwise."""
        if model == self.name:
            return 0
        if isinstance(model, str) and model in self.adapters:
            return self.adapters.index(model) + 1
        valid = ", ".join(f"'{m}'" for m in [self.name, *self.adapters])
        has = f"has {valid}" if not self.adapters else f"has {valid} (the base and its adapters)"
        raise BadRequest(f"The model {shown(model)} does not exist; this server {has}", "model",
                         404, "model_not_found")  # fmt: skip


# ---- request fields ---------------------------------------------------------------------------
def _check_fields(body: dict, chat: bool) -> None:
    """Refuse fields this endpoint does not know, and implemented-nowhere OpenAI fields unless
    they hold their "off" value: a request is never answered as if they were not there."""
    unknown = [k for k in body if k not in FIELDS[chat] and k not in OFF]
    if unknown:
        names = ", ".join(shown(k) for k in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        plural = "s" if len(unknown) > 1 else ""
        raise BadRequest(f"Unrecognized request argument{plural} supplied: {names}{more}")
    for key, (off, accepts) in OFF.items():
        value = body.get(key)
        if value is not None and not accepts(value):
            allowed = f"null or {off}" if off else "null"
            raise BadRequest(
                f"'{key}' is not supported by this server (it accepts only {allowed}), got "
                f"{shown(value)}", key,
            )  # fmt: skip


def _number(body, key, default, lo, hi, integer=False):
    """``body[key]`` (``default`` when absent or null) checked to be a number in [lo, hi] (no
    upper bound when ``hi`` is None)."""
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not lo <= value <= (value if hi is None else hi):
        kind = "an integer" if integer else "a number"
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"'{key}' must be {kind} {bounds}, got {shown(value)}", key)
    return value


def _limit_field(body: dict, chat: bool) -> str | None:
    """The field that bounds the reply's tokens in ``body`` (None: not given)."""
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    return next((k for k in keys if body.get(k) is not None), None)


def _fit_context(prompt: int, max_tokens: int, key: str | None, context: int, chat: bool) -> int:
    """The reply's bound for a prompt of ``prompt`` tokens: ``max_tokens`` asked by the field
    ``key`` must fit in the context after the prompt (OpenAI's context_length_exceeded error
    otherwise); not asked (``key`` None), it is cut to the context left."""
    if prompt >= context:
        raise BadRequest(
            f"the prompt is {prompt} tokens; the model's context is {context}, leaving no room "
            "for a reply", "messages" if chat else "prompt", code="context_length_exceeded",
        )  # fmt: skip
    if key is not None and prompt + max_tokens > context:
        raise BadRequest(
            f"This model's maximum context length is {context} tokens; you requested "
            f"{prompt + max_tokens} tokens: {prompt} in the prompt and {max_tokens} for the "
            f"completion; set '{key}' to at most {context - prompt}, or leave it out for a "
            "reply up to the end of the context", key, code="context_length_exceeded",
        )  # fmt: skip
    return min(max_tokens, context - prompt)


def _params(body: dict, chat: bool, context: int) -> tuple[Params, int]:
    """The request's generation settings and its number of choices; ``max_tokens`` is checked
    against ``context`` once the prompt is known (``_fit_context``)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest(
            f"'stop' must be a string or up to 4 non-empty strings, got {shown(stop)}", "stop"
        )
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest(f"'logprobs' must be true or false, got {shown(want)}", "logprobs")
        top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        logprobs = top if want else None
    else:
        logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    key = _limit_field(body, chat)
    default = context if chat else COMPLETION_TOKENS
    max_tokens = default if key is None else _number(body, key, None, 1, None, integer=True)
    params = Params(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=_number(body, "top_p", None, 0.0, 1.0),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stop=tuple(stop or ()),
        logprobs=logprobs,
    )
    if params.top_p is not None and params.top_p == 0:
        raise BadRequest("'top_p' must be > 0", "top_p")
    n = _number(body, "n", 1, 1, 16, integer=True)
    return params, n


def _prompt_ids(served: Served, body: dict, chat: bool) -> list[int]:
    """The request's prompt as token ids: its ids, or its text (a chat's rendered) encoded; a
    text too long for the context whatever it encodes to is refused before it is encoded."""
    prompt = _prompt_text(served, body, chat)
    if isinstance(prompt, list):
        return prompt
    least, context = min_tokens(len(prompt), served.chars_per_token), served.engine.context
    if least >= context:
        raise BadRequest(
            f"the prompt is {len(prompt):,} characters, so at least {least:,} tokens (a token "
            f"of this tokenizer stands for {served.chars_per_token:g} characters at most); the "
            f"model's context is {context}", "messages" if chat else "prompt",
            code="context_length_exceeded",
        )  # fmt: skip
    try:
        return _encode(served.tokenizer, prompt)
    except ValueError as e:
        raise BadRequest(f"the prompt cannot be encoded: {e}", "prompt") from None


def _encode(tok, text: str) -> list[int]:
    """``text``'s ids, no special tokens added; a Hugging Face tokenizer's through encode_batch,
    which lets go of the GIL while it works (its encode holds it: the server would stall)."""
    hf = getattr(tok, "hf", None)
    if hf is None:
        return tok.encode(text)
    return hf.encode_batch([text], add_special_tokens=False)[0].ids


def _prompt_text(served: Served, body: dict, chat: bool) -> str | list[int]:
    """The request's prompt: a text (a chat's rendered in its template) or token ids."""
    if chat:
        from llm_foundry.chat import render_chat

        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' must be a non-empty list of {role, content} objects with string "
                "values", "messages",
            )  # fmt: skip
        try:  # the roles and contents fine-tuning takes, so a served model sees no others
            check_messages(messages, "messages", "the request")
        except DataError as e:
            raise BadRequest(str(e), "messages") from None
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        for j, m in enumerate(messages):
            _check_unicode(m["content"], f"messages[{j}].content", "messages")
        try:
            text = render_chat(served.template, messages, add_generation_prompt=True,
                               **served.specials)  # fmt: skip
        except ValueError as e:
            raise BadRequest(str(e), "messages") from None
    else:
        text = body.get("prompt")
        if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
            text = text[0]
        if (
            isinstance(text, list)
            and text
            and all(isinstance(i, int) and not isinstance(i, bool) for i in text)
        ):
            vocab = served.engine.model.cfg.vocab_size
            bad = next((i for i in text if not 0 <= i < vocab), None)
            if bad is not None:
                raise BadRequest(
                    f"'prompt' token ids must be in [0, {vocab}), got {shown(bad)}", "prompt"
                )
            return list(text)
        if not isinstance(text, str) or not text:
            raise BadRequest(
                "'prompt' must be a non-empty string (or one list of token ids)", "prompt"
            )
        _check_unicode(text, "'prompt'", "prompt")
    return text


def _check_unicode(text: str, what: str, param: str) -> None:
    """Refuse a string that is not Unicode text: JSON's escapes can write a lone surrogate
    (\\ud800), which no encoding has (tokenizers fail on it, deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"{what} is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at "
            f"character {e.start:,} (a UTF-16 half with no other half)", param,
        ) from None  # fmt: skip


# ---- responses ----------------------------------------------------------------------------------
def _logprobs_block(served: Served, records: list, chat: bool, offsets: list[int] | None = None):
    """The logprobs of ``records`` ((token, logprob, top) each); a completion's ``text_offset``:
    ``offsets``, where each token starts in the completion's text (``serve.offsets``). Each
    token's string is that token decoded alone (U+FFFD for bytes of an unfinished character)."""
    decode = served.tokenizer.decode
    if chat:

        def entry(token: int, logprob: float) -> dict:
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                for t, lp, top in records
            ]
        }
    tokens = [decode([t]) for t, _, _ in records]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in records],
        "top_logprobs": [{decode([i]): v for i, v in top} for _, _, top in records],
        "text_offset": offsets,
    }


def _finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def create_app(served: Served, max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The app over ``served``; a request body over ``max_request_bytes`` is refused (413)
    before it is read whole."""
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {max_request_bytes} must be >= 1")
    app = FastAPI(title="llm-foundry", docs_url=None, redoc_url=None)
    add_page(app)  # the chat page at /
    engine = served.engine
    relays: dict = {}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        path = shown(request.url.path)
        if e.status_code == 404:
            message = f"Invalid URL ({request.method} {path})"
        elif e.status_code == 405:
            message = f"Method {request.method} is not allowed for {path}"
        else:
            message = str(e.detail)
        kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
        return JSONResponse(error_body(message, kind=kind), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):
        endpoint = ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            count(endpoint, 500)
        message = f"the server failed on this request ({type(e).__name__}: {one_line(str(e))})"
        return JSONResponse(error_body(message, kind="server_error"), 500)

    async def read_json(request: Request):
        """The request body as JSON, read up to ``max_request_bytes`` (413 past it)."""

        def too_big(size: str) -> BadRequest:
            return BadRequest(
                f"the request body is {size}; the most this server takes is "
                f"{max_request_bytes:,} bytes (--max-request-bytes)", status=413,
                code="request_too_large",
            )  # fmt: skip

        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise too_big(f"{int(declared):,} bytes")
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > max_request_bytes:
                    raise too_big(f"more than {max_request_bytes:,} bytes")
        except ClientDisconnect:  # counted under 499 (nginx's "client closed request"), no trace
            raise BadRequest(
                f"the client closed the connection after {len(data):,} bytes of its request",
                status=499, code="client_closed_request",
            ) from None  # fmt: skip
        try:
            return json.loads(data)
        except RecursionError:
            raise BadRequest("the request body is JSON nested too deeply to read") from None
        except (UnicodeDecodeError, ValueError):
            raise BadRequest("the request body is not valid JSON") from None

    def relay(loop):
        """post(queue, item) from the engine's thread: items gathered and handed to the event
        loop in one wake-up per batch (not one per token per request)."""
        if loop not in relays:
            pending: collections.deque = collections.deque()
            scheduled = [False]

            def drain():
                scheduled[0] = False
                while pending:
                    queue, item = pending.popleft()
                    queue.put_nowait(item)

            def post(queue, item):
                pending.append((queue, item))
                if not scheduled[0]:
                    scheduled[0] = True
                    loop.call_soon_threadsafe(drain)

            relays[loop] = post
        return relays[loop]

    def count(endpoint: str, status: int) -> None:
        served.requests[(endpoint, status)] = served.requests.get((endpoint, status), 0) + 1

    def refuse(endpoint: str, e: BadRequest) -> JSONResponse:
        count(endpoint, e.status)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        kind = "server_overloaded" if e.status == 503 else "invalid_request_error"
        return JSONResponse(error_body(str(e), e.param, e.code, kind), e.status, headers=headers)

    @app.api_route("/health", methods=READ)
    async def health():
        return {"status": "ok", "slots": engine.slots, "busy": engine.busy(),
                "waiting": engine.queue_length()}  # fmt: skip

    @app.api_route("/v1/models", methods=READ)
    async def models():
        model = {"id": served.name, "object": "model", "created": served.created,
                 "owned_by": "llm-foundry"}  # fmt: skip
        adapters = [{**model, "id": name, "parent": served.name} for name in served.adapters]
        return {"object": "list", "data": [model, *adapters]}

    @app.api_route("/metrics", methods=READ)
    async def metrics():
        s = engine.stats
        lines = [
            "# TYPE llm_foundry_requests_total counter",
            *(
                f'llm_foundry_requests_total{{endpoint="{e}",status="{c}"}} {n}'
                for (e, c), n in sorted(served.requests.items())
            ),  # fmt: skip
            "# TYPE llm_foundry_prompt_tokens_total counter",
            f"llm_foundry_prompt_tokens_total {s.prompt_tokens}",
            "# TYPE llm_foundry_generated_tokens_total counter",
            f"llm_foundry_generated_tokens_total {s.generated_tokens}",
            "# TYPE llm_foundry_queue_length gauge",
            f"llm_foundry_queue_length {engine.queue_length()}",
            "# TYPE llm_foundry_slots_busy gauge",
            f"llm_foundry_slots_busy {engine.busy()}",
            "# TYPE llm_foundry_slots gauge",
            f"llm_foundry_slots {engine.slots}",
            "# TYPE llm_foundry_batch_occupancy gauge",
            f"llm_foundry_batch_occupancy "
            f"{s.busy_slot_steps / max(1, s.decode_steps * engine.slots):.4f}",
            "# TYPE llm_foundry_time_to_first_token_seconds summary",
            f"llm_foundry_time_to_first_token_seconds_sum {s.ttft_sum_s:.6f}",
            f"llm_foundry_time_to_first_token_seconds_count {s.ttft_count}",
            "# TYPE llm_foundry_decode_steps_total counter",
            f"llm_foundry_decode_steps_total {s.decode_steps}",
            "# TYPE llm_foundry_requests_cancelled_total counter",
            f"llm_foundry_requests_cancelled_total {s.cancelled}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            model = body.get("model", served.name)
            adapter = served.adapter_of(model)
            _check_fields(body, chat)
            params, n = _params(body, chat, engine.context)
            bound = engine.slots + engine.max_queue
            if n > bound:
                raise BadRequest(
                    f"'n' is {n}; this server runs at most {bound} sequences of one request "
                    f"({engine.slots} slots + a queue of {engine.max_queue})", "n",
                )  # fmt: skip
            if chat:
                params.stop = tuple(dict.fromkeys(params.stop + served.chat_stop))
            # encoding a long prompt takes a while: in a worker thread, not the event loop
            prompt = await asyncio.to_thread(_prompt_ids, served, body, chat)
            params.max_tokens = _fit_context(len(prompt), params.max_tokens,
                                             _limit_field(body, chat), engine.context, chat)  # fmt: skip
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest(f"'stream' must be true or false, got {shown(stream)}", "stream")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict) or not isinstance(
                options.get("include_usage", False), bool
            ):  # fmt: skip
                raise BadRequest(
                    "'stream_options' must be an object whose 'include_usage' is true or "
                    f"false, got {shown(options)}", "stream_options",
                )  # fmt: skip
            usage_chunk = options.get("include_usage") is True
        except BadRequest as e:
            return refuse(endpoint, e)

        events: asyncio.Queue = asyncio.Queue()
        post = relay(asyncio.get_running_loop())
        seqs = []
        for i in range(n):
            p = Params(**{**params.__dict__})
            if p.seed is not None:
                p.seed += i  # n choices with one seed: different draws, still reproducible

            def emit(kind, payload, index=i):
                post(events, (index, kind, payload))

            seqs.append(Sequence(prompt=prompt, params=p, emit=emit, adapter=adapter))
        try:
            engine.submit(seqs)
        except QueueFull as e:
            return refuse(endpoint, BadRequest(f"the server is busy ({e}); retry later",
                                               status=503))  # fmt: skip
        except ValueError as e:
            return refuse(endpoint, BadRequest(str(e)))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        usage = lambda: {  # noqa: E731
            "prompt_tokens": len(prompt),
            "completion_tokens": sum(len(s.tokens) for s in seqs),
            "total_tokens": len(prompt) + sum(len(s.tokens) for s in seqs),
        }
        obj = "chat.completion" if chat else "text_completion"

        if stream:
            count(endpoint, 200)  # the status line goes out with the first chunk
            chunk_obj = obj + (".chunk" if chat else "")

            async def sse():
                done = 0
                offsets = [StreamedOffsets(served.tokenizer.decode) for _ in range(n)]
                try:
                    if chat:
                        for i in range(n):
                            first = {"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}  # fmt: skip
                            yield _sse(rid, obj + ".chunk", created, model, [first])
                    while done < n:
                        batch = [await events.get()]
                        while not events.empty():  # what arrived meanwhile goes in one write
                            batch.append(events.get_nowait())
                        out = []
                        for i, kind, payload in batch:
                            if kind == "done":
                                done += 1
                                if payload.startswith("error"):
                                    body = error_body(payload, kind="server_error")
                                    out.append("data: " + json.dumps(body) + "\n\n")
                                    continue
                                # tokens past a stop string, sent at the end of the text
                                left, at = offsets[i].end()
                                lp = _logprobs_block(served, left, chat, at) if left else None
                                choice = _choice(chat, i, "", lp, _finish_reason(payload))
                            else:
                                piece, records = payload
                                at = None
                                if not chat and seqs[i].params.logprobs is not None:
                                    records, at = offsets[i].chunk(piece, records)
                                lp = _logprobs_block(served, records, chat, at) if records else None
                                choice = _choice(chat, i, piece, lp, None)
                            out.append(_sse(rid, chunk_obj, created, model, [choice]))
                        yield "".join(out)
                    if usage_chunk:
                        yield _sse(rid, obj + (".chunk" if chat else ""), created, model,
                                   [], usage=usage())  # fmt: skip
                    yield "data: [DONE]\n\n"
                finally:
                    engine.cancel([s for s in seqs if not s.finished])  # a client that left

            return StreamingResponse(sse(), media_type="text/event-stream")

        texts = [""] * n
        records: list[list] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        clock = asyncio.get_running_loop().time
        checked = clock()
        try:
            while any(r is None for r in reasons):
                try:
                    batch = [await asyncio.wait_for(events.get(), timeout=DISCONNECT_CHECK_S)]
                except TimeoutError:
                    batch = []
                while not events.empty():
                    batch.append(events.get_nowait())
                # asked whether tokens flow or not, at most every DISCONNECT_CHECK_S
                if clock() - checked >= DISCONNECT_CHECK_S:
                    checked = clock()
                    if await request.is_disconnected():  # its rows are cancelled below
                        return refuse(endpoint, BadRequest(
                            "the client closed the connection before its reply was ready",
                            status=499, code="client_closed_request"))  # fmt: skip
                for i, kind, payload in batch:
                    if kind == "text":
                        texts[i] += payload[0]
                        records[i] += payload[1]
                    else:
                        reasons[i] = payload
        finally:
            engine.cancel([s for s in seqs if not s.finished])
        failed = [r for r in reasons if r.startswith("error")]
        if failed:
            count(endpoint, 500)
            return JSONResponse(error_body(failed[0], kind="server_error"), 500)
        choices = []
        for i in range(n):
            lp = None
            if seqs[i].params.logprobs is not None:
                ids, at = [r[0] for r in records[i]], None
                if not chat:  # one decode per token: off the event loop
                    at = await asyncio.to_thread(
                        text_offsets, served.tokenizer.decode, ids, texts[i]
                    )
                lp = _logprobs_block(served, records[i], chat, at)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": lp, "finish_reason": _finish_reason(reasons[i])})  # fmt: skip
            else:
                choices.append({"index": i, "text": texts[i], "logprobs": lp,
                                "finish_reason": _finish_reason(reasons[i])})  # fmt: skip
        count(endpoint, 200)
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": choices, "usage": usage()}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


def _choice(chat: bool, index: int, text: str, logprobs, finish) -> dict:
    """One choice of a streamed chunk: a chat delta or a completion's text."""
    if chat:
        delta = {"content": text} if text or finish is None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _sse(rid, obj, created, model, choices, usage=None) -> str:
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"
