"""Submit-time checks of a job spec against the server's files, so a typo fails in the 4xx of the
submit, not ten minutes into a run. Cheap: reads a header or a first line, never the whole data.

Only regular files are opened (a FIFO or a device named as a config would block the reader), reads
are bounded in size, and the whole check runs on a worker thread with a time limit
(`check_spec_async`), so a slow or hostile path can never hold the server's event loop."""
from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from server.hubcheck import check_hub_repo
from server.settings import Settings
from tokenpulse.errors import SpecError
from tokenpulse.hubid import hub_repo_id
from tokenpulse.protocol import BUILTIN_DATASET, BUILTIN_MODEL, CommandSpec, JobSpec

DATA_SUFFIXES = {".jsonl", ".json", ".csv", ".parquet", ".txt"}
HEAD_BYTES = 1 << 20  # enough for a header, a first JSON line or a config; never the whole data
CHECK_TIMEOUT_S = 20.0


# A field the file checks refused is set aside to check the rest; these are judged against it (a
# column against the dataset), so they go with it rather than be checked against the default.
DEPENDS_ON = {"dataset": ("text_field", "prompt_field", "response_field", "messages_field", "dataset_config",
                          "dataset_split", "dataset_revision", "eval_dataset", "eval_split"),
              "model": ("revision",)}
MAX_ROUNDS = 6


def every_spec_error(body: dict, model, settings: Settings, set_aside=()) -> list[dict]:
    """All the file checks' errors of a submit in one answer, not one per round: after a field fails
    (or failed the schema: set_aside), it is put back to its default and the rest checked again."""
    body = {k: v for k, v in body.items() if k not in set_aside}
    found: list[dict] = []
    from pydantic import ValidationError
    for _ in range(MAX_ROUNDS):
        try:
            spec = model.model_validate(body)
        except ValidationError:
            return found
        try:
            check_spec(spec, settings)
            return found
        except SpecError as e:
            found += [x for x in e.errors if x not in found]
            top = e.field.split(".")[0]
            if top not in body:
                return found
            for k in (top, *DEPENDS_ON.get(top, ())):
                body.pop(k, None)
    return found


async def every_spec_error_async(body: dict, model, settings: Settings, set_aside=(),
                                 timeout: float = CHECK_TIMEOUT_S) -> list[dict]:
    try:
        return await asyncio.wait_for(asyncio.to_thread(every_spec_error, body, model, settings, set_aside), timeout)
    except asyncio.TimeoutError:
        return []


def confined(settings: Settings, raw: str, field: str) -> Path:
    """Resolve a user-given path; refuse it outside the configured roots (symlinks resolved first)."""
    try:
        path = Path(raw).expanduser()
        real = path.resolve()  # symlinks followed: a link inside a root pointing out of it is refused
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long...
        raise SpecError(field, f"{raw!r} is not a usable path: {e}") from None
    if settings.path_roots:
        roots = [Path(r).resolve() for r in settings.path_roots]
        if not any(real == r or r in real.parents for r in roots):
            raise SpecError(field, f"{raw!r} is outside the allowed roots ({', '.join(map(str, roots))})")
    return real


def quotable(settings: Settings, path: str) -> bool:
    """May an error message quote this dataset's content (its columns, keys, first line)? Only a
    file under the configured path roots, which the operator opened to every user: without roots,
    a submit may name any file the server can read, and its column names (`db_password`) are not
    the submitter's to see. The builtin dataset is ours; a Hub dataset is not read here."""
    if path == BUILTIN_DATASET or not os.path.isabs(path):
        return path == BUILTIN_DATASET or hub_repo_id(path, "dataset") is not None
    if not settings.path_roots:
        return False
    real = Path(os.path.realpath(path))
    return any(real == r or r in real.parents for r in (Path(os.path.realpath(x)) for x in settings.path_roots))


def has_columns(settings: Settings, path: str, columns: list[str]) -> str:
    """' (it has: a, b)' for a dataset whose content may be quoted, else how to get them listed."""
    if quotable(settings, path):
        return f" (it has: {', '.join(columns)})"
    return (" (its columns are listed only for files under the server's path roots, "
            "TOKENPULSE_PATH_ROOTS)")


def read_head(path: Path, field: str, limit: int = HEAD_BYTES) -> bytes:
    """The first `limit` bytes of a regular file. O_NONBLOCK: opening a FIFO for reading would wait
    for a writer forever; with it the open returns and fstat says what the path really is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise SpecError(field, f"cannot open {str(path)!r}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecError(field, f"{str(path)!r} is not a regular file")
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 16))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    except OSError as e:
        raise SpecError(field, f"cannot read {str(path)!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_json(path: Path, field: str) -> object:
    raw = read_head(path, field)
    if len(raw) >= HEAD_BYTES:
        raise SpecError(field, f"{str(path)!r} is larger than {HEAD_BYTES >> 20} MiB: not a config file")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise SpecError(field, f"{str(path)!r} is not valid JSON: {e}") from None


def needs_remote_code(model_dir: Path) -> bool:
    """A model whose config or tokenizer config maps classes to its own modules (auto_map)."""
    for name in ("config.json", "tokenizer_config.json"):
        if not os.path.lexists(model_dir / name):
            continue
        try:
            cfg = read_json(model_dir / name, "model")
        except SpecError as e:
            raise SpecError("model", f"cannot read {name} of {str(model_dir)!r}: {e}") from None
        if isinstance(cfg, dict) and cfg.get("auto_map"):
            return True
    return False


# A plain `env` value is stored and shown: a name that says "credential" belongs in secret_env (the
# agent passes its own value on, masked, never stored). Names, not values: TOKENIZERS_PARALLELISM is
# not a token, HF_TOKEN and WANDB_API_KEY are.
CREDENTIAL_ENV = re.compile(r"(?:^|_)(?:TOKEN|SECRET|KEY|APIKEY|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)(?:_|$)"
                            r"|PASSWORD|SECRET|API_?KEY", re.IGNORECASE)


def check_command(spec: CommandSpec, settings: Settings) -> CommandSpec:
    """A command's plain env holds no credential-looking name; its working directory is confined
    like dataset paths: resolved, under path_roots, an existing directory (on the server's machine;
    the agent resolves and checks it again when it starts the command)."""
    for name in spec.env:
        if CREDENTIAL_ENV.search(name):
            raise SpecError(f"env.{name}", f"{name} looks like a credential: plain env values are stored and shown "
                                           f"on the job page. Give its name in secret_env instead (the agent passes "
                                           f"on its own {name}, masked in output, never sent to the server)")
    if spec.cwd is None:
        return spec
    cwd = confined(settings, spec.cwd, "cwd")
    if not cwd.is_dir():
        raise SpecError("cwd", f"working directory {spec.cwd!r} " + (
            "is not a directory" if cwd.exists() else "does not exist on the server's machine") +
            " (give the directory holding your script, as the workers see it)")
    return spec.model_copy(update={"cwd": str(cwd)})


# Two lanes of threads for the checks, neither the loop's default executor (which every to_thread
# shares): a spec naming a Hub repo waits on the Hub, which may be slow or drip its answer for
# minutes; the others (builtin, local files, command jobs) never queue behind one of those.
LOCAL_LANE = ThreadPoolExecutor(max_workers=4, thread_name_prefix="check-local")
HUB_LANE = ThreadPoolExecutor(max_workers=4, thread_name_prefix="check-hub")


def hub_field(spec) -> Optional[str]:
    """The field of a spec that names a Hub repo (checked on the Hub), or None."""
    if isinstance(spec, JobSpec):
        if spec.model != BUILTIN_MODEL and hub_repo_id(spec.model, "model"):
            return "model"
        if spec.dataset != BUILTIN_DATASET and hub_repo_id(spec.dataset, "dataset"):
            return "dataset"
    return None


async def check_spec_async(spec, settings: Settings, timeout: float = CHECK_TIMEOUT_S):
    """check_spec off the event loop, with a time limit (a hung network mount answers 422, not a
    server that stops answering everyone), in its lane (a slow Hub holds only Hub submits)."""
    hub = hub_field(spec)
    if hub:
        timeout = min(timeout, getattr(settings, "hub_check_timeout_s", timeout))
    try:
        lane = HUB_LANE if hub else LOCAL_LANE
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(lane, check_spec, spec, settings),
                                      timeout)
    except asyncio.TimeoutError:
        if hub:
            raise SpecError(hub, f"the Hub did not answer within {timeout:.0f} s (a slow or unreachable "
                                 "HF_ENDPOINT?); try again, or give a local path") from None
        field = "cwd" if isinstance(spec, CommandSpec) else "dataset"
        raise SpecError(field, f"checking the paths took longer than {timeout:.0f} s "
                               "(a slow or hung filesystem?)") from None
    except SpecError as e:
        if isinstance(spec, CommandSpec):
            raise
        # the model and the dataset can both be wrong: name both now, not one per submit
        found = await every_spec_error_async(spec.model_dump(exclude_unset=True), JobSpec, settings, timeout=timeout)
        errors = e.errors + [x for x in found if x not in e.errors]
        raise SpecError(e.field, e.message, errors) from None


def check_spec(spec, settings: Settings):
    """A JobSpec's model and dataset, or a CommandSpec's working directory, checked against the
    server's files; returns the spec with its paths resolved."""
    try:
        if isinstance(spec, CommandSpec):
            return check_command(spec, settings)
        return _check_spec(spec, settings)
    except OSError as e:  # a name too long, a permission error, an I/O error: the user's to fix
        if isinstance(spec, CommandSpec):
            field = "cwd"
        else:
            field = "dataset" if spec.dataset in str(getattr(e, "filename", "")) else "model"
        raise SpecError(field, f"cannot use {str(getattr(e, 'filename', '') or 'the path')!r}: "
                               f"{e.strerror or e}") from None


def _check_spec(spec: JobSpec, settings: Settings) -> JobSpec:
    model_repo = hub_repo_id(spec.model, "model") if spec.model != BUILTIN_MODEL else None
    if model_repo:  # a Hub id: resolved on the Hub (or, offline, in the cache); agents download it
        check_hub_repo(model_repo, "model", spec.revision, "model", "revision", spec.hub_token_secret,
                       settings.allow_remote_code)
    elif spec.model != BUILTIN_MODEL:
        model = confined(settings, spec.model, "model")
        if not model.is_dir():
            raise SpecError("model", f"model directory {spec.model!r} does not exist "
                                     f"(give a local Hugging Face model directory or {BUILTIN_MODEL})")
        if not (model / "config.json").is_file():
            raise SpecError("model", f"{spec.model!r} has no config.json: not a Hugging Face model directory")
        if needs_remote_code(model) and not settings.allow_remote_code:
            raise SpecError("model", f"{spec.model!r} ships its own Python code (auto_map in its config), which "
                                     "would need trust_remote_code; this server does not run a model's code "
                                     "unless its operator allows it (TOKENPULSE_ALLOW_REMOTE_CODE)")
        spec = spec.model_copy(update={"model": str(model)})
    if spec.lora is not None and spec.lora.load_in_4bit and spec.device == "cpu":
        raise SpecError("lora.load_in_4bit", "4-bit QLoRA needs a CUDA GPU; this job is pinned to the CPU")
    data_repo = hub_repo_id(spec.dataset, "dataset") if spec.dataset != BUILTIN_DATASET else None
    if spec.dataset == BUILTIN_DATASET:
        columns: Optional[list[str]] = ["text"]
    elif data_repo:  # its columns are checked by the worker once downloaded
        check_hub_repo(data_repo, "dataset", spec.dataset_revision, "dataset", "dataset_revision",
                       spec.hub_token_secret)
        columns = None
    else:
        data = confined(settings, spec.dataset, "dataset")
        spec = spec.model_copy(update={"dataset": str(data)})
        columns = dataset_columns(data)
    wanted = [("text_field", spec.text_field), ("prompt_field", spec.prompt_field),
              ("response_field", spec.response_field), ("messages_field", spec.messages_field)]
    if columns is not None:
        for field, name in wanted:
            if name and name not in columns:
                raise SpecError(field,
                                f"column {name!r} is not in the dataset{has_columns(settings, spec.dataset, columns)}")
        named = any(name for _, name in wanted)
        alpaca = "instruction" in columns and "output" in columns
        if not named and not ({"text", "messages"} & set(columns) or alpaca):
            raise SpecError("text_field", f"the dataset has no 'text' column (nor 'messages' for chats, nor "
                                          f"'instruction'+'output'); name one with text_field, messages_field or "
                                          f"prompt_field/response_field{has_columns(settings, spec.dataset, columns)}")
        if spec.messages_field or not named and "messages" in columns:
            check_chat_template(spec)
        if spec.loss_on_response_only is None:  # unset: on where the data has a prompt to mask
            spec = spec.model_copy(update={"loss_on_response_only": has_prompt(spec, columns)})
    if spec.eval_dataset:
        spec = check_eval_dataset(spec, settings, [name for _, name in wanted if name], columns)
    return spec


def has_prompt(spec: JobSpec, columns: list[str]) -> bool:
    """Does the data hold a prompt (prompt/response, Alpaca, a chat) rather than plain text? The
    columns the training process picks, in its order (worker/training/data.py resolve_fields)."""
    if spec.messages_field or spec.prompt_field:
        return True
    if spec.text_field:
        return False
    if "messages" in columns:
        return True
    return "text" not in columns and "instruction" in columns and "output" in columns


def check_chat_template(spec: JobSpec) -> None:
    """Chat data is rendered with the tokenizer's chat template: a model without one fails here."""
    if hub_repo_id(spec.model, "model"):
        return  # a Hub model's tokenizer is checked by the worker once downloaded
    if spec.model == BUILTIN_MODEL:
        has = False
    else:
        model = Path(spec.model)
        cfg = read_json(model / "tokenizer_config.json", "model") if (model / "tokenizer_config.json").is_file() else {}
        has = (isinstance(cfg, dict) and bool(cfg.get("chat_template"))) or any(
            (model / f).is_file() for f in ("chat_template.jinja", "chat_template.json")) or (
            model / "additional_chat_templates").is_dir()
    if not has:
        raise SpecError("model", f"the dataset holds chats (messages) but the tokenizer of {spec.model!r} has no "
                                 "chat template: use a chat/instruct model, add a chat_template to its "
                                 "tokenizer, or name plain-text columns with text_field")


def check_eval_dataset(spec: JobSpec, settings: Settings, named: list[str], train_columns) -> JobSpec:
    """The evaluation file: an allowed local path, readable, holding the fields training reads
    (the named ones, or the same kind of data the training set has: text, messages or Alpaca)."""
    path = confined(settings, spec.eval_dataset, "eval_dataset")
    try:
        columns = dataset_columns(path)
    except SpecError as e:
        raise SpecError("eval_dataset", e.message) from None
    if columns is not None:
        # a Hub training set's columns are not known here: then only named fields are checked
        auto = [c for c in ("text", "messages", "instruction", "output") if c in (train_columns or [])]
        missing = [f for f in (named or auto[:1]) if f not in columns]
        if missing:
            raise SpecError("eval_dataset", f"the evaluation dataset has no column {missing[0]!r} "
                                            f"{has_columns(settings, str(path), columns)}")
    return spec.model_copy(update={"eval_dataset": str(path)})


def dataset_columns(path: Path) -> Optional[list[str]]:
    """Column names of a local dataset, or None where it has none (plain text: one 'text' column)."""
    if path.is_dir():
        for info in (path / "dataset_info.json", *path.glob("*/dataset_info.json")):
            if info.is_file():
                meta = read_json(info, "dataset")
                features = meta.get("features") if isinstance(meta, dict) else None
                if not isinstance(features, dict):
                    raise SpecError("dataset", f"{str(info)!r} has no 'features' mapping: not a dataset "
                                               "saved with save_to_disk, or a damaged one")
                return list(features)
        raise SpecError("dataset", f"{str(path)!r} is a directory but not a dataset saved with save_to_disk")
    if not path.exists():
        raise SpecError("dataset", f"dataset file {str(path)!r} does not exist")
    if not os.access(path, os.R_OK):
        raise SpecError("dataset", f"dataset file {str(path)!r} is not readable")
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise SpecError("dataset", f"unsupported dataset type {suffix!r}; use one of {sorted(DATA_SUFFIXES)}")
    if suffix == ".parquet":
        read_head(path, "dataset", limit=4)  # a regular file (pyarrow would block on a FIFO)
        try:
            import pyarrow.parquet as pq
            return list(pq.read_schema(path).names)
        except Exception as exc:  # malformed: say so at submit time
            raise SpecError("dataset", f"cannot read {str(path)!r} as parquet: {exc}") from None
    head = read_head(path, "dataset")
    if not head.strip():
        raise SpecError("dataset", f"dataset file {str(path)!r} is empty")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut by the read limit
            raise SpecError("dataset", f"dataset file {str(path)!r} is not UTF-8 text "
                                       f"(byte {e.start}): a binary file?") from None
        text = head[:e.start].decode("utf-8")
    if "\x00" in text:
        raise SpecError("dataset", f"dataset file {str(path)!r} contains NUL bytes: a binary file, not text")
    if suffix == ".txt":
        return ["text"]
    if suffix in (".jsonl", ".json"):
        if len(head) >= HEAD_BYTES and "\n" not in text:
            return None  # a first line over the read limit: its columns are checked by the worker
        first = next((line for line in text.splitlines() if line.strip()), "")
        try:
            row = json.loads(first)
        except ValueError as e:
            raise SpecError("dataset", f"the first line of {str(path)!r} is not a JSON object: {e}") from None
        if not isinstance(row, dict):
            raise SpecError("dataset", "each JSON line must be an object with named fields")
        return list(row)
    header = next(csv.reader(io.StringIO(text, newline="")), None)
    if not header:
        raise SpecError("dataset", f"dataset file {str(path)!r} is empty")
    return header
