"""A small local server that speaks the Hugging Face Hub's HTTP API to the real `huggingface_hub`
client (point HF_ENDPOINT at it). It serves the endpoints the installed client calls to resolve and
download a repo: repo info `/api/{models|datasets}/{repo}[/revision/{rev}]`, the recursive tree
listing `/api/{type}s/{repo}/tree/{rev}[/{path}]` (recursive or one level with folders, which is how
`datasets`' streaming globs data files through HfFileSystem), and file resolve
`[/datasets]/{repo}/resolve/{rev}/{path}` (HEAD with X-Repo-Commit, ETag/X-Linked-Etag,
Content-Length/X-Linked-Size; GET streams the bytes). `requests` records every request line.

Unknown repos and revisions answer 404 with the Hub's X-Error-Code, so the client raises its real
RepositoryNotFoundError / RevisionNotFoundError. A repo can be private (needs `Bearer <token>`),
downloads can be throttled (`chunk_delay_s`) and every GET is counted (`downloads`).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, unquote, urlparse

CHUNK = 64 * 1024


@dataclass
class Repo:
    files: dict[str, bytes]
    token: Optional[str] = None  # private: this bearer token is needed
    info: dict = field(default_factory=dict)  # extra fields of the info answer (e.g. config)

    @property
    def sha(self) -> str:
        h = hashlib.sha1()
        for p in sorted(self.files):
            h.update(p.encode() + b"\0" + hashlib.sha256(self.files[p]).digest())
        return h.hexdigest()


def tree(repo: Repo, sub: str, recursive: bool) -> list[dict]:
    """Tree entries under `sub` as the Hub lists them: files, and folders when not recursive."""
    out, folders = [], set()
    prefix = sub + "/" if sub else ""
    for p, b in sorted(repo.files.items()):
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix):]
        if "/" in rest and not recursive:
            folders.add(prefix + rest.split("/", 1)[0])
            continue
        out.append({"type": "file", "path": p, "size": len(b),
                    "oid": hashlib.sha1(b"blob %d\0" % len(b) + b).hexdigest()})
    if recursive:  # folders on every level, as the Hub lists them
        for p in repo.files:
            if p.startswith(prefix):
                parts = p[len(prefix):].split("/")[:-1]
                folders.update(prefix + "/".join(parts[:k + 1]) for k in range(len(parts)))
    out += [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in sorted(folders)]
    return out


class HubFixture:
    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}  # (models|datasets, id) -> Repo
        self.chunk_delay_s = 0.0
        self.downloads: list[str] = []  # paths of file GETs, in order
        self.requests: list[str] = []  # every request line, for reading what the client asked
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def add(self, kind: str, repo_id: str, files: dict[str, bytes], **kw) -> Repo:
        repo = Repo(files, **kw)
        self.repos[(kind, repo_id)] = repo
        return repo

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- request handling --------------------------------------------------------------------
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            # -- helpers
            def _send(self, code: int, body: bytes = b"", headers: Optional[dict] = None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _json(self, obj, head=False):
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

            def _error(self, code: str, msg: str, head=False):
                self._send(404, json.dumps({"error": msg}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": msg}, head)

            def _repo(self, kind: str, repo_id: str, head: bool) -> Optional[Repo]:
                repo = hub.repos.get((kind, repo_id))
                if repo is None:
                    self._error("RepoNotFound", "Repository not found", head)
                    return None
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._send(401, b'{"error":"Invalid username or password."}',
                               {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound",
                                "X-Error-Message": "Invalid username or password."}, head)
                    return None
                return repo

            def _rev_ok(self, repo: Repo, rev: str, head: bool) -> bool:
                if rev in ("main", repo.sha):
                    return True
                self._error("RevisionNotFound", f"Invalid rev id: {rev}", head)
                return False

            def _route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                with hub.lock:
                    hub.requests.append(f"{self.command} {self.path}")
                m = re.fullmatch(r"/api/(models|datasets)/(.+?)(?:/revision/([^/]+))?", path)
                if m and "/tree/" not in path:
                    kind, repo_id, rev = m.group(1), m.group(2), m.group(3) or "main"
                    repo = self._repo(kind, repo_id, head)
                    if repo and self._rev_ok(repo, rev, head):
                        self._json({"id": repo_id, "sha": repo.sha, "private": bool(repo.token),
                                    "siblings": [{"rfilename": p} for p in sorted(repo.files)], **repo.info}, head)
                    return
                m = re.fullmatch(r"/api/(models|datasets)/(.+?)/tree/([^/]+)(/.*)?", path)
                if m:
                    kind, repo_id, rev = m.group(1), m.group(2), m.group(3)
                    repo = self._repo(kind, repo_id, head)
                    if repo and self._rev_ok(repo, rev, head):
                        recursive = parse_qs(urlparse(self.path).query).get("recursive", ["false"])[0] == "true"
                        self._json(tree(repo, (m.group(4) or "").strip("/"), recursive), head)
                    return
                m = re.fullmatch(r"/(datasets/)?(.+?)/resolve/([^/]+)/(.+)", path)
                if m:
                    kind = "datasets" if m.group(1) else "models"
                    repo_id, rev, fpath = m.group(2), m.group(3), m.group(4)
                    repo = self._repo(kind, repo_id, head)
                    if not repo or not self._rev_ok(repo, rev, head):
                        return
                    body = repo.files.get(fpath)
                    if body is None:
                        self._error("EntryNotFound", f"{fpath} does not exist", head)
                        return
                    etag = f'"{hashlib.sha256(body).hexdigest()}"'
                    headers = {"X-Repo-Commit": repo.sha, "ETag": etag, "X-Linked-Etag": etag,
                               "X-Linked-Size": str(len(body)), "Accept-Ranges": "bytes",
                               "Content-Type": "application/octet-stream"}
                    if head:
                        self._send(200, body, headers, head=True)
                        return
                    with hub.lock:
                        hub.downloads.append(f"{kind}/{repo_id}/{fpath}")
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for i in range(0, len(body), CHUNK):
                        self.wfile.write(body[i:i + CHUNK])
                        self.wfile.flush()
                        if hub.chunk_delay_s:
                            time.sleep(hub.chunk_delay_s)
                    return
                self._send(404, b'{"error":"not found"}', {"Content-Type": "application/json"}, head)

        return Handler


def tiny_model_files(tmp_dir, chat_template: Optional[str] = None) -> dict[str, bytes]:
    """A tiny Llama (config + safetensors) with the demo tokenizer files, as a Hub repo's files."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from worker.training.data import DEMO_DIR
    from worker.training.modeling import builtin_config
    tok = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    if chat_template:
        tok.chat_template = chat_template
    torch.manual_seed(0)
    model = LlamaForCausalLM(builtin_config(len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    model.save_pretrained(tmp_dir)
    tok.save_pretrained(tmp_dir)
    from pathlib import Path
    root = Path(tmp_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
