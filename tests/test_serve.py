"""The OpenAI-compatible server, tested as its users meet it: a real server on a free loopback
port, the official ``openai`` client and plain HTTP, several clients at once. Every greedy
result is compared with the library's own ``generate`` of the same prompt alone."""

from __future__ import annotations

import logging
import os
import socket
import string
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from conftest import assert_decisive

from llm_foundry.checkpoint import save_checkpoint
from llm_foundry.generate import generate
from llm_foundry.messages import shown
from llm_foundry.models import Transformer
from llm_foundry.presets import get_preset
from llm_foundry.tokenizer import CharTokenizer

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from llm_foundry.serve import load_served  # noqa: E402
from llm_foundry.serve.app import create_app  # noqa: E402
from llm_foundry.serve.engine import Engine, Params, Sequence  # noqa: E402

LETTERS = " \n" + string.ascii_letters + string.punctuation  # what the plays' opening holds
PROMPTS = ["ROMEO:", "JULIET: O", "To be, or not", "First Citizen:\nBefore we", "the", "What",
           "KING:", "Good morrow"]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random character model (128 positions) over a fixed vocabulary: letters,
    punctuation, space and newline (what tiny Shakespeare's opening holds), so the model and its
    greedy choices are the same with or without the shared corpus."""
    return char_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt", seed=0, max_seq_len=128)


def char_checkpoint(path, seed: int, chars: str = LETTERS, **sizes):
    """A random LLaMA-style character model over ``chars`` (2 layers, 64 wide unless ``sizes``
    say otherwise; ``seed`` draws its weights) with its tokenizer, saved at ``path``."""
    tok = CharTokenizer.train(chars)
    torch.manual_seed(seed)
    sizes = {**dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2), **sizes}
    save_checkpoint(Transformer(get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size,
                                           **sizes)), path)  # fmt: skip
    tok.save(path / "tokenizer.json")
    return path


def wait_healthy(url: str, seconds: float) -> None:
    """Poll ``url``/health until it answers 200 (or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


@contextmanager
def running(checkpoint, app_options: dict | None = None, **kwargs):
    """A real server on a free 127.0.0.1 port; yields its base URL and the engine."""
    served = load_served(checkpoint, name="tiny", **kwargs)
    served.engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(served, **(app_options or {}))
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 20)
    try:
        yield url, served
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        served.engine.stop()
        sock.close()


def solo(checkpoint, prompt: str, n: int) -> str:
    """The library's greedy continuation of ``prompt`` alone, every choice checked decisive."""
    from llm_foundry.loading import load_any

    model, tok, _ = load_any(checkpoint)
    return greedy(model, tok, prompt, n)


def greedy(model, tok, prompt: str, n: int) -> str:
    """``generate``'s greedy continuation of ``prompt`` alone, every choice checked decisive."""
    ids = torch.tensor([tok.encode(prompt)])
    out = generate(model, ids, n, temperature=0)
    with torch.no_grad():
        logits = model(out[:, :-1])[0][0, ids.shape[1] - 1 :]
    assert_decisive(logits, f"greedy continuation of {prompt!r}")
    return tok.decode(out[0, ids.shape[1] :].tolist())


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_completions_chat_streaming_stop_and_usage_through_the_openai_client(checkpoint):
    with running(checkpoint) as (url, served):
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        want = solo(checkpoint, "ROMEO:", 24)
        r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 24)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        # streaming: OpenAI's chunk shape; the pieces join into the same text; usage at the end
        chunks = list(c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=24,
                      temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
        assert all(ch.object == "text_completion" and ch.id == chunks[0].id for ch in chunks)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
        # a stop string ends the text before it
        stop = want[5:7]
        r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0,
                                 stop=[stop])  # fmt: skip
        assert r.choices[0].text == want[: want.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        # logprobs: the chosen token's and the alternatives, from the model's distribution
        r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=4, temperature=0,
                                 logprobs=2)  # fmt: skip
        lp = r.choices[0].logprobs
        assert lp.tokens == list(want[:4]) and len(lp.top_logprobs) == 4
        assert all(max(top.values()) == pytest.approx(v) for top, v in
                   zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
        # chat: the built-in template renders the prompt; the reply ends at its end of turn
        from llm_foundry.chat import BUILTIN_TEMPLATE, render_chat

        messages = [{"role": "user", "content": "Who speaks?"}]
        prompt = render_chat(BUILTIN_TEMPLATE, messages, add_generation_prompt=True)
        full = solo(checkpoint, prompt, 30)
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                                      temperature=0)  # fmt: skip
        cut = full.split(served.chat_stop[0])[0] if served.chat_stop else full
        assert r.choices[0].message.content == cut and r.choices[0].message.role == "assistant"
        chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=30,
                      temperature=0, stream=True))  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_eight_concurrent_clients_each_get_what_they_get_alone(checkpoint, cuda_graph):
    lengths = [40, 12, 30, 25, 8, 50, 17, 33]
    want = [solo(checkpoint, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    with running(checkpoint, slots=8, cuda_graph=cuda_graph) as (url, served):
        c = client(url)

        def ask(i):
            r = c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i],
                                     temperature=0)  # fmt: skip
            return r.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(8)))
        assert got == want
        assert served.engine.stats.busy_slot_steps > served.engine.stats.decode_steps  # batched
        assert served.engine.busy() == 0


def run_moving_rows(engine, tok, lengths: list[int]):
    """Nine prompts of 1-3 repeats with these lengths submitted at once and stepped to the end:
    (prompts, sequences, how many steps moved the rows left)."""
    prompts = [PROMPTS[i % 8] * (1 + i % 3) for i in range(9)]
    seqs = [Sequence(tok.encode(p), Params(max_tokens=n, temperature=0), lambda k, v: None)
            for p, n in zip(prompts, lengths, strict=True)]  # fmt: skip
    engine.submit(seqs)
    moved = 0
    while any(not s.finished for s in seqs):
        before = engine.t
        engine.step()
        moved += engine.t < before
    return prompts, seqs, moved


def test_rows_that_move_in_the_cache_keep_their_tokens(checkpoint):
    """A cache of 132 positions for 128-token rows: rows move left (compaction) and right (a
    longer prompt joining) many times; every sequence still equals its solo run."""
    served = load_served(checkpoint, slots=3)
    engine = Engine(served.engine.model, served.tokenizer, slots=3, capacity=132)
    lengths = [60 + 7 * i for i in range(9)]
    prompts, seqs, moved = run_moving_rows(engine, served.tokenizer, lengths)
    assert moved >= 3
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        room = min(n, 128 - len(p))
        assert served.tokenizer.decode(seqs[i].tokens) == solo(checkpoint, p, room), i


class _PoisonRow:
    """The engine's model, with one batch row's decode-step logits made NaN once ``on``."""

    def __init__(self, model, row: int):
        self.model, self.row, self.on = model, row, False

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, idx, **kw):
        out = self.model(idx, **kw)
        if self.on and idx.shape == (idx.shape[0], 1) and idx.shape[0] > self.row:
            out[0][self.row] = float("nan")
        return out


def test_greedy_rows_read_as_one_batch_keep_each_request_its_own_fate(checkpoint, monkeypatch):
    """Greedy rows take their tokens from one read of the batch's argmax (row by row, each
    row's two reads of the device paced a GPU); a sampled row beside them still samples with its
    own seed, and a row whose logits turn NaN fails alone, saying why, while the others end with
    their solo tokens."""
    from llm_foundry.serve import engine as engine_module

    sampled = []
    sample_next = engine_module.sample_next
    monkeypatch.setattr(engine_module, "sample_next",
                        lambda logits, **kw: sampled.append(kw["temperature"])
                        or sample_next(logits, **kw))  # fmt: skip
    served = load_served(checkpoint, slots=3)
    tok = served.tokenizer

    def run(params: list[Params], poison: int | None = None, after: int = 5):
        engine = Engine(served.engine.model, tok, slots=3)
        if poison is not None:
            engine.model = _PoisonRow(engine.model, poison)
        ends = {}
        seqs = [Sequence(tok.encode(PROMPTS[i]), p, lambda k, v, i=i: ends.setdefault(i, v)
                         if k == "done" else None) for i, p in enumerate(params)]  # fmt: skip
        engine.submit(seqs)
        steps = 0
        while any(not s.finished for s in seqs):
            engine.step()
            steps += 1
            if poison is not None and steps == after:
                engine.model.on = True
        return seqs, ends

    params = [Params(max_tokens=20, temperature=0), Params(max_tokens=20, temperature=0),
              Params(max_tokens=20, temperature=1.0, seed=7)]  # fmt: skip
    seqs, ends = run(params)
    assert ends == {0: "length", 1: "length", 2: "length"}
    # alone: each greedy row's first token (after its prefill) and every token of the sampled one
    assert sorted(sampled) == [0, 0] + [1.0] * 20
    for i in (0, 1):
        assert tok.decode(seqs[i].tokens) == solo(checkpoint, PROMPTS[i], 20), i
    alone, _ = run([params[2]])  # the seeded row, sampled alone
    assert seqs[2].tokens == alone[0].tokens
    seqs, ends = run(params, poison=1)
    assert ends[1].startswith("error: ValueError: the model produced non-finite logits (NaN)")
    assert ends[0] == ends[2] == "length" and 0 < len(seqs[1].tokens) < 20
    assert tok.decode(seqs[0].tokens) == solo(checkpoint, PROMPTS[0], 20)
    assert seqs[2].tokens == alone[0].tokens


class _Replays:
    """Stands in for a CUDA graph on the CPU: "captured" once, each replay runs the static step."""

    captured = replayed = 0

    def __init__(self, dec):
        self.dec = dec
        type(self).captured += 1

    def replay(self):
        type(self).replayed += 1
        self.dec.logits = self.dec._run(self.dec._model())


@pytest.mark.parametrize("graphs", ["static", "captured"])
def test_cuda_graph_steps_keep_every_row_its_solo_tokens(checkpoint, graphs, monkeypatch):
    """``cuda_graph=True`` on the CPU: every step is the static step over rows 0..b-1 (b: 1, 2,
    or the 3 slots), run eagerly ("static") or replayed by stand-in graphs captured as on CUDA
    ("captured": each size once, at warm-up, and every step a replay). Rows move in the cache
    and join and leave as in the eager test; every sequence equals its solo run."""
    from llm_foundry import decode_graph

    if graphs == "captured":
        monkeypatch.setattr(decode_graph, "captures", lambda device: True)
        monkeypatch.setattr(decode_graph.StaticDecoder, "_capture",
                            lambda d: setattr(d, "graph", _Replays(d)))  # fmt: skip
        _Replays.captured = _Replays.replayed = 0
    served = load_served(checkpoint, slots=3)
    engine = Engine(served.engine.model, served.tokenizer, slots=3, capacity=132,
                    cuda_graph=True)  # fmt: skip
    engine.warm_up()
    if graphs == "captured":  # rounded up to whole buckets of positions, as on CUDA
        assert engine.capacity == decode_graph.BUCKET and _Replays.captured == 3
    lengths = [116 - 7 * i for i in range(9)]  # the first rows finish last: b shrinks
    sizes, step = [], engine._static_step
    engine._static_step = lambda b, *a: (sizes.append(b), step(b, *a))[1]
    prompts, seqs, moved = run_moving_rows(engine, served.tokenizer, lengths)
    assert moved >= 1 and len(set(sizes)) >= 2 and len(sizes) == engine.stats.decode_steps
    if graphs == "captured":
        assert _Replays.captured == 3 and _Replays.replayed == engine.stats.decode_steps + 3
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        room = min(n, 128 - len(p))
        got = served.tokenizer.decode(seqs[i].tokens)
        assert got == solo(checkpoint, p, room), i


def test_cuda_graph_with_adapters_is_refused_in_one_line(checkpoint):
    served = load_served(checkpoint, slots=2)
    with pytest.raises(ValueError, match="--cuda-graph with --adapter") as e:
        Engine(served.engine.model, served.tokenizer, slots=2, adapters=object(), cuda_graph=True)
    assert "\n" not in str(e.value)


def test_a_late_request_gets_its_first_token_before_the_long_ones_finish(checkpoint):
    with running(checkpoint, slots=4) as (url, served):
        c = client(url)
        ends = []

        def long(i):
            r = c.completions.create(model="tiny", prompt=PROMPTS[i],
                                     max_tokens=128 - len(PROMPTS[i]), temperature=0)  # fmt: skip
            ends.append(time.monotonic())
            return r

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(long, i) for i in range(3)]
            deadline = time.monotonic() + 10
            while served.engine.busy() < 3 and time.monotonic() < deadline:
                time.sleep(0.001)  # the long requests are decoding
            stream = c.completions.create(model="tiny", prompt="the", max_tokens=5,
                                          temperature=0, stream=True)  # fmt: skip
            next(iter(stream))
            first = time.monotonic()
            for f in futures:
                f.result()
        assert first < min(ends)


def test_a_client_that_disconnects_frees_its_slot(checkpoint):
    with running(checkpoint, slots=1, max_queue=0) as (url, served):
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 120, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert served.engine.busy() == 1
        deadline = time.monotonic() + 10
        while served.engine.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.engine.busy() == 0 and served.engine.stats.cancelled == 1
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_full_queue_answers_503_with_retry_after(checkpoint):
    """One slot and a queue of one: with the engine paused, two requests are taken (one for the
    slot, one waiting) and the third is refused; resumed, both taken ones complete."""
    with running(checkpoint, slots=1, max_queue=1) as (url, served):
        served.engine.stop()  # paused: nothing leaves the queue
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 5}
        with ThreadPoolExecutor(2) as pool:
            taken = [pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)]
            deadline = time.monotonic() + 10
            while served.engine.queue_length() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            taken.append(pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60))
            while served.engine.queue_length() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            third = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert "busy" in third.json()["error"]["message"]
            served.engine.start()
            assert [f.result().status_code for f in taken] == [200, 200]


def test_bad_requests_get_openai_errors_and_leave_the_others_alone(checkpoint):
    want = solo(checkpoint, "KING:", 100)
    with running(checkpoint, slots=4) as (url, _):
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(
                httpx.post, url + "/v1/completions", timeout=60,
                json={"model": "tiny", "prompt": "KING:", "max_tokens": 100, "temperature": 0},
            )  # fmt: skip
            post = lambda body, **kw: httpx.post(url + "/v1/completions", timeout=10, **kw,  # noqa: E731
                                                 **({"json": body} if body is not None else {}))  # fmt: skip
            r = post(None, content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = post({"model": "tiny", "prompt": "a", "max_tokens": "ten"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = post({"model": "tiny", "prompt": "a", "temperature": -1})
            assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
            r = post({"model": "gpt-9", "prompt": "a"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = post({"model": "tiny", "prompt": "ab" * 80})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded"
            r = post({"model": "tiny", "prompt": "\u6771"})  # not in the character vocabulary
            assert r.status_code == 400 and "cannot be encoded" in r.json()["error"]["message"]
            r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            with pytest.raises(openai.BadRequestError):
                client(url).completions.create(model="tiny", prompt="a", n=0)
            assert busy.result().json()["choices"][0]["text"] == want
        metrics = httpx.get(url + "/metrics").text
        assert 'llm_foundry_requests_total{endpoint="completions",status="400"} 6' in metrics
        assert 'llm_foundry_requests_total{endpoint="completions",status="404"} 1' in metrics
        assert "llm_foundry_slots_busy 0" in metrics


def test_n_choices_and_seeds_are_reproducible(checkpoint):
    with running(checkpoint) as (url, _):
        c = client(url)
        ask = lambda: c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=20,  # noqa: E731
                                           temperature=1.0, seed=7, n=3)  # fmt: skip
        a, b = ask(), ask()
        texts = [ch.text for ch in a.choices]
        assert texts == [ch.text for ch in b.choices] and len(set(texts)) > 1
        assert a.usage.completion_tokens == 60


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


@pytest.mark.heavy
def test_a_soak_of_hundreds_of_requests_leaks_no_slot_and_no_memory(checkpoint):
    with running(checkpoint, slots=8, max_queue=64) as (url, served):
        c = client(url)

        def ask(i):
            kind = i % 3
            if kind == 2:  # a client that leaves mid-stream
                with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                        "model": "tiny", "prompt": PROMPTS[i % 8], "max_tokens": 60,
                        "stream": True}) as r:  # fmt: skip
                    next(r.iter_lines())
                return None
            return c.completions.create(model="tiny", prompt=PROMPTS[i % 8],
                                        max_tokens=4 + i % 9, temperature=0).choices[0].text  # fmt: skip

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, range(60)))  # warm-up: allocator pools, client connections
            base = _rss_mib()
            start = time.monotonic()
            results = list(pool.map(ask, range(60, 360)))
        took = time.monotonic() - start
        deadline = time.monotonic() + 10
        while served.engine.busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        grew = _rss_mib() - base
        assert served.engine.busy() == 0 and served.engine.queue_length() == 0
        assert sum(r is not None for r in results) == 200
        assert grew < 50, f"resident memory grew {grew:.0f} MiB over 300 requests ({took:.0f} s)"


def test_a_client_gone_before_its_body_is_sent_is_counted_not_logged_as_a_failure(checkpoint):
    """A body cut short by the client's close is a 499 in /metrics, never the 60-line 'Exception
    in ASGI application' (the catch-all 500 handler re-raises into uvicorn's log)."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    with running(checkpoint) as (url, served):
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            port = int(url.rsplit(":", 1)[1])
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b'application/json\r\nContent-Length: 1000\r\n\r\n{"prompt"'
                    )
            line = 'llm_foundry_requests_total{endpoint="completions",status="499"} 3'
            deadline = time.monotonic() + 10
            while line not in httpx.get(url + "/metrics").text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert line in httpx.get(url + "/metrics").text
            r = client(url).completions.create(
                model="tiny", prompt="RO", max_tokens=3, temperature=0
            )
            assert r.choices[0].text == solo(checkpoint, "RO", 3)  # the server goes on
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


@pytest.mark.heavy
@pytest.mark.parametrize("flags", [[], ["--cuda-graph"]], ids=["eager", "cuda_graph"])
def test_the_serve_command_starts_a_server_a_client_can_use(checkpoint, tmp_path, flags):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llm_foundry", "serve", "--checkpoint", str(checkpoint),
           "--port", str(port), "--model-name", "tiny", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60)
        r = client(url).completions.create(model="tiny", prompt="ROMEO:", max_tokens=10,
                                           temperature=0)  # fmt: skip
        assert r.choices[0].text == solo(checkpoint, "ROMEO:", 10)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert f"serving tiny on http://127.0.0.1:{port}/v1" in out, err
    assert f"; chat page at http://127.0.0.1:{port}/\n" in out
    if flags:  # on this CPU: the static step, eagerly, said once; no graph is captured
        assert "note: --cuda-graph: no CUDA graphs on cpu; the static decode step runs " in err
        assert err.count("note: --cuda-graph") == 1
    assert "capturing" not in out + err and "ready in" not in out + err
    assert "without --cuda-graph" not in err  # the GPU's note: not on a CPU


def test_the_serve_command_refuses_cuda_graph_with_adapters_before_loading(tmp_path, capsys):
    from llm_foundry.cli import main

    args = ["serve", "--checkpoint", str(tmp_path / "absent"), "--cuda-graph", "--adapter",
            f"a={tmp_path}"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--cuda-graph with --adapter" in err and "absent" not in err and err.count("\n") == 1


def test_a_gpu_served_without_cuda_graphs_is_told_to_add_them():
    """Eager decoding on a GPU is paced by kernel launches (14x slower for one client on an H100):
    the command says so there, and only where --cuda-graph would apply."""
    from llm_foundry.cli.serve import eager_gpu_note

    note = eager_gpu_note("cuda", cuda_graph=False, adapters={})
    assert note.startswith("note: decoding on cuda without --cuda-graph") and "\n" not in note
    assert note.endswith("; add --cuda-graph")
    assert eager_gpu_note("cuda", cuda_graph=True, adapters={}) is None
    assert eager_gpu_note("cuda", cuda_graph=False, adapters={"a": "dir"}) is None  # refused there
    assert eager_gpu_note("cpu", cuda_graph=False, adapters={}) is None


def test_without_fastapi_the_install_line_is_given(checkpoint, monkeypatch, capsys):
    import re

    from llm_foundry.cli import main
    from llm_foundry.package import install_line

    for name in [m for m in sys.modules if m.split(".")[0] in ("fastapi", "uvicorn")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "llm_foundry.serve.app")
    assert main(["serve", "--checkpoint", str(checkpoint)]) == 2  # one line, no traceback
    err = capsys.readouterr().err
    assert re.search("^llm-foundry serve: error: serve needs FastAPI and uvicorn: "
                     + re.escape(install_line("serve")), err) and err.count("\n") == 1  # fmt: skip
    monkeypatch.setitem(sys.modules, "uvicorn", uvicorn)  # FastAPI alone missing: the same line
    assert main(["serve", "--checkpoint", str(checkpoint)]) == 2
    assert install_line("serve") in capsys.readouterr().err


def test_a_quantized_model_is_served_as_generate_decodes_it(checkpoint):
    """`serve --quantize int8`: the engine holds int8 projections and a request's greedy text is
    the library's greedy generation with the same quantized weights."""
    from llm_foundry.loading import load_any
    from llm_foundry.models.quant import Int8Linear

    model, tok, _ = load_any(checkpoint, quantize="int8")
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    out = generate(model, ids, 16, temperature=0)
    want = tok.decode(out[0, ids.shape[1] :].tolist())
    with running(checkpoint, quantize="int8") as (url, served):
        assert any(isinstance(m, Int8Linear) for m in served.engine.model.modules())
        r = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0)  # fmt: skip
        assert r.choices[0].text == want


# ---- misuse: nothing a client sends ends the server, every error is OpenAI's ------------------

SMALL_CHARS = "USERAINT: \na"  # what the built-in chat template writes around the message "a"
SMALL_PROMPT = "USER: a"
SMALL_MESSAGES = [{"role": "user", "content": "a"}]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """A random character model over 12 characters (64 positions): fewer tokens than the 20
    alternatives a chat request may ask for, and enough to write a built-in chat prompt."""
    path = tmp_path_factory.mktemp("serve-small") / "ckpt"
    return char_checkpoint(path, seed=2, chars=SMALL_CHARS, max_seq_len=64)


@pytest.fixture(scope="module")
def small_server(small_checkpoint):
    """One server on the small model (2 slots, a queue of 2) and its solo greedy texts."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, render_chat

    chat = render_chat(BUILTIN_TEMPLATE, SMALL_MESSAGES, add_generation_prompt=True)
    with running(small_checkpoint, slots=2, max_queue=2) as (url, served):
        reply = solo(small_checkpoint, chat, 8)
        for stop in served.chat_stop:
            reply = reply.split(stop)[0]
        greedy = {"completions": solo(small_checkpoint, SMALL_PROMPT, 8), "chat": reply}
        yield url, served, greedy


def ask(url, endpoint: str, body: dict | None = None, **kw) -> httpx.Response:
    """POST ``body`` as JSON text (NaN and Infinity included, as Python's json writes them)."""
    import json

    if body is not None:
        kw = {"content": json.dumps(body), "headers": {"content-type": "application/json"}, **kw}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(url + path, timeout=60, **kw)


def base_body(endpoint: str) -> dict:
    what = {"messages": SMALL_MESSAGES} if endpoint == "chat" else {"prompt": SMALL_PROMPT}
    return {"model": "tiny", **what, "max_tokens": 8, "temperature": 0}


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    """``r`` is OpenAI's error body with ``status``, its message one line of bounded length."""
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and "\n" not in error["message"]
    assert len(error["message"]) < 400, error["message"][:400]
    return error


def assert_still_serves(url, greedy) -> None:
    """A normal request after the odd one gets its solo greedy text."""
    for endpoint in ("completions", "chat"):
        r = ask(url, endpoint, base_body(endpoint))
        assert r.status_code == 200, r.text[:300]
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        assert text == greedy[endpoint], endpoint


BAD_PROMPTS = ([], [-1], [12], [10**30], [True], [1.5], ["U", "S"], [[1, 2]], "", "U" * 100,
               list(range(12)) * 1000, [-1] * 10_000, ["a"] * 10_000, {"a": 1}, 5, None,
               "\u6771")  # fmt: skip
BAD_MESSAGES = ([], [{}], [{"role": "user"}], [{"role": "user", "content": None}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                [{"role": "x" * 10_000, "content": "a"}], SMALL_MESSAGES * 10_000, "hi",
                [{"role": 5, "content": "a"}], [[[[[[["a"]]]]]]])  # fmt: skip
GREEDY = "greedy"  # 200 with the solo greedy text
NAN, INF = float("nan"), float("inf")
C, CH = "completions", "chat"
EXTREMES = [  # (endpoint, fields over the base request, the answer)
    *[(e, {"temperature": t}, GREEDY) for e in (C, CH) for t in (1e-40, 5e-324, 1e-300)],
    (C, {"temperature": 1e-40, "stream": True}, GREEDY),
    (C, {"temperature": 2.0, "seed": 1}, 200),
    *[(C, {"temperature": t}, 400) for t in (-1e-40, 2.0000001, NAN, INF, 1e308, "0", True)],
    *[(C, {"temperature": 1.0, "top_p": p}, GREEDY) for p in (1e-40, 5e-324)],
    *[(C, {"top_p": p}, 400) for p in (0, -0.0, 1.0000001, NAN, INF, "1")],
    (C, {"temperature": 1.0, "seed": 2**63 - 1, "n": 2}, 200),
    (C, {"temperature": 1.0, "seed": -(2**63)}, 200),
    *[(C, {"seed": s}, 400) for s in (2**63, -(2**63) - 1, 10**30, 1.5, "7", True)],
    (C, {"max_tokens": 1}, 200),
    (C, {"max_tokens": 57}, 200),  # the prompt's 7 tokens and 57 fill the 64 of the context
    *[(C, {"max_tokens": m}, 400) for m in (0, -1, 58, 65, 10**30, 1.0, NAN, "8")],
    *[(CH, {"max_completion_tokens": m}, 400) for m in (0, 10**30)],
    *[(C, {"logprobs": k}, 200) for k in (0, 5)],
    *[(C, {"logprobs": k}, 400) for k in (6, -1, True, 10**20)],
    *[(CH, {"logprobs": True, "top_logprobs": k}, 200) for k in (0, 12, 20)],
    *[(CH, {"logprobs": True, "top_logprobs": k}, 400) for k in (21, -1, 10**20)],
    *[(CH, {"logprobs": v}, 400) for v in ("yes", 1)],
    (C, {"n": 4}, 200),  # slots + queue
    *[(C, {"n": n}, 400) for n in (5, 16, 0, 10**9)],
    (C, {"stop": "U" * 100_000}, GREEDY),  # never met
    (C, {"stop": ["\n"] * 4}, 200),
    *[(C, {"stop": s}, 400) for s in ("", [""], ["a"] * 5, ["a"] * 10_000, [1], [["a"]])],
    (C, {"prompt": [0]}, 200),
    (C, {"prompt": [11]}, 200),
    *[(C, {"prompt": p}, 400) for p in BAD_PROMPTS],
    *[(CH, {"messages": m}, 400) for m in BAD_MESSAGES],
    *[(C, {"stream": v}, 400) for v in ("yes", 1, ["x"] * 10_000)],
    (C, {"stream": True, "stream_options": {"include_usage": True}}, GREEDY),
    *[(C, {"stream": True, "stream_options": o}, 400) for o in ("yes", {"include_usage": 1})],
    *[(C, {"model": m}, 404) for m in (["x"] * 10_000, 5, "x" * 100_000)],
]


@pytest.mark.parametrize(
    "endpoint, fields, want",
    EXTREMES,
    ids=[e + "-" + ",".join(f"{k}={shown(v, 24)}" for k, v in f.items()) for e, f, _ in EXTREMES],
)
def test_no_request_value_ends_the_server(small_server, endpoint, fields, want):
    """Extreme values of every request field get an answer (200, or OpenAI's one-line error
    that names no more than a line of the value) and the server goes on serving: a normal
    request after each gets its solo greedy text."""
    url, _, greedy = small_server
    r = ask(url, endpoint, {**base_body(endpoint), **fields})
    if want in (200, GREEDY):
        assert r.status_code == 200, r.text[:300]
        if fields.get("stream"):
            import json

            lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            chunks = [json.loads(x) for x in lines[:-1]]
            text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
        else:
            choices = r.json()["choices"]
            assert len(choices) == fields.get("n", 1)
            choice = choices[0]
            text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
            if fields.get("logprobs") is True:  # chat: every token's alternatives, up to all
                k = min(fields["top_logprobs"], len(SMALL_CHARS))
                assert all(len(t["top_logprobs"]) == k for t in choice["logprobs"]["content"])
        if want == GREEDY:
            assert text == greedy[endpoint]
    else:
        assert_openai_error(r, want)
    assert_still_serves(url, greedy)


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    """A random model over a byte-level BPE (Hugging Face ``tokenizers``) of ASCII pieces only:
    its tokens are 1 to several whole characters each."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("serve-bpe") / "ckpt"
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=160, show_progress=False)
    tok.train_from_iterator([" ".join(PROMPTS)] * 20, trainer)  # no byte outside the text
    torch.manual_seed(3)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.get_vocab_size(), n_layers=2,
                     dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_completion_text_offsets_locate_each_token_in_the_text(bpe_checkpoint):
    """``logprobs.text_offset``: where each returned token begins in the completion's text (from
    0, as vLLM without echo), through the official client, whole and streamed (each chunk's
    offsets go on from the tokens sent before, also while a stop string holds text back)."""
    with running(bpe_checkpoint) as (url, _):
        c = client(url)
        ask = dict(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0, logprobs=2)
        r = c.completions.create(**ask)
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.text_offset) == r.usage.completion_tokens == 24
        assert any(len(t) > 1 for t in lp.tokens)  # multi-character tokens
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        for token, at in zip(lp.tokens, lp.text_offset, strict=True):
            assert text[at : at + len(token)] == token
        # a stop string the text's end begins, ended by a byte the tokenizer lacks: held to the end
        for stop in ([], [text[-3:] + "\x00"]):
            chunks = list(c.completions.create(**ask, stream=True, stop=stop))
            assert "".join(ch.choices[0].text for ch in chunks) == text
            streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
            assert len(streamed) > 1
            assert [t for b in streamed for t in b.tokens] == lp.tokens
            assert [o for b in streamed for o in b.text_offset] == lp.text_offset


def test_completion_logprobs_past_a_tiny_vocabulary_list_all_of_it(tmp_path):
    """logprobs=5 over a 3-token vocabulary: the 3 alternatives of each token, a distribution
    (their probabilities add up to 1), the chosen one among them."""
    import math

    path = tmp_path / "ckpt"
    tok = CharTokenizer.train("ab ")
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=1, dim=32,
                     n_heads=2, max_seq_len=32)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
    tok.save(path / "tokenizer.json")
    with running(path, slots=1) as (url, _):
        body = {"model": "tiny", "prompt": "ab", "max_tokens": 4, "logprobs": 5, "seed": 3}
        r = ask(url, "completions", body)
        assert r.status_code == 200, r.text[:300]
        lp = r.json()["choices"][0]["logprobs"]
        for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                      strict=True):  # fmt: skip
            assert set(top) == {"a", "b", " "}
            assert sum(math.exp(v) for v in top.values()) == pytest.approx(1, abs=1e-5)
            assert top[token] == pytest.approx(chosen, abs=1e-6)
        assert ask(url, "completions", {**body, "logprobs": None}).status_code == 200


def test_a_row_that_raises_fails_alone_and_the_engine_goes_on(small_server, monkeypatch):
    """Whatever a row raises (here: decoding its text, then the shared decode step, then a
    prompt past the model's vocabulary given to the engine directly) fails that request with
    OpenAI's error body; the engine's loop survives and the next request is served."""
    import threading as th

    url, served, greedy = small_server
    engine = served.engine

    def broken(ids):
        raise RuntimeError("the decoder broke")

    from llm_foundry.serve.detok import WindowText

    monkeypatch.setattr(engine, "detokenizer", lambda prompt: WindowText(broken))
    error = assert_openai_error(ask(url, "completions", base_body("completions")), 500)
    assert error["type"] == "server_error" and "the decoder broke" in error["message"]
    monkeypatch.undo()
    assert_still_serves(url, greedy)

    def failing_step(*args, **kwargs):
        raise RuntimeError("the decode step broke")

    monkeypatch.setattr(engine, "decode", failing_step)  # the one-row decode step
    error = assert_openai_error(ask(url, "completions", base_body("completions")), 500)
    assert "the decode step broke" in error["message"]
    monkeypatch.undo()
    assert_still_serves(url, greedy)

    done, finished = {}, th.Event()

    def emit(kind, payload):
        if kind == "done":
            done["reason"] = payload
            finished.set()

    vocab = engine.model.cfg.vocab_size
    engine.submit([Sequence([1, vocab + 5], Params(max_tokens=4, temperature=0), emit)])
    assert finished.wait(30)
    assert done["reason"].startswith("error") and f"[0, {vocab})" in done["reason"]
    assert_still_serves(url, greedy)


UNSUPPORTED = [  # (endpoint, field, a value that is not its "off" one)
    (C, "logit_bias", {"5": 100}),
    (CH, "logit_bias", {"5": -100}),
    (C, "presence_penalty", 1.5),
    (CH, "frequency_penalty", -0.5),
    (C, "best_of", 3),
    (C, "echo", True),
    (C, "suffix", "a"),
    (CH, "response_format", {"type": "json_object"}),
    (CH, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CH, "tool_choice", "required"),
    (CH, "functions", [{"name": "f", "parameters": {}}]),
    (CH, "function_call", "auto"),
    (CH, "modalities", ["text", "audio"]),
    (CH, "audio", {"voice": "alloy", "format": "wav"}),
    (CH, "reasoning_effort", "high"),
]


@pytest.mark.parametrize("endpoint, field, value", UNSUPPORTED)
def test_unsupported_openai_fields_are_refused_by_name(small_server, endpoint, field, value):
    url, _, _ = small_server
    error = assert_openai_error(ask(url, endpoint, {**base_body(endpoint), field: value}), 400)
    assert error["param"] == field and f"'{field}'" in error["message"]


CHAT_REFUSED = [{"role": "wizard", "content": "Hi"}, {"role": "tool", "content": "a"},
                {"content": "a"}, {"role": "user", "content": None},
                {"role": "user", "content": 5}]  # fmt: skip


def test_a_chat_message_fine_tuning_refuses_is_refused_by_the_server(checkpoint, tmp_path):
    """A message the SFT loader refuses (a role outside its list, content that is neither a
    string nor text parts) is a 400 naming 'messages' and the message, through the official
    client too; each role the loader takes is served, and 'developer' (taken as 'system')."""
    import json

    from llm_foundry.data.sft import ROLES, read_rows
    from llm_foundry.data.sources import DataError

    rows = tmp_path / "rows.jsonl"
    with running(checkpoint, slots=2) as (url, _):
        for message in CHAT_REFUSED:
            rows.write_text(json.dumps({"messages": [message, {"role": "assistant",
                                                               "content": "a"}]}))  # fmt: skip
            with pytest.raises(DataError):
                read_rows(rows)
            body = {"model": "tiny", "messages": [message], "max_tokens": 4}
            error = assert_openai_error(ask(url, CH, body), 400)
            assert error["param"] == "messages" and "messages[0]" in error["message"], error
            if isinstance(message.get("content"), str):  # the role is named, and the valid ones
                assert json.dumps(message) in error["message"]  # as the client wrote it
                assert all(role in error["message"] for role in (*ROLES, "developer"))
            with pytest.raises(openai.BadRequestError) as e:
                client(url).chat.completions.create(model="tiny", messages=[message],
                                                    max_tokens=4)  # fmt: skip
            assert e.value.status_code == 400 and e.value.param == "messages"
        for role in (*ROLES, "developer"):
            r = ask(url, CH, {"model": "tiny", "messages": [{"role": role, "content": "Hi"}],
                              "max_tokens": 4})  # fmt: skip
            assert r.status_code == 200, r.text[:300]


def test_a_max_tokens_past_the_context_left_is_refused_as_openai_does(checkpoint):
    """Prompt + max_tokens past the context (128) is OpenAI's 400 context_length_exceeded naming
    the numbers and the field, for any size of max_tokens; what fits is served in full; with
    max_tokens left out a chat reply runs to the end of the context (generate's, cut at the
    template's end of turn)."""
    from llm_foundry.chat import BUILTIN_TEMPLATE, render_chat

    with running(checkpoint) as (url, served):
        c = client(url)
        r = c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=122, temperature=0)
        assert r.usage.completion_tokens == 122 and r.choices[0].finish_reason == "length"
        for asked in (123, 128, 10**6):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=asked)
            assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
            said = (f"maximum context length is 128 tokens; you requested {6 + asked} tokens: "
                    f"6 in the prompt and {asked} for the completion")  # fmt: skip
            assert said in e.value.message
            assert "at most 122" in e.value.message
        messages = [{"role": "user", "content": "Who speaks?"}]
        prompt = render_chat(BUILTIN_TEMPLATE, messages, add_generation_prompt=True)
        room = 128 - len(prompt)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=messages,
                                      max_completion_tokens=room + 1)  # fmt: skip
        assert e.value.code == "context_length_exceeded"
        assert e.value.param == "max_completion_tokens"
        r = c.chat.completions.create(model="tiny", messages=messages, temperature=0)
        full = solo(checkpoint, prompt, room)
        cut = full.split(served.chat_stop[0])[0] if served.chat_stop else full
        assert r.choices[0].message.content == cut
        if cut == full:
            assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
        # a prompt that fills the context is refused by the same code, naming the prompt
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="ab" * 64)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")


def test_fields_unknown_to_openai_are_refused(small_server):
    url, _, _ = small_server
    for endpoint, fields in ((C, {"top_k": 5}), (CH, {"prompt": "a"}), (C, {"messages": []}),
                             (C, {"x" * 10_000: 1, "y": 2})):  # fmt: skip
        error = assert_openai_error(ask(url, endpoint, {**base_body(endpoint), **fields}), 400)
        assert "Unrecognized request argument" in error["message"]
        assert next(iter(fields))[:20] in error["message"]


def test_off_values_of_unsupported_fields_work_through_the_openai_client(small_server):
    """The official client with the unsupported fields at their defaults gets the greedy text;
    with a value that would change the result, openai.BadRequestError naming the field."""
    url, _, greedy = small_server
    c = client(url)
    r = c.completions.create(model="tiny", prompt=SMALL_PROMPT, max_tokens=8, temperature=0,
                             presence_penalty=0, frequency_penalty=0.0, best_of=1, echo=False,
                             logit_bias={}, user="someone")  # fmt: skip
    assert r.choices[0].text == greedy["completions"]
    r = c.chat.completions.create(model="tiny", messages=SMALL_MESSAGES, max_tokens=8,
                                  temperature=0, response_format={"type": "text"},
                                  tool_choice="none", presence_penalty=0, logit_bias={},
                                  store=False)  # fmt: skip
    assert r.choices[0].message.content == greedy["chat"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=SMALL_PROMPT, max_tokens=8, logit_bias={"3": 50})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=SMALL_MESSAGES, max_tokens=8,
                                  response_format={"type": "json_object"})  # fmt: skip
    assert e.value.param == "response_format"


def test_a_body_over_the_size_limit_gets_413_before_it_is_read(small_server):
    """5 MB of prompt (over the default 4 MiB): refused by its Content-Length, and when sent
    without one (chunked), once the bytes read pass the limit; nothing is tokenized."""
    import json

    url, served, greedy = small_server
    body = json.dumps({**base_body(C), "prompt": "a" * 5_000_000}).encode()
    before = served.engine.stats.prompt_tokens
    error = assert_openai_error(ask(url, C, content=body), 413)
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]

    def chunks():
        for i in range(0, len(body), 2**16):
            yield body[i : i + 2**16]

    error = assert_openai_error(ask(url, C, content=chunks()), 413)
    assert error["code"] == "request_too_large"
    assert served.engine.stats.prompt_tokens == before
    assert_still_serves(url, greedy)


def test_a_body_nested_too_deeply_is_a_400_not_a_crash(small_server):
    url, _, greedy = small_server
    for raw in ("[" * 100_000 + "]" * 100_000,
                '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"):  # fmt: skip
        r = ask(url, C, content=raw.encode(), headers={"content-type": "application/json"})
        assert "nested too deeply" in assert_openai_error(r, 400)["message"]
    assert_still_serves(url, greedy)


def test_every_error_the_app_answers_is_openai_shaped(small_server, monkeypatch):
    """Unknown routes (404), wrong methods (405) and a failure inside a handler (500) answer
    OpenAI's error body, as the request errors do; n past what the server can ever run at once
    is a 400 (not a 503 a client would retry forever)."""
    url, served, greedy = small_server
    assert_openai_error(httpx.get(url + "/v1/nope", timeout=10), 404)
    assert_openai_error(httpx.post(url + "/v1/embeddings", json={}, timeout=10), 404)
    assert_openai_error(httpx.get(url + "/v1/completions", timeout=10), 405)
    assert_openai_error(httpx.post(url + "/health", timeout=10), 405)

    def broken(*args, **kwargs):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(served.tokenizer, "encode", broken)
    error = assert_openai_error(ask(url, C, base_body(C)), 500)
    assert error["type"] == "server_error" and "the tokenizer broke" in error["message"]
    monkeypatch.undo()
    r = ask(url, C, {**base_body(C), "n": 5})
    assert "retry-after" not in r.headers
    assert assert_openai_error(r, 400)["param"] == "n"
    assert_still_serves(url, greedy)


def test_head_answers_as_get_does_without_a_body(small_server):
    """What health checkers send: HEAD on /, /health, /v1/models and /metrics gets GET's status
    and headers and no body, with httpx and with ``curl -I``."""
    import shutil

    url, _, _ = small_server
    for path in ("/", "/health", "/v1/models", "/metrics"):
        get, head = httpx.get(url + path, timeout=10), httpx.head(url + path, timeout=10)
        assert head.status_code == get.status_code == 200, (path, head.status_code)
        assert head.content == b""
        for name in ("content-type", "content-length", "content-security-policy"):
            assert head.headers.get(name) == get.headers.get(name), (path, name)
        if shutil.which("curl"):
            out = subprocess.run(["curl", "-sSI", "--max-time", "10", url + path],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert out.startswith("HTTP/1.1 200 "), out
    assert httpx.head(url + "/v1/completions", timeout=10).status_code == 405  # a POST route


def test_serve_refuses_a_kv_cache_larger_than_memory_before_allocating(tmp_path, capsys):
    """A config with a 10^9-token context: `serve` says in one line what the cache would take
    and which flag to use; with --max-context the same model serves (its greedy text is
    generate's) and refuses prompts past that context. Flags out of range: one line each."""
    from llm_foundry.cli import main

    path = tmp_path / "long"
    tok = CharTokenizer.train(SMALL_CHARS)
    torch.manual_seed(2)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=2, dim=64,
                     n_heads=4, n_kv_heads=2, max_seq_len=10**9)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
    tok.save(path / "tokenizer.json")
    assert main(["serve", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would take" in err and "--max-context" in err, err
    for flags, named in ((["--slots", "1000000"], "--slots"), (["--slots", "0"], "--slots"),
                         (["--max-queue", "-1"], "--max-queue"),
                         (["--max-context", "1"], "--max-context"),
                         (["--max-context", str(10**10)], "--max-context"),
                         (["--max-request-bytes", "0"], "--max-request-bytes")):  # fmt: skip
        assert main(["serve", "--checkpoint", str(path), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err, err
    with running(path, max_context=48) as (url, served):
        assert served.engine.context == 48 and served.engine.cache.k[0].shape[2] == 96
        r = ask(url, C, {**base_body(C), "max_tokens": 10})
        assert r.json()["choices"][0]["text"] == solo(path, SMALL_PROMPT, 10)
        r = ask(url, C, {**base_body(C), "prompt": "a" * 48})
        assert assert_openai_error(r, 400)["code"] == "context_length_exceeded"


@pytest.mark.parametrize("device", ["cuda", "cuda:99", "banana", "mps"])
def test_serve_on_a_device_this_machine_lacks_is_one_line(checkpoint, capsys, monkeypatch, device):
    from llm_foundry.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda:99")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert main(["serve", "--checkpoint", str(checkpoint), "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-foundry serve: error: --device") and err.count("\n") == 1, err
