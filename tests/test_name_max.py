"""The longest name a source takes is enforced before its server is asked (Backend.name_max):
ganesha says 1024 where its xfs takes 255, and a server that says less than 255 means it."""
import errno
import os

import pytest

from offloadfs.backends.local import LocalBackend
from offloadfs.filesystem import Filesystem, Options
from offloadfs.fuse.operations import Ctx
from offloadfs.stats import Stats

CTX = Ctx(0, 0, 1)


class Asked(LocalBackend):
    """A local source that takes names of 8 bytes at most, and counts the names it was asked about."""
    name_max = 8

    def __init__(self, *args):
        super().__init__(*args)
        self.asked = []

    def _node(self, dir, name):
        self.asked.append(name)
        return super()._node(dir, name)


async def test_a_name_longer_than_the_source_takes_never_reaches_it(tmp_path):
    (tmp_path / "short").write_bytes(b"x")
    backend = Asked(str(tmp_path), {})
    fs = Filesystem({"s": backend}, Options(), Stats("/mnt", {}))
    await fs.start()
    file = await fs.lookup(CTX, 1, b"short")
    long = b"x" * 9
    for call in (lambda: fs.lookup(CTX, 1, long), lambda: fs.mkdir(CTX, 1, long, 0o755),
                 lambda: fs.create(CTX, 1, long, 0o644, os.O_WRONLY), lambda: fs.symlink(CTX, 1, long, b"short"),
                 lambda: fs.link(CTX, file.nodeid, 1, long), lambda: fs.rename(CTX, 1, b"short", 1, long, 0),
                 lambda: fs.unlink(CTX, 1, long)):
        with pytest.raises(OSError) as e:
            await call()
        assert e.value.errno == errno.ENAMETOOLONG
    assert backend.asked == [b"short"]
    assert os.listdir(tmp_path) == ["short"]
    await fs.mkdir(CTX, 1, b"x" * 8, 0o755)  # as long as it takes: made
    assert sorted(os.listdir(tmp_path)) == ["short", "x" * 8]
