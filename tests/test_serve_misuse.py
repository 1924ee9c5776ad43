"""The server under misuse: clients that leave, prompts far past the context, text that is not
Unicode, odd but valid field values, browsers on other sites. A real server on a free loopback
port, checked with the official ``openai`` client and plain HTTP."""

from __future__ import annotations

import json
import time

import pytest
from _bytes_bpe import bytes_bpe
from test_serve import (  # noqa: F401 - fixtures
    ask,
    assert_openai_error,
    base_body,
    char_checkpoint,
    client,
    running,
    small_checkpoint,
    small_server,
)

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")


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


# ---- prompts far past the context -------------------------------------------------------------
def _byte_level(vocab_size: int = 300, normalizer=None):
    """A byte-level BPE (every byte a token) trained on CORPUS, with ``normalizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def _sentencepiece_like(normalizer=None, fallback: bool = True):
    """A Metaspace BPE with byte-fallback tokens (as Llama's tokenizer.json), with
    ``normalizer``; without ``fallback``: no byte tokens, unknown characters fused into one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from llm_foundry.serve.prompt_size import BYTE_FALLBACK

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=fallback, fuse_unk=not fallback))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<unk>", *(BYTE_FALLBACK if fallback else [])]
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=specials)
    tok.train_from_iterator([CORPUS], trainer)
    return tok


CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak. Café naïve\n" * 20


def _hard_texts(hf) -> list[str]:
    """Texts that encode to as few tokens per character as can be found: the longest tokens'
    texts repeated, words of the corpus, scripts the vocabulary lacks, combining marks."""
    vocab = hf.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=len)[-5:]
    texts = [hf.decode([vocab[t]]) * 50 for t in longest if hf.decode([vocab[t]])]
    return texts + [CORPUS * 3, "世界🙂" * 40, "e\u0301" * 200, "\u1100\u1161\u11a8" * 100,
                    "  \n\t " * 100, "a" * 3000]  # fmt: skip


BOUNDED = {
    "ours (BPETokenizer)": lambda: bytes_bpe().hf,
    "byte-level": _byte_level,
    "byte-level, NFC": lambda: _byte_level(normalizer=tokenizers.normalizers.NFC()),
    "byte-fallback, NFKC": lambda: _sentencepiece_like(tokenizers.normalizers.NFKC()),
}


@pytest.mark.parametrize("make", BOUNDED.values(), ids=list(BOUNDED))
def test_a_texts_length_bounds_its_tokens_from_below_where_a_bound_is_given(make):
    """``chars_per_token`` against the tokenizer's own encode: no text encodes to fewer than
    ceil(characters / bound) tokens, and without a normalizer the longest token repeated meets
    it."""
    from llm_foundry.serve.prompt_size import hf_chars_per_token, min_tokens

    hf = make()
    per_token = hf_chars_per_token(hf)
    assert per_token is not None
    tight = False
    for text in _hard_texts(hf):
        got = len(hf.encode(text, add_special_tokens=False).ids)
        assert got >= min_tokens(len(text), per_token), (text[:40], got, per_token)
        tight |= got == min_tokens(len(text), per_token)
    assert tight or hf.normalizer is not None  # a normalizer's factor is a worst case


def test_no_bound_is_claimed_where_the_pipeline_can_drop_characters():
    """A pre-tokenizer that drops spaces, a normalizer that strips, WordPiece (a long word is
    one [UNK]), unknown characters fused into one token: a text of any length can encode to
    a few tokens, and no bound is given."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from llm_foundry.serve.prompt_size import hf_chars_per_token

    spaces = _byte_level()
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    fused = _sentencepiece_like(fallback=False)
    for hf, text in ((spaces, " " * 5000 + "a"), (_byte_level(normalizer=normalizers.Strip()),
                     " " * 5000 + "a"), (wordpiece, "b" * 5000), (fused, "世" * 5000)):  # fmt: skip
        assert len(hf.encode(text, add_special_tokens=False).ids) <= 2
        assert hf_chars_per_token(hf) is None


@pytest.fixture(scope="module")
def byte_level_checkpoint(tmp_path_factory):
    """A random model (128 positions) over ``_byte_level()``'s 300 ids, with no end of text."""
    import torch

    from llm_foundry.checkpoint import save_checkpoint
    from llm_foundry.models import Transformer
    from llm_foundry.presets import get_preset

    path = tmp_path_factory.mktemp("serve-byte-level") / "ckpt"
    tok = _byte_level()
    torch.manual_seed(0)
    save_checkpoint(Transformer(get_preset("llama-shakespeare-char", vocab_size=tok.get_vocab_size(),
                                           n_layers=1, dim=32, n_heads=2, max_seq_len=128)),
                    path)  # fmt: skip
    tok.save(str(path / "tokenizer.json"))
    return path


def test_a_prompt_far_past_the_context_is_refused_before_it_is_encoded(
    byte_level_checkpoint, monkeypatch
):
    """3.9 MB of prompt (under the body limit) on a byte-level BPE model of 128 positions: 400
    context_length_exceeded naming 'prompt' (a chat: 'messages') with no text longer than the
    bound encoded; a prompt the bound lets through is still refused by its exact count."""
    from llm_foundry.serve import prompts

    encoded: list[int] = []
    encode = prompts._encode
    monkeypatch.setattr(prompts, "_encode", lambda tok, text, chat: (encoded.append(len(text)),
                                                                 encode(tok, text, chat))[1])  # fmt: skip
    with running(byte_level_checkpoint, slots=1) as (url, served):
        most = 128 * served.chars_per_token
        for endpoint, body, param in (
            ("completions", {"prompt": "a " * 1_950_000}, "prompt"),
            ("chat", {"messages": [{"role": "user", "content": "a " * 1_950_000}]}, "messages"),
        ):  # fmt: skip
            r = ask(url, endpoint, {"model": "tiny", "max_tokens": 2, **body})
            error = assert_openai_error(r, 400)
            assert (error["code"], error["param"]) == ("context_length_exceeded", param)
            assert "at least" in error["message"]
        assert all(n < most for n in encoded), (encoded, most)
        r = ask(url, "completions", {"model": "tiny", "prompt": "ROMEO: " * 30})
        error = assert_openai_error(r, 400)
        assert error["code"] == "context_length_exceeded" and "at least" not in error["message"]
        assert encoded  # encoded, and counted exactly
        r = ask(url, "completions", {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]


# ---- text that is not Unicode; failures counted -----------------------------------------------
@pytest.mark.parametrize("model", ["byte-level", "char"])
def test_a_lone_surrogate_is_a_400_naming_the_field_not_a_500(
    model, byte_level_checkpoint, long_checkpoint
):
    """JSON can escape half of a UTF-16 pair alone ("\\ud800"); Python reads it into a string no
    tokenizer takes (the official client cannot even send it: JSON as curl sends it). Both
    tokenizers: 400 invalid_request_error naming 'prompt' or 'messages' and where the surrogate
    is; the server goes on."""
    path = byte_level_checkpoint if model == "byte-level" else long_checkpoint
    with running(path, slots=1) as (url, _):
        r = ask(url, "completions", {"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2})
        error = assert_openai_error(r, 400)
        assert (error["type"], error["param"]) == ("invalid_request_error", "prompt")
        assert "lone surrogate \\ud800 at character 1" in error["message"]
        messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "x\udfff"}]
        r = ask(url, "chat", {"model": "tiny", "messages": messages, "max_tokens": 2})
        error = assert_openai_error(r, 400)
        assert error["param"] == "messages" and "messages[1].content" in error["message"]
        r = ask(url, "completions", {"model": "tiny", "prompt": "First", "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        assert requests_counted(url) == {("completions", "400"): 1, ("chat", "400"): 1,
                                         ("completions", "200"): 1}  # fmt: skip


def test_a_failed_request_is_counted_under_500(long_checkpoint, monkeypatch):
    """A handler that raises (the tokenizer broke) and an engine row that fails (the decoder
    broke): each a 500, each counted in llm_foundry_requests_total under status 500."""
    from llm_foundry.serve.detok import WindowText

    with running(long_checkpoint, slots=1) as (url, served):
        body = {"model": "tiny", "prompt": "First", "max_tokens": 2}
        with monkeypatch.context() as m:
            m.setattr(served.tokenizer, "encode", lambda text: 1 / 0)
            assert_openai_error(ask(url, "completions", body), 500)
        with monkeypatch.context() as m:
            m.setattr(served.engine, "detokenizer", lambda prompt: WindowText(lambda ids: 1 / 0))
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}
            assert_openai_error(ask(url, "chat", chat), 500)
        assert requests_counted(url) == {("completions", "500"): 1, ("chat", "500"): 1}


# ---- field values ------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_optional_field_null_is_as_if_left_out(request, endpoint):
    """What SDKs that send every optional field send: each field the endpoint takes (model and
    stream included) as null gives the greedy reply of the request without them, from the
    served model."""
    from llm_foundry.serve.fields import FIELDS, OFF

    url, _, greedy = request.getfixturevalue("small_server")
    body = base_body(endpoint)
    chat = endpoint == "chat"
    nulls = {k: None for k in [*FIELDS[chat], *OFF[chat]] if k not in body and k not in
             ("prompt", "messages")}  # fmt: skip
    assert ask(url, endpoint, {**body, "stream": None}).status_code == 200
    r = ask(url, endpoint, {**body, **nulls, "model": None})
    assert r.status_code == 200, r.text[:300]
    reply = r.json()
    assert reply["model"] == "tiny" and reply["object"] == ("chat.completion" if chat else
                                                            "text_completion")  # fmt: skip
    choice = reply["choices"][0]
    assert (choice["message"]["content"] if chat else choice["text"]) == greedy[endpoint]


MESSAGE = [{"role": "user", "content": "a"}]
REFUSED = [  # (endpoint, fields over the base request, the param named, words of the message)
    ("chat", {"top_logprobs": 3}, "top_logprobs", "'logprobs': true"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "'logprobs': true"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "'stream'"),
    ("chat", {"stream": False, "stream_options": {}}, "stream_options", "'stream': true"),
    ("completions", {"stream": True, "stream_options": {"foo": 1}}, "stream_options", "foo"),
    *[("chat", {"stream": True, "stream_options": {"include_usage": v}}, "stream_options",
       "include_usage") for v in (0, 1, "", "true")],  # fmt: skip
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options", "include_obfuscation"),  # fmt: skip
    *[(e, {"user": v}, "user", "'user' must be a string") for e in ("completions", "chat")
      for v in (123, {"a": 1}, True)],  # fmt: skip
    *[("chat", {"metadata": v}, "metadata", "'metadata' must be") for v in
      (5, "a", [], {"a": 1}, {"a": None}, {"k" * 65: "v"}, {"a": "v" * 513},
       {str(i): "v" for i in range(17)})],  # fmt: skip
    ("chat", {"store": "yes"}, "store", "'store' must be true or false"),
    ("chat", {"messages": [{**MESSAGE[0], "name": "bob"}]}, "messages", 'messages[0] has the key "name"'),
    ("chat", {"messages": [*MESSAGE, {**MESSAGE[0], "x": 1}]}, "messages", 'messages[1] has the key "x"'),
    ("chat", {"messages": [{**MESSAGE[0], "tool_calls": []}]}, "messages", '"tool_calls", which this server'),
    *[("chat", {k: v}, None, f'"{k}"') for k, v in (("echo", False), ("suffix", ""),
                                                      ("best_of", 1))],  # fmt: skip
    *[("completions", {k: v}, None, f'"{k}"') for k, v in (("tools", []),
                                                             ("response_format", {"type": "text"}))],
]  # fmt: skip


@pytest.mark.parametrize("endpoint, fields, param, words", REFUSED,
                         ids=[f"{e}-{','.join(f)}-{i}" for i, (e, f, _, _) in
                              enumerate(REFUSED)])  # fmt: skip
def test_a_field_that_would_be_ignored_is_refused_by_name(request, endpoint, fields, param, words):
    """What OpenAI refuses is refused here too, naming the field, rather than answered as if it
    were not there: top_logprobs without logprobs true, stream_options without stream true (or
    with keys or values it lacks), user and metadata of the wrong type, keys a message does not
    have (or has for what this server does not do), one endpoint's fields sent to the other."""
    url, _, greedy = request.getfixturevalue("small_server")
    error = assert_openai_error(ask(url, endpoint, {**base_body(endpoint), **fields}), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert words in error["message"], error["message"]


ACCEPTED = [
    ("chat", {"logprobs": True, "top_logprobs": 2}),
    ("chat", {"logprobs": True, "top_logprobs": None}),
    ("chat", {"logprobs": None, "top_logprobs": None}),
    ("completions", {"stream": False, "stream_options": None}),
    *[
        ("chat", {"stream": True, "stream_options": o})
        for o in (
            {},
            {"include_usage": True},
            {"include_usage": None},
            {"include_usage": False, "include_obfuscation": False},
        )
    ],  # fmt: skip
    ("completions", {"user": "someone"}),
    ("chat", {"user": "someone", "metadata": {"k" * 64: "v" * 512}, "store": False}),
    ("chat", {"metadata": {str(i): "v" for i in range(16)}}),
    ("chat", {"messages": [{**MESSAGE[0], "name": None, "tool_calls": None}]}),
]


@pytest.mark.parametrize("endpoint, fields", ACCEPTED, ids=[f"{e}-{i}" for i, (e, _) in
                                                            enumerate(ACCEPTED)])  # fmt: skip
def test_the_valid_neighbours_of_each_refused_value_are_served(request, endpoint, fields):
    url, _, greedy = request.getfixturevalue("small_server")
    body = {**base_body(endpoint), **fields}
    if "messages" in fields:
        body["messages"] = [{**m, "content": "a"} for m in fields["messages"]]
    r = ask(url, endpoint, body)
    assert r.status_code == 200, r.text[:300]
    if not fields.get("stream"):
        choice = r.json()["choices"][0]
        assert (choice["message"]["content"] if endpoint == "chat" else choice["text"]) == greedy[
            endpoint
        ]


# ---- chat in OpenAI's newer forms --------------------------------------------------------------
def _chat_text(url, messages) -> str:
    r = ask(url, "chat", {"model": "tiny", "messages": messages, "max_tokens": 8,
                          "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["message"]["content"]


def test_text_parts_and_the_developer_role_are_read_as_openai_means_them(request, long_checkpoint):
    """Content as a list of text parts is their texts joined with newlines, through the
    official client too; 'developer' is 'system'; each reply equals the string form's."""
    url, _, greedy = request.getfixturevalue("small_server")
    part = {"type": "text", "text": "a"}
    assert _chat_text(url, [{"role": "user", "content": [part]}]) == greedy["chat"]
    two = _chat_text(url, [{"role": "user", "content": [part, part]}])
    assert two == _chat_text(url, [{"role": "user", "content": "a\na"}])
    r = client(url).chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": [part]}])  # fmt: skip
    assert r.choices[0].message.content == greedy["chat"]
    system = [{"role": "system", "content": "a"}, {"role": "user", "content": "a"}]
    developer = [{"role": "developer", "content": [part]}, system[1]]
    with running(long_checkpoint, slots=1) as (url, _):  # a vocabulary that writes SYSTEM
        assert _chat_text(url, developer) == _chat_text(url, system)


PARTS_REFUSED = [  # (content, words of the message)
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], '"image_url"'),
    ([{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}], "content[1]"),
    ([{"type": "text", "text": "a", "cache_control": {}}], "must be a text part"),
    ([{"type": "text", "text": 5}], "must be a text part"),
    (["a"], "must be a text part"),
    ([], "non-empty list of text parts"),
]


@pytest.mark.parametrize("content, words", PARTS_REFUSED)
def test_parts_that_are_not_text_are_refused_by_name(request, content, words):
    url, _, _ = request.getfixturevalue("small_server")
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    error = assert_openai_error(ask(url, "chat", body), 400)
    assert error["param"] == "messages" and words in error["message"], error["message"]
    assert "messages[0].content" in error["message"]


def test_a_chat_the_tokenizer_cannot_encode_names_messages(request):
    """A character the model's vocabulary lacks, in a chat: 400 naming 'messages' (a prompt's
    names 'prompt')."""
    url, _, _ = request.getfixturevalue("small_server")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "\u6771"}]}
    error = assert_openai_error(ask(url, "chat", body), 400)
    assert error["param"] == "messages" and "cannot be encoded" in error["message"]
    error = assert_openai_error(ask(url, "completions", {"model": "tiny", "prompt": "\u6771"}), 400)
    assert error["param"] == "prompt"


# ---- routes ------------------------------------------------------------------------------------
def test_a_model_is_retrieved_by_its_id_as_openai_answers(request):
    """GET /v1/models/{id} through the official client: the served model's card, as listed;
    an unknown id (a name with a slash too) is OpenAI's 404 model_not_found; HEAD as GET."""
    url, _, _ = request.getfixturevalue("small_server")
    c = client(url)
    got = c.models.retrieve("tiny")
    assert got.model_dump() == c.models.list().data[0].model_dump()
    assert (got.id, got.object, got.owned_by) == ("tiny", "model", "llm-foundry")
    for unknown in ("gpt-9", "org/tiny", "tiny/"):
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve(unknown)
        assert (e.value.code, e.value.param) == ("model_not_found", "model")
        assert unknown in e.value.message
        assert_openai_error(httpx.get(f"{url}/v1/models/{unknown}", timeout=10), 404)
    head = httpx.head(url + "/v1/models/tiny", timeout=10)
    assert head.status_code == 200 and head.content == b""


def test_no_schema_and_a_trailing_slash_is_a_json_404_not_a_redirect(request):
    """No /openapi.json (nor /docs); POST /v1/completions/ is OpenAI's 404 body, not a 307 the
    official client would not follow."""
    url, _, _ = request.getfixturevalue("small_server")
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_openai_error(httpx.get(url + path, timeout=10), 404)
    body = base_body("completions")
    for path in ("/v1/completions/", "/v1/chat/completions/", "/health/", "/v1/models/"):
        r = httpx.post(url + path, json=body, timeout=10) if "compl" in path else httpx.get(
            url + path, timeout=10)  # fmt: skip
        assert_openai_error(r, 404)
    c = openai.OpenAI(base_url=url + "/v1/", api_key="none", max_retries=0)
    assert c.completions.create(**body).choices  # the client's own slash is still fine


def test_a_browser_post_from_another_site_is_refused_and_the_own_page_is_served(request):
    """A request whose Origin header names another site (what a browser adds to a page's
    cross-site POST) is 403, before the request is run; this server's own origin (the chat
    page's requests) and no Origin (curl, the official client) are served."""
    url, served, greedy = request.getfixturevalue("small_server")
    body = base_body("completions")
    before = served.engine.stats.prompt_tokens
    for origin in ("http://evil.example", "null", url.replace("127.0.0.1", "localhost"),
                   url + "0", "file://"):  # fmt: skip
        r = httpx.post(url + "/v1/completions", timeout=10, content=json.dumps(body),
                       headers={"Origin": origin, "content-type": "text/plain"})  # fmt: skip
        error = assert_openai_error(r, 403)
        assert error["code"] == "cross_origin" and origin in error["message"]
    assert served.engine.stats.prompt_tokens == before  # nothing was run
    r = httpx.post(url + "/v1/completions", json=body, headers={"Origin": url}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy["completions"]
    assert client(url).completions.create(**body).choices[0].text == greedy["completions"]


def test_a_request_for_another_host_name_is_refused_on_loopback(request):
    """DNS rebinding: a page whose site name now resolves to 127.0.0.1 sends same-origin
    requests for its own name. A server answering loopback names and --allow-host's refuses
    them (403, before anything runs) and serves localhost, 127.x, [::1] and the names given;
    the command picks the names from the address it listens on."""
    from llm_foundry.cli.serve import answered_hosts

    assert answered_hosts("127.0.0.1", []) == answered_hosts("localhost", []) == frozenset()
    assert answered_hosts("::1", ["MyBox"]) == frozenset({"mybox"})
    assert answered_hosts("0.0.0.0", []) is None  # reachable by any name anyway
    assert answered_hosts("0.0.0.0", ["mybox"]) == frozenset({"mybox"})
    body, checkpoint = base_body("completions"), request.getfixturevalue("small_checkpoint")
    with running(checkpoint, app_options={"hosts": frozenset({"mybox"})}) as (url, served):
        port = url.rsplit(":", 1)[1]
        for host in ("evil.example", "127.0.0.1.evil.example", "mybox.evil.example"):
            r = httpx.post(
                url + "/v1/completions",
                json=body,
                timeout=10,
                headers={"Host": f"{host}:{port}", "Origin": f"http://{host}:{port}"},
            )
            error = assert_openai_error(r, 403)
            assert error["code"] == "host_not_allowed" and host in error["message"]
            assert error["message"].endswith("(another name this machine has: --allow-host NAME)")
        assert served.engine.stats.prompt_tokens == 0  # nothing was run
        for host in ("localhost", "127.0.0.1", "127.1.2.3", "[::1]", "app.localhost", "MyBox"):
            r = httpx.post(url + "/v1/completions", json=body, timeout=10,
                           headers={"Host": f"{host}:{port}"})  # fmt: skip
            assert r.status_code == 200, (host, r.text[:200])


# ---- what errors say ---------------------------------------------------------------------------
SAID = [  # (endpoint, fields over the base request, words of the message)
    ("completions", {"stream": "yes"}, 'got "yes"'),
    ("completions", {"temperature": True}, "got true"),
    ("completions", {"n": None, "logprobs": False}, "got false"),
    ("chat", {"top_logprobs": 2, "logprobs": None}, "'logprobs': null"),
    ("chat", {"metadata": {"a": 1}}, 'got {"a": 1}'),
    ("completions", {"stop": ""}, 'got ""'),
    ("completions", {"stop": ["a", None]}, 'got ["a", null]'),
    ("completions", {"model": "gpt-9"}, 'The model "gpt-9" does not exist; this server has "tiny"'),
    ("completions", {"model": "\ud800"}, 'The model "\\ud800"'),
    ("completions", {"prompt": "U", "max_tokens": [1.5, "日"]}, 'got [1.5, "日"]'),
]


@pytest.mark.parametrize("endpoint, fields, words", SAID, ids=[w for _, _, w in SAID])
def test_errors_show_values_as_the_json_the_client_sent(request, endpoint, fields, words):
    url, _, _ = request.getfixturevalue("small_server")
    r = ask(url, endpoint, {**base_body(endpoint), **fields})
    assert words in assert_openai_error(r, 404 if "model" in fields else 400)["message"]


def test_an_integer_past_pythons_digit_limit_is_named_not_called_invalid_json(request):
    """5000 digits is valid JSON; Python reads integers of up to 4300 digits: said so."""
    url, _, greedy = request.getfixturevalue("small_server")
    raw = json.dumps(base_body("completions"))[:-1] + ', "max_tokens": ' + "9" * 5000 + "}"
    r = ask(url, "completions", content=raw.encode(), headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400)
    assert error["code"] == "integer_too_long" and "5,000 digits" in error["message"]
    assert "4,300" in error["message"] and "not valid JSON" not in error["message"]
    raw = json.dumps(base_body("completions"))[:-1] + ', "seed": -' + "1" * 4300 + "}"
    assert assert_openai_error(ask(url, "completions", content=raw.encode(), headers={
        "content-type": "application/json"}), 400)["param"] == "seed"  # fmt: skip


def test_serve_on_a_host_that_is_no_address_of_this_machine_says_so(long_checkpoint, capsys):
    """--host that is no IP address nor a name this machine resolves, an address of another
    machine, a port in use: one line each, naming what is wrong (not "is the port in use?")."""
    import socket

    from llm_foundry.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for host, words in (("999.1.1.1", "--host '999.1.1.1' is not an IP address or a host"),
                            ("192.0.2.1", "--host '192.0.2.1' is not an address of this machine"),
                            ("127.0.0.1", f"could not serve on 127.0.0.1:{port}: the port is in "
                                          "use")):  # fmt: skip
            argv = ["serve", "--checkpoint", str(long_checkpoint), "--host", host, "--port", port]
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and words in err, err


# ---- shutting down -----------------------------------------------------------------------------
@pytest.mark.heavy
def test_sigterm_ends_each_reply_in_flight_with_its_last_chunk_before_the_server_exits(
    long_checkpoint,
):
    """`llm-foundry serve` sent SIGTERM while a stream and a whole request run (2000 tokens
    each): the stream gets a last chunk with finish_reason "length" (cut short), its usage and
    [DONE]; the whole request its reply so far; the process then exits 0."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llm_foundry", "serve", "--checkpoint", str(long_checkpoint),
           "--port", str(port), "--model-name", "tiny"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60)
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 2000}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=stream, timeout=60) as r:
                lines = r.iter_lines()
                first = next(lines)
                assert wait_until(lambda: httpx.get(url + "/health").json()["busy"] == 2, 10)
                proc.send_signal(signal.SIGTERM)
                rest = [x for x in lines if x]
            reply = whole.result()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    chunks = [json.loads(x[6:]) for x in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and finish.count("length") == 1
    usage = chunks[-1]["usage"]
    assert 0 < usage["completion_tokens"] < 2000  # cut short
    assert reply.status_code == 200, reply.text[:300]
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"]) == reply.json()["usage"]["completion_tokens"] < 2000
    assert "Traceback" not in err, err
