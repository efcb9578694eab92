"""Build the embedded default's base drafter on one GPU host, without Ray: the drafter `make demo`
starts from (configs/smollm2-cpu.yaml `drafter.init`), as a team starts from a public drafter.

    python benchmarks/base_pool.py --config configs/smollm2-cpu.yaml --out pool.jsonl.gz
    python benchmarks/base_drafter.py gen   --target T.gguf --pool pool.jsonl.gz --out /tmp/base
    python benchmarks/base_drafter.py train --target T.gguf --out /tmp/base --export drafters/smollm2-135m-base

`gen`: the target regenerates a reply for every pool prompt (greedy, bf16, the server's chat
template and stop tokens) with the batched GPU decoder (actors/batch_decode.py), after a
self-check against transformers: the decoder's greedy tokens must equal HF's own decode loop on
a few prompts, and its captured states must equal HF's hidden states of the same tokens.
Writes `samples.pt` (prompt and reply ids per prompt) and `gen.json`.

`train`: online training with the project's training code (eagle3.train_step): each packed
batch's aux states are captured by one forward pass of the target right before its step (the
135M target's forward costs less than reading the states back from disk; nothing is stored).
The draft vocabulary is the smallest that covers `--coverage` of the reply tokens. Held-out
samples give the simulated chain-3 acceptance after `--curve` samples seen and after every
epoch; the best state is exported in bf16 (no embedding: SGLang and vLLM take the target's).
Each curve point's drafter is exported too (`curve-N/`), for the served-acceptance curve.
`Trainee`, `drafter_trainee` and `epoch_order` are also what benchmarks/finetune_sweep.py
fine-tunes with.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.batch_decode import BatchDecoder  # noqa: E402
from actors.pool import read_pool  # noqa: E402
from benchmarks.harness import Results, add_training_args, parser  # noqa: E402

AUX = None  # SGLang's default ids for the target ([1, 14, 26] for SmolLM2's 30 layers)


def log(**kw) -> None:
    Results("base_drafter", "cuda" if torch.cuda.is_available() else "cpu").emit(kw)


def load_target(target: str):
    from actors.config import TargetConfig
    from actors.hf_backend import HFTarget

    gpu = int(torch.cuda.is_available())
    return HFTarget(TargetConfig(model=target, dtype="bfloat16" if gpu else "auto", num_gpus_per_actor=gpu))  # fmt: skip


def self_check(t, prompts: list[list[int]], aux: list[int]) -> dict:
    """The decoder against transformers on the same prompts: greedy tokens (bf16 near-ties may
    flip a token late in a reply, so the figure is the share of replies equal up to 32 tokens and
    of all tokens before the first difference) and aux states (relative max difference)."""
    dec = BatchDecoder(t.model, len(prompts), max(map(len, prompts)) + 65, list(t.info().eos_token_ids))  # fmt: skip
    ours, _ = dec.generate(prompts, 64)
    ref = t.generate(prompts, 64)
    same32 = sum(a[:32] == b[:32] for a, b in zip(ours, ref, strict=True)) / len(prompts)
    agree = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))) for a, b in zip(ours, ref, strict=True)]  # fmt: skip
    seq = prompts[0] + ours[0]
    got = dec.capture([seq], aux)[0][0].float()
    hs = t.model(torch.tensor([seq], device=t.device), output_hidden_states=True).hidden_states
    want = torch.cat([hs[k + 1][0] for k in aux], dim=-1).float()
    rel = float((got - want).abs().max() / want.abs().max())
    return {"same_first_32": same32, "tokens_before_first_difference": sum(agree),
            "of_tokens": sum(map(len, ref)), "capture_rel_diff": round(rel, 4),
            "reply": t.tokenizer.decode(ours[0][:60])}  # fmt: skip


def gen(a: argparse.Namespace) -> None:
    from actors.chat import prompt_ids
    from eagle3.fit import resolve_aux_layer_ids

    a.out.mkdir(parents=True, exist_ok=True)
    t = load_target(str(a.target))
    aux = resolve_aux_layer_ids(AUX, t.num_layers)
    pool = read_pool(a.pool)[: a.limit or None]
    t0 = time.perf_counter()
    ids = [prompt_ids(t.tokenizer, r["messages"]) for r in pool]
    keep = [i for i, p in enumerate(ids) if len(p) <= a.max_prompt_tokens]
    log(pool=len(pool), kept=len(keep), too_long=len(pool) - len(keep), tokenize_s=round(time.perf_counter() - t0, 1))  # fmt: skip
    log(self_check=self_check(t, [ids[i] for i in keep[:8]], aux))
    order = sorted(keep, key=lambda i: len(ids[i]))  # short first: smaller attention windows
    eos = list(t.info().eos_token_ids)
    if a.replies == "dataset":  # the way many public drafters are built: another model's text
        return _dataset_samples(a, t, pool, ids, order, aux, eos)
    dec = BatchDecoder(t.model, a.rows, a.max_prompt_tokens + a.max_new_tokens, eos)
    replies, st = dec.generate([ids[i] for i in order], a.max_new_tokens)
    ended = sum(bool(r) and r[-1] in eos for r in replies)
    stats = {"prompts": len(order), "gen_tokens": st.tokens, "gen_s": round(st.seconds, 1),
             "gen_tok_s": round(st.tok_per_s), "steps": st.steps, "prefills": st.prefills,
             "ended_at_eos": ended, "rows": a.rows, "max_new_tokens": a.max_new_tokens,
             "prompt_tokens": sum(len(ids[i]) for i in order)}  # fmt: skip
    log(gen=stats)
    samples = [{"prompt": ids[i], "reply": r, "source": pool[i].get("source", "?")} for i, r in zip(order, replies, strict=True)]  # fmt: skip
    torch.save({"aux": aux, "eos": eos, "samples": samples}, a.out / "samples.pt")
    (a.out / "gen.json").write_text(json.dumps(stats))


def _dataset_samples(a, t, pool: list, ids: list, order: list, aux: list, eos: list) -> None:
    """`gen --replies dataset`: each prompt's reply is its source's own (a ShareGPT answer,
    written by another model), templated as the server would show it, cut at
    `--max-new-tokens`; prompts whose source has no reply are left out. Nothing is generated:
    the training captures the target's states over these tokens."""
    from actors.chat import encode_conversation

    samples, cut = [], 0
    for i in order:
        reply = pool[i].get("reply")
        if not reply:
            continue
        full, mask = encode_conversation(
            t.tokenizer, pool[i]["messages"] + [{"role": "assistant", "content": reply}], 1 << 20
        )
        p = ids[i]
        last = max((j for j, m in enumerate(mask) if m), default=-1)
        if full[: len(p)] != p or last < len(p):
            continue  # the template renders this reply's prompt differently: not comparable
        r = full[len(p) : last + 1]
        cut += len(r) > a.max_new_tokens
        samples.append({"prompt": p, "reply": r[: a.max_new_tokens], "source": pool[i].get("source", "?")})  # fmt: skip
    stats = {"prompts": len(samples), "replies": "dataset", "reply_tokens": sum(len(s["reply"]) for s in samples),
             "cut_at_max_new_tokens": cut, "prompt_tokens": sum(len(s["prompt"]) for s in samples)}  # fmt: skip
    log(gen=stats)
    torch.save({"aux": aux, "eos": eos, "samples": samples}, a.out / "samples.pt")
    (a.out / "gen.json").write_text(json.dumps(stats))


def _vocab(samples: list[dict], vocab: int, coverage: float, cap: int) -> tuple[int, float, torch.Tensor]:  # fmt: skip
    counts = torch.zeros(vocab, dtype=torch.float64)
    for s in samples:
        counts += torch.bincount(torch.tensor(s["reply"]), minlength=vocab).double()
    top = counts.sort(descending=True).values.cumsum(0) / counts.sum()
    need = int((top < coverage).sum()) + 1
    n = min(cap, -(-need // 256) * 256)
    return n, float(top[n - 1]), counts


def _batch(dec: BatchDecoder, aux: list[int], seqs: list[dict]):
    from eagle3.train_step import Batch

    ids = [s["prompt"] + s["reply"] for s in seqs]
    got = dec.capture(ids, aux)
    cu = [0]
    for x in ids:
        cu.append(cu[-1] + len(x))
    dev = dec.device
    return Batch(
        input_ids=torch.tensor([t for x in ids for t in x], device=dev),
        loss_mask=torch.tensor(
            [m for s in seqs for m in [0] * len(s["prompt"]) + [1] * len(s["reply"])], device=dev
        ).bool(),  # fmt: skip
        aux_hidden=torch.cat([g[0] for g in got]),
        final_hidden=torch.cat([g[1] for g in got]),
        cu_seqlens=cu,
        position_ids=torch.cat([torch.arange(len(x), device=dev) for x in ids]),
        keys=[""] * len(ids),
    )


@dataclass
class Trainee:
    """A drafter as the loop trains it, wrapped for training on `device`, with its soft-label
    teacher: a scratch one (`scratch_trainee`, what `train` builds) or an existing one
    (`drafter_trainee`, what benchmarks/finetune_sweep.py fine-tunes)."""

    drafter: Any
    module: Any
    autocast: torch.dtype | None
    soft: Any  # eagle3.train_step.SoftTargets
    device: torch.device

    def evaluate(self, batches, ttt: int) -> dict[str, float]:
        """Held-out TTT metrics (sim_accept_len, acc_i, ...) over `batches`."""
        from eagle3.train_step import eval_metrics, eval_step

        self.module.eval()
        sums = torch.zeros(3 * ttt, dtype=torch.float64)
        for b in batches:
            sums += eval_step(self.module, b.to(self.device), self.soft, ttt, self.autocast).cpu()
        self.module.train()
        return eval_metrics(sums, ttt, 3)

    def export(self, where: Path) -> float:
        """Save the drafter as the loop exports it; returns its size in MiB."""
        from eagle3.checkpoint import save_drafter

        sd = self.module.state_dict().items()
        state = {k.removeprefix("drafter."): v.detach().cpu() for k, v in sd}
        save_drafter(state, self.drafter.cfg, where)
        return round((where / "model.safetensors").stat().st_size / 2**20, 2)


def scratch_trainee(
    target: str, info, aux: list[int], vocab: int, counts: torch.Tensor, device
) -> Trainee:
    """The loop's scratch drafter (pipeline.train's config for this target, aux ids and draft
    vocab of `vocab` from token `counts`)."""
    from eagle3.config import Eagle3Config
    from eagle3.target_weights import load_target_tensors
    from eagle3.train_step import SoftTargets, parallelize, scratch_drafter
    from eagle3.vocab import build_vocab_map
    from pipeline.config import DrafterConfig  # pydantic: `train` needs it, `gen` does not
    from pipeline.train import _scratch_config

    cfg = Eagle3Config(**_scratch_config(DrafterConfig(draft_vocab_size=vocab), info, aux))
    tens = load_target_tensors(target)
    d2t, t2d = build_vocab_map(counts, vocab)
    drafter = scratch_drafter(cfg, tens["embed"], tens["lm_head"], tens["norm"], d2t, t2d, 0)
    drafter = drafter.to(device)
    module, autocast, dt = parallelize(drafter, device, "auto")
    soft = SoftTargets(tens["lm_head"], drafter.d2t, drafter.t2d, dt or torch.float32, device)
    return Trainee(drafter, module, autocast, soft, torch.device(device))


def drafter_trainee(target: str, init: str | Path, device) -> Trainee:
    """An existing drafter (SGLang folder) as the loop fine-tunes it: its own vocab map and
    weights, the target's embedding and lm_head for the soft labels."""
    from eagle3.checkpoint import load_drafter
    from eagle3.model import drafter_from_state
    from eagle3.target_weights import load_target_tensors
    from eagle3.train_step import SoftTargets, parallelize

    tens = load_target_tensors(target)
    cfg, state = load_drafter(init)
    drafter = drafter_from_state(cfg, state, tens["embed"].float()).to(device)
    module, autocast, dt = parallelize(drafter, device, "auto")
    soft = SoftTargets(tens["lm_head"], drafter.d2t, drafter.t2d, dt or torch.float32, device)
    return Trainee(drafter, module, autocast, soft, torch.device(device))


def epoch_order(bins: int, epoch: int) -> list[int]:
    """The bins of one epoch, shuffled with the epoch as seed: the order these scripts have
    always used (drafters/smollm2-135m-base was trained in it, so its build reproduces)."""
    order = list(range(bins))
    random.Random(epoch).shuffle(order)
    return order


def train(a: argparse.Namespace) -> None:
    from eagle3.train_step import make_optimizer, make_scheduler, pack, train_step

    blob = torch.load(a.out / "samples.pt")
    aux, samples = blob["aux"], [s for s in blob["samples"] if s["reply"]]
    if a.train_prompt_tokens:  # a CPU build: the short prompts the demo serves, less capture
        samples = [s for s in samples if len(s["prompt"]) <= a.train_prompt_tokens]
    t = load_target(str(a.target))
    dev = t.device
    random.Random(0).shuffle(samples)
    held, tr = samples[: a.heldout], samples[a.heldout :]
    if a.train_samples:  # a time-boxed build: the schedule ends where the data does
        tr = tr[: a.train_samples]
    # the vocabulary from every reply made (counting needs no capture), not only the trained ones
    vd, cov, counts = _vocab(samples, t.vocab_size, a.coverage, a.max_vocab)
    log(vocab={"draft_vocab_size": vd, "coverage": round(cov, 4), "train_samples": len(tr), "heldout": len(held)})  # fmt: skip
    trainee = scratch_trainee(str(a.target), t.info().arch, aux, vd, counts.long(), dev)
    module, soft, autocast = trainee.module, trainee.soft, trainee.autocast
    longest = max(len(s["prompt"]) + len(s["reply"]) for s in samples)
    dec = BatchDecoder(t.model, 1, longest + 1, blob["eos"])  # its forward only: capture
    bins = pack([len(s["prompt"]) + len(s["reply"]) for s in tr], a.tokens_per_batch, 0)
    steps = len(bins) * a.epochs
    opt = make_optimizer(module, a.lr, 0.0)
    sched = make_scheduler(opt, steps, 0.015)
    held_batches = [_batch(dec, aux, [held[j] for j in b]) for b in pack([len(s["prompt"]) + len(s["reply"]) for s in held], a.tokens_per_batch, 1)]  # fmt: skip

    def evaluate() -> dict:
        m = trainee.evaluate(held_batches, a.ttt)
        return {"sim_accept_len": round(m["sim_accept_len"], 4), "acc": [round(m[f"acc_{i}"], 3) for i in range(a.ttt)]}  # fmt: skip

    curve = sorted(int(x) for x in a.curve.split(",") if x)
    seen, step, best, t0, trained_tokens = 0, 0, -1.0, time.perf_counter(), 0
    results = {"curve": [], "epochs": []}
    for epoch in range(a.epochs):
        for b in epoch_order(len(bins), epoch):
            if a.seconds and time.perf_counter() - t0 > a.seconds:
                break
            batch = _batch(dec, aux, [tr[j] for j in bins[b]])
            out = train_step(module, batch, soft, opt, sched, a.ttt, 0.5, autocast)
            step, seen, trained_tokens = step + 1, seen + len(bins[b]), trained_tokens + out.tokens  # fmt: skip
            if step % a.log_every == 0:
                el = time.perf_counter() - t0
                log(step=step, of=steps, loss=round(out.loss, 4), tok_s=round(trained_tokens / el), s=round(el))  # fmt: skip
            while epoch == 0 and curve and seen >= curve[0]:
                n = curve.pop(0)
                point = {"samples": n, **evaluate(), "mb": trainee.export(a.out / f"curve-{n}")}
                results["curve"].append(point)
                log(curve=point)
        m = {"epoch": epoch, "steps": step, "samples_seen": seen, **evaluate(),
             "s": round(time.perf_counter() - t0, 1), "tok_s": round(trained_tokens / (time.perf_counter() - t0))}  # fmt: skip
        if epoch == 0:
            results["curve"].append(
                {"samples": seen, **{k: m[k] for k in ("sim_accept_len", "acc")}}
            )
        if m["sim_accept_len"] > best:
            best = m["sim_accept_len"]
            m["mb"] = trainee.export(a.export)
        results["epochs"].append(m)
        log(epoch=m)
    results.update(draft_vocab_size=vd, coverage=cov, ttt=a.ttt, lr=a.lr, tokens_per_batch=a.tokens_per_batch,
                   best_sim_accept_len=best, train_samples=len(tr), heldout=len(held))  # fmt: skip
    (a.out / "train.json").write_text(json.dumps(results, indent=1))
    log(done=results)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("phase", choices=["gen", "train"])
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pool", type=Path)
    ap.add_argument("--limit", type=int, default=0, help="first N pool prompts (0: all)")
    ap.add_argument(
        "--replies",
        choices=["target", "dataset"],
        default="target",
        help="gen: the target regenerates every reply (on-policy), or each prompt keeps its "
        "source's own reply (ShareGPT's; off-policy, as many public drafters are trained)",
    )
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--heldout", type=int, default=512)
    ap.add_argument("--coverage", type=float, default=0.99)
    ap.add_argument("--max-vocab", type=int, default=12288, help="25 MB in bf16 at SmolLM2's shape")
    ap.add_argument(
        "--seconds", type=float, default=0, help="stop training after this (0: no limit)"
    )
    add_training_args(ap, tokens_per_batch=16384, ttt=5, threads=0)
    ap.add_argument("--curve", default="2000,8000,32000")
    ap.add_argument("--export", type=Path, default=Path("drafters/smollm2-135m-base"))
    ap.add_argument(
        "--train-prompt-tokens",
        type=int,
        default=0,
        help="train only on samples whose prompt is at most this long (0: all)",
    )
    ap.add_argument("--log-every", type=int, default=100)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen(a) if a.phase == "gen" else train(a)


if __name__ == "__main__":
    main()
