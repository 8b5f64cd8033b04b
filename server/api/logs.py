"""A job's whole log: searched (GET /api/jobs/{id}/logs) and downloaded as text
(GET /api/jobs/{id}/logs.txt). Lines are shown without terminal control codes, also those stored
before the agent dropped them. A search is a substring unless regex=true; a regular expression runs
on RE2 (linear time), never on Python's backtracking `re`."""
from __future__ import annotations

import json
import threading
from typing import Iterator, Optional

import re2
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from server.api.jobs import get_job_or_404
from server.context import AppDep
from server.dialect import raw_cursor
from server.errors import unprocessable
from server.security import UserDep
from tokenpulse.terminal import strip_control

router = APIRouter(prefix="/api/jobs", tags=["logs"])
PAGE = 1000  # rows read (and decoded under SCANS) per query while scanning
SCANS = threading.Lock()  # one page decoded at a time, process-wide
RE2_MAX_MEM = 8 << 20  # a pattern's compiled program: a huge repetition is refused, not built


def matcher(grep: Optional[str], regex: bool, case: bool):
    """grep -> a predicate on a line: a substring, or with regex=true a regular expression run by
    RE2 (google-re2), whose time is linear in the line: no pattern can hold the server (Python's
    `re` backtracks: `(a+)+$` over 30 characters takes seconds, with the GIL held). 422 naming `grep`."""
    if not grep:
        return lambda line: True
    if regex:
        options = re2.Options()
        options.case_sensitive = case
        options.log_errors = False
        options.max_mem = RE2_MAX_MEM
        try:
            rx = re2.compile(grep, options)
        except Exception as e:  # re2.error; its message is bytes
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise unprocessable([{"field": "grep", "message": f"not a regular expression RE2 accepts "
                                  f"(no backreferences or lookaround): {why}"}]) from None
        return lambda line: rx.search(line) is not None
    if case:
        return lambda line: grep in line
    low = grep.lower()
    return lambda line: low in line.lower()


def scan(tp, job_id: int, after_seq: int, match) -> Iterator[tuple[list[dict], int, int]]:
    """A job's stored log lines after after_seq, oldest first, a page at a time: (the page's lines
    that match, lines read, the page's last seq). A page is read, decoded and matched under SCANS,
    one page at a time in the whole process: a dozen searches of long logs at once take turns instead
    of each holding a share of the GIL that every other request waits on."""
    while True:
        with SCANS, tp.db.read() as s:
            rows = raw_cursor(s).execute(
                "SELECT seq, t, data FROM events WHERE job_id = ? AND kind = 'log' AND seq > ? "
                f"ORDER BY seq LIMIT {PAGE}", (job_id, after_seq)).fetchall()
            page = []
            for seq, t, data in rows:
                d = json.loads(data)
                line = strip_control(d.get("line", ""))
                if match(line):
                    page.append({"seq": seq, "t": t, "stream": d.get("stream", "stdout"), "line": line})
        if not rows:
            return
        after_seq = rows[-1][0]
        yield page, len(rows), after_seq
        if len(rows) < PAGE:
            return


def checked(tp, job_id: int) -> None:
    with tp.db.read() as s:
        get_job_or_404(s, job_id)


@router.get("/{job_id}/logs")
def search_logs(job_id: int, tp: AppDep, _: UserDep,
                grep: Optional[str] = Query(None, max_length=1000, description="lines containing this text"),
                regex: bool = Query(False, description="grep is a regular expression"),
                case: bool = Query(False, description="grep is case-sensitive"),
                after_seq: int = Query(-1, ge=-1, description="only lines after this event (follow)"),
                limit: int = Query(1000, ge=1, le=100_000),
                tail: bool = Query(True, description="the last `limit` matches (else the first)")) -> dict:
    """A job's log lines, all of them or those matching `grep`: {"lines": [{seq, t, stream, line}],
    "matched": how many matched in all, "scanned": lines read, "last_seq"}."""
    checked(tp, job_id)
    match = matcher(grep, regex, case)
    out: list[dict] = []
    matched = scanned = 0
    last_seq = after_seq
    for page, read, page_end in scan(tp, job_id, after_seq, match):
        scanned, last_seq = scanned + read, page_end
        matched += len(page)
        out.extend(page)
        if tail and len(out) > limit:
            del out[:len(out) - limit]
        elif not tail and len(out) >= limit:
            del out[limit:]
            break
    return {"job_id": job_id, "lines": out, "matched": matched, "scanned": scanned, "last_seq": last_seq}


@router.get("/{job_id}/logs.txt", response_class=StreamingResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "the log as text, one line each"}})
def download_logs(job_id: int, tp: AppDep, _: UserDep,
                  grep: Optional[str] = Query(None, max_length=1000), regex: bool = False, case: bool = False,
                  timestamps: bool = Query(False, description="each line prefixed with its time (UTC) and stream")
                  ) -> StreamingResponse:
    """The whole stored log as a text file (or the lines matching grep)."""
    checked(tp, job_id)
    match = matcher(grep, regex, case)

    def body() -> Iterator[bytes]:
        import time as _t
        buf = []
        for page, _, _ in scan(tp, job_id, -1, match):
            for row in page:
                line = row["line"]
                if timestamps:
                    stamp = _t.strftime("%Y-%m-%dT%H:%M:%S", _t.gmtime(row["t"])) + f".{int(row['t'] % 1 * 1000):03d}Z"
                    line = f"{stamp} {row['stream']}: {line}"
                buf.append(line)
                if len(buf) >= 2000:
                    yield ("\n".join(buf) + "\n").encode()
                    buf = []
        if buf:
            yield ("\n".join(buf) + "\n").encode()
    return StreamingResponse(body(), media_type="text/plain; charset=utf-8",
                             headers={"Content-Disposition": f'attachment; filename="job-{job_id}.log"'})
