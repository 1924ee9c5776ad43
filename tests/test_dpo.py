"""Preference tuning (DPO): loss, rewards and margins equal TRL's DPOTrainer on the same weights
and batch (sigmoid, robust, IPO, conservative label smoothing; the reference scored per batch
or precomputed), the loss counts completion tokens only, LoRA's reference is its base, runs
resume exactly, bad rows are one line, and the corpus demo's reward margins rise."""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil

import pytest
import torch
from conftest import cli_status, tiny_hf_llama

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.config import ConfigError, ModelConfig
from llm_foundry.data import DataError
from llm_foundry.data.batches import IGNORE
from llm_foundry.data.preference import FIELDS, PreferenceSampler, prepare_preference
from llm_foundry.models import Transformer
from llm_foundry.models.lora import adapters_disabled, add_lora, lora_layers
from llm_foundry.tokenizer import CharTokenizer
from llm_foundry.train.config import TrainConfig
from llm_foundry.train.dpo import completion_lengths, preference_loss, sequence_logps
from llm_foundry.train.reference import ModelReference, StoredReference, score_all
from llm_foundry.train.trainer import Trainer

WORDS = "what light through yonder window breaks it is the east and juliet sun".split()
SPEAKERS = ["ROMEO", "JULIET", "NURSE", "TYBALT"]


def _rows(n: int = 16, seed: int = 0) -> list[dict]:
    """Text preference rows of varied lengths: a speaker and words; chosen and rejected lines."""
    rng = random.Random(seed)

    def line(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [
        {"prompt": f"{rng.choice(SPEAKERS)}: {line(rng.randint(1, 4))}\n",
         "chosen": line(rng.randint(1, 5)), "rejected": line(rng.randint(1, 5))}
        for _ in range(n)
    ]  # fmt: skip


CHAT_ROW = {
    "prompt": [
        {"role": "user", "content": "ROMEO: what light?"},
        {"role": "assistant", "content": "JULIET"},
        {"role": "user", "content": "and then?"},
    ],
    "chosen": [{"role": "assistant", "content": "NURSE"}],
    "rejected": {"role": "assistant", "content": "TYBALT"},
}
ALPHABET = "".join(sorted(set(" \n:?" + "".join(WORDS) + "".join(SPEAKERS) + "USERASISTNTYSM")))


def _write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def pref(tmp_path):
    """(prepared preference directory, its char tokenizer) of 16 text rows (4 held out)."""
    tok = CharTokenizer.train(ALPHABET + "abcdefghijklmnopqrstuvwxyz")
    tok.save(tmp_path / "tokenizer.json")
    _write_rows(tmp_path / "rows.jsonl", _rows())
    prepare_preference(
        tmp_path / "pref", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json", 0.25
    )
    return tmp_path / "pref", tok


# ----------------------------------------------------------------------------------------------
# the data: completion-only targets, pairs in order, one-line errors


def test_targets_are_the_completion_tokens_alone(pref):
    data, tok = pref
    rows = _rows()[:12]  # the training split
    sampler = PreferenceSampler(data, "train", block_size=64, batch_size=4, seed=0)
    assert sampler.pairs == 12 and sampler.dropped == 0
    for _ in range(3):
        x, y, pairs = sampler.next()
        assert x.shape == y.shape == (8, 64) and pairs.shape == (4,)
        for b, p in enumerate(pairs.tolist()):
            for row_y, row_x, field in ((y[b], x[b], "chosen"), (y[b + 4], x[b + 4], "rejected")):
                kept = row_y[row_y != IGNORE].tolist()
                assert tok.decode(kept) == rows[p][field]
                text = (
                    rows[p]["prompt"] + rows[p][field]
                )  # no end-of-sequence token: a char tokenizer
                assert tok.decode(row_x[: len(text) - 1].tolist()) == text[:-1]


def test_chat_rows_target_the_completion_reply_not_the_prompt_replies(tmp_path):
    tok = CharTokenizer.train(ALPHABET + "abcdefghijklmnopqrstuvwxyz")
    tok.save(tmp_path / "tokenizer.json")
    _write_rows(tmp_path / "rows.jsonl", [CHAT_ROW] * 3)
    prepare_preference(
        tmp_path / "pref", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json", 0.34
    )
    x, y, _ = PreferenceSampler(tmp_path / "pref", "train", 80, 1, seed=0).next()
    whole = "USER: ROMEO: what light?\nASSISTANT: JULIET\nUSER: and then?\nASSISTANT: "
    assert tok.decode(x[0, : len(whole) + 5].tolist()) == whole + "NURSE"
    assert tok.decode(y[0][y[0] != IGNORE].tolist()) == "NURSE\n"  # not JULIET, a prompt reply
    assert tok.decode(y[1][y[1] != IGNORE].tolist()) == "TYBALT\n"


BAD_ROWS = [
    ('{"prompt": "a", "chosen": "b"}', "line 2: no 'rejected'"),
    ('{"prompt": "a", "chosen": "", "rejected": "c"}', "line 2: 'chosen' must be a non-empty string"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "line 2: 'chosen' must be a non-empty string"),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}',
     "line 2: 'chosen' is a string but 'prompt' is messages"),
    ('{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}],'
     ' "rejected": [{"role": "assistant", "content": "c"}]}',
     "line 2: 'chosen' has no non-empty assistant message"),
    ('{"prompt": [{"role": "robot", "content": "a"}], "chosen": [], "rejected": []}',
     "line 2: prompt[0] needs a 'role' of system, user, assistant"),
    ('{"prompt": [{"role": "user", "content": 5}], "chosen": [], "rejected": []}',
     "line 2: prompt[0].content must be a string"),
    ("[1, 2]", "line 2: a list, expected an object"),
    ("{nope", "line 2: not JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "message"), BAD_ROWS)
def test_a_bad_row_is_one_line_naming_file_line_and_field(tmp_path, line, message):
    tok = CharTokenizer.train(ALPHABET)
    tok.save(tmp_path / "tokenizer.json")
    good = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
    (tmp_path / "rows.jsonl").write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(DataError) as e:
        prepare_preference(tmp_path / "out", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json")
    text = str(e.value)
    assert "\n" not in text and text.startswith(str(tmp_path / "rows.jsonl")) and message in text


def test_a_row_the_tokenizer_cannot_encode_names_its_line_and_field(tmp_path):
    CharTokenizer.train("abc \n").save(tmp_path / "tokenizer.json")
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b",
            "rejected": "Z"}, {"prompt": "a", "chosen": "b", "rejected": "c"}]  # fmt: skip
    _write_rows(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"rows.jsonl, line 2: 'rejected' cannot be encoded"):
        prepare_preference(tmp_path / "out", tmp_path / "rows.jsonl", tmp_path / "tokenizer.json")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(dpo_loss="kto"), "dpo_loss='kto' is not one of sigmoid, robust, ipo"),
        (dict(dpo_beta=0), "dpo_beta=0 must be a number > 0"),
        (dict(dpo_label_smoothing=0.5), "dpo_label_smoothing=0.5 must be a number in [0, 0.5)"),
        (dict(dpo_loss="ipo", dpo_label_smoothing=0.1), "IPO has no label smoothing"),
        (dict(dpo_reference="copy"), "dpo_reference='copy' is not one of model, precomputed"),
        (dict(task="dpo", fused_loss=True), "task='dpo' with fused_loss=true"),
        (dict(task="ppo"), "task='ppo' is not one of lm, dpo"),
    ],
)
def test_bad_dpo_settings_are_one_line_each(fields, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**fields)
    assert message in str(e.value) and str(e.value).count("\n") == 0


# ----------------------------------------------------------------------------------------------
# parity with TRL's DPOTrainer


def _pairs_as_trl(sampler: PreferenceSampler, pairs) -> list[dict]:
    """TRL's tokenized examples (prompt_ids, chosen_ids, rejected_ids) of our prepared pairs."""
    out = []
    for p in pairs.tolist():
        seqs = []
        for s in (2 * p, 2 * p + 1):
            a, b = int(sampler.offsets[s]), int(sampler.offsets[s + 1])
            ids, mask = sampler.data[a:b].tolist(), sampler.mask[a:b].tolist()
            seqs.append((ids[: mask.index(1)], ids[mask.index(1) :]))
        assert seqs[0][0] == seqs[1][0]  # one prompt
        out.append({"prompt_ids": seqs[0][0], "chosen_ids": seqs[0][1], "rejected_ids": seqs[1][1]})
    return out


@pytest.fixture(scope="module")
def trl_setup():
    """A TRL DPOTrainer on a tiny random HF Llama (policy: the reference's weights moved by
    noise, so the log-ratios are O(1)) and its frozen reference; built once, its loss settings
    changed per test (the attributes its loss computation reads)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import DPOConfig, DPOTrainer

    vocab = {c: i for i, c in enumerate(ALPHABET + "abcdefghijklmnopqrstuvwxyz")}
    vocab = {**vocab, "<pad>": len(vocab)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                                  eos_token="<pad>")  # fmt: skip
    ref = tiny_hf_llama(0, vocab_size=len(vocab))
    policy = tiny_hf_llama(0, vocab_size=len(vocab))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    import tempfile

    out = tempfile.mkdtemp()
    # fp32 as ours (TRL's configs default to bf16 autocast, on the CPU too)
    args = DPOConfig(output_dir=out, report_to=[], use_cpu=True, gradient_checkpointing=False,
                     bf16=False, fp16=False)  # fmt: skip
    ds = Dataset.from_list([{"prompt": "ab", "chosen": "c", "rejected": "d"}] * 2)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds,
                         processing_class=hf_tok)  # fmt: skip
    yield trainer, policy, ref
    shutil.rmtree(out, ignore_errors=True)


# (our dpo_loss, label smoothing, TRL's loss_type and loss_weights computing the same). TRL
# 1.16's sigmoid loss has no label smoothing; conservative DPO's -(1-e) ls(bh) - e ls(-bh) is
# its sigmoid loss a = -ls(bh) and robust loss r = ((1-e) a - e b) / (1-2e), b = -ls(-bh),
# combined: (1-e) a + e b = 2 (1-e) a - (1-2e) r.
VARIANTS = [
    ("sigmoid", 0.0, ["sigmoid"], [1.0]),
    ("sigmoid", 0.2, ["sigmoid", "robust"], [2 * (1 - 0.2), -(1 - 2 * 0.2)]),
    ("robust", 0.2, ["robust"], [1.0]),
    ("ipo", 0.0, ["ipo"], [1.0]),
]


@pytest.mark.heavy
@pytest.mark.parametrize("reference", ["model", "precomputed"])
@pytest.mark.parametrize(("kind", "eps", "trl_types", "trl_weights"), VARIANTS)
def test_loss_rewards_and_margins_equal_trl(trl_setup, pref, reference, kind, eps, trl_types,
                                            trl_weights):  # fmt: skip
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from llm_foundry.interop.hf import from_hf

    trainer, hf_policy, hf_ref = trl_setup
    data, _ = pref
    beta = 0.3
    sampler = PreferenceSampler(data, "train", block_size=64, batch_size=4, seed=3)
    x, y, pairs = sampler.next()
    inputs = DataCollatorForPreference(pad_token_id=0)(_pairs_as_trl(sampler, pairs))
    # ours: the same weights, imported
    policy, frozen = from_hf(hf_policy), from_hf(hf_ref)
    scorer = ModelReference(policy, frozen, contextlib.nullcontext)
    if reference == "precomputed":
        table = score_all(scorer, {"train": PreferenceSampler(data, "train", 64, 4)}, 4, "cpu")
        scorer = StoredReference(table)
    policy_logps = sequence_logps(policy(x)[0], y)
    reference_logps = scorer.logps(x, y, pairs, "train")
    ours, stats = preference_loss(policy_logps, reference_logps, completion_lengths(y), kind, beta,
                                  eps)  # fmt: skip
    # TRL's: its own loss computation on its copy of the weights
    trainer.beta, trainer.label_smoothing = beta, eps
    trainer.loss_types, trainer.loss_weights = trl_types, trl_weights
    trainer.precompute_ref_logps = reference == "precomputed"
    if trainer.precompute_ref_logps:
        chosen, rejected = trainer.compute_ref_log_probs(hf_ref, inputs)
        inputs = {**inputs, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}
    trainer.model.train()
    theirs = trainer._compute_loss(trainer.model, inputs, False).item()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    # fp32 on both sides. A sequence's log-prob sums <= ~40 per-token terms computed in other
    # orders (TRL's tiled log-sum-exp; attention over a batch padded to another length): they
    # agree to ~1e-7 of their size (measured 8e-8), so to 1e-6 on any CPU. h combines four of
    # them: it may move by dh = 4e-6 max|logp|; the rewards by beta dh, the losses by at most
    # 4 dh (sigmoid and robust slopes <= beta / (1 - 2 eps) < 1; IPO's 2 |h' - 1 / (2 beta)| < 4)
    dh = 4e-6 * torch.cat([policy_logps, reference_logps]).abs().max().item()
    assert ours.item() == pytest.approx(theirs, abs=4 * dh)
    for k in ("logps/chosen", "logps/rejected"):
        assert stats[k].item() == pytest.approx(logged[k], rel=1e-6), k
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert stats[k].item() == pytest.approx(logged[k], abs=beta * dh), k
    # every pair's margin is far from 0 next to dh, so which side wins cannot hinge on rounding
    ratios = (policy_logps - reference_logps).detach()
    margins = beta * (ratios[:4] - ratios[4:])
    assert margins.abs().min().item() > 10 * beta * dh
    assert stats["rewards/accuracies"].item() == logged["rewards/accuracies"]
    assert 0 < logged["rewards/accuracies"] < 1  # both outcomes occur: the test is not of zeros


@pytest.mark.heavy
def test_text_rows_tokenize_as_trl_does_with_the_eos_in_the_completion(trl_setup, tmp_path):
    """Text rows with a tokenizer that has an end-of-sequence token: our prompt and completion
    ids are TRL's own tokenization (its DPOTrainer's dataset preparation), the EOS counted as
    the completion's last target."""
    from datasets import Dataset

    trainer = trl_setup[0]
    hf_tok = trainer.processing_class
    hf_tok.save_pretrained(str(tmp_path / "tok"))
    rows = _rows(6)
    _write_rows(tmp_path / "rows.jsonl", rows)
    prepare_preference(tmp_path / "pref", tmp_path / "rows.jsonl", tmp_path / "tok" /
                       "tokenizer.json", 0.34)  # fmt: skip
    sampler = PreferenceSampler(tmp_path / "pref", "train", block_size=64, batch_size=4)
    assert sampler.pairs == 4
    theirs = trainer._prepare_dataset(Dataset.from_list(rows[:4]), hf_tok, trainer.args, "rows")
    names = ("prompt_ids", "chosen_ids", "rejected_ids")
    assert _pairs_as_trl(sampler, torch.arange(4)) == [{k: ex[k] for k in names} for ex in theirs]
    assert all(ex["chosen_ids"][-1] == hf_tok.eos_token_id for ex in theirs)
    _, y, _ = sampler.next()
    assert all(row[row != IGNORE][-1] == hf_tok.eos_token_id for row in y)


def test_lora_reference_is_the_base_and_dpo_grads_reach_adapters_only(tiny_config):
    torch.manual_seed(0)
    base = Transformer(tiny_config(dropout=0.0))
    model = Transformer(tiny_config(dropout=0.0))
    model.load_state_dict(base.state_dict())
    add_lora(model, ["wq", "wv", "w2"], r=4, alpha=8.0, dropout=0.0, rslora=False)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 0.2)  # adapters that change the function
    x = torch.randint(0, 37, (4, 16))
    y = torch.where(torch.arange(16) >= 6, torch.randint(0, 37, (4, 16)), IGNORE)
    with adapters_disabled(model):
        off = model(x)[0]
    torch.testing.assert_close(off, base(x)[0], rtol=0, atol=0)  # the base's own computation
    assert not torch.equal(model(x)[0], off)  # and the adapters are back on after it
    lens = completion_lengths(y)
    ref = ModelReference(model, None, contextlib.nullcontext).logps(x, y)
    loss, _ = preference_loss(sequence_logps(model(x)[0], y), ref, lens, "sigmoid", 0.1)
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    # the same loss as full fine-tuning of the merged weights against a frozen base copy
    merged = Transformer(tiny_config(dropout=0.0))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.merge()
        merged.load_state_dict({k.replace(".base", ""): v for k, v in model.state_dict().items()
                                if "lora_" not in k})  # fmt: skip
        for layer in lora_layers(model).values():
            layer.unmerge()
    ref_full = ModelReference(merged, base, contextlib.nullcontext).logps(x, y)
    full, _ = preference_loss(sequence_logps(merged(x)[0], y), ref_full, lens, "sigmoid", 0.1)
    torch.testing.assert_close(loss.detach(), full, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# training runs


def _base(tmp_path, tok) -> str:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
    return str(save_checkpoint(Transformer(cfg), tmp_path / "base")), cfg


def _dpo_trainer(data, out, init_from, cfg, resume=False, **train):
    settings = dict(task="dpo", init_from=init_from, batch_size=4, block_size=64, max_steps=8,
                    eval_interval=4, eval_batches=2, warmup_steps=2, checkpoint_interval=4,
                    sample_tokens=0, progress=False, lr=3e-3, dpo_beta=0.5)  # fmt: skip
    return Trainer(cfg, TrainConfig(**{**settings, **train}), data, out, resume=resume)


def _records(run, key):
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if key in r]


@pytest.mark.parametrize(
    "train",
    [
        pytest.param(dict(dpo_reference="model", lora_r=4, lora_targets="wq,wv,w2"),
                     id="lora-model", marks=pytest.mark.heavy),  # ~15 s on 2 busy cores
        pytest.param(dict(dpo_reference="precomputed", dpo_loss="ipo"), id="full-precomputed"),
    ],
)  # fmt: skip
def test_dpo_runs_log_rewards_and_resume_exactly(pref, tmp_path, train):
    from llm_foundry.train.state import write_json_atomic

    data, tok = pref
    init, cfg = _base(tmp_path, tok)
    _dpo_trainer(data, tmp_path / "full", init, cfg, **train).run()
    recs = _records(tmp_path / "full", "loss")
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(
        recs[0]
    )
    # step 1 starts at the reference: every log-ratio is 0 (the reference is the start)
    assert recs[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert "val_rewards/margins" in _records(tmp_path / "full", "val_loss")[0]
    if train["dpo_reference"] == "precomputed":
        assert (tmp_path / "full" / "reference_logps.safetensors").is_file()
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step_000008")
    write_json_atomic(
        tmp_path / "cut" / "checkpoints" / "latest.json", {"step": 4, "path": "step_000004"}
    )
    _dpo_trainer(data, tmp_path / "cut", init, cfg, resume=True, **train).run()
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")
    full, cut = _records(tmp_path / "full", "loss"), _records(tmp_path / "cut", "loss")
    assert [[r[k] for k in keys] for r in cut] == [[r[k] for k in keys] for r in full]
    assert all(math.isfinite(r["loss"]) for r in full)


def _short_run(data, out, init, cfg, **train):
    """Two DPO steps, checkpointed at step 2 (the run to resume)."""
    settings = dict(max_steps=2, checkpoint_interval=2, eval_interval=2, eval_batches=1)
    _dpo_trainer(data, out, init, cfg, **{**settings, **train}).run()


def test_a_stale_precomputed_reference_is_refused_on_resume(pref, tmp_path):
    """The stored table holds the log-probabilities of the sequences as they were cut and
    scored: a resume that cuts them elsewhere, or a table with no record of it, is refused."""
    from safetensors.torch import load_file, save_file

    from llm_foundry.train.reference import REFERENCE_FILE

    data, tok = pref
    init, cfg = _base(tmp_path, tok)
    run = tmp_path / "run"
    _short_run(data, run, init, cfg, dpo_reference="precomputed")
    table = run / REFERENCE_FILE
    with pytest.raises(ValueError) as e:
        _dpo_trainer(data, run, init, cfg, resume=True, dpo_reference="precomputed",
                     block_size=48, max_steps=3)  # fmt: skip
    msg = str(e.value)
    assert "\n" not in msg and str(table) in msg and "block_size 64 -> 48" in msg, msg
    save_file(load_file(str(table)), str(table))  # the same values, no record of what they are
    with pytest.raises(ValueError, match="no record of them"):
        _dpo_trainer(data, run, init, cfg, resume=True, dpo_reference="precomputed", max_steps=3)
    table.unlink()
    with pytest.raises(FileNotFoundError, match="resume with --train.dpo_reference model"):
        _dpo_trainer(data, run, init, cfg, resume=True, dpo_reference="precomputed", max_steps=3)


def test_a_reference_whose_weights_changed_is_refused_on_resume(pref, tmp_path, capsys):
    """Full fine-tuning scores a frozen copy of train.init_from, read again on resume: other
    weights there by then (the base retrained in place) are refused, the same ones resume; the
    eval lines show the held-out reward margin and accuracy."""
    data, tok = pref
    init, cfg = _base(tmp_path, tok)
    run = tmp_path / "run"
    _short_run(data, run, init, cfg)
    ev = _records(run, "val_loss")[-1]
    shown = (
        f"val margin {ev['val_rewards/margins']:.3f}, val acc {ev['val_rewards/accuracies']:.2f}"
    )
    assert shown in capsys.readouterr().out
    # and finetune's last words: the last evaluation's margin and accuracy
    from llm_foundry.cli.finetune import held_out_rewards

    said = held_out_rewards(run / "metrics.jsonl")
    assert f"at step 2: reward margin {ev['val_rewards/margins']:.3f}" in said
    assert said.endswith(f"ahead in {ev['val_rewards/accuracies']:.0%} of the held-out pairs "
                         "drawn for it (train.eval_batches batches, drawn with replacement)")  # fmt: skip
    _dpo_trainer(data, run, init, cfg, resume=True, max_steps=3, checkpoint_interval=3).run()
    torch.manual_seed(1)
    save_checkpoint(Transformer(cfg), init)  # the same directory, other weights
    with pytest.raises(ValueError) as e:
        _dpo_trainer(data, run, init, cfg, resume=True, max_steps=4)
    msg = str(e.value)
    assert "\n" not in msg and f"train.init_from={init} holds other weights" in msg, msg


def test_dpo_needs_preference_data_and_a_start(pref, tmp_path, char_data):
    data, tok = pref
    init, cfg = _base(tmp_path, tok)
    with pytest.raises(ValueError, match="train.task=dpo needs the model to start from"):
        _dpo_trainer(data, tmp_path / "a", None, cfg)
    with pytest.raises(ValueError, match="holds preference pairs: train them with train.task=dpo"):
        _dpo_trainer(data, tmp_path / "b", init, cfg, task="lm")
    text = char_data(5000)
    with pytest.raises(ValueError, match="train.task=dpo needs one directory of preference"):
        _dpo_trainer(text, tmp_path / "c", init, cfg)


@pytest.mark.heavy
def test_the_corpus_demo_raises_the_reward_margins(shared_data, tmp_path, capsys):
    """finetune --task dpo on shakespeare_prefer_next_line (the true next line over its words
    shuffled), from a small model trained on the corpus: the held-out pairs' reward margin and
    accuracy rise, and the rewards are plotted."""
    from llm_foundry.cli import main
    from llm_foundry.plots import png_size

    corpus = shared_data / "tinyshakespeare.txt"
    assert main(["prepare", "--text", str(corpus), "--out", str(tmp_path / "char")]) == 0
    common = [
        "--train.progress",
        "false",
        "--train.sample_tokens",
        "0",
        "--train.block_size",
        "128",
    ]
    base = ["train", "--data", str(tmp_path / "char"), "--out", str(tmp_path / "base"),
            "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.max_seq_len", "128", "--train.batch_size", "16", "--train.max_steps", "150",
            "--train.lr", "3e-3", "--train.eval_interval", "150", *common]  # fmt: skip
    assert main(base) == 0
    dpo = ["finetune", "--task", "dpo", "--checkpoint", str(tmp_path / "base"),
           "--data", "shakespeare_prefer_next_line", "--out", str(tmp_path / "dpo"),
           "--train.batch_size", "8", "--train.max_steps", "30", "--train.lr", "5e-4",
           "--train.warmup_steps", "5", "--train.eval_interval", "10", "--train.eval_batches", "4",
           "--train.dpo_beta", "0.5", *common]  # fmt: skip
    rc, err = cli_status(dpo, capsys)
    assert rc == 0, err
    evals = _records(tmp_path / "dpo", "val_loss")
    margins = [r["val_rewards/margins"] for r in evals]
    # at step 0 every margin is 0 (the policy is its reference); the held-out pairs' margin
    # rises from there and the chosen line wins most pairs
    assert 0 < margins[0] < margins[-1], margins
    assert evals[-1]["val_rewards/accuracies"] > 0.7
    assert png_size(tmp_path / "dpo" / "rewards.png") == (1500, 450)


@pytest.mark.heavy
@pytest.mark.parametrize("train", [dict(), dict(lora_r=2, lora_targets="wq,wv,w2"),
                                   dict(dpo_reference="precomputed")],
                         ids=["full", "lora", "precomputed"])  # fmt: skip
def test_dpo_on_two_ddp_ranks_gives_the_losses_of_one_process(pref, tmp_path, train):
    """Each rank's loss is the mean over its half of the pairs; DDP averages the gradients, so
    two ranks at B pairs each train as one process at 2B (their sampler draws the same pairs);
    a precomputed reference is the same table (scored in batches of B, not 2B)."""
    from test_distributed import MODEL, TRAIN, _flags, losses, torchrun, val_losses

    from llm_foundry.presets import get_preset

    data, tok = pref
    model = {**MODEL, "max_seq_len": 64}
    cfg = get_preset("llama-shakespeare-char", **model, vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    init = str(save_checkpoint(Transformer(cfg), tmp_path / "base"))
    settings = {**TRAIN, "block_size": 64, "max_steps": 6, "task": "dpo", "init_from": init,
                "dpo_beta": 0.5, "lr": 3e-3, **train}  # fmt: skip
    Trainer(cfg, TrainConfig(**settings, batch_size=4), data, tmp_path / "one").run()
    args = ["train", "--data", str(data), "--out", str(tmp_path / "ddp"), *_flags(**settings)]
    args += ["--model.max_seq_len=64", "--train.batch_size=2", "--train.parallel=ddp"]
    r = torchrun(args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    one, ddp = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert one.keys() == ddp.keys() and max(abs(one[k] - ddp[k]) for k in one) < 1e-5
    one, ddp = val_losses(tmp_path / "one"), val_losses(tmp_path / "ddp")
    assert one.keys() == ddp.keys() and max(abs(one[k] - ddp[k]) for k in one) < 1e-5
    if train.get("dpo_reference") == "precomputed":
        from safetensors.torch import load_file

        from llm_foundry.train.reference import REFERENCE_FILE

        one, ddp = (load_file(str(tmp_path / run / REFERENCE_FILE)) for run in ("one", "ddp"))
        assert one.keys() == ddp.keys() == {"train", "val"}
        for split in one:
            torch.testing.assert_close(ddp[split], one[split], rtol=0, atol=1e-5)


def test_chat_rows_under_an_hf_template_target_what_trl_calls_the_completion(tmp_path):
    """ChatML: the completion is what the reply adds after the prompt's generation prompt (its
    text and end of turn), as TRL's conversational rows have it; the prompt's reply is not."""
    transformers = pytest.importorskip("transformers")
    from test_chat import CHATML, MESSAGES, _hf_tokenizer_dir

    directory = _hf_tokenizer_dir(tmp_path / "tok", CHATML)
    row = {"prompt": MESSAGES[:3], "chosen": [MESSAGES[3]],
           "rejected": {"role": "assistant", "content": "JULIET"}}  # fmt: skip
    _write_rows(tmp_path / "rows.jsonl", [row] * 3)
    prepare_preference(
        tmp_path / "pref", tmp_path / "rows.jsonl", directory / "tokenizer.json", 0.34
    )
    x, y, _ = PreferenceSampler(tmp_path / "pref", "train", 128, 1, seed=0).next()
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    prompt = hf.apply_chat_template(MESSAGES[:3], tokenize=False, add_generation_prompt=True)
    for b, reply in ((0, MESSAGES[3]["content"]), (1, "JULIET")):
        whole = hf.apply_chat_template([*MESSAGES[:3], {"role": "assistant", "content": reply}],
                                       tokenize=False)  # fmt: skip
        assert whole.startswith(prompt)
        assert hf.decode(y[b][y[b] != IGNORE].tolist()) == whole[len(prompt) :]


def test_finetune_task_dpo_errors_are_one_line(pref, tmp_path, capsys):
    data, tok = pref
    init, _ = _base(tmp_path, tok)
    tok.save(f"{init}/tokenizer.json")
    (tmp_path / "bad.jsonl").write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a"}\n'
    )
    base = ["finetune", "--task", "dpo", "--checkpoint", init, "--out", str(tmp_path / "run")]
    for data_arg, message in (
        (str(tmp_path / "missing.jsonl"), "no such file or directory; give preference rows"),
        (str(tmp_path / "bad.jsonl"), "bad.jsonl, line 2: no 'chosen'"),
    ):
        rc, err = cli_status([*base, "--data", data_arg], capsys)
        assert rc == 2 and err.count("\n") == 1 and message in err, err
    lm = ["finetune", "--checkpoint", init, "--data", str(data), "--out", str(tmp_path / "lm")]
    rc, err = cli_status(lm, capsys)
    assert rc == 2 and "holds preference pairs: train them with train.task=dpo" in err, err


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--train.dpo_beta", "-1"], "train.dpo_beta=-1"),
        (["--train.dpo_loss", "kto"], "train.dpo_loss='kto'"),
        (["--train.dpo_label_smoothing", "0.5"], "train.dpo_label_smoothing=0.5"),
        (["--train.dpo_reference", "copy"], "train.dpo_reference='copy'"),
        (["--train.fused_loss", "true"], "task='dpo' with fused_loss=true"),  # as task=dpo
    ],
)
def test_bad_dpo_settings_are_refused_before_any_row_is_read(pref, tmp_path, capsys, flags, field):
    """finetune --task dpo checks the settings as the training command will, before it reads
    the rows (bad rows: their error would come first otherwise) or writes OUT/data (good rows:
    they would be tokenized there first otherwise)."""
    data, tok = pref
    init, _ = _base(tmp_path, tok)
    tok.save(f"{init}/tokenizer.json")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    _write_rows(tmp_path / "good.jsonl", _rows())
    out = tmp_path / "run"
    args = ["finetune", "--task", "dpo", "--checkpoint", init, "--out", str(out), *flags]
    for rows in ("bad.jsonl", "good.jsonl"):
        rc, err = cli_status([*args, "--data", str(tmp_path / rows)], capsys)
        assert rc == 2 and err.count("\n") == 1 and field in err, err
        assert not (out / "data").exists()


def test_validation_pairs_cut_at_the_block_size_are_counted_as_the_training_ones(tmp_path, capsys):
    """A sequence longer than block_size + 1 tokens is cut; a pair whose prompt fills the block
    keeps no completion token and is left out. Counted from the rows' lengths (one character a
    token, no end-of-sequence token), the notes at the start say so for both splits."""
    block = 24
    rng = random.Random(1)

    def text(n):
        return "".join(rng.choice("abcdefghij ") for _ in range(n - 1)) + "\n"

    # (prompt, chosen, rejected) lengths; finetune holds the last 10% out: rows 18 and 19
    sizes = [(8, 6, 4)] * 15 + [(10, 20, 20), (10, 20, 5), (30, 3, 3), (6, 30, 4), (25, 2, 2)]
    rows = [{"prompt": text(p), "chosen": text(c), "rejected": text(r)} for p, c, r in sizes]
    _write_rows(tmp_path / "rows.jsonl", rows)
    tok = CharTokenizer.train("abcdefghij \n")
    init, _ = _base(tmp_path, tok)
    tok.save(f"{init}/tokenizer.json")

    def expected(part):
        cut = sum(len(r["prompt"]) + len(r[f]) > block + 1 for r in part for f in FIELDS[1:])
        left_out = sum(len(r["prompt"]) > block for r in part)  # no target in the block
        return cut, left_out, len(part)

    train, val = expected(rows[:18]), expected(rows[18:])
    assert train != val and all(train) and all(val)  # both splits cut and leave out, unalike
    args = ["finetune", "--task", "dpo", "--checkpoint", init, "--out", str(tmp_path / "run"),
            "--data", str(tmp_path / "rows.jsonl"), "--train.block_size", str(block),
            "--train.max_steps", "1", "--train.batch_size", "2", "--train.eval_batches", "1",
            "--train.sample_tokens", "0", "--train.progress", "false"]  # fmt: skip
    from llm_foundry.cli import main

    capsys.readouterr()
    rc = main(args)
    out_text, err = capsys.readouterr()
    assert rc == 0, err
    for what, (cut, left_out, n) in (("training", train), ("validation", val)):
        note = (
            f"note: {cut} {what} sequences are longer than block_size + 1 = {block + 1} "
            f"tokens and are cut; {left_out} of {n} pairs keep no target and are left out"
        )
        assert note in out_text, out_text
    sampler = PreferenceSampler(tmp_path / "run" / "data", "val", block, 1)
    assert (sampler.cut, sampler.dropped, sampler.pairs) == val


SCORE_SCRIPT = """
import contextlib, json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from llm_foundry.checkpoint import read_config
from llm_foundry.data.preference import PreferenceSampler
from llm_foundry.train import distributed as D
from llm_foundry.train.reference import ModelReference, frozen_copy, score_all

data, init, out, batch = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
world, device = D.init_world(torch.device("cpu"), "ddp")
frozen = frozen_copy(read_config(init), init, device)
scorer = ModelReference(frozen, frozen, contextlib.nullcontext)
scored, logps = [], scorer.logps
scorer.logps = lambda x, y: scored.append(len(x) // 2) or logps(x, y)  # pairs this rank scores
samplers = {split: PreferenceSampler(data, split, 64, batch) for split in ("train", "val")}
table = score_all(scorer, samplers, batch, device, world=world)
(out / f"rank{world.rank}.json").write_text(json.dumps(sum(scored)))
if world.main:
    save_file(table, str(out / "table.safetensors"))
if world.distributed:
    dist.destroy_process_group()
"""


@pytest.mark.heavy
def test_a_precomputed_reference_on_two_ranks_is_scored_in_halves_and_equals_one_process(
    pref, tmp_path
):
    """With a distributed world each rank scores its share of the pairs (every pair once over
    the ranks) and the gathered table is one process's, bit for bit: each batch is the one a
    single process scores (batches of 5: the 12 training pairs end with a short one, the 4
    held-out pairs are one, of which the second rank has no share)."""
    from safetensors.torch import load_file
    from test_distributed import torchrun

    data, tok = pref
    init, _ = _base(tmp_path, tok)
    script = tmp_path / "score.py"
    script.write_text(SCORE_SCRIPT)
    tables, counts = {}, {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}"
        out.mkdir()
        r = torchrun([str(data), init, str(out), "5"], nproc=nproc, script=str(script))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        tables[nproc] = load_file(str(out / "table.safetensors"))
        counts[nproc] = [json.loads((out / f"rank{k}.json").read_text()) for k in range(nproc)]
    pairs = sum(PreferenceSampler(data, s, 64, 1).pairs for s in ("train", "val"))
    assert counts[1] == [pairs] and sum(counts[2]) == pairs and min(counts[2]) > 0, counts
    assert tables[1].keys() == tables[2].keys() == {"train", "val"}
    for split, one in tables[1].items():
        two = tables[2][split]
        assert one.shape == two.shape and torch.equal(one.view(torch.int32), two.view(torch.int32))


def test_under_torchrun_only_rank_0_prepares_and_the_others_wait_for_these_rows(
    tmp_path, monkeypatch
):
    """A rank > 0 does not tokenize the rows itself: it waits until OUT/data holds a meta.json
    of these very rows (a stale one from other rows does not count), which rank 0 writes."""
    import argparse
    import threading
    import time

    from llm_foundry.cli import finetune

    tok = CharTokenizer.train(ALPHABET + "abcdefghijklmnopqrstuvwxyz")
    save_checkpoint(Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1,
                                            n_heads=2, max_seq_len=64)), tmp_path / "ck")  # fmt: skip
    tok.save(tmp_path / "ck" / "tokenizer.json")
    _write_rows(tmp_path / "old.jsonl", _rows(8))
    _write_rows(tmp_path / "rows.jsonl", _rows(12))
    out = tmp_path / "run"
    prepare_preference(out / "data", tmp_path / "old.jsonl", tmp_path / "ck" / "tokenizer.json")
    monkeypatch.setenv("RANK", "1")
    ns = argparse.Namespace(data=str(tmp_path / "rows.jsonl"), out=str(out),
                            checkpoint=str(tmp_path / "ck"))  # fmt: skip

    def rank_0():
        time.sleep(1.0)
        prepare_preference(
            out / "data", tmp_path / "rows.jsonl", tmp_path / "ck" / "tokenizer.json"
        )

    writer = threading.Thread(target=rank_0)
    t = time.monotonic()
    writer.start()
    finetune._prepare(ns)
    waited = time.monotonic() - t
    writer.join()
    assert waited >= 1.0 and ns.data == str(out / "data")
    assert json.loads((out / "data" / "meta.json").read_text())["train_pairs"] > 6  # not old's


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_under_torchrun_a_run_without_out_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, command
):
    """Ranks started a second apart would each name their own runs/NAME-TIME directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    _write_rows(tmp_path / "rows.jsonl", _rows(8))
    args = {"train": ["train", "--data", str(tmp_path)],
            "finetune": ["finetune", "--task", "dpo", "--checkpoint", str(tmp_path / "ck"),
                         "--data", str(tmp_path / "rows.jsonl")]}[command]  # fmt: skip
    code, err = cli_status(args, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "under torchrun give --out RUN_DIR: every rank must name the same run" in err
    assert not (tmp_path / "runs").exists()
