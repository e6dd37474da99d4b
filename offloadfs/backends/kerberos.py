"""What the SMB and NFS backends share about Kerberos: whose credential cache a mount uses, and one line
for each way getting a ticket fails.

MIT Kerberos (through pyspnego or python-gssapi) says what went wrong in a
paragraph of major and minor codes; failure() makes one line of it that
tells the user what to do.
"""
import importlib.util
import pwd
import re

NO_TICKET = "no Kerberos ticket: run kinit (or give keytab= or cruid=)"
# Substrings of MIT Kerberos messages, and the line each failure gets.
FAILURES = (
    ("No Kerberos credentials available", NO_TICKET),
    ("No credentials cache found", NO_TICKET),
    ("Ticket expired", "the Kerberos ticket has expired: run kinit again"),
    ("Clock skew too great", "clock skew too great between this machine and the KDC: set the clock (NTP)"),
    ("not found in Kerberos database", "the server's name is unknown to the KDC: give the server by the name "
                                       "its service principal has"),
    ("No key table entry found", "the keytab holds no key for that principal"),
    ("Key table file", "the keytab cannot be read"),
    ("Preauthentication failed", "the KDC refused the key or password (wrong keytab or password)"),
    ("Cannot find KDC", "no KDC known for the realm: check krb5.conf (KRB5_CONFIG)"),
    ("Cannot contact any KDC", "no KDC of the realm answers"),
)
PACKAGES = "Kerberos needs the Python packages gssapi and krb5: pip install 'offloadfs[kerberos]'"


def available():
    """True if the Python packages Kerberos needs are installed."""
    return importlib.util.find_spec("gssapi") is not None and importlib.util.find_spec("krb5") is not None


def cache_of(cruid):
    """The credential cache of user ``cruid`` (a uid or a name): MIT's default file for that uid."""
    if cruid is True or not cruid:
        raise ValueError("cruid= needs a uid or a user name")
    try:
        uid = int(cruid) if cruid.isdigit() else pwd.getpwnam(cruid).pw_uid
    except KeyError:
        raise ValueError(f"cruid={cruid}: no such user") from None
    return f"FILE:/tmp/krb5cc_{uid}"


def typed(name):
    """A cache name as MIT wants it, TYPE:residual; a bare path is a FILE cache."""
    return name if re.match(r"^[A-Z_]+:", name) else f"FILE:{name}"


def failure(e):
    """One line for a failed Kerberos logon ``e`` (any exception whose text is MIT's), or None."""
    text = str(e)
    for needle, line in FAILURES:
        if needle in text:
            return line
    return None
