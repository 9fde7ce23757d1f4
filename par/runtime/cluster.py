"""A cluster on one Linux machine: hosts as network namespaces, joined by a switch, links shaped by `tc`.

    host h0 (netns)            switch (netns: a bridge)            host h1 (netns)
    eth0 10.213.0.1 ──veth── h0 ┤ br0 ├ h1 ──veth── eth0 10.213.0.2
    tc tbf: RATE out            tc tbf: RATE out to each host

Each host is a network namespace with its own loopback and one link (a veth pair) to a switch
namespace, where a bridge joins the links. `tc tbf` caps every link at `rate` in both directions
(the host's eth0 and the switch's port towards it); netem adds latency where the kernel has it.
Nothing is created outside the namespaces this module names (`<prefix>-h0`, `<prefix>-sw`, ...):
deleting them deletes every link and address.

`Cluster.run(target, args)` starts one torchrun per host, exactly the command of
`par.runtime.multinode.MultiNode` (c10d rendezvous at h0, `--local-addr` the host's address, gloo bound to
eth0 with GLOO_SOCKET_IFNAME), streams every line prefixed with its host, and returns what rank 0
saved. Ranks of one host talk over that host's own stack (loopback), ranks of different hosts
over the shaped links: the bandwidth hierarchy of a real cluster.

Failure: the first host whose torchrun exits non-zero starts a short grace period, after which
every host still running is powered off; the `ClusterError`'s first line names the host that
failed first (a host that died from a signal before one whose ranks only saw a peer vanish).
Teardown always: `with Cluster(...)`, atexit, SIGTERM and SIGHUP (like Ctrl-C). A SIGKILLed owner cannot
clean up: its torchruns die with it (a parent-death signal), their ranks follow (`par.runtime.dist`'s
watchdog), and the next cluster removes its namespaces (`cleanup_stale`), saying so in one line.
Root only: `available()` says why not.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from par.runtime import lifeline
from par.runtime.failure import describe_failure, signal_name
from par.runtime.multinode import MultiNode

PREFIX = "parc"                  # every namespace this module creates starts with it
SUBNET = "10.213.0"              # host i is SUBNET.(i+1); only inside our namespaces
CMD_TIMEOUT = 20                 # seconds for one `ip`/`tc` call
MARK = "[par-mark]"              # a rank's line `[par-mark] NAME`: read the links' byte counters now


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or its job failed: the first line is the cause."""

    @property
    def root_cause(self) -> str:
        return str(self).splitlines()[0]


def missing() -> str | None:
    """Why an emulated cluster cannot be built here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` binary is missing (install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, e.g. in CI)"
    return None


def sh(*cmd: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    """Run one `ip`/`tc` command; a failure is a ClusterError naming the command and what it said."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def namespaces() -> list[str]:
    """Every network namespace on the machine (`ip netns list`)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def ours(prefix: str = PREFIX) -> list[str]:
    return [n for n in namespaces() if n.startswith(prefix + "-")]


def pids_in(ns: str) -> list[int]:
    p = sh("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def delete_namespace(ns: str) -> None:
    """Kill every process inside `ns`, then delete it (its links and addresses go with it)."""
    for pid in pids_in(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(50):
        if sh("ip", "netns", "del", ns, check=False).returncode == 0 or ns not in namespaces():
            return
        time.sleep(0.1)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces `<prefix>-<pid>-...` whose creating process `pid` is gone (a crash, a kill -9)."""
    removed = []
    for ns in ours(prefix):
        m = re.match(re.escape(prefix) + r"-(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            delete_namespace(ns)
            removed.append(ns)
    return removed


def tbf(ns: str, dev: str, rate: str, delay_ms: float = 0.0) -> None:
    """Cap `dev`'s egress at `rate` (tc tbf; a burst of 2 ms at that rate); add netem delay when asked."""
    bits = parse_rate(rate)
    burst = max(64 * 1024, int(bits / 8 * 0.002))
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
       "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "200ms")
    if delay_ms:
        p = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
               "netem", "delay", f"{delay_ms}ms", check=False)
        if p.returncode != 0:
            raise ClusterError(f"latency needs tc netem, which this kernel lacks ({p.stderr.strip()}): "
                               f"use delay_ms=0 (bandwidth alone, tbf)")


def parse_rate(rate: str | float) -> float:
    """Bits per second of '1gbit', '200mbit', '500kbit' or a number (bits/s)."""
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ClusterError(f"rate {rate!r}: write it as tc does, e.g. '1gbit', '200mbit' or a number of bits/s")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


_LIVE: set = set()


@atexit.register
def _teardown_all():
    for c in list(_LIVE):
        c.teardown()


class Cluster:
    """`hosts` emulated machines joined by a switch, each link capped at `rate` (None: unshaped).

    Use as a context manager: the namespaces exist inside the `with` block and never after it.
    """

    def __init__(self, hosts: int = 2, rate: str | float | None = "1gbit", delay_ms: float = 0.0,
                 prefix: str = PREFIX):
        why = missing()
        if why:
            raise ClusterError(f"cannot build an emulated cluster: {why}")
        if hosts < 1:
            raise ClusterError(f"hosts must be at least 1, got {hosts}")
        self.prefix = prefix
        self.tag = f"{prefix}-{os.getpid()}-{next(_COUNTER)}"
        self.hosts = [f"h{i}" for i in range(hosts)]
        self.rate, self.delay_ms = rate, delay_ms
        self.created: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.powered_off: list[str] = []
        self.powered_off_at: dict[str, float] = {}      # host -> time.monotonic() of power_off

    # ---------------------------------------------------------- names
    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    # ---------------------------------------------------------- build and tear down
    def __enter__(self) -> "Cluster":
        removed = cleanup_stale(self.prefix)
        if removed:     # their owner was SIGKILLed (nothing runs then): said, not silently done
            print(f"par.runtime.cluster: removed {len(removed)} network namespaces left by a killed run: "
                  f"{', '.join(removed)}", file=sys.stderr, flush=True)
        _LIVE.add(self)
        self._sigterm = _sigterm_raises()
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def build(self) -> None:
        sw = f"{self.tag}-sw"
        for ns in [sw, *map(self.ns, self.hosts)]:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for host in self.hosts:
            ns = self.ns(host)
            sh("ip", "-n", sw, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", sw, "link", "set", host, "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.rate is not None:
                tbf(ns, "eth0", self.rate, self.delay_ms)       # host -> switch
                tbf(sw, host, self.rate, self.delay_ms)         # switch -> host

    def teardown(self) -> None:
        """Power off every host and delete every namespace this cluster created (idempotent)."""
        for proc in self.procs.values():
            _kill_session(proc)
        for ns in reversed(self.created):
            delete_namespace(ns)
        self.created.clear()
        _LIVE.discard(self)
        if getattr(self, "_sigterm", None) is not None:       # put back the SIGTERM handler we replaced
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def power_off(self, host: str) -> None:
        """Emulate a machine losing power: SIGKILL every process on `host` at once."""
        self.powered_off.append(host)
        self.powered_off_at.setdefault(host, time.monotonic())
        self._kill_host(host)

    def _kill_host(self, host: str) -> None:
        for pid in pids_in(self.ns(host)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link_bytes(self) -> dict[str, int]:
        """{host: bytes it has sent over its link} (the kernel's counter of its eth0: the shaped link)."""
        out = {}
        for host in self.hosts:
            stats = json.loads(sh("ip", "-n", self.ns(host), "-j", "-s", "link", "show", "eth0").stdout)
            out[host] = int(stats[0]["stats64"]["tx"]["bytes"])
        return out

    # ---------------------------------------------------------- jobs
    def nodes(self, nproc_per_node: int, port: int = 29400) -> MultiNode:
        return MultiNode(len(self.hosts), nproc_per_node, f"{self.addr(self.hosts[0])}:{port}",
                         rdzv_id=self.tag)

    def command(self, nodes: MultiNode, host: str, target: str, args=()) -> list[str]:
        """What `host` runs: `MultiNode.command` inside its namespace, the store on h0, its own address."""
        i = self.hosts.index(host)
        torchrun = [sys.executable, "-m", "torch.distributed.run",
                    f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={self.addr(host)}",
                    "--monitor-interval=0.1", "--tee=3"]
        return ["ip", "netns", "exec", self.ns(host), *nodes.command(target, args, i, torchrun)]

    def run(self, target: str, args=(), nproc_per_node: int = 1, timeout: float = 300.0, env: dict | None = None,
            quiet: bool = False, power_off: tuple[str, str] | None = None, grace: float = 15.0):
        """Start one torchrun per host, stream `[hN] ...` lines, return rank 0's saved result (or None).

        `power_off=(host, regex)`: power that host off when a line matches `regex` (fault injection).
        A line `[par-mark] NAME` (printed by a rank) reads `link_bytes()` at once; the result then holds
        them as {"links": {NAME: {host: bytes sent}}}.
        Raises ClusterError naming the host that failed first, or the hosts still running at `timeout`."""
        nodes = self.nodes(nproc_per_node)
        with lifeline.run_dir() as tmp, lifeline.stops_raise():    # SIGTERM/SIGHUP: like Ctrl-C; no file left
            result = os.path.join(tmp, "result.json")
            child_env = {**os.environ, "PAR_RESULT": result, "TMPDIR": tmp, lifeline.LAUNCHER_ENV: str(os.getpid()),
                         "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                         "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "LOGLEVEL": "WARNING",
                         "PAR_BACKEND": "gloo", **(env or {})}
            q: queue.Queue = queue.Queue()
            lines: dict[str, list[str]] = {h: [] for h in self.hosts}
            for host in self.hosts:
                proc = subprocess.Popen(self.command(nodes, host, target, args), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=child_env,
                                        start_new_session=True, bufsize=1,
                                        preexec_fn=lifeline.dies_with_parent(signal.SIGKILL))
                self.procs[host] = proc
                threading.Thread(target=_pump, args=(host, proc, q), daemon=True).start()
            exits: dict[str, tuple[int, float]] = {}
            links: dict[str, dict] = {}
            start, stop_at, first = time.monotonic(), time.monotonic() + timeout, None
            try:
                while len(exits) < len(self.hosts):
                    try:
                        host, line = q.get(timeout=0.2)
                    except queue.Empty:
                        host, line = None, None
                    if line:
                        lines[host].append(line)
                        if not quiet:
                            print(f"[{host}] {line}", end="", flush=True)
                        if MARK in line:
                            links[line.split(MARK, 1)[1].strip()] = self.link_bytes()
                        if power_off and host is not None and re.search(power_off[1], line) \
                                and power_off[0] not in self.powered_off:
                            self.power_off(power_off[0])
                    for h, proc in self.procs.items():
                        if h not in exits and proc.poll() is not None:
                            exits[h] = (proc.returncode, time.monotonic() - start)
                            if proc.returncode != 0 and first is None:
                                first, stop_at = h, min(stop_at, time.monotonic() + grace)
                    if time.monotonic() > stop_at:
                        break
            finally:
                for h, proc in self.procs.items():
                    if proc.poll() is None:
                        self._kill_host(h)
                        _kill_session(proc)
                self.procs.clear()
            running = [h for h in self.hosts if h not in exits]
            if first is None and running:
                raise ClusterError(f"{target} on {len(self.hosts)} hosts timed out after {timeout:.0f}s; "
                                   f"still running: {', '.join(running)} (killed)")
            if first is not None or any(code for code, _ in exits.values()):
                raise ClusterError(self.explain(exits, lines, running))
            if not os.path.exists(result):
                return {"links": links} if links else None
            with open(result) as f:
                saved = json.load(f)
            return {**saved, "links": links} if links and isinstance(saved, dict) else saved

    def explain(self, exits: dict, lines: dict, running: list[str]) -> str:
        """First line: the host that failed first, by cause (a signal, then its own error, then a lost peer)."""
        def order(h):
            code, t = exits[h]
            head = describe_failure(lines[h])[0] if code else ""
            lost_peer = any(p in head for p in ("Connection reset", "Connection closed", "Broken pipe", "refused"))
            return (0 if code < 0 or h in self.powered_off else 2 if lost_peer else 1, t)
        failed = sorted((h for h, (code, _) in exits.items() if code), key=order)
        h = failed[0]
        code, t = exits[h]
        if code < 0 or h in self.powered_off:
            why = f"went down ({'powered off' if h in self.powered_off else 'torchrun killed'} by " \
                  f"{signal_name(-code) if code < 0 else 'SIGKILL'})"
        else:
            why = f"failed: {describe_failure(lines[h])[0]}"
        others = "; ".join(f"{o} exit {exits[o][0]} ({describe_failure(lines[o])[0]})" for o in failed[1:]) or "none"
        stopped = f"; stopped {', '.join(running)}" if running else ""
        tail = "".join(f"[{x}] {line}" for x in self.hosts for line in lines[x][-10:])
        return (f"host {h} ({self.addr(h)}) {why} {t:.1f}s into the job; then: {others}{stopped}\n"
                f"last output:\n{tail}")


def _counter():
    i = 0
    while True:
        yield i
        i += 1


_COUNTER = _counter()


def _sigterm_raises():
    """While a cluster exists, SIGTERM (a `kill`, a CI timeout) raises SystemExit, so that `finally` and
    teardown run (the default handler would end Python without them). Returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, stop)


def _pump(host: str, proc: subprocess.Popen, q: queue.Queue) -> None:
    for line in proc.stdout:
        q.put((host, line))


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
