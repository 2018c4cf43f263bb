"""Entry points other frameworks call: SGLang's platform and general plugins, which let
`python -m sglang.launch_server` drive our workers (docs/sglang.md)."""
