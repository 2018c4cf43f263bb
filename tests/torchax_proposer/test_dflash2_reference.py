"""Our DFlash 2 drafter against the z-lab reference (`dflash` 0.1.0, `DFlash2DraftModel`).

Checkpoints are random-weight drafters written in z-lab's DFlash 2 format (tests/tiny_draft.py)
and read back by the reference through its own `from_pretrained` key mapping (the codebooks are
stored without `.weight`). The reference is driven as `dflash_generate` drives it; the features
are real hidden states of a tiny transformers Qwen3 target whose embedding and lm_head both use.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest
import torch
from dflash import model as ref_lib

from tests.torchax_proposer.test_drafter_reference import ReferenceDrafter, accepted_schedule
from tests.tiny_checkpoints import load_hf_model, make_tiny_target
from tests.tiny_draft import DFLASH2_TINY, context_features, make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import DFlash2DraftModel, DFlashProposer, TorchDrafter, load_draft_model

CONFIGS = {
    # GQA target shape, 2-tap convolutions over groups of 16, K=4.
    "b8_k4": dict(num_layers=2, block_size=8, target_layer_ids=[1, 4], dflash2=DFLASH2_TINY),
    # 3 taps over groups of 32, K=8, rank 16, output scaling and softcap on the unary logits.
    "b6_k8_softcap": dict(
        num_layers=1, block_size=6, target_layer_ids=[2], output_multiplier=0.8, final_logit_softcapping=6.0,
        dflash2=dict(conv_kernel_size=3, conv_group_size=32, selector_rank=16, selector_top_k=8),
    ),
}
PROMPT_LENS = (5, 17)
NUM_STEPS = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=6)
    return load_hf_model(path), json.loads(open(f"{path}/config.json").read())


def build(tmp_path_factory, target, options, token_map=None):
    target_model, target_config = target
    draft_dir = make_tiny_draft(tmp_path_factory.mktemp("draft"), target_config, seed=5, **options)
    reference, info = ref_lib.DFlash2DraftModel.from_pretrained(draft_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = load_draft_model(draft_dir, target_config)
    assert isinstance(ours, DFlash2DraftModel)
    embed = target_model.get_input_embeddings().weight.detach()
    lm_head = target_model.lm_head.weight.detach()
    proposer = DFlashProposer(
        draft_dir, target_embed=embed.numpy(), target_lm_head=lm_head.numpy(), target_config=target_config,
        max_num_seqs=4, max_context_len=128, token_map=token_map,
    )
    return reference.eval(), ours, TorchDrafter(ours, embed, lm_head), proposer


def sorted_candidates(candidates: torch.Tensor, *rows: torch.Tensor):
    """Candidates [..., K] in increasing id order, with rows [..., K] aligned to them: the
    reference's top-k is unsorted, ours is best first."""
    order = candidates.argsort(-1)
    return (candidates.gather(-1, order), *(r.gather(-1, order) for r in rows))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_path_matches_reference(target, tmp_path_factory, name):
    target_model, _ = target
    reference, ours, eager, proposer = build(tmp_path_factory, target, CONFIGS[name])
    head = ref_lib._output_head(target_model)
    block = ours.block_size
    gen = torch.Generator().manual_seed(11)
    tokens = [torch.randint(3, 256, (1, n), generator=gen) for n in PROMPT_LENS]
    seq_ids = list(range(len(tokens)))
    refs = []
    for seq, ids in zip(seq_ids, tokens):
        features = context_features(target_model, ids, ours.target_layer_ids)
        refs.append(ReferenceDrafter(reference, target_model, block, features))
        eager.add(seq, features)
        proposer.add(seq, features.numpy())
    bonus = [int(b) for b in torch.randint(3, 256, (len(seq_ids),), generator=gen)]

    selector_changed_a_draft = False
    for step in range(NUM_STEPS):
        jax_path = proposer.propose_path(seq_ids, bonus)
        assert jax_path.probs is None and jax_path.tokens.shape == (len(seq_ids), block - 1)
        counts, rows = [], []
        for seq in seq_ids:
            ref_hidden, ref_logits = refs[seq].draft(bonus[seq])
            with torch.inference_mode():
                ref_path, ref_candidates, _ = reference.propose(ref_hidden[None], torch.tensor([bonus[seq]]), head, 0.0)
                our_hidden = eager.draft(seq, bonus[seq])[1:]
                our_path, our_candidates, _ = ours.propose(our_hidden[None], torch.tensor([bonus[seq]]), head.weight)
            torch.testing.assert_close(our_hidden, ref_hidden, atol=1e-5, rtol=0)
            ref_sorted = sorted_candidates(ref_candidates)[0]
            assert torch.equal(sorted_candidates(our_candidates)[0], ref_sorted)
            assert np.array_equal(sorted_candidates(torch.from_numpy(np.array(jax_path.candidates[seq])).long())[0], ref_sorted[0])
            assert torch.equal(our_path, ref_path) and np.array_equal(jax_path.tokens[seq], ref_path[0].numpy())
            selector_changed_a_draft |= not torch.equal(ref_path[0], ref_logits.argmax(-1))

            accepted = accepted_schedule(block, seq, step)
            block_ids = torch.tensor([[bonus[seq], *ref_path[0].tolist()]])
            tokens[seq] = torch.cat([tokens[seq], block_ids[:, : accepted + 1]], dim=1)
            features = context_features(target_model, tokens[seq], ours.target_layer_ids)[-(accepted + 1):]
            refs[seq].commit(features)
            counts.append(accepted)
            rows.append(features)
        eager.commit(seq_ids, counts, rows)
        proposer.commit(seq_ids, counts, [r.numpy() for r in rows])
        bonus = [int(b) for b in torch.randint(3, 256, (len(seq_ids),), generator=gen)]
    # The path is the selector's, not the per-position argmax (else this test would prove little).
    assert selector_changed_a_draft
    # `propose` is the greedy path; TorchDrafter's too.
    assert np.array_equal(proposer.propose(seq_ids, bonus), eager.propose(seq_ids, bonus).numpy())


def test_sampled_q_matches_reference(target, tmp_path_factory, monkeypatch):
    """At T > 0 our jitted step samples a path and returns q; the reference, made to take the same
    path, computes the same q over the same candidates. A T = 0 row in the batch stays greedy."""
    target_model, _ = target
    reference, ours, eager, proposer = build(tmp_path_factory, target, CONFIGS["b8_k4"])
    head = ref_lib._output_head(target_model)
    gen = torch.Generator().manual_seed(12)
    temperatures = [1.0, 0.6, 0.0]
    refs = []
    for seq in range(len(temperatures)):
        features = context_features(target_model, torch.randint(3, 256, (1, 9 + seq), generator=gen), ours.target_layer_ids)
        refs.append(ReferenceDrafter(reference, target_model, ours.block_size, features))
        proposer.add(seq, features.numpy())
    bonus = [int(b) for b in torch.randint(3, 256, (len(temperatures),), generator=gen)]
    drafted = proposer.propose_path(list(range(len(temperatures))), bonus, temperatures=temperatures, key=jax.random.key(3))
    assert drafted.probs.shape == drafted.candidates.shape == (3, ours.block_size - 1, ours.top_k)
    np.testing.assert_allclose(drafted.probs.sum(-1), 1.0, atol=1e-6)

    for seq, temperature in enumerate(temperatures):
        ref_hidden, ref_logits = refs[seq].draft(bonus[seq])
        if temperature == 0:
            with torch.inference_mode():
                greedy = reference.propose(ref_hidden[None], torch.tensor([bonus[seq]]), head, 0.0)[0]
            assert np.array_equal(drafted.tokens[seq], greedy[0].numpy())
            on_path = drafted.candidates[seq] == drafted.tokens[seq][:, None]
            assert np.array_equal(drafted.probs[seq], on_path.astype(np.float32))  # q one-hot on the path
            continue
        # The reference draws each index with `_sample_probs`; make it pick our path's token.
        with torch.inference_mode():
            ref_logits = reference.compute_logits(ref_hidden[None], head)
        ref_candidates = ref_logits.topk(ours.top_k, dim=-1, sorted=False).indices
        picks = iter(int((ref_candidates[0, j] == int(t)).nonzero()[0, 0]) for j, t in enumerate(drafted.tokens[seq]))
        monkeypatch.setattr(ref_lib, "_sample_probs", lambda q: torch.tensor([next(picks)]))
        with torch.inference_mode():
            path, candidates, q = reference.propose(ref_hidden[None], torch.tensor([bonus[seq]]), head, temperature)
        assert np.array_equal(path[0].numpy(), drafted.tokens[seq])
        ref_ids, ref_q = sorted_candidates(candidates[0], q[0])
        our_ids, our_q = sorted_candidates(torch.from_numpy(np.array(drafted.candidates[seq])).long(), torch.from_numpy(np.array(drafted.probs[seq])))
        assert torch.equal(our_ids, ref_ids)
        torch.testing.assert_close(our_q, ref_q.float(), atol=1e-5, rtol=0)
        monkeypatch.undo()


def test_token_map_candidates_come_from_the_map(target, tmp_path_factory):
    """With a hot-token map the selector's candidates are the top-K of the mapped ids: the same
    path as the reference's when the logits of every other id are -inf."""
    target_model, _ = target
    token_map = np.sort(np.random.default_rng(8).choice(np.arange(3, 256), 40, replace=False))
    reference, ours, _, proposer = build(tmp_path_factory, target, CONFIGS["b8_k4"], token_map=token_map.tolist())
    in_map = torch.zeros(256, dtype=torch.bool)
    in_map[torch.from_numpy(token_map)] = True
    head = ref_lib._output_head(target_model)
    masked_head = lambda h: head(h).masked_fill(~in_map, float("-inf"))  # noqa: E731

    gen = torch.Generator().manual_seed(13)
    bonus = [int(token_map[3]), 200]  # an anchor outside the map is fine: codebooks cover the vocabulary
    refs = []
    for seq in range(2):
        features = context_features(target_model, torch.randint(3, 256, (1, 7 + seq), generator=gen), ours.target_layer_ids)
        refs.append(ReferenceDrafter(reference, target_model, ours.block_size, features))
        proposer.add(seq, features.numpy())
    drafted = proposer.propose_path([0, 1], bonus)
    assert np.isin(drafted.candidates, token_map).all()
    for seq in range(2):
        ref_hidden, _ = refs[seq].draft(bonus[seq])
        with torch.inference_mode():
            path, candidates, _ = reference.propose(ref_hidden[None], torch.tensor([bonus[seq]]), masked_head, 0.0)
        assert np.array_equal(drafted.tokens[seq], path[0].numpy())
        assert np.array_equal(np.sort(drafted.candidates[seq], -1), np.sort(candidates[0].numpy(), -1))
        # Unmasked, the reference's candidates leave the map: the map really restricts them.
        with torch.inference_mode():
            assert not np.isin(reference.propose(ref_hidden[None], torch.tensor([bonus[seq]]), head, 0.0)[1], token_map).all()


def test_decode_loop_matches_dflash_generate(tmp_path_factory, monkeypatch):
    """The proposer protocol (propose -> verify -> commit) in a plain greedy decode loop over the
    transformers target gives `dflash_generate`'s tokens and accepted lengths with DFlash 2. A
    16-token vocabulary with peaked distributions, so that some random drafts are accepted."""
    target_dir = make_tiny_target(tmp_path_factory.mktemp("small_vocab"), "qwen3", num_hidden_layers=3,
                                  vocab_size=16, initializer_range=0.3)
    target = (load_hf_model(target_dir), json.loads(open(f"{target_dir}/config.json").read()))
    reference, ours, _, proposer = build(tmp_path_factory, target, dict(CONFIGS["b8_k4"], target_layer_ids=[0, 1]))
    target_model = target[0]
    block, max_new = ours.block_size, 60
    prompt = torch.randint(0, 15, (1, 11), generator=torch.Generator().manual_seed(14))
    monkeypatch.setattr(ref_lib, "_cuda_time", time.perf_counter)  # its stats timer needs CUDA
    expected = ref_lib.dflash_generate(
        reference, target_model, prompt, max_new_tokens=max_new, stop_token_ids=None, return_stats=True
    )

    def target_pass(tokens):
        with torch.inference_mode():
            out = target_model(tokens, output_hidden_states=True)
        features = torch.cat([out.hidden_states[layer + 1][0] for layer in ours.target_layer_ids], dim=-1)
        return out.logits[0].argmax(-1), features

    posterior, features = target_pass(prompt)
    tokens, bonus = prompt, int(posterior[-1])
    proposer.add(0, features.numpy())
    accepted_lengths = []
    while tokens.shape[1] + block <= prompt.shape[1] + max_new:  # the reference shrinks its last blocks
        drafts = torch.tensor(proposer.propose([0], [bonus])[0]).long()
        start = tokens.shape[1]
        verify = torch.cat([tokens, torch.tensor([[bonus]]), drafts[None]], dim=1)
        posterior, features = target_pass(verify)
        accepted = int((drafts == posterior[start:-1]).int().cumprod(0).sum())
        proposer.commit([0], [accepted], [features[start : start + accepted + 1].numpy()])
        tokens, bonus = verify[:, : start + accepted + 1], int(posterior[start + accepted])
        accepted_lengths.append(accepted + 1)
    assert accepted_lengths == expected.acceptance_lengths[: len(accepted_lengths)]
    assert torch.equal(tokens[0], expected.output_ids[0, : tokens.shape[1]])
    # Random drafters rarely agree with the target; commits of every size are covered above.
    assert len(accepted_lengths) >= 4 and max(accepted_lengths) >= 2, accepted_lengths
