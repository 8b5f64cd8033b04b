"""A failed training job's reason leads with its root cause (issue 25, item 2, the backend part): a
dataset broken at row 1200 fails as "JSON parse error ... in row 1200", not as datasets' wrapper
"DatasetGenerationError: An error occurred while generating the dataset". Real agent, real training
process, a real .jsonl whose row 1200 is cut."""
from __future__ import annotations

import json


def test_a_dataset_broken_at_row_1200_fails_naming_the_row(agent_server, tmp_path):
    data = tmp_path / "broken.jsonl"
    with data.open("w") as f:
        for i in range(1500):
            f.write('{"text": "cut here\n' if i == 1200 else json.dumps({"text": f"example number {i}"}) + "\n")
    with agent_server.client() as c:
        r = c.post("/api/jobs", json={"dataset": str(data), "max_steps": 3, "max_retries": 0})
        assert r.status_code == 201, r.text  # the header is fine: only reading it all finds row 1200
        job = agent_server.wait_job(r.json()["id"], timeout=180)
        assert job["state"] == "failed" and job["failure"] == "spec", job
        head = job["reason"].splitlines()[0]
        assert f"cannot read dataset {data}: JSON parse error" in head and "in row 1200" in head, head
        assert head.index("row 1200") < head.index("DatasetGenerationError"), head  # the cause first
