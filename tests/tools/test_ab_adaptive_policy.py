"""scripts/ab_adaptive_policy.py: its --old settings are checked before any model loads (the A/B
itself serves the real pair for minutes; docs/adaptive.md holds its runs)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_adaptive_policy.py"


def load_script():
    spec = importlib.util.spec_from_file_location("ab_adaptive_policy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_old_settings_are_the_policys_numeric_arguments(capsys):
    script = load_script()
    parser = script.argparse.ArgumentParser()
    assert script.parse_settings(parser, ["min_gain=0", "probe_slack=1", "probe_every=8"]) == {
        "min_gain": 0.0, "probe_slack": 1.0, "probe_every": 8}
    for bad in (["min_gian=0"], ["cost_model=1"], ["min_gain=fast"]):
        with pytest.raises(SystemExit):
            script.main(["--old", *bad])
    assert "min_gain" in capsys.readouterr().err
