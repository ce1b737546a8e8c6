"""The dashboard's HTTP server (aiohttp) on the coordinator's event loop: page, snapshots, SSE.

Read-only: ``GET /`` the page (one HTML file shipped in ``coordinator/dashboard/static``),
``GET /snapshot`` one JSON snapshot, ``GET /events`` server-sent events, one snapshot every
``PUSH_INTERVAL_S``. Under auth, a request without a valid token cookie gets the login page;
``POST /login`` checks the token (reader, writer or admin, ``verify_token``) and keeps it in
an HttpOnly, SameSite=Strict cookie. Under tls, HTTPS with the coordinator's certificate
(browsers present no client certificate: the token is the credential).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from html import escape
from importlib import resources
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from coordinator.cluster import Cluster
from coordinator.dashboard.snapshot import SnapshotBuilder, StorePoller
from shared.config import CoordinatorConfig
from shared.logging import get_logger
from shared.security.exposure import check_listen
from shared.security.tokens import Principal, TokenError, verify_token

log = get_logger("coordinator.dashboard")

PUSH_INTERVAL_S = 0.5
EVENT_POLL_S = 0.05  # how soon a new cluster event triggers a push, seconds
COOKIE = "neuroshard_dashboard"
VIEWER_ROLES = frozenset({"reader", "writer", "admin"})
MAX_LOGIN_BYTES = 16 * 1024

_STATIC = resources.files("coordinator.dashboard") / "static"


def check_exposure(cfg: CoordinatorConfig) -> None:
    """Refuse (or, with ``insecure``, warn about) a dashboard open beyond loopback unprotected.

    Raises:
        ExposureRefused: a non-loopback ``dashboard_host`` without tls and auth, and not
            ``insecure`` (the process exits 2).
    """
    check_listen(
        "coordinator dashboard",
        f"{cfg.dashboard_host}:{cfg.dashboard_port}",
        cfg.tls is not None,
        cfg.auth is not None,
        cfg.insecure,
        field="dashboard_host",
    )


class DashboardServer:
    """The dashboard of one coordinator: ``await start()`` returns the port; ``await stop()``."""

    def __init__(
        self,
        cluster: Cluster,
        cfg: CoordinatorConfig,
        public_key: Ed25519PublicKey | None,
    ) -> None:
        """Check the exposure rules and build the app; nothing listens yet.

        Args:
            cluster: what the page shows.
            cfg: ``dashboard_port``/``dashboard_host``, ``tls`` (HTTPS), ``insecure``.
            public_key: verifies viewers' tokens; None: no login.

        The exposure rule is the caller's to check first, with ``check_exposure(cfg)``,
        before it builds anything the dashboard needs (``CoordinatorServer`` does).
        """
        assert cfg.dashboard_port is not None
        self._cfg = cfg
        self._public_key = public_key
        self._builder = SnapshotBuilder(cluster)
        self._store = StorePoller(cluster)
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        app = web.Application(client_max_size=MAX_LOGIN_BYTES)
        app.router.add_get("/", self._page)
        app.router.add_get("/snapshot", self._snapshot)
        app.router.add_get("/events", self._events)
        app.router.add_post("/login", self._login)
        self._app = app

    @property
    def scheme(self) -> str:
        """``https`` under tls, else ``http``."""
        return "https" if self._cfg.tls is not None else "http"

    @property
    def url(self) -> str:
        """The page's URL, once started (0.0.0.0 and :: shown as 127.0.0.1)."""
        host = self._cfg.dashboard_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
        return f"{self.scheme}://{host}:{self.port}/"

    def _ssl_context(self) -> ssl.SSLContext | None:
        tls = self._cfg.tls
        if tls is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
        return ctx

    async def start(self) -> int:
        """Bind and serve; return the port bound (``dashboard_port`` 0 picks one)."""
        self._runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self._cfg.dashboard_host.strip("[]"),
            self._cfg.dashboard_port,
            ssl_context=self._ssl_context(),
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info("dashboard_started", url=self.url)
        return self.port

    async def stop(self) -> None:
        """End the event streams and stop serving."""
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- auth -----------------------------------------------------------------------------

    def _viewer(self, request: web.Request) -> Principal | None:
        """The token cookie's principal when it may view; without auth, an anonymous one."""
        if self._public_key is None:
            return Principal("", "reader", 0.0)
        token = request.cookies.get(COOKIE, "")
        if not token:
            return None
        try:
            principal = verify_token(self._public_key, token)
        except TokenError:
            return None
        return principal if principal.role in VIEWER_ROLES else None

    def _login_page(self, message: str = "", status: int = 200) -> web.Response:
        page = (_STATIC / "login.html").read_text(encoding="utf-8")
        page = page.replace("{{message}}", escape(message))
        return web.Response(text=page, content_type="text/html", status=status, headers=_NO_CACHE)

    async def _login(self, request: web.Request) -> web.StreamResponse:
        """Check the posted token; on success keep it in the cookie and go to the page."""
        if self._public_key is None:
            raise web.HTTPSeeOther("/")
        form = await request.post()
        token = str(form.get("token", "")).strip()
        try:
            principal = verify_token(self._public_key, token)
        except TokenError as exc:
            return self._login_page(f"token refused: {exc}", status=401)
        if principal.role not in VIEWER_ROLES:
            return self._login_page(
                f"a {principal.role} token cannot view the dashboard; use a reader, writer "
                "or admin token",
                status=403,
            )
        response = web.HTTPSeeOther("/")
        response.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="Strict",
            secure=self._cfg.tls is not None,
            path="/",
        )
        log.info("dashboard_login", subject=principal.subject, role=principal.role)
        raise response

    # -- handlers -------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        """The dashboard page, or the login page without a valid token."""
        if self._viewer(request) is None:
            return self._login_page()
        html = (_STATIC / "index.html").read_text(encoding="utf-8")
        return web.Response(text=html, content_type="text/html", headers=_NO_CACHE)

    async def snapshot(self) -> dict[str, Any]:
        """One snapshot, the store's figures refreshed when due."""
        return self._builder.build(await self._store.refresh())

    async def _snapshot(self, request: web.Request) -> web.StreamResponse:
        if self._viewer(request) is None:
            raise web.HTTPUnauthorized(text="log in at /")
        return web.json_response(await self.snapshot(), headers=_NO_CACHE)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``data: SNAPSHOT`` every ``PUSH_INTERVAL_S`` and on each event."""
        if self._viewer(request) is None:
            raise web.HTTPUnauthorized(text="log in at /")
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", **_NO_CACHE, "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        events = self._builder.events
        try:
            while not self._stopping.is_set():
                if self._viewer(request) is None:  # the token expired while watching
                    await response.write(b"event: logout\ndata: {}\n\n")
                    break
                seen = events.last_seq
                body = json.dumps(await self.snapshot(), separators=(",", ":"))
                await response.write(f"data: {body}\n\n".encode())
                # The next push after PUSH_INTERVAL_S, or at once when something happened (a
                # worker died, replicas were promoted...): a short under-replication shows.
                due = asyncio.get_running_loop().time() + PUSH_INTERVAL_S
                while not self._stopping.is_set() and events.last_seq == seen:
                    left = due - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(self._stopping.wait(), min(left, EVENT_POLL_S))
                    except TimeoutError:
                        pass
        except ConnectionResetError:
            pass  # the browser went away
        return response


_NO_CACHE = {"Cache-Control": "no-store"}
