"""Who may send what: the action matrix of the three socket kinds (docs/protocol.md).

Authority comes only from the socket a peer connected to (whose peer UID was checked
with SO_PEERCRED before any frame was read, see `peercred`), never from message
fields. The transport runs the controller's attempts; the machine administrator may do
everything, including the two actions that can change what the host promises (offers)
or records (acknowledging an absent legacy attempt); a local owner may only read the
snapshot and set the offer of their own machine. An action not in the table is refused.
"""

from __future__ import annotations

import enum

from ficc.execution.errors import ErrorCode
from ficc.execution.host.core.errors import HostError
from ficc.execution.protocol import SENDERS, Sender, may_send


class SocketKind(enum.StrEnum):
    """The three kinds of listening socket the daemon opens."""

    TRANSPORT = "transport"
    ADMINISTRATOR = "administrator"
    LOCAL_OWNER = "local_owner"


SENDER_OF: dict[SocketKind, Sender] = {
    SocketKind.TRANSPORT: Sender.TRANSPORT,
    SocketKind.ADMINISTRATOR: Sender.ADMINISTRATOR,
    SocketKind.LOCAL_OWNER: Sender.OWNER,
}
"""The protocol's sender for each socket kind. The action matrix itself lives in one
place, `ficc.execution.protocol.SENDERS` / `may_send`; this module only names sockets."""


def _actions(kind: SocketKind) -> frozenset[str]:
    return frozenset(action for action in SENDERS if may_send(SENDER_OF[kind], action))


TRANSPORT_ACTIONS = _actions(SocketKind.TRANSPORT)
ADMINISTRATOR_ACTIONS = _actions(SocketKind.ADMINISTRATOR)
LOCAL_OWNER_ACTIONS = _actions(SocketKind.LOCAL_OWNER)
ALL_ACTIONS = frozenset(SENDERS)


def allowed(kind: SocketKind, action: str) -> bool:
    """True if a peer on a socket of this kind may send this action."""
    return may_send(SENDER_OF[kind], action)


def authorize(kind: SocketKind, action: str, socket_name: str | None = None) -> None:
    """Refuse with `not_authorized` unless this socket kind may send `action`.

    `socket_name` (for example `owner-1001.sock`) makes the message name the exact socket.
    """
    if allowed(kind, action):
        return
    where = socket_name or f"{kind.value} socket"
    permitted = sorted(k for k in SocketKind if allowed(k, action))
    if permitted:
        fix = "send it on the " + " or ".join(f"{k.value} socket" for k in permitted)
    else:
        fix = "it is not an action of this protocol"
    raise HostError(ErrorCode.NOT_AUTHORIZED, f"{where} may not send {action[:80]!r}; {fix}")
