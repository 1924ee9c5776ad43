"""`serve --adapter NAME=DIR`: several LoRA adapters over one base, unmerged, each request
computed with the adapter its ``model`` names while rows of different adapters share a decode
step. Every greedy text is compared with that adapter merged into the base (peft's
``merge_and_unload`` or our fold) and generated alone, and served alone."""

from __future__ import annotations

import string
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from llm_foundry.checkpoint import load_checkpoint, save_checkpoint
from llm_foundry.interop.peft import save_adapter
from llm_foundry.loading import load_any
from llm_foundry.models import Transformer
from llm_foundry.models.lora import LoRALinear, add_lora, lora_layers
from llm_foundry.models.multi_lora import AdapterRows, LoRAWeights, MultiLoRALinear, stack_adapters
from llm_foundry.presets import get_preset
from llm_foundry.tokenizer import CharTokenizer

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from test_serve import client, greedy, running  # noqa: E402

from llm_foundry.serve import load_served  # noqa: E402
from llm_foundry.serve.engine import Engine, Params, Sequence  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET: O", "To be, or not", "the"]
LENGTHS = [20, 14, 24, 10]


def tiny_model(tok, seed: int = 0, **fields) -> Transformer:
    torch.manual_seed(seed)
    sizes = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=128)
    cfg = get_preset("llama-shakespeare-char", vocab_size=tok.vocab_size, **{**sizes, **fields})
    return Transformer(cfg)


def randomise(model, seed: int, std: float = 0.5) -> None:
    """Draw every adapter's B (zeros at init, so an adapter would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0.0, std, generator=g)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small random character model, and three adapters for it, each in another form: "qv"
    made by peft on the model's HF export (with peft's own merged model beside it), "mlp" by
    our add_lora + save_adapter (PEFT format, rsLoRA), "run" a LoRA checkpoint of ours."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from llm_foundry.export import convert_to_hf
    from llm_foundry.interop.hf import from_hf

    root = tmp_path_factory.mktemp("adapters")
    tok = CharTokenizer.train(" \n" + string.ascii_letters + string.punctuation)
    save_checkpoint(tiny_model(tok), root / "base")
    tok.save(root / "base" / "tokenizer.json")

    convert_to_hf(root / "base", root / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    with_adapter = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in with_adapter.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=g)
    with_adapter.save_pretrained(str(root / "qv"))
    peft_merged = from_hf(with_adapter.merge_and_unload()).eval()

    model = load_checkpoint(root / "base")
    add_lora(model, ("wk", "wo", "w1", "w3"), r=2, alpha=6, rslora=True)
    randomise(model, 2)
    save_adapter(model, root / "mlp")

    model = load_checkpoint(root / "base")
    add_lora(model, ("wq", "w2", "lm_head"), r=8, alpha=4)
    randomise(model, 3, std=0.2)
    save_checkpoint(model, root / "run")
    adapters = {name: root / name for name in ("qv", "mlp", "run")}
    return root / "base", tok, adapters, peft_merged


def run_engine(engine: Engine, jobs: list[tuple[int, str, int]]) -> tuple[list[str], set]:
    """Submit every (adapter, prompt, max_tokens) at once and step until all finish: (texts,
    the adapter modes the decode steps ran in)."""
    texts = [""] * len(jobs)

    def emit_for(i):
        def emit(kind, payload):
            if kind == "text":
                texts[i] += payload[0]

        return emit

    seqs = [Sequence(engine.tok.encode(p), Params(max_tokens=n, temperature=0), emit_for(i),
                     adapter=a) for i, (a, p, n) in enumerate(jobs)]  # fmt: skip
    engine.submit(seqs)
    modes = set()
    while any(not s.finished for s in seqs):
        engine.step()
        if engine.adapters is not None:
            modes.add(engine.adapters.mode)
    return texts, modes


@pytest.fixture(scope="module")
def wanted(base):
    """(adapter index, prompt) -> the greedy text of that adapter merged (our fold) and
    generated alone; index 0 is the bare base."""
    path, tok, adapters, _ = base
    want = {}
    for k, directory in enumerate([None, *adapters.values()]):
        merged = load_any(path, adapter=directory).model
        for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
            want[k, prompt] = greedy(merged, tok, prompt, n)
    return want


@pytest.mark.parametrize("kernel", ["gather", "masked"])
def test_a_row_of_each_adapter_computes_what_that_adapter_alone_does(kernel):
    """MultiLoRALinear with rows on different adapters (ranks 3 and 5, padded, and the bare
    base) equals each row through a LoRALinear holding that row's adapter, by either kernel."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 12)
    singles = []
    for r, alpha in ((3, 6.0), (5, 2.0)):
        lora = LoRALinear(linear, r=r, alpha=alpha, dropout=0.0, rslora=False)
        torch.nn.init.normal_(lora.lora_B)
        singles.append(lora)
    weights = [LoRAWeights(s.lora_A.detach(), s.lora_B.detach(), s.scale) for s in singles]
    A, B = stack_adapters(weights, 16, 12)
    rows = AdapterRows(["a", "b"])
    multi = MultiLoRALinear(linear, A, B, rows, kernel=kernel)
    x = torch.randn(4, 7, 16)
    choice = [2, 0, 1, 2]
    with torch.no_grad():
        want = torch.stack([(singles[a - 1] if a else linear)(x[i]) for i, a in enumerate(choice)])
        for select in (choice, [1] * 4, [0] * 4):  # mixed rows, one adapter, the base
            rows.select(select)
            ref = want if select is choice else torch.stack(
                [(singles[a - 1] if a else linear)(x[i]) for i, a in enumerate(select)]
            )  # fmt: skip
            torch.testing.assert_close(multi(x), ref, rtol=1e-5, atol=1e-5)
    assert rows.mode == "base"
    with pytest.raises(ValueError, match=r"must be in 0\.\.2"):
        rows.select([3])
    with pytest.raises(ValueError, match="must be one of gather, masked"):
        MultiLoRALinear(linear, A, B, rows, kernel="fast")


@pytest.mark.parametrize("kernel", ["gather", "masked"])
def test_mixed_adapter_rows_share_decode_steps_and_each_equals_its_merged_model(
    base, wanted, kernel, monkeypatch
):
    from llm_foundry.models import multi_lora

    path, tok, adapters, peft_merged = base
    monkeypatch.setattr(multi_lora, "choose_kernel", lambda *sizes: kernel)
    served = load_served(path, slots=4, adapters=adapters)
    assert served.adapters == ["qv", "mlp", "run"]
    names = [n for n, m in served.engine.model.named_modules() if isinstance(m, MultiLoRALinear)]
    assert len(names) == 2 * 7 + 1  # every projection some adapter adapts, lm_head too
    kernels = {m.kernel for m in served.engine.model.modules() if isinstance(m, MultiLoRALinear)}
    assert kernels == {kernel}
    # rows of all four kinds at once, interleaved so that decode steps mix them
    jobs = [(i % 4, PROMPTS[(i + i // 4) % 4], LENGTHS[(i + i // 4) % 4]) for i in range(8)]
    texts, modes = run_engine(served.engine, jobs)
    assert "mixed" in modes
    assert texts == [wanted[a, p] for a, p, _ in jobs]
    # the adapters change the text: the comparison above is not the base's four times over
    for k in (1, 2, 3):
        assert any(wanted[k, p] != wanted[0, p] for p in PROMPTS), k
    if kernel == "masked":
        return  # what follows does not depend on the kernel
    # each merged adapter served alone by the engine gives the same text
    for k, directory in enumerate([None, *adapters.values()]):
        merged = load_any(path, adapter=directory).model
        jobs = [(0, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
        alone, _ = run_engine(Engine(merged, tok, slots=2), jobs)
        assert alone == [wanted[k, p] for p in PROMPTS]
    # peft's own merge of "qv" generates what the served adapter does
    for prompt, n in zip(PROMPTS, LENGTHS, strict=True):
        assert greedy(peft_merged, tok, prompt, n) == wanted[1, prompt]


def test_the_server_serves_each_adapter_by_name_to_concurrent_clients(base, wanted):
    path, _, adapters, _ = base
    with running(path, slots=4, adapters=adapters) as (url, served):
        c = client(url)
        models = c.models.list().data
        assert [m.id for m in models] == ["tiny", "qv", "mlp", "run"]
        assert all(getattr(m, "parent", None) == "tiny" for m in models[1:])
        assert [c.models.retrieve(m.id) for m in models] == models  # GET /v1/models/{id}
        names = ["tiny", "qv", "mlp", "run"]
        jobs = [(i % 4, PROMPTS[(i + 2 + i // 4) % 4], LENGTHS[(i + 2 + i // 4) % 4])
                for i in range(8)]  # fmt: skip

        def ask(job):
            k, prompt, n = job
            r = c.completions.create(model=names[k], prompt=prompt, max_tokens=n, temperature=0)
            return r.model, r.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, jobs))
        assert got == [(names[k], wanted[k, p]) for k, p, _ in jobs]
        assert served.engine.stats.busy_slot_steps > served.engine.stats.decode_steps  # batched
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="qv2", prompt="ROMEO:", max_tokens=2)
        message = e.value.body["message"]
        assert '"qv2" does not exist' in message and '"tiny", "qv", "mlp", "run"' in message
        assert e.value.body["code"] == "model_not_found"
        assert served.engine.busy() == 0


def _refusal(argv: list[str], capsys) -> str:
    from llm_foundry.cli import main

    capsys.readouterr()
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-foundry serve: error: ") and err.count("\n") == 1, err
    return err


def test_adapters_that_do_not_fit_the_served_model_are_refused_in_one_line(base, tmp_path,
                                                                           capsys):  # fmt: skip
    path, tok, adapters, _ = base
    wider = tiny_model(tok, dim=96)
    add_lora(wider, ("wq",), r=2)
    save_adapter(wider, tmp_path / "wider")
    deeper = tiny_model(tok, n_layers=3)
    add_lora(deeper, ("wv",), r=2)
    save_adapter(deeper, tmp_path / "deeper")
    run = tiny_model(tok, dim=96)
    add_lora(run, ("wq",), r=2)
    save_checkpoint(run, tmp_path / "run96")
    (tmp_path / "empty").mkdir()
    cases = {
        "wider": "made for a model with dim 96 (this one: 64)",
        "deeper": "made for a model with 3 layers (this one: 2)",
        "run96": "trained on another model (dim: 96 there, 64 here",
        "empty": "neither a PEFT adapter",
        "missing": "no such directory",
    }
    for name, why in cases.items():
        directory = tmp_path / name
        err = _refusal(["--checkpoint", str(path), "--adapter", f"qv={adapters['qv']}",
                        "--adapter", f"bad={directory}"], capsys)  # fmt: skip
        assert f"--adapter bad={directory}: " in err and why in err, err
    # a failed read leaves the served model as it was
    from llm_foundry.serve.adapters import read_adapter

    model = load_checkpoint(path)
    with pytest.raises(ValueError, match="made for a model with dim 96"):
        read_adapter(model, tmp_path / "wider")
    assert not lora_layers(model) and isinstance(model.layers[0].attn.wq, torch.nn.Linear)


def test_bad_adapter_specs_are_one_line(base, capsys):
    path, _, adapters, _ = base
    qv = adapters["qv"]
    for specs, why in (
        (["qv"], "--adapter 'qv' must be NAME=DIR"),
        ([f"={qv}"], "must be NAME=DIR"),
        (["qv="], "must be NAME=DIR"),
        ([f"a={qv}", f"a={qv}"], "the name 'a' is given twice"),
        ([f"base={qv}"], "'base' is the base model's name"),
    ):
        argv = ["--checkpoint", str(path)] + [x for s in specs for x in ("--adapter", s)]
        assert why in _refusal(argv, capsys)
    err = _refusal(["--checkpoint", str(path), "--adapter", f"a={qv}", "--quantize", "int8"],
                   capsys)  # fmt: skip
    assert "--adapter with --quantize int8" in err


@pytest.mark.heavy
def test_the_serve_command_with_compile_serves_each_adapter(base, wanted):
    """`llm-foundry serve --compile --adapter ...`: one row at a time decodes through the
    compiled step, with the adapter each request names."""
    import os
    import socket
    import subprocess
    import sys

    from test_serve import wait_healthy

    path, _, adapters, _ = base
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    specs = [x for name, d in adapters.items() for x in ("--adapter", f"{name}={d}")]
    cmd = [sys.executable, "-m", "llm_foundry", "serve", "--checkpoint", str(path), "--port",
           str(port), "--model-name", "tiny", "--compile", *specs]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 240)
        c = client(url)
        assert [m.id for m in c.models.list().data] == ["tiny", "qv", "mlp", "run"]
        for i, k in enumerate([0, 1, 2, 3, 1]):  # adapter 1 again after the others
            prompt, n = PROMPTS[i % 4], LENGTHS[i % 4]
            r = c.completions.create(model=["tiny", "qv", "mlp", "run"][k], prompt=prompt,
                                     max_tokens=n, temperature=0)  # fmt: skip
            assert r.choices[0].text == wanted[k, prompt], (k, prompt)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "adapters qv, mlp, run)" in out, err


def test_a_lora_run_as_the_base_is_merged_with_its_line_and_takes_adapters_over_it(base,
                                                                                  tmp_path,
                                                                                  capsys):  # fmt: skip
    """As generate: a LoRA run served is its adapters merged, said in a line; adapters go over
    it (a DPO adapter trained on an SFT run), served unmerged as over any base."""
    import shutil

    from llm_foundry.cli.__init__ import show_library_messages

    path, tok, adapters, _ = base
    run = shutil.copytree(adapters["run"], tmp_path / "run")
    tok.save(run / "tokenizer.json")
    show_library_messages()
    capsys.readouterr()
    load_served(run, slots=1)
    assert "merged the LoRA adapters (r=8, alpha=4, on lm_head, w2, wq)" in capsys.readouterr().out
    served = load_served(run, slots=2, adapters={"qv": adapters["qv"]})
    assert "merged the LoRA adapters (r=8, alpha=4, on lm_head, w2, wq)" in capsys.readouterr().out
    assert served.adapters == ["qv"]
    texts, _ = run_engine(served.engine, [(1, PROMPTS[2], LENGTHS[2]), (0, PROMPTS[1], LENGTHS[1])])
    over = load_any(run, adapter=adapters["qv"]).model  # qv merged over the run's merged weights
    assert texts == [greedy(over, tok, PROMPTS[2], LENGTHS[2]),
                     greedy(load_any(run).model, tok, PROMPTS[1], LENGTHS[1])]  # fmt: skip


def test_an_adapter_run_over_other_base_weights_or_a_rounded_base_is_noted(base, tmp_path,
                                                                          capsys):  # fmt: skip
    """A LoRA run's adapters served over a base of its shape that is not the base they were
    fitted over (retrained since), or fitted over an nf4-rounded copy: served, with the note a
    merge gives (before: nothing said)."""
    from llm_foundry.cli.__init__ import show_library_messages

    path, tok, adapters, _ = base
    other = tmp_path / "other"
    save_checkpoint(tiny_model(tok, seed=5), other)
    tok.save(other / "tokenizer.json")
    rounded = load_checkpoint(path)
    add_lora(rounded, ("wq", "wv"), r=2, base_dtype="nf4")
    randomise(rounded, 4)
    save_checkpoint(rounded, tmp_path / "qlora")
    show_library_messages()
    capsys.readouterr()
    load_served(other, slots=1, adapters={"run": adapters["run"]})
    err = capsys.readouterr().err
    assert (
        f"note: --adapter run={adapters['run']}: trained over other base weights than these ("
        in err
    )
    load_served(path, slots=1, adapters={"q": tmp_path / "qlora"})
    err = capsys.readouterr().err
    assert f"note: --adapter q={tmp_path / 'qlora'}: trained over the nf4-rounded base" in err
    assert "other base weights" not in err  # the base it was fitted over, rounded
    load_served(path, slots=1, adapters={"run": adapters["run"]})
    assert "note:" not in capsys.readouterr().err


def test_adapters_past_a_layers_rank_or_on_a_tied_head_run_as_in_peft(tmp_path):
    """Adapters peft makes and runs: r=48 over a 64->32 projection (exact: past its rank a LoRA
    adds parameters, no error), loaded by generate's reader too; and one on the head of a model
    whose head is its embedding, served unmerged (merging it would change the embedding: there
    it is refused). Greedy texts equal peft's own, unmerged."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from conftest import assert_decisive

    from llm_foundry.export import convert_to_hf

    tok = CharTokenizer.train(" \n" + string.ascii_letters + string.punctuation)
    save_checkpoint(tiny_model(tok, tie_embeddings=True), tmp_path / "tied")
    tok.save(tmp_path / "tied" / "tokenizer.json")
    convert_to_hf(tmp_path / "tied", tmp_path / "hf")
    save_checkpoint(tiny_model(tok), tmp_path / "untied")
    convert_to_hf(tmp_path / "untied", tmp_path / "hf-untied")
    made = {}
    for name, config, where in [
        ("big", peft.LoraConfig(r=48, lora_alpha=16, target_modules=["k_proj", "v_proj"]), "hf"),
        # made where the head is its own (peft saves a tied head's weight beside its adapter)
        ("head", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
         "hf-untied"),
    ]:  # fmt: skip
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / where).eval()
        with_adapter = peft.get_peft_model(hf, config)
        g = torch.Generator().manual_seed(len(name))
        with torch.no_grad():
            for pname, p in with_adapter.named_parameters():
                if "lora_B" in pname:
                    p.normal_(0.0, 0.3, generator=g)
        with_adapter.save_pretrained(str(tmp_path / name), save_embedding_layers=False)
        tied = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        made[name] = peft.PeftModel.from_pretrained(tied, str(tmp_path / name)).eval()

    def peft_greedy(name: str, prompt: str, n: int) -> str:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = made[name].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)  # fmt: skip
            assert_decisive(made[name](input_ids=out[:, :-1]).logits[0, ids.shape[1] - 1 :])
        return tok.decode(out[0, ids.shape[1] :].tolist())

    x = torch.tensor([tok.encode("To be, or not")])
    with torch.no_grad():  # generate's reader merges the rank-48 adapter: peft's logits
        ours = load_any(tmp_path / "tied", adapter=tmp_path / "big").model(x)[0]
        torch.testing.assert_close(ours, made["big"](input_ids=x).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="lm_head is tied to the token embedding: a LoRA merged"):
        load_any(tmp_path / "tied", adapter=tmp_path / "head")
    served = load_served(tmp_path / "tied", slots=2,
                         adapters={n: tmp_path / n for n in ("big", "head")})  # fmt: skip
    jobs = [(1, PROMPTS[2], 16), (2, PROMPTS[1], 12)]
    texts, _ = run_engine(served.engine, jobs)
    assert texts == [peft_greedy("big", PROMPTS[2], 16), peft_greedy("head", PROMPTS[1], 12)]
