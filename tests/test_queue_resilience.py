"""One bad number must never block the queue: non-finite numbers are refused at submit (422 naming
the field), and a stored spec that no longer validates fails its own job at claim while the next
job is handed out."""
from __future__ import annotations

import pytest

QUICK = {"max_steps": 5, "batch_size": 2, "grad_accum": 1, "max_seq_length": 64, "precision": "fp32"}


@pytest.mark.parametrize("body, field", [
    ('{"weight_decay": 1e999}', "weight_decay"),
    ('{"epochs": Infinity}', "epochs"),
    ('{"learning_rate": NaN}', "learning_rate"),
    ('{"stall": {"floor_s": 1e999}}', "stall.floor_s"),
    ('{"lora": {"alpha": -Infinity}}', "lora.alpha"),
])
def test_non_finite_numbers_are_refused_at_submit(server, body, field):
    with server.client() as c:
        r = c.post("/api/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["detail"]["field"] == field, r.text
        assert "finite" in r.text
        assert c.get("/api/jobs").json()["total"] == 0  # nothing stored


def test_clone_with_infinity_is_refused(server):
    with server.client() as c:
        jid = c.post("/api/jobs", json=QUICK).json()["id"]
        r = c.post(f"/api/jobs/{jid}/clone", content='{"changes": {"weight_decay": Infinity}}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert "weight_decay" in r.text
        assert c.get("/api/jobs").json()["total"] == 1
        r = c.post(f"/api/jobs/{jid}/clone", json={"set": {"seed": 1}})  # misspelt key: said so, not ignored
        assert r.status_code == 422 and "set" in r.text, r.text
        assert c.get("/api/jobs").json()["total"] == 1


def test_a_stored_spec_that_does_not_validate_fails_alone(server):
    with server.client() as c:
        bad = c.post("/api/jobs", json={**QUICK, "name": "bad", "priority": 5}).json()["id"]
        good = c.post("/api/jobs", json={**QUICK, "name": "good"}).json()["id"]
    # What the old bug stored for weight_decay=1e999 (JSON has no infinity): null.
    set_null = ("jsonb_set(spec::jsonb, '{weight_decay}', 'null'::jsonb)::text" if server.on_postgres
                else "json_set(spec, '$.weight_decay', json('null'))")
    server.query(f"UPDATE jobs SET spec = {set_null} WHERE id = ?", (bad,), write=True)
    server.start_agent("a1")
    failed = server.wait_job(bad, timeout=60)
    assert failed["state"] == "failed" and failed["failure"] == "spec", failed
    assert "weight_decay" in failed["reason"], failed["reason"]
    done = server.wait_job(good, timeout=180)
    assert done["state"] == "completed", done


def test_a_huge_spec_error_fails_once_and_is_never_retried(agent_server):
    # 1,000 missing LoRA modules: the training process's error names them all (~30k characters,
    # past the 8,192 an event may carry). It must still say "spec", and a spec error is final.
    modules = [f"no_such_projection_number_{i:04d}" for i in range(1000)]
    with agent_server.client() as c:
        jid = c.post("/api/jobs", json={**QUICK, "max_retries": 3, "lora": {"target_modules": modules}}).json()["id"]
        job = agent_server.wait_job(jid, timeout=180)
        assert job["state"] == "failed" and job["failure"] == "spec", job
        assert "no_such_projection_number_0000" in job["reason"] and "more characters" in job["reason"]
        assert len(job["attempts"]) == 1, job["attempts"]
        r = c.post("/api/jobs", json={**QUICK, "lora": {"target_modules": modules + ["one_too_many"]}})
        assert r.status_code == 422 and "lora.target_modules" in r.text, r.text
