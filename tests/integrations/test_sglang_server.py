"""SGLang's own server, `python -m sglang.launch_server ... --device cpu`, on the tiny pair (a
random byte-level target + a random DFLASH drafter): our platform plugin makes it run our JAX
target and torchax drafter. Checked against our Engine and transformers (greedy exact), through
SGLang's /generate (+ streaming, spec meta_info, /metrics), its OpenAI API (openai client), its
frontend language, with abort, retraction (a KV pool too small for the load) and 16 concurrent
clients, and with what it refuses (logprobs, grammar)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import pytest
import requests
import torch

from tests.integrations.sglang_harness import SGLangServer
from tests.server_harness import make_byte_target
from tests.tiny_checkpoints import load_hf_model
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

BLOCK = 4
# A small KV pool: 16 clients x (prompt + 24 tokens + a verify block) do not fit, so SGLang retracts.
SERVER_FLAGS = ["--chunked-prefill-size", "16", "--max-running-requests", "16", "--max-total-tokens", "640",
                "--enable-metrics", "--log-level", "warning"]
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog, again and again and again.",
           "abc", "Once upon a time"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = make_byte_target(tmp_path_factory.mktemp("sglang_target"))
    draft = str(make_tiny_draft(tmp_path_factory.mktemp("sglang_draft"), target, block_size=BLOCK))
    return target, draft


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    target, draft = pair
    handle = SGLangServer(["--model-path", target, "--speculative-algorithm", "DFLASH",
                           "--speculative-draft-model-path", draft, *SERVER_FLAGS],
                          tmp_path_factory.mktemp("sglang_logs") / "server.log")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def prompt_ids(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine_outputs(pair, prompt_ids):
    """Our own Engine's greedy DFLASH outputs (themselves checked equal to NONE elsewhere)."""
    from sgl_dflash import Engine

    engine = Engine(model_path=pair[0], speculative_algorithm="DFLASH", speculative_draft_model_path=pair[1],
                    max_total_tokens=1024, max_running_requests=4)
    outs = engine.generate(input_ids=prompt_ids, sampling_params=greedy(ignore_eos=True))
    with_eos = engine.generate(input_ids=prompt_ids, sampling_params=greedy(40))
    return [o["output_ids"] for o in outs], [o["output_ids"] for o in with_eos]


def greedy(max_new_tokens=24, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def test_greedy_equals_engine_and_transformers(server, pair, prompt_ids, engine_outputs):
    hf = load_hf_model(pair[0])
    for ids, expected in zip(prompt_ids, engine_outputs[0]):
        out = server.generate(input_ids=ids, sampling_params=greedy(ignore_eos=True))
        assert out["output_ids"] == expected
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out["output_ids"] == ref[0, len(ids):].tolist()
        # The second prompt is longer than --chunked-prefill-size: prefilled in chunks.
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] >= 1.0
        assert meta["completion_tokens"] == 24


def test_eos_and_stop_strings_cut_verified_blocks(server, prompt_ids, engine_outputs):
    # Without ignore_eos a request ends at its EOS token, wherever it falls in a verified block.
    for ids, expected in zip(prompt_ids, engine_outputs[1]):
        assert server.generate(input_ids=ids, sampling_params=greedy(40))["output_ids"] == expected
    # A stop string: a printable ASCII character from the middle of a text (a random model's bytes
    # are not all valid UTF-8).
    fulls = [server.generate(input_ids=ids, sampling_params=greedy(ignore_eos=True))["text"] for ids in prompt_ids]
    k, stop = next((k, full[i]) for k, full in enumerate(fulls) for i in range(3, len(full))
                   if full[i].isascii() and full[i].isprintable() and not full[i].isspace())
    cut = server.generate(input_ids=prompt_ids[k], sampling_params=greedy(ignore_eos=True, stop=stop))
    assert cut["text"] == fulls[k][: fulls[k].index(stop)]
    assert cut["meta_info"]["finish_reason"]["matched"] == stop
    info = requests.get(server.base_url + "/server_info", timeout=30).json()
    assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0


def test_streaming_matches(server, prompt_ids):
    full = server.generate(input_ids=prompt_ids[3], sampling_params=greedy(ignore_eos=True))
    with requests.post(server.base_url + "/generate", stream=True, timeout=600, json={
            "input_ids": prompt_ids[3], "sampling_params": greedy(ignore_eos=True), "stream": True}) as response:
        chunks = [line[len(b"data: "):] for line in response.iter_lines() if line.startswith(b"data: ")]
    assert chunks[-1] == b"[DONE]" and len(chunks) > 2
    last = json.loads(chunks[-2])
    assert last["output_ids"] == full["output_ids"] and last["text"] == full["text"]


def test_sampling_and_metrics(server, prompt_ids):
    outs = [server.generate(input_ids=prompt_ids[0], sampling_params={
        "temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": 16, "ignore_eos": True}) for _ in range(3)]
    assert all(len(o["output_ids"]) == 16 for o in outs)
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # it samples
    metrics = requests.get(server.base_url + "/metrics", timeout=30).text
    assert "sglang:spec_accept_length" in metrics


def test_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 8
    completion = client.completions.create(model="default", prompt="Hello there", max_tokens=8, temperature=0)
    expected = server.generate(text="Hello there", sampling_params=greedy(8))["text"]
    assert completion.choices[0].text == expected


def test_frontend_language_program(server):
    import sglang as sgl

    @sgl.function
    def two_turns(s, topic):
        s += "Topic: " + topic + "\n"
        s += "A:" + sgl.gen("first", max_tokens=6, temperature=0)
        s += "\nB:" + sgl.gen("second", max_tokens=6, temperature=0)

    backend = sgl.RuntimeEndpoint(server.base_url)
    state = two_turns.run(topic="cats", backend=backend)
    first = server.generate(text="Topic: cats\nA:", sampling_params=greedy(6))["text"]
    assert state["first"] == first
    assert state.text().startswith("Topic: cats\nA:" + first + "\nB:")


def test_refused_requests(server):
    for body, needle in [
        ({"text": "hi", "return_logprob": True}, "logprobs"),
        ({"text": "hi", "sampling_params": {"json_schema": "{\"type\": \"object\"}"}}, "grammar"),
        ({"text": "hi", "sampling_params": {"frequency_penalty": 0.5}}, "penalties"),
    ]:
        response = requests.post(server.base_url + "/generate", json=body, timeout=60)
        assert response.status_code == 400 and needle in response.text.lower(), response.text


def test_abort_then_serve(server, prompt_ids):
    rid = "abort-me"
    with cf.ThreadPoolExecutor(1) as pool:
        long = pool.submit(requests.post, server.base_url + "/generate", timeout=600, json={
            "rid": rid, "input_ids": prompt_ids[0], "sampling_params": greedy(400, ignore_eos=True)})
        time.sleep(2)
        requests.post(server.base_url + "/abort_request", json={"rid": rid}, timeout=30)
        out = long.result()
    assert out.json()["meta_info"]["finish_reason"]["type"] == "abort"
    again = server.generate(input_ids=prompt_ids[2], sampling_params=greedy(ignore_eos=True))
    assert len(again["output_ids"]) == 24


def test_16_concurrent_clients_with_retraction(server, prompt_ids, engine_outputs):
    jobs = [prompt_ids[i % len(prompt_ids)] for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda ids: server.generate(input_ids=ids, sampling_params=greedy(ignore_eos=True)), jobs))
    for i, out in enumerate(outs):
        assert out["output_ids"] == engine_outputs[0][i % len(prompt_ids)]
    # 16 requests of up to 24 + 24 + BLOCK tokens do not fit in 640 KV slots at once. Threads may
    # arrive spread out (a loaded machine finishes the first before the last is sent), so the
    # retraction is checked on one batched request, whose 16 prompts reach the scheduler together.
    batch = server.generate(input_ids=jobs, sampling_params=greedy(ignore_eos=True))
    assert [o["output_ids"] for o in batch] == [engine_outputs[0][i % len(prompt_ids)] for i in range(16)]
    assert sum(o["meta_info"]["num_retractions"] for o in batch) > 0


def test_plain_autoregressive_server(pair, prompt_ids, tmp_path_factory):
    handle = SGLangServer(["--model-path", pair[0], "--log-level", "warning"],
                          tmp_path_factory.mktemp("sglang_ar_logs") / "server.log")
    try:
        from sgl_dflash import Engine

        expected = Engine(model_path=pair[0], max_total_tokens=1024).generate(
            input_ids=prompt_ids, sampling_params=greedy(ignore_eos=True))
        for ids, exp in zip(prompt_ids, expected):
            assert handle.generate(input_ids=ids, sampling_params=greedy(ignore_eos=True))["output_ids"] == exp["output_ids"]
    finally:
        handle.stop()
