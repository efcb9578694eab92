"""The served traffic a round learns from: chosen once from the run's traffic log (skipping torn
and foreign lines, and what earlier rounds or the benchmark took) and kept in the round's data
dir, then handed to the data stage as `Answered` batches (capture only)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from pipeline.config import Config
from pipeline.layout import RunDir
from pipeline.state import RunState, write_json_atomic, write_text_atomic

log = logging.getLogger("pipeline.loop")


def traffic_for_round(
    cfg: Config, run_dir: Path, state: RunState, r: int, out: Path, evalset
) -> list[dict]:
    """The traffic records round `r` learns from, chosen once and kept in the round's data dir
    (a resumed round captures the same ones even if the log grew)."""
    import json

    from actors.prompts import prompt_key
    from serve.traffic import Skipped, read_traffic, select_traffic

    share = cfg.data.sources().get("traffic", 0.0)
    if not share:
        return []
    chosen = out / "traffic_selected.jsonl"
    if chosen.exists():
        return [json.loads(x) for x in chosen.read_text().splitlines() if x.strip()]
    used = {i for rs in state.rounds[:r] for i in (rs.done.get("generate") or {}).get("traffic_ids", [])}  # fmt: skip
    skipped = Skipped()
    recs = select_traffic(
        read_traffic(RunDir(run_dir).traffic, skipped),  # streamed, never whole in memory
        round(cfg.data.prompts_for_round(r) * share),
        used,
        {prompt_key(c) for c in evalset[0]},
        cfg.data.max_length,
    )
    if skipped.torn or skipped.foreign:
        log.warning("round %d: the traffic log had %d torn line(s) (a replica that died "
                    "mid-write) and %d foreign one(s); skipped", r, skipped.torn, skipped.foreign)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # before the selection: a resumed round that finds the selection finds this beside it
    write_json_atomic(RunDir(run_dir).traffic_skipped(r), dataclasses.asdict(skipped))
    write_text_atomic(chosen, "".join(json.dumps(x) + "\n" for x in recs))
    return recs


def answered_batches(records: list[dict], batch_size: int) -> list:
    from actors.prompts import Answered

    return [
        Answered(
            tuple(tuple(x["prompt_ids"]) for x in records[i : i + batch_size]),
            tuple(tuple(x["completion_ids"]) for x in records[i : i + batch_size]),
        )
        for i in range(0, len(records), batch_size)
    ]


def users_left(prompts: list, traffic_dir: Path, since: float) -> list:
    """The simulated users' prompts a users stage still has to ask: those without an answer in
    the traffic log since the stage first began (`since`, kept in the round's state). A `ray job
    stop` in the stage leaves the answers its users got in the log; asking them again would put
    each prompt into the next round's traffic twice. A prompt the list holds k times needs k
    answers. A redaction hook that changes a prompt's text (`serve.redact`) hides its answer
    here, and that prompt is asked again."""
    from collections import Counter

    from actors.prompts import prompt_key
    from serve.traffic import prompt_text_key, read_traffic

    if not Path(traffic_dir).is_dir():
        return list(prompts)
    answered = Counter(
        prompt_text_key(rec) for rec in read_traffic(traffic_dir) if rec.get("time", 0.0) >= since
    )
    left = []
    for p in prompts:
        k = prompt_key(p)
        if answered[k]:
            answered[k] -= 1
        else:
            left.append(p)
    return left
