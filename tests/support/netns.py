"""Test networks.

- :func:`run_offline`: a command with no network at all (``unshare -rn sh -c 'ip link set lo up; ...'``).
  Intranet-side tests use it so that any hidden hub call fails loudly instead of silently succeeding.
- :func:`run_in_mount_namespace`: a shell script in a private user + mount namespace (``unshare -rm``), root there,
  for a small tmpfs (a full disk) or a read-only bind mount that the rest of the machine never sees.
- :class:`TwoHosts`: two hosts on a real (virtual) network: network namespaces joined by a veth pair, each with
  its own host name, for multi-node tests (root only).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_offline(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 900,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a new user + network namespace with only loopback up. Returns the completed process
    (stdout and stderr captured as text). Raises ``AssertionError`` with both streams when ``check`` and the
    command failed."""
    inner = "ip link set lo up && exec " + " ".join(shlex.quote(str(a)) for a in argv)
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", inner],
        env=env,
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"offline command failed ({proc.returncode}): {' '.join(map(str, argv))}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def run_in_mount_namespace(
    script: str, *, timeout: float = 300, pythonpath: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``sh`` ``script`` in a new user + mount namespace (``unshare -rm``): mounts it makes (a tmpfs, a
    read-only bind mount) vanish with it. ``pythonpath``: put this folder on ``PYTHONPATH`` for the Pythons it
    starts. Returns the completed process, stdout and stderr captured as text; the exit status is the script's."""
    env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath is not None else {})}
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, timeout=timeout
    )


def enter_offline_namespace() -> None:
    """Move this (single-threaded) process into a new user + network namespace with only loopback up, as
    ``unshare -rn`` then ``ip link set lo up`` does: this user mapped to root inside, ``setgroups`` denied.

    Raises:
        OSError: the kernel refused the namespaces (unshare(2)'s errno), or ``ip`` failed.
    """
    _unshare_as_root(CLONE_NEWNET, "CLONE_NEWNET")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True)


def enter_mount_namespace(setup: str) -> None:
    """Move this (single-threaded) process into a new user + mount namespace, as ``unshare -rm`` does (root there,
    every mount private), then run the ``sh`` script ``setup`` in it: the mounts it makes (a small tmpfs, a
    read-only bind mount) are seen by this process and its children, and by nothing else.
    :func:`run_in_mount_namespace` is the same for a script.

    Raises:
        OSError: the kernel refused the namespaces (unshare(2)'s errno).
        subprocess.CalledProcessError: ``setup`` failed (its output in the exception).
    """
    _unshare_as_root(CLONE_NEWNS, "CLONE_NEWNS")
    subprocess.run(["sh", "-c", f"mount --make-rprivate / && {setup}"], check=True, capture_output=True, text=True)


CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000


def _unshare_as_root(flag: int, name: str) -> None:
    """``unshare(CLONE_NEWUSER | flag)`` with this user mapped to root inside and ``setgroups`` denied.

    Raises:
        OSError: the kernel refused (unshare(2)'s errno).
    """
    import ctypes

    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | flag) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWUSER | {name}): {os.strerror(errno)}")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


# ---------------------------------------------------------------------- two hosts joined by a veth pair

#: Addresses of :class:`TwoHosts`: a /24 that exists only inside the namespaces the tests create.
TEST_SUBNET = "10.213.{}"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, or a container that forbids them)."""


class TwoHosts:
    """Two test hosts: network namespaces joined by a veth pair, each with its own host name that resolves to
    its veth address on both sides (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts over /etc/hosts),
    as real cluster nodes have. In a fresh namespace the host name would resolve to 127.0.0.1, and a torchrun
    c10d rendezvous or gloo would then connect to itself.

    ``with TwoHosts() as hosts: hosts.popen(0, argv, ...)`` runs ``argv`` on host 0 (``hosts.names[0]``,
    ``hosts.addresses[0]``). Everything is removed on exit: namespaces, veth pair, /etc/netns entries.
    Needs root (the test machine's user namespaces cannot create veth pairs in two separate namespaces).
    """

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.namespaces = [f"ferry-a{tag}", f"ferry-b{tag}"]
        self.names = [f"ferry-node-a{tag}", f"ferry-node-b{tag}"]
        self.veth = [f"fva{tag}", f"fvb{tag}"]  # interface names: at most 15 characters
        self.addresses = [TEST_SUBNET.format(f"{os.getpid() % 250}.1"), TEST_SUBNET.format(f"{os.getpid() % 250}.2")]
        self._made: list[list[str]] = []

    @staticmethod
    def _ip(*args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NamespacesUnavailable(f"ip {' '.join(args)}: {proc.stderr.strip()}")

    def __enter__(self) -> TwoHosts:
        if os.geteuid() != 0:
            raise NamespacesUnavailable("not root: network namespaces and veth pairs need CAP_NET_ADMIN")
        try:
            for ns in self.namespaces:
                self._ip("netns", "add", ns)
                self._made.append(["netns", "del", ns])
            self._ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
            for ns, dev, address in zip(self.namespaces, self.veth, self.addresses):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts, encoding="utf-8")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.namespaces:
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for args in reversed(self._made):  # deleting a namespace deletes the veth end inside it, and its peer
            subprocess.run(["ip", *args], capture_output=True)
        self._made.clear()
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only when no other namespace's files are left

    def rx_bytes(self, host: int) -> int:
        """Bytes received so far on ``host``'s veth end (what came over the wire from the other host)."""
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.namespaces[host],
                "cat",
                f"/sys/class/net/{self.veth[host]}/statistics/rx_bytes",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(proc.stdout.strip())

    def argv(self, host: int, argv: Sequence[str], setup: str = "") -> list[str]:
        """``argv`` run on ``host``: in its network namespace (and /etc/hosts), with its own UTS namespace and
        host name, and its own mount namespace (``ip netns exec`` makes one; mounts made by ``setup``, a shell
        snippet run first, stay on that host)."""
        inner = f"hostname {shlex.quote(self.names[host])} && {setup + ' && ' if setup else ''}exec " + " ".join(
            shlex.quote(str(a)) for a in argv
        )
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c", inner]

    def enter(self, host: int, setup: str = "") -> None:
        """Move this (forked, single-threaded) process onto ``host`` as :meth:`argv` runs a command there: its
        network namespace, and what ``ip netns exec`` adds (a mount namespace, ``/etc/netns/NAME/hosts`` over
        ``/etc/hosts``, the namespace's own ``/sys``), a UTS namespace with the host's name (``unshare --uts``,
        ``hostname``), then ``setup`` run by ``sh`` there (its mounts stay on that host).

        Raises:
            OSError: the kernel refused a step (its errno), or ``setup`` failed.
        """
        import ctypes
        import socket

        clone_newns, clone_newuts, clone_newnet = 0x00020000, 0x04000000, 0x40000000
        ms_bind, ms_rec, ms_slave, mnt_detach = 0x1000, 0x4000, 0x80000, 2
        libc = ctypes.CDLL(None, use_errno=True)

        def check(result: int, what: str) -> None:
            if result != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"{what}: {os.strerror(errno)}")

        namespace = self.namespaces[host]
        fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            check(libc.setns(fd, clone_newnet), f"setns({namespace})")
        finally:
            os.close(fd)
        check(libc.unshare(clone_newns | clone_newuts), "unshare(CLONE_NEWNS | CLONE_NEWUTS)")
        check(libc.mount(b"none", b"/", None, ms_rec | ms_slave, None), "mount --make-rslave /")
        hosts = str(Path("/etc/netns") / namespace / "hosts").encode()
        check(libc.mount(hosts, b"/etc/hosts", None, ms_bind, None), "mount --bind .../hosts /etc/hosts")
        check(libc.umount2(b"/sys", mnt_detach), "umount -l /sys")
        check(libc.mount(namespace.encode(), b"/sys", b"sysfs", 0, None), "mount -t sysfs")
        socket.sethostname(self.names[host])
        if setup:
            subprocess.run(["sh", "-c", setup], check=True, capture_output=True)

    def popen(self, host: int, argv: Sequence[str], setup: str = "", **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on ``host`` after ``setup`` (``subprocess.Popen`` keyword arguments pass through)."""
        return subprocess.Popen(self.argv(host, argv, setup), **kwargs)
