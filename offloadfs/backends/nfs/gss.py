"""RPCSEC_GSS version 1 (RFC 2203) with Kerberos V5: sec=krb5, krb5i and krb5p.

A context is set up with NULL calls carrying the GSS tokens (INIT, then
CONTINUE_INIT while the mechanism asks for more); the server names it by a
handle and says how many calls it keeps track of (the sequence window).
Every call then carries the handle and a sequence number in its credential,
and as verifier a MIC over the RPC header; the reply's verifier is a MIC of
that sequence number, so a reply that does not verify is an error, never
data.  krb5i sends arguments and results as rpc_gss_integ_data (the
sequence number and the body, then a MIC over both), krb5p as
rpc_gss_priv_data (both wrapped, encrypted).

The server drops calls whose sequence number has fallen out of its window:
no more calls than the window are in flight on one context.  A context the
server no longer knows (it expired, or the server restarted) is refused with
RPCSEC_GSS_CREDPROBLEM or CTXPROBLEM: a new one is set up and the call sent
again, which is safe because a refused call never ran.

One context per user: root (and the client's own housekeeping) uses the
mount's credentials (the cache or keytab given at mount), any other uid its
own cache, found where the system put it as rpc.gssd finds it
(kerberos.user_cache); a uid without one gets EACCES.
"""
import contextlib
import errno
import logging

import trio

from .. import kerberos
from . import rpc
from .xdr import Packer, ProtocolError, Unpacker

log = logging.getLogger(__name__)

RPCSEC_GSS = 6
RPCSEC_GSS_VERSION = 1
DATA, INIT, CONTINUE_INIT, DESTROY = range(4)
SVC_NONE, SVC_INTEGRITY, SVC_PRIVACY = 1, 2, 3
SERVICES = {"krb5": SVC_NONE, "krb5i": SVC_INTEGRITY, "krb5p": SVC_PRIVACY}
# auth_stat values (RFC 2203 section 5.3.3.3): the context is gone, set up another.
CREDPROBLEM, CTXPROBLEM = 13, 14
GSS_S_COMPLETE, GSS_S_CONTINUE_NEEDED = 0, 1
MAXSEQ = 0x80000000  # RFC 2203 5.3.3.1: a context must not go past this sequence number
KRB5_OID = bytes.fromhex("2a864886f712010202")  # 1.2.840.113554.1.2.2, as SECINFO carries it
MAX_TOKEN = 64 << 10
EXPIRY_MARGIN = 1.0  # seconds before its ticket ends that a context is replaced
NFS_PROGRAM, NFS_V4, NFS_NULL = 100003, 4, 0


class Refused(Exception):
    """The server or the KDC would not set a context up; the message is one line for the user."""


class Expired(Exception):
    """Our side of the context has expired (its ticket has): set up another and send again."""


# -- the wire (pure functions: tests check them against RFC 2203's layouts) ----------------------------


def credential(proc, seq, service, handle):
    """rpc_gss_cred_t, version 1: (flavor, body)."""
    p = Packer()
    for v in (RPCSEC_GSS_VERSION, proc, seq, service):
        p.u32(v)
    p.opaque(handle)
    return RPCSEC_GSS, p.bytes()


def seq_bytes(seq):
    p = Packer()
    p.u32(seq)
    return p.bytes()


def integ_data(seq, body, get_mic):
    """rpc_gss_integ_data: databody_integ (seq, body) and a MIC over it."""
    databody = seq_bytes(seq) + body
    p = Packer()
    p.opaque(databody)
    p.opaque(get_mic(databody))
    return p.bytes()


def priv_data(seq, body, wrap):
    """rpc_gss_priv_data: databody_priv (seq, body), wrapped."""
    p = Packer()
    p.opaque(wrap(seq_bytes(seq) + body))
    return p.bytes()


def _body_of(seq, databody):
    u = Unpacker(databody)
    got = u.u32()
    if got != seq:
        raise ProtocolError(f"RPCSEC_GSS reply for sequence number {got}, not {seq}")
    return Unpacker(databody, u.pos)


def open_integ(seq, u, verify_mic, limit):
    """The results inside rpc_gss_integ_data ``u``, once its MIC and sequence number check out."""
    databody = u.opaque(limit, "databody_integ")
    mic = u.opaque(MAX_TOKEN, "checksum")
    verify_mic(databody, mic)
    return _body_of(seq, databody)


def open_priv(seq, u, unwrap, limit):
    """The results inside rpc_gss_priv_data ``u``, unwrapped."""
    return _body_of(seq, unwrap(u.opaque(limit, "databody_priv")))


def init_result(u):
    """rpc_gss_init_res: (handle, major, minor, window, token)."""
    handle = u.opaque(MAX_TOKEN, "context handle")
    major, minor, window = u.u32(), u.u32(), u.u32()
    return handle, major, minor, window, u.opaque(MAX_TOKEN, "GSS token")


class Window:
    """The sequence numbers of one context and the calls in flight on it: never more than the server's
    window, so that none falls out of it."""

    def __init__(self, size):
        self.size = max(1, size)
        self.next = 1
        self._in_flight = trio.Semaphore(self.size)

    async def __aenter__(self):
        await self._in_flight.acquire()
        seq, self.next = self.next, self.next + 1
        return seq

    async def __aexit__(self, *exc):
        self._in_flight.release()

    @property
    def spent(self):
        return self.next >= MAXSEQ


# -- contexts ------------------------------------------------------------------------------------------


class Context:
    """One established RPCSEC_GSS context: its handle, window and GSS security context."""

    def __init__(self, service, handle, window, gss_context):
        self.service = service
        self.handle = handle
        self.window = Window(window)
        self.gss = gss_context
        self.dead = False
        # Its ticket's end: the server refuses the context from then on, and the library too.
        self.expires = trio.current_time() + (gss_context.lifetime or 0)

    @property
    def usable(self):
        return not self.dead and not self.window.spent and trio.current_time() < self.expires - EXPIRY_MARGIN

    @contextlib.contextmanager
    def _mechanism(self, refusal=None):
        """Around a GSS call: an expired context is Expired; with ``refusal`` (what a reply that fails
        the check is) any other GSS failure is the server's ProtocolError."""
        import gssapi.exceptions

        try:
            yield
        except gssapi.exceptions.ExpiredContextError:
            self.dead = True
            raise Expired() from None
        except gssapi.exceptions.GSSError as e:
            if refusal is None:
                raise
            raise ProtocolError(f"RPCSEC_GSS {refusal}: {e.gen_message()}") from None

    def _mic(self, data):
        with self._mechanism():
            return self.gss.get_signature(data)

    def _wrap(self, data):
        with self._mechanism():
            return self.gss.encrypt(data)

    def _verify(self, data, mic):
        with self._mechanism("checksum does not verify"):
            self.gss.verify_signature(data, mic)

    def _unwrap(self, data):
        with self._mechanism("reply does not unwrap"):
            return self.gss.decrypt(data)

    async def call(self, conn, prog, vers, proc, args):
        async with self.window as seq:
            if self.service == SVC_INTEGRITY:
                args = integ_data(seq, args, self._mic)
            elif self.service == SVC_PRIVACY:
                args = priv_data(seq, args, self._wrap)
            u, verifier = await conn.call_verified(prog, vers, proc, credential(DATA, seq, self.service, self.handle),
                                                   args, self._mic)
        flavor, mic = verifier
        if flavor != RPCSEC_GSS:
            raise ProtocolError(f"RPCSEC_GSS reply with a verifier of flavor {flavor}")
        self._verify(seq_bytes(seq), mic)
        if self.service == SVC_INTEGRITY:
            return open_integ(seq, u, self._verify, conn.max_record)
        if self.service == SVC_PRIVACY:
            return open_priv(seq, u, self._unwrap, conn.max_record)
        return u

    async def destroy(self, conn):
        """RPCSEC_GSS_DESTROY: the server may drop the context now rather than at its ticket's end.  Neither
        the call nor the reply is wrapped (as the Linux client and server have it: RFC 2203 is unclear)."""
        self.dead = True
        async with self.window as seq:
            await conn.call_verified(NFS_PROGRAM, NFS_V4, NFS_NULL, credential(DESTROY, seq, self.service, self.handle),
                                     b"", self._mic)


async def establish(conn, service, target, creds):
    """Set a context up for ``creds`` (gssapi.Credentials) with host-based service ``target`` (nfs@HOST)."""
    import gssapi

    flags = (gssapi.RequirementFlag.mutual_authentication | gssapi.RequirementFlag.integrity
             | gssapi.RequirementFlag.confidentiality)
    name = gssapi.Name(target, gssapi.NameType.hostbased_service)
    gss = gssapi.SecurityContext(name=name, creds=creds, flags=flags, mech=gssapi.MechType.kerberos,
                                 usage="initiate")
    token = await _step(gss, None)  # asks the KDC for a service ticket: off the event loop
    handle = b""
    while True:
        p = Packer()
        p.opaque(token)
        cred = credential(CONTINUE_INIT if handle else INIT, 0, service, handle)
        u, verifier = await conn.call_verified(NFS_PROGRAM, NFS_V4, NFS_NULL, cred, p.bytes())
        handle, major, minor, window, token = init_result(u)
        if major not in (GSS_S_COMPLETE, GSS_S_CONTINUE_NEEDED):
            raise Refused(f"the NFS server refused the Kerberos context (GSS major {major:#x}, minor {minor})")
        if token:
            token = await _step(gss, token)
        if major == GSS_S_COMPLETE and gss.complete:
            break
        if not token:
            raise Refused("the Kerberos context did not complete")
    context = Context(service, handle, window, gss)
    if verifier[0] != RPCSEC_GSS:
        raise ProtocolError("RPCSEC_GSS context set up without a verifier")
    context._verify(seq_bytes(window), verifier[1])
    return context


async def _step(gss, token):
    import gssapi.exceptions

    try:
        return await trio.to_thread.run_sync(gss.step, token) or b""
    except gssapi.exceptions.GSSError as e:
        raise Refused(kerberos.failure(e) or f"Kerberos: {e.gen_message()}") from None


class Security:
    """The contexts of one NFS client: one per uid, set up on first use and again when the server
    forgets one."""

    def __init__(self, sec, host, ccache=None, keytab=None, cruid=None):
        self.service = SERVICES[sec]
        self.target = f"nfs@{host}"
        self.ccache, self.keytab, self.cruid = ccache, keytab, cruid
        self.contexts = {}  # uid -> Context
        self._setting_up = {}  # uid -> trio.Lock

    def credentials(self, uid):
        """(gssapi.Credentials of ``uid``, the kerberos.UserCache they come from or None): the mount's for
        root, else those in the user's own cache (its copy is not needed once a context is set up); the
        mount's with cruid= are in that uid's, looked up as a user's."""
        import gssapi
        import gssapi.exceptions

        cache, store = None, {}
        owner = uid if uid != 0 else self.cruid
        if owner is not None:
            try:
                cache = kerberos.user_cache(owner)
            except kerberos.NoCache as e:
                raise Refused(f"uid {uid}: {e}" if uid != 0 else f"cruid={owner}: {e}") from None
            store["ccache"] = cache.ccache
        elif self.keytab:
            # The keytab's first principal; its tickets stay in the daemon's memory.
            store["client_keytab"] = self.keytab
            store["ccache"] = f"MEMORY:offloadfs-nfs-{id(self)}"
        elif self.ccache:
            store["ccache"] = self.ccache
        try:
            return gssapi.Credentials(usage="initiate", store=store or None), cache
        except gssapi.exceptions.GSSError as e:
            if cache is not None:
                cache.__exit__()
            raise Refused(kerberos.failure(e) or f"Kerberos: {e.gen_message()}") from None

    async def context(self, conn, uid):
        context = self.contexts.get(uid)
        if context is not None and context.usable:
            return context
        lock = self._setting_up.setdefault(uid, trio.Lock())
        async with lock:
            context = self.contexts.get(uid)
            if context is None or not context.usable:
                if context is not None and not context.dead:  # a dead one was logged as it died
                    log.info("RPCSEC_GSS context of uid %d ended: setting up another", uid)
                creds, cache = await trio.to_thread.run_sync(self.credentials, uid)
                with cache or contextlib.nullcontext():
                    context = self.contexts[uid] = await establish(conn, self.service, self.target, creds)
                if cache is not None:
                    log.info("uid %d: RPCSEC_GSS context as %s from %s", uid, cache.principal, cache.found)
            return context

    async def destroy_all(self, conn):
        """Destroy every context that may still be in use (at unmount; best effort)."""
        for context in list(self.contexts.values()):
            if context.usable:
                await context.destroy(conn)
        self.contexts.clear()

    def for_user(self, uid):
        """The credential Connection.call takes for requests acting for ``uid``."""
        return UserCredential(self, uid)


class UserCredential:
    """What session and backend pass as ``cred``: the uid whose context signs the call."""

    __slots__ = ("security", "uid")

    def __init__(self, security, uid):
        self.security = security
        self.uid = uid

    async def call(self, conn, prog, vers, proc, args):
        for attempt in range(2):
            try:
                context = await self.security.context(conn, self.uid)
            except Refused as e:
                raise OSError(errno.EACCES, str(e)) from None
            except rpc.AuthError as e:
                raise OSError(errno.EACCES, f"the NFS server refused a Kerberos context (auth_stat {e.stat})") from None
            try:
                return await context.call(conn, prog, vers, proc, args)
            except Expired:
                if attempt:
                    raise OSError(errno.EACCES, "the Kerberos context expired as it was set up") from None
                log.info("RPCSEC_GSS context of uid %d expired: setting up another", self.uid)
            except rpc.AuthError as e:
                if e.stat not in (CREDPROBLEM, CTXPROBLEM) or attempt:
                    raise
                log.info("RPCSEC_GSS context of uid %d gone (auth_stat %d): setting up another", self.uid, e.stat)
                context.dead = True


def flavour_name(flavor, oid, service):
    """sec= for one SECINFO entry (flavor, mechanism OID, service); None for one we do not speak."""
    if flavor == rpc.AUTH_SYS_FLAVOR:
        return "sys"
    if flavor == RPCSEC_GSS and oid == KRB5_OID:
        return {SVC_NONE: "krb5", SVC_INTEGRITY: "krb5i", SVC_PRIVACY: "krb5p"}.get(service)
    return None
