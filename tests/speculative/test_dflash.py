"""DFLASH end to end: lossless vs NONE (block sizes 2..16, batches of mixed lengths, stop rules cutting
blocks), drafter/target state in lockstep after every step, partial and full acceptance with a trained
drafter, and token-for-token + accept-length agreement with the z-lab reference `dflash_generate`."""

import time

import numpy as np
import pytest
import torch

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.managers.schedule_batch import Req
from tests.tiny_checkpoints import load_hf_model

BLOCK_SIZES = [2, 4, 8, 16]


def batch_requests(reference_outputs):
    """4 prompts of mixed lengths with rules that end requests inside verify blocks."""
    stop = reference_outputs[1][11]
    return [
        {"temperature": 0.0, "max_new_tokens": 29, "ignore_eos": True},
        {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True, "stop_token_ids": [stop]},
        {"temperature": 0.0, "max_new_tokens": 23},  # may also end at the model's EOS
        {"temperature": 0.0, "max_new_tokens": 37, "ignore_eos": True},
    ]


def reference_params(prompts):
    return [{"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}] * len(prompts)


@pytest.fixture(scope="module")
def none_outputs(none_engine, spec_prompts):
    base = [o["output_ids"] for o in none_engine.generate(input_ids=spec_prompts, sampling_params=reference_params(spec_prompts))]
    params = batch_requests(base)
    outs = none_engine.generate(input_ids=spec_prompts, sampling_params=params)
    return params, [o["output_ids"] for o in outs], [o["meta_info"]["finish_reason"] for o in outs]


def watch_steps(engine, monkeypatch):
    """Wrap the scheduler's result processing (until the test ends): after every prefill/decode
    step, each live request's drafter committed length must equal its target committed length;
    records (tokens offered, tokens kept) of every step whose stop rules cut tokens."""
    worker, scheduler = engine.scheduler.worker, engine.scheduler
    log = {"checks": 0, "cut": []}
    process = scheduler.process_batch_result

    def checked(batch, result):
        before = [len(r.output_ids) for r in batch.reqs]
        process(batch, result)
        for i, req in enumerate(batch.reqs):
            offered, kept = int(result.num_new_tokens[i]), len(req.output_ids) - before[i]
            if kept < offered:
                log["cut"].append((req.finished_reason["type"], offered, kept))
            if not req.finished and req.slot in worker.drafting:  # adaptive: some have no drafter context
                assert worker.committed_len(req.slot) == req.committed_len
                log["checks"] += 1

    monkeypatch.setattr(scheduler, "process_batch_result", checked)
    return log


# The fast lane keeps B = 4 and 8; B = 2 and 16 run in the full suite.
@pytest.mark.parametrize("block_size", [pytest.param(b, marks=pytest.mark.slow) if b in (2, 16) else b for b in BLOCK_SIZES])
def test_greedy_dflash_is_lossless(block_size, dflash_engine, spec_prompts, none_outputs, monkeypatch):
    params, expected, reasons = none_outputs
    engine = dflash_engine(block_size)
    worker = engine.scheduler.worker  # greedy drafts from the target's greedy head where it has one (AMX hosts)
    assert (worker.proposer._greedy is not None) == ("greedy_head" in worker.runner.params)
    log = watch_steps(engine, monkeypatch)
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == expected
    assert [o["meta_info"]["finish_reason"] for o in outs] == reasons
    assert reasons[1] == {"type": "stop", "matched": params[1]["stop_token_ids"][0]}
    single = engine.generate(input_ids=spec_prompts[3], sampling_params=params[3])
    assert single["output_ids"] == expected[3]
    assert log["checks"] > 0
    for out in outs:
        info = out["meta_info"]
        hist = info["spec_correct_drafts_histogram"]
        assert len(hist) == block_size and sum(hist) == info["spec_verify_ct"]
        assert info["spec_num_proposed_drafts"] == (block_size - 1) * info["spec_verify_ct"]
        assert info["spec_num_correct_drafts"] == sum(a * n for a, n in enumerate(hist))
        assert info["spec_accept_length"] == pytest.approx(info["completion_tokens"] / max(1, info["spec_verify_ct"]))
        assert info["spec_accept_rate"] == pytest.approx(
            info["spec_num_correct_drafts"] / max(1, info["spec_num_proposed_drafts"]))


def chunk_bounds(chunks):
    """(first index, last index) in the output of each token list handed over in one step."""
    bounds, start = [], 0
    for chunk in chunks:
        bounds.append((start, start + len(chunk) - 1))
        start += len(chunk)
    return bounds


def record_chunks(engine):
    """Record the token lists handed over per step (prefill token, then a+1 per verify) by rid.
    Returns (chunks, stop_recording)."""
    chunks = {}
    process = engine.scheduler.process_batch_result

    def recording_process(batch, result):
        for i, req in enumerate(batch.reqs):
            chunks.setdefault(req.rid, []).append(result.new_tokens(i))
        process(batch, result)

    engine.scheduler.process_batch_result = recording_process

    def stop():
        engine.scheduler.process_batch_result = process

    return chunks, stop


def test_stop_rules_cut_inside_blocks(dflash_engine, none_engine, spec_prompts, monkeypatch):
    """A stop token and max_new_tokens placed inside a verified block end the request there."""
    engine = dflash_engine(16)
    chunks, stop_recording = record_chunks(engine)
    free = engine.generate(input_ids=spec_prompts, sampling_params=reference_params(spec_prompts))
    stop_recording()
    stop_cases, length_cases = [], []
    for k, out in enumerate(free):
        bounds = chunk_bounds(chunks[out["meta_info"]["id"]])
        inside = {i for first, last in bounds for i in range(first, last)}  # not a chunk's last token
        first_seen = {}
        for i, token in enumerate(out["output_ids"]):
            first_seen.setdefault(token, i)
        stop_cases += [(k, t, i) for t, i in first_seen.items() if i in inside]
        length_cases += [(k, i + 1) for i in sorted(inside) if i > 0]
    assert stop_cases and length_cases, chunks
    stop_case = stop_cases[0]
    length_case = next((c for c in length_cases if c[0] != stop_case[0]), None)
    assert length_case, (stop_cases, length_cases)

    k, token, index = stop_case
    n, limit = length_case
    params = reference_params(spec_prompts)
    params[k] = {**params[k], "stop_token_ids": [token]}
    params[n] = {**params[n], "max_new_tokens": limit}
    log = watch_steps(engine, monkeypatch)
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    expected = none_engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert outs[k]["output_ids"] == free[k]["output_ids"][: index + 1]
    assert outs[k]["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert outs[n]["meta_info"]["finish_reason"] == {"type": "length", "length": limit}
    assert {kind for kind, offered, kept in log["cut"]} == {"stop", "length"}, log["cut"]


def test_stop_strings_cut_inside_blocks(spec_target_with_tokenizer, trained_draft_dir, engine_kwargs, spec_prompts,
                                       monkeypatch):
    """A stop string completed by a token inside a verified block ends the request there; the text
    stops before the string, and everything equals NONE's."""
    kwargs = {**engine_kwargs, "model_path": spec_target_with_tokenizer, "skip_tokenizer_init": False}
    none = Engine(**kwargs)
    engine = Engine(**kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                    speculative_num_draft_tokens=16)
    tokenizer = engine.tokenizer
    chunks, stop_recording = record_chunks(engine)
    params = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
    free = engine.generate(input_ids=spec_prompts, sampling_params=params)
    stop_recording()
    case = None
    for k, out in enumerate(free):
        ids = out["output_ids"]
        inside = {i for first, last in chunk_bounds(chunks[out["meta_info"]["id"]]) for i in range(first, last)}
        for i in sorted(inside):
            if i == 0:
                continue
            stop = tokenizer.decode(ids[i - 1 : i + 1])  # two tokens, e.g. "t7 t3"
            first = next(j for j in range(len(ids)) if stop in tokenizer.decode(ids[: j + 1]))
            if first in inside:
                case = (k, stop, first)
                break
        if case:
            break
    assert case, chunks
    k, stop, index = case
    log = watch_steps(engine, monkeypatch)
    cut_params = [params] * len(spec_prompts)
    cut_params[k] = {**params, "stop": stop}
    outs = engine.generate(input_ids=spec_prompts, sampling_params=cut_params)
    expected = none.generate(input_ids=spec_prompts, sampling_params=cut_params)
    assert [(o["output_ids"], o["text"]) for o in outs] == [(o["output_ids"], o["text"]) for o in expected]
    full_text = free[k]["text"]
    assert outs[k]["output_ids"] == free[k]["output_ids"][: index + 1]
    assert outs[k]["text"] == full_text[: full_text.index(stop)]
    assert outs[k]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert "stop" in {kind for kind, offered, kept in log["cut"]}, log["cut"]


def test_trained_drafter_accepts_partial_and_full_blocks(dflash_engine, spec_prompts, none_engine):
    engine = dflash_engine(8)
    params = reference_params(spec_prompts)
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [
        o["output_ids"] for o in none_engine.generate(input_ids=spec_prompts, sampling_params=params)]
    hist = np.sum([o["meta_info"]["spec_correct_drafts_histogram"] for o in outs], axis=0)
    assert hist[0] > 0 and hist[1:7].sum() > 0 and hist[7] > 0, hist  # rejected, partial, full
    assert engine.scheduler.get_stats()["avg_spec_accept_length"] > 1.0


def test_random_drafter_is_lossless(random_draft_dir, spec_prompts, none_outputs, engine_kwargs, monkeypatch):
    params, expected, _ = none_outputs
    engine = Engine(**engine_kwargs, speculative_algorithm="DFLASH",
                    speculative_draft_model_path=random_draft_dir, speculative_num_draft_tokens=8)
    log = watch_steps(engine, monkeypatch)
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == expected
    assert log["checks"] > 0


def test_token_map_is_lossless_and_validated(trained_draft_dir, spec_prompts, none_outputs, engine_kwargs,
                                            tmp_path):
    """--speculative-token-map: drafts only from the map, output still equal to NONE's."""
    import json

    from sgl_dflash.errors import ServerArgsError

    params, expected, _ = none_outputs
    used = sorted({t for out in expected for t in out} | {t for p in spec_prompts for t in p})
    token_map = tmp_path / "token_map.json"
    token_map.write_text(json.dumps(used[: max(2, len(used) // 2)]))  # half: some drafts must miss
    kwargs = dict(engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=trained_draft_dir,
                  speculative_num_draft_tokens=8)
    engine = Engine(**kwargs, speculative_token_map=str(token_map))
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    engine.shutdown()
    assert [o["output_ids"] for o in outs] == expected
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > 0

    for content, message in [("[1, 1]", "distinct"), ('{"a": 1}', "JSON list"), ("[-1]", "distinct")]:
        token_map.write_text(content)
        with pytest.raises(ServerArgsError, match="--speculative-token-map"):
            Engine(**kwargs, speculative_token_map=str(token_map))
    with pytest.raises(ServerArgsError, match="no such file"):
        Engine(**kwargs, speculative_token_map=str(tmp_path / "missing.json"))
    with pytest.raises(ServerArgsError, match="NONE"):
        Engine(**engine_kwargs, speculative_token_map=str(token_map))


def test_drafter_config_names_its_token_map(trained_draft_dir, spec_prompts, none_outputs, engine_kwargs, tmp_path):
    """Without --speculative-token-map, the map the drafter's config.json names (`token_map.file`,
    as the shipped drafter's does) is used; 'none' drafts over the whole vocabulary; a named file
    that is missing is refused."""
    import json
    import shutil

    from sgl_dflash.errors import ServerArgsError
    from sgl_dflash.server_args import ServerArgs

    params, expected, _ = none_outputs
    draft = tmp_path / "draft"
    shutil.copytree(trained_draft_dir, draft)
    used = sorted({t for out in expected for t in out} | {t for p in spec_prompts for t in p})
    ids = used[: max(2, len(used) // 2)]
    (draft / "hot.json").write_text(json.dumps(ids))
    config = json.loads((draft / "config.json").read_text())
    config["token_map"] = {"file": "hot.json", "ids": len(ids)}
    (draft / "config.json").write_text(json.dumps(config))
    kwargs = dict(engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
                  speculative_num_draft_tokens=8)

    engine = Engine(**kwargs)
    assert engine.server_args.speculative_token_map == str(draft / "hot.json")
    np.testing.assert_array_equal(np.asarray(engine.scheduler.worker.proposer.token_map), ids)
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    engine.shutdown()
    assert [o["output_ids"] for o in outs] == expected

    # 'none' stays 'none' (SGLang's launcher checks its args, then ours, with the same value).
    assert ServerArgs(**kwargs, speculative_token_map="None").check().speculative_token_map == "None"
    (draft / "hot.json").unlink()
    with pytest.raises(ServerArgsError, match="names the token map 'hot.json'"):
        ServerArgs(**kwargs).check()
    engine = Engine(**kwargs, speculative_token_map="none")
    assert engine.scheduler.worker.proposer.token_map is None
    outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
    engine.shutdown()
    assert [o["output_ids"] for o in outs] == expected


@pytest.mark.parametrize("drafter, block_size", [pytest.param("trained", 8, marks=pytest.mark.slow), ("random", 4), ("last_layer", 4)])
def test_matches_reference_dflash_generate(drafter, block_size, monkeypatch, dflash_engine, spec_target_dir,
                                           random_draft_dir, trained_draft_dir, last_layer_draft_dir,
                                           spec_prompts, engine_kwargs):
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its stats timer needs CUDA
    draft_dir = {"trained": trained_draft_dir, "random": random_draft_dir, "last_layer": last_layer_draft_dir}[drafter]
    engine = (dflash_engine(block_size) if drafter == "trained" else Engine(
        **engine_kwargs, speculative_algorithm="DFLASH", speculative_draft_model_path=draft_dir,
        speculative_num_draft_tokens=block_size))
    target = load_hf_model(spec_target_dir)
    reference_drafter = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()

    steps = []  # our correct-draft count per verify step, in order
    record_verify = Req.record_verify

    def recording(self, num_drafts, num_correct):
        steps.append(num_correct)
        record_verify(self, num_drafts, num_correct)

    monkeypatch.setattr(Req, "record_verify", recording)
    new_tokens = 40
    for prompt in spec_prompts:
        steps.clear()
        ours = engine.generate(input_ids=prompt, sampling_params={
            "temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True})
        # Extra room so that every reference step we compare with verifies a full block.
        ref = dflash_generate(reference_drafter, target, torch.tensor([prompt]), new_tokens + block_size,
                              stop_token_ids=None, block_size=block_size, return_stats=True)
        ref_tokens = ref.output_ids[0, len(prompt):].tolist()
        ref_steps = [produced - 1 for produced in ref.acceptance_lengths][: len(steps)]
        assert ours["output_ids"] == ref_tokens[:new_tokens]
        assert steps == ref_steps
        hist = np.bincount(ref_steps, minlength=block_size).tolist()
        assert ours["meta_info"]["spec_correct_drafts_histogram"] == hist
