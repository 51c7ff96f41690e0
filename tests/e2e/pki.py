"""Test PKI for a real kube-apiserver, made with the `cryptography` package.

- a serving CA and a serving certificate (SANs localhost, 127.0.0.1, kubernetes.default...),
- a client CA and client certificates (admin: CN=admin, O=system:masters; more users on demand),
- a service-account signing key pair.

ECDSA P-256 keys: fast to generate, accepted by the apiserver for TLS and service-account tokens.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_ONE_DAY = dt.timedelta(days=1)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """What every certificate here shares: 30 days' validity, basic constraints, critical key usage (signing)."""
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + 30 * _ONE_DAY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )


@dataclass(frozen=True)
class CA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, cn: str) -> CA:
        key = _key()
        cert = (
            _builder(_name(cn), _name(cn), key, ca=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return _cert_pem(self.cert)

    def issue(
        self,
        cn: str,
        orgs: tuple[str, ...] = (),
        *,
        server: bool = False,
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> tuple[bytes, bytes]:
        """Return (cert PEM, key PEM) for a new leaf certificate signed by this CA."""
        key = _key()
        builder = (
            _builder(_name(cn, orgs), self.cert.subject, key, ca=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if dns or ips:
            sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return _cert_pem(cert), _key_pem(key)


@dataclass(frozen=True)
class ClusterPKI:
    """Files written into `dir`; paths are attributes."""

    dir: Path
    serving_ca: CA
    client_ca: CA

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def client_ca_crt(self) -> Path:
        return self.dir / "client-ca.crt"

    @property
    def serving_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    @classmethod
    def create(cls, directory: Path) -> ClusterPKI:
        directory.mkdir(parents=True, exist_ok=True)
        serving_ca = CA.create("deviceplane-test-ca")
        client_ca = CA.create("deviceplane-test-client-ca")
        pki = cls(directory, serving_ca, client_ca)
        _write(pki.ca_crt, serving_ca.cert_pem)
        _write(pki.client_ca_crt, client_ca.cert_pem)
        crt, key = serving_ca.issue(
            "kube-apiserver",
            server=True,
            dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            ips=("127.0.0.1", "10.0.0.1"),
        )
        _write(pki.serving_crt, crt)
        _write(pki.serving_key, key)
        sa = _key()
        _write(pki.sa_key, _key_pem(sa))
        _write(
            pki.sa_pub,
            sa.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo),
        )
        return pki

    def user_files(self, cn: str) -> tuple[Path, Path]:
        """(cert path, key path) of user `cn`'s client certificate (written by user())."""
        safe = _safe(cn)
        return self.dir / f"user-{safe}.crt", self.dir / f"user-{safe}.key"

    def user(self, cn: str, orgs: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """Mint a client certificate for user `cn` in groups `orgs`; return (cert path, key path)."""
        crt, key = self.client_ca.issue(cn, orgs)
        crt_path, key_path = self.user_files(cn)
        _write(crt_path, crt)
        _write(key_path, key)
        return crt_path, key_path

    def kubeconfig(self, server: str, cn: str, orgs: tuple[str, ...] = (), *, path: Path | None = None) -> Path:
        """Mint user `cn`'s client certificate (user()) and write a kubeconfig using it to talk to `server`; return
        the kubeconfig's path. The certificate files stay, for clients that need them (user_files())."""
        crt_path, key_path = self.user(cn, orgs)
        path = path or self.dir / f"{_safe(cn)}.kubeconfig"
        text = kubeconfig_text(
            server, self.serving_ca.cert_pem, crt_path.read_bytes(), key_path.read_bytes(), user=_safe(cn)
        )
        _write(path, text)
        return path


def kubeconfig_text(server: str, ca_pem: bytes, crt_pem: bytes, key_pem: bytes, *, user: str) -> str:
    def b64(b: bytes) -> str:
        return base64.b64encode(b).decode()

    return f"""apiVersion: v1
kind: Config
clusters:
- name: deviceplane-test
  cluster:
    server: {server}
    certificate-authority-data: {b64(ca_pem)}
users:
- name: {user}
  user:
    client-certificate-data: {b64(crt_pem)}
    client-key-data: {b64(key_pem)}
contexts:
- name: {user}@deviceplane-test
  context:
    cluster: deviceplane-test
    user: {user}
current-context: {user}@deviceplane-test
"""


def _safe(cn: str) -> str:
    return cn.replace(":", "_").replace("/", "_")


def _write(path: Path, data: bytes | str) -> None:
    if isinstance(data, str):
        data = data.encode()
    path.write_bytes(data)
    path.chmod(0o600)
