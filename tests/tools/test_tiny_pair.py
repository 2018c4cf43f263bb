"""The tiny pair builder (run here with a miniature recipe): tokenizer with chat template,
an HF target the Engine serves from text, a drafter that fits it, and a stamp that skips rebuilds."""

import dataclasses
import json

import pytest

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.server_args import ServerArgs
from sgl_dflash.tools.tiny_pair import SPECIAL_TOKENS, TinyPairSpec, ensure_tiny_pair

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)

MINI = TinyPairSpec(
    topics=("pass", "break"), vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
    intermediate_size=64, max_position_embeddings=256, target_steps=3, target_batch=2, target_seq_len=32,
    answer_tokens=6, draft_block_size=4, draft_steps=2,
)


def test_builds_a_servable_pair_once(tmp_path):
    model = ensure_tiny_pair(tmp_path / "pair", MINI, progress=False)
    target = json.loads((tmp_path / "pair/target/config.json").read_text())
    assert target["architectures"] == ["LlamaForCausalLM"] and target["tie_word_embeddings"]

    # The same limits as the builder's own engine: its compiled programs are reused.
    engine = Engine(model_path=model.target_dir, max_total_tokens=32 * 512, max_running_requests=32)
    tokenizer = engine.tokenizer
    assert all(tokenizer.convert_tokens_to_ids(t) != tokenizer.unk_token_id for t in SPECIAL_TOKENS)
    assert len(tokenizer) == target["vocab_size"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain pass."}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nExplain pass.<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate(prompt=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 5})
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert engine.scheduler.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}

    args = ServerArgs(model_path=model.target_dir, speculative_algorithm="DFLASH",
                      speculative_draft_model_path=model.draft_dir).check()
    assert args.speculative_num_draft_tokens == MINI.draft_block_size
    draft = json.loads((tmp_path / "pair/drafter/config.json").read_text())
    assert draft["dflash_config"]["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")

    # Built once: the same recipe reuses the files; another recipe rebuilds.
    stamp = tmp_path / "pair/build.json"
    mtime = stamp.stat().st_mtime_ns
    ensure_tiny_pair(tmp_path / "pair", MINI, progress=False)
    assert stamp.stat().st_mtime_ns == mtime
    ensure_tiny_pair(tmp_path / "pair", dataclasses.replace(MINI, seed=1), progress=False)
    assert json.loads(stamp.read_text())["seed"] == 1
