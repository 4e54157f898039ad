"""Resuming, replaying or exporting an untrusted run directory never runs code planted in its checkpoint.

A real checkpoint (tiny Qwen2, TrainEngine, test_replay's recorded run with a checkpoint at step 2) is copied and
poisoned with pickles whose `__reduce__` would create a marker file: in a rank's RNG file, in DCP's `.metadata`, and
in a non-tensor entry of a DCP shard. Loading refuses each with `UnsafeCheckpointError` naming the file and the
global, and the marker is never created; the untouched checkpoint still loads and resumes bit for bit.

    .venv/bin/python -m pytest -q tests/integration/test_safe_loading.py
"""

from __future__ import annotations

import os
import pathlib
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.test_fsdp import build_tiny_qwen2, make_batch, rank_share
from tests.integration.test_replay import record_run

CKPT = "checkpoints/step_00000002"


class Touch:
    """Unpickling this creates `path` (as `pathlib.Path.touch`: no shell)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return pathlib.Path.touch, (pathlib.Path(self.path),)


class Shell:
    """Unpickling this runs a shell command that creates `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch '{self.path}'",)


PAYLOADS = {"pathlib-touch": Touch, "os-system": Shell}
#: the global each payload makes the pickle reference, as the error names it (pickle protocol 2 for torch.save and
#: protocol 5 for a plain pickle spell pathlib's differently)
FORBIDDEN = {"pathlib-touch": {"builtins.getattr", "pathlib.Path.touch"}, "os-system": {"posix.system", "nt.system"}}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record_run(tmp_path_factory.mktemp("safe_loading"))


@pytest.fixture
def run_copy(recorded: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of the recorded run directory, to poison."""
    dst = tmp_path / "run"
    shutil.copytree(recorded["run_dir"], dst)
    return dst


def fresh_engine(recorded: dict[str, Any]):
    from rlbus.trainer.engine import TrainEngine

    return TrainEngine.from_config(recorded["cfg"])


def assert_live(payload: type, tmp_path: Path, *, via_torch: bool = False) -> None:
    """The payload is real: an unrestricted load of it does create its marker."""
    marker = tmp_path / "live-marker"
    data = pickle.dumps({"x": payload(marker)})
    if via_torch:
        f = tmp_path / "live.pt"
        torch.save({"x": payload(marker)}, f)
        torch.load(f, weights_only=False)
    else:
        pickle.loads(data)
    assert marker.exists()
    marker.unlink()


# ---------------------------------------------------------------------------------------------------------------
# what DCP's metadata really is


def test_dcp_metadata_is_a_pickle_of_only_the_admitted_globals(recorded: dict[str, Any]) -> None:
    from rlbus.trainer.checkpoint import _DCP_METADATA_GLOBALS, _TORCH_DTYPES, _read_metadata

    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    ckpt = recorded["run_dir"] / CKPT
    with open(ckpt / ".metadata", "rb") as f:  # our own, trusted file: a full unpickle to list what it names
        full = Recording(f).load()
    assert seen, "DCP metadata references globals (it is a pickle, not plain data)"
    dtypes = {g for g in seen if g[0] == "torch" and g[1] in _TORCH_DTYPES}
    assert dtypes and seen - dtypes <= _DCP_METADATA_GLOBALS, seen - dtypes - _DCP_METADATA_GLOBALS
    safe = _read_metadata(ckpt)
    assert safe.state_dict_metadata == full.state_dict_metadata and safe.storage_data == full.storage_data


# ---------------------------------------------------------------------------------------------------------------
# poisoned checkpoints are refused, and nothing runs


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("fmt", ["torch.save", "plain pickle"])
def test_poisoned_rng_file_is_refused(recorded, run_copy: Path, tmp_path: Path, kind: str, fmt: str) -> None:
    from rlbus.trainer.checkpoint import UnsafeCheckpointError, load_checkpoint

    payload = PAYLOADS[kind]
    assert_live(payload, tmp_path, via_torch=fmt == "torch.save")
    marker = tmp_path / "marker"
    rng_file = run_copy / CKPT / "rng" / "rank_00000.pt"
    if fmt == "torch.save":
        torch.save({"torch": torch.get_rng_state(), "python": payload(marker)}, rng_file)
    else:  # torch.load's legacy (non-zip) format: a plain pickle
        rng_file.write_bytes(pickle.dumps({"python": payload(marker)}, protocol=2))
    engine = fresh_engine(recorded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the plain pickle's protocol
        with pytest.raises(UnsafeCheckpointError, match="RNG state: refusing to unpickle") as err:
            load_checkpoint(engine, run_copy / "checkpoints")
    assert err.value.path == str(rng_file) and str(rng_file) in str(err.value)
    assert err.value.forbidden in FORBIDDEN[kind]
    assert "weights_only=False" not in str(err.value)  # no advice to load it the unsafe way
    assert not marker.exists()


def _poisoned_metadata(ckpt: Path, payload: Any) -> None:
    """The checkpoint's real metadata with one hostile object slipped in (where DCP keeps plain strings)."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # trusted here: our own checkpoint
    md.storage_meta.modules = [payload]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("kind", PAYLOADS)
def test_poisoned_dcp_metadata_is_refused(recorded, run_copy: Path, tmp_path: Path, kind: str) -> None:
    import torch.distributed.checkpoint as dcp

    from rlbus.trainer.checkpoint import UnsafeCheckpointError, load_checkpoint

    marker = tmp_path / "marker"
    ckpt = run_copy / CKPT
    _poisoned_metadata(ckpt, PAYLOADS[kind](marker))
    engine = fresh_engine(recorded)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing to unpickle") as err:
        load_checkpoint(engine, ckpt)
    assert err.value.path == str(ckpt / ".metadata") and err.value.forbidden in FORBIDDEN[kind]
    assert f"`{err.value.forbidden}`" in str(err.value)
    assert not marker.exists()
    dcp.load(engine.state_dict(), checkpoint_id=ckpt)  # ... whereas DCP's own reader runs it: the attack is real
    assert marker.exists()


def test_poisoned_non_tensor_shard_entry_is_refused(recorded, run_copy: Path, tmp_path: Path) -> None:
    """DCP's default planner reads non-tensor entries (LR schedule, update count) with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    from rlbus.trainer.checkpoint import UnsafeCheckpointError, load_checkpoint

    marker = tmp_path / "marker"
    ckpt = run_copy / CKPT
    engine = fresh_engine(recorded)
    state = engine.state_dict()
    state["num_updates"] = Touch(marker)  # written by DCP itself: legitimate metadata, a hostile shard entry
    for f in [ckpt / ".metadata", *ckpt.glob("*.distcp")]:
        f.unlink()
    dcp.save(state, checkpoint_id=ckpt)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="entry 'num_updates': refusing to unpickle") as err:
        load_checkpoint(fresh_engine(recorded), ckpt)
    assert err.value.forbidden == "builtins.getattr" and err.value.path.endswith(".distcp")
    assert not marker.exists()
    again = pickle.loads(pickle.dumps(err.value))  # DCP gathers a rank's failure to every rank as a pickle
    assert type(again) is type(err.value) and str(again) == str(err.value) and again.forbidden == err.value.forbidden
    dcp.load(fresh_engine(recorded).state_dict(), checkpoint_id=ckpt)  # DCP's default planner runs it
    assert marker.exists()


def test_replay_and_export_refuse_poisoned_metadata(recorded, run_copy: Path, tmp_path: Path, capsys) -> None:
    from rlbus.cli.export import export_checkpoint
    from rlbus.trainer.checkpoint import UnsafeCheckpointError, export_hf
    from rlbus.trainer.replay import main

    marker = tmp_path / "marker"
    ckpt = run_copy / CKPT
    _poisoned_metadata(ckpt, Shell(marker))
    # `rlbus replay RUN --from-step 3`: one clear line and exit code 2, no traceback, nothing run
    assert main([str(run_copy), "--from-step", "3"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "rlbus replay:" in said and "refusing to unpickle `posix.system`" in said
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        export_hf(ckpt, tmp_path / "hf", recorded["cfg"].model.path)
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        export_checkpoint(run_copy / "checkpoints", tmp_path / "hf2", recorded["cfg"].model.path)  # `rlbus export`
    assert not marker.exists()
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "damage",
    ["truncated", "garbage", "shard outside the checkpoint", "not metadata"],
)
def test_malformed_metadata_is_a_checkpoint_error(recorded, run_copy: Path, damage: str) -> None:
    from rlbus.trainer.checkpoint import UnsafeCheckpointError, load_checkpoint

    ckpt = run_copy / CKPT
    meta = ckpt / ".metadata"
    if damage == "truncated":
        meta.write_bytes(meta.read_bytes()[: len(meta.read_bytes()) // 2])
    elif damage == "garbage":
        meta.write_bytes(os.urandom(256))
    elif damage == "shard outside the checkpoint":
        md = pickle.loads(meta.read_bytes())
        next(iter(md.storage_data.values())).relative_path = "../../../etc/passwd"
        meta.write_bytes(pickle.dumps(md))
    else:
        meta.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: "):
        load_checkpoint(fresh_engine(recorded), ckpt)


def test_latest_pointer_must_name_a_checkpoint_beside_it(recorded, run_copy: Path, tmp_path: Path) -> None:
    from rlbus.trainer.checkpoint import CheckpointError, load_checkpoint

    elsewhere = tmp_path / "elsewhere" / "step_00000002"
    shutil.copytree(run_copy / CKPT, elsewhere)
    for name in (str(elsewhere), "../elsewhere/step_00000002", "step_2/../../x"):
        (run_copy / "checkpoints" / "latest").write_text(name)
        with pytest.raises(CheckpointError, match="`latest` must name a step_<N> directory"):
            load_checkpoint(object(), run_copy / "checkpoints")


# ---------------------------------------------------------------------------------------------------------------
# the untouched checkpoint still loads, and resumes bit for bit


def test_untouched_checkpoint_restores_rng_and_replays_bit_for_bit(recorded, run_copy: Path) -> None:
    from rlbus.trainer.checkpoint import load_checkpoint
    from rlbus.trainer.replay import replay

    ckpt = run_copy / CKPT
    saved_rng = torch.load(ckpt / "rng" / "rank_00000.pt", weights_only=True)
    engine = fresh_engine(recorded)
    torch.manual_seed(12345)
    random.seed(12345)
    assert load_checkpoint(engine, run_copy / "checkpoints") == {"step": 2, "version": 2}
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"]) and random.getstate() == saved_rng["python"]
    assert engine.num_updates == 2 * recorded["cfg"].trainer.mini_batches
    weights = engine.full_state_dict()
    assert all(torch.equal(weights[k], w) for k, w in recorded["weights"][2].items())

    result, engine = replay(run_copy, from_step=3, num_steps=2)
    assert result.from_checkpoint == 2 and result.identical, [d for d in result.diffs if not d.equal]
    weights = engine.full_state_dict()
    assert all(torch.equal(weights[k], w) for k, w in recorded["weights"][4].items())


# ---------------------------------------------------------------------------------------------------------------
# two ranks: one rank's poisoned RNG file stops every rank (none is left waiting in a collective)


def _two_rank_worker(model_dir: str, root: str, marker: str) -> dict:
    from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
    from rlbus.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from rlbus.trainer.dist import barrier, destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    info = init_distributed("cpu")
    cfg, algo = TrainerConfig(micro_batch_size=4, lr=1e-3), AlgorithmConfig()
    engine = TrainEngine(model_dir, cfg, algo, temperature=0.9)
    engine.train_step(rank_share(make_batch(seed=1), info.rank, info.world_size))
    path = save_checkpoint(engine, root, 1, {"step": 1})
    if info.rank == 1:
        torch.save({"torch": torch.get_rng_state(), "python": Shell(Path(marker))}, path / "rng" / "rank_00001.pt")
    barrier()
    out: dict[str, Any] = {}
    try:
        load_checkpoint(TrainEngine(model_dir, cfg, algo, temperature=0.9), root)
    except CheckpointError as e:
        out = {"type": type(e).__name__, "message": str(e)}
    barrier()  # both ranks past the load before the process group goes (once, under load, rank 1 aborted in gloo)
    destroy_distributed()
    return out


def test_one_ranks_poisoned_rng_file_stops_every_rank(tmp_path: Path) -> None:
    from rlbus.trainer.dist import spawn_local

    model = build_tiny_qwen2(tmp_path / "model")
    marker = tmp_path / "marker"
    r0, r1 = spawn_local(2, _two_rank_worker, str(model), str(tmp_path / "ckpt"), str(marker))
    assert r1["type"] == "UnsafeCheckpointError" and "rank_00001.pt" in r1["message"]
    assert "posix.system" in r1["message"] or "nt.system" in r1["message"]
    assert r0["type"] == "CheckpointError" and "another rank refused its RNG state" in r0["message"]
    assert not marker.exists()
