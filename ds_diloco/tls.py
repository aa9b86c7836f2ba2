"""TLS between islands and the coordinator: the server's and the clients' contexts.

Islands in other datacenters reach the coordinator over networks the run does not own;
in clear text, anyone on the path reads the bearer token (and can then upload) and the
model. The coordinator serves TLS itself with ``tls_cert``/``tls_key`` (PEM files), and
clients check its certificate against the system's CAs, or against the PEM bundle an
island names in ``coordinator_ca`` (or ``$DS_DILOCO_CA_FILE``): a self-signed
certificate is trusted by listing it there. Any certificate of that bundle is a trust
anchor (``VERIFY_X509_PARTIAL_CHAIN``), so the coordinator's own certificate is enough
even when a private CA issued it. A self-signed one for a coordinator at 10.0.0.1::

    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=ds-diloco \\
        -addext subjectAltName=IP:10.0.0.1 -keyout coord.key -out coord.pem
"""

from __future__ import annotations

import ipaddress
import math
import os
import ssl
import time

CA_FILE_ENV = "DS_DILOCO_CA_FILE"
"""A PEM bundle that clients trust for the coordinator's certificate when none is given."""


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """The coordinator's TLS context; a ValueError naming the file that is wrong."""
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if not os.path.isfile(path):
            raise ValueError(f"{name} {path!r} does not exist")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)

    def encrypted():  # else OpenSSL asks for its pass phrase on the terminal, and waits
        raise ValueError(f"tls_key {key!r} is encrypted: give it unencrypted (openssl pkey)")

    try:
        ctx.load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as e:
        raise ValueError(
            f"tls_cert {cert!r} and tls_key {key!r} are not a PEM certificate and its "
            f"private key: {e.reason or e}"
        ) from None
    # Every client refuses an expired certificate, or one not valid yet: the coordinator
    # served it, and each island failed its handshake. (The standard library's one reader
    # of its dates is private: where it is gone, the handshakes say it.)
    try:
        dates = ssl._ssl._test_decode_cert(cert)
        starts, expires = (ssl.cert_time_to_seconds(dates[k]) for k in ("notBefore", "notAfter"))
    except (AttributeError, KeyError, ValueError, ssl.SSLError):
        starts, expires = -math.inf, math.inf
    if expires < time.time():
        raise ValueError(
            f"tls_cert {cert!r} expired on {time.strftime('%Y-%m-%d', time.gmtime(expires))}: "
            "clients refuse it; give it a new certificate"
        )
    if starts > time.time():
        raise ValueError(
            f"tls_cert {cert!r} is not valid before "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(starts))}: clients refuse it "
            "until then; give it a certificate valid now (or check this machine's clock)"
        )
    return ctx


def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A client's context: the system's CAs, or only ``ca_file`` (else $DS_DILOCO_CA_FILE)."""
    # One from the environment is named as such: set long ago, the user gave no file.
    what = (
        f"CA file {ca_file!r}"
        if ca_file
        else f"CA file {os.environ.get(CA_FILE_ENV)!r} (${CA_FILE_ENV})"
    )
    ca_file = ca_file or os.environ.get(CA_FILE_ENV) or None
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ValueError(f"{what} (the coordinator's certificate) does not exist")
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as e:
        raise ValueError(f"{what} holds no PEM certificate: {e.reason or e}") from None
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


_NOT_FOR_THIS_HOST = (62, 64)  # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
_OUT_OF_DATE = (9, 10)  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED


def explain(error: ssl.SSLError, url: str) -> str:
    """What a failed TLS handshake with the coordinator at ``url`` means, and what to do."""
    if isinstance(error, ssl.SSLCertVerificationError):
        # A trusted certificate for another host, or out of date, is refused the same
        # whatever the client trusts: trusting it again (the advice for the rest) fixes
        # nothing.
        if error.verify_code in _NOT_FOR_THIS_HOST:
            fix = (
                "reach the coordinator by a name or IP address its certificate's "
                "subjectAltName lists, or give it a certificate for this one"
            )
        elif error.verify_code in _OUT_OF_DATE:
            fix = "give the coordinator a new certificate (or check this machine's clock)"
        else:
            fix = (
                f"trust it with the island's coordinator_ca or ${CA_FILE_ENV} (a PEM file "
                "holding it or its CA)"
            )
        return (
            f"TLS with the coordinator at {url}: its certificate was refused "
            f"({error.verify_message}); {fix}"
        )
    if error.reason == "WRONG_VERSION_NUMBER":
        return f"the coordinator at {url} does not speak TLS: use http:// (or give it tls_cert)"
    return f"TLS with the coordinator at {url} failed: {error.reason or error}"


def clear_text_warning(host: str, tls: bool) -> str | None:
    """Why a coordinator bound to ``host`` without TLS is readable by others, or None."""
    if tls:
        return None
    try:
        if ipaddress.ip_address(host or "0.0.0.0").is_loopback:
            return None
    except ValueError:  # a host name
        if host == "localhost":
            return None
    return (
        f"the coordinator listens on {host or '0.0.0.0'} without TLS: the bearer token and "
        "the model cross the network in clear text (set tls_cert and tls_key, or keep it "
        "on a network you own)"
    )
