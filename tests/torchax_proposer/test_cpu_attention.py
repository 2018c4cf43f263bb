"""The drafter's attention through the CPU kernel (`DFlashProposer(cpu_attention=)`,
`cpu_lowering.cpu_attention`): the same drafts as XLA's attention, logits within float32 rounding
of it and of the eager torch drafter, in narrow and wide steps, for every block the proposer
drafts; and through the kernel that reads the drafter's cache in place
(`DFlashProposer(cache_attention=)`): the same bits as the gathered window's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jax_backend import cpu_kernels
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlashProposer, load_draft_model
from torchax_proposer.torch_drafter import TorchDrafter

TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    target_dir = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=4)
    # Head size 64 (the kernel's), 4 query heads over 2 kv heads.
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), target_dir, num_layers=2, block_size=8,
                           target_layer_ids=[1, 2], head_dim=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_the_kernel_attention_drafts_what_xla_drafts(draft_dir, num_seqs):
    assert cpu_kernels.available()
    rng = np.random.default_rng(num_seqs)
    embed, lm_head = (0.1 * rng.standard_normal((2, 256, 64))).astype(np.float32)
    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[0].shape)  # at trace time: once per compiled program
        return cpu_kernels.dense_attention(*args, **kwargs)

    make = lambda attention: DFlashProposer(draft_dir, target_embed=embed, target_lm_head=lm_head,  # noqa: E731
                                            target_config=TARGET, max_num_seqs=4, max_context_len=400,
                                            few_row_matmul=cpu_kernels.rows_matmul, cpu_attention=attention)
    kernel_p, xla_p = make(kernel), make(None)
    eager = TorchDrafter(load_draft_model(draft_dir, TARGET), torch.from_numpy(embed), torch.from_numpy(lm_head))
    ids = list(range(num_seqs))
    for i in ids:  # 150-rows prompts: windows of 256 cached rows, two of the kernel's key blocks
        prompt = rng.standard_normal((150 + 7 * i, 128)).astype(np.float32)
        for p in (kernel_p, xla_p):
            p.add(i, jax.device_put(prompt))
        eager.add(i, torch.from_numpy(prompt))
    for block in [8, 8, 4, 2]:
        bonus = rng.integers(0, 256, num_seqs)
        tokens, logits = kernel_p.propose(ids, bonus, return_logits=True, block_size=block)
        xla_tokens, xla_logits = xla_p.propose(ids, bonus, return_logits=True, block_size=block)
        np.testing.assert_array_equal(tokens, xla_tokens)
        np.testing.assert_allclose(logits, xla_logits, atol=1e-5, rtol=0)
        if block == 8:
            eager_tokens, eager_logits = eager.propose(ids, bonus.tolist(), return_logits=True)
            np.testing.assert_allclose(logits, eager_logits.numpy(), atol=1e-5, rtol=0)
        accepted = rng.integers(0, block, num_seqs)
        new = [rng.standard_normal((int(a) + 1, 128)).astype(np.float32) for a in accepted]
        for p in (kernel_p, xla_p):
            p.commit(ids, accepted, [jax.device_put(x) for x in new])
        eager.commit(ids, accepted.tolist(), [torch.from_numpy(x) for x in new])  # it drafts block 8 only
    # Every block's program: query rows = groups (2) x block, one call per draft layer.
    assert {shape[2] for shape in calls} == {16, 8, 4} and len(calls) == 2 * 3


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_attention_over_the_cache_in_place_drafts_the_same_bits(draft_dir, num_seqs):
    """`cache_attention`: a draft attends over each layer's cache in place instead of a window the
    program gathers next to the block; the same drafts and logits bit for bit, commit after
    commit, and no window is gathered (the dense kernel is no longer called by a draft), so the
    context crossing a window size (256 rows here) compiles no new draft program."""
    assert cpu_kernels.available()
    rng = np.random.default_rng(10 + num_seqs)
    embed, lm_head = (0.1 * rng.standard_normal((2, 256, 64))).astype(np.float32)
    calls = {"dense": 0, "cache": 0}

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1  # at trace time: once per compiled program and layer
            return kernel(*args, **kwargs)
        return call

    make = lambda **kw: DFlashProposer(draft_dir, target_embed=embed, target_lm_head=lm_head,  # noqa: E731
                                       target_config=TARGET, max_num_seqs=4, max_context_len=400,
                                       few_row_matmul=cpu_kernels.rows_matmul, **kw)
    in_place = make(cpu_attention=counted("dense", cpu_kernels.dense_attention),
                    cache_attention=counted("cache", cpu_kernels.cache_attention))
    window = make(cpu_attention=cpu_kernels.dense_attention)
    ids = list(range(num_seqs))
    for i in ids:
        prompt = rng.standard_normal((245 + 3 * i, 128)).astype(np.float32)
        for p in (in_place, window):
            p.add(i, jax.device_put(prompt))
    for block in [8, 4, 8, 2, 8]:
        bonus = rng.integers(0, 256, num_seqs)
        tokens, logits = in_place.propose(ids, bonus, return_logits=True, block_size=block)
        want_tokens, want_logits = window.propose(ids, bonus, return_logits=True, block_size=block)
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(logits, want_logits)
        accepted = np.full(num_seqs, block - 1)
        new = [rng.standard_normal((int(a) + 1, 128)).astype(np.float32) for a in accepted]
        for p in (in_place, window):
            p.commit(ids, accepted, [jax.device_put(x) for x in new])
    assert min(in_place.committed_len(i) for i in ids) > 256  # the gathered window grew to 400 rows
    assert calls["dense"] == 0 and calls["cache"] == 2 * 3  # two layers, one program per block (8, 4, 2)
    assert window.num_compilations() > in_place.num_compilations()
