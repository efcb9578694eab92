"""The run directory in one place: where the driver and every stage of every round write.

Layout of a run directory:
    <run>/config.resolved.yaml   the validated config of this run
    <run>/state.json             finished stages and their records (what a resume reads)
    <run>/summary.json           the rounds table, the stop reason and the champion
    <run>/data/round-NNN/        shards and manifest.json (generate); the traffic records it
                                 chose and the log's torn lines it skipped
    <run>/data/gate/             the gate set's shards, made once per run, read by every round's
                                 training (no rule that frees old rounds' data may touch it)
    <run>/train/round-NNN/       Ray Train storage, metrics.jsonl, drafter/ (train)
    <run>/bench/round-NNN/       round-NNN.json and round-NNN.png (bench)
    <run>/serve/                 logs of the serving deployment
    <run>/traffic/               requests the embedded server recorded (prompts of later rounds)
    <run>/mlflow.db              the default MLflow store (tracking.tracking_uri unset)
    <run>/baseline.json          cached no-speculation figures of the SGLang server
    <run>/plots/                 accept_len and tok/s per round
    <run>/logs/driver.log        everything the driver printed besides its console lines, the
                                 Ray workers' forwarded output included (pipeline/console.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def round_tag(r: int) -> str:
    """`round-NNN`: the folder, benchmark tag and Ray Train run-name suffix of round r."""
    return f"round-{r:03d}"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.resolved.yaml"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def lock(self) -> Path:
        return self.root / "driver.lock"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def start_keys(self) -> Path:
        """The prompt keys the run's starting drafter was trained on, as they were when the run
        began (pipeline/round_data.py `run_prompts`)."""
        return self.root / "start_prompt_keys.txt.gz"

    @property
    def serve(self) -> Path:
        return self.root / "serve"

    @property
    def traffic(self) -> Path:
        return self.root / "traffic"

    @property
    def baseline(self) -> Path:
        return self.root / "baseline.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def driver_log(self) -> Path:
        return self.root / "logs" / "driver.log"

    def data(self, r: int) -> Path:
        return self.root / "data" / round_tag(r)

    def traffic_skipped(self, r: int) -> Path:
        """The traffic log's lines round r's reader passed over: {"torn": n, "foreign": n}."""
        return self.data(r) / "traffic_skipped.json"

    def gate(self) -> Path:
        """The gate set's data (`data.gate_prompts`): the train stage's eval set, every round."""
        return self.root / "data" / "gate"

    def train(self, r: int) -> Path:
        return self.root / "train" / round_tag(r)

    def drafter(self, r: int) -> Path:
        """Where round r's trained drafter is exported (SGLang format)."""
        return self.train(r) / "drafter"

    def bench(self, r: int) -> Path:
        return self.root / "bench" / round_tag(r)
