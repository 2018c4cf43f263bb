"""SpeculativeAlgorithm registry: lookup, errors, and an outside plugin registering through the same
public decorator DFLASH uses (its validator runs in ServerArgs.check, its worker serves requests)."""

import pytest

from sgl_dflash.entrypoints.engine import Engine
from sgl_dflash.errors import ServerArgsError
from sgl_dflash.server_args import ServerArgs
from sgl_dflash.speculative.spec_algorithm import SpeculativeAlgorithm
from sgl_dflash.model_executor.target_worker import TargetWorker


def test_lookup_is_case_insensitive_and_errors_list_known_names():
    assert SpeculativeAlgorithm.from_string(None).is_none()
    assert SpeculativeAlgorithm.from_string("none") is SpeculativeAlgorithm.NONE
    assert SpeculativeAlgorithm.from_string("dFlash") is SpeculativeAlgorithm.DFLASH
    assert SpeculativeAlgorithm.DFLASH.is_dflash() and not SpeculativeAlgorithm.DFLASH.supports_overlap
    assert {"NONE", "DFLASH"} <= set(SpeculativeAlgorithm.names())
    with pytest.raises(ServerArgsError, match=r"'EAGLE9'.*registered: \['NONE', 'DFLASH'"):
        SpeculativeAlgorithm.from_string("EAGLE9")
    with pytest.raises(ValueError, match="already registered"):
        SpeculativeAlgorithm.register("dflash")(lambda server_args: TargetWorker)


def test_dflash_refuses_drafters_that_do_not_fit(spec_target_dir, random_draft_dir, tiny_qwen3_dir, tmp_path):
    from tests.tiny_draft import make_tiny_draft

    args = ServerArgs(model_path=spec_target_dir, speculative_algorithm="dflash",
                      speculative_draft_model_path=random_draft_dir).check()
    assert args.speculative_algorithm == "DFLASH"
    assert args.speculative_num_draft_tokens == 16  # the drafter's block_size
    for block_size in (1, 17):
        with pytest.raises(ServerArgsError, match=r"--speculative-num-draft-tokens must be an integer in \[2, 16\]"):
            ServerArgs(model_path=spec_target_dir, speculative_algorithm="DFLASH",
                       speculative_draft_model_path=random_draft_dir,
                       speculative_num_draft_tokens=block_size).check()
    # A drafter made for another target (vocabulary 16, the target here has 256) does not fit.
    with pytest.raises(ServerArgsError, match="does not fit the target: .*vocab_size"):
        ServerArgs(model_path=tiny_qwen3_dir, speculative_algorithm="DFLASH",
                   speculative_draft_model_path=random_draft_dir).check()
    wide = make_tiny_draft(tmp_path / "wide", spec_target_dir, hidden_size=32)
    with pytest.raises(ServerArgsError, match="hidden_size"):
        ServerArgs(model_path=spec_target_dir, speculative_algorithm="DFLASH",
                   speculative_draft_model_path=str(wide)).check()
    with pytest.raises(ServerArgsError, match="no config.json"):
        ServerArgs(model_path=spec_target_dir, speculative_algorithm="DFLASH",
                   speculative_draft_model_path=str(tmp_path / "missing")).check()


class CountingWorker(TargetWorker):
    """A plugin's worker: autoregressive decoding that counts its steps."""

    decode_calls = 0

    def forward_decode(self, batch):
        CountingWorker.decode_calls += 1
        return super().forward_decode(batch)


def test_outside_plugin_registers_like_dflash(engine_kwargs, none_engine, spec_prompts):
    validated = []

    def validate(server_args):
        validated.append(server_args.model_path)
        if server_args.speculative_num_draft_tokens is not None:
            raise ServerArgsError("TOY_PLUGIN takes no --speculative-num-draft-tokens")

    @SpeculativeAlgorithm.register("toy_plugin", validate_server_args=validate)
    def toy_factory(server_args):
        return CountingWorker

    try:
        assert SpeculativeAlgorithm.from_string("Toy_Plugin").worker_class(None) is CountingWorker
        with pytest.raises(ServerArgsError, match="TOY_PLUGIN takes no"):
            ServerArgs(**engine_kwargs, speculative_algorithm="toy_plugin", speculative_num_draft_tokens=3).check()
        engine = Engine(**engine_kwargs, speculative_algorithm="toy_plugin")
        assert validated and isinstance(engine.scheduler.worker, CountingWorker)
        params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        outs = engine.generate(input_ids=spec_prompts, sampling_params=params)
        assert CountingWorker.decode_calls == 7
        expected = none_engine.generate(input_ids=spec_prompts, sampling_params=params)
        assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    finally:
        SpeculativeAlgorithm.unregister("toy_plugin")
    with pytest.raises(ServerArgsError):
        SpeculativeAlgorithm.from_string("toy_plugin")
