"""The rendezvous store of one allreduce generation: bound to one host, its keys sealed.

torch's ``TCPStore`` has no authentication: whoever reaches its port may list, read, write
and delete every key (``list_keys`` included), and its server listens on every interface
whatever host it is given. A peer that rewrote a gloo address key before the rank it names
could join the group and feed it gradients. So:

- **Bound to the advertised host.** Rank 0 binds the listening socket itself, to the host
  the worker advertises (:func:`bound_listener`), and hands its descriptor to the store
  (``master_listen_fd``); gloo's listeners go to the interface carrying that host
  (:func:`gloo_interface`, ``GLOO_SOCKET_IFNAME``). On a loopback cluster nothing of a
  generation is reachable from other machines.
- **Sealed with the generation's secret.** The coordinator draws a fresh secret for every
  generation (``secrets.token_hex(32)``) and sends it to each rank in its ``AllreduceHeader``
  (the coordinator-to-worker channel, mutual TLS when TLS is on); the daemon hands it to the
  child on its stdin, never in argv or the environment. :class:`SealedStore`, the only
  store the process group sees, derives from it (HMAC-SHA256, RFC 2104) a key that names and
  a key that seals: each key the group uses is stored as ``HMAC(name_key, key)`` and each
  value as AES-256-GCM of it under ``seal_key`` with the stored name as associated data
  (NIST SP 800-38D). A peer without the secret sees names it cannot invert and values it
  cannot read, and any value it writes, moves or replays from another generation fails
  authentication: the rank that reads it raises :class:`RendezvousTampered` and the
  generation ends (the coordinator opens the next one with a new secret) instead of taking
  a forged address. Counters (``add``) are sealed too, updated by compare-and-set.
  Prefixing the keys with a secret name alone would not do: ``list_keys`` shows every name.

What this leaves open (plain TCP): a peer that reaches the store's port can still fill
rank 0's memory with keys of its own or delete the group's keys (the generation then fails,
it does not take a forged value); one that can watch the traffic sees which sealed keys are
read; and gloo's own connections between ranks (tensors, gradients) are neither
authenticated nor encrypted, so a peer on the path, or one that reaches a rank's gloo port,
can read or disturb them. Run allreduce ranks on a network only they share.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import socket
import threading
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

NONCE_BYTES = 12  # AES-GCM's 96-bit nonce, drawn at random for every value
MIN_SECRET_HEX = 32  # a secret shorter than 128 bits is refused


class RendezvousTampered(RuntimeError):
    """A rendezvous value did not authenticate: written by someone without the secret."""


class SealedStore(Store):
    """A torch ``Store`` over another whose key names are HMACs and values are AES-GCM sealed.

    The process group is given this store directly: a ``PrefixStore`` around a Python store
    fails in torch 2.13 (``clone`` is not forwarded), and the hashed names make a prefix
    unneeded anyway (the generation is part of what is hashed).
    """

    def __init__(self, inner: Store, secret: str, generation: int) -> None:
        """Seal every key of ``inner`` with a key derived from ``secret``.

        Args:
            inner: the shared store (rank 0's ``TCPStore``, or a client of it).
            secret: the generation's secret, hex, at least ``MIN_SECRET_HEX`` digits.
            generation: the generation number, bound into every name.

        Raises:
            ValueError: the secret is too short or not hex.
        """
        super().__init__()
        if len(secret) < MIN_SECRET_HEX:
            raise ValueError(f"rendezvous_secret: at least {MIN_SECRET_HEX} hex digits needed")
        root = bytes.fromhex(secret)
        # Any: torch's stubs type values as str, but the store carries bytes (std::string)
        self._inner: Any = inner
        self._name_key = hmac.digest(root, b"neuroshard-rendezvous-names", "sha256")
        self._aead = AESGCM(hmac.digest(root, b"neuroshard-rendezvous-seal", "sha256"))
        self._generation = generation

    def name(self, key: str) -> str:
        """The name ``key`` is stored under: hex HMAC-SHA256 of (generation, key)."""
        msg = f"{self._generation}\0{key}".encode()
        return hmac.new(self._name_key, msg, hashlib.sha256).hexdigest()

    def _seal(self, name: str, value: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, value, name.encode())

    def _open(self, name: str, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], name.encode())
        except (InvalidTag, ValueError):
            raise RendezvousTampered(
                "a rendezvous key's value did not authenticate: someone without the "
                "generation's secret wrote to the store"
            ) from None

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` (sealed) under ``key``'s name."""
        name = self.name(key)
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(name, self._seal(name, data))

    def get(self, key: str) -> bytes:
        """Wait for ``key`` and return its value.

        Raises:
            RendezvousTampered: the stored value was not sealed with this secret.
        """
        name = self.name(key)
        return self._open(name, bytes(self._inner.get(name)))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (absent: 0) and return the new value.

        Raises:
            RendezvousTampered: the stored counter was not sealed with this secret.
        """
        name = self.name(key)
        current = b""
        while True:
            value = int(self._open(name, current)) if current else 0
            new = self._seal(name, str(value + amount).encode())
            got = bytes(self._inner.compare_set(name, current, new))
            if got == new:
                return value + amount
            current = got  # another rank got there first: add to its value

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (without waiting)."""
        return bool(self._inner.check([self.name(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key is set (up to ``timeout``, else the store's own)."""
        names = [self.name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it was set."""
        return bool(self._inner.delete_key(self.name(key)))

    def num_keys(self) -> int:
        """Keys in the shared store (everyone's: the count is not sealed)."""
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Set the inner store's wait timeout."""
        self._inner.set_timeout(timeout)

    def clone(self) -> SealedStore:
        """A store on its own connection, with the same secret (torch asks for one)."""
        twin = SealedStore.__new__(SealedStore)
        Store.__init__(twin)
        twin._inner = self._inner.clone()
        twin._name_key, twin._aead = self._name_key, self._aead
        twin._generation = self._generation
        return twin


def client_store(host: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """A client of rank 0's store at ``host:port`` that has answered, within ``timeout``.

    torch's ``TCPStore`` client retries its connect for ``timeout``, then pings the server
    and waits for the answer with no deadline at all (torch 2.13: a blocking ``recv`` in
    ``TCPStore::ping``). A store host that accepts the connection (the kernel does, from the
    listen backlog) but never answers, a stopped or wedged process, would hold this rank,
    and with it the generation, forever. So the client is made on a helper thread and given
    up on after ``timeout``; that thread stays in its ``recv`` until the host's socket closes
    (the host's worker kills it when the coordinator gives up on it).

    Args:
        host: rank 0's advertised host.
        port: its store's port.
        timeout: the generation's rendezvous deadline (``collective_timeout_s``).

    Raises:
        TimeoutError: the store did not answer within ``timeout``.
        RuntimeError: torch's own connect failed or timed out (``DistStoreError``).
    """
    made: list[TCPStore] = []
    failed: list[BaseException] = []

    def connect() -> None:
        try:
            made.append(TCPStore(host, port, None, False, timeout))
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=connect, name="store-client", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    if failed:
        raise failed[0]
    if not made:
        raise TimeoutError(
            f"rank 0's store at {host}:{port} did not answer within "
            f"{timeout.total_seconds():g} s (collective_timeout_s)"
        )
    return made[0]


def bound_listener(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (a port the kernel picks), for ``master_listen_fd``.

    Args:
        host: the worker's advertised host (a name resolves to its first address).

    Raises:
        OSError: the host is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    infos = socket.getaddrinfo(host.strip("[]"), 0, family, socket.SOCK_STREAM)
    sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
    try:
        sock.bind(infos[0][4])
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def gloo_interface(host: str) -> str:
    """The network interface that carries ``host``'s address (gloo listens on it).

    Args:
        host: the worker's advertised host.

    Raises:
        OSError: no interface of this machine has that address.
    """
    infos = socket.getaddrinfo(host.strip("[]"), 0, proto=socket.IPPROTO_TCP)
    wanted = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    for name, addresses in interface_addresses().items():
        if wanted & addresses:
            return name
    raise OSError(f"{host} is not an address of any interface of this machine")


def interface_addresses() -> dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Each interface's IPv4 (SIOCGIFADDR) and IPv6 (/proc/net/if_inet6) addresses (Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found: dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            found[name] = set()
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address on it
                continue
            found[name].add(ipaddress.IPv4Address(raw[20:24]))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        for line in inet6.read_text().splitlines():
            parts = line.split()
            found.setdefault(parts[-1], set()).add(ipaddress.IPv6Address(bytes.fromhex(parts[0])))
    return found
