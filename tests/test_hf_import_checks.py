"""HF directories as people have them, not as ``save_pretrained`` writes them fresh: checked
against what transformers itself loads from the same files (which weights, which head, which
special ids), and against one-line refusals naming the file where nothing can be loaded.

Each model is a tiny random LLaMA (``conftest.tiny_hf_llama``) saved with ``save_pretrained``,
its weights scaled so that logits are far from 0 and a wrong tensor shows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import cli_status, tiny_hf_llama
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from llm_foundry.checkpoint import load_checkpoint  # noqa: E402
from llm_foundry.export import convert_from_hf, convert_to_hf  # noqa: E402
from llm_foundry.interop.hf import ConversionError, from_hf  # noqa: E402
from llm_foundry.loading import load_any  # noqa: E402

TOL = 1e-4


def _saved(path, seed: int = 0, **fields):
    """A tiny HF Llama of ``fields``, weights x4, saved at ``path``; returns the model."""
    model = tiny_hf_llama(seed, **fields)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(path))
    return model


def _edit(file, **fields) -> None:
    config = json.loads(file.read_text())
    config.update(fields)
    file.write_text(json.dumps(config))


def _ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 61, (2, n), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _diff(ours, theirs, x) -> float:
    return (ours(x)[0] - theirs(x).logits).abs().max().item()


def _transformers(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()


# ----------------------------------------------------------------------------------------------
# Which weights: the ones transformers loads


def test_a_tied_config_with_its_own_stored_head_loads_untied_as_transformers_does(tmp_path, notes):
    """config.json says tie_word_embeddings but the file stores an lm_head.weight of its own:
    transformers 5 keeps both (untied); so do we, with a note, and the export says untied."""
    _saved(tmp_path / "hf", tie_word_embeddings=False)
    _edit(tmp_path / "hf" / "config.json", tie_word_embeddings=True)
    hf = _transformers(tmp_path / "hf")
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # transformers unties
    x = _ids()
    ours = from_hf(tmp_path / "hf")
    assert not ours.cfg.tie_embeddings
    diff = _diff(ours, hf, x)
    assert any("loaded untied, as transformers loads it" in n for n in notes)
    convert_from_hf(tmp_path / "hf", tmp_path / "ck")
    converted = _diff(load_checkpoint(tmp_path / "ck"), hf, x)
    convert_to_hf(tmp_path / "ck", tmp_path / "rt")
    back = json.loads((tmp_path / "rt" / "config.json").read_text())
    assert back["tie_word_embeddings"] is False
    round_trip = (_transformers(tmp_path / "rt")(x).logits - hf(x).logits).abs().max().item()
    print(f"max |logit diff| vs transformers: {diff:.2e} (from_hf), {converted:.2e} (converted), "
          f"{round_trip:.2e} (round trip)")  # fmt: skip
    assert max(diff, converted, round_trip) <= TOL
    with torch.no_grad():  # tied as the config says, the head would be the embedding: far apart
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    assert _diff(ours, hf, x) > 1.0


def test_a_tied_config_storing_its_head_alone_ties_the_embedding_to_it(tmp_path):
    """Only lm_head.weight stored, the config tied: transformers ties the embedding to the head
    it has (from_pretrained's tie is symmetric); so do we."""
    _saved(tmp_path / "hf", tie_word_embeddings=False)
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    _edit(tmp_path / "hf" / "config.json", tie_word_embeddings=True)
    hf = _transformers(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.tie_embeddings
    diff = _diff(ours, hf, _ids())
    print(f"max |logit diff| vs transformers: {diff:.2e}")
    assert diff <= TOL


def test_a_single_weights_file_wins_over_a_shard_index_as_in_transformers(tmp_path, notes):
    """A model re-saved unsharded over an older sharded save: transformers reads
    model.safetensors and leaves the index; so do we (with a note), not the shards."""
    old = tiny_hf_llama(1)
    old.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    _saved(tmp_path / "new", seed=2)
    shutil.copyfile(tmp_path / "new" / "model.safetensors", tmp_path / "hf" / "model.safetensors")
    hf = _transformers(tmp_path / "hf")
    x = _ids()
    assert _diff(from_hf(tmp_path / "new"), hf, x) <= TOL  # transformers read the new weights
    diff = _diff(load_any(tmp_path / "hf").model, hf, x)
    print(f"max |logit diff| vs transformers: {diff:.2e}")
    assert diff <= TOL
    assert any("model.safetensors read, as transformers reads it" in n for n in notes)


# ----------------------------------------------------------------------------------------------
# What travels with the weights


def test_the_model_s_special_ids_travel_without_a_tokenizer(tmp_path, notes):
    """No tokenizer.json: the eos of generation_config.json still ends generation after
    convert, and --to-hf writes it into config.json, as transformers' generate reads it; a
    tokenizer file left behind (tokenizer.model) is named in a note."""
    _saved(tmp_path / "hf", eos_token_id=7, bos_token_id=1)
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"sentencepiece model")
    theirs = transformers.GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert theirs.eos_token_id == 7
    convert_from_hf(tmp_path / "hf", tmp_path / "ck")
    assert load_any(tmp_path / "ck").info.eos_ids == {theirs.eos_token_id}
    assert any("tokenizer.model left behind" in n and "save_pretrained" in n for n in notes)
    convert_to_hf(tmp_path / "ck", tmp_path / "rt")
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "rt"))
    again = transformers.GenerationConfig.from_pretrained(str(tmp_path / "rt"))
    assert (back.eos_token_id, back.bos_token_id) == (7, 1)
    assert again.eos_token_id == theirs.eos_token_id


def test_bf16_weights_widened_to_fp32_are_said_with_the_sizes(tmp_path, notes):
    model = _saved(tmp_path / "hf32")
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    convert_from_hf(tmp_path / "hf", tmp_path / "ck")
    before = (tmp_path / "hf" / "model.safetensors").stat().st_size
    after = (tmp_path / "ck" / "model.safetensors").stat().st_size
    note = next(n for n in notes if "weights are held as fp32" in n)
    print(note, f"({before:,} -> {after:,} bytes)")
    assert "bf16" in note and after > 1.9 * before
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model"]  # no dtype change
    convert_from_hf(tmp_path / "hf32", tmp_path / "ck32")
    assert sum("held as fp32" in n for n in notes) == 1  # fp32 weights: nothing to say


# ----------------------------------------------------------------------------------------------
# Refusals: one line, naming the file


def _refused(argv, capsys) -> str:
    rc, err = cli_status(argv, capsys)
    assert rc == 2, err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "text, needle",
    [("[1, 2]", "is neither an llm-foundry checkpoint config"), ("{not json", "not valid JSON")],
)
def test_a_config_json_that_is_no_config_is_named_in_one_line(tmp_path, capsys, text, needle):
    _saved(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(text)
    err = _refused(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")],
                   capsys)  # fmt: skip
    assert str(tmp_path / "hf" / "config.json") in err and needle in err
    assert not (tmp_path / "c").exists()


def test_a_setting_without_a_counterpart_is_one_line_naming_the_config_file(tmp_path, capsys):
    params = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}
    _saved(tmp_path / "hf", rope_parameters=params)
    read = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf")).rope_parameters
    assert read["rope_type"] == "yarn"  # a config transformers reads
    err = _refused(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")],
                   capsys)  # fmt: skip
    assert f"({tmp_path / 'hf' / 'config.json'})" in err and "rope_type='yarn'" in err


@pytest.mark.parametrize(
    "file, text, needle",
    [
        ("tokenizer.json", '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b c"]}}',
         "Hugging Face tokenizers cannot read it"),
        ("tokenizer_config.json", '{"chat_template": 5}', "chat_template is 5"),
    ],
)  # fmt: skip
def test_tokenizer_files_nothing_could_use_are_refused_before_converting(
    tmp_path, capsys, file, text, needle
):
    """Refused by convert --from-hf itself, in one line naming the file, not carried into a
    checkpoint that generate and --to-hf would then refuse."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    _saved(tmp_path / "hf")
    good = Tokenizer(models.BPE({chr(97 + i): i for i in range(20)}, []))
    good.pre_tokenizer = pre_tokenizers.Whitespace()
    good.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / file).write_text(text)
    err = _refused(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")],
                   capsys)  # fmt: skip
    assert str(tmp_path / "hf" / file) in err and needle in err
    assert not (tmp_path / "c").exists()


def test_a_peft_adapter_given_as_the_model_names_its_base_and_adapter(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    _saved(tmp_path / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(str(tmp_path / "adapter"))
    named = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base_dir = named["base_model_name_or_path"]
    assert base_dir == str(tmp_path / "base")
    hint = f"--checkpoint {base_dir} --adapter {tmp_path / 'adapter'}"
    commands = [
        ["generate", "--checkpoint", str(tmp_path / "adapter"), "--prompt-ids", "1"],
        ["convert", "--from-hf", str(tmp_path / "adapter"), "--out", str(tmp_path / "c")],
        ["params", "--checkpoint", str(tmp_path / "adapter")],
    ]
    try:
        import gguf  # noqa: F401

        commands.append(["convert", "--to-gguf", str(tmp_path / "adapter"), "--out",
                         str(tmp_path / "c.gguf")])  # fmt: skip
    except ImportError:
        pass
    for argv in commands:
        err = _refused(argv, capsys)
        assert "is a PEFT adapter (adapter_config.json)" in err and hint in err, err
    # the hint works
    argv = ["generate", "--checkpoint", base_dir, "--adapter", str(tmp_path / "adapter")]
    rc, err = cli_status([*argv, "--prompt-ids", "1", "--max-new-tokens", "2", "--json"], capsys)
    assert rc == 0, err


# ----------------------------------------------------------------------------------------------
# partial_rotary_factor: accepted where transformers' model ignores it, refused where it rotates
# part of each head


def test_partial_rotary_factor_is_read_as_transformers_reads_it(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    _saved(tmp_path / "default", rope_parameters=rope)
    _saved(tmp_path / "plain")
    x = _ids()
    hf = _transformers(tmp_path / "default")
    ignored = (hf(x).logits - _transformers(tmp_path / "plain")(x).logits).abs().max().item()
    diff = _diff(from_hf(tmp_path / "default"), hf, x)
    print(f"default RoPE: transformers with/without the factor {ignored:.1e}; ours {diff:.2e}")
    assert diff <= TOL

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    linear = {**rope, "rope_type": "linear", "factor": 2.0}
    _saved(tmp_path / "linear", rope_parameters=linear)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "linear"))
    # here transformers computes frequencies for half of each head's dims only
    assert 2 * LlamaRotaryEmbedding(config).inv_freq.numel() == config.head_dim // 2
    with pytest.raises(ConversionError) as e:
        from_hf(tmp_path / "linear")
    assert "partial_rotary_factor=0.5 with rope_type='linear'" in str(e.value)
    assert "frequencies for part of each head" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("source", ["--from-hf", "--to-gguf"])
def test_family_is_refused_where_the_source_names_the_architecture(tmp_path, capsys, source):
    _saved(tmp_path / "hf")
    argv = ["convert", source, str(tmp_path / "hf"), "--out", str(tmp_path / "x")]
    err = _refused([*argv, "--family", "gpt2"], capsys)
    assert "--family gpt2 applies to --to-hf and --to-peft only" in err
    assert not (tmp_path / "x").exists()


def test_convert_help_names_every_family_it_converts(capsys):
    from llm_foundry.cli import main
    from llm_foundry.interop.hf import FAMILIES

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert {"BLOOM", "Falcon"} <= {f.title for f in FAMILIES.values()}
    assert all(f.title in text.split(" and llm-foundry")[0] for f in FAMILIES.values())
