"""What a command's exit status says happened: the one table `eagle-loop`, `pipeline/run.py` and
`python -m pipeline.preflight` return from (the README lists it).

| code | name   | what happened                                                                 |
|------|--------|-------------------------------------------------------------------------------|
| 0    | OK     | done                                                                          |
| 1    | FAILED | it ran and failed: a stage raised (traceback), the loop stopped with a message, a server did not start, a check answered no (`compat`, `plan`, `swap`) |
| 2    | USAGE  | the command line is wrong (argparse's own status): nothing was read or started |
| 3    | CONFIG | the config or the preflight refused it, or a needed package is missing: nothing started; the message names the field and the fix |
| 4    | BUSY   | another driver holds the run directory: wait for it, stop it, or pass another --run-dir |

1 is also what Python exits with on an uncaught exception, so a crash reads as FAILED.
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
CONFIG = 3
BUSY = 4

TABLE: dict[int, str] = {
    OK: "done",
    FAILED: "it ran and failed (a stage, the loop, a server start, or a check that answered no)",
    USAGE: "the command line is wrong: nothing was read or started",
    CONFIG: "the config or preflight refused it, or a package is missing: nothing started",
    BUSY: "another driver holds the run directory",
}
