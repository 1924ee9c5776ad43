"""A chat request's messages as the chat template takes them: ``{role, content}`` each. Keys
OpenAI's messages have for what this server does not do (a participant's name, tool calls,
audio) are accepted only as null; any other key is refused by name: nothing in a message is
silently dropped."""

from __future__ import annotations

from llm_foundry.data.sft import check_messages
from llm_foundry.data.sources import DataError
from llm_foundry.messages import shown
from llm_foundry.serve.fields import BadRequest, check_unicode

# OpenAI's message keys that no chat template here has a place for: null only
NULL_ONLY = ("name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio")


def chat_messages(messages) -> list[dict]:
    """``messages`` (the request's) checked, as ``[{role, content}, ...]``; BadRequest naming
    'messages' and the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "'messages' must be a non-empty list of {role, content} objects with string "
            "values", "messages",
        )  # fmt: skip
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            continue  # check_messages names it
        for key, value in m.items():
            if key in ("role", "content") or (key in NULL_ONLY and value is None):
                continue
            why = (
                f"is not supported by this server (it accepts only null), got {shown(value)}"
                if key in NULL_ONLY
                else "is not a key of a message; a message has 'role' and 'content'"
            )
            raise BadRequest(f"messages[{j}].{shown(key)} {why}", "messages")
    try:  # the roles and contents fine-tuning takes, so a served model sees no others
        check_messages(messages, "messages", "the request")
    except DataError as e:
        raise BadRequest(str(e), "messages") from None
    for j, m in enumerate(messages):
        check_unicode(m["content"], f"messages[{j}].content", "messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
