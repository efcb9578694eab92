"""The secrets rule lives in actors/redact.py (serve/ writes argv lines and may not import
pipeline/); this name stays for the driver's imports."""

from actors.redact import MASK, is_secret, redact

__all__ = ["MASK", "is_secret", "redact"]
