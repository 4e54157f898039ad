"""`rlbus tinker` killed with SIGKILL and started again on the same port and directory, while the `tinker` SDK's
clients of the first process go on (tinker 0.38.0, unmodified; the shipped tiny model).

What a user relies on: a training client whose model was saved (`save_state`) and not changed since goes on after
the restart as if nothing happened: the same weights, the same AdamW moments (its next step equals that of a client
made from the state before the kill), its seq_ids where they were; a request sent while the service is down goes
through once it is back; a sampling client samples the same tokens, and a sample that was running when the
service died is sent again by the SDK (410: a lost promise) and comes back whole; a model that trained since its
last save is not
silently rolled back: its requests fail with NotFoundError naming the state to resume from, and a client made from
that state (`create_training_client_from_state_with_optimizer`) goes on.

    .venv/bin/python -m pytest -q tests/integration/test_tinker_resume.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlbus.common.model.ensure import SHIPPED
from tests.support.runs import log_tail, start_role, stop, write_config

tinker = pytest.importorskip("tinker", reason="the tinker extra: pip install -e '.[tinker]'")
from tinker import types

KEY = "tml-test-key-resume-0123456789"
MODEL = SHIPPED / "tiny-calculator"
START_TIMEOUT_S = 60.0


def start_service(tmp: Path, run_dir: Path, keys: Path, port: int, name: str) -> tuple[subprocess.Popen, str]:
    """`rlbus tinker` on `port` (0: a free one) with its state under `run_dir`; returns the process and its URL."""
    cfg = {"name": "tinkerresume", "model": {"path": str(MODEL)}, "logging": {"run_dir": str(run_dir)},
           "tinker": {"keys_file": str(keys), "port": port, "poll_s": 5.0}}
    proc = start_role("tinker", write_config(tmp / f"{name}.yaml", cfg), tmp / f"logs-{name}", name=name)
    url_file = run_dir / "tinker.url"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not url_file.is_file():
        if proc.poll() is not None:
            pytest.fail(f"rlbus tinker exited with {proc.returncode}:\n{log_tail(proc)}")
        if time.monotonic() > deadline:
            stop(proc, signal.SIGKILL)
            pytest.fail(f"rlbus tinker did not serve within {START_TIMEOUT_S:.0f}s:\n{log_tail(proc)}")
        time.sleep(0.2)
    return proc, url_file.read_text().strip()


def data(tokenizer) -> list[types.Datum]:
    out = []
    for prompt, answer in (("What is 12*7?", " 12*7 = 84."), ("Say hi.", " hi there")):
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
        full = p + a
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:],
                                               "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)}))  # fmt: skip
    return out


def step(tc, batch) -> None:
    tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


def loss(tc, batch) -> float:
    return tc.forward(batch, "cross_entropy").result().metrics["loss:sum"]


def test_clients_go_on_after_the_service_is_killed_and_started_again(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    fd = os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, f"{KEY}\n".encode())
    os.close(fd)
    run_dir = tmp_path / "run"
    first, url = start_service(tmp_path, run_dir, keys, 0, "first")
    second = None
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        base = str(MODEL.resolve())
        saved = sc.create_lora_training_client(base_model=base, rank=4, seed=0).result()
        batch = data(saved.get_tokenizer())
        for _ in range(2):
            step(saved, batch)
        state = saved.save_state("two-steps").result().path
        sampler = saved.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(saved.get_tokenizer().encode("What is 12*7?"))
        params = types.SamplingParams(max_tokens=6, temperature=0.9, seed=11, stop=[])
        tokens = [s.tokens for s in sampler.sample(prompt, 2, params).result().sequences]
        long = types.SamplingParams(max_tokens=900, temperature=1.0, seed=5, stop=[])  # seconds of generation
        t0 = time.monotonic()
        long_tokens = [s.tokens for s in sampler.sample(prompt, 16, long).result().sequences]
        assert time.monotonic() - t0 > 1.5  # so that the one below is still running when the service dies
        at_state = loss(saved, batch)  # forward only: the model is still the state
        # what the next step gives without any restart: a client made from the state takes it
        reference = sc.create_training_client_from_state_with_optimizer(state).result()
        step(reference, batch)
        after_step = loss(reference, batch)
        assert after_step < at_state
        # a model that trains past its last saved state
        unsaved = sc.create_lora_training_client(base_model=base, rank=4, seed=1).result()
        step(unsaved, batch)
        unsaved_state = unsaved.save_state("one-step").result().path
        at_unsaved_state = loss(unsaved, batch)
        step(unsaved, batch)

        running = sampler.sample(prompt, 16, long)
        time.sleep(0.5)  # taken by the service (a send takes milliseconds), not finished
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        (run_dir / "tinker.url").unlink()  # left by the killed process
        port = int(url.rsplit(":", 1)[1])
        pending = saved.forward(batch, "cross_entropy")  # sent while nothing listens: the SDK retries it
        second, url_again = start_service(tmp_path, run_dir, keys, port, "second")
        assert url_again == url

        assert pending.result().metrics["loss:sum"] == pytest.approx(at_state, rel=1e-6)
        assert saved.get_info().lora_rank == 4
        step(saved, batch)  # the same AdamW moments and step count: the same step as the reference's
        assert loss(saved, batch) == pytest.approx(after_step, rel=1e-5)
        assert [s.tokens for s in sampler.sample(prompt, 2, params).result().sequences] == tokens
        assert [s.tokens for s in running.result().sequences] == long_tokens
        with pytest.raises(tinker.NotFoundError, match="lost when the service stopped") as lost:
            unsaved.forward(batch, "cross_entropy").result()
        assert unsaved_state in str(lost.value)
        resumed = sc.create_training_client_from_state_with_optimizer(unsaved_state).result()
        assert loss(resumed, batch) == pytest.approx(at_unsaved_state, rel=1e-6)
        step(resumed, batch)
        assert loss(resumed, batch) < at_unsaved_state
        sc.close("success").result()
    finally:
        stop(first, signal.SIGKILL)
        if second is not None:
            stop(second, signal.SIGTERM)
    assert second.returncode == 0, log_tail(second)
    records = list((run_dir / "tinker").glob("*/*/model.json"))
    assert not records, records  # a finished session's models are not restored by a later start
