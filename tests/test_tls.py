"""amqps:// against a private node with a TLS listener, certificates made by the test.

The node (``amqplockstls``, beside the shared test node) gets a CA and a server certificate
for 127.0.0.1 from ``openssl``, and a TLS listener configured through devbroker's
``extra.conf``. The TCP listener stays (devbroker checks liveness there).
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from amqp_locks import Broker, BrokerUnreachable, ConfigurationError, Mutex, TokenSemaphore
from amqp_locks_dev import devbroker

from . import nodes

TLS_NODE = nodes.node_name("amqplockstls")


@dataclass(frozen=True)
class TlsNode:
    info: devbroker.NodeInfo
    port: int
    ca: Path

    def url(self, query: str = "") -> str:
        return f"amqps://guest:guest@127.0.0.1:{self.port}/{query}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certificates(d: Path) -> None:
    """A CA and a server certificate (127.0.0.1, localhost) it signed, with the extensions
    Python's strict verification asks for."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "3650",
        "-subj", "/CN=amqp-locks test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
        cwd=d,
    )  # fmt: skip
    (d / "server.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "authorityKeyIdentifier=keyid,issuer\n"
        "subjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "3650", "-extfile", "server.ext",
        cwd=d,
    )  # fmt: skip
    for f in d.iterdir():  # the node runs as the rabbitmq user
        f.chmod(0o644)
    d.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tls_port(extra: Path) -> int | None:
    try:
        for line in extra.read_text().splitlines():
            if line.startswith("listeners.ssl.1"):
                return int(line.rsplit(":", 1)[1])
    except FileNotFoundError:
        pass
    return None


@pytest.fixture(scope="module")
def tls_node() -> Iterator[TlsNode]:
    home = nodes.test_home()
    base = home / TLS_NODE if home else None
    d = devbroker.node_dir(TLS_NODE, base)
    certs = d / "tls"
    extra = d / devbroker.EXTRA_CONFIG
    running = devbroker.status(TLS_NODE, base)
    port = _tls_port(extra) if running else None
    if port is None or not (certs / "ca.pem").exists():
        if running:
            devbroker.stop(TLS_NODE, base)
        d.mkdir(parents=True, exist_ok=True)
        _make_certificates(certs)
        port = _free_port()
        extra.write_text(
            f"listeners.ssl.1 = 127.0.0.1:{port}\n"
            f"ssl_options.cacertfile = {certs / 'ca.pem'}\n"
            f"ssl_options.certfile = {certs / 'server.pem'}\n"
            f"ssl_options.keyfile = {certs / 'server.key'}\n"
            "ssl_options.verify = verify_none\n"
            "ssl_options.fail_if_no_peer_cert = false\n"
        )
    info = devbroker.start(TLS_NODE, base)
    yield TlsNode(info, port, certs / "ca.pem")
    if os.environ.get("CI") and os.environ.get("AMQP_LOCKS_KEEP_BROKER") != "1":
        devbroker.stop(TLS_NODE, base)


def _ssl_of_connection(node: TlsNode, connection_name: str) -> str:
    """What the broker says about the connection named `connection_name`: "true" if TLS."""
    out = devbroker.rabbitmqctl(
        node.info, "-q", "list_connections", "--no-table-headers", "ssl", "client_properties"
    )
    rows = [line.split("\t") for line in out.splitlines() if line.strip()]
    found = [r[0].strip() for r in rows if f'"{connection_name}"' in r[-1]]
    assert len(found) == 1, out
    return found[0]


def test_amqps_with_the_ca_in_the_url(tls_node: TlsNode) -> None:
    conn = f"tls-url-{uuid.uuid4().hex[:8]}"
    with Broker(tls_node.url(f"?cafile={tls_node.ca}"), connection_name=conn) as broker:
        lock = Mutex(broker, f"tls-{uuid.uuid4().hex[:8]}")
        with lock.acquire(timeout=10) as lease:
            assert lease is not None and lease.fencing_token >= 1
            assert _ssl_of_connection(tls_node, conn) == "true"
        assert lock.acquire(blocking=False) is not None


def test_amqps_with_an_ssl_context(tls_node: TlsNode) -> None:
    ctx = ssl.create_default_context(cafile=str(tls_node.ca))
    conn = f"tls-ctx-{uuid.uuid4().hex[:8]}"
    with Broker(tls_node.url(), connection_name=conn, ssl_context=ctx) as broker:
        sem = TokenSemaphore(broker, f"tls-{uuid.uuid4().hex[:8]}")
        sem.setup(1)
        with sem.acquire(timeout=10) as permit:
            assert permit is not None
            assert sem.acquire(blocking=False) is None
            assert _ssl_of_connection(tls_node, conn) == "true"
        sem.destroy()


def test_an_untrusted_certificate_is_a_typed_error_naming_it(tls_node: TlsNode) -> None:
    with (
        Broker(tls_node.url(), connect_timeout=10) as broker,
        pytest.raises(BrokerUnreachable) as err,
    ):
        broker.connect()
    text = str(err.value)
    assert "certificate" in text and "cafile" in text, text
    assert "guest:guest" not in text


def test_plain_amqp_against_the_tls_listener_fails_fast(tls_node: TlsNode) -> None:
    url = f"amqp://guest:guest@127.0.0.1:{tls_node.port}/"
    with Broker(url, connect_timeout=10) as b, pytest.raises(BrokerUnreachable):
        b.connect()


def test_an_ssl_context_with_a_plain_url_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="amqps"):
        Broker("amqp://guest:guest@127.0.0.1:5672/", ssl_context=ssl.create_default_context())
