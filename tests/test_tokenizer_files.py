"""An HF chat model's tokenizer metadata (its chat template, its bos/eos/pad tokens) travels with
the weights through every step: convert --from-hf, prepare --sft, a LoRA fine-tune, then serve,
generate --chat, convert --to-hf and --to-gguf; ``transformers`` is the reference for each
(``apply_chat_template``, ``AutoTokenizer``'s special tokens, the source's own GGUF)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from conftest import tiny_hf_llama

from llm_foundry.cli import main
from llm_foundry.tokenizer_files import METADATA_FILES, open_tokenizer, read_tokenizer_meta

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# ChatML as Qwen writes it: a turn ends with <|im_end|>, which is also the tokenizer's eos
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Answer with the number."},
    {"role": "user", "content": "What is 3 plus one?"},
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_level_bpe(specials=SPECIALS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    texts = ["system user assistant Answer with the number. What is 3 plus one? 4"] * 20
    tok.train_from_iterator(texts, trainer)
    return tok


def _chatml_model(directory):
    """A random Llama with a ChatML tokenizer (eos <|im_end|>, pad <|endoftext|>, no bos) saved
    by transformers in ``directory``; returns its AutoTokenizer."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(), eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )  # fmt: skip
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    ids = dict(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None)
    tiny_hf_llama(vocab_size=len(fast), **ids).save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _gguf_chat_fields(path) -> tuple:
    """(bos, eos, padding id, chat template) a GGUF file names."""
    gguf = pytest.importorskip("gguf")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    ids = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")]
    return (*ids, fields.get("tokenizer.chat_template"))


@pytest.mark.heavy
def test_an_hf_chat_model_keeps_its_template_and_specials_through_a_fine_tune(tmp_path, capsys):
    from llm_foundry.loading import load_any
    from llm_foundry.serve import load_served
    from llm_foundry.serve.app import _prompt_ids

    hf_dir, base, sft, run = (tmp_path / n for n in ("hf", "base", "sft", "run"))
    hf_tok = _chatml_model(hf_dir)
    rows = [{"messages": [*CHAT, {"role": "assistant", "content": str(i)}]} for i in range(12)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _cli(capsys, "convert", "--from-hf", str(hf_dir), "--out", str(base))
    _cli(capsys, "prepare", "--sft", str(tmp_path / "rows.jsonl"), "--tokenizer-from", str(base),
         "--out", str(sft))  # fmt: skip
    _cli(capsys, "finetune", "--checkpoint", str(base), "--data", str(sft), "--out", str(run),
         "--train.lora_r", "4", "--train.max_steps", "3", "--train.batch_size", "2",
         "--train.eval_interval", "3", "--train.eval_batches", "1", "--train.sample_tokens", "8",
         "--train.progress", "false")  # fmt: skip
    want = list(hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    eos = hf_tok.eos_token_id
    for model in (base, run):
        # generate --chat and the server both write the conversation in the model's template
        argv = ["generate", "--checkpoint", str(model), "--chat", "--prompt", CHAT[1]["content"]]
        rec = json.loads(_cli(capsys, *argv, "--max-new-tokens", "2", "--json").splitlines()[-1])
        assert rec["prompt_ids"] == list(hf_tok.apply_chat_template(
            CHAT[1:], add_generation_prompt=True, return_dict=False))  # fmt: skip
        served = load_served(model, slots=1)
        assert _prompt_ids(served, {"messages": CHAT}, chat=True) == want
        assert served.chat_stop == () and eos in served.engine.eos_ids
        # a plain completion stops at the tokenizer's eos too
        assert load_any(model).info.eos_ids == {eos}

    # convert --to-hf: AutoTokenizer and the config name the source's specials and template
    _cli(capsys, "convert", "--to-hf", str(run), "--out", str(tmp_path / "hf-run"))
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf-run"))
    for attr in ("eos_token", "eos_token_id", "pad_token_id", "bos_token_id", "chat_template"):
        assert getattr(back, attr) == getattr(hf_tok, attr), attr
    assert back.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False) == want
    source, config = (json.loads((d / "config.json").read_text()) for d in (hf_dir, tmp_path / "hf-run"))  # fmt: skip
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == source[key], key
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-run"))
    assert model.generation_config.eos_token_id == eos

    # the GGUF of the run names the eos, padding and template of the source's own GGUF
    pytest.importorskip("gguf")
    for src, out in ((hf_dir, "hf.gguf"), (run, "run.gguf")):
        _cli(capsys, "convert", "--to-gguf", str(src), "--out", str(tmp_path / out))
    source_gguf = _gguf_chat_fields(tmp_path / "hf.gguf")
    assert source_gguf[1:] == (eos, hf_tok.pad_token_id, CHATML)
    assert _gguf_chat_fields(tmp_path / "run.gguf") == source_gguf


def test_dpo_rows_and_their_directory_carry_the_template(tmp_path):
    """Preference rows of chats are written in the model's template (transformers' ids for the
    prompt and the chosen reply) and the prepared directory keeps the tokenizer's files."""
    from llm_foundry.data.batches import load_meta
    from llm_foundry.data.preference import prepare_preference
    from llm_foundry.export import convert_from_hf

    hf_tok = _chatml_model(tmp_path / "hf")
    base = convert_from_hf(tmp_path / "hf", tmp_path / "base")
    row = {"prompt": CHAT, "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    prepare_preference(tmp_path / "dpo", tmp_path / "pairs.jsonl", base / "tokenizer.json", 0.5)
    meta = load_meta(tmp_path / "dpo")
    ids = np.fromfile(tmp_path / "dpo" / "train.bin", dtype=meta["dtype"]).tolist()
    chosen = hf_tok.apply_chat_template([*CHAT, *row["chosen"]], return_dict=False)
    assert ids[: len(chosen)] == list(chosen)
    carried = sorted(f.name for f in (tmp_path / "dpo").iterdir() if f.name in METADATA_FILES)
    assert carried == sorted(n for n in METADATA_FILES if (base / n).is_file())
    assert set(carried) <= set(meta["files"])


def test_the_reader_agrees_with_autotokenizer_on_older_layouts(tmp_path):
    """A template inside tokenizer_config.json, the special tokens in special_tokens_map.json,
    and a generation_config.json listing two end ids: read as transformers reads them."""
    tok = _byte_level_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML}))  # fmt: skip
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours, meta = open_tokenizer(tmp_path / "tokenizer.json")
    assert meta.template == hf.chat_template
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (hf.eos_token_id, hf.pad_token_id, None)
    assert meta.eos_ids == {hf.eos_token_id, 0}
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path)).eos_token_id == [2, 0]


def test_a_prepared_directory_drops_an_earlier_tokenizers_files(tmp_path):
    """prepare --sft into a directory prepared before with an HF chat tokenizer, now with one of
    ours: the ChatML template and special tokens go, so no checkpoint trained on it chats in
    them."""
    from llm_foundry.data.sft import SFTSampler, prepare_sft
    from llm_foundry.tokenizer import BPETokenizer

    _chatml_model(tmp_path / "hf")
    rows = [{"prompt": "What is 3 plus one?", "completion": " 4"}] * 4
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_sft(tmp_path / "sft", tmp_path / "rows.jsonl", tmp_path / "hf" / "tokenizer.json")
    assert (tmp_path / "sft" / "chat_template.jinja").is_file()
    ours = BPETokenizer.train("What is 3 plus one? 4 " * 20, 300)
    ours.save(tmp_path / "tokenizer.json")
    meta = prepare_sft(tmp_path / "sft", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json",
                       restart=True)  # fmt: skip
    assert not [n for n in METADATA_FILES if (tmp_path / "sft" / n).exists()]
    assert not set(METADATA_FILES) & set(meta["files"])
    SFTSampler(tmp_path / "sft", "train", block_size=16, batch_size=2).next()


def test_an_hf_tokenizer_without_a_template_is_said_once_not_silently_replaced(
    tmp_path, caplog, capsys
):
    """No chat template beside an HF tokenizer: serve, generate --chat (and the GGUF export)
    take the built-in one and say so in one line; convert --to-hf says what the export lacks."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, render_chat
    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.export import convert_to_hf
    from llm_foundry.interop.hf import from_hf
    from llm_foundry.serve import load_served

    _chatml_model(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    save_checkpoint(from_hf(tmp_path / "hf"), ckpt)
    (ckpt / "tokenizer.json").write_bytes((tmp_path / "hf" / "tokenizer.json").read_bytes())
    with caplog.at_level(logging.WARNING, logger="llm_foundry"):
        served = load_served(ckpt, slots=1)
    assert served.template == BUILTIN_TEMPLATE
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and f"note: {ckpt} has no chat template" in notes[0], notes
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm_foundry"):
        convert_to_hf(ckpt, tmp_path / "out")
    (note,) = [r.getMessage() for r in caplog.records]
    assert note.startswith(f"note: {ckpt} names no eos token") and "no chat template" in note
    assert read_tokenizer_meta(tmp_path / "out").ids == {}

    # generate --chat (last: the command routes the library's log to the console, not caplog):
    # the same note on stderr, then the prompt in the built-in template
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(ckpt), "--chat", "--prompt", CHAT[1]["content"]]
    assert main([*argv, "--max-new-tokens", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if "chat template" in line] == [notes[0]], err
    prompt = render_chat(BUILTIN_TEMPLATE, CHAT[1:2], add_generation_prompt=True)
    assert json.loads(out)["prompt"] == prompt


@pytest.mark.parametrize("end", ["<|end|>", "###", "\n"])
def test_a_turn_ends_on_an_id_only_where_transformers_sees_a_special_token(tmp_path, end):
    """A template whose turn ends with a special token stops on its id; one ending with ordinary
    text that is one vocabulary entry all the same ("###", "\\n") keeps it a stop string (it
    took that entry's id before, so a reply spelling it in other pieces ran on)."""
    from tokenizers import Tokenizer, models

    from llm_foundry.tokenizer_files import chat_format

    words = ["<unk>", "<|end|>", "###", "\n", "user", "assistant", ":", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.add_special_tokens(["<|end|>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + end + "\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    specials = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert hf.convert_tokens_to_ids(end) == words.index(end)  # each is one vocabulary entry

    chat = chat_format(tmp_path, open_tokenizer(tmp_path / "tokenizer.json")[0])
    assert (chat.end, chat.end_id) == (end, specials.get(end))
    assert (chat.end_id is None) == (end != "<|end|>")  # the three cases are not all alike
