"""A sandbox per graded submission: bubblewrap (`bwrap`) when this machine has it, else none ("unsandboxed").

    box = Sandbox.create(workdir, cpu_seconds=600, memory_bytes=16 << 30)
    subprocess.Popen(box.wrap([sys.executable, "-m", "ipykernel_launcher", "-f", conn]), ...)
    remove(workdir)                                   # after its processes are gone: its files

What a sandboxed submission sees and may do (bwrap, no root needed where unprivileged user namespaces are on;
`isolation` lists the namespaces):

* no powers, whoever grades: a user namespace of its own in which it is nobody (uid and gid 65534) with every
  capability dropped and no user namespace of its own to make, so a root grader's sandbox cannot remount a
  read-only bind read-write, mount anything or change what it was given; files only root may read under /etc
  and /opt are masked (bwrap maps the sandbox's nobody to the grader's uid, root's for a root grader);
* no network: a network namespace of its own with only a loopback (gloo ranks on 127.0.0.1 still work);
* no shared memory with anyone: an IPC namespace of its own (SysV segments, message queues) and its own /dev,
  so a segment it leaves goes with it;
* a pid namespace of its own: the grader, other submissions and their kernels are not in its /proc; when the
  kernel's sandbox ends (killed at the timeout, or the grader dies: --die-with-parent) every process in it goes;
* the file system: /usr, /etc and the Python installation read-only, a read-only private copy of the `par`
  package (made once per batch, `package_copy`), its own work folder (the notebook's files, writable), and a
  private /tmp and HOME that vanish with it. The checkout (solutions/, tests/), other submissions, the report
  and feedback paths are not mounted;
* par's reference answers to the exercise replaced by stubs that raise (`overlays`, `par.course.grading.stubs`),
  and, for a real-rank job, the grader's input/output folder mounted (`binds`, `par.course.grading.rank_io`);
* limits per process: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS) and the size of a file it writes
  (RLIMIT_FSIZE, FILE_BYTES), set before the kernel starts; the private /tmp, which lives in memory, holds at
  most TMP_BYTES (PAR_GRADE_TMP, 1 GiB);
* a cap on processes (`ProcessCap`): the grader counts the processes of the sandbox's pid namespace ten times
  a second and kills them all when there are more than MAX_PROCESSES (PAR_GRADE_MAX_PROCESSES, 256) at once: a
  fork bomb ends the submission ("more than N processes" in its row) and the batch goes on. Where Linux counts
  RLIMIT_NPROC per user namespace (5.14 and later) and the grader is not root, RLIMIT_NPROC (TASKS) is also set
  inside, a hard stop that needs no polling; root is exempt from it, so for root the poll is the only cap.

What it does not do: it is not a container or VM; it shares the kernel and the CPUs with the grader, the limits
are per process (memory: each process's address space, not the submission's total), and the process cap is
polled, so a fast fork bomb overshoots it by what it forks in a tenth of a second before it is killed.
Without bwrap (macOS, no user namespaces) the submission runs as the grader's user in a session of its own,
killed as a group at the end (and, on Linux, by a parent-death signal if the grader dies; the process cap then
counts its session), with its network, the checkout and par's answers in reach, and its grade says
"unsandboxed". Work folders are named after the grader's pid: `sweep` removes those of a killed grader.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from par.runtime import procs
from par.runtime.checks import env_number
from par.runtime.paths import ROOT

MEMORY = int(env_number("PAR_GRADE_MEMORY", 16 << 30, minimum=1 << 20))   # bytes of address space per process
MAX_PROCESSES = int(env_number("PAR_GRADE_MAX_PROCESSES", 256, minimum=1))   # processes at once in one sandbox
TASKS = 4096         # RLIMIT_NPROC in a sandbox (threads included), where the kernel counts it per user namespace
TMP_BYTES = int(env_number("PAR_GRADE_TMP", 1 << 30, minimum=1 << 20))   # the private /tmp's size (it is memory)
FILE_BYTES = int(env_number("PAR_GRADE_FILE", 2 << 30, minimum=1 << 20))  # the largest file a process may write


NOBODY = 65534      # the uid and gid a sandboxed process has inside its user namespace
# what every sandbox is started with: its own user namespace, in which it is nobody with no capability (bwrap keeps
# a root caller's capabilities unless told: a root grader's sandbox could then remount its read-only binds
# read-write), and its own pid, network, IPC (SysV segments, POSIX message queues), uts and cgroup namespaces
ISOLATION = ("--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL",
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
NO_NESTED_USERNS = ("--disable-userns",)     # bwrap 0.8 and later: no user namespace of its own inside


def _runs(bwrap: str, flags) -> bool:
    try:
        return subprocess.run([bwrap, *flags, "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                               "--dev", "/dev", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def isolation() -> tuple[str, ...] | None:
    """The namespace flags this machine's bwrap takes (ISOLATION, and NO_NESTED_USERNS where it has it), or None
    when there is no usable bwrap: then grading runs unsandboxed."""
    bwrap = shutil.which("bwrap")
    if not bwrap or os.environ.get("PAR_GRADE_SANDBOX") == "off":
        return None
    for flags in ((*ISOLATION, *NO_NESTED_USERNS), ISOLATION):
        if _runs(bwrap, flags):
            return flags
    return None


def available() -> bool:
    """bwrap exists and can make the namespaces we ask for on this machine."""
    return isolation() is not None


@functools.lru_cache(maxsize=None)
def sized_tmp() -> tuple[str, ...]:
    """bwrap's `--size TMP_BYTES` for the private /tmp where this bwrap has it (0.7 and later), else nothing."""
    flags = ("--size", str(TMP_BYTES))
    return flags if isolation() and _runs(shutil.which("bwrap"), (*isolation(), *flags, "--tmpfs", "/tmp")) else ()


def package_copy(dest: Path) -> Path:
    """A private copy of the `par` package under `dest` (what a sandbox puts on its PYTHONPATH), read-only."""
    target = Path(dest) / "par"
    shutil.copytree(ROOT / "par", target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in [target, *target.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    return Path(dest)


MASKED_TREES = ("/etc", "/opt")      # searched for what only its owner may read (/etc/shadow, /etc/ssl/private)


def _system_binds() -> list[str]:
    args = []
    for top in ("/usr", "/etc", "/opt"):
        if os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/sys/devices/system/cpu", "/sys/devices/system/cpu"]
    for path, is_dir in _owner_only(MASKED_TREES):
        args += ["--tmpfs", path, "--remount-ro", path] if is_dir else ["--ro-bind", "/dev/null", path]
    return args


@functools.lru_cache(maxsize=None)
def _owner_only(tops: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """(path, is a folder) of every file and folder under `tops` that others may not read: masked in the sandbox.
    A root grader's sandbox is nobody to itself but root's uid to the host's files (bwrap maps it so), so it would
    read what only root may; masked, it reads an empty file or folder there."""
    found = []
    for top in tops:
        for root, dirs, files in os.walk(top):
            for name in [*dirs, *files]:
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISLNK(st.st_mode) and not st.st_mode & stat.S_IROTH:
                    found.append((path, stat.S_ISDIR(st.st_mode)))
                    if name in dirs:
                        dirs.remove(name)
    return tuple(found)


def _python_binds() -> list[str]:
    """The Python installation and its virtual environment, read-only, wherever they are: mounted after the
    private /tmp, so that a checkout (and its .venv) under /tmp stays visible."""
    args = []
    pythons = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    pythons.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    for path in sorted(pythons):
        if not any(path.startswith(top + "/") for top in ("/usr", "/opt")):
            args += ["--ro-bind", path, path]
    if os.path.realpath(sys.prefix) != sys.prefix:
        args += ["--ro-bind", sys.prefix, sys.prefix]
    return args


@dataclass
class Sandbox:
    workdir: Path            # the submission's folder: its notebook's files; the kernel's cwd
    package: Path | None     # the folder holding the read-only copy of `par` (None: this checkout's)
    cpu_seconds: int
    memory_bytes: int
    sandboxed: bool
    binds: tuple = ()        # more host folders mounted read-write at the same path (a launch's rank_io folder)
    overlays: tuple = ()     # (host file, path in the sandbox) mounted read-only over what is there

    @classmethod
    def create(cls, workdir: Path, package: Path | None = None, cpu_seconds: float = 600,
               memory_bytes: int = MEMORY, sandboxed: bool | None = None) -> "Sandbox":
        return cls(Path(workdir), package, max(1, int(cpu_seconds)), int(memory_bytes),
                   available() if sandboxed is None else sandboxed)

    @property
    def pythonpath(self) -> str:
        return str(self.package or ROOT)

    def env(self, extra: dict | None = None) -> dict:
        """The environment of the submission's processes: no variable of the grader's beyond the basics."""
        keep = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TERM")
        env = {k: os.environ[k] for k in keep if k in os.environ}
        home = "/tmp/home" if self.sandboxed else str(self.workdir / ".home")
        env.update({"HOME": home, "IPYTHONDIR": f"{home}/.ipython", "MPLCONFIGDIR": f"{home}/.mpl",
                    "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                    "PYTHONPATH": self.pythonpath, "TMPDIR": "/tmp" if self.sandboxed else str(self.workdir / ".tmp"),
                    "JUPYTER_PLATFORM_DIRS": "1", "JUPYTER_RUNTIME_DIR": f"{home}/.jupyter"})
        if self.sandboxed:
            env["PAR_SANDBOXED"] = "1"
        if not self.sandboxed:
            for sub in (".home", ".tmp"):
                (self.workdir / sub).mkdir(exist_ok=True)
        env.update(extra or {})
        return env

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside the sandbox, with the limits set (the limits also apply unsandboxed)."""
        limited = [sys.executable, "-m", "par.course.grading.sandbox", "limit", str(self.cpu_seconds),
                   str(self.memory_bytes), "--", *cmd]
        if not self.sandboxed:
            return limited
        work = str(self.workdir)
        args = ["bwrap", *(isolation() or ISOLATION), "--die-with-parent", "--new-session"]
        args += _system_binds()
        args += ["--proc", "/proc", "--dev", "/dev", *sized_tmp(), "--tmpfs", "/tmp", "--dir", "/tmp/home"]
        args += _python_binds()        # after the private /tmp: bwrap mounts in order, a later mount hides an earlier
        if self.package is not None:
            args += ["--ro-bind", str(self.package), str(self.package)]
        else:   # no private copy: this checkout's package only, read-only (never solutions/ or tests/)
            args += ["--ro-bind", str(ROOT / "par"), str(ROOT / "par")]
        for source, target in self.overlays:     # after the package: a stubbed module hides the real one
            args += ["--ro-bind", str(source), str(target)]
        for folder in self.binds:
            args += ["--bind", str(folder), str(folder)]
        args += ["--bind", work, work, "--chdir", work, "--"]
        return args + limited


def _per_namespace_nproc() -> bool:
    """Linux >= 5.14 counts RLIMIT_NPROC per user namespace (ucounts): inside a sandbox, only its own tasks."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return sys.platform.startswith("linux") and (major, minor) >= (5, 14)


def limit(argv: list[str]) -> None:
    """`python -m par.course.grading.sandbox limit CPU_SECONDS MEMORY_BYTES -- cmd...`: set the limits, exec cmd."""
    cpu, memory, sep, *cmd = argv
    assert sep == "--" and cmd, "usage: limit CPU_SECONDS MEMORY_BYTES -- cmd..."
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 5))
    if os.environ.get("PAR_SANDBOXED") == "1" and _per_namespace_nproc():   # a fork bomb's hard stop (not for
        resource.setrlimit(resource.RLIMIT_NPROC, (TASKS, TASKS))          # root, whom the kernel exempts)
    if int(memory) > 0:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    if sys.platform.startswith("linux"):   # SIGKILL when the grader (our parent) dies, even unsandboxed
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    os.execvp(cmd[0], cmd)


class ProcessCap:
    """Watches the processes of one sandboxed command from the grader and kills them all when there are more
    than `limit` at once (a fork bomb): every process of its pid namespace (bwrap), or of its session
    (unsandboxed). `tripped` says it fired. Polled every `every` seconds, so a fast bomb overshoots by what it
    forks meanwhile; RLIMIT_NPROC (`limit`, per user namespace) is the hard stop where the kernel applies it."""

    def __init__(self, proc: subprocess.Popen, sandboxed: bool, limit: int = MAX_PROCESSES, every: float = 0.1):
        self.proc, self.sandboxed, self.limit, self.every = proc, sandboxed, limit, every
        self.tripped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"process-cap-{proc.pid}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _namespace(self) -> str | None:
        children = procs.children(self.proc.pid)
        return procs.pid_namespace(children[0]) if children else None

    def _members(self, ns: str | None) -> list[int]:
        return procs.members(namespace=ns) if ns is not None else procs.members(session=self.proc.pid)

    def _watch(self) -> None:
        if not os.path.isdir("/proc"):
            return
        ns = None
        while not self._stop.wait(self.every) and self.proc.poll() is None:
            if self.sandboxed and ns is None:
                ns = self._namespace()
                if ns is None or ns == os.readlink("/proc/self/ns/pid"):
                    ns = None
                    continue
            if len(self._members(ns)) > self.limit:
                self.tripped = True
                self._kill(ns)
                return

    def _kill(self, ns: str | None) -> None:
        for _ in range(20):       # a bomb forks while we kill: until none is left (the namespace's init first)
            members = self._members(ns)
            if not members:
                break
            for pid in [self.proc.pid, *members]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            time.sleep(0.05)


PREFIX = "par-grade-"


def temporary_workdir(kind: str = "") -> Path:
    """A submission's work folder (or another folder of its grading: `kind`), named after the grader's pid
    (for `sweep` after a killed grader)."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{kind + '-' if kind else ''}"))


def kill_processes_of(folder: Path) -> list[int]:
    """SIGKILL every process whose command line names `folder` (a sandbox's bwrap binds its work folder, a kernel
    reads its connection file there); the pids killed. A grader SIGKILLed while bwrap sets a sandbox up can leave
    that bwrap behind: as root, bwrap changes credentials during its set-up, which clears the parent-death signal
    until it arms its own, so a death in those milliseconds is missed (1 start in 20 when the kill lands in the
    first 0.3 s after the start)."""
    killed = []
    for pid in procs.members(naming=str(folder).encode()):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return killed


def sweep() -> list[Path]:
    """Remove the work folders left by graders that were killed (their pid is gone), after killing any process
    still using them; the folders removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not path.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue                       # its grader is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue                       # another user's grader
        if kill_processes_of(path):
            time.sleep(0.2)                # their files are released before the folder goes
        remove(path)
        removed.append(path)
    return removed


def remove(path: Path) -> None:
    """Remove a work folder whatever the submission left in it (read-only folders included). A mode is changed
    only on what is in the folder, never through a link the submission made (it may point at a host file), and
    never on the folder's own parent (/tmp, say)."""
    top = os.path.abspath(path)

    def unlock(func, p, _):
        try:
            for q in (os.path.dirname(p), p):
                inside = os.path.commonpath([top, os.path.abspath(q)]) == top
                if inside and not os.path.islink(q):
                    os.chmod(q, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=unlock)


if __name__ == "__main__":
    if sys.argv[1:2] == ["limit"]:
        limit(sys.argv[2:])
    else:
        print(__doc__)
