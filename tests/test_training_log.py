"""The training process's readable account on stdout (issue 11 #18): the agent relays stdout as the
job's Log, so phases, choices, step lines, checkpoints and the end must be there, and step lines
must stay few on a long run."""
from __future__ import annotations

import os

from worker.training.emit import Emitter


def test_narration_phases_choices_steps_and_end(capsys):
    em = Emitter(fd=os.open(os.devnull, os.O_WRONLY), alive_every=0, narrate=True)
    em.phase("loading model", detail="builtin:tiny-llama")
    em.phase("loading model", done=1, total=1, detail="1,066,112 parameters")
    em.phase("tokenizing", done=0, total=1500, unit="examples")
    em.phase("tokenizing", done=700, total=1500, unit="examples")  # a tick: stays in the phase line
    em.phase("tokenizing", done=1500, total=1500, unit="examples")
    em.info(precision="fp32", reason="asked for", measured={"x": 1})
    em.phase("training", done=0, total=2000, unit="steps")
    for s in range(1, 2001):
        em.metrics(s, loss=2.0, lr=3e-4, tokens_per_s=5000.0, eta_s=(2000 - s) * 0.1)
        em.phase("training", done=s, total=2000, unit="steps")
        if s % 500 == 0 and s < 2000:  # a checkpoint, then back to training: not announced again (issue 33 #17)
            em.phase("saving", detail=f"checkpoint at step {s}")
            em.phase("saving", done=1, total=1, detail=f"/out/checkpoints/step-{s}")
            em.emit("checkpoint", step=s, path=f"/out/checkpoints/step-{s}")
    em.emit("checkpoint", step=2000, path="/out/final", final=True)
    em.emit("state", state="completed", reason="trained 2000 steps")
    em.close()
    out = capsys.readouterr().out.splitlines()
    assert out[:6] == ["loading model · builtin:tiny-llama", "loading model done · 1,066,112 parameters", "tokenizing",
                       "tokenizing done 1,500/1,500 examples", "chose precision=fp32 (asked for)",
                       "training 2,000 steps"], out[:6]
    steps = [x for x in out if x.startswith("step ")]
    assert 15 <= len(steps) <= 25, len(steps)  # about twenty, not 2,000
    assert steps[0] == "step 1/2,000 · loss 2 · lr 0.0003 · 5,000 tok/s · ETA 3 min 20 s", steps[0]
    assert steps[-1] == "step 2,000/2,000 · loss 2 · lr 0.0003 · 5,000 tok/s"  # the last step always, no ETA
    assert out[-2:] == ["final model saved at step 2,000: /out/final", "completed: trained 2000 steps"]
    assert "checkpoint saved at step 1,500: /out/checkpoints/step-1500" in out
    assert [x for x in out if x.startswith("training")] == ["training 2,000 steps"], out


def test_a_resumed_attempt_says_where_it_starts_once(capsys):
    em = Emitter(fd=os.open(os.devnull, os.O_WRONLY), alive_every=0, narrate=True)
    for s in range(40, 61):
        em.phase("training", done=s, total=100, unit="steps")
        if s == 50:
            em.phase("evaluating", done=0, total=4, unit="batches")
            em.phase("evaluating", done=4, total=4, unit="batches")
    em.close()
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith("training")] == ["training from step 40 of 100"], out


def test_no_narration_unless_asked(capsys):
    em = Emitter(fd=os.open(os.devnull, os.O_WRONLY), alive_every=0)  # analyze: stdout is its JSON answer
    em.phase("tokenizing", done=0, total=10, unit="examples")
    em.close()
    assert capsys.readouterr().out == ""
