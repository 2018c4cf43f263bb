"""The runtime's error types, one per kind of error.

- `ServerArgsError`: the server cannot start as configured (a flag, a model or tokenizer
  directory, a drafter that does not fit the target, an unknown speculative algorithm). The
  message names the flag; `launch_server` prints it and exits with status 2.
- `InvalidRequestError`: a request refused before it runs; `status_code` is what the HTTP server
  answers (400 unless said otherwise), `param` the offending field (a path such as
  `messages[0].content`) and `code` a machine-readable reason (OpenAI's, e.g.
  `context_length_exceeded`) when there is one. `SamplingParamsError` is one that names a
  sampling parameter.
- `GenerationError`: a request that was accepted but ended with an abort (internal error,
  shutdown, a client that went away, a request timeout).
"""

from __future__ import annotations


class ServerArgsError(ValueError):
    """An invalid argument or combination of arguments; the message names the flag."""


class InvalidRequestError(ValueError):
    """A request the runtime refuses before running it; the server answers `status_code`."""

    def __init__(self, message: str, status_code: int = 400, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.param = param
        self.code = code


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling parameter; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"sampling_params.{field}: {message}", param=f"sampling_params.{field}")
        self.field = field


class GenerationError(Exception):
    """A request that ended with an abort (internal error, server shutdown, client gone)."""

    def __init__(self, message: str, status_code: int = 500):
        super().__init__(message)
        self.status_code = status_code
