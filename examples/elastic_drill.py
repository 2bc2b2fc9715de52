"""A lost node and a node that comes back, on one machine: the elastic pattern of train_llama.py.

    PYTHONPATH=. .venv/bin/python examples/elastic_drill.py --workdir /tmp/drill

1. A single process trains the built-in Llama for --steps steps (the uninterrupted reference).
2. Two torchrun agents of 2 processes each (--nnodes 1:2, c10d rendezvous on 127.0.0.1) train the
   same steps with a checkpoint every --save-every steps. When a 4-process step is logged, one
   agent and its workers are killed with SIGKILL (a lost node): the survivor's workers fail,
   torchrun restarts them on 2 processes, autopar re-plans and resumes from the newest complete
   checkpoint. With --scale-up, when a 2-process step is logged, a third agent joins and the next
   rendezvous scales the job back to 4 processes the same way. Every agent runs with
   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's default (the agent of rendezvous rank 0
   shares its own store with the workers) a node that joins a later round waits for the round's
   MASTER_ADDR key, which that agent publishes only in the round it created its store
   (DynamicRendezvousHandler.next_rendezvous, torch 2.13), until the store times out (60 s) and
   the job fails. A later round is joined by a node that comes back, and also by agent b when it
   starts after agent a's last call (2 s), which a loaded machine makes likely: the drill's flake.
3. Checked: the remaining agent(s) exit 0; the job ran on 4, then 2 (then 4) processes; every step's
   last loss equals the reference's within --tolerance; every step's samples are the
   reference's, each read once.

Prints one line per check and exits 1 if one fails. `run_drill` is what tests/dist/test_elastic.py
runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

EXAMPLE = Path(__file__).with_name("train_llama.py")
RDZV_CONF = "join_timeout=120,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass
class DrillResult:
    exit_codes: dict[str, int | None]
    worlds: list[int]
    """The world size of each logged step, in log order."""
    loss_errors: dict[int, float]
    """Per step: |last logged loss - reference loss|."""
    sample_problems: list[str]
    outputs: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def training_command(args, log: Path, checkpoints: Path) -> list[str]:
    return [str(EXAMPLE), "--elastic", "--steps", str(args.steps), "--save-every", str(args.save_every),
            "--checkpoints", str(checkpoints), "--step-log", str(log), "--step-sleep-s", str(args.step_sleep_s)]


AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What every agent of an elastic job needs on torch 2.13 so that a node can join a running job
(docs/guide.md, Elastic training)."""


def start_agent(args, port: int, log: Path, checkpoints: Path, output: Path, *, host: bool) -> subprocess.Popen:
    """One torchrun agent of 2 processes. On one machine every agent would take itself for the
    rendezvous host (127.0.0.1 is its own address) and two stores could bind the port at once:
    is_host says which one serves it, as the endpoint's hostname does across machines."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "drill", "--rdzv-conf", f"{RDZV_CONF},is_host={str(host).lower()}",
               "--max-restarts", "4", "--monitor-interval", "0.5", *training_command(args, log, checkpoints)]
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPAR_COLLECTIVE_TIMEOUT_S="60", **AGENT_ENV)
    return subprocess.Popen(command, env=env, stdout=output.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as a lost machine takes them."""
    workers = children(agent.pid)
    for pid in [agent.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def read_log(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_for(condition, deadline_s: float, what: str, agents: list[subprocess.Popen]) -> None:
    while not condition():
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"drill: gave up waiting for {what}")
        if all(agent.poll() is not None for agent in agents):
            raise RuntimeError(f"drill: every agent ended while waiting for {what}")
        time.sleep(0.2)


def run_reference(args, workdir: Path) -> list[dict]:
    log = workdir / "reference.jsonl"
    command = [sys.executable, *training_command(args, log, workdir / "reference-ckpt")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    subprocess.run(command, env=env, check=True, timeout=args.timeout_s, stdout=subprocess.DEVNULL)
    return read_log(log)


def run_drill(args, workdir: Path) -> DrillResult:
    import shutil

    for name in ("reference.jsonl", "reference-ckpt", "job.jsonl", "ckpt"):  # a fresh start
        shutil.rmtree(workdir / name, ignore_errors=True) if (workdir / name).is_dir() else \
            (workdir / name).unlink(missing_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    reference = {record["step"]: record for record in run_reference(args, workdir)}
    log, checkpoints, port = workdir / "job.jsonl", workdir / "ckpt", free_port()
    deadline_s = time.monotonic() + args.timeout_s
    agents: dict[str, subprocess.Popen] = {}
    try:
        agents["a"] = start_agent(args, port, log, checkpoints, workdir / "agent-a.txt", host=True)
        time.sleep(1)  # agent a hosts the rendezvous store: it must not be the one that is lost
        agents["b"] = start_agent(args, port, log, checkpoints, workdir / "agent-b.txt", host=False)
        live = lambda: [agent for agent in agents.values() if agent.poll() is None]  # noqa: E731
        wait_for(lambda: any(r["world"] == 4 and r["step"] > args.save_every for r in read_log(log)),
                 deadline_s, "a 4-process step after the first checkpoint", live())
        kill_node(agents["b"])
        wait_for(lambda: sum(r["world"] == 2 for r in read_log(log)) >= 2, deadline_s, "2-process steps", live())
        if args.scale_up:
            agents["c"] = start_agent(args, port, log, checkpoints, workdir / "agent-c.txt", host=False)
        for name in ("a", "c") if args.scale_up else ("a",):
            agents[name].wait(timeout=max(deadline_s - time.monotonic(), 1))
    except (RuntimeError, TimeoutError) as error:  # what the agents said is the diagnosis
        tails = "".join(f"\n--- {path.name}, last lines:\n" + "\n".join(path.read_text().splitlines()[-30:])
                        for path in sorted(workdir.glob("agent-*.txt")))
        raise type(error)(f"{error}{tails}") from None
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                kill_node(agent)
    return _check(read_log(log), reference, agents, workdir)


def _check(records: list[dict], reference: dict[int, dict], agents: dict, workdir: Path) -> DrillResult:
    final = _final_attempts(records)
    loss_errors = {step: abs(final[step][0]["loss"] - ref["loss"]) if step in final else float("inf")
                   for step, ref in reference.items()}
    return DrillResult(exit_codes={name: agent.returncode for name, agent in agents.items()},
                       worlds=[record["world"] for record in records if record["rank"] == 0],
                       loss_errors=loss_errors, sample_problems=_sample_problems(final, reference),
                       outputs={name: (workdir / f"agent-{name}.txt").read_text()[-4000:] for name in agents})


def _final_attempts(records: list[dict]) -> dict[int, list[dict]]:
    """Per step, the records of its last attempt (a step run, then lost, is run again), rank order."""
    newest: dict[int, int] = {}
    for record in records:
        newest[record["step"]] = max(newest.get(record["step"], 0), record["attempt"])
    final: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        if record["attempt"] == newest[record["step"]]:
            final[record["step"]].append(record)
    return {step: sorted(found, key=lambda r: r["rank"]) for step, found in final.items()}


def _sample_problems(final: dict[int, list[dict]], reference: dict[int, dict]) -> list[str]:
    """Each step's last attempt read the reference's samples, each once (one replica's ranks
    read the same rows: counted once per data-parallel rank)."""
    problems = []
    for step, ref in reference.items():
        if step not in final:
            problems.append(f"step {step} was never run")
            continue
        by_replica = {record["dp_rank"]: record["samples"] for record in final[step]}
        read = sorted(index for samples in by_replica.values() for index in samples)
        if len(final[step]) != final[step][0]["world"]:
            problems.append(f"step {step}: {len(final[step])} of {final[step][0]['world']} ranks logged it")
        if read != sorted(ref["samples"]):
            problems.append(f"step {step} read {read}, the reference {sorted(ref['samples'])}")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="elastic-drill")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--step-sleep-s", type=float, default=1.0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--timeout-s", type=float, default=480.0)
    parser.add_argument("--scale-up", action="store_true",
                        help="add a third agent after the loss; the job grows back to 4 processes")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    result = run_drill(args, Path(args.workdir))
    worst = max(result.loss_errors.values())
    survivors, worlds = (("a", "c"), (4, 2, 4)) if args.scale_up else (("a",), (4, 2))
    checks = {f"agent(s) {', '.join(survivors)} exit 0": all(result.exit_codes[name] == 0 for name in survivors),
              f"ran on {', then '.join(map(str, worlds))} processes": _went(result.worlds, worlds),
              f"every step's loss within {args.tolerance:g} of the reference (worst {worst:.2e})": worst <= args.tolerance,
              "every sample read once, as in the reference": not result.sample_problems}
    for check, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {check}")
    for problem in result.sample_problems[:5]:
        print("     ", problem)
    return 0 if all(checks.values()) else 1


def _went(worlds: list[int], sequence: tuple[int, ...]) -> bool:
    changes = [world for index, world in enumerate(worlds) if index == 0 or worlds[index - 1] != world]
    return changes == list(sequence)


if __name__ == "__main__":
    sys.exit(main())
