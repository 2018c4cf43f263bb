"""Tensor parallelism (jax_backend/sharding.py) on virtual CPU devices: tp=2 and tp=4 give the same
greedy outputs as tp=1 (NONE and DFLASH, Llama and Qwen3), compile nothing new in steady state,
and hold ~1/N of the weights and exactly 1/N of the KV pool per device; bad sizes are refused.

Virtual devices need XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts, so the
multi-device runs are subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_backend import TargetRunner, TargetConfig
from jax_backend.sharding import TensorParallelError, check_tp_size, param_spec
from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.server_args import ServerArgs
from tests.tiny_checkpoints import make_tiny_target
from tests.tiny_draft import make_tiny_draft

REPO = Path(__file__).resolve().parents[2]
# 8 query heads, 4 KV heads, 128 MLP columns, 256 vocabulary: every size divides by 4.
TP_SHAPE = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16)


def run_on_virtual_devices(script: str, num_devices: int, *args: str, timeout: float = 1200) -> dict:
    """Run `script` in a fresh Python with `num_devices` virtual CPU devices; its last stdout line
    is JSON."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count={num_devices} "
        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_targets(tmp_path_factory):
    """{arch: (target dir, drafter dir)} with head counts divisible by 4."""
    pairs = {}
    for arch in ("llama", "qwen3"):
        target = make_tiny_target(tmp_path_factory.mktemp(f"tp_{arch}"), arch, **TP_SHAPE)
        draft = make_tiny_draft(tmp_path_factory.mktemp(f"tp_{arch}_draft"), target, block_size=4,
                                target_layer_ids=[0, 1])
        pairs[arch] = (target, str(draft))
    return pairs


RUNNER_SCRIPT = """
    import json, sys
    import numpy as np
    from jax import monitoring
    from jax_backend import SeqInput, TargetRunner

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    rng = np.random.default_rng(0)
    prompt_a, prompt_b = rng.integers(0, 256, 21).tolist(), rng.integers(0, 256, 6).tolist()
    out = {}
    for name, tp, loop in (("1", 1, "scan"), ("2", 2, "scan"), ("2-switch", 2, "switch")):
        # (greedy_head=False: the one-device runner's bfloat16 head copy would not be in the tp ones' weights)
        runner = TargetRunner(sys.argv[1], page_size=8, max_total_tokens=256, max_num_seqs=4, aux_layer_ids=(0, 1),
                              tp_size=tp, layer_loop=loop, greedy_head=False)
        a, b = runner.allocator.allocate("a", 40), runner.allocator.allocate("b", 40)
        fwd = runner.forward([SeqInput(prompt_a, 0, a, "all"), SeqInput(prompt_b, 0, b)])

        def decode_and_verify(pos_a, pos_b):
            tokens = runner.sample([SeqInput([5], pos_a, a), SeqInput([9], pos_b, b)], [0, 0], [1, 1], [0, 0]).tokens
            ver = runner.verify([SeqInput([3, 4, 5, 6], pos_a + 1, a, "all"), SeqInput([7, 8, 9, 1], pos_b + 1, b, "all")])
            return tokens.tolist(), ver.accepted.tolist(), ver.bonus.tolist(), np.asarray(ver.features).tolist()

        first = decode_and_verify(21, 6)
        before = len(compiles)
        second = decode_and_verify(26, 11)  # same shapes, later positions: nothing to compile
        out[name] = dict(logits=[l.tolist() for l in fwd.logits], first=first, second=second,
                       new_compiles=len(compiles) - before, memory=runner.memory_per_device(),
                       pool_spec=list(runner.kv_pool.sharding.spec)[:4] if tp > 1 else None)
    print(json.dumps(out))
"""


def test_runner_tp2_matches_tp1_and_halves_memory(tp_targets):
    out = run_on_virtual_devices(RUNNER_SCRIPT, 2, tp_targets["qwen3"][0])
    one, two = out["1"], out["2"]
    for other in (two, out["2-switch"]):  # the switch layer loop's per-layer weights shard alike
        for l1, l2 in zip(one["logits"], other["logits"]):  # row-parallel sums: float rounding only
            np.testing.assert_allclose(l1, l2, rtol=0, atol=1e-4)
        for run in ("first", "second"):
            assert one[run][:3] == other[run][:3]  # sampled tokens, accepted counts, bonus tokens
            np.testing.assert_allclose(one[run][3], other[run][3], atol=1e-4)  # drafter features
        assert other["new_compiles"] == 0
    assert one["new_compiles"] == 0
    assert two["pool_spec"] == [None, None, None, "tp"]  # the combined K/V head axis
    (kv,) = one["memory"]["kv"].values()
    (weights,) = one["memory"]["weights"].values()
    assert sorted(two["memory"]["kv"].values()) == [kv // 2, kv // 2]
    for per_device in two["memory"]["weights"].values():  # only the norms are replicated
        assert weights / 2 <= per_device < 0.51 * weights
    switched = out["2-switch"]["memory"]["weights"]  # the stack and its per-layer copies, sharded alike
    assert sorted(switched) == sorted(two["memory"]["weights"])
    assert all(0.51 * weights < switched[d] < weights for d in switched)


ENGINE_SCRIPT = """
    import json, sys
    import numpy as np
    from jax import monitoring
    from sgl_dflash.entrypoints.engine import Engine

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    pairs = json.loads(sys.argv[1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (29, 7, 16)]
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    sampled = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 8, "ignore_eos": True}
    results = []
    for arch, (target, draft) in pairs.items():
        for algorithm in ("NONE", "DFLASH"):
            extra = {} if algorithm == "NONE" else dict(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
            for tp in (1, 2, 4):
                engine = Engine(model_path=target, skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=4,
                                context_length=256, random_seed=0, tp_size=tp, **extra)
                runs = []
                for _ in range(2):  # the second round runs the same shapes: steady state
                    before = len(compiles)
                    outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
                    engine.generate(input_ids=prompts[:2], sampling_params=sampled)
                    runs.append(([o["output_ids"] for o in outputs], len(compiles) - before))
                worker = engine.scheduler.worker
                proposer = getattr(worker, "proposer", None)
                head = worker.runner.params.get("greedy_head") or ()  # one device only (the CPU matmul kernel)
                results.append(dict(
                    arch=arch, algorithm=algorithm, tp=tp, outputs=runs[0][0], again=runs[1][0],
                    steady_compiles=runs[1][1], memory=worker.runner.memory_per_device(),
                    greedy_head_bytes=sum(int(x.nbytes) for x in head),
                    drafter_devices=None if proposer is None else len(proposer.k_cache[0].sharding.device_set),
                    drafter_replicated=None if proposer is None else proposer.k_cache[0].sharding.is_fully_replicated))
    print(json.dumps(results))
"""


@pytest.mark.slow
def test_engine_tp2_tp4_greedy_outputs_equal_tp1(tp_targets):
    results = run_on_virtual_devices(ENGINE_SCRIPT, 4, json.dumps(tp_targets))
    by_key = {(r["arch"], r["algorithm"], r["tp"]): r for r in results}
    for arch in ("llama", "qwen3"):
        for algorithm in ("NONE", "DFLASH"):
            ref = by_key[(arch, algorithm, 1)]
            assert all(len(ids) == 24 for ids in ref["outputs"])
            (kv,) = ref["memory"]["kv"].values()
            (weights,) = ref["memory"]["weights"].values()
            weights -= ref["greedy_head_bytes"]  # tp 1 may hold the greedy head's copy (AMX); tp > 1 never
            for tp in (1, 2, 4):
                run = by_key[(arch, algorithm, tp)]
                assert run["outputs"] == ref["outputs"], (arch, algorithm, tp)
                assert run["again"] == ref["outputs"]
                assert run["steady_compiles"] == 0, (arch, algorithm, tp)
                assert sorted(run["memory"]["kv"].values()) == [kv // tp] * tp
                assert all(weights / tp <= w < 1.05 * weights / tp for w in run["memory"]["weights"].values())
                if algorithm == "DFLASH":  # the drafter is replicated over the target's devices
                    assert run["drafter_devices"] == tp and run["drafter_replicated"]


MULTIHOST_SCRIPT = """
    import json, sys
    import numpy as np
    from sgl_dflash.entrypoints.engine import Engine

    target, draft, rank, nnodes, address = sys.argv[1:6]
    distributed = {} if nnodes == "1" else dict(nnodes=int(nnodes), node_rank=int(rank), dist_init_addr=address)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, n).tolist() for n in (29, 7, 16)]
    outputs = {}
    for algorithm in ("NONE", "DFLASH"):
        extra = {} if algorithm == "NONE" else dict(speculative_algorithm="DFLASH", speculative_draft_model_path=draft)
        engine = Engine(model_path=target, skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=4,
                        context_length=256, random_seed=0, tp_size=int(nnodes), **distributed, **extra)
        outputs[algorithm] = [o["output_ids"] for o in engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True})]
    print(json.dumps(outputs))
"""


@pytest.mark.slow
def test_tp2_across_two_processes_matches_tp1(tp_targets):
    """Multi-host tensor parallel, rehearsed on one machine: two processes with one CPU device each
    join through jax.distributed (Engine's nnodes / node_rank / dist_init_addr; gloo collectives)
    and run the same Engine calls; the mesh spans both processes."""
    from tests.server_harness import free_port

    target, draft = tp_targets["qwen3"]
    expected = run_on_virtual_devices(MULTIHOST_SCRIPT, 1, target, draft, "0", "1", "")
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(MULTIHOST_SCRIPT), target, draft, str(rank), "2",
                               address], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    for process in ranks:
        stdout, stderr = process.communicate(timeout=900)
        assert process.returncode == 0, stderr[-4000:]
        assert json.loads(stdout.strip().splitlines()[-1]) == expected


# -- refusals (in process, one device) --------------------------------------------------------
def test_tp_sizes_that_do_not_divide_the_heads_are_refused(tp_targets, tiny_qwen3_dir):
    config = TargetConfig.from_file(Path(tp_targets["qwen3"][0]) / "config.json")
    with pytest.raises(TensorParallelError, match="does not divide the target's num_key_value_heads"):
        check_tp_size(config, 3)
    with pytest.raises(TensorParallelError, match="needs 4 devices, but JAX sees 1"):
        check_tp_size(config, 4)
    with pytest.raises(TensorParallelError, match="needs 4 devices"):
        TargetRunner(tp_targets["qwen3"][0], max_total_tokens=64, tp_size=4)
    # The default tiny target has 2 KV heads: tp=4 is refused before anything is loaded.
    with pytest.raises(ServerArgsError, match="--tp-size 4 does not divide the target's num_key_value_heads"):
        ServerArgs(model_path=tiny_qwen3_dir, tp_size=4).check()
    with pytest.raises(ServerArgsError, match="--tp-size must be an integer >= 1"):
        ServerArgs(model_path=tiny_qwen3_dir, tp_size=0).check()
    # Multi-host arguments (Engine only) are checked before jax.distributed is touched.
    with pytest.raises(ServerArgsError, match="nnodes > 1 needs dist_init_addr"):
        ServerArgs(model_path=tiny_qwen3_dir, nnodes=2).check()
    with pytest.raises(ServerArgsError, match="node_rank 2 must be < nnodes 2"):
        ServerArgs(model_path=tiny_qwen3_dir, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234").check()
    with pytest.raises(ServerArgsError, match="nnodes must be an integer >= 1"):
        Engine(model_path=tiny_qwen3_dir, nnodes=0)


def test_megatron_partition_specs():
    assert param_spec("q_proj", 3, True) == param_spec("gate_proj", 3, True)  # column-parallel
    assert param_spec("k_proj", 3, True) == P(None, None, "tp")
    assert param_spec("o_proj", 3, True) == P(None, "tp", None)  # row-parallel
    assert param_spec("down_proj", 2, True) == P("tp", None)  # an unrolled layer's weight
    assert param_spec("embed", 2, True) == P("tp", None)  # vocabulary-parallel
    assert param_spec("lm_head", 2, False) == P(None, None)  # V not divisible: replicated
    assert param_spec("input_norm", 2, True) == P(None, None)
    with pytest.raises(TensorParallelError, match="fused"):
        param_spec("qkv_proj", 3, True)
