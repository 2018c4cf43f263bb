"""Entry points other frameworks call (the SGLang plugin)."""
