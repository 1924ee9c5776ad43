"""The training loader (data/loader.py) on sharded directories written here (tests/sharded.py):
one shard draws the batches the sampler drew before shards; windows across shards; packed
documents with document masks; mixtures; exact resume (shard boundaries, epochs, world sizes);
the prefetch thread; and the refusals, through the trainer and ``llm-foundry train``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, corpus_text, make_trainer
from sharded import sharded_text, write_sharded

from llm_foundry.cli import main
from llm_foundry.config import ConfigError
from llm_foundry.data import BatchSampler, DataError, load_split
from llm_foundry.data.batches import IGNORE
from llm_foundry.data.loader import Loader, Prefetch, PreparedSplit, parse_sources
from llm_foundry.data.shards import split_shards
from llm_foundry.train.state import write_json_atomic

T = 16  # block size of the loader-level tests


def loader(dirs, split="train", weights=None, batch=4, seed=0, **kw) -> Loader:
    dirs = dirs if isinstance(dirs, list) else [dirs]
    return Loader([PreparedSplit(d, split) for d in dirs], weights, T, batch, seed, **kw)


def todays_batches(tokens: np.ndarray, block: int, batch: int, seed: int, n: int, rank=0, world=1):
    """The draw of BatchSampler as it was before shards (commit 6f68d1d), copied: one generator,
    ``batch * world`` starts in [0, len - block), this rank's slice, windows read from it."""
    rng = np.random.Generator(np.random.PCG64(seed))
    out = []
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - block, size=batch * world)
        mine = starts[rank * batch : (rank + 1) * batch]
        w = torch.from_numpy(np.array(tokens[mine[:, None] + np.arange(block + 1)], np.int64))
        out.append((w[:, :-1], w[:, 1:]))
    return out


@pytest.fixture(scope="module")
def text_dir(char_data) -> Path:
    return char_data(60_000)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory) -> Path:
    """Three train shards whose token k of shard s is s * 1000 + k (a window shows where it was
    cut from), one of them too short for a window; documents of 1 to 40 tokens."""
    rng = np.random.default_rng(0)

    def shard(s, n):
        ids = s * 1000 + np.arange(n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=n // 20, replace=False))
        return np.split(ids, cuts)

    train = [shard(1, 900), shard(2, 10), shard(3, 400)]
    val = [shard(5, 300)]
    return write_sharded(tmp_path_factory.mktemp("num") / "d", train, val, vocab_size=6000)


def docs_dir(root: Path, first: int, n: int, seed: int, vocab: int = 400) -> Path:
    """``n`` documents of 2 to 30 tokens in 2 shards: document j is ``first + j`` repeated, then
    the end-of-text id 0, so a row shows which documents it holds and where each ends."""
    rng = np.random.default_rng(seed)
    docs = [[first + j] * int(rng.integers(1, 30)) + [0] for j in range(n)]
    half = n // 2
    return write_sharded(root, [docs[:half], docs[half:]], [docs[: n // 4]], vocab_size=vocab)


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return docs_dir(tmp_path_factory.mktemp("docs") / "d", 1, 120, 0)


# ----------------------------------------------------------------------------------------------
# windows


@pytest.mark.parametrize("world", [1, 2])
def test_one_shard_windows_are_the_batches_drawn_before_shards(text_dir, world):
    """A directory from before shards (one train.bin) through the loader: the batches of the
    sampler as it was, on every rank."""
    tokens = load_split(text_dir, "train")
    for rank in range(world):
        want = todays_batches(tokens, 32, 4, 1337, 5, rank, world)
        got = Loader(
            [PreparedSplit(text_dir, "train")], None, 32, 4, 1337, rank=rank, world_size=world
        )
        plain = BatchSampler(tokens, 32, 4, 1337, rank=rank, world_size=world)
        for x, y in want:
            gx, gy = got.next()
            assert torch.equal(gx, x) and torch.equal(gy, y)
            assert all(torch.equal(a, b) for a, b in zip(plain.next(), (x, y), strict=True))


def test_a_one_shard_sharded_directory_draws_the_same_batches(tmp_path):
    stream = (np.arange(3000) * 7 % 251).astype(np.uint16)
    d = write_sharded(tmp_path / "d", [[stream]], [[stream[:100]]], vocab_size=251)
    got = loader(d, batch=6, seed=9)
    for x, y in todays_batches(stream, T, 6, 9, 4):
        gx, gy = got.next()
        assert torch.equal(gx, x) and torch.equal(gy, y)


def test_windows_cover_each_shard_in_proportion_and_never_cross_one(numbered):
    batches, batch = 100, 40
    sampler = loader(numbered, batch=batch, seed=3)
    counts = {1: 0, 2: 0, 3: 0}
    for _ in range(batches):
        x, y = sampler.next()
        w = torch.cat([x, y[:, -1:]], 1)  # the T + 1 tokens of each window
        assert (w[:, 1:] - w[:, :-1] == 1).all()  # consecutive tokens of one shard
        for s in (w[:, 0] // 1000).tolist():
            counts[s] += 1
    n = batches * batch
    valid = {1: 900 - T, 3: 400 - T}  # shard 2 (10 tokens) holds no window
    for s, v in valid.items():
        p = v / sum(valid.values())
        assert abs(counts[s] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), counts
    assert counts[2] == 0


def test_no_shard_holding_a_window_names_the_longest(numbered):
    with pytest.raises(DataError, match=r"\(longest of 3 shards\) has 900 tokens; .* = 1,001"):
        Loader([PreparedSplit(numbered, "train")], None, 1000, 2)


# ----------------------------------------------------------------------------------------------
# packing


def _documents(docs_dir: Path) -> dict[int, list[int]]:
    """document number (its first token) -> its tokens, read from the shards as written."""
    tokens = np.concatenate(
        [np.fromfile(f, np.uint16) for f in sorted(docs_dir.glob("train_*.bin"))]
    )
    ends = np.flatnonzero(tokens == 0) + 1
    return {int(d[0]): d.tolist() for d in np.split(tokens, ends[:-1])}


def _split_after_ends(row: list[int]) -> list[list[int]]:
    """A row's tokens cut after every end-of-text id (0)."""
    pieces, piece = [], []
    for t in row:
        piece.append(t)
        if t == 0:
            pieces.append(piece)
            piece = []
    return pieces + ([piece] if piece else [])


def test_packed_rows_hold_whole_documents_each_once_an_epoch(docs):
    """Rows of whole documents, the row's last one cut at its end; every document once per
    epoch, in an order the seed decides."""
    whole = _documents(docs)
    sampler = loader(docs, batch=3, seed=5, packed=True, document_mask=False)
    seen = []
    while len(seen) < 3 * len(whole) + 1:  # three epochs
        x, y = sampler.next()
        for row in torch.cat([x, y[:, -1:]], 1).tolist():  # each row's block_size + 1 tokens
            pieces = _split_after_ends(row)
            for i, piece in enumerate(pieces):
                want = whole[piece[0]]
                assert piece == (want[: len(piece)] if i == len(pieces) - 1 else want)
                seen.append(piece[0])
    n = len(whole)
    for e in range(3):  # each epoch a permutation of all documents (a cut one counted once)
        assert sorted(seen[e * n : (e + 1) * n]) == sorted(whole), e
    assert seen[:n] != seen[n : 2 * n]  # another order each epoch
    other = loader(docs, batch=3, seed=6, packed=True)
    assert not torch.equal(other.next()[0], loader(docs, batch=3, seed=5, packed=True).next()[0])


def test_document_masks_number_the_documents_and_drop_targets_across_them(docs):
    """With document_mask, doc numbers each row's documents, and no position targets the next
    document's first token; the other targets, and the rows, are those of the plain shift."""
    masked = loader(docs, batch=4, seed=1, packed=True)
    plain = loader(docs, batch=4, seed=1, packed=True, document_mask=False)
    for _ in range(5):
        (x, y, doc), (px, py) = masked.next(), plain.next()
        assert torch.equal(x, px) and torch.equal(px[:, 1:], py[:, :-1])
        for b in range(x.shape[0]):
            ends = torch.cumsum((x[b] == 0).long(), 0)  # documents ended before each position
            assert torch.equal(doc[b], torch.cat([ends.new_zeros(1), ends[:-1]]))
        keep = y != IGNORE
        assert torch.equal(y[keep], py[keep])
        assert torch.equal(~keep, x == 0)  # ignored: exactly the targets after an end


@pytest.mark.parametrize("pe", ["rope", "alibi"])
def test_a_packed_document_computes_what_it_computes_alone(docs, pe, tiny_config):
    from llm_foundry.models import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=400, pos_encoding=pe, max_seq_len=64)).eval()
    x, y, doc = Loader([PreparedSplit(docs, "train")], None, 48, 2, 0, packed=True).next()
    assert (doc.max(1).values >= 2).all()  # several documents a row
    logits = model(x, doc=doc)[0]
    for b in range(x.shape[0]):
        for k in doc[b].unique():
            where = (doc[b] == k).nonzero().flatten()
            s, e = int(where[0]), int(where[-1]) + 1
            torch.testing.assert_close(model(x[b : b + 1, s:e])[0][0], logits[b, s:e],
                                       atol=1e-4, rtol=1e-4)  # fmt: skip
    unmasked = model(x)[0]  # without the mask, later documents see earlier ones
    assert not torch.allclose(unmasked, logits, atol=1e-3)


def test_packing_needs_document_indexes(text_dir):
    with pytest.raises(
        DataError, match=r"train.bin has no document index: .* `llm-foundry prepare --input"
    ):
        Loader([PreparedSplit(text_dir, "train")], None, T, 2, packed=True)


# ----------------------------------------------------------------------------------------------
# ranks, state, prefetch


@pytest.mark.parametrize("packed", [False, True])
def test_ranks_together_draw_the_one_process_batch_and_resume_on_another_world_size(
    docs, tmp_path, packed
):
    other = docs_dir(tmp_path / "o", 200, 60, 1)
    mix = dict(weights=[2.0, 1.0], packed=packed)
    one = loader([docs, other], batch=8, seed=4, **mix)
    ranks = [loader([docs, other], batch=4, seed=4, rank=r, world_size=2, **mix) for r in (0, 1)]
    for _ in range(6):
        whole, parts = one.next(), [r.next() for r in ranks]
        for i, t in enumerate(whole):
            assert torch.equal(torch.cat([p[i] for p in parts]), t)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # saved by 2 ranks
    assert state == one.state_dict() == ranks[1].state_dict()
    resumed = loader([docs, other], batch=8, seed=99, **mix)  # resumed by one process
    resumed.load_state_dict(state)
    for _ in range(6):
        assert all(torch.equal(a, b) for a, b in zip(resumed.next(), one.next(), strict=True))


def test_packed_state_resumes_across_shard_and_epoch_boundaries(docs):
    sampler = loader(docs, batch=3, seed=2, packed=True)
    states, batches = [], []
    for _ in range(100):  # 120 documents, ~1.6 a row: past two epochs
        states.append(json.loads(json.dumps(sampler.state_dict())))
        batches.append(sampler.next())
    assert sampler.epoch[0] >= 2
    for k in (1, 9, 31, 52, 77, 93):
        resumed = loader(docs, batch=3, seed=2, packed=True)
        resumed.load_state_dict(states[k])
        for want in batches[k : k + 5]:
            assert all(torch.equal(a, b) for a, b in zip(resumed.next(), want, strict=True))


def test_prefetch_hands_out_the_batches_in_order_and_saves_the_consumed_state(docs):
    plain, ahead = loader(docs, seed=1, packed=True), loader(docs, seed=1, packed=True)
    feed = Prefetch(ahead, depth=3)
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(feed.next(), plain.next(), strict=True))
    assert feed.state_dict() == plain.state_dict()  # the 5 handed out, not the 8 built
    feed.close()
    assert not feed._thread.is_alive() and ahead.state_dict() == plain.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(ahead.next(), plain.next(), strict=True))


def test_prefetch_raises_the_threads_error_at_its_batch(docs):
    class Failing(Loader):
        def next(self):
            if self.batches == 2:
                raise DataError("shard gone")
            return super().next()

    feed = Prefetch(Failing([PreparedSplit(docs, "train")], None, T, 2, 0), depth=2)
    feed.next(), feed.next()
    with pytest.raises(DataError, match="shard gone"):
        feed.next()
    feed.close()
    assert not feed._thread.is_alive()


# ----------------------------------------------------------------------------------------------
# mixtures


@pytest.mark.parametrize("packed", [False, True])
def test_mixture_rows_come_from_each_source_by_weight_reproducibly(docs, tmp_path, packed):
    """2,000 rows of sources weighted 0.7 / 0.3: each source's share within 5 binomial sigmas
    of its weight (a row's tokens tell its source), and the same rows again from the seed."""
    other = docs_dir(tmp_path / "o", 200, 60, 1)  # documents numbered from 200
    rows = []
    for seed in (11, 11, 12):
        sampler = loader([docs, other], weights=[0.7, 0.3], batch=50, seed=seed, packed=packed)
        rows.append(torch.cat([sampler.next()[0] for _ in range(40)]))
    assert torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
    n = len(rows[0])
    from_a, from_b = (rows[0] >= 1) & (rows[0] < 200), rows[0] >= 200
    assert not (from_a.any(1) & from_b.any(1)).any()  # a row comes from one source
    share_b = int(from_b.any(1).sum())
    assert abs(share_b - 0.3 * n) <= 5 * math.sqrt(n * 0.3 * 0.7), share_b


def test_mixture_specs_and_their_refusals(docs, tmp_path):
    other = docs_dir(tmp_path / "o", 200, 60, 1)
    s = parse_sources(f"{docs}=0.7,{other}=0.3")
    assert [(x.dir, x.weight, x.name) for x in s] == [(docs, 0.7, "d"), (other, 0.3, "o")]
    assert parse_sources(str(docs))[0].dir == docs
    for spec, message in (
        (f"{docs}=0.7,{other}=0", f"--data entry '{other}=0': the weight 0.0 must be a number > 0"),
        (f"{docs}=1,{other}=-2", "the weight -2.0 must be a number > 0"),
        (f"{docs}=1,{other}=lots", "the weight 'lots' must be a number > 0"),
        (f"{docs}=1,{other}=nan", "the weight 'nan' must be a number > 0"),
        (f"{docs}=1,{other}", f"--data entry '{other}': expected DIR=WEIGHT"),
        (f"{docs}=1,{docs}=2", f"--data entry '{docs}=2': {docs} is named twice"),
    ):
        with pytest.raises(DataError, match=message) as err:
            parse_sources(spec)
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------
# training on shards: exact resume, CLI, refusals

TRAIN = dict(block_size=32, max_steps=12, checkpoint_interval=4, eval_interval=4, keep_last=5)


@pytest.fixture(scope="module")
def shakespeare_shards(tmp_path_factory) -> Path:
    return sharded_text(tmp_path_factory.mktemp("sh") / "d", corpus_text(60_000), 4, 2)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _cut_at(full: Path, cut: Path, step: int) -> None:
    shutil.copytree(full, cut)
    for ckpt in (cut / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    write_json_atomic(
        cut / "checkpoints" / "latest.json", {"step": step, "path": f"step_{step:06d}"}
    )


@pytest.mark.parametrize("sampling", ["windows", "packed"])
def test_training_on_shards_resumes_exactly(shakespeare_shards, tmp_path, sampling):
    """Cut at step 4 (packed: in the middle of an epoch's document order, which draws from every
    shard), resumed: the losses of the uninterrupted run, bit for bit."""
    kw = dict(TRAIN, data_sampling=sampling)
    make_trainer(shakespeare_shards, tmp_path / "full", **kw).run()
    state = json.loads((tmp_path / "full/checkpoints/step_000004/state.json").read_text())
    if sampling == "packed":  # the cut lands mid-epoch: some documents used, not all
        documents = sum(sh.documents for sh in split_shards(shakespeare_shards, "train"))
        epoch, cursor = state["sampler"]["documents"][0]
        assert epoch == 0 and 0 < cursor < documents
    _cut_at(tmp_path / "full", tmp_path / "cut", 4)
    make_trainer(shakespeare_shards, tmp_path / "cut", resume=True, **kw).run()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    assert all(math.isfinite(v) for v in _losses(tmp_path / "full").values())


def test_prefetch_changes_no_loss_and_saves_the_batches_trained_on(shakespeare_shards, tmp_path):
    runs = {}
    for depth in (0, 4):
        t = make_trainer(shakespeare_shards, tmp_path / str(depth), data_sampling="packed",
                         prefetch=depth, **TRAIN)  # fmt: skip
        t.run()
        state = json.loads((tmp_path / f"{depth}/checkpoints/step_000008/state.json").read_text())
        runs[depth] = (_losses(tmp_path / str(depth)), state["sampler"], t.sampler.state_dict())
    assert runs[0] == runs[4]
    assert runs[4][1]["batches"] == 8 and runs[4][2]["batches"] == 12


def test_train_cli_on_a_mixture_records_it_and_reports_each_source(
    shakespeare_shards, text_dir, tmp_path, capsys
):
    """``--data a=2,b=1``: run.json records the mixture, validation reports each source and
    their weighted mean; ``--resume --out`` alone continues on it."""
    a, b = shakespeare_shards, tmp_path / "b"
    shutil.copytree(a, b)  # the same tokenizer, the same documents
    flags = [f"--model.{k}={v}" for k, v in TINY.items()] + ["--model.pos_encoding=rope"]
    flags += ["--train.batch_size=4", "--train.block_size=32", "--train.eval_batches=2",
              "--train.sample_tokens=0", "--train.progress=false", "--train.eval_interval=4",
              "--train.checkpoint_interval=4", "--train.data_sampling=packed"]  # fmt: skip
    run = tmp_path / "run"
    assert main(["train", "--data", f"{a}=2,{b}=1", "--out", str(run), *flags,
                 "--train.max_steps=8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "val loss" in out and "(weighted mean of d " in out
    info = json.loads((run / "run.json").read_text())
    assert info["data"]["dir"] == f"{a}=2.0,{b}=1.0"
    assert [s["share"] for s in info["data"]["sources"]] == [2 / 3, 1 / 3]
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ev = next(r for r in evals if "val_loss" in r)
    each = [v for k, v in ev.items() if k.startswith("val_loss/")]
    assert len(each) == 2
    assert ev["val_loss"] == pytest.approx(2 / 3 * each[0] + 1 / 3 * each[1], rel=1e-12)
    assert main(["train", "--out", str(run), "--resume", "--train.max_steps=10"]) == 0
    assert max(_losses(run)) == 10
    # resumed on one of the two: other data, refused
    assert main(["train", "--out", str(run), "--resume", "--data", str(a)]) == 2
    assert "was trained on other data" in capsys.readouterr().err


def _one_line_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_train_refuses_damaged_or_mismatched_shards_in_one_line(
    shakespeare_shards, text_dir, tmp_path, capsys
):
    flags = [f"--model.{k}={v}" for k, v in TINY.items()]
    flags += ["--train.block_size=32", "--train.max_steps=2", "--train.sample_tokens=0",
              "--train.progress=false"]  # fmt: skip
    base = ["train", "--out", str(tmp_path / "r"), *flags]
    # a shard truncated on disk
    cut = tmp_path / "cut"
    shutil.copytree(shakespeare_shards, cut)
    with open(cut / "train_00001.bin", "r+b") as f:
        f.truncate(100)
    err = _one_line_error([*base, "--data", str(cut)], capsys)
    assert "train_00001.bin has 100 bytes" in err and "records" in err
    # a mixture of two tokenizers
    other = sharded_text(tmp_path / "other", corpus_text(20_000).upper(), 2, 1)
    err = _one_line_error([*base, "--data", f"{shakespeare_shards}=1,{other}=1"], capsys)
    assert "were prepared with different tokenizers" in err
    # a weight of 0, named
    err = _one_line_error([*base, "--data", f"{shakespeare_shards}=1,{other}=0"], capsys)
    assert f"--data entry '{other}=0': the weight 0.0 must be a number > 0" in err
    # packing a stream without document indexes
    err = _one_line_error([*base, "--data", str(text_dir), "--train.data_sampling=packed"], capsys)
    assert "train.bin has no document index" in err
    # a run resumed on shards of another tokenizer
    run = tmp_path / "run"
    assert main(["train", "--data", str(shakespeare_shards), "--out", str(run), *flags]) == 0
    err = _one_line_error(["train", "--out", str(run), "--resume", "--data", str(other),
                           "--train.max_steps=3"], capsys)  # fmt: skip
    assert "tokens of another tokenizer" in err and "tokenizer_sha256: saved" in err


def test_packed_text_is_refused_where_it_cannot_work(text_dir, shakespeare_shards, tmp_path):
    with pytest.raises(DataError, match="has no document index"):
        make_trainer(text_dir, tmp_path / "a", data_sampling="packed")
    with pytest.raises(ConfigError, match="pos_encoding='learned': packed documents .* "
                       r"\(or train.document_mask=false\)"):  # fmt: skip
        from llm_foundry.config import ModelConfig
        from llm_foundry.train.config import TrainConfig
        from llm_foundry.train.trainer import Trainer

        Trainer(ModelConfig(**{**TINY, "pos_encoding": "learned"}),
                TrainConfig(data_sampling="packed", block_size=32, progress=False),
                shakespeare_shards, tmp_path / "b")  # fmt: skip
