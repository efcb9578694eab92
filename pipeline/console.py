"""The driver's console and its log file. The console says one line when a stage starts (what it
plans) and one when it ends (what it took and made), with a progress bar while a long stage runs.
Every other line the driver's process writes goes to <run>/logs/driver.log: library progress bars
and warnings, HTTP requests, MLflow, Ray Serve, and the Ray workers' output, which Ray forwards to
the driver's stdout and stderr (the actors', the Serve replicas' access logs, the trainers' step
lines). The Ray session's own log files keep each worker's lines too.

Console lines are `eagle_loop` records at INFO (`detail` is the log file only), warnings of the
project's modules, and errors of any."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from pipeline.budget import size
from pipeline.layout import RunDir

log = logging.getLogger("eagle_loop")
detail = logging.getLogger("eagle_loop.detail")  # the driver log only

BAR_AFTER_S = 5.0  # a stage shorter than this shows no bar
BAR_WIDTH = 20
# Where the console is not a terminal (`ray job submit` streams the driver's log line by line),
# every bar update is a new line: about three per stage that ends on plan, at least MIN_EVERY_S apart.
BAR_UPDATES = 3
MIN_EVERY_S = 20.0
UNPLANNED_S = 180.0  # a stage without a plan: a line a minute
PROJECT = ("eagle_loop", "pipeline", "actors", "serve.", "eagle3")
FILE_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

_console: ConsoleHandler | None = None  # set inside driver_console


class ConsoleHandler(logging.StreamHandler):
    """Console lines: short timestamp and message. On a terminal it first clears the bar's line."""

    def __init__(self, stream: TextIO):
        super().__init__(stream)
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        self.addFilter(on_console)

    def emit(self, record: logging.LogRecord) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        super().emit(record)

    def write_bar(self, text: str) -> None:
        with self.lock:  # never inside a log line
            self.stream.write(("\r\x1b[K" + text) if self.tty else text + "\n")
            self.stream.flush()


def on_console(record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR:
        return True
    if record.name == "eagle_loop":
        return record.levelno >= logging.INFO
    return record.levelno >= logging.WARNING and record.name.startswith(PROJECT)


@contextlib.contextmanager
def driver_console(run_dir: Path) -> Iterator[Path]:
    """For the block: this process's stdout and stderr, and the log handlers that wrote to them,
    go to <run_dir>/logs/driver.log (appended: a resumed run adds to it); the terminal gets the
    console lines. An exception's traceback goes to the log before it propagates. Yields the
    log's path."""
    global _console
    path = RunDir(run_dir).driver_log
    path.parent.mkdir(parents=True, exist_ok=True)
    out, err = sys.stdout, sys.stderr
    f = path.open("a", buffering=1, encoding="utf-8", errors="replace")
    f.write(f"==== driver pid {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    root = logging.getLogger()
    # the root's own stream handlers (logging.basicConfig) are replaced by the file handler
    removed = [h for h in root.handlers if _writes_to(h, (out, err))]
    for h in removed:
        root.removeHandler(h)
    moved = _repoint((out, err), f)
    to_file = logging.StreamHandler(f)
    to_file.setFormatter(FILE_FORMAT)
    _console = ConsoleHandler(out)
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(to_file)
    root.addHandler(_console)
    sys.stdout = sys.stderr = f
    try:
        yield path
    except BaseException:
        f.write(traceback.format_exc())
        raise
    finally:
        sys.stdout, sys.stderr = out, err
        root.removeHandler(_console)
        root.removeHandler(to_file)
        root.setLevel(level)
        for h in removed:
            root.addHandler(h)
        for h, stream in moved:
            h.setStream(stream)
        _repoint((f,), err)  # handlers made inside the block (Serve's, transformers')
        _console = None
        f.close()


def _writes_to(h: logging.Handler, streams: tuple) -> bool:
    if not isinstance(h, logging.StreamHandler) or isinstance(h, logging.FileHandler):
        return False
    return any(h.stream is s for s in streams)


def _repoint(streams: tuple, to: TextIO) -> list[tuple[logging.StreamHandler, Any]]:
    """Every logger's StreamHandler (not file handlers) writing to `streams` now writes to `to`;
    returns (handler, old stream) pairs."""
    loggers = [logging.getLogger()] + [
        x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)
    ]
    moved = []
    for lg in loggers:
        for h in lg.handlers:
            if _writes_to(h, streams):
                moved.append((h, h.stream))
                h.setStream(to)
    return moved


class Stage:
    """One stage's console lines; the block sets `result`, what the end line says it made."""

    def __init__(self, name: str, planned_s: float | None):
        self.name, self.planned_s, self.result = name, planned_s, ""
        self.t0 = time.monotonic()

    def took(self) -> str:
        s = f"{time.monotonic() - self.t0:.0f} s"
        return f"{s} (planned {self.planned_s:.0f} s)" if self.planned_s else s


@contextlib.contextmanager
def stage(
    name: str, planned_s: float | None = None, plan: str = "", note: Callable[[], str] | None = None
) -> Iterator[Stage]:
    """'<name>: planned 237 s, <plan>' now; a bar of the seconds against the plan (and `note()`,
    e.g. steps done) while it runs, once past BAR_AFTER_S; '<name>: 222 s (planned 237 s):
    <result>' at the end, or 'failed after ...'."""
    st = Stage(name, planned_s)
    head = ", ".join(x for x in (planned_s and f"planned {planned_s:.0f} s", plan) if x)
    log.info("%s: %s", name, head or "started")
    bar = _Bar(st, _console, note) if _console else None
    try:
        yield st
    except BaseException:
        if bar:
            bar.stop()
        log.warning("%s: failed after %s", name, st.took())
        raise
    if bar:
        bar.stop()
    log.info("%s: %s%s", name, st.took(), f": {st.result}" if st.result else "")


class _Bar:
    """A thread drawing the stage's bar: every second in place on a terminal; elsewhere a line
    every planned/BAR_UPDATES seconds (MIN_EVERY_S at least), none before BAR_AFTER_S."""

    def __init__(self, st: Stage, con: ConsoleHandler, note: Callable[[], str] | None):
        self.st, self.con, self.note, self.drawn = st, con, note, False
        self.every = (
            1.0 if con.tty else max(MIN_EVERY_S, (st.planned_s or UNPLANNED_S) / BAR_UPDATES)
        )
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"bar {st.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        at = BAR_AFTER_S if self.con.tty else max(BAR_AFTER_S, self.every)
        while not self.done.wait(max(0.0, self.st.t0 + at - time.monotonic())):
            try:
                note = self.note() if self.note else ""
            except Exception:  # noqa: BLE001 - a bar must never fail its stage
                note = ""
            self.con.write_bar(bar_text(self.st.name, time.monotonic() - self.st.t0,
                                        self.st.planned_s, note))  # fmt: skip
            self.drawn = True
            at += self.every

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        if self.con.tty and self.drawn:
            self.con.write_bar("")


def bar_text(name: str, elapsed: float, planned: float | None, note: str = "") -> str:
    """'  round 1 data [########............] 95/237 s planned, 4/33 batches'."""
    if planned:
        k = min(BAR_WIDTH, round(BAR_WIDTH * elapsed / planned))
        text = f"  {name} [{'#' * k}{'.' * (BAR_WIDTH - k)}] {elapsed:.0f}/{planned:.0f} s planned"
    else:
        text = f"  {name} ... {elapsed:.0f} s"
    return f"{text}, {note}" if note else text


def ray_logs_dir() -> str:
    """This Ray session's log folder (each worker's and Serve's own files), as the driver sees
    it; '' when Ray is not running here."""
    import ray

    if not ray.is_initialized():
        return ""
    ctx = ray.get_runtime_context()
    return str(Path(ctx.get_temp_dir(), ctx.get_session_name(), "logs"))


# ---- what each stage's lines say ---------------------------------------------------------------


def regime_line(cfg) -> str:
    """Which precision the target decodes and the drafter trains in, and why: on a CPU the
    speed of everything the run does, and so how much of it fits the budget."""
    from eagle3.cpu import cpu_regime

    if cfg.serve.num_gpus > 0 or cfg.train.use_gpu:
        return "regime: GPU (bf16 where target.dtype and train.precision are auto)"
    name, why = cpu_regime()
    if cfg.target.dtype != "auto":
        return f"regime: CPU, target.dtype {cfg.target.dtype} as configured (auto would be {name}: {why})"  # fmt: skip
    return f"regime: CPU {name}: {why}"


def measured_line(m: dict[str, Any]) -> str:
    return (
        f"plain decode {1 / m['plain_s_per_token']:.1f} tok/s, speculative "
        f"{1 / m['spec_s_per_token']:.1f} tok/s with {m['drafter']}"
    )


def sizing_line(z: dict[str, Any]) -> str:
    """What the start-up measurement sized the run's measuring work to (pipeline/round_plan.py
    `size_work`)."""
    what = "as configured" if z["scale"] >= 1 else f"cut to {z['scale']:.0%} to fit this machine"
    gate = f"gate set {z['gate_prompts']} a source" if z["gate_prompts"] else "no gate set"
    return (
        f"measuring work {what}: {z['bench_tokens']} benchmark tokens a request, shape chains "
        f"{z['shape_chains'] or 'none'}, {z['simulate_users']} simulated users, {gate}; data "
        f"and training get {z['work_share']:.0%} of the budget"
    )


def plan_line(r: int, p: dict[str, Any], stop: Any) -> str:
    """Round r's plan `p` under the time budgets of `stop` (StopConfig)."""
    parts = [("data", "data_s"), ("train", "train_s"), ("bench", "bench_s"), ("users", "traffic_s")]
    stages = ", ".join(f"{n} {p[k]:.0f} s" for n, k in parts if p.get(k))
    of = [f"the {stop.max_wall_minutes * 60:.0f} s budget"] if stop.max_wall_minutes else []
    of += [f"{stop.round_minutes * 60:.0f} s a round"] if stop.round_minutes else []
    return (
        f"round {r} plan: {stages}; {p['budget_s']:.0f} s from {p['start_s']:.0f} s into the "
        f"run ({', '.join(of)})"
    )


def data_line(rec: dict[str, Any]) -> str:
    made = f"{rec['num_samples']} samples, {rec['num_tokens']:,} tokens"
    if "num_loss_tokens" in rec:  # learned (the target's own text unless context_turns: learn)
        ctx = rec["num_tokens"] - rec["num_loss_tokens"]
        made += f" ({rec['num_loss_tokens']:,} learned, {ctx:,} context)"
    given = f"{rec.get('traffic_records', 0)} served requests + {rec.get('fresh_prompts', 0)} fresh prompts"
    if drawn := {k: v for k, v in (rec.get("drawn") or {}).items() if v}:  # per source or domain
        given += ": " + ", ".join(f"{k} {v}" for k, v in drawn.items())
    if early := rec.get("early"):  # pipeline/round_data.py start_early
        given += (f"; {early['samples']} samples of them made early, in {early['wall_s']:.0f} s "
                  "beside the last round's server")  # fmt: skip
    cut = f"; {rec['cut']} batch(es) stopped at the deadline" if rec.get("cut") else ""
    cut += f"; {rec['left_out']} batch(es) left out at the deadline" if rec.get("left_out") else ""
    torn = (rec.get("traffic_skipped") or {}).get("torn")
    cut += f"; {torn} torn traffic line(s) skipped" if torn else ""
    disk = f"; peak disk {size(rec['disk_bytes'])} of data" if "disk_bytes" in rec else ""
    return f"{made} ({given}){cut}{disk}"


def disk_line(r: int, plan: dict[str, Any]) -> str:
    """The round's disk plan (pipeline/budget.py DiskPlan record), before it generates."""
    how = "measured" if plan["measured"] else "estimated"
    return (
        f"round {r} disk plan: {size(plan['round_bytes'])} ({plan['samples']} samples x "
        f"{plan['tokens_per_sample']:.0f} tokens ({how}) x {plan['bytes_per_token']} B), "
        f"window of {plan['window']} round(s); {size(plan['free_bytes'])} free, "
        f"{size(plan['held_bytes'])} held"
    )


def train_line(rec: dict[str, Any]) -> str:
    ev = (rec.get("eval_metrics") or {}).get("sim_accept_len")
    held = f", held-out sim_accept {ev:.2f}" if ev else ""
    gate = rec.get("gate") or {}
    if gate.get("gain_se") is not None:  # the keep-the-start decision and its evidence
        verdict = "replaces the start" if gate["replaced_start"] else "start kept"
        held += f", {gate['gain']:+.3f} +- {gate['gain_se']:.3f} over the start: {verdict}"
    return f"{rec['steps']} steps at {rec['tok_per_s']:.0f} tok/s{held}"


def bench_line(rec: dict[str, Any]) -> str:
    doms = ", ".join(f"{d} {v['accept_len']:.3f}" for d, v in (rec.get("domains") or {}).items()
                     if v.get("accept_len"))  # fmt: skip
    acc = rec["accept_len"]
    text = f"accept_len {acc:.3f}" if acc is not None else "no drafter"
    text += f" ({doms})" if doms else ""
    s = (rec.get("extra") or {}).get("settings") or {}
    if s.get("temperature"):  # a sampled figure says so
        text += f" at temperature {s['temperature']:g}, top_p {s.get('top_p', 1.0):g}"
        text += f", top_k {s['top_k']}" if s.get("top_k", -1) > 0 else ""
    shape = rec.get("shape") or {}
    if shape:
        text += (
            f"; serves {shape['served']} at {shape.get('served_speedup') or 0:.2f}x plain decoding"
        )
    return text


def users_line(rec: dict[str, Any]) -> str:
    return (
        f"{rec['requests']} requests, {rec['failed']} failed, {rec['completion_tokens']} tokens "
        "recorded for the next round"
    )


def data_note(out_dir: Path) -> Callable[[], str]:
    """The data stage's bar note: batches on disk (each has its sidecar record)."""

    def note() -> str:
        n = sum(1 for _ in out_dir.glob("b?????.json"))  # actors/shards.py batch_stem
        return f"{n} batches on disk" if n else ""

    return note


def train_note(out_dir: Path) -> Callable[[], str]:
    """The train stage's bar note: the last step logged, of the total once the workers fixed it
    (a time box fixes it after its timed steps)."""
    import json

    from pipeline.time_box import BOXED

    def note() -> str:
        metrics, boxed = out_dir / "metrics.jsonl", out_dir / BOXED
        lines = metrics.read_text().splitlines()[-5:] if metrics.exists() else []
        step = max((json.loads(x).get("step", 0) for x in lines if x.startswith("{")), default=0)
        total = json.loads(boxed.read_text())["total"] if boxed.exists() else None
        return f"step {step}/{total}" if total else f"step {step}" if step else ""

    return note


def final_report(summary: dict[str, Any]) -> str:
    """The run's end: what the plan was sized from, the per-round table, why it stopped, and the
    champion (summary.json's figures)."""
    from pipeline.rules import format_table

    lines = []
    first = (summary.get("plans") or [{}])[0]
    if m := first.get("measured"):  # what the budget plan was sized from (pipeline/measure.py)
        lines.append(f"measured at start-up ({m['wall_s']:.0f} s): {measured_line(m)}")
    if z := first.get("sizing"):
        lines.append(sizing_line(z))
    lines += [format_table(summary["rounds"]), f"stopped because: {summary['stopped_because']}"]
    if c := summary.get("champion"):
        doms = ", ".join(f"{d} {v:.3f}" for d, v in (c.get("domains") or {}).items() if v)
        lines.append(f"champion: round {c['round']}, accept_len {c['accept_len']:.3f} on "
                     f"held-out real prompts ({doms})")  # fmt: skip
        lines.append(f"          {c['drafter_dir']}")
    return "\n".join(lines)
