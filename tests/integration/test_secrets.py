"""No secret at rest outside its 0600 file: a bus password given on the command line to `rlbus up`, searched for in
the whole run directory and every role's log afterwards, and in `rlbus config show`.

    .venv/bin/python -m pytest -q tests/integration/test_secrets.py
"""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from rlbus.bus.auth import load_creds
from rlbus.schemas.config import REDACTED
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError
from tests.support.runs import ROOT, files_holding, small_run_config, write_config


def test_config_show_redacts_secrets(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "config", "show", "configs/quickstart.yaml",
                          "bus.user=u", "bus.password=hunter2-secret", "bus.token=tok-secret-123"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "hunter2-secret" not in out.stdout and "tok-secret-123" not in out.stdout
    assert out.stdout.count(REDACTED) == 2
    # a redacted config cannot be mistaken for the real secret
    written = tmp_path / "config.yaml"
    written.write_text(out.stdout)
    with pytest.raises(ConfigError, match="bus.token: was redacted"):
        load_config(written)


@pytest.mark.slow
def test_up_with_a_password_on_the_command_line_keeps_it_in_one_private_file(tmp_path, nats_server, ray_address,
                                                                              tiny_model_dir, run_name):
    # A remote bus (the module's server) reached with a user and password typed on the command line.
    admin = load_creds(nats_server.creds_file("admin"))
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, nats_server.url, "", ray_address,
                           trainer={"total_steps": 2, "checkpoint_interval": 2}, rollout={"num_producers": 1})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(cfg_path), f"bus.user={admin['user']}",
                           f"bus.password={admin['password']}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    secret_file = run_dir / "creds" / "bus.json"
    assert load_creds(secret_file)["password"] == admin["password"]
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
    assert files_holding([run_dir], [admin["password"]], skip={secret_file}) == []
    assert admin["password"] not in proc.stdout + proc.stderr
    for written in ("config.yaml", "launch.yaml"):  # they point at the file instead
        text = (run_dir / written).read_text()
        assert f"creds_file: {secret_file}" in text and "password: ''" in text, written
