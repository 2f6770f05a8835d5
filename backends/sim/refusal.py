"""What the simulator answers 400, worded as vLLM 0.32 words it (see :mod:`.validate`)."""

from __future__ import annotations

import re


class BadRequest(Exception):
    """What vLLM answers 400: its message, ``param`` and error ``type``."""

    def __init__(
        self, message: str, param: str | None = None, error_type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.error_type = error_type


def refused(message: str, parameter: str | None = None, value: object = None) -> BadRequest:
    """A ``VLLMValidationError`` as vLLM answers it: its str() names parameter and value."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    extras += [f"value={value}"] if value is not None else []
    said = f"{message} ({', '.join(extras)})" if extras else message
    return BadRequest(without_paths(said), parameter)


def without_paths(message: str) -> str:
    """vLLM's ``sanitize_message``: a file path in what the client sent is not echoed."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message).strip()
