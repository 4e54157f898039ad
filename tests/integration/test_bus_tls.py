"""TLS on the bus, end to end: a CA, a server certificate and client certificates made here, a real nats-server.

`rlbus bus up --tls-cert --tls-key [--tls-ca]` serves TLS (mutual TLS with --tls-ca); roles connect with
`bus.tls_ca` (and `bus.tls_cert` / `bus.tls_key`). A client that does not speak TLS, does not trust the server's CA,
or has no certificate the server's CA signed is refused.

    .venv/bin/python -m pytest -q tests/integration/test_bus_tls.py
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from rlbus.bus.client import Bus
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.config import BusConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import StepCompleted


def _key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return key


def _cert(path: Path, subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False,
          ip: str | None = None, client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ip is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                        critical=False)
    if not ca:
        usage = x509.ExtendedKeyUsageOID.CLIENT_AUTH if client else x509.ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert


def _authority(d: Path, name: str) -> tuple[Path, x509.Name, ec.EllipticCurvePrivateKey]:
    key = _key(d / f"{name}.key")
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    _cert(d / f"{name}.pem", name, key, subject, key, ca=True)
    return d / f"{name}.pem", subject, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_name, ca_key = _authority(d, "rlbus-test-ca")
    other_ca, other_name, other_key = _authority(d, "someone-else-ca")
    _cert(d / "server.pem", "nats", _key(d / "server.key"), ca_name, ca_key, ip="127.0.0.1")
    _cert(d / "client.pem", "trainer", _key(d / "client.key"), ca_name, ca_key, client=True)
    _cert(d / "rogue.pem", "rogue", _key(d / "rogue.key"), other_name, other_key, client=True)
    return {"ca": str(ca), "other_ca": str(other_ca), **{f"{n}_{k}": str(d / f"{n}.{ext}")
            for n in ("server", "client", "rogue") for k, ext in (("cert", "pem"), ("key", "key"))}}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, str]) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(tmp_path_factory.mktemp("tls") / "bus", runs=["tlsrun"], tls_cert=pki["server_cert"],
                         tls_key=pki["server_key"], tls_ca=pki["ca"]).start()
    try:
        yield srv
    finally:
        srv.stop()


def _cfg(srv: EmbeddedServer, **tls: str) -> BusConfig:
    return BusConfig(url=srv.url, creds_file=str(srv.creds_file("trainer")), connect_timeout_s=3.0, **tls)


async def test_mutual_tls_round_trip(tls_server: EmbeddedServer, pki: dict[str, str]) -> None:
    assert tls_server.url.startswith("tls://127.0.0.1:")
    cfg = _cfg(tls_server, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
    async with await Bus.connect(cfg, "tlsrun", name="trainer") as bus:
        await bus.ensure_streams()
        await bus.publish_event(StepCompleted(step=1, version=1, group_ids=["g"]))
        (step,) = await bus.snapshot(bus.subjects.event("step"), StepCompleted)
        assert step.group_ids == ["g"]
        assert bus.nc.connected_url.scheme == "tls"


@pytest.mark.parametrize("case", ["plaintext", "untrusted server", "no client certificate", "foreign client cert"])
async def test_clients_without_the_right_tls_are_refused(tls_server: EmbeddedServer, pki: dict[str, str],
                                                         case: str) -> None:
    tls = {
        "plaintext": {},  # a nats:// client to a TLS-only server
        "untrusted server": {"tls_ca": pki["other_ca"], "tls_cert": pki["client_cert"], "tls_key": pki["client_key"]},
        "no client certificate": {"tls_ca": pki["ca"]},
        "foreign client cert": {"tls_ca": pki["ca"], "tls_cert": pki["rogue_cert"], "tls_key": pki["rogue_key"]},
    }[case]
    url = tls_server.url.replace("tls://", "nats://") if case == "plaintext" else tls_server.url
    cfg = BusConfig(url=url, creds_file=str(tls_server.creds_file("trainer")), connect_timeout_s=3.0, **tls)
    with pytest.raises(BusError):
        bus = await Bus.connect(cfg, "tlsrun", name=case)
        await bus.close()


def test_a_certificate_without_its_key_is_refused_at_start(tmp_path: Path, pki: dict[str, str]) -> None:
    with pytest.raises(BusError, match="both a certificate and its key"):
        EmbeddedServer(tmp_path / "bus", tls_cert=pki["server_cert"])
