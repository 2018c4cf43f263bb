"""The official OpenAI Python client against `python -m sgl_dflash.launch_server` running DFLASH
(subprocess, real CLI): completions and chat, streaming and not, errors; plus the speculative
statistics in meta_info, /server_info and /metrics.

References are independent of the server: greedy continuations from transformers' `generate`
(DFLASH greedy output must equal the target's own greedy output).
"""

from __future__ import annotations

import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.server_harness import launch_cli_server, make_byte_target
from tests.tiny_checkpoints import load_hf_model
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

API_KEY = "sk-openai-test"
BLOCK = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target = make_byte_target(tmp_path_factory.mktemp("oai_target"))
    draft = make_tiny_draft(tmp_path_factory.mktemp("oai_draft"), target, block_size=BLOCK)
    return target, str(draft)


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    target, draft = model_dirs
    handle = launch_cli_server(
        ["--model-path", target, "--speculative-algorithm", "DFLASH",
         "--speculative-draft-model-path", draft, "--page-size", "8", "--max-total-tokens", "1024",
         "--max-running-requests", "8", "--api-key", API_KEY, "--served-model-name", "tiny-dflash",
         "--log-level", "warning"],
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dirs):
    """Greedy continuation (token ids) of `ids` by transformers, stopping at EOS like the server."""
    target, _ = model_dirs
    model = load_hf_model(target)
    tokenizer = AutoTokenizer.from_pretrained(target)

    def greedy(ids, max_new_tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new = out[0, len(ids):].tolist()
        return new, tokenizer.decode(new, skip_special_tokens=True)

    greedy.tokenizer = tokenizer
    return greedy


def test_models_list(client, model_dirs):
    (model,) = client.models.list().data
    assert model.id == "tiny-dflash"


def test_completion_equals_target_greedy(client, reference):
    prompt = "The quick brown fox"
    _, expected = reference(list(prompt.encode()), 16)
    resp = client.completions.create(model="tiny-dflash", prompt=prompt, max_tokens=16, temperature=0)
    (choice,) = resp.choices
    assert choice.text == expected
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage.prompt_tokens == len(prompt.encode())
    assert resp.usage.completion_tokens <= 16
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_stream_concatenates_to_the_same_text(client, reference):
    prompt = "Once upon a time"
    _, expected = reference(list(prompt.encode()), 16)
    stream = client.completions.create(model="tiny-dflash", prompt=prompt, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completion_stop_sequence(client, reference):
    prompt = "Stop here please"
    _, full = reference(list(prompt.encode()), 16)
    stop = full[5:7]
    resp = client.completions.create(model="tiny-dflash", prompt=prompt, max_tokens=16, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def chat_prompt_ids(reference, messages):
    text = reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference.tokenizer.encode(text, add_special_tokens=False)


def test_chat_completion_equals_target_greedy(client, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    _, expected = reference(chat_prompt_ids(reference, messages), 12)
    resp = client.chat.completions.create(model="tiny-dflash", messages=messages, max_tokens=12,
                                          temperature=0)
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert resp.usage.prompt_tokens == len(chat_prompt_ids(reference, messages))


def test_chat_completion_stream(client, reference):
    messages = [{"role": "user", "content": "Tell me a story."}]
    _, expected = reference(chat_prompt_ids(reference, messages), 12)
    chunks = list(client.chat.completions.create(model="tiny-dflash", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_client_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny-dflash", messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="tiny-dflash", prompt="x", n=2)
    bad_key = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert requests.get(server.base_url + "/health", timeout=10).status_code == 200


def test_speculative_stats_in_meta_info_server_info_and_metrics(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = requests.post(server.base_url + "/generate", headers=headers, timeout=120, json={
        "text": "Speculate about this", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                           "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 24
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
    assert 1.0 <= meta["spec_accept_length"] <= BLOCK
    assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (BLOCK - 1)
    assert meta["spec_accept_rate"] == pytest.approx(
        meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
    assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]

    info = requests.get(server.base_url + "/server_info", headers=headers, timeout=10).json()
    state = info["internal_states"][0]
    assert info["speculative_algorithm"] == "DFLASH" and info["speculative_num_draft_tokens"] == BLOCK
    assert state["avg_spec_accept_length"] >= 1.0
    metrics = requests.get(server.base_url + "/metrics", timeout=10).text  # open, like SGLang
    values: dict[str, float] = {}  # summed over label sets
    for line in metrics.splitlines():
        if line.startswith("sglang:") and "{" in line:
            name = line.split("{")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert values["sglang:spec_accept_length"] == pytest.approx(state["avg_spec_accept_length"])
    assert values["sglang:spec_accept_rate"] == pytest.approx(state["spec_accept_rate"])
    assert values["sglang:generation_tokens_total"] >= 24
    assert values["sglang:num_requests_total"] >= 1
    assert "sglang:num_queue_reqs" in values and "sglang:num_running_reqs" in values
