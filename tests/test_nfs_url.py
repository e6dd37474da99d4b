"""nfs:// URLs and the NFS mount options."""
import pytest

from offloadfs.backends import SourceError, backend_class, open_backend
from offloadfs.backends.nfs import url
from offloadfs.options import parse


def test_host_port_and_path():
    settings, path = url.parse("nfs://server.example:2050/export/a%20b/c", {})
    assert (settings.host, settings.port, path) == ("server.example", 2050, [b"export", b"a b", b"c"])
    settings, path = url.parse("nfs://[::1]/", {})
    assert (settings.host, settings.port, path) == ("::1", 2049, [])


def test_defaults_are_a_hard_nfs_4_2_mount():
    settings, _ = url.parse("nfs://h/x", {})
    assert (settings.soft, settings.timeo, settings.retrans, settings.minorversion) == (False, 60.0, 2, 2)


def test_options():
    settings, _ = url.parse("nfs://h/x", {"soft": True, "timeo": "15", "retrans": "4", "rsize": "65536",
                                          "wsize": "131072", "minorversion": "1"})
    assert (settings.soft, settings.timeo, settings.retrans) == (True, 1.5, 4)
    assert (settings.rsize, settings.wsize, settings.minorversion) == (65536, 131072, 1)


def test_security_options(tmp_path):
    keytab = tmp_path / "kt"
    keytab.write_bytes(b"")
    settings, _ = url.parse("nfs://h/x", {}, environ={})
    assert (settings.sec, settings.ccache, settings.keytab) == (None, None, None)  # SECINFO_NO_NAME decides
    settings, _ = url.parse("nfs://h/x", {"sec": "krb5p"}, environ={"KRB5CCNAME": "/tmp/cc"})
    assert (settings.sec, settings.ccache) == ("krb5p", "FILE:/tmp/cc")
    settings, _ = url.parse("nfs://h/x", {"sec": "krb5i", "cruid": "0"}, environ={"KRB5CCNAME": "/tmp/cc"})
    assert (settings.ccache, settings.cruid) == (None, 0)  # looked up at each context (gss.Security)
    settings, _ = url.parse("nfs://h/x", {"sec": "krb5", "keytab": str(keytab)}, environ={})
    assert (settings.keytab, settings.ccache) == (str(keytab), None)


@pytest.mark.parametrize("options, message", [
    ({"sec": "krb5x"}, "sec= takes one of sys, krb5, krb5i, krb5p"),
    ({"sec": True}, "sec= takes one of"),
    ({"sec": "sys", "cruid": "0"}, "for Kerberos, not sec=sys"),
    ({"keytab": "/nonexistent", "sec": "krb5"}, "not readable"),
    ({"keytab": "/etc/hostname", "cruid": "0"}, "give one"),
])
def test_bad_security_options(options, message):
    with pytest.raises(ValueError, match=message):
        url.parse("nfs://h/x", options, environ={})


@pytest.mark.parametrize("source, options, message", [
    ("nfs:///export", {}, "no server"),
    ("nfs://user@h/export", {}, "no user name"),
    ("nfs://h/export?x=1", {}, r"no \?query"),
    ("nfs://h:99999/export", {}, "bad port"),
    ("nfs://h/a/../b", {}, "may not contain"),
    ("nfs://h/x", {"soft": True, "hard": True}, "soft or hard"),
    ("nfs://h/x", {"soft": "yes"}, "takes no value"),
    ("nfs://h/x", {"timeo": True}, "needs a number"),
    ("nfs://h/x", {"rsize": "12"}, "between 4096"),
    ("nfs://h/x", {"minorversion": "0"}, "between 1 and 2"),
])
def test_bad_sources_and_options(source, options, message):
    with pytest.raises(SourceError, match=message):
        open_backend(source, options)


def test_mount_options_reach_the_backend():
    config = parse("/mnt", "nfs://h/export", ["soft,timeo=20,rsize=65536"])
    assert config.backend_options == {"soft": True, "timeo": "20", "rsize": "65536"}
    assert backend_class("nfs").OPTIONS >= set(config.backend_options)
