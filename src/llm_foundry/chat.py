"""Chat templates: turn a list of messages into the text a chat model was trained on.

An HF tokenizer directory carries its template as Jinja (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` file); it is rendered here with the engine
``transformers`` uses for ``apply_chat_template``: jinja2's immutable sandbox (templates from the
Hub are untrusted code) with ``trim_blocks``/``lstrip_blocks``, loop controls, a ``tojson`` that
keeps non-ASCII text, ``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens
as variables. This project's char and BPE tokenizers use the built-in template of
``llm_foundry.data.sft`` (``ROLE: content`` lines). ``tokenizer_files.chat_format`` picks a
model's template and its end of turn for serve and the GGUF export, from the files that travel
beside its tokenizer.json; an HF tokenizer without a template gets the built-in one with a
note, never silently.

``response_spans`` finds which characters of a rendered chat are each assistant reply (render
the conversation up to a reply with the generation prompt, then with the reply: the difference),
so fine-tuning masks everything else out of the loss whatever the template.

A template comes with the checkpoint, so it is untrusted: besides the sandbox, a rendering is
stopped (a one-line ValueError naming the template's file) past ``MAX_STEPS`` lines of template
code run (loops inside loops), ``MAX_SECONDS``, a ``range`` of more than ``MAX_RANGE`` items, or
a text, list or number past ``MAX_OUTPUT`` (characters of output, of a ``+``, ``*`` or ``**``,
a width or count given to a function); ``MAX_OUTPUT`` grows with the messages rendered.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from llm_foundry.messages import one_line, shown
from llm_foundry.tokenizer import json_type

TEMPLATE_FILE = "chat_template.jinja"
# this project's own chat format (char and BPE tokenizers): one "ROLE: content" line a message;
# ``llm_foundry.data.sft.segments`` writes the same text piece by piece for the loss mask
BUILTIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
CONFIG_FILE = "tokenizer_config.json"

MAX_STEPS = 2_000_000  # lines of template code run in one rendering
MAX_SECONDS = 10.0  # wall-clock time of one rendering
MAX_RANGE = 10_000  # items of one range()
MAX_OUTPUT = 4 << 20  # characters, plus twice those of the messages and variables rendered


class ChatTemplate(str):
    """A template's text that knows where it was read from (``origin``), for error messages."""

    origin: str = ""

    def __new__(cls, text: str, origin: str = "") -> ChatTemplate:
        template = super().__new__(cls, text)
        template.origin = origin
        return template


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
        ) from None


def load_chat_template(directory: str | Path) -> tuple[str | None, dict[str, str]]:
    """(the Jinja chat template, the special tokens as template variables) of an HF tokenizer
    directory; (None, {}) when it has none. The template is a ``ChatTemplate`` naming its file.
    A config that is not a JSON object, or a template that is not text, is a one-line error."""
    directory = Path(directory)
    config, path = tokenizer_config(directory), directory / CONFIG_FILE
    template = config.get("chat_template")
    origin = f"{path} (chat_template)"
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(
                f"{path}: chat_template is a list of named templates without a 'default' one "
                f"(names: {shown(sorted(map(str, named)))}); name one 'default'"
            )
        template, origin = named["default"], f"{path} (chat_template 'default')"
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{path}: chat_template is {shown(template)}; expected the Jinja template as a string"
        )
    if template is None and (directory / TEMPLATE_FILE).is_file():
        template, origin = _read_text(directory / TEMPLATE_FILE), str(directory / TEMPLATE_FILE)
    if template is not None:
        template = ChatTemplate(template, origin)
    return template, special_tokens(config)


def tokenizer_config(directory: str | Path) -> dict:
    """An HF tokenizer directory's tokenizer_config.json ({} when it has none); a file that is
    not a JSON object is a one-line error naming it."""
    return json_object(Path(directory) / CONFIG_FILE, "tokenizer settings")


def json_object(path: str | Path, what: str = "settings") -> dict:
    """The JSON object in ``path`` ({} when there is no such file); a file that is not one is a
    one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {json_type(config)}, not a JSON object of {what}")
    return config


def special_tokens(config: dict) -> dict[str, str]:
    """The special tokens a tokenizer config names (bos_token, ...: their text), as a chat
    template's variables."""
    specials = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out
            value = value.get("content")
        if isinstance(value, str):
            specials[key] = value
    return specials


class _Stop(Exception):
    """A rendering that went past one of the limits."""


class _Budget:
    """What one rendering may spend; ``step`` is called on every line of template code run."""

    def __init__(self, output: int):
        self.steps = 0
        self.output = output
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Stop(
                f"stopped after {MAX_STEPS:,} steps: it loops far too long (or without end)"
            )
        if not self.steps % 1024 and time.monotonic() > self.deadline:
            raise _Stop(f"stopped after {MAX_SECONDS:g} s: it runs far too long")

    def size(self, n: int, what: str) -> None:
        if n > self.output:
            raise _Stop(f"{what}: {n:,}, past the limit of {self.output:,}")


def _size_of(value) -> int:
    """How large a value a template made is: characters or items, or an integer's magnitude."""
    if isinstance(value, (str, list, tuple, dict)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value)
    return 0


def _environment(budget: _Budget | None = None):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with transformers
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    budget = budget or _Budget(MAX_OUTPUT)

    def check_args(what, args, kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                budget.size(abs(value), f"a number passed to {what}")

    def bounded_range(*args):
        items = range(*args)
        n = (items.stop - items.start) // items.step  # len() fails past sys.maxsize
        if n > MAX_RANGE:
            raise _Stop(f"range() of {n:,} items is past the limit of {MAX_RANGE:,}")
        return items

    class Limited(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(left, int) and isinstance(right, int):
                # about bits(left) * right bits: refused before it is computed
                budget.size(
                    abs(left).bit_length() * max(right, 0) // 4, "the digits of a power (about)"
                )
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(b, int) and _size_of(a) and not isinstance(a, int):
                        budget.size(
                            _size_of(a) * max(b, 0), "the length of a repeated text or list"
                        )
            result = super().call_binop(context, operator, left, right)
            if not isinstance(result, int):
                budget.size(_size_of(result), "the length of a value")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            name = getattr(__obj, "__name__", "a function")
            if __obj is not bounded_range:  # which says more itself
                check_args(name, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            if isinstance(result, (str, list, tuple)):
                budget.size(len(result), f"the length of what {name} returns")
            return result

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = Limited(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson

    def guarded(name, f):
        @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
        def run(*args, **kwargs):
            check_args(f"the filter {name!r}", args[1:], kwargs)
            result = f(*args, **kwargs)
            if isinstance(result, (str, list, tuple)):
                budget.size(len(result), f"the length of what the filter {name!r} returns")
            return result

        return run

    env.filters = {name: guarded(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = bounded_range
    return env


def _traced(budget: _Budget):
    """A trace function (``sys.settrace``) that spends a step of ``budget`` on every line of
    template code; other frames go to the tracer that was there before (a debugger, coverage)."""
    previous = sys.gettrace()

    def local(frame, event, arg):
        if event == "line":
            budget.step()
        return local

    def trace(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            budget.step()
            return local
        return previous(frame, event, arg) if previous is not None else None

    return trace, previous


def _chars(value) -> int:
    """Characters of text in the messages and variables given to a template."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(k) + _chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0


def render_chat(
    template: str, messages: list[dict], add_generation_prompt: bool = False, **variables
) -> str:
    """The text of ``messages`` under a Jinja chat ``template``; errors the template raises (or
    an undefined name it needs), and renderings past the limits, become a one-line ValueError
    naming the template (its file, for a ``ChatTemplate``) and the problem."""
    origin = getattr(template, "origin", "")
    where = f"chat template {origin}" if origin else "chat template"
    budget = _Budget(MAX_OUTPUT + 2 * (_chars(messages) + _chars(variables)))
    trace, previous = _traced(budget)
    sys.settrace(trace)
    try:
        compiled = _environment(budget).from_string(str(template))
        pieces, n = [], 0
        for piece in compiled.generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        ):
            n += len(piece)
            budget.size(n, "characters of output")
            pieces.append(piece)
        return "".join(pieces)
    except _Stop as e:
        raise ValueError(f"{where}: {e}") from None
    except (RecursionError, MemoryError) as e:
        raise ValueError(
            f"{where}: stopped: {type(e).__name__} (it nests or grows without bound)"
        ) from None
    except Exception as e:  # noqa: BLE001 - whatever the template's code raises is named
        raise ValueError(f"{where}: {type(e).__name__}: {one_line(e)}") from None
    finally:
        sys.settrace(previous)


def response_spans(template: str, messages: list[dict], **variables) -> tuple[str, list[tuple]]:
    """(the rendered chat, the (start, end) characters of every assistant reply in it): each
    reply is what rendering it adds to the conversation before it with the generation prompt."""
    text = render_chat(template, messages, **variables)
    origin = getattr(template, "origin", "")
    where = f"chat template {origin}" if origin else "chat template"
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render_chat(template, messages[:i], add_generation_prompt=True, **variables)
        through = render_chat(template, messages[: i + 1], **variables)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"{where}: message {i} (assistant) cannot be located: the template renders a "
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
    if sentinel not in text:
        origin = getattr(template, "origin", "")
        raise ValueError(
            f"chat template{' ' + origin if origin else ''}: an assistant reply does not appear in "
            "what it renders, so the end of a turn cannot be found"
        )
    after = text[text.index(sentinel) + len(sentinel) :]
    return after.strip() or after[:1]
