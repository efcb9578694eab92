"""The run directory's persisted state: which stages of which round are done, with their outputs.

`state.json` is rewritten atomically and fsynced after every stage, so a killed loop resumes at
the first stage not recorded as done, and reuses the MLflow run ids it created instead of making
new ones. A copy, `state.json.bak`, is written first: a state.json found empty or torn (a disk
that lost unsynced data) heals from it, or, without a good copy, is set aside and the state
rebuilt from nothing (the stages run again), each with a warning naming the file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from actors.files import atomic_write
from pipeline.layout import RunDir
from pipeline.redact import redact

log = logging.getLogger(__name__)

STAGES = ("generate", "train", "bench", "gate", "traffic")


def write_text_atomic(path: Path, text: str) -> None:
    atomic_write(path, text)


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


@dataclass
class RoundState:
    index: int
    mlflow_run_id: str | None = None
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> its result record

    def is_done(self, stage: str) -> bool:
        return stage in self.done

    # Typed reads of the records later stages need (the records are the stages' result dataclasses,
    # saved as JSON by `loop._record`).
    @property
    def manifest(self) -> Path:
        """The generate stage's manifest.json (DataResult.manifest)."""
        return Path(self.done["generate"]["manifest"])

    @property
    def drafter_dir(self) -> str:
        """The train stage's exported drafter (TrainResult.drafter_dir)."""
        return self.done["train"]["drafter_dir"]


@dataclass
class RunState:
    config_digest: str
    parent_run_id: str | None = None
    rounds: list[RoundState] = field(default_factory=list)
    elapsed_s: float = 0.0  # wall time spent in earlier invocations
    stopped_because: str | None = None
    champion: dict[str, Any] | None = None
    tracking_uri: str | None = None  # the MLflow store the run ids below live in (saved masked)
    run_dir: str | None = None  # where it was saved: a run directory copied elsewhere re-roots

    def run_ids(self) -> dict[str, str | None]:
        """Every MLflow run id this state names: "parent", "round-N"."""
        ids: dict[str, str | None] = {"parent": self.parent_run_id}
        ids.update({f"round-{rs.index}": rs.mlflow_run_id for rs in self.rounds})
        return ids

    @classmethod
    def load_or_new(
        cls, run_dir: Path, digest: str, changes: Callable[[dict], list[str]] | None = None
    ) -> RunState:
        """The run directory's state, or a new one. One made with another config digest is
        refused, naming what changed, unless `changes` (Config.changes_from) finds nothing in the
        stored config.resolved.yaml: then an earlier release made it, and it resumes."""
        path = RunDir(run_dir).state
        if not path.exists():
            return cls(config_digest=digest)
        raw = _read_state(path)
        if raw is None:
            return cls(config_digest=digest)
        if raw["config_digest"] != digest:
            stored = RunDir(run_dir).config
            diff = [f"digest {raw['config_digest']} != {digest}, no {stored.name} to compare"]
            if changes is not None and stored.is_file():
                diff = changes(yaml.safe_load(stored.read_text()) or {})
            if diff:
                raise ValueError(
                    f"{path}: this run directory was made with another config ({'; '.join(diff[:6])}"
                    f"{'; ...' if len(diff) > 6 else ''}); use a new --run-dir or restore the config"
                )
            log.warning("%s: made by an earlier release, with this config: it resumes", path)
            raw["config_digest"] = digest
        here = str(Path(run_dir).resolve())
        if (was := raw.get("run_dir")) and was != here:
            # copied or moved (another machine, another mount): every path it names under its old
            # folder is the same file under this one
            raw = _rerooted(raw, was, here)
            log.warning("%s: the run directory moved from %s; its paths now point here", path, was)
        rounds = [RoundState(**r) for r in raw.pop("rounds")]
        return cls(**raw, rounds=rounds)

    def save(self, run_dir: Path) -> None:
        """state.json and its copy; a `user:password@` in the tracking URI is masked here, where
        the file is written, whoever set the field."""
        path = RunDir(run_dir).state
        self.run_dir = str(Path(run_dir).resolve())
        data = {**asdict(self), "tracking_uri": redact(self.tracking_uri)}
        write_json_atomic(_backup(path), data)  # first: state.json is never the only copy
        write_json_atomic(path, data)

    def round(self, i: int) -> RoundState:
        while len(self.rounds) <= i:
            self.rounds.append(RoundState(index=len(self.rounds)))
        return self.rounds[i]


def _rerooted(obj: Any, old: str, new: str) -> Any:
    """`obj` (state.json's JSON) with every string naming a path under `old` naming it under
    `new`: the records' paths, and a sqlite tracking URI inside the run directory."""
    if isinstance(obj, dict):
        return {k: _rerooted(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rerooted(v, old, new) for v in obj]
    if isinstance(obj, str) and (obj == old or old + "/" in obj):
        return obj.replace(old + "/", new + "/") if obj != old else new
    return obj


def _backup(path: Path) -> Path:
    return path.with_name(path.name + ".bak")


def _parse_state(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(raw, dict) and isinstance(raw.get("config_digest"), str)
    return raw if ok and isinstance(raw.get("rounds"), list) else None


def _read_state(path: Path) -> dict[str, Any] | None:
    """state.json, else its backup when state.json is empty or torn, else None (rebuild)."""
    raw = _parse_state(path)
    if raw is not None:
        return raw
    bak = _backup(path)
    raw = _parse_state(bak) if bak.exists() else None
    if raw is not None:
        log.warning("%s is empty or torn; resuming from its copy %s", path, bak)
        return raw
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    path.replace(aside)
    log.warning(
        "%s is empty or torn and has no good copy; set aside as %s, the run state is rebuilt "
        "from nothing (finished stages run again)",
        path,
        aside,
    )
    return None


class Clock:
    """Wall time of the loop across resumed invocations."""

    def __init__(self, state: RunState):
        self.state, self.t0, self.base = state, time.monotonic(), state.elapsed_s

    def elapsed(self) -> float:
        return self.base + time.monotonic() - self.t0

    def commit(self) -> None:
        self.state.elapsed_s = self.elapsed()


class RunDirBusy(RuntimeError):
    """Another driver holds the run directory."""


@contextmanager
def hold_run_dir(run_dir: Path, wait_s: float = 180.0) -> Iterator[None]:
    """One driver per run directory, for the driver's whole life: an exclusive lock on
    <run>/driver.lock, which the OS frees when its holder dies (SIGKILL included). A job that
    `ray job stop` stopped can outlive the stop: its driver was seen saving state.json 16 s
    after a resubmitted one had started, overwriting the finished run's record. So a second
    driver waits for the first up to `wait_s`, then refuses, naming the holder. (flock is
    per host: on storage several nodes share, submit one job per run directory.)"""
    path = RunDir(run_dir).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise RunDirBusy(
                        f"run dir {run_dir} is in use by another driver ({holder}), still "
                        f"after {wait_s:.0f} s: wait for that job to end, or stop it "
                        "(`ray job stop <id>`), then submit again; or pass another --run-dir"
                    ) from None
                if not said:
                    log.warning("run dir %s is held by another driver (%s): waiting up to "
                                "%.0f s for it to exit", run_dir, holder, wait_s)  # fmt: skip
                    said = True
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n".encode(), 0
        )
        yield
    finally:
        os.close(fd)  # releases the lock
