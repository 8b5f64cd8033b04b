"""Pages a person sees. Each is a Jinja2 template plus static JS that uses the same REST and
websocket API as scripts; the pages themselves hold no data, so they stay fast and cacheable."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates

from server import auth
from server.security import token_from

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).resolve().parent / "templates")


def logged_in(request: Request) -> bool:
    caller = request.app.state.tp.caller(token_from(request.headers, request.cookies, {}))
    return caller is not None and caller.is_person


def page(request: Request, name: str, status_code: int = 200, **ctx):
    if not logged_in(request):
        return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
    return templates.TemplateResponse(request, name, {"page": name.removesuffix(".html"), **ctx},
                                      status_code=status_code)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request, next: str = "/", error: str = ""):
    return templates.TemplateResponse(request, "login.html", {"next": next, "error": error, "page": "login"})


@router.post("/login")
def login(request: Request, token: str = Form(..., max_length=500), next: str = Form("/")):
    tp = request.app.state.tp
    client = request.client.host if request.client else "?"
    wait_s = tp.login_throttle.retry_after(client)
    if wait_s:
        return templates.TemplateResponse(
            request, "login.html", {"next": next, "page": "login",
                                    "error": f"Too many failed logins from this address; try again in {wait_s:.0f} s."},
            status_code=429, headers={"Retry-After": str(int(wait_s) + 1)})
    caller = tp.caller(token.strip()) if not token.strip().startswith(auth.SESSION_PREFIX) else None
    if caller is None or not caller.is_person:
        tp.login_throttle.failed(client)
        return templates.TemplateResponse(
            request, "login.html", {"next": next, "page": "login",
                                    "error": "That token is not valid. It is in the server's data directory, file "
                                             "'token'."},
            status_code=401)

    def start(s):
        from server.models import Token
        return auth.new_session(s, s.get(Token, caller.token_id), tp.settings.session_ttl_s)
    secret = tp.db.write_sync(start)
    target = next if next.startswith("/") and not next.startswith("//") else "/"
    resp = RedirectResponse(target, status_code=303)
    resp.set_cookie(auth.COOKIE, secret, httponly=True, samesite="strict",
                    max_age=int(tp.settings.session_ttl_s), secure=request.url.scheme == "https")
    return resp


@router.get("/logout")
def logout(request: Request):
    secret = request.cookies.get(auth.COOKIE, "")
    if secret.startswith(auth.SESSION_PREFIX):
        tp = request.app.state.tp
        tp.db.write_sync(lambda s: auth.revoke_session(s, secret))
        tp.forget(secret)
    resp = RedirectResponse("/login", status_code=303)
    resp.delete_cookie(auth.COOKIE)
    return resp


def wants_page(request: Request) -> bool:
    """A person's browser asking for a page (not a script, not the API): it gets HTML errors."""
    path = request.url.path
    return "text/html" in request.headers.get("accept", "") and not path.startswith(("/api/", "/ws", "/metrics"))


async def not_found(request: Request, exc):
    """Unknown routes: the app's own 404 page in a browser, the usual JSON for everything else."""
    from fastapi.exception_handlers import http_exception_handler
    if exc.status_code == 404 and wants_page(request):
        return page(request, "not_found.html", status_code=404, title="No such page",
                    message=f"There is no page at {request.url.path[:200]}.",
                    hint="The link may be mistyped or out of date.")
    return await http_exception_handler(request, exc)


@router.get("/", response_class=HTMLResponse)
def jobs_page(request: Request):
    return page(request, "jobs.html")


def job_exists(request: Request, job_id: int) -> bool:
    from server.models import Job
    if not 0 < job_id < 2 ** 63:
        return False
    with request.app.state.tp.db.read() as s:
        return s.get(Job, job_id) is not None


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str):
    # A job that does not exist gets a page saying so (404), not an empty job page that never fills
    # (nor, for /jobs/abc, a JSON validation error).
    number = int(job_id) if job_id.isascii() and job_id.isdigit() and len(job_id) < 30 else None
    if logged_in(request) and (number is None or not job_exists(request, number)):
        shown = f"#{number}" if number is not None else f"“{job_id[:40]}”"
        return page(request, "not_found.html", status_code=404,
                    message=f"There is no job {shown}.", hint="It may never have existed, or the database was reset.")
    return page(request, "job.html", job_id=number)


# The submit form, one entry per JobSpec setting: (name, label, kind, help). Defaults and extra help
# come from JobSpec itself, so the form cannot drift from what the API accepts; a test checks that
# every JobSpec field is on the form.
FORM: list[tuple[str, str, list[tuple]]] = [
    ("data", "Model and data", [
        ("name", "Name", "text", "A label for the job, shown in lists and charts."),
        ("project", "Project", "text", "The project it belongs to: the jobs list filters and groups by it."),
        ("tags", "Tags", "list", "Comma-separated labels to find it by (editable on the job page)."),
        ("model", "Model", "text",
         "A local Hugging Face model directory, a Hub id (e.g. Qwen/Qwen2.5-0.5B), or builtin:tiny-llama (a tiny model "
         "for trying things out)."),
        ("dataset", "Dataset", "text",
         ".jsonl / .csv / .parquet / .txt file, a datasets save_to_disk directory, a Hub dataset id, or builtin:demo."),
        ("text_field", "Text field", "text", "Column holding plain text. Leave empty to detect (text, content...)."),
        ("prompt_field", "Prompt field", "text",
         "For prompt/response pairs: the prompt column (give both or neither)."),
        ("response_field", "Response field", "text", "For prompt/response pairs: the response column."),
        ("messages_field", "Messages field", "text",
         "For chat data: the column holding a list of {role, content}, rendered with the model's chat template. Leave "
         "empty to use a 'messages' column."),
        ("loss_on_response_only", "Loss on the response only", "bool",
         "Mask prompt tokens out of the loss (prompt/response and Alpaca data; for chats, everything but the "
         "assistant's turns). Unless you set it: on for such data, off for plain text (from the dataset's columns)."),
        ("streaming", "Stream the dataset", "bool",
         "Read the dataset as a stream, accumulating chunks (for data larger than memory)."),
    ]),
    # Only for a model or dataset on the Hugging Face Hub (or a saved DatasetDict's split): folded away.
    ("hub", "Hub model and dataset options", [
        ("revision", "Model revision", "text", "Hub model: a branch, tag or commit (default: main)."),
        ("dataset_config", "Dataset config", "text", "Hub dataset: the configuration (subset) name."),
        ("dataset_split", "Dataset split", "text", "The split to train on (default: train)."),
        ("dataset_revision", "Dataset revision", "text", "Hub dataset: a branch, tag or commit (default: main)."),
        ("hub_token_secret", "Hub token secret", "text",
         "For private or gated Hub repos: the name of a secret on the workers (TOKENPULSE_SECRET_<NAME>); default: "
         "their HF_TOKEN. The token is never stored."),
    ]),
    ("training", "Training", [
        ("max_steps", "Max steps", "int",
         "Optimizer steps. Leave empty and set epochs instead; 200 when both are empty."),
        ("epochs", "Epochs", "float", "Passes over the data, used when max steps is empty."),
        ("learning_rate", "Learning rate", "float", "Peak learning rate (after warmup)."),
        ("warmup_steps", "Warmup steps", "int", "Steps of linear warmup from 0 to the peak learning rate."),
        ("weight_decay", "Weight decay", "float", "AdamW weight decay."),
        ("seed", "Seed", "int", "Random seed for data order and initialisation."),
    ]),
    ("batching", "Batching, length and precision", [
        ("max_seq_length", "Max sequence length (tokens)", "auto-int",
         "auto: covers the data up to the coverage percentile (see Analyze dataset)."),
        ("length_coverage", "Length coverage (%)", "float",
         "Percentile of example lengths that auto max length keeps whole."),
        ("padding", "Padding", "select:auto,pack,dynamic,max_length",
         "pack: padding-free, several examples per row; dynamic: pad to the batch's longest; max_length: pad every row "
         "to the max (wasteful)."),
        ("group_by_length", "Group by length", "bool",
         "With dynamic padding, batch examples of similar length together (less padding)."),
        ("batch_size", "Micro-batch (rows)", "auto-int",
         "Rows per forward pass; auto measures a few sizes and takes the fastest that fits."),
        ("tokens_per_batch", "Tokens per optimizer step", "int",
         "Effective batch in real tokens per step. Empty: 16 rows' worth."),
        ("grad_accum", "Gradient accumulation", "auto-int",
         "Micro-batches per optimizer step; auto reaches tokens per step."),
        ("precision", "Precision", "select:auto,bf16,fp16,fp32",
         "auto: bf16 where measured faster or on GPUs that have it."),
        ("gradient_checkpointing", "Gradient checkpointing", "bool",
         "Recompute activations in the backward pass: less memory, ~30 % slower."),
        ("torch_compile", "torch.compile", "select:auto,on,off",
         "auto: the output head and loss compiled where checked equal, measured faster, and the run is long enough to "
         "repay a few seconds of compiling; on: wherever checked equal."),
        ("device", "Device", "select:auto,cpu,cuda", "auto: the accelerator when there is one."),
    ]),
    ("eval", "Evaluation and a quick test run", [
        ("eval_fraction", "Hold out for eval (fraction)", "float",
         "Share of the examples held out for evaluation (0–0.5, chosen by seed). Or give an eval dataset."),
        ("eval_dataset", "Eval dataset", "text",
         "A separate evaluation file or save_to_disk directory with the same fields."),
        ("eval_split", "Eval split", "text",
         "Evaluate on this split of the dataset (a save_to_disk DatasetDict or a Hub dataset), e.g. validation."),
        ("eval_every", "Evaluate every (steps)", "int",
         "Eval loss and perplexity every N steps; always at the end when evaluating."),
        ("eval_every_min", "… or every (minutes)", "float", "Evaluate every N minutes of training."),
        ("eval_max_examples", "Eval examples (at most)", "int",
         "Evaluate on at most this many examples (a fixed random choice)."),
        ("eval_prompts", "Eval prompts", "lines",
         "One box per prompt (at most 8; a prompt may span several lines): greedy generations at each eval, shown on "
         "the job page."),
        ("eval_max_new_tokens", "Tokens per generation", "int",
         "New tokens generated for each eval prompt (at most 256)."),
        ("test_run", "Quick test run first", "bool",
         "Before the full run: load, tokenize a sample, train a few steps, eval, checkpoint, resume, save and reload; "
         "a failing check fails the job at once."),
    ]),
    ("lora", "LoRA (parameter-efficient fine-tuning)", [
        ("lora.enabled", "Use LoRA", "bool", "Train small low-rank adapters instead of all weights."),
        ("lora.rank", "Rank r", "int", "Adapter rank; 8–64 is typical."),
        ("lora.alpha", "Alpha", "float", "Scaling = alpha / rank."),
        ("lora.dropout", "Dropout", "float", "Dropout on the adapter input (0 to <1)."),
        ("lora.target_modules", "Target modules", "list", "Comma-separated module names, e.g. q_proj, v_proj."),
        ("lora.load_in_4bit", "4-bit base weights (QLoRA)", "bool",
         "CUDA only: quantize the frozen base model to 4 bits."),
    ]),
    ("ops", "Checkpoints, scheduling and retries", [
        ("checkpoint_every", "Checkpoint every (steps)", "int", "Save a checkpoint every N optimizer steps."),
        ("checkpoint_every_min", "… or every (minutes)", "float", "Save a checkpoint every N minutes of training."),
        ("keep_checkpoints", "Keep checkpoints", "int", "How many recent checkpoints to keep on disk."),
        ("log_every", "Log every (steps)", "int", "Steps between metric points on the charts."),
        ("priority", "Priority", "int", "−100 to 100; higher runs first."),
        ("max_retries", "Max retries", "int",
         "Automatic retries after OOM (with a halved micro-batch), a lost worker or a crash."),
        ("nproc_per_node", "Processes per machine", "int",
         "Ranks per machine (torchrun, DistributedDataParallel); same effective batch."),
        ("nnodes", "Machines", "int", "Agents that run the job together (claimed all or nothing)."),
    ]),
    # ("stall", ...): appended below from StallSpec, where each knob's label and help are declared
]


def form_fields() -> list[dict]:
    from tokenpulse.protocol import JobSpec, LoraSpec, SlurmSpec, StallSpec
    models = {"": JobSpec, "lora": LoraSpec, "stall": StallSpec, "slurm": SlurmSpec}
    groups = []
    for gid, title, fields in FORM:
        out = []
        for name, label, kind, help_text in fields:
            prefix, _, leaf = name.rpartition(".")
            f = models[prefix].model_fields.get(leaf)
            default = None
            if f is not None and not f.is_required():
                default = f.get_default(call_default_factory=True)
            if isinstance(default, list):
                default = ", ".join(default)
            if name == "lora.enabled":
                default = False
            if prefix == "slurm":  # empty unless set: a job sent from here carries no Slurm block by default
                default = None
            out.append({"name": name, "label": label, "kind": kind.split(":")[0],
                        "options": kind.split(":")[1].split(",") if ":" in kind else [],
                        "help": help_text, "default": default, "id": "f-" + name.replace(".", "-")})
        groups.append({"id": gid, "title": title, "fields": out})
    # Settings added to JobSpec after this form was written still get an input, labelled from the
    # field name and helped by its description, so the form never silently lags the API.
    listed = {f["name"] for g in groups for f in g["fields"]}
    by_id = {g["id"]: g for g in groups}
    for prefix, model in models.items():
        for leaf, f in model.model_fields.items():
            name = f"{prefix}.{leaf}" if prefix else leaf
            if name in listed or name in ("lora", "stall", "slurm"):
                continue
            kind = field_kind(f.annotation)
            default = f.get_default(call_default_factory=True) if not f.is_required() else None
            target = by_id.get(prefix or "ops")
            target["fields"].append({
                "name": name, "label": label_for(leaf),
                "kind": kind[0], "options": kind[1], "help": (f.description or "").capitalize() + ".",
                "default": ", ".join(default) if isinstance(default, list) else default,
                "id": "f-" + name.replace(".", "-")})
    return groups


def label_for(leaf: str) -> str:
    if leaf.endswith("_s"):
        return leaf[:-2].replace("_", " ").capitalize() + " (s)"
    return leaf.replace("_", " ").capitalize()


def field_kind(annotation) -> tuple[str, list]:
    import typing
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    lits = [x for a in args if typing.get_origin(a) is typing.Literal for x in typing.get_args(a)]
    if int in args and lits == ["auto"]:
        return "auto-int", []
    if lits and len(args) == 1:
        return "select", [str(x) for x in lits]
    base = args[0]
    if base is bool:
        return "bool", []
    if base is int:
        return "int", []
    if base is float:
        return "float", []
    if typing.get_origin(base) is list:
        return "list", []
    return "text", []


def sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def stall_inputs() -> list[tuple]:
    """The stall knobs' rows of FORM, from their one declaration: StallSpec's fields, each with its
    title (the label) and description (the help)."""
    from tokenpulse.protocol import StallSpec
    return [(f"stall.{leaf}", f.title or label_for(leaf), field_kind(f.annotation)[0], sentence(f.description or ""))
            for leaf, f in StallSpec.model_fields.items()]


FORM.append(("stall", "Stall and slow-job detection (empty = server default)", stall_inputs()))


def slurm_inputs() -> list[tuple]:
    """The Slurm allocation's rows of FORM, from SlurmSpec's declaration (its descriptions are the help)."""
    from tokenpulse.protocol import SlurmSpec
    labels = {"qos": "QOS", "time_limit_min": "Time limit (min)", "mem_gb": "Memory per node (GB)",
              "cpus_per_node": "CPUs per node", "gpus_per_node": "GPUs per node",
              "signal_before_s": "Warning before the limit (s)"}
    return [(f"slurm.{leaf}", labels.get(leaf) or label_for(leaf), field_kind(f.annotation)[0],
             sentence(f.description or "")) for leaf, f in SlurmSpec.model_fields.items()]


FORM.append(("slurm", "Slurm allocation (only for a Slurm executor; empty = its defaults)", slurm_inputs()))


@router.get("/submit", response_class=HTMLResponse)
def submit_page(request: Request, clone: int | None = None):
    return page(request, "submit.html", clone=clone, groups=form_fields())


@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request):
    return page(request, "sweeps.html")


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: int):
    return page(request, "sweep.html", sweep_id=sweep_id)


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request):
    return page(request, "compare.html")


@router.get("/alerts", response_class=HTMLResponse)
def alerts_page(request: Request):
    return page(request, "alerts.html")


@router.get("/workers", response_class=HTMLResponse)
def workers_page(request: Request):
    return page(request, "workers.html")
