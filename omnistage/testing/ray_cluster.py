"""A real Ray cluster on this machine, on loopback, for tests and benchmarks.

Every node and port is on 127.0.0.2 (loopback: ``ray start`` replaces 127.0.0.1 by the
host's outward address, ``ray._private.services.resolve_ip_for_localhost``, but keeps any
other address).

:class:`LocalRayCluster` runs ``ray start --head`` and any number of ``ray start
--address`` worker nodes as child processes (each in its own session, so that one node can
be killed alone, as a lost node), every port chosen free, every file under one temporary
directory. Each node gets its own custom resource (``{"<name>": 1}``), so a stage pins
itself to a node with ``resources.custom: {<name>: 1}``. :meth:`LocalRayCluster.stop`
kills the processes it started, by their process group, and removes the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.testing.waits import free_ports

RAY = str(Path(sys.executable).with_name("ray"))
NODE_IP = "127.0.0.2"  # every node's address (see above)


_NODE_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
"""The ports each node is given (``ray start`` options), picked free and distinct."""


@dataclass
class RayNode:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class LocalRayCluster:
    """Args: ``cpus``: logical CPUs each node declares (Ray's scheduling unit, not a
    limit on what runs there)."""

    cpus: int = 4
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")))
    nodes: dict[str, RayNode] = field(default_factory=dict)
    port: int = 0

    @property
    def address(self) -> str:
        return f"{NODE_IP}:{self.port}"

    def start_head(self, name: str = "head", timeout_s: float = 60.0) -> None:
        # the node's own ports are picked with these, so that none of them repeats one
        self.port, dashboard, *ports = free_ports(2 + len(_NODE_PORTS), NODE_IP)
        # --no-monitor: no autoscaler (nothing to scale), whose metrics server binds the fixed
        # port 44217 on every interface (two clusters at once would collide)
        head = ["--head", f"--port={self.port}", f"--temp-dir={self.root}", "--include-dashboard=false",
                f"--dashboard-port={dashboard}", "--no-monitor"]  # fmt: skip
        self._start(name, head, timeout_s, ports)

    def add_node(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a worker node that joins the head, and wait until the cluster has it."""
        self._start(name, [f"--address={self.address}"], timeout_s, free_ports(len(_NODE_PORTS), NODE_IP))

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of node ``name`` (its raylet, its workers): a lost node."""
        node = self.nodes.pop(name)
        _kill_group(node.process, signal.SIGKILL)

    def stop(self) -> None:
        for name in reversed(list(self.nodes)):
            _kill_group(self.nodes.pop(name).process, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _start(self, name: str, role: list[str], timeout_s: float, ports: list[int]) -> None:
        """Start node ``name`` with ``ports`` (distinct, one per :data:`_NODE_PORTS` option:
        Ray refuses a node whose components were given one port twice)."""
        log = self.root / f"{name}.log"
        command = [
            RAY, "start", "--block", *role, f"--node-ip-address={NODE_IP}", f"--num-cpus={self.cpus}",
            "--num-gpus=0", f"--resources={json.dumps({name: 1})}", "--disable-usage-stats",
            *(f"--{option}={port}" for option, port in zip(_NODE_PORTS, ports, strict=True)),
            "--object-store-memory=100000000", "--include-log-monitor=false",
        ]  # fmt: skip
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.nodes[name] = RayNode(name, process, log)
        deadline = time.monotonic() + timeout_s
        while b"Ray runtime started" not in log.read_bytes():  # `ray start` logs it once the node runs
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {name!r} did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.1)


def _kill_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Signal ``process``, its process group and every descendant (Ray starts its worker
    processes in groups of their own), all at once: a node that is gone at one instant."""
    targets = {process.pid, *_descendants(process.pid)}
    for pid in targets:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def _descendants(root: int) -> set[int]:
    """Process ids below ``root`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
