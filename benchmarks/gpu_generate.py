"""Generated tok/s of the data stage's GPU generator (actors/batch_decode.py) beside the
references, in one run on one GPU: today's HF decode loop (actors/hf_backend.HFTarget.generate)
and transformers' own `generate` with a static cache (compiled by transformers).

    python benchmarks/gpu_generate.py --target SmolLM2-135M-Instruct.Q4_1.gguf --pool pool.jsonl.gz

Two workloads:
- fixed length: random 128-token prompts, 192 new tokens, no EOS, batch 64 / 256 / 512;
- the real pool: the first `--real` prompts of the pool (chat template, greedy, stop at EOS,
  up to 256 new tokens), where lengths vary and rows finish early: the decoder refills rows,
  transformers decodes batches of 512 until the longest row ends.
Then capture tok/s: one forward per group of finished samples, aux states of 3 layers.
Prints one JSON line per measurement and a table last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.batch_decode import BatchDecoder  # noqa: E402
from actors.pool import read_pool  # noqa: E402
from benchmarks.harness import Results, clocked, parser  # noqa: E402

DEVICE = "cuda"  # a GPU script: the batched decoder's figures are for the GPU


def load(target: str):
    from actors.hf_backend import HFTarget

    if target == "random":  # SmolLM2-135M's shape, random weights: the speed, not the text
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=2,
                          max_position_embeddings=8192)  # fmt: skip
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
        return HFTarget.from_model(model)
    from benchmarks.base_drafter import load_target

    return load_target(target)


def ours(model, prompts, new, eos, rows, compiled=False) -> dict:
    cap = max(len(p) for p in prompts) + new
    dec = BatchDecoder(model, rows, -(-cap // 64) * 64, eos, compiled=compiled)
    dec.generate(prompts[: min(len(prompts), rows)], 8)  # graph capture and warm-up
    (outs, st), s = clocked(lambda: dec.generate(prompts, new), DEVICE)
    torch.cuda.empty_cache()
    return {"tokens": st.tokens, "s": round(s, 2), "tok_s": round(st.tokens / s), "steps": st.steps,
            "prefills": st.prefills, "outs": outs}  # fmt: skip


def hf_static(model, prompts, new, pad, fixed: bool, batch: int) -> dict:
    """transformers' generate, static cache (it compiles the forward itself), left-padded
    batches of `batch`; counted tokens stop at each row's EOS."""
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list) else [model.generation_config.eos_token_id])  # fmt: skip
    tokens, total = 0, 0.0
    kw = dict(max_new_tokens=new, do_sample=False, cache_implementation="static", pad_token_id=pad)
    if fixed:
        kw["min_new_tokens"] = new
    for warm in (True, False):
        for b in range(0, len(prompts), batch):
            chunk = prompts[b : b + batch]
            if len(chunk) < batch:  # one compiled shape: pad the last batch with copies
                chunk = chunk + [chunk[0]] * (batch - len(chunk))
            w = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (w - len(p)) + p for p in chunk], device="cuda")
            mask = (torch.arange(w, device="cuda")[None] >= torch.tensor([w - len(p) for p in chunk], device="cuda")[:, None]).long()  # fmt: skip
            out, s = clocked(lambda ids=ids, mask=mask: model.generate(input_ids=ids, attention_mask=mask, **kw), DEVICE)  # fmt: skip
            if warm:
                break
            total += s
            for r, row in enumerate(out[:, w:].tolist()[: len(prompts[b : b + batch])]):
                n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) if not fixed else len(row)  # fmt: skip
                tokens += n
                del r
    return {"tokens": tokens, "s": round(total, 2), "tok_s": round(tokens / total)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--target", required=True, help="a model, or `random` (SmolLM2-135M-shaped)")
    ap.add_argument("--pool", default=None)
    ap.add_argument("--real", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip", default="", help="comma list of: compiled,hf_loop,hf_static")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    t = load(a.target)
    model, eos = t.model, list(t.info().eos_token_ids)
    rows: list[dict] = []
    res = Results("gpu_generate", DEVICE)

    def emit(**r) -> None:
        r.pop("outs", None)
        rows.append(res.emit(r))

    g = torch.Generator().manual_seed(0)
    fixed = [torch.randint(100, 40000, (128,), generator=g).tolist() for _ in range(1024)]
    for b in (64, 256, 512):
        emit(
            what="fixed", engine="batch_decode", batch=b, **ours(model, fixed[: 2 * b], 192, [], b)
        )
    if "compiled" not in skip:
        try:
            emit(what="fixed", engine="batch_decode+compile", batch=512, **ours(model, fixed, 192, [], 512, compiled=True))  # fmt: skip
        except Exception as e:  # a compile failure is a figure too
            emit(what="fixed", engine="batch_decode+compile", batch=512, error=repr(e)[:300])
    if "hf_loop" not in skip:
        _, s = clocked(lambda: t.generate(fixed[:256], 64), DEVICE)
        emit(what="fixed", engine="hf_loop", batch=256, new=64, tok_s=round(256 * 64 / s), s=round(s, 2))  # fmt: skip
    if "hf_static" not in skip:
        emit(what="fixed", engine="hf_generate_static", batch=512, **hf_static(model, fixed[:1024], 192, t.pad_id, True, 512))  # fmt: skip

    if a.target == "random":
        return table(rows, a.out)
    from actors.chat import prompt_ids

    pool = [r["messages"] for r in read_pool(a.pool)[: a.real]]
    prompts = sorted((prompt_ids(t.tokenizer, c) for c in pool), key=len)
    prompts = [p for p in prompts if len(p) <= 1024]
    r = ours(model, prompts, 256, eos, 512)
    emit(what="real", engine="batch_decode", batch=512, prompts=len(prompts), **r)
    outs = r["outs"]
    if "hf_static" not in skip:
        emit(what="real", engine="hf_generate_static", batch=512, prompts=len(prompts), **hf_static(model, prompts, 256, t.pad_id, False, 512))  # fmt: skip

    cap = max(len(p) + len(o) for p, o in zip(prompts, outs, strict=True))
    dec = BatchDecoder(model, 8, cap + 1, eos)
    seqs = [p + o for p, o in zip(prompts, outs, strict=True)]
    dec.capture(seqs[:64], [1, 14, 26])
    _, s = clocked(lambda: dec.capture(seqs, [1, 14, 26]), DEVICE)
    n = sum(map(len, seqs))
    emit(what="capture", engine="batch_decode", tokens=n, s=round(s, 2), tok_s=round(n / s))
    table(rows, a.out)


def table(rows: list[dict], out: Path | None) -> None:
    if out:
        out.write_text("".join(json.dumps(x) + "\n" for x in rows))
    print(f"{'what':8} {'engine':24} {'batch':>5} {'tok/s':>9}")
    for x in rows:
        if "tok_s" in x:
            print(f"{x['what']:8} {x['engine']:24} {x.get('batch', ''):>5} {x['tok_s']:>9}")


if __name__ == "__main__":
    main()
