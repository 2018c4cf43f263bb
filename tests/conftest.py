"""Shared, session-scoped tiny checkpoints (built once per test session)."""

import numpy as np
import pytest

from tests.tiny_checkpoints import make_tiny_target


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("qwen3_target"), "qwen3", num_hidden_layers=2)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("llama_target"), "llama", num_hidden_layers=2)


@pytest.fixture(scope="session")
def tokenizer_model_dir(tmp_path_factory):
    """A tiny Qwen3 target saved together with a small BPE tokenizer (vocabulary = the model's)."""
    from pydoc_data.topics import topics

    from sgl_dflash.tools.tiny_pair import train_tokenizer

    path = tmp_path_factory.mktemp("qwen3_with_tokenizer")
    texts = [topics[key] for key in sorted(topics)[:20]]
    tokenizer = train_tokenizer(texts, vocab_size=320, out_dir=path)
    make_tiny_target(path, "qwen3", num_hidden_layers=2, vocab_size=len(tokenizer),
                     eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return str(path), tokenizer


def pytest_configure(config):
    import os
    import tempfile

    # Test models are tiny: one thread per process is faster than two (no thread hand-offs), and
    # far faster when several test processes share the 2 cores. Set before JAX starts its backend;
    # an XLA_FLAGS given by the caller wins.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    import torch

    torch.set_num_threads(1)

    # Engines built by different tests compile the same programs: a session-wide persistent
    # compilation cache lets later engines load them instead of recompiling (pure speed; a cache
    # key is the whole program, so results are unchanged). Fresh per session: nothing stale.
    import jax

    cache_dir = tempfile.mkdtemp(prefix="sgl_dflash_jax_cache_")
    # Servers the tests launch as subprocesses share it too (instead of the user's ~/.cache).
    os.environ["SGL_DFLASH_COMPILATION_CACHE_DIR"] = cache_dir
    # Adaptive engines skip the startup sweep (dozens of programs per engine); its own tests turn
    # it on (tests/speculative/test_precompile.py).
    os.environ["SGL_DFLASH_DISABLE_PRECOMPILE"] = "1"
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# -- speculative decoding: a 16-token-vocabulary target (random models then accept some drafts) --
@pytest.fixture(scope="session")
def spec_target_dir(tmp_path_factory):
    # initializer_range 0.3: peaked next-token distributions, so that the 16^3 joint distribution
    # of 3 sampled tokens has most of its mass in cells a chi-square test can check (power).
    return make_tiny_target(tmp_path_factory.mktemp("spec_target"), "qwen3", num_hidden_layers=3, vocab_size=16,
                            initializer_range=0.3)


# Drafters read the outputs of target layers 0 and 1 (two concatenated feature blocks); the
# last-layer case (final-normed features) has its own drafter below.
DRAFT_LAYER_IDS = [0, 1]


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, spec_target_dir):
    from tests.tiny_draft import make_tiny_draft

    return str(make_tiny_draft(tmp_path_factory.mktemp("random_draft"), spec_target_dir, block_size=16,
                               target_layer_ids=DRAFT_LAYER_IDS))


@pytest.fixture(scope="session")
def engine_kwargs(spec_target_dir):
    # One set of limits for every engine on the spec target: same shapes, shared compilations.
    return dict(model_path=spec_target_dir, skip_tokenizer_init=True, max_total_tokens=4096,
                max_running_requests=32, context_length=256, random_seed=0)


@pytest.fixture(scope="session")
def spec_prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 16, size=n).tolist() for n in (3, 7, 12, 21)]


@pytest.fixture(scope="session")
def none_engine(engine_kwargs):
    from sgl_dflash.entrypoints.engine import Engine

    return Engine(**engine_kwargs)


@pytest.fixture(scope="session")
def trained_draft_dir(tmp_path_factory, spec_target_dir, none_engine):
    """A drafter that accepts: trained briefly (sgl_dflash.train) on the target's greedy outputs."""
    from sgl_dflash.tools.train import train_drafter

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 16, size=int(rng.integers(3, 12))).tolist() for _ in range(32)]
    outs = none_engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True})
    sequences = [p + o["output_ids"] for p, o in zip(prompts, outs)]
    path = tmp_path_factory.mktemp("trained_draft")
    train_drafter(spec_target_dir, path, sequences, prompt_lens=[len(p) for p in prompts], block_size=16, steps=40,
                  target_layer_ids=DRAFT_LAYER_IDS, batch_size=8, num_anchors=16, lr=3e-3, progress=False)
    return str(path)


@pytest.fixture(scope="session")
def dflash_engine(engine_kwargs, trained_draft_dir):
    """DFLASH engines with the trained drafter, one per block size, built on first use."""
    from sgl_dflash.entrypoints.engine import Engine

    engines = {}

    def get(block_size: int) -> Engine:
        if block_size not in engines:
            engines[block_size] = Engine(
                **engine_kwargs, speculative_algorithm="DFLASH",
                speculative_draft_model_path=trained_draft_dir, speculative_num_draft_tokens=block_size)
        return engines[block_size]

    return get


@pytest.fixture(scope="session")
def spec_target_with_tokenizer(tmp_path_factory, spec_target_dir):
    """The spec target plus a word-level tokenizer ("t0" .. "t15", decoded space-separated), so
    that stop strings can be tested; same weights and config, so compiled programs are shared."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("spec_target_tok")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f"{spec_target_dir}/{name}", path / name)
    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(16)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t2").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def last_layer_draft_dir(tmp_path_factory, spec_target_dir):
    """A random drafter reading layer 0 and the LAST target layer (z-lab's features for the last
    layer are final-normed)."""
    from tests.tiny_draft import make_tiny_draft

    return str(make_tiny_draft(tmp_path_factory.mktemp("last_layer_draft"), spec_target_dir, block_size=16,
                               target_layer_ids=[0, 2]))
