"""The README's main command (`python -m sgl_dflash.demo`): SmolLM2-135M-Instruct served with the
shipped DFlash drafter, greedy DFLASH equal to greedy NONE on the real model pair."""

from __future__ import annotations

import json

import pytest

from sgl_dflash.tools import demo

pytestmark = pytest.mark.slow  # long end-to-end: not in the fast lane (scripts/test.sh --fast)


def test_demo_serves_smollm2_with_the_shipped_drafter_losslessly(tmp_path, capsys):
    out = tmp_path / "demo.json"
    summary = demo.main(["--questions", "What is 12 times 7?", "Write a Python function that adds two numbers.",
                         "--max-new-tokens", "24", "--json", str(out)])
    assert summary["drafter"] == str(demo.DEFAULT_DRAFTER)
    assert summary["model"].endswith("SmolLM2-135M-Instruct")
    own = json.loads((demo.DEFAULT_DRAFTER / "config.json").read_text())["block_size"]
    assert summary["block_size"] == own
    assert summary["token_map"] == str(demo.DEFAULT_DRAFTER / "token_map.json")
    assert summary["outputs_identical"] is True
    assert summary["tau"] >= 1.0 and summary["none_tokens_per_s"] > 0
    assert json.loads(out.read_text()) == summary
    assert "identical to NONE: True" in capsys.readouterr().out


def test_demo_needs_a_drafter_for_another_target(tmp_path):
    with pytest.raises(SystemExit):
        demo.main(["--model-path", str(tmp_path)])


def test_readme_engine_example_runs(monkeypatch, capsys):
    """The README's offline-engine example, run as written from the repository root."""
    from sgl_dflash import tools
    from sgl_dflash.tools import model_import

    model_import.ensure_default_model()  # the example's model_path: the converted default target
    code = (tools.REPO_ROOT / "README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert "sgl_dflash.Engine(" in code
    monkeypatch.chdir(tools.REPO_ROOT)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    # No flag: the drafter's config.json names its hot-token map, and the engine drafts over it.
    assert namespace["engine"].server_args.speculative_token_map.endswith("smollm2-135m-dflash/token_map.json")
    # Its narrow draft steps read the target's Q8_0 head blocks and the bf16 checkpoint's projections as bfloat16.
    proposer = namespace["engine"].scheduler.worker.proposer
    assert type(proposer.narrow_head).__name__ == "BlockWeights" and proposer.narrow_head.codes.shape[0] == 8192
    assert str(proposer.narrow_params["layers.0.mlp.gate_up_stack"].dtype) == "bfloat16"
    assert str(proposer.params["layers.0.mlp.gate_up_stack"].dtype) == "float32"
    printed = capsys.readouterr().out.split()
    assert len(printed) > 3 and float(printed[-1]) > 1.0  # an answer, then its accept length
