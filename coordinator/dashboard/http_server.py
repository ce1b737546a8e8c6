"""The dashboard's HTTP server (aiohttp) on the coordinator's event loop: page, snapshots, SSE.

Read-only: ``GET /`` the page (one HTML file shipped in ``coordinator/dashboard/static``),
``GET /snapshot`` one JSON snapshot, ``GET /events`` server-sent events, one snapshot every
``PUSH_INTERVAL_S``. Under tls, HTTPS with the coordinator's certificate (browsers present no
client certificate: the token is the credential).

Every request must name in its Host header one of the dashboard's host names
(``sessions.host_names``: loopback, ``dashboard_host``, ``dashboard_host_names``), else 421:
a DNS-rebinding page cannot read a token-less dashboard.

Under auth, a request without a live session gets the login page. ``POST /login`` checks the
token (reader, writer or admin, ``verify_token``) and opens a session (``sessions.Sessions``)
until the token's ``exp``: the cookie ``neuroshard_dashboard_PORT`` holds only the session's
random id (HttpOnly, SameSite=Strict, Secure under tls; one per port, so two dashboards on
one host do not share it). The login form is protected against cross-site requests by a
double-submitted token (a cookie ``neuroshard_csrf_PORT`` and the form's hidden field must
match) and by refusing a foreign ``Origin`` or ``Sec-Fetch-Site``. A snapshot shows the
viewer's own jobs only (an admin's: all), as GetJob and ListJobs do.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from html import escape
from importlib import resources
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from coordinator.cluster import Cluster
from coordinator.dashboard.sessions import Sessions, host_names, host_of
from coordinator.dashboard.snapshot import SnapshotBuilder, StorePoller
from shared.config import CoordinatorConfig
from shared.logging import get_logger
from shared.security.auth import may_see_job, reset_principal, set_principal
from shared.security.exposure import check_listen, local_host
from shared.security.tokens import Principal, RevocationList, TokenError, verify_token

log = get_logger(__name__)

PUSH_INTERVAL_S = 0.5
EVENT_POLL_S = 0.05  # how soon a new cluster event triggers a push, seconds
COOKIE_PREFIX = "neuroshard_dashboard"  # the session cookie: NAME_PORT
CSRF_PREFIX = "neuroshard_csrf"  # the login form's double-submitted token: NAME_PORT
CSRF_FIELD = "csrf"
SAME_ORIGIN_FETCH = frozenset({"same-origin", "none"})  # Sec-Fetch-Site a login may carry
VIEWER_ROLES = frozenset({"reader", "writer", "admin"})
MAX_LOGIN_BYTES = 16 * 1024

_STATIC = resources.files("coordinator.dashboard") / "static"


def cookie_name(port: int) -> str:
    """The session cookie of the dashboard on ``port`` (cookies are not port-scoped)."""
    return f"{COOKIE_PREFIX}_{port}"


def csrf_cookie_name(port: int) -> str:
    """The login form's CSRF cookie of the dashboard on ``port``."""
    return f"{CSRF_PREFIX}_{port}"


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
        revoked: RevocationList | None = None,
    ) -> None:
        """Check the exposure rules and build the app; nothing listens yet.

        Args:
            cluster: what the page shows.
            cfg: ``dashboard_port``/``dashboard_host``, ``tls`` (HTTPS), ``insecure``.
            public_key: verifies viewers' tokens; None: no login.
            revoked: the coordinator's revocation list (``auth.revoked_file``): a revoked
                token opens no session, and a session of a token revoked since ends.

        The exposure rule is the caller's to check first, with ``check_exposure(cfg)``,
        before it builds anything the dashboard needs (``CoordinatorServer`` does).
        """
        assert cfg.dashboard_port is not None
        self._cfg = cfg
        self._public_key = public_key
        self._revoked = revoked if revoked is not None else RevocationList(None)
        self._builder = SnapshotBuilder(cluster)
        self._store = StorePoller(cluster)
        self._stopping = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.sessions = Sessions(cfg.dashboard_max_sessions)
        self._hosts = host_names(cfg.dashboard_host, cfg.dashboard_host_names)
        app = web.Application(client_max_size=MAX_LOGIN_BYTES, middlewares=[self._check_host])
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
        return f"{self.scheme}://{local_host(self._cfg.dashboard_host)}:{self.port}/"

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

    @web.middleware
    async def _check_host(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Answer only requests whose Host names this dashboard (421 otherwise)."""
        if host_of(request.headers.get("Host", "")) not in self._hosts:
            return web.Response(
                status=421,
                text="421 misdirected request: the Host header names no host this dashboard "
                "serves (localhost, its dashboard_host, or one of dashboard_host_names)",
                headers=_NO_CACHE,
            )
        return await handler(request)

    @property
    def _cookie(self) -> str:
        assert self.port is not None, "not started"
        return cookie_name(self.port)

    @property
    def _csrf_cookie(self) -> str:
        assert self.port is not None, "not started"
        return csrf_cookie_name(self.port)

    def _viewer(self, request: web.Request) -> Principal | None:
        """The session cookie's principal while its token lasts; without auth, an anonymous one."""
        if self._public_key is None:
            return Principal("", "reader", 0.0)
        return self.sessions.get(request.cookies.get(self._cookie, ""), self._revoked)

    def _login_page(
        self, request: web.Request, message: str = "", status: int = 200
    ) -> web.Response:
        """The login form, with a CSRF token in a hidden field and in a cookie."""
        csrf = request.cookies.get(self._csrf_cookie, "")
        if len(csrf) < 32 or not csrf.replace("-", "").replace("_", "").isalnum():
            csrf = secrets.token_urlsafe(32)
        page = (_STATIC / "login.html").read_text(encoding="utf-8")
        page = page.replace("{{message}}", escape(message)).replace("{{csrf}}", escape(csrf))
        response = web.Response(
            text=page, content_type="text/html", status=status, headers=_NO_CACHE
        )
        self._set_cookie(response, self._csrf_cookie, csrf)
        return response

    def _set_cookie(
        self,
        response: web.StreamResponse,
        name: str,
        value: str,
        path: str = "/",
        max_age: int | None = None,
    ) -> None:
        response.set_cookie(
            name,
            value,
            httponly=True,
            samesite="Strict",
            secure=self._cfg.tls is not None,
            path=path,
            max_age=max_age,
        )

    def _cross_site(self, request: web.Request, form_csrf: str) -> str | None:
        """Say why a login request may come from another site, or return None."""
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{self.scheme}://{request.headers.get('Host')}":
            return "login refused: the form was posted from another origin"
        fetch_site = request.headers.get("Sec-Fetch-Site")
        if fetch_site is not None and fetch_site not in SAME_ORIGIN_FETCH:
            return f"login refused: a {fetch_site} request"
        cookie = request.cookies.get(self._csrf_cookie, "")
        if not cookie or not hmac.compare_digest(cookie.encode(), form_csrf.encode()):
            return "login refused: the CSRF token of the form is missing or stale; log in again"
        return None

    async def _login(self, request: web.Request) -> web.StreamResponse:
        """Check the form and the posted token; on success open a session, go to the page."""
        if self._public_key is None:
            raise web.HTTPSeeOther("/")
        form = await request.post()
        cross_site = self._cross_site(request, str(form.get(CSRF_FIELD, "")))
        if cross_site is not None:
            return self._login_page(request, cross_site, status=403)
        token = str(form.get("token", "")).strip()
        try:
            principal = verify_token(self._public_key, token, revoked=self._revoked)
        except TokenError as exc:
            return self._login_page(request, f"token refused: {exc}", status=401)
        if principal.role not in VIEWER_ROLES:
            return self._login_page(
                request,
                f"a {principal.role} token cannot view the dashboard; use a reader, writer "
                "or admin token",
                status=403,
            )
        left_s = principal.expires_at - time.time()
        if left_s <= 0:  # accepted within verify_token's leeway: no session to open
            return self._login_page(request, "token refused: token has expired", status=401)
        self.sessions.end(request.cookies.get(self._cookie, ""))  # no session fixation
        response = web.HTTPSeeOther("/")
        self._set_cookie(
            response, self._cookie, self.sessions.create(principal), max_age=int(left_s) + 1
        )
        log.info("dashboard_login", subject=principal.subject, role=principal.role)
        raise response

    # -- handlers -------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        """The dashboard page, or the login page without a valid token."""
        if self._viewer(request) is None:
            return self._login_page(request)
        html = (_STATIC / "index.html").read_text(encoding="utf-8")
        return web.Response(text=html, content_type="text/html", headers=_NO_CACHE)

    async def snapshot(self, viewer: Principal | None = None) -> dict[str, Any]:
        """One snapshot for ``viewer``, the store's figures refreshed when due.

        Args:
            viewer: the session's principal: jobs and their events are filtered by
                ``may_see_job`` as that caller; None (no auth): every job.
        """
        store = await self._store.refresh()
        if viewer is None:
            return self._builder.build(store)
        token = set_principal(viewer)
        try:
            return self._builder.build(store, may_see_job)
        finally:
            reset_principal(token)

    def _filter_as(self, viewer: Principal) -> Principal | None:
        """Whom snapshots are filtered for: the viewer under auth, nobody without."""
        return None if self._public_key is None else viewer

    async def _snapshot(self, request: web.Request) -> web.StreamResponse:
        viewer = self._viewer(request)
        if viewer is None:
            raise web.HTTPUnauthorized(text="log in at /")
        doc = await self.snapshot(self._filter_as(viewer))
        return web.json_response(doc, headers=_NO_CACHE)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``data: SNAPSHOT`` every ``PUSH_INTERVAL_S`` and on each event.

        The stream ends with ``event: logout`` when the session does (its token expired).
        """
        viewer = self._viewer(request)
        if viewer is None:
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
                doc = await self.snapshot(self._filter_as(viewer))
                body = json.dumps(doc, separators=(",", ":"))
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
