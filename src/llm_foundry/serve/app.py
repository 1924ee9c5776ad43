"""The OpenAI-compatible HTTP API over an ``Engine``: /v1/models (and /v1/models/{id}),
/v1/completions, /v1/chat/completions (both with server-sent-event streaming), /health and
/metrics. A request's ``model`` is the served model's name or, with LoRA adapters over it, an
adapter's.

Requests are checked (``fields``: types and ranges; ``prompts``: the prompt, the context length)
and refused with OpenAI's error body and HTTP 400 (404 for an unknown model, 413 for a body over
the size limit, 503 with Retry-After when the queue is full); a request that fails never reaches
the engine, so it cannot disturb the others. OpenAI fields this server does not implement
(``logit_bias``, ``tools``, ...) are refused by name unless they hold the value that means
"off", and unknown fields are refused as OpenAI does: nothing a client asks for is silently
ignored. Every error the app answers (unknown routes and methods, failures) has OpenAI's body,
``{"error": {message, type, param, code}}``, values shown as the JSON the client sent. A web
page of another site is refused (403, ``origin``); there is no generated schema or docs page.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property

from llm_foundry.messages import one_line
from llm_foundry.serve.engine import Closing, Engine, Params, QueueFull, Sequence
from llm_foundry.serve.fields import (
    BadRequest,
    as_json,
    check_fields,
    error_body,
    fit_context,
    limit_field,
    request_params,
    streaming,
)
from llm_foundry.serve.offsets import StreamedOffsets, text_offsets
from llm_foundry.serve.origin import SameOrigin
from llm_foundry.serve.page import add_page
from llm_foundry.serve.pieces import Pieces
from llm_foundry.serve.prompt_size import chars_per_token
from llm_foundry.serve.prompts import prompt_ids

_prompt_ids = prompt_ids  # the name it had here

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

MAX_REQUEST_BYTES = 4 * 2**20  # default bound on a request body (--max-request-bytes)
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request asks whether its client is there
READ = ["GET", "HEAD"]  # HEAD as GET without the body: what health checkers send
# the routes that generate, by their name in /metrics
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


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
    pieces: Pieces | None = None  # what the reply says of tokens (default: the tokenizer's)

    def __post_init__(self):
        if self.pieces is None:
            self.pieces = Pieces(self.tokenizer)

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
        valid = ", ".join(as_json(m) for m in [self.name, *self.adapters])
        has = f"has {valid}" if not self.adapters else f"has {valid} (the base and its adapters)"
        raise BadRequest(f"The model {as_json(model)} does not exist; this server {has}", "model",
                         404, "model_not_found")  # fmt: skip


# ---- responses ----------------------------------------------------------------------------------
def _logprobs_block(served: Served, records: list, chat: bool, offsets: list[int] | None = None):
    """The logprobs of ``records`` ((token, logprob, top) each); a completion's ``text_offset``:
    ``offsets``, where each token starts in the completion's text (``serve.offsets``). Tokens
    are named and their bytes given as ``serve.pieces`` has them."""
    pieces = served.pieces
    if chat:

        def entry(token: int, logprob: float) -> dict:
            return {"token": pieces.name(token), "logprob": logprob,
                    "bytes": list(pieces.token_bytes(token))}  # fmt: skip

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                for t, lp, top in records
            ]
        }
    return {
        "tokens": [pieces.name(t) for t, _, _ in records],
        "token_logprobs": [lp for _, lp, _ in records],
        "top_logprobs": [{pieces.name(i): v for i, v in top} for _, _, top in records],
        "text_offset": offsets,
    }


def _finish_reason(reason: str) -> str:
    """OpenAI's finish_reason for the engine's: a reply cut by the server shutting down is
    "length" (cut short, as by max_tokens: not a natural end); a cancelled one "stop"."""
    return {"stop": "stop", "length": "length", "shutdown": "length"}.get(reason, "stop")


def create_app(
    served: Served,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    hosts: frozenset[str] | None = None,
) -> FastAPI:
    """The app over ``served``; a request body over ``max_request_bytes`` is refused (413)
    before it is read whole; ``hosts``: the names besides loopback ones a request may be for
    (None: any; ``origin.host_allowed``)."""
    if max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {max_request_bytes} must be >= 1")
    # no generated API pages or schema; a path with a trailing slash is not redirected (clients
    # do not follow a redirect of a POST): it is an unknown route, answered as one
    app = FastAPI(title="llm-foundry", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # fmt: skip
    app.add_middleware(SameOrigin, hosts=hosts)
    add_page(app)  # the chat page at /
    engine = served.engine
    relays: dict = {}

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        path = as_json(request.url.path)
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
            return json.loads(data, parse_int=_int)
        except TooManyDigits as e:  # valid JSON, past what Python turns into an int
            raise BadRequest(
                f"the request body has an integer of {e.digits:,} digits; this server reads "
                f"integers of up to {sys.get_int_max_str_digits():,} digits", code="integer_too_long",
            ) from None  # fmt: skip
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

    def card(name: str) -> dict:
        """OpenAI's model object of the served model (or of an adapter over it)."""
        model = {"id": name, "object": "model", "created": served.created,
                 "owned_by": "llm-foundry"}  # fmt: skip
        return model if name == served.name else {**model, "parent": served.name}

    @app.api_route("/v1/models", methods=READ)
    async def models():
        return {"object": "list", "data": [card(m) for m in [served.name, *served.adapters]]}

    @app.api_route("/v1/models/{model:path}", methods=READ)
    async def model(model: str):
        try:
            served.adapter_of(model)
        except BadRequest as e:
            return JSONResponse(error_body(str(e), e.param, e.code), e.status)
        return card(model)

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
            model = served.name if body.get("model") is None else body["model"]
            adapter = served.adapter_of(model)
            check_fields(body, chat)
            params, n = request_params(body, chat, engine.context)
            bound = engine.slots + engine.max_queue
            if n > bound:
                raise BadRequest(
                    f"'n' is {n}; this server runs at most {bound} sequences of one request "
                    f"({engine.slots} slots + a queue of {engine.max_queue})", "n",
                )  # fmt: skip
            if chat:
                params.stop = tuple(dict.fromkeys(params.stop + served.chat_stop))
            # encoding a long prompt takes a while: in a worker thread, not the event loop
            prompt = await asyncio.to_thread(prompt_ids, served, body, chat)
            params.max_tokens = fit_context(len(prompt), params.max_tokens,
                                             limit_field(body, chat), engine.context, chat)  # fmt: skip
            stream, usage_chunk = streaming(body)
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
        except Closing as e:
            return refuse(endpoint, BadRequest(str(e), status=503))
        except QueueFull as e:
            return refuse(endpoint, BadRequest(f"the server is busy ({e}); retry later",
                                               status=503))  # fmt: skip
        except ValueError as e:
            return refuse(endpoint, BadRequest(str(e)))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        usage = lambda: {  # noqa: E731 - an end-of-text token that ended a reply counted
            "prompt_tokens": len(prompt),
            "completion_tokens": sum(len(s.tokens) + s.eos for s in seqs),
            "total_tokens": len(prompt) + sum(len(s.tokens) + s.eos for s in seqs),
        }
        obj = "chat.completion" if chat else "text_completion"

        pieces = served.pieces  # offsets from the tokens' bytes where the text joins them
        joined = (pieces.text, pieces.token_bytes if pieces.joined else None)
        if stream:
            count(endpoint, 200)  # the status line goes out with the first chunk
            chunk_obj = obj + (".chunk" if chat else "")

            async def sse():
                done = 0
                offsets = [StreamedOffsets(*joined) for _ in range(n)]
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
                if not chat:  # off the event loop: a decode per token where not joined
                    at = await asyncio.to_thread(text_offsets, joined[0], ids, texts[i],
                                                 token_bytes=joined[1])  # fmt: skip
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


class TooManyDigits(Exception):
    def __init__(self, digits: int):
        self.digits = digits


def _int(text: str) -> int:
    """A JSON integer as json.loads reads it; one past Python's digit limit (4300 unless set
    otherwise) named as such, not as invalid JSON."""
    try:
        return int(text)
    except ValueError:
        raise TooManyDigits(len(text.lstrip("-"))) from None


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
