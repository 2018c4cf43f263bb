"""The DFlash 2 selector loss: gold insertion, its value, its gradient, and its tie to serving."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tiny_draft import DFLASH2_TINY, single_torch_thread  # noqa: F401
from torchax_proposer import DFlash2DraftModel, DFlashConfig
from torchax_proposer.selector_loss import selector_loss, teacher_forced_predecessors, training_candidates

VOCAB, HIDDEN = 32, 16


def tiny_config(top_k=4) -> DFlashConfig:
    return DFlashConfig.from_dict({
        "architectures": ["DFlash2DraftModel"], "hidden_size": HIDDEN, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
        "vocab_size": VOCAB, "num_target_layers": 4,
        "dflash_config": {"mask_token_id": VOCAB - 1, "block_size": 4, "target_layer_ids": [1],
                          **dict(DFLASH2_TINY, conv_group_size=8, selector_top_k=top_k)},
    })


@pytest.fixture
def selector():
    torch.manual_seed(0)
    model = DFlash2DraftModel(tiny_config())
    with torch.no_grad():  # a trained-looking selector: every factor non-zero
        model.candidate_selector.successor_codebook.normal_()
        model.candidate_selector.predecessor_codebook.normal_()
    return model.candidate_selector


def test_gold_inserted_when_missing():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0, -1.0]] * 2)
    candidates, unary, gold_index, in_top_k = training_candidates(logits, torch.tensor([3, 6]), top_k=3)
    # Gold 3 is the third best: kept where it is. Gold 6 is missing: it replaces the weakest.
    assert candidates.tolist() == [[1, 2, 3], [1, 2, 6]]
    assert unary.tolist() == [[5.0, 4.0, 3.0], [5.0, 4.0, -1.0]]  # the inserted gold keeps its logit
    assert gold_index.tolist() == [2, 2] and in_top_k.tolist() == [True, False]


def test_teacher_forced_predecessors():
    labels = torch.tensor([[11, 12, 13], [21, 22, 23]])
    assert teacher_forced_predecessors(torch.tensor([10, 20]), labels).tolist() == [[10, 11, 12], [20, 21, 22]]


def test_value_is_the_weighted_k_way_cross_entropy(selector):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, HIDDEN, generator=gen)
    logits = torch.randn(2, 3, VOCAB, generator=gen) * 3
    predecessors = torch.randint(0, VOCAB, (2, 3), generator=gen)
    gold = torch.randint(0, VOCAB, (2, 3), generator=gen)
    gold[0, 0] = logits[0, 0].argmax()  # at least one gold inside the top-K
    weights = torch.tensor([[1.0, 0.5, 0.0], [0.25, 1.0, 1.0]])
    loss, stats = selector_loss(selector, hidden, logits, predecessors, gold, weights, alpha=0.3)

    # Position by position, straight from the definition.
    with torch.no_grad():
        expected, total = by_definition(selector, hidden, logits, predecessors, gold, weights)
    assert stats["selector_loss"] == pytest.approx(expected / total, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(0.3 * expected / total, rel=1e-5)
    assert 0 < stats["recall"] < 1


def by_definition(selector, hidden, logits, predecessors, gold, weights):
    total, expected = 0.0, 0.0
    for i in range(2):
        for j in range(3):
            top = logits[i, j].topk(selector.top_k).indices.tolist()
            if int(gold[i, j]) not in top:
                top[-1] = int(gold[i, j])
            context = selector.predecessor_codebook[predecessors[i, j]] * selector.hidden_projection(hidden[i, j])
            scores = [float(logits[i, j, c] + context @ selector.successor_codebook[c]) for c in top]
            ce = math.log(sum(math.exp(s) for s in scores)) - scores[top.index(int(gold[i, j]))]
            expected += float(weights[i, j]) * ce
            total += float(weights[i, j])
    return expected, total


def test_training_the_selector_learns_a_bigram(selector):
    """Flat unary logits and a gold that depends only on the predecessor: only the codebooks can
    tell, and a few optimizer steps on this loss teach them."""
    gen = torch.Generator().manual_seed(2)
    predecessors = torch.randint(0, VOCAB, (256,), generator=gen)
    gold = (predecessors * 7 + 3) % VOCAB
    logits = 0.01 * torch.randn(256, VOCAB, generator=gen)
    logits.scatter_(1, gold[:, None], 0.02)  # gold inside the (near-random) top-K: a K-way choice
    hidden = torch.randn(256, HIDDEN, generator=gen)
    weights = torch.ones(256)
    optimizer = torch.optim.Adam(selector.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss, stats = selector_loss(selector, hidden, logits, predecessors, gold, weights)
        first = first or stats
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first["accuracy"] < 0.6 and stats["accuracy"] > 0.95
    assert stats["selector_loss"] < 0.5 * first["selector_loss"]


def test_teacher_forced_on_its_own_greedy_path_the_selector_picks_every_gold(selector):
    """The loss scores candidates exactly as serving walks them: with the greedy path as gold
    (and so as predecessors), every position's best-scored candidate is the gold."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, HIDDEN, generator=gen)
    logits = torch.randn(3, 5, VOCAB, generator=gen)
    anchors = torch.tensor([1, 2, 3])
    with torch.no_grad():
        path, _, _ = selector(hidden, logits, anchors)
        _, stats = selector_loss(
            selector, hidden, logits, teacher_forced_predecessors(anchors, path), path, torch.ones(3, 5)
        )
    assert stats["recall"] == 1.0 and stats["accuracy"] == 1.0
    assert stats["unary_accuracy"] < 1.0  # the path is not the plain argmax here
