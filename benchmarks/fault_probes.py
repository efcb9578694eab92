"""Issue 51's fault probes: each fault made to happen against the real components, one JSON line
per probe: {"probe": NAME, "lost": COUNT, "recovery_s": SECONDS, "detail": {...}} (with the
harness's fields: bench, device, date, load).

  python benchmarks/fault_probes.py                          # this checkout, every probe
  python benchmarks/fault_probes.py --repo /tmp/before       # another checkout's code (before)
  python benchmarks/fault_probes.py --only disk_full mlflow_blip

`lost` counts what did not survive: a record, a metric, a request, a file left half-written under
its name, a job that failed. `recovery_s` is from the fault's end to the first thing that worked
again (null where nothing had to recover).
- `override_upload`: a real `ray start --head` and `ray job submit` of the run's first check
  (preflight) with `--set drafter.init=drafters/smollm2-135m-base`, the runtime env made as
  scripts/demo.sh makes it; lost 1 when the job does not find the drafter it was told to use.
- `torn_traffic`: a process appending 40 KB traffic records dies mid-line (SIGXFSZ: its
  RLIMIT_FSIZE cuts a write); lost = acknowledged records the reader does not return; detail
  says whether the reader reported the torn line.
- `disk_full`: a real 32 MiB tmpfs filled by another file, then a manifest, a shard, a drafter
  export over an older one and a traffic record are written; lost = files half-written under
  their names + old drafters damaged + traffic records lost; detail: whether each error named the
  file and the free bytes. Needs root (mount); says so and skips otherwise.
- `replica_kill_after_swap`: a real Serve app of a tiny target swapped from drafter A to B, then
  one engine replica killed with SIGKILL by its pid while 4 requests run; twice: with one replica
  (lost = requests neither answered 200 nor told to retry by a 503 with Retry-After), then two
  (`serve.num_replicas: 2`; lost = requests not answered 200). recovery_s = kill to the first
  200; detail: the statuses, the router's retry counts, whether the app then serves B (its
  `usage.drafter` digest).
- `mlflow_blip`: a real `mlflow server` (sqlite) stopped for 20 s while the tracking seam logs a
  metric every 0.25 s, then started again; lost = metrics missing from the store.
- `two_runs`: two tiny two-round runs (tests/test_first_round.py's) submitted at once to one real
  `ray start --head`, logging to one real `mlflow server`; the second takes its own serve.app and
  route_prefix where the checkout has them. lost = jobs that failed + the 4 simulated users'
  requests of a run that its own traffic log lacks + runs whose registered `champion` is not
  their own champion round's. Minutes (two runs on 2 cores).
- `job_stop_<stage>` (generate, train, bench, gate, traffic: the simulated users): the two_runs
  run (round 0 serves a random drafter to 4 simulated users, round 1 fine-tunes it on their
  traffic and 4 fresh prompts) submitted to a real head, `ray job stop` as soon as its state
  shows the stage running (round 1's; round 0's for traffic), then the same submit again. lost =
  the resumed job failing + rounds missing or twice in the summary + MLflow parent runs other
  than one + round runs missing or twice + traffic records lost or twice (against what the
  state says the users were served) + a registered version twice + a data manifest of the
  stopped job's rewritten. detail: where the stop landed (a fast stage may end first) and the
  counts. About 3 minutes each on 2 cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from actors.ports import free_port  # noqa: E402
from benchmarks.harness import Results  # noqa: E402

RESULTS = Results("fault_probes")


def emit(probe: str, lost: int, recovery_s: float | None, **detail: Any) -> None:
    """One line per probe (the harness adds where and when it was measured)."""
    RESULTS.emit({"probe": probe, "lost": lost, "recovery_s": recovery_s, "detail": detail})


# -- override_upload ---------------------------------------------------------------------------
def probe_override_upload(repo: Path, tmp: Path) -> None:
    sys.path.insert(0, str(HERE / "tests"))  # the tests' real head (tests/ray_head.py)
    from ray_head import RayHead

    helps = subprocess.run([sys.executable, "pipeline/run.py", "runtime-env", "--help"],
                           cwd=repo, capture_output=True, text=True).stdout  # fmt: skip
    takes_set = "--set" in helps  # before the fix, scripts/demo.sh gave it none
    head = RayHead(Path(tempfile.mkdtemp(prefix="fp-ray-", dir="/tmp")), repo=repo)
    t = time.monotonic()
    try:
        job = head.submit(
            repo / "configs" / "smollm2-cpu.yaml",
            None,
            overrides=("drafter.init=drafters/smollm2-135m-base",),
            entrypoint=("-m", "pipeline.preflight"),
            env_overrides=None if takes_set else (),
        )
    finally:
        head.shutdown()
    out = job.stdout + job.stderr
    ok = job.returncode == 0 and "preflight: ok" in out
    why = next((ln.strip() for ln in out.splitlines() if "does not exist" in ln), None)
    emit("override_upload", 0 if ok else 1, None, job_rc=job.returncode, runtime_env_set=takes_set,
         job_s=round(time.monotonic() - t, 1), error=why and why[:300])  # fmt: skip


# -- torn_traffic ------------------------------------------------------------------------------
# The writer dies mid-line: its file-size limit (RLIMIT_FSIZE) lets the kernel write part of a
# record, then kills it with SIGXFSZ, as a crash would (a SIGKILL rarely lands inside the
# memcpy of a write; the fsync after it takes the time).
WRITER = """
import resource, signal, sys
from serve.traffic import TrafficLog
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's kill is the crash
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
log = TrafficLog(sys.argv[1], "7")
for i in range(10**6):
    log.append({"id": f"r{i}", "prompt_ids": [1] * 20_000, "completion_ids": [4, 5]})
    print(f"r{i}", flush=True)
"""


def probe_torn_traffic(repo: Path, tmp: Path) -> None:
    from serve import traffic

    d = tmp / "traffic"
    proc = subprocess.run([sys.executable, "-c", WRITER, str(d), str(100_000)], cwd=repo,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(repo)))  # fmt: skip
    acked = proc.stdout.split()
    data = b"".join(p.read_bytes() for p in d.glob("*.jsonl"))
    if hasattr(traffic, "Skipped"):  # the reader counts what it skips
        skipped = traffic.Skipped()
        got = [r["id"] for r in traffic.read_traffic(d, skipped)]
        reported: Any = skipped.torn
    else:
        got, reported = [r["id"] for r in traffic.read_traffic(d)], "not reported"
    emit("torn_traffic", len(set(acked) - set(got)), None, writer_rc=proc.returncode,
         line_cut=not data.endswith(b"\n"), acked=len(acked), read=len(got),
         torn_lines_reported=reported)  # fmt: skip


# -- disk_full ---------------------------------------------------------------------------------
def _fill(d: Path, leave: int) -> Path:
    filler = d / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


def _names(err: BaseException, path: Path) -> bool:
    return str(path) in str(err) and "bytes free" in str(err)


def probe_disk_full(repo: Path, tmp: Path) -> None:
    import torch

    from actors.files import atomic_write
    from actors.shards import Sample, write_shard
    from eagle3.checkpoint import load_drafter, save_drafter
    from pipeline.best import write_drafter_dir
    from serve.traffic import TrafficLog, read_traffic

    mnt = tmp / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        emit("disk_full", 0, None, skipped=f"cannot mount a tmpfs: {done.stderr.strip()}")
        return
    detail: dict[str, Any] = {"fs": "tmpfs 32 MiB"}
    lost = 0
    try:
        drafter = repo / "drafters" / "smollm2-135m-base"
        cfg, old = load_drafter(drafter)
        dest = mnt / "drafter"
        save_drafter(old, cfg, dest, dtype=torch.bfloat16)  # the one a resume would read
        log = TrafficLog(mnt / "traffic", "7")
        rec = {"prompt": "p", "completion_ids": [4, 5]}
        log.append({**rec, "id": "before", "prompt_ids": [1, 2, 3]})
        t = 2000
        sample = Sample(list(range(t)), [1] * t, torch.zeros(t, 768, dtype=torch.bfloat16),
                        torch.zeros(t, 256, dtype=torch.bfloat16))  # fmt: skip
        writes = {
            "manifest": (mnt / "manifest.json", lambda p: atomic_write(p, b"x" * (1 << 20))),
            "shard": (mnt / "batch-000000-part-000.safetensors", lambda p: write_shard(p, [sample])),
            "drafter": (dest, lambda p: write_drafter_dir(p, None, {k: v + 1 if v.is_floating_point() else v for k, v in old.items()}, cfg)),
        }  # fmt: skip
        filler = _fill(mnt, 256 << 10)
        for name, (path, write) in writes.items():
            try:
                write(path)
                detail[name] = "written?"
            except Exception as e:  # noqa: BLE001 - what each one raises is the finding
                detail[name] = {"error": type(e).__name__, "names_path_and_free": _names(e, path)}
            if name != "drafter" and path.exists():
                lost += 1  # a half file under its name
        try:
            _, kept = load_drafter(dest)
            lost += 0 if all(torch.equal(kept[k], old[k].to(kept[k].dtype)) for k in old) else 1
        except Exception as e:  # noqa: BLE001
            lost += 1
            detail["old_drafter"] = repr(e)[:200]
        try:
            log.append({**rec, "id": "cut", "prompt_ids": list(range(100_000))})
        except OSError:
            pass
        filler.unlink()
        t0 = time.monotonic()
        atomic_write(mnt / "manifest.json", b"x" * (1 << 20))  # space freed: works again
        recovery = round(time.monotonic() - t0, 3)
        log.append({**rec, "id": "after", "prompt_ids": [1, 2, 3]})
        log.close()
        got = [r["id"] for r in read_traffic(mnt / "traffic")]
        lost += len({"before", "after"} - set(got))
        detail["traffic_read"] = got
        detail["temp_files_left"] = [p.name for p in mnt.rglob("*") if ".tmp-" in p.name]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    emit("disk_full", lost, recovery, **detail)


def _tiny_target(tmp: Path) -> tuple[Path, Any]:
    """The tests' tiny random Llama (tests/conftest.py) with SmolLM2's tokenizer, saved under
    `tmp`, and loaded; tests/ goes on sys.path for the tests' helpers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(HERE / "tests"))
    from conftest import build_tiny_llama

    from eagle3.target_weights import SMOLLM2_GGUF, smollm2_dir

    tok = tmp / "tok"
    AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF).save_pretrained(tok)
    target = build_tiny_llama(tmp / "target", tok)
    return target, AutoModelForCausalLM.from_pretrained(target)


# -- replica_kill_after_swap -------------------------------------------------------------------
def probe_replica_kill(repo: Path, tmp: Path) -> None:
    """Twice: with one engine replica, then two (where the checkout has serve.num_replicas)."""
    import ray

    target, lm = _tiny_target(tmp)
    from conftest import save_random_drafter

    a, b = (save_random_drafter(lm, tmp / n, s) for n, s in (("a", 1), ("b", 2)))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(repo)}})  # fmt: skip
    try:
        port = free_port()
        for replicas in (1, 2):
            _kill_a_replica(target, a, b, tmp, port, replicas)
    finally:
        ray.shutdown()


def _kill_a_replica(target: Path, a: str, b: str, tmp: Path, port: int, replicas: int) -> None:
    import concurrent.futures as cf

    import httpx
    from ray import serve

    from pipeline.config import ServeConfig, TargetConfig
    from serve.deployment import drafter_digest
    from serve.endpoint import deploy_endpoint

    has_replicas = "num_replicas" in ServeConfig.model_fields
    if replicas > 1 and not has_replicas:
        emit("replica_kill_after_swap", 0, None, replicas=replicas,
             skipped="this checkout has no serve.num_replicas")  # fmt: skip
        return
    cfg = ServeConfig(port=port, steps=2, num_cpus=1, **({"num_replicas": replicas} if has_replicas else {}))  # fmt: skip
    app = f"faults-{replicas}"
    ep = deploy_endpoint(cfg, TargetConfig(model=str(target)), a, tmp / "logs", app_name=app)
    try:
        ep.swap_drafter(b)
        engine = serve.get_deployment_handle("SpecServer", app)
        pids: set[int] = set()
        for _ in range(50):  # requests reach the replicas at random: ask until each answered
            pids.add(engine.drafter_info.remote().result()["pid"])
            if len(pids) == replicas:
                break
        pid = min(pids)
        body = {"prompt": [5, 6, 7], "max_tokens": 300, "temperature": 0, "ignore_eos": True}

        def ask() -> tuple[int, str | None, float]:
            """(status, Retry-After, when it came back); status 0 = no HTTP answer."""
            try:
                r = httpx.post(f"{ep.url}/v1/completions", json=body, timeout=180)
                return r.status_code, r.headers.get("retry-after"), time.monotonic()
            except httpx.HTTPError:
                return 0, None, time.monotonic()

        with cf.ThreadPoolExecutor(4) as pool:
            inflight = [pool.submit(ask) for _ in range(4)]
            time.sleep(1.0)  # all four are in the engine (300 tokens take a few seconds)
            os.kill(pid, signal.SIGKILL)
            t = time.monotonic()
            answers = [f.result() for f in inflight]
        codes = [c for c, _, _ in answers]
        told_retry = sum(c == 503 and bool(ra) for c, ra, _ in answers)
        done_200 = [w for c, _, w in answers if c == 200]
        digest, recovery = None, round(min(done_200) - t, 1) if done_200 else None
        while time.monotonic() - t < 240:
            try:
                r = httpx.post(f"{ep.url}/v1/completions", json=body, timeout=60)
                if r.status_code == 200:
                    recovery = recovery if recovery is not None else round(time.monotonic() - t, 1)
                    digest = r.json()["usage"].get("drafter")
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        new = {engine.drafter_info.remote().result()["pid"] for _ in range(10)}
        try:
            router = serve.get_app_handle(app).router_info.remote().result()
        except Exception:  # noqa: BLE001 - a checkout without the router
            router = None
        # lost: requests neither answered nor told to retry (with one replica), not answered
        # (with two: another replica takes them at once)
        lost = sum(c != 200 for c in codes) - (told_retry if replicas == 1 else 0)
        emit("replica_kill_after_swap", lost, recovery, replicas=replicas,
             in_flight_status=codes, answered_200=len(done_200), told_retry_503=told_retry,
             answered_500=codes.count(500), router=router, killed_pid_gone=pid not in new,
             serves_swapped=digest == drafter_digest(b), serves_initial=digest == drafter_digest(a))  # fmt: skip
    finally:
        ep.shutdown()


# -- mlflow_blip -------------------------------------------------------------------------------
def _mlflow(port: int, db: Path, log: Path) -> subprocess.Popen:
    mlflow = Path(sys.executable).with_name("mlflow")
    return subprocess.Popen(
        [str(mlflow), "server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(db.parent / "art")],
        stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
    )  # fmt: skip


def _wait_up(port: int, timeout: float = 180) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"mlflow server on {port} did not start")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def probe_mlflow_blip(repo: Path, tmp: Path, outage_s: float = 20.0) -> None:
    from pipeline.config import TrackingConfig
    from pipeline.tracking import Tracker

    port, db = free_port(), tmp / "mlflow.db"
    server = _mlflow(port, db, tmp / "mlflow.log")
    _wait_up(port)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    tracker = Tracker(TrackingConfig(tracking_uri=f"http://127.0.0.1:{port}", experiment="blip"))
    run = tracker.start_run("blip")
    sent, failed, stop = [], [], threading.Event()
    times: dict[str, float] = {}

    def logger() -> None:
        step = 0
        while not stop.is_set():
            try:
                tracker.log(run, {"probe/x": float(step)}, step=step)
                sent.append(step)
                if "down" in times and "up" in times and "first_ok" not in times:
                    times["first_ok"] = time.monotonic()
            except Exception as e:  # noqa: BLE001 - a lost metric is the finding
                failed.append((step, type(e).__name__, str(e)[:160]))
            step += 1
            time.sleep(0.25)

    th = threading.Thread(target=logger)
    th.start()
    time.sleep(3)
    _stop(server)
    times["down"] = time.monotonic()
    time.sleep(outage_s)
    server = _mlflow(port, db, tmp / "mlflow.log")
    _wait_up(port)
    times["up"] = time.monotonic()
    time.sleep(3)
    stop.set()
    th.join(timeout=600)
    stored = {int(m.step) for m in tracker.client.get_metric_history(run, "probe/x")}
    attempted = len(sent) + len(failed)
    _stop(server)
    rec = times.get("first_ok")
    emit("mlflow_blip", attempted - len(stored), rec and round(rec - times["up"], 1),
         outage_s=outage_s, attempted=attempted, stored=len(stored), failed_calls=len(failed),
         first_error=failed[0][1:] if failed else None)  # fmt: skip


# -- two_runs ----------------------------------------------------------------------------------
def _random_base(lm: Any, tmp: Path) -> str:
    """The runs' starting drafter: random, at the aux layers the runs capture, saved in bf16."""
    import torch

    from actors.hf_backend import resolve_aux_layer_ids
    from eagle3.checkpoint import save_drafter
    from serve.engine import random_drafter

    aux = resolve_aux_layer_ids(None, lm.config.num_hidden_layers)
    d = random_drafter(lm, draft_vocab_size=512, seed=3, aux_layer_ids=aux).model
    return str(save_drafter(d.state_dict(), d.cfg, tmp / "base", dtype=torch.bfloat16))


def _two_run_config(name: str, target: Path, base: str, serve_port: int, mlflow_uri: str,
                    isolate: bool) -> dict[str, Any]:  # fmt: skip
    """tests/test_first_round.py's run: round 0 serves `base` to 4 simulated users, round 1
    fine-tunes it on their traffic plus 4 fresh prompts."""
    serve = {"steps": 2, "port": serve_port, "record_traffic": True, "simulate_users": 4,
             "simulate_concurrency": 2}  # fmt: skip
    if isolate:  # the second run takes its own app and route (unknown fields before the fix)
        serve |= {"app": f"eagle3-{name}", "route_prefix": f"/{name}"}
    return {
        "name": name,
        "target": {"model": str(target)},
        "data": {"source": {"builtin": 0.5, "traffic": 0.5}, "prompts_per_round": 8,
                 "heldout_prompts": 4, "user_prompts": 8, "max_new_tokens": 24, "batch_size": 6,
                 "num_actors": 1},
        "drafter": {"init": base},
        "train": {"first_round": "skip", "num_workers": 1, "epochs": 2, "lr": 0.003,
                  "ttt_length": 2, "tokens_per_batch": 256, "checkpoint_every": 4},
        "serve": serve,
        "bench": {"num_prompts": 4, "max_tokens": 16, "warmup": 1, "shape_chains": [],
                  "collapse_predicted": 99},
        "stop": {"accept_len": None, "max_rounds": 2},
        "tracking": {"tracking_uri": mlflow_uri, "experiment": "two-runs"},
    }  # fmt: skip


def probe_two_runs(repo: Path, tmp: Path) -> None:
    import json

    import yaml
    from mlflow.tracking import MlflowClient

    target, lm = _tiny_target(tmp)
    from ray_head import RayHead

    from serve.traffic import read_traffic

    base = _random_base(lm, tmp)
    isolate = "route_prefix" in (repo / "serve" / "config.py").read_text()
    mport, sport = free_port(), free_port()
    server = _mlflow(mport, tmp / "mlflow.db", tmp / "mlflow.log")
    _wait_up(mport)
    head = RayHead(tmp / "ray", repo=repo, num_cpus=8)
    jobs: dict[str, str] = {}
    t = time.monotonic()
    try:
        for name in ("a", "b"):
            cfg = _two_run_config(name, target, base, sport, f"http://127.0.0.1:{mport}",
                                  isolate and name == "b")  # fmt: skip
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
            job = head.submit(tmp / f"{name}.yaml", tmp / name, wait=False)
            jobs[name] = head.job_id(job)
        status = {n: head.wait_job(j, timeout_s=2400) for n, j in jobs.items()}
    finally:
        head.shutdown()
    wall = round(time.monotonic() - t, 1)
    client = MlflowClient(f"http://127.0.0.1:{mport}")
    failed, traffic, champions = 0, {}, {}
    for name in jobs:
        run = tmp / name
        failed += status[name] != "SUCCEEDED"
        traffic[name] = len(list(read_traffic(run / "traffic")))
        state = json.loads((run / "state.json").read_text()) if (run / "state.json").exists() else {}  # fmt: skip
        champ = state.get("champion") or {}
        want = champ and state["rounds"][champ["round"]]["mlflow_run_id"]
        model = champ.get("registered_model")
        try:
            got = model and client.get_model_version_by_alias(model, "champion").run_id
        except Exception:  # noqa: BLE001 - no such model or alias: the finding
            got = None
        champions[name] = {"registered_model": model, "own_champion": bool(want) and got == want}
    _stop(server)
    # lost: a job that failed, a user's request logged in the other run's traffic (4 each),
    # a run whose registered champion is not its own
    lost = failed + sum(max(0, 4 - n) for n in traffic.values())
    lost += sum(not c["own_champion"] for c in champions.values())
    emit("two_runs", lost, None, jobs=status, traffic_records=traffic, champions=champions,
         isolated_config=isolate, wall_s=wall)  # fmt: skip


# -- job_stop_<stage> --------------------------------------------------------------------------
# The stage a run is in, by its state.json: the first of a round's stages not yet done. The loop
# runs them in this order (round 0 of a `first_round: skip` run has no data or training).
STAGES = ("generate", "train", "bench", "gate", "traffic")
STOP_AT = {"generate": 1, "train": 1, "bench": 1, "gate": 1, "traffic": 0}  # the round to stop in


def _state(run: Path) -> dict[str, Any]:
    """The run's state.json; {} before it is written or while it is being written."""
    try:
        return json.loads((run / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _manifests(run: Path) -> dict[str, str]:
    return {p.parent.name: p.read_text() for p in sorted((run / "data").glob("round-*/manifest.json"))}  # fmt: skip


def _running(run: Path) -> tuple[int, str] | None:
    rounds = _state(run).get("rounds", [])
    if not rounds:
        return None
    todo = [s for s in STAGES if s not in rounds[-1]["done"]]
    return (len(rounds) - 1, todo[0]) if todo else None


def _run_record(run: Path, uri: str, model: str) -> dict[str, Any]:
    """What a finished run left: its rounds, its MLflow runs, its traffic, its versions."""
    from mlflow.tracking import MlflowClient

    from serve.traffic import read_traffic

    state = _state(run)
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}  # fmt: skip
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("job-stop")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    try:
        versions = len(client.search_model_versions(f"name='{model}'"))
    except Exception:  # noqa: BLE001 - no registered model: none registered
        versions = 0
    ids = [r["id"] for r in read_traffic(run / "traffic")]
    return {
        "rounds": [x["round"] for x in summary.get("rounds", [])],
        "stopped_because": summary.get("stopped_because"),
        "parents": sum("mlflow.parentRunId" not in r.data.tags for r in runs),
        "children": sorted(r.info.run_name for r in runs if "mlflow.parentRunId" in r.data.tags),
        "traffic": len(ids), "traffic_unique": len(set(ids)),
        "traffic_served": sum(x["done"].get("traffic", {}).get("requests", 0) for x in state["rounds"]),
        "versions": versions, "promoted": sum(bool(x.get("promoted")) for x in summary.get("rounds", [])),
        "manifests": _manifests(run),
    }  # fmt: skip


def probe_job_stop(repo: Path, tmp: Path, stage: str) -> None:
    """`ray job stop` while the run is in `stage`, then the same `ray job submit` again."""
    import yaml

    target, lm = _tiny_target(tmp)
    from ray_head import RayHead

    base = _random_base(lm, tmp)
    uri = f"sqlite:///{tmp}/mlflow.db"
    cfg = _two_run_config("job-stop", target, base, free_port(), uri, False)
    cfg["tracking"]["experiment"] = "job-stop"
    if stage == "traffic":  # 4 users end before a stop lands: enough of them to stop among
        cfg["serve"]["simulate_users"], cfg["data"]["user_prompts"] = 24, 32
    config, run = tmp / "run.yaml", tmp / "run"
    config.write_text(yaml.safe_dump(cfg))
    head = RayHead(tmp / "ray", repo=repo, num_cpus=8)
    want = (STOP_AT[stage], stage)
    seen, stopped_in, at_kill, status, t = None, None, {}, "NOT_SUBMITTED", time.monotonic()
    try:
        job_id = head.job_id(head.submit(config, run, wait=False))
        while time.monotonic() - t < 1200 and (seen := _running(run)) != want:
            if _state(run).get("stopped_because"):  # the run ended before the stage came
                break
            time.sleep(0.1)
        head.stop_job(job_id)
        stopped = head.wait_job(job_id, timeout_s=120)
        stopped_in = _running(run)  # where the stop landed (a fast stage may have ended first)
        at_kill = _manifests(run)
        again = head.submit(config, run)
        out = (again.stdout + again.stderr).splitlines()
        why = [ln for ln in out if "Error" in ln or "error:" in ln][-3:]  # the job's own words
        status = "SUCCEEDED" if again.returncode == 0 else f"FAILED: {why}"
    finally:
        head.shutdown()
    rec = _run_record(run, uri, f"{cfg['name']}-drafter")
    # lost: the resumed job failing, a round missing or twice, a duplicated MLflow run, a
    # traffic record lost or twice, a version registered twice, a data shard made again
    lost = (status != "SUCCEEDED") + abs(len(rec["rounds"]) - 2) + abs(rec["parents"] - 1)
    lost += len(rec["children"]) - len(set(rec["children"])) + (set(rec["children"]) != {"round-0", "round-1"})  # fmt: skip
    lost += abs(rec["traffic"] - rec["traffic_served"]) + rec["traffic"] - rec["traffic_unique"]
    lost += max(0, rec["versions"] - 1)
    lost += sum(rec["manifests"].get(k) != v for k, v in at_kill.items())
    lost += seen != want  # the stage never came: nothing was probed
    emit(f"job_stop_{stage}", lost, None, seen=seen and list(seen), stopped_in=stopped_in and list(stopped_in),
         first_job=stopped, resumed=status, wall_s=round(time.monotonic() - t, 1),
         **{k: v for k, v in rec.items() if k != "manifests"})  # fmt: skip


PROBES = {
    "override_upload": probe_override_upload,
    "torn_traffic": probe_torn_traffic,
    "disk_full": probe_disk_full,
    "replica_kill_after_swap": probe_replica_kill,
    "mlflow_blip": probe_mlflow_blip,
    "two_runs": probe_two_runs,
    **{f"job_stop_{s}": functools.partial(probe_job_stop, stage=s) for s in STAGES},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--repo", type=Path, default=HERE, help="checkout whose code is probed")
    ap.add_argument("--only", nargs="+", choices=sorted(PROBES), default=sorted(PROBES))
    args = ap.parse_args()
    repo = args.repo.resolve()
    sys.path.insert(0, str(repo))  # the product's modules come from the probed checkout
    os.chdir(repo)  # and in Ray's workers too: they put the driver's directory first on their path
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in args.only:
        with tempfile.TemporaryDirectory(prefix=f"fp-{name}-", dir="/tmp") as tmp:
            try:
                PROBES[name](repo, Path(tmp))
            except Exception as e:  # noqa: BLE001 - one probe's failure is its line
                emit(name, -1, None, probe_failed=f"{type(e).__name__}: {e}"[:400])


if __name__ == "__main__":
    main()
