"""Chat templates: an HF tokenizer's Jinja template renders, and tokenizes, exactly as
``transformers``' ``apply_chat_template``; replies are located for masking; bad templates are
one-line errors."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from conftest import tiny_hf_llama  # noqa: E402

from llm_foundry.chat import load_chat_template, render_chat, response_spans  # noqa: E402
from llm_foundry.tokenizer import load_any_tokenizer  # noqa: E402

# ChatML (Qwen style) with a default system prompt, and a Llama-2 style one that raises on a
# misplaced role: written here, as the Hub's tokenizer_config.json files hold them
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "Who speaks next, après Roméo?"},
    {"role": "assistant", "content": "JULIET"},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": 'The Nurse, "within".'},
]


def _with_random_llama(directory):
    """Save a tiny random Llama beside the tokenizer in ``directory``; returns the tokenizer."""

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    sizes = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    tiny_hf_llama(vocab_size=len(hf_tok), **sizes).save_pretrained(str(directory))
    return hf_tok


def _hf_tokenizer_dir(tmp_path, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(
        [m["content"] for m in MESSAGES] * 20 + ["system assistant user"], trainer
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("template", [CHATML, LLAMA2], ids=["chatml", "llama2"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_and_ids_equal_apply_chat_template(tmp_path, template, generation_prompt):
    directory = _hf_tokenizer_dir(tmp_path, template)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = MESSAGES[:3] if generation_prompt else MESSAGES
    loaded, specials = load_chat_template(directory)
    assert loaded == template and specials["eos_token"] == "</s>"
    ours = render_chat(loaded, messages, add_generation_prompt=generation_prompt, **specials)
    theirs = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours == theirs
    ids = load_any_tokenizer(directory / "tokenizer.json").encode(ours, add_special_tokens=False)
    want = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    assert ids == list(want)


def test_replies_are_located_in_the_rendered_text():
    text, spans = response_spans(CHATML, MESSAGES)
    assert [text[a:b] for a, b in spans] == [
        "JULIET<|im_end|>\n",
        'The Nurse, "within".<|im_end|>\n',
    ]
    text, spans = response_spans(LLAMA2, MESSAGES, bos_token="<s>", eos_token="</s>")
    assert [text[a:b] for a, b in spans] == [" JULIET </s>", ' The Nurse, "within". </s>']


def test_template_errors_are_one_line():
    with pytest.raises(ValueError, match="chat template: TemplateError: Conversation roles must"):
        render_chat(LLAMA2, [MESSAGES[1]], bos_token="<s>", eos_token="</s>")
    with pytest.raises(ValueError, match="chat template: TemplateSyntaxError"):
        render_chat("{% for m in messages %}", MESSAGES)
    # a name the template needs but nobody passes: named (a bare {{ x }} renders empty, as in HF)
    with pytest.raises(ValueError, match="chat template: UndefinedError: 'system' is undefined"):
        render_chat(
            "{{ system.content }}{% for m in messages %}{{ m.content }}{% endfor %}", MESSAGES
        )
    # templates are sandboxed: no reaching into Python internals
    with pytest.raises(ValueError, match="chat template: SecurityError"):
        render_chat("{{ messages.__class__.__mro__ }}", MESSAGES)


def test_sft_rows_under_an_hf_template_mask_exactly_the_replies(tmp_path):
    import json

    from llm_foundry.data.sft import SFTSampler, prepare_sft

    directory = _hf_tokenizer_dir(tmp_path / "tok", CHATML)
    rows = [{"messages": MESSAGES}, {"prompt": "Who speaks next?", "completion": "JULIET"}] * 3
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare_sft(tmp_path / "sft", tmp_path / "rows.jsonl", directory / "tokenizer.json", 0.3)
    assert meta["train_examples"] == 4
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    sampler = SFTSampler(tmp_path / "sft", "train", block_size=128, batch_size=8, seed=0)
    _, y = sampler.next()
    seen = {hf.decode([t for t in row if t != -100]) for row in y.tolist()}
    # chat rows: both replies with their end-of-turn markers; prompt/completion rows: the
    # completion and the tokenizer's end of sequence
    chat = 'JULIET<|im_end|>\nThe Nurse, "within".<|im_end|>\n'
    assert seen == {chat, "JULIET</s>"}


def test_the_builtin_template_is_the_fine_tuning_format_and_each_template_ends_its_turn():
    from llm_foundry.chat import BUILTIN_TEMPLATE, end_of_turn
    from llm_foundry.data.sft import segments

    chat = [{"role": "system", "content": "be brief"}, *MESSAGES]
    assert render_chat(BUILTIN_TEMPLATE, chat) == "".join(
        t for t, _ in segments({"messages": chat})
    )
    assert end_of_turn(CHATML) == "<|im_end|>"
    assert end_of_turn(LLAMA2, bos_token="<s>", eos_token="</s>") == "</s>"
    assert end_of_turn(BUILTIN_TEMPLATE) == "\n"


def test_generate_chat_prompts_an_hf_model_through_its_template(tmp_path, capsys):
    import json

    from llm_foundry.cli import main

    directory = _hf_tokenizer_dir(tmp_path, CHATML)
    hf_tok = _with_random_llama(directory)
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(directory), "--chat", "--prompt", "Who speaks next?"]
    assert main([*argv, "--max-new-tokens", "4", "--temperature", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "no chat template" not in err, err  # its own template: no note of a stand-in
    rec = json.loads(out)
    want = hf_tok.apply_chat_template(
        [{"role": "user", "content": "Who speaks next?"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    assert rec["prompt_ids"] == list(want)


def test_a_template_that_would_hang_stops_generate_chat_and_serve_in_one_line(tmp_path, capsys):
    """A checkpoint whose chat template loops 10^9 times: `generate --chat` and the server's
    start end with one line naming the template's file instead of hanging."""

    from llm_foundry.cli import main
    from llm_foundry.serve import load_served

    directory = _hf_tokenizer_dir(tmp_path, "{% for i in range(10**9) %}{% endfor %}" + CHATML)
    _with_random_llama(directory)
    # transformers writes the template into tokenizer_config.json or chat_template.jinja
    file = next(
        f for f in ("chat_template.jinja", "tokenizer_config.json") if (directory / f).is_file()
    )
    origin = load_chat_template(directory)[0].origin
    assert origin.startswith(str(directory / file))
    where = f"chat template {origin}: range() of 1,000,000,000 items is past the limit"
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(directory), "--chat", "--prompt", "Who speaks next?"]
    assert main([*argv, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err, err
    with pytest.raises(ValueError, match=r"^" + where.replace("(", r"\(").replace(")", r"\)")):
        load_served(directory)
