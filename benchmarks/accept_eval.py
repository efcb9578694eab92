"""Score a drafter in-process on prompt files: accept_len per file, as a tree and as a chain.

  python benchmarks/accept_eval.py --drafter demo-run/train/round-000/drafter \
      --prompts benchmarks/prompts/everyday.jsonl [--prompts more.jsonl ...] \
      [--tree 5,4,12] [--chain 3] [--max-tokens 96]

Greedy, batch 1, each request ending at EOS or `--max-tokens`, with the target in the dtype the
demo serves (`--dtype auto`). accept_len is the mean of per-request figures (completion tokens
per verify pass, as SGLang counts it and as the loop's benchmark reports it); `pooled` divides
all tokens by all verify passes. No HTTP and no Ray: the same `SpecEngine` the deployment runs,
so the figures match `serve.cli bench` up to timing. Prints one JSON line (benchmarks/harness.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import Results, parser  # noqa: E402


def _prompts(path: Path) -> list:
    from actors.prompts import parse_record

    lines = [x for x in path.read_text().splitlines() if x.strip()]
    return [parse_record(json.loads(x), f"{path}:{i + 1}") for i, x in enumerate(lines)]


def score(engine, prompts: list[list[int]], params, per_request: bool = False) -> dict:
    gens = [engine.generate([p], params)[0] for p in prompts]
    per_req = [g.stats.accept_len for g in gens if g.stats.accept_len]
    tokens = sum(g.stats.completion_tokens for g in gens)
    verifies = sum(g.stats.spec_verify_ct for g in gens)
    out = {
        "accept_len": round(statistics.fmean(per_req), 3) if per_req else None,
        "pooled": round(tokens / verifies, 3) if verifies else None,
        "requests": len(gens),
        "tokens": tokens,
    }
    if per_request:  # in prompt order: two drafters compared prompt by prompt
        out["per_request"] = [round(g.stats.accept_len or 0.0, 3) for g in gens]
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", action="append", required=True, help="JSONL prompt file")
    ap.add_argument("--tree", default="5,4,12", help="steps,topk,num_draft_tokens ('' = skip)")
    ap.add_argument("--chain", type=int, default=3, help="chain steps (0 = skip)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of each file (0 = all)")
    ap.add_argument("--per-request", action="store_true", help="each request's accept_len too")
    ap.add_argument(
        "--device", default=None, help="cuda or cpu (default: cuda where torch sees one)"
    )
    args = ap.parse_args()

    import torch

    from actors.chat import prompt_ids
    from serve.engine import GenParams, SpecEngine, load_eagle, load_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok = load_target(args.target, dtype=args.dtype, device=device)
    engine = SpecEngine(model, load_eagle(args.drafter, model))
    settings = {}
    if args.tree:
        k, topk, n = (int(x) for x in args.tree.split(","))
        settings[f"tree_{k}_{topk}_{n}"] = GenParams(
            max_tokens=args.max_tokens, steps=k, topk=topk, num_draft_tokens=n
        )
    if args.chain:
        settings[f"chain_{args.chain}"] = GenParams(
            max_tokens=args.max_tokens, steps=args.chain, topk=1
        )
    out: dict = {"drafter": args.drafter, "max_tokens": args.max_tokens, "files": {}}
    t0 = time.perf_counter()
    for f in args.prompts:
        convs = _prompts(Path(f))
        if args.limit:
            convs = convs[: args.limit]
        ids = [prompt_ids(tok, c) for c in convs]
        engine.generate(ids[:1], GenParams(max_tokens=4))  # warm-up
        out["files"][Path(f).stem] = {
            name: score(engine, ids, p, args.per_request) for name, p in settings.items()
        }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    Results("accept_eval", model.device).emit(out)


if __name__ == "__main__":
    main()
