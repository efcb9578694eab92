"""The whole suite as two pytest runs side by side, closed by one summary line (`make test`).

The tests marked `own_cluster` start Rays of their own (a `ray start` head, `pipeline/run.py`);
the rest share one in-process Ray (tests/conftest.py). In one pytest the former wait until the
shared Ray is down; most of their time is Ray and Serve starting, jobs polling and subprocesses
loading, not CPU, so here they run in a second pytest beside the first. Each pytest gives its
Rays a folder of their own (conftest's RAY_TMPDIR), so neither looks the other's cluster up.
The modules marked `ray_free` (no Ray at all) run in the second pytest too: without them the
shared-Ray run was ~240 s longer (1375 s against 1135 s on a 2-core machine), its last minutes
alone on the two cores. Since the own-cluster tests grew, the longest Ray-free modules (pool,
tracking store, budget, gate, prompts: about 90 s) stay unmarked, in the first pytest (before:
390 s against 844 s on a 2-core machine, 2026-12-05), and so does test_job_upload (a job on a
head of its own, ~30 s: 862 s against 924 s in a clean clone's CI run, 2026-12-06), and so do
test_cli, test_compat and test_fit (~20 s: 836 s against 909 s in a clean clone's CI run, later
on 2026-12-06).

  python scripts/test_suite.py [-m "not gpu and not sglang"] [pytest args...]

Extra pytest arguments go to both runs. The shared-Ray run streams its output; the other's is
printed when both have ended. A failed test marked `timing` (its outcome depends on the machine's
speed: the benchmark's speed-based choices, which a second pytest on two cores can upset) is run
once more, alone; no other test is. A rerun is never a pass: one that passes is counted `flaky`,
a `FLAKY <id>` line names it, and the summary line says how many were rerun (`0 rerun` when
none). Exit status: 0 when every test passed or was flaky."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COUNTS = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors")
# The second pytest's tests: those with Rays of their own, and Ray-free ones that even out the
# two runs' lengths (tests/conftest.py registers both markers)
SECOND = "own_cluster or ray_free"
# One intra-op thread per process unless the caller sets its own: torch's default is one per
# core, so two pytests side by side ran 2 threads per process on 2 cores, and OpenMP threads
# spin-wait between ops while the other run's processes want that core. Processes that size
# their own threads keep doing so (the trainer's workers and Serve's replicas set torch's from
# the CPUs they reserve; vLLM binds its own).
THREADS = {"OMP_NUM_THREADS": "1"}
# pytest's last line, e.g. "== 3 failed, 120 passed, 2 warnings in 412.31s (0:06:52) =="
SUMMARY = re.compile(r"(\d+) (failed|passed|skipped|deselected|xfailed|xpassed|warnings?|errors?)")


def counts(output: str) -> dict[str, int]:
    """The outcome counts of pytest's summary line (the last line naming any)."""
    lines = [ln for ln in output.splitlines() if SUMMARY.search(ln) and " in " in ln]
    if not lines:
        return {}
    got: dict[str, int] = {}
    for n, what in SUMMARY.findall(lines[-1]):
        what = {"warning": "warnings", "error": "errors"}.get(what, what)
        got[what] = got.get(what, 0) + int(n)
    return got


def outcome_ids(output: str, outcomes: tuple[str, ...] = ("FAILED", "ERROR")) -> dict[str, str]:
    """Node id -> outcome, from pytest's short summary: `FAILED <id> - ...` lines and the like."""
    ids: dict[str, str] = {}
    for ln in output.splitlines():
        m = re.match(r"([A-Z]+) (\S+)", ln)
        if m and m.group(1) in outcomes and "::" in m.group(2):
            ids.setdefault(m.group(2), m.group(1))
    return ids


def failed_ids(output: str) -> list[str]:
    """Node ids of pytest's short summary: `FAILED <id> - ...` and `ERROR <id> - ...` lines."""
    return sorted(outcome_ids(output))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", dest="marker", default="not gpu and not sglang",
                    help="the marker expression of the whole suite (default: %(default)s)")  # fmt: skip
    args, rest = ap.parse_known_args(argv)
    pytest = [sys.executable, "-m", "pytest"]
    own_log = tempfile.NamedTemporaryFile("w+", prefix="pytest-own-cluster-", suffix=".log")
    base = Path(tempfile.mkdtemp(prefix="pytest-own-cluster-"))
    env = {**THREADS, **os.environ}
    t0 = time.monotonic()
    # The second run keeps off the first's files: its own --basetemp and no shared .pytest_cache.
    own = subprocess.Popen(
        [*pytest, "-q", "-m", f"({args.marker}) and ({SECOND})", "-p", "no:cacheprovider",
         f"--basetemp={base}", *rest],
        cwd=REPO, env=env, stdout=own_log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    shared = subprocess.Popen(
        [*pytest, "-q", "-m", f"({args.marker}) and not ({SECOND})", *rest],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    shared_out = []
    for line in shared.stdout:
        sys.stdout.write(line)
        shared_out.append(line)
    rc_shared, rc_own = shared.wait(), own.wait()
    wall = time.monotonic() - t0
    own_log.seek(0)
    own_out = own_log.read()
    print(f"\n---- the own_cluster tests, run beside the others (exit {rc_own}) ----")
    sys.stdout.write(own_out)

    a, b = counts("".join(shared_out)), counts(own_out)
    total = {k: a.get(k, 0) + b.get(k, 0) for k in COUNTS}
    # each run deselects the other's tests: the suite's deselected are those neither ran
    ran_own = sum(b.get(k, 0) for k in ("failed", "passed", "skipped", "xfailed", "xpassed"))
    total["deselected"] = a.get("deselected", 0) - ran_own
    # exit 5 is "no tests collected": a filter (-k, a path) that leaves one run empty
    ok = all(rc in (0, 5) for rc in (rc_shared, rc_own)) and (rc_shared, rc_own) != (5, 5)
    failed = outcome_ids("".join(shared_out) + own_out)
    flaky: list[str] = []
    rerun = 0
    if not ok and failed and all(rc in (0, 1, 5) for rc in (rc_shared, rc_own)):
        # only the failed tests marked `timing` are collected again; -rA names the passed ones
        print(
            f"\n---- run again, alone, those marked timing of: {' '.join(failed)} ----", flush=True
        )
        again = subprocess.run(
            [*pytest, "-q", "-rA", "-m", f"({args.marker}) and timing", "-p", "no:cacheprovider",
             f"--basetemp={tempfile.mkdtemp(prefix='pytest-rerun-')}", *sorted(failed)],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
        sys.stdout.write(again.stdout + again.stderr)
        wall = time.monotonic() - t0
        c = counts(again.stdout)
        rerun = sum(c.get(k, 0) for k in ("passed", "failed", "errors"))
        flaky = sorted(outcome_ids(again.stdout, ("PASSED",)).keys() & failed.keys())
        for node in flaky:  # counted as flaky, no longer as failed: never as passed
            total["failed" if failed[node] == "FAILED" else "errors"] -= 1
            print(f"FLAKY {node} (failed beside the other run, passed alone)")
        ok = len(flaky) == len(failed)
    total["flaky"] = len(flaky)
    parts = ", ".join(f"{total[k]} {k}" for k in (*COUNTS, "flaky") if total[k])
    print(f"==== whole suite: {parts or 'no tests ran'}, {rerun} rerun in {wall:.2f}s "
          f"(two pytest runs side by side; exit {rc_shared} and {rc_own}"
          f"{'; flaky: ' + ', '.join(flaky) if flaky else ''}) ====")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
