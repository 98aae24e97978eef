"""A warm single-node launcher: ranks forked from a server that has already imported torch.

    python -m autotune.workers.torch_probe.warm --nproc-per-node N TRIAL_FILE

Why: on a small probe the fixed cost dominates. Every fresh rank pays the interpreter plus
``import torch`` (~2 s on 2 cores) and, on its first optimizer, the import of ``torch._dynamo``
(~1.6 s, pulled in by ``Optimizer.add_param_group``): 65 % of a tiny CPU trial's wall time
(benchmarks/torch_probe_overhead.py). The warm launcher pays that once per machine, not once
per trial, the way a zygote or a build daemon does:

- The **client** (this module's ``main``; imports no torch) connects to a Unix socket, hands the
  server its own stdin/stdout/stderr file descriptors (``SCM_RIGHTS``), its environment, working
  directory and the probe's arguments, then waits for the exit status and exits with it.
- The **server** (``--serve``; started on first use, detached, stdio on /dev/null, without the
  probe's mark ``AUTOTUNE_PROBE_MARK``, which the command backend kills after the probe) imports torch
  and the probe's modules, never runs a tensor op and never starts a thread, so forking it is
  safe; it exits after ``AUTOTUNE_WARM_IDLE_S`` (default 600) seconds without a trial.
- Per trial the server forks a **supervisor** (own session, so one ``killpg`` reaches the whole
  trial), which forks the N ranks. Each rank takes the client's descriptors as its stdio, the
  client's environment (plus ``RANK``/``WORLD_SIZE``/... and the file-store rendezvous of
  spawn.py) and runs the probe module as ``__main__``. The probe protocol is unchanged; the
  dispatcher cannot tell the launchers apart except by the time.
- Stopping: a SIGTERM/SIGINT to the client (the dispatcher's deadline, a pruned trial) is passed
  on; the supervisor stops the ranks (SIGTERM, then SIGKILL after 5 s) and reports. If the
  client dies outright (SIGKILL), its socket closes and the supervisor kills the ranks at once.
  One failing rank stops the others, as with torchrun.

The socket's name hashes the interpreter, torch's install and the probe's sources, so an
upgraded torch or an edited probe gets a fresh server. What the server imported was imported
under the first client's environment: variables that torch reads *at import* (``TORCH_*``,
``OMP_*``, ``MKL_*``, ``KMP_*``, ``LD_*``, ``PYTHONPATH``) are part of the hash as well. Allocator
settings (``PYTORCH_*_ALLOC_CONF``) are read when the device first allocates, in the rank, and
take effect as usual. Single node only; ``launch.probe_argv`` picks this launcher on a single
CPU node (where start-up matters) and spawn.py elsewhere, unless ``backend.launcher`` says.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import io
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..process_group import PROBE_MARK_ENV
from .spawn import DIST_INIT_ENV

__all__ = ["main", "socket_path", "shutdown_server", "WARM_DIR_ENV", "IDLE_ENV"]

WARM_DIR_ENV = "AUTOTUNE_WARM_DIR"  # where sockets and locks live (default: a per-user temp dir)
IDLE_ENV = "AUTOTUNE_WARM_IDLE_S"
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "torch.distributed.optim",
    "torch.utils.checkpoint",
    "torch._dynamo",
    "autotune.workers.torch_probe.train",
    "autotune.workers.torch_probe.parallelize",
    "autotune.workers.torch_probe.infer",
)
_IMPORT_TIME_ENV = ("TORCH_", "OMP_", "MKL_", "KMP_", "LD_", "PYTHONPATH")
_GRACE_S = 5.0
_CONNECT_WAIT_S = 120.0
_HEADER = struct.Struct("!Q")
_STOP = b"S"


def _state_dir() -> Path:
    """The directory of the server's socket and lock: this user's alone. In a shared /tmp another
    user could create it first (or a symlink in its place) and hand the probes a socket they
    control, which receives every probe's environment; such a directory is refused."""
    base = os.environ.get(WARM_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"autotune-warm-{os.getuid()}")
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise unless ``path`` is a real directory owned by this user with no access for others."""
    info = os.lstat(path)
    problems = []
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problems.append("not a directory (a symlink or a file)")
    if info.st_uid != os.getuid():
        problems.append(f"owned by uid {info.st_uid}, not by you (uid {os.getuid()})")
    if info.st_mode & 0o077:
        problems.append(f"mode {stat.S_IMODE(info.st_mode):04o} lets other users in (0700 expected)")
    if problems:
        raise PermissionError(
            f"refusing the warm-start directory {path}: {'; '.join(problems)}. Remove it, "
            f"or set {WARM_DIR_ENV} to a directory of your own with mode 0700"
        )


def _fingerprint() -> str:
    """What the server's imports depend on: interpreter, torch's install, probe sources, import-time env."""
    h = hashlib.sha256(sys.executable.encode())
    spec = importlib.util.find_spec("torch")
    origin = Path(spec.origin) if spec and spec.origin else None
    if origin is not None:
        h.update(f"{origin}:{origin.stat().st_mtime_ns}".encode())
    here = Path(__file__).resolve().parent
    for src in sorted(list(here.glob("*.py")) + list(here.parent.glob("*.py"))):
        h.update(f"{src.name}:{src.stat().st_mtime_ns}".encode())
    for key in sorted(k for k in os.environ if k.startswith(_IMPORT_TIME_ENV)):
        h.update(f"{key}={os.environ[key]}".encode())
    return h.hexdigest()[:16]


def socket_path() -> Path:
    """The Unix socket of the server this client would use (AF_UNIX paths are limited to ~100 bytes)."""
    return _state_dir() / f"{_fingerprint()}.sock"


# ---------------------------------------------------------------------------------------------- client


def _connect(path: Path) -> socket.socket:
    """Connect, starting the server first if none answers (one starter at a time, under a lock)."""
    deadline = time.monotonic() + _CONNECT_WAIT_S
    started = False
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
        if time.monotonic() > deadline:
            raise SystemExit(f"autotune warm launcher: no server answered on {path} within {_CONNECT_WAIT_S:.0f} s")
        if not started:
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(path))  # someone else started it meanwhile
                except (FileNotFoundError, ConnectionRefusedError):
                    path.unlink(missing_ok=True)  # a dead server's socket
                    # the server outlives this probe on purpose: without the probe's mark, or the
                    # command backend kills it as an escaped descendant once the probe ends, and
                    # every trial starts a cold server (each probe of a study did, with a warning)
                    server_env = {k: v for k, v in os.environ.items() if k != PROBE_MARK_ENV}
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            __spec__.name if __spec__ else "autotune.workers.torch_probe.warm",
                            "--serve",
                            str(path),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                        close_fds=True,
                        env=server_env,
                    )
                    # the server binds before it imports torch: wait for the socket file only
                    while not path.exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                finally:
                    probe.close()
            started = True
        time.sleep(0.01)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m autotune.workers.torch_probe.warm")
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int)
    ap.add_argument("--module", default="autotune.workers.torch_probe", help="module each rank runs")
    ap.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)
    ap.add_argument("--shutdown", action="store_true", help="stop this interpreter's warm server, if any")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module (the trial file)")
    ns = ap.parse_args(argv)
    if ns.serve:
        return _serve(Path(ns.serve))
    if ns.shutdown:
        return 0 if shutdown_server() else 1
    if not ns.nproc_per_node or ns.nproc_per_node < 1:
        ap.error("--nproc-per-node must be >= 1")
    request = json.dumps(
        {"nproc": ns.nproc_per_node, "module": ns.module, "args": ns.args, "env": dict(os.environ), "cwd": os.getcwd()}
    ).encode()
    try:
        sock = _connect(socket_path())
    except PermissionError as exc:
        print(f"autotune warm launcher: {exc}", file=sys.stderr, flush=True)
        return 2
    socket.send_fds(sock, [_HEADER.pack(len(request))], [0, 1, 2])
    sock.sendall(request)

    def forward(signum: int, frame: object) -> None:  # the dispatcher's deadline: stop the ranks, then report
        try:
            sock.sendall(_STOP)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        (status,) = struct.unpack("!i", _recv_exactly(sock, 4))
    except ConnectionError:
        return 1
    return status


def shutdown_server() -> bool:
    """Ask this interpreter's server to exit now (tests, a clean machine). False if none ran."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(socket_path()))
    except OSError:
        return False
    with sock:
        sock.sendall(_HEADER.pack(0))  # a zero-length request is the stop message
        try:
            sock.recv(1)
        except OSError:
            pass
    return True


# ---------------------------------------------------------------------------------------------- server


def _serve(path: Path) -> int:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
    except OSError:
        return 0  # another server won the race
    server.listen(64)
    import importlib

    for name in _PRELOAD:  # what every probe needs; no tensor op, no thread
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # shutdown: unlink the socket
    idle = float(os.environ.get(IDLE_ENV, "600"))
    server.settimeout(idle)
    try:
        while True:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                return 0
            _flush_std()
            if os.fork() == 0:
                server.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                try:
                    code = _supervise(conn)
                except BaseException:  # noqa: BLE001 - a supervisor never returns into the server loop
                    code = 1
                os._exit(code)
            # the stop message is read by the supervisor; it tells the server via SIGTERM
            conn.close()
    finally:
        if path.exists():
            path.unlink(missing_ok=True)


def _supervise(conn: socket.socket) -> int:
    """One trial: read the request, fork the ranks, watch them and the client, send the status."""
    os.setsid()  # the trial's own session and process group: one killpg stops every rank
    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (length,) = _HEADER.unpack(msg)
    if length == 0:  # shutdown request
        os.kill(os.getppid(), signal.SIGTERM)
        return 0
    request = json.loads(_recv_exactly(conn, length))
    with tempfile.TemporaryDirectory(prefix="autotune-warm-") as tmp:
        n = int(request["nproc"])
        ranks = [_fork_rank(request, rank, n, fds, os.path.join(tmp, "store")) for rank in range(n)]
        for fd in fds:
            os.close(fd)
        status = _watch(conn, ranks)
    try:
        conn.sendall(struct.pack("!i", status))
    except OSError:
        pass
    return 0


def _flush_std() -> None:
    """Flush this process's Python-level stdout and stderr before a fork: a child inherits their
    buffers, and a rank would write whatever the server or supervisor had buffered (an import's
    print) into the trial's own stdout, ahead of its lines."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _line_buffered_std() -> None:
    """A rank's stdout and stderr written a whole line at a time. The ranks share the client's
    pipes, and the command backend starts launchers with ``PYTHONUNBUFFERED=1``, under which the
    server's (inherited) streams write ``print``'s text and its newline in two calls: two ranks
    printing at once then merged into one line and a blank one (``tests/test_warm_launcher.py``
    under load), and a merged line is a metrics line the parser cannot read. One write per line is
    atomic on a pipe up to ``PIPE_BUF`` (4 KiB on Linux), and still prompt."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        stream = io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or "backslashreplace",
            line_buffering=True,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fork_rank(request: dict, rank: int, n: int, fds: list[int], store: str) -> int:
    _flush_std()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        _line_buffered_std()
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(
            {
                DIST_INIT_ENV: store,
                "WORLD_SIZE": str(n),
                "LOCAL_WORLD_SIZE": str(n),
                "GROUP_RANK": "0",
                "ROLE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
            }
        )
        os.chdir(request["cwd"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import runpy

        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return 0  # not reached


def _watch(conn: socket.socket, ranks: list[int]) -> int:
    """Wait for the ranks; stop them all when one fails, the client asks, or the client is gone."""
    codes: dict[int, int] = {}
    stop_at: float | None = None
    status = 0
    while len(codes) < len(ranks):
        for pid in ranks:
            if pid in codes:
                continue
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(raw)
                codes[pid] = code if code >= 0 else 128 - code
                if codes[pid] != 0 and status == 0:
                    status = codes[pid]
        if len(codes) == len(ranks):
            break
        if status and stop_at is None:  # one rank failed: stop the others, as torchrun does
            stop_at = _signal_ranks(ranks, codes, signal.SIGTERM)
        readable, _, _ = select.select([conn], [], [], 0.02)
        if readable:
            data = conn.recv(1)
            if not data:  # the client died (SIGKILL): nobody will read the answer
                _signal_ranks(ranks, codes, signal.SIGKILL)
            elif stop_at is None:
                stop_at = _signal_ranks(ranks, codes, signal.SIGTERM)
                status = status or 128 + signal.SIGTERM
        if stop_at is not None and time.monotonic() > stop_at:
            _signal_ranks(ranks, codes, signal.SIGKILL)
    return status


def _signal_ranks(ranks: list[int], codes: dict[int, int], sig: int) -> float:
    for pid in ranks:
        if pid not in codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return time.monotonic() + _GRACE_S


if __name__ == "__main__":
    sys.exit(main())
