"""The memory iteration on Redis, for comparison: part 3 of ``make bench-memory``.

Debian's ``redis-server`` is started on loopback (a free port, a temporary directory, no
persistence) and always stopped. The store is one sorted set (member: the id as 8 big-endian
bytes, score: the strength), driven with the ``redis`` client from PyPI:

- reinforce: the same 100k Zipf accesses as ZINCRBY (boost 0.05 each, duplicates add), one
  pipeline; then a Lua script clips to 1 (ZRANGE BYSCORE (1 +inf and ZADD 1 for those), so the
  result has the clip semantics of ours. Scores are float64 in Redis (ours float32), and the
  few ids pushed over 1 are clipped after the batch, not per access: with boosts >= 0 the same
  result. The pipeline is encoded as raw RESP bytes with NumPy and written to its own socket,
  the replies read back in bulk: redis-py needs ~35 us of Python per pipelined command, which
  would make this a benchmark of redis-py (``redis_py_reinforce_s`` measures that path too);
- decay: a Lua script reads every (member, score) with ZRANGE 0 -1 WITHSCORES and writes back
  ``max(score - rate, 0)`` with ZADD in chunks of 2000 pairs (one script, atomic like ours);
- quality: ZCARD, ZCOUNT for the 10 histogram bins and the min and max by rank, pipelined.
  Redis has no cheap sum, so the mean is *not* computed on Redis (ours computes it);
- top-100: ZRANGE +inf -inf BYSCORE REV LIMIT 0 100 WITHSCORES (ties ordered by member,
  i.e. larger id first, where ours puts the smaller id first).

Redis keeps one copy in one process; ours keeps two copies (RF=2) on 3 worker processes.
``server_cpu_s`` (from INFO cpu) tells how much of an iteration the server itself spends;
the rest is the Python client (redis-py encoding 100k commands) and the loopback.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from coordinator.memory.access_stream import ScrambledZipfStream, generate_memories
from tests.benchmarks.bench_cluster import ALPHA, BATCH, BOOST, DECAY_RATE, PHASES, SEED, TOP_K

KEY = "memories"
LOAD_CHUNK = 10_000  # members per ZADD while loading

CLIP_LUA = """
local over = redis.call('ZRANGE', KEYS[1], '(1', '+inf', 'BYSCORE')
for i = 1, #over do redis.call('ZADD', KEYS[1], 1, over[i]) end
return #over
"""

DECAY_LUA = """
local rate = tonumber(ARGV[1])
local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local args = {}
for i = 1, #all, 2 do
  local s = tonumber(all[i + 1]) - rate
  if s < 0 then s = 0 end
  args[#args + 1] = s
  args[#args + 1] = all[i]
  if #args >= 4000 then  -- Lua 5.1 unpack() stops near 8000 values
    redis.call('ZADD', KEYS[1], unpack(args))
    args = {}
  end
end
if #args > 0 then redis.call('ZADD', KEYS[1], unpack(args)) end
return #all / 2
"""


@dataclass
class RedisResult:
    """Per-iteration and per-phase seconds of the Redis run, and how it went."""

    memories: int
    version: str = ""
    load_s: float = 0.0
    iteration_s: list[float] = field(default_factory=list)
    phase_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    server_cpu_s: list[float] = field(default_factory=list)  # redis-server CPU per iteration
    redis_py_reinforce_s: list[float] = field(default_factory=list)  # same batch via redis-py
    skipped: str = ""  # why the part did not run, when it did not

    def ms(self, what: str, q: float = 50) -> float:
        """Percentile ``q`` of an iteration's or a phase's time, ms."""
        s = self.iteration_s if what == "iteration" else self.phase_s[what]
        return float(np.percentile(np.asarray(s) * 1e3, q))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _members(ids: np.ndarray) -> list[bytes]:
    """Ids as 8-byte big-endian members (byte order = numeric order)."""
    raw = ids.astype(">u8").tobytes()
    return [raw[i : i + 8] for i in range(0, len(raw), 8)]


class RedisServer:
    """``redis-server`` on 127.0.0.1:free port in a temp dir; a context manager that always
    stops it (SHUTDOWN NOSAVE, then SIGKILL after 10 s)."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RedisServer:
        args = [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self._tmp.name,
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--logfile",
            "",
        ]
        self.proc = subprocess.Popen(
            [self.binary, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis shuts down (nothing to save)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()


def _connect(port: int, timeout_s: float = 10.0):  # -> redis.Redis
    import redis

    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _zincrby_resp(members: np.ndarray, boost: float) -> bytes:
    """One ZINCRBY command per member, RESP-encoded: members [K, 8] uint8 (big-endian ids)."""
    b = repr(boost).encode()
    head = b"*4\r\n$7\r\nZINCRBY\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$8\r\n" % (
        len(KEY),
        KEY.encode(),
        len(b),
        b,
    )
    rows = np.empty((len(members), len(head) + 10), np.uint8)
    rows[:, : len(head)] = np.frombuffer(head, np.uint8)
    rows[:, len(head) : -2] = members
    rows[:, -2:] = np.frombuffer(b"\r\n", np.uint8)
    return rows.tobytes()


def _pipeline_raw(sock: socket.socket, payload: bytes, replies: int) -> None:
    """Send a pipeline and read its replies (each a bulk string: two CRLFs) in bulk."""
    sock.sendall(payload)
    want, seen, tail = 2 * replies, 0, b""
    while seen < want:
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("redis-server closed the connection")
        if chunk[:1] == b"-" or b"\r\n-" in tail + chunk:
            raise RuntimeError(f"redis error: {chunk[:200]!r}")
        seen += (tail + chunk).count(b"\r\n") - tail.count(b"\r\n")
        tail = chunk[-1:]
    if seen != want:
        raise RuntimeError(f"redis replied {seen} CRLFs, expected {want}")


def _server_cpu_s(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _iteration(
    r, sock: socket.socket, accessed: np.ndarray, scripts, res: RedisResult, record: bool
) -> None:
    clip, decay = scripts
    members = accessed.astype(">u8").view(np.uint8).reshape(-1, 8)
    cpu0 = _server_cpu_s(r)
    t0 = time.perf_counter()
    _pipeline_raw(sock, _zincrby_resp(members, BOOST), len(members))
    clip(keys=[KEY])
    t1 = time.perf_counter()
    decay(keys=[KEY], args=[DECAY_RATE])
    t2 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    pipe.zcard(KEY)
    for b in range(10):
        hi = "(%r" % ((b + 1) / 10) if b < 9 else "+inf"
        pipe.zcount(KEY, b / 10, hi)
    pipe.zrange(KEY, 0, 0, withscores=True)
    pipe.zrange(KEY, -1, -1, withscores=True)
    pipe.execute()
    t3 = time.perf_counter()
    r.execute_command(
        "ZRANGE", KEY, "+inf", "-inf", "BYSCORE", "REV", "LIMIT", 0, TOP_K, "WITHSCORES"
    )
    t4 = time.perf_counter()
    if record:
        for p, s in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            res.phase_s[p].append(s)
        res.iteration_s.append(t4 - t0)
        res.server_cpu_s.append(_server_cpu_s(r) - cpu0)


def _redis_py_reinforce(r, accessed: np.ndarray, clip) -> float:
    """The reinforce phase through a redis-py pipeline (what a Python user writes); seconds."""
    members = _members(accessed)
    t = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for m in members:
        pipe.zincrby(KEY, BOOST, m)
    pipe.execute()
    clip(keys=[KEY])
    return time.perf_counter() - t


def run_redis_bench(
    n: int = 1_000_000, iterations: int = 10, warmup: int = 1, redis_py_repeats: int = 3
) -> RedisResult:
    """Load ``n`` memories into a fresh redis-server and time ``iterations`` iterations, then
    ``redis_py_repeats`` reinforce batches through a redis-py pipeline.

    Returns a result with ``skipped`` set (and nothing timed) when redis-server or the
    ``redis`` Python package is missing.
    """
    res = RedisResult(memories=n)
    binary = shutil.which("redis-server")
    if binary is None:
        res.skipped = (
            "redis-server is not installed (Debian: apt-get install redis-server); "
            "the Redis comparison is skipped"
        )
        return res
    try:
        import redis  # noqa: F401
    except ImportError:
        res.skipped = "the redis Python package is missing (pip install -e '.[dev]'); skipped"
        return res
    ids, strengths = generate_memories(n, SEED)
    stream = ScrambledZipfStream(ids, ALPHA, BATCH, SEED)
    with RedisServer(binary) as server:
        r = _connect(server.port)
        res.version = str(r.info("server").get("redis_version", ""))
        t = time.perf_counter()
        members = _members(ids)
        for start in range(0, n, LOAD_CHUNK):
            part = dict(
                zip(
                    members[start : start + LOAD_CHUNK],
                    strengths[start : start + LOAD_CHUNK].tolist(),
                    strict=True,
                )
            )
            r.zadd(KEY, part)
        res.load_s = time.perf_counter() - t
        scripts = r.register_script(CLIP_LUA), r.register_script(DECAY_LUA)
        with socket.create_connection(("127.0.0.1", server.port), timeout=300) as sock:
            for i in range(warmup + iterations):
                _iteration(r, sock, stream.next_batch(i), scripts, res, record=i >= warmup)
        for i in range(redis_py_repeats):
            accessed = stream.next_batch(warmup + iterations + i)
            res.redis_py_reinforce_s.append(_redis_py_reinforce(r, accessed, scripts[0]))
        r.close()
    return res
