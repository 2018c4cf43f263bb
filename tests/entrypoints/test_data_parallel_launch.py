"""How `launch_server --dp-size N` builds its replicas and its router, without starting them:
each replica's flags recreate the launcher's arguments on its own loopback port, replica i gets its
own tp_size GPUs (SGLang's base_gpu_id = i * tp_size), and the `--router-*` flags reach
sglang-router's RouterArgs. The processes themselves: tests/entrypoints/test_data_parallel.py."""

from __future__ import annotations

import dataclasses

from sgl_dflash.entrypoints.data_parallel import REPLICA_HOST, replica_argv, replica_env
from sgl_dflash.launch_server import parse_cli_args, prepare_server_args
from sgl_dflash.server_args import ServerArgs


def test_replica_flags_recreate_the_launchers_arguments():
    launcher = prepare_server_args([
        "--model-path", "/models/target", "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", "/models/draft", "--speculative-num-draft-tokens", "8",
        "--max-total-tokens", "4096", "--skip-tokenizer-init", "--tp-size", "2", "--dp-size", "3",
        "--api-key", "secret", "--host", "0.0.0.0", "--port", "30000"])
    argv = replica_argv(launcher, 41234)
    replica = prepare_server_args(argv)
    assert "--dp-size" not in argv  # a replica is one server
    assert (replica.host, replica.port, replica.dp_size) == (REPLICA_HOST, 41234, 1)
    expected = dataclasses.replace(launcher, host=REPLICA_HOST, port=41234, dp_size=1)
    assert replica == expected  # every other field, the flags and the api key included
    assert prepare_server_args(replica_argv(ServerArgs(model_path="/m"), 1)) == ServerArgs(
        model_path="/m", host=REPLICA_HOST, port=1)


def test_each_replica_sees_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [replica_env(i, 2)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["0,1", "2,3", "4,5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # within the launcher's own GPUs
    assert [replica_env(i, 1)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["4", "5", "6", "7"]
    assert replica_env(1, 2)["CUDA_VISIBLE_DEVICES"] == "6,7"
    # More replicas than visible GPUs: the variable is left as it is (CPU / TPU hosts ignore it).
    assert replica_env(2, 2)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_router_flags_reach_sglang_router():
    from sglang_router.router_args import RouterArgs

    cli = parse_cli_args(["--model-path", "/m", "--dp-size", "2", "--router-policy", "round_robin",
                          "--router-retry-max-retries", "7"])
    router = RouterArgs.from_cli_args(cli, use_router_prefix=True)
    assert (router.policy, router.retry_max_retries) == ("round_robin", 7)
