"""The current figures: one table, made from bench/results/*.json, in docs/benchmarks.md and (headline rows) README.md.

    .venv/bin/python bench/report.py            # rewrite both tables in place
    .venv/bin/python bench/report.py --check    # exit 1 if either page's table is not what the results say

Each figure reads one or two results files and states a value, its spread over seeds or rounds, and a ratio
against its baseline (raw nats-py, bare vLLM, TRL, the synchronous schedule, the run's own first steps, ...), with
the command, commit, date and machine of the measurement. A results file that does not record its commit, date or
machine gets them from PROVENANCE below, which says where each came from. tests/unit/test_docs_report.py checks
that both pages hold exactly what this module makes now, so README and docs/benchmarks.md cannot disagree.

A new measurement: run its bench (it writes bench/results/NAME.json and its section of docs/benchmarks.md), point
its figure below at the new file, and run this script.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BEGIN = "<!-- current figures: made by bench/report.py from bench/results/*.json; edit those, not this table -->"
END = "<!-- end of current figures -->"

#: What a results file does not record itself, and where it was read. "git" means: the commit that wrote the file
#: into bench/results (`git log -- bench/results/NAME.json`), whose date is the measurement's; "docs" names the
#: docs/benchmarks.md section that reported the run.
PROVENANCE: dict[str, dict[str, str]] = {
    "bus.json": {"commit": "f7e88fa", "date": "2026-12-01",
                 "source": "git: written by f7e88fa; docs: 'Before and after the re-layout' (re-run on that tree)"},
    "trainer.json": {"commit": "f7e88fa", "date": "2026-12-01", "command": "python bench/trainer.py",
                     "source": "git: written by f7e88fa; docs: 'Before and after the re-layout' (after: 0.92)"},
    "transfer_queue.json": {"commit": "f7e88fa", "date": "2026-12-01",
                            "source": "git: written by f7e88fa; docs: 'Before and after the re-layout'"},
    "rollout.json": {"commit": "f7e88fa", "date": "2026-12-01",
                     "source": "git: written by f7e88fa; docs: 'Before and after the re-layout'"},
    "recorder.json": {"commit": "f7e88fa", "date": "2026-12-01", "command": "OMP_NUM_THREADS=1 python bench/recorder.py",
                      "source": "git: written by f7e88fa; docs: 'Recorder' (command)"},
    "weights.json": {"commit": "0866641", "date": "2026-12-01", "source": "git: last written by 0866641"},
    "vllm_engine_prefill_whole.json": {
        "commit": "f6012c1", "date": "2026-12-03",
        "command": "python bench/vllm_engine.py --concurrency 1 16 64 --max-new-tokens 64 --rounds 2 --loads 3",
        "source": "docs: 'Prompts prefilled whole on CPU', now in benchmarks-history.md (tree f6012c1, command); "
                  "git: written by cf49313"},
    "endpoint.json": {"commit": "2550780", "date": "2026-12-03", "command": "python bench/endpoint.py --calls 20",
                      "source": "git: last written by 2550780; docs: 'OpenAI endpoint', its streaming re-run (command)"},
    "partial_rollout.json": {"commit": "b85a3ba", "date": "2026-12-03", "source": "git: written by b85a3ba"},
    "pipeline_after_weights_wait.json": {"commit": "4391aaf", "date": "2026-11-29", "source": "git: written by 4391aaf"},
    "pipeline_hf.json": {"commit": "3d334af", "date": "2026-12-01", "source": "git: written by 3d334af"},
    "peer_trl_adder1_400_s20-25_sync_trl.json": {"date": "2026-12-05",
                                                 "source": "git: written by 9869979 (its commit is in the file)"},
    "quickstart_seeds20_epyc_skip0_quiet.json": {"date": "2026-12-05", "source": "git: written by 5c8ef6b"},
    "quickstart_seeds20_epyc_skip0_busy.json": {"date": "2026-12-05", "source": "git: written by 5c8ef6b"},
    "quickstart_vllm_seeds20_epyc_lr5e-3_skip0_quiet.json": {"date": "2026-12-05", "source": "git: written by 481bf99"},
    "quickstart_vllm_seeds20_epyc_lr5e-3_skip0_busy.json": {"date": "2026-12-05", "source": "git: written by 4e9ec3c"},
    "smollm2_seeds60.json": {"date": "2026-12-03", "source": "git: written by 190a1d9"},
    "smollm2_seeds60_s12.json": {"date": "2026-12-04", "source": "git: written by 22f7e4d"},
}

#: Options that only say where a bench writes (results, kept runs, the docs section): left out of the command shown.
_OUTPUT_OPTIONS = {"--results", "--keep", "--docs", "--heading"}
_OUTPUT_FLAGS = {"--keep-runs"}


@dataclass(frozen=True)
class Reading:
    value: str
    spread: str
    ratio: str


@dataclass(frozen=True)
class Figure:
    title: str  # what is measured, as the table's first column says it
    section: str  # the heading (without "## ") of the docs/benchmarks.md section that reports it
    files: tuple[str, ...]  # results files under bench/results; the first gives command, commit, date, machine
    read: Callable[[list[dict[str, Any]]], Reading]
    headline: bool = False  # also in README.md's table


def slug(heading: str) -> str:
    """The anchor of a heading, as the docs site (Python-Markdown's toc) and GitHub both make it for plain
    headings (no " - ", no non-ASCII letters: tests/unit/test_docs_report.py keeps the linked ones so)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _seeds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "last10" in r]


def _learning(files: list[dict[str, Any]]) -> Reading:
    """bench/quickstart_seeds.py: reward over the last 10 steps of each seed, against its first 5 steps."""
    runs = [r for d in files for r in _seeds(d["runs"])]
    last, first = [r["last10"] for r in runs], [r["first5"] for r in runs]
    reached = sum(x >= 0.9 for x in last)
    mean_last, mean_first = statistics.fmean(last), statistics.fmean(first)
    return Reading(value=f"last-10-step reward {mean_last:.3f}; {reached} of {len(last)} seeds at or above 0.9",
                   spread=f"{min(last):.3f}-{max(last):.3f} over {len(last)} seeds",
                   ratio=f"{mean_last / mean_first:.2f}x its first 5 steps ({mean_first:.3f})")


def _bus(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    rounds = d["rlbus_rounds"]
    return Reading(value=f"{d['rlbus_events_per_s']:,.0f} events/s",
                   spread=f"{min(rounds):,.0f}-{max(rounds):,.0f} over {len(rounds)} rounds",
                   ratio=f"{d['ratio']:.2f}x raw nats-py ({d['raw_events_per_s']:,.0f})")


def _transfer_queue(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    rows = {r["path"]: r for r in d["rows"]}
    tq, raw = rows["TransferQueue put_many + get_list"], rows["raw ray.put/get (numpy)"]
    round_trips = [p + g for p, g in zip(tq["times"]["put"], tq["times"]["get"])]
    return Reading(value=f"{tq['round_trip_gbps']:.2f} GB/s round trip ({d['batch_mb']:.1f} MB batch)",
                   spread=f"{min(round_trips) * 1e3:.0f}-{max(round_trips) * 1e3:.0f} ms over {len(round_trips)} repeats",
                   ratio=f"{d['ratio']:.2f}x raw ray.put/get ({raw['round_trip_gbps']:.2f} GB/s)")


def _trainer(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    return Reading(value=f"{d['engine_tokens_per_s']:,.0f} tokens/s (FSDP2, 1 rank)",
                   spread="median of 3 steps",
                   ratio=f"{d['engine_over_plain']:.2f}x a plain PyTorch loop ({d['plain_tokens_per_s']:,.0f})")


def _rollout(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    per_round = [r["tokens_per_s"] for r in d["rounds_detail"] if r["path"] == "producer"]
    bare = d["paths"]["bare"]["tokens_per_s"]
    return Reading(value=f"{d['paths']['producer']['tokens_per_s']:,.0f} generated tokens/s",
                   spread=f"{min(per_round):,.0f}-{max(per_round):,.0f} over {len(per_round)} rounds",
                   ratio=f"{d['ratio']['producer_over_bare_tokens']:.2f}x bare model.generate ({bare:,.0f})")


def _vllm_engine(files: list[dict[str, Any]]) -> Reading:
    paths = files[0]["paths"]
    rlbus, bare, hf = paths["rlbus"]["64"], paths["bare"]["64"], paths["hf"]["64"]
    return Reading(value=f"{rlbus['tokens_per_s']:.0f} tokens/s at 64 requests ({hf['tokens_per_s']:.0f} on the HF "
                         f"engine)",
                   spread=f"+-{rlbus['spread']:.0f} over {rlbus['rounds']} rounds",
                   ratio=f"{rlbus['tokens_per_s'] / bare['tokens_per_s']:.2f}x bare vLLM ({bare['tokens_per_s']:.0f})")


def _weights(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    totals = [p + f + w for p, f, w in zip(d["times"]["publish"], d["times"]["fetch_verify"], d["times"]["load"])]
    return Reading(value=f"{d['total_s'] * 1e3:.0f} ms publish + producer load of {d['state_bytes'] / 1e6:.0f} MB",
                   spread=f"{min(totals) * 1e3:.0f}-{max(totals) * 1e3:.0f} ms over {len(totals)} repeats",
                   ratio=f"{d['over_clone']:.2f}x one fresh copy ({d['clone_s'] * 1e3:.0f} ms)")


def _recorder(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    return Reading(value=f"{d['recorder_s'] * 1e3:.1f} ms a step ({d['bytes_per_step']['total'] / 1e3:.0f} KB)",
                   spread=f"median of {d['config']['rounds']} rounds",
                   ratio=f"{d['overhead_frac']:.1%} of a training step")


def _inspector(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    pages = d["pages"]
    slowest = max(pages, key=lambda name: pages[name]["max_s"])
    return Reading(value=f"{d['open']['server_first_answer_s']:.1f} s to open {d['run']['steps']:,} steps and "
                         f"{d['run']['samples']:,} samples; every page <= "
                         f"{max(v['median_s'] for v in pages.values()) * 1e3:.0f} ms (median)",
                   spread=f"slowest request {pages[slowest]['max_s'] * 1e3:.0f} ms ({slowest}, first after start), "
                          f"{d['repeats']} per page",
                   ratio=f"index built once in {d['open']['first_s']:.1f} s, then cached")


def _env_task(files: list[dict[str, Any]]) -> Reading:
    """bench/env_task.py: held-out accuracy at version 0 and at the last version, each seed."""
    runs = [r for r in files[0]["runs"] if len(r["eval"]) >= 2 and r["eval"][0]["version"] == 0]
    first, last = [r["eval"][0]["accuracy"] for r in runs], [r["eval"][-1]["accuracy"] for r in runs]
    gains = [b - a for a, b in zip(first, last)]
    return Reading(value=f"held-out accuracy {statistics.fmean(first):.3f} at v0 -> {statistics.fmean(last):.3f} at "
                         f"v{runs[0]['eval'][-1]['version']} (mean of {len(runs)} seeds)",
                   spread=f"gain {min(gains) * 100:+.0f} to {max(gains) * 100:+.0f} points over {len(runs)} seeds",
                   ratio=f"{statistics.fmean(gains) * 100:+.0f} points over version 0")


def _trl_env(files: list[dict[str, Any]]) -> Reading:
    """bench/peer_env.py: time from process start to a held-out target, each side's mean over its seeds."""
    from bench.common import peer_summary

    s = peer_summary(files[0])
    mine, trl = s["reached"]["rlbus"], s["reached"]["trl"]
    finals = [r["saved"][-1]["accuracy"] for r in files[0]["runs"] if r["side"] == "rlbus" and r["rc"] == 0]
    others = sorted({r["side"] for r in files[0]["runs"]} - {"rlbus", "trl"})
    beside = ""
    for side in others:  # rlbus on another engine, against the same target (bench/peer_env.py --sides)
        o = peer_summary(files[0], mine=side, target=s["target"])
        got, of = o["reached"]["rlbus"], len(o["times"]["rlbus"])
        if not of:
            continue
        when = f"{statistics.fmean(got):.0f} s in {len(got)} of {of}" if got else f"not reached in {of} of {of}"
        beside += f"; {side}: {when}, final {o['final']['rlbus']:.3f}"
    return Reading(value=f"held-out accuracy {s['target']:.3f} reached in {statistics.fmean(mine):.0f} s "
                         f"(TRL {statistics.fmean(trl):.0f} s); final {s['final']['rlbus']:.3f} (TRL "
                         f"{s['final']['trl']:.3f}){beside}",
                   spread=f"{min(mine):.0f}-{max(mine):.0f} s, final {min(finals):.3f}-{max(finals):.3f} over "
                          f"{len(mine)} of {len(s['times']['rlbus'])} seeds (TRL: {len(trl)} of "
                          f"{len(s['times']['trl'])})",
                   ratio=f"{statistics.fmean(mine) / statistics.fmean(trl):.2f}x TRL's time" + _bound(s))


def _bound(s: dict[str, Any]) -> str:
    from bench.common import bounded_ratio

    if (b := bounded_ratio(s)) is None:
        return ""
    how, _, _, ratio = b
    how = f"{how} " if how else ""
    return f" among runs that reached it; {how}{ratio:.2f}x counting the others at their whole run time"


def _lora(files: list[dict[str, Any]]) -> Reading:
    d = files[0]
    t, s = d["trainer"], d["sync"]
    full, r8 = t["full"]["step_s"], t["lora_r8"]["step_s"]
    fb = s["full float32"]["bytes"]["median"]
    return Reading(value=f"LoRA r8 step {r8['median']:.1f} s (full {full['median']:.1f} s); a version's bytes: "
                         f"adapter {s['adapter r8']['bytes']['median'] / fb:.2%}, bf16 delta "
                         f"{s['delta bfloat16']['bytes']['median'] / fb:.1%} of a float32 copy's",
                   spread=f"{r8['min']:.1f}-{r8['max']:.1f} s over {r8['n']} steps",
                   ratio=f"{full['median'] / r8['median']:.2f}x full fine-tuning's step")


def _lora_layer(files: list[dict[str, Any]]) -> Reading:
    p = files[0]["passes"]
    med = {v: statistics.median(xs) for v, xs in p.items()}
    per_round = lambda a, b: statistics.median(x / y for x, y in zip(p[a], p[b]))  # noqa: E731
    ours = p["lora_rlbus"]
    return Reading(value=f"LoRA r8 pass {med['lora_rlbus']:.2f} s, peft's {med['lora_peft']:.2f} s, full "
                         f"{med['full']:.2f} s, frozen base {med['frozen']:.2f} s",
                   spread=f"{min(ours):.2f}-{max(ours):.2f} s over {len(ours)} rounds",
                   ratio=f"{per_round('lora_peft', 'lora_rlbus'):.2f}x peft's speed; "
                         f"{per_round('full', 'lora_rlbus'):.2f}x full's (a frozen base: "
                         f"{per_round('full', 'frozen'):.2f}x)")


def _lora_accuracy(files: list[dict[str, Any]]) -> Reading:
    s = files[0]["summary"]
    at = s["at_equal_wall_clock"]
    mean = lambda side: statistics.fmean(a[side][1] for a in at)  # noqa: E731
    diffs = ", ".join(f"{d * 100:+.1f}" for d in s["diffs"])
    return Reading(value=f"held-out accuracy at equal wall clock: LoRA {mean('lora'):.3f}, full {mean('full'):.3f}",
                   spread=f"LoRA minus full {diffs} points over {len(at)} seed(s)",
                   ratio=f"{statistics.fmean(s['diffs']) * 100:+.1f} points (goal: no worse than -2); full's runs "
                         f"{statistics.fmean(s['length']):.2f}x LoRA's time")


def _endpoint(files: list[dict[str, Any]]) -> Reading:
    c = files[0]["calls"]
    return Reading(value=f"{c['overhead_ms']:.1f} ms added per call", spread=f"p90 {c['overhead_p90_ms']:.1f} ms",
                   ratio=f"{c['overhead_ms'] / c['endpoint_engine_ms']:.1%} of the engine's time per call "
                         f"({c['endpoint_engine_ms']:.0f} ms)")


def _partial(files: list[dict[str, Any]]) -> Reading:
    s = files[0]["summary"]
    p, base = s["partial"], s["drop-chunk"]
    return Reading(value=f"{p['steps_per_min']:.1f} steps/min; {p['discarded_share']:.0%} of tokens discarded",
                   spread=f"{p['steps_per_min_min']:.1f}-{p['steps_per_min_max']:.1f} over {p['runs']} runs",
                   ratio=f"{p['steps_per_min'] / base['steps_per_min']:.2f}x finish-then-drop "
                         f"({base['steps_per_min']:.1f}; {base['discarded_share']:.0%} discarded)")


def _pipeline(workload: str, producers: int, mode: str) -> Callable[[list[dict[str, Any]]], Reading]:
    def read(files: list[dict[str, Any]]) -> Reading:
        rows = {(r["num_producers"], r["mode"]): r for r in files[0]["results"] if r["workload"] == workload}
        row, sync = rows[(producers, mode)], rows[(producers, "sync")]
        return Reading(value=f"{row['steps_per_min']:.1f} steps/min, {producers} producer(s), {mode}",
                       spread=f"1 run of {row['measured_steps']} measured steps",
                       ratio=f"{row['steps_per_min'] / sync['steps_per_min']:.2f}x synchronous "
                             f"({sync['steps_per_min']:.1f})")

    return read


def _trl_speed(files: list[dict[str, Any]]) -> Reading:
    s = files[0]["summary"]
    mine, trl = s["rlbus"]["steps_per_min"], s["trl"]["steps_per_min"]
    return Reading(value=f"{statistics.fmean(mine):.0f} steps/min (steady)",
                   spread=f"{min(mine):.0f}-{max(mine):.0f} over {len(mine)} seeds",
                   ratio=f"{statistics.fmean(mine) / statistics.fmean(trl):.2f}x TRL's GRPOTrainer "
                         f"({statistics.fmean(trl):.0f})")


def _trl_lora(files: list[dict[str, Any]]) -> Reading:
    s = files[0]["summary"]
    mine, trl = s["rlbus"], s["trl"]
    rate = lambda side: statistics.fmean(side["steps_per_min"])  # noqa: E731
    reward = lambda side: statistics.fmean(side["last10"])  # noqa: E731
    return Reading(value=f"{rate(mine):.1f} steps/min (steady); last-10-step reward {reward(mine):.3f} (TRL "
                         f"{reward(trl):.3f})",
                   spread=f"{min(mine['steps_per_min']):.1f}-{max(mine['steps_per_min']):.1f} steps/min over "
                          f"{len(mine['steps_per_min'])} seeds",
                   ratio=f"{rate(mine) / rate(trl):.2f}x TRL's GRPOTrainer with LoRA ({rate(trl):.1f})")


def _trl_learning(files: list[dict[str, Any]]) -> Reading:
    s = files[0]["summary"]
    mine, trl = s["rlbus"]["last10"], s["trl"]["last10"]
    return Reading(value=f"last-10-step reward {statistics.fmean(mine):.3f} after {files[0]['steps']} steps",
                   spread=f"{min(mine):.3f}-{max(mine):.3f} over {len(mine)} seeds",
                   ratio=f"{statistics.fmean(mine) / statistics.fmean(trl):.2f}x TRL's ({statistics.fmean(trl):.3f})")


#: What waits in each agentic workload (bench/agentic_workloads.py), for the figure's words.
_AGENTIC_WAITS = {"b1": "tool", "b2": "judge", "b3": "environment-step"}


def _agentic(files: list[dict[str, Any]]) -> Reading:
    """bench/agentic.py: steps/min of the asynchronous arm with the slow service, against its synchronous arm (and
    TRL's, where the file has it) and the no-latency run."""
    runs = [r for r in files[0]["runs"] if "steps_per_min" in r]
    arms = [a for a in ("nolat", "async", "sync", "trl") if any(r["arm"] == a for r in runs)]
    rate = {a: [r["steps_per_min"] for r in runs if r["arm"] == a] for a in arms}
    mean = {a: statistics.fmean(v) for a, v in rate.items()}
    median = {r["median_s"] for r in runs if r["arm"] == "async"}
    waits = _AGENTIC_WAITS.get(files[0].get("workload", "b1"), "service")
    ratio = f"{mean['async'] / mean['sync']:.2f}x synchronous ({mean['sync']:.1f})"
    if "trl" in mean:  # on the seeds TRL ran: one seed's arms share a machine's load, other seeds' need not
        seeds = {r["seed"] for r in runs if r["arm"] == "trl"}
        paired = statistics.fmean(r["steps_per_min"] for r in runs if r["arm"] == "async" and r["seed"] in seeds)
        ratio += f"; {paired / mean['trl']:.0f}x TRL ({mean['trl']:.1f}) on seed(s) {', '.join(map(str, sorted(seeds)))}"
    return Reading(value=f"{mean['async']:.1f} steps/min with a {'/'.join(f'{m:g}' for m in sorted(median))} s "
                         f"median {waits} latency; {mean['async'] / mean['nolat']:.0%} of no latency "
                         f"({mean['nolat']:.1f})",
                   spread=f"{min(rate['async']):.1f}-{max(rate['async']):.1f} over {len(rate['async'])} seeds",
                   ratio=ratio)


FIGURES: tuple[Figure, ...] = (
    Figure("Quickstart learns its tool (HF engine)",
           "Quickstart, the model rlbus ships: 20 seeds, quiet",
           ("quickstart_seeds20_shipped_quiet.json",), _learning, headline=True),
    Figure("Quickstart learns its tool (HF engine, cores kept busy)",
           "Quickstart, the model rlbus ships: 10 seeds, both cores busy",
           ("quickstart_seeds10_shipped_busy.json",), _learning),
    Figure("Quickstart on the vLLM engine",
           "The vLLM quickstart, its model rebuilt (6 December): 20 seeds, quiet",
           ("quickstart_vllm_seeds20_w3000_quiet.json",), _learning, headline=True),
    Figure("Quickstart on the vLLM engine (cores kept busy)",
           "The vLLM quickstart, its model rebuilt (6 December): 10 seeds, both cores busy",
           ("quickstart_vllm_seeds10_w3000_busy.json",), _learning),
    Figure("SmolLM2-135M-Instruct on the calculator task, 60 steps",
           "SmolLM2-135M-Instruct on the calculator task, 60 steps",
           ("smollm2_seeds60.json", "smollm2_seeds60_s12.json"), _learning, headline=True),
    Figure("SmolLM2-135M-Instruct learns a reasoning-gym task: gcd up to 20, 30 steps",
           "Learning a reasoning-gym task: gcd up to 20, SmolLM2-135M-Instruct",
           ("env_task_gcd_smollm2.json",), _env_task, headline=True),
    Figure("SmolLM2-135M-Instruct learns a reasoning-gym task: syllogism, 30 steps",
           "Learning a reasoning-gym task: syllogism, SmolLM2-135M-Instruct",
           ("env_task_syllogism_smollm2.json",), _env_task, headline=True),
    Figure("Asynchronous against synchronous (long-tailed generation)",
           "Pipeline", ("pipeline_after_weights_wait.json",), _pipeline("simulated", 16, "async-2"), headline=True),
    Figure("Asynchronous against synchronous (the quickstart, HF engine)",
           "Pipeline on the HF engine", ("pipeline_hf.json",), _pipeline("quickstart", 1, "async-2")),
    Figure("Against TRL: speed (one-digit sums, 200 steps)",
           "Against TRL's GRPOTrainer on a task that learns: one-digit sums",
           ("peer_trl_adder1.json",), _trl_speed, headline=True),
    Figure("Against TRL: learning per step (one-digit sums, 400 steps)",
           "One-digit sums: synchronous rlbus against TRL on six more seeds (4-5 December)",
           ("peer_trl_adder1_400_s20-25_sync_trl.json",), _trl_learning, headline=True),
    Figure("Against TRL: time to a held-out target (syllogism, SmolLM2-135M-Instruct, 30 steps)",
           "Against TRL's GRPOTrainer on a reasoning-gym task: syllogism_smollm2",
           ("peer_env_syllogism_smollm2.json",), _trl_env, headline=True),
    Figure("Against TRL: time to a held-out target (gcd up to 20, SmolLM2-135M-Instruct, 30 steps)",
           "Against TRL's GRPOTrainer on a reasoning-gym task: gcd_smollm2",
           ("peer_env_gcd_smollm2.json",), _trl_env),
    Figure("Partial rollout (long-tailed generation)", "Partial rollout", ("partial_rollout.json",), _partial),
    Figure("Agentic: the quickstart with a slow tool (asynchronous against synchronous)", "Agentic: a slow tool",
           ("agentic.json",), _agentic),
    Figure("Agentic: a straggling environment, 2% of steps 30 s, 0.5% hung (asynchronous against synchronous)",
           "Agentic: a straggling environment", ("agentic_b3.json",), _agentic),
    Figure("Bus: trajectory events end to end", "Bus", ("bus.json",), _bus, headline=True),
    Figure("TransferQueue: a batch's tensors through Ray", "TransferQueue", ("transfer_queue.json",),
           _transfer_queue, headline=True),
    Figure("Trainer step", "Trainer", ("trainer.json",), _trainer, headline=True),
    Figure("Producer path (HF engine)", "Rollout", ("rollout.json",), _rollout, headline=True),
    Figure("vLLM engine throughput (SmolLM2, CPU)", "vLLM engine", ("vllm_engine_prefill_whole.json",), _vllm_engine,
           headline=True),
    Figure("Weight sync (SmolLM2, 651 MB)", "Weights", ("weights.json",), _weights, headline=True),
    Figure("Event recorder (logging.record: full)", "Recorder", ("recorder.json",), _recorder),
    Figure("OpenAI-compatible endpoint", "OpenAI endpoint", ("endpoint.json",), _endpoint),
    Figure("LoRA and weight sync (SmolLM2)", "LoRA and weight sync", ("lora.json",), _lora),
    Figure("LoRA's adapted layers: one forward and backward (SmolLM2)", "LoRA's adapted layers", ("lora_layer.json",),
           _lora_layer),
    Figure("LoRA against full fine-tuning at equal wall clock (gcd up to 20, SmolLM2)",
           "LoRA against full fine-tuning at equal wall clock", ("lora_accuracy.json",), _lora_accuracy),
    Figure("Against TRL with LoRA: speed and reward (two-digit sums, SmolLM2, 20 steps)",
           "Against TRL's GRPOTrainer with LoRA: SmolLM2-135M-Instruct", ("peer_trl_smollm2_lora_s2-5.json",),
           _trl_lora),
    Figure("Web inspector (`rlbus ui`) on a large run", "Inspector", ("inspector.json",), _inspector),
)


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def command(raw: str) -> str:
    """The bench's command as a user would type it: output options left out, a run of seeds as `$(seq A B)`;
    commands joined by ` && ` (a figure made of two runs) each so."""
    if " && " in raw:
        return " && ".join(command(part) for part in raw.split(" && "))
    words = shlex.split(raw)
    words[0] = words[0].removeprefix(".venv/bin/")
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in _OUTPUT_OPTIONS:
            i += 2
            continue
        if w in _OUTPUT_FLAGS:
            i += 1
            continue
        if w == "--seeds":
            j = i + 1
            while j < len(words) and words[j].isdigit():
                j += 1
            seeds = [int(s) for s in words[i + 1 : j]]
            if len(seeds) > 3 and seeds == list(range(seeds[0], seeds[-1] + 1)):
                out += ["--seeds", f"$(seq {seeds[0]} {seeds[-1]})"]
            else:
                out += words[i:j]
            i = j
            continue
        out.append(w)
        i += 1
    return " ".join(w if w.startswith("$(") else shlex.quote(w) for w in out)


def machine(d: dict[str, Any]) -> str:
    m = d.get("machine") or {}
    text = f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores"
    if "load_avg_1m" in m:
        text += f", load {m['load_avg_1m']:.1f}"
    if d.get("busy_cpus"):
        text += f", {d['busy_cpus']} cores kept busy"
    return text.replace("Intel(R) Xeon(R) Processor", "Intel Xeon")


def provenance(name: str, d: dict[str, Any]) -> dict[str, str]:
    """command, commit, date of a results file: its own where it records them, else PROVENANCE's."""
    known = PROVENANCE.get(name, {})
    commit = d.get("commit") or d.get("rlbus_commit") or known.get("commit")
    date = (d.get("started") or d.get("date") or "")[:10] or known.get("date")
    raw = d.get("command") or known.get("command")
    missing = [k for k, v in (("commit", commit), ("date", date), ("command", raw)) if not v]
    if missing:
        raise KeyError(f"bench/results/{name} records no {', '.join(missing)}: add it to PROVENANCE in bench/report.py")
    return {"command": command(raw), "commit": commit, "date": date}


def rows(*, headline_only: bool = False, link_prefix: str = "") -> list[str]:
    out = ["| figure | value | spread | against its baseline | command | commit | date | machine |",
           "|---|---|---|---|---|---|---|---|"]
    for fig in FIGURES:
        if headline_only and not fig.headline:
            continue
        data = [_load(name) for name in fig.files]
        r = fig.read(data)
        p = provenance(fig.files[0], data[0])
        cells = [f"[{fig.title}]({link_prefix}#{slug(fig.section)})", r.value, r.spread, r.ratio,
                 f"`{p['command']}`", f"`{p['commit']}`", p["date"], machine(data[0])]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out


def table(*, headline_only: bool = False, link_prefix: str = "") -> str:
    """The table with its markers, as it stands in a page."""
    return "\n".join([BEGIN, "", *rows(headline_only=headline_only, link_prefix=link_prefix), "", END])


def readme_table() -> str:
    return table(headline_only=True, link_prefix="docs/benchmarks.md")


def benchmarks_table() -> str:
    return table()


def current(text: str) -> str:
    """The table between the markers of a page (ValueError if the page has none)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError("no current-figures markers")
    return text[start : end + len(END)]


def write(path: Path, made: str) -> bool:
    """Put `made` between the page's markers; True if the page changed."""
    text = path.read_text()
    new = text.replace(current(text), made)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's table differs from the results")
    args = ap.parse_args(argv)
    pages = {README: readme_table(), BENCHMARKS: benchmarks_table()}
    if args.check:
        stale = [p.name for p, made in pages.items() if current(p.read_text()) != made]
        if stale:
            print(f"stale current-figures table in {', '.join(stale)}: run python bench/report.py", file=sys.stderr)
            return 1
        return 0
    for path, made in pages.items():
        print(f"{path.relative_to(ROOT)}: {'updated' if write(path, made) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # run as a script: the repository root, for `bench.common`
    sys.exit(main())
