"""The OpenAI-compatible server, tested as its users meet it: a real server on a free loopback
port, the official ``openai`` client and plain HTTP, several clients at once. Every greedy
result is compared with the library's own ``generate`` of the same prompt alone."""

from __future__ import annotations

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

PROMPTS = ["ROMEO:", "JULIET: O", "To be, or not", "First Citizen:\nBefore we", "the", "What",
           "KING:", "Good morrow"]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small random character model (128 positions) over a fixed vocabulary: letters,
    punctuation, space and newline (what tiny Shakespeare's opening holds), so the model and its
    greedy choices are the same with or without the shared corpus."""
    path = tmp_path_factory.mktemp("serve") / "ckpt"
    tok = CharTokenizer.train(" \n" + string.ascii_letters + string.punctuation)
    torch.manual_seed(0)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, n_layers=2, dim=64,
                     n_heads=4, n_kv_heads=2, max_seq_len=128)  # fmt: skip
    save_checkpoint(Transformer(cfg), path)
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
def running(checkpoint, **kwargs):
    """A real server on a free 127.0.0.1 port; yields its base URL and the engine."""
    served = load_served(checkpoint, name="tiny", **kwargs)
    served.engine.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(served), log_level="warning", lifespan="off")
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
    from llm_foundry.rundir import load

    model, tok, _ = load(checkpoint)
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


def test_eight_concurrent_clients_each_get_what_they_get_alone(checkpoint):
    lengths = [40, 12, 30, 25, 8, 50, 17, 33]
    want = [solo(checkpoint, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    with running(checkpoint, slots=8) as (url, served):
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


def test_rows_that_move_in_the_cache_keep_their_tokens(checkpoint):
    """A cache of 132 positions for 128-token rows: rows move left (compaction) and right (a
    longer prompt joining) many times; every sequence still equals its solo run."""
    served = load_served(checkpoint, slots=3)
    engine = Engine(served.engine.model, served.tokenizer, slots=3, capacity=132)
    prompts = [PROMPTS[i % 8] * (1 + i % 3) for i in range(9)]
    lengths = [60 + 7 * i for i in range(9)]
    results = {}

    def emit_for(i):
        def emit(kind, payload):
            if kind == "text":
                results[i] = results.get(i, "") + payload[0]

        return emit

    seqs = [Sequence(served.tokenizer.encode(p), Params(max_tokens=n, temperature=0),
                     emit_for(i)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
    engine.submit(seqs)
    moved = 0
    while any(not s.finished for s in seqs):
        before = engine.t
        engine.step()
        moved += engine.t < before
    assert moved >= 3
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        room = min(n, 128 - len(p))
        assert results[i] == solo(checkpoint, p, room), i


def test_a_late_request_gets_its_first_token_before_the_long_ones_finish(checkpoint):
    with running(checkpoint, slots=4) as (url, served):
        c = client(url)
        ends = []

        def long(i):
            r = c.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=118,
                                     temperature=0)  # fmt: skip
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


@pytest.mark.heavy
def test_the_serve_command_starts_a_server_a_client_can_use(checkpoint, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "llm_foundry", "serve", "--checkpoint", str(checkpoint),
           "--port", str(port), "--model-name", "tiny"]  # fmt: skip
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


def test_without_fastapi_the_install_line_is_given(checkpoint, monkeypatch):
    from llm_foundry.cli import main

    for name in [m for m in sys.modules if m.split(".")[0] in ("fastapi", "uvicorn")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "llm_foundry.serve.app")
    with pytest.raises(SystemExit, match=r"pip install 'llm-foundry\[serve\]'"):
        main(["serve", "--checkpoint", str(checkpoint)])


def test_a_quantized_model_is_served_as_generate_decodes_it(checkpoint):
    """`serve --quantize int8`: the engine holds int8 projections and a request's greedy text is
    the library's greedy generation with the same quantized weights."""
    from llm_foundry.models.quant import Int8Linear
    from llm_foundry.rundir import load

    model, tok, _ = load(checkpoint, quantize="int8")
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    out = generate(model, ids, 16, temperature=0)
    want = tok.decode(out[0, ids.shape[1] :].tolist())
    with running(checkpoint, quantize="int8") as (url, served):
        assert any(isinstance(m, Int8Linear) for m in served.engine.model.modules())
        r = client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                           temperature=0)  # fmt: skip
        assert r.choices[0].text == want
