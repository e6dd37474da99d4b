"""How a mount logs on: NTLM with a password, or Kerberos from a credential cache, a keytab or a password.

``sec=krb5`` and ``sec=ntlmssp`` choose, as with mount.cifs; without sec=,
the credentials given choose: keytab=, cruid=, or no password but a
KRB5CCNAME in the environment mean Kerberos, else NTLM with the password (as
mount.cifs, whose default is NTLM).  The cache is the
one KRB5CCNAME names in the mounting process, the library's default, or with
``cruid=`` that uid's, looked up at each logon and renewal where cifs.upcall
looks (kerberos.user_cache: it must be theirs, and the daemon logs on from a
copy in its memory); ``keytab=`` logs on as the principal in username= with its
key, for mounts at boot, with nobody there to kinit.  smbprotocol derives
the signing and sealing keys from the Kerberos session key, as from NTLM's.

A Kerberos session ends when its ticket does: the server then fails requests
with STATUS_NETWORK_SESSION_EXPIRED, unprocessed.  reauthenticate() sets the
same session up again with a fresh ticket (MS-SMB2 3.2.4.2.3, re-authentication),
keeping its keys, handles and leases, so that the requests are just sent again.

backends/kerberos.py makes one line of each way logging on fails.
"""
import os

import spnego
from smbprotocol.exceptions import MoreProcessingRequired
from smbprotocol.session import SMB2SessionSetupRequest, SMB2SessionSetupResponse

from .. import kerberos

SECURITY = {"krb5": "krb5", "krb5i": "krb5", "ntlmssp": "ntlmssp", "ntlmsspi": "ntlmssp"}

def choose(options, user, domain, password, environ):
    """(sec, credential cache, keytab, cruid uid) from the mount options; ValueError says what does not fit."""
    sec = options.get("sec")
    if sec is True:
        raise ValueError("sec= needs a value")
    if sec is not None and sec not in SECURITY:
        raise ValueError(f"sec={sec}: choose one of {', '.join(SECURITY)}")
    keytab = options.get("keytab")
    if keytab is True:
        raise ValueError("keytab= needs a value")
    if not sec:
        wants_kerberos = keytab or "cruid" in options or (password is None and "KRB5CCNAME" in environ)
        sec = "krb5" if wants_kerberos else "ntlmssp"
    sec = SECURITY[sec]
    if sec == "ntlmssp":
        if keytab or "cruid" in options:
            raise ValueError("keytab= and cruid= are for Kerberos, not sec=ntlmssp")
        if password is None:
            raise ValueError("no password: give -o credentials=FILE or set PASSWD in the environment "
                             "(or log on with Kerberos: -o sec=krb5)")
        return sec, None, None, None
    if not kerberos.available():
        raise ValueError(kerberos.PACKAGES)
    if keytab and "cruid" in options:
        raise ValueError("keytab= and cruid= both name credentials: give one")
    if keytab:
        if not os.access(keytab, os.R_OK):
            raise ValueError(f"keytab={keytab}: not readable")
        return sec, None, os.path.abspath(keytab), None
    if "cruid" in options:
        return sec, None, None, kerberos.cruid_of(options["cruid"])
    name = environ.get("KRB5CCNAME")
    return sec, (kerberos.typed(name) if name else None), None, None


def principal(target):
    """user@REALM from username= and domain=, or the user name as given if it has its realm."""
    user = target.username
    return f"{user}@{target.domain.upper()}" if user and "@" not in user and target.domain else user


def credential(target):
    """(username, password, protocol) for spnego.client and smbprotocol's Session."""
    if target.sec == "ntlmssp":
        user = f"{target.domain}\\{target.username}" if target.domain else target.username
        return user, target.password, "ntlm"
    if target.keytab:
        return spnego.KerberosKeytab(keytab=target.keytab, principal=principal(target)), None, "kerberos"
    if target.password is not None:
        return principal(target), target.password, "kerberos"
    if target.ccache:
        return spnego.KerberosCCache(ccache=target.ccache, principal=principal(target) or None), None, "kerberos"
    return principal(target) or None, None, "kerberos"


def who(target):
    """The identity a log line names."""
    if target.sec == "ntlmssp":
        return f"{target.domain}\\{target.username}" if target.domain else target.username
    if principal(target):
        return principal(target)
    if target.cruid is not None:
        return f"the principal of uid {target.cruid}'s credential cache"
    return f"the principal of {target.ccache or 'the default credential cache'}"


def reauthenticate(conn, session, target, hostname):
    """Set ``session`` up again with fresh credentials; blocking.  Its keys stay those of the first logon
    (MS-SMB2 3.3.5.5.3: re-authentication derives none), so nothing of smbprotocol's Session is redone."""
    user, password, protocol = credential(target)
    context = spnego.client(user, password, service="cifs", hostname=hostname,
                            options=spnego.NegotiateOptions.session_key, protocol=protocol)
    token = None
    while not context.complete:
        token = context.step(token)
        if not token:
            break
        setup = SMB2SessionSetupRequest()
        setup["security_mode"] = conn.client_security_mode
        setup["buffer"] = token
        request = conn.send(setup, sid=session.session_id, credit_request=64)
        try:
            response = conn.receive(request)
        except MoreProcessingRequired as more:
            response = more.header
        conn.preauth_integrity_session_hash_value.pop(request.message["message_id"].get_value(), None)
        reply = SMB2SessionSetupResponse()
        reply.unpack(response["data"].get_value())
        token = reply["buffer"].get_value()
