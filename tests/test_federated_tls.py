"""Run-local TLS certificates and SuperNode keys for the Flower deployment (taste_cl/adapters/flower/tls.py)."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store

from taste_cl.adapters.flower.tls import write_certificates, write_node_key


def _verify(ca: x509.Certificate, server: x509.Certificate, host: str) -> None:
    subject = x509.IPAddress(ipaddress.ip_address(host)) if host[0].isdigit() else x509.DNSName(host)
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(subject)
    verifier.verify(server, [])


def test_server_certificate_verifies_against_the_run_ca_only(tmp_path: Path) -> None:
    files = write_certificates(tmp_path, hosts=["127.0.0.1", "localhost"])
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    for host in ("127.0.0.1", "localhost"):
        _verify(ca, server, host)
    with pytest.raises(x509.verification.VerificationError):
        _verify(ca, server, "10.0.0.7")  # a name the certificate was not made for
    other = x509.load_pem_x509_certificate(write_certificates(tmp_path / "other", hosts=["127.0.0.1"]).ca_cert.read_bytes())
    with pytest.raises(x509.verification.VerificationError):
        _verify(other, server, "127.0.0.1")  # another run's CA does not vouch for it
    key = serialization.load_pem_private_key(files.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()  # type: ignore[union-attr]
    assert stat.S_IMODE(files.server_key.stat().st_mode) == 0o600


def test_node_key_is_what_flower_reads(tmp_path: Path) -> None:
    pytest.importorskip("flwr")
    from flwr.cli.supernode.register import try_load_public_key

    pair = write_node_key(tmp_path, "node-0")
    private = serialization.load_ssh_private_key(pair.private_key.read_bytes(), None)  # as flower-supernode loads it
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert try_load_public_key(pair.public_key)  # as `flwr supernode register` loads it
    assert stat.S_IMODE(pair.private_key.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("hosts", "days", "match"),
    [([], 7, "`hosts == \\[\\]`"), ("127.0.0.1", 7, "non-empty sequence"), (["127.0.0.1"], 0, "`days == 0`")],
)
def test_bad_certificate_arguments(tmp_path: Path, hosts: object, days: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_certificates(tmp_path, hosts=hosts, days=days)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_bad_key_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be a plain file name"):
        write_node_key(tmp_path, "../escape")
