"""The dashboard's security paths against a real in-process coordinator on a bound port.

Under ``auth`` the page asks for a reader/writer/admin token (the form protected by a
double-submitted CSRF token) and opens a session whose opaque id is kept in an HttpOnly,
SameSite=Strict cookie named after the port (Secure under ``tls``), checked again on every
request; under ``tls``
the page is HTTPS with the coordinator's certificate (auth needs tls, so every dashboard that
asks for a token is HTTPS); beyond loopback it needs tls and auth (or
``insecure``); and it is read-only. Every refusal also checks that nothing happened: no
cookie set, no data served, no state changed, no port bound, no data directory created.

Cookies are read from and sent as raw headers (a ``DummyCookieJar``), so the tests see
exactly what a browser is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding
from structlog.testing import capture_logs

from coordinator.dashboard.http_server import cookie_name, csrf_cookie_name
from coordinator.server import CoordinatorServer
from shared.client import Client
from shared.config import CoordinatorConfig
from shared.security.exposure import ExposureRefused
from shared.security.tokens import AUD_DATA, create_token
from tests.integration.security_helpers import Material, coordinator_state, forged_tokens

pytestmark = pytest.mark.integration

LOGIN_FORM = 'action="/login"'  # only the login page has it
DASHBOARD_SCRIPT = 'new EventSource("/events")'  # only the dashboard page has it


def _worker_role_token(material: Material) -> str:
    """A token with the worker role of old, well signed: no token carries it any more."""
    import time
    import uuid

    import jwt

    now = int(time.time())
    claims = {
        "sub": "worker-0",
        "role": "worker",
        "aud": "neuroshard",
        "jti": uuid.uuid4().hex,
        "iss": "neuroshard",
        "iat": now,
        "exp": now + 300,
    }
    return jwt.encode(claims, material.key, algorithm="EdDSA")


def _url(cluster: Any, path: str) -> str:
    dashboard = cluster.coordinator.dashboard
    return f"{dashboard.scheme}://127.0.0.1:{dashboard.port}{path}"


def _cookie_header(cluster: Any, value: str) -> dict[str, str]:
    """A session cookie holding ``value``, as a browser would send it."""
    return {"Cookie": f"{cookie_name(cluster.coordinator.dashboard.port)}={value}"}


def _set_cookies(response: aiohttp.ClientResponse) -> list[str]:
    return response.headers.getall("Set-Cookie", [])


def _session_cookies(response: aiohttp.ClientResponse, cluster: Any) -> list[str]:
    """The Set-Cookie headers of the session cookie (not the login form's CSRF cookie)."""
    name = cookie_name(cluster.coordinator.dashboard.port)
    return [c for c in _set_cookies(response) if c.startswith(f"{name}=")]


async def _login_form(http: aiohttp.ClientSession, cluster: Any) -> tuple[str, dict[str, str]]:
    """Load the login page as a browser does; return its CSRF field and the cookie to send."""
    name = csrf_cookie_name(cluster.coordinator.dashboard.port)
    async with http.get(_url(cluster, "/")) as page:
        html = await page.text()
        cookie = SimpleCookie(next(c for c in _set_cookies(page) if c.startswith(f"{name}=")))[name]
    field = html.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    return field, {"Cookie": f"{name}={cookie.value}"}


async def _login(
    http: aiohttp.ClientSession, cluster: Any, token: str
) -> tuple[int, list[str], str, dict[str, str]]:
    """Log in through the form; return status, session Set-Cookies, body, the session header."""
    csrf, cookie = await _login_form(http, cluster)
    async with http.post(
        _url(cluster, "/login"),
        data={"token": token, "csrf": csrf},
        headers=cookie,
        allow_redirects=False,
    ) as response:
        status, body = response.status, await response.text()
        session = _session_cookies(response, cluster)
    header = {}
    if session:
        name = cookie_name(cluster.coordinator.dashboard.port)
        header = {"Cookie": f"{name}={SimpleCookie(session[0])[name].value}"}
    return status, session, body, header


def trust_ca(material: Material) -> ssl.SSLContext:
    """A client TLS context that trusts the test CA (and checks the host name)."""
    return ssl.create_default_context(cafile=str(material.certs.ca_cert))


@pytest.fixture
async def http(material: Material) -> AsyncIterator[aiohttp.ClientSession]:
    """A client that trusts the test CA and keeps no cookies by itself."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=trust_ca(material)),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=10),
    ) as session:
        yield session


@pytest.fixture
def dashboard_cluster(make_cluster, secure, material: Material) -> Callable[..., Any]:
    """Factory: a coordinator with a dashboard on port 0, with or without tls and auth."""

    async def make(tls: bool, auth: bool, workers: int = 0, **overrides: object) -> Any:
        assert tls or not auth, "auth needs tls (tokens never travel in plaintext)"
        if tls and auth:
            return await secure(workers=workers, dashboard_port=0, **overrides)
        assert workers == 0, "workers of a half-secure cluster are not needed here"
        security: dict[str, object] = {}
        if tls:
            security["tls"] = material.tls
        if auth:
            security["auth"] = material.coordinator_auth
        return await make_cluster(workers=0, dashboard_port=0, **security, **overrides)

    return make


# -- auth: what a visitor without a valid cookie gets ---------------------------------------


async def test_without_cookie_only_the_login_page_is_served(dashboard_cluster, http) -> None:
    # Arrange
    cluster = await dashboard_cluster(tls=True, auth=True)

    # Act
    async with http.get(_url(cluster, "/")) as page:
        page_status, page_html = page.status, await page.text()
    async with http.get(_url(cluster, "/snapshot")) as snap:
        snap_status, snap_body = snap.status, await snap.text()
    async with http.get(_url(cluster, "/events")) as events:
        events_status, events_type = events.status, events.content_type
        events_body = await events.text()

    # Assert
    assert page_status == 200
    assert LOGIN_FORM in page_html and DASHBOARD_SCRIPT not in page_html
    assert (snap_status, events_status) == (401, 401)
    assert events_type != "text/event-stream"
    for body in (snap_body, events_body):
        assert "log in at /" in body
        assert '"workers"' not in body and "slots" not in body


@pytest.mark.parametrize(
    ("case", "status", "message"),
    [
        ("worker role", 401, "token refused: token has unknown role 'worker'"),
        (
            "data-plane token",
            401,
            "token refused: token is not for this daemon (audience 'neuroshard-data'",
        ),
        ("garbage", 401, "token refused: token is malformed"),
        ("empty", 401, "token refused: token is malformed"),
        ("expired", 401, "token refused: token expired at "),
        ("another key", 401, "token refused: token signature is invalid"),
        ("alg none", 401, "only EdDSA (Ed25519) tokens are accepted"),
    ],
)
async def test_login_refuses_and_sets_no_cookie(
    dashboard_cluster, http, material: Material, case: str, status: int, message: str
) -> None:
    # Arrange
    cluster = await dashboard_cluster(tls=True, auth=True)
    tokens = {
        "worker role": _worker_role_token(material),
        "data-plane token": material.token("admin", "root", audience=AUD_DATA),
        "garbage": "not-a-token",
        "empty": "",
        "expired": forged_tokens(material)["expired"],
        "another key": create_token(Ed25519PrivateKey.generate(), "reader", "mallory", 300),
        "alg none": forged_tokens(material)["alg none"],
    }
    before = coordinator_state(cluster)

    # Act
    got_status, cookies, body, _ = await _login(http, cluster, tokens[case])

    # Assert
    assert got_status == status
    assert cookies == []
    assert LOGIN_FORM in body and message in html.unescape(body)
    assert DASHBOARD_SCRIPT not in body
    assert coordinator_state(cluster) == before


async def test_a_revoked_token_opens_no_session(
    make_cluster, http, material: Material, tmp_path: Path
) -> None:
    # Arrange: a coordinator with a revocation list naming a reader's token
    from shared.config import AuthConfig
    from shared.security.tokens import token_id

    revoked = tmp_path / "revoked"
    auth = AuthConfig(
        public_key_file=str(material.public_key_file),
        private_key_file=str(material.private_key_file),
        revoked_file=str(revoked),
    )
    cluster = await make_cluster(workers=0, dashboard_port=0, tls=material.tls, auth=auth)
    token = material.token("reader", "alice")
    revoked.write_text(token_id(token) + "\n")  # before any token was checked: read at once
    async with Client(cluster.address, security=material.client(token)) as client:
        with pytest.raises(Exception, match="is revoked"):  # the gRPC side refuses it
            await client.status()

    # Act
    status, cookies, body, _ = await _login(http, cluster, token)

    # Assert
    assert (status, cookies) == (401, [])
    assert f"token refused: token {token_id(token)} is revoked" in body
    assert len(cluster.coordinator.dashboard.sessions) == 0


@pytest.mark.parametrize(
    ("case", "token"),
    [
        ("another key", lambda m: create_token(Ed25519PrivateKey.generate(), "admin", "x", 300)),
        ("worker role", _worker_role_token),
        ("a data-plane token", lambda m: m.token("reader", "alice", audience=AUD_DATA)),
        ("expired", lambda m: forged_tokens(m)["expired"]),
        ("alg none", lambda m: forged_tokens(m)["alg none"]),
        # the cookie holds a session id: a valid token (stolen, or guessed format) opens nothing
        ("a valid admin token", lambda m: m.token("admin", "root")),
        ("a guessed session id", lambda m: "A" * 43),
    ],
)
async def test_a_bad_cookie_is_refused_on_every_path(
    dashboard_cluster, http, material: Material, case: str, token
) -> None:
    # Arrange: a cookie a browser could be made to send, never issued by this dashboard
    cluster = await dashboard_cluster(tls=True, auth=True)
    cookie = _cookie_header(cluster, token(material))

    # Act
    async with http.get(_url(cluster, "/"), headers=cookie) as page:
        page_html = await page.text()
    async with http.get(_url(cluster, "/snapshot"), headers=cookie) as snap:
        snap_status, snap_body = snap.status, await snap.text()
    async with http.get(_url(cluster, "/events"), headers=cookie) as events:
        events_status, events_body = events.status, await events.text()

    # Assert
    assert LOGIN_FORM in page_html and DASHBOARD_SCRIPT not in page_html
    assert (snap_status, events_status) == (401, 401)
    assert '"workers"' not in snap_body and '"workers"' not in events_body


# -- auth: a reader logs in ------------------------------------------------------------------


async def test_reader_login_sets_a_strict_httponly_cookie_that_opens_the_data(
    dashboard_cluster, http, material: Material
) -> None:
    # Arrange
    cluster = await dashboard_cluster(tls=True, auth=True, workers=1)
    token = material.token("reader", "alice")

    # Act
    csrf, csrf_cookie = await _login_form(http, cluster)
    async with http.post(
        _url(cluster, "/login"),
        data={"token": token, "csrf": csrf},
        headers=csrf_cookie,
        allow_redirects=False,
    ) as login:
        login_status, location = login.status, login.headers["Location"]
        set_cookies = _session_cookies(login, cluster)
    name = cookie_name(cluster.coordinator.dashboard.port)
    session_id = SimpleCookie(set_cookies[0])[name].value
    cookie = {"Cookie": f"{name}={session_id}"}
    async with http.get(_url(cluster, "/"), headers=cookie) as page:
        page_html = await page.text()
    async with http.get(_url(cluster, "/snapshot"), headers=cookie) as snap:
        snap_status, snapshot = snap.status, await snap.json()
    async with http.get(_url(cluster, "/events"), headers=cookie) as events:
        events_type = events.content_type
        first_push = (await events.content.readline()).decode()

    # Assert: the Set-Cookie header, attribute by attribute: an opaque id, never the token
    assert (login_status, location) == (303, "/")
    assert len(set_cookies) == 1
    morsel = SimpleCookie(set_cookies[0])[name]
    assert name == f"neuroshard_dashboard_{cluster.coordinator.dashboard.port}"
    assert morsel.value != token and token not in set_cookies[0]
    assert len(morsel.value) == 43  # 256 random bits, URL-safe base64
    assert 0 < int(morsel["max-age"]) <= 301  # the session ends with the token
    assert morsel["httponly"] is True
    assert morsel["samesite"] == "Strict"
    assert morsel["path"] == "/"
    assert morsel["secure"] is True  # auth needs tls: always HTTPS
    # the cookie opens the page, the snapshot and the event stream
    assert DASHBOARD_SCRIPT in page_html and LOGIN_FORM not in page_html
    assert snap_status == 200
    assert {"workers", "slots", "jobs", "events"} <= snapshot.keys()
    expected_workers = ["worker-0"]
    assert [w["name"] for w in snapshot["workers"]] == expected_workers
    assert events_type == "text/event-stream"
    assert first_push.startswith("data: ")
    pushed = json.loads(first_push.removeprefix("data: "))
    assert [w["name"] for w in pushed["workers"]] == expected_workers


async def test_event_stream_logs_out_when_the_cookie_expires_while_watching(
    dashboard_cluster, http, material: Material
) -> None:
    # Arrange: a session opened with a reader token that expires in about 2 s
    cluster = await dashboard_cluster(tls=True, auth=True)
    token = material.token("reader", "bob", ttl_s=2)
    _, _, _, session = await _login(http, cluster, token)

    # Act: read the stream to its end (the client's 10 s timeout bounds it)
    async with http.get(_url(cluster, "/events"), headers=session) as events:
        status = events.status
        lines = [line.decode().rstrip("\n") async for line in events.content]

    # Assert: snapshots while valid, then a logout event, then the server ends the stream
    frames = [line for line in lines if line]
    assert status == 200
    assert frames[0].startswith("data: {")
    assert frames[-2:] == ["event: logout", "data: {}"]
    assert all(f.startswith('data: {"') for f in frames[:-2])


# -- tls -------------------------------------------------------------------------------------


async def test_tls_serves_https_with_the_coordinator_certificate_only(
    dashboard_cluster, http, material: Material
) -> None:
    # Arrange
    cluster = await dashboard_cluster(tls=True, auth=False)
    port = cluster.coordinator.dashboard.port
    coordinator_cert = x509.load_pem_x509_certificate(material.certs.coordinator_cert.read_bytes())

    # Act
    async with http.get(f"https://127.0.0.1:{port}/snapshot") as secure:
        secure_status = secure.status
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=trust_ca(material))
    peer_der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    with pytest.raises(aiohttp.ClientError) as plain:
        async with http.get(f"http://127.0.0.1:{port}/snapshot") as response:
            await response.read()
    async with aiohttp.ClientSession() as untrusting:  # the system CAs, not the test CA
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await untrusting.get(f"https://127.0.0.1:{port}/snapshot")

    # Assert
    assert cluster.coordinator.dashboard.url == f"https://127.0.0.1:{port}/"
    assert secure_status == 200
    assert peer_der == coordinator_cert.public_bytes(Encoding.DER)
    assert not isinstance(plain.value, aiohttp.ClientResponseError)  # no HTTP answer at all


# -- exposure --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s, contextlib.suppress(OSError):
        s.settimeout(2)
        s.connect(("127.0.0.1", port))
        return True
    return False


@pytest.mark.parametrize(
    ("tls", "auth", "missing"),
    [(False, False, "tls and auth"), (True, False, "auth"), (False, True, "tls")],
)
async def test_open_dashboard_without_tls_and_auth_is_refused_before_anything(
    tmp_path: Path, material: Material, tls: bool, auth: bool, missing: str
) -> None:
    # Arrange
    port = _free_port()
    data_dir = tmp_path / "coord"
    cfg = CoordinatorConfig(
        listen="127.0.0.1:0",
        data_dir=str(data_dir),
        metrics_port=None,
        dashboard_port=port,
        dashboard_host="0.0.0.0",
        tls=material.tls if tls else None,
        auth=material.coordinator_auth if auth else None,
    )

    # Act
    with pytest.raises(ExposureRefused) as refused:
        CoordinatorServer(cfg)

    # Assert
    message = str(refused.value)
    assert message.startswith(f"dashboard_host: 0.0.0.0:{port} is reachable from other machines")
    assert f"has no {missing}" in message and "--insecure" in message
    assert not data_dir.exists()
    assert not _listening(port)


@pytest.mark.parametrize("secure_cluster", [False, True], ids=["insecure", "tls+auth"])
async def test_open_dashboard_is_served_with_insecure_or_with_tls_and_auth(
    dashboard_cluster, http, material: Material, secure_cluster: bool
) -> None:
    # Arrange
    overrides: dict[str, object] = {"dashboard_host": "0.0.0.0"}
    if not secure_cluster:
        overrides["insecure"] = True
    token = material.token("reader", "alice")

    # Act
    with capture_logs() as logs:
        cluster = await dashboard_cluster(tls=secure_cluster, auth=secure_cluster, **overrides)
    headers = (await _login(http, cluster, token))[3] if secure_cluster else {}
    async with http.get(_url(cluster, "/snapshot"), headers=headers) as snap:
        status = snap.status

    # Assert
    assert status == 200
    warned = [e for e in logs if e["event"] == "insecure_listen"]
    if secure_cluster:
        assert warned == []
    else:
        assert [(e["daemon"], e["missing"]) for e in warned] == [
            ("coordinator dashboard", "tls and auth")
        ]


# -- read-only -------------------------------------------------------------------------------


async def test_dashboard_is_read_only(dashboard_cluster, http, material: Material) -> None:
    # Arrange: a settled cluster of one worker; logged in, so a refusal is the method's
    cluster = await dashboard_cluster(tls=True, auth=True, workers=1)
    admin = material.token("admin", "root")
    async with Client(cluster.address, security=material.client(admin)) as client:
        await client.wait_ready()
    cookie = (await _login(http, cluster, admin))[3]
    before = coordinator_state(cluster)
    requests = [
        ("POST", "/"),
        ("PUT", "/"),
        ("DELETE", "/"),
        ("POST", "/snapshot"),
        ("PATCH", "/snapshot"),
        ("DELETE", "/events"),
        ("PUT", "/login"),
        ("DELETE", "/login"),
        ("POST", "/jobs"),
        ("POST", "/workers/worker-0"),
        ("DELETE", "/workers/worker-0"),
    ]

    # Act
    statuses = {}
    for method, path in requests:
        async with http.request(
            method, _url(cluster, path), headers=cookie, data={"state": "DEAD"}
        ) as response:
            statuses[(method, path)] = (response.status, _set_cookies(response))

    # Assert
    assert statuses == {
        ("POST", "/"): (405, []),
        ("PUT", "/"): (405, []),
        ("DELETE", "/"): (405, []),
        ("POST", "/snapshot"): (405, []),
        ("PATCH", "/snapshot"): (405, []),
        ("DELETE", "/events"): (405, []),
        ("PUT", "/login"): (405, []),
        ("DELETE", "/login"): (405, []),
        ("POST", "/jobs"): (404, []),
        ("POST", "/workers/worker-0"): (404, []),
        ("DELETE", "/workers/worker-0"): (404, []),
    }
    assert coordinator_state(cluster) == before


# -- what a viewer sees: only their own jobs (finding 8) --------------------------------------


async def test_snapshots_show_a_viewer_only_their_own_jobs_and_events(
    dashboard_cluster, http, material: Material
) -> None:
    # Arrange: alice and bob each submit a job (no workers: both stay QUEUED)
    cluster = await dashboard_cluster(tls=True, auth=True)
    ids = {}
    for who in ("alice", "bob"):
        token = material.token("writer", who)
        async with Client(cluster.address, security=material.client(token)) as client:
            job = await client.submit(
                {"kind": "train", "workers": 1, "steps": 1, "name": f"{who}-secret-run"}
            )
            ids[who] = job.job_id

    async def seen_by(role: str, subject: str) -> tuple[dict, dict]:
        session = (await _login(http, cluster, material.token(role, subject)))[3]
        async with http.get(_url(cluster, "/snapshot"), headers=session) as snap:
            snapshot = await snap.json()
        async with http.get(_url(cluster, "/events"), headers=session) as events:
            pushed = json.loads((await events.content.readline()).decode()[len("data: ") :])
        return snapshot, pushed

    # Act
    views = {
        "alice": await seen_by("reader", "alice"),
        "bob": await seen_by("writer", "bob"),
        "mallory": await seen_by("reader", "mallory"),
        "admin": await seen_by("admin", "root"),
    }

    # Assert: in the snapshot and in the event stream alike
    expected = {"alice": ["alice"], "bob": ["bob"], "mallory": [], "admin": ["bob", "alice"]}
    for viewer, whose in expected.items():
        for doc in views[viewer]:
            assert [j["name"] for j in doc["jobs"]] == [f"{w}-secret-run" for w in whose]
            assert doc["jobs_by_state"]["QUEUED"] == len(whose)
            job_events = {e["job_id"] for e in doc["events"] if "job_id" in e}
            assert job_events == {ids[w] for w in whose}
            text = json.dumps(doc)
            for other in {"alice", "bob"} - set(whose):
                assert ids[other] not in text and f"{other}-secret" not in text


# -- Host header: DNS rebinding (finding 12) -------------------------------------------------


@pytest.mark.parametrize("auth", [False, True], ids=["token-less", "auth"])
async def test_a_foreign_host_header_is_refused_on_every_path(
    dashboard_cluster, http, material: Material, auth: bool
) -> None:
    # Arrange: a page of evil.example whose name now resolves to 127.0.0.1
    cluster = await dashboard_cluster(tls=auth, auth=auth)
    evil = {"Host": f"evil.example:{cluster.coordinator.dashboard.port}"}
    before = coordinator_state(cluster)

    # Act
    answers = {}
    for method, path in [
        ("GET", "/"),
        ("GET", "/snapshot"),
        ("GET", "/events"),
        ("POST", "/login"),
    ]:
        async with http.request(
            method,
            _url(cluster, path),
            headers=evil,
            data={"token": material.token("admin", "root")} if method == "POST" else None,
            allow_redirects=False,
        ) as response:
            answers[path] = (response.status, _set_cookies(response), await response.text())

    # Assert: 421, no data, no cookie, no session
    for status, cookies, body in answers.values():
        assert status == 421
        assert "Host header names no host this dashboard serves" in body
        assert cookies == [] and '"workers"' not in body
    assert len(cluster.coordinator.dashboard.sessions) == 0
    assert coordinator_state(cluster) == before


async def test_loopback_names_and_configured_host_names_are_served(dashboard_cluster, http) -> None:
    cluster = await dashboard_cluster(
        tls=False, auth=False, dashboard_host_names=["dash.example.org"]
    )
    port = cluster.coordinator.dashboard.port

    statuses = []
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"DASH.example.org:{port}", "[::1]"):
        async with http.get(_url(cluster, "/snapshot"), headers={"Host": host}) as snap:
            statuses.append(snap.status)

    assert statuses == [200, 200, 200, 200]


# -- login CSRF (finding 12) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no csrf field or cookie", "the CSRF token of the form is missing or stale"),
        ("a field that is not the cookie's", "the CSRF token of the form is missing or stale"),
        ("a foreign Origin", "the form was posted from another origin"),
        ("a cross-site fetch", "login refused: a cross-site request"),
    ],
)
async def test_a_cross_site_login_is_refused_and_opens_no_session(
    dashboard_cluster, http, material: Material, case: str, message: str
) -> None:
    # Arrange: the attacker's page posts its own admin token (login CSRF) into the victim's
    # browser, which holds the victim's CSRF cookie
    cluster = await dashboard_cluster(tls=True, auth=True)
    csrf, cookie = await _login_form(http, cluster)
    form = {"token": material.token("admin", "mallory"), "csrf": csrf}
    headers = dict(cookie)
    if case == "no csrf field or cookie":
        headers, form = {}, {"token": form["token"]}
    elif case == "a field that is not the cookie's":
        form["csrf"] = "B" * 43
    elif case == "a foreign Origin":
        headers["Origin"] = "http://evil.example"
    else:
        headers["Sec-Fetch-Site"] = "cross-site"
    before = coordinator_state(cluster)

    # Act
    async with http.post(
        _url(cluster, "/login"), data=form, headers=headers, allow_redirects=False
    ) as response:
        status, body = response.status, await response.text()
        session = _session_cookies(response, cluster)

    # Assert
    assert status == 403
    assert message in body and LOGIN_FORM in body
    assert session == []
    assert len(cluster.coordinator.dashboard.sessions) == 0
    assert coordinator_state(cluster) == before


async def test_a_same_origin_login_with_its_csrf_token_opens_a_session(
    dashboard_cluster, http, material: Material
) -> None:
    cluster = await dashboard_cluster(tls=True, auth=True)
    csrf, cookie = await _login_form(http, cluster)
    headers = cookie | {
        "Origin": f"https://127.0.0.1:{cluster.coordinator.dashboard.port}",
        "Sec-Fetch-Site": "same-origin",
    }

    async with http.post(
        _url(cluster, "/login"),
        data={"token": material.token("reader", "alice"), "csrf": csrf},
        headers=headers,
        allow_redirects=False,
    ) as response:
        status, session = response.status, _session_cookies(response, cluster)

    assert status == 303 and len(session) == 1
    assert len(cluster.coordinator.dashboard.sessions) == 1


# -- sessions are bounded (finding 12) -------------------------------------------------------


async def test_sessions_beyond_dashboard_max_sessions_end_the_oldest(
    dashboard_cluster, http, material: Material
) -> None:
    cluster = await dashboard_cluster(tls=True, auth=True, dashboard_max_sessions=2)

    sessions = []
    for ttl in (100, 200, 300):  # the first expires soonest
        sessions.append((await _login(http, cluster, material.token("reader", "a", ttl)))[3])
    statuses = []
    for session in sessions:
        async with http.get(_url(cluster, "/snapshot"), headers=session) as snap:
            statuses.append(snap.status)

    assert statuses == [401, 200, 200]
    assert len(cluster.coordinator.dashboard.sessions) == 2
