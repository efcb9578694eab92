"""A run's plots, written to <run>/plots/ and logged to MLflow by the driver: accept_len per round
(overall and per domain), acceptance per draft position, tok/s against plain decoding, and the
curve: accept_len against the training tokens and the machine minutes spent so far."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.state import RunState


def round_plots(
    state: RunState, rows: list[dict[str, Any]], out: Path, cur: dict[str, Any]
) -> list[Path]:
    """Every plot of a run into `out`, from its rounds' rows (rules.round_row), their benchmark
    records in `state`, and its curve (rules.curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["round"] for r in rows], [r["accept_len"] for r in rows], "o-", label="overall")
    for dom in dict.fromkeys(d for r in rows for d in r.get("domains") or {}):
        pts = [(r["round"], r["domains"][dom]) for r in rows if (r.get("domains") or {}).get(dom)]
        ax.plot(*zip(*pts, strict=True), ".--", label=dom)
    for r in rows:  # rounds the gate did not promote: the serving drafter stayed
        if not r.get("promoted", True):
            ax.annotate("not promoted", (r["round"], r["accept_len"]), fontsize=7)
    ax.set(xlabel="round", ylabel="accept_len", title="accept_len per round (held-out)")
    ax.legend(fontsize=7)
    paths.append(out / "accept_len_per_round.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    paths.append(curve_plot(cur, out / "accept_len_curve.png"))

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for rs in state.rounds:
        acc = (rs.done.get("bench") or {}).get("acceptance_per_position") or []
        ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"round {rs.index}")
    ax.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance per position")
    ax.legend()
    paths.append(out / "acceptance_per_position.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["round"] for r in rows], [r["tok_per_s"] for r in rows], "o-", label="speculative")
    ax.plot(
        [r["round"] for r in rows], [r["baseline_tok_per_s"] for r in rows], "s--", label="baseline"
    )
    ax.set(xlabel="round", ylabel="output tok/s", title="tok/s vs baseline")
    ax.legend()
    paths.append(out / "tok_per_s.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)
    return paths


def curve_plot(cur: dict[str, Any], path: Path, extra: dict[str, dict] | None = None) -> Path:
    """accept_len (held-out, overall and per domain) against the training tokens and the machine
    minutes spent so far, round by round (rules.curve); `extra`: labelled single points drawn
    beside it (benchmarks/climb_vs_scratch.py: the same data trained from scratch in one round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = cur["points"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, key, label in ((axes[0], "train_tokens", "training tokens so far"),
                           (axes[1], "minutes", cur["minutes"])):  # fmt: skip
        ax.plot([p[key] for p in pts], [p["accept_len"] for p in pts], "o-", label="overall")
        for dom in dict.fromkeys(d for p in pts for d in p["domains"]):
            xy = [(p[key], p["domains"][dom]) for p in pts if p["domains"].get(dom)]
            ax.plot(*zip(*xy, strict=True), ".--", label=dom)
        for p in pts:
            ax.annotate(f"r{p['round']}" + ("" if p["promoted"] else " (not promoted)"),
                        (p[key], p["accept_len"]), fontsize=7)  # fmt: skip
        for name, e in (extra or {}).items():
            ax.plot([e[key]], [e["accept_len"]], "*", markersize=11, label=name)
        ax.set(xlabel=label)
    axes[0].set(ylabel="accept_len (held-out)", title="accept_len vs data")
    axes[1].set(title="accept_len vs cost")
    axes[1].legend(fontsize=7)
    fig.tight_layout(), fig.savefig(path), plt.close(fig)
    return path
