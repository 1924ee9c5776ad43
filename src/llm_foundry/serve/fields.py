"""A request's fields checked against OpenAI's API: each one's type and range, the fields an
endpoint takes, and those it does not implement (refused by name unless "off"). Every refusal is a
``BadRequest``: one line naming the field and the value, answered with OpenAI's error body."""

from __future__ import annotations

import json
from collections.abc import Sized

from llm_foundry.messages import LIMIT
from llm_foundry.serve.engine import Params

MAX_LOGPROBS = 5  # OpenAI's bound for completions
COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions
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
# fields about OpenAI's own service: their types checked (as OpenAI does), no effect here
SERVICE = {"user": (str, "a string"), "store": (bool, "true or false"),
           "service_tier": (str, "a string"), "safety_identifier": (str, "a string"),
           "prompt_cache_key": (str, "a string"),
           "parallel_tool_calls": (bool, "true or false")}  # fmt: skip
METADATA = (16, 64, 512)  # OpenAI's bounds: pairs, characters of a key, of a value
STREAM_OPTIONS = {"include_usage", "include_obfuscation"}


def _is_zero(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == 0


# OpenAI fields not implemented here: accepted only at the value that means "off" (or null);
# each endpoint's own (a completions field sent for a chat is unknown there, as OpenAI has it)
_OFF_BOTH: dict[str, tuple[str, object]] = {
    "logit_bias": ("{}", lambda v: v == {}),
    "presence_penalty": ("0", _is_zero),
    "frequency_penalty": ("0", _is_zero),
}
OFF: dict[bool, dict[str, tuple[str, object]]] = {
    False: {
        **_OFF_BOTH,
        "best_of": ("1", lambda v: type(v) is int and v == 1),
        "echo": ("false", lambda v: v is False),
        "suffix": ('""', lambda v: v == ""),
    },
    True: {
        **_OFF_BOTH,
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
    },
}


def as_json(value, limit: int = LIMIT) -> str:
    """``value`` (a request's, read from JSON) written as JSON (true, null, {"a": 1}, as the
    client wrote it), or its first ``limit`` characters with '...' and the value's size."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate cannot be sent back as it is: escaped
        text = json.dumps(value)
    if len(text) <= limit:
        return text
    unit = "characters" if isinstance(value, str) else "items"
    size = f" ({len(value):,} {unit})" if isinstance(value, Sized) else ""
    return f"{text[:limit]}...{size}"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, param=None, code=None, kind="invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse fields this endpoint does not know, and implemented-nowhere OpenAI fields unless
    they hold their "off" value: a request is never answered as if they were not there."""
    unknown = [k for k in body if k not in FIELDS[chat] and k not in OFF[chat]]
    if unknown:
        names = ", ".join(as_json(k) for k in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        plural = "s" if len(unknown) > 1 else ""
        raise BadRequest(f"Unrecognized request argument{plural} supplied: {names}{more}")
    for key, (off, accepts) in OFF[chat].items():
        value = body.get(key)
        if value is not None and not accepts(value):
            allowed = f"null or {off}" if off else "null"
            raise BadRequest(
                f"'{key}' is not supported by this server (it accepts only {allowed}), got "
                f"{as_json(value)}", key,
            )  # fmt: skip
    for key, (kind, what) in SERVICE.items():
        value = body.get(key)
        if value is not None and type(value) is not kind:
            raise BadRequest(f"'{key}' must be {what} or null, got {as_json(value)}", key)
    _check_metadata(body.get("metadata"))


def _check_metadata(metadata) -> None:
    """OpenAI's ``metadata``: null or an object of up to 16 string values, keys up to 64
    characters, values up to 512."""
    pairs, key_chars, value_chars = METADATA
    if metadata is None:
        return
    if not (
        isinstance(metadata, dict)
        and len(metadata) <= pairs
        and all(len(k) <= key_chars for k in metadata)
        and all(isinstance(v, str) and len(v) <= value_chars for v in metadata.values())
    ):  # fmt: skip
        raise BadRequest(
            f"'metadata' must be null or an object of up to {pairs} string values (keys up to "
            f"{key_chars} characters, values up to {value_chars}), got {as_json(metadata)}",
            "metadata",
        )


def number(body, key, default, lo, hi, integer=False):
    """``body[key]`` (``default`` when absent or null) checked to be a number in [lo, hi] (no
    upper bound when ``hi`` is None)."""
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok or not lo <= value <= (value if hi is None else hi):
        kind = "an integer" if integer else "a number"
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise BadRequest(f"'{key}' must be {kind} {bounds}, got {as_json(value)}", key)
    return value


def limit_field(body: dict, chat: bool) -> str | None:
    """The field that bounds the reply's tokens in ``body`` (None: not given)."""
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    return next((k for k in keys if body.get(k) is not None), None)


def fit_context(prompt: int, max_tokens: int, key: str | None, context: int, chat: bool) -> int:
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


def request_params(body: dict, chat: bool, context: int) -> tuple[Params, int]:
    """The request's generation settings and its number of choices; ``max_tokens`` is checked
    against ``context`` once the prompt is known (``fit_context``)."""
    asked = stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise BadRequest(
            f"'stop' must be a non-empty string or up to 4 of them, got {as_json(asked)}", "stop"
        )
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest(f"'logprobs' must be true or false, got {as_json(want)}", "logprobs")
        if body.get("top_logprobs") is not None and want is not True:
            raise BadRequest(
                "'top_logprobs' asks for alternatives to the tokens' log probabilities: it "
                f"needs 'logprobs': true, got 'logprobs': {as_json(want)}", "top_logprobs",
            )  # fmt: skip
        top = number(body, "top_logprobs", 0, 0, 20, integer=True)
        logprobs = top if want else None
    else:
        logprobs = number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    key = limit_field(body, chat)
    default = context if chat else COMPLETION_TOKENS
    max_tokens = default if key is None else number(body, key, None, 1, None, integer=True)
    params = Params(
        max_tokens=max_tokens,
        temperature=float(number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=number(body, "top_p", None, 0.0, 1.0),
        seed=number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stop=tuple(stop or ()),
        logprobs=logprobs,
    )
    if params.top_p is not None and params.top_p == 0:
        raise BadRequest("'top_p' must be > 0", "top_p")
    n = number(body, "n", 1, 1, 16, integer=True)
    return params, n


def streaming(body: dict) -> tuple[bool, bool]:
    """(whether to stream the reply, whether a last chunk gives the usage); ``stream`` null is
    false, as left out; ``stream_options`` only with ``stream`` true."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true, false or null, got {as_json(stream)}", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream is True, False
    if stream is not True:
        raise BadRequest(
            "'stream_options' is for streamed replies: set 'stream': true, or leave "
            "'stream_options' out", "stream_options",
        )  # fmt: skip
    if not isinstance(options, dict):
        raise BadRequest(f"'stream_options' must be an object, got {as_json(options)}",
                         "stream_options")  # fmt: skip
    unknown = [k for k in options if k not in STREAM_OPTIONS]
    if unknown:
        raise BadRequest(
            f"'stream_options' has the key {as_json(unknown[0])}; it takes "
            f"{' and '.join(map(as_json, sorted(STREAM_OPTIONS)))}", "stream_options",
        )  # fmt: skip
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise BadRequest(f"'stream_options.include_usage' must be true, false or null, got "
                         f"{as_json(usage)}", "stream_options")  # fmt: skip
    if options.get("include_obfuscation") not in (None, False):  # padding chunks: not done
        raise BadRequest(
            "'stream_options.include_obfuscation' is not supported by this server (it "
            f"accepts only null or false), got {as_json(options['include_obfuscation'])}",
            "stream_options",
        )  # fmt: skip
    return True, usage is True


def check_unicode(text: str, what: str, param: str) -> None:
    """Refuse a string that is not Unicode text: JSON's escapes can write a lone surrogate
    (\\ud800), which no encoding has (tokenizers fail on it, deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            f"{what} is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at "
            f"character {e.start:,} (a UTF-16 half with no other half)", param,
        ) from None  # fmt: skip
