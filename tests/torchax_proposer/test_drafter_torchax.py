"""The same DFlashDraftModel in torch eager and lowered through torchax into jax.jit."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_backend import cpu_kernels
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft, single_torch_thread  # noqa: F401
from torchax_proposer import load_draft_model
from torchax_proposer import cpu_lowering
from torchax_proposer.cpu_lowering import _few_row_linear
from torchax_proposer.jax_drafter import call_model, model_params
from torchax_proposer.model import attend

TARGET = dict(hidden_size=64, vocab_size=256, num_hidden_layers=4)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target_dir = make_tiny_target(tmp_path_factory.mktemp("target"), "qwen3", num_hidden_layers=4)
    # GQA, and a sliding (causal) second layer so both mask kinds are lowered.
    draft_dir = make_tiny_draft(
        tmp_path_factory.mktemp("draft"), target_dir, num_layers=2, block_size=8, target_layer_ids=[0, 2],
        use_sliding_window=True, sliding_window=5, layer_types=["full_attention", "sliding_attention"],
    )
    return load_draft_model(draft_dir, TARGET)


def padded_inputs(model, seed=0):
    """A batch of 3 sequences with different cached / new context lengths, padded to one shape."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    past_lens, new_lens = [12, 0, 7], [3, 8, 1]
    batch, past, new, block = 3, 12, 8, 8
    # Padding rows hold large garbage: a mask that leaks would show.
    past_kv = [
        (10 * torch.randn(batch, past, config.num_key_value_heads, config.head_dim, generator=gen),
         10 * torch.randn(batch, past, config.num_key_value_heads, config.head_dim, generator=gen))
        for _ in model.layers
    ]
    features = 10 * torch.randn(batch, new, config.num_context_features, generator=gen)
    context_positions = torch.tensor(past_lens)[:, None] + torch.arange(new)[None]
    block_positions = torch.tensor([p + n for p, n in zip(past_lens, new_lens)])[:, None] + torch.arange(block)[None]
    key_valid = torch.cat(
        [torch.arange(past)[None] < torch.tensor(past_lens)[:, None], torch.arange(new)[None] < torch.tensor(new_lens)[:, None]], 1
    )
    noise = torch.randn(batch, block, config.hidden_size, generator=gen)
    return dict(
        context_features=features, context_positions=context_positions, noise_embedding=noise,
        block_positions=block_positions, past_kv=past_kv, key_valid=key_valid,
    ), past_lens, new_lens


def test_eager_equals_torchax_jit(drafter):
    inputs, _, _ = padded_inputs(drafter)
    with torch.inference_mode():
        hidden, new_kv = drafter(**inputs)

    def forward(params, kwargs):
        return call_model(drafter, params, **kwargs)

    as_jax = jax.tree_util.tree_map(lambda t: jnp.asarray(t.numpy()), inputs)
    jax_hidden, jax_new_kv = jax.jit(forward)(model_params(drafter), as_jax)
    np.testing.assert_allclose(np.asarray(jax_hidden), hidden.numpy(), atol=1e-5, rtol=0)
    for (k, v), (jk, jv) in zip(new_kv, jax_new_kv):
        np.testing.assert_allclose(np.asarray(jk), k.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(jv), v.numpy(), atol=1e-5, rtol=0)


def test_stacked_projections_are_one_product_each_with_the_same_outputs(drafter):
    """`stack_projections`: each layer's q/k/v and gate/up, and every layer's context k/v, run as
    one product each: the same outputs (the kernel's bits: each output is the same dot product),
    fewer kernel calls, and the params hold the stacks instead of the weights they replace."""
    assert cpu_kernels.available()
    inputs, _, _ = padded_inputs(drafter, seed=2)
    stacked = copy.deepcopy(drafter)
    params = {"plain": model_params(drafter), "stacked": model_params(stacked, stacked=True)}
    layers = len(drafter.layers)
    assert set(params["plain"]) - set(params["stacked"]) == {
        f"layers.{i}.{name}.weight" for i in range(layers)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert set(params["stacked"]) - set(params["plain"]) == {"context_kv_stack"} | {
        f"layers.{i}.{name}" for i in range(layers) for name in ("self_attn.qkv_stack", "mlp.gate_up_stack")}
    with torch.inference_mode():  # torch eager: stacked or not, the same outputs
        (hidden, new_kv), (s_hidden, s_new_kv) = drafter(**inputs), stacked(**inputs)
    np.testing.assert_allclose(s_hidden.numpy(), hidden.numpy(), atol=1e-5, rtol=0)
    for (k, v), (sk, sv) in zip(new_kv, s_new_kv):
        np.testing.assert_allclose(sk.numpy(), k.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(sv.numpy(), v.numpy(), atol=1e-5, rtol=0)
    as_jax = jax.tree_util.tree_map(lambda t: jnp.asarray(t.numpy()), inputs)
    outputs, calls = {}, {}
    for name, model in (("plain", drafter), ("stacked", stacked)):
        calls[name] = 0

        def kernel(x, w, name=name):
            calls[name] += 1
            return cpu_kernels.rows_matmul(x, w)

        def forward(p, kwargs, model=model, kernel=kernel):
            with cpu_lowering.few_row_matmul(kernel):
                return call_model(model, p, **kwargs)

        outputs[name] = jax.jit(forward)(params[name], as_jax)
    # fc, 2 context k/v per layer, then q, k, v, o, gate, up, down per layer; stacked: 1 + 1 + 4 per layer
    assert calls == {"plain": 1 + 2 * layers + 7 * layers, "stacked": 2 + 4 * layers}
    for a, b in zip(jax.tree.leaves(outputs["plain"]), jax.tree.leaves(outputs["stacked"])):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_padded_batch_equals_each_sequence_alone(drafter):
    """Masks: padded rows (past or new) change nothing; each row equals its unpadded run."""
    inputs, past_lens, new_lens = padded_inputs(drafter, seed=1)
    with torch.inference_mode():
        hidden, new_kv = drafter(**inputs)
        for i, (past, new) in enumerate(zip(past_lens, new_lens)):
            alone, alone_kv = drafter(
                inputs["context_features"][i : i + 1, :new],
                inputs["context_positions"][i : i + 1, :new],
                noise_embedding=inputs["noise_embedding"][i : i + 1],
                block_positions=inputs["block_positions"][i : i + 1],
                past_kv=[(k[i : i + 1, :past], v[i : i + 1, :past]) for k, v in inputs["past_kv"]],
            )
            torch.testing.assert_close(hidden[i], alone[0], atol=1e-5, rtol=0)
            for (k, v), (ak, av) in zip(new_kv, alone_kv):
                torch.testing.assert_close(k[i, :new], ak[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(v[i, :new], av[0], atol=1e-5, rtol=0)


def test_context_split_does_not_matter(drafter):
    """Context K/V computed in one pass or in pieces (then passed back as past) give the same draft."""
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 20, drafter.config.num_context_features, generator=gen)
    noise = torch.randn(1, 8, drafter.config.hidden_size, generator=gen)
    positions = torch.arange(28)[None]
    with torch.inference_mode():
        whole, _ = drafter(features, positions[:, :20], noise_embedding=noise, block_positions=positions[:, 20:])
        _, first_kv = drafter(features[:, :13], positions[:, :13])
        split, _ = drafter(
            features[:, 13:], positions[:, 13:20], noise_embedding=noise, block_positions=positions[:, 20:], past_kv=first_kv
        )
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_rows", [1, 4])
def test_attend_is_grouped_query_sdpa_over_the_joined_segments(mask_rows):
    """`attend` (query groups folded into rows, K/V never repeated) is torch's enable_gqa SDPA
    over the concatenated segments, in torch eager and through torchax: query head j reads kv
    head j // groups, one softmax spans every segment, masked keys get no weight."""
    gen = torch.Generator().manual_seed(0)
    n, length, heads, kv_heads, dim = 2, 4, 6, 2, 8
    q = torch.randn(n, length, heads, dim, generator=gen)
    segments = [(torch.randn(n, t, kv_heads, dim, generator=gen), torch.randn(n, t, kv_heads, dim, generator=gen))
                for t in (5, 0, 4)]
    mask = torch.rand(n, 1, mask_rows, 9, generator=gen) > 0.3
    mask[..., -1] = True  # every query row sees at least one key
    keys, values = (torch.cat([s[i] for s in segments], 1).transpose(1, 2) for i in (0, 1))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=0.3, enable_gqa=True).transpose(1, 2)

    torch.testing.assert_close(attend(q, segments, mask, 0.3), expected, atol=1e-6, rtol=0)
    as_jax = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    lowered = jax.jit(lowered_attend)(as_jax(q), [(as_jax(k), as_jax(v)) for k, v in segments], as_jax(mask))
    np.testing.assert_allclose(np.asarray(lowered), expected.numpy(), atol=1e-5, rtol=0)
    # The drafter's own CPU lowering (`_keys_first_attention`, scores computed as keys @ queries.T)
    cpu = jax.jit(lambda *a: lowered_attend(*a, env=cpu_lowering.lowering))(
        as_jax(q), [(as_jax(k), as_jax(v)) for k, v in segments], as_jax(mask))
    np.testing.assert_allclose(np.asarray(cpu), expected.numpy(), atol=1e-5, rtol=0)
    wrong = torch.nn.functional.scaled_dot_product_attention(  # kv head j % kv_heads: must differ
        q.transpose(1, 2), keys.repeat(1, heads // kv_heads, 1, 1), values.repeat(1, heads // kv_heads, 1, 1),
        attn_mask=mask, scale=0.3).transpose(1, 2)
    assert not torch.allclose(attend(q, segments, mask, 0.3), wrong, atol=1e-3)


def lowered_attend(q, segments, mask, env=None):
    """`attend(q, segments, mask, 0.3)` on jax values inside a trace, through torchax (its own
    lowering, or the environment `env()` enters)."""
    import torchax
    from torchax.interop import jax_view, torch_view

    with (env or torchax.default_env)():
        return jax_view(attend(torch_view(q), torch_view(segments), torch_view(mask), 0.3))


def test_few_row_projections_run_weight_first_on_a_cpu_and_torchax_is_left_as_it_was(drafter, monkeypatch):
    """On a CPU every nn.Linear of at most FEW_ROWS rows lowers to (W @ x.T).T behind an
    optimization barrier (XLA:CPU reads the weight faster as the dot's left operand; same values,
    `test_eager_equals_torchax_jit`); wider inputs keep x @ W.T; torchax's own lowering of
    F.linear is back once the drafter's trace is done."""
    import torchax

    env = torchax.default_env()
    before = env._ops[torch.nn.functional.linear]
    inputs, _, _ = padded_inputs(drafter)
    as_jax = jax.tree_util.tree_map(lambda t: jnp.asarray(t.numpy()), inputs)
    params = model_params(drafter)
    calls = []  # the F.linear calls the trace lowers (some modules run twice: context and block rows)
    monkeypatch.setattr(cpu_lowering, "_few_row_linear", lambda x, w, b=None: calls.append(x.shape) or _few_row_linear(x, w, b))
    few = jax.make_jaxpr(lambda p, kw: call_model(drafter, p, **kw))(params, as_jax)
    assert len(calls) >= sum(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    assert str(few).count("optimization_barrier") == len(calls)  # 3 sequences x 8 rows: all weight-first
    assert env._ops[torch.nn.functional.linear] is before
    wide = jax.tree_util.tree_map(lambda x: jnp.concatenate([x] * 3) if x.ndim else x, as_jax)  # 9 x 8 rows
    assert "optimization_barrier" not in str(jax.make_jaxpr(lambda p, kw: call_model(drafter, p, **kw))(params, wide))
    x, w, b = (jnp.asarray(np.random.default_rng(0).standard_normal(s), jnp.float32) for s in ((2, 5, 16), (24, 16), (24,)))
    np.testing.assert_allclose(np.asarray(_few_row_linear(x, w, b)), np.asarray(x @ w.T + b), atol=1e-5, rtol=0)


def test_keys_first_attention_is_torch_sdpa():
    """The drafter's CPU lowering of F.scaled_dot_product_attention equals torch's, with a
    boolean mask, a float mask and none, and refuses what the drafter never asks for."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, length, 8, generator=gen) for length in (4, 11, 11))
    masks = [None, torch.rand(2, 1, 4, 11, generator=gen) > 0.3, torch.randn(2, 1, 1, 11, generator=gen)]
    masks[1][..., 0] = True
    for mask in masks:
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4)
        got = cpu_lowering._keys_first_attention(*(jnp.asarray(t.numpy()) for t in (q, k, v)),
                                                None if mask is None else jnp.asarray(mask.numpy()), scale=0.4)
        np.testing.assert_allclose(np.asarray(got), expected.numpy(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="is_causal"):
        cpu_lowering._keys_first_attention(jnp.asarray(q.numpy()), jnp.asarray(k.numpy()), jnp.asarray(v.numpy()),
                                          is_causal=True)
