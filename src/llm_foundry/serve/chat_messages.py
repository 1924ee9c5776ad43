"""A chat request's messages as the chat template takes them: ``{role, content}`` each.

OpenAI's forms are read as they mean: ``content`` a string or a list of text parts
(``{"type": "text", "text": ...}``, joined with newlines, as vLLM joins them); the role
``developer`` (OpenAI's name for ``system`` in newer models) as ``system``. Parts of other types
(images, audio, files) are refused by name; keys OpenAI's messages have for what this server
does not do (a participant's name, tool calls, audio) are accepted only as null; any other key
is refused by name: nothing in a message is silently dropped."""

from __future__ import annotations

from llm_foundry.data.sft import ROLES, check_messages
from llm_foundry.data.sources import DataError
from llm_foundry.serve.fields import BadRequest, as_json, check_unicode

# OpenAI's message keys that no chat template here has a place for: null only
NULL_ONLY = ("name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio")
ROLE_OF = {**{r: r for r in ROLES}, "developer": "system"}  # a request's role -> the template's
PARTS_JOINED = "\n"


def chat_messages(messages) -> list[dict]:
    """``messages`` (the request's) checked, as ``[{role, content}, ...]`` with string contents
    and the template's roles; BadRequest naming 'messages' and the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "'messages' must be a non-empty list of {role, content} objects", "messages"
        )
    out = [_message(m, f"messages[{j}]") for j, m in enumerate(messages)]
    try:  # the roles and contents fine-tuning takes, so a served model sees no others
        check_messages(out, "messages", "the request")
    except DataError as e:
        raise BadRequest(str(e), "messages") from None
    return out


def _message(m, where: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLE_OF:
        raise BadRequest(
            f"{where} needs a 'role' of {', '.join(ROLE_OF)} ('developer' is taken as "
            f"'system'); got {as_json(m)}", "messages",
        )  # fmt: skip
    for key, value in m.items():
        if key in ("role", "content") or (key in NULL_ONLY and value is None):
            continue
        why = (
            f"which this server does not support (it accepts only null), got {as_json(value)}"
            if key in NULL_ONLY
            else "which a message does not have; a message has 'role' and 'content'"
        )
        raise BadRequest(f"{where} has the key {as_json(key)}, {why}", "messages")
    content = _content(m.get("content"), f"{where}.content")
    check_unicode(content, f"{where}.content", "messages")
    return {"role": ROLE_OF[m["role"]], "content": content}


def _content(content, where: str) -> str:
    """A message's content as one string: itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRequest(f"{where} must be a string or a non-empty list of text parts "
                         f'({{"type": "text", "text": ...}}), got {as_json(content)}',
                         "messages")  # fmt: skip
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" and isinstance(kind, str):
            raise BadRequest(f"{where}[{k}] is a part of type {as_json(kind)}; this server takes "
                             "text parts only", "messages")  # fmt: skip
        if kind != "text" or set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise BadRequest(f'{where}[{k}] must be a text part, {{"type": "text", "text": '
                             f"a string}}, got {as_json(part)}", "messages")  # fmt: skip
        texts.append(part["text"])
    return PARTS_JOINED.join(texts)
