"""Screenshots of the two UIs `make demo` prints, as a new user opens them: headless Chromium
(Debian's `chromium` package) driven over its DevTools protocol. The Ray dashboard first shows its
token prompt; the token (`ray get-auth-token`) is typed into it as a user would, and the page after
it is taken too. Run while the demo runs:

    python scripts/ui_screenshots.py --dashboard http://127.0.0.1:8265 --mlflow http://127.0.0.1:5000 --out docs/img
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image
from websockets.sync.client import connect

from pipeline.tracking import runs_page  # noqa: E402

SIZE = (1400, 860)


class Page:
    """One Chromium tab over the DevTools protocol (just the calls used here)."""

    def __init__(self, ws):
        self.ws, self.n = ws, 0

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str, settle_s: float) -> None:
        self.call("Page.navigate", url=url)
        time.sleep(settle_s)  # single-page apps render after load; a busy machine is slow

    def js(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get(
            "value"
        )

    def shot(self, path: Path) -> None:
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        img = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128)  # a few 100 KB
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, optimize=True)
        print(f"{path}: {path.stat().st_size // 1024} KB")


def start_chromium(port: int, profile: str) -> subprocess.Popen:
    cmd = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
           f"--window-size={SIZE[0]},{SIZE[1]}", "about:blank"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(60):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError("chromium did not start")


def page_ws(port: int) -> str:
    tabs = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list").read())
    return next(t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page")


def type_token(page: Page, token: str) -> None:
    """Focus the prompt's input, type the token, press Enter: what a user does."""
    page.js("document.querySelector('[role=dialog] input').focus()")
    page.call("Input.insertText", text=token)
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                  windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "")  # fmt: skip
    time.sleep(3)
    page.js(  # Enter did not submit the prompt: click its button
        "(() => { const d = document.querySelector('[role=dialog]'); if (!d) return;"
        " [...d.querySelectorAll('button')].filter(b => /submit|authenticate|sign in|"
        "log ?in|continue/i.test(b.textContent)).forEach(b => b.click()); })()"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--mlflow", required=True)
    ap.add_argument("--experiment", default="eagle-loop", help="tracking.experiment")
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    ap.add_argument("--port", type=int, default=9322, help="Chromium's DevTools port")
    args = ap.parse_args()
    token = subprocess.run(["ray", "get-auth-token"], capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()[-1]  # fmt: skip
    with tempfile.TemporaryDirectory() as profile:
        proc = start_chromium(args.port, profile)
        try:
            with connect(page_ws(args.port), max_size=2**26) as ws:
                shoot(Page(ws), args, token)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def shoot(page: Page, args: argparse.Namespace, token: str) -> None:
    page.call("Page.enable")
    page.call("Emulation.setDeviceMetricsOverride", width=SIZE[0], height=SIZE[1],
              deviceScaleFactor=1, mobile=False)  # fmt: skip
    page.open(args.dashboard, 12)
    page.shot(args.out / "ray-dashboard-token.png")
    type_token(page, token)
    time.sleep(12)
    page.shot(args.out / "ray-dashboard.png")
    page.open(args.dashboard.rstrip("/") + "/#/jobs", 12)
    page.shot(args.out / "ray-dashboard-jobs.png")
    page.open(args.mlflow, 15)
    page.shot(args.out / "mlflow-home.png")
    link = page.js(  # the experiment's link on the home page, as a user clicks it
        "[...document.querySelectorAll('a')].filter(a => a.textContent.trim() == "
        f"{json.dumps(args.experiment)}).map(a => a.href)[0] || null"
    )
    if link:  # MLflow 3.17 opens it in its GenAI view, whatever its kind tag
        page.open(link, 15)
        page.shot(args.out / "mlflow-experiment-link.png")
    url = f"{args.mlflow.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?experiment_name={args.experiment}"  # fmt: skip
    exp = json.loads(urllib.request.urlopen(url).read())["experiment"]
    page.open(runs_page(args.mlflow, exp["experiment_id"]), 15)  # the address the job prints
    page.shot(args.out / "mlflow-runs.png")


if __name__ == "__main__":
    main()
