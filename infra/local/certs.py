"""A throwaway certificate authority and server certificate for the local stack's TLS Redis.

Made with the `openssl` command line (no Python dependency): an EC P-256 CA and a server
certificate it signs, valid for 127.0.0.1 and localhost, with the extensions that strict X.509
checking (Python >= 3.13's default) asks for. Private keys are written readable by their owner
only. Clients trust the CA file, e.g. `rediss://...?ssl_ca_certs=<ca>&ssl_cert_reqs=required`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from diloco.storage.errors import DilocoError

_SERVER_EXT = """\
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer
"""


class CertError(DilocoError):
    """The certificates could not be made; the message carries what openssl said."""


@dataclass(frozen=True, slots=True)
class ServerCerts:
    ca: Path
    """The CA certificate that clients trust."""
    cert: Path
    """The server certificate, signed by the CA, for 127.0.0.1 and localhost."""
    key: Path
    """The server's private key (mode 0600)."""


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise CertError("no `openssl` on PATH to make the local CA: install it (Debian: apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise CertError(f"openssl {args[0]} failed ({done.returncode}): {done.stderr.strip()[-800:]}")


def ensure_server_certs(directory: Path, days: int = 3650) -> ServerCerts:
    """The CA and server certificate in `directory`, made on first use and reused afterwards (a
    restarted server keeps its certificate, so clients that trust the CA keep working)."""
    directory.mkdir(parents=True, exist_ok=True)
    certs = ServerCerts(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server.key")
    if all(p.exists() for p in (certs.ca, certs.cert, certs.key)):
        return certs
    (directory / "server.ext").write_text(_SERVER_EXT)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days),
             "-subj", "/CN=diloco local stack CA", "-config", "/dev/null",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", "subjectKeyIdentifier=hash",
             cwd=directory)
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
             "-config", "/dev/null", cwd=directory)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", str(days), "-extfile", "server.ext", cwd=directory)
    for key in (directory / "ca.key", certs.key):
        key.chmod(0o600)
    return certs
