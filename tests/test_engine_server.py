"""The launcher both engines share (actors/engine_server.py): a secret flag reaches the server
through a file only its user can read, never its command line (what `ps` shows every user) nor
its log; the settings both floors pass have the fields the launcher reads. Where vllm is
installed, vLLM's own parser reads the secret back from that file."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

pytest.importorskip("pydantic")  # bare GPU host (torch only): skip
from actors.engine_server import LocalSettings, ServerSettings, split_secret_flags
from actors.ports import free_port
from actors.sglang_server import MAX_PORT, SGLangServer
from actors.vllm_server import VLLMServer, vllm_available, vllm_python
from pipeline.config import ServeConfig, TargetConfig

# The "server": prints the command line it got (what ps shows), whether the --config file holds
# the key and only its user may read it, then fails, so the launcher reports its log.
_SHOW = """
import os, stat, sys, yaml
path = sys.argv[sys.argv.index("--config") + 1]
print("ARGV", " ".join(sys.argv[1:]))
print("KEY", yaml.safe_load(open(path)) == {"api-key": "detnalp-ks"[::-1]})  # not its own argv
print("MODE", oct(stat.S_IMODE(os.stat(path).st_mode)))
sys.exit(3)
"""


def test_a_secret_flag_reaches_the_server_in_a_private_file_not_its_command_line(tmp_path):
    cfg = ServeConfig(
        engine="sglang", port=free_port(below=MAX_PORT + 1), extra_args=["--api-key", "sk-planted"]
    )
    srv = SGLangServer(cfg, TargetConfig(model="/nowhere", backend="sglang"), tmp_path,
                       start_timeout_s=30, launch=[sys.executable, "-c", _SHOW])  # fmt: skip
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        srv.start(None)
    logged = (tmp_path / "sglang-000.log").read_text()
    argv = next(ln for ln in logged.splitlines() if ln.startswith("ARGV "))
    assert "--config" in argv and "--api-key" not in argv
    assert "KEY True" in logged and "MODE 0o600" in logged
    assert "sk-planted" not in logged + str(err.value)
    assert not Path(argv.split("--config ")[1].split()[0]).exists()  # deleted once read


def test_a_taken_port_is_refused_before_the_server_is_launched(tmp_path, monkeypatch):
    """Another process on serve.port would answer (or garble) the health probe of a server that
    never bound it: the launcher names the port and starts nothing."""
    import socket

    import actors.engine_server as es

    monkeypatch.setattr(es, "PORT_RELEASE_S", 1.0)
    ran = tmp_path / "launched"
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        srv = VLLMServer(ServeConfig(engine="vllm", port=port), TargetConfig(model="/nowhere"),
                         tmp_path, start_timeout_s=30, model_dir="/nowhere",
                         launch=[sys.executable, "-c", f"open({str(ran)!r}, 'w')"])  # fmt: skip
        with pytest.raises(RuntimeError, match=f"serve.port {port} on 127.0.0.1 is taken"):
            srv.start(None)
    assert srv.proc is None and not ran.exists()


def test_secret_flags_split_in_every_form():
    argv = ["python", "--api-key=K1", "--port", "1", "--admin-api-key", "K2", "--hf-token",
            "--enforce-eager", "--ssl-keyfile-password", "K3"]  # fmt: skip
    public, secrets = split_secret_flags(argv)
    assert public == ["python", "--port", "1", "--enforce-eager"]
    assert secrets == {"api-key": "K1", "admin-api-key": "K2", "hf-token": True,
                       "ssl-keyfile-password": "K3"}  # fmt: skip
    assert split_secret_flags(["--max-tokens", "8", "--tokenizer", "t"]) == (
        ["--max-tokens", "8", "--tokenizer", "t"],
        {},
    )


def test_a_secret_beside_the_users_own_config_file_is_refused(tmp_path):
    extra = ["--config", "my.yaml", "--api-key", "K"]
    cfg = ServeConfig(engine="vllm", port=free_port(), extra_args=extra)
    srv = VLLMServer(cfg, TargetConfig(model="/nowhere"), tmp_path, launch=["true"],
                     model_dir="/nowhere")  # fmt: skip
    with pytest.raises(ValueError, match="serve.extra_args: secret flags .*api-key.* --config"):
        srv.start(None)


def test_both_settings_have_what_the_launcher_reads():
    wanted = set(ServerSettings.__annotations__)
    assert wanted <= set(ServeConfig.model_fields)
    assert wanted <= {f.name for f in fields(LocalSettings)}


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="no Python with vllm: make setup-vllm")
def test_vllm_reads_the_secret_from_the_file(tmp_path):
    """vLLM's own argument parser, given the launcher's command line, has the key."""
    cfg = ServeConfig(engine="vllm", port=free_port(), extra_args=["--api-key", "sk-planted"])
    srv = VLLMServer(cfg, TargetConfig(model="/nowhere"), tmp_path, model_dir="/nowhere")
    argv, path = srv.command()
    parse = (
        "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser; "
        "print('KEY', make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]).api_key)"
    )
    try:
        out = subprocess.run([vllm_python(), "-c", parse, *argv[len(srv.launch):]],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        path.unlink()
    assert "sk-planted" not in " ".join(argv)
    assert "KEY ['sk-planted']" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
