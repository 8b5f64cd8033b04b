"""Submit-time check of a Hub model or dataset id: it must resolve on the Hub (HF_ENDPOINT), asked
with huggingface_hub's own model_info/dataset_info (a time limit per call; validate.check_spec_async
runs it off the event loop). In offline mode (HF_HUB_OFFLINE) the server's HF cache is checked
instead (agents and server share it when they share HF_HOME)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from tokenpulse.errors import SpecError

HUB_TIMEOUT_S = 10.0


def check_hub_repo(repo_id: str, kind: str, revision: Optional[str], field: str, rev_field: str,
                   token_secret: Optional[str], allow_remote_code: bool = True) -> None:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
    if constants.HF_HUB_OFFLINE:
        return _check_cache(repo_id, kind, revision, field)
    token = None
    if token_secret:
        token = os.environ.get(f"TOKENPULSE_SECRET_{token_secret.upper()}")
        if not token:
            return  # only the agents hold this secret: they check the repo when they download it
    api = HfApi()
    what = f"{kind} {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        get = api.model_info if kind == "model" else api.dataset_info
        info = get(repo_id, revision=revision, timeout=HUB_TIMEOUT_S, token=token)
    except GatedRepoError:
        return  # exists; whether an agent's token may read it is the agent's to say
    except RevisionNotFoundError:
        raise SpecError(rev_field, f"{what}: no such revision on the Hub ({api.endpoint})") from None
    except RepositoryNotFoundError:
        raise SpecError(field, f"{repo_id!r} is neither a local path nor a {kind} on the Hub ({api.endpoint}); "
                               "if it is private, give the agents a token (HF_TOKEN, or the job's "
                               "hub_token_secret)") from None
    except Exception as e:  # noqa: BLE001 -- unreachable Hub, timeout, a proxy error: still the user's 422
        raise SpecError(field, f"cannot check {what} on the Hub ({api.endpoint}): {type(e).__name__}: {e}") from None
    config = getattr(info, "config", None) or {}
    if kind == "model" and not allow_remote_code and isinstance(config, dict) and config.get("auto_map"):
        raise SpecError(field, f"{repo_id!r} ships its own Python code (auto_map in its config), which would "
                               "need trust_remote_code; this server does not run a model's code unless its "
                               "operator allows it (TOKENPULSE_ALLOW_REMOTE_CODE)")


def _check_cache(repo_id: str, kind: str, revision: Optional[str], field: str) -> None:
    from huggingface_hub import constants
    folder = Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo_id.replace('/', '--')}"
    rev = revision or "main"
    if (folder / "refs" / rev).is_file() or (folder / "snapshots" / rev).is_dir():
        return
    raise SpecError(field, f"{kind} {repo_id!r}{'@' + revision if revision else ''} is not in the Hugging Face "
                           f"cache ({constants.HF_HUB_CACHE}) and offline mode (HF_HUB_OFFLINE) is on")
