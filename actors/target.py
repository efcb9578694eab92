"""The Ray actor that owns the target LLM: regenerate responses, capture hidden states, write shards.

The driver sends prompt batches (plain conversations, or a `SelfWritten` count whose user turns
the target writes first) and gets back small `BatchResult` records;
tokens, hidden states and shards never leave the actor. The model sits behind `TargetBackend`:
`HFTarget` (transformers), `SGLangTarget` (actors/sglang_backend.py) or `VLLMTarget`
(actors/vllm_backend.py: vLLM generates, the HF forward captures).

Two ways through a batch:
- `process`: generate, then capture, batch by batch (the HF backend: both live in one model).
- `generate_batch` for every batch of the round, then `capture_batch` for every batch: the SGLang
  backend swaps its serving engine for capture runners between the two (two copies of a 1T
  model do not fit), so the round is split in two phases. The generated ids wait on disk in a
  small JSON-lines sidecar `b{batch:05d}.gen.jsonl`, so a rerun after a kill in the capture
  phase does not regenerate.

Capture never holds a whole batch's hidden states in memory (`data.batch_size` is 512 for Kimi).
The HF backend captures shard by shard into pinned buffers of one shard each (`CAPTURE_SLOTS`)
and streams each shard to its file while the GPU runs the next; SGLang captures token-bounded
groups (`CAPTURE_TOKENS`) and writes shards as they fill.

The actor runs two batches at a time but only one of them computes (a lock): while one batch's
shards are serialised, hashed and written, the next batch computes. The HF actor has a third
call slot (``max_concurrency=3``) for `TargetWorker.stop_now`, which must not wait behind them.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from actors.batch_records import (
    BatchResult,
    Generated,
    Written,
    not_started,
    read_generated,
    write_generated,
)
from actors.chat import Conversation, encode_conversation, prompt_ids, user_turn_prefix
from actors.config import DataConfig, TargetConfig
from actors.hf_backend import (
    HFTarget,
    PinnedPool,
    StopAt,
    load_tokenizer,
    passed,
    resolve_aux_layer_ids,
    stop_time,
)
from actors.prompts import Answered, Batch, Replied, SelfWritten, keep_written_turns
from actors.sglang_backend import token_bounded_batches
from actors.shards import (
    HEADER_RESERVE,
    Sample,
    ShardInfo,
    ShardWriter,
    pack_lengths,
    pack_parts,
    shard_name,
    write_batch_record,
    write_shard,
)

if TYPE_CHECKING:
    from actors.sglang_backend import SGLangOptions

CAPTURE_TOKENS = 32768
"""Tokens captured per backend call: a batch's hidden states reach the CPU one group at a time
(32k tokens x 57 KiB = 1.8 GiB for Kimi-K2.5's H = 7168) and are written as shards fill."""

CAPTURE_SLOTS = 4
"""HF backend: pinned host buffers of one shard each (`data.shard_max_bytes`, 256 MiB by default).
A shard streams to its file while the next ones are captured; a capture waits for a free buffer,
which bounds host memory and how far the GPU runs ahead of the disk. On the H200 host (96
sequences of 2048 tokens): 3 buffers kept 96% of the plain forward's tok/s, 4 kept 97-98%."""


class TargetBackend(Protocol):
    """What the data stage needs from a target engine (HFTarget, SGLangTarget)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def model_id(self) -> str: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def tokenizer_hash(self) -> str: ...

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
    ) -> list[list[int]]: ...

    def capture(
        self, sequences: list[list[int]], layer_ids: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def make_backend(
    target: TargetConfig,
    num_threads: int | None = None,
    sglang_options: SGLangOptions | None = None,
) -> TargetBackend:
    """The backend `target.backend` names. SGLang loads nothing until its first call."""
    if target.backend == "sglang":
        from actors.sglang_backend import SGLangOptions, SGLangTarget

        return SGLangTarget(target, options=sglang_options or SGLangOptions())
    if target.backend == "vllm":
        from actors.vllm_backend import VLLMTarget

        return VLLMTarget(target, num_threads=num_threads)
    return HFTarget(target, num_threads=num_threads)


# A batch starts only with this share of the last decode's time left: its prefill (a third of a
# long-prompt batch's time on 2 cores) runs before the first check of stop_at, and a batch begun
# with a quarter left ran 18 s past the demo's deadline (2026-12-05).
LATE_START_SHARE = 0.4


class _DeviceSpan:
    """How long the work queued between `__init__` and `stop()` took on the device: CUDA events
    (the capture calls return before the GPU has run them), the host clock on a CPU (they
    return when done)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.begin, self.end = self._now(), 0.0

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self) -> _DeviceSpan:
        self.end = self._now()
        return self

    def seconds(self) -> float:
        if not self.cuda:
            return self.end - self.begin
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000


def _captured(
    gen: Generated,
    batch_index: int,
    shards: list[ShardInfo],
    capture_s: float,
    write_s: float,
    switch_s: float = 0.0,
) -> BatchResult:
    """The record of a capture phase: its shards and figures, none of generation's."""
    return BatchResult(
        batch_index=batch_index,
        shards=tuple(shards),
        num_prompts=gen.num_prompts,
        skipped_prompts=gen.skipped_prompts,
        gen_tokens=0,
        gen_seconds=0.0,
        capture_tokens=sum(len(s) for s in gen.input_ids),
        capture_seconds=capture_s,
        write_seconds=write_s,
        switch_seconds=switch_s,
    )


def capture_mode(capture: str, backend_name: str, backend: Any) -> str:
    """`data.capture` resolved for this actor's backend. `auto`: keep the states of the HF decode
    loop's own forwards (no second pass) where that loop generates, i.e. on a CPU; where the
    batched GPU decoder generates (it keeps no states: CUDA-graph steps over a static cache), one
    capture pass afterwards is far cheaper than decoding in the HF loop, 1.6k against 35k tok/s
    for SmolLM2 on an H200. SGLang and vLLM capture in a separate pass anyway."""
    if capture != "auto":
        return capture
    batched = getattr(backend, "batch_decodes", lambda: False)()
    return "decode" if backend_name == "hf" and not batched else "forward"


class TargetWorker:
    """Owns one target replica. Plain class (testable without Ray); `TargetActor` is its actor."""

    def __init__(
        self,
        target: TargetConfig,
        data: DataConfig,
        num_threads: int | None = None,
        sglang_options: SGLangOptions | None = None,
    ):
        os.environ.update(target.env)
        self.data = data
        self.backend = make_backend(target, num_threads, sglang_options)
        # chat templating happens here, so a backend without a tokenizer of its own works too
        self.tokenizer = getattr(self.backend, "tokenizer", None) or load_tokenizer(target)
        self.aux_layer_ids = resolve_aux_layer_ids(target.aux_layer_ids, self.backend.num_layers)
        self._compute = threading.Lock()
        self._pinned: PinnedPool | None = None  # made by the first forward capture (HF backend)
        # online states: the training workers compute them; this stage keeps ids and masks only
        self.online = data.states == "online"
        self.capture_in_decode = (
            not self.online and capture_mode(data.capture, target.backend, self.backend) == "decode"
        )
        self._last_decode_s = 0.0  # how long this actor's last batch decoded
        self._stopped_at: float | None = None  # when `stop_now` was called

    def stop_now(self) -> None:
        """Stop the batch decoding now at the token it has (its replies so far are written) and
        start no other: the stage that made this actor needs its core back. Called beside a
        running `process`, in the actor's third call slot."""
        self._stopped_at = time.time()

    def _stop_at(self, stop_at: float | None) -> StopAt:
        """The decode loop's stop time: ``stop_at``, or the moment `stop_now` was called."""
        if stop_at is None:
            return None
        return lambda: stop_at if self._stopped_at is None else min(stop_at, self._stopped_at)

    def _too_late(self, stop_at: StopAt) -> bool:
        """Whether a batch starting now would get under `LATE_START_SHARE` of the time the last
        one decoded: its prefill and a few tokens would cost more than they teach."""
        at = stop_time(stop_at)
        return at is not None and at - time.time() < LATE_START_SHARE * self._last_decode_s

    def run_in_background(self) -> None:
        """This actor takes only the CPU time others leave (eagle3/cpu.py)."""
        from eagle3.cpu import run_in_background

        run_in_background()

    def info(self) -> dict[str, Any]:
        """Target identity for the manifest, plus the resolved aux layer ids."""
        b = self.backend
        target = {
            "model": b.model_id,
            "revision": b.revision,
            "num_layers": b.num_layers,
            "hidden_size": b.hidden_size,
            "vocab_size": b.vocab_size,
            "tokenizer_hash": b.tokenizer_hash,
        }
        return {"target": target, "aux_layer_ids": list(self.aux_layer_ids), "online": self.online}

    def prompt_lengths(self, prompts: list[Conversation]) -> list[int]:
        """Templated token counts (for the storage estimate)."""
        return [len(prompt_ids(self.tokenizer, c)) for c in prompts]

    def cuts_decoding(self) -> bool:
        """Whether `process` stops decoding at its ``stop_at`` (the HF decode loop), so a data
        stage may hand out batches until its deadline rather than only those that end before it."""
        cuts = getattr(self.backend, "cuts_decoding", None)
        return bool(cuts and cuts())

    def process(
        self,
        batch: Batch,
        out_dir: str,
        batch_index: int,
        batch_key: str,
        stop_at: float | None = None,
    ) -> BatchResult:
        """Generate responses for one prompt batch, capture hidden states of prompt + response, and
        write the batch's shards and its sidecar into ``out_dir``.

        Loss mask: the response (EOS included) plus earlier assistant turns of the prompt.
        With ``data.capture`` decode (HF's default) the states come out of the generation itself.
        ``stop_at`` (wall clock, where `cuts_decoding`): decoding stops there and the replies so
        far are written (`BatchResult.cut`); a batch that would get less than `LATE_START_SHARE` of
        the time this actor's last decode took is not started (`BatchResult.left_out`)."""
        if isinstance(batch, Answered | Replied):  # answered already: capture only
            gen = self._answered(*self._as_answered(batch))
            return self._capture_and_write(gen, out_dir, batch_index, batch_key)
        convs, wrote = self._conversations(batch)
        stop = self._stop_at(stop_at) if self.cuts_decoding() else None
        if self.capture_in_decode:
            return wrote.add_to(
                self._generate_captured(convs, out_dir, batch_index, batch_key, stop)
            )
        gen = self._generate(convs, batch_index, stop)
        if gen is None:
            return wrote.add_to(not_started(batch_index, len(convs)))
        gen = wrote.add_to(gen)
        c = self._capture_and_write(gen, out_dir, batch_index, batch_key)
        return replace(
            c,
            gen_tokens=gen.gen_tokens,
            gen_seconds=gen.gen_seconds,
            switch_seconds=c.switch_seconds + gen.switch_seconds,
            cut=gen.cut,
        )

    def generate_batch(
        self, batch: Batch, out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """Phase 1 of the two-phase round: generate and keep the ids in the batch's
        `.gen.jsonl` sidecar (no capture, no shards)."""
        if isinstance(batch, Answered | Replied):
            gen = self._answered(*self._as_answered(batch))
        else:
            convs, wrote = self._conversations(batch)
            # the sidecar carries the dropped turns, so the capture phase reports them too
            gen = wrote.add_to(self._generate(convs, batch_index))
        write_generated(out_dir, batch_index, batch_key, gen)
        return BatchResult(
            batch_index=batch_index,
            shards=(),
            num_prompts=gen.num_prompts,
            skipped_prompts=gen.skipped_prompts,
            gen_tokens=gen.gen_tokens,
            gen_seconds=gen.gen_seconds,
            capture_tokens=0,
            capture_seconds=0.0,
            write_seconds=0.0,
            switch_seconds=gen.switch_seconds,
        )

    def capture_batch(self, out_dir: str, batch_index: int, batch_key: str) -> BatchResult:
        """Phase 2: capture the sequences `generate_batch` left on disk, write shards + sidecar."""
        gen = read_generated(out_dir, batch_index, batch_key)
        return self._capture_and_write(gen, out_dir, batch_index, batch_key)

    def close(self) -> None:
        """Stop the backend's processes (SGLang's engine or capture ranks) before the actor dies."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            with self._compute:
                close()

    def _as_answered(self, batch: Answered | Replied) -> tuple[Answered, int]:
        """A `Replied` batch in token ids: each prompt as the template renders it for generation,
        the reply as the template renders the assistant turn (its end-of-turn token included),
        cut at data.max_new_tokens like a generated reply. A template whose prompt is not a prefix
        of the answered conversation leaves that one out. Returns (batch, left out)."""
        if isinstance(batch, Answered):
            return batch, 0
        prompts, replies = [], []
        for conv, reply in zip(batch.conversations, batch.replies, strict=True):
            head = self._encode(conv)[0]
            full = encode_conversation(
                self.tokenizer, [*conv, {"role": "assistant", "content": reply}], 1 << 30
            )[0]
            if full[: len(head)] == head and len(full) > len(head):
                prompts.append(tuple(head))
                replies.append(tuple(full[len(head) :][: self.data.max_new_tokens]))
        return Answered(tuple(prompts), tuple(replies)), len(batch) - len(prompts)

    def _answered(self, batch: Answered, left_out: int = 0) -> Generated:
        """Served requests as sequences: the prompt ids as the server templated them, then the
        completion (masked in), cut at max_length; prompts that leave no room are skipped (and
        `left_out` more were dropped before)."""
        n = self.data.max_length
        keep = [(p, c) for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True) if len(p) < n]  # fmt: skip
        return Generated(
            input_ids=[(list(p) + list(c))[:n] for p, c in keep],
            loss_mask=[([0] * len(p) + [1] * len(c))[:n] for p, c in keep],
            num_prompts=len(batch) + left_out,
            skipped_prompts=len(batch) - len(keep) + left_out,
            gen_tokens=0,
            gen_seconds=0.0,
        )

    def _conversations(self, batch: Batch) -> tuple[list[Conversation], Written]:
        """The batch's conversations; a `SelfWritten` batch first samples its user turns by
        continuing the chat template's user header (tokens and time count as generation)."""
        if not isinstance(batch, SelfWritten):
            return batch, Written()
        d = self.data
        with self._compute:
            t0 = time.perf_counter()
            turns = self.backend.generate(
                [user_turn_prefix(self.tokenizer)] * batch.count,
                d.self_prompt_max_tokens,
                d.self_prompt_temperature,
                batch.seed,
            )
            seconds = time.perf_counter() - t0
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in turns]
        # a turn shorter than the budget ended with EOS; one that used it all was cut off
        convs = keep_written_turns(texts, [len(t) < d.self_prompt_max_tokens for t in turns])
        return convs, Written(sum(map(len, turns)), seconds, batch.count - len(convs))

    def _generate(
        self, batch: list[Conversation], batch_index: int, stop_at: StopAt = None
    ) -> Generated | None:
        """The batch's sequences, or None where ``stop_at`` leaves too little time to start."""
        d = self.data
        with self._compute:
            if self._too_late(stop_at):
                return None
            encoded = self._encode_batch(batch)
            sw, t0 = self._switch_seconds(), time.perf_counter()
            cut = {"stop_at": stop_at} if stop_at is not None else {}
            new = self.backend.generate(
                [ids for ids, _ in encoded],
                d.max_new_tokens,
                d.temperature,
                d.seed + batch_index,
                **cut,
            )
            switch = self._switch_seconds() - sw
            seconds = time.perf_counter() - t0 - switch
            self._last_decode_s = seconds
            cut = passed(stop_at)
        seqs, masks = self._join(encoded, new)
        return Generated(
            input_ids=seqs,
            loss_mask=masks,
            num_prompts=len(batch),
            skipped_prompts=len(batch) - len(encoded),
            gen_tokens=sum(len(n) for n in new),
            gen_seconds=seconds,
            switch_seconds=switch,
            cut=cut,
        )

    def _generate_captured(
        self,
        batch: list[Conversation],
        out_dir: str,
        batch_index: int,
        batch_key: str,
        stop_at: StopAt = None,
    ) -> BatchResult:
        """Generate with the states of every token kept by the decode forwards (no capture
        pass), then write the batch's shards and sidecar outside the compute lock."""
        d = self.data
        with self._compute:
            if self._too_late(stop_at):
                return not_started(batch_index, len(batch))
            encoded = self._encode_batch(batch)
            t0 = time.perf_counter()
            outs = self.backend.generate_and_capture(  # type: ignore[attr-defined]
                [ids for ids, _ in encoded],
                d.max_new_tokens,
                d.temperature,
                d.seed + batch_index,
                self.aux_layer_ids,
                stop_at,
            )
            seconds = self._last_decode_s = time.perf_counter() - t0
            cut = passed(stop_at)
        t1 = time.perf_counter()
        seqs, masks = self._join(encoded, [new for new, _ in outs])
        samples = [
            Sample(ids, m, aux[: len(ids)], final[: len(ids)])
            for ids, m, (_, (aux, final)) in zip(seqs, masks, outs, strict=True)
        ]
        meta = self._shard_meta(batch_key)
        out = Path(out_dir)
        shards = [
            write_shard(out / shard_name(batch_index, j), part, meta)
            for j, part in enumerate(pack_parts(samples, d.shard_max_bytes))
        ]
        write_batch_record(out, batch_index, batch_key, shards, self.info())
        gen_tokens = sum(len(new) for new, _ in outs)
        return BatchResult(
            batch_index=batch_index,
            shards=tuple(shards),
            num_prompts=len(batch),
            skipped_prompts=len(batch) - len(encoded),
            gen_tokens=gen_tokens,
            gen_seconds=seconds,
            capture_tokens=sum(len(s.input_ids) for s in samples),
            capture_seconds=0.0,
            write_seconds=time.perf_counter() - t1,
            cut=cut,
        )

    def _capture_and_write(
        self, gen: Generated, out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """Capture the batch's sequences and write its shards (packed as `pack_parts` packs the
        whole batch), then the batch sidecar. Writing happens outside the compute lock, so the
        actor's other call computes meanwhile.

        HF backend: overlapped (`_capture_streamed`). Other backends (SGLang): capture in
        token-bounded groups, then write each shard as soon as it is full. Online states: no
        capture, the ids only (`_write_ids`)."""
        if self.online:
            return self._write_ids(gen, out_dir, batch_index, batch_key)
        if isinstance(self.backend, HFTarget):
            return self._capture_streamed(gen, out_dir, batch_index, batch_key)
        return self._capture_then_write(gen, out_dir, batch_index, batch_key)

    def _write_ids(
        self, gen: Generated, out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """`data.states: online`: the batch's shards hold its token ids and loss masks, with
        states of width 0 (the same format, 5 bytes a token); the training workers compute the
        states per batch (pipeline/online_states.py)."""
        t0 = time.perf_counter()

        def none(n: int) -> torch.Tensor:
            return torch.empty(n, 0, dtype=torch.bfloat16)

        samples = [
            Sample(ids, m, none(len(ids)), none(len(ids)))
            for ids, m in zip(gen.input_ids, gen.loss_mask, strict=True)
        ]
        meta, out = self._shard_meta(batch_key), Path(out_dir)
        shards = [
            write_shard(out / shard_name(batch_index, j), part, meta)
            for j, part in enumerate(pack_parts(samples, self.data.shard_max_bytes))
        ]
        write_batch_record(out, batch_index, batch_key, shards, self.info())
        return _captured(gen, batch_index, shards, 0.0, time.perf_counter() - t0)

    def _capture_streamed(
        self, gen: Generated, out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """The shard packing is planned from the sequence lengths first (`pack_lengths`); then,
        shard by shard, every forward of the shard is queued on the GPU into one pinned buffer
        (`HFTarget.capture_async` with a `PinnedPool` slot) and the shard goes to a writer
        thread at once. The writer streams each sample as its copy lands, hashing beside a
        writing thread (`write_shard` with `Sample.ready`), while the GPU runs the next shard.
        Same samples, packing and bytes as capturing first and writing after.

        capture_seconds: the device's time on this batch's forwards and copies (CUDA events,
        so the actor's two calls, whose captures overlap on the host clock, do not count the same
        GPU time twice); write_seconds: the writer's tail after the last states landed, and the
        sidecar."""
        seqs, masks = gen.input_ids, gen.loss_mask
        meta = self._shard_meta(batch_key)
        out = Path(out_dir)
        lengths = [len(s) for s in seqs]
        width = (len(self.aux_layer_ids) + 1) * self.backend.hidden_size
        parts = pack_lengths(lengths, width, self.data.shard_max_bytes)
        pool = self._pinned_pool(width)
        futures: list[Future[ShardInfo]] = []
        spans: list[_DeviceSpan] = []
        with ShardWriter(threads=pool.slots) as writer:
            last = None
            for j, part in enumerate(parts):
                slot = pool.take()  # outside the lock: the other call may compute meanwhile
                try:
                    with self._compute:
                        span = _DeviceSpan(self.backend.device)
                        pending = self.backend.capture_async(
                            [seqs[i] for i in part], self.aux_layer_ids, pool, slot
                        )
                        spans.append(span.stop())
                except BaseException:
                    pool.give(slot)
                    raise
                samples = [
                    Sample(seqs[i], masks[i], p.aux, p.final, ready=p.wait)
                    for i, p in zip(part, pending, strict=True)
                ]
                path = out / shard_name(batch_index, j)
                futures.append(
                    writer.submit(path, samples, meta, after=lambda s=slot: pool.give(s))
                )
                last = pending[-1]
            if last is not None:
                last.wait()
            landed = time.perf_counter()
        shards = [f.result() for f in futures]
        write_batch_record(out, batch_index, batch_key, shards, self.info())
        capture_s = sum(span.seconds() for span in spans)
        return _captured(gen, batch_index, shards, capture_s, time.perf_counter() - landed)

    def _pinned_pool(self, width: int) -> PinnedPool:
        """The worker's `CAPTURE_SLOTS` pinned buffers, each holding the states of one full shard
        (made once: pinning a fresh 64 MB buffer cost 24 ms on the H200 host)."""
        with self._compute:  # the actor's two calls: make it once
            if self._pinned is None:
                tokens = (self.data.shard_max_bytes - HEADER_RESERVE) // (2 * width)
                self._pinned = PinnedPool(CAPTURE_SLOTS, tokens, width)
            return self._pinned

    def _capture_then_write(
        self, gen: Generated, out_dir: str, batch_index: int, batch_key: str
    ) -> BatchResult:
        """Capture in token-bounded groups; write each shard as soon as it is full (the packing
        equals `pack_parts` over the whole batch)."""
        seqs, masks = gen.input_ids, gen.loss_mask
        meta = self._shard_meta(batch_key)
        out = Path(out_dir)
        lengths = [len(s) for s in seqs]
        bound = max([CAPTURE_TOKENS, *lengths])
        shards: list[ShardInfo] = []
        pending: list[Sample] = []
        capture_s = write_s = switch = 0.0
        for group in token_bounded_batches(lengths, bound, max(1, len(seqs))):
            with self._compute:
                sw, t0 = self._switch_seconds(), time.perf_counter()
                states = self.backend.capture([seqs[i] for i in group], self.aux_layer_ids)
                took, dsw = time.perf_counter() - t0, self._switch_seconds() - sw
            switch += dsw
            capture_s += took - dsw
            t1 = time.perf_counter()
            for i, (aux, final) in zip(group, states, strict=True):
                pending.append(Sample(seqs[i], masks[i], aux, final))
            parts = pack_parts(pending, self.data.shard_max_bytes)
            for part in parts[:-1]:  # full: the next sample did not fit
                shards.append(write_shard(out / shard_name(batch_index, len(shards)), part, meta))
            pending = parts[-1] if parts else []
            write_s += time.perf_counter() - t1
        t1 = time.perf_counter()
        if pending:
            shards.append(write_shard(out / shard_name(batch_index, len(shards)), pending, meta))
        write_batch_record(out, batch_index, batch_key, shards, self.info())
        write_s += time.perf_counter() - t1
        return _captured(gen, batch_index, shards, capture_s, write_s, switch)

    def _switch_seconds(self) -> float:
        """Seconds the backend spent loading or switching phases so far (SGLang reports them)."""
        return sum(s for _, s in getattr(self.backend, "phase_switch_s", ()))

    def _encode_batch(self, batch: list[Conversation]) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, mask) of each conversation that leaves room for a response."""
        encoded = [self._encode(c) for c in batch]
        return [e for e in encoded if len(e[0]) < self.data.max_length]

    def _join(
        self, encoded: list[tuple[list[int], list[int]]], new: list[list[int]]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Prompt + response ids and loss masks (the response is masked in), cut at max_length."""
        n = self.data.max_length
        seqs = [(p + r)[:n] for (p, _), r in zip(encoded, new, strict=True)]
        masks = [(m + [1] * len(r))[:n] for (_, m), r in zip(encoded, new, strict=True)]
        return seqs, masks

    def _shard_meta(self, batch_key: str) -> dict[str, str]:
        return {"batch_key": batch_key, "aux_layer_ids": ",".join(map(str, self.aux_layer_ids))}

    def _encode(self, conv: Conversation) -> tuple[list[int], list[int]]:
        """Prompt ids (ending with the assistant header) and their mask, untruncated. The
        prompt's own assistant turns were written by another model: context (mask 0) unless
        `data.context_turns` is `learn`."""
        ids, mask = encode_conversation(self.tokenizer, conv, 1 << 30, add_generation_prompt=True)
        return ids, (mask if self.data.context_turns == "learn" else [0] * len(ids))


if TYPE_CHECKING:
    TargetActor: Any


def __getattr__(name: str) -> Any:
    """`TargetActor`: `TargetWorker` as a Ray actor, made on first use, so that `TargetWorker`
    runs where Ray is not installed (the GPU benchmark host). HF backend:
    ``TargetActor.options(num_cpus=..., num_gpus=target.num_gpus_per_actor, max_concurrency=3)``;
    SGLang backend: ``TargetActor.options(**target_actor_options(target,
    reserve_target_gpus(target.tp_size)), max_concurrency=2)`` (see actors/generate.py
    `_start_actors`)."""
    if name == "TargetActor":
        import ray

        actor = globals()["TargetActor"] = ray.remote(TargetWorker)
        return actor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
