"""The administrator is never starved by the transport, through the real daemon.

A transport peer (the real transport account, over the real socket) announces five
12 MiB frames and trickles: four fill the transport's request pool, the fifth is
`busy`. While they hold it, the administrator's snapshots are answered at once from
the administrator's own pool; the tricklers are cut off (`too_slow`) within seconds,
and the transport is served again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from ficc.execution.frames import REQUEST_MAX
from ficc.execution.protocol import SnapshotRequest
from ficc.execution.wire import SnapshotReply
from ficc_testkit.host import Daemon

FLOOD = f"""
import json, select, socket, struct, sys
frames = []
for _ in range(5):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    sock.sendall(struct.pack("!I", {REQUEST_MAX}) + b"{{")
    frames.append(sock)
readable, _, _ = select.select(frames, [], [], 30)
print(json.dumps({{"busy_now": len(readable)}}), flush=True)
sys.stdin.read()  # hold the other four until the test has asked
cut = 0
for sock in frames:
    if sock in readable:
        continue
    sock.settimeout(30)
    cut += sock.recv(4) == b""
print(json.dumps({{"cut_off": cut}}), flush=True)
"""


def test_a_trickling_transport_flood_leaves_the_administrator_served(daemon: Daemon) -> None:
    transport = daemon.accounts["transport"]
    socket_dir = daemon.layout.socket_dir
    flood = subprocess.Popen(
        ["setpriv", f"--reuid={transport.uid}", f"--regid={transport.gid}", "--clear-groups",
         sys.executable, "-c", FLOOD, str(socket_dir / "transport.sock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert flood.stdout is not None
        assert flood.stdin is not None
        assert json.loads(flood.stdout.readline()) == {"busy_now": 1}
        worst = 0.0
        for n in range(20):
            started = time.monotonic()
            reply = daemon.as_admin(SnapshotRequest(version=1, id=f"{n + 1:032x}"))
            worst = max(worst, time.monotonic() - started)
            assert isinstance(reply, SnapshotReply), reply
        print(f"administrator's worst snapshot latency during the flood: {worst * 1000:.1f} ms")
        assert worst < 2.0
        flood.stdin.close()
        assert json.loads(flood.stdout.readline()) == {"cut_off": 4}
    finally:
        flood.kill()
        flood.wait()
    assert any(e.get("event") == "too_slow" for e in daemon.process.events())
    assert isinstance(daemon.snapshot(), SnapshotReply)  # the transport is served again
