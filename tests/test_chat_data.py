"""Chat (messages) and Alpaca (instruction/input/output) data: rendering with the tokenizer's own chat
template, loss on the assistant's turns only (checked token by token), analysis and packing on the
rendered tokens, and the submit-time checks. Real tokenizers, real datasets, a tiny real Llama."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from worker.training.runtime import configure

configure()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from tokenpulse.errors import SpecError  # noqa: E402
from tokenpulse.protocol import JobSpec  # noqa: E402
from worker.training.controls import Controls  # noqa: E402
from worker.training.data import DEMO_DIR, alpaca_prompt  # noqa: E402
from worker.training.emit import Emitter  # noqa: E402
from worker.training.errors import EXIT_OK  # noqa: E402
from worker.training.modeling import builtin_config, load_tokenizer  # noqa: E402
from worker.training.packing import IGNORE, Layout, collate  # noqa: E402
from worker.training.prepare import load_tokenized  # noqa: E402
from worker.training.session import Session  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
END = "<|im_end|>"

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Say a fortune"},
     {"role": "assistant", "content": "You will write many tests, and they will pass."}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4, of course."}],
    [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue"},
     {"role": "user", "content": "Another"}, {"role": "assistant", "content": "Green, like the grass outside."},
     {"role": "user", "content": "And one more"}, {"role": "assistant", "content": "Red."}],
]


class Recorder(Emitter):
    def __init__(self):
        super().__init__(alive_every=0)
        self.events = []

    def emit(self, kind, /, **data):
        self.events.append((kind, data))


def chat_model_dir(path: Path, template: str | None = TEMPLATE) -> Path:
    """A tiny Llama whose tokenizer (the demo one + two turn markers) has a chat template."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", END]})
    if template:
        tok.chat_template = template
    torch.manual_seed(0)
    LlamaForCausalLM(builtin_config(len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
                     ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chatmodel"))


def named(info) -> dict:
    return {k: v for k, v in info["fields"].items() if v}


def labelled_runs(data, i, tok) -> list[str]:
    """Decode the maximal runs of consecutive loss targets of example i, from the real collate."""
    lay = Layout(mode="pack", max_len=4096, row_len=4096, rows=1)
    b = collate(data, [[i]], lay, tok.pad_token_id)
    ids, tgt = b["input_ids"][0].tolist(), b["targets"][0].tolist()
    n = int(data.lengths[i])
    runs, cur = [], []
    for t in range(n - 1):
        if tgt[t] != IGNORE:
            assert tgt[t] == ids[t + 1]  # targets are the next token, never shifted wrongly
            cur.append(tgt[t])
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_loss_on_assistant_turns_only_token_by_token(tmp_path, model_dir):
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    spec = JobSpec(model=str(model_dir), dataset=str(ds))
    tok = load_tokenizer(spec)
    data, info = load_tokenized(spec, tok, Recorder())
    assert named(info) == {"messages": "messages"}  # detected: nothing else named
    assert data.n == len(CHATS)
    for i, chat in enumerate(CHATS):
        # The example is the template's own rendering, token for token.
        rendered = tok.apply_chat_template(chat, tokenize=False)
        want_ids = tok(rendered, add_special_tokens=False)["input_ids"]
        assert data.ids(i, 10**6).tolist() == want_ids
        # Every labelled run is exactly one assistant turn's content plus its end marker, in order;
        # so no prompt/system/user token is a target and every assistant token is.
        want = [m["content"] + END for m in chat if m["role"] == "assistant"]
        assert labelled_runs(data, i, tok) == want


def test_loss_on_everything_when_asked(tmp_path, model_dir):
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    spec = JobSpec(model=str(model_dir), dataset=str(ds), loss_on_response_only=False)
    tok = load_tokenizer(spec)
    data, _ = load_tokenized(spec, tok, Recorder())
    b = collate(data, [[0]], Layout(mode="pack", max_len=4096, row_len=4096, rows=1), tok.pad_token_id)
    assert b["n_targets"] == int(data.lengths[0]) - 1


def test_named_messages_field_and_packing_keeps_masks_apart(tmp_path, model_dir):
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"conv": c, "text": "ignored"} for c in CHATS])
    spec = JobSpec(model=str(model_dir), dataset=str(ds), messages_field="conv")
    tok = load_tokenizer(spec)
    data, info = load_tokenized(spec, tok, Recorder())
    assert named(info) == {"messages": "conv"}
    lay = Layout(mode="pack", max_len=4096, row_len=4096, rows=1)
    packed = collate(data, [[0, 1, 2]], lay, tok.pad_token_id)
    alone = [collate(data, [[i]], lay, tok.pad_token_id) for i in range(3)]
    n = data.lengths
    got = packed["targets"][0].tolist()
    want = sum((a["targets"][0].tolist()[:n[i]] for i, a in enumerate(alone)), [])
    assert got[:len(want)] == want  # packed rows carry each example's own mask, nothing crosses
    assert packed["n_targets"] == sum(a["n_targets"] for a in alone)


def test_chat_without_template_is_a_clear_spec_error(tmp_path):
    bare = chat_model_dir(tmp_path / "bare", template=None)
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    spec = JobSpec(model=str(bare), dataset=str(ds))
    with pytest.raises(SpecError) as e:
        load_tokenized(spec, load_tokenizer(spec), Recorder())
    assert e.value.field == "model" and "chat template" in e.value.message and "chat_template" in e.value.message
    # the submit-time check (analyze --check-only) says the same
    (tmp_path / "s.json").write_text(spec.model_dump_json())
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(tmp_path / "s.json"),
                        "--check-only"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and json.loads(r.stdout)["field"] == "model"


def test_malformed_messages_name_the_field(tmp_path, model_dir):
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"messages": "just a string"}])
    spec = JobSpec(model=str(model_dir), dataset=str(ds))
    with pytest.raises(SpecError) as e:
        load_tokenized(spec, load_tokenizer(spec), Recorder())
    assert e.value.field == "messages_field"


def test_alpaca_columns_loss_on_output_only(tmp_path):
    rows = [{"instruction": "Give a fortune.", "input": "", "output": "You will be happy."},
            {"instruction": "Translate to French.", "input": "cat", "output": "chat"}]
    ds = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    spec = JobSpec(dataset=str(ds))
    tok = load_tokenizer(spec)
    data, info = load_tokenized(spec, tok, Recorder())
    assert named(info) == {"instruction": "instruction", "input": "input", "output": "output"}
    for i, r in enumerate(rows):
        prompt = alpaca_prompt(r["instruction"], r["input"])
        assert ("### Input:" in prompt) == bool(r["input"])
        ids = data.ids(i, 10**6).tolist()
        p_ids = tok(prompt, add_special_tokens=True)["input_ids"]
        assert ids[:len(p_ids)] == p_ids
        assert labelled_runs(data, i, tok) == [r["output"] + tok.eos_token]


def test_analysis_and_training_on_rendered_chats(tmp_path, model_dir):
    ds = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 20])
    spec = JobSpec(model=str(model_dir), dataset=str(ds), max_steps=4, precision="fp32", batch_size=2,
                   grad_accum=1, log_every=1)
    tok = load_tokenizer(spec)
    rendered = [len(tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"])
                for c in CHATS]
    (tmp_path / "s.json").write_text(spec.model_dump_json())
    r = subprocess.run([sys.executable, "-m", "worker.training.analyze", "--spec", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["percentiles"]["max"] == max(rendered) and out["tokens"] == 20 * sum(rendered)
    assert out["fields"] == {"messages": "messages"}
    em = Recorder()
    sess = Session(spec, tmp_path / "out", em, Controls(), cache_dir=tmp_path / "cache", telemetry=False)
    assert sess.run() == EXIT_OK, [e for e in em.events if e[0] in ("state", "log")]
    assert sess.result.step == 4 and all(np.isfinite(sess.result.losses)) and sess.result.losses
    assert [d["state"] for k, d in em.events if k == "state"] == ["completed"]
    assert (tmp_path / "out" / "final" / "config.json").exists()


def test_submit_accepts_chat_and_alpaca_columns_and_names_bad_ones(server, tmp_path, model_dir):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi", "output": "hi"}])
    with server.client() as c:
        def post(spec):
            return c.post("/api/jobs", json=spec, timeout=60)
        assert post({"model": str(model_dir), "dataset": str(chat)}).status_code in (200, 201)
        assert post({"dataset": str(alpaca)}).status_code in (200, 201)
        r = post({"model": str(model_dir), "dataset": str(chat), "messages_field": "conversation"})
        assert r.status_code == 422 and r.json()["detail"]["field"] == "messages_field", r.text
        r = post({"dataset": str(chat)})  # the builtin model's tokenizer has no chat template
        assert r.status_code == 422 and r.json()["detail"]["field"] == "model", r.text
        assert "chat template" in r.text
        r = post({"dataset": str(chat), "messages_field": "messages", "text_field": "messages"})
        assert r.status_code == 422 and "messages_field" in r.text, r.text


def test_cli_analyze_counts_rendered_chat_tokens(server, tmp_path, model_dir):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"conv": c} for c in CHATS])
    r = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "analyze", "--json", "--model", str(model_dir),
                        "--dataset", str(chat), "--messages-field", "conv"], capture_output=True, text=True,
                       timeout=180, env={**server.env, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": server.token})
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    tok = load_tokenizer(JobSpec(model=str(model_dir)))
    want = [len(tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]) for c in CHATS]
    assert out["fields"] == {"messages": "conv"} and out["tokens"] == sum(want)


def test_template_that_rewrites_earlier_turns_still_masks_by_content(tmp_path, model_dir):
    """A template that renders earlier assistant turns differently from the last one (as templates
    that strip reasoning do) is not prefix-stable: each turn's content is then found in the text."""
    from transformers import AutoTokenizer

    from worker.training.chat import encode_chats
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' and not loop.last %} [earlier]{% endif %}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = CHATS[2]
    ids, masks = encode_chats(tok, [chat], "messages", True)
    runs, cur = [], []
    for t, m in zip(ids[0], masks[0]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    runs += [tok.decode(cur)] if cur else []
    contents = [m["content"] for m in chat if m["role"] == "assistant"]
    assert runs[:-1] == contents[:-1] and runs[-1] == contents[-1] + END  # the last turn is prefix-stable
