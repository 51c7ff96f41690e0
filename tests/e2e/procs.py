"""Processes started by the e2e fixtures: each in its own process group, always killed, checked at the end.

`Procs.start()` launches a command in a new session (so a new process group whose id is the child's pid),
logs its output to a file, and remembers the group. `stop()` sends SIGTERM to the whole group, waits, then
SIGKILLs. `leftovers()` scans /proc for any live process in any group we ever started: the session-end check.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ProcessFailed(RuntimeError):
    pass


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:])


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path
    pgid: int

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log, n)

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessFailed(f"{self.name} exited with {self.popen.returncode}; log {self.log}:\n{self.log_tail()}")


def _pgid_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid pgrp ...; comm may contain spaces/parens: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie is dead; it only awaits its parent's wait()
        return None
    return int(fields[2])


def processes_in_groups(pgids: set[int]) -> list[tuple[int, int, str]]:
    """(pid, pgid, cmdline) of every live process whose process group is in pgids."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        pg = _pgid_of(pid)
        if pg is not None and pg in pgids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            found.append((pid, pg, cmd.strip()))
    return found


@dataclass
class Procs:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    all_pgids: set[int] = field(default_factory=set)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        n = 1
        while log.exists():
            n += 1
            log = self.log_dir / f"{name}.{n}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,  # own session => own process group (pgid == pid)
            )
        proc = Proc(name, list(argv), popen, log, popen.pid)
        self.procs.append(proc)
        if not self.all_pgids:
            atexit.register(self._kill_all_groups)  # last resort if pytest dies without running teardown
        self.all_pgids.add(proc.pgid)
        return proc

    def _kill_all_groups(self) -> None:
        # Only groups that still have members: an empty group's id may since belong to someone else.
        for pgid in {pg for _, pg, _ in processes_in_groups(self.all_pgids)}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def stop(self, proc: Proc, timeout: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `timeout`, then SIGKILL it; reap the leader."""
        if proc.alive() or processes_in_groups({proc.pgid}):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=0.1)
                if not proc.alive() and not processes_in_groups({proc.pgid}):
                    break
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=5)
        deadline = time.monotonic() + 5
        while processes_in_groups({proc.pgid}) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pgid, signal.SIGKILL)
            time.sleep(0.05)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)

    def pids(self) -> list[int]:
        """Every live pid in the groups we started (leaders and their children)."""
        return [pid for pid, _, _ in processes_in_groups(self.all_pgids)]

    def leftovers(self) -> list[tuple[int, int, str]]:
        return processes_in_groups(self.all_pgids)


def wait_for(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float = 60.0,
    interval: float = 0.2,
    procs: Sequence[Proc] = (),
) -> None:
    """Poll `check` until true; fail early (with the log) if one of `procs` dies."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        try:
            if check():
                return
        except Exception as exc:
            last_exc = exc
        time.sleep(interval)
    logs = "\n".join(f"--- {p.name} ({p.log}):\n{p.log_tail(25)}" for p in procs)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_exc!r})\n{logs}")


# ---- listening sockets --------------------------------------------------------------------------------------


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _parse_addr(hex_addr: str) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    port = int(port_hex, 16)
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
        return f"{ip}:{port}"
    # IPv6: four little-endian 32-bit words
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    import ipaddress

    ip6 = ipaddress.IPv6Address(b"".join(words))
    if ip6.ipv4_mapped:
        return f"{ip6.ipv4_mapped}:{port}"
    return f"[{ip6}]:{port}"


def listening_tcp(pids: Sequence[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP socket in LISTEN state owned by one of `pids` (and UDP sockets)."""
    owner: dict[int, int] = {}
    for pid in pids:
        for ino in _socket_inodes(pid):
            owner[ino] = pid
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], int(cols[9])
            is_listen = state == "0A" if table.startswith("tcp") else state == "07"
            if is_listen and inode in owner:
                found.append((owner[inode], f"{table}:{_parse_addr(local)}"))
    return found


def is_loopback(addr: str) -> bool:
    host = addr.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1"
