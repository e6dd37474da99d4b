"""Several sources in one mount, each a top-level directory.

A copy between two sources on different filesystems cannot be a clone, but
it must still reach the daemon (one mount, so the kernel forwards it) and
come out right.
"""

import os

from mpkit import MiB, sh, sha256, total_copies, write_file


def test_copy_between_sources(backing, mount):
    sources = {"b": backing("btrfs"), "e": backing("ext4")}
    mnt = mount(sources)
    assert sorted(os.listdir(mnt.path)) == ["b", "e"]
    assert set(mnt.status()["sources"]) == {"b", "e"}
    digest = write_file(sources["b"] / "f", 24 * MiB + 5)
    sh("cp", mnt.path / "b" / "f", mnt.path / "e" / "f")
    assert sha256(sources["e"] / "f") == digest
    assert total_copies(mnt.counters()) >= 1
    sh("cp", mnt.path / "e" / "f", mnt.path / "b" / "back")
    assert sha256(mnt.path / "b" / "back") == digest
    counters = mnt.counters()
    assert total_copies(counters) >= 2
    assert sum(counters["copy_bytes"].values()) == 2 * (24 * MiB + 5)


def test_config_file(backing, mount, tmp_path):
    one, two = backing("ext4"), backing("ext4")
    (one / "in-one").write_bytes(b"1")
    (two / "in-two").write_bytes(b"2")
    config = tmp_path / "offloadfs.toml"
    config.write_text(f'[sources]\none = "{one}"\ntwo = "file://{two}"\n')
    mnt = mount({}, options=[f"config={config}"])
    assert sorted(os.listdir(mnt.path)) == ["one", "two"]
    assert (mnt.path / "two" / "in-two").read_bytes() == b"2"
    assert os.listdir(mnt.path / "one") == ["in-one"]
