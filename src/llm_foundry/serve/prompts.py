"""A request's prompt: its token ids, or its text (a chat's rendered in the model's template)
checked and encoded. A text too long for the context whatever it encodes to is refused from its
length before it is encoded (``prompt_size``)."""

from __future__ import annotations

from llm_foundry.serve.chat_messages import chat_messages
from llm_foundry.serve.fields import BadRequest, as_json, check_unicode
from llm_foundry.serve.prompt_size import min_tokens


def prompt_ids(served, body: dict, chat: bool) -> list[int]:
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
        return _encode(served.tokenizer, prompt, chat)
    except ValueError as e:
        what, param = ("the chat, written in its template,", "messages") if chat else (
            "the prompt", "prompt")  # fmt: skip
        raise BadRequest(f"{what} cannot be encoded: {e}", param) from None


def _encode(tok, text: str, chat: bool) -> list[int]:
    """``text``'s ids as ``generate`` encodes it: a prompt with the special tokens an HF
    tokenizer.json adds (a Llama one's BOS; ours add none), a rendered chat with none (its
    template writes them); a Hugging Face tokenizer's through encode_batch, which lets go of the
    GIL while it works (its encode holds it: the server would stall)."""
    hf = getattr(tok, "hf", None)
    if hf is None:
        return tok.encode(text)
    adds = not chat and getattr(tok, "kind", "") == "hf"
    return hf.encode_batch([text], add_special_tokens=adds)[0].ids


def _prompt_text(served, body: dict, chat: bool) -> str | list[int]:
    """The request's prompt: a text (a chat's rendered in its template) or token ids."""
    if chat:
        from llm_foundry.chat import render_chat

        messages = chat_messages(body.get("messages"))
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
                    f"'prompt' token ids must be in [0, {vocab}), got {as_json(bad)}", "prompt"
                )
            return list(text)
        if not isinstance(text, str) or not text:
            raise BadRequest(
                "'prompt' must be a non-empty string (or one list of token ids)", "prompt"
            )
        check_unicode(text, "'prompt'", "prompt")
    return text
