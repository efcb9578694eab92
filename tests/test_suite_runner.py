"""`make test`'s runner (scripts/test_suite.py): both of its pytests run with one intra-op thread
per process unless the caller set OMP_NUM_THREADS, and its summary line adds up the two runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.ray_free  # no Ray: `make test` runs it in the second pytest

# One test for each of the runner's two pytests: the unmarked one runs in the shared-Ray pytest,
# the ray_free one in the second; each writes down the thread setting its process got.
PROBE = textwrap.dedent(
    """
    import os
    from pathlib import Path

    import pytest

    def _write(name):
        Path(os.environ["PROBE_OUT"], name).write_text(os.environ.get("OMP_NUM_THREADS", "unset"))

    def test_shared():
        _write("shared")

    @pytest.mark.ray_free
    def test_second():
        _write("second")
    """
)


@pytest.mark.parametrize("given", [None, "2"])
def test_both_pytests_get_one_thread_unless_the_caller_sets_it(tmp_path, given):
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PROBE_OUT"] = str(tmp_path)
    if given:
        env["OMP_NUM_THREADS"] = given
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/test_suite.py"), "-m", "not gpu",
         "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path / "probe")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "==== whole suite: 2 passed in " in done.stdout, done.stdout[-3000:]
    want = given or "1"
    assert (tmp_path / "shared").read_text() == (tmp_path / "second").read_text() == want
