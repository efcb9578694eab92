"""The one place that talks to MLflow.

Runs are addressed by id through `MlflowClient`, never through MLflow's global "active run", so a
caller that already has an outer run open (a notebook, an outer pipeline) is not disturbed and a
resumed loop reopens exactly the runs it created. Child runs carry `mlflow.parentRunId`, which is
what `mlflow.start_run(parent_run_id=...)` sets.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH

from pipeline.config import TrackingConfig
from pipeline.redact import redact

log = logging.getLogger("eagle_loop")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> dotted params, secrets redacted (pipeline/redact.py)."""
    out: dict[str, str] = {}
    for k, v in redact(d).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


class UnknownRuns(RuntimeError):
    """state.json names MLflow runs the tracking store does not have."""


class TrackingUnavailable(RuntimeError):
    """The tracking server stayed unreachable past MLflow's own retries."""


def _unreachable(err: BaseException) -> bool:
    """An MLflow error caused by a server that cannot be reached (refused, reset, timed out,
    retries used up), as opposed to one the server answered with."""
    from requests.exceptions import ConnectionError, RetryError, Timeout

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ConnectionError | RetryError | Timeout):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class _Guarded:
    """An MlflowClient whose calls name an outage. MLflow's HTTP client already retries a server
    that does not answer (MLFLOW_HTTP_REQUEST_MAX_RETRIES, 7 by default, with backoff: about 4
    minutes), so a blip costs the stage a wait and no metric (benchmarks/fault_probes.py
    `mlflow_blip`: 20 s down, 0 lost). What outlasts that raises TrackingUnavailable, which ends
    the stage before its record is committed: the re-run resumes there and logs it again."""

    def __init__(self, client: MlflowClient, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                if not _unreachable(e):
                    raise
                raise TrackingUnavailable(
                    f"tracking server {redact(self._uri)} unreachable: MLflow's {name} gave up "
                    f"after {time.monotonic() - t:.0f} s of retries ({type(e).__name__}). The "
                    "stage stopped before its results were recorded, so nothing is lost: start "
                    "the server again (or set tracking.tracking_uri) and re-run the same "
                    "command; the run resumes at this stage"
                ) from e

        return call


def store_uri(cfg: TrackingConfig, run_dir: str | Path | None) -> str:
    """`tracking.tracking_uri`, or the run directory's own store when none is given: a re-run
    from another working directory finds the same runs."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if run_dir is None:
        raise ValueError("tracking.tracking_uri: not set and no run directory to keep a store in")
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a new experiment in a sqlite store go beside the database (MLflow's default,
    ./mlruns, would be relative to whatever directory the driver runs in)."""
    if not uri.startswith("sqlite:///"):
        return None  # a server decides
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


def rehome_artifacts(uri: str) -> str | None:
    """A run directory's own sqlite store, copied with it to another folder, still names its
    artifacts by absolute file URIs under the old folder (MLflow keeps them so): point them at
    the `mlartifacts` beside the database, where the copy put them, so the runs of later rounds
    log there too. Returns the old artifact root when it moved, else None."""
    import sqlite3

    new = _artifact_root(uri)
    db = Path(uri.removeprefix("sqlite:///"))
    if new is None or not db.is_file():
        return None
    with sqlite3.connect(db) as c:
        if not c.execute("select 1 from sqlite_master where name = 'experiments'").fetchone():
            return None  # a new store: MLflow creates its tables
        locs = [x for (x,) in c.execute("select artifact_location from experiments") if x]
        old = next((x for x in locs if x.endswith("/mlartifacts") and x != new), None)
        if old is None:
            return None
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                              ("model_versions", "source"), ("model_versions", "storage_location")):  # fmt: skip
            if column in {r[1] for r in c.execute(f"pragma table_info({table})")}:
                c.execute(f"update {table} set {column} = replace({column}, ?, ?)", (old, new))
    return old


# The experiment's kind: model training ("custom_model_development"), not GenAI, where this
# project logs nothing. A kind someone set by hand is left alone. MLflow 3.17's UI still opens
# every experiment in its GenAI view (traces, an assistant panel) unless the address asks for
# model training (seen in headless Chromium, docs/img/): `runs_page` is the address to open.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def runs_page(uri: str, experiment_id: str) -> str | None:
    """The UI address of an experiment's runs on a tracking server (None: a file store has no
    UI address); no password of the URI in it."""
    if not uri.startswith(("http://", "https://")):
        return None
    base = redact(uri).rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: str | Path | None = None):
        self.cfg = cfg
        self.uri = store_uri(cfg, run_dir)
        if not cfg.tracking_uri and (old := rehome_artifacts(self.uri)):
            log.warning("%s: its artifacts were under %s (the run directory moved); now beside it",
                        self.uri, old)  # fmt: skip
        self.client = _Guarded(MlflowClient(tracking_uri=self.uri), self.uri)
        exp = self.client.get_experiment_by_name(cfg.experiment)
        self.experiment_id = (
            exp.experiment_id
            if exp
            else self.client.create_experiment(
                cfg.experiment, artifact_location=_artifact_root(self.uri)
            )
        )
        if exp is None or EXPERIMENT_KIND[0] not in exp.tags:
            self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)

    def check_known(self, run_ids: dict[str, str | None], source: str, made_in: str | None) -> None:
        """Raise UnknownRuns when any of `run_ids` (what -> id, from `source`) is not an active run
        of this store: resuming would silently start new runs beside the old ones."""
        unknown = {k: v for k, v in run_ids.items() if v and not self.run_exists(v)}
        if not unknown:
            return
        listed = ", ".join(f"{k} {v}" for k, v in unknown.items())
        uri = redact(self.uri)  # a user:password@ in the URI never reaches a message
        was = f" (it was made with {redact(made_in)})" if made_in and redact(made_in) != uri else ""
        raise UnknownRuns(
            f"{source} names MLflow runs that the tracking store {uri} does not have: "
            f"{listed}{was}. Point tracking.tracking_uri at the store this run was tracked in "
            f"(--set tracking.tracking_uri=...), or start fresh MLflow runs for these results by "
            f"moving {source} aside or using a new --run-dir."
        )

    def start_run(
        self, name: str, parent_id: str | None = None, params: dict[str, Any] | None = None
    ) -> str:
        tags = {"mlflow.parentRunId": parent_id} if parent_id else {}
        run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
        if params:
            flat = flatten(params)
            items = [Param(k, v) for k, v in flat.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(run.info.run_id, params=items[i : i + 100])
        return run.info.run_id

    def run_exists(self, run_id: str | None) -> bool:
        if not run_id:
            return False
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except TrackingUnavailable:  # not "unknown": that would tell the user to start new runs
            raise
        except Exception:
            return False

    def log(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """All metrics go through here, with namespaced keys (data/, train/, bench/)."""
        self.log_steps(run_id, [(step, metrics)])

    def log_steps(self, run_id: str, steps: Iterable[tuple[int, dict[str, float]]]) -> None:
        """A curve's metrics, `(step, metrics)` each, in as few requests as MLflow takes: one
        request a step cost 7.0 s for a 580-step round (2 cores, the demo's server), 0.8 s so."""
        items = [
            Metric(k, float(v), 0, step)
            for step, metrics in steps
            for k, v in metrics.items()
            if isinstance(v, int | float) and math.isfinite(float(v))
        ]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])

    def tag(self, run_id: str, tags: dict[str, str]) -> None:
        """Named results that are not numbers (e.g. the serving shape); a resumed stage may set
        them again, which MLflow params would refuse."""
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        elif path.exists():
            self.client.log_artifact(run_id, str(path), artifact_path)

    def reopen(self, run_id: str) -> None:
        """A resumed run is RUNNING again (an earlier attempt may have ended it FAILED)."""
        self.client.update_run(run_id, status="RUNNING")

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def register_champion(
        self, run_id: str, name: str | None = None, artifact_path: str = "drafter"
    ) -> str:
        """Register the run's drafter as a new version of `name` (None: tracking.
        registered_model) and point alias `champion` at it."""
        name = name or self.cfg.registered_model
        if not name:
            raise ValueError(
                "register_champion: no registered model name (tracking.registered_model)"
            )
        try:
            self.client.get_registered_model(name)
        except Exception:
            self.client.create_registered_model(name)
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        for mv in self.client.search_model_versions(f"name='{name}' and run_id='{run_id}'"):
            version = mv.version  # already registered (a resumed loop): reuse it
            break
        else:
            version = self.client.create_model_version(name, source, run_id=run_id).version
        self.client.set_registered_model_alias(name, "champion", str(version))
        return str(version)
