"""The training process: correctness of packing, masking, caching, resume, and the CLI's event stream.

CPU only, no network; tiny models built from configs. Whole file well under 2 minutes on 2 cores.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from worker.training.runtime import configure

configure()  # OMP_WAIT_POLICY=PASSIVE before torch loads, as the worker does (shared, busy CI boxes)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tokenpulse.protocol import JobSpec
from worker.training import checkpoint as ckpt
from worker.training.analysis import analyze_lengths, recommend_max_len
from worker.training.bpe import train_bpe
from worker.training.controls import Controls
from worker.training.data import DEMO_DIR, Fields
from worker.training.emit import Emitter
from worker.training.errors import EXIT_NAN, EXIT_OK
from worker.training.loop import forward_loss
from worker.training.modeling import builtin_config, load_tokenizer
from worker.training.packing import IGNORE, Layout, collate, epoch_batches
from worker.training.prepare import load_tokenized
from worker.training.session import Session
from worker.training.tokenization import encode_batch

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(2)


class Recorder(Emitter):
    """An Emitter that keeps events in memory (validated exactly like the real one)."""

    def __init__(self):
        super().__init__(alive_every=0)
        self.events: list[tuple[str, dict]] = []

    def emit(self, kind, /, **data):
        from tokenpulse.events import _validate
        data = _validate(kind, data)
        json.dumps(data, allow_nan=False)
        self.events.append((kind, data))

    def infos(self, key):
        return [d for k, d in self.events if k == "info" and key in d]


def demo_texts(n):
    with (DEMO_DIR / "demo.jsonl").open() as f:
        return [json.loads(next(f))["text"] for _ in range(n)]


def tiny_llama(vocab, seed=0):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(builtin_config(vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2)).eval()


def write_jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quick_spec(**kw):
    base = dict(max_steps=6, precision="fp32", batch_size=2, grad_accum=2, log_every=1, seed=1)
    base.update(kw)
    return JobSpec(**base)


# ---- packing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("row_len", [512, 96])  # 96: rows shorter than max_len, long examples apart
def test_packed_loss_equals_unpacked_loss(row_len):
    tok = load_tokenizer(JobSpec())
    data = encode_batch(tok, [("", t) for t in demo_texts(40)], is_pair=False, mask_prompt=False)
    model = tiny_llama(len(tok))
    dev = torch.device("cpu")
    packed = Layout(mode="pack", max_len=256, row_len=row_len, rows=2)
    batches = epoch_batches(data, packed, seed=0, epoch=0)
    assert any(len(row) > 2 for b in batches for row in b), "rows must really hold several examples"
    if row_len < 256:
        assert (data.lengths > row_len).any() and any(collate(data, b, packed, 0)["input_ids"].shape[1] > row_len
                                                      for b in batches)
    assert sorted(i for b in batches for row in b for i in row) == list(range(data.n))
    with torch.no_grad():
        p_sum, p_n = 0.0, 0
        for rows in batches:
            b = collate(data, rows, packed, tok.pad_token_id)
            p_sum += forward_loss(model, b, "fp32", dev).item()
            p_n += b["n_targets"]
        # unpacked: every example alone, through the model's own loss (labels shifted by HF)
        u_sum, u_n = 0.0, 0
        for i in range(data.n):
            ids = torch.from_numpy(data.ids(i, 256).astype(np.int64))[None]
            out = model(input_ids=ids, labels=ids)
            u_sum += out.loss.item() * (ids.shape[1] - 1)
            u_n += ids.shape[1] - 1
    assert p_n == u_n
    assert abs(p_sum / p_n - u_sum / u_n) / (u_sum / u_n) < 1e-5


def test_model_that_cannot_pack_falls_back_to_dynamic(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM
    tok = load_tokenizer(JobSpec())
    cfg = OPTConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                    max_position_embeddings=512, word_embed_proj_dim=32, pad_token_id=tok.pad_token_id,
                    bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    OPTForCausalLM(cfg).save_pretrained(tmp_path / "opt")
    tok.save_pretrained(tmp_path / "opt")
    em = Recorder()
    s = Session(quick_spec(model=str(tmp_path / "opt")), tmp_path / "out", em, Controls())
    assert s.run() == EXIT_OK
    pad = em.infos("padding")
    assert pad[0]["padding"] == "dynamic" and "leaks" in pad[0]["reason"]
    m = [d for k, d in em.events if k == "metrics" and "padding_frac" in d["values"]]
    assert m and m[-1]["values"]["padding_frac"] > 0  # dynamic padding really pads
    assert em.events[-1] == ("state", {"state": "completed", "reason": "trained 6 steps", "retry": False})


def test_loss_on_response_only_masks_prompt_tokens(tmp_path):
    tok = load_tokenizer(JobSpec())
    pairs = [("Question: what is two and two?", " Four."), ("Say hi.", " Hi there, friend.")]
    lay = Layout(mode="pack", max_len=64, row_len=64, rows=1)
    masked = encode_batch(tok, pairs, is_pair=True, mask_prompt=True)
    full = encode_batch(tok, pairs, is_pair=True, mask_prompt=False)
    bm, bf = collate(masked, [[0, 1]], lay, tok.pad_token_id), collate(full, [[0, 1]], lay, tok.pad_token_id)
    tm, tf = bm["targets"][0], bf["targets"][0]
    c = 0
    for i, (p, r) in enumerate(pairs):
        n_p = len(tok(p)["input_ids"])
        n = int(masked.lengths[i])
        resp = tok(r)["input_ids"] + [tok.eos_token_id]
        # positions c .. c+n_p-2 predict prompt tokens: masked; c+n_p-1 .. predicts the response
        assert (tm[c:c + n_p - 1] == IGNORE).all()
        assert tm[c + n_p - 1:c + n - 1].tolist() == resp
        assert (tf[c:c + n - 1] != IGNORE).all()  # loss on everything when not masking
        assert tm[c + n - 1] == IGNORE  # never predict across the example boundary
        c += n
    assert bm["n_targets"] == sum(len(tok(r)["input_ids"]) + 1 for _, r in pairs)


def test_response_only_through_the_dataset_pipeline(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": f"Q{i}: 2+{i}?", "a": f" {2 + i}"} for i in range(20)])
    tok = load_tokenizer(JobSpec())
    spec = JobSpec(dataset=str(path), prompt_field="q", response_field="a")
    data, info = load_tokenized(spec, tok, Recorder())
    assert info["fields"] == Fields(prompt="q", response="a").__dict__
    assert (data.prompt_lens > 0).all() and (data.prompt_lens < data.lengths).all()


# ---- max length -----------------------------------------------------------------------------------

@pytest.mark.parametrize("coverage", [90.0, 99.0, 99.9, 100.0])
def test_auto_max_length_never_truncates_more_than_allowed(coverage):
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.lognormal(3.4, 0.8, 5000).astype(int) + 2, [4000, 3000]])
    L = recommend_max_len(lengths, coverage)
    assert L % 8 == 0
    assert (lengths > L).mean() <= (100 - coverage) / 100 + 1e-12
    a = analyze_lengths(lengths, coverage)
    assert a["recommended_max_seq_length"] == L and a["truncated_frac"] <= (100 - coverage) / 100 + 1e-12
    assert a["layouts"]["pack"]["padding_frac"] < 0.05 < a["layouts"]["dynamic"]["padding_frac"]
    assert sum(b["count"] for b in a["histogram"]) == len(lengths)


def test_analyze_cli_reports_and_errors(tmp_path):
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"dataset": str(write_jsonl(tmp_path / "d.jsonl", [{"body": "x y z"}] * 5))}))
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(spec), "--check-only"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and json.loads(r.stdout)["field"] == "text_field"
    spec.write_text(json.dumps({}))
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(spec)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["examples"] == 1500 and out["truncated_frac"] <= 0.001
    assert out["recommended_max_seq_length"] >= out["percentiles"]["p99.9"]


# ---- tokenization cache -----------------------------------------------------------------------------

def test_tokenization_cache_reused_and_invalidated(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in demo_texts(50)])
    spec = JobSpec(dataset=str(path))
    tok = load_tokenizer(spec)
    cache = tmp_path / "cache"
    d1, i1 = load_tokenized(spec, tok, Recorder(), cache)
    d2, i2 = load_tokenized(spec, tok, Recorder(), cache)
    assert not i1["cache_hit"] and i2["cache_hit"]
    assert np.array_equal(d1.tokens, d2.tokens) and np.array_equal(d1.offsets, d2.offsets)
    # same size, one byte different: content hash, not mtime/size
    text = path.read_text()
    path.write_text(text.replace("a", "b", 1))
    d3, i3 = load_tokenized(spec, tok, Recorder(), cache)
    assert not i3["cache_hit"] and not np.array_equal(d1.tokens, d3.tokens)
    other = train_bpe(demo_texts(200), 600)
    other.pad_token = other.eos_token
    _, i4 = load_tokenized(spec, other, Recorder(), cache)
    assert not i4["cache_hit"]
    _, i5 = load_tokenized(spec, tok, Recorder(), cache)
    assert i5["cache_hit"]


# ---- whole runs ---------------------------------------------------------------------------------------

def test_saved_model_reloads_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    s = Session(quick_spec(), tmp_path, Recorder(), Controls())
    assert s.run() == EXIT_OK
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    ids = tok("The meaning of life", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, s.model.eval()(ids).logits, atol=1e-6)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5
    assert isinstance(tok.decode(out[0]), str)


class PauseAt(Controls):
    """Pauses before step k: the loop reads `pause` once per step boundary."""

    def __init__(self, k):
        super().__init__()
        self._reads, self._k = 0, k

    @property
    def pause(self):
        self._reads += 1
        return self._reads > self._k

    @pause.setter
    def pause(self, v):
        pass


def test_pause_resume_losses_match_uninterrupted_run(tmp_path):
    spec = quick_spec(max_steps=8, warmup_steps=2)
    full = Session(spec, tmp_path / "full", Recorder(), Controls())
    assert full.run() == EXIT_OK
    em = Recorder()
    first = Session(spec, tmp_path / "run", em, PauseAt(4))
    assert first.run() == EXIT_OK
    assert em.events[-1][1]["state"] == "paused"
    cp = [d for k, d in em.events if k == "checkpoint"][-1]
    assert cp["step"] == 4
    second = Session(spec, tmp_path / "run", Recorder(), Controls(), resume=Path(cp["path"]))
    assert second.run() == EXIT_OK
    losses = first.result.losses + second.result.losses
    assert len(losses) == 8
    np.testing.assert_allclose(losses, full.result.losses, rtol=1e-6)


def test_checkpoints_rotate_and_are_atomic(tmp_path):
    em = Recorder()
    spec = quick_spec(checkpoint_every=2, keep_checkpoints=2, padding="max_length", max_seq_length=64)
    assert Session(spec, tmp_path, em, Controls()).run() == EXIT_OK
    # the batch plan's phase says what it does: nothing is packed (issue 33 #17)
    phases = {d["name"] for k, d in em.events if k == "phase"}
    assert "padding to max length" in phases and "packing" not in phases, phases
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-0000002", "step-0000004"]  # step 6 is the final model, not a periodic one
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert [d["step"] for k, d in em.events if k == "checkpoint"] == [2, 4, 6]
    # a half-written checkpoint (no state file) is never taken for a checkpoint
    (tmp_path / "checkpoints" / "step-0000008").mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == names


def test_nan_loss_fails_with_alert(tmp_path):
    em = Recorder()
    from worker.training.faults import Fault, Faults
    faults = Faults(Fault(nan_at_step=3))
    assert Session(quick_spec(), tmp_path, em, Controls(), faults=faults).run() == EXIT_NAN
    alert = [d for k, d in em.events if k == "alert"][0]
    assert alert["kind"] == "nan" and "step 3" in alert["message"]
    # the NaN point itself is sent (as its word) at the next logged step: stored and shown, not dropped
    losses = [(d["step"], d["values"]["loss"]) for k, d in em.events if k == "metrics"]
    assert losses[-1] == (losses[-2][0] + 1, "nan") and all(isinstance(v, float) for _, v in losses[:-1]), losses
    assert em.events[-1][1]["state"] == "failed" and em.events[-1][1]["failure"] == "nan"


# ---- the real process ---------------------------------------------------------------------------------

def run_train(tmp_path, spec: dict, extra=(), on_event=None, timeout=90, fault=None):
    spec_path = tmp_path / f"spec-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    r, w = os.pipe()
    env = {**os.environ, "TOKENPULSE_EVENT_FD": str(w)}
    if fault is not None:  # the test-only channel: a plan file named in the environment, by job name
        plan = tmp_path / "fault-plan.json"
        plan.write_text(json.dumps({spec.get("name", ""): fault}))
        env["TOKENPULSE_FAULT_PLAN"] = str(plan)
    proc = subprocess.Popen([sys.executable, "-m", "worker.training.train", "--spec", str(spec_path), "--out",
                             str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), *extra],
                            cwd=REPO, env=env, pass_fds=(w,), stderr=subprocess.PIPE, text=True)
    os.close(w)
    events = []
    with os.fdopen(r) as f:
        for line in f:
            ev = json.loads(line)
            events.append(ev)
            if on_event:
                on_event(proc, ev)
    proc.wait(timeout=timeout)
    return proc.returncode, events, proc.stderr.read()


def test_train_subprocess_emits_phases_metrics_state_in_order(tmp_path):
    code, events, err = run_train(tmp_path, {"max_steps": 8})
    assert code == 0, err
    kinds = [e["kind"] for e in events if e["kind"] != "alive"]
    phases = [e["data"]["name"] for e in events if e["kind"] == "phase"]
    order = ["loading model", "loading dataset", "tokenizing", "packing", "training", "saving"]
    first = [phases.index(p) for p in order]
    assert first == sorted(first), phases
    assert kinds[-1] == "state" and events[-1]["data"]["state"] == "completed"
    m = [e["data"] for e in events if e["kind"] == "metrics"]
    assert [x["step"] for x in m] == list(range(1, 9))
    later = m[-1]["values"]
    for k in ("loss", "lr", "grad_norm", "tokens_per_s", "padded_tokens_per_s", "padding_frac", "samples_per_s",
              "step_time_s", "eta_s", "rss_mb", "mfu"):
        assert k in later, k
    assert "tokens_per_s" not in m[0]["values"]  # warm-up steps stay out of speed figures
    infos = [e["data"] for e in events if e["kind"] == "info"]
    assert any(d.get("padding") == "pack" for d in infos)
    assert any("precision" in d and "reason" in d for d in infos)
    assert kinds.index("metrics") > phases.index("training")
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()


def test_train_subprocess_pause_by_signal_then_resume(tmp_path):
    spec = {"name": "sleepy", "max_steps": 12, "precision": "fp32", "batch_size": 2, "grad_accum": 1}
    sleepy = {"step_sleep_s": 0.1}
    sent = []

    def pause_at_3(proc, ev):
        if ev["kind"] == "metrics" and ev["data"]["step"] >= 3 and not sent:
            proc.send_signal(signal.SIGUSR2)
            sent.append(1)

    code, events, err = run_train(tmp_path, spec, on_event=pause_at_3, fault=sleepy)
    assert code == 0, err
    assert events[-1]["data"]["state"] == "paused"
    cp = [e["data"] for e in events if e["kind"] == "checkpoint"][-1]
    assert 3 <= cp["step"] < 12
    code, events2, err = run_train(tmp_path, spec, extra=("--resume", cp["path"]), fault=sleepy)
    assert code == 0, err
    steps = [e["data"]["step"] for e in events2 if e["kind"] == "metrics"]
    assert steps[0] == cp["step"] + 1 and steps[-1] == 12
    assert events2[-1]["data"]["state"] == "completed"


def test_train_subprocess_sigterm_cancels(tmp_path):
    def term_at_2(proc, ev):
        if ev["kind"] == "metrics" and ev["data"]["step"] == 2:
            proc.terminate()

    code, events, err = run_train(tmp_path, {"name": "sleepy", "max_steps": 50, "batch_size": 2, "grad_accum": 1},
                                  on_event=term_at_2, fault={"step_sleep_s": 0.1})
    assert code == 0, err
    assert events[-1]["data"]["state"] == "cancelled"
    assert max(e["data"]["step"] for e in events if e["kind"] == "metrics") < 50


def test_lora_trains_adapters_only_and_final_reloads_merged(tmp_path):
    from transformers import AutoModelForCausalLM

    from tokenpulse.protocol import LoraSpec
    em = Recorder()
    s = Session(quick_spec(lora=LoraSpec(rank=4), gradient_checkpointing=True), tmp_path, em, Controls())
    assert s.run() == EXIT_OK
    p = em.infos("trainable_params")[0]
    assert 0 < p["trainable_params"] < p["params"] / 50
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").exists()
    assert not any("lora" in n for n, _ in merged.named_parameters())


def test_load_in_4bit_refused_without_cuda(tmp_path):
    from tokenpulse.errors import SpecError
    from tokenpulse.protocol import LoraSpec
    with pytest.raises(SpecError, match="CUDA") as e:
        Session(quick_spec(lora=LoraSpec(load_in_4bit=True)), tmp_path, Recorder(), Controls()).run()
    assert e.value.field == "lora"


def test_streaming_accumulates_and_trains(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in demo_texts(300)])
    em = Recorder()
    assert Session(quick_spec(dataset=str(path), streaming=True), tmp_path / "o", em, Controls()).run() == EXIT_OK
    acc = [d for k, d in em.events if k == "phase" and d["name"] == "accumulating"]
    assert acc and "samples" in acc[-1]["detail"] and "tokens" in acc[-1]["detail"]
    assert em.events[-1][1]["state"] == "completed"


def test_fault_plan_is_read_from_the_environment_by_job_name(tmp_path):
    """The test-only channel: TOKENPULSE_FAULT_PLAN names a JSON file keyed by job name ("*" for the
    rest); no variable, no faults; a typo in a plan is an error, not a silently healthy job."""
    from pydantic import ValidationError

    from worker.training.faults import PLAN_ENV, Faults, plan_for
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"hangs": {"hang_at_step": 8}, "*": {"step_sleep_s": 0.5}}))
    env = {PLAN_ENV: str(plan)}
    assert plan_for("hangs", env).hang_at_step == 8
    assert plan_for("other", env).step_sleep_s == 0.5 and plan_for(None, env).hang_at_step is None
    assert plan_for("hangs", {}) is None
    assert plan_for("hangs", {PLAN_ENV: str(tmp_path / "not-written-yet.json")}) is None
    plan.write_text(json.dumps({"hangs": {"hang_at_stpe": 8}}))
    with pytest.raises(ValidationError):
        plan_for("hangs", env)
    assert Faults().at("loss", 3) is False  # no plan: every hook is a no-op
