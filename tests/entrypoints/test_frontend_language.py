"""An unmodified SGLang frontend-language program (`sgl.function` with `gen` and `select`) run
through `sgl.RuntimeEndpoint` against `python -m sgl_dflash.launch_server` (DFLASH, subprocess).

`gen` must produce the target's greedy continuation (transformers reference); `select` must pick
the choice SGLang's own rule picks from the target's token logprobs (computed here with
transformers): the highest mean logprob over the tokens after `logprob_start_len`.
"""

from __future__ import annotations

import numpy as np
import pytest
import sglang as sgl
import torch
from transformers import AutoTokenizer

from tests.server_harness import launch_cli_server, make_byte_target
from tests.tiny_checkpoints import load_hf_model
from tests.tiny_draft import make_tiny_draft

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

CHOICES = ["yes", "no", "maybe so"]
QUESTIONS = ["Is the sky blue?", "Do fish fly?", "Can pigs sing?", "Is two even?"]


@sgl.function
def answer_and_judge(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=10, temperature=0, stop="\n")
    s += "\nVerdict: " + sgl.select("verdict", choices=CHOICES)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_byte_target(tmp_path_factory.mktemp("fl_target"))


@pytest.fixture(scope="module")
def backend(model_dir, tmp_path_factory):
    draft = make_tiny_draft(tmp_path_factory.mktemp("fl_draft"), model_dir, block_size=4)
    handle = launch_cli_server(
        ["--model-path", model_dir, "--speculative-algorithm", "DFLASH",
         "--speculative-draft-model-path", str(draft), "--page-size", "8", "--max-total-tokens", "1024",
         "--max-running-requests", "8", "--api-key", "sk-frontend", "--log-level", "warning"],
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    yield sgl.RuntimeEndpoint(handle.base_url, api_key="sk-frontend")
    handle.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf_model(model_dir), AutoTokenizer.from_pretrained(model_dir)


def greedy_text(hf, text, max_new_tokens, stop):
    model, tokenizer = hf
    ids = tokenizer.encode(text)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    return text.split(stop)[0]


def expected_choice(hf, prefix):
    """SGLang's `token_length_normalized` choice, from transformers' logprobs."""
    model, tokenizer = hf
    start = max(len(tokenizer.encode(prefix)) - 2, 0)
    scores = []
    for choice in CHOICES:
        ids = tokenizer.encode(prefix + choice)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        values = [logprobs[k - 1, ids[k]].item() for k in range(start + 1, len(ids))]
        scores.append(np.mean(values))
    return CHOICES[int(np.argmax(scores))], scores


def check_state(state, question, hf):
    prefix = "Q: " + question + "\nA:"
    assert state["answer"] == greedy_text(hf, prefix, 10, "\n")
    verdict_prefix = prefix + state["answer"] + "\nVerdict: "
    choice, scores = expected_choice(hf, verdict_prefix)
    assert state["verdict"] == choice
    meta = state.get_meta_info("verdict")
    np.testing.assert_allclose(meta["normalized_prompt_logprobs"], scores, atol=2e-4)
    assert state.text() == verdict_prefix + choice


def test_gen_and_select(backend, hf):
    state = answer_and_judge.run(question=QUESTIONS[0], backend=backend)
    check_state(state, QUESTIONS[0], hf)
    assert state.get_meta_info("answer")["finish_reason"] is not None


def test_run_batch_concurrently(backend, hf):
    states = answer_and_judge.run_batch([{"question": q} for q in QUESTIONS], backend=backend,
                                        num_threads=len(QUESTIONS))
    for state, question in zip(states, QUESTIONS):
        check_state(state, question, hf)


def test_streaming_gen(backend, hf):
    state = answer_and_judge.run(question=QUESTIONS[1], backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"]
    check_state(state, QUESTIONS[1], hf)
