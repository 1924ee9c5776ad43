"""A checkpoint's chat template is untrusted code: renderings that loop or grow without bound are
stopped with one line naming the template's file, and a tokenizer_config.json that is not what
it should be is named in one line too (jinja2 only; no transformers needed)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jinja2")

from llm_foundry.chat import end_of_turn, load_chat_template, render_chat, response_spans  # noqa: E402

MESSAGES = [{"role": "user", "content": "Who speaks next?"}, {"role": "assistant", "content": "X"}]
LONG = [{"role": "user", "content": "ab" * 2500}]  # 5,000 characters


def _config_dir(tmp_path, config) -> tuple:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path, tmp_path / "tokenizer_config.json"


@pytest.mark.parametrize(
    "template, messages, stopped",
    [
        ("{% for i in range(10**9) %}x{% endfor %}", MESSAGES, "range() of 1,000,000,000 items"),
        (  # 10^8 turns of an empty loop: nothing is output, nothing is called
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
            MESSAGES,
            "stopped after 2,000,000 steps",
        ),
        (  # no range at all: 25 million turns over a message's characters
            "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}"
            "{% endfor %}{% endfor %}{% endfor %}",
            LONG,
            "stopped after 2,000,000 steps",
        ),
        (  # 10 MB of output from a short loop
            "{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}",
            MESSAGES,
            "characters of output",
        ),
        (  # a text doubled 40 times
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
            "{% endfor %}{{ ns.s | length }}",
            MESSAGES,
            "the length of a value",
        ),
        ("{{ 'x' * 10**10 }}", MESSAGES, "the length of a repeated text or list: 10,000,000,000"),
        ("{{ 7 ** 100000000 }}", MESSAGES, "the digits of a power"),
        ("{{ 'x' | center(10**9) }}", MESSAGES, "a number passed to the filter 'center'"),
        ("{{ 'x'.ljust(10**9) }}", MESSAGES, "a number passed to ljust"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", MESSAGES, "RecursionError"),
    ],
)
def test_templates_that_loop_or_grow_without_bound_are_stopped_in_one_line(
    tmp_path, template, messages, stopped
):
    directory, config = _config_dir(tmp_path, {"chat_template": template, "eos_token": "</s>"})
    loaded, specials = load_chat_template(directory)
    with pytest.raises(ValueError) as e:
        render_chat(loaded, messages, add_generation_prompt=True, **specials)
    message = str(e.value)
    assert message.startswith(f"chat template {config} (chat_template): ")
    assert stopped in message and "\n" not in message


def test_the_limits_leave_ordinary_renderings_alone(tmp_path):
    """A long conversation renders whole (its size raises the output limit), and the same
    rendering without the limits' bookkeeping gives the same text."""
    import jinja2.sandbox

    from llm_foundry.chat import ChatTemplate

    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index0 % 2 == 0 %}[INST] "
        "{{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}{% for i in range(3) %}.{% endfor %}"
    )
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "w" * 50_000}
        for i in range(200)
    ]  # 10 MB of text: past the fixed part of the output limit
    ours = render_chat(ChatTemplate(template, "x"), turns, bos_token="<s>", eos_token="</s>")
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    theirs = plain.from_string(template).render(messages=turns, bos_token="<s>", eos_token="</s>")
    assert ours == theirs and len(ours) > 10_000_000


def test_errors_of_spans_and_turn_ends_name_the_template_file(tmp_path):
    directory, config = _config_dir(tmp_path, {"chat_template": "{{ 'fixed text' }}"})
    template, _ = load_chat_template(directory)
    with pytest.raises(
        ValueError, match=rf"^chat template {config} \(chat_template\): an assistant"
    ):
        end_of_turn(template)
    varying = "{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": varying}))
    template, _ = load_chat_template(directory)
    with pytest.raises(ValueError, match=rf"^chat template {config} \(chat_template\): message 1"):
        response_spans(template, MESSAGES)


def test_a_template_file_is_named_too(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{% for i in range(10**9) %}{% endfor %}")
    template, _ = load_chat_template(tmp_path)
    with pytest.raises(ValueError, match=rf"^chat template {tmp_path / 'chat_template.jinja'}: "):
        render_chat(template, MESSAGES)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "holds a list, not a JSON object of tokenizer settings"),
        ('"<s>"', "holds a string, not a JSON object of tokenizer settings"),
        ("7", "holds a number (7), not a JSON object"),
        ("{oops", "is not valid JSON (Expecting property name"),
        ('{"chat_template": 5}', "chat_template is 5; expected the Jinja template as a string"),
        (
            '{"chat_template": [{"name": "tool_use", "template": "x"}]}',
            "chat_template is a list of named templates without a 'default' one",
        ),
    ],
)
def test_a_tokenizer_config_that_is_not_what_it_should_be_is_one_line(tmp_path, text, message):
    (tmp_path / "tokenizer_config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        load_chat_template(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tokenizer_config.json'}")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_prepare_sft_names_a_bad_tokenizer_config_in_one_line(tmp_path, capsys):
    """Through the command: an HF tokenizer.json whose tokenizer_config.json is a list."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llm_foundry.cli import main

    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "b", "</s>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('[{"eos_token": "</s>"}]')
    rows = [{"prompt": "a", "completion": "b"}] * 4
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["prepare", "--sft", str(tmp_path / "rows.jsonl"), "--tokenizer-from"]
    argv += [str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{tmp_path / 'tokenizer_config.json'} holds a list, not a JSON object" in err
    assert not (tmp_path / "out").exists()
