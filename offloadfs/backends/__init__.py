"""Backends: one module or package per protocol behind the interface in base.py.

A source URL's scheme picks the backend.  Each backend class lists the mount
options it takes in ``OPTIONS``; options the core does not know are passed
to every backend of the mount that takes them.
"""
import importlib

from .base import Backend

# scheme -> (module, class); modules load on first use so one protocol's
# dependencies never stand in the way of another's.
SCHEMES = {
    "file": ("offloadfs.backends.local", "LocalBackend"),
    "smb": ("offloadfs.backends.smb", "SMBBackend"),
    "nfs": ("offloadfs.backends.nfs", "NFSBackend"),
}


class SourceError(Exception):
    """A source cannot be opened; the message is meant for the user."""


def scheme_of(url):
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_class(scheme):
    try:
        module, name = SCHEMES[scheme]
    except KeyError:
        supported = ", ".join(f"{s}://" for s in SCHEMES)
        raise SourceError(f"unsupported scheme {scheme}:// (supported: a path, {supported})") from None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SourceError(f"the {scheme}:// backend cannot be loaded: {e}") from None


def check_options(urls, options):
    """Refuse an option that no backend of these sources takes (only their modules are loaded)."""
    known = set().union(*(backend_class(scheme_of(url)).OPTIONS for url in urls))
    for name in options:
        if name not in known:
            raise SourceError(f"unknown mount option '{name}'")


def open_backend(url, options) -> Backend:
    """The backend serving ``url``, given the backend options of the mount ({name: value or True})."""
    cls = backend_class(scheme_of(url))
    try:
        return cls(url, {k: v for k, v in options.items() if k in cls.OPTIONS})
    except SourceError:
        raise
    except ValueError as e:
        raise SourceError(f"source {url}: {e}") from None
    except FileNotFoundError:
        raise SourceError(f"source {url}: no such directory") from None
    except NotADirectoryError:
        raise SourceError(f"source {url}: not a directory") from None
    except OSError as e:
        raise SourceError(f"source {url}: {e.strerror}") from None
