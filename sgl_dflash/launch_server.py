"""`python -m sgl_dflash.launch_server --model-path DIR [...]`: SGLang's launcher, same flags.

Invalid flags or combinations (e.g. DFLASH without a draft model, a draft that does not fit the
target) are refused before anything is served: a one-line message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_dflash.server_args import ServerArgs


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_dflash.launch_server",
        description="Serve a model with DFlash speculative decoding over SGLang's HTTP API.",
    )
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="[%(asctime)s %(name)s] %(levelname)s %(message)s",
    )
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
