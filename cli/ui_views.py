"""What each page of `rlbus ui` shows, as JSON, read from the run's index (cli/ui_index.py) and its recorded tensors.

    overview(index, since=0)            reward, eval accuracy, entropy, mismatch, staleness, throughput, step time by
                                        step; guard actions, rollbacks, weight versions and checkpoints on that axis
    samples_page(index, query)          one page of trained samples, filtered and sorted in SQL (server-side paging)
    Tokens(run_dir).sample(index, id)   one sample token by token: mask, version, behaviour log-prob, advantage
    producers(index)                    who was online when, restarts and kills, versions, tokens made and discarded,
                                        in-flight limit and engine idle share, failure counts; errors by class
    compare(index, a, b)                two steps' metrics side by side

Tests: `pytest tests/unit/test_ui_index.py tests/system/test_inspector.py`.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from rlbus.cli.ui_index import OVERVIEW_KEYS, RunIndex
from rlbus.consumers.event_log import advantages_path, mask_spans, shard_path

#: Columns the samples page may sort by, and the query parameter that names each.
SORTS = {"step": "step", "reward": "reward", "staleness": "staleness", "length": "response_len",
         "turns": "num_turns", "tool_calls": "num_tool_calls"}
PAGE_MAX = 200
#: A producer silent for longer than this (seconds) between two heartbeats was offline in between.
OFFLINE_GAP_S = 10.0
#: A producer's failure counts, summed over its processes: tasks given back because a tool, sandbox or judge failed;
#: tasks whose environment raised or gave bad output; tool attempts retried after their service failed.
FAILURE_COUNTS = ("infra_failures", "env_failures", "tool_retries")


def overview(index: RunIndex, since: int = 0) -> dict[str, Any]:
    """The overview's series from step `since` on (the live page asks only for what it has not got)."""
    cols = ", ".join(f'"{k}"' for k in OVERVIEW_KEYS)
    train = index.db.execute(f"SELECT step, {cols} FROM metrics WHERE is_eval=0 AND step>? ORDER BY rowid",
                             (since,)).fetchall()
    evals = index.db.execute('SELECT step, "eval/accuracy" FROM metrics WHERE is_eval=1 AND step>? ORDER BY rowid',
                             (since,)).fetchall()
    series: dict[str, list] = {"step": [r[0] for r in train]}
    for i, k in enumerate(OVERVIEW_KEYS):
        if k != "eval/accuracy":
            series[k] = [r[i + 1] for r in train]
    return {
        "generation": index.generation,
        "last_step": max([since, *series["step"]]),
        "series": series,
        "eval": {"step": [r[0] for r in evals], "accuracy": [r[1] for r in evals]},
        "guard": index.rows("SELECT step, rules, actions, message, rollback_to, lr_scale FROM guard WHERE step>? "
                            "ORDER BY t", (since,)),
        "weights": index.rows("SELECT step, version, t FROM weights WHERE step>? ORDER BY t", (since,)),
        "discarded": [r[0] for r in index.db.execute("SELECT step FROM discarded WHERE step>?", (since,))],
        "checkpoints": index.checkpoints(),
        "num_samples": index.db.execute("SELECT count(*) FROM samples").fetchone()[0],
    }


def samples_page(index: RunIndex, q: dict[str, str]) -> dict[str, Any]:
    """One page of samples. Filters: step (N or A:B), producer, q (prompt text), min_reward, max_reward,
    min_staleness, min_length; sort (SORTS), desc, offset, limit (<= PAGE_MAX)."""
    where, args = ["1"], []
    if q.get("step"):
        lo, colon, hi = q["step"].partition(":")
        where.append("s.step BETWEEN ? AND ?")
        args += [int(lo or 0), int(hi) if hi else (1 << 62 if colon else int(lo))]
    for name, sql in (("producer", "s.producer_id = ?"), ("min_reward", "s.reward >= ?"),
                      ("max_reward", "s.reward <= ?"), ("min_staleness", "s.staleness >= ?"),
                      ("min_length", "s.response_len >= ?"), ("group", "s.group_id = ?")):
        if q.get(name, "") != "":
            where.append(sql)
            args.append(q[name] if name in ("producer", "group") else float(q[name]))
    if q.get("q"):
        where.append("s.task_id IN (SELECT task_id FROM prompts WHERE text LIKE ?)")
        args.append(f"%{q['q']}%")
    sort = SORTS.get(q.get("sort", "step"), "step")  # each has an index, ordered by (column, id): no sort step
    order = "DESC" if q.get("desc", "0") in ("1", "true") else "ASC"
    limit = max(1, min(int(q.get("limit", 50)), PAGE_MAX))
    offset = max(0, int(q.get("offset", 0)))
    cond = " AND ".join(where)
    total = index.db.execute(f"SELECT count(*) FROM samples s WHERE {cond}", args).fetchone()[0]
    rows = index.rows(f"SELECT s.id, s.step, s.gpos, s.spos, s.group_id, s.producer_id, s.reward, s.prompt_len, "
                      f"s.response_len, s.num_turns, s.num_tool_calls, s.finish_reason, s.min_version, "
                      f"s.max_version, s.staleness FROM samples s WHERE {cond} ORDER BY s.{sort} {order}, s.id {order} "
                      f"LIMIT ? OFFSET ?", (*args, limit, offset))
    prompts = {r["task_id"]: r["text"] for r in index.rows(
        f"SELECT task_id, text FROM prompts WHERE task_id IN ({','.join('?' * len(rows))})",
        tuple(r["group_id"] for r in rows))} if rows else {}
    for r in rows:
        r["prompt"] = _last_line(prompts.get(r["group_id"], ""))
    return {"total": total, "offset": offset, "limit": limit, "rows": rows}


def _last_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[-1] if text.strip() else ""
    return line if len(line) <= width else line[:width - 1] + "…"


class Tokens:
    """One sample's tokens from the step's recorded tensors, decoded with the run's tokenizer (loaded once)."""

    run_dir: Path
    index_dir: Path  # where cli/ui_proximal.py's recomputed proximal log-probs are kept
    _tokenizer: Any
    _loaded: bool
    _lock: threading.Lock
    _algo: Any  # the run's AlgorithmConfig, read once
    _adv_step: tuple[int, int]  # (step, index generation) of the advantages in _adv
    _adv: Any  # that step's advantages [B, T], ranks in order
    _adv_offsets: list[int]  # each rank's first row in _adv

    def __init__(self, run_dir: Path, index_dir: Path):
        self.run_dir, self.index_dir = run_dir, index_dir
        self._tokenizer, self._loaded, self._lock = None, False, threading.Lock()
        self._algo, self._adv_step, self._adv, self._adv_offsets = None, (-1, -1), None, []

    def tokenizer(self) -> Any:
        """The run's tokenizer (model.path of RUN_DIR/config.yaml), or None where that directory is not here: a
        run copied to another machine still shows ids, masks, versions and log-probs."""
        with self._lock:
            if not self._loaded:
                self._loaded = True
                self._tokenizer = _load_tokenizer(self.run_dir)
            return self._tokenizer

    def sample(self, index: RunIndex, sample_id: int) -> dict[str, Any]:
        rows = index.rows("SELECT * FROM samples WHERE id=?", (sample_id,))
        if not rows:
            raise KeyError(f"no sample {sample_id}")
        s = rows[0]
        out = {**s, "prompt_text": "", "tokens": [], "turns": [], "note": ""}
        prompt = index.rows("SELECT text, ground_truth FROM prompts WHERE task_id=?", (s["task_id"],))
        out["ground_truth"] = prompt[0]["ground_truth"] if prompt else ""
        path = shard_path(self.run_dir, s["step"], s["rank"])
        if not path.is_file():
            out["note"] = "this step was recorded without tensors (logging.record=metadata): no tokens to show"
            return out
        p, n = s["prompt_len"], s["prompt_len"] + s["response_len"]
        fields = _row(path, s["row"], ("input_ids", "response_mask", "rollout_log_probs", "versions"))
        advantages, values, why = self._advantages(index, s)
        proximal = self._proximal(index, s)
        tok = self.tokenizer()
        ids = fields["input_ids"][:n]
        pieces = _pieces(tok, ids)
        out["prompt_text"] = _decode(tok, ids[:p])
        out["tokens"] = [{"id": ids[i], "text": pieces[i], "mask": int(fields["response_mask"][i]),
                          "version": int(fields["versions"][i]), "logprob": _finite(fields["rollout_log_probs"][i]),
                          "advantage": None if advantages is None else _finite(advantages[i]),
                          "value": None if values is None else _finite(values[i]),
                          "proximal": None if proximal is None else _finite(proximal[i])}
                         for i in range(p, n)]
        out["turns"] = [_turn(m, e - st, _decode(tok, ids[p + st:p + e]))
                         for m, st, e in mask_spans([t["mask"] for t in out["tokens"]])]
        out["proximal"] = (f"recomputed at version {s['step'] - 1} by replay" if proximal is not None else
                           "not recorded (the trainer keeps their summary, mismatch/kl_k1 and mismatch/kl_k3); "
                           "recompute them for this step from the page")
        out["advantage_note"] = why
        out["tokenizer"] = tok is not None
        return out

    def _proximal(self, index: RunIndex, s: dict[str, Any]) -> list[float] | None:
        """The sample's proximal log-probs where cli/ui_proximal.py recomputed its step (rows: ranks in order)."""
        from rlbus.cli.ui_proximal import proximal_path

        path = proximal_path(self.index_dir, s["step"])
        if not path.is_file():
            return None
        before = index.db.execute("SELECT count(*) FROM samples WHERE step=? AND rank<?", (s["step"], s["rank"]))
        return _row(path, before.fetchone()[0] + s["row"], ("proximal_log_probs",))["proximal_log_probs"]

    def _advantages(self, index: RunIndex, s: dict[str, Any]) -> tuple[list[float] | None, list[float] | None, str]:
        """The sample's token advantages and, for GAE, the critic's values: those the trainer recorded beside the
        step's batch (consumers/recorder.py write_advantages), else the advantages recomputed as the trainer computes
        them (trainer/algorithms/advantages.py) from the recorded rewards, masks and groups; None (and why) where
        they need what is not recorded."""
        computed = advantages_path(self.run_dir, s["step"], s["rank"])
        if computed.is_file():
            row = _row(computed, s["row"])
            return row["advantages"], row.get("values"), "as the trainer computed them (recorded with the step)"
        adv, why = self._recomputed(index, s)
        return adv, None, why

    def _recomputed(self, index: RunIndex, s: dict[str, Any]) -> tuple[list[float] | None, str]:
        cfg_path = self.run_dir / "config.yaml"
        if not cfg_path.is_file():
            return None, "RUN_DIR/config.yaml is missing: the estimator is unknown"
        from rlbus.consumers.event_log import load_step_batch
        from rlbus.trainer.algorithms.advantages import compute_advantages

        if self._algo is None:
            from rlbus.schemas.config_io import load_config

            self._algo = load_config(cfg_path).algorithm
        algo = self._algo
        if algo.adv_estimator == "gae":
            return None, "gae: advantages need the critic's values, which this run did not record"
        if algo.kl_coef > 0 and not algo.use_kl_loss:
            return None, ("the KL penalty in the reward needs the reference model's log-probs, which this run did not "
                          "record")
        if self._adv_step != (s["step"], index.generation):  # one step's kept: a group's samples come in a row
            record = index.step_record(s["step"])
            if record is None:
                return None, "no step record"
            batch = load_step_batch(self.run_dir, record)
            self._adv = compute_advantages(batch["token_level_rewards"], batch["response_mask"], batch["group_index"],
                                           estimator=algo.adv_estimator, norm_by_std=algo.norm_adv_by_std,
                                           gamma=algo.gamma)
            self._adv_offsets = [sum(len(rows) for rows in record.shards[:r]) for r in range(len(record.shards))]
            self._adv_step = (s["step"], index.generation)
        row = self._adv_offsets[s["rank"]] + s["row"]
        return self._adv[row].tolist(), f"{algo.adv_estimator}, recomputed from the recorded rewards"


def _row(path: Path, row: int, keys: tuple[str, ...] | None = None) -> dict[str, list]:
    """Row `row` of each [B, T] tensor `keys` (default: all) of a safetensors file, read without loading the rest."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_slice(k)[row:row + 1][0].tolist() for k in (keys or f.keys())}


def _turn(mask: int, num_tokens: int, text: str) -> dict[str, Any]:
    """One span of the response: sampled by the policy (a tool call where it holds one, in the Hermes/Qwen
    `<tool_call>` format the agent loop parses) or inserted (a tool's result, the chat template's turn marks)."""
    if not mask:
        return {"role": "inserted: tool result, template", "tokens": num_tokens, "text": text}
    role = "assistant: tool call" if "<tool_call>" in text else "assistant"
    return {"role": role, "tokens": num_tokens, "text": text}


def _load_tokenizer(run_dir: Path) -> Any:
    from rlbus.schemas.config_io import load_config

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        return None
    model = Path(load_config(cfg_path).model.path)
    if (model / "tokenizer.json").is_file():  # the `tokenizers` library alone: no transformers import
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(model / "tokenizer.json"))
    if model.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model))
    return None


def _decode(tok: Any, ids: list[int]) -> str:
    if tok is None:
        return " ".join(map(str, ids))
    return tok.decode(ids, skip_special_tokens=False)


def _pieces(tok: Any, ids: list[int]) -> list[str]:
    """Each token's own text: the decode of the sequence up to it less the decode up to the one before, so
    multi-byte characters split over tokens come out whole on the token that completes them."""
    if tok is None:
        return [f"[{i}]" for i in ids]
    out = []
    for i in range(len(ids)):
        window = ids[max(0, i - 8):i + 1]
        text = tok.decode(window, skip_special_tokens=False)
        prev = tok.decode(window[:-1], skip_special_tokens=False) if len(window) > 1 else ""
        out.append(text[len(prev):] if text.startswith(prev) else tok.decode([ids[i]], skip_special_tokens=False))
    return out


def _finite(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def producers(index: RunIndex) -> dict[str, Any]:
    """Per producer: online spans (from heartbeats), its processes (a new pid is a restart; a pid that stopped
    without a RoleStopped, or stopped unclean, was killed), versions loaded, tokens generated and discarded, its
    latest in-flight limit and engine idle share, the limit over time, and its failure counts (None where its
    heartbeats predate them)."""
    out: dict[str, dict[str, Any]] = {}
    failures = ", ".join(f"max({k}) AS {k}" for k in FAILURE_COUNTS)
    for pid_row in index.rows("SELECT producer_id, pid, min(t) AS first, max(t) AS last, max(tokens_generated) AS "
                              "tokens, max(tokens_discarded) AS discarded, max(groups_done) AS groups, "
                              f"max(samples_restarted) AS restarted, {failures} FROM heartbeats "
                              "GROUP BY producer_id, pid ORDER BY first"):
        p = out.setdefault(pid_row["producer_id"], {"producer_id": pid_row["producer_id"], "processes": [],
                                                     "spans": [], "versions": [], "tokens_generated": 0,
                                                     "tokens_discarded": 0, "groups_done": 0,
                                                     "samples_restarted": 0, "inflight_limit": None,
                                                     "engine_idle": None, "inflight_limits": [],
                                                     **dict.fromkeys(FAILURE_COUNTS)})
        p["processes"].append({"pid": pid_row["pid"], "first": pid_row["first"], "last": pid_row["last"],
                               "stop": None})
        for k, col in (("tokens_generated", "tokens"), ("tokens_discarded", "discarded"), ("groups_done", "groups"),
                       ("samples_restarted", "restarted")):
            p[k] += pid_row[col] or 0
        for k in FAILURE_COUNTS:  # each process counts from zero; NULL where its heartbeats predate the counts
            if pid_row[k] is not None:
                p[k] = (p[k] or 0) + pid_row[k]
    for pid, rows in _by_producer(index).items():
        p = out[pid]
        spans, versions, limits = p["spans"], p["versions"], p["inflight_limits"]
        for t, proc, version, limit, _ in rows:
            if spans and spans[-1]["pid"] == proc and t - spans[-1]["end"] <= OFFLINE_GAP_S:
                spans[-1]["end"] = t
            else:
                spans.append({"pid": proc, "start": t, "end": t})
            if not versions or versions[-1]["version"] != version:
                versions.append({"version": version, "t": t})
            if limit is not None and (not limits or limits[-1]["limit"] != limit):
                limits.append({"limit": limit, "t": t})
        t, _, _, limit, idle = rows[-1]  # the latest heartbeat's: "-" where it predates them
        p["inflight_limit"], p["engine_idle"] = limit, idle
        if limit is not None and limits[-1]["t"] != t:
            limits.append({"limit": limit, "t": t})  # the line reaches the latest heartbeat
    events = index.rows("SELECT t, kind, role, role_id, pid, detail, clean FROM lifecycle ORDER BY t LIMIT 2000")
    for e in events:
        p = out.get(e["role_id"])
        if p is None or e["kind"] != "RoleStopped":
            continue
        alive = [pr for pr in p["processes"] if pr["first"] <= e["t"] + 1.0 and pr["stop"] is None]
        if alive:
            alive[-1]["stop"] = {"t": e["t"], "reason": e["detail"], "clean": bool(e["clean"])}
    for p in out.values():
        p["restarts"] = max(0, len(p["processes"]) - 1)
        p["killed"] = sum(1 for pr in p["processes"][:-1] if pr["stop"] is None or not pr["stop"]["clean"])
    t0 = index.db.execute("SELECT min(t) FROM (SELECT min(t) AS t FROM heartbeats UNION SELECT min(t) FROM "
                          "lifecycle)").fetchone()[0]
    return {"t0": t0, "producers": list(out.values()), "lifecycle": events,
            "errors": index.rows("SELECT t, role, role_id, error, failure, message FROM errors ORDER BY t DESC "
                                 "LIMIT 100")}


def _by_producer(index: RunIndex) -> dict[str, list[tuple[float, int, int, int | None, float | None]]]:
    """Each producer's heartbeats in time order: (t, pid, version, in-flight limit, engine idle share)."""
    out: dict[str, list[tuple[float, int, int, int | None, float | None]]] = {}
    for producer_id, *row in index.db.execute(
            "SELECT producer_id, t, pid, version, inflight_limit, engine_idle FROM heartbeats ORDER BY producer_id, t"):
        out.setdefault(producer_id, []).append(tuple(row))
    return out


def compare(index: RunIndex, a: int, b: int) -> dict[str, Any]:
    """Steps `a` and `b`: every metric of both rows, and a summary of each step's samples."""
    def row(step: int) -> dict[str, Any]:
        r = index.db.execute("SELECT row FROM metrics WHERE step=? AND is_eval=0 ORDER BY rowid DESC LIMIT 1",
                             (step,)).fetchone()
        return json.loads(r[0]) if r else {}

    def summary(step: int) -> dict[str, Any]:
        got = index.rows("SELECT count(*) AS samples, count(DISTINCT group_id) AS groups, avg(reward) AS reward, "
                         "avg(response_len) AS length, avg(staleness) AS staleness, max(staleness) AS max_staleness, "
                         "group_concat(DISTINCT producer_id) AS producers FROM samples WHERE step=?", (step,))
        return got[0]

    ra, rb = row(a), row(b)
    keys = sorted(set(ra) | set(rb))
    return {"a": a, "b": b, "metrics": [{"metric": k, "a": ra.get(k), "b": rb.get(k)} for k in keys],
            "samples": {"a": summary(a), "b": summary(b)}}
