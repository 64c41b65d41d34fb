"""What the connection layer (`connections.py`) uses of uvicorn and h11 beyond their public
API, checked when a server starts: a release that renamed one of these would otherwise
lose a limit silently (a hook never called, a field read as missing). pyproject.toml pins
both to the versions below; `check()` names whatever a newer one lacks."""

from __future__ import annotations

import inspect
import re

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.h11_impl import RequestResponseCycle as Cycle

WRITTEN_AGAINST = {"uvicorn": "0.55.0", "h11": "0.16.0"}
# H11Protocol's hooks that `GuardedH11Protocol` overrides and calls with super().
PROTOCOL_HOOKS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "handle_events",
    "on_response_complete",
    "pause_writing",
    "resume_writing",
)
# What `GuardedH11Protocol` reads or replaces of an H11Protocol instance.
PROTOCOL_FIELDS = ("config", "conn", "logger", "cycle", "transport", "loop", "connections")
CYCLE_FIELDS = ("response_complete", "scope")  # of a RequestResponseCycle
CONFIG_FIELDS = ("h11_max_incomplete_event_size",)  # of uvicorn.Config
# What `StrictConnection` overrides or reads of h11.Connection.
CONNECTION_FIELDS = (
    "receive_data",
    "next_event",
    "start_next_cycle",
    "their_state",
    "_max_incomplete_event_size",
)


class InternalsChanged(RuntimeError):
    """The installed uvicorn or h11 lacks something the connection layer relies on."""


def missing() -> list[str]:
    """What the installed uvicorn and h11 lack of the above, by qualified name."""
    connection = h11.Connection(h11.SERVER)
    return [
        *(f"H11Protocol.{n}" for n in PROTOCOL_HOOKS if not _has_method(H11Protocol, n)),
        *(f"H11Protocol.{n}" for n in PROTOCOL_FIELDS if not _assigns(H11Protocol, n)),
        *(f"RequestResponseCycle.{n}" for n in CYCLE_FIELDS if not _assigns(Cycle, n)),
        *(f"uvicorn.Config.{n}" for n in CONFIG_FIELDS if not _assigns(uvicorn.Config, n)),
        *(f"h11.Connection.{n}" for n in CONNECTION_FIELDS if not hasattr(connection, n)),
    ]


def _has_method(cls: type, name: str) -> bool:
    """Whether uvicorn itself defines `name` (asyncio's no-op base hooks do not count)."""
    owners = [k for k in cls.__mro__ if k.__module__.startswith("uvicorn.")]
    return any(callable(vars(k).get(name)) for k in owners)


def _assigns(cls: type, name: str) -> bool:
    """Whether `cls`'s code sets `self.<name>` (instance fields exist only once made)."""
    return re.search(rf"\bself\.{name}\b(: [^=]+)? = ", inspect.getsource(cls)) is not None


def check() -> None:
    """Raise `InternalsChanged` naming each missing piece and both versions."""
    lacking = missing()
    if lacking:
        installed = f"uvicorn {uvicorn.__version__}, h11 {h11.__version__}"
        pinned = ", ".join(f"{name} {version}" for name, version in WRITTEN_AGAINST.items())
        raise InternalsChanged(
            f"{installed} lack what entrypoints/network/connections.py uses "
            f"(written against {pinned}): {', '.join(lacking)}"
        )
