"""The SSD decode readout's two forms agree, and the form is chosen by measurement only where
numerics may differ between processes (never in deterministic mode)."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model import ssd_readout
from hyrax.actors.model.mamba2 import Mamba2Mixer
from hyrax.actors.model.ssd import ssd_step
from test_ssd import inputs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("batch,groups", [(1, 1), (1, 2), (5, 1), (5, 2)])
def test_the_transposed_readout_equals_the_plain_one(dtype, batch, groups):
    x, dt, A, Bm, Cm, D, s0 = inputs(batch, 1, groups, dtype, seed=4)
    args = (x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], D)
    y_plain, s_plain = ssd_step(s0.clone(), *args)
    y_flip, s_flip = ssd_step(s0.clone(), *args, transposed=True)
    assert torch.equal(s_plain, s_flip)  # the state update is the same code
    torch.testing.assert_close(y_flip, y_plain, atol=1e-12 if dtype == torch.float64 else 1e-5, rtol=0)


def test_the_measurement_picks_the_clearly_faster_form_and_is_taken_once(monkeypatch):
    """With the clock stubbed: the transposed form wins only where it costs <= MARGIN of the
    plain one at every timed pair count; each shape is timed once per process."""
    timed = []

    def fake_seconds(fn, reps=5):
        timed.append(fn)
        return fake_seconds.costs[len(timed) % 2 == 0]  # calls alternate: plain, transposed
    monkeypatch.setattr(ssd_readout, "_seconds", fake_seconds)
    monkeypatch.setattr(ssd_readout, "_plans", {})
    fake_seconds.costs = {False: 1.0, True: 0.5}  # plain 1.0, transposed 0.5
    assert ssd_readout.transposed_is_faster(256, 32, torch.float32)
    assert len(timed) == 2 * len(ssd_readout.PAIRS)
    assert ssd_readout.transposed_is_faster(256, 32, torch.float32) and len(timed) == 2 * len(ssd_readout.PAIRS)
    fake_seconds.costs = {False: 1.0, True: 0.9}  # a near-tie keeps the plain form
    assert not ssd_readout.transposed_is_faster(128, 32, torch.float32)


def _mixers(deterministic: bool) -> list[Mamba2Mixer]:
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.model.demo import DEMO_DIR

    model = load_engine(str(DEMO_DIR), EngineConfig(deterministic=deterministic)).executor.rank.model
    return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]


def test_deterministic_engines_keep_the_plain_readout_others_take_the_measured_one(monkeypatch):
    monkeypatch.setattr(ssd_readout, "transposed_is_faster", lambda rows, n, dtype: True)
    assert [m.readout_transposed for m in _mixers(True)] == [False] * len(_mixers(True))
    planned = _mixers(False)
    assert planned and all(m.readout_transposed for m in planned)


def test_a_model_decodes_the_same_tokens_with_either_readout():
    from engine_helpers import make_engine, run_requests, tiny_model
    from hyrax.actors.engine.request import SamplingParams
    import copy

    outs = []
    for flip in (False, True):
        model = copy.deepcopy(tiny_model("mamba"))
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                m.readout_transposed = flip
        engine = make_engine(model, deterministic=False)
        prompts = [[(3 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((4, 19, 11, 30))]
        outs.append(run_requests(engine, prompts, SamplingParams(max_tokens=10, ignore_eos=True)))
    assert outs[0] == outs[1]
