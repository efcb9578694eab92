"""The driver's console (pipeline/console.py): stage lines and bars on the console, every other
line the driver's process writes in <run>/logs/driver.log."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

from pipeline import console


def test_the_console_gets_stage_lines_and_the_log_everything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(console, "BAR_AFTER_S", 0.2)
    monkeypatch.setattr(console, "MIN_EVERY_S", 0.3)
    early = logging.StreamHandler(sys.stderr)  # a library's handler, made before the console
    logging.getLogger("somelib").addHandler(early)
    try:
        with console.driver_console(tmp_path) as path:
            print("a stray print")
            for _ in tqdm(range(3), desc="a library's bar"):
                pass
            logging.getLogger("httpx").info("HTTP Request: POST /v1/chat/completions")
            logging.getLogger("somelib").warning("a library's warning")
            console.detail.info("resolved config: x")
            with console.stage("round 0 bench", 0.9, "4 prompts") as st:
                time.sleep(1.0)
                st.result = "accept_len 1.500"
            with console.stage("round 0 gate"):
                pass
    finally:
        logging.getLogger("somelib").removeHandler(early)
    out = capsys.readouterr()
    shown = [line.split(" ", 1)[1] if line[:2].isdigit() else line for line in out.out.splitlines()]
    assert shown[0] == "round 0 bench: planned 1 s, 4 prompts"
    bars = [x for x in shown if x.startswith("  round 0 bench [")]
    assert 2 <= len(bars) <= 4 and bars[-1].endswith("/1 s planned")  # a line per update
    assert shown[len(bars) + 1] == "round 0 bench: 1 s (planned 1 s): accept_len 1.500"
    assert shown[len(bars) + 2 :] == ["round 0 gate: started", "round 0 gate: 0 s"]  # no bar
    written = path.read_text()
    for line in ("a stray print", "a library's bar", "HTTP Request", "a library's warning",
                 "resolved config", "round 0 bench: 1 s", "round 0 gate: 0 s"):  # fmt: skip
        assert line in written
        assert line not in out.err
    assert early.stream is sys.stderr  # handed back


def test_ray_workers_output_goes_to_the_driver_log(ray_local, tmp_path, capsys):
    @ray_local.remote
    def speak() -> None:
        print("worker line on stdout")
        print("worker line on stderr", file=sys.stderr)

    with console.driver_console(tmp_path) as path:
        ray_local.get(speak.remote())
        for _ in range(40):  # Ray forwards workers' lines to the driver within a second or two
            if all(f"worker line on {s}" in path.read_text() for s in ("stdout", "stderr")):
                break
            time.sleep(0.5)
    out = capsys.readouterr()
    assert "worker line on stdout" in path.read_text()
    assert "worker line on stderr" in path.read_text()
    assert "worker line" not in out.out + out.err
