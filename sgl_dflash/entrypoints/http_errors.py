"""Error bodies: SGLang's `ErrorResponse` on the native API, OpenAI's on /v1/*.

Native (SGLang):  {"object": "error", "message": ..., "type": "BadRequest", "param": ..., "code": 400}
OpenAI (/v1/*):   {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}

`param` names the offending field as a path (`messages[0].content`, `sampling_params.top_p`);
OpenAI's `code` is a string such as `context_length_exceeded` or null. Also here: pydantic
validation errors turned into one readable message naming each field once.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from sgl_dflash.errors import GenerationError, InvalidRequestError

NATIVE_TYPES = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed",
                413: "PayloadTooLarge", 499: "ClientClosedRequest", 500: "InternalServerError",
                503: "ServiceUnavailable"}
OPENAI_PREFIX = "/v1/"
# An error message repeats at most this many characters of what the client sent.
MAX_ECHO_CHARS = 80


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def openai_error_type(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    if status_code == 401:
        return "authentication_error"
    return "invalid_request_error"


def error_body(message: str, status_code: int, *, openai: bool, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    if openai:
        return {"error": {"message": message, "type": openai_error_type(status_code), "param": param,
                          "code": code}}
    return {"object": "error", "message": message, "type": NATIVE_TYPES.get(status_code, str(status_code)),
            "param": param, "code": status_code}


def error_response(message: str, status_code: int, *, openai: bool = False, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status_code,
                        content=error_body(message, status_code, openai=openai, param=param, code=code))


def exception_response(e: InvalidRequestError | GenerationError, path: str) -> JSONResponse:
    return error_response(str(e), e.status_code, openai=is_openai_path(path),
                          param=getattr(e, "param", None), code=getattr(e, "code", None))


def error_chunk(e: InvalidRequestError | GenerationError, *, openai: bool = False) -> dict[str, Any]:
    """The error event a stream ends with when its request fails after the response started."""
    kind = "invalid_request_error" if e.status_code < 500 else ("server_error" if openai else "internal_error")
    error: dict[str, Any] = {"message": str(e), "type": kind, "code": e.status_code}
    if openai:
        error["param"] = getattr(e, "param", None)
    return {"error": error}


# -- pydantic errors ------------------------------------------------------------------------
def validation_error(errors: list[dict[str, Any]], *, openai: bool) -> InvalidRequestError:
    """Pydantic errors -> an `InvalidRequestError` naming each offending field once (the most
    telling error first: a value out of range says more than "not a string" from the other
    member of a `str | list[str]` union)."""
    located = [(field_path(err.get("loc", ())), err) for err in _drop_union_noise(errors)]
    # Same at a field: "should be a list" is noise beside an error inside that field.
    paths = [path for path, _ in located]
    located = [(path, err) for path, err in located
               if not (_is_type_error(err) and any(_is_inside(other, path) for other in paths))]
    by_path: dict[str, list[dict[str, Any]]] = {}
    for path, err in sorted(located, key=lambda item: _is_type_error(item[1])):
        by_path.setdefault(path, []).append(err)
    if not by_path:
        return InvalidRequestError("invalid request body")
    messages = [_describe(path, errs, openai) for path, errs in by_path.items()]
    first_path, first_errs = next(iter(by_path.items()))
    return InvalidRequestError("; ".join(messages), param=first_path or None,
                               code=_openai_code(first_errs[0]) if openai else None)


def _drop_union_noise(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the errors of union members that only refused the input's type ("should be a valid
    list") when another member of the same union accepted the type and refused something in it."""
    locs = [tuple(err.get("loc", ())) for err in errors]
    branches = {loc[: i + 1] for loc in locs for i, part in enumerate(loc) if _is_union_tag(part)}

    def informative(branch: tuple) -> bool:
        return any(loc[: len(branch)] == branch and not _is_type_error(err) for loc, err in zip(locs, errors))

    noisy = [b for b in branches if not informative(b)
             and any(o[:-1] == b[:-1] and o != b and informative(o) for o in branches)]
    return [err for loc, err in zip(locs, errors) if not any(loc[: len(b)] == b for b in noisy)]


def _is_type_error(err: dict[str, Any]) -> bool:
    return str(err.get("type", "")).endswith("_type")


def _is_inside(path: str, outer: str) -> bool:
    if not outer:
        return bool(path)
    return len(path) > len(outer) and path.startswith(outer) and path[len(outer)] in ".["


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """('messages', 0, 'content', 'list[ContentPart]', 1, 'text') -> 'messages[0].content[1].text'."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _is_union_tag(part):
            path += f".{part}" if path else str(part)
    return path


def _is_union_tag(part: Any) -> bool:
    """Pydantic adds the union member's type to an error's location ('str', 'list[int]',
    'constrained-str', 'ContentPart'); field names here are lower-case identifiers."""
    return isinstance(part, str) and (
        any(c in part for c in "[-") or part[:1].isupper()
        or part in ("str", "int", "float", "bool", "dict", "list", "none", "literal")
    )


def _describe(path: str, errs: list[dict[str, Any]], openai: bool) -> str:
    kind = errs[0].get("type", "")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {path}" if openai else f"unknown field '{path}'"
    if kind == "missing":
        return f"Missing required parameter: '{path}'." if openai else f"missing required field '{path}'"
    msgs = list(dict.fromkeys(str(e.get("msg", "")) for e in errs))
    prefix = "Input should be "
    if len(msgs) > 1 and all(m.startswith(prefix) for m in msgs):
        msg = prefix + " or ".join(m[len(prefix):] for m in msgs)  # every union member refused
    else:
        msg = msgs[0]
    got = _echo(errs[0].get("input"))
    if openai:
        return f"Invalid '{path}': {msg} (got {got})" if path else f"Invalid request body: {msg}"
    return f"{path}: {msg} (got {got})" if path else f"invalid request body ({msg})"


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


def _openai_code(err: dict[str, Any]) -> str:
    kind = str(err.get("type", ""))
    if kind == "missing":
        return "missing_required_parameter"
    if kind == "extra_forbidden":
        return "unknown_parameter"
    if kind.endswith("_type") or kind == "literal_error":
        return "invalid_type" if kind.endswith("_type") else "invalid_value"
    return "invalid_value"
