"""The HTTP server under load and abuse, against a real uvicorn server on a loopback port.

One module-scoped server: tiny random Qwen3 target (plain decoding), byte-level tokenizer, an API
key, and a KV pool far smaller than the offered load (queueing and retraction happen).
Outputs are compared with the offline `Engine` (greedy) and logprobs with transformers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import numpy as np
import pytest
import requests
import torch

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.server_args import ServerArgs
from tests.server_harness import make_byte_target, start_in_process, wait_until_idle
from tests.tiny_checkpoints import load_hf_model

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PAGE_SIZE = 8
MAX_TOTAL_TOKENS = 256  # 32 pages: a few requests at a time
NUM_CLIENTS = 32
MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_byte_target(tmp_path_factory.mktemp("server_target"))


@pytest.fixture(scope="module")
def server(model_dir):
    args = ServerArgs(model_path=model_dir, page_size=PAGE_SIZE, max_total_tokens=MAX_TOTAL_TOKENS,
                      max_running_requests=16, api_key=API_KEY)
    handle = start_in_process(args)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def url(server):
    return server.base_url


def post(url, path, body, headers=AUTH, **kwargs):
    return requests.post(url + path, json=body, headers=headers, timeout=120, **kwargs)


def prompts(n):
    return [f"Prompt {i}: " + "abcdefghij"[: 1 + i % 10] for i in range(n)]


@pytest.fixture(scope="module")
def engine(model_dir):
    """The offline Engine on the same checkpoint, with a KV pool large enough for everything."""
    engine = Engine(model_path=model_dir, max_total_tokens=4096, max_running_requests=64)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def engine_outputs(engine):
    """Greedy outputs of the offline Engine for `prompts(NUM_CLIENTS)`."""
    outs = engine.generate(prompts(NUM_CLIENTS), {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0})
    # Not vacuous: most prompts run to the length limit (EOS is rare for this model).
    assert sum(len(o["output_ids"]) == MAX_NEW_TOKENS for o in outs) >= NUM_CLIENTS // 2
    return outs


# -- native API ---------------------------------------------------------------------------
def test_generate_matches_engine_and_sglang_shape(url, engine_outputs):
    prompt = prompts(NUM_CLIENTS)[3]
    r = post(url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS,
                                                                    "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["output_ids"] == engine_outputs[3]["output_ids"]
    assert out["text"] == engine_outputs[3]["text"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt.encode())  # one token per byte
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["e2e_latency"] > 0


def test_batch_generate_with_per_prompt_params(url, engine_outputs):
    ps = prompts(NUM_CLIENTS)
    r = post(url, "/generate", {"text": [ps[0], ps[1]],
                                "sampling_params": [{"max_new_tokens": 5, "temperature": 0},
                                                    {"max_new_tokens": 7, "temperature": 0}]})
    assert r.status_code == 200, r.text
    a, b = r.json()
    assert a["output_ids"] == engine_outputs[0]["output_ids"][:5]
    assert b["output_ids"] == engine_outputs[1]["output_ids"][:7]


def test_stream_is_cumulative_and_ends_like_non_stream(url, engine_outputs):
    body = {"text": prompts(NUM_CLIENTS)[5], "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
    events = sse_events(post(url, "/generate", body, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    final = chunks[-1]
    assert final["output_ids"] == engine_outputs[5]["output_ids"]
    assert final["text"] == engine_outputs[5]["text"]
    for earlier, later in zip(chunks, chunks[1:]):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert final["text"].startswith(earlier["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert final["meta_info"]["finish_reason"] is not None


def test_batch_stream_tags_chunks_with_their_index(url, engine_outputs):
    ps = prompts(NUM_CLIENTS)
    body = {"text": [ps[8], ps[9]], "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
    chunks = [json.loads(e) for e in sse_events(post(url, "/generate", body, stream=True))[:-1]]
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[-1]["output_ids"] == engine_outputs[8 + index]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] is not None


def test_stop_string_is_trimmed_and_never_streamed(url, engine_outputs):
    ref = engine_outputs[7]
    text = ref["text"]
    stop = text[6:8]  # a stop string inside the greedy output
    assert stop and text.index(stop) >= 1
    body = {"text": prompts(NUM_CLIENTS)[7], "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "stop": [stop]}}
    chunks = [json.loads(e) for e in sse_events(post(url, "/generate", body, stream=True))[:-1]]
    final = chunks[-1]
    assert final["text"] == text[: text.index(stop)]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert all(final["text"].startswith(c["text"]) for c in chunks)


def test_input_ids_and_logprobs_match_transformers(url, model_dir):
    ids = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 3,
            "return_text_in_logprobs": True}
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        logits = load_hf_model(model_dir)(torch.tensor([full])).logits[0].double()
    ref = torch.log_softmax(logits, -1)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[2:]
    assert inp[0][0] is None  # SGLang: the first entry from logprob_start_len has no value
    for k, (lp, tok, text) in enumerate(inp[1:], start=3):
        assert lp == pytest.approx(ref[k - 1, tok].item(), abs=2e-4)
        assert text == bytes([tok]).decode("latin-1") or text == "\ufffd"
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    for j, (lp, tok, _) in enumerate(outp):
        assert lp == pytest.approx(ref[len(ids) + j - 1, tok].item(), abs=2e-4)
        # Greedy: each output token is the top-1 of its position.
        assert meta["output_top_logprobs"][j][0][1] == tok
    top = meta["input_top_logprobs"]
    assert top[0] is None and len(top[1]) == 3
    expected = torch.topk(ref[2], 3)
    assert [t for _, t, _ in top[1]] == expected.indices.tolist()
    np.testing.assert_allclose([lp for lp, _, _ in top[1]], expected.values.numpy(), atol=2e-4)


def test_model_and_server_info(url, model_dir):
    info = requests.get(url + "/get_model_info", headers=AUTH, timeout=10).json()
    assert info["model_path"] == model_dir and info["tokenizer_path"] == model_dir
    assert info["is_generation"] is True
    server_info = requests.get(url + "/server_info", headers=AUTH, timeout=10).json()
    assert server_info["api_key"] == "<redacted>"
    stats = server_info["internal_states"][0]
    assert stats["total_pages"] == MAX_TOTAL_TOKENS // PAGE_SIZE
    assert "avg_spec_accept_length" in stats
    assert requests.post(url + "/flush_cache", headers=AUTH, timeout=10).status_code == 200


def test_freeze_gc_moves_what_is_alive_out_of_garbage_collection(url):
    """SGLang's /freeze_gc: the server froze what startup built; a call freezes what lives now."""
    import gc

    started = gc.get_freeze_count()  # the server runs in this process
    assert started > 0
    garbage = [[] for _ in range(1000)]  # alive objects the freeze takes along
    reply = requests.post(url + "/freeze_gc", headers=AUTH, timeout=60)
    assert reply.status_code == 200 and "Froze" in reply.text
    assert gc.get_freeze_count() >= started + len(garbage)


# -- load: concurrency, disconnects, KV budget --------------------------------------------
def sse_events(response):
    assert response.status_code == 200, response.text
    return [line[len("data: "):] for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]


async def stream_client(client, url, prompt, disconnect):
    """Stream one request to the end and return its last chunk; or, with `disconnect`, ask for
    a long output (it cannot finish first) and hang up after the first chunk (returns None)."""
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
    if disconnect:
        params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    last = None
    async with client.stream("POST", url + "/generate", headers=AUTH,
                             json={"text": prompt, "stream": True, "sampling_params": params}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return last
            last = json.loads(line[len("data: "):])
            if disconnect:
                assert last["meta_info"]["finish_reason"] is None
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


async def poll_stats(url, stop, seen):
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            stats = (await client.get(url + "/server_info", headers=AUTH)).json()["internal_states"][0]
            seen.append(stats)
            await asyncio.sleep(0.05)


def test_concurrent_streams_with_disconnects_under_a_small_kv_budget(url, engine_outputs):
    baseline = wait_until_idle(url, AUTH)
    assert baseline["num_free_pages"] == baseline["total_pages"]
    aborted_before = metric(url, "sglang:num_aborted_requests_total")
    ps = prompts(NUM_CLIENTS)
    disconnecting = {i for i in range(NUM_CLIENTS) if i % 2 == 1}

    async def run():
        stop, seen = asyncio.Event(), []
        poller = asyncio.create_task(poll_stats(url, stop, seen))
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            results = await asyncio.gather(*[
                stream_client(client, url, p, i in disconnecting) for i, p in enumerate(ps)
            ])
        stop.set()
        await poller
        return results, seen

    results, seen = asyncio.run(run())
    for i, out in enumerate(results):
        if i in disconnecting:
            assert out is None
        else:
            assert out["output_ids"] == engine_outputs[i]["output_ids"], i
            assert out["text"] == engine_outputs[i]["text"], i

    # More requests than could run at once: they queued.
    assert max(s["num_waiting"] for s in seen) > 0
    after = wait_until_idle(url, AUTH)
    # Every page came back: disconnected requests were aborted and freed.
    assert after["num_free_pages"] == after["total_pages"]
    assert metric(url, "sglang:num_aborted_requests_total") - aborted_before == len(disconnecting)


def test_requests_outgrowing_the_kv_pool_are_retracted_and_still_exact(url, engine):
    # 8 requests of 8 + 40 tokens need 6 pages each at the end: 48 > 32 pages. All fit at
    # admission, so running requests must be retracted (and recomputed) as they grow.
    ps = [f"grow {i}:" for i in range(8)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected = engine.generate(ps, params)
    before = wait_until_idle(url, AUTH)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[client.post(url + "/generate", headers=AUTH,
                                                      json={"text": p, "sampling_params": params})
                                          for p in ps])

    for r, ref in zip(asyncio.run(run()), expected):
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ref["output_ids"]
    after = wait_until_idle(url, AUTH)
    assert after["num_retractions"] > before["num_retractions"]
    assert after["num_free_pages"] == after["total_pages"]


def test_non_streaming_disconnect_aborts_the_request(url, server, monkeypatch):
    # A client that hangs up on a running non-streaming request frees its pages too. Each step
    # is slowed (200 steps >= 4 s) so that the request cannot finish before the hang-up lands.
    scheduler = server.tokenizer_manager.scheduler
    step = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda: (time.sleep(0.02), step())[1])
    aborted_before = metric(url, "sglang:num_aborted_requests_total")
    body = json.dumps({"text": "slow one", "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                                               "ignore_eos": True}}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), API_KEY.encode(), len(body), body))
        deadline = time.monotonic() + 60
        while requests.get(url + "/server_info", headers=AUTH, timeout=10).json()[
                "internal_states"][0]["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    stats = wait_until_idle(url, AUTH, timeout=30)
    assert stats["num_free_pages"] == stats["total_pages"]
    assert metric(url, "sglang:num_aborted_requests_total") - aborted_before == 1


def metric(url, name):
    text = requests.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- robustness ---------------------------------------------------------------------------
BAD_GENERATE_BODIES = [
    ('{"text": "hi", ', "malformed JSON"),
    ("", "empty"),
    ("[1, 2]", "must be a JSON object"),
    ({"text": "hi", "foo": 1}, "unknown field 'foo'"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "hi", "sampling_params": {"frobnicate": 1}}, "frobnicate"),
    ({"text": "hi", "sampling_params": {"regex": "a+"}}, "regex"),
    ({"text": ""}, "empty"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 2, 100000]}, "invalid token ids"),
    ({"input_ids": [5] * (MAX_TOTAL_TOKENS + 10)}, "context length"),
    ({"text": "x" * (MAX_TOTAL_TOKENS + 10)}, "context length"),
    ({"sampling_params": {}}, "exactly one of `text` and `input_ids`"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
]


@pytest.mark.parametrize("body,needle", BAD_GENERATE_BODIES)
def test_bad_generate_requests_get_400_naming_the_problem(url, body, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = requests.post(url + "/generate", data=data, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["message"]


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"model": "default", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "n": 3}, "'n'"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": -2}, "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/chat/completions", {"model": "default"}, "Missing required parameter: 'messages'"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}], "top_p": 2},
     "top_p"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"model": "default", "messages": [], "bogus": True}, "bogus"),
])
def test_bad_openai_requests_get_400(url, path, body, needle):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": "Bearer \u00e9t\u00e9"}])
@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("GET", "/v1/models"),
                                         ("GET", "/server_info"), ("POST", "/v1/chat/completions")])
def test_api_key_is_required(url, headers, method, path):
    r = requests.request(method, url + path, json={"text": "hi"}, headers=headers, timeout=10)
    assert r.status_code == 401
    body = r.json()
    assert "API key" in (body["error"]["message"] if path.startswith("/v1/") else body["message"])


def test_bad_requests_do_not_disturb_good_ones_and_server_stays_healthy(url, engine_outputs):
    ps = prompts(NUM_CLIENTS)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            good = [client.post(url + "/generate", headers=AUTH, json={
                "text": ps[i], "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}})
                for i in range(4)]
            bad = [client.post(url + "/generate", headers=AUTH, json=b) for b, _ in BAD_GENERATE_BODIES
                   if isinstance(b, dict)]
            return await asyncio.gather(*good, *bad)

    responses = asyncio.run(run())
    for i, r in enumerate(responses[:4]):
        assert r.status_code == 200 and r.json()["output_ids"] == engine_outputs[i]["output_ids"]
    assert all(r.status_code == 400 for r in responses[4:])
    assert requests.get(url + "/health", timeout=10).status_code == 200  # no key needed
    assert requests.get(url + "/health_generate", timeout=60).status_code == 200
    stats = wait_until_idle(url, AUTH)
    assert stats["num_free_pages"] == stats["total_pages"]
