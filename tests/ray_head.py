"""A real `ray start --head` on loopback, as users run it, and `ray job submit`/`stop` against
it: the tests that start a job as users do (tests/test_closed_loop.py, tests/test_job_upload.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port

REPO = Path(__file__).resolve().parent.parent


class RayHead:
    """A real `ray start --head` on loopback, as users run it, and `ray job` against it."""

    def __init__(self, tmp: Path, repo: Path = REPO, num_cpus: int = 4):
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp, self.repo = tmp, repo  # the checkout jobs are submitted from
        # Token auth on, as Ray 2.60 defaults for local clusters: the head, `ray job submit` and
        # the driver all read ~/.ray/auth_token (made here if missing).
        env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token")
        self.bin = Path(sys.executable).parent
        env["PATH"] = f"{self.bin}:{env['PATH']}"  # the job's `python` is this venv's
        self.env = env
        token = [str(self.bin / "ray"), "get-auth-token", "--generate"]
        subprocess.run(token, check=True, env=env, capture_output=True)
        # Every port this head listens on is a free one: Ray's fixed defaults (client server
        # 10001, dashboard agent 52365) are shared with any other Ray on the machine, and an
        # agent that loses its port leaves the head without a job agent ("No available agent").
        dash, gcs, client, agent = (free_port() for _ in range(4))
        log = tmp / "ray-start.log"
        # --block, and SIGTERM to stop it: that stops this head's processes only, where
        # `ray stop --force` would kill every Ray on the machine (other test runs' included).
        self.proc = subprocess.Popen(
            [str(self.bin / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(gcs), "--ray-client-server-port", str(client),
             "--dashboard-agent-listen-port", str(agent), "--num-cpus", str(num_cpus),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
             "--disable-usage-stats", f"--temp-dir={tmp}"],
            env=dict(env, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"), stdout=log.open("w"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.address = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 300
        while "Ray runtime started" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)

    def submit(
        self,
        config: Path,
        run_dir: Path | None,
        wait: bool = True,
        overrides: tuple[str, ...] = (),
        entrypoint: tuple[str, ...] = ("pipeline/run.py",),
        env_overrides: tuple[str, ...] | None = None,
    ) -> subprocess.CompletedProcess:
        """`ray job submit` of `python ENTRYPOINT --config CONFIG [--set OVERRIDES] [--run-dir
        RUN_DIR]`, with the runtime env scripts/demo.sh makes: `runtime-env CONFIG` with the
        same overrides (`env_overrides`: others, for a checkout whose runtime-env takes none)."""
        sets = ["--set", *overrides] if overrides else []
        env_over = overrides if env_overrides is None else env_overrides  # a probe of old code
        env_sets = ["--set", *env_over] if env_over else []
        renv = subprocess.run(
            [sys.executable, "pipeline/run.py", "runtime-env", str(config), *env_sets],
            cwd=self.repo, env=self.env, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        renv_file = self.tmp / "runtime-env.json"  # a file, as scripts/demo.sh passes it:
        renv_file.write_text(renv)  # never on the command line, where `ps` shows its env vars
        renv_file.chmod(0o600)
        cmd = [str(self.bin / "ray"), "job", "submit", "--address", self.address,
               "--runtime-env", str(renv_file)]  # fmt: skip
        if not wait:
            cmd.append("--no-wait")
        cmd += ["--", "python", *entrypoint, "--config", str(config), *sets]
        if run_dir is not None:
            cmd += ["--run-dir", str(run_dir)]
        for _ in range(30):  # a fresh head answers "No available agent" until its job agent is up
            done = subprocess.run(
                cmd, cwd=self.repo, env=self.env, capture_output=True, text=True, timeout=1500
            )
            if "No available agent" not in done.stderr + done.stdout:
                break
            time.sleep(2)
        return done

    def wait_job(self, job_id: str, timeout_s: float = 1500) -> str:
        """The job's end status (SUCCEEDED, FAILED, STOPPED), or TIMEOUT."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            out = subprocess.run([str(self.bin / "ray"), "job", "status", "--address", self.address, job_id],
                                 env=self.env, capture_output=True, text=True, timeout=120).stdout  # fmt: skip
            m = re.search(r"Job '[^']+' (succeeded|failed|was stopped)", out)  # Ray's CLI words
            if m:
                return {"succeeded": "SUCCEEDED", "failed": "FAILED"}.get(m.group(1), "STOPPED")
            time.sleep(5)
        return "TIMEOUT"

    @staticmethod
    def job_id(submitted: subprocess.CompletedProcess) -> str:
        """The submission id `ray job submit` printed. Its CLI colours its output even into a
        pipe: the first word starting `raysubmit_` ends in an escape code, and `ray job stop`
        of that word answers 404 (a closed-loop test stopped nothing that way)."""
        ids = re.findall(r"raysubmit_[A-Za-z0-9]+", submitted.stdout + submitted.stderr)
        assert ids, submitted.stdout[-2000:] + submitted.stderr[-2000:]
        return ids[0]

    def stop_job(self, job_id: str) -> None:
        """`ray job stop` (it waits for the job to stop); raises when Ray did not stop it."""
        subprocess.run([str(self.bin / "ray"), "job", "stop", "--address", self.address, job_id],
                       env=self.env, capture_output=True, timeout=300, check=True)  # fmt: skip

    def shutdown(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
