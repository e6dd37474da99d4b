import pytest

from offloadfs.options import OptionError, parse


def test_defaults_and_flags():
    c = parse("/mnt", "/srv", ["ro,allow_other,uid=1000,umask=022,noauto,_netdev,x-systemd.automount"])
    assert c.sources == {"source": "/srv"}
    assert c.fs.ro and c.allow_other and c.fs.uid == 1000 and c.fs.umask == 0o22
    assert c.default_permissions  # allow_other never opens the sources to everyone
    assert c.fs.offload and c.fs.detect_copies and not c.fs.always_offload


def test_detect_copies_off():
    assert not parse("/mnt", "/srv", ["detect_copies=off"]).fs.detect_copies


@pytest.mark.parametrize("value,offload,always", [("on", True, False), ("off", False, False),
                                                   ("always", True, True)])
def test_offload_modes(value, offload, always):
    c = parse("/mnt", "/srv", [f"offload={value}"])
    assert (c.fs.offload, c.fs.always_offload) == (offload, always)


def test_sources_from_options_and_config(tmp_path):
    cfg = tmp_path / "o.toml"
    cfg.write_text('[sources]\nb = "/srv/b"\n')
    c = parse("/mnt", None, ["source=a=/srv/a", f"config={cfg}", "offload=off"])
    assert c.sources == {"a": "/srv/a", "b": "/srv/b"} and not c.fs.offload


@pytest.mark.parametrize("source,opts,message", [
    (None, [], "no source"),
    ("/srv", ["bogus"], "unknown mount option 'bogus'"),
    ("/srv", ["uid=abc"], "not a number"),
    ("/srv", ["attr_timeout=-1"], "between 0"),
    ("/srv", ["offload=maybe"], "offload=off or offload=always"),
    ("/srv", ["detect_copies=yes"], "detect_copies=on or detect_copies=off"),
    ("/srv", ["source=a=/x"], "not both"),
    (None, ["source=a/b=/x"], "plain directory name"),
    (None, ["source=a=/x,source=a=/y"], "given twice"),
    ("/srv", ["passthrough,writeback_cache"], "exclude each other"),
    (None, ["config=/nonexistent.toml"], "No such file"),
])
def test_bad_options_say_what_is_wrong(source, opts, message):
    with pytest.raises(OptionError, match=message):
        parse("/mnt", source, opts)


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "o.toml"
    cfg.write_text("sources = 3\n")
    with pytest.raises(OptionError, match=r"\[sources\] table"):
        parse("/mnt", None, [f"config={cfg}"])


def test_logfile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse("/mnt", "/srv", ["logfile=o.log"]).logfile == str(tmp_path / "o.log")
    assert parse("/mnt", "/srv", []).logfile is None
    with pytest.raises(OptionError, match=r"option logfile=/nowhere/o.log: /nowhere: no such directory"):
        parse("/mnt", "/srv", ["logfile=/nowhere/o.log"])


def test_multiuser_needs_allow_other_and_leaves_permissions_to_the_server(monkeypatch):
    monkeypatch.setenv("KRB5CCNAME", "FILE:/tmp/cc")
    with pytest.raises(OptionError, match="multiuser needs allow_other"):
        parse("/mnt", "smb://h/s", ["sec=krb5,multiuser"])
    c = parse("/mnt", "smb://h/s", ["sec=krb5,multiuser,allow_other"])
    assert c.allow_other and not c.default_permissions  # each user's own session: the server checks
