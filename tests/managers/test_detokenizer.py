"""Incremental detokenization equals decoding everything at once (byte-level tokens that split
UTF-8 characters, word-level tokens joined by spaces), and stop strings are found at the same
token as a whole-text search would find them."""

import numpy as np
import pytest

from sgl_dflash.managers.detokenizer_manager import IncrementalDetokenizer, decode, final_text
from tests.server_harness import make_byte_target


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_byte_target(tmp_path_factory.mktemp("byte_tok"))
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(16)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t2")


def sequences(tokenizer, rng):
    if tokenizer.vocab_size > 100:  # bytes: text with multi-byte characters, then random bytes
        yield tokenizer.encode("héllo wörld — ünïcode ✓ 数据 ok", add_special_tokens=False)
        for _ in range(20):
            yield rng.integers(0, 256, size=40).tolist() + [258]  # 258: a special token, skipped
    else:
        for _ in range(5):
            yield rng.integers(0, 16, size=30).tolist()


@pytest.mark.parametrize("name", ["byte_tokenizer", "word_tokenizer"])
def test_incremental_text_equals_whole_decode(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = np.random.default_rng(0)
    for ids in sequences(tokenizer, rng):
        detok, end = IncrementalDetokenizer(tokenizer), 0
        while end < len(ids):
            end = min(len(ids), end + int(rng.integers(1, 5)))  # blocks of 1-4 tokens, like DFLASH
            assert detok.update(ids[:end]) == decode(tokenizer, ids[:end])


def test_stop_strings_found_at_the_same_token_as_a_whole_text_search(byte_tokenizer):
    ids = byte_tokenizer.encode("one, two; three. four; ✓ five", add_special_tokens=False)
    for stops in (["; "], [". ", "; "], ["✓"], ["four", "one"], ["absent"]):
        detok = IncrementalDetokenizer(byte_tokenizer)
        found = [detok.find_stop(ids[: i + 1], stops) for i in range(len(ids))]
        expected = []
        for i in range(len(ids)):
            text = decode(byte_tokenizer, ids[: i + 1])
            expected.append(next((s for s in stops if s in text), None))
        first = next((i for i, s in enumerate(expected) if s), None)
        assert found[: (first + 1 if first is not None else None)] == expected[: (first + 1 if first is not None else None)]


def test_final_text_cuts_a_matched_stop_string(word_tokenizer):
    ids = [7, 3, 5, 9]  # "t7 t3 t5 t9"
    assert final_text(word_tokenizer, ids, {"type": "stop", "matched": "t5"}) == "t7 t3 "
    assert final_text(word_tokenizer, ids, {"type": "stop", "matched": 9}) == "t7 t3 t5 t9"
    assert final_text(word_tokenizer, ids, None) == "t7 t3 t5 t9"
