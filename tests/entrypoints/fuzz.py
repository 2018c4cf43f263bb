"""Property-based fuzzing of a live server: hypothesis-generated bodies (well-formed, mutated,
arbitrary JSON, garbage bytes) and schemathesis cases from the server's own /openapi.json
(positive and negative), sent to /generate, /v1/completions, /v1/chat/completions,
/abort_request and /flush_cache while well-formed greedy requests run beside them.

What is checked, per request: never a 5xx (nor a 5xx error event inside a stream), an answer
within `timeout_s` (else it counts as a hang), every 4xx in its API's error format. At the end:
the well-formed requests' outputs equal a clean run's, and the server is healthy and idle with
every KV page free. `python scripts/fuzz_server.py` is the long run; tests/entrypoints/test_fuzz.py
the short one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import strategies as st

FUZZED = [("POST", "/generate"), ("PUT", "/generate"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/abort_request"), ("POST", "/flush_cache"),
          ("GET", "/flush_cache")]

# -- hypothesis strategies ------------------------------------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
           | st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
EDGE_NUMBERS = st.sampled_from([-1, 0, 1, 2, 3, -(2**31), 2**31, 2**63, 10**7, 10**30, 0.0, 0.5, 1.5,
                                -0.5, 2.5, 100.0, 1e308, -1e-9])


def sometimes_odd(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `good`, sometimes an edge number or any JSON value."""
    return st.one_of(good, good, good, EDGE_NUMBERS, JSON)


def prompt_text() -> st.SearchStrategy:
    return st.text(min_size=0, max_size=24)


def token_ids(vocab_size: int) -> st.SearchStrategy:
    return st.lists(st.integers(-2, vocab_size + 2), min_size=0, max_size=12)


def stops() -> st.SearchStrategy:
    return st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6)


def sampling_fields(native: bool) -> dict[str, st.SearchStrategy]:
    fields = {
        "temperature": sometimes_odd(st.sampled_from([0, 0.0, 0.7, 1.0, 2.0])),
        "top_p": sometimes_odd(st.sampled_from([0.5, 0.9, 1.0])),
        "top_k": sometimes_odd(st.sampled_from([-1, 0, 1, 5])),
        "min_p": sometimes_odd(st.just(0.0)),
        "stop": sometimes_odd(stops()),
        "stop_token_ids": sometimes_odd(st.lists(st.integers(0, 300), max_size=3)),
        "ignore_eos": sometimes_odd(st.booleans()),
        "frequency_penalty": sometimes_odd(st.just(0.0)),
        "presence_penalty": sometimes_odd(st.just(0.0)),
        "n": sometimes_odd(st.just(1)),
    }
    if native:
        fields["max_new_tokens"] = sometimes_odd(st.integers(0, 8))
        fields["repetition_penalty"] = sometimes_odd(st.just(1.0))
        fields["min_new_tokens"] = sometimes_odd(st.just(0))
    return fields


def generate_bodies(vocab_size: int) -> st.SearchStrategy:
    prompt = st.one_of(
        st.fixed_dictionaries({"text": prompt_text()}),
        st.fixed_dictionaries({"text": st.lists(prompt_text(), max_size=3)}),
        st.fixed_dictionaries({"input_ids": token_ids(vocab_size)}),
        st.fixed_dictionaries({"input_ids": st.lists(token_ids(vocab_size), max_size=3)}),
    )
    extra = st.fixed_dictionaries({}, optional={
        "sampling_params": sometimes_odd(st.fixed_dictionaries({}, optional=sampling_fields(True))),
        "stream": sometimes_odd(st.booleans()),
        "rid": sometimes_odd(st.text(max_size=8)),
        "return_logprob": sometimes_odd(st.booleans()),
        "logprob_start_len": sometimes_odd(st.integers(-2, 8)),
        "top_logprobs_num": sometimes_odd(st.integers(0, 4)),
        "return_text_in_logprobs": sometimes_odd(st.booleans()),
    })
    return st.builds(lambda a, b: {**a, **b}, prompt, extra)


def openai_bodies(models: list[str], vocab_size: int, chat: bool) -> st.SearchStrategy:
    model = st.sampled_from(models) | st.text(max_size=8)
    fields = {**sampling_fields(False), "stream": sometimes_odd(st.booleans()),
              "max_tokens": sometimes_odd(st.integers(0, 8)),
              "stream_options": sometimes_odd(st.fixed_dictionaries({"include_usage": st.booleans()})),
              "logprobs": sometimes_odd(st.just(None)), "seed": sometimes_odd(st.just(None)),
              "user": sometimes_odd(st.text(max_size=5))}
    if chat:
        part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]),
                                      "text": prompt_text()})
        message = st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "user", "assistant", "developer", "tool", "wizard"])},
            optional={"content": sometimes_odd(prompt_text() | st.lists(part, max_size=3)),
                      "name": st.text(max_size=4)})
        required = {"model": model, "messages": sometimes_odd(st.lists(message, max_size=3))}
        fields["max_completion_tokens"] = sometimes_odd(st.integers(1, 8))
        fields["chat_template_kwargs"] = sometimes_odd(st.dictionaries(st.text(max_size=12), JSON, max_size=2))
    else:
        prompt = st.one_of(prompt_text(), st.lists(prompt_text(), max_size=3), token_ids(vocab_size),
                           st.lists(token_ids(vocab_size), max_size=2))
        required = {"model": model, "prompt": sometimes_odd(prompt)}
        fields["echo"] = sometimes_odd(st.booleans())
    return st.fixed_dictionaries(required, optional=fields)


def mutated(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """A body as generated, or with a key dropped / added / replaced, or not an object at all."""

    @st.composite
    def mutate(draw: Any) -> Any:
        body = dict(draw(bodies))
        how = draw(st.sampled_from(["keep", "keep", "drop", "add", "replace", "not_object"]))
        if how == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif how == "add":
            body[draw(st.text(min_size=1, max_size=10))] = draw(JSON)
        elif how == "replace" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(JSON)
        elif how == "not_object":
            return draw(JSON)
        return body

    return mutate()


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b'{"text": "hi", ', b"[]", b"null", b'"text"', b"{}", b"\xff\xfe{}",
                     b'{"text": NaN}', b'{"text": "hi", "sampling_params": {"temperature": Infinity}}',
                     b"[" * 5000, b'{"text": "\\ud800"}', b'{"text": "a", "text": 1}']),
)
CONTENT_TYPES = st.sampled_from(["application/json", "application/json", "text/plain",
                                 "application/x-www-form-urlencoded", "application/json; charset=latin-1"])


@dataclasses.dataclass
class Target:
    """What the fuzzer needs to know about the server."""

    base_url: str
    api_key: str | None
    models: list[str]
    vocab_size: int


def hand_written_requests(target: Target) -> st.SearchStrategy:
    """(method, path, headers, body bytes) built by the strategies above."""
    bodies = {
        "/generate": mutated(generate_bodies(target.vocab_size)),
        "/v1/completions": mutated(openai_bodies(target.models, target.vocab_size, chat=False)),
        "/v1/chat/completions": mutated(openai_bodies(target.models, target.vocab_size, chat=True)),
        "/abort_request": mutated(st.fixed_dictionaries({"rid": st.text(max_size=8)})),
        "/flush_cache": st.just(None),
    }
    auth = [] if target.api_key is None else [f"Bearer {target.api_key}"]
    header_values = st.sampled_from(auth * 8 + ["", "Bearer", "Bearer wrong", "Basic abc", "Bearer \u00e9\u00e8"])

    @st.composite
    def build(draw: Any) -> tuple[str, str, dict[str, str], bytes | None]:
        method, path = draw(st.sampled_from(FUZZED + [("GET", "/generate"), ("DELETE", "/v1/completions")]))
        headers = {"Content-Type": draw(CONTENT_TYPES)}
        authorization = draw(header_values)
        if authorization:
            headers["Authorization"] = authorization
        if path == "/flush_cache" or draw(st.integers(0, 9)) == 0:
            body = draw(RAW_BODIES) if path != "/flush_cache" else None
        else:
            body = json.dumps(draw(bodies[path])).encode()
        return method, path, headers, body

    return build()


def schemathesis_requests(target: Target, spec: dict[str, Any]) -> st.SearchStrategy:
    """Cases schemathesis derives from the server's OpenAPI schema, positive and negative."""
    import schemathesis

    spec = json.loads(json.dumps(spec))
    schemas = spec.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # valid cases name a served model
        if name in schemas:
            schemas[name]["properties"]["model"] = {"type": "string", "enum": target.models}
    schema = schemathesis.openapi.from_dict(spec)
    headers = {} if target.api_key is None else {"Authorization": f"Bearer {target.api_key}"}
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) not in FUZZED or not operation.body:
            continue
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(generation_mode=mode).map(
                lambda case: _from_case(case, target.base_url, headers)))
    return st.one_of(strategies)


def _from_case(case: Any, base_url: str, headers: dict[str, str]) -> tuple[str, str, dict[str, str], bytes | None]:
    kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
    if "json" in kwargs:
        body = json.dumps(kwargs["json"]).encode()
    else:
        body = kwargs.get("data")
        body = body.encode() if isinstance(body, str) else body
    return kwargs["method"], kwargs["url"][len(base_url):], dict(kwargs["headers"]), body
