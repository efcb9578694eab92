"""The one rule for secrets in anything the project writes or logs: `redact(obj)`.

A key is secret when its last word is token, key, secret, password (passwd, pwd), credential(s)
or apikey, or any word is secret/password/credentials: `HF_TOKEN`, `WANDB_API_KEY`,
`AWS_SECRET_ACCESS_KEY`, `MLFLOW_TRACKING_PASSWORD`, `hfToken`; not `max_tokens`,
`num_key_value_heads` or `tokenizer`. Secret values become `***`, and so do a `user:password@`
in URLs and the value after a secret `--flag` in argument lists (`--api-key X`, `--api-key=X`).
Used by `dump_config` (config.resolved.yaml, train_config.yaml, the driver log), by MLflow
params and artifacts (pipeline/tracking.py), by the engine launcher (actors/engine_server.py:
the command line it logs, and which flags it moves off the command line into a private file) and
by the tracking URI kept in state.json.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
_LAST = {"token", "key", "secret", "password", "passwd", "pwd", "credential", "credentials"}
_LAST |= {"apikey", "accesskey", "secretkey"}
_ANY = {"secret", "password", "passwd", "credentials"}
_URL_USERINFO = re.compile(r"(://[^/@\s:]+):[^/@\s]+@")


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)  # camelCase
    return [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]


def is_secret(key: str) -> bool:
    words = _words(key)
    return bool(words) and (words[-1] in _LAST or any(w in _ANY for w in words))


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, strings) with every secret masked."""
    if isinstance(obj, dict):
        return {
            k: (MASK if obj[k] not in (None, "") else obj[k])
            if isinstance(k, str) and is_secret(k)
            else redact(obj[k])
            for k in obj
        }
    if isinstance(obj, list | tuple):
        out, hide_next = [], False
        for item in obj:
            if hide_next:
                out.append(MASK)
                hide_next = False
                continue
            if isinstance(item, str) and item.startswith("--") and is_secret(item.split("=")[0]):
                hide_next = "=" not in item
                item = item if hide_next else f"{item.split('=')[0]}={MASK}"
            out.append(redact(item))
        return type(obj)(out) if isinstance(obj, tuple) else out
    if isinstance(obj, str):
        return _URL_USERINFO.sub(rf"\1:{MASK}@", obj)
    return obj
