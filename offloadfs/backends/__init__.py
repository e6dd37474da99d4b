"""Backends: one module per protocol behind the interface in base.py."""
from .base import Backend


class SourceError(Exception):
    """A source cannot be opened; the message is meant for the user."""


def open_backend(url) -> Backend:
    """The backend serving ``url``: a path or file:// URL (smb:// and nfs:// come with their backends)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme != "file":
        raise SourceError(f"source {url}: unsupported scheme {scheme}:// (supported: a path or file:///path)")
    from .local import LocalBackend
    try:
        return LocalBackend(url)
    except ValueError as e:
        raise SourceError(f"source {e}") from None
    except FileNotFoundError:
        raise SourceError(f"source {url}: no such directory") from None
    except NotADirectoryError:
        raise SourceError(f"source {url}: not a directory") from None
    except OSError as e:
        raise SourceError(f"source {url}: {e.strerror}") from None
