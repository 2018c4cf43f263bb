"""Request schemas of the native API (`/generate`, `/abort_request`), in SGLang's field names.

The schemas carry the validation rules (types, ranges, list sizes) so that pydantic refuses a bad
body naming the field, and FastAPI publishes the same rules in /openapi.json. Models are strict
(no "0.5" for a number, no `true` for an integer) and refuse unknown fields. Each HTTP request is
then normalized into one `GenerateRequest` per prompt. Sampling parameters are SGLang's, with
SGLang's ranges (`SamplingParams.verify` in sglang/srt/sampling/sampling_params.py); the ones
this runtime does not implement are accepted only at their neutral value (what SGLang's frontend
sends by default) and refused otherwise, by name.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from sgl_dflash.errors import InvalidRequestError
from sgl_dflash.managers.io_struct import GenerateRequest
from sgl_dflash.sampling_params import SamplingParams

# SGLang's MAX_STOP_COUNT: at most this many stop strings per request.
MAX_STOP_STRINGS = 32
STRICT = ConfigDict(extra="forbid", strict=True)

NonNegativeInt = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]
StartLen = Annotated[int, Field(ge=-1)]  # -1: no input logprobs

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


class SamplingParamsInput(BaseModel):
    """`sampling_params` of /generate: SGLang's fields and ranges; null means "the default"."""

    model_config = STRICT

    max_new_tokens: NonNegativeInt | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: the whole vocabulary
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool | None = None
    # Accepted at their neutral value only (UNSUPPORTED_SAMPLING_PARAMS), SGLang's ranges.
    min_new_tokens: NonNegativeInt | None = None
    n: int | None = Field(None, ge=1)
    stop_regex: str | list[str] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    sampling_seed: int | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    # Accepted and without effect here: it only matters when special tokens are kept.
    spaces_between_special_tokens: bool | None = None


def to_sampling_params(params: SamplingParamsInput | None, *, where: str = "sampling_params") -> SamplingParams:
    """Validated `sampling_params` -> `SamplingParams`; refuses unsupported ones by name."""
    if params is None:
        return SamplingParams()
    for name, neutral in UNSUPPORTED_SAMPLING_PARAMS.items():
        value = getattr(params, name)
        if not is_neutral(value, neutral):
            raise InvalidRequestError(f"{where}.{name}={_short(value)} is not supported by this server",
                                      param=f"{where}.{name}")
    supported = {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
    sampling_params = SamplingParams(**{k: v for k, v in supported.items() if v is not None})
    if isinstance(sampling_params.stop_token_ids, list):
        sampling_params.stop_token_ids = list(sampling_params.stop_token_ids)
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
        elif isinstance(n, int) and isinstance(value, float) and value == n:
            return True
    return False


def _short(value: Any, limit: int = 80) -> str:
    """repr() of a client's value, cut so that an error message stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class GenerateReqInput(BaseModel):
    """Body of POST /generate (SGLang's `GenerateReqInput`, the fields this server implements).
    A list of prompts is a batch; the per-prompt fields may then be lists too."""

    model_config = STRICT

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: SamplingParamsInput | list[SamplingParamsInput | None] | None = None
    rid: str | list[str | None] | None = None
    return_logprob: bool | list[bool | None] | None = None
    logprob_start_len: StartLen | list[StartLen | None] | None = None
    top_logprobs_num: NonNegativeInt | list[NonNegativeInt | None] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # SGLang fields that sglang-router writes into every request it forwards (data parallel,
    # docs/scale.md): accepted at their neutral value, refused by name otherwise
    # (ROUTER_FIELDS_OFF). `model` is ignored: a server serves one model.
    model: str | None = None
    no_logs: bool = False
    return_hidden_states: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


# Request options this runtime does not implement: only False passes.
ROUTER_FIELDS_OFF = ("return_hidden_states", "background", "return_bytes", "return_entropy")


class AbortReqInput(BaseModel):
    """Body of POST /abort_request."""

    model_config = STRICT
    rid: str


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its JSON body (see `publish_body_schemas`)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def new_request_id() -> str:
    return uuid.uuid4().hex


def normalize(obj: GenerateReqInput) -> tuple[list[GenerateRequest], bool]:
    """Split a /generate body into per-prompt requests; returns (requests, is_batch)."""
    if (obj.text is None) == (obj.input_ids is None):
        raise InvalidRequestError("pass exactly one of `text` and `input_ids`", param="text")
    if obj.text is not None:
        is_batch = isinstance(obj.text, list)
        prompts: list[Any] = obj.text if is_batch else [obj.text]
    else:
        is_batch = isinstance(obj.input_ids[0], list)
        prompts = obj.input_ids if is_batch else [obj.input_ids]
    n = len(prompts)
    for name in ROUTER_FIELDS_OFF:
        if getattr(obj, name):
            raise InvalidRequestError(f"`{name}` is not supported by this server", param=name)

    def per_prompt(name: str, value: Any, default: Any) -> list[Any]:
        if isinstance(value, list):
            if not is_batch:
                raise InvalidRequestError(f"`{name}` is a list but the request has a single prompt", param=name)
            if len(value) != n:
                raise InvalidRequestError(f"`{name}` has {len(value)} entries for {n} prompts", param=name)
            return [default if v is None else v for v in value]
        return [default if value is None else value] * n

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
            # SGLang refuses prompt + max_new_tokens beyond the context only when the client
            # asked for that many; the default (128) is clipped to the room left.
            max_new_tokens_explicit=params[i] is not None and params[i].max_new_tokens is not None,
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.input_ids = list(prompt)
        requests.append(req)
    if len({r.rid for r in requests}) != len(requests):
        raise InvalidRequestError("`rid` values must be unique within a batch", param="rid")
    return requests, is_batch
