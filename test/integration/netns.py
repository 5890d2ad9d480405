"""Two hosts on one machine for multi-node tests: two network namespaces joined by a veth pair, each end with
an address the test assigns, and the means to run a server in one and talk HTTP to it from inside it (the
test's own namespace has no route into them).

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; `netns_unavailable()` says why not, for a skip.
Every namespace made here is deleted on exit, and with it its end of the veth pair and every socket in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

# A private subnet no real network here is expected to use; host A is .1, host B is .2.
SUBNET = "10.213.0.{}"
PREFIX_LEN = 24
IP_TIMEOUT_SECONDS = 10
# What `fetch` runs inside a namespace: stdlib only (python -I starts in ~50 ms, httpx would not be faster).
CLIENT = """
import json, sys, urllib.error, urllib.request
url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
req = urllib.request.Request(url, data=body.encode() or None, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        print(json.dumps([r.status, r.read().decode()]))
except urllib.error.HTTPError as e:
    print(json.dumps([e.code, e.read().decode()]))
except OSError as e:
    print(json.dumps([0, str(e)]))
"""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_SECONDS)


def netns_unavailable() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"srt-probe-{os.getpid()}"
    made = ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    ip("netns", "delete", probe)
    return None


@dataclass(frozen=True)
class Host:
    netns: str
    address: str
    link: str  # its end of the veth pair

    def cut_link(self) -> None:
        """Take this host off the network without ending anything on it (a partition, a pulled cable)."""
        check(ip("-n", self.netns, "link", "set", self.link, "down"))

    def command(self, *cmd: str) -> list[str]:
        """`cmd` run inside this host's namespace (ip netns exec replaces itself with it: same pid)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def fetch(self, url: str, body: dict | list | None = None, timeout: float = 60.0) -> tuple[int, str]:
        """(status, body text) of a GET (or a JSON POST) from inside this host; status 0: no connection."""
        payload = json.dumps(body) if body is not None else ""
        out = subprocess.run(
            self.command(sys.executable, "-I", "-c", CLIENT, url, payload, str(timeout)),
            capture_output=True,
            text=True,
            timeout=timeout + IP_TIMEOUT_SECONDS,
        )
        if out.returncode != 0:
            raise RuntimeError(f"client in {self.netns} failed: {out.stderr.strip()}")
        status, text = json.loads(out.stdout)
        return status, text


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Hosts A (10.213.0.1) and B (10.213.0.2), each in its own namespace with loopback up, joined by a veth
    pair; both namespaces are deleted on exit, whatever happened."""
    tag = os.getpid()
    a, b = (
        Host(f"srt-mn{tag}-{end}", SUBNET.format(i), f"srtv{tag % 100000}{end}")  # links: 15 bytes at most
        for i, end in ((1, "a"), (2, "b"))
    )
    made: list[str] = []
    try:
        for host in (a, b):
            check(ip("netns", "add", host.netns))
            made.append(host.netns)
        check(
            ip(
                "link",
                "add",
                a.link,
                "netns",
                a.netns,
                "type",
                "veth",
                "peer",
                "name",
                b.link,
                "netns",
                b.netns,
            )
        )
        for host in (a, b):
            check(ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.link))
            check(ip("-n", host.netns, "link", "set", host.link, "up"))
            check(ip("-n", host.netns, "link", "set", "lo", "up"))
        yield a, b
    finally:
        for netns in made:
            ip("netns", "delete", netns)


def check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)}: {result.stderr.strip()}")
