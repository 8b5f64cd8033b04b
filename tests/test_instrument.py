"""Zero-code instrumentation: unchanged user scripts (a Trainer script, TRL's `trl sft` command) run
with the startup hook on PYTHONPATH and an event pipe, as an agent runs a command job's process.
The test reads the pipe itself, so what arrives is exactly what the script's processes wrote."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, wait_for

from tokenpulse.instrument import hook_dir

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DEMO = ROOT / "tokenpulse" / "demo"
TRL = Path(sys.executable).parent / "trl"


class PipeJob:
    """A command run the way an agent runs one: own session, TOKENPULSE_EVENT_FD, hook on PYTHONPATH."""

    def __init__(self, argv: list[str], tmp: Path, extra_env: dict | None = None, hook: bool = True):
        r, w = os.pipe()
        path = [hook_dir()] if hook else []
        env = {**os.environ, "TOKENPULSE_EVENT_FD": str(w), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(path + [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        env.update(extra_env or {})
        self.stderr_path = tmp / f"stderr-{os.getpid()}-{id(self)}.log"
        self.stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(argv, env=env, pass_fds=(w,), stdout=self.stderr, stderr=self.stderr,
                                     start_new_session=True, cwd=tmp)
        os.close(w)
        self.events: list[dict] = []
        self.reader = threading.Thread(target=self._read, args=(r,), daemon=True)
        self.reader.start()

    def _read(self, r: int) -> None:
        with os.fdopen(r) as f:
            for line in f:
                self.events.append(json.loads(line))

    def of(self, kind: str) -> list[dict]:
        return [e["data"] for e in list(self.events) if e["kind"] == kind]

    def phases(self, name: str) -> list[dict]:
        return [d for d in self.of("phase") if d["name"] == name]

    def metric(self, key: str) -> list[tuple[int, float]]:
        return [(d["step"], d["values"][key]) for d in self.of("metrics") if key in d["values"]]

    def log(self) -> str:
        self.stderr.flush()
        return self.stderr_path.read_text()[-4000:]

    def wait(self, timeout: float = 240) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"script did not finish in {timeout} s; output:\n{self.log()}") from None
        self.reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def make_tiny_model(out: Path) -> Path:
    """A tiny Llama saved like any Hugging Face model directory (weights, config, tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from worker.training.modeling import builtin_config
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    torch.manual_seed(0)
    model = LlamaForCausalLM(builtin_config(len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def trainer_job(tiny_model: Path, tmp: Path, *args: str, env: dict | None = None) -> PipeJob:
    return PipeJob([sys.executable, str(SCRIPTS / "hf_trainer.py"), "--model", str(tiny_model),
                    "--data", str(DEMO / "demo.jsonl"), "--out", str(tmp / "out"), *args], tmp, env)


def test_trainer_script_reports_phases_metrics_and_checkpoints(tiny_model, tmp_path):
    job = trainer_job(tiny_model, tmp_path, "--max-steps", "6", "--eval-steps", "3", "--save-steps", "4")
    assert job.wait() == 0, job.log()
    names = [d["name"] for d in job.of("phase")]
    for expected in ("running", "mapping", "loading model", "training", "evaluating", "saving"):
        assert expected in names, (expected, names)
    mapping = job.phases("mapping")[-1]
    assert mapping["done"] == mapping["total"] == 200 and mapping["unit"] == "examples"
    assert job.phases("training")[-1]["done"] == job.phases("training")[-1]["total"] == 6
    assert [s for s, _ in job.metric("loss")] == [1, 2, 3, 4, 5, 6]
    for key in ("lr", "grad_norm", "epoch", "tokens_per_s", "padded_tokens_per_s", "samples_per_s",
                "step_time_s", "rss_mb"):
        assert job.metric(key), key
    # the collator pads each batch to its longest example: real tokens are visibly fewer than padded
    for (_, real), (_, padded) in zip(job.metric("tokens_per_s"), job.metric("padded_tokens_per_s")):
        assert 0 < real < padded
    assert 0 < job.metric("padding_frac")[-1][1] < 1
    assert [s for s, _ in job.metric("eval/loss")] == [3, 6]
    assert [d["step"] for d in job.of("checkpoint")] == [4, 6]  # every 4 steps, and at the end
    assert Path(job.of("checkpoint")[0]["path"]).is_dir()
    assert any(d.get("pausable") for d in job.of("info")), job.of("info")
    assert job.of("alive"), "no alive events"
    assert "finished at step 6" in job.log()


def test_trl_sft_command_reports_the_same_and_pauses_through_its_launcher(tiny_model, tmp_path):
    """`trl sft` exactly as its users type it: the same telemetry, nothing changed in TRL. Its
    trainer runs in a child that `accelerate launch` starts; a pause sent to the command (what the
    agent signals) is passed down to it."""
    data = tmp_path / "data"
    data.mkdir()
    lines = (DEMO / "demo.jsonl").read_text().splitlines()[:300]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    job = PipeJob([str(TRL), "sft", "--model_name_or_path", str(tiny_model), "--dataset_name", str(data),
                   "--output_dir", str(tmp_path / "out"), "--max_steps", "500", "--logging_steps", "1",
                   "--report_to", "none", "--use_cpu", "--per_device_train_batch_size", "4",
                   "--max_length", "64", "--save_strategy", "no"], tmp_path)
    wait_for(lambda: len(job.metric("loss")) >= 3, 240, "three logged steps", show=job.log)
    job.proc.send_signal(signal.SIGUSR2)
    assert job.wait() == 0, job.log()
    names = [d["name"] for d in job.of("phase")]
    for expected in ("loading model", "tokenizing", "training"):
        assert expected in names, (expected, names)
    steps = [s for s, _ in job.metric("loss")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 500
    for key in ("lr", "grad_norm", "tokens_per_s", "padded_tokens_per_s", "samples_per_s"):
        assert job.metric(key), key
    assert job.metric("train/mean_token_accuracy"), "TRL's own metrics pass through"
    assert any(d.get("trainer") == "SFTTrainer" and d.get("pausable") for d in job.of("info")), job.of("info")
    assert [d["state"] for d in job.of("state")] == ["paused"]
    assert Path(job.of("checkpoint")[-1]["path"]).is_dir()


def test_pause_checkpoints_and_resume_continues_at_the_same_step(tiny_model, tmp_path):
    job = trainer_job(tiny_model, tmp_path, "--max-steps", "40", "--step-sleep", "0.3")
    wait_for(lambda: any((d.get("done") or 0) >= 2 for d in job.phases("training")), 180,
             "training to reach step 2", show=job.log)
    job.proc.send_signal(signal.SIGUSR2)  # what the agent sends for pause
    assert job.wait() == 0, job.log()
    paused = job.of("state")
    assert [d["state"] for d in paused] == ["paused"], paused
    ckpt = job.of("checkpoint")[-1]
    step = ckpt["step"]
    assert 2 <= step < 40 and Path(ckpt["path"]).name == f"checkpoint-{step}"
    assert "finished at step" not in job.log(), "the script must stop after the pause checkpoint"

    again = trainer_job(tiny_model, tmp_path, "--max-steps", "40",
                        env={"TOKENPULSE_RESUME_FROM": ckpt["path"]})
    wait_for(lambda: again.metric("loss"), 180, "a loss after resuming", show=again.log)
    again.kill()
    assert any(d.get("resumed_from") == ckpt["path"] for d in again.of("info"))
    assert again.phases("training")[0]["done"] == step
    assert again.metric("loss")[0][0] == step + 1


def test_a_stuck_script_dumps_its_stack_on_sigusr1(tmp_path):
    """Stack capture without py-spy: faulthandler on SIGUSR1, as for native jobs; the dump names
    the user's function and line."""
    script = tmp_path / "stuck.py"
    script.write_text("import time\n\ndef wait_for_the_server():\n    while True:\n        time.sleep(1)\n\n"
                      "wait_for_the_server()\n")
    job = PipeJob([sys.executable, str(script)], tmp_path)
    wait_for(lambda: job.of("alive"), 60, "the alive thread", show=job.log)
    job.proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: "wait_for_the_server" in job.log(), 30, "a stack dump on stderr", show=job.log)
    assert f'File "{script}", line 5 in wait_for_the_server' in job.log()
    assert job.proc.poll() is None, "SIGUSR1 must not kill the script"
    job.kill()


LIST_MODULES = "import sys; print(' '.join(sorted(sys.modules)))"


def test_the_hook_costs_a_plain_script_nothing_heavy_and_chains_to_sitecustomize(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    job = PipeJob([sys.executable, "-c", LIST_MODULES + "; import os; print('site', os.environ.get('SITE_RAN'))"],
                  tmp_path, extra_env={"PYTHONPATH": os.pathsep.join([hook_dir(), str(site), str(ROOT)])})
    assert job.wait(60) == 0, job.log()
    loaded = set(job.log().split())
    assert "tokenpulse.instrument.boot" in loaded  # the check can fail: the hook really ran
    assert not {"torch", "transformers", "datasets", "pydantic"} & loaded
    assert "site yes" in job.log(), "the shadowed sitecustomize must still run"
    assert [d["name"] for d in job.of("phase")] == ["running"]


def test_switched_off_by_environment(tmp_path):
    job = PipeJob([sys.executable, "-c", LIST_MODULES], tmp_path, extra_env={"TOKENPULSE_INSTRUMENT": "0"})
    assert job.wait(60) == 0, job.log()
    assert "tokenpulse.instrument.boot" not in job.log().split()
    assert job.events == []


def test_a_descendant_without_the_descriptor_finds_the_pipe(tmp_path):
    """torchrun, accelerate and spawn start workers with close_fds: they reopen the job's pipe."""
    child = "import tokenpulse; tokenpulse.log({'x': 1.0}, step=7)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    job = PipeJob([sys.executable, "-c", parent], tmp_path)
    assert job.wait(60) == 0, job.log()
    assert job.of("metrics") == [{"step": 7, "values": {"x": 1.0}}]
