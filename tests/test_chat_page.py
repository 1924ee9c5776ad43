"""The chat page at ``/`` (serve/chat.html), tested in a real headless Chromium driven by
selenium against a real server: what the page shows is compared with what the API answers the
same conversation (greedy), through the official ``openai`` client.

Chromium and its driver come from Debian's packages (`make test` installs them with
scripts/install_chromium.sh); without them these tests skip with that line."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from test_serve import char_checkpoint, client, running  # noqa: E402

from llm_foundry.serve.page import CSP  # noqa: E402

INSTALL = (
    "scripts/install_chromium.sh (apt-get install chromium chromium-driver), as `make test` runs"
)


def _browser_paths() -> tuple[str, str]:
    chrome = (
        os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    driver = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
    if not chrome or not driver:
        pytest.skip(f"no Chromium and chromedriver on PATH: {INSTALL}")
    return chrome, driver


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random character model with a long context (1024), so that a long reply streams for
    seconds: long enough to press Stop in the middle of it."""
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    return char_checkpoint(path, seed=0, n_layers=4, dim=128, max_seq_len=1024)


@pytest.fixture(scope="module")
def server(checkpoint):
    with running(checkpoint, slots=4) as (url, served):
        yield url, served


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    chrome, driver = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,800"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    b = webdriver.Chrome(service=Service(driver), options=options)
    b.implicitly_wait(0)
    yield b
    b.quit()


@pytest.fixture
def page(server, browser):
    """The page freshly loaded, greedy (temperature 0), its model list filled in."""
    url, _ = server
    browser.get(url + "/")
    wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#model option"), "the model list")
    field(browser, "temperature", "0")
    return browser


def wait(browser, condition, what: str, seconds: float = 30):
    try:
        return WebDriverWait(browser, seconds, poll_frequency=0.02).until(condition)
    except TimeoutException:
        shown = [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".message")]
        raise AssertionError(f"waited {seconds} s for {what}; the page shows {shown}") from None


def field(browser, element_id: str, value: str) -> None:
    el = browser.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)


def say(browser, text: str) -> None:
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def replies(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")


def finished_reply(browser) -> str:
    """The last reply's text once it has finished streaming."""
    wait(browser, lambda b: replies(b) and replies(b)[-1].get_attribute("data-state") == "done",
         "the reply to finish")  # fmt: skip
    return replies(browser)[-1].text


def api_reply(url: str, messages: list[dict], max_tokens: int, model: str = "tiny") -> str:
    out = client(url).chat.completions.create(model=model, messages=messages, temperature=0,
                                              max_tokens=max_tokens)  # fmt: skip
    return out.choices[0].message.content


def visible(text: str) -> str:
    """What the page shows of ``text``: the browser's innerText drops a trailing newline and
    leading/trailing blanks of the element (white-space: pre-wrap keeps the rest)."""
    return text.strip()


def test_the_page_is_served_whole_from_the_package_and_reaches_nothing_else(server):
    url, _ = server
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CSP and "connect-src 'self'" in CSP
    html = r.text
    assert "<script" in html and "/v1/chat/completions" in html
    for ref in ("http://", "https://", "@import", "url("):
        assert ref not in html, f"the page refers to something outside itself: {ref!r}"
    refs = re.findall(r"""\b(?:src|href)\s*=\s*["']?([^"'\s>]*)""", html)
    assert all(r.startswith("data:") for r in refs), f"the page loads {refs}"


def test_a_typed_message_streams_the_apis_greedy_reply_and_the_conversation_goes_on(server, page):
    url, _ = server
    assert [o.text for o in page.find_elements(By.CSS_SELECTOR, "#model option")] == ["tiny"]
    field(page, "max-tokens", "40")
    say(page, "ROMEO:")
    first = finished_reply(page)
    want = api_reply(url, [{"role": "user", "content": "ROMEO:"}], 40)
    assert first == visible(want) and first
    # the second turn carries the first: the API given the same history answers the same
    say(page, "And then?")
    second = finished_reply(page)
    history = [{"role": "user", "content": "ROMEO:"}, {"role": "assistant", "content": want},
               {"role": "user", "content": "And then?"}]  # fmt: skip
    assert second == visible(api_reply(url, history, 40))
    users = [m.text for m in page.find_elements(By.CSS_SELECTOR, ".message.user")]
    assert users == ["ROMEO:", "And then?"]
    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], f"the browser console reports {errors}"


def test_stop_ends_the_stream_midway_and_frees_the_servers_slot(server, page):
    url, served = server
    field(page, "max-tokens", "900")
    say(page, "JULIET:")
    # the first pieces arrive, then Stop, while most of the 900 tokens are still to come
    wait(page, lambda b: replies(b) and len(replies(b)[-1].text) >= 5, "the first pieces")
    page.find_element(By.ID, "stop").click()
    wait(page, lambda b: replies(b)[-1].get_attribute("data-state") == "stopped", "the stop")
    partial = replies(page)[-1].text
    full = api_reply(url, [{"role": "user", "content": "JULIET:"}], 900)
    assert 5 <= len(partial) < len(visible(full)) / 2, (len(partial), len(full))
    assert visible(full).startswith(partial.rstrip())
    assert page.find_element(By.ID, "send").is_displayed()
    assert not page.find_element(By.ID, "stop").is_displayed()
    deadline = time.monotonic() + 10  # the server noticed the client leave: no slot stays busy
    while served.engine.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.engine.busy() == 0


def test_new_chat_starts_a_conversation_without_the_old_one(server, page):
    url, _ = server
    field(page, "max-tokens", "30")
    say(page, "KING:")
    finished_reply(page)
    page.find_element(By.ID, "new-chat").click()
    assert page.find_elements(By.CSS_SELECTOR, ".message") == []
    say(page, "What")
    reply = finished_reply(page)
    assert reply == visible(api_reply(url, [{"role": "user", "content": "What"}], 30))
    assert [m.text for m in page.find_elements(By.CSS_SELECTOR, ".message.user")] == ["What"]


def test_an_error_from_the_server_is_shown_as_a_message(server, page):
    url, _ = server
    field(page, "max-tokens", "100000")
    say(page, "Hello")
    wait(page, lambda b: b.find_elements(By.CSS_SELECTOR, ".message.error"), "the error")
    shown = page.find_element(By.CSS_SELECTOR, ".message.error").text
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True,
            "temperature": 0, "top_p": 0.95, "max_tokens": 100000}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400
    assert shown == r.json()["error"]["message"] and "max_tokens" in shown
    assert replies(page) == []  # the failed turn left no empty reply behind
    # and the page goes on: the same message with a valid setting gets its reply
    field(page, "max-tokens", "20")
    say(page, "Hello")
    assert finished_reply(page) == visible(
        api_reply(url, [{"role": "user", "content": "Hello"}], 20)
    )


@pytest.mark.parametrize("typed, asked", [("1e1", 10), ("1.2e1", 12)])
def test_max_tokens_typed_in_exponent_form_asks_for_that_many_tokens(server, page, typed, asked):
    """The number field takes "1e1" as 10: the page sends that number, not the text's leading
    digit (1), which would cut the reply after one token without a word."""
    url, _ = server
    turn = [{"role": "user", "content": "ROMEO:"}]
    want = visible(api_reply(url, turn, asked))
    assert want != visible(api_reply(url, turn, 1))  # else the check below could not fail
    field(page, "max-tokens", typed)
    say(page, "ROMEO:")
    assert finished_reply(page) == want


@pytest.mark.parametrize(
    "element_id, typed, said",
    [("max-tokens", "2.5", "max tokens must be a whole number >= 1 (or empty, for a reply up "
      "to the end of the context), got 2.5"),
     ("max-tokens", "0", "max tokens must be a whole number >= 1 (or empty, for a reply up to "
      "the end of the context), got 0"),
     ("max-tokens", "1e", "max tokens: the field holds no number"),
     ("temperature", "1e", "temperature: the field holds no number")],
    ids=["max-tokens=2.5", "max-tokens=0", "max-tokens=1e", "temperature=1e"],
)  # fmt: skip
def test_a_setting_the_page_cannot_send_is_an_error_and_the_message_waits(
    server, page, element_id, typed, said
):
    """A non-integer or too small max tokens, or a field the browser reads no number from, is
    shown as an error naming the field; nothing is sent and the typed message stays in the box,
    to go once the field is fixed."""
    url, _ = server
    field(page, element_id, typed)
    say(page, "Hello")
    wait(page, lambda b: b.find_elements(By.CSS_SELECTOR, ".message.error"), "the error")
    assert [m.text for m in page.find_elements(By.CSS_SELECTOR, ".message")] == [said]
    assert page.find_element(By.ID, "input").get_attribute("value") == "Hello"
    field(page, element_id, "0" if element_id == "temperature" else "20")
    field(page, "max-tokens", "20")
    page.find_element(By.ID, "input").send_keys(Keys.ENTER)
    assert finished_reply(page) == visible(
        api_reply(url, [{"role": "user", "content": "Hello"}], 20)
    )
    assert [m.text for m in page.find_elements(By.CSS_SELECTOR, ".message.user")] == ["Hello"]


def test_the_adapter_picked_in_the_page_is_the_one_that_answers(checkpoint, browser, tmp_path):
    """Served with an adapter (`serve --adapter tuned=DIR`): the page lists the base and the
    adapter, and the one picked answers as the API does under that name."""
    from selenium.webdriver.support.ui import Select

    from llm_foundry.checkpoint import load_checkpoint
    from llm_foundry.interop.peft import save_adapter
    from llm_foundry.models.lora import add_lora, lora_layers

    model = load_checkpoint(checkpoint)
    add_lora(model, ("wq", "wv", "w2"), r=4, alpha=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B is zero at init: an adapter that changes nothing would prove nothing
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0.0, 0.5, generator=g)
    save_adapter(model, tmp_path / "tuned")
    with running(checkpoint, slots=2, adapters={"tuned": tmp_path / "tuned"}) as (url, _):
        browser.get(url + "/")
        options = lambda b: [o.text for o in b.find_elements(By.CSS_SELECTOR, "#model option")]  # noqa: E731
        wait(browser, lambda b: options(b) == ["tiny", "tuned"], "the base and the adapter listed")
        field(browser, "temperature", "0")
        field(browser, "max-tokens", "30")
        Select(browser.find_element(By.ID, "model")).select_by_visible_text("tuned")
        say(browser, "ROMEO:")
        reply = finished_reply(browser)
        turn = [{"role": "user", "content": "ROMEO:"}]
        assert reply == visible(api_reply(url, turn, 30, model="tuned"))
        assert reply != visible(api_reply(url, turn, 30, model="tiny"))
