"""Chat templates: turn a list of messages into the text a chat model was trained on.

An HF tokenizer directory carries its template as Jinja (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file); it is rendered here with the engine
``transformers`` uses for ``apply_chat_template``: jinja2's immutable sandbox (templates from the
Hub are untrusted code) with ``trim_blocks``/``lstrip_blocks``, loop controls, a ``tojson`` that
keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens
as variables. This project's char and BPE tokenizers use the built-in template of
``llm_foundry.data.sft`` (``ROLE: content`` lines).

``response_spans`` finds which characters of a rendered chat are each assistant reply (render
the conversation up to a reply with the generation prompt, then with the reply: the difference),
so fine-tuning masks everything else out of the loss whatever the template.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
# this project's own chat format (char and BPE tokenizers): one "ROLE: content" line a message;
# ``llm_foundry.data.sft.segments`` writes the same text piece by piece for the loss mask
BUILTIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
CONFIG_FILE = "tokenizer_config.json"


def load_chat_template(directory: str | Path) -> tuple[str | None, dict[str, str]]:
    """(the Jinja chat template, the special tokens as template variables) of an HF tokenizer
    directory; (None, {}) when it has none."""
    directory = Path(directory)
    config = {}
    if (directory / CONFIG_FILE).is_file():
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / TEMPLATE_FILE).is_file():
        template = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    specials = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str):
            specials[key] = value
    return template, specials


def _environment():
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with transformers
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render_chat(
    template: str, messages: list[dict], add_generation_prompt: bool = False, **variables
) -> str:
    """The text of ``messages`` under a Jinja chat ``template``; errors the template raises (or
    an undefined name it needs) become a ValueError naming the problem."""
    import jinja2

    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {type(e).__name__}: {e}") from None


def response_spans(template: str, messages: list[dict], **variables) -> tuple[str, list[tuple]]:
    """(the rendered chat, the (start, end) characters of every assistant reply in it): each
    reply is what rendering it adds to the conversation before it with the generation prompt."""
    text = render_chat(template, messages, **variables)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render_chat(template, messages[:i], add_generation_prompt=True, **variables)
        through = render_chat(template, messages[: i + 1], **variables)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"chat template: message {i} (assistant) cannot be located: the template renders a "
                "conversation differently from its beginning (it cannot be masked per reply)"
            )
        spans.append((len(before), len(through)))
    return text, spans


def end_of_turn(template: str, **variables) -> str:
    """What the template writes after an assistant reply, stripped (e.g. ``<|im_end|>``,
    ``</s>``; a newline for the built-in template): where a generated reply ends."""
    sentinel = "\x00reply\x00"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": sentinel}]
    text = render_chat(template, messages, **variables)
    after = text[text.index(sentinel) + len(sentinel) :]
    return after.strip() or after[:1]
