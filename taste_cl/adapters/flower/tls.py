"""Run-local credentials for a Flower deployment: a TLS CA and server certificate, SuperNode keys.

Flower 1.42 secures a deployment in two layers, both generated here with ``cryptography``
(nothing is fetched):

- **TLS** on the SuperLink's Fleet, Control and Runtime APIs: ``flower-superlink
  --ssl-ca-certfile CA --ssl-certfile CERT --ssl-keyfile KEY``; SuperNodes and the
  ``flwr`` CLI verify the server against the CA (``flower-supernode
  --root-certificates CA``, ``root-certificates`` in the SuperLink connection of
  ``config.toml``). :func:`write_certificates` makes a fresh CA that signs one server
  certificate whose subject alternative names are the given hosts (IP addresses or
  DNS names), so a SuperNode that does not hold this CA cannot complete the handshake.
- **SuperNode authentication**: ``flower-superlink --enable-supernode-auth`` accepts only
  SuperNodes whose public key was registered with ``flwr supernode register PUBLIC_KEY``
  (Control API); each SuperNode signs its requests with its private key
  (``flower-supernode --auth-supernode-private-key KEY``). :func:`write_node_key`
  writes such a pair: an EC key on NIST P-384 in OpenSSH format, as Flower reads it.

Private keys are written with mode 0600 and never leave the run folder.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> tls = write_certificates(folder, hosts=["127.0.0.1", "localhost"])
>>> tls.ca_cert.name, tls.server_cert.name, tls.server_key.name
('ca.crt', 'server.pem', 'server.key')
>>> write_node_key(folder, "node-0").public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
True
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

__all__ = ["NodeKey", "TlsFiles", "write_certificates", "write_node_key"]


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a run's CA certificate and the SuperLink's certificate and private key (PEM)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    """Paths of one SuperNode's authentication key pair (OpenSSH format)."""

    private_key: Path
    public_key: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file readable by its owner only."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _san(host: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _ca_usage() -> x509.KeyUsage:
    from cryptography import x509

    signing = {"key_cert_sign": True, "crl_sign": True}
    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement", "encipher_only", "decipher_only")
    return x509.KeyUsage(**dict.fromkeys(names, False), **signing)


def write_certificates(folder: str | Path, *, hosts: Sequence[str], days: int = 7) -> TlsFiles:
    """Write a fresh CA (``ca.crt``) and a SuperLink certificate it signs for ``hosts`` into ``folder``.

    ``hosts`` are the addresses SuperNodes and the CLI dial (``"127.0.0.1"``,
    ``"localhost"``, a LAN address or DNS name); each becomes a subject alternative
    name, which is what the TLS client checks. Keys are ECDSA P-256; the certificates
    are valid for ``days`` days from now. Raises ``ValueError`` on an empty ``hosts``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if isinstance(hosts, str) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ValueError(f"`hosts == {hosts!r}`, must be a non-empty sequence of host names or IP addresses")
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"`days == {days!r}`, must be an int >= 1")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "taste-cl fleet run CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_usage(), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_private(
        files.server_key,
        server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return files


def write_node_key(folder: str | Path, name: str) -> NodeKey:
    """Write a SuperNode authentication key pair ``<name>`` / ``<name>.pub`` (EC P-384, OpenSSH) into ``folder``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"`name == {name!r}`, must be a plain file name")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    pair = NodeKey(out / name, out / f"{name}.pub")
    _write_private(pair.private_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    pair.public_key.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return pair
