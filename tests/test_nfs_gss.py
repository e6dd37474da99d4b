"""RPCSEC_GSS (offloadfs/backends/nfs/gss.py): the wire layouts of RFC 2203 section 5, the sequence
window, reply verifiers, and contexts set up again; with a stand-in for the GSS mechanism (the real one
is tested against ganesha in mountpoint-tests/test_mp_nfs_kerberos.py)."""
import hashlib
import struct

import pytest
import trio
import trio.testing

from test_nfs_rpc import connected, record

from offloadfs.backends.nfs import gss, ops, rpc
from offloadfs.backends.nfs.session import Client, Settings
from offloadfs.backends.nfs.xdr import Packer, ProtocolError, Unpacker


class FakeMech:
    """A GSS context stand-in: the MIC is a keyed hash, wrapping reverses the bytes."""

    lifetime = 3600

    def __init__(self, key=b"k"):
        self.key = key

    def get_signature(self, data):
        return hashlib.sha256(self.key + data).digest()[:16]

    def verify_signature(self, data, mic):
        import gssapi.exceptions

        if mic != self.get_signature(data):
            raise gssapi.exceptions.BadMICError(0x60000, 0)

    def encrypt(self, data):
        return data[::-1]

    def decrypt(self, data):
        return data[::-1]


def xdr(*items):
    p = Packer()
    for kind, value in items:
        getattr(p, kind)(value)
    return p.bytes()


def test_credential_is_rpc_gss_cred_vers_1():
    flavor, body = gss.credential(gss.DATA, 7, gss.SVC_INTEGRITY, b"handle")
    assert flavor == 6
    # version, gss_proc, seq_num, service, handle<>
    assert body == struct.pack(">5I", 1, 0, 7, 2, 6) + b"handle\0\0"


def test_integrity_body_is_databody_then_its_mic():
    mech = FakeMech()
    data = gss.integ_data(9, b"ARGS", mech.get_signature)
    databody = struct.pack(">I", 9) + b"ARGS"
    assert data == xdr(("opaque", databody), ("opaque", mech.get_signature(databody)))
    assert gss.open_integ(9, Unpacker(data), mech.verify_signature, 1 << 20).fixed(4) == b"ARGS"


def test_privacy_body_is_the_wrapped_databody():
    mech = FakeMech()
    data = gss.priv_data(3, b"ARGS", mech.encrypt)
    assert data == xdr(("opaque", (struct.pack(">I", 3) + b"ARGS")[::-1]))
    u = gss.open_priv(3, Unpacker(data), mech.decrypt, 1 << 20)
    assert u.fixed(4) == b"ARGS"


def test_a_body_for_another_sequence_number_is_refused():
    mech = FakeMech()
    with pytest.raises(ProtocolError, match="sequence number 4, not 5"):
        gss.open_integ(5, Unpacker(gss.integ_data(4, b"x", mech.get_signature)), mech.verify_signature, 1 << 20)
    with pytest.raises(ProtocolError, match="sequence number 4, not 5"):
        gss.open_priv(5, Unpacker(gss.priv_data(4, b"x", mech.encrypt)), mech.decrypt, 1 << 20)


async def test_a_tampered_integrity_body_is_refused():
    mech = FakeMech()
    data = bytearray(gss.integ_data(1, b"ARGS", mech.get_signature))
    data[8] ^= 1  # the first byte of the arguments, after the opaque's length and the sequence number
    context = gss.Context(gss.SVC_INTEGRITY, b"h", 4, mech)
    with pytest.raises(ProtocolError, match="checksum does not verify"):
        gss.open_integ(1, Unpacker(bytes(data)), context._verify, 1 << 20)


async def test_the_verifier_is_a_mic_over_the_header_up_to_the_credential():
    mech = FakeMech()
    cred = gss.credential(gss.DATA, 5, gss.SVC_NONE, b"hd")
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)

        async def server():
            call = await peer.read_record()
            header_end = 6 * 4 + 4 + 4 + len(cred[1])
            header, u = call[:header_end], Unpacker(call, header_end)
            assert u.u32() == gss.RPCSEC_GSS and u.opaque(400) == mech.get_signature(header)
            assert call[u.pos:] == b"ARGS"
            (xid,) = struct.unpack(">I", call[:4])
            reply = xdr(("u32", xid), ("u32", rpc.REPLY), ("u32", rpc.MSG_ACCEPTED), ("u32", 6),
                        ("opaque", b"server-mic"), ("u32", rpc.SUCCESS))
            await peer.stream.send_all(record(reply + b"RES!"))

        nursery.start_soon(server)
        u, verifier = await conn.call_verified(100003, 4, 1, cred, b"ARGS", mech.get_signature)
        assert verifier == (6, b"server-mic") and u.fixed(4) == b"RES!"
        await conn.close()


def test_init_result_layout():
    u = Unpacker(xdr(("opaque", b"hd"), ("u32", 0), ("u32", 0), ("u32", 128), ("opaque", b"tok")))
    assert gss.init_result(u) == (b"hd", 0, 0, 128, b"tok")


def test_secinfo_names():
    assert gss.flavour_name(1, None, None) == "sys"
    assert [gss.flavour_name(6, gss.KRB5_OID, s) for s in (1, 2, 3)] == ["krb5", "krb5i", "krb5p"]
    assert gss.flavour_name(6, b"\x2a\x03", 1) is None  # another mechanism
    assert gss.flavour_name(0, None, None) is None


def test_secinfo_no_name_decodes_gss_entries():
    body = xdr(("u32", 3), ("u32", 6), ("opaque", gss.KRB5_OID), ("u32", 0), ("u32", 3),
               ("u32", 1), ("u32", 0))
    assert ops.SecInfoNoName().decode(Unpacker(body)) == [(6, gss.KRB5_OID, 3), (1, None, None), (0, None, None)]


async def test_the_window_bounds_calls_in_flight():
    window = gss.Window(2)
    seqs, entered = [], []

    async def one():
        async with window as seq:
            entered.append(seq)
            await trio.sleep(1)
            seqs.append(seq)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        assert len(entered) == 2  # the third waits for a reply
    assert sorted(seqs) == [1, 2, 3, 4, 5]


class FakeConn:
    """Answers calls as a server would: verifies the header MIC, answers with the MIC of the sequence
    number (or a wrong one), or refuses the context once."""

    max_record = 1 << 20

    def __init__(self, mech, service, refuse=0, bad_verifier=False):
        self.mech, self.service = mech, service
        self.refuse, self.bad_verifier = refuse, bad_verifier
        self.calls = []

    async def call_verified(self, prog, vers, proc, cred, args, sign=None):
        u = Unpacker(cred[1])
        _, gss_proc, seq, service = u.u32(), u.u32(), u.u32(), u.u32()
        handle = u.opaque(64)
        self.calls.append((gss_proc, seq, handle))
        if gss_proc == gss.DESTROY:
            assert args == b""  # never wrapped
            return Unpacker(b""), (6, self.mech.get_signature(struct.pack(">I", seq)))
        if gss_proc in (gss.INIT, gss.CONTINUE_INIT):
            res = xdr(("opaque", b"ctx%d" % len(self.calls)), ("u32", 0), ("u32", 0), ("u32", 8), ("opaque", b""))
            return Unpacker(res), (6, self.mech.get_signature(struct.pack(">I", 8)))
        if self.refuse:
            self.refuse -= 1
            raise rpc.AuthError(gss.CREDPROBLEM)
        if service == gss.SVC_INTEGRITY:
            body = gss.open_integ(seq, Unpacker(args), self.mech.verify_signature, 1 << 20)
            reply = gss.integ_data(seq, b"RES:" + body.data[body.pos:], self.mech.get_signature)
        elif service == gss.SVC_PRIVACY:
            body = gss.open_priv(seq, Unpacker(args), self.mech.decrypt, 1 << 20)
            reply = gss.priv_data(seq, b"RES:" + body.data[body.pos:], self.mech.encrypt)
        else:
            reply = b"RES:" + args
        mic = self.mech.get_signature(struct.pack(">I", seq + self.bad_verifier))
        return Unpacker(reply), (6, mic)


def fake_security(monkeypatch, service):
    security = gss.Security(service, "server")
    monkeypatch.setattr(security, "credentials", lambda uid: (None, None))

    async def establish(conn, svc, target, creds):
        res, verifier = await conn.call_verified(100003, 4, 0, gss.credential(gss.INIT, 0, svc, b""), b"")
        handle, _, _, window, _ = gss.init_result(res)
        return gss.Context(svc, handle, window, conn.mech)

    monkeypatch.setattr(gss, "establish", establish)
    return security


@pytest.mark.parametrize("sec", ["krb5", "krb5i", "krb5p"])
async def test_a_call_goes_and_its_results_come_back(monkeypatch, sec):
    conn = FakeConn(FakeMech(), gss.SERVICES[sec])
    cred = fake_security(monkeypatch, sec).for_user(0)
    u = await cred.call(conn, 100003, 4, 1, b"ARGS")
    assert u.data[u.pos:] == b"RES:ARGS"
    assert [c[:2] for c in conn.calls] == [(gss.INIT, 0), (gss.DATA, 1)]


async def test_a_reply_with_a_wrong_verifier_is_an_error_not_data(monkeypatch):
    conn = FakeConn(FakeMech(), gss.SVC_NONE, bad_verifier=True)
    cred = fake_security(monkeypatch, "krb5").for_user(0)
    with pytest.raises(ProtocolError, match="checksum does not verify"):
        await cred.call(conn, 100003, 4, 1, b"ARGS")


async def test_a_context_the_server_forgot_is_set_up_again_and_the_call_resent(monkeypatch):
    conn = FakeConn(FakeMech(), gss.SVC_INTEGRITY, refuse=1)
    cred = fake_security(monkeypatch, "krb5i").for_user(0)
    u = await cred.call(conn, 100003, 4, 1, b"ARGS")
    assert u.data[u.pos:] == b"RES:ARGS"
    # INIT, the refused call, INIT again, and the call under the new handle with its own numbers
    assert [c[:2] for c in conn.calls] == [(gss.INIT, 0), (gss.DATA, 1), (gss.INIT, 0), (gss.DATA, 1)]
    assert conn.calls[1][2] != conn.calls[3][2]


async def test_a_context_refused_twice_in_a_row_fails(monkeypatch):
    conn = FakeConn(FakeMech(), gss.SVC_NONE, refuse=2)
    cred = fake_security(monkeypatch, "krb5").for_user(0)
    with pytest.raises(rpc.AuthError):
        await cred.call(conn, 100003, 4, 1, b"ARGS")


async def test_each_uid_has_its_own_context(monkeypatch):
    conn = FakeConn(FakeMech(), gss.SVC_NONE)
    security = fake_security(monkeypatch, "krb5")
    await security.for_user(0).call(conn, 100003, 4, 1, b"a")
    await security.for_user(1000).call(conn, 100003, 4, 1, b"b")
    await security.for_user(0).call(conn, 100003, 4, 1, b"c")
    assert [c[:2] for c in conn.calls] == [(gss.INIT, 0), (gss.DATA, 1), (gss.INIT, 0), (gss.DATA, 1),
                                           (gss.DATA, 2)]


@pytest.mark.parametrize("offered, chosen", [
    ([(6, gss.KRB5_OID, 3), (1, None, None)], None),  # AUTH_SYS wherever the server takes it
    ([(6, b"\x2a\x03", 1), (6, gss.KRB5_OID, 2), (6, gss.KRB5_OID, 1)], gss.SVC_INTEGRITY),  # its first we speak
    ([(0, None, None)], None),  # nothing we speak: AUTH_SYS, and the server says no
])
async def test_without_sec_the_servers_list_chooses(monkeypatch, offered, chosen):
    client = Client(Settings(host="h"))

    async def compound(op_list, cred=None):
        assert isinstance(op_list[1], ops.SecInfoNoName)
        return [None, offered]

    monkeypatch.setattr(client, "compound", compound)
    await client._choose_security(())
    assert (client.security and client.security.service) == chosen


async def test_each_component_of_the_path_is_asked_for_on_the_way_down(monkeypatch):
    client = Client(Settings(host="h"))
    answers = {b"a": [(1, None, None)], b"b": [(6, gss.KRB5_OID, 3)]}
    asked = []

    async def compound(op_list, cred=None):
        asked.append(([type(op).__name__ for op in op_list], cred))
        return [None] * (len(op_list) - 1) + [answers[op_list[-1].name]]

    monkeypatch.setattr(client, "compound", compound)
    await client._choose_security((b"a", b"b"))
    assert [names for names, _ in asked] == [["PutRootFH", "SecInfo"], ["PutRootFH", "Lookup", "SecInfo"]]
    assert client.security.service == gss.SVC_PRIVACY


async def test_unmount_destroys_the_contexts(monkeypatch):
    conn = FakeConn(FakeMech(), gss.SVC_PRIVACY)
    security = fake_security(monkeypatch, "krb5p")
    await security.for_user(0).call(conn, 100003, 4, 1, b"a")
    await security.destroy_all(conn)
    assert conn.calls[-1] == (gss.DESTROY, 2, conn.calls[1][2])
    assert security.contexts == {}


def test_cruid_takes_that_users_own_cache_alone(monkeypatch, tmp_path):
    """cruid=: root's contexts come from that uid's cache, looked up as a user's, so one in
    /tmp/krb5cc_UID that is not theirs is refused with the line that says why."""
    monkeypatch.delenv("KRB5_CONFIG", raising=False)
    uid = 61997
    cache = tmp_path / f"krb5cc_{uid}"
    monkeypatch.setattr(gss.kerberos, "CACHE_DIR", str(tmp_path))
    cache.write_bytes(b"")
    cache.chmod(0o600)
    with pytest.raises(gss.Refused) as e:
        gss.Security("krb5", "h", cruid=uid).credentials(0)
    assert str(e.value) == f"cruid={uid}: {cache} belongs to uid {cache.stat().st_uid}, not to the user"
