"""Request schemas of the native API (`/generate`), in SGLang's field names.

Each HTTP request is parsed with pydantic (unknown top-level fields are refused), then normalized
into one `GenerateRequest` per prompt. Sampling parameters are SGLang's: the ones this runtime
implements become a `SamplingParams`; the ones it does not implement are accepted only at their
neutral value (what SGLang's frontend sends by default) and refused otherwise, by name.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.sampling_params import SamplingParams

# SGLang sampling parameters this runtime does not implement, with the values that mean "off".
# SGLang's frontend sends all of them on every call, so the neutral values must pass.
UNSUPPORTED_SAMPLING_PARAMS: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (None, 0),
    "n": (None, 1),
    "stop_regex": (None, "", [], ()),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
    "sampling_seed": (None,),
    "no_stop_trim": (None, False),
    # Output text is decoded without special tokens, as SGLang does by default.
    "skip_special_tokens": (None, True),
}
# Accepted and without effect here: they only matter when special tokens are kept.
IGNORED_SAMPLING_PARAMS = ("spaces_between_special_tokens",)


def to_sampling_params(params: Any, *, where: str = "sampling_params") -> SamplingParams:
    """SGLang-style sampling params dict -> `SamplingParams`; raises `InvalidRequestError` naming the field."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {type(params).__name__}")
    supported: dict[str, Any] = {}
    for key, value in params.items():
        if key in UNSUPPORTED_SAMPLING_PARAMS:
            if not is_neutral(value, UNSUPPORTED_SAMPLING_PARAMS[key]):
                raise InvalidRequestError(f"{where}.{key}={value!r} is not supported by this server")
        elif key in IGNORED_SAMPLING_PARAMS:
            continue
        elif value is not None:  # SGLang treats null as "use the default"
            supported[key] = value
    try:
        sampling_params = SamplingParams.from_dict(supported)
        sampling_params.verify()
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e).replace("sampling_params", where, 1)) from None
    except TypeError as e:
        raise InvalidRequestError(f"{where}: {e}") from None
    return sampling_params


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    for n in neutral:
        if type(value) in (list, tuple) and type(n) in (list, tuple):
            if len(value) == 0 and len(n) == 0:
                return True
        elif value is n or (type(value) is type(n) and value == n):
            return True
        elif isinstance(n, float) and isinstance(value, int) and not isinstance(value, bool) and value == n:
            return True
    return False


class GenerateReqInput(BaseModel):
    """Body of POST /generate (SGLang's `GenerateReqInput`, the fields this server implements)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True


class AbortReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str


def new_request_id() -> str:
    return uuid.uuid4().hex


def normalize(obj: GenerateReqInput) -> tuple[list[GenerateRequest], bool]:
    """Split a /generate body into per-prompt requests; returns (requests, is_batch)."""
    if (obj.text is None) == (obj.input_ids is None):
        raise InvalidRequestError("pass exactly one of `text` and `input_ids`")
    if obj.text is not None:
        is_batch = isinstance(obj.text, list)
        prompts: list[Any] = obj.text if is_batch else [obj.text]
        key = "text"
    else:
        ids = obj.input_ids
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        key = "input_ids"
    if is_batch and not prompts:
        raise InvalidRequestError(f"`{key}` is an empty batch")
    n = len(prompts)

    def per_prompt(name: str, value: Any, default: Any) -> list[Any]:
        if isinstance(value, list):
            if not is_batch:
                raise InvalidRequestError(f"`{name}` is a list but the request has a single prompt")
            if len(value) != n:
                raise InvalidRequestError(f"`{name}` has {len(value)} entries for {n} prompts")
            return [default if v is None else v for v in value]
        return [default if value is None else value] * n

    if obj.rid is None:
        rids = [new_request_id() for _ in range(n)]
    else:
        rids = [rid if rid is not None else new_request_id() for rid in per_prompt("rid", obj.rid, None)]
    params = per_prompt("sampling_params", obj.sampling_params, None)
    return_logprob = per_prompt("return_logprob", obj.return_logprob, False)
    start_len = per_prompt("logprob_start_len", obj.logprob_start_len, -1)
    top_num = per_prompt("top_logprobs_num", obj.top_logprobs_num, 0)

    requests = []
    for i, prompt in enumerate(prompts):
        where = f"sampling_params[{i}]" if is_batch else "sampling_params"
        req = GenerateRequest(
            rid=rids[i],
            sampling_params=to_sampling_params(params[i], where=where),
            stream=obj.stream,
            return_logprob=bool(return_logprob[i]),
            logprob_start_len=start_len[i],
            top_logprobs_num=top_num[i],
            return_text_in_logprobs=obj.return_text_in_logprobs,
        )
        if key == "text":
            req.text = prompt
        else:
            req.input_ids = list(prompt)
        requests.append(req)
    if len({r.rid for r in requests}) != len(requests):
        raise InvalidRequestError("`rid` values must be unique within a batch")
    return requests, is_batch
