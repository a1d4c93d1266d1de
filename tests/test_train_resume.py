"""Interrupted translator training continues where it stopped and ends where an uninterrupted run ends."""

from __future__ import annotations

import pytest
import torch

from mot_cag.errors import MotCagError
from mot_cag.translate.mot import build_translator
from mot_cag.translate.resume import STATE_FILE
from mot_cag.translate.train import TrainConfig, train_translator


def _cfg(**kw) -> TrainConfig:
    base = dict(steps=6, batch=1, lr=3e-3, warmup=2, ccl=1.0, kl=1.0, calibration_tokens=200,
                max_context_tokens=48, log_every=1, checkpoint_every=2, seed=3)
    return TrainConfig(**{**base, **kw})


def _fresh(models):
    torch.manual_seed(0)
    return build_translator(models["gpt2"], models["qwen2"], expert="mlp", experts=2, top_k=1, hidden=16)


class _Stop(KeyboardInterrupt):
    pass


def _stop_at(step):
    def log(record):
        if record.get("step") == step:
            raise _Stop

    return log


def test_interrupted_run_resumes_to_the_same_weights(tiny_models, tmp_path):
    s, t = tiny_models["gpt2"], tiny_models["qwen2"]
    whole = _fresh(tiny_models)
    summary = train_translator(whole, s, t, _cfg())
    state = tmp_path / "run.partial"
    first = _fresh(tiny_models)
    with pytest.raises(_Stop):
        train_translator(first, s, t, _cfg(), log=_stop_at(3), state_dir=state)
    assert (state / STATE_FILE).exists()  # saved on the interrupt after step 3 (not only at step 2)
    resumed = _fresh(tiny_models)
    records = []
    out = train_translator(resumed, s, t, _cfg(), log=records.append, state_dir=state)
    assert records[0] == {"resumed_from": 3} and [r["step"] for r in records[1:]] == [4, 5, 6]
    assert out["resumed_from"] == 3 and [r["step"] for r in out["history"]] == [1, 2, 3, 4, 5, 6]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert out["final"]["loss"] == pytest.approx(summary["final"]["loss"], rel=1e-4)


def test_a_state_of_other_settings_or_a_damaged_one_is_refused(tiny_models, tmp_path):
    s, t = tiny_models["gpt2"], tiny_models["qwen2"]
    state = tmp_path / "run.partial"
    with pytest.raises(_Stop):
        train_translator(_fresh(tiny_models), s, t, _cfg(), log=_stop_at(2), state_dir=state)
    with pytest.raises(MotCagError, match="other settings"):
        train_translator(_fresh(tiny_models), s, t, _cfg(lr=1e-3), state_dir=state)
    saved = (state / STATE_FILE).read_bytes()
    (state / STATE_FILE).write_bytes(saved[: len(saved) // 2])
    with pytest.raises(MotCagError, match="damaged"):
        train_translator(_fresh(tiny_models), s, t, _cfg(), state_dir=state)


def test_run_training_keeps_state_until_saved_and_fresh_starts_over(tiny_dir, tmp_path):
    from mot_cag.translate.recipe import TrainRequest, run_training
    from mot_cag.translate.resume import state_dir_for
    from mot_cag.translate.spec import TranslatorSpec

    def request(**kw):
        return TrainRequest(str(tiny_dir / "tiny-gpt2"), str(tiny_dir / "tiny-opt"),
                            spec=TranslatorSpec(kind="mot", expert="mlp", experts=2, top_k=1, hidden=16),
                            train=_cfg(steps=4), out=str(tmp_path / "tr"), eval_examples=0, device="cpu", **kw)

    partial = state_dir_for(tmp_path / "tr")
    with pytest.raises(_Stop):
        run_training(request(), log=_stop_at(3))
    assert (partial / STATE_FILE).exists() and not (tmp_path / "tr").exists()
    seen = []
    result = run_training(request(fresh=True), log=seen.append)
    assert "resumed_from" not in seen[0] and result["final"]["step"] == 4
    assert (tmp_path / "tr" / "config.json").exists() and not partial.exists()
