"""Backends driven directly under trio, as the backend tests use them."""
import contextlib
import os

from offloadfs.backends import open_backend


@contextlib.asynccontextmanager
async def mounted(url, **options):
    """(backend, root node) of a source URL, closed on exit."""
    backend = open_backend(url, options)
    try:
        root, _ = await backend.root()
        yield backend, root
    finally:
        await backend.close()


async def make(b, root, name, data=b""):
    """(node, open file) of a new file holding ``data``, on the server's disk."""
    node, _, f = await b.create(root, name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if data:
        assert await b.write(f, 0, data) == len(data)
        await b.fsync(f, False)
    return node, f
