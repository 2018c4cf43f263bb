"""Engine (autoregressive, NONE): greedy output == transformers generate(do_sample=False), token for
token, for single and batched prompts of different lengths; text in/out with a real tokenizer;
stop rules; request validation; SGLang-shaped results."""

import numpy as np
import pytest
import torch

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.errors import InvalidRequestError, SamplingParamsError
from tests.tiny_checkpoints import load_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 45)), [3] * 9]
NEW_TOKENS = 24


def hf_greedy(hf, prompt, max_new_tokens, eos_token_id=None):
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos_token_id, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["qwen3", pytest.param("llama", marks=pytest.mark.slow)])
def arch_setup(request, tiny_qwen3_dir, tiny_llama_dir):
    model_dir = {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir}[request.param]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=8)
    hf = load_hf_model(model_dir)
    references = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return engine, hf, references


def test_greedy_single_and_batched_match_transformers(arch_setup):
    engine, _, references = arch_setup
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    single = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert isinstance(single, dict)
    assert single["output_ids"] == references[0]
    batched = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o["output_ids"] for o in batched] == references
    for out, prompt in zip(batched, PROMPTS):
        info = out["meta_info"]
        assert info["prompt_tokens"] == len(prompt) and info["completion_tokens"] == NEW_TOKENS
        assert info["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert info["e2e_latency"] > 0
        assert "text" not in out  # skip_tokenizer_init: ids only, like SGLang
        assert "spec_verify_ct" not in info


def test_stop_token_and_eos_end_like_transformers(arch_setup):
    engine, hf, references = arch_setup
    # A stop token taken from the middle of the reference output: generation ends right after it.
    stop = references[2][9]
    cut = references[2].index(stop) + 1
    out = engine.generate(input_ids=PROMPTS[2], sampling_params={
        "temperature": 0.0, "max_new_tokens": NEW_TOKENS, "stop_token_ids": [stop]})
    assert out["output_ids"] == references[2][:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Treating that token as the model's EOS in transformers gives the same output.
    assert hf_greedy(hf, PROMPTS[2], NEW_TOKENS, eos_token_id=stop) == references[2][:cut]
    # ignore_eos ignores EOS only; the explicit stop token still applies. max_new_tokens=0 -> empty.
    outs = engine.generate(input_ids=[PROMPTS[2], PROMPTS[0]], sampling_params=[
        {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "stop_token_ids": [stop], "ignore_eos": True},
        {"max_new_tokens": 0}])
    assert outs[0]["output_ids"] == references[2][:cut]
    assert outs[1]["output_ids"] == [] and outs[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_generate_as_completed_yields_each_result_when_it_finishes(arch_setup):
    engine, _, references = arch_setup
    lengths = [NEW_TOKENS, 3, 12, 1]
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    results = list(engine.generate_as_completed(input_ids=PROMPTS, sampling_params=params))
    assert [i for i, _ in results] == [3, 1, 2, 0]  # the order they finished in
    for i, out in results:
        assert out["output_ids"] == references[i][: lengths[i]]
    # A bad prompt is refused when the call is made, before anything is queued.
    with pytest.raises(InvalidRequestError, match="invalid token ids"):
        engine.generate_as_completed(input_ids=[[1, 2], [1, 10**6]])
    # Stopping early aborts what is still running or waiting; the engine serves the next call.
    many = [{"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * 12
    stream = engine.generate_as_completed(input_ids=PROMPTS * 3, sampling_params=many)
    next(stream)
    stream.close()
    stats = engine.scheduler.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] == stats["total_pages"]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=params[0])["output_ids"] == references[0]


def test_bad_requests_get_clear_errors(arch_setup):
    engine, _, _ = arch_setup
    with pytest.raises(SamplingParamsError, match="top_p"):
        engine.generate(input_ids=[1, 2], sampling_params={"top_p": 0.0})
    with pytest.raises(SamplingParamsError, match="max_new_tokens"):
        engine.generate(input_ids=[[1, 2], [3]], sampling_params=[{}, {"max_new_tokens": -3}])
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter"):
        engine.generate(input_ids=[1, 2], sampling_params={"max_tokens": 3})
    with pytest.raises(InvalidRequestError, match=r"input \(1024 tokens\) is longer than the model's context length"):
        engine.generate(input_ids=[1] * 1024)
    with pytest.raises(InvalidRequestError, match="invalid token ids"):
        engine.generate(input_ids=[1, 10**6])
    with pytest.raises(InvalidRequestError, match="need a tokenizer"):
        engine.generate(prompt="hello")
    with pytest.raises(InvalidRequestError, match="2 sampling_params for 3 prompts"):
        engine.generate(input_ids=[[1], [2], [3]], sampling_params=[{}, {}])
    # Nothing was left queued or holding pages by the refused calls.
    stats = engine.scheduler.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] == stats["total_pages"]


def test_text_in_text_out_with_tokenizer(tokenizer_model_dir):
    model_dir, tokenizer = tokenizer_model_dir
    engine = Engine(model_path=model_dir, max_total_tokens=512, max_running_requests=4)
    hf = load_hf_model(model_dir)
    prompts = ["The for statement", "An iterator is created"]
    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    outs = engine.generate(prompt=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outs):
        ids = tokenizer.encode(prompt)
        assert out["output_ids"] == hf_greedy(hf, ids, 16)
        assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        assert out["meta_info"]["prompt_tokens"] == len(ids)

    # A stop string taken from the middle of the decoded text: the text ends before it.
    text = outs[0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = engine.generate(prompt=prompts[0], sampling_params={**params, "stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    assert outs[0]["output_ids"][: len(cut["output_ids"])] == cut["output_ids"]
    assert len(cut["output_ids"]) < 16


@pytest.mark.slow
def test_sampling_is_seeded_and_respects_top_k(tiny_qwen3_dir):
    kwargs = dict(model_path=tiny_qwen3_dir, skip_tokenizer_init=True, max_total_tokens=1024, random_seed=7)
    params = {"temperature": 1.0, "top_k": 2, "max_new_tokens": 6, "ignore_eos": True}
    first = [o["output_ids"] for o in Engine(**kwargs).generate(input_ids=[PROMPTS[0]] * 8, sampling_params=params)]
    again = [o["output_ids"] for o in Engine(**kwargs).generate(input_ids=[PROMPTS[0]] * 8, sampling_params=params)]
    assert first == again  # same seed, same samples
    assert len({tuple(o) for o in first}) > 1  # but the samples differ between requests
    # Every sampled token is one of the 2 most likely tokens of the target at that point.
    hf = load_hf_model(tiny_qwen3_dir)
    for out in first:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[0] + out])).logits[0]
        top2 = torch.topk(logits[len(PROMPTS[0]) - 1 : -1], 2).indices.numpy()
        assert np.all((top2 == np.array(out)[:, None]).any(axis=1))


@pytest.mark.slow
def test_aux_hidden_layers_are_transformers_hidden_states_recorded_while_generating(tiny_llama_dir):
    """`aux_hidden_layers` (drafter training data in one pass): meta_info["aux_hidden_states"] holds
    one row per token of prompt + output but the last, equal to transformers' hidden_states[l + 1]
    on the finished sequence (the LAST layer final-normed, as transformers reports it); the
    output itself is unchanged. A small KV budget forces a retraction, whose rows are recomputed."""
    import json

    from sgl_dflash.errors import ServerArgsError

    num_layers = json.load(open(f"{tiny_llama_dir}/config.json"))["num_hidden_layers"]
    layers = (0, num_layers - 1)
    params = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    plain = Engine(model_path=tiny_llama_dir, skip_tokenizer_init=True, max_total_tokens=1024)
    expected_ids = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    plain.shutdown()
    # 4 prompts of up to 25 + 20 tokens in 96 slots: some request is retracted and recomputed.
    engine = Engine(model_path=tiny_llama_dir, skip_tokenizer_init=True, max_total_tokens=96, page_size=8,
                    aux_hidden_layers=layers)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    retractions = engine.get_server_info()["internal_states"][0]["num_retractions"]
    engine.shutdown()
    hf = load_hf_model(tiny_llama_dir)
    for prompt, out, ids in zip(PROMPTS, outs, expected_ids):
        assert out["output_ids"] == ids
        seq = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            hidden = hf(seq, output_hidden_states=True).hidden_states
        reference = torch.cat([hidden[l + 1][0] for l in layers], dim=-1)[:-1].numpy()
        aux = out["meta_info"]["aux_hidden_states"]
        assert aux.shape == reference.shape
        np.testing.assert_allclose(aux, reference, atol=1e-4, rtol=1e-4)
    assert retractions > 0

    with pytest.raises(ServerArgsError, match="aux_hidden_layers"):
        Engine(model_path=tiny_llama_dir, skip_tokenizer_init=True, aux_hidden_layers=(num_layers,))
    with pytest.raises(ServerArgsError, match="aux_hidden_layers"):
        Engine(model_path=tiny_llama_dir, skip_tokenizer_init=True, aux_hidden_layers=(0,),
               speculative_algorithm="DFLASH", speculative_draft_model_path=tiny_llama_dir)
