"""SMB 2/3 sources: smb://[user@]host[:port]/share[/path], with server-side copies."""
from .backend import SMBBackend

__all__ = ["SMBBackend"]
