"""The compiled output head and loss (worker/training/losshead.py) and the near-padding-free layout.

Real tiny models from a config, real torch.compile (inductor on the CPU): the compiled path must give
the eager path's loss and gradients, refuse models whose logits are not the plain output projection,
and stay off for runs too short to repay compiling; a measurement kept in the cache dir is taken by
the next attempt without measuring again.
"""
from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from test_training import Recorder, quick_spec, tiny_llama

from tokenpulse.protocol import JobSpec
from worker.training import losshead, precision
from worker.training.choices import Choices
from worker.training.controls import Controls
from worker.training.errors import EXIT_OK
from worker.training.packing import Layout, collate, epoch_steps
from worker.training.session import Session

CPU = torch.device("cpu")


def _batch(vocab: int, rows: int = 3, length: int = 40) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    targets[0, :5] = -100  # a masked prompt
    return {"input_ids": ids, "targets": targets}


def test_compiled_head_gives_the_eager_loss_and_gradients():
    model = tiny_llama(300).train()
    fused, why, _ = losshead.choose(model, "fp32", CPU, wanted="on")
    assert fused, why
    assert "compiled" in why
    b = _batch(300)
    grads = []
    for lm in (losshead.LossModel(model), losshead.loss_model(model)):
        assert lm.fused == (len(grads) == 1)
        model.zero_grad(set_to_none=True)
        loss = lm(**b)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) <= 1e-4 * abs(l0)
    for a, c in zip(g0, g1):
        torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-5)


def test_a_model_that_scales_its_logits_keeps_the_eager_path():
    from transformers import GraniteConfig, GraniteForCausalLM
    torch.manual_seed(0)
    cfg = GraniteConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, logits_scaling=8.0, use_cache=False)
    model = GraniteForCausalLM(cfg)
    fused, why, _ = losshead.choose(model, "fp32", CPU, wanted="on")
    assert not fused
    assert "transforms its logits" in why
    assert losshead.loss_model(model).fused is False


def test_auto_leaves_short_runs_eager_and_off_means_off():
    model = tiny_llama(300).train()
    fused, why, _ = losshead.choose(model, "fp32", CPU, wanted="auto", planned_tokens=5_000)
    assert not fused and "too short" in why
    fused, why, _ = losshead.choose(model, "fp32", CPU, wanted="off")
    assert not fused and "off" in why


def test_a_kept_measurement_is_taken_without_measuring_again(tmp_path):
    """The next attempt (or job) of the same model shape on this machine takes the kept choice: no
    forward+backward is timed, no compile is tried; a shorter run still stays eager from the kept timing."""
    cache = tmp_path / "cache"
    fused, why, meas = losshead.choose(tiny_llama(300), "fp32", CPU, wanted="on", cache_dir=cache)
    assert fused and meas["loss_head_measured"] is True, why
    assert len(list((cache / losshead.KEPT_AS).glob("*.json"))) == 1

    model = tiny_llama(300, seed=1)  # other weights, same shape: the relaunch's model
    backwards = []
    model.get_output_embeddings().weight.register_hook(lambda g: backwards.append(1))
    fused, why, meas = losshead.choose(model, "fp32", CPU, wanted="on", cache_dir=cache)
    assert fused and meas["loss_head_measured"] is False and "kept from an earlier measurement" in why
    assert losshead.loss_model(model).fused
    fused, why, _ = losshead.choose(model, "fp32", CPU, wanted="auto", planned_tokens=5_000, cache_dir=cache)
    assert not fused and "too short" in why
    assert backwards == []  # nothing was timed: the measurement is what the kept file saves
    # what the choice depends on is in its key: another precision or model shape is measured afresh
    assert len({losshead.head_key(m.config, "LlamaForCausalLM", p, CPU)
                for m, p in ((model, "fp32"), (model, "bf16"), (tiny_llama(301), "fp32"))}) == 3


def test_a_session_trains_with_the_compiled_head_and_its_next_attempt_keeps_the_choice(tmp_path):
    runs = []
    for n in range(2):  # the second: a fresh attempt of the same job on the same agent (its cache dir)
        em = Recorder()
        s = Session(quick_spec(torch_compile="on", padding="pack"), tmp_path / f"out{n}", em, Controls(),
                    cache_dir=tmp_path / "cache")
        assert s.run() == EXIT_OK
        [choice] = em.infos("loss_head")
        assert choice["loss_head"] == "compiled", choice
        assert choice["loss_head_measured"] is (n == 0), choice
        runs.append([d["values"]["loss"] for k, d in em.events if k == "metrics" and "loss" in d["values"]])
    assert len(runs[0]) == 6 and all(np.isfinite(runs[0]))
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)  # the kept choice trains exactly as the measured one


def test_a_kept_cpu_precision_choice_is_taken_by_the_next_attempt(tmp_path):
    """CPU precision=auto times bf16 against fp32 once per matmul shape on this machine: the next
    attempt takes the kept ratio (the same choice, so the same loss-head key) without timing again."""
    cache, spec = tmp_path / "cache", JobSpec(precision="auto")
    p, why, meas = precision.pick_precision(spec, CPU, 64, cache)
    assert p in ("bf16", "fp32") and meas["precision_measured"] is True and why.startswith("measured"), why
    [kept] = (cache / precision.KEPT_AS).glob("*.json")
    assert json.loads(kept.read_text()) == {"bf16_speedup": meas["bf16_speedup"]}
    kept.write_text(json.dumps({"bf16_speedup": 9.5}))  # what the next attempt reads, not a new timing
    again, why2, meas2 = precision.pick_precision(spec, CPU, 64, cache)
    assert (again, meas2) == ("bf16", {"bf16_speedup": 9.5, "precision_measured": False})
    assert why2 == "kept from an earlier measurement on this machine: bf16 matmul 9.5x faster than fp32 on this CPU"
    _, _, meas3 = precision.pick_precision(spec, CPU, 128, cache)  # another width: another shape, timed
    assert meas3["precision_measured"] is True and len(list(kept.parent.glob("*.json"))) == 2


def test_a_cpu_without_native_bf16_is_told_by_a_small_probe(tmp_path):
    """Where bf16 is emulated (no AMX or AVX512-BF16: 20-50x slower than fp32), a 256^3 probe decides
    fp32 without timing the model-shaped matmul (a minute at hidden 256), and an explicit bf16 is
    kept but named. Which branch runs is this CPU's: both are checked against the probe's own answer."""
    probe = precision.bf16_probe(CPU)
    assert probe > 0
    p, why, meas = precision.pick_precision(JobSpec(precision="auto"), CPU, 512, tmp_path)
    em = Recorder()  # an explicit bf16 through the training's own choice: kept, and said
    cfg = types.SimpleNamespace(hidden_size=512)
    asked = Choices(JobSpec(precision="bf16"), em, None, None, CPU, cfg, None).precision()
    [info] = em.infos("precision")
    alerts = [d for k, d in em.events if k == "alert" and d["kind"] == "precision"]
    assert asked == "bf16"
    if probe < precision.NO_FAST_BF16 / 2:  # clearly emulated here
        assert p == "fp32" and "no native bf16" in why and meas["bf16_speedup"] < precision.NO_FAST_BF16, why
        assert "no native bf16" in info["reason"] and info["bf16_speedup"] < precision.NO_FAST_BF16, info
        assert len(alerts) == 1 and "without native bf16" in alerts[0]["message"], alerts
    elif probe > precision.NO_FAST_BF16 * 2:  # native: the model-shaped timing decides, asked bf16 is plain
        assert "no native bf16" not in why and info["reason"] == "asked for" and not alerts, info


def test_packed_steps_waste_under_one_percent_on_cpu():
    """Lengths like short chat turns with a long tail: balanced rows, a widening example moved to the
    long rows, no multiple-of-8 width on a CPU."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3.6, 0.7, 3000).astype(np.int64), 2, 900)
    data = types.SimpleNamespace(lengths=lengths, n=len(lengths))
    step_tokens = int(32 * lengths.mean())
    for pad_multiple, most in ((1, 0.01), (8, 0.04)):
        lay = Layout(mode="pack", max_len=1024, row_len=256, rows=9, step_tokens=step_tokens,
                     pad_multiple=pad_multiple)
        real = padded = 0
        seen = []
        for step in epoch_steps(data, lay, seed=0, epoch=0):
            for mb in step:
                used = [int(lengths[row].sum()) for row in mb]
                width = -(-max(used) // pad_multiple) * pad_multiple
                real, padded = real + sum(used), padded + width * len(used)
                seen += [i for row in mb for i in row]
        assert sorted(seen) == sorted(np.flatnonzero(lengths >= 2).tolist())  # every example once
        assert real / padded > 1 - most, (pad_multiple, 1 - real / padded)


def test_collate_width_follows_pad_multiple():
    data = types.SimpleNamespace()
    tokens = np.arange(1, 31, dtype=np.int64)
    offsets = np.array([0, 13, 30])
    data.ids = lambda i, L: tokens[offsets[i]:offsets[i + 1]][:L]
    data.prompt_lens = np.zeros(2, np.int64)
    data.loss_mask = None
    for multiple, width in ((1, 17), (8, 24)):
        lay = Layout(mode="pack", max_len=64, row_len=32, rows=2, pad_multiple=multiple)
        b = collate(data, [[0], [1]], lay, pad_id=0)
        assert b["input_ids"].shape == (2, width)
