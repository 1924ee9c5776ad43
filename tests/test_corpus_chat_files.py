"""A document corpus prepared with an HF chat model's tokenizer (``prepare --input DIR
--tokenizer-from MODEL``) keeps the files that carry its chat template and special tokens
(``tokenizer_files``) beside the shards, as ``prepare --sft`` does; a run trained on it carries
them into its checkpoints. ``transformers`` reads the data directory and the checkpoint as it
reads the source model (``AutoTokenizer``, ``apply_chat_template``)."""

from __future__ import annotations

import json

import pytest
from test_corpus import interrupt_after_shards, make_docs, write
from test_tokenizer_files import CHAT, _chatml_model

from llm_foundry.data import DataError
from llm_foundry.data.batches import file_entry
from llm_foundry.data.documents import prepare_documents
from llm_foundry.data.shard_writer import AlreadyPrepared
from llm_foundry.tokenizer_files import METADATA_FILES, metadata_files

transformers = pytest.importorskip("transformers")

KW = dict(shard_tokens=2000, progress=False)


@pytest.fixture
def chat_model(tmp_path):
    """(an HF ChatML model's directory, its AutoTokenizer)."""
    return tmp_path / "hf", _chatml_model(tmp_path / "hf")


@pytest.fixture
def docs(tmp_path):
    return [write(tmp_path / "a.jsonl", make_docs(200, seed=3), "jsonl")]


def _carried(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in METADATA_FILES if (out / name).exists()}


def test_the_data_directory_keeps_the_models_chat_files_through_a_rerun_and_a_resume(
    tmp_path, chat_model, docs, monkeypatch
):
    hf_dir, hf_tok = chat_model
    source = {name: (hf_dir / name).read_bytes() for name in metadata_files(hf_dir)}
    assert "tokenizer_config.json" in source  # and the template in it or in its own file
    out = tmp_path / "d"
    meta = prepare_documents(out, docs, tokenizer_from=hf_dir, **KW)
    assert _carried(out) == source
    for name in source:  # listed with their digests: the readers check them
        assert meta["files"][name] == file_entry(out / name)
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    for attr in ("chat_template", "eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(back, attr) == getattr(hf_tok, attr), attr

    # the same command again: nothing to do
    with pytest.raises(AlreadyPrepared):
        prepare_documents(out, docs, tokenizer_from=hf_dir, **KW)

    # an interrupted prepare resumes to the same files
    resumed = tmp_path / "r"
    interrupt_after_shards(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        prepare_documents(resumed, docs, tokenizer_from=hf_dir, **KW)
    monkeypatch.undo()
    assert not _carried(resumed)  # published with the shards, at the end
    again = prepare_documents(resumed, docs, tokenizer_from=hf_dir, **KW)
    assert again["timing"]["resumed"] and _carried(resumed) == source
    assert {k: again["files"][k] for k in source} == {k: meta["files"][k] for k in source}

    # a changed template beside the tokenizer is another setting: refused, then --restart
    changed = json.loads(source["tokenizer_config.json"])
    changed["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(changed))
    (hf_dir / "chat_template.jinja").unlink(missing_ok=True)  # the config's template is read
    with pytest.raises(DataError, match=r"settings\.tokenizer_from\.metadata\.") as e:
        prepare_documents(out, docs, tokenizer_from=hf_dir, **KW)
    assert str(e.value).count("\n") == 0
    prepare_documents(out, docs, tokenizer_from=hf_dir, restart=True, **KW)
    assert _carried(out) == {n: (hf_dir / n).read_bytes() for n in metadata_files(hf_dir)}
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert back.chat_template == changed["chat_template"]

    # prepared again with a tokenizer of ours: the HF one's files go
    meta = prepare_documents(out, docs, vocab_size=300, restart=True, **KW)
    assert not _carried(out) and not set(METADATA_FILES) & set(meta["files"])


def test_a_run_trained_on_the_corpus_carries_the_chat_files_into_its_checkpoint(
    tmp_path, chat_model, docs, capsys
):
    from llm_foundry.cli import main
    from llm_foundry.rundir import checkpoint_dir

    hf_dir, hf_tok = chat_model
    data, run = tmp_path / "d", tmp_path / "run"
    argv = ["prepare", "--input", str(docs[0]), "--tokenizer-from", str(hf_dir), "--out", str(data)]
    assert main(argv) == 0, capsys.readouterr().err
    assert main(["finetune", "--checkpoint", str(hf_dir), "--data", str(data), "--out", str(run),
                 "--train.max_steps", "2", "--train.batch_size", "2", "--train.block_size", "32",
                 "--train.eval_interval", "2", "--train.eval_batches", "1",
                 "--train.sample_tokens", "0", "--train.progress", "false"]) == 0  # fmt: skip
    ckpt = checkpoint_dir(run)
    assert _carried(ckpt) == {n: (hf_dir / n).read_bytes() for n in metadata_files(hf_dir)}
    # generate --chat on the run writes the prompt as transformers does, with no note
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(run), "--chat", "--prompt", CHAT[1]["content"]]
    assert main([*argv, "--max-new-tokens", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    want = hf_tok.apply_chat_template(CHAT[1:], add_generation_prompt=True, return_dict=False)
    assert json.loads(out.splitlines()[-1])["prompt_ids"] == list(want)
    assert "no chat template" not in err, err
