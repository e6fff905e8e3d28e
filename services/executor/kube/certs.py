"""The admission webhook's serving certificate when cert-manager does not issue one: a self-signed CA that gpuq
creates, kept in a Secret, and replaced (CA and serving certificate together) before it expires.

Kept as a `kubernetes.io/tls` Secret: `tls.crt`, `tls.key` (the serving pair) and `ca.crt` (the CA the API server
must trust, written into the webhook configurations' `caBundle`). The CA's key is not kept: a new pair is made with
a new CA, and during a rotation the caBundle carries the old CA beside the new one, so that no request fails while
the API server and the webhook switch over."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_VALIDITY = dt.timedelta(days=365)
DEFAULT_RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class CertPair:
    cert_pem: bytes  # the serving certificate
    key_pem: bytes
    ca_pem: bytes  # the CA that signed it

    @property
    def not_after(self) -> dt.datetime:
        return x509.load_pem_x509_certificate(self.cert_pem).not_valid_after_utc

    def names(self) -> set[str]:
        """The DNS names and IP addresses the serving certificate is valid for."""
        ext = x509.load_pem_x509_certificate(self.cert_pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        return {*ext.get_values_for_type(x509.DNSName), *(str(a) for a in ext.get_values_for_type(x509.IPAddress))}

    def due(self, now: dt.datetime, renew_before: dt.timedelta, hosts: list[str]) -> bool:
        """Whether it must be replaced: it expires within `renew_before`, or does not name every host."""
        return self.not_after - renew_before <= now or not set(hosts) <= self.names()

    def secret_data(self) -> dict[str, str]:
        import base64

        return {key: base64.b64encode(value).decode() for key, value in
                (("tls.crt", self.cert_pem), ("tls.key", self.key_pem), ("ca.crt", self.ca_pem))}

    @staticmethod
    def from_secret(secret: dict[str, object]) -> CertPair | None:
        """The pair in a Secret, or None when it is incomplete or unreadable (then a new one is made)."""
        import base64

        data = secret.get("data") or {}
        if not isinstance(data, dict) or not all(k in data for k in ("tls.crt", "tls.key", "ca.crt")):
            return None
        try:
            pair = CertPair(*(base64.b64decode(str(data[k])) for k in ("tls.crt", "tls.key", "ca.crt")))
            pair.names()
            serialization.load_pem_private_key(pair.key_pem, password=None)
        except (ValueError, TypeError, x509.ExtensionNotFound):
            return None
        return pair


def service_hosts(service: str, namespace: str) -> list[str]:
    """The names the API server uses to reach a webhook Service."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def generate(hosts: list[str], now: dt.datetime, validity: dt.timedelta = DEFAULT_VALIDITY) -> CertPair:
    """A new CA and a serving certificate it signed for `hosts`, valid from a minute before `now`."""
    start, end = now - dt.timedelta(minutes=1), now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpuq webhook CA {now:%Y-%m-%dT%H:%M:%SZ}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return CertPair(cert.public_bytes(pem),
                    key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
                    ca.public_bytes(pem))
