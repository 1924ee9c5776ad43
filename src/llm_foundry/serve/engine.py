"""Continuous batching: one loop runs the model for every request in flight.

The KV cache holds ``slots`` rows of ``capacity`` positions. Every row is right-aligned at the
shared write position ``t``: row r's tokens sit in cache slots pad[r]..t-1, and each decode step
feeds every busy row's last token at slot t together, in one forward (B = slots). Positions are
counted per row (slot - pad[r]; RoPE rotates keys at these positions too), so a row's keys do
not depend on where its slots lie and rows can be moved:

    join     a request's prompt (P tokens) is prefilled alone, at positions 0..P-1 exactly as a
             solo run, and its keys/values are copied into a free row at slots t-P..t-1 (when
             t < P every row first moves right by P - t)
    decode   one token for every busy row; free rows see only themselves (their output unused)
    leave    a finished or cancelled row is simply marked free
    compact  when t reaches the capacity, every row moves left by the smallest pad

Requests wait in a bounded queue; a full queue refuses new ones (``QueueFull``).

With ``cuda_graph=True`` every decode step runs the static step of ``decode_graph`` over rows
0..b-1 of the cache, b the smallest of 1, 2, 4, ... (capped at ``slots``) covering the busy
rows: the write position and each row's pad are device tensors and attention reads the whole
buffer, masked, so on CUDA each b's step is one CUDA graph, captured once (``warm_up``) and
replayed every step. Off CUDA the same step runs eagerly (the numbers a graph gives, no graph).

With LoRA adapters over the model (``models.multi_lora``), each request names its adapter (0:
the bare base) and every forward first tells the adapted layers each row's: rows of different
adapters share one decode step.

Nothing a request holds can stop the loop: whatever one row raises (its prefill, its sampling,
decoding its text, telling its client) finishes that row with an error, and a failure of the
shared decode step (or of anything else in a step) finishes the rows in flight; the loop goes on
with the next request.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llm_foundry.messages import one_line
from llm_foundry.sampling import check_sampling, sample_next
from llm_foundry.serve.detok import Utf8Text, WindowText
from llm_foundry.stops import settle

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a token the model rules out (JSON has no -inf)
CUDA_GRAPH_ADAPTERS = ("--cuda-graph with --adapter: a graph holds one adapter layout, not each "
                       "step's rows; serve adapters without --cuda-graph")  # fmt: skip


class QueueFull(Exception):
    """The waiting queue is at its bound: try again later."""


class Closing(QueueFull):
    """The engine is closing (the server is shutting down): no new requests."""


def _error(e: BaseException) -> str:
    """A request's "error: ..." finish reason for ``e``: one line, of bounded length."""
    return f"error: {type(e).__name__}: {one_line(e)}"


@dataclass
class Params:
    """How one sequence is generated (OpenAI's request fields, checked by the server)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives to report per token (0: the chosen one only)


@dataclass
class Sequence:
    """One generation in flight. ``emit(kind, payload)`` receives, from the engine's thread:
    ("text", (piece, [(token, logprob, top)...])) as text becomes final, then
    ("done", finish_reason) once: stop | length | cancelled | shutdown | error: MESSAGE."""

    prompt: list[int]
    params: Params
    emit: Callable[[str, object], None]
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text emitted so far
    detok: object = None  # the reply's text token by token (``detok``), made by the engine
    eos: bool = False  # ended by an end-of-text token: generated, counted, not in the text
    tail: str = ""  # the final text from character ``base`` on: what stop strings still need
    base: int = 0
    pending: list = field(default_factory=list)  # logprob records not yet sent with text
    slot: int | None = None
    cancelled: bool = False
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    generator: torch.Generator | None = None
    adapter: int = 0  # the LoRA adapter of its rows (0: the bare base; see Engine's adapters)


@dataclass
class Stats:
    """Counters for /metrics (read from other threads; ints and floats only)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    busy_slot_steps: int = 0  # sum over decode steps of the rows in use
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    cancelled: int = 0


class Engine:
    """Runs ``model`` for queued ``Sequence``s in a background thread (``start``/``stop``).
    ``adapters``: the ``AdapterRows`` of LoRA adapters put over ``model`` (None: none), which
    each forward sets to its rows' ``Sequence.adapter``."""

    def __init__(
        self,
        model,
        tokenizer,
        slots: int = 8,
        max_queue: int = 64,
        eos_ids: set[int] | frozenset = frozenset(),
        capacity: int | None = None,
        compile: bool = False,
        max_context: int | None = None,
        adapters=None,
        cuda_graph: bool = False,
        detokenizer: Callable[[list[int]], Utf8Text | WindowText] | None = None,
    ):
        cfg = model.cfg
        if slots < 1 or max_queue < 0:
            raise ValueError(f"slots={slots} must be >= 1 and max_queue={max_queue} >= 0")
        if max_context is not None and not 2 <= max_context <= cfg.max_seq_len:
            raise ValueError(
                f"--max-context {max_context} must be in [2, {cfg.max_seq_len}] (the model's "
                "max_seq_len)"
            )
        self.context = max_context or cfg.max_seq_len  # prompt + reply, per request
        self.capacity = capacity or 2 * self.context
        device = next(model.parameters()).device
        dtype = model.tok_emb.weight.dtype
        self.cuda_graph = cuda_graph
        if cuda_graph:
            from llm_foundry import decode_graph

            if adapters is not None:
                raise ValueError(CUDA_GRAPH_ADAPTERS)
            decode_graph.check_static(model, decode_graph.captures(device))
            self.capacity = decode_graph.buffer_length(self.capacity, device)
        if cfg.sliding_window is not None and cfg.sliding_window < self.capacity:
            raise ValueError(
                f"serving a sliding-window model (window {cfg.sliding_window}) needs its window "
                f">= the cache capacity {self.capacity}; not supported yet"
            )
        self._check_memory(cfg, slots, device, dtype, capacity is None)
        self.model, self.tok, self.slots, self.max_queue = model.eval(), tokenizer, slots, max_queue
        self.eos_ids = set(eos_ids)
        # a new reply's text token by token after its prompt; default: windows of the decode
        self.detokenizer = detokenizer or (lambda prompt: WindowText(tokenizer.decode, prompt))
        self.adapters = adapters
        # one busy row decodes through the compiled step, whose fused matvec streams weights
        # faster; batches of rows are matrix products either way and run eager (measured:
        # benchmarks/README.md, bench_serve); prefill stays eager
        self.compile = compile
        self.static: dict[int, object] = {}  # rows b -> decode_graph.StaticDecoder over them
        # the batch sizes a static step is built for: 1, 2, 4, ... and slots
        self.sizes = [1 << i for i in range(slots.bit_length()) if 1 << i < slots] + [slots]
        if compile and not cuda_graph:
            from llm_foundry.generate import _compiled

            self.decode = _compiled(model)
        else:
            self.decode = model
        self.device = device
        from llm_foundry.models.kv_cache import KVCache

        self.cache = KVCache(cfg.replace(sliding_window=None), slots, self.capacity, device,
                             dtype)  # fmt: skip
        model.pos.reserve(self.capacity)
        self.t = 0  # the shared write position
        self.pad = torch.zeros(slots, dtype=torch.long, device=device)
        self.rows: list[Sequence | None] = [None] * slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.stats = Stats()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._closing = False

    def _check_memory(self, cfg, slots: int, device, dtype, doubled: bool) -> None:
        """Refuse, before allocating, a cache larger than the memory left on ``device``: say
        what it would take and which context would fit."""
        from llm_foundry.accounting import human
        from llm_foundry.machine import memory_left
        from llm_foundry.models.kv_cache import cache_bytes

        need = cache_bytes(cfg.replace(sliding_window=None), slots, self.capacity, dtype)
        have = memory_left(device)
        if have is None or need <= have:
            return
        per_position = need // (slots * self.capacity)
        fits = have // (slots * per_position * (2 if doubled else 1))
        fix = (
            f"serve a shorter context (--max-context N: at most {fits} fits) or fewer --slots"
            if fits >= 2
            else "serve fewer --slots"
        )
        raise ValueError(
            f"the KV cache for {slots} slots x {self.capacity} positions (2 x the context of "
            f"{self.context}) would take {human(need, 'B')}, more than the {human(have, 'B')} of "
            f"memory left on {device}: {fix}"
        )

    # ---- the server's side (any thread) ---------------------------------------------------
    def submit(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` (all or none): QueueFull when the queue has no room for them."""
        known = len(self.adapters.names) if self.adapters is not None else 0
        for s in seqs:
            check_sampling(s.params.temperature, s.params.top_k, s.params.top_p, None, None)
            if not 0 <= s.adapter <= known:
                raise ValueError(f"adapter {s.adapter} is not one of 0..{known} (0: the base)")
        with self._wake:
            if self._closing:
                raise Closing("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue + self.free_slots():
                raise QueueFull(f"{len(self.waiting)} requests waiting (bound {self.max_queue})")
            self.waiting.extend(seqs)
            self._wake.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        """Stop ``seqs`` (a client went away): their rows are freed at the next step."""
        with self._wake:
            for s in seqs:
                s.cancelled = True
            self._wake.notify()

    def free_slots(self) -> int:
        return sum(r is None for r in self.rows)

    def queue_length(self) -> int:
        return len(self.waiting)

    def busy(self) -> int:
        return self.slots - self.free_slots()

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the one-row decode step before the first request (two cache lengths: the
        second makes the length symbolic, so it compiles once; with adapters, once for the
        bare base and once for a row with an adapter). With ``cuda_graph``: capture every
        batch size's graph (its step writes slot 0 of an empty cache)."""
        if any(r is not None for r in self.rows):
            return
        if self.cuda_graph:
            from llm_foundry.decode_graph import captures

            if captures(self.device) or self.compile:
                for b in self.sizes:
                    self._static_step(b, torch.zeros(b, 1, dtype=torch.long), 0,
                                      torch.zeros(b, dtype=torch.long, device=self.device))  # fmt: skip
            self.t = 0
            return
        if self.decode is self.model:
            return
        for adapter in (0, 1) if self.adapters is not None else (0,):
            self._select([adapter])
            for n, length in ((1, 1), (1, 2)):
                cache = self.cache.rows(n)
                cache.length = length
                cache.pad = torch.zeros(n, dtype=torch.long, device=self.device)
                idx = torch.zeros(n, 1, dtype=torch.long, device=self.device)
                self.decode(idx, cache=cache, last_only=True)
        self.t = 0

    def run(self) -> None:
        """Run the loop in the calling thread until ``stop`` (the command runs it in the main
        thread: compiled CPU kernels run ~2.5x slower from other threads here)."""
        self._running = True
        self._loop()

    def start(self) -> Engine:
        """Run the loop in a background thread."""
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llm-foundry-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """End every request in flight or waiting at the next step, with the text it has so far
        and the reason "shutdown" (its client gets a last chunk), and take no new ones."""
        with self._wake:
            self._closing = True
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- the loop (the engine's thread) ---------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self.waiting and not self.busy():
                    self._wake.wait(timeout=0.5)
                if not self._running:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the rows in flight fail, the loop goes on
                self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        """Finish every row in flight with ``e`` and start the cache over empty."""
        for seq in list(self.rows):
            if seq is not None:
                self._finish(seq, _error(e))
        self.rows = [None] * self.slots
        self.t = 0
        self.pad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Drop cancelled rows, admit waiting requests into free rows, then one decode step;
        once closing, end every request instead."""
        if self._closing:
            with self._wake:
                ending, self.waiting = [*self.rows, *self.waiting], collections.deque()
            for seq in ending:
                if seq is None:
                    continue
                try:
                    self._flush(seq, final=True)
                except Exception as e:  # noqa: BLE001 - this request fails, the others end
                    self._finish(seq, _error(e))
                self._finish(seq, "shutdown")
            self.t = 0
            return
        for seq in list(self.rows):
            if seq is not None and seq.cancelled:
                self._finish(seq, "cancelled")
        while self.free_slots():
            with self._wake:
                if not self.waiting:
                    break
                seq = self.waiting.popleft()
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            self._join(seq)
        active = [r for r, s in enumerate(self.rows) if s is not None]
        if not active:
            self.t = 0
            return
        if self.t >= self.capacity:
            self._shift(-int(min(self.pad[r] for r in active)))
        n = active[-1] + 1  # rows past the last busy one are left out of the batch
        if self.cuda_graph:
            n = next(b for b in self.sizes if b >= n)  # a size a graph was captured for
        rows = self.rows[:n]  # a free row feeds token 0 and sees only itself (pad = t)
        # built on the host and sent without a wait: the step's one sync is reading its tokens
        last = torch.tensor([[s.tokens[-1] if s else 0] for s in rows])
        busy = torch.tensor([s is not None for s in rows]).to(self.device, non_blocking=True)
        pad = torch.where(busy, self.pad[:n], self.t)
        try:
            if self.cuda_graph:
                logits = self._static_step(n, last, self.t, pad)
            else:
                cache = self.cache.rows(n)
                cache.length, cache.pad = self.t, pad
                self._select([s.adapter if s else 0 for s in rows])
                step = self.decode if n == 1 else self.model
                idx = last.to(self.device, non_blocking=True)
                logits = step(idx, cache=cache, last_only=True)[0][:, -1]
        except Exception as e:  # noqa: BLE001 - every request in flight is told
            self._fail_all(e)
            return
        self.t += 1
        self.stats.decode_steps += 1
        self.stats.busy_slot_steps += len(active)
        picks = self._greedy_picks(logits, active)
        for r in active:
            self._accept(self.rows[r], logits[r : r + 1], picks.get(r))

    def _greedy_picks(self, logits: torch.Tensor, active: list[int]) -> dict[int, int]:
        """Row -> token for the greedy rows whose logits are finite, read from the device once
        for the batch (row by row, two reads each paced a GPU's decoding at many clients); a row
        left out samples alone, and says why it cannot."""
        greedy = [r for r in active if self.rows[r].params.temperature == 0]
        if not greedy:
            return {}
        sub = logits[greedy]
        tokens, finite = torch.stack([sub.argmax(-1), torch.isfinite(sub.amax(-1))]).tolist()
        return {r: t for r, t, ok in zip(greedy, tokens, finite, strict=True) if ok}

    def _static_step(self, b: int, last: torch.Tensor, t: int, pad: torch.Tensor):
        """The logits (b, V) of the static step over rows 0..b-1 (its graph replayed on CUDA),
        feeding ``last`` (b, 1) at slot ``t`` with each row's ``pad`` (b,)."""
        dec = self.static.get(b)
        if dec is None:
            from llm_foundry.decode_graph import StaticDecoder, captures

            dec = StaticDecoder(self.model, b, self.capacity, cache=self.cache.rows(b),
                                compile=self.compile and b == 1,
                                capture=captures(self.device))  # fmt: skip
            self.static[b] = dec
        return dec.decode(last, t, pad)

    def _join(self, seq: Sequence) -> None:
        """Prefill ``seq`` alone and place its keys/values in a free row ending at slot t; what
        fails before it holds a row fails this request only."""
        try:
            logits, small = self._prefill(seq)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self._finish(seq, _error(e))
            return
        try:
            self._place(seq, small)
        except Exception as e:
            self._finish(seq, _error(e))
            raise  # rows may be half moved: the loop fails the others too
        self._accept(seq, logits)

    def _prefill(self, seq: Sequence):
        """The logits after ``seq``'s prompt and its keys/values in a cache of its own."""
        P, vocab = len(seq.prompt), self.model.cfg.vocab_size
        if not 0 < P < self.context:
            raise ValueError(f"the prompt is {P} tokens; the context is {self.context}")
        low, high = min(seq.prompt), max(seq.prompt)
        if low < 0 or high >= vocab:  # an embedding lookup out of range kills a CUDA context
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
        small = self.model.new_cache(1, P)
        idx = torch.tensor([seq.prompt], device=self.device)
        self._select([seq.adapter])
        return self.model(idx, cache=small, last_only=True)[0][:, -1], small

    def _place(self, seq: Sequence, small) -> None:
        """Copy a prefilled cache into a free row ending at slot t (rows move right if t < P)."""
        P = len(seq.prompt)
        if not any(s is not None for s in self.rows):
            self.t = 0
        if self.t < P:
            self._shift(P - self.t)
        r = self.rows.index(None)
        for layer in range(len(self.cache.k)):
            self.cache.k[layer][r, :, self.t - P : self.t] = small.k[layer][0, :, :P]
            self.cache.v[layer][r, :, self.t - P : self.t] = small.v[layer][0, :, :P]
        self.pad[r] = self.t - P
        self.rows[r], seq.slot = seq, r
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        self.stats.prompt_tokens += P

    def _select(self, adapters: list[int]) -> None:
        """Tell the adapted layers each row's adapter for the next forward."""
        if self.adapters is not None:
            self.adapters.select(adapters)

    def _shift(self, d: int) -> None:
        """Move every row's slots by ``d`` (right when > 0) and the write position with them."""
        if d == 0:
            return
        t = self.t
        for layer in range(len(self.cache.k)):
            for buf in (self.cache.k[layer], self.cache.v[layer]):
                if d > 0:
                    buf[:, :, d : t + d] = buf[:, :, 0:t].clone()
                else:
                    buf[:, :, 0 : t + d] = buf[:, :, -d:t].clone()
        for r, s in enumerate(self.rows):
            if s is not None:
                self.pad[r] += d
        self.t = t + d

    def _accept(self, seq: Sequence, logits: torch.Tensor, pick: int | None = None) -> None:
        """Pick ``seq``'s next token from its logits (1, V) (or take ``pick``, its greedy token
        read with the batch's), emit the text that is final; what fails here fails this request
        only."""
        try:
            self._next_token(seq, logits, pick)
        except Exception as e:  # noqa: BLE001 - sampling, decoding, the client's queue
            self._finish(seq, _error(e))

    def _next_token(self, seq: Sequence, logits: torch.Tensor, pick: int | None) -> None:
        p = seq.params
        token = pick
        if token is None:
            token = int(sample_next(logits, temperature=p.temperature, top_k=p.top_k,
                                    top_p=p.top_p, generator=seq.generator)[0])  # fmt: skip
        now = time.perf_counter()
        if seq.first_token_s is None:
            seq.first_token_s = now - seq.submitted
            self.stats.ttft_sum_s += seq.first_token_s
            self.stats.ttft_count += 1
        seq.tokens.append(token)
        self.stats.generated_tokens += 1
        if p.logprobs is not None:
            lp = torch.log_softmax(logits[0].float(), -1).clamp(min=LOGPROB_FLOOR)
            k = min(p.logprobs, lp.shape[-1])  # a vocabulary smaller than asked: all of it
            top = lp.topk(k) if k else None
            alternatives = (
                [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
                if top is not None
                else []
            )
            seq.pending.append((token, float(lp[token]), alternatives))
        if token in self.eos_ids:
            seq.tokens.pop()  # the end of the text, not part of it
            seq.eos = True
            self._flush(seq, final=True)
            self._finish(seq, "stop")
            return
        if seq.detok is None:
            seq.detok = self.detokenizer(seq.prompt)
        seq.tail += seq.detok.add(token)
        reason = self._flush(seq, final=False)
        if reason is None and len(seq.tokens) >= p.max_tokens:
            reason = "length"
        if reason is None and len(seq.prompt) + len(seq.tokens) >= self.context:
            reason = "length"  # the model's context is full
        if reason is not None:
            if reason == "length":
                self._flush(seq, final=True)
            self._finish(seq, reason)

    def _flush(self, seq: Sequence, final: bool) -> str | None:
        """Emit the text that can no longer change: all of it when ``final``; else hold back
        what could still begin a stop string or an unfinished character (``stops.settle``).
        Returns "stop" when a stop string appeared (the text is emitted up to it)."""
        if seq.detok is None:  # a request ended before its first token
            seq.detok = self.detokenizer(seq.prompt)
        if final:
            seq.tail += seq.detok.end()
        # the final text from ``base`` on (what may still change waits): settle sees no further
        # back than a stop string reaches
        text = seq.tail
        sent = seq.sent - seq.base
        cut, stopped = settle(text, seq.params.stop, final=final, released=sent)
        if cut > sent or (seq.pending and (final or stopped)):
            seq.emit("text", (text[sent : max(cut, sent)], seq.pending))
            seq.sent, seq.pending = seq.base + max(cut, sent), []
        reach = max(map(len, seq.params.stop), default=1) - 1
        drop = min(seq.sent - reach, seq.base + len(seq.tail)) - seq.base
        if drop > 0:
            seq.tail, seq.base = seq.tail[drop:], seq.base + drop
        return "stop" if stopped else None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            return
        seq.finished = True
        if seq.slot is not None:
            self.rows[seq.slot] = None
            seq.slot = None
        if reason == "cancelled":
            self.stats.cancelled += 1
        try:
            seq.emit("done", reason)
        except Exception:  # noqa: BLE001 - the client is gone (its event loop closed)
            pass
