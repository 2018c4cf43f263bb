"""The check the issue names: SGLang's launcher with DFLASH on the real pair (SmolLM2-135M-Instruct
+ our shipped drafter) on CPU: /generate equal to our own Engine, spec_accept_length in meta_info."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.integrations.sglang_harness import SGLangServer

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

QUESTIONS = ["What is the capital of France?", "Write a Python function that adds two numbers."]


def test_real_pair_through_sglang_equals_engine(tmp_path):
    from sgl_dflash import Engine
    from sgl_dflash.tools.demo import DEFAULT_DRAFTER
    from sgl_dflash.tools.model_import import ensure_default_model

    model = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True), add_special_tokens=False)
               for q in QUESTIONS]
    params = {"temperature": 0, "max_new_tokens": 32}
    handle = SGLangServer(["--model-path", model, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                           str(DEFAULT_DRAFTER), "--max-total-tokens", "2048", "--max-running-requests", "4",
                           "--log-level", "warning"], tmp_path / "server.log")
    try:
        served = [handle.generate(input_ids=ids, sampling_params=params) for ids in prompts]
    finally:
        handle.stop()
    engine = Engine(model_path=model, speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEFAULT_DRAFTER),
                    max_total_tokens=2048, max_running_requests=4)
    expected = engine.generate(input_ids=prompts, sampling_params=params)
    for out, exp in zip(served, expected):
        assert out["output_ids"] == exp["output_ids"]
        assert out["meta_info"]["spec_verify_ct"] == exp["meta_info"]["spec_verify_ct"]
        assert out["meta_info"]["spec_accept_length"] > 1.0  # the trained drafter gets drafts accepted
