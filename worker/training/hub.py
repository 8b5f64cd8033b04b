"""Hub models and datasets: download a repo into the HF cache as a `downloading` phase with bytes
done/total and speed, so a slow or stuck download is seen (the stall detector watches its counter).

The cache is shared: the agent's jobs all get `--cache-dir`, and HF_HOME defaults to `<cache-dir>/hf`
(an HF_HOME already set wins). A repo already cached downloads nothing (its phase says so). Offline
mode (HF_HUB_OFFLINE=1) uses the cache only. The token is HF_TOKEN from the environment, or the
secret the job names (`hub_token_secret` -> env TOKENPULSE_SECRET_<NAME> on the agent); it is never
put in an event or a message.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from tokenpulse.errors import SpecError
from tokenpulse.hubid import hub_repo_id
from tokenpulse.protocol import JobSpec

PHASE = "downloading"
TICK_S = 0.5
# Weights in other frameworks' formats are never needed: the worker loads safetensors or torch files.
SKIP_ALWAYS = ["*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.ot", "*.tflite", "*.mlmodel", "*.gguf",
               "*.pth", "original/*", "onnx/*", "coreml/*", "openvino/*", ".gitattributes"]
_resolved: dict[tuple, Path] = {}


def use_shared_cache(cache_dir: Optional[Path]) -> None:
    """HF_HOME under the agent's shared cache dir unless the environment already says where."""
    if cache_dir is None or os.environ.get("HF_HOME") or os.environ.get("HF_HUB_CACHE"):
        return
    if "huggingface_hub" in sys.modules:  # its constants are read at import: too late to redirect
        return
    os.environ["HF_HOME"] = str(Path(cache_dir).resolve() / "hf")


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def hub_token(spec: JobSpec):
    """The secret the job names, else None (huggingface_hub then uses HF_TOKEN / its stored login)."""
    if not spec.hub_token_secret:
        return None
    env = f"TOKENPULSE_SECRET_{spec.hub_token_secret.upper()}"
    tok = os.environ.get(env)
    if not tok:
        raise SpecError("hub_token_secret",
                        f"the job names the secret {spec.hub_token_secret!r} but this worker has none "
                        f"(set {env} in the agent's environment)")
    return tok


def model_repo(spec: JobSpec) -> Optional[str]:
    return hub_repo_id(spec.model, "model")


def dataset_repo(spec: JobSpec) -> Optional[str]:
    return hub_repo_id(spec.dataset, "dataset")


class _ByteCounter:
    """Shared by the tqdm bars huggingface_hub opens: it keeps the largest byte count any bar saw
    (the transfer and reconstruction bars count the same bytes for plain HTTP)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_bar: dict[int, float] = {}

    def add(self, bar: int, n: float) -> None:
        with self.lock:
            self.by_bar[bar] = self.by_bar.get(bar, 0) + n

    @property
    def done(self) -> float:
        with self.lock:
            return max(self.by_bar.values(), default=0)


def _tqdm_class(counter: _ByteCounter):
    from tqdm import tqdm

    class Counting(tqdm):
        """A silent bar that only counts bytes (our phase events are the progress display)."""

        def __init__(self, *a, **kw):
            kw["disable"] = True
            kw.pop("name", None)
            self._bytes = kw.get("unit") == "B"
            super().__init__(*a, **kw)

        def update(self, n=1):
            if self._bytes and n:
                counter.add(id(self), n)
            return super().update(n)

    return Counting


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _errors():
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    return GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError


def fetch(repo_id: str, repo_type: str, revision: Optional[str], em, field: str, token=None,
          ignore: Optional[list] = None) -> Path:
    """The repo's snapshot directory in the cache, downloaded first if needed, with progress events."""
    key = (repo_type, repo_id, revision)
    if key in _resolved:
        return _resolved[key]
    from huggingface_hub import constants, snapshot_download
    gated, local_missing, not_found, bad_rev = _errors()
    what = f"{repo_type} {repo_id}" + (f"@{revision}" if revision else "")
    kw = dict(repo_id=repo_id, repo_type=repo_type, revision=revision, token=token,
              ignore_patterns=ignore or None)
    try:
        if constants.HF_HUB_OFFLINE:
            em.phase(PHASE, done=0, total=0, unit="bytes", detail=f"{what}: offline mode, from the local cache")
            path = Path(snapshot_download(local_files_only=True, **kw))
            _resolved[key] = path
            return path
        from huggingface_hub import HfApi
        # Ask for the repo first: its errors are the real ones (a dry run wraps them), with their field.
        HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision, token=token)
        quiet = _tqdm_class(_ByteCounter())
        plan = snapshot_download(dry_run=True, tqdm_class=quiet, **kw)
        todo = [f for f in plan if f.will_download]
        total = float(sum(f.file_size or 0 for f in todo))
        if not todo:
            em.phase(PHASE, done=0, total=0, unit="bytes", detail=f"{what}: in the cache, nothing to download")
            path = Path(snapshot_download(tqdm_class=quiet, **kw))
        else:
            path = _download_with_progress(kw, em, what, len(todo), total)
    except local_missing as e:
        raise SpecError(field, f"{what} is not in the local Hugging Face cache and offline mode (HF_HUB_OFFLINE) "
                               f"is on: download it once with the Hub reachable ({type(e).__name__})") from e
    except gated as e:
        raise SpecError(field, f"{what} is gated: accept its terms on the Hub and give a token "
                               "(HF_TOKEN on the agent, or hub_token_secret)") from e
    except bad_rev as e:
        raise SpecError("revision" if field == "model" else field, f"{what}: revision not found on the Hub") from e
    except not_found as e:
        raise SpecError(field, f"{what} not found on the Hub (or it is private: give a token with HF_TOKEN on the "
                               "agent or hub_token_secret), and it is not a local path either") from e
    except Exception as e:  # the Hub unreachable: a cached copy still serves, else a crash (retried)
        try:
            path = Path(snapshot_download(local_files_only=True, **kw))
        except Exception:
            raise e from None
        em.phase(PHASE, done=0, total=0, unit="bytes",
                 detail=f"{what}: the Hub is unreachable ({type(e).__name__}); using the cached copy")
    _resolved[key] = path
    return path


def _download_with_progress(kw: dict, em, what: str, n_files: int, total: float) -> Path:
    from huggingface_hub import snapshot_download
    counter = _ByteCounter()
    stop = threading.Event()
    t0 = time.monotonic()
    em.phase(PHASE, done=0, total=total, unit="bytes", detail=f"{what}: {n_files} files, {_human(total)}")

    def tick():
        last = -1.0
        while not stop.wait(TICK_S):
            done = min(counter.done, total)
            if done != last:  # only movement is progress: a stuck download goes quiet and alerts
                speed = done / max(time.monotonic() - t0, 1e-6)
                em.phase(PHASE, done=done, total=total, unit="bytes",
                         detail=f"{what}: {_human(done)} of {_human(total)} at {_human(speed)}/s")
                last = done

    th = threading.Thread(target=tick, name="download-progress", daemon=True)
    th.start()
    try:
        path = Path(snapshot_download(tqdm_class=_tqdm_class(counter), **kw))
    finally:
        stop.set()
        th.join()
    took = time.monotonic() - t0
    em.phase(PHASE, done=total, total=total, unit="bytes",
             detail=f"{what}: {_human(total)} in {took:.1f} s ({_human(total / max(took, 1e-6))}/s)")
    return path


def fetch_model(spec: JobSpec, em) -> Optional[Path]:
    """The local directory of a Hub model (downloaded into the shared cache), or None for local ones."""
    repo = model_repo(spec)
    if repo is None:
        return None
    if ("model", repo, spec.revision) in _resolved:  # fetched already by this process
        return _resolved[("model", repo, spec.revision)]
    from huggingface_hub import HfApi
    token = hub_token(spec)
    ignore = list(SKIP_ALWAYS)
    try:  # with safetensors weights present, the pickled copies many repos also carry are skipped
        # the repo's info lists its files in one request that fails at once when the Hub is
        # unreachable (list_repo_files retries with backoff: 23 s before the cache could serve)
        info = HfApi().model_info(repo, revision=spec.revision, token=token)
        files = [s.rfilename for s in info.siblings or []]
        if any(f.endswith(".safetensors") for f in files):
            ignore += ["*.bin", "*.pt"]
    except Exception:  # noqa: BLE001 -- fetch() below reports the real error with its field
        pass
    return fetch(repo, "model", spec.revision, em, "model", token, ignore)


def fetch_dataset(spec: JobSpec, em) -> Optional[Path]:
    repo = dataset_repo(spec)
    if repo is None:
        return None
    return fetch(repo, "dataset", spec.dataset_revision, em, "dataset", hub_token(spec))


def commit_of(snapshot: Path) -> str:
    """A snapshot directory is named by its commit: a content address, no need to hash the files."""
    return snapshot.name
