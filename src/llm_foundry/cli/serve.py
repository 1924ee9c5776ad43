"""``llm-foundry serve``: an OpenAI-compatible server (completions, chat, streaming) with
continuous batching, on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import signal
import socket
import sys
import threading
import time

from llm_foundry.cli.options import add_quantize_flags, quantize_choice
from llm_foundry.package import absent, missing_extra

MAX_SLOTS = 4096  # sequences decoded together: far past what one forward batches usefully
MAX_QUEUE = 1_000_000  # requests waiting
GRACE_S = 10  # seconds replies have to end after SIGTERM


def adapter_spec(spec: str) -> tuple[str, str]:
    """(name, directory) of one ``--adapter NAME=DIR``; ValueError (one line) when malformed."""
    name, eq, directory = spec.partition("=")
    if not eq or not name.strip() or not directory:
        raise ValueError(f"--adapter {spec!r} must be NAME=DIR (the name clients ask for as "
                         "'model', then the adapter's directory)")  # fmt: skip
    return name.strip(), directory


def adapter_specs(specs: list[str]) -> dict[str, str]:
    """name -> directory of every ``--adapter``, each name once."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, directory = adapter_spec(spec)
        if name in adapters:
            raise ValueError(f"--adapter {spec!r}: the name '{name}' is given twice")
        adapters[name] = directory
    return adapters


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (bound here, so that what is wrong is said in
    one line: a host that is no address, an address not of this machine, a port in use)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ValueError(f"--host {host!r} is not an IP address or a host name this machine "
                         f"resolves ({why})") from None  # fmt: skip
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host!r} is not an address of this machine (use "
                             "127.0.0.1, 0.0.0.0 for every interface, or one of its own "
                             "addresses)") from None  # fmt: skip
        why = "the port is in use (choose another --port)" if e.errno == errno.EADDRINUSE else (
            e.strerror or str(e))  # fmt: skip
        raise OSError(f"could not serve on {host}:{port}: {why}") from None


def answered_hosts(host: str, allow: list[str]) -> frozenset[str] | None:
    """The Host names besides loopback ones the server answers (``origin.host_allowed``): on a
    loopback address only ``allow``; on other addresses any (None), or loopback ones and
    ``allow`` where names are given."""
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        addresses = set()  # ``listen`` says what is wrong with it
    names = frozenset(name.lower().strip("[]") for name in allow)
    loopback = bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                 for a in addresses)  # fmt: skip
    return names if loopback or allow else None


def eager_gpu_note(device_type: str, cuda_graph: bool, adapters: dict) -> str | None:
    """What to say when a GPU serves without --cuda-graph: there each eager decode step is paced
    by the host's few hundred kernel launches (an H100 in benchmarks/README.md: 33 tokens/s for
    one client, 469 with graphs). Nothing where graphs do not apply (CPU, adapters)."""
    if device_type != "cuda" or cuda_graph or adapters:
        return None
    return ("note: decoding on cuda without --cuda-graph: each step is bound by kernel launches "
            "(an H100 served one client 14x faster with --cuda-graph); add --cuda-graph")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llm-foundry serve",
        allow_abbrev=False,  # exact option names: a prefix could mean another option
        description="Serve a model over OpenAI's HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics); concurrent requests share "
        "the model through continuous batching. Needs the [serve] extra (FastAPI, uvicorn).",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint, run or HF directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME", help="a name "
                   "besides localhost and loopback addresses that requests may be for (their "
                   "Host header); repeatable. On a loopback --host others are refused (403), as "
                   "a web page reaching the server by DNS rebinding would be; on other "
                   "addresses any name is answered unless names are given")  # fmt: skip
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the "
                   "slots before new ones get 503")  # fmt: skip
    p.add_argument("--max-context", type=int, default=None, metavar="N", help="tokens (prompt "
                   "+ reply) a request may use, which sizes the KV cache (slots x 2N positions); "
                   "default: the model's max_seq_len, refused when that cache would not fit in "
                   "memory")  # fmt: skip
    p.add_argument("--max-request-bytes", type=int, default=None, metavar="B", help="largest "
                   "request body taken (larger ones get 413; default 4 MiB)")  # fmt: skip
    p.add_argument("--model-name", default=None, help="the id clients ask for (default: the "
                   "checkpoint directory's name)")  # fmt: skip
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR", help="a LoRA "
                   "adapter served unmerged over the model as 'model': NAME (a PEFT adapter "
                   "directory or a LoRA run of ours); repeatable: requests for different "
                   "adapters share a batch, the base's own name picks the bare base")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="compile the one-row decode step (its fused "
                   "matvec streams weights faster; ~20 s at start)")  # fmt: skip
    p.add_argument("--cuda-graph", action="store_true", help="decode every step as a CUDA "
                   "graph: one per batch size (1, 2, 4, ... --slots), captured at start and "
                   "replayed each token (decoding on a GPU is bound by kernel launches); with "
                   "--compile the one-row step is compiled too; on CPU the static step runs "
                   "eagerly, with a note; not with --adapter")  # fmt: skip
    add_quantize_flags(p)
    ns = p.parse_args(argv)
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port {ns.port} must be in 1..65535")
    if not 1 <= ns.slots <= MAX_SLOTS:
        raise ValueError(f"--slots {ns.slots} must be in 1..{MAX_SLOTS}")
    if not 0 <= ns.max_queue <= MAX_QUEUE:
        raise ValueError(f"--max-queue {ns.max_queue} must be in 0..{MAX_QUEUE:,}")
    if ns.max_context is not None and ns.max_context < 2:
        raise ValueError(f"--max-context {ns.max_context} must be >= 2 (a prompt and a reply)")
    if ns.max_request_bytes is not None and ns.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {ns.max_request_bytes} must be >= 1")
    adapters = adapter_specs(ns.adapter)
    if ns.cuda_graph and adapters:
        from llm_foundry.serve.engine import CUDA_GRAPH_ADAPTERS

        raise ValueError(CUDA_GRAPH_ADAPTERS)
    try:
        import uvicorn
    except ImportError as e:
        if not absent(e, "uvicorn"):
            raise  # installed but broken: its own error
        raise missing_extra("serve needs FastAPI and uvicorn", "serve", str(e)) from None
    from llm_foundry.serve import load_served
    from llm_foundry.serve.app import MAX_REQUEST_BYTES, create_app  # MissingExtra without FastAPI

    scheme, group = quantize_choice(ns.quantize, ns.group_size)
    served = load_served(ns.checkpoint, ns.slots, ns.max_queue, ns.model_name, ns.device,
                         ns.compile, scheme, group, ns.max_context, adapters,
                         ns.cuda_graph)  # fmt: skip
    app = create_app(served, ns.max_request_bytes or MAX_REQUEST_BYTES,
                     answered_hosts(ns.host, ns.allow_host))  # fmt: skip
    from llm_foundry.decode_graph import captures

    graphs = ns.cuda_graph and captures(served.engine.device)
    note = eager_gpu_note(served.engine.device.type, ns.cuda_graph, adapters)
    if note:
        print(note, file=sys.stderr)
    if ns.cuda_graph and not graphs:
        print(f"note: --cuda-graph: no CUDA graphs on {served.engine.device.type}; the static "
              "decode step runs eagerly (the same tokens, no faster)", file=sys.stderr)  # fmt: skip
    if ns.compile or graphs:  # else there is nothing to wait for
        what = "capturing the decode steps' CUDA graphs" if graphs else "compiling"
        print(f"{what} ...", flush=True)
        t = time.perf_counter()
        served.engine.warm_up()
        print(f"ready in {time.perf_counter() - t:.1f} s", flush=True)
    # HTTP in a thread, the model loop in this (main) thread, where compiled kernels run fastest
    sock = listen(ns.host, ns.port)
    # on SIGTERM in-flight replies end with their last chunk; one that still has not after
    # GRACE_S (a client that does not read) is cut
    server = uvicorn.Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level="warning",
                                           timeout_graceful_shutdown=GRACE_S))  # fmt: skip
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http",
                              daemon=True)  # fmt: skip
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not thread.is_alive():
        raise OSError(f"could not serve on {ns.host}:{ns.port}")
    weights = f", {scheme} weights" if scheme else ""
    weights += f", adapters {', '.join(served.adapters)}" if served.adapters else ""
    print(f"serving {served.name} on http://{ns.host}:{ns.port}/v1 ({ns.slots} slots, context "
          f"{served.engine.context}{weights}); chat page at http://{ns.host}:{ns.port}/",
          flush=True)  # fmt: skip
    watcher = threading.Thread(target=lambda: (thread.join(), served.engine.stop()), daemon=True)
    watcher.start()  # the HTTP server ending ends the loop

    def terminate(signum, frame):
        """SIGTERM: end every reply with a last chunk (the engine), take no new request and
        stop once the replies are out (uvicorn's graceful shutdown); a second one: at once."""
        if server.should_exit:
            server.force_exit = True
        served.engine.close()
        server.should_exit = True

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        served.engine.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, before)
        server.should_exit = True
        thread.join(timeout=GRACE_S + 5)
    return 0
