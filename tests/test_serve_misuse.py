"""The server under misuse: clients that leave, prompts far past the context, text that is not
Unicode, odd but valid field values, browsers on other sites. A real server on a free loopback
port, checked with the official ``openai`` client and plain HTTP."""

from __future__ import annotations

import time

import pytest
from test_serve import char_checkpoint, client, running

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """A small character model with a long context (2048), for replies that run for seconds."""
    path = tmp_path_factory.mktemp("serve-misuse") / "ckpt"
    return char_checkpoint(path, seed=0, n_layers=1, dim=32, n_heads=2, n_kv_heads=1,
                           max_seq_len=2048)  # fmt: skip


def slowed(engine, seconds: float) -> None:
    """Every step of ``engine`` takes ``seconds`` more: a 2000-token reply lasts ~10 s."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        step()

    engine.step = slow_step


def wait_until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.02)
    return check()


def requests_counted(url: str) -> dict[tuple[str, str], int]:
    """/metrics' llm_foundry_requests_total as (endpoint, status) -> count."""
    import re

    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r'requests_total\{endpoint="(\w+)",status="(\d+)"\} (\d+)', text)
    return {(e, s): int(n) for e, s, n in found}


def test_a_non_streamed_request_whose_client_left_is_cancelled_while_tokens_flow(
    long_checkpoint,
):
    """The official client times out after 0.5 s and retries twice: each of its three requests
    (2000 tokens, ~10 s each) is cancelled within a few steps of its client leaving, counted
    as cancelled and under status 499, and the slots are free for the next client."""
    with running(long_checkpoint, slots=4, max_queue=2) as (url, served):
        engine = served.engine
        slowed(engine, 0.005)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            c.completions.create(model="tiny", prompt="ROMEO:", max_tokens=2000)
        assert wait_until(lambda: engine.busy() == 0, 2.0), f"{engine.busy()} slots still busy"
        assert engine.stats.cancelled == 3
        assert requests_counted(url) == {("completions", "499"): 3}
        r = client(url).completions.create(model="tiny", prompt="ROMEO:", max_tokens=3)
        assert r.usage.completion_tokens == 3
