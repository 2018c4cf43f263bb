"""`python -m sgl_dflash.launch_server --model-path DIR [...]`: SGLang's launcher, same flags.

Invalid flags or combinations (e.g. DFLASH without a draft model, a draft that does not fit the
target) are refused before anything is served: a one-line message on stderr and exit status 2.
Scale-out (docs/scale.md): `--tp-size N` shards the target over N devices; `--dp-size N` starts N
servers behind sglang-router on --host/--port (entrypoints/data_parallel.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_dflash.server_args import ServerArgs


def parse_cli_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_dflash.launch_server",
        description="Serve a model with DFlash speculative decoding over SGLang's HTTP API.",
    )
    ServerArgs.add_cli_args(parser)
    known, _ = parser.parse_known_args(argv)
    if known.dp_size > 1:  # data parallel: sglang-router's `--router-*` flags join in
        from sgl_dflash.entrypoints.data_parallel import add_router_cli_args

        try:
            add_router_cli_args(parser)
        except ImportError as e:
            parser.error(f"--dp-size {known.dp_size} runs replicas behind sglang-router, which is not "
                         f"installed ({e}): pip install sglang-router==0.3.2")
    return parser.parse_args(argv)


def prepare_server_args(argv: list[str]) -> ServerArgs:
    return ServerArgs.from_cli_args(parse_cli_args(argv))


def main(argv: list[str] | None = None) -> int:
    cli_args = parse_cli_args(sys.argv[1:] if argv is None else argv)
    server_args = ServerArgs.from_cli_args(cli_args)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="[%(asctime)s %(name)s] %(levelname)s %(message)s",
    )
    if server_args.dp_size > 1:  # N replicas of this server behind sglang-router
        from sgl_dflash.entrypoints.data_parallel import launch_data_parallel

        try:
            server_args.check()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return launch_data_parallel(server_args, cli_args)
    from sgl_dflash.entrypoints.http_server import launch_server
    from sgl_dflash.managers.tokenizer_manager import TokenizerManager

    try:
        server_args.check()
        tokenizer_manager = TokenizerManager(server_args)  # loads target, drafter, tokenizer
    except ValueError as e:  # ServerArgsError, checkpoint and tokenizer errors all subclass it
        print(f"error: {e}", file=sys.stderr)
        return 2
    launch_server(server_args, tokenizer_manager)
    return 0


if __name__ == "__main__":
    sys.exit(main())
