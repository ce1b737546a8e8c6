"""``neuroshard link``'s listen rule is the daemons' ``check_listen`` (shared/security/exposure.py).

The link had its own copy of the rule (``check_link_listen``); now it calls the daemons'
function with neither TLS nor auth. Each host is judged by both here, so a link that decides
differently from a daemon without TLS and auth fails. Nothing listens: the event loop the
command would run is replaced.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from shared.cli import link
from shared.cli.main import build_parser
from shared.security.exposure import ExposureRefused, check_listen

LISTENS = [
    "127.0.0.1:0",
    "127.0.0.2:0",
    "localhost:0",
    "[::1]:0",
    "0.0.0.0:0",
    "[::]:0",
    "192.0.2.2:0",
    "example.com:0",
]


def _link_refuses(monkeypatch: pytest.MonkeyPatch, listen: str, insecure: bool) -> bool:
    """Run ``neuroshard link`` up to its event loop; True when it refused ``listen``."""
    monkeypatch.setattr(link, "configure_logging", lambda: None)
    monkeypatch.setattr(link, "run_event_loop", lambda main: main.close())
    argv = ["link", "--listen", listen, "--target", "127.0.0.1:1"]
    args = build_parser().parse_args(argv + (["--insecure"] if insecure else []))
    try:
        assert link.cmd_link(args) == 0
    except ExposureRefused as refused:
        assert str(refused).startswith(
            f"--listen: {listen} is reachable from other machines but the link has no tls "
            "and auth; it relays whoever reaches it to its target"
        )
        assert str(refused).endswith("(e.g. when the target serves mutual TLS itself)")
        return True
    return False


def _daemon_refuses(listen: str, insecure: bool) -> bool:
    """Whether a daemon without TLS and auth is refused ``listen``."""
    try:
        check_listen("worker", listen, tls=False, auth=False, insecure=insecure)
    except ExposureRefused:
        return True
    return False


@pytest.mark.parametrize("insecure", [False, True], ids=["default", "insecure"])
@pytest.mark.parametrize("listen", LISTENS)
def test_the_link_judges_a_listen_address_as_the_daemons_do(
    monkeypatch: pytest.MonkeyPatch, listen: str, insecure: bool
) -> None:
    # Act
    with capture_logs() as logs:
        refused = _link_refuses(monkeypatch, listen, insecure)

    # Assert: the same verdict, and the daemons' warning when --insecure lets it listen out
    assert refused is _daemon_refuses(listen, insecure)
    assert refused is (not insecure and listen in LISTENS[4:])
    warned = [e for e in logs if e["event"] == "insecure_listen"]
    if insecure and listen in LISTENS[4:]:
        assert [(e["daemon"], e["missing"]) for e in warned] == [("link", "tls and auth")]
        assert (
            warned[0]["hint"] == "anyone who reaches this port reaches the target through the link"
        )
    else:
        assert warned == []
