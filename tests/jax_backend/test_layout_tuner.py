"""LayoutTuner: each layout timed on a shape (first step = compile, not timed), then the faster;
the others timed again every `recheck_every` steps."""

from __future__ import annotations

import pytest

from jax_backend.layout_tuner import LayoutTuner


def run(tuner, key, default, seconds, steps):
    """`steps` timed steps of `key`; seconds[layout] is what a step of that layout takes. Returns the layouts run."""
    ran = []
    for _ in range(steps):
        layout = tuner.choose(key, default)
        tuner.observe(key, layout, seconds[layout])
        ran.append(layout)
    return ran


def test_each_layout_is_timed_then_the_faster_runs():
    tuner = LayoutTuner(trials=3, recheck_every=1000)
    ran = run(tuner, "k", "scan", {"scan": 2.0, "switch": 1.0}, 12)
    # the default first: 1 compiling + 3 timed steps, then the other's 1 + 3, then the faster
    assert ran == ["scan"] * 4 + ["switch"] * 4 + ["switch"] * 4
    assert tuner.times("k") == {"scan": [2.0] * 3, "switch": [1.0] * 5}  # the running one keeps its last `window`
    assert tuner.best("k") == "switch"
    # another key and default: measured on its own
    assert run(tuner, "other", "switch", {"scan": 1.0, "switch": 3.0}, 10)[-2:] == ["scan", "scan"]


def test_an_untimed_step_takes_the_best_known_and_explores_nothing():
    tuner = LayoutTuner(trials=2, recheck_every=1000)
    assert tuner.choose("k", "switch", timed=False) == "switch"  # nothing measured: the default
    assert tuner.best("k") is None
    run(tuner, "k", "switch", {"scan": 1.0, "switch": 2.0}, 6)
    assert tuner.choose("k", "switch", timed=False) == "scan"


def test_the_other_layout_is_timed_again_and_wins_when_the_host_changes():
    tuner = LayoutTuner(trials=2, window=3, recheck_every=20)
    assert run(tuner, "k", "scan", {"scan": 1.0, "switch": 2.0}, 19)[-1] == "scan"
    # the host changes: the scan's copies now cost more than the switch's reads
    ran = run(tuner, "k", "scan", {"scan": 3.0, "switch": 2.0}, 6)
    assert ran[0] == "switch" and ran[1] == "switch"  # step 20: the switch timed twice again
    assert ran[-1] == "switch" and tuner.best("k") == "switch"  # the scan's window filled with 3.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="trials"):
        LayoutTuner(trials=4, window=3)


def test_the_layouts_a_shape_has_not_run_are_named_until_they_run():
    tuner = LayoutTuner()
    assert tuner.uncompiled("k", "scan") == ["switch"]
    tuner.observe("k", "switch", 0.0)  # the runner compiles it at the shape's first step
    assert tuner.uncompiled("k", "scan") == [] and tuner.uncompiled("k", "switch") == ["scan"]
    assert tuner.times("k") == {"scan": [], "switch": []}  # a compiling step is not a timing


def test_a_settled_shape_runs_one_layout_and_names_nothing_to_compile():
    tuner = LayoutTuner(trials=2, recheck_every=4)
    tuner.settle("k", "switch")
    assert tuner.uncompiled("k", "switch") == []
    assert run(tuner, "k", "scan", {"scan": 1.0, "switch": 2.0}, 9) == ["switch"] * 9  # no exploring, no rechecks
    assert tuner.choose("k", "scan", timed=False) == "switch"
    assert run(tuner, "other", "scan", {"scan": 1.0, "switch": 2.0}, 4) == ["scan"] * 3 + ["switch"]  # others explore
