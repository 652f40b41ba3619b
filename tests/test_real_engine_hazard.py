"""The copy shim (tpuoffload/sim/engine_shims.py, 10) against the hazard it removes (issue 33).

tpu-inference's ``TPUModelRunner._prepare_inputs`` rewrites its host numpy buffers (``positions_cpu``,
the ``DeviceBuffer`` metadata blob) every step and hands views of them to its device put; CPU JAX
aliases a view that starts on a 64-byte boundary instead of copying it, so with vLLM's async
scheduling (batch queue of 2) a step still queued on the device reads the next step's inputs.
``real_engine --hazard`` makes that happen on every step with a successor (the buffers forced onto a
64-byte boundary, each step's program held behind a gate until the runner has prepared the next
step: ``_force_aliasing_hazard``), on the engine WITHOUT the connector (the hazard is the harness's,
not tpuoffload's). With the shim, every pass gives the same greedy tokens; the negative control
leaves exactly that one shim out (``--without-shim device_put_copy``) and the tokens go wrong.
"""

from __future__ import annotations

import pytest

from tpuoffload.sim.real_engine import config_name, run_child

pytestmark = pytest.mark.slow  # two child processes, one engine each: about 3 minutes

PASSES = 2


def hazard_run(workdir, *extra):
    report = run_child(str(workdir), (1,), timeout_s=600,
                       extra_args=("--only", "baseline", "--hazard", "--passes", str(PASSES), *extra))
    run = report["runs"][config_name(1, False)]
    return report, run


@pytest.fixture(scope="module")
def with_shim(tmp_path_factory):
    return hazard_run(tmp_path_factory.mktemp("hazard-shim"))


@pytest.fixture(scope="module")
def without_shim(tmp_path_factory):
    return hazard_run(tmp_path_factory.mktemp("hazard-noshim"), "--without-shim", "device_put_copy")


def test_the_hazard_was_set_up(with_shim, without_shim):
    for report, run in (with_shim, without_shim):
        assert report["hazard"] is True
        # most steps ran only after the runner had rewritten its buffers for the next step
        assert run["hazard"]["released_by_next_step"] >= 10, run["hazard"]
        assert run["hazard"]["released_by_next_step"] > run["hazard"]["released_by_timeout"], run["hazard"]
    assert any("general_device_put" in s for s in with_shim[1]["shims"])
    assert not any("general_device_put" in s for s in without_shim[1]["shims"])
    # exactly the one shim left out
    assert len(without_shim[1]["shims"]) == len(with_shim[1]["shims"]) - 1


def test_with_the_copy_shim_the_held_steps_give_the_same_tokens(with_shim):
    _, run = with_shim
    tokens = [e["tokens"] for e in run["passes"]]
    assert len(tokens) == PASSES and all(t == tokens[0] for t in tokens), tokens
    assert all(len(t) == 6 for t in tokens[0])


def test_without_it_the_held_steps_read_the_next_steps_inputs(with_shim, without_shim):
    good = [e["tokens"] for e in with_shim[1]["passes"]]
    bad = [e["tokens"] for e in without_shim[1]["passes"]]
    wrong = sum(b != g for pb, pg in zip(bad, good) for b, g in zip(pb, pg))
    assert wrong >= PASSES, (bad, good)  # the negative control fails: wrong tokens in every pass
