"""Token authentication on the Ray heads rlbus starts (bus.ray_cluster.start_ray_head; the session's head here).

    .venv/bin/python -m pytest -q tests/integration/test_ray_auth.py

A driver with the head's environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH) connects and uses a named actor;
one without the token -- or with another -- is turned away by the GCS before it learns anything about the cluster.
What Ray prints then, once a second until it gives up (RAY_NUM_REDIS_GET_RETRIES tries, 20 by default):

    gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: RPC error: InvalidAuthToken:
    Authentication token is missing or incorrect

and ray.init raises `ConnectionError: Failed to connect to Ray cluster at 127.0.0.1:PORT`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.listeners import process_tree
from tests.support.ray_cluster import head_env, ray_driver

# What someone else on the machine would run: plain Ray, the head's address, whatever auth environment it has.
_INTRUDER = textwrap.dedent("""
    import sys, time
    import ray
    t0 = time.monotonic()
    try:
        ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
    except Exception as e:
        print(f"REFUSED {type(e).__name__} {time.monotonic() - t0:.1f}s: {str(e)[:300]}", flush=True)
        sys.exit(3)
    print("CONNECTED", ray.util.list_named_actors(all_namespaces=True), flush=True)
""")


def _without_ray_auth(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    # Ray resolves 127.0.0.1 to the routable IP without this (see bus.ray_cluster); an intruder can set it too.
    # Two connection attempts (~1 s apart) instead of 20: each one is refused alike.
    return dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_NUM_REDIS_GET_RETRIES="2", **extra)


def _intrude(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _INTRUDER, address]
    return subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=60)


def _token(head) -> str:
    return Path(head.token_path).read_text()


def test_the_token_is_in_a_private_file_and_only_its_path_in_the_environment(ray_head):
    token_file = Path(ray_head.token_path)
    assert len(_token(ray_head)) == 64  # 256 random bits, hex
    st, dst = token_file.stat(), token_file.parent.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.getuid()
    assert ray_head.env["RAY_AUTH_MODE"] == "token"
    assert ray_head.env["RAY_AUTH_TOKEN_PATH"] == str(token_file)
    assert _token(ray_head) not in json.dumps(ray_head.env)
    # an inherited RAY_AUTH_TOKEN (someone else's cluster) would win over the file: joining the head drops it
    assert "RAY_AUTH_TOKEN" not in head_env(ray_head, {"RAY_AUTH_TOKEN": "f" * 64})


def test_rays_own_files_are_inside_a_private_folder(ray_head):
    # Ray makes its temp dir and the session, sockets and logs dirs in it 0777: they must sit in a 0700 folder.
    root = Path(ray_head.temp_dir)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    sockets = list(root.glob("ray/session_*/sockets/raylet"))
    assert sockets, sorted(p.name for p in root.iterdir())


def test_a_driver_with_the_head_environment_uses_a_named_actor(ray_head):
    with ray_driver(ray_head.address, head_env(ray_head), name="auth-echo") as driver:
        assert "auth-echo" in driver.named
        assert driver.actor_pid != driver.pid


def _decoded(arg: str) -> str:
    # gcs_server gets its settings as base64 JSON (--config_list=...): look inside that too.
    _, _, value = arg.partition("=")
    try:
        return base64.b64decode(value, validate=True).decode(errors="replace")
    except (binascii.Error, ValueError):
        return ""


def test_the_token_is_on_no_command_line_and_in_no_environment(ray_head):
    token = _token(ray_head)
    with ray_driver(ray_head.address, head_env(ray_head), name="auth-argv") as driver:
        pids = process_tree(ray_head.pid, driver.pid)
        names = set()
        for pid in pids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())
            except FileNotFoundError:  # ended meanwhile
                continue
            assert not any(token in a or token in _decoded(a) for a in argv), (pid, argv[:3])
            assert token not in environ, pid
        assert driver.actor_pid in pids  # the actor's worker was among them
    assert {"gcs_server", "raylet"} <= names, names
    # nor in Ray's logs and session files
    for path in Path(ray_head.temp_dir).rglob("*"):
        if path.is_file() and not path.is_symlink() and path != Path(ray_head.token_path):
            assert token.encode() not in path.read_bytes(), path


def test_the_head_runs_no_ray_client_server_and_no_dashboard(ray_head):
    """bus/ray_start.py: nothing of rlbus connects through ray:// or asks the dashboard, so the head runs without
    its proxy and without the dashboard process `--include-dashboard=false` would still start."""
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                for pid in process_tree(ray_head.pid) if Path(f"/proc/{pid}/cmdline").exists()]
    assert any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands), commands
    assert not [c for c in commands if "ray.util.client.server" in c]
    assert not [c for c in commands if "dashboard/dashboard.py" in c], commands


@pytest.mark.parametrize(
    "case",
    ["no auth environment", "auth mode disabled", "another token"],
)
def test_a_driver_without_the_token_cannot_attach(ray_head, case):
    extra = {
        "no auth environment": {},
        "auth mode disabled": {"RAY_AUTH_MODE": "disabled"},
        "another token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(32).hex()},
    }[case]
    t0 = time.monotonic()
    r = _intrude(ray_head.address, _without_ray_auth(**extra))
    assert r.returncode == 3, (r.stdout, r.stderr[-2000:])
    assert r.stdout.startswith("REFUSED ConnectionError"), r.stdout
    assert "Unauthenticated" in r.stderr and "InvalidAuthToken" in r.stderr, r.stderr[-2000:]
    assert "CONNECTED" not in r.stdout
    assert time.monotonic() - t0 < 45


def test_token_mode_with_no_token_anywhere_fails_at_once(ray_head, tmp_path):
    # HOME without ~/.ray/auth_token: Ray looks there last, after RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH.
    r = _intrude(ray_head.address, _without_ray_auth(RAY_AUTH_MODE="token", HOME=str(tmp_path)))
    assert r.returncode == 3, (r.stdout, r.stderr[-2000:])
    assert r.stdout.startswith("REFUSED AuthenticationError"), r.stdout
    assert "no authentication token was found" in r.stdout


_LATE = textwrap.dedent("""
    import json, os, sys
    from ray._raylet import AuthenticationMode, get_authentication_mode
    from rlbus.bus.ray_cluster import ensure_ray
    from rlbus.schemas.config import RayConfig
    import ray

    assert get_authentication_mode() == AuthenticationMode.DISABLED  # read (and cached) before the head is known
    os.environ.update(json.loads(sys.stdin.read()))
    ensure_ray(RayConfig(address=sys.argv[1], namespace="rlbus-tests"))
    print("OK", len(ray.nodes()), flush=True)
""")


def test_ensure_ray_connects_when_ray_read_its_auth_mode_before_the_head_was_known(ray_head):
    # The head's environment comes on stdin (it holds a file path, not the token; either way, not on argv).
    cmd = [sys.executable, "-c", _LATE, ray_head.address]
    r = subprocess.run(cmd, check=False, input=json.dumps(ray_head.env), env=_without_ray_auth(),
                       capture_output=True, text=True, timeout=90)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("OK 1"), (r.stdout, r.stderr[-2000:])


_EARLY = textwrap.dedent("""
    import sys, time
    import ray
    from rlbus.bus.ray_cluster import ensure_ray
    from rlbus.schemas.config import RayConfig
    print("STARTED", flush=True)
    ensure_ray(RayConfig(address=sys.argv[1]))
    print("OK", len(ray.nodes()), flush=True)
""")


def test_a_role_started_before_its_head_is_up_waits_for_it_and_connects(tmp_path):
    """`rlbus up` starts its roles while its Ray head is still starting (start_ray_head(wait=False)): a driver with
    the head's environment waits in ensure_ray until the starter marks the head up, then connects with its token."""
    from rlbus.bus import ray_cluster
    from rlbus.bus.ray_cluster import await_ray_head, start_ray_head, stop_ray_head

    head = start_ray_head(num_cpus=1, wait=False)
    try:
        assert not Path(head.env[ray_cluster.UP_ENV]).exists()  # spawned, not up yet
        proc = subprocess.Popen([sys.executable, "-c", _EARLY, head.address], env=head_env(head, _without_ray_auth()),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        await_ray_head(head)
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0 and "OK 1" in out, (out, err[-2000:])
    finally:
        stop_ray_head(head)


def test_a_head_never_marked_up_fails_the_wait_with_its_path(tmp_path, monkeypatch):
    from rlbus.bus import ray_cluster

    monkeypatch.setenv(ray_cluster.UP_ENV, str(tmp_path / "up"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="was not up within"):
        ray_cluster._await_marked_up(timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    (tmp_path / "up").touch()
    ray_cluster._await_marked_up(timeout_s=0.3)  # marked: returns at once


def test_the_heads_gcs_declares_a_dead_node_dead_within_seconds(ray_head):
    """bus/ray_cluster.py NODE_DEATH_ENV reaches the process that health-checks the nodes: with Ray's defaults a
    lost node's actors stay ALIVE (and every call to them waits) for about 15 s (the nemesis' stalls of 13-21 s);
    with these about 3 s (bench/soak.py --nemesis --kinds node-loss,shard-kill, docs/reliability.md)."""
    from rlbus.bus.ray_cluster import NODE_DEATH_ENV

    gcs = [pid for pid in process_tree(ray_head.pid)
           if Path(f"/proc/{pid}/comm").exists() and Path(f"/proc/{pid}/comm").read_text().strip() == "gcs_server"]
    assert len(gcs) == 1, gcs
    environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{gcs[0]}/environ").read_bytes().decode().split("\0") if "=" in kv)
    assert {k: environ.get(k) for k in NODE_DEATH_ENV} == NODE_DEATH_ENV
