"""HTTP serving: SGLang's native API and the OpenAI-compatible API over the scheduler."""

from sgl_dflash.server.http_server import create_app, launch_server
from sgl_dflash.server.tokenizer_manager import TokenizerManager

__all__ = ["TokenizerManager", "create_app", "launch_server"]
